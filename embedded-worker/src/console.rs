//! Capture of everything R writes during a call, in order, with a byte cap.
//!
//! R reports console output through `ptr_R_WriteConsoleEx`; the R-side driver
//! reports warnings, messages and errors through `.Call`. Both land here, on
//! the R thread, in one ordered list of segments, so stdout, stderr and
//! conditions keep the order in which they happened. Everything counts
//! against the call's byte cap; what was cut is recorded by field name
//! (`RunResult::truncated_fields`). What is kept is also handed to
//! `stream`, which sends it on while the call runs when the call asked.

use rvisor_protocol::Segment;
use std::cell::RefCell;

/// The output of the call in progress.
#[derive(Debug, Default)]
pub struct Capture {
    /// Segments in order; adjacent text of the same stream is merged.
    pub segments: Vec<Segment>,
    /// Bytes counted against the cap so far.
    pub bytes: u64,
    /// The cap for this call.
    pub cap: u64,
    /// Set once something was cut or dropped (the cap, or a field's own cap).
    pub truncated: bool,
    /// Set once the cap was reached: nothing more is kept.
    full: bool,
    /// Fields cut or dropped at a cap (`console`, `error.message`...), in
    /// the order first seen.
    pub fields: Vec<&'static str>,
}

thread_local! {
    // Only the R thread writes here (R calls the hooks on its own thread).
    static CAPTURE: RefCell<Capture> = RefCell::new(Capture { cap: u64::MAX, ..Capture::default() });
    /// Standard output held apart while a visible value prints (display
    /// option `values`): the text, and whether more came than it keeps.
    static DIVERT: RefCell<Option<(String, bool)>> = const { RefCell::new(None) };
    /// What the last diverted print wrote, once it returned.
    static HELD: RefCell<Option<(String, bool)>> = const { RefCell::new(None) };
}

/// The most text a diverted print keeps: one byte more than a display's
/// `text/plain`, so a cut is seen and noted.
const DIVERT_BYTES: usize = rvisor_protocol::display::TEXT_PLAIN_BYTES + 1;

/// From now on, standard output is held apart (not captured, not
/// streamed) until [`end_divert`]: what a visible value's print writes,
/// for its display.
pub fn begin_divert() {
    DIVERT.with(|d| *d.borrow_mut() = Some((String::new(), false)));
}

/// Ends holding output apart (the print returned): what was held is kept
/// for [`take_held`]. Allocates nothing, so it may run between R calls.
pub fn end_divert() {
    let held = DIVERT.with(|d| d.borrow_mut().take());
    HELD.with(|h| *h.borrow_mut() = held);
}

/// The text the last diverted print wrote (at most [`DIVERT_BYTES`]) and
/// whether it wrote more; `None` when there is none.
pub fn take_held() -> Option<(String, bool)> {
    HELD.with(|h| h.borrow_mut().take())
}

/// Output still held apart (the print did not return: it jumped), taken;
/// `None` when none is.
pub fn abandon_divert() -> Option<(String, bool)> {
    DIVERT.with(|d| d.borrow_mut().take())
}

/// Keeps `bytes` of standard output apart, if output is held; false when
/// it is not.
fn divert(bytes: &[u8]) -> bool {
    DIVERT.with(|d| {
        let mut d = d.borrow_mut();
        let Some((text, more)) = d.as_mut() else {
            return false;
        };
        let room = DIVERT_BYTES.saturating_sub(text.len());
        if bytes.len() > room {
            *more = true;
        }
        let piece = String::from_utf8_lossy(&bytes[..bytes.len().min(room + 4)]);
        let (kept, _) = rvisor_protocol::bounds::cut(&piece, room);
        text.push_str(kept);
        true
    })
}

/// Which stream console text went to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// Starts a new capture with the given cap and returns nothing; the previous
/// capture, if any, is discarded.
pub fn begin(cap: u64) {
    CAPTURE.with(|c| {
        *c.borrow_mut() = Capture {
            cap,
            ..Capture::default()
        }
    });
}

/// Ends the capture in progress and returns it.
pub fn take() -> Capture {
    CAPTURE.with(|c| {
        std::mem::replace(
            &mut *c.borrow_mut(),
            Capture {
                cap: u64::MAX,
                ..Capture::default()
            },
        )
    })
}

