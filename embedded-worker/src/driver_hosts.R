## The driver's part of host-side replacements, loaded on first use
## (driver.R, "parts loaded on first use"): install.packages() through the
## server (docs/packages.md), readline()/menu() through a front end's input
## (docs/jupyter.md), and the packages of a tenant's library a call had
## loaded. Only workers that have those tools or libraries parse it.
## Top-level assignments only.

## install.packages() through the host (docs/packages.md): where the
## server installs packages for this tenant (the rvisor.install tool),
## utils' own is replaced, in this worker only, by one that asks it; the
## worker never downloads. Without the tool (a later call of another
## kind) utils' own runs.
install_via_host <- function(pkgs, lib, repos = NULL, ..., quiet = FALSE) {
  if (!("rvisor.install" %in% state$tool_names))
    return(state$install_orig(pkgs, lib, repos = repos, ..., quiet = quiet))
  pkgs <- unname(as.character(pkgs))
  if (!length(pkgs) || anyNA(pkgs) || !all(nzchar(pkgs)))
    stop("name the packages to install, e.g. install.packages(\"janitor\")", call. = FALSE)
  files <- grepl("[/\\\\]|[.](tar[.]gz|tgz|zip)$", pkgs)
  if (any(files))
    stop(sprintf(paste0("'%s' is a file or a URL: this server installs packages by name from ",
                        "its own repositories (GET /v1/packages shows them)"), pkgs[files][1L]),
         call. = FALSE)
  if (!quiet)
    message(sprintf("Installing %s from the server's repositories ...",
                    paste0("'", pkgs, "'", collapse = ", ")))
  res <- call_tool("rvisor.install", list(packages = as.list(pkgs)))
  if (!quiet) {
    if (!length(res$installed))
      message(sprintf("Nothing to do: %s already installed at the repositories' version",
                      paste(pkgs, collapse = ", ")))
    for (p in res$installed)
      message(sprintf("* installed %s %s from %s%s%s", p$name, p$version, p$repository,
                      if (isTRUE(p$cached)) " (built before: from the cache)" else "",
                      if (isTRUE(p$requested)) "" else " (a dependency)"))
  }
  invisible(NULL)
}

patch_install <- function() {
  if (isTRUE(state$install_patched) || !isNamespaceLoaded("utils")) return(invisible())
  ns <- asNamespace("utils")
  state$install_orig <- get("install.packages", envir = ns)
  envs <- list(ns)
  if ("package:utils" %in% search()) envs[[2L]] <- as.environment("package:utils")
  for (e in envs) {
    unlockBinding("install.packages", e)
    assign("install.packages", install_via_host, envir = e)
    lockBinding("install.packages", e)
  }
  state$install_patched <- TRUE
  invisible()
}

## --- input from the front end ---------------------------------------------
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

## Packages loaded from the libraries after R's own (a tenant's).
report_packages_loaded <- function() tryCatch({
  ns <- setdiff(loadedNamespaces(), "base")
  lib <- vapply(ns, function(n) dirname(getNamespaceInfo(n, "path")), "")
  mine <- sort(ns[lib %in% state$libs_after])
  if (length(mine))
    .Call(emit, "packages_loaded", mine,
          vapply(mine, function(n) as.character(getNamespaceVersion(n)), ""), NULL)
}, error = function(e) NULL)
