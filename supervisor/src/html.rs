//! Rendering a RunResult as one self-contained HTML fragment.
//!
//! [`render`] turns one call's [`RunResult`] into a `<div>` that carries its
//! own scoped `<style>` (every class is prefixed `rvisor-`), with no external
//! CSS, scripts or fonts, so it can be pasted into any page: a chat UI, a
//! notebook-like report, an e-mail. [`render_document`] wraps several
//! fragments in a minimal HTML5 document.
//!
//! All text taken from the result (code, output, messages, JSON, ids) is
//! HTML-escaped, so output such as `<script>` comes out inert. Plots are
//! inlined as `data:image/png;base64,...` URLs; a plot whose mime type is not
//! `image/png` or whose data is not plain base64 is left out (an SVG page
//! is shown from its display, as a `data:image/svg+xml` image, which runs
//! no script). Displays with HTML (tables, widgets) are shown in sandboxed
//! iframes (`srcdoc`, escaped): a table's with no permission at all, a
//! widget's with scripts only, never the page's origin, so their HTML
//! cannot reach the page around them.

use std::fmt::Write as _;

use base64::Engine;
use rvisor_protocol::{Display, ErrorInfo, Plot, RunResult, Segment};

/// The scoped style sheet put inside every fragment.
const STYLE: &str = "\
.rvisor-result{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,'Liberation Mono',monospace;\
font-size:13px;line-height:1.4;color:#1f2328;background:#fff;border:1px solid #d0d7de;\
border-radius:6px;padding:8px 10px;margin:8px 0;max-width:100%;box-sizing:border-box;overflow:hidden}\
.rvisor-result pre{margin:0;padding:0;white-space:pre-wrap;word-break:break-word;font:inherit;background:none}\
.rvisor-result .rvisor-header,.rvisor-result .rvisor-footer{font-size:12px;color:#59636e;margin:2px 0}\
.rvisor-result .rvisor-outcome{display:inline-block;padding:0 6px;border-radius:4px;\
background:#eef1f4;color:#1f2328;font-weight:600}\
.rvisor-outcome-complete .rvisor-outcome{background:#dafbe1;color:#116329}\
.rvisor-outcome-error .rvisor-outcome,.rvisor-outcome-parse_error .rvisor-outcome,\
.rvisor-outcome-worker_failed .rvisor-outcome,.rvisor-outcome-startup_failed .rvisor-outcome\
{background:#ffebe9;color:#a40e26}\
.rvisor-result .rvisor-notice{display:block;color:#9a6700}\
.rvisor-result .rvisor-code{background:#f6f8fa;border-left:3px solid #8c959f;padding:4px 8px;margin:6px 0}\
.rvisor-result .rvisor-output{margin:6px 0}\
.rvisor-result .rvisor-stdout{color:#1f2328}\
.rvisor-result .rvisor-stderr,.rvisor-result .rvisor-message{color:#6e7781}\
.rvisor-result .rvisor-warning{color:#9a6700}\
.rvisor-result .rvisor-error{color:#cf222e;margin:6px 0}\
.rvisor-result .rvisor-traceback{margin:2px 0 0 0;padding-left:2em;color:#a40e26;font-size:12px}\
.rvisor-result .rvisor-plot{margin:6px 0}\
.rvisor-result .rvisor-plot img{max-width:100%;height:auto;display:block}\
.rvisor-result .rvisor-json{background:#f6f8fa;padding:4px 8px;margin:6px 0}\
.rvisor-result .rvisor-display{margin:6px 0}\
.rvisor-result .rvisor-display iframe{width:100%;border:1px solid #d0d7de;border-radius:4px;background:#fff}\
.rvisor-result .rvisor-display img{max-width:100%;height:auto;display:block}";

