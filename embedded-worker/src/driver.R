## rvisor's R-side driver. Evaluated once at worker start in a private
## environment whose parent is baseenv(); `emit` (a NativeSymbolInfo for the
## worker's .Call entry "rvisor_emit") is assigned into it by the worker.
## Everything here runs on the R thread, called from Rust inside its
## protected boundary (r.rs). User code is not evaluated here: the worker
## evaluates each top-level expression itself, at frame 0 in the global
## environment (eval.rs), after begin_expr() has installed the handlers
## below as global calling handlers.

state <- new.env(parent = emptyenv())
state$dev <- 0L            # our png device number, 0 when closed
state$last <- NULL         # recordPlot() of the last page of the previous call
state$newpage_pending <- FALSE
state$replayed <- FALSE    # the open device started by replaying state$last
state$replay_len <- 0L
state$drop_first <- FALSE  # the replayed page got nothing new: do not report it
state$plot_dir <- ""
state$page_n <- 0L         # pages begun on our device in this call
state$width <- 1000L
state$height <- 650L
state$warnings <- list()   # warnings of the current top-level expression
state$warn_n <- 0L         # warnings kept in this call
state$warn_dropped <- 0    # warnings past caps$warnings in this call
state$lastw <- list()      # R's record of the expression's deferred warnings: calls
state$lastw_names <- character()  # ... and their messages (last.warning's names)
## The call's display options (RunRequest.display): set by begin_call().
state$display <- list(enabled = TRUE, rows = 20L, cols = 20L, html_max = 5242880,
                      png = TRUE, svg = FALSE)
state$recs <- list()       # with SVG asked for: each finished page, recorded

## Caps on what a call reports (rvisor_protocol::bounds); the worker
## replaces these with its own values when it loads the driver, and sets
## `max_out` (the call's output cap) before each call.
caps <- list(message = 8192L, call = 1024L, frames = 50L, warning = 8192L,
             warnings = 50L, plots = 64L, tool_request = 262144L)
max_out <- 8388608

html_classes <- c("htmlwidget", "gt_tbl", "flextable", "shiny.tag",
                  "shiny.tag.list", "html", "datatables", "reactable")

first_line <- function(x) if (length(x)) x[[1L]] else ""

## One string: `x` itself when it has at most `n` bytes, else its first
## n + 1 characters, which the worker cuts to `n` bytes at a character
## boundary (and so knows it was cut). A condition may carry a 250 MB
## message or a million-element vector: only this much crosses into Rust.
clip <- function(x, n) {
  if (!is.character(x))
    x <- tryCatch(as.character(x[seq_len(min(length(x), 1L))]), error = function(e) "")
  if (!length(x)) return("")
  x <- x[[1L]]
  if (is.na(x)) return("NA")
  n <- min(n, .Machine$integer.max - 1)
  if (nchar(x, type = "bytes") > n)
    x <- tryCatch(substr(x, 1L, n + 1),
                  error = function(e) strrep("?", n + 1))  # not valid in its encoding
  x
}

## deparse() is R code around R's internal deparser, and its own work
## (.deparseOpts() matching the option names each time) costs more than
## deparsing a short call: an error's call and traceback frames are
## deparsed by the internal one directly, with deparse()'s default options
## worked out at the first (NA: this R's deparse() is not the one that was
## read, so it is called). Not when the driver loads: base's functions are
## lazily loaded, and forcing deparse() and .deparseOpts() would add some
## 400 cons cells to what a user's gc() counts.
## Not clipped here: `emit` copies at most the call's output cap of a
## string, and the worker cuts each call and frame to its cap.
deparse_call <- function(cl) {
  if (is.null(cl)) return(NULL)
  if (is.null(opts <- state$deparse_opts)) opts <- state$deparse_opts <- deparse_options()
  s <- if (is.na(opts)) deparse(cl, width.cutoff = 500L, nlines = 2L)
       else .Internal(deparse(cl, 500L, TRUE, opts, 2L))
  if (length(s) > 1L) paste0(s[[1L]], " ...") else s
}

deparse_options <- function() {
  read <- quote(.Internal(deparse(expr, width.cutoff, backtick, .deparseOpts(control), nlines)))
  if (!identical(body(deparse), read)) return(NA_integer_)
  .deparseOpts(eval(formals(deparse)$control))
}

## --- conditions -----------------------------------------------------------

on_warning <- function(w) {
  level <- getOption("warn", 0)
  if (is.numeric(level) && level >= 2) return(invisible())  # R turns it into an error
  if (!is.numeric(level) || level >= 0) {
    pending <- length(state$warnings) > 0L || length(state$lastw) > 0L
    msg <- clip(conditionMessage(w), caps$warning)
    if (state$warn_n >= caps$warnings) {
      # Counted, not kept (R keeps 50 too); a notice says how many.
      state$warn_dropped <- state$warn_dropped + 1
    } else {
      state$warn_n <- state$warn_n + 1L
      # Shown after the top-level expression finishes, as at the R prompt.
      state$warnings[[length(state$warnings) + 1L]] <-
        list(msg, deparse_call(conditionCall(w)))
    }
    # What R keeps for warnings() (last.warning): the deferred warnings of
    # the expression (warn = 0; warn = 1 prints at once and keeps none), at
    # most getOption("nwarnings"), message as name and call as value.
    nw <- getOption("nwarnings", 50L)
    if (is.numeric(level) && level < 1 && length(state$lastw) < nw) {
      state$lastw[length(state$lastw) + 1L] <- list(conditionCall(w))
      state$lastw_names <- c(state$lastw_names, substr(msg, 1L, caps$warning))
    }
    # The worker flushes them after the expression.
    if (!pending && (length(state$warnings) || length(state$lastw)))
      .Call(emit, "warning_pending", NULL, NULL, NULL)
  }
  tryInvokeRestart("muffleWarning")
}

on_message <- function(m) {
  .Call(emit, "message", clip(conditionMessage(m), max_out), NULL, NULL)
  tryInvokeRestart("muffleMessage")
}

## What stop("...") signals: its message is the string R itself prints,
## so it is read without dispatch (conditionMessage() is an S3 generic).
simple_error_class <- c("simpleError", "error", "condition")

