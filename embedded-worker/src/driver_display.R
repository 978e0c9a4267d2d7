## Rich results: tables and HTML-only values as MIME bundles (Jupyter's
## display_data). Loaded on first use (driver.R, "parts loaded on first
## use"): a call that prints no table and no HTML value never parses this
## file, and repr and htmltools are loaded only when a value
## needs them (a table of plain columns never does: table_markup). Every function here reports through `emit` ("display",
## "unsupported") and never lets an error out: a bundle that cannot be
## made becomes a note, the value's text still printed.

## A table cut to what repr shows with these limits: repr shows the first
## and last halves of `rows` (and of `cols`), so half of it plus one from
## each end keeps every cell it shows and still more than it shows (it
## then marks the cut as it would), and repr (which types and formats
## every column it is given) costs the same for 1e6 rows or 10,000
## columns as for 22. Automatic row names stay automatic.
table_window <- function(x, rows, cols) {
  nr <- NROW(x)
  nc <- NCOL(x)
  end <- function(n, limit) {
    k <- limit %/% 2L + 1L
    if (n > 2L * k) c(seq_len(k), seq.int(n - k + 1L, n)) else seq_len(n)
  }
  i <- end(nr, rows)
  j <- end(nc, cols)
  if (length(i) == nr && length(j) == nc) return(x)
  auto <- is.data.frame(x) && .row_names_info(x) < 0L
  y <- x[i, j, drop = FALSE]
  if (auto) attr(y, "row.names") <- .set_row_names(length(i))
  y
}

## repr's caption names the window's size: put the table's own back.
## (repr's chars$times_s is this sign.)
fix_caption <- function(text, small, big) {
  if (identical(dim(small), dim(big))) return(text)
  times <- "\u00d7"
  sub(paste(NROW(small), times, NCOL(small)), paste(NROW(big), times, NCOL(big)),
      text, fixed = TRUE)
}

## HTML and Markdown of a table window, written here rather than by repr
## (repr::repr_html / repr_markdown, 1.1.x) for the plain columns tables
## mostly hold: byte for byte what repr gives, in a sixth of its time
## (a 2,000-row frame, both: 0.97 ms against 6.4), and repr (with pillar,
## vctrs, htmltools) not loaded. Anything else is NULL, and repr makes it
## as before.

## format(v) for a plain vector (no class, no attributes) without its
## dispatch and argument matching: what format.default() calls for these
## types with its defaults (prettyNum() then changes nothing), at half
## the cost; anything else goes through format() itself.
format_cells <- function(v) {
  if (is.object(v) || !is.null(attributes(v))) return(format(v))
  switch(typeof(v),
         character = .Internal(format(v, FALSE, NULL, 0L, NULL, 0L, TRUE, NA, NA_character_)),
         double = , integer = , logical =
           .Internal(format(v, FALSE, NULL, 0L, NULL, 3L, TRUE, NA, getOption("OutDec"))),
         format(v))
}

## pillar's type_sum() of a column this covers, or NULL.
markup_type <- function(v) {
  if (!is.null(attr(v, "pillar", exact = TRUE)) || !is.null(dim(v))) return(NULL)
  if (!is.object(v))
    return(switch(typeof(v), double = "dbl", integer = "int", character = "chr",
                  logical = "lgl", NULL))
  cl <- class(v)
  if (identical(cl, "factor")) "fct"
  else if (identical(cl, c("ordered", "factor"))) "ord"
  else if (identical(cl, "Date") && is.numeric(unclass(v))) "date"
  else if (identical(cl, c("POSIXct", "POSIXt")) && is.numeric(unclass(v))) "dttm"
  else NULL
}

## repr's partition(): the first and last parts shown of `n` items, or
## NULL when all are shown.
markup_part <- function(n, limit) {
  if (limit >= n) return(NULL)
  list(seq_len(ceiling(limit / 2)), seq.int(n - floor(limit / 2) + 1L, n))
}

