## rvisor bench: the peer driver. Runs workloads through callr and Rserve on
## request from the Rust benchmark, so that peers and rvisor are measured
## side by side, interleaved, in one run. Protocol on stdin/stdout, one line
## each: "<peer> <workload> <n>" -> "OK <ms> <ms> ..." or "NA <reason>".
## "quit" ends it. Rserve listens on loopback only (its default).

suppressPackageStartupMessages({
  has_callr <- requireNamespace("callr", quietly = TRUE)
  has_rs <- requireNamespace("RSclient", quietly = TRUE) &&
    requireNamespace("Rserve", quietly = TRUE)
})

now_ms <- function() as.numeric(Sys.time()) * 1000

setup_df <- quote(dat <- data.frame(a = 1:2000, b = rnorm(2000), c = sample(letters, 2000, TRUE)))

## --- callr -----------------------------------------------------------------
callr_session <- NULL
callr_start <- function() {
  s <- callr::r_session$new(wait = TRUE)
  s$run(function() { x <- 0; NULL })
  s$run(function() {
    x <<- 0
    dat <<- data.frame(a = 1:2000, b = rnorm(2000), c = sample(letters, 2000, TRUE))
    NULL
  })
  s
}
callr_fun <- list(
  one_plus_one = function() 1 + 1,
  counter = function() x <<- x + 1,
  colmeans = function() summary(colMeans(matrix(rnorm(1e6), 1000))),
  print_df = function() capture.output(print(dat)),
  base_plot = function() {
    f <- tempfile(fileext = ".png"); grDevices::png(f, 800, 600); plot(rnorm(100)); grDevices::dev.off()
    r <- readBin(f, "raw", file.size(f)); unlink(f); r
  },
  ggplot = function() {
    f <- tempfile(fileext = ".png"); grDevices::png(f, 800, 600)
    print(ggplot2::ggplot(mtcars, ggplot2::aes(wt, mpg)) + ggplot2::geom_point()); grDevices::dev.off()
    r <- readBin(f, "raw", file.size(f)); unlink(f); r
  }
)
run_callr <- function(workload, n) {
  if (!has_callr) return("NA callr not installed")
  if (workload == "cold_start") {
    out <- numeric(n)
    for (i in seq_len(n)) {
      t0 <- now_ms(); s <- callr::r_session$new(wait = TRUE); s$run(function() 1 + 1)
      out[i] <- now_ms() - t0; s$close()
    }
    return(out)
  }
  if (is.null(callr_session)) callr_session <<- callr_start()
  s <- callr_session
  if (workload == "error_then_next") {
    out <- numeric(n)
    for (i in seq_len(n)) {
      t0 <- now_ms()
      try(s$run(function() stop("boom")), silent = TRUE)
      s$run(function() 1 + 1)
      out[i] <- now_ms() - t0
    }
    return(out)
  }
  if (workload == "timeout_recovery") {
    # callr has no per-call timeout: start the call, wait 1 s, interrupt.
    out <- numeric(n); kept <- TRUE
    for (i in seq_len(n)) {
      s$run(function() { keep_me <<- 42; NULL })
      s$call(function() Sys.sleep(60))
      s$poll_process(1000)
      t0 <- now_ms()
      ok <- tryCatch({ s$interrupt(); s$poll_process(5000); s$read(); TRUE }, error = function(e) FALSE)
      if (!ok) return("NA callr session cannot be interrupted here")
      r <- s$run(function() exists("keep_me"))
      out[i] <- now_ms() - t0
      kept <- kept && isTRUE(r)
    }
    return(c(out, if (kept) -1 else -2))
  }
  f <- callr_fun[[workload]]
  if (is.null(f)) return(paste("NA callr workload", workload, "unknown"))
  out <- numeric(n)
  for (i in seq_len(n)) { t0 <- now_ms(); s$run(f); out[i] <- now_ms() - t0 }
  out
}

