## Input from the front end: loaded on first use (driver.R, "parts loaded
## on first use"), by the first call of a session that has the tool, so
## other workers never parse it.
## In a session whose host offers the tool "rvisor.input" (the Jupyter
## kernel's: an input_request on the front end's stdin channel),
## readline(), menu() and askYesNo() (which calls readline()) ask through
## it; elsewhere, and in sessions without the tool, they are R's own in a
## non-interactive R (readline() returns "", menu() refuses).
## interactive() stays FALSE. Installed once per worker, on the first call
## that has the tool.
install_input <- function() {
  if (isTRUE(state$input_installed)) return(invisible())
  r_readline <- get("readline", envir = baseenv())
  utils_ns <- asNamespace("utils")
  r_menu <- get("menu", envir = utils_ns)
  has_input <- function() "rvisor.input" %in% state$tool_names
  ask <- function(prompt, what) {
    prompt <- paste(as.character(prompt), collapse = "")
    res <- tryCatch(call_tool("rvisor.input", list(prompt = prompt, password = FALSE)),
                    error = function(e) stop(sprintf("%s cannot read input: %s", what,
                      sub("^tool 'rvisor.input' failed: ", "", conditionMessage(e))),
                      call. = FALSE))
    if (!is.character(res) || length(res) != 1L) res <- ""
    res
  }
  readline <- function(prompt = "") {
    if (has_input()) ask(prompt, "readline()") else r_readline(prompt)
  }
  menu <- function(choices, graphics = FALSE, title = NULL) {
    if (!has_input()) return(r_menu(choices, graphics, title))
    nc <- length(choices)
    if (length(title) && nzchar(title[1L])) cat(title[1L], "\n")
    cat("", paste0(format(seq_len(nc)), ": ", choices), "", sep = "\n")
    repeat {
      ans <- trimws(ask("Selection: ", "menu()"))
      ind <- suppressWarnings(as.integer(ans))
      if (is.na(ind)) ind <- match(ans, choices)
      if (!is.na(ind) && ind >= 0L && ind <= nc) return(ind)
      cat("Enter an item from the menu, or 0 to exit\n")
    }
  }
  envs <- list(list("readline", readline, list(baseenv(), .BaseNamespaceEnv)),
               list("menu", menu, c(list(utils_ns),
                 if ("package:utils" %in% search()) list(as.environment("package:utils")))))
  for (sw in envs) {
    for (e in sw[[3L]]) {
      unlockBinding(sw[[1L]], e)
      assign(sw[[1L]], sw[[2L]], envir = e)
      lockBinding(sw[[1L]], e)
    }
  }
  state$input_installed <- TRUE
  invisible()
}
