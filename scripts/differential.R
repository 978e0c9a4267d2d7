## Differential test: R code run through rvisor and through Rscript,
## compared. Two sources of code, one runner:
##
##  - R's own examples (the default): the Rd files of the installed base
##    and recommended packages (tools::Rd2ex), through one `rvisor batch
##    --unconfined --no-preload` and Rscript, both from one empty directory.
##  - The corpus (`--vignettes`): the vignette code installed packages ship
##    (<lib>/<pkg>/doc/*.R across .libPaths()), code nobody here wrote,
##    each script through Rscript twice and through `rvisor run` (confined,
##    the default: the path a user takes), each run in a fresh directory of
##    its own; optionally through `rvisor batch` too (CORPUS_BATCH=1).
##
## Both sides run with the same locale (C.UTF-8), time zone (UTC) and seed
## (set.seed(1) first); compared: stdout line by line, the number of plot
## pages, and success or error.
##
## Usage: Rscript scripts/differential.R [--vignettes] RVISOR [N|all|LIST] [OUT.tsv] [JOBS]
##   RVISOR  the rvisor binary; N: a fixed sample of N snippets or scripts
##   (every k-th in a sorted list), `all`: every one, LIST: a
##   comma-separated list of PKG/TOPIC (that Rd file's examples, e.g.
##   utils/removeSource; with --vignettes PKG/SCRIPT.R, e.g.
##   grid/moveline.R) and FILE.R (a script of one's own, run the same way;
##   its topic is the file's name), each of which must exist. Prints a
##   summary; writes one line per snippet (package, topic, class; the
##   corpus adds the `rvisor batch` class when run) to OUT.tsv. JOBS
##   (default 2): snippets run at once. Every snippet runs in its own fresh
##   process on each side, so running them at once changes no result.
##
## Examples: DIFF_KEEP=DIR keeps both sides of every mismatch (TOPIC.R,
## TOPIC.rscript.txt, TOPIC.rvisor.txt). The corpus: CORPUS_KEEP=DIR keeps
## both sides of every script that does not match (normalised stdout, and
## stderr as .err.txt), CORPUS_TIMEOUT (default 120) is each run's limit in
## seconds, CORPUS_BATCH=1 runs the scripts through `rvisor batch
## --no-preload -j JOBS` too, CORPUS_FLAGS="--allow-program cat ..." are
## flags for rvisor (split at spaces: programs allowed besides the
## default, pandoc; paths exposed read-only). Corpus classes:
## docs/r-semantics.md.

args <- commandArgs(trailingOnly = TRUE)
vignettes <- length(args) >= 1L && identical(args[[1L]], "--vignettes")
if (vignettes) args <- args[-1L]
rvisor <- if (length(args) >= 1L) args[[1L]] else "rvisor"
n_want <- if (length(args) >= 2L) args[[2L]] else if (vignettes) "24" else "40"
out_tsv <- if (length(args) >= 3L) args[[3L]] else ""
jobs <- if (length(args) >= 4L) as.integer(args[[4L]]) else 2L
Sys.setenv(LANG = "C.UTF-8", LC_ALL = "C.UTF-8", TZ = "UTC")
rvisor <- normalizePath(rvisor, mustWork = FALSE)
work <- tempfile("rvisor-diff-")
dir.create(work)

## The first `n` of `items` spread evenly over the sorted list (every k-th),
## or all of them.
sample_of <- function(items, n_want) {
  if (n_want == "all") return(items)
  n <- as.integer(n_want)
  if (length(items) > n) items <- items[unique(round(seq(1, length(items), length.out = n)))]
  items
}

## `code` with set.seed(1) first, as both sides run it, written to `f`;
## FALSE for a file that is not valid UTF-8 (skipped).
write_seeded <- function(code, f) {
  if (!all(validUTF8(code))) return(FALSE)
  writeLines(c("set.seed(1)", code), f, useBytes = TRUE)
  TRUE
}

## A clean environment, as a worker gets: this R's own (R_PAPERSIZE,
## R_LIBS_SITE, PAGER... set by its Renviron) would otherwise leak in.
clean_env <- function(home, ...) {
  c("-i", paste0("PATH=", Sys.getenv("PATH")), paste0("HOME=", home),
    "LANG=C.UTF-8", "LC_ALL=C.UTF-8", "TZ=UTC", ...)
}