on_error <- function(e) {
  # Runs at the point of the error, possibly thousands of frames deep (stack
  # overflow): do little, and never fail. A global handler: user code sits
  # at frame 1 up, as at the R prompt. Every step counts: an error's cost
  # is mostly this handler's (rvisor bench, "stop(\"boom\") then the next
  # call"). The common case, what stop("...") signals a few frames deep,
  # takes no dispatch and no guard: nothing in it can fail there. The
  # message goes as it is (`emit` copies at most the output cap of it and
  # the worker cuts it to its own).
  calls <- sys.calls()
  n <- length(calls)
  if (n < 100L) {
    # What R's C code signals (stop("..."), a primitive's error) reaches
    # us as .handleSimpleError(h, msg, call) calling h(simpleError(msg,
    # call)), the condition a promise not yet built: its message and call
    # are read from that frame instead (building it, simpleError() and
    # structure(), cost 27,600 of a warm error's 264,500 instructions).
    if (n >= 2L && identical(calls[[n - 1L]][[1L]], quote(.handleSimpleError)) &&
        identical(substitute(e), quote(simpleError(msg, call)))) {
      f <- parent.frame()
      if (is.character(m <- f$msg) && length(m) == 1L)
        return(report_error(m, f$call, calls))
    }
    if (identical(class(e), simple_error_class) &&
        is.character(m <- .subset2(e, "message")) && length(m) == 1L)
      return(report_error(m, .subset2(e, "call"), calls))
  }
  msg <- tryCatch(clip(conditionMessage(e), caps$message), error = function(e2) "unknown error")
  cl <- tryCatch(conditionCall(e), error = function(e2) NULL)
  ctb <- tryCatch(list(deparse_call(cl), error_frames(calls)),
                  error = function(e2) list(NULL, character()))
  # The worker keeps R's own printing of this error off the console.
  .Call(emit, "error", msg, ctb[[1L]], ctb[[2L]])
}

## Reports an error whose message is one string. The worker writes the
## call and the traceback itself when they are calls of named functions on
## names and short constants (deparse.rs: what R's deparser gives, without
## its set-up for each, some 50,000 instructions of `stop("boom")`); it
## says NULL for anything else, and R's deparser writes them.
report_error <- function(m, cl, calls) {
  if (is.null(.Call(error_sym, m, cl, calls, caps$frames)))
    .Call(emit, "error", m, deparse_call(cl), error_frames(calls))
}

## The traceback of an error, innermost frame first, within the caps:
## `calls` are sys.calls() of on_error, whose own frame (and R's
## .handleSimpleError under it) are not the user's.
error_frames <- function(calls) {
  n <- length(calls) - 1L
  if (n >= 1L && identical(calls[[n]][[1L]], quote(.handleSimpleError))) n <- n - 1L
  if (n < 1L) return(character())
  k <- min(n, caps$frames)
  tb <- character(k)
  for (j in seq_len(k)) tb[[j]] <- first_line(deparse_call(calls[[n + 1L - j]]))
  if (n > k) c(tb, sprintf("... and %d more frames", n - k)) else tb
}

on_interrupt <- function(i) {
  .Call(emit, "interrupted", NULL, NULL, NULL)
}

## rvisor's global calling handlers. begin_expr() puts them last, after the
## user's own global handlers (which run first, as at the R prompt), and
## keeps the user's across expressions and calls: R_ToplevelExec restores
## R's handler stack when each expression ends.
our_handlers <- list(warning = on_warning, message = on_message, error = on_error,
                     interrupt = on_interrupt)
gh_env <- environment(globalCallingHandlers)
state$gh <- NULL

begin_expr <- function() {
  gh <- gh_env$gh
  if (!identical(gh, state$gh)) {
    ours <- vapply(gh, function(h) any(vapply(our_handlers, identical, NA, h)), NA)
    gh <- c(gh[!ours], our_handlers)
    gh_env$gh <- gh
    state$gh <- gh
  }
  .Internal(.addGlobHands(names(gh), gh, .GlobalEnv, NULL, TRUE))
  invisible()
}

report_html <- function(v) {
  .Call(emit, "unsupported", sprintf(paste0(
    "rvisor: a value of class '%s' renders only as HTML, which rvisor cannot ",
    "show; print the underlying data instead (for example print(head(df)) or str(x))."),
    clip(class(v)[[1L]], caps$call)), NULL, NULL)
  invisible()
}

## Reports the expression's warnings and returns R's record of them for
## last.warning (NULL when none was deferred: the previous one stays, as in
## R). The worker binds it in the base environment, as R's REPL does (R
## code cannot add a binding there).
flush_warnings <- function() {
  for (w in state$warnings) .Call(emit, "warning", w[[1L]], w[[2L]], NULL)
  state$warnings <- list()
  lw <- state$lastw
  if (!length(lw)) return(NULL)
  names(lw) <- state$lastw_names
  state$lastw <- list()
  state$lastw_names <- character()
  lw
}

## --- plots ----------------------------------------------------------------
## A png device is opened only when something draws (options(device=)), and
## closed at the end of the call, which writes one file per page. The last
## page is kept with recordPlot(): if the next call draws on the current plot
## without starting a new page (lines(), points(), abline()...), the device
## opens by replaying it, so the low-level call adds to the previous plot and
## the call returns the updated page.

dl_len <- function() length(grDevices::recordPlot()[[1L]])

## Whether the device is being opened by a function that starts a new page
## anyway: high-level base plots call dev.hold() before plot.new() (so the
## before.plot.new hook runs too late to tell), grid and frame() start pages.
## Replaying the previous plot for them would draw, encode and drop a page.
high_level_caller <- function() {
  for (cl in sys.calls()) {
    f <- cl[[1L]]
    if (is.call(f) && length(f) == 3L && (identical(f[[1L]], quote(`::`)) ||
                                          identical(f[[1L]], quote(`:::`)))) f <- f[[3L]]
    if (is.name(f) && as.character(f) %in% c("dev.hold", "plot.new", "frame",
                                             "grid.newpage", "dev.new"))
      return(TRUE)
  }
  FALSE
}

