# Runs lintr 3's default linters over the files named on the command line
# and prints one lint a line, tab-separated: file, line, column, linter,
# message. The reference side of tests/lintr_agreement.rs.
args <- commandArgs(trailingOnly = TRUE)
suppressPackageStartupMessages(library(lintr))
linters <- lintr::linters_with_defaults()
for (f in args) {
  lints <- tryCatch(
    lintr::lint(f, linters = linters, parse_settings = FALSE, cache = FALSE),
    error = function(e) NULL
  )
  if (is.null(lints)) {
    cat(f, "0", "0", "lintr_failed", "lintr_failed", sep = "\t")
    cat("\n")
    next
  }
  for (l in lints) {
    msg <- gsub("[\t\n]", " ", l$message)
    cat(f, l$line_number, l$column_number, l$linter, msg, sep = "\t")
    cat("\n")
  }
}