## ---- R's own examples -----------------------------------------------------

examples_mode <- function() {
  pkgs <- c("base", "stats", "utils", "graphics", "grDevices", "methods",
            rownames(installed.packages(priority = "recommended")))
  snippets <- character()
  for (p in pkgs) {
    db <- tryCatch(tools::Rd_db(p), error = function(e) list())
    for (nm in sort(names(db))) {
      f <- file.path(work, paste0(p, "__", gsub("/", "_", sub("[.]Rd$", "", nm), fixed = TRUE), ".R"))
      ok <- tryCatch({ tools::Rd2ex(db[[nm]], f, commentDontrun = TRUE,
                                    commentDonttest = TRUE); file.exists(f) },
                     error = function(e) FALSE)
      # Both sides run the same file: set.seed(1), then the example. A file
      # that is not valid UTF-8 is skipped (none in R 4.2's sets).
      if (ok) ok <- write_seeded(readLines(f, warn = FALSE, encoding = "UTF-8"), f)
      if (ok) snippets <- c(snippets, f)
    }
  }
  if (grepl("/|[.]R$", n_want)) {
    # Named topics and scripts of one's own, in the order given.
    picked <- character()
    for (item in strsplit(n_want, ",", fixed = TRUE)[[1L]]) {
      if (grepl("[.]R$", item)) {
        if (!file.exists(item)) stop("no such script: ", item)
        f <- file.path(work, paste0("own__", sub("[.]R$", "", basename(item)), ".R"))
        write_seeded(readLines(item, warn = FALSE, encoding = "UTF-8"), f)
      } else {
        f <- file.path(work, paste0(sub("/", "__", item, fixed = TRUE), ".R"))
        if (!(f %in% snippets)) stop("no examples for ", item, " (PKG/TOPIC, as the Rd file is named)")
      }
      picked <- c(picked, f)
    }
    snippets <- picked
  } else {
    snippets <- sample_of(snippets, n_want)
  }

  profile <- file.path(work, "profile.R")
  writeLines(c(
    # rvisor's device: PNG pages of 1000 x 650 pixels (its default plot size).
    "options(device = function(...) grDevices::png(file.path(Sys.getenv('DIFF_PLOTS'), 'p%03d.png'), width = 1000, height = 650, type = 'cairo'))",
    "set.seed(1)"), profile)

  run_rscript <- function(f) {
    plots <- tempfile("plots-"); dir.create(plots)
    env <- clean_env(Sys.getenv("HOME"), paste0("R_PROFILE_USER=", profile),
                     paste0("DIFF_PLOTS=", plots))
    out <- suppressWarnings(system2("env", c(env, "timeout", "60",
                                             file.path(R.home("bin"), "Rscript"), f),
                                    stdout = TRUE, stderr = FALSE))
    status <- attr(out, "status")
    n_plots <- length(list.files(plots))
    unlink(plots, recursive = TRUE)
    list(stdout = as.character(out), ok = is.null(status) || status == 0L, plots = n_plots)
  }

  ## A mismatch's class: the first difference found.
  classify <- function(a, b) {
    if (a$ok != b$ok) return(if (a$ok) "rvisor_error_only" else "rscript_error_only")
    if (a$plots != b$plots) return("plot_pages")
    if (!identical(a$stdout, b$stdout)) {
      # Addresses of environments and pointers differ from run to run.
      strip <- function(x) gsub("<(environment|pointer|bytecode): [^>]*>", "<addr>", x)
      if (identical(strip(a$stdout), strip(b$stdout))) return("match_but_addresses")
      return("stdout")
    }
    "match"
  }

  keep <- Sys.getenv("DIFF_KEEP")  # a directory for both sides of each mismatch
  if (nzchar(keep)) dir.create(keep, showWarnings = FALSE, recursive = TRUE)
  # Both sides start in the same empty directory (examples list it).
  dir.create(file.path(work, "cwd"))
  setwd(file.path(work, "cwd"))
  rscript <- parallel::mclapply(snippets, run_rscript, mc.cores = jobs, mc.preschedule = FALSE)
  rvis <- run_batch(snippets, c("--unconfined", "--no-preload", "--timeout", "60"))
  res <- data.frame(package = character(), topic = character(), class = character())
  for (i in seq_along(snippets)) {
    parts <- strsplit(sub("[.]R$", "", basename(snippets[[i]])), "__", fixed = TRUE)[[1L]]
    a <- rscript[[i]]
    if (!is.list(a)) a <- list(stdout = character(), ok = FALSE, plots = 0L)  # the fork failed
    b <- rvis[[snippets[[i]]]]
    res[nrow(res) + 1L, ] <- list(parts[[1L]], parts[[2L]], classify(a, b))
    if (nzchar(keep) && res$class[[nrow(res)]] != "match") {
      # Both sides of a mismatch, for a closer look.
      stem <- file.path(keep, sub("[.]R$", "", basename(snippets[[i]])))
      file.copy(snippets[[i]], paste0(stem, ".R"), overwrite = TRUE)
      writeLines(c(sprintf("# ok=%s plots=%d", a$ok, a$plots), a$stdout), paste0(stem, ".rscript.txt"))
      writeLines(c(sprintf("# ok=%s plots=%d", b$ok, b$plots), b$stdout), paste0(stem, ".rvisor.txt"))
    }
  }
  tab <- table(res$class)
  cat(sprintf("snippets: %d\n", nrow(res)))
  for (k in names(tab)) cat(sprintf("%-22s %d\n", k, tab[[k]]))
  res
}

