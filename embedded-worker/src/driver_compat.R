## The driver's part for distribution-patched packages that run a program
## to learn what R can read for itself, loaded on first use (driver.R,
## "parts loaded on first use"). Only a confined worker whose code loads
## such a package parses it (docs/confinement.md, "Programs").
## Top-level assignments only.

## Debian's r-cran-jquerylib uses the system's jQuery and learns its
## version by running `dpkg -s libjs-jquery | grep | sed | cut`, twice,
## whenever a page needs jQuery (DT and other htmlwidgets, R Markdown's
## html_document), which a confined worker refuses unless five programs
## and dpkg's database are allowed. The answer is the directory the
## package ships under lib/ (jquery_core() loads jQuery's files from
## `lib/<version>`), so in a confined worker the version is read from
## there and no program runs. A jquerylib that does not run dpkg (CRAN's)
## is left as it is.
patch_jquerylib <- function() {
  ns <- asNamespace("jquerylib")
  orig <- get0("expand_version", envir = ns, inherits = FALSE)
  if (!is.function(orig) || !any(grepl("dpkg", deparse(body(orig)), fixed = TRUE)))
    return(invisible())
  lib <- system.file("lib", package = "jquerylib")
  local_version <- function(major_version) {
    v <- list.files(lib)
    v <- v[startsWith(v, paste0(major_version, "."))]
    if (!length(v)) return("")
    v[order(numeric_version(v, strict = FALSE), decreasing = TRUE)][[1L]]
  }
  unlockBinding("expand_version", ns)
  assign("expand_version", local_version, envir = ns)
  lockBinding("expand_version", ns)
  invisible()
}
