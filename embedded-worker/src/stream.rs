//! Events of the running call, sent to the supervisor while it runs
//! (`RunRequest.stream`), in batches.
//!
//! Everything here runs on the R thread: the console hook and the
//! driver's reports add events; R's event hook (`R_ProcessEvents`, which
//! R calls whenever it checks for interrupts, and every few milliseconds
//! in `Sys.sleep()`), `flush.console()` and the end of the call send what
//! waits. Full mode sends the first event after a quiet spell at once and
//! then at most one batch per `FLUSH_INTERVAL_MS` (or per `FLUSH_BYTES` of
//! text), never a frame per write; tail mode sends only console text, and
//! only for calls that run longer than `TAIL_INTERVAL_MS`. With streaming
//! off (the default) every entry point returns after one check.

use crate::link;
use rvisor_protocol::{
    Display, EventKind, FromWorker, Segment, StreamMode, FLUSH_BYTES, FLUSH_INTERVAL_MS,
    STREAM_DISPLAY_BYTES, TAIL_BYTES, TAIL_INTERVAL_MS,
};
use std::cell::RefCell;
use std::time::{Duration, Instant};

struct State {
    mode: StreamMode,
    execution_id: String,
    pending: Vec<EventKind>,
    /// Bytes of text in `pending`.
    bytes: usize,
    started: Instant,
    last_flush: Option<Instant>,
    /// The link failed: nothing more is sent for this call (the result
    /// frame reports the failure, if it can).
    broken: bool,
    /// Plot pages reported so far (indices below this).
    plots: usize,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State {
        mode: StreamMode::Off,
        execution_id: String::new(),
        pending: Vec::new(),
        bytes: 0,
        started: Instant::now(),
        last_flush: None,
        broken: false,
        plots: 0,
    });
}

/// How long R may wait between two calls of its event hook in
/// `Sys.sleep()` (R's `R_wait_usec`) for `mode`, in microseconds.
pub fn wait_usec(mode: StreamMode) -> i32 {
    match mode {
        StreamMode::Off => 0,
        StreamMode::Tail => (TAIL_INTERVAL_MS * 1000) as i32,
        StreamMode::Full => (FLUSH_INTERVAL_MS * 1000) as i32,
    }
}

/// Starts the events of call `execution_id`.
pub fn begin(mode: StreamMode, execution_id: &str) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.mode = mode;
        s.execution_id.clear();
        s.execution_id.push_str(execution_id);
        s.pending.clear();
        s.bytes = 0;
        s.started = Instant::now();
        s.last_flush = None;
        s.broken = false;
        s.plots = 0;
    });
}

/// Sends what waits and ends the call's events (before its result frame).
pub fn end() {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.mode != StreamMode::Off {
            // Tail mode: a short call sends nothing at its end either.
            if s.mode == StreamMode::Full {
                flush(&mut s);
            }
            s.mode = StreamMode::Off;
            s.pending.clear();
            s.bytes = 0;
        }
    });
}

/// Console text as the capture kept it.
pub fn text(stderr: bool, text: &str) {
    if text.is_empty() {
        return;
    }
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.mode == StreamMode::Off || s.broken {
            return;
        }
        if s.mode == StreamMode::Full && !stderr {
            if let Some(p) = progress_bar(text) {
                push_text(&mut s, stderr, text);
                s.pending.push(p);
                maybe_flush(&mut s);
                return;
            }
        }
        push_text(&mut s, stderr, text);
        maybe_flush(&mut s);
    });
}

/// A typed segment of the capture (warning, message, error).
pub fn segment(seg: &Segment) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.mode == StreamMode::Off || s.broken {
            return;
        }
        if s.mode == StreamMode::Tail {
            if let Segment::Message { text } = seg {
                push_text(&mut s, true, text);
                maybe_flush(&mut s);
            }
            return;
        }
        if matches!(seg, Segment::Display { .. }) {
            // Sent with its bundle by `display`, as it is made.
            return;
        }
        if let Some(e) = EventKind::from_segment(seg) {
            s.bytes += e.console_text().map_or(0, str::len);
            s.pending.push(e);
            maybe_flush(&mut s);
        }
    });
}

/// A display as it is made (a value's, `rvisor_display()`'s; a plot
/// page's at the end of the call, before the result), by its index in the
/// final result's displays: sent with its bundle.
pub fn display(index: usize, d: &Display) {
    let full = STATE.with(|s| {
        let s = s.borrow();
        s.mode == StreamMode::Full && !s.broken
    });
    if !full {
        return; // no copy of the bundle for a call nobody streams
    }
    full_event(EventKind::Display {
        index,
        display: streamed(d.clone()),
    });
}

