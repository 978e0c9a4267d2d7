## rvisor's driver, validation: a part of driver.R loaded on first use
## (driver.R, "Parts loaded on first use"), evaluated in the driver's
## environment. Only assignments at top level.
##
## Validation runs nothing: it walks the parse data of `script`: forbidden functions (called, referred to,
## `pkg::fn`, or named by a literal in do.call/match.fun/get/get0/
## getExportedValue), nesting depth, and built-in style rules. Returns JSON.

validate <- function(script, forbidden, max_depth, style_mode = "auto") {
  problems <- list()
  warns <- list()
  style <- list()
  add <- function(lst, ...) c(lst, list(list(...)))
  exprs <- tryCatch(parse(text = script, keep.source = TRUE, encoding = "UTF-8"),
                    error = function(e) e)
  if (inherits(exprs, "error")) {
    p <- parse_error_at(conditionMessage(exprs), script)
    problems <- add(problems, kind = "syntax", message = p$message,
                    line = p$line, column = p$column)
    return(to_json(list(problems = problems, warnings = warns, style = style), unbox = TRUE))
  }
  pd <- utils::getParseData(exprs, includeText = NA)  # terminals only: 50x faster
  if (!is.null(pd) && nrow(pd)) {
    # Everything below is vectorised: a validate-fix loop calls this often.
    tok <- pd$token
    txt <- pd$text
    by_id <- match(pd$parent, pd$id)
    # Nesting depth: the number of expr ancestors of each token, computed
    # one tree level per round for all tokens at once.
    is_expr <- tok == "expr"
    depth <- integer(nrow(pd))
    cur <- by_id
    while (any(live <- !is.na(cur))) {
      depth[live] <- depth[live] + is_expr[cur[live]]
      cur[live] <- by_id[cur[live]]
    }
    deepest <- which.max(depth)
    if (length(deepest) && depth[deepest] > max_depth)
      problems <- add(problems, kind = "nesting",
                      message = sprintf("code is nested %d levels deep; the limit is %d: split it into functions or steps",
                                        depth[deepest], max_depth),
                      line = pd$line1[deepest], column = pd$col1[deepest])
    sym <- tok %in% c("SYMBOL_FUNCTION_CALL", "SYMBOL")
    for (i in which(sym & txt %in% forbidden))
      problems <- add(problems, kind = "forbidden",
                      message = sprintf("%s '%s' is not allowed here",
                                        if (tok[i] == "SYMBOL") "use of" else "call to", txt[i]),
                      line = pd$line1[i], column = pd$col1[i])
    name_args <- c(do.call = 1L, match.fun = 1L, get = 1L, get0 = 1L, getExportedValue = 2L)
    unquote <- function(s) gsub("^[\"'`]|[\"'`]$", "", s)
    children <- function(id) { k <- which(pd$parent == id); k[order(pd$line1[k], pd$col1[k])] }
    for (i in which(tok == "SYMBOL_FUNCTION_CALL" & txt %in% names(name_args))) {
      nm <- txt[i]
      kids <- children(pd$parent[by_id[i]])
      args <- kids[tok[kids] == "expr"][-1L]  # drop the function itself
      pos <- name_args[[nm]]
      if (length(args) < pos) next
      a <- args[[pos]]
      leaf <- children(pd$id[a])
      if (length(leaf) == 1L && tok[leaf] == "STR_CONST") {
        target <- unquote(txt[leaf])
        if (target %in% forbidden)
          problems <- add(problems, kind = "forbidden",
                          message = sprintf("call to '%s' through %s() is not allowed here", target, nm),
                          line = pd$line1[leaf], column = pd$col1[leaf])
      } else {
        warns <- add(warns, kind = "forbidden",
                     message = sprintf("%s() with a computed name cannot be checked; use the function directly", nm),
                     line = pd$line1[a], column = pd$col1[a])
      }
    }
    if (style_mode != "none") for (i in which(tok == "SYMBOL" & txt %in% c("T", "F")))
      style <- add(style, rule = "T_and_F_symbol",
                   message = sprintf("use %s instead of %s", if (txt[i] == "T") "TRUE" else "FALSE", txt[i]),
                   line = pd$line1[i], column = pd$col1[i])
    if (style_mode != "none") for (i in which(tok == "EQ_ASSIGN"))
      style <- add(style, rule = "assignment", message = "use <- for assignment, not =",
                   line = pd$line1[i], column = pd$col1[i])
  }
  lines <- if (style_mode == "none") character() else strsplit(script, "\n", fixed = TRUE)[[1L]]
  for (k in seq_along(lines)) {
    w <- nchar(lines[[k]], type = "width")
    if (w > 80L)
      style <- add(style, rule = "line_length", message = sprintf("line is %d characters; keep lines to 80", w),
                   line = k, column = 81L)
    if (grepl("[ \t]+$", lines[[k]]))
      style <- add(style, rule = "trailing_whitespace", message = "trailing whitespace",
                   line = k, column = nchar(sub("[ \t]+$", "", lines[[k]])) + 1L)
  }
  engine <- if (style_mode == "none") "none" else "builtin"
  # lintr's default linters when lintr is installed, else the built-in set.
  if (style_mode == "auto" && requireNamespace("lintr", quietly = TRUE)) {
    lints <- tryCatch(as.data.frame(lintr::lint(text = script, parse_settings = FALSE)),
                      error = function(e) NULL)
    if (!is.null(lints)) {
      engine <- paste("lintr", as.character(utils::packageVersion("lintr")))
      style <- lapply(seq_len(nrow(lints)), function(k)
        list(rule = sub("_linter$", "", lints$linter[[k]]), message = lints$message[[k]],
             line = as.integer(lints$line_number[[k]]), column = as.integer(lints$column_number[[k]])))
    }
  }
  to_json(list(problems = problems, warnings = warns, style = style, style_engine = engine), unbox = TRUE)
}