/// Renders one call's result as a self-contained HTML fragment.
///
/// The fragment is a `<div class="rvisor-result rvisor-outcome-{outcome}">`
/// holding a scoped `<style>`, a header (outcome, duration and notices such
/// as truncation, a fresh session, a timeout or a parse error's position),
/// the code, the output segments in the order they happened (stdout, stderr,
/// messages, warnings, errors with their traceback, plots inline) and, when
/// the call returned a structured result, its JSON, pretty-printed.
///
/// Every piece of text is HTML-escaped. A plot segment whose index is out of
/// range, or whose plot is not a base64 `image/png`, is skipped.
pub fn render(result: &RunResult) -> String {
    let mut out = String::with_capacity(STYLE.len() + 512 + result.console.len());
    let outcome = result.outcome.as_str();
    let _ = write!(
        out,
        "<div class=\"rvisor-result rvisor-outcome-{}\" data-execution-id=\"{}\">",
        escape(outcome),
        escape(&result.execution_id)
    );
    out.push_str("<style>");
    out.push_str(STYLE);
    out.push_str("</style>");

    render_header(&mut out, result);

    if !result.code.is_empty() {
        let _ = write!(
            out,
            "<pre class=\"rvisor-code\">{}</pre>",
            escape(&result.code)
        );
    }

    render_segments(&mut out, result);
    render_error_summary(&mut out, result);
    render_footer(&mut out, result);

    out.push_str("</div>");
    out
}

/// Wraps the fragments of several results in a minimal, complete HTML5
/// document titled `title` (escaped), with `<meta charset="utf-8">`.
pub fn render_document(results: &[RunResult], title: &str) -> String {
    let title = escape(title);
    let mut out = String::new();
    out.push_str("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n");
    out.push_str("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n");
    let _ = writeln!(out, "<title>{title}</title>");
    out.push_str("</head>\n<body>\n");
    let _ = writeln!(out, "<h1>{title}</h1>");
    for result in results {
        out.push_str(&render(result));
        out.push('\n');
    }
    out.push_str("</body>\n</html>\n");
    out
}

/// The line above the code: outcome, duration, and notices.
fn render_header(out: &mut String, result: &RunResult) {
    let _ = write!(
        out,
        "<div class=\"rvisor-header\"><span class=\"rvisor-outcome\">{}</span> \
         <span class=\"rvisor-duration\">{} ms</span>",
        escape(result.outcome.as_str()),
        escape(&format!("{:.2}", result.duration_ms))
    );
    if result.session.fresh || result.session.reset_reason.is_some() {
        let text = match &result.session.reset_reason {
            Some(reason) => format!("fresh R session (previous one was replaced: {reason})"),
            None => "fresh R session".to_string(),
        };
        notice(out, "rvisor-session", &text);
    }
    if result.truncated {
        notice(
            out,
            "rvisor-truncated",
            "output was truncated at the output limit",
        );
    }
    if let Some(error) = &result.error {
        if error.timed_out {
            notice(out, "rvisor-timed-out", "the call reached its deadline");
        }
        if let Some(position) = parse_position(error) {
            notice(out, "rvisor-parse-position", &position);
        }
    }
    out.push_str("</div>");
}

/// "parse error at line L, column C" when the error has a position.
fn parse_position(error: &ErrorInfo) -> Option<String> {
    match (error.line, error.column) {
        (Some(line), Some(column)) => Some(format!("parse error at line {line}, column {column}")),
        (Some(line), None) => Some(format!("parse error at line {line}")),
        (None, Some(column)) => Some(format!("parse error at column {column}")),
        (None, None) => None,
    }
}

/// One notice line in the header, `text` escaped.
fn notice(out: &mut String, class: &str, text: &str) {
    let _ = write!(
        out,
        "<span class=\"rvisor-notice {class}\">{}</span>",
        escape(text)
    );
}