## c(html = , markdown = ) of `x` with repr's limits `rows` and `cols`, as
## repr::repr_html(x) and repr::repr_markdown(x) would give them, or NULL
## for a table this does not cover.
table_markup <- function(x, rows, cols) {
  # Outside a UTF-8 locale sprintf() and format() translate the
  # ellipses and the sign: leave that to repr.
  if (!isTRUE(l10n_info()[["UTF-8"]])) return(NULL)
  cls <- class(x)
  df <- is.data.frame(x)
  if (df) {
    if (!identical(cls, "data.frame") && !identical(cls, c("tbl_df", "tbl", "data.frame")))
      return(NULL)
    types <- lapply(x, markup_type)
    if (!length(types) || any(vapply(types, is.null, NA))) return(NULL)
    types <- sprintf("<%s>", unlist(types, use.names = FALSE))
  } else {
    if (!is.matrix(x) || !identical(cls, c("matrix", "array")) ||
        !is.null(attr(x, "pillar", exact = TRUE))) return(NULL)
    types <- switch(typeof(x), double = "dbl", integer = "int", character = "chr",
                    logical = "lgl", NULL)
    if (is.null(types) || !nrow(x) || !ncol(x)) return(NULL)
  }
  nr <- nrow(x)
  nc <- ncol(x)
  pr <- markup_part(nr, rows)
  pc <- markup_part(nc, cols)
  # Cut both ways, repr takes a corner by x[i, j], which drops a corner of
  # one column (of one row, for a matrix) to a vector, and fails on it.
  tib <- identical(cls[[1L]], "tbl_df")
  if (!is.null(pr) && !is.null(pc) && ((cols < 4L && !tib) || (!df && rows < 4L)))
    return(NULL)
  rn_all <- rownames(x)
  has_rn <- if (df) .row_names_info(x) > 0L else !is.null(rn_all)
  cn_all <- colnames(x)
  has_cn <- !is.null(cn_all)
  ri <- if (is.null(pr)) list(seq_len(nr)) else pr
  ci <- if (is.null(pc)) seq_len(nc) else c(pc[[1L]], pc[[2L]])
  v_ell <- "\u22ee"
  h_ell <- "\u22ef"
  # Each shown column formatted as repr does, in each part of the rows
  # apart, the rows' ellipsis between.
  cells <- lapply(ci, function(j) {
    v <- if (df) x[[j]] else x[, j]
    out <- lapply(ri, function(i) {
      s <- format_cells(v[i])
      if (length(s) != length(i)) stop("format() changed the length")
      as.character(s)
    })
    if (length(out) == 2L) c(out[[1L]], v_ell, out[[2L]]) else out[[1L]]
  })
  rn <- if (is.null(pr)) rn_all else c(rn_all[pr[[1L]]], v_ell, rn_all[pr[[2L]]])
  cn <- cn_all[ci]
  if (!is.null(pc)) {
    k <- length(pc[[1L]])
    n_out <- length(cells[[1L]])
    ell <- rep(h_ell, n_out)
    if (!is.null(pr)) ell[[length(pr[[1L]]) + 1L]] <- "\u22f1"
    cells <- c(cells[seq_len(k)], list(ell), cells[-seq_len(k)])
    cn <- c(cn[seq_len(k)], h_ell, cn[-seq_len(k)])
    if (df) types <- c(types[pc[[1L]]], h_ell, types[pc[[2L]]])
  } else if (df) types <- types[ci]
  m <- matrix(unlist(cells, use.names = FALSE), ncol = length(cells))
  n_out <- nrow(m)
  caption_cls <- if (identical(cls[[1L]], "tbl_df")) "tibble" else cls[[1L]]
  caption <- sprintf("A %s: %s \u00d7 %s", caption_cls, nr, nc)
  if (!df) caption <- sprintf("%s of type %s", caption, types)

  ## The HTML and Markdown are written in Rust (markup.rs) from these
  ## cells, byte for byte as repr writes them: escaping and joining a few
  ## hundred strings was most of a table's display in R.
  out <- .Call(markup_sym, "table",
               list(as.character(m), n_out, if (has_rn) as.character(rn),
                    if (has_cn) as.character(cn), if (df) as.character(types),
                    caption, min(nc, cols + 1L) + as.integer(has_rn)))
  if (length(out) != 2L) return(NULL)
  c(html = out[[1L]], markdown = out[[2L]])
}

