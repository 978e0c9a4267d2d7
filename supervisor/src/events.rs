//! A call's events while it runs: the sink the worker's call loop hands
//! them to, the feed that numbers and queues them, and [`Events`], which
//! a host reads them from: a blocking iterator, or without blocking a
//! thread (`poll_next`, `next_event().await`) from any async runtime.
//! The last event of a call is always its result.

use rvisor_protocol::{CallEvent, EventKind, RunResult, StreamMode};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
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

#[derive(Debug, Default)]
struct FeedState {
    queue: VecDeque<CallEvent>,
    next_seq: u64,
    done: bool,
    /// Every writer is gone: no result will come.
    closed: bool,
    wakers: Vec<Waker>,
}

#[derive(Debug)]
struct Feed {
    execution_id: String,
    m: Mutex<FeedState>,
    cv: Condvar,
}

fn lock(m: &Mutex<FeedState>) -> MutexGuard<'_, FeedState> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
    /// A feed for call `execution_id` and the [`Events`] that reads it.
    pub fn new(execution_id: &str) -> (Self, Events) {
        let feed = Arc::new(Feed {
            execution_id: execution_id.to_string(),
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

    /// Queues one event (ignored once the result was queued).
    pub fn push(&self, kind: EventKind) {
        let wakers = {
            let mut s = lock(&self.feed.m);
            if s.done {
                return;
            }
            if matches!(kind, EventKind::Result { .. }) {
                s.done = true;
            }
            let seq = s.next_seq;
            s.next_seq += 1;
            s.queue.push_back(CallEvent {
                execution_id: self.feed.execution_id.clone(),
                seq,
                kind,
            });
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

    /// The next queued event; `None` when none is queued. Marks the end
    /// when the writers are gone and nothing is left.
    fn take(&mut self, s: &mut FeedState) -> Option<CallEvent> {
        let Some(e) = s.queue.pop_front() else {
            if s.closed {
                self.done = true;
            }
            return None;
        };
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