/// The bundle a display event carries: the display, unless its JSON is
/// over [`STREAM_DISPLAY_BYTES`] (then the result alone has it).
fn streamed(d: Display) -> Option<Box<Display>> {
    /// Counts the bytes written to it.
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            if self.0 > STREAM_DISPLAY_BYTES {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    if d.size_bytes() > STREAM_DISPLAY_BYTES {
        return None;
    }
    // JSON escaping can make text up to six times longer: measured only
    // when that could pass the bound.
    if d.size_bytes().saturating_mul(6) > STREAM_DISPLAY_BYTES
        && serde_json::to_writer(&mut Count(0), &d).is_err()
    {
        return None;
    }
    Some(Box::new(d))
}

/// The bytes of an event that count toward a batch: its console text, a
/// display's bundle.
fn event_bytes(e: &EventKind) -> usize {
    match e {
        EventKind::Display {
            display: Some(d), ..
        } => d.size_bytes(),
        e => e.console_text().map_or(0, str::len),
    }
}

/// A finished plot page, by its index in the final result's plots.
pub fn plot(index: usize) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.plots = s.plots.max(index + 1);
    });
    full_event(EventKind::Plot { index });
}

/// The call kept `n` plot pages: the ones not reported yet (the last page,
/// finished when the call ended) are reported now, before the result.
pub fn plots_kept(n: usize) {
    let from = STATE.with(|s| s.borrow().plots);
    for index in from..n {
        plot(index);
    }
}

/// Progress from `rvisor_progress()`.
pub fn progress(value: f64, total: Option<f64>, message: Option<String>) {
    full_event(EventKind::Progress {
        value,
        total,
        message,
    });
}

/// R checks for events (the event hook): sends a batch that has waited
/// long enough.
pub fn poll() {
    // A page finished in a loop is read here, before the loop ends.
    crate::due::run();
    STATE.with(|s| {
        let Ok(mut s) = s.try_borrow_mut() else {
            return;
        };
        if s.mode != StreamMode::Off && !s.pending.is_empty() {
            maybe_flush(&mut s);
        }
    });
}

/// `flush.console()`: the code asks for its output to be shown now.
pub fn flush_console() {
    STATE.with(|s| {
        let Ok(mut s) = s.try_borrow_mut() else {
            return;
        };
        if s.mode == StreamMode::Full {
            flush(&mut s);
        } else if s.mode == StreamMode::Tail {
            maybe_flush(&mut s);
        }
    });
}

fn full_event(e: EventKind) {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.mode != StreamMode::Full || s.broken {
            return;
        }
        // Progress replaces progress not yet sent: a fast loop reports at
        // most one value per batch.
        if let (EventKind::Progress { .. }, Some(EventKind::Progress { .. })) =
            (&e, s.pending.last())
        {
            s.pending.pop();
        }
        s.bytes += event_bytes(&e);
        s.pending.push(e);
        maybe_flush(&mut s);
    });
}

fn push_text(s: &mut State, stderr: bool, text: &str) {
    s.bytes += text.len();
    match (stderr, s.pending.last_mut()) {
        (false, Some(EventKind::Stdout { text: t }))
        | (true, Some(EventKind::Stderr { text: t })) => t.push_str(text),
        (false, _) => s.pending.push(EventKind::Stdout { text: text.into() }),
        (true, _) => s.pending.push(EventKind::Stderr { text: text.into() }),
    }
    if s.mode == StreamMode::Tail && s.bytes > 2 * TAIL_BYTES {
        keep_tail(s);
    }
}

/// Tail mode: only the last `TAIL_BYTES` of text wait.
fn keep_tail(s: &mut State) {
    let mut text = String::new();
    for e in s.pending.drain(..) {
        if let Some(t) = e.console_text() {
            text.push_str(t);
        }
    }
    let mut from = text.len().saturating_sub(TAIL_BYTES);
    while !text.is_char_boundary(from) {
        from += 1;
    }
    let text = text[from..].to_string();
    s.bytes = text.len();
    s.pending.push(EventKind::Stdout { text });
}

fn maybe_flush(s: &mut State) {
    let now = Instant::now();
    let due = match s.mode {
        StreamMode::Off => false,
        StreamMode::Full => {
            s.bytes >= FLUSH_BYTES
                || s.last_flush.is_none_or(|t| {
                    now.duration_since(t) >= Duration::from_millis(FLUSH_INTERVAL_MS)
                })
        }
        StreamMode::Tail => {
            let every = Duration::from_millis(TAIL_INTERVAL_MS);
            now.duration_since(s.started) >= every
                && s.last_flush.is_none_or(|t| now.duration_since(t) >= every)
        }
    };
    if due {
        flush(s);
    }
}

fn flush(s: &mut State) {
    if s.pending.is_empty() || s.broken {
        return;
    }
    if s.mode == StreamMode::Tail {
        keep_tail(s);
    }
    let events = split_large(std::mem::take(&mut s.pending));
    s.bytes = 0;
    s.last_flush = Some(Instant::now());
    // A frame of at most ~FLUSH_BYTES of text (a single large write is cut
    // into pieces) and at most one display over FLUSH_BYTES (at most
    // STREAM_DISPLAY_BYTES of JSON), below the supervisor's frame limit
    // even when JSON escaping multiplies the text.
    let mut batch = Vec::new();
    let mut bytes = 0;
    for e in events {
        bytes += event_bytes(&e);
        batch.push(e);
        if bytes >= FLUSH_BYTES {
            send(s, std::mem::take(&mut batch));
            bytes = 0;
        }
    }
    if !batch.is_empty() {
        send(s, batch);
    }
}