## rvisor's side through one `rvisor batch` (a fresh worker per file, JOBS
## at a time) with `flags`; results by file: stdout lines, success, plot
## pages, and the rest of the console (messages, warnings, errors) as
## `stderr`.
run_batch <- function(files, flags) {
  out <- file.path(work, "rvisor.jsonl")
  unlink(out)
  status <- suppressWarnings(system2(rvisor, c("batch", flags, "-j", jobs, "-o", out, files),
                                     stdout = FALSE, stderr = FALSE))
  if (!file.exists(out)) stop("rvisor batch wrote no results (exit status ", status, ")")
  failed <- list(stdout = character(), stderr = character(), ok = FALSE, plots = 0L)
  res <- setNames(rep(list(failed), length(files)), files)
  lines_of <- function(txt) if (nzchar(txt)) strsplit(txt, "\n", fixed = TRUE)[[1L]] else character()
  for (line in readLines(out, warn = FALSE)) {
    r <- tryCatch(jsonlite::fromJSON(line, simplifyVector = FALSE), error = function(e) NULL)
    if (is.null(r) || is.null(r$file) || is.null(r$result) || !(r$file %in% files)) next
    x <- r$result
    txt <- paste0(vapply(x$segments, function(s) if (identical(s$kind, "stdout")) s$text else "", ""),
                  collapse = "")
    other <- vapply(x$segments, function(s) {
      if (identical(s$kind, "stdout")) return("")
      paste(unlist(s[c("text", "message", "call")]), collapse = " ")
    }, "")
    res[[r$file]] <- list(stdout = lines_of(txt), stderr = other[nzchar(other)],
                          ok = isTRUE(x$success), plots = length(x$plots))
  }
  res
}

## ---- the corpus: vignette code of installed packages ----------------------

## Bytes of each stream kept per run; a file-size limit stops a run that
## writes far more.
out_cap <- 1e6
run_timeout <- as.numeric(Sys.getenv("CORPUS_TIMEOUT", "120"))
## rvisor's flags of the operator (--allow-program, --read-only...).
allow_flags <- strsplit(trimws(Sys.getenv("CORPUS_FLAGS")), " +")[[1L]]

## Every installed package's vignette code, one package once (the first
## library of .libPaths() that has it, as library() picks), sorted by
## package and file name, in a locale-free order.
vignette_scripts <- function() {
  seen <- character()
  out <- character()
  for (lib in .libPaths()) {
    for (pkg in list.files(lib)) {
      if (pkg %in% seen || !file.exists(file.path(lib, pkg, "DESCRIPTION"))) next
      seen <- c(seen, pkg)
      out <- c(out, list.files(file.path(lib, pkg, "doc"), pattern = "[.]R$", full.names = TRUE))
    }
  }
  key <- paste(basename(dirname(dirname(out))), basename(out), sep = "/")
  setNames(out, key)[order(key, method = "radix")]
}

## The lines of a file, at most `out_cap` bytes of it, NULs dropped.
read_capped <- function(f) {
  if (!file.exists(f)) return(character())
  b <- readBin(f, "raw", out_cap)
  b <- b[b != as.raw(0L)]
  if (!length(b)) return(character())
  strsplit(rawToChar(b), "\n", fixed = TRUE)[[1L]]
}

