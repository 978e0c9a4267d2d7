## Differential test: R's own examples run through `rvisor run --json` and
## through Rscript, compared. Examples come from the Rd files of the
## installed base and recommended packages (tools::Rd2ex). Both sides run
## with the same locale (C.UTF-8), time zone (UTC) and seed (set.seed(1)
## first); compared: stdout line by line, the number of plot pages, and
## success or error.
##
## Usage: Rscript scripts/differential.R RVISOR [N|all|LIST] [OUT.tsv] [JOBS]
##   RVISOR  the rvisor binary; N: a fixed sample of N snippets (every k-th
##   in a sorted list), `all`: every snippet, LIST: a comma-separated list
##   of PKG/TOPIC (that Rd file's examples, e.g. utils/removeSource) and
##   FILE.R (a script of one's own, run the same way; its topic is the
##   file's name), each of which must exist. Prints a summary; writes one
##   line per snippet (package, topic, class) to OUT.tsv. JOBS (default 2):
##   snippets run at once on each side: Rscript's through forked R
##   processes, rvisor's through one `rvisor batch -j JOBS --no-preload`
##   (a fresh worker per snippet, as `rvisor run`). Both sides run every
##   snippet from its own fresh process, so running them at once changes
##   no result. With DIFF_KEEP=DIR set, both sides of every mismatch are
##   written there (TOPIC.R, TOPIC.rscript.txt, TOPIC.rvisor.txt).

args <- commandArgs(trailingOnly = TRUE)
rvisor <- if (length(args) >= 1L) args[[1L]] else "rvisor"
n_want <- if (length(args) >= 2L) args[[2L]] else "40"
out_tsv <- if (length(args) >= 3L) args[[3L]] else ""
jobs <- if (length(args) >= 4L) as.integer(args[[4L]]) else 2L
Sys.setenv(LANG = "C.UTF-8", LC_ALL = "C.UTF-8", TZ = "UTC")

pkgs <- c("base", "stats", "utils", "graphics", "grDevices", "methods",
          rownames(installed.packages(priority = "recommended")))
work <- tempfile("rvisor-diff-")
dir.create(work)
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
    if (ok) {
      code <- readLines(f, warn = FALSE, encoding = "UTF-8")
      ok <- all(validUTF8(code))
      if (ok) writeLines(c("set.seed(1)", code), f, useBytes = TRUE)
    }
    if (ok) snippets <- c(snippets, f)
  }
}
if (grepl("/|[.]R$", n_want)) {
  # Named topics and scripts of one's own, in the order given.
  picked <- character()
  for (item in strsplit(n_want, ",", fixed = TRUE)[[1L]]) {
    if (grepl("[.]R$", item)) {
      if (!file.exists(item)) stop("no such script: ", item)
      code <- readLines(item, warn = FALSE, encoding = "UTF-8")
      f <- file.path(work, paste0("own__", sub("[.]R$", "", basename(item)), ".R"))
      writeLines(c("set.seed(1)", code), f, useBytes = TRUE)
    } else {
      f <- file.path(work, paste0(sub("/", "__", item, fixed = TRUE), ".R"))
      if (!(f %in% snippets)) stop("no examples for ", item, " (PKG/TOPIC, as the Rd file is named)")
    }
    picked <- c(picked, f)
  }
  snippets <- picked
} else if (n_want != "all") {
  n <- as.integer(n_want)
  if (length(snippets) > n)
    snippets <- snippets[unique(round(seq(1, length(snippets), length.out = n)))]
}

profile <- file.path(work, "profile.R")
writeLines(c(
  # rvisor's device: PNG pages of 1000 x 650 pixels (its default plot size).
  "options(device = function(...) grDevices::png(file.path(Sys.getenv('DIFF_PLOTS'), 'p%03d.png'), width = 1000, height = 650, type = 'cairo'))",
  "set.seed(1)"), profile)

run_rscript <- function(f) {
  plots <- tempfile("plots-"); dir.create(plots)
  # A clean environment, as a worker gets: this R's own (R_PAPERSIZE,
  # R_LIBS_SITE, PAGER... set by its Renviron) would otherwise leak in.
  env <- c("-i", paste0("PATH=", Sys.getenv("PATH")), paste0("HOME=", Sys.getenv("HOME")),
           "LANG=C.UTF-8", "LC_ALL=C.UTF-8", "TZ=UTC",
           paste0("R_PROFILE_USER=", profile), paste0("DIFF_PLOTS=", plots))
  out <- suppressWarnings(system2("env", c(env, "timeout", "60",
                                           file.path(R.home("bin"), "Rscript"), f),
                                  stdout = TRUE, stderr = FALSE))
  status <- attr(out, "status")
  n_plots <- length(list.files(plots))
  unlink(plots, recursive = TRUE)
  list(stdout = as.character(out), ok = is.null(status) || status == 0L, plots = n_plots)
}

## rvisor's side: one `rvisor batch` over every snippet; results by file.
run_rvisor_all <- function(files) {
  out <- file.path(work, "rvisor.jsonl")
  status <- suppressWarnings(system2(rvisor, c("batch", "--unconfined", "--no-preload",
                                               "-j", jobs, "--timeout", "60", "-o", out,
                                               files), stdout = FALSE, stderr = FALSE))
  if (!file.exists(out)) stop("rvisor batch wrote no results (exit status ", status, ")")
  failed <- list(stdout = character(), ok = FALSE, plots = 0L)
  res <- setNames(rep(list(failed), length(files)), files)
  for (line in readLines(out, warn = FALSE)) {
    r <- tryCatch(jsonlite::fromJSON(line, simplifyVector = FALSE), error = function(e) NULL)
    if (is.null(r) || is.null(r$file) || is.null(r$result) || !(r$file %in% files)) next
    x <- r$result
    txt <- paste0(vapply(x$segments, function(s) if (identical(s$kind, "stdout")) s$text else "", ""),
                  collapse = "")
    lines <- if (nzchar(txt)) strsplit(txt, "\n", fixed = TRUE)[[1L]] else character()
    res[[r$file]] <- list(stdout = lines, ok = isTRUE(x$success), plots = length(x$plots))
  }
  res
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
rvis <- run_rvisor_all(snippets)
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
if (nzchar(out_tsv)) utils::write.table(res, out_tsv, sep = "\t", quote = FALSE, row.names = FALSE)
