//! A call's events while it runs: the sink the worker's call loop hands
//! them to, the feed that numbers and queues them, and [`Events`], which
//! a host reads them from: a blocking iterator, or without blocking a
//! thread (`poll_next`, `next_event().await`) from any async runtime.
//! The last event of a call is always its result.
//!
//! The queue between the call and its reader is bounded ([`StreamLimits`]):
//! the call never waits for its reader (a slow client must not hold a
//! worker, nor run a call into its timeout), so a reader that falls behind
//! by more than its bound, or than the [`StreamBudget`] it shares with
//! other streams, loses the events in between and is told so, exactly, by
//! one [`EventKind::Lagged`] event in their place. The result is never
//! dropped: it holds everything the dropped events held.

use rvisor_protocol::{CallEvent, EventKind, RunResult, StreamMode};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

type Emit = Arc<dyn Fn(EventKind) + Send + Sync>;

/// Where a running call's events go (called on the thread that runs the
/// call, in order; it must not block for long).
#[derive(Clone)]
pub struct EventSink {
    mode: StreamMode,
    emit: Emit,
}

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSink")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl EventSink {
    /// A sink asking the worker for `mode` events, handing each to `emit`.
    pub fn new(mode: StreamMode, emit: impl Fn(EventKind) + Send + Sync + 'static) -> Self {
        Self {
            mode,
            emit: Arc::new(emit),
        }
    }

    /// Which events the worker is asked for.
    pub fn mode(&self) -> StreamMode {
        self.mode
    }

    pub(crate) fn emit(&self, e: EventKind) {
        (self.emit)(e)
    }
}

/// Bytes of events one stream holds for a reader that has not taken them
/// yet, by default ([`StreamLimits::max_bytes`]): 4 MiB, over a hundred
/// full batches of text (32 KiB each).
pub const DEFAULT_STREAM_BUFFER_BYTES: usize = 4 << 20;

/// The smallest useful [`StreamLimits::max_bytes`]: room for the largest
/// single events (a 32 KiB batch of text, an error with its 50-frame
/// traceback: ~60 KiB) a few times over. A smaller bound drops those
/// events every time.
pub const MIN_STREAM_BUFFER_BYTES: usize = 256 << 10;

/// What a stream may hold whatever its shared budget holds: two full
/// batches of text. A reader that keeps up never needs more, so clients
/// of a tenant that stop reading cannot make the tenant's other streams
/// lag; a budget may thus be passed by this much per open stream.
pub const STREAM_OWN_BYTES: usize = 64 << 10;

/// How many bytes of a call's events may wait for their reader.
///
/// The bytes counted are what the queued events hold in memory (their
/// text and fields, plus a fixed overhead per event); the final result is
/// not counted and never dropped (every call holds its result until it is
/// taken, streamed or not; the output cap bounds it).
#[derive(Debug, Clone)]
pub struct StreamLimits {
    /// Bytes this stream may hold ([`DEFAULT_STREAM_BUFFER_BYTES`];
    /// `usize::MAX`: no bound of its own).
    pub max_bytes: usize,
    /// A budget this stream shares with others (one tenant's streams),
    /// if any: an event is kept only if it fits both, except within the
    /// stream's first [`STREAM_OWN_BYTES`].
    pub shared: Option<StreamBudget>,
}

impl Default for StreamLimits {
    fn default() -> Self {
        Self {
            max_bytes: DEFAULT_STREAM_BUFFER_BYTES,
            shared: None,
        }
    }
}

impl StreamLimits {
    /// No bound: every event is kept until read. For a reader in the same
    /// process that always reads (the CLI printing a call as it runs);
    /// the call's output cap still bounds the text.
    pub fn unbounded() -> Self {
        Self {
            max_bytes: usize::MAX,
            shared: None,
        }
    }
}

/// Bytes of queued events shared by several streams (one tenant's), with
/// their count and the events they dropped: the numbers `/metrics` shows.
/// Cheap to clone (one shared counter).
#[derive(Debug, Clone)]
pub struct StreamBudget(Arc<BudgetState>);

#[derive(Debug)]
struct BudgetState {
    limit: usize,
    held: AtomicUsize,
    streams: AtomicUsize,
    dropped: AtomicU64,
    lagged: AtomicU64,
}