## Runs `argv` in `dir` (created empty) with a clean environment, its
## stdout and stderr in files beside `dir`, a time limit (the run's, and
## 15 s for start-up) and a file-size limit; what it printed, its exit
## status and whether it succeeded.
run_in <- function(argv, dir, ...) {
  dir.create(dir, recursive = TRUE)
  out <- paste0(dir, ".out")
  err <- paste0(dir, ".err")
  # ulimit -f counts KiB blocks: 50 MB per file written.
  cmd <- paste("cd", shQuote(dir), "&& ulimit -f 51200 && exec env",
               paste(shQuote(clean_env(dir, ...)), collapse = " "),
               "timeout -k 5", run_timeout + 15,
               paste(shQuote(argv), collapse = " "), ">", shQuote(out), "2>", shQuote(err))
  status <- suppressWarnings(system2("sh", c("-c", shQuote(cmd))))
  list(stdout = read_capped(out), stderr = read_capped(err), status = status,
       ok = identical(as.integer(status), 0L))
}

## Plot pages of R's default device in a script's directory (Rplots.pdf).
pdf_pages <- function(dir) {
  f <- file.path(dir, "Rplots.pdf")
  if (!file.exists(f)) return(0L)
  b <- readBin(f, "raw", file.size(f))
  length(grepRaw("/Type /Page ", b, fixed = TRUE, all = TRUE))
}

## One script through Rscript: run `n` of it, in a fresh directory.
rscript_side <- function(f, n) {
  dir <- file.path(work, "runs", paste0(sub("[.]R$", "", basename(f)), ".rscript", n))
  r <- run_in(c(file.path(R.home("bin"), "Rscript"), f), dir)
  r$plots <- pdf_pages(dir)
  r$wd <- dir
  r
}

## One script through `rvisor run` (confined), in a fresh directory; its
## plots written to a directory beside it.
rvisor_side <- function(f) {
  dir <- file.path(work, "runs", paste0(sub("[.]R$", "", basename(f)), ".rvisor"))
  plots <- paste0(dir, ".plots")
  env <- if (nzchar(Sys.getenv("RVISOR_WORKER"))) paste0("RVISOR_WORKER=", Sys.getenv("RVISOR_WORKER"))
  # --no-displays: a table shown as a display loads repr and htmltools
  # (and their imports) into the session, which sessionInfo() then lists;
  # the console is what Rscript's is (docs/r-semantics.md, "Decisions").
  r <- run_in(c(rvisor, allow_flags, "run", "--no-displays", "--timeout", run_timeout,
                "--plots-dir", plots, f),
              dir, env)
  r$plots <- length(list.files(plots, pattern = "^plot-[0-9]+[.]png$"))  # not the displays beside them
  r$wd <- dir
  r
}

## What differs from run to run or from one side's directories to the
## other's, replaced by placeholders: addresses (environments, pointers,
## bytecode, any 0x...), temporary paths (Rscript's /tmp/RtmpXXXXXX,
## rvisor's /tmp/rvisor-<hex>/Rtmp) and file names in them, the working
## directory (the run's own, and a confined worker's private
## /tmp/rvisor-<hex>, also as a base name), timings (`Time difference
## of`, system.time()'s and proc.time()'s numbers, "N secs") and clock
## times (hh:mm:ss, as in a date printed in a table's header).
normalise <- function(x, wd) {
  if (nzchar(wd)) {
    x <- gsub(wd, "<wd>", x, fixed = TRUE)
    x <- gsub(basename(wd), "<wd>", x, fixed = TRUE)
  }
  x <- gsub("/tmp/rvisor-[0-9a-f]+/Rtmp", "<tempdir>", x)
  x <- gsub("/tmp/Rtmp[A-Za-z0-9]{6}", "<tempdir>", x)
  x <- gsub("<tempdir>/[A-Za-z_]*[0-9a-f]{4,}", "<tempdir>/<file>", x)
  x <- gsub("(/tmp/)?rvisor-[0-9a-f]{16}", "<wd>", x)
  x <- gsub("<(environment|pointer|bytecode|weak reference|externalptr): [^>]*>", "<\\1: addr>", x)
  x <- gsub("0x[0-9a-f]{5,16}", "0x<addr>", x)
  x <- gsub("Time difference of [-+0-9.e]+ [a-z]+", "Time difference of <t>", x)
  x <- gsub("[0-9]+([.][0-9]+)? ?(secs|sec|seconds|ms|mins)\\b", "<t> \\2", x)
  x <- gsub("\\b[0-9]{2}:[0-9]{2}:[0-9]{2}([.][0-9]+)?\\b", "<hh:mm:ss>", x)
  timing <- grep("^\\s*user\\s+system\\s+elapsed\\s*$", x) + 1L
  timing <- timing[timing <= length(x)]
  x[timing] <- "<timings>"
  x
}