## One cell of the JSON preview: numbers and logicals as themselves (NA,
## NaN, Inf as null), everything else as its format()ed text, cut to 256
## characters.
preview_column <- function(v, i) {
  v <- v[i]
  if (is.factor(v)) v <- as.character(v)
  if (is.list(v)) v <- vapply(v, function(e) paste(format(e), collapse = ", "), "")
  if (is.numeric(v) && !is.object(v)) {
    v <- as.numeric(v)
    v[!is.finite(v)] <- NA
    return(v)
  }
  if (is.logical(v) && !is.object(v)) return(v)
  s <- if (is.character(v)) v else format(v)
  na <- is.na(v)
  long <- !na & nchar(s, type = "chars", allowNA = TRUE) > 256L
  long[is.na(long)] <- FALSE
  s[long] <- paste0(substr(s[long], 1L, 255L), "\u2026")
  s[na] <- NA
  s
}

## The type of a column: its R class (integer, numeric, character,
## factor, Date, POSIXct, list...).
column_type <- function(v) class(v)[[1L]]

## One column of the preview for markup.rs: "raw" cells (numbers as R
## writes them with 15 significant digits, logicals as true and false)
## or "text" cells (written as JSON strings); NA is null.
preview_cells <- function(v) {
  if (is.numeric(v)) list("raw", as.character(v))
  else if (is.logical(v)) list("raw", ifelse(v, "true", "false"))
  else list("text", as.character(v))
}

## A typed preview of a table: its size, its columns' names and types
## (the first `cols`), the first `rows` rows, and whether it was cut.
## The cells are prepared column by column here (vectorised) and the
## JSON written in Rust (markup.rs): jsonlite's per-value dispatch was
## two fifths of a table's display, and R's own string pasting most of
## the rest.
preview_json <- function(x, rows, cols) {
  nr <- NROW(x)
  nc <- NCOL(x)
  j <- seq_len(min(nc, cols))
  i <- seq_len(min(nr, rows))
  df <- if (is.data.frame(x)) x else as.data.frame(x, stringsAsFactors = FALSE)
  nm <- names(df)
  if (is.null(nm)) nm <- paste0("V", seq_len(nc))
  nm <- nm[j]
  types <- vapply(j, function(k) column_type(df[[k]]), "")
  cells <- lapply(j, function(k) preview_cells(preview_column(df[[k]], i)))
  rn <- if (is.data.frame(x) && .row_names_info(x) < 0L) NULL else rownames(x)[i]
  count <- function(n) format(n, scientific = FALSE)
  out <- .Call(markup_sym, "preview",
               list(count(nr), count(nc), as.character(nm), as.character(types),
                    vapply(cells, `[[`, "", 1L), lapply(cells, `[[`, 2L), length(i),
                    if (!is.null(rn)) as.character(rn), nr > rows || nc > cols))
  if (length(out) != 1L) stop("the preview could not be written")
  out
}

## Emits a display: `data` a named character vector (MIME type to text;
## `application/json` holds JSON text), `meta` JSON text.
emit_display <- function(data, meta = "{}") {
  .Call(emit, "display", names(data), unname(data), meta)
  invisible()
}

meta_json <- function(kind, cls, notes = character()) {
  fields <- c(sprintf("\"kind\":%s", json_string(kind)),
              sprintf("\"class\":%s", json_string(cls)))
  if (length(notes))
    fields <- c(fields, sprintf("\"truncated\":{%s}",
                                paste0(json_string(names(notes)), ":", json_string(notes),
                                       collapse = ",")))
  paste0("{\"rvisor\":{", paste(fields, collapse = ","), "}}")
}

