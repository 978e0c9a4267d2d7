# Writes the example code of installed packages' help pages as R files, one
# per help topic, into the directory given first; the packages follow
# (default: a few base packages). The real-code side of the corpus of
# tests/lintr_agreement.rs.
args <- commandArgs(trailingOnly = TRUE)
out <- args[[1]]
pkgs <- if (length(args) > 1) args[-1] else c("stats", "utils", "graphics", "base")
dir.create(out, showWarnings = FALSE, recursive = TRUE)
for (p in pkgs) {
  db <- tryCatch(tools::Rd_db(p), error = function(e) list())
  for (topic in names(db)) {
    f <- file.path(out, paste0(p, "-", sub("\\.Rd$", "", topic), ".R"))
    tryCatch(
      tools::Rd2ex(db[[topic]], f, commentDontrun = TRUE, commentDonttest = FALSE),
      error = function(e) NULL
    )
  }
}
