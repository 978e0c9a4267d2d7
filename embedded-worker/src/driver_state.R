## rvisor's driver, checkpoints: a part of driver.R loaded on first use
## (driver.R, "Parts loaded on first use"), evaluated in the driver's
## environment. Only assignments at top level.
##
## A session's state as one R object, serialised by checkpoint_state() and
## loaded into a fresh worker by restore_state() (the worker compresses it
## and writes the file; state.rs). Options and environment variables are
## saved as they differ from what they were when this worker started
## serving (mark_start(), in driver.R).

## The environment as a named list, from Sys.getenv()'s strings.
env_list <- function(x) {
  m <- regexpr("=", x, fixed = TRUE)
  n <- substring(x, 1L, m - 1L)
  o <- sort.list(n)
  structure(as.list(substring(x, m + 1L))[o], names = n[o])
}

## Objects that cannot cross into another process faithfully: a connection
## would silently name whatever connection has its number there; an
## external pointer comes back NULL (data.table's self-reference repairs
## itself, so a data.table is kept).
unsafe_kind <- function(v) {
  if (inherits(v, "connection")) return("connection")
  found <- FALSE
  hook <- function(x) {
    if (typeof(x) == "externalptr") found <<- TRUE
    NULL
  }
  if (typeof(v) == "externalptr" && !inherits(v, "data.table")) return("external pointer")
  if (inherits(v, "data.table")) return("")
  invisible(serialize(v, NULL, version = 3L, xdr = FALSE, refhook = hook))
  if (found) "external pointer" else ""
}

## Files of `dir` (recursive, hidden ones too), up to `max_bytes` in all;
## R's own temporary directory is left out.
wd_files <- function(dir, max_bytes) {
  out <- list()
  skipped <- character()
  if (!nzchar(dir) || !dir.exists(dir)) return(list(files = out, skipped = skipped))
  tmp <- normalizePath(tempdir(), mustWork = FALSE)
  rel <- list.files(dir, recursive = TRUE, all.files = TRUE, no.. = TRUE)
  total <- 0
  for (f in rel) {
    full <- file.path(dir, f)
    np <- normalizePath(full, mustWork = FALSE)
    if (startsWith(np, tmp)) next
    size <- file.size(full)
    if (is.na(size) || dir.exists(full)) next
    if (total + size > max_bytes) { skipped <- c(skipped, f); next }
    data <- tryCatch(readBin(full, "raw", n = size), error = function(e) NULL)
    if (is.null(data)) { skipped <- c(skipped, f); next }
    total <- total + size
    out[[length(out) + 1L]] <- list(path = f, data = data)
  }
  list(files = out, skipped = skipped)
}

## The state (a raw vector) and what the manifest says about it.
checkpoint_state <- function(dir, max_file_bytes) {
  g <- globalenv()
  nms <- ls(g, all.names = TRUE, sorted = TRUE)
  unsaved <- list()
  keep <- character()
  found <- FALSE
  hook <- function(x) {
    if (typeof(x) == "externalptr") found <<- TRUE
    NULL
  }
  for (n in nms) {
    v <- get(n, envir = g, inherits = FALSE)
    if (inherits(v, "connection")) {
      unsaved[[length(unsaved) + 1L]] <- list(name = n, reason = "connection")
    } else keep <- c(keep, n)
  }
  objects <- mget(keep, envir = g, inherits = FALSE)
  blob <- serialize(objects, NULL, version = 3L, xdr = FALSE, refhook = hook)
  if (found) {
    # Rare: find which objects hold an external pointer, drop them, again.
    bad <- keep[vapply(keep, function(n) nzchar(unsafe_kind(objects[[n]])), NA)]
    for (n in bad) unsaved[[length(unsaved) + 1L]] <- list(name = n, reason = "external pointer")
    objects <- objects[setdiff(keep, bad)]
    blob <- serialize(objects, NULL, version = 3L, xdr = FALSE)
  }
  opts <- options()
  start <- state$start_options
  changed <- names(opts)[!vapply(names(opts), function(k)
    identical(opts[[k]], start[[k]]) && k %in% names(start), NA)]
  removed <- setdiff(names(start), names(opts))
  env <- env_list(env_strings())
  senv <- env_list(state$start_env)
  env_changed <- names(env)[!vapply(names(env), function(k) identical(env[[k]], senv[[k]]), NA)]
  env_removed <- setdiff(names(senv), names(env))
  search_path <- search()
  attached <- sub("^package:", "", search_path[startsWith(search_path, "package:")])
  ns <- loadedNamespaces()
  versions <- vapply(ns, function(p) tryCatch(as.character(getNamespaceVersion(p)),
                                               error = function(e) ""), "")
  files <- wd_files(dir, max_file_bytes)
  st <- list(
    format = 1L,
    objects = blob,
    options = opts[changed],
    options_removed = removed,
    env = env[env_changed],
    env_removed = env_removed,
    attached = attached,
    namespaces = ns,
    rng_kind = RNGkind(),
    files = files$files
  )
  raw <- serialize(st, NULL, version = 3L, xdr = FALSE)
  # The worker writes the manifest (JSON) from these vectors.
  list(raw, names(objects), length(blob),
       vapply(unsaved, function(u) u$name, ""), vapply(unsaved, function(u) u$reason, ""),
       attached, ns, unname(versions),
       vapply(files$files, function(f) f$path, ""), files$skipped,
       changed, c(env_changed, env_removed))
}