impl StreamBudget {
    /// A budget of `limit` bytes (`usize::MAX`: counted, not bounded). Its
    /// streams hold at most `limit` together, plus [`STREAM_OWN_BYTES`]
    /// each.
    pub fn new(limit: usize) -> Self {
        Self(Arc::new(BudgetState {
            limit,
            held: AtomicUsize::new(0),
            streams: AtomicUsize::new(0),
            dropped: AtomicU64::new(0),
            lagged: AtomicU64::new(0),
        }))
    }

    /// The bound, in bytes.
    pub fn limit(&self) -> usize {
        self.0.limit
    }

    /// Bytes of events its streams hold now, waiting for their readers.
    pub fn held_bytes(&self) -> usize {
        self.0.held.load(Ordering::SeqCst)
    }

    /// Streams open now (their reader not dropped yet).
    pub fn open_streams(&self) -> usize {
        self.0.streams.load(Ordering::SeqCst)
    }

    /// Events its streams dropped for readers that lagged, in all.
    pub fn dropped_events(&self) -> u64 {
        self.0.dropped.load(Ordering::Relaxed)
    }

    /// [`EventKind::Lagged`] notices its streams queued for their
    /// readers, in all.
    pub fn lagged_notices(&self) -> u64 {
        self.0.lagged.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes whether they fit or not (a stream's own share).
    fn force(&self, n: usize) {
        self.0.held.fetch_add(n, Ordering::SeqCst);
    }

    /// Takes `n` bytes if they fit.
    fn take(&self, n: usize) -> bool {
        let limit = self.0.limit;
        self.0
            .held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |h| {
                h.checked_add(n).filter(|t| *t <= limit)
            })
            .is_ok()
    }

    fn give_back(&self, n: usize) {
        self.0.held.fetch_sub(n, Ordering::SeqCst);
    }
}

/// Events not queued for a reader that lagged, not reported yet.
#[derive(Debug)]
struct Gap {
    first_seq: u64,
    last_seq: u64,
    /// Console text they held.
    bytes: u64,
    /// Which bound was full when the first was dropped.
    cause: &'static str,
}

#[derive(Debug, Default)]
struct FeedState {
    /// Events and what each is counted for (its weight).
    queue: VecDeque<(CallEvent, usize)>,
    /// The weights of `queue` together.
    held: usize,
    next_seq: u64,
    done: bool,
    /// Every writer is gone: no result will come.
    closed: bool,
    /// The reader is gone: nothing more is kept.
    reader_gone: bool,
    /// Events dropped since the last one queued.
    gap: Option<Gap>,
    /// The most this stream held at once, its result counted in.
    peak: usize,
    wakers: Vec<Waker>,
}

#[derive(Debug)]
struct Feed {
    execution_id: String,
    limits: StreamLimits,
    m: Mutex<FeedState>,
    cv: Condvar,
}

fn lock(m: &Mutex<FeedState>) -> MutexGuard<'_, FeedState> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a queued event is counted for: what it holds on the heap plus the
/// queue entry itself, so that many tiny events count too.
fn weight(e: &CallEvent) -> usize {
    let fields = match &e.kind {
        EventKind::Stdout { text } | EventKind::Stderr { text } | EventKind::Message { text } => {
            text.len()
        }
        EventKind::Warning { message, call } => {
            message.len() + call.as_ref().map_or(0, String::len)
        }
        EventKind::Error {
            message,
            call,
            traceback,
        } => {
            message.len()
                + call.as_ref().map_or(0, String::len)
                + traceback
                    .iter()
                    .map(|t| t.len() + std::mem::size_of::<String>())
                    .sum::<usize>()
        }
        EventKind::Progress { message, .. } => message.as_ref().map_or(0, String::len),
        EventKind::Lagged { message, .. } => message.len(),
        EventKind::Display {
            display: Some(d), ..
        } => d.size_bytes(),
        _ => 0,
    };
    std::mem::size_of::<(CallEvent, usize)>() + e.execution_id.len() + fields
}

/// Roughly what a result holds on the heap: its texts, plots and displays (not
/// counted against any bound, only for [`Events::peak_bytes`]).
fn result_bytes(r: &RunResult) -> usize {
    let segments: usize = r
        .segments
        .iter()
        .filter_map(|s| s.console_text())
        .map(|t| t.len())
        .sum();
    let plots: usize = r.plots.iter().map(|p| p.data_base64.len()).sum();
    let displays: usize = r.displays.iter().map(|d| d.size_bytes()).sum();
    std::mem::size_of::<RunResult>() + r.code.len() + r.console.len() + segments + plots + displays
}

/// The console text an event holds, in bytes (what [`EventKind::Lagged`]
/// counts).
fn text_bytes(e: &CallEvent) -> u64 {
    match &e.kind {
        EventKind::Lagged { bytes, .. } => *bytes,
        k => k.console_text().map_or(0, str::len) as u64,
    }
}

impl Feed {
    fn release(&self, n: usize) {
        if let Some(b) = &self.limits.shared {
            b.give_back(n);
        }
    }

