## R's default packages, loaded as R's own start-up loads them, without
## the two shell commands utils' .onLoad runs to name the operating system
## (utils::osVersion, what sessionInfo() prints): `Sys.which("uname")`
## runs `sh -c which uname`, then `system("uname -a")` runs `sh -c uname
## -a`, about 5 ms of every R start. r.rs starts R with
## R_DEFAULT_PACKAGES=NULL and R_ENABLE_JIT=0 and calls this function
## right after, with both variables as they were: it sets
## options(defaultPackages) as R's system profile does, answers those two
## calls from uname(2) (Sys.info()) and the PATH while the packages load,
## runs R's own .OptRequireMethods() and .First.sys(), then turns the JIT
## on at the level R would have (compiler loaded last, as R loads it).
## Every other call of Sys.which() and system() goes to R's own; both are
## R's own again afterwards.
function(default_packages, jit_level) {
  dp <- default_packages
  if (identical(dp, "")) dp <- c("datasets", "utils", "grDevices", "graphics", "stats", "methods")
  else if (identical(dp, "NULL")) dp <- character(0)
  else dp <- strsplit(dp, ",")[[1]]
  dp <- sub("[[:blank:]]*([[:alnum:]]+)", "\\1", dp)
  options(defaultPackages = dp)
  base <- baseenv()
  sys_which <- base$Sys.which
  sys_system <- base$system
  which_uname <- function() {
    for (d in strsplit(Sys.getenv("PATH"), ":", fixed = TRUE)[[1L]]) {
      f <- file.path(d, "uname")
      if (nzchar(d) && file.access(f, 1L) == 0L && !dir.exists(f)) return(f)
    }
    ""
  }
  put <- function(name, value) {
    unlockBinding(name, base)
    assign(name, value, envir = base)
    lockBinding(name, base)
  }
  put("Sys.which", function(names) {
    if (identical(names, "uname")) c(uname = which_uname()) else sys_which(names)
  })
  put("system", function(command, intern = FALSE, ...) {
    # Only the first word is read: the kernel's name.
    if (identical(command, "uname -a") && isTRUE(intern)) Sys.info()[["sysname"]]
    else sys_system(command, intern, ...)
  })
  on.exit({
    put("Sys.which", sys_which)
    put("system", sys_system)
  })
  .OptRequireMethods()
  .First.sys()
  if (jit_level > 0L) .Internal(enableJIT(jit_level))
  invisible()
}
