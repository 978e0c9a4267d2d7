//! Watching a session's calls ([`Session::watch`]): every call that
//! starts while a watcher is there runs in full stream mode and the
//! watcher gets its own bounded feed of the call's events
//! (docs/streaming.md, "Watching a session's calls").

use super::{lock, Rejection, Session};
use crate::events::{EventFeed, Events, StreamLimits};
use std::sync::Arc;
use std::time::Duration;

/// Most watchers a session has at once ([`Session::watch`]).
pub const MAX_WATCHERS: usize = 8;

/// Calls a watcher has not taken yet before the next ones go unwatched.
const WATCH_BACKLOG: usize = 4;

/// A call a watcher of its session sees ([`Session::watch`]): its id, its
/// code, and its events as a streaming caller gets them, ending with its
/// result.
#[derive(Debug)]
pub struct WatchedCall {
    /// The call's execution id.
    pub execution_id: String,
    /// The code it runs.
    pub code: String,
    /// Its events (bounded as `limits` said; a slow reader gets `lagged`).
    pub events: Events,
}

#[derive(Debug)]
pub(super) struct Watcher {
    tx: std::sync::mpsc::SyncSender<WatchedCall>,
    limits: StreamLimits,
    /// Gone when the [`Watch`] is dropped.
    alive: std::sync::Weak<()>,
}

/// A session's calls as they start ([`Session::watch`]). Dropping it stops
/// watching.
#[derive(Debug)]
pub struct Watch {
    rx: std::sync::mpsc::Receiver<WatchedCall>,
    _alive: Arc<()>,
}

impl Watch {
    /// The next call to start (waits); an error once the session closed.
    pub fn recv(&self) -> Result<WatchedCall, std::sync::mpsc::RecvError> {
        self.rx.recv()
    }

    /// [`Watch::recv`] waiting at most `timeout`.
    pub fn recv_timeout(
        &self,
        timeout: Duration,
    ) -> Result<WatchedCall, std::sync::mpsc::RecvTimeoutError> {
        self.rx.recv_timeout(timeout)
    }
}

/// A feed of the call `execution_id` for each live watcher in `watchers`
/// (a watcher gone is forgotten; one that has not taken the calls before
/// misses this one).
pub(super) fn start(watchers: &mut Vec<Watcher>, execution_id: &str, code: &str) -> Vec<EventFeed> {
    let mut feeds = Vec::new();
    watchers.retain(|w| {
        if w.alive.strong_count() == 0 {
            return false;
        }
        let (feed, events) = EventFeed::with_limits(execution_id, w.limits.clone());
        let seen = WatchedCall {
            execution_id: execution_id.to_string(),
            code: code.to_string(),
            events,
        };
        match w.tx.try_send(seen) {
            Ok(()) => {
                feeds.push(feed);
                true
            }
            Err(std::sync::mpsc::TrySendError::Full(_)) => true,
            Err(std::sync::mpsc::TrySendError::Disconnected(_)) => false,
        }
    });
    feeds
}

impl Session {
    /// Follows the session's calls from the next one to start on: each
    /// comes as a [`WatchedCall`] with its events, as a streaming caller
    /// gets them (whoever queued it, streaming or not), bounded by
    /// `limits`. For a person watching an agent's session (the web
    /// console). Dropping the receiver stops watching; the stream ends
    /// when the session closes. A watcher that has not taken the calls
    /// before misses the next ones; at most [`MAX_WATCHERS`] at once.
    ///
    /// ```
    /// # let sup = rvisor::Supervisor::new(Default::default())?;
    /// let session = sup.session()?;
    /// let watch = session.watch(Default::default())?;
    /// session.run("cat('seen\\n')")?.wait();
    /// let call = watch.recv()?;
    /// let text: String = call.events.filter_map(|e| e.kind.console_text().map(String::from)).collect();
    /// assert_eq!(text, "seen\n");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn watch(&self, limits: StreamLimits) -> Result<Watch, Rejection> {
        let s = self.shared();
        let mut i = lock(&s.inner);
        if i.closed {
            return Err(Rejection::Closed);
        }
        i.watchers.retain(|w| w.alive.strong_count() > 0);
        if i.watchers.len() >= MAX_WATCHERS {
            return Err(Rejection::Invalid(format!(
                "this session has {MAX_WATCHERS} watchers already; close one (or wait for it to time out) and try again"
            )));
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(WATCH_BACKLOG);
        let alive = Arc::new(());
        i.watchers.push(Watcher {
            tx,
            limits,
            alive: Arc::downgrade(&alive),
        });
        Ok(Watch { rx, _alive: alive })
    }
}
