//! A call's output on the terminal (`run`, `repl`): its events as they
//! come, then what the stream did not carry, without the structured
//! result block.

use anyhow::{bail, Result};
use rvisor::{RunResult, Segment};
use std::io::Write;

/// Prints a call's events as they come (stdout to stdout, the rest to
/// stderr) and returns its result and the console text printed.
/// `first`, if given, is an event already read from `events`.
pub(crate) fn follow_events(
    first: Option<rvisor::CallEvent>,
    events: rvisor::Events,
) -> Result<(RunResult, String)> {
    let mut printed = String::new();
    let mut live = BlockFilter::default();
    for e in first.into_iter().chain(events) {
        let seg = match e.kind {
            rvisor::EventKind::Result { result } => {
                let mut out = crate::out::stdout();
                out.write_all(live.finish().as_bytes())?;
                out.flush()?;
                return Ok((*result, printed));
            }
            rvisor::EventKind::Stdout { text } => {
                let mut out = crate::out::stdout();
                out.write_all(live.feed(&text).as_bytes())?;
                out.flush()?;
                printed.push_str(&text);
                continue;
            }
            rvisor::EventKind::Stderr { text } => Segment::Stderr { text },
            rvisor::EventKind::Message { text } => Segment::Message { text },
            rvisor::EventKind::Warning { message, call } => Segment::Warning { message, call },
            rvisor::EventKind::Error {
                message,
                call,
                traceback,
            } => Segment::Error {
                message,
                call,
                traceback,
            },
            _ => continue,
        };
        if let Some(t) = seg.console_text() {
            let mut err = std::io::stderr().lock();
            err.write_all(t.as_bytes())?;
            err.flush()?;
            printed.push_str(&t);
        }
    }
    bail!("the call ended without a result")
}

/// Live standard output without the structured result block, which the
/// result removes from its console: lines from a start marker to its end
/// marker are not shown. A partial line that may still become a marker is
/// held until its line ends; any other text is shown as it comes (a
/// progress line without a newline too). An unterminated block is shown
/// after the call by [`print_rest`], as the result keeps it.
#[derive(Debug, Default)]
struct BlockFilter {
    inside: bool,
    pending: String,
}

const BLOCK_STARTS: [&str; 2] = ["<<<RVISOR_RESULT_START>>>", "<<<JUBE_RESULT_START>>>"];
const BLOCK_ENDS: [&str; 2] = ["<<<RVISOR_RESULT_END>>>", "<<<JUBE_RESULT_END>>>"];

impl BlockFilter {
    /// What of `text` to show now.
    fn feed(&mut self, text: &str) -> String {
        self.pending.push_str(text);
        let mut show = String::new();
        while let Some(nl) = self.pending.find('\n') {
            let line: String = self.pending.drain(..=nl).collect();
            let l = line.trim_end();
            if self.inside {
                self.inside = !BLOCK_ENDS.contains(&l);
            } else if BLOCK_STARTS.contains(&l) {
                self.inside = true;
            } else {
                show.push_str(&line);
            }
        }
        // The rest has no newline yet: show it unless it may be a marker.
        if !self.inside && !BLOCK_STARTS.iter().any(|m| m.starts_with(&self.pending)) {
            show.push_str(&std::mem::take(&mut self.pending));
        }
        show
    }

    /// At the call's end: what is held and not in a block.
    fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        if self.inside || BLOCK_STARTS.contains(&rest.trim_end()) {
            String::new()
        } else {
            rest
        }
    }
}