/// Appends console text. Text past the cap is dropped (cut at a character
/// boundary) and the capture marked truncated.
pub fn write_text(stream: Stream, bytes: &[u8]) {
    // A plot page finished before this text comes before it.
    crate::due::run();
    if stream == Stream::Stdout && divert(bytes) {
        return;
    }
    CAPTURE.with(|c| {
        let mut c = c.borrow_mut();
        // Only what can fit is decoded (R hands over a 250 MB `cat()` in one
        // piece); a character cut here is cut again by `admit`.
        let room = if c.full {
            0
        } else {
            c.cap.saturating_sub(c.bytes)
        };
        let upto = bytes.len().min(
            usize::try_from(room)
                .unwrap_or(usize::MAX)
                .saturating_add(4),
        );
        let text = String::from_utf8_lossy(&bytes[..upto]);
        let admitted = c.admit(&text);
        if upto < bytes.len() {
            c.full = true;
            c.mark("console");
        }
        let Some(text) = admitted else { return };
        crate::stream::text(stream == Stream::Stderr, &text);
        match (stream, c.segments.last_mut()) {
            (Stream::Stdout, Some(Segment::Stdout { text: t }))
            | (Stream::Stderr, Some(Segment::Stderr { text: t })) => t.push_str(&text),
            (Stream::Stdout, _) => c.segments.push(Segment::Stdout { text }),
            (Stream::Stderr, _) => c.segments.push(Segment::Stderr { text }),
        }
    });
}

/// Appends a typed segment (warning, message, error), counting its console
/// text (and an error's traceback) against the cap. A message that does not
/// fit is cut like console text; a warning or an error that does not fit
/// whole is dropped (the call's `error` is reported apart, within its own
/// caps).
pub fn push(seg: Segment) {
    if matches!(seg, Segment::Error { .. }) {
        if let Some((text, _)) = abandon_divert() {
            // A value's print failed: what it wrote comes before the
            // error, as at R's prompt.
            write_text(Stream::Stdout, text.as_bytes());
        }
    }
    if let Segment::Message { text } = seg {
        CAPTURE.with(|c| {
            let mut c = c.borrow_mut();
            if let Some(text) = c.admit(&text) {
                let seg = Segment::Message { text };
                crate::stream::segment(&seg);
                c.segments.push(seg);
            }
        });
        return;
    }
    let mut len = seg.console_text().map_or(0, |t| t.len() as u64);
    if let Segment::Error { traceback, .. } = &seg {
        len += traceback.iter().map(|t| t.len() as u64 + 1).sum::<u64>();
    }
    CAPTURE.with(|c| {
        let mut c = c.borrow_mut();
        if c.full || c.bytes + len > c.cap {
            c.full = true;
            c.mark("console");
            return;
        }
        c.bytes += len;
        crate::stream::segment(&seg);
        c.segments.push(seg);
    });
}

/// Appends a segment with no console text whose event was sent apart (a
/// plot page read as it finished: its `plot` event went when the driver
/// reported the page).
pub fn push_unstreamed(seg: Segment) {
    CAPTURE.with(|c| c.borrow_mut().segments.push(seg));
}

/// Records that `field` was cut at a cap of its own (or, for `console`
/// and `plots`, at the call's byte cap).
pub fn mark(field: &'static str) {
    CAPTURE.with(|c| c.borrow_mut().mark(field));
}

/// Counts `n` bytes of non-text output (plots) against the cap; returns false
/// (and marks the capture truncated) when they do not fit.
pub fn admit_bytes(n: u64) -> bool {
    CAPTURE.with(|c| {
        let mut c = c.borrow_mut();
        if c.full || c.bytes + n > c.cap {
            c.full = true;
            c.mark("plots");
            false
        } else {
            c.bytes += n;
            true
        }
    })
}

/// Where the capture stands: the number of segments and the length of
/// the last one's text, for [`stdout_since`]. No allocation, no R.
pub fn position() -> (usize, usize) {
    CAPTURE.with(|c| {
        let c = c.borrow();
        let last = match c.segments.last() {
            Some(Segment::Stdout { text }) => text.len(),
            _ => 0,
        };
        (c.segments.len(), last)
    })
}

/// The standard output written since `pos` (a [`position`]), at most `max`
/// bytes (cut at a character boundary): what a `print()` just wrote.
pub fn stdout_since(pos: (usize, usize), max: usize) -> String {
    CAPTURE.with(|c| {
        let c = c.borrow();
        let mut out = String::new();
        let first = pos.0.saturating_sub(1);
        for (i, seg) in c.segments.iter().enumerate().skip(first) {
            if let Segment::Stdout { text } = seg {
                let from = if i + 1 == pos.0 { pos.1 } else { 0 };
                if i + 1 < pos.0 || from > text.len() || !text.is_char_boundary(from) {
                    continue;
                }
                out.push_str(&text[from..]);
                if out.len() >= max {
                    break;
                }
            }
        }
        let keep = rvisor_protocol::bounds::cut(&out, max).0.len();
        out.truncate(keep);
        out
    })
}

/// Counts `n` bytes of a display against the cap; false (and `displays`
/// marked cut) when they do not fit.
pub fn admit_display(n: u64) -> bool {
    CAPTURE.with(|c| {
        let mut c = c.borrow_mut();
        if c.full || c.bytes + n > c.cap {
            c.mark("displays");
            false
        } else {
            c.bytes += n;
            true
        }
    })
}