    /// The notice that takes the place of the events of `gap`.
    fn notice(&self, gap: &Gap) -> CallEvent {
        let events = gap.last_seq - gap.first_seq + 1;
        CallEvent {
            execution_id: self.execution_id.clone(),
            seq: gap.last_seq,
            kind: EventKind::Lagged {
                first_seq: gap.first_seq,
                events,
                bytes: gap.bytes,
                message: format!(
                    "this client read the call's events more slowly than the call wrote them, \
                     and the events waiting for it filled {}: events {} to {} ({events} events, \
                     {} bytes of console text) were dropped. Nothing is lost: the final \
                     result holds all of the call's output (console, segments, plots); read \
                     the stream faster to follow it live",
                    gap.cause, gap.first_seq, gap.last_seq, gap.bytes
                ),
            },
        }
    }

    /// Queues `notice` (weighing `w`) for the reader.
    fn queue_notice(&self, s: &mut FeedState, notice: CallEvent, w: usize) {
        if let Some(b) = &self.limits.shared {
            b.0.lagged.fetch_add(1, Ordering::Relaxed);
        }
        s.held += w;
        s.queue.push_back((notice, w));
    }

    /// Queues `e` unless the reader lags past a bound; then it joins the
    /// gap the next queued event (or the result) reports. A display event
    /// whose bundle does not fit is queued without it (`{kind, index}`,
    /// the bundle in the result's `displays[index]`) rather than dropped:
    /// one large display does not make a reader that keeps up lag.
    fn offer(&self, s: &mut FeedState, mut e: CallEvent) {
        let w = weight(&e);
        if let EventKind::Display { display, .. } = &mut e.kind {
            if display.is_some() && !self.fits(s, w) {
                *display = None;
            }
        }
        let max = self.limits.max_bytes;
        let w = weight(&e);
        // A stream that lagged resumes once its reader has taken half of
        // what waited (one notice per spell, not one per event), with its
        // notice first.
        let notice = match &s.gap {
            None => None,
            Some(_) if s.held > max / 2 => {
                self.drop_event(s, &e, "this stream's buffer");
                return;
            }
            Some(gap) => {
                let n = self.notice(gap);
                let nw = weight(&n);
                Some((n, nw))
            }
        };
        let total = w + notice.as_ref().map_or(0, |(_, nw)| *nw);
        if s.held.saturating_add(total) > max {
            self.drop_event(s, &e, "this stream's buffer");
            return;
        }
        if let Some(b) = &self.limits.shared {
            if s.held + total <= STREAM_OWN_BYTES {
                b.force(total);
            } else if !b.take(total) {
                self.drop_event(s, &e, "the buffer it shares with other streams");
                return;
            }
        }
        if let Some((n, nw)) = notice {
            s.gap = None;
            self.queue_notice(s, n, nw);
        }
        s.held += w;
        s.peak = s.peak.max(s.held);
        s.queue.push_back((e, w));
    }