## How a confined worker's refused programs show: rvisor's words for a
## program outside the operator's allow-list of programs ("rvisor: 'cat'
## was not run: ..."), and R's for a failed system(), system2(), pipe()
## or Sys.which() (which a worker without the guard gives). A script that
## needs a program the allow-list leaves out differs.
refused_pattern <- paste("rvisor: .* (was|were) not run: |allow-list of programs|cannot popen",
                         "error in running command|had status 127|sh: [0-9]+: .*: not found",
                         sep = "|")
refused <- function(r) any(grepl(refused_pattern, c(r$stdout, r$stderr)))

## Differences that are choices (docs/r-semantics.md, "The corpus"), each
## as what it rewrites on either side; a script matching once they are
## applied is of that class.
choices <- list(
  # rvisor captures plots on its own PNG device; Rscript's default is pdf
  # (Rplots.pdf in the working directory): dev.cur() and friends name it.
  device = function(x) {
    x <- sub("^(pdf|png) +$", "<device> ", x)
    x <- gsub("\"Rplots[.]pdf\" *", "", x)
    x
  },
  # The driver's own objects are counted by gc() (Ncells, Vcells).
  gc_counts = function(x) {
    x <- sub("^(Ncells|Vcells)( +[0-9.]+)+ *$", "\\1 <n>", x)
    x
  },
  # A confined worker's paths have other lengths than Rscript's (its
  # temporary directory /tmp/rvisor-<hex>/Rtmp, pid 1 in tempfile()
  # names): columns padded to a path's width line up differently and wide
  # tables wrap elsewhere. The same words in another layout, in output
  # that prints such a path. Last: it compares words only.
  path_widths = function(x) {
    if (!any(grepl("<tempdir>|<wd>", x))) return(x)
    sort(unlist(strsplit(trimws(x), "[[:space:]]+")), method = "radix")
  }
)

## A script's class: nondeterministic (Rscript's two runs differ), match,
## program_refused, a documented choice (or several, joined by +), or the
## first other difference found.
classify_script <- function(a, a2, b) {
  same <- function(x, y, f = identity)
    x$ok == y$ok && x$plots == y$plots && identical(f(x$stdout), f(y$stdout))
  norm <- function(r) { r$stdout <- normalise(r$stdout, r$wd); r }
  a <- norm(a); a2 <- norm(a2); b <- norm(b)
  if (!same(a, a2)) return("nondeterministic")
  if (same(a, b)) return("match")
  if (refused(b) && !refused(a)) return("program_refused")
  # The fewest choices that explain the difference, applied in their order.
  for (n in seq_along(choices)) {
    for (set in utils::combn(names(choices), n, simplify = FALSE)) {
      f <- function(x) Reduce(function(v, k) choices[[k]](v), set, x)
      if (same(a, b, f)) return(paste(set, collapse = "+"))
    }
  }
  if (a$ok != b$ok) return(if (a$ok) "rvisor_error_only" else "rscript_error_only")
  if (a$plots != b$plots) return("plot_pages")
  "stdout"
}