impl Capture {
    fn mark(&mut self, field: &'static str) {
        self.truncated = true;
        if !self.fields.contains(&field) {
            self.fields.push(field);
        }
    }

    /// Returns the part of `text` that fits under the cap and counts it.
    fn admit(&mut self, text: &str) -> Option<String> {
        if self.full {
            self.mark("console");
            return None;
        }
        let room = self.cap.saturating_sub(self.bytes);
        if (text.len() as u64) <= room {
            self.bytes += text.len() as u64;
            return Some(text.to_string());
        }
        self.mark("console");
        self.full = true;
        let (kept, _) = rvisor_protocol::bounds::cut(text, room as usize);
        self.bytes += kept.len() as u64;
        (!kept.is_empty()).then(|| kept.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_same_stream_and_keeps_order() {
        begin(1000);
        write_text(Stream::Stdout, b"a");
        write_text(Stream::Stdout, b"b\n");
        write_text(Stream::Stderr, b"e\n");
        write_text(Stream::Stdout, b"c\n");
        let c = take();
        assert_eq!(
            c.segments,
            vec![
                Segment::Stdout {
                    text: "ab\n".into()
                },
                Segment::Stderr { text: "e\n".into() },
                Segment::Stdout { text: "c\n".into() },
            ]
        );
        assert_eq!(c.bytes, 7);
        assert!(!c.truncated);
    }

    #[test]
    fn cap_cuts_at_char_boundary_and_drops_the_rest() {
        begin(5);
        write_text(Stream::Stdout, "abcé".as_bytes()); // 5 bytes: fits exactly
        write_text(Stream::Stdout, b"x");
        let c = take();
        assert!(c.truncated);
        assert_eq!(c.fields, vec!["console"]);
        assert_eq!(
            c.segments,
            vec![Segment::Stdout {
                text: "abcé".into()
            }]
        );

        begin(4);
        write_text(Stream::Stdout, "abcé".as_bytes()); // é would straddle the cap
        let c = take();
        assert_eq!(c.segments, vec![Segment::Stdout { text: "abc".into() }]);
        assert!(c.truncated);
    }

    #[test]
    fn messages_are_cut_and_errors_count_their_traceback() {
        begin(10);
        push(Segment::Message {
            text: "0123456789abc\n".into(),
        });
        let c = take();
        assert_eq!(
            c.segments,
            vec![Segment::Message {
                text: "0123456789".into()
            }]
        );
        assert!(c.truncated);

        begin(30);
        push(Segment::Error {
            message: "boom".into(),
            call: None,
            traceback: vec!["x".repeat(40)],
        });
        let c = take();
        assert!(c.segments.is_empty(), "the traceback does not fit");
        assert_eq!(c.fields, vec!["console"]);
    }

    #[test]
    fn diverted_stdout_is_held_apart_and_bounded() {
        begin(1000);
        write_text(Stream::Stdout, b"a\n");
        begin_divert();
        write_text(Stream::Stdout, b"[1] 2\n");
        write_text(Stream::Stderr, b"note\n");
        end_divert();
        assert_eq!(take_held(), Some(("[1] 2\n".to_string(), false)));
        assert_eq!(take_held(), None);
        assert_eq!(abandon_divert(), None);
        write_text(Stream::Stdout, b"b\n");
        begin_divert();
        write_text(Stream::Stdout, &vec![b'x'; DIVERT_BYTES + 10]);
        let (held, more) = abandon_divert().unwrap();
        assert!(more && held.len() == DIVERT_BYTES);
        let c = take();
        assert_eq!(
            c.segments,
            vec![
                Segment::Stdout { text: "a\n".into() },
                Segment::Stderr {
                    text: "note\n".into()
                },
                Segment::Stdout { text: "b\n".into() },
            ]
        );
    }

    #[test]
    fn stdout_since_takes_only_the_new_text() {
        begin(1000);
        write_text(Stream::Stdout, b"before ");
        let pos = position();
        write_text(Stream::Stdout, b"printed\n");
        write_text(Stream::Stderr, b"e\n");
        write_text(Stream::Stdout, b"more\n");
        assert_eq!(stdout_since(pos, 1000), "printed\nmore\n");
        assert_eq!(stdout_since(pos, 3), "pri");
        assert!(admit_display(10));
        assert!(!admit_display(10_000));
        let c = take();
        assert_eq!(c.fields, vec!["displays"]);
    }

    #[test]
    fn invalid_utf8_is_replaced_not_lost() {
        begin(100);
        write_text(Stream::Stdout, b"a\xffb");
        let c = take();
        assert_eq!(
            c.segments,
            vec![Segment::Stdout {
                text: "a\u{fffd}b".into()
            }]
        );
    }
}