    /// Whether an event weighing `w` would be queued now, its lag notice
    /// (if one waits) counted in: the checks of [`Self::offer`], taking
    /// nothing.
    fn fits(&self, s: &FeedState, w: usize) -> bool {
        let max = self.limits.max_bytes;
        let notice = match &s.gap {
            None => 0,
            Some(_) if s.held > max / 2 => return false,
            Some(gap) => weight(&self.notice(gap)),
        };
        let total = w + notice;
        if s.held.saturating_add(total) > max {
            return false;
        }
        match &self.limits.shared {
            Some(b) if s.held + total > STREAM_OWN_BYTES => b
                .held_bytes()
                .checked_add(total)
                .is_some_and(|t| t <= b.limit()),
            _ => true,
        }
    }

    /// `e` is not queued: it joins the gap (`cause` is the bound that was
    /// full, said when the gap opens).
    fn drop_event(&self, s: &mut FeedState, e: &CallEvent, cause: &'static str) {
        if let Some(b) = &self.limits.shared {
            b.0.dropped.fetch_add(1, Ordering::Relaxed);
        }
        let bytes = text_bytes(e);
        match &mut s.gap {
            Some(g) => {
                g.last_seq = e.seq;
                g.bytes += bytes;
            }
            None => {
                s.gap = Some(Gap {
                    first_seq: e.seq,
                    last_seq: e.seq,
                    bytes,
                    cause,
                })
            }
        }
    }

    /// The result came while the reader lags: what still waits for it is
    /// in the result too, so it goes into the gap (and its memory is
    /// given back at once) and the reader gets the notice, then the
    /// result.
    fn fold_backlog(&self, s: &mut FeedState) {
        let Some(gap) = s.gap.as_mut() else { return };
        let Some((front, _)) = s.queue.front() else {
            return;
        };
        gap.first_seq = match &front.kind {
            EventKind::Lagged { first_seq, .. } => *first_seq,
            _ => front.seq,
        };
        let (mut dropped, mut notices) = (0, 0);
        for (e, _) in s.queue.drain(..) {
            gap.bytes += text_bytes(&e);
            match e.kind {
                // An earlier notice never read: the new one covers it.
                EventKind::Lagged { .. } => notices += 1,
                _ => dropped += 1,
            }
        }
        if let Some(b) = &self.limits.shared {
            b.0.dropped.fetch_add(dropped, Ordering::Relaxed);
            b.0.lagged.fetch_sub(notices, Ordering::Relaxed);
        }
        self.release(s.held);
        s.held = 0;
    }
}

/// The writing end of a call's events: numbers them (1, 2, ...) and wakes
/// the reader.
#[derive(Debug, Clone)]
pub struct EventFeed {
    feed: Arc<Feed>,
    _writers: Arc<Writers>,
}

/// Ends the reader's wait when the last writer is dropped without a
/// result (a request refused before it ran).
#[derive(Debug)]
struct Writers(Arc<Feed>);

impl Drop for Writers {
    fn drop(&mut self) {
        let wakers = {
            let mut s = lock(&self.0.m);
            s.closed = true;
            std::mem::take(&mut s.wakers)
        };
        self.0.cv.notify_all();
        for w in wakers {
            w.wake();
        }
    }
}

impl EventFeed {
    /// A feed for call `execution_id` and the [`Events`] that reads it,
    /// with the default bound ([`StreamLimits::default`]).
    pub fn new(execution_id: &str) -> (Self, Events) {
        Self::with_limits(execution_id, StreamLimits::default())
    }

    /// [`EventFeed::new`] with the bounds of `limits`.
    pub fn with_limits(execution_id: &str, limits: StreamLimits) -> (Self, Events) {
        if let Some(b) = &limits.shared {
            b.0.streams.fetch_add(1, Ordering::SeqCst);
        }
        let feed = Arc::new(Feed {
            execution_id: execution_id.to_string(),
            limits,
            m: Mutex::new(FeedState {
                next_seq: 1,
                ..FeedState::default()
            }),
            cv: Condvar::new(),
        });
        (
            Self {
                feed: feed.clone(),
                _writers: Arc::new(Writers(feed.clone())),
            },
            Events { feed, done: false },
        )
    }

    /// The call's execution id.
    pub fn execution_id(&self) -> &str {
        &self.feed.execution_id
    }