## SVG only (RunRequest.display.plot_format "svg"): the device itself is
## cairo's svg(), one file per page, sized in inches at 72 pixels each.
open_device <- function() {
  if (state$display$png)
    grDevices::png(filename = file.path(state$plot_dir, "rvisor-plot-%04d.png"),
                   width = state$width, height = state$height, type = "cairo")
  else
    grDevices::svg(filename = file.path(state$plot_dir, "rvisor-plot-%04d.svg"),
                   width = state$width / 72, height = state$height / 72, onefile = FALSE)
  grDevices::dev.control("enable")
  state$dev <- grDevices::dev.cur()
  state$replayed <- FALSE
  # A page begun before the device opened (grid) is the device's first.
  state$page_n <- if (state$newpage_pending) 1L else 0L
  if (!state$newpage_pending && !is.null(state$last) && !high_level_caller()) {
    ok <- tryCatch({ grDevices::replayPlot(state$last); TRUE },
                   error = function(e) FALSE)
    if (ok) {
      state$replayed <- TRUE
      state$replay_len <- dl_len()
      state$page_n <- 1L
    }
  }
  state$newpage_pending <- FALSE
  invisible()
}

## Whether the replayed page got something drawn on it, rather than only
## settings: `par(mfrow = c(2, 2))` (or layout(), palette()) at the start
## of a call opens the device, which replays the last page, and R records
## the setting in the page's display list; that page is not reported
## again.
check_replay <- function() {
  state$replayed <- FALSE
  dl <- grDevices::recordPlot()[[1L]]
  settings <- c("C_par", "C_layout", "palette", "palette2")
  for (e in dl[-seq_len(min(state$replay_len, length(dl)))]) {
    nm <- tryCatch(e[[2L]][[1L]]$name, error = function(err) NULL)
    if (!is.character(nm) || !nm %in% settings) return(invisible())
  }
  state$drop_first <- TRUE
}

## The page hooks. grid.newpage() always begins a page; plot.new() begins
## one only when par("page") says so: with par(mfrow) or layout() it moves
## to the next panel of the same page, and the device's page (its file)
## stays the same. Counting every plot.new() as a page named a later page's
## file and gave multi-panel pages wrong indices.
on_base_page <- function(...) on_new_page(FALSE)
on_grid_page <- function(...) on_new_page(TRUE)

on_new_page <- function(grid) {
  cur <- grDevices::dev.cur()
  if (cur == 1L) {
    state$newpage_pending <- TRUE
    return(invisible())
  }
  if (cur != state$dev) return(invisible())
  if (state$replayed) check_replay()
  # par() on our device, open already: it opens no other.
  if (!grid && !isTRUE(graphics::par("page"))) return(invisible())
  # PNG and SVG both: the finished page is kept to be drawn again as SVG
  # when the call ends (pages past the cap are not).
  if (state$display$svg && state$display$png && state$page_n >= 1L &&
      length(state$recs) <= caps$plots)
    state$recs[[length(state$recs) + 1L]] <- grDevices::recordPlot()
  # The page before this one is finished: its index among the pages the
  # call reports (a replayed page that got nothing new is not reported),
  # and its file, which the device writes as this hook returns (the
  # worker reads it then: pages.rs).
  done <- state$page_n - as.integer(state$drop_first)
  if (done > 0L && done <= caps$plots)
    .Call(emit, "plot_page", as.character(done - 1L),
          sprintf(if (state$display$png) "%s/rvisor-plot-%04d.png" else "%s/rvisor-plot-%04d.svg",
                  state$plot_dir, state$page_n), NULL)
  state$page_n <- state$page_n + 1L
  invisible()
}

finish_plots <- function() {
  d <- state$dev
  state$dev <- 0L
  state$newpage_pending <- FALSE
  if (d > 1L) {
    if (d %in% grDevices::dev.list()) {
      prev <- grDevices::dev.cur()
      if (prev != d) grDevices::dev.set(d)
      if (state$replayed) check_replay()
      rec <- grDevices::recordPlot()
      if (length(rec[[1L]]) > 0L) state$last <- rec
      if (state$display$svg && state$display$png) state$recs[[length(state$recs) + 1L]] <- rec
      grDevices::dev.off()
      if (prev != d && prev %in% grDevices::dev.list()) grDevices::dev.set(prev)
    } else {
      state$last <- NULL  # the code closed the device itself: no plot to continue
    }
  }
  state$replayed <- FALSE
  files <- sort(list.files(state$plot_dir, pattern = "^rvisor-plot-[0-9]+[.](png|svg)$",
                           full.names = TRUE))
  recs <- state$recs
  state$recs <- list()
  if (state$drop_first && length(files)) {
    unlink(files[[1L]])
    files <- files[-1L]
    if (length(recs)) recs <- recs[-1L]
  }
  state$drop_first <- FALSE
  if (length(files) > caps$plots) {
    # The device wrote every page; only the first caps$plots are reported.
    unlink(files[-seq_len(caps$plots)])
    .Call(emit, "plots_dropped", as.character(length(files) - caps$plots), NULL, NULL)
    files <- files[seq_len(caps$plots)]
  }
  if (length(files)) .Call(emit, "plots", files, NULL, NULL)
  if (length(recs) && length(files)) {
    svgs <- file.path(state$plot_dir, sprintf("rvisor-plot-%04d.svg",
                                              seq_len(min(length(recs), length(files)))))
    for (k in seq_along(svgs)) {
      grDevices::svg(filename = svgs[[k]], width = state$width / 72,
                     height = state$height / 72)
      tryCatch(grDevices::replayPlot(recs[[k]]), finally = grDevices::dev.off())
    }
    .Call(emit, "svgs", svgs, NULL, NULL)
  }
}

## --- pager -------------------------------------------------------------------

## R's pager, as R's file.show() on Unix feeds its external one: each
## file's header (when given) and a blank line, then its contents and a
## newline, which
## `less` copies as they are when its output is not a terminal (Rscript).
show_files <- function(files, header = rep("", length(files)), title = "",
                       delete.file = FALSE) {
  for (i in seq_along(files)) {
    f <- files[[i]]
    if (length(header) >= i && nzchar(header[[i]])) cat(header[[i]], "\n\n", sep = "")
    n <- file.size(f)
    if (!is.na(n) && n > 0) {
      bytes <- readBin(f, "raw", n)
      bytes <- bytes[bytes != as.raw(0L)]
      cat(rawToChar(bytes))
    }
    cat("\n")  # R's own pager command gets one after each file
    if (isTRUE(delete.file)) unlink(f)
  }
  invisible()
}