## Why a saved file cannot be written back to `p` under `dir`, or "": only
## a plain relative path stays inside the directory (no leading "/", no
## "..", "." or empty part), and no part of it may already be a symbolic
## link (it could point anywhere).
bad_file_path <- function(dir, p) {
  if (!is.character(p) || length(p) != 1L || is.na(p) || !nzchar(p))
    return("it names a file without a path")
  shown <- encodeString(p, quote = '"')
  parts <- strsplit(p, "/", fixed = TRUE)[[1L]]
  if (startsWith(p, "/") || endsWith(p, "/") || any(parts %in% c("", ".", "..")))
    return(sprintf("the file %s would be written outside the working directory", shown))
  at <- dir
  for (part in parts) {
    at <- file.path(at, part)
    link <- Sys.readlink(at)  # NA: nothing there yet
    if (!is.na(link) && nzchar(link))
      return(sprintf("the file %s would be written through a symbolic link", shown))
  }
  ""
}

## Loads a checkpoint's state (a raw vector) into this worker, before any
## call ran in it. Checks the packages it needs and the files' paths first,
## so that a checkpoint naming a package that is gone, or a file outside
## the working directory, changes nothing.
restore_state <- function(raw, dir) {
  st <- unserialize(raw)
  if (!is.list(st) || !identical(st$format, 1L))
    stop("the checkpoint's format is not one this worker reads")
  if (!is.list(st$files) || !all(vapply(st$files, function(f)
        is.list(f) && is.raw(f$data), NA)))
    stop("the checkpoint is damaged (its saved files are not path and bytes)", call. = FALSE)
  if (nzchar(dir)) {
    for (f in st$files) {
      why <- bad_file_path(dir, f$path)
      if (nzchar(why)) stop(sprintf("the checkpoint is refused: %s", why), call. = FALSE)
    }
  }
  missing <- st$namespaces[!vapply(st$namespaces, function(p)
    nzchar(system.file(package = p)), NA)]
  if (length(missing))
    stop(sprintf(
      "%s no longer installed; install %s again to use %s",
      if (length(missing) == 1L) sprintf("package %s is", missing)
      else sprintf("packages %s are", paste(missing, collapse = ", ")),
      if (length(missing) == 1L) "it" else "them",
      if (length(missing) == 1L) "it" else "them"),
      call. = FALSE)
  objects <- unserialize(st$objects)
  for (p in setdiff(st$namespaces, loadedNamespaces()))
    loadNamespace(p)
  now <- sub("^package:", "", search()[startsWith(search(), "package:")])
  for (p in rev(setdiff(st$attached, now)))
    suppressPackageStartupMessages(library(p, character.only = TRUE))
  if (length(st$options)) options(st$options)
  for (k in st$options_removed) options(structure(list(NULL), names = k))
  if (length(st$env)) do.call(Sys.setenv, st$env)
  if (length(st$env_removed)) Sys.unsetenv(st$env_removed)
  k <- st$rng_kind
  suppressWarnings(RNGkind(k[[1L]], k[[2L]], if (length(k) > 2L) k[[3L]]))
  g <- globalenv()
  for (n in names(objects)) assign(n, objects[[n]], envir = g)
  if (nzchar(dir)) {
    for (f in st$files) {
      full <- file.path(dir, f$path)
      dir.create(dirname(full), recursive = TRUE, showWarnings = FALSE)
      writeBin(f$data, full)
    }
  }
  invisible(TRUE)
}