    /// Queues one event (ignored once the result was queued, or once the
    /// reader is gone). Never waits for the reader: past the bounds the
    /// event is dropped and the reader told ([`EventKind::Lagged`]).
    pub fn push(&self, kind: EventKind) {
        let feed = &self.feed;
        let wakers = {
            let mut s = lock(&feed.m);
            if s.done || s.reader_gone {
                return;
            }
            let seq = s.next_seq;
            s.next_seq += 1;
            let e = CallEvent {
                execution_id: feed.execution_id.clone(),
                seq,
                kind,
            };
            if matches!(e.kind, EventKind::Result { .. }) {
                s.done = true;
                feed.fold_backlog(&mut s);
                if let Some(gap) = s.gap.take() {
                    let n = feed.notice(&gap);
                    feed.queue_notice(&mut s, n, 0);
                }
                // Not counted: every call holds its result until it is
                // taken; the output cap bounds it.
                if let EventKind::Result { result } = &e.kind {
                    s.peak = s.peak.max(s.held + result_bytes(result));
                }
                s.queue.push_back((e, 0));
            } else {
                feed.offer(&mut s, e);
            }
            std::mem::take(&mut s.wakers)
        };
        self.feed.cv.notify_all();
        for w in wakers {
            w.wake();
        }
    }

    /// Queues the final result: the last event.
    pub fn finish(&self, result: &RunResult) {
        self.push(EventKind::Result {
            result: Box::new(result.clone()),
        });
    }

    /// A sink that queues the worker's events here.
    pub fn sink(&self) -> EventSink {
        let me = self.clone();
        EventSink::new(StreamMode::Full, move |e| me.push(e))
    }
}

/// The events of one call, in order, ending with its result
/// ([`EventKind::Result`]). A blocking [`Iterator`]; without blocking,
/// [`Events::poll_next`] or `events.next_event().await`.
///
/// ```
/// # let sup = rvisor::Supervisor::new(Default::default())?;
/// use rvisor::EventKind;
/// let session = sup.session()?;
/// let mut events = session.run_streaming("cat('a\\n'); Sys.sleep(0.1); cat('b\\n')")?.events();
/// let texts: Vec<String> = events
///     .by_ref()
///     .filter_map(|e| match e.kind {
///         EventKind::Stdout { text } => Some(text),
///         _ => None,
///     })
///     .collect();
/// assert_eq!(texts.concat(), "a\nb\n");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Events {
    feed: Arc<Feed>,
    done: bool,
}

impl Events {
    /// The call's execution id.
    pub fn execution_id(&self) -> &str {
        &self.feed.execution_id
    }

    /// The most bytes this stream held at once for its reader, its result
    /// counted in (roughly: texts and plots): after a large one, a host
    /// may want to give freed memory back to the system.
    pub fn peak_bytes(&self) -> usize {
        lock(&self.feed.m).peak
    }

    /// The next queued event; `None` when none is queued. Marks the end
    /// when the writers are gone and nothing is left.
    fn take(&mut self, s: &mut FeedState) -> Option<CallEvent> {
        let Some((e, w)) = s.queue.pop_front() else {
            if s.closed {
                self.done = true;
            }
            return None;
        };
        s.held -= w;
        self.feed.release(w);
        if matches!(e.kind, EventKind::Result { .. }) {
            self.done = true;
        }
        Some(e)
    }

    /// The next event if one is there now; `None` also after the result.
    pub fn try_next(&mut self) -> Option<CallEvent> {
        if self.done {
            return None;
        }
        let feed = self.feed.clone();
        let mut s = lock(&feed.m);
        self.take(&mut s)
    }