## --- entry point ------------------------------------------------------------

## R's parse error `msg` for `code` as message, line, column and the lines
## R shows (NULL line and column when R gave none). parse(text = ) counts
## the empty string after a final newline as one more line, so "unexpected
## end of input" is put on the line parse(file), Rscript and source() name.
parse_error_at <- function(msg, code) {
  m <- regmatches(msg, regexec("^<text>:([0-9]+):([0-9]+): ([^\n]*)", msg))[[1L]]
  if (length(m) != 4L) return(list(message = msg, line = NULL, column = NULL, detail = ""))
  line <- as.integer(m[[2L]])
  if (m[[4L]] == "unexpected end of input" && line > 1L && endsWith(code, "\n"))
    line <- line - 1L
  list(message = m[[4L]], line = line, column = as.integer(m[[3L]]),
       detail = sub("^[^\n]*\n", "", msg))
}

parse_code <- function(code) {
  tryCatch(parse(text = code, keep.source = FALSE, encoding = "UTF-8"),
           error = function(e) {
             p <- parse_error_at(conditionMessage(e), code)
             if (is.null(p$line)) {
               .Call(emit, "parse_error", p$message, NULL, NULL)
             } else {
               .Call(emit, "parse_error", paste0(p$message, "\n", p$detail),
                     as.character(p$line), as.character(p$column))
             }
             NULL
           })
}

## The call's start: tools, plot size, counters. The worker then evaluates
## the expressions itself (or, when its parse failed, calls parse_code()
## for R's message, line and column) and ends with end_call(). It has
## already changed directory.
begin_call <- function(width, height, tools, display) {
  if (!identical(tools, state$tool_names)) set_tools(tools)
  if (!identical(display, state$display_given)) set_display(display)
  # One list2env() rather than an assignment each: R's JIT scores a closure
  # by its calls and compiles one past 50 the second time it runs (see
  # set_display).
  list2env(list(width = width, height = height, recs = list(), newpage_pending = FALSE,
                warnings = list(), lastw = list(), lastw_names = character(), warn_n = 0L,
                warn_dropped = 0), state)
  invisible()
}

## Apart from begin_call, and called only when the options change: R's JIT
## compiles a driver closure past its size score the second time it runs,
## and a worker's first compile forces some 60,000 cons cells of the
## compiler into the heap (ffi-tests cli.rs,
## run_loads_what_rscript_loads_and_gc_counts_few_cells_of_rvisors_own).
set_display <- function(display) {
  state$display_given <- display
  state$display <- list(enabled = display[[1L]] != 0, rows = as.integer(display[[2L]]),
                        cols = as.integer(display[[3L]]), html_max = display[[4L]],
                        png = display[[5L]] != 0, svg = display[[6L]] != 0)
}

end_call <- function() {
  # Warnings raised outside the expressions (none normally) are reported;
  # R's record is only of top-level expressions.
  if (length(state$warnings)) flush_warnings()
  # Only a call that opened our device can have pages to collect.
  if (state$dev > 1L)
    tryCatch(finish_plots(), error = function(e)
      .Call(emit, "notice", paste0("rvisor: failed to capture plots: ",
                                   clip(conditionMessage(e), caps$message), "\n"), NULL, NULL))
  if (state$warn_dropped > 0)
    .Call(emit, "warnings_dropped", format(state$warn_dropped, scientific = FALSE), NULL, NULL)
  # Packages loaded from the libraries after R's own (a tenant's):
  # reported with every result, for reproducibility (docs/packages.md).
  if (length(state$libs_after)) report_packages_loaded()
  invisible()
}


## --- helpers visible to user code (attached as "rvisor") ---------------------

json_string <- function(s) {
  s <- enc2utf8(as.character(s))
  s <- gsub("\\", "\\\\", s, fixed = TRUE)
  s <- gsub("\"", "\\\"", s, fixed = TRUE)
  s <- gsub("\n", "\\n", s, fixed = TRUE)
  s <- gsub("\r", "\\r", s, fixed = TRUE)
  s <- gsub("\t", "\\t", s, fixed = TRUE)
  s <- gsub("[\001-\037]", " ", s, perl = TRUE)
  paste0("\"", s, "\"")
}

to_json <- function(x, unbox = TRUE) {
  if (is.null(x)) return("null")
  if (is.data.frame(x)) {
    rows <- lapply(seq_len(nrow(x)), function(i) as.list(x[i, , drop = FALSE]))
    return(paste0("[", paste(vapply(rows, to_json, ""), collapse = ","), "]"))
  }
  if (is.list(x)) {
    parts <- vapply(x, to_json, "")
    nm <- names(x)
    if (!is.null(nm) && all(nzchar(nm)))
      return(paste0("{", paste0(json_string(nm), ":", parts, collapse = ","), "}"))
    return(paste0("[", paste(parts, collapse = ","), "]"))
  }
  if (is.factor(x) || inherits(x, c("Date", "POSIXt"))) x <- as.character(x)
  vals <- if (is.logical(x)) ifelse(x, "true", "false")
          else if (is.numeric(x)) ifelse(is.finite(x), formatC(x, digits = 15, format = "fg", flag = "-"), "null")
          else if (is.character(x)) json_string(x)
          else json_string(format(x))
  vals <- trimws(vals)
  vals[is.na(x)] <- "null"
  if (unbox && length(x) == 1L && is.null(names(x))) return(vals)
  if (!is.null(names(x)) && all(nzchar(names(x))))
    return(paste0("{", paste0(json_string(names(x)), ":", vals, collapse = ","), "}"))
  paste0("[", paste(vals, collapse = ","), "]")
}