vignettes_mode <- function() {
  all <- vignette_scripts()
  listed <- grepl("/|[.]R$", n_want)
  picked <- if (listed) {
    items <- strsplit(n_want, ",", fixed = TRUE)[[1L]]
    vapply(items, function(item) {
      if (file.exists(item)) return(normalizePath(item))
      if (!(item %in% names(all))) stop("no vignette code ", item, " (PKG/SCRIPT.R, as installed in PKG/doc)")
      all[[item]]
    }, "")
  } else {
    sample_of(all, n_want)
  }
  keys <- ifelse(names(picked) %in% names(all), names(picked), paste0("own/", basename(picked)))
  files <- character()
  skipped <- character()
  for (i in seq_along(picked)) {
    f <- file.path(work, paste0(sub("/", "__", sub("[.]R$", "", keys[[i]]), fixed = TRUE), ".R"))
    if (write_seeded(readLines(picked[[i]], warn = FALSE, encoding = "UTF-8"), f)) {
      files <- c(files, setNames(f, keys[[i]]))
    } else {
      skipped <- c(skipped, keys[[i]])
    }
  }
  cat(sprintf("vignette scripts installed: %d; run: %d (%s)%s\n", length(all), length(files),
              if (listed) "as listed" else if (n_want == "all") "all" else "a sample", if (length(skipped))
                paste0("; skipped, not UTF-8: ", paste(skipped, collapse = ", ")) else ""))
  one <- function(f) {
    a <- rscript_side(f, 1L)
    a2 <- rscript_side(f, 2L)
    b <- rvisor_side(f)
    list(a = a, a2 = a2, b = b, class = classify_script(a, a2, b))
  }
  runs <- parallel::mclapply(unname(files), one, mc.cores = jobs, mc.preschedule = FALSE)
  failed <- !vapply(runs, is.list, NA)
  if (any(failed)) stop("a run failed inside the runner: ", paste(names(files)[failed], collapse = ", "))
  res <- data.frame(package = sub("/.*", "", names(files)), script = sub(".*/", "", names(files)),
                    class = vapply(runs, `[[`, "", "class"))
  if (identical(Sys.getenv("CORPUS_BATCH"), "1")) {
    # The same scripts through `rvisor batch` (confined, no preloads, as
    # `rvisor run`), from a fresh directory of its own.
    bdir <- file.path(work, "runs", "batch")
    dir.create(bdir, recursive = TRUE)
    old <- setwd(bdir)
    batch <- run_batch(unname(files), c(allow_flags, "--no-preload", "--timeout", run_timeout))
    setwd(old)
    res$batch <- vapply(seq_along(files), function(i) {
      b <- batch[[files[[i]]]]
      b$wd <- bdir
      classify_script(runs[[i]]$a, runs[[i]]$a2, b)
    }, "")
  }
  keep <- Sys.getenv("CORPUS_KEEP")
  if (nzchar(keep)) {
    dir.create(keep, showWarnings = FALSE, recursive = TRUE)
    for (i in which(res$class != "match")) {
      stem <- file.path(keep, sub("[.]R$", "", basename(files[[i]])))
      file.copy(files[[i]], paste0(stem, ".R"), overwrite = TRUE)
      r <- runs[[i]]
      sides <- list(rscript = r$a, rvisor = r$b)
      if (res$class[[i]] == "nondeterministic") sides$rscript2 <- r$a2
      for (s in names(sides)) {
        x <- sides[[s]]
        writeLines(c(sprintf("# class=%s ok=%s status=%s plots=%d", res$class[[i]], x$ok,
                             format(x$status), x$plots), normalise(x$stdout, x$wd)),
                   paste0(stem, ".", s, ".txt"), useBytes = TRUE)
        writeLines(x$stderr, paste0(stem, ".", s, ".err.txt"), useBytes = TRUE)
      }
    }
  }
  comparable <- res$class != "nondeterministic"
  cat(sprintf("scripts: %d, nondeterministic (Rscript's two runs differ): %d, comparable: %d\n",
              nrow(res), sum(!comparable), sum(comparable)))
  for (col in intersect(c("class", "batch"), names(res))) {
    tab <- table(res[[col]][comparable])
    cat(sprintf("%s: match %d of %d\n", if (col == "class") "rvisor run" else "rvisor batch",
                sum(res[[col]][comparable] == "match"), sum(comparable)))
    for (k in names(tab)) cat(sprintf("  %-24s %d\n", k, tab[[k]]))
  }
  odd <- res$class != "match" | (if (is.null(res$batch)) FALSE else res$batch != "match")
  for (i in which(odd))
    cat(sprintf("  %s/%s: %s%s\n", res$package[[i]], res$script[[i]], res$class[[i]],
                if (is.null(res$batch)) "" else paste0(" (batch: ", res$batch[[i]], ")")))
  res
}

res <- if (vignettes) vignettes_mode() else examples_mode()
if (nzchar(out_tsv)) utils::write.table(res, out_tsv, sep = "\t", quote = FALSE, row.names = FALSE)
