//! `complete`, `inspect` and `is_complete`: answered by R itself (its
//! completion engine, `str()` and help, its parser), as small calls of the
//! kernel's own session so they see the user's variables.

use crate::Shell;
use rvisor_server::service::SessionRun;
use serde_json::{json, Value};

/// Most completions sent back.
const MAX_MATCHES: usize = 1000;
/// Most bytes of `inspect` text sent back.
const MAX_INSPECT_BYTES: usize = 64 * 1024;

/// `s` as an R string literal; `None` if R cannot hold it (a NUL).
pub(crate) fn r_string(s: &str) -> Option<String> {
    if s.contains('\0') {
        return None;
    }
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push('"');
    Some(out)
}

/// Runs `code` (which ends with `rvisor_result(...)`) in the session and
/// gives the result block.
fn ask(k: &Shell, code: String) -> Result<Value, String> {
    let call = SessionRun {
        code,
        timeout_seconds: None,
        plot_width: None,
        plot_height: None,
        display: None,
    };
    let r = k
        .service
        .session_run(&k.tenant, &k.session_id, &call)
        .map_err(|e| e.message)?
        .wait();
    match (r.success, r.result) {
        (true, Some(v)) => Ok(v),
        _ => Err(r
            .error
            .map(|e| e.message)
            .unwrap_or_else(|| format!("R answered {}", r.outcome))),
    }
}

/// The longest prefix of `s` of at most `max` bytes ending on a character.
fn cut(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The text of `code` as characters, and `cursor` (code points, as the
/// protocol counts from 5.2) kept inside it.
fn chars_at(code: &str, cursor: &Value) -> (Vec<char>, usize) {
    let chars: Vec<char> = code.chars().collect();
    let at = cursor
        .as_u64()
        .map(|c| (c as usize).min(chars.len()))
        .unwrap_or(chars.len());
    (chars, at)
}

/// `complete_request`: R's completions of the token before the cursor.
pub(crate) fn complete(k: &Shell, content: &Value) -> Value {
    let code = content["code"].as_str().unwrap_or("");
    let (chars, at) = chars_at(code, &content["cursor_pos"]);
    let line_start = chars[..at]
        .iter()
        .rposition(|c| *c == '\n')
        .map_or(0, |i| i + 1);
    let line: String = chars[line_start..at].iter().collect();
    let empty = json!({"status": "ok", "matches": [], "cursor_start": at, "cursor_end": at, "metadata": {}});
    let Some(lit) = r_string(&line) else {
        return empty;
    };
    let r = format!(
        "local({{\n  utils:::.assignLinebuffer({lit})\n  utils:::.assignEnd(nchar({lit}))\n  \
         utils:::.guessTokenFromLine()\n  utils:::.completeToken()\n  \
         rvisor_result(list(matches = as.list(utils:::.retrieveCompletions()), \
         start = utils:::.CompletionEnv[[\"start\"]]))\n}})"
    );
    match ask(k, r) {
        Ok(v) => {
            let matches: Vec<Value> = v["matches"]
                .as_array()
                .map(|m| m.iter().take(MAX_MATCHES).cloned().collect())
                .unwrap_or_default();
            let start = v["start"]
                .as_u64()
                .map_or(at, |s| (line_start + s as usize).min(at));
            json!({"status": "ok", "matches": matches, "cursor_start": start,
                   "cursor_end": at, "metadata": {}})
        }
        Err(_) => empty,
    }
}

/// The R name under (or just before) the cursor: letters, digits, `.`,
/// `_`, and `$`, `@`, `::` between them.
fn token_at(chars: &[char], at: usize) -> String {
    let is_name = |c: char| c.is_alphanumeric() || matches!(c, '.' | '_' | '$' | '@' | ':');
    let mut start = at;
    while start > 0 && is_name(chars[start - 1]) {
        start -= 1;
    }
    let mut end = at;
    while end < chars.len() && is_name(chars[end]) {
        end += 1;
    }
    chars[start..end]
        .iter()
        .collect::<String>()
        .trim_matches(|c| c == ':' || c == '$' || c == '@')
        .to_string()
}

/// `inspect_request`: `str()` of the object named at the cursor and its
/// help page as text.
pub(crate) fn inspect(k: &Shell, content: &Value) -> Value {
    let code = content["code"].as_str().unwrap_or("");
    let (chars, at) = chars_at(code, &content["cursor_pos"]);
    let token = token_at(&chars, at);
    let not_found = json!({"status": "ok", "found": false, "data": {}, "metadata": {}});
    let Some(lit) = r_string(&token).filter(|_| !token.is_empty()) else {
        return not_found;
    };
    let r = format!(
        "local({{\n  nm <- {lit}\n  out <- character()\n  \
         obj <- tryCatch(list(eval(str2lang(nm), globalenv())), error = function(e) NULL)\n  \
         if (length(obj)) out <- utils::capture.output(utils::str(obj[[1]]))\n  \
         base <- sub(\".*(::|\\\\$|@)\", \"\", nm)\n  \
         h <- tryCatch(utils::help((base)), error = function(e) character())\n  \
         if (length(h)) out <- c(out, if (length(out)) \"\", utils::capture.output(\
         tools::Rd2txt(utils:::.getHelpFile(h[[1]]), options = list(underline_titles = FALSE))))\n  \
         rvisor_result(list(found = length(out) > 0, text = paste(out, collapse = \"\\n\")))\n}})"
    );
    match ask(k, r) {
        Ok(v) if v["found"] == true => {
            let text = v["text"].as_str().unwrap_or("");
            let text = cut(text, MAX_INSPECT_BYTES);
            json!({"status": "ok", "found": true, "data": {"text/plain": text}, "metadata": {}})
        }
        _ => not_found,
    }
}

/// `is_complete_request`: R's parser says whether the code is whole.
pub(crate) fn is_complete(k: &Shell, content: &Value) -> Value {
    let code = content["code"].as_str().unwrap_or("");
    let Some(lit) = r_string(code) else {
        return json!({"status": "invalid"});
    };
    let r = format!(
        "local({{\n  s <- tryCatch({{ parse(text = {lit}, keep.source = FALSE); \"complete\" }},\n    \
         error = function(e) if (grepl(\"unexpected (end of input|INCOMPLETE_STRING)\", \
         conditionMessage(e))) \"incomplete\" else \"invalid\")\n  \
         rvisor_result(list(status = s))\n}})"
    );
    match ask(k, r) {
        Ok(v) => match v["status"].as_str() {
            Some("incomplete") => json!({"status": "incomplete", "indent": ""}),
            Some(s) => json!({"status": s}),
            None => json!({"status": "unknown"}),
        },
        Err(_) => json!({"status": "unknown"}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r_strings_escape_what_r_reads_specially() {
        assert_eq!(r_string("a\"b\\c\nd").unwrap(), r#""a\"b\\c\nd""#);
        assert_eq!(r_string("\u{1}é").unwrap(), "\"\\x01é\"");
        assert_eq!(r_string("a\0b"), None);
    }

    #[test]
    fn the_token_at_the_cursor() {
        let c: Vec<char> = "x <- stats::rnorm(df$col".chars().collect();
        assert_eq!(token_at(&c, 15), "stats::rnorm");
        assert_eq!(token_at(&c, c.len()), "df$col");
        assert_eq!(token_at(&c, 0), "x");
    }
}