helpers <- new.env(parent = baseenv())
helpers$rvisor_result <- function(x) {
  json <- if (requireNamespace("jsonlite", quietly = TRUE))
    as.character(jsonlite::toJSON(x, auto_unbox = TRUE, digits = NA, null = "null",
                                  na = "null", dataframe = "rows", force = TRUE))
  else to_json(x)
  cat("<<<RVISOR_RESULT_START>>>\n", json, "\n<<<RVISOR_RESULT_END>>>\n", sep = "")
  invisible(x)
}
helpers$.rvisor_to_json <- to_json

## Shows a value now as a display (a table: its text, HTML, Markdown and
## JSON preview; an HTML-only value: its self-contained HTML), as the
## prompt shows a visible one; other values print. Returns `x` invisibly.
## With `display_id` (one string) the display carries that id (Jupyter's
## `transient.display_id`; any value is then a display, its text what
## print() shows), and `update = TRUE` makes it replace the display shown
## earlier with that id (Jupyter's update_display_data) rather than add one.
helpers$rvisor_display <- function(x, display_id = NULL, update = FALSE) {
  if (is.null(display_id)) {
    if (!identical(update, FALSE))
      stop("rvisor_display(): 'update' needs a 'display_id'", call. = FALSE)
    display_now(x)
    return(invisible(x))
  }
  if (!is.character(display_id) || length(display_id) != 1L || is.na(display_id) ||
      !nzchar(display_id) || nchar(display_id, type = "bytes") > 256L)
    stop("rvisor_display(): 'display_id' must be one non-empty string of at most 256 bytes",
         call. = FALSE)
  if (!is.logical(update) || length(update) != 1L || is.na(update))
    stop("rvisor_display(): 'update' must be TRUE or FALSE", call. = FALSE)
  .Call(emit, "display_id", display_id, if (update) "update" else "new", NULL)
  on.exit(.Call(emit, "display_id", NULL, NULL, NULL))
  display_now(x, always = TRUE)
  invisible(x)
}

## Reports progress to a client that streams the call (an event of kind
## "progress"); does nothing otherwise. `value` out of `total`, with an
## optional message.
helpers$rvisor_progress <- function(value, total = NULL, message = NULL) {
  num <- function(x, what) {
    v <- suppressWarnings(as.numeric(x))
    if (length(v) != 1L || !is.finite(v))
      stop(sprintf("rvisor_progress(): '%s' must be one finite number", what), call. = FALSE)
    format(v, digits = 15L, scientific = FALSE)
  }
  v <- num(value, "value")
  t <- if (is.null(total)) NULL else num(total, "total")
  m <- if (is.null(message)) NULL else clip(as.character(message), caps$message)
  .Call(emit, "progress", v, t, m)
  invisible(NULL)
}

## --- tools from the host ---------------------------------------------------

state$tool_names <- character()

call_tool <- function(name, args) {
  json <- to_json(args, unbox = TRUE)
  if (nchar(json, type = "bytes") > caps$tool_request)
    stop(sprintf(paste0("the request to tool '%s' is %.0f bytes, over the limit of %d bytes; ",
                        "pass a data pointer or a file name instead of the data"),
                 name, nchar(json, type = "bytes"), caps$tool_request), call. = FALSE)
  res <- .Call(tool_sym, name, json)
  if (is.null(res)) stop("the tool's answer could not be built in R", call. = FALSE)
  if (is.na(res[[1L]]))  # interrupted while waiting: end as an interrupt
    stop(structure(class = c("interrupt", "condition"),
                   list(message = res[[2L]], call = NULL)))
  if (!isTRUE(res[[1L]])) stop(res[[2L]], call. = FALSE)
  res[[2L]]
}

set_tools <- function(names) {
  fns <- lapply(names, function(nm) {
    force(nm)
    function(...) call_tool(nm, list(...))
  })
  names(fns) <- names
  assign("tools", structure(fns, class = "rvisor_tools"), envir = state$attached)
  state$tool_names <- names
  if ("rvisor.install" %in% names) patch_install()
  if ("rvisor.input" %in% names) install_input()
}

## install_input(): driver_input.R, loaded on first use.

helpers$`$.rvisor_tools` <- function(x, name) {
  f <- .subset2(x, name)
  if (is.null(f))
    stop(sprintf("unknown tool '%s'; this session's tools: %s", name,
                 if (length(x)) paste(names(x), collapse = ", ") else "none"), call. = FALSE)
  f
}
helpers$`[[.rvisor_tools` <- helpers$`$.rvisor_tools`

## Publishes a data frame as a new data pointer (where the host offers
## it: runs through `rvisor serve`). Returns the pointer.
helpers$rvisor_publish <- function(df, name = NULL) {
  if (!is.data.frame(df)) stop("rvisor_publish() takes a data frame")
  if (!("rvisor.publish" %in% state$tool_names))
    stop("publishing tables is not available here (run through rvisor serve)", call. = FALSE)
  out <- df
  for (j in seq_along(out)) {
    x <- out[[j]]
    # ISO text the table store reads back as dates and timestamps.
    if (inherits(x, "POSIXt")) out[[j]] <- format(x, "%Y-%m-%dT%H:%M:%S", tz = "UTC")
    else if (inherits(x, "Date")) out[[j]] <- format(x, "%Y-%m-%d")
    else if (is.factor(x)) out[[j]] <- as.character(x)
  }
  f <- tempfile(fileext = ".csv")
  on.exit(unlink(f))
  utils::write.csv(out, f, row.names = FALSE, na = "NA")
  res <- call_tool("rvisor.publish", list(path = f, name = if (is.null(name)) "" else as.character(name)))
  res$data_pointer
}
helpers$print.rvisor_tools <- function(x, ...) {
  cat("rvisor tools:", if (length(x)) paste(names(x), collapse = ", ") else "none", "\n")
  invisible(x)
}
helpers$tools <- structure(list(), class = "rvisor_tools")

## In a worker forked from the zygote: its own plot directory, no plot to
## continue, no RNG state shared with its siblings.
reinit <- function(plot_dir) {
  state$plot_dir <- plot_dir
  dir.create(plot_dir, showWarnings = FALSE, recursive = TRUE)
  state$last <- NULL
  state$dev <- 0L
  state$replayed <- FALSE
  state$drop_first <- FALSE
  if (exists(".Random.seed", envir = globalenv(), inherits = FALSE))
    rm(".Random.seed", envir = globalenv())
  invisible()
}