    /// The next event, waiting at most `timeout`: `Err(())` when none came
    /// in time, `Ok(None)` after the result.
    #[allow(clippy::result_unit_err)]
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Option<CallEvent>, ()> {
        if self.done {
            return Ok(None);
        }
        let end = Instant::now() + timeout;
        let feed = self.feed.clone();
        let mut s = lock(&feed.m);
        loop {
            if let Some(e) = self.take(&mut s) {
                return Ok(Some(e));
            }
            if self.done {
                return Ok(None);
            }
            let now = Instant::now();
            if now >= end {
                return Err(());
            }
            s = feed
                .cv
                .wait_timeout(s, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The next event without blocking: `Ready(None)` after the result.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<CallEvent>> {
        if self.done {
            return Poll::Ready(None);
        }
        let feed = self.feed.clone();
        let mut s = lock(&feed.m);
        match self.take(&mut s) {
            Some(e) => Poll::Ready(Some(e)),
            None if self.done => Poll::Ready(None),
            None => {
                if !s.wakers.iter().any(|w| w.will_wake(cx.waker())) {
                    s.wakers.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }

    /// A future of the next event (`None` after the result).
    pub fn next_event(&mut self) -> NextEvent<'_> {
        NextEvent { events: self }
    }
}

impl Iterator for Events {
    type Item = CallEvent;

    /// Blocks until the next event; `None` after the result.
    fn next(&mut self) -> Option<CallEvent> {
        if self.done {
            return None;
        }
        let feed = self.feed.clone();
        let mut s = lock(&feed.m);
        loop {
            if let Some(e) = self.take(&mut s) {
                return Some(e);
            }
            if self.done {
                return None;
            }
            s = feed.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Events {
    /// The reader is gone (a client that left): what waited for it is
    /// given back now, and nothing more is kept, even while the call
    /// still runs.
    fn drop(&mut self) {
        let mut s = lock(&self.feed.m);
        s.reader_gone = true;
        s.queue.clear();
        s.gap = None;
        self.feed.release(s.held);
        s.held = 0;
        drop(s);
        if let Some(b) = &self.feed.limits.shared {
            b.0.streams.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// The future [`Events::next_event`] returns.
#[derive(Debug)]
pub struct NextEvent<'a> {
    events: &'a mut Events,
}

impl Future for NextEvent<'_> {
    type Output = Option<CallEvent>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<CallEvent>> {
        self.events.poll_next(cx)
    }
}

/// The last lines a running call printed, for `status`: at most
/// [`TAIL_LINES`] lines and [`TAIL_BYTES`] bytes.
#[derive(Debug, Default)]
pub(crate) struct Tail {
    text: String,
}

/// Lines of output `status` shows of a running call.
pub const TAIL_LINES: usize = 20;
/// Bytes of output `status` shows of a running call.
pub const TAIL_BYTES: usize = 4096;

impl Tail {
    pub(crate) fn push(&mut self, text: &str) {
        self.text.push_str(text);
        if self.text.len() > 2 * TAIL_BYTES {
            self.trim();
        }
    }

    fn trim(&mut self) {
        let mut from = self.text.len().saturating_sub(TAIL_BYTES);
        while !self.text.is_char_boundary(from) {
            from += 1;
        }
        // The last TAIL_LINES lines (a line still being written counts).
        let body = self.text[from..].trim_end_matches('\n');
        if let Some((i, _)) = body.rmatch_indices('\n').nth(TAIL_LINES - 1) {
            from += i + 1;
        }
        self.text.drain(..from);
    }

    pub(crate) fn get(&mut self) -> String {
        self.trim();
        self.text.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feed_numbers_and_ends_with_the_result() {
        let (feed, mut events) = EventFeed::new("e1");
        feed.push(EventKind::Stdout { text: "a".into() });
        feed.finish(&RunResult::empty("e1".into(), "x".into()));
        feed.push(EventKind::Stdout {
            text: "late".into(),
        });
        let all: Vec<CallEvent> = events.by_ref().collect();
        assert_eq!(all.len(), 2);
        assert_eq!((all[0].seq, all[1].seq), (1, 2));
        assert!(matches!(all[1].kind, EventKind::Result { .. }));
        assert_eq!(events.try_next(), None);
    }

    #[test]
    fn reader_ends_when_the_writers_are_gone() {
        let (feed, mut events) = EventFeed::new("e2");
        let writer = feed.clone();
        feed.push(EventKind::Stdout { text: "a".into() });
        drop(feed);
        let t = std::thread::spawn(move || drop(writer));
        assert!(events.next().is_some());
        assert_eq!(events.next(), None, "no result, and no hang");
        t.join().unwrap();
    }

    fn text(n: usize) -> EventKind {
        EventKind::Stdout {
            text: "x".repeat(n),
        }
    }

    /// Every seq of a call's events, 1 to the result's, is there once:
    /// as an event read or inside a notice; the text read plus the
    /// notices' bytes is all the text written. Returns the notices.
    fn check_accounted(read: &[CallEvent], written_text: u64) -> Vec<(u64, u64, u64)> {
        let mut next = 1;
        let mut text = 0;
        let mut notices = Vec::new();
        for e in read {
            match &e.kind {
                EventKind::Lagged {
                    first_seq,
                    events,
                    bytes,
                    ..
                } => {
                    assert_eq!(*first_seq, next, "{read:?}");
                    assert_eq!(e.seq - first_seq + 1, *events);
                    text += bytes;
                    notices.push((*first_seq, e.seq, *bytes));
                }
                k => {
                    assert_eq!(e.seq, next, "{:?}", k.name());
                    text += k.console_text().map_or(0, str::len) as u64;
                }
            }
            next = e.seq + 1;
        }
        assert!(matches!(
            read.last().map(|e| &e.kind),
            Some(EventKind::Result { .. })
        ));
        assert_eq!(text, written_text);
        notices
    }

    #[test]
    fn a_reader_that_does_not_read_holds_at_most_its_bound_and_is_told_what_it_missed() {
        let budget = StreamBudget::new(usize::MAX);
        let limits = StreamLimits {
            max_bytes: 64 * 1024,
            shared: Some(budget.clone()),
        };
        let (feed, mut events) = EventFeed::with_limits("e3", limits);
        for _ in 0..100 {
            feed.push(text(1000));
            assert!(budget.held_bytes() <= 64 * 1024, "{}", budget.held_bytes());
        }
        assert!(budget.held_bytes() > 32 * 1024, "it kept what fitted");
        assert_eq!(budget.open_streams(), 1);
        let first = events.try_next().unwrap();
        assert_eq!(first.seq, 1);
        feed.finish(&RunResult::empty("e3".into(), "x".into()));
        // The result supersedes what still waited: given back at once.
        assert_eq!(budget.held_bytes(), 0);
        let mut read = vec![first];
        read.extend(events.by_ref());
        let notices = check_accounted(&read, 100 * 1000);
        assert_eq!(notices, vec![(2, 100, 99 * 1000)], "one notice for the gap");
        assert_eq!(budget.dropped_events(), 99);
        assert_eq!(budget.lagged_notices(), 1);
        drop(events);
        assert_eq!(budget.open_streams(), 0);
    }

    #[test]
    fn a_slow_reader_gets_every_event_or_a_notice_in_its_place() {
        let limits = StreamLimits {
            max_bytes: 16 * 1024,
            shared: None,
        };
        let (feed, mut events) = EventFeed::with_limits("e4", limits);
        let mut read = Vec::new();
        for i in 0..1000 {
            feed.push(text(100));
            // Reads one event for every three written.
            if i % 3 == 0 {
                read.extend(events.try_next());
            }
        }
        feed.finish(&RunResult::empty("e4".into(), "x".into()));
        read.extend(events.by_ref());
        let notices = check_accounted(&read, 1000 * 100);
        assert!(!notices.is_empty());
        // It resumes after each spell: events after the first gap arrive.
        let after = read
            .iter()
            .skip_while(|e| e.kind.name() != "lagged")
            .filter(|e| e.kind.name() == "stdout")
            .count();
        assert!(after > 0, "{read:?}");
    }

    fn display(bytes: usize) -> EventKind {
        let mut d = rvisor_protocol::Display::default();
        d.data
            .insert("text/html".into(), serde_json::json!("x".repeat(bytes)));
        EventKind::Display {
            index: 0,
            display: Some(Box::new(d)),
        }
    }

    #[test]
    fn a_display_counts_its_bytes_and_one_too_large_comes_without_its_bundle() {
        let limits = StreamLimits {
            max_bytes: 64 * 1024,
            shared: None,
        };
        let (feed, mut events) = EventFeed::with_limits("e9", limits);
        feed.push(display(1000));
        feed.push(display(1 << 20));
        feed.push(text(10));
        feed.finish(&RunResult::empty("e9".into(), "x".into()));
        let read: Vec<CallEvent> = events.by_ref().collect();
        assert!(check_accounted(&read, 10).is_empty(), "no event dropped");
        assert!(weight(&read[0]) > 1000);
        match (&read[0].kind, &read[1].kind) {
            (
                EventKind::Display {
                    display: Some(small),
                    ..
                },
                EventKind::Display { display: None, .. },
            ) => assert_eq!(small.data["text/html"].as_str().unwrap().len(), 1000),
            other => panic!("{other:?}"),
        }
        // A reader that does not read: displays fill the bound like text.
        let limits = StreamLimits {
            max_bytes: 64 * 1024,
            shared: None,
        };
        let (feed, mut events) = EventFeed::with_limits("e10", limits);
        for _ in 0..200 {
            feed.push(display(1000));
        }
        feed.finish(&RunResult::empty("e10".into(), "x".into()));
        let read: Vec<CallEvent> = events.by_ref().collect();
        let with_bundle = read
            .iter()
            .filter(|e| {
                matches!(
                    e.kind,
                    EventKind::Display {
                        display: Some(_),
                        ..
                    }
                )
            })
            .count();
        assert!(with_bundle < 64, "{with_bundle}");
    }

    #[test]
    fn a_reader_that_keeps_up_loses_nothing() {
        let limits = StreamLimits {
            max_bytes: 4 * 1024,
            shared: None,
        };
        let (feed, mut events) = EventFeed::with_limits("e5", limits);
        let mut read = Vec::new();
        for _ in 0..1000 {
            feed.push(text(1000));
            read.extend(events.try_next());
        }
        feed.finish(&RunResult::empty("e5".into(), "x".into()));
        read.extend(events.by_ref());
        assert!(check_accounted(&read, 1000 * 1000).is_empty());
        assert_eq!(read.len(), 1001);
    }

    #[test]
    fn streams_of_one_budget_hold_at_most_its_bound_together() {
        let budget = StreamBudget::new(160 * 1024);
        let limits = StreamLimits {
            max_bytes: 128 * 1024,
            shared: Some(budget.clone()),
        };
        let (a, ra) = EventFeed::with_limits("a", limits.clone());
        let (b, mut rb) = EventFeed::with_limits("b", limits);
        assert_eq!(budget.open_streams(), 2);
        for _ in 0..300 {
            a.push(text(1000));
            b.push(text(1000));
            assert!(budget.held_bytes() <= 160 * 1024 + 2 * STREAM_OWN_BYTES);
        }
        assert!(budget.dropped_events() > 0);
        // Its own share is a stream's whatever the others hold: a reader
        // that keeps up loses nothing.
        let (c, mut rc) = EventFeed::with_limits(
            "c",
            StreamLimits {
                max_bytes: 128 * 1024,
                shared: Some(budget.clone()),
            },
        );
        let mut read = Vec::new();
        for _ in 0..100 {
            c.push(text(1000));
            read.extend(rc.try_next());
        }
        c.finish(&RunResult::empty("c".into(), "x".into()));
        read.extend(rc.by_ref());
        assert!(
            check_accounted(&read, 100 * 1000).is_empty(),
            "nothing lost"
        );
        drop(rc);
        // A reader that leaves gives its share back, and the call's later
        // events are not kept for it.
        drop(ra);
        a.push(text(1000));
        assert_eq!(budget.open_streams(), 1);
        assert!(budget.held_bytes() <= 128 * 1024);
        b.finish(&RunResult::empty("b".into(), "x".into()));
        let read: Vec<CallEvent> = rb.by_ref().collect();
        check_accounted(&read, 300 * 1000);
        assert_eq!(budget.held_bytes(), 0);
        drop(rb);
        assert_eq!(budget.open_streams(), 0);
    }

    #[test]
    fn tail_keeps_the_last_lines() {
        let mut t = Tail::default();
        for i in 0..100 {
            t.push(&format!("line {i}\n"));
        }
        let s = t.get();
        assert_eq!(s.lines().count(), TAIL_LINES);
        assert!(
            s.starts_with("line 80\n") && s.ends_with("line 99\n"),
            "{s}"
        );
        let mut t = Tail::default();
        t.push(&"x".repeat(3 * TAIL_BYTES));
        assert_eq!(t.get().len(), TAIL_BYTES);
    }
}