/// The output segments, in order. Consecutive text segments share one
/// `<pre class="rvisor-output">` so the console reads as it was written;
/// errors and plots are blocks of their own.
fn render_segments(out: &mut String, result: &RunResult) {
    let mut in_pre = false;
    for segment in &result.segments {
        match segment {
            Segment::Plot { index } => {
                let Some(plot) = result.plots.get(*index) else {
                    continue;
                };
                let Some(img) = plot_img(plot, *index) else {
                    continue;
                };
                close_pre(out, &mut in_pre);
                let _ = write!(out, "<div class=\"rvisor-plot\">{img}</div>");
            }
            Segment::Display { index } => {
                let Some(d) = result.displays.get(*index) else {
                    continue;
                };
                if let Some(html) = display_html(d, result, *index) {
                    close_pre(out, &mut in_pre);
                    let _ = write!(out, "<div class=\"rvisor-display\">{html}</div>");
                }
            }
            Segment::Error { traceback, .. } => {
                close_pre(out, &mut in_pre);
                let text = segment.console_text().unwrap_or_default();
                let _ = write!(
                    out,
                    "<div class=\"rvisor-error\"><pre>{}</pre>",
                    escape(text.trim_end_matches('\n'))
                );
                render_traceback(out, traceback);
                out.push_str("</div>");
            }
            other => {
                let class = match other {
                    Segment::Stdout { .. } => "rvisor-stdout",
                    Segment::Message { .. } => "rvisor-message",
                    Segment::Warning { .. } => "rvisor-warning",
                    _ => "rvisor-stderr",
                };
                let Some(text) = other.console_text() else {
                    continue;
                };
                if text.is_empty() {
                    continue;
                }
                if !in_pre {
                    out.push_str("<pre class=\"rvisor-output\">");
                    in_pre = true;
                }
                let _ = write!(out, "<span class=\"{class}\">{}</span>", escape(&text));
            }
        }
    }
    close_pre(out, &mut in_pre);
}

/// Ends the open `<pre class="rvisor-output">`, if any.
fn close_pre(out: &mut String, in_pre: &mut bool) {
    if *in_pre {
        out.push_str("</pre>");
        *in_pre = false;
    }
}

/// The traceback as an ordered list, innermost call first.
fn render_traceback(out: &mut String, traceback: &[String]) {
    if traceback.is_empty() {
        return;
    }
    out.push_str("<ol class=\"rvisor-traceback\">");
    for call in traceback {
        let _ = write!(out, "<li><code>{}</code></li>", escape(call));
    }
    out.push_str("</ol>");
}

/// The `<img>` of a plot, or `None` when it is not a base64 PNG.
fn plot_img(plot: &Plot, index: usize) -> Option<String> {
    if !plot.mime.trim().eq_ignore_ascii_case("image/png") || !is_base64(&plot.data_base64) {
        return None;
    }
    Some(format!(
        "<img src=\"data:image/png;base64,{}\" width=\"{}\" height=\"{}\" alt=\"plot {}\" \
         style=\"max-width:100%;height:auto\">",
        plot.data_base64,
        plot.width,
        plot.height,
        index.saturating_add(1)
    ))
}

/// How a display shows inline: HTML in a sandboxed iframe (a table's with
/// no permissions, other HTML with scripts only); an SVG page not shown as
/// a PNG plot as an image; `None` for what the console or a plot segment
/// already shows (a table's text, a PNG page) or an HTML value's text line
/// when it has no HTML (shown as text).
fn display_html(d: &Display, result: &RunResult, index: usize) -> Option<String> {
    let kind = d
        .metadata
        .get("rvisor")
        .and_then(|m| m.get("kind"))
        .and_then(|k| k.as_str())
        .unwrap_or("");
    if let Some(html) = d.data.get("text/html").and_then(|h| h.as_str()) {
        let (sandbox, height) = if kind == "table" {
            let rows = html.matches("<tr").count().min(25);
            ("", 48 + 26 * rows)
        } else {
            ("allow-scripts", 420)
        };
        return Some(format!(
            "<iframe sandbox=\"{sandbox}\" srcdoc=\"{}\" style=\"height:{height}px\" \
             title=\"display {}\" loading=\"lazy\"></iframe>",
            escape(html),
            index.saturating_add(1)
        ));
    }
    if kind == "plot" {
        let page = d.metadata["rvisor"]["plot"].as_u64().unwrap_or(u64::MAX) as usize;
        let png_shown = result
            .plots
            .get(page)
            .is_some_and(|p| p.mime.eq_ignore_ascii_case("image/png"));
        let svg = d.data.get("image/svg+xml").and_then(|s| s.as_str())?;
        if png_shown {
            return None;
        }
        return Some(format!(
            "<img src=\"data:image/svg+xml;base64,{}\" alt=\"plot {}\">",
            base64::engine::general_purpose::STANDARD.encode(svg),
            page.saturating_add(1)
        ));
    }
    if kind == "html" {
        let text = d.data.get("text/plain").and_then(|t| t.as_str())?;
        return Some(format!("<pre>{}</pre>", escape(text)));
    }
    None
}