init <- function(plot_dir) {
  state$plot_dir <- plot_dir
  dir.create(plot_dir, showWarnings = FALSE, recursive = TRUE)
  options(device = open_device)
  # help(), file.show(), data(), demo(), library() and the like print
  # through it: to the console, in order, with no child process (a
  # confined worker can run none).
  options(pager = show_files)
  setHook("before.plot.new", on_base_page)
  setHook("before.grid.newpage", on_grid_page)
  # Attaching copies `helpers`; later changes (tools) go to the copy. R's
  # own step of attach(): the closure around it would also look for S4
  # metadata (helpers has none) and leave ~2,600 cons cells of methods'
  # caches behind, which every user's gc() would count.
  state$attached <- .Internal(attach(helpers, 2L, "rvisor"))
  # S3 dispatch skips attached environments between the global and base
  # environments (R >= 3.6), so the tools object's methods are not found in
  # the attached copy: register them where dispatch looks (base's S3 table,
  # where registerS3method() puts methods of base's generics, without the
  # methods package's look at the generic).
  # Without this, `tools$nope()` gave "attempt to apply non-function".
  table <- .BaseNamespaceEnv[[".__S3MethodsTable__."]]
  for (g in c("$", "[[", "print"))
    assign(paste0(g, ".rvisor_tools"), get(paste0(g, ".rvisor_tools"), envir = helpers),
           envir = table)
  invisible()
}

## Byte-compiles the driver's functions. R's JIT never compiles them: a
## small closure whose environment is not the global one is marked "never
## JIT" on its first call, so every call ran the AST interpreter
## (begin_call 12.6 us instead of 3.8). Compiling all of them takes a few
## hundred milliseconds, so only the warm zygote does it (its forks share
## the compiled code). The functions held elsewhere (our global handlers,
## the device option, the plot hooks, the pager) are swapped for the
## compiled ones.
compile_driver <- function() {
  # Once: a preloaded zygote is forked from the warm one, compiled already.
  if (isTRUE(state$compiled)) return(invisible())
  adopt_compiled(compiled_closures())
}

## The driver's closures, byte-compiled, by name.
compiled_closures <- function() {
  env <- environment(compile_driver)
  out <- list()
  for (nm in ls(env, all.names = TRUE)) {
    f <- get(nm, envir = env)
    if (typeof(f) == "closure" && identical(environment(f), env) &&
        !nm %in% c("compile_driver", "compiled_closures", "adopt_compiled",
                   "compile_driver_to_file", "install_compiled_driver")) {
      cf <- tryCatch(compiler::cmpfun(f, options = list(suppressAll = TRUE)),
                     error = function(e) NULL)
      if (!is.null(cf)) out[[nm]] <- cf
    }
  }
  out
}

## Puts compiled closures in place of the driver's, and swaps those held
## elsewhere (our global handlers, the device option, the plot hooks, the
## pager) for the compiled ones.
adopt_compiled <- function(fns) {
  env <- environment(compile_driver)
  old <- list(handlers = our_handlers, before.plot.new = on_base_page,
              before.grid.newpage = on_grid_page)
  new_hooks <- list(before.plot.new = "on_base_page", before.grid.newpage = "on_grid_page")
  for (nm in names(fns)) assign(nm, fns[[nm]], envir = env)
  env$our_handlers <- list(warning = env$on_warning, message = env$on_message,
                           error = env$on_error, interrupt = env$on_interrupt)
  # Our handlers installed so far are the old closures: drop them, and the
  # next expression installs the compiled ones.
  gh <- gh_env$gh
  ours <- vapply(gh, function(h) any(vapply(old$handlers, identical, NA, h)), NA)
  gh_env$gh <- gh[!ours]
  state$gh <- NULL
  options(device = env$open_device, pager = env$show_files)
  for (h in c("before.plot.new", "before.grid.newpage")) {
    hooks <- lapply(getHook(h), function(f) if (identical(f, old[[h]])) env[[new_hooks[[h]]]] else f)
    setHook(h, hooks, "replace")
  }
  state$compiled <- TRUE
  invisible()
}

## Compiling apart. compiler::cmpfun() forces some 60,000 cons cells of
## the compiler's own functions out of its lazy-load database (Rscript:
## 273,430 cells after start, 332,917 after one cmpfun()), and they end up
## interleaved with the compiled code on the heap's pages. A worker forked
## from the warm zygote inherits those pages, and its first full gc()
## writes mark bits on every one of them: 8 MB more private memory per live
## session (docs/process-model.md, "Memory"). So the warm zygote compiles
## in a child process it forks for the purpose (compile_driver_to_file,
## then _exit) and reads the compiled closures back (install_compiled_driver):
## byte code serialises whole, and unserialize() needs no compiler. The
## driver's environment is written as a reference (refhook) and read back
## as the reader's own (`environment<-` would drop the byte code).
## The JIT off while the warm zygote warms up: on, it would compile the
## closures the warm-ups call twice (validation's, ggplot2's ggproto
## methods) and with them force the compiler's code into the heap every
## worker inherits. Off, then back at the level R started with; the
## driver is compiled apart (above), and a session's own closures are
## compiled by the JIT in the session, as Rscript does.
jit_off <- function() {
  if (is.null(state$jit_level)) state$jit_level <- compiler::enableJIT(0L)
  invisible()
}

jit_restore <- function() {
  if (!is.null(state$jit_level)) {
    compiler::enableJIT(state$jit_level)
    state$jit_level <- NULL
  }
  invisible()
}

compiled_driver_file <- function() file.path(tempdir(), "rvisor-compiled-driver.rds")

compile_driver_to_file <- function() {
  if (isTRUE(state$compiled)) return(invisible())
  env <- environment(compile_driver)
  saveRDS(compiled_closures(), compiled_driver_file(), compress = FALSE,
          refhook = function(e) if (identical(e, env)) "rvisor-driver")
  invisible()
}

install_compiled_driver <- function() {
  if (isTRUE(state$compiled)) return(invisible())
  path <- compiled_driver_file()
  on.exit(unlink(path))
  env <- environment(compile_driver)
  adopt_compiled(readRDS(path, refhook = function(name) env))
}