fn send(s: &mut State, events: Vec<EventKind>) {
    if s.broken {
        return;
    }
    let msg = FromWorker::Events {
        execution_id: s.execution_id.clone(),
        events,
    };
    if link::send(&msg).is_err() {
        s.broken = true;
    }
}

/// Cuts text events over `FLUSH_BYTES` into pieces (at character
/// boundaries).
fn split_large(events: Vec<EventKind>) -> Vec<EventKind> {
    if events
        .iter()
        .all(|e| e.console_text().is_none_or(|t| t.len() <= FLUSH_BYTES))
    {
        return events;
    }
    let mut out = Vec::new();
    for e in events {
        let (stderr, text) = match &e {
            EventKind::Stdout { text } if text.len() > FLUSH_BYTES => (false, text.as_str()),
            EventKind::Stderr { text } if text.len() > FLUSH_BYTES => (true, text.as_str()),
            _ => {
                out.push(e);
                continue;
            }
        };
        let mut rest = text;
        while !rest.is_empty() {
            let mut at = rest.len().min(FLUSH_BYTES);
            while !rest.is_char_boundary(at) {
                at -= 1;
            }
            let (piece, tail) = rest.split_at(at);
            let text = piece.to_string();
            out.push(if stderr {
                EventKind::Stderr { text }
            } else {
                EventKind::Stdout { text }
            });
            rest = tail;
        }
    }
    out
}

/// A `txtProgressBar(style = 3)` redraw (`"\r  |=====     |  40%"`) as a
/// progress event.
fn progress_bar(text: &str) -> Option<EventKind> {
    let at = text.rfind('\r')?;
    let line = text[at + 1..].trim_end();
    let pct = line.strip_suffix('%')?;
    let bar = line.rfind('|')?;
    if !line[..bar].trim_start().starts_with('|') {
        return None;
    }
    let value: f64 = pct[bar + 1..].trim().parse().ok()?;
    Some(EventKind::Progress {
        value,
        total: Some(100.0),
        message: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_progress_bar_lines() {
        assert_eq!(
            progress_bar("\r  |==========          |  40%"),
            Some(EventKind::Progress {
                value: 40.0,
                total: Some(100.0),
                message: None
            })
        );
        assert_eq!(
            progress_bar("\r  |                    | 100%\n").map(|e| e.name()),
            Some("progress")
        );
        assert_eq!(progress_bar("40%"), None);
        assert_eq!(progress_bar("\r  |=====     |"), None);
        assert_eq!(progress_bar("\rloading 40%"), None);
    }

    #[test]
    fn large_text_is_cut_at_char_boundaries() {
        let big = "é".repeat(FLUSH_BYTES); // 2 bytes each
        let out = split_large(vec![EventKind::Stdout { text: big.clone() }]);
        assert_eq!(out.len(), 2);
        let joined: String = out.iter().filter_map(|e| e.console_text()).collect();
        assert_eq!(joined, big);
        assert!(out
            .iter()
            .all(|e| e.console_text().unwrap().len() <= FLUSH_BYTES));
    }

    #[test]
    fn a_display_too_large_for_an_event_frame_goes_without_its_bundle() {
        let of = |text: String| {
            let mut d = Display::default();
            d.data.insert("text/html".into(), text.into());
            d
        };
        assert!(streamed(of("<table></table>".into())).is_some());
        assert!(streamed(of("x".repeat(STREAM_DISPLAY_BYTES + 1))).is_none());
        // Small in memory, over the bound once JSON escapes it.
        let control = "\u{1}".repeat(STREAM_DISPLAY_BYTES / 4);
        assert!(streamed(of(control)).is_none());
    }

    #[test]
    fn off_keeps_nothing() {
        begin(StreamMode::Off, "x");
        text(false, "a\n");
        STATE.with(|s| assert!(s.borrow().pending.is_empty()));
    }

    #[test]
    fn tail_keeps_only_the_end() {
        begin(StreamMode::Tail, "x");
        // Not due for a long time: nothing is sent (there is no link here).
        STATE.with(|s| s.borrow_mut().started = Instant::now() + Duration::from_secs(3600));
        for i in 0..2000 {
            text(false, &format!("line {i}\n"));
        }
        STATE.with(|s| {
            let s = s.borrow();
            let kept: usize = s
                .pending
                .iter()
                .filter_map(|e| e.console_text())
                .map(str::len)
                .sum();
            assert!(kept <= 2 * TAIL_BYTES, "{kept}");
            let last = s.pending.last().and_then(|e| e.console_text()).unwrap();
            assert!(last.ends_with("line 1999\n"));
        });
        end();
    }
}