/// True when `s` is non-empty and only holds characters of the standard
/// base64 alphabet (with padding), so it is safe inside a URL attribute.
fn is_base64(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/' || b == b'=')
}

/// Shows the call's error when no segment did (e.g. a timeout or a worker
/// failure whose message is not in the console).
fn render_error_summary(out: &mut String, result: &RunResult) {
    let Some(error) = &result.error else {
        return;
    };
    if error.message.is_empty()
        || result
            .segments
            .iter()
            .any(|s| matches!(s, Segment::Error { .. }))
        || result.console.contains(error.message.as_str())
    {
        return;
    }
    let text = match &error.call {
        Some(call) => format!("Error in {call} : {}", error.message),
        None => format!("Error: {}", error.message),
    };
    let _ = write!(
        out,
        "<div class=\"rvisor-error rvisor-error-summary\"><pre>{}</pre>",
        escape(&text)
    );
    render_traceback(out, &error.traceback);
    out.push_str("</div>");
}

/// The structured result, if any, and the R version.
fn render_footer(out: &mut String, result: &RunResult) {
    if let Some(value) = result.result.as_ref().filter(|v| !v.is_null()) {
        let json = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
        let _ = write!(out, "<pre class=\"rvisor-json\">{}</pre>", escape(&json));
    }
    if !result.r_version.is_empty() {
        let _ = write!(
            out,
            "<div class=\"rvisor-footer\">R {}</div>",
            escape(&result.r_version)
        );
    }
}

