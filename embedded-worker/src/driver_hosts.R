## The driver's part of host-side replacements, loaded on first use
## (driver.R, "parts loaded on first use"): install.packages() through the
## server (docs/packages.md) and the packages of a tenant's library a call
## had loaded (input from a front end is driver_input.R). Only workers that have those tools or libraries parse it.
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

## Packages loaded from the libraries after R's own (a tenant's).
report_packages_loaded <- function() tryCatch({
  ns <- setdiff(loadedNamespaces(), "base")
  lib <- vapply(ns, function(n) dirname(getNamespaceInfo(n, "path")), "")
  mine <- sort(ns[lib %in% state$libs_after])
  if (length(mine))
    .Call(emit, "packages_loaded", mine,
          vapply(mine, function(n) as.character(getNamespaceVersion(n)), ""), NULL)
}, error = function(e) NULL)