## --- Rserve ----------------------------------------------------------------
rs_port <- 6300L + sample.int(600L, 1L)
rs_conn <- NULL
rs_started <- FALSE
rs_daemon <- NA_integer_
rs_start <- function() {
  Rserve::Rserve(port = rs_port, args = "--no-save --RS-enable-control --slave", quote = FALSE)
  rs_started <<- TRUE
  for (i in 1:200) {
    c <- tryCatch(RSclient::RS.connect(port = rs_port), error = function(e) NULL)
    if (!is.null(c)) return(c)
    Sys.sleep(0.05)
  }
  stop("Rserve did not start")
}
rs_code <- list(
  one_plus_one = quote(1 + 1),
  counter = quote(x <- x + 1),
  colmeans = quote(summary(colMeans(matrix(rnorm(1e6), 1000)))),
  print_df = quote(capture.output(print(dat))),
  base_plot = quote({
    f <- tempfile(fileext = ".png"); grDevices::png(f, 800, 600); plot(rnorm(100)); grDevices::dev.off()
    r <- readBin(f, "raw", file.size(f)); unlink(f); r
  }),
  ggplot = quote({
    f <- tempfile(fileext = ".png"); grDevices::png(f, 800, 600)
    print(ggplot2::ggplot(mtcars, ggplot2::aes(wt, mpg)) + ggplot2::geom_point()); grDevices::dev.off()
    r <- readBin(f, "raw", file.size(f)); unlink(f); r
  })
)
## A new Rserve daemon to its first result: start the server (as its users
## do, Rserve::Rserve()), connect (retried every 5 ms until it listens),
## eval 1+1; then the daemon is ended (not timed).
rs_process_start <- function(n) {
  out <- numeric(n)
  for (i in seq_len(n)) {
    port <- 7000L + sample.int(2000L, 1L)
    t0 <- now_ms()
    Rserve::Rserve(port = port, args = "--no-save --slave", quote = FALSE)
    k <- NULL
    for (j in 1:2000) {
      k <- tryCatch(RSclient::RS.connect(port = port), error = function(e) NULL)
      if (!is.null(k)) break
      Sys.sleep(0.005)
    }
    if (is.null(k)) return("NA Rserve did not start")
    v <- RSclient::RS.eval(k, 1 + 1)
    out[i] <- now_ms() - t0
    if (!identical(v, 2)) return("NA Rserve's 1+1 was not 2")
    daemon <- RSclient::RS.eval(k, as.integer(strsplit(sub(".*\\) ", "", readLines("/proc/self/stat")), " ")[[1]][2]))
    RSclient::RS.close(k)
    invisible(tools::pskill(daemon, tools::SIGTERM))
  }
  out
}

## Memory of live sessions after a full gc() (`rvisor bench --only
## memory`): a daemon of its own (nothing preloaded, as Rserve::Rserve()
## starts it), n connections (a forked child each), the case's calls in
## every connection in turn, then the PSS of the daemon's whole process
## tree (smaps_rollup) / n and the median private bytes of a connection's
## process. The calls match cli/src/bench/memory.rs's CASES.
rs_ggplot <- quote({
  f <- tempfile(fileext = ".png"); grDevices::png(f, 800, 600)
  print(ggplot2::ggplot(mtcars, ggplot2::aes(wt, mpg)) + ggplot2::geom_point()); grDevices::dev.off()
  unlink(f); NULL
})
rs_gc <- quote({ v <- rnorm(1e5); invisible(gc()); NULL })
memory_cases <- list(
  gc = list(rs_gc),
  ggplot_gc = list(rs_ggplot, rs_gc),
  ggplot_later_gc = list(quote({ v <- rnorm(1e5); NULL }), rs_ggplot, quote({ invisible(gc()); NULL }))
)
ppid_of <- function(pid) {
  s <- tryCatch(readLines(sprintf("/proc/%s/stat", pid), warn = FALSE), error = function(e) "")
  if (!length(s) || !nzchar(s)) return(NA_integer_)
  as.integer(strsplit(sub(".*\\) ", "", s), " ")[[1]][2])
}
rs_memory_tree <- function(case, n) {
  calls <- memory_cases[[case]]
  if (is.null(calls)) return(paste("NA memory case", case, "unknown"))
  port <- 7000L + sample.int(2000L, 1L)
  Rserve::Rserve(port = port, args = "--no-save --slave", quote = FALSE)
  conns <- list()
  for (j in 1:2000) {
    k <- tryCatch(RSclient::RS.connect(port = port), error = function(e) NULL)
    if (!is.null(k)) break
    Sys.sleep(0.005)
  }
  if (is.null(k)) return("NA Rserve did not start")
  conns[[1]] <- k
  daemon <- RSclient::RS.eval(k, as.integer(strsplit(sub(".*\\) ", "", readLines("/proc/self/stat")), " ")[[1]][2]))
  on.exit({
    for (c in conns) try(RSclient::RS.close(c), silent = TRUE)
    invisible(tools::pskill(daemon, tools::SIGTERM))
  })
  for (i in seq_len(n - 1)) conns[[i + 1]] <- RSclient::RS.connect(port = port)
  for (code in calls) for (c in conns) RSclient::RS.eval(c, code, lazy = FALSE)
  Sys.sleep(0.5)
  procs <- as.integer(list.files("/proc", pattern = "^[0-9]+$"))
  kids <- procs[vapply(procs, function(p) identical(ppid_of(p), as.integer(daemon)), TRUE)]
  tree <- c(daemon, kids)
  mem <- vapply(tree, memory_of, numeric(3))
  c(sum(mem[2, ], na.rm = TRUE) / n, stats::median(mem[3, -1], na.rm = TRUE), length(kids))
}