## A data frame, tibble or matrix that has just been printed (`text`, the
## console text of that print): its bundle. Without repr the bundle has
## the text and the JSON preview only, and says why.
show_table <- function(x, text) {
  o <- state$display
  notes <- character()
  data <- c("text/plain" = text)
  res <- tryCatch(suppressWarnings({
    # repr shows at least 2 rows and 2 columns (its own minimum).
    rows <- max(o$rows, 2L)
    cols <- max(o$cols, 2L)
    w <- table_window(x, rows, cols)
    # The driver's own markup when it covers the table (it errs on the
    # side of repr: any error here is repr's turn).
    markup <- tryCatch(table_markup(w, rows, cols), error = function(e) NULL)
    if (is.null(markup)) {
      if (!requireNamespace("repr", quietly = TRUE))
        stop("the R package repr is not installed (Debian: r-cran-repr)")
      old <- options(repr.matrix.max.rows = rows, repr.matrix.max.cols = cols)
      on.exit(options(old))
      markup <- c(html = repr::repr_html(w), markdown = repr::repr_markdown(w))
    }
    c("text/html" = fix_caption(markup[["html"]], w, x),
      "text/markdown" = fix_caption(markup[["markdown"]], w, x),
      "application/json" = preview_json(x, o$rows, o$cols))
  }), error = function(e) {
    notes[["text/html"]] <<- clip(paste("not made:", conditionMessage(e)), caps$message)
    NULL
  })
  if (!is.null(res)) data <- c(data, res)
  big <- nchar(data, type = "bytes") > o$html_max
  big[names(data) == "text/plain"] <- FALSE
  for (m in names(data)[big])
    notes[[m]] <- sprintf("left out: %.0f bytes, over display.html_max_bytes (%.0f)",
                          nchar(data[[m]], type = "bytes"), o$html_max)
  data <- data[!big]
  emit_display(data, meta_json("table", class(x)[[1L]], notes))
}

## A dependency's directory on disk (`package` makes `src$file` relative
## to the installed package), or an error saying why it cannot be inlined.
dependency_dir <- function(dep) {
  dir <- dep$src$file
  if (is.null(dir))
    stop(sprintf("its dependency '%s' has only a URL, which cannot be inlined offline", dep$name))
  if (!is.null(dep$package)) dir <- system.file(dir, package = dep$package)
  if (!nzchar(dir) || !dir.exists(dir))
    stop(sprintf("its dependency '%s' cannot be read: its directory %s is missing",
                 dep$name, dep$src$file))
  dir
}

## The files of one kind (`script`, `stylesheet`) of a dependency, checked
## readable, as data URIs inside their tags.
inline_files <- function(dep, dir, kind) {
  entries <- dep[[kind]]
  if (!length(entries)) return(character())
  files <- vapply(entries, function(e) if (is.list(e)) e$src else e, "")
  out <- character()
  for (f in files) {
    path <- file.path(dir, f)
    if (!file.exists(path) || file.access(path, 4L) != 0L)
      stop(sprintf("its dependency '%s' cannot be read: %s is missing or unreadable",
                   dep$name, path))
    if (kind == "script")
      out <- c(out, sprintf("<script title=\"%s\" src=\"%s\"></script>",
                            gsub("\"", "", dep$name, fixed = TRUE),
                            base64enc::dataURI(file = path, mime = "application/javascript")))
    else
      out <- c(out, sprintf("<link href=\"%s\" rel=\"stylesheet\" />",
                            base64enc::dataURI(file = path, mime = "text/css;charset=utf-8")))
  }
  out
}

## Tags (or a widget) as one self-contained page: repr's embed_tags, with
## dependencies resolved from their package and their own head lines kept,
## every script and stylesheet a data URI, so it renders offline and in a
## sandboxed iframe. No pandoc, no network.
embed_html <- function(x) {
  if (inherits(x, "htmlwidget")) x <- htmltools::as.tags(x, standalone = TRUE)
  obj <- htmltools::renderTags(x)
  deps <- htmltools::resolveDependencies(obj$dependencies)
  head <- unlist(lapply(deps, function(dep) {
    dir <- dependency_dir(dep)
    c(if (length(dep$head)) dep$head, inline_files(dep, dir, "stylesheet"),
      inline_files(dep, dir, "script"))
  }))
  sprintf(repr:::HTML_SKELETON, paste(c(head, obj$head), collapse = "\n"), obj$html)
}