## --- programs (a confined worker) ------------------------------------------
## A confined worker may run only the programs of the server's allow-list
## (docs/confinement.md, "Programs"); the kernel refuses the rest (seccomp
## without any, else Landlock and the noexec program directories). What R
## would word "Cannot allocate memory" (glibc's popen() turns every failure
## to start the shell into ENOMEM) or "error in running command", this says
## in words: what happened and what to do. It is no boundary: code that
## gets around it meets the kernel's refusal.
##
## `install_program_guard()` patches base once, in the zygote, before its
## first confined fork (its namespace and package environment share their
## bindings); each confined worker then only calls `set_programs()`. In a
## worker that did not (none is forked from such a zygote) all behaves as
## R's own.
## - Sys.which() answers from the allow-list: a program is found only if
##   it may run, and no shell is started, so it works with none allowed
##   and packages that look for a program when they load keep loading;
## - system() and system2() say which program was refused, with a warning
##   (after the shell's status 126 or 127), or, with no program allowed
##   at all, an error (intern = TRUE, as R's "cannot popen") or a warning
##   and status 127, as R has it;
## - pipe() says so when no program may run at all.

programs <- new.env(parent = emptyenv())
programs$installed <- FALSE
programs$confined <- FALSE
programs$files <- character()   # the allowed files, symlinks resolved
programs$listed <- character()  # the names the operator allowed

## This worker's allow-list (`files`, and `listed`, the names the operator
## gave: the shell and interpreters come with them).
set_programs <- function(files, listed) {
  programs$files <- files
  programs$listed <- listed
  programs$confined <- TRUE
  if (isNamespaceLoaded("jquerylib")) patch_jquerylib()
  invisible()
}

## A package loaded in a confined worker that would run a program for what
## R can read itself (driver_compat.R) is mended as it loads.
jquerylib_loaded <- function(...) if (programs$confined) patch_jquerylib()

install_program_guard <- function() {
  if (programs$installed) return(invisible())
  g <- new.env(parent = baseenv())
  g$st <- programs
  g$r_which <- get("Sys.which", envir = baseenv())
  g$builtins <- c(".", ":", "[", "alias", "bg", "break", "cd", "chdir", "command",
                  "continue", "echo", "eval", "exec", "exit", "export", "false", "fc",
                  "fg", "getopts", "hash", "jobs", "kill", "local", "printf", "pwd",
                  "read", "readonly", "return", "set", "shift", "test", "times", "trap",
                  "true", "type", "ulimit", "umask", "unalias", "unset", "wait")
  g$prefixes <- c("!", "if", "then", "else", "elif", "do", "while", "until",
                  "exec", "command", "nohup", "time", "{")
  g$allowed <- function(f) normalizePath(f, mustWork = FALSE) %in% st$files
  g$path_dirs <- function() {
    d <- strsplit(Sys.getenv("PATH"), ":", fixed = TRUE)[[1L]]
    d[!nzchar(d)] <- "."
    d
  }
  # The programs a shell command runs: the first word of each simple
  # command (past assignments, redirections and keywords), shell builtins
  # left out. A rough reading, only used to explain a refusal.
  g$command_words <- function(cmd) {
    out <- character()
    for (part in strsplit(paste(cmd, collapse = " "), "[;&|()`}\n]|\\$\\(", perl = TRUE)[[1L]]) {
      w <- tryCatch(suppressWarnings(scan(text = part, what = "", quiet = TRUE,
                                          quote = "\"'")),
                    error = function(e) character())
      i <- 1L
      while (i <= length(w) && (grepl("^[A-Za-z_][A-Za-z0-9_]*=", w[[i]]) ||
                                grepl("^[0-9]*[<>]", w[[i]]) || w[[i]] %in% prefixes)) {
        if (grepl("^[0-9]*[<>]+&?$", w[[i]])) i <- i + 1L  # its target is the next word
        i <- i + 1L
      }
      if (i <= length(w) && !(w[[i]] %in% builtins)) out <- c(out, w[[i]])
    }
    unique(out)
  }
  # Where the shell would find program `w`, or NA.
  g$locate <- function(w) {
    cands <- if (grepl("/", w, fixed = TRUE)) w else file.path(path_dirs(), w)
    for (f in cands) if (file.exists(f) && !dir.exists(f)) return(f)
    NA_character_
  }
  # The programs of `cmd` that exist but may not run.
  g$refused <- function(cmd) {
    w <- command_words(cmd)
    w[vapply(w, function(x) { f <- locate(x); !is.na(f) && !allowed(f) }, NA)]
  }
  g$refusal <- function(cmd, progs = command_words(cmd)) {
    what <- if (length(progs)) paste0("'", progs, "'")
            else paste0("'", substr(paste(cmd, collapse = " "), 1L, 80L), "'")
    many <- length(progs) > 1L
    if (many)
      what <- paste(paste(what[-length(what)], collapse = ", "), "and", what[length(what)])
    flags <- paste("--allow-program", if (length(progs)) basename(progs) else "NAME",
                   collapse = " ")
    if (!length(st$files))
      sprintf("rvisor: %s %s not run: this server's allow-list of programs is empty, so R code here may run no programs; an operator can allow %s with %s",
              what, if (many) "were" else "was",
              if (many) "them" else if (length(progs)) "it" else "one", flags)
    else
      sprintf("rvisor: %s %s not run: %s not in this server's allow-list of programs (allowed: %s); an operator can allow %s with %s",
              what, if (many) "were" else "was", if (many) "they are" else "it is",
              if (length(st$listed)) paste(st$listed, collapse = ", ") else "none",
              if (many) "them" else "it", flags)
  }
  g$sys_which <- function(names) {
    if (!st$confined) return(r_which(names))
    res <- character(length(names))
    names(res) <- names
    dirs <- path_dirs()
    for (i in seq_along(names)) {
      n <- names[[i]]
      if (is.na(n)) { res[i] <- NA; next }
      cands <- if (grepl("/", n, fixed = TRUE)) n else file.path(dirs, n)
      for (f in cands) if (nzchar(n) && file.exists(f) && !dir.exists(f) && allowed(f)) {
        res[i] <- f
        break
      }
    }
    res
  }
  g$run_system <- function(command, intern, timeout) {
    if (!st$confined) return(.Internal(system(command, intern, timeout)))
    call <- sys.call(-1L)
    if (!length(st$files)) {
      msg <- refusal(command)
      if (intern) stop(simpleError(msg, call))
      warning(simpleWarning(msg, call))
      return(invisible(127L))
    }
    warns <- list()
    res <- tryCatch(withCallingHandlers(
      .Internal(system(command, intern, timeout)),
      warning = function(w) {
        warns[[length(warns) + 1L]] <<- w
        invokeRestart("muffleWarning")
      }),
      # R's own error, as system() gives it: the shell could not start
      # ("cannot popen"), which glibc calls ENOMEM whatever the cause.
      error = function(e) stop(simpleError(paste0(conditionMessage(e),
        " (rvisor: glibc gives this reason for any failure to start the shell; in a confined worker it is usually the process limit, --processes, or the memory limit, --memory-mb)"),
        call)))
    status <- if (intern) attr(res, "status") else res
    bad <- if (length(status) == 1L && !is.na(status) && status %in% c(126L, 127L))
             refused(command) else character()
    if (length(bad)) warning(simpleWarning(refusal(command, bad), call))
    else for (w in warns) {
      # R's own warning, as system() gives it.
      w$call <- call
      warning(w)
    }
    if (intern) res else invisible(res)
  }
  g$run_pipe <- function(description, open, encoding) {
    if (st$confined && !length(st$files))
      stop(simpleError(refusal(description), sys.call(-1L)))
    .Internal(pipe(description, open, encoding))
  }
  for (f in c("allowed", "path_dirs", "command_words", "locate", "refused", "refusal",
              "sys_which", "run_system", "run_pipe"))
    environment(g[[f]]) <- g
  # The new bindings, made in one loop below: a helper closure called
  # for each would be compiled by R's JIT on its second call, which forces
  # most of the compiler's lazily loaded functions (~56,000 cons cells,
  # in every worker forked after it, counted by a user's gc()).
  replaced <- list()
  # system(), system2() and pipe() as they are, but for their last call
  # into R's internals, which goes to ours; each keeps its formals and
  # finds the rest in base. Left alone if this R wrote them otherwise.
  inner <- new.env(parent = .BaseNamespaceEnv)
  inner$.rvisor_system <- g$run_system
  inner$.rvisor_pipe <- g$run_pipe
  swaps <- list(
    list("system", quote(.Internal(system(command, intern, timeout))),
         quote(.rvisor_system(command, intern, timeout))),
    list("system2", quote(.Internal(system(command, intern, timeout))),
         quote(.rvisor_system(command, intern, timeout))),
    list("pipe", quote(.Internal(pipe(description, open, encoding))),
         quote(.rvisor_pipe(description, open, encoding))))
  for (sw in swaps) {
    f <- get(sw[[1L]], envir = baseenv())
    b <- body(f)
    if (is.call(b) && identical(b[[1L]], as.name("{")) && identical(b[[length(b)]], sw[[2L]]))
      b[[length(b)]] <- sw[[3L]]
    else if (identical(b, sw[[2L]]))
      b <- sw[[3L]]
    else next
    body(f) <- b
    environment(f) <- inner
    replaced[[sw[[1L]]]] <- f
  }
  replaced$Sys.which <- g$sys_which
  for (name in names(replaced)) {
    for (e in list(baseenv(), .BaseNamespaceEnv)) {
      unlockBinding(name, e)
      assign(name, replaced[[name]], envir = e)
      lockBinding(name, e)
    }
  }
  setHook(packageEvent("jquerylib", "onLoad"), jquerylib_loaded)
  programs$installed <- TRUE
  invisible()
}