run_rserve <- function(workload, n) {
  if (!has_rs) return("NA Rserve/RSclient not installed")
  if (workload == "process_start") return(rs_process_start(n))
  if (startsWith(workload, "pss_")) return(rs_memory_tree(sub("^pss_", "", workload), n))
  if (is.null(rs_conn)) {
    rs_conn <<- tryCatch(rs_start(), error = function(e) NULL)
    if (is.null(rs_conn)) return("NA Rserve did not start")
    # The connection runs in a fork of the daemon: its parent is the daemon.
    rs_daemon <<- RSclient::RS.eval(rs_conn, as.integer(strsplit(sub(".*\\) ", "", readLines("/proc/self/stat")), " ")[[1]][2]))
    RSclient::RS.eval(rs_conn, x <- 0)
    RSclient::RS.eval(rs_conn, setup_df, lazy = FALSE)
  }
  c <- rs_conn
  if (workload == "cold_start") {
    out <- numeric(n)
    for (i in seq_len(n)) {
      t0 <- now_ms(); k <- RSclient::RS.connect(port = rs_port); RSclient::RS.eval(k, 1 + 1)
      out[i] <- now_ms() - t0; RSclient::RS.close(k)
    }
    return(out)
  }
  if (workload == "error_then_next") {
    out <- numeric(n)
    for (i in seq_len(n)) {
      t0 <- now_ms()
      try(RSclient::RS.eval(c, stop("boom")), silent = TRUE)
      RSclient::RS.eval(c, 1 + 1)
      out[i] <- now_ms() - t0
    }
    return(out)
  }
  if (workload == "timeout_recovery") return("NA Rserve has no call timeouts or interrupts")
  code <- rs_code[[workload]]
  if (is.null(code)) return(paste("NA Rserve workload", workload, "unknown"))
  out <- numeric(n)
  for (i in seq_len(n)) { t0 <- now_ms(); RSclient::RS.eval(c, code, lazy = FALSE); out[i] <- now_ms() - t0 }
  out
}

memory_of <- function(pid) {
  f <- sprintf("/proc/%d/smaps_rollup", pid)
  if (!file.exists(f)) return(c(NA, NA, NA))
  l <- readLines(f)
  kb <- function(key) as.numeric(sub("^[^:]+:\\s+([0-9]+) kB$", "\\1", grep(paste0("^", key, ":"), l, value = TRUE)[1]))
  c(kb("Rss"), kb("Pss"), kb("Private_Clean") + kb("Private_Dirty")) * 1024
}

run_memory <- function(peer) {
  pid <- if (peer == "callr") {
    if (!has_callr) return("NA callr not installed")
    if (is.null(callr_session)) callr_session <<- callr_start()
    callr_session$get_pid()
  } else {
    if (!has_rs || is.null(rs_conn)) return("NA Rserve not running")
    RSclient::RS.eval(rs_conn, Sys.getpid())
  }
  memory_of(pid)
}

con <- file("stdin")
open(con)
repeat {
  line <- readLines(con, n = 1L)
  if (!length(line) || line == "quit") break
  parts <- strsplit(line, " ", fixed = TRUE)[[1]]
  res <- tryCatch({
    if (parts[2] == "memory") run_memory(parts[1])
    else if (parts[1] == "callr") run_callr(parts[2], as.integer(parts[3]))
    else if (parts[1] == "rserve") run_rserve(parts[2], as.integer(parts[3]))
    else paste("NA unknown peer", parts[1])
  }, error = function(e) paste("NA", gsub("[\r\n]", " ", conditionMessage(e))))
  if (is.character(res)) cat(res, "\n", sep = "") else cat("OK", format(res, digits = 6), "\n")
  flush(stdout())
}
if (!is.null(callr_session)) try(callr_session$close(), silent = TRUE)
if (!is.null(rs_conn)) try(RSclient::RS.close(rs_conn), silent = TRUE)
## Rserve >= 1.8 has no shutdown command: end the daemon by its pid.
if (!is.na(rs_daemon)) invisible(tools::pskill(rs_daemon, tools::SIGTERM))