## HTML of a value that renders only as HTML, self-contained. `NULL` for
## a knitr table that is not HTML (it prints as text).
value_html <- function(x) {
  if (inherits(x, "knitr_kable")) {
    if (!identical(attr(x, "format"), "html")) return(NULL)
    return(paste(as.character(x), collapse = "\n"))
  }
  for (p in c("repr", "htmltools", "base64enc"))
    if (!requireNamespace(p, quietly = TRUE))
      stop(sprintf("the R package %s is not installed (Debian: r-cran-%s)", p, p))
  if (inherits(x, "flextable")) x <- flextable::htmltools_value(x)
  if (inherits(x, c("htmlwidget", "shiny.tag", "shiny.tag.list", "html")))
    return(embed_html(x))
  html <- repr::repr_html(x)
  if (is.null(html)) stop("repr has no HTML for it")
  paste(html, collapse = "\n")
}

## A visible value of an HTML-only class: its bundle (HTML under the cap,
## and a text/plain line saying what it is), or `unsupported` with the
## reason when no HTML can be made.
show_html <- function(x) {
  o <- state$display
  cls <- class(x)[[1L]]
  html <- tryCatch(suppressWarnings(suppressMessages(value_html(x))),
                   error = function(e) structure(conditionMessage(e), class = "rvisor_failed"))
  if (is.null(html)) {
    print_in_global(x)
    return(invisible())
  }
  if (inherits(html, "rvisor_failed")) {
    .Call(emit, "unsupported", clip(sprintf(
      "rvisor: a value of class '%s' renders only as HTML, and its HTML could not be made: %s",
      cls, html), caps$message), NULL, NULL)
    return(invisible())
  }
  n <- nchar(html, type = "bytes")
  what <- if (inherits(x, "htmlwidget")) sprintf("an htmlwidget (%s)", cls) else
    sprintf("a value of class '%s'", cls)
  if (n > o$html_max) {
    emit_display(
      c("text/plain" = sprintf(paste0(
        "[%s: its HTML is %.0f bytes, over display.html_max_bytes (%.0f), so it was left out; ",
        "raise the cap or show less]"), what, n, o$html_max)),
      meta_json("html", cls, c("text/html" = sprintf("left out: %.0f bytes, over display.html_max_bytes (%.0f)",
                                                      n, o$html_max))))
    return(invisible())
  }
  emit_display(c("text/html" = html,
                 "text/plain" = sprintf("[%s, shown as HTML: %.0f bytes]", what, n)),
               meta_json("html", cls))
}

## print() as the prompt would call it: dispatched from the global
## environment, so the user's methods are found.
print_in_global <- function(x) {
  eval(quote(print(x)), list(x = x), globalenv())
  invisible()
}

## rvisor_display(x): shows `x` now, as a display when it is a table or
## an HTML value (the text too, as print() would), else prints it;
## `always` (a display id was given): any other value is a display too, its
## text/plain what print() shows (not also on the console).
display_now <- function(x, always = FALSE) {
  if (!isTRUE(state$display$enabled)) return(print_in_global(x))
  if (inherits(x, c(html_classes, "knitr_kable"))) return(show_html(x))
  if (is.data.frame(x) || is.matrix(x)) {
    text <- paste0(paste(utils::capture.output(print_in_global(x)), collapse = "\n"), "\n")
    cat(text)
    return(show_table(x, clip(text, 65536L)))
  }
  if (!always) return(print_in_global(x))
  text <- paste0(paste(utils::capture.output(print_in_global(x)), collapse = "\n"), "\n")
  emit_display(c("text/plain" = clip(text, 65536L)), meta_json("value", class(x)[[1L]]))
}