/// Escapes `&`, `<`, `>`, `"` and `'` for use in HTML text and attributes.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rvisor_protocol::Outcome;

    fn png(data: &str) -> Plot {
        Plot {
            mime: "image/png".into(),
            width: 640,
            height: 480,
            data_base64: data.into(),
        }
    }

    fn pos(haystack: &str, needle: &str) -> usize {
        haystack
            .find(needle)
            .unwrap_or_else(|| panic!("{needle:?} not found in {haystack}"))
    }

    #[test]
    fn displays_show_in_sandboxed_iframes_and_svg_pages_as_images() {
        let mut r = RunResult::empty("e".into(), "x".into());
        let mut table = Display::default();
        table.data.insert(
            "text/html".into(),
            "<table><tr><td>1</td></tr></table>".into(),
        );
        table
            .metadata
            .insert("rvisor".into(), serde_json::json!({"kind": "table"}));
        let mut widget = Display::default();
        widget
            .data
            .insert("text/html".into(), "<script>alert(\"x\")</script>".into());
        widget
            .metadata
            .insert("rvisor".into(), serde_json::json!({"kind": "html"}));
        let mut svg = Display::default();
        svg.data.insert("image/svg+xml".into(), "<svg/>".into());
        svg.metadata.insert(
            "rvisor".into(),
            serde_json::json!({"kind": "plot", "plot": 0}),
        );
        r.plots.push(Plot {
            mime: "image/svg+xml".into(),
            width: 10,
            height: 10,
            data_base64: "PHN2Zy8+".into(),
        });
        r.displays = vec![table, widget, svg];
        for index in 0..3 {
            r.segments.push(Segment::Display { index });
        }
        let html = render(&r);
        assert!(html.contains("<iframe sandbox=\"\" srcdoc=\"&lt;table&gt;"));
        assert!(html.contains(
            "<iframe sandbox=\"allow-scripts\" srcdoc=\"&lt;script&gt;alert(&quot;x&quot;)"
        ));
        assert!(!html.contains("<script>"), "no live script in the page");
        assert!(html.contains("src=\"data:image/svg+xml;base64,PHN2Zy8+\""));
    }

    #[test]
    fn escape_covers_all_five() {
        assert_eq!(
            escape(r#"<a href="x">&'"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }

    #[test]
    fn script_is_escaped_in_code_stdout_and_error() {
        let mut r = RunResult::empty("e1".into(), "cat('<script>alert(1)</script>')".into());
        r.outcome = Outcome::Error;
        r.success = false;
        r.push_segment(Segment::Stdout {
            text: "<script>out()</script>\n".into(),
        });
        r.push_segment(Segment::Error {
            message: "<script>err()</script>".into(),
            call: Some("f(\"<b>\")".into()),
            traceback: vec!["g('<i>')".into()],
        });
        let html = render(&r);
        assert!(!html.contains("<script"), "{html}");
        assert!(!html.contains("<b>") && !html.contains("<i>"), "{html}");
        assert!(html.contains("cat(&#39;&lt;script&gt;alert(1)&lt;/script&gt;&#39;)"));
        assert!(html.contains("&lt;script&gt;out()&lt;/script&gt;"));
        assert!(
            html.contains("Error in f(&quot;&lt;b&gt;&quot;) : &lt;script&gt;err()&lt;/script&gt;")
        );
        assert!(html.contains("<li><code>g(&#39;&lt;i&gt;&#39;)</code></li>"));
    }

    #[test]
    fn segments_keep_their_order() {
        let mut r = RunResult::empty("e2".into(), "x".into());
        r.outcome = Outcome::Error;
        r.push_segment(Segment::Stdout {
            text: "first line\n".into(),
        });
        r.push_segment(Segment::Plot { index: 0 });
        r.push_segment(Segment::Error {
            message: "boom".into(),
            call: None,
            traceback: Vec::new(),
        });
        r.plots.push(png("QUJD"));
        let html = render(&r);
        let stdout = pos(&html, "first line");
        let plot = pos(&html, "data:image/png;base64,QUJD");
        let error = pos(&html, "Error: boom");
        assert!(stdout < plot && plot < error, "{html}");
    }

    #[test]
    fn text_segments_are_styled_apart() {
        let mut r = RunResult::empty("e3".into(), "x".into());
        r.push_segment(Segment::Stdout {
            text: "out\n".into(),
        });
        r.push_segment(Segment::Stderr {
            text: "err\n".into(),
        });
        r.push_segment(Segment::Message {
            text: "msg\n".into(),
        });
        r.push_segment(Segment::Warning {
            message: "NaNs produced".into(),
            call: Some("log(-1)".into()),
        });
        let html = render(&r);
        assert!(html.contains("<span class=\"rvisor-stdout\">out\n</span>"));
        assert!(html.contains("<span class=\"rvisor-stderr\">err\n</span>"));
        assert!(html.contains("<span class=\"rvisor-message\">msg\n</span>"));
        assert!(html.contains(
            "<span class=\"rvisor-warning\">Warning message:\nIn log(-1) : NaNs produced\n</span>"
        ));
    }

    #[test]
    fn plot_is_an_inline_data_url() {
        let mut r = RunResult::empty("e4".into(), "plot(1)".into());
        r.plots.push(png("iVBORw0KGgo="));
        r.push_segment(Segment::Plot { index: 0 });
        let html = render(&r);
        assert!(html.contains(
            "<img src=\"data:image/png;base64,iVBORw0KGgo=\" width=\"640\" height=\"480\" \
             alt=\"plot 1\" style=\"max-width:100%;height:auto\">"
        ));
    }

    #[test]
    fn non_png_mime_is_skipped() {
        let mut r = RunResult::empty("e5".into(), "x".into());
        let mut plot = png("PHN2Zz4=");
        plot.mime = "image/svg+xml".into();
        r.plots.push(plot);
        let mut evil = png("QUJD");
        evil.mime = "text/html;base64,PHNjcmlwdD4=\" onerror=\"x".into();
        r.plots.push(evil);
        r.push_segment(Segment::Plot { index: 0 });
        r.push_segment(Segment::Plot { index: 1 });
        let html = render(&r);
        assert!(!html.contains("<img"), "{html}");
        assert!(!html.contains("svg+xml") && !html.contains("text/html"));
    }

    #[test]
    fn non_base64_data_is_skipped() {
        let mut r = RunResult::empty("e6".into(), "x".into());
        r.plots.push(png("QUJD\" onerror=\"alert(1)"));
        r.push_segment(Segment::Plot { index: 0 });
        let html = render(&r);
        assert!(
            !html.contains("<img") && !html.contains("onerror"),
            "{html}"
        );
    }

    #[test]
    fn out_of_range_plot_index_is_skipped() {
        let mut r = RunResult::empty("e7".into(), "x".into());
        r.plots.push(png("QUJD"));
        r.push_segment(Segment::Plot { index: 5 });
        r.push_segment(Segment::Stdout {
            text: "still here\n".into(),
        });
        let html = render(&r);
        assert!(!html.contains("<img"), "{html}");
        assert!(html.contains("still here"));
    }

    #[test]
    fn outcome_class_and_header() {
        let mut r = RunResult::empty("e8".into(), "1 +".into());
        r.outcome = Outcome::ParseError;
        r.success = false;
        r.duration_ms = 1.5;
        r.truncated = true;
        r.session.fresh = true;
        r.session.reset_reason = Some("<timeout>".into());
        r.error = Some(ErrorInfo {
            message: "unexpected end of input".into(),
            line: Some(2),
            column: Some(0),
            timed_out: true,
            ..ErrorInfo::default()
        });
        let html = render(&r);
        assert!(html.starts_with("<div class=\"rvisor-result rvisor-outcome-parse_error\""));
        assert!(html.ends_with("</div>"));
        assert!(html.contains("<style>") && !html.contains("<html") && !html.contains("<body"));
        assert!(html.contains("1.50 ms"));
        assert!(html.contains("rvisor-truncated"));
        assert!(html.contains("replaced: &lt;timeout&gt;"));
        assert!(html.contains("rvisor-timed-out"));
        assert!(html.contains("line 2, column 0"));
        // The error is shown once even though no segment carried it.
        assert!(html.contains("Error: unexpected end of input"));
    }

    #[test]
    fn complete_result_has_complete_class() {
        let r = RunResult::empty("e9".into(), "1".into());
        let html = render(&r);
        assert!(html.contains("rvisor-outcome-complete"));
        assert!(!html.contains("class=\"rvisor-notice"));
        assert!(!html.contains("class=\"rvisor-json"));
    }

    #[test]
    fn result_json_is_pretty_and_escaped() {
        let mut r = RunResult::empty("e10".into(), "x".into());
        r.result = Some(serde_json::json!({"html": "<b>&</b>"}));
        let html = render(&r);
        assert!(html.contains(
            "<pre class=\"rvisor-json\">{\n  &quot;html&quot;: &quot;&lt;b&gt;&amp;&lt;/b&gt;&quot;\n}</pre>"
        ));
        r.result = Some(serde_json::Value::Null);
        assert!(!render(&r).contains("class=\"rvisor-json"));
    }

    #[test]
    fn document_wraps_fragments_and_escapes_title() {
        let a = RunResult::empty("a".into(), "1".into());
        let b = RunResult::empty("b".into(), "2".into());
        let doc = render_document(&[a, b], "<script>t</script> & co");
        assert!(doc.starts_with("<!DOCTYPE html>"));
        assert!(doc.contains("<meta charset=\"utf-8\">"));
        assert!(doc.contains("<title>&lt;script&gt;t&lt;/script&gt; &amp; co</title>"));
        assert!(!doc.contains("<script"));
        assert_eq!(doc.matches("class=\"rvisor-result ").count(), 2);
        assert!(doc.trim_end().ends_with("</html>"));
    }
}