## What options and environment variables are when the worker starts
## serving: a checkpoint (driver_state.R) saves only what the session
## changed. The environment is kept as R's "NAME=value" strings, not as
## Sys.getenv()'s named list (fewer objects for a user's gc() to count).
## The options are read from .Options, where R keeps them: options() would
## sort their names by the locale's collation (ICU here), a quarter of a
## new worker's instructions to its first result, and the checkpoint
## compares them by name.
mark_start <- function() {
  state$start_options <- as.list(.Options)
  state$start_env <- env_strings()
  invisible()
}

env_strings <- function() .Internal(Sys.getenv(character(), ""))

## --- parts loaded on first use --------------------------------------------
## Validation (driver_validate.R) and checkpoints (driver_state.R) are kept
## as text until a worker first calls one of their functions: a worker that
## only runs code never parses them, so their code is not among the objects
## a user's gc() counts (docs/r-semantics.md). Each name a part defines is
## bound to a promise that loads the whole part into this environment.
## Called once, with every part (the text of each): R's JIT compiles a
## closure with a loop on its second call, and a first compile forces most
## of the compiler's lazily loaded functions (~56,000 cons cells) in every
## worker.
on_demand <- function(...) {
  env <- environment(on_demand)
  args <- list(...)
  # Pairs: a part's text, then the names it assigns (found by the worker at
  # build time, so no part is parsed here: that took ~4 ms of each start).
  # seq_len (a primitive): seq() would force base's lazily loaded
  # seq.default into every worker's heap (~1,300 cons cells).
  for (i in seq_len(length(args) %/% 2L)) {
    text <- args[[2L * i - 1L]]
    names <- args[[2L * i]]
    # call() is a primitive (bquote() is a closure, twice as slow here).
    for (name in names)
      eval(call("delayedAssign", name, call("load_part", text, name, names), env, env))
  }
  invisible()
}

load_part <- function(text, name, names) {
  env <- environment(load_part)
  for (e in parse(text = text, keep.source = FALSE)) {
    # The names were read from the text without R's parser: a part that
    # does anything else at top level is refused as soon as it is loaded.
    if (!is.call(e) || !identical(e[[1L]], as.name("<-")) || !is.name(e[[2L]]) ||
        !(as.character(e[[2L]]) %in% names))
      stop("a part loaded on demand may only assign, at top level, the names it declares")
    eval(e, env)
  }
  get(name, envir = env, inherits = FALSE)
}