/// After [`follow_events`]: the plots, and the console text the stream
/// did not carry (a notice the supervisor put first, raw output of child
/// processes and C code after), each part where its segment goes: raw
/// standard output (a program's that `system()` ran) to stdout, as under
/// Rscript, the rest to stderr.
pub(crate) fn print_rest(
    r: &RunResult,
    printed: &str,
    mut on_plot: impl FnMut(&rvisor::Plot, &mut dyn Write) -> Result<()>,
) -> Result<()> {
    let parts: Vec<(bool, String)> = r
        .segments
        .iter()
        .filter_map(|s| Some((matches!(s, Segment::Stdout { .. }), s.console_text()?)))
        .collect();
    let all: String = parts.iter().map(|(_, t)| t.as_str()).collect();
    let streamed = without_result_block(printed);
    let mut out = crate::out::stdout();
    let mut err = std::io::stderr().lock();
    if let Some(at) = all.find(streamed.as_str()) {
        let shown = at..at + streamed.len();
        let mut start = 0;
        for (to_stdout, text) in &parts {
            let end = start + text.len();
            // This segment's bytes before and after the streamed text.
            for range in [start..end.min(shown.start), start.max(shown.end)..end] {
                if range.start >= range.end {
                    continue;
                }
                let bytes = &all.as_bytes()[range];
                if *to_stdout {
                    err.flush()?;
                    out.write_all(bytes)?;
                } else {
                    out.flush()?;
                    err.write_all(bytes)?;
                }
            }
            start = end;
        }
    }
    out.flush()?;
    for p in &r.plots {
        on_plot(p, &mut err)?;
    }
    Ok(())
}

/// `text` without the structured result block (the result keeps it apart).
fn without_result_block(text: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in text.split_inclusive('\n') {
        let l = line.trim_end();
        if l == "<<<RVISOR_RESULT_START>>>" || l == "<<<JUBE_RESULT_START>>>" {
            inside = true;
        } else if inside && (l == "<<<RVISOR_RESULT_END>>>" || l == "<<<JUBE_RESULT_END>>>") {
            inside = false;
        } else if !inside {
            out.push_str(line);
        }
    }
    out
}

/// Prints a result's segments in order: stdout text to stdout, everything
/// else (stderr, messages, warnings, errors) to stderr; `on_plot` gets each
/// plot segment's plot, with stdout flushed first.
pub(crate) fn print_console(
    r: &RunResult,
    mut on_plot: impl FnMut(&rvisor::Plot, &mut dyn Write) -> Result<()>,
) -> Result<()> {
    let mut out = crate::out::stdout();
    let mut err = std::io::stderr().lock();
    for seg in &r.segments {
        match seg {
            Segment::Stdout { text } => {
                err.flush()?;
                out.write_all(text.as_bytes())?;
            }
            Segment::Plot { index } => {
                if let Some(p) = r.plots.get(*index) {
                    out.flush()?;
                    on_plot(p, &mut err)?;
                }
            }
            other => {
                out.flush()?;
                if let Some(t) = other.console_text() {
                    err.write_all(t.as_bytes())?;
                }
            }
        }
    }
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod block_filter_tests {
    use super::BlockFilter;

    fn shown(chunks: &[&str]) -> String {
        let mut f = BlockFilter::default();
        let mut out: String = chunks.iter().map(|c| f.feed(c)).collect();
        out.push_str(&f.finish());
        out
    }

    #[test]
    fn a_block_is_left_out_however_the_chunks_split_it() {
        let text =
            "before\n<<<RVISOR_RESULT_START>>>\n{\"a\": 1}\n<<<RVISOR_RESULT_END>>>\nafter\n";
        assert_eq!(shown(&[text]), "before\nafter\n");
        let bytes: Vec<String> = text.chars().map(String::from).collect();
        let chunks: Vec<&str> = bytes.iter().map(String::as_str).collect();
        assert_eq!(shown(&chunks), "before\nafter\n");
        assert_eq!(
            shown(&[
                "x <<<RVISOR_RESULT_START>>>\n",
                "<<<JUBE_RESULT_START>>>\n1\n<<<JUBE_RESULT_END>>>\n"
            ]),
            "x <<<RVISOR_RESULT_START>>>\n"
        );
    }

    #[test]
    fn other_text_is_shown_at_once_and_an_open_block_is_held() {
        let mut f = BlockFilter::default();
        assert_eq!(f.feed("step 1"), "step 1");
        assert_eq!(f.feed("\n<<<"), "\n");
        assert_eq!(f.feed("x\n"), "<<<x\n");
        assert_eq!(f.feed("<<<RVISOR_RESULT_START>>>\nhalf"), "");
        assert_eq!(f.finish(), "");
    }
}
