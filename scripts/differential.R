## Differential test: R's own examples run through `rvisor run --json` and
## through Rscript, compared. Examples come from the Rd files of the
## installed base and recommended packages (tools::Rd2ex). Both sides run
## with the same locale (C.UTF-8), time zone (UTC) and seed (set.seed(1)
## first); compared: stdout line by line, the number of plot pages, and
## success or error.
##
## Usage: Rscript scripts/differential.R RVISOR [N|all] [OUT.tsv]
##   RVISOR  the rvisor binary; N: a fixed sample of N snippets (every k-th
##   in a sorted list), `all`: every snippet. Prints a summary; writes one
##   line per snippet (package, topic, class) to OUT.tsv.

args <- commandArgs(trailingOnly = TRUE)
rvisor <- if (length(args) >= 1L) args[[1L]] else "rvisor"
n_want <- if (length(args) >= 2L) args[[2L]] else "40"
out_tsv <- if (length(args) >= 3L) args[[3L]] else ""
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
    if (ok) snippets <- c(snippets, f)
  }
}
if (n_want != "all") {
  n <- as.integer(n_want)
  if (length(snippets) > n)
    snippets <- snippets[unique(round(seq(1, length(snippets), length.out = n)))]
}

profile <- file.path(work, "profile.R")
writeLines(c(
  "options(device = function(...) grDevices::png(file.path(Sys.getenv('DIFF_PLOTS'), 'p%03d.png'), type = 'cairo'))",
  "set.seed(1)"), profile)

run_rscript <- function(f) {
  plots <- tempfile("plots-"); dir.create(plots)
  code <- c("set.seed(1)", readLines(f, warn = FALSE))
  g <- tempfile(fileext = ".R"); writeLines(code, g)
  out <- suppressWarnings(system2("timeout", c("60", file.path(R.home("bin"), "Rscript"), g),
                                  stdout = TRUE, stderr = FALSE,
                                  env = c(paste0("R_PROFILE_USER=", profile),
                                          paste0("DIFF_PLOTS=", plots))))
  status <- attr(out, "status")
  list(stdout = as.character(out), ok = is.null(status) || status == 0L,
       plots = length(list.files(plots)))
}

run_rvisor <- function(f) {
  code <- c("set.seed(1)", readLines(f, warn = FALSE))
  g <- tempfile(fileext = ".R"); writeLines(code, g)
  js <- suppressWarnings(system2(rvisor, c("run", "--json", "--unconfined", "--timeout", "60", g),
                                 stdout = TRUE, stderr = FALSE))
  r <- tryCatch(jsonlite::fromJSON(paste(js, collapse = "\n"), simplifyVector = FALSE),
                error = function(e) NULL)
  if (is.null(r)) return(list(stdout = character(), ok = FALSE, plots = 0L))
  txt <- paste0(vapply(r$segments, function(s) if (identical(s$kind, "stdout")) s$text else "", ""),
                collapse = "")
  lines <- if (nzchar(txt)) strsplit(txt, "\n", fixed = TRUE)[[1L]] else character()
  list(stdout = lines, ok = isTRUE(r$success), plots = length(r$plots))
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

res <- data.frame(package = character(), topic = character(), class = character())
for (f in snippets) {
  base <- sub("[.]R$", "", basename(f))
  parts <- strsplit(base, "__", fixed = TRUE)[[1L]]
  a <- run_rscript(f); b <- run_rvisor(f)
  res[nrow(res) + 1L, ] <- list(parts[[1L]], parts[[2L]], classify(a, b))
}
tab <- table(res$class)
cat(sprintf("snippets: %d\n", nrow(res)))
for (k in names(tab)) cat(sprintf("%-22s %d\n", k, tab[[k]]))
if (nzchar(out_tsv)) utils::write.table(res, out_tsv, sep = "\t", quote = FALSE, row.names = FALSE)
