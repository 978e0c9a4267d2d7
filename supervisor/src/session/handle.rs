//! The handles a host holds: [`CallHandle`] (the pending result of one
//! call, blocking or a `Future`) and [`Session`] (queueing calls, status,
//! reset, checkpoints, hibernation, release), and [`Rejection`], why a
//! call was refused before it was queued.

use super::failure::Retry;
use super::{close, lock, Inner, Pending, RunOptions, SessionState, SessionStatus, Shared};
use crate::call::{validate_call, CallOptions};
use crate::cancel::CancelToken;
use crate::checkpoint::CheckpointInfo;
use crate::error::CheckpointError;
use crate::events::{EventFeed, Events};
use crate::ids;
use rvisor_protocol::{Outcome, RunResult};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// Why a call was refused before it was queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// Empty code, code over the size limit, a bad plot size...
    #[error("{0}")]
    Invalid(String),
    /// `queue_limit` calls already wait.
    #[error("the session's queue is full ({0} calls waiting); wait for a result or cancel")]
    QueueFull(usize),
    /// The session was closed.
    #[error("the session is closed; create a new one")]
    Closed,
}

impl Rejection {
    /// A stable code for the wire (`{code, message}`).
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::Invalid(_) => "invalid",
            Rejection::QueueFull(_) => "queue_full",
            Rejection::Closed => "closed",
        }
    }
}

// ---------------------------------------------------------------------------
// Call handles

#[derive(Debug, Default)]
pub(super) struct SlotState {
    result: Option<RunResult>,
    wakers: Vec<Waker>,
    /// Where a streaming call's events go (its result last).
    pub(super) feed: Option<EventFeed>,
    /// Their reader, until [`CallHandle::events`] takes it.
    events: Option<Events>,
}

#[derive(Debug, Default)]
pub(super) struct Slot {
    pub(super) m: Mutex<SlotState>,
    cv: Condvar,
}

impl Slot {
    pub(super) fn resolve(&self, r: RunResult) {
        let wakers = {
            let mut s = lock(&self.m);
            if s.result.is_some() {
                return;
            }
            if let Some(feed) = s.feed.take() {
                feed.finish(&r);
            }
            s.result = Some(r);
            std::mem::take(&mut s.wakers)
        };
        self.cv.notify_all();
        for w in wakers {
            w.wake();
        }
    }
}

/// The pending result of one call: wait on it (blocking, with a deadline),
/// or `.await` it (it is a `Future`, usable from any async runtime).
///
/// ```
/// # let sup = rvisor::Supervisor::new(Default::default())?;
/// let session = sup.session()?;
/// let handle = session.run("Sys.sleep(0.2); 7")?;
/// assert!(handle.wait_timeout(std::time::Duration::from_millis(1)).is_none());
/// assert_eq!(handle.wait().console, "[1] 7\n");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct CallHandle {
    execution_id: String,
    slot: Arc<Slot>,
}

impl CallHandle {
    /// The call's execution id (also in its result).
    pub fn execution_id(&self) -> &str {
        &self.execution_id
    }

    /// Blocks until the result is there.
    pub fn wait(self) -> RunResult {
        let mut s = lock(&self.slot.m);
        loop {
            if let Some(r) = &s.result {
                return r.clone();
            }
            s = self.slot.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Blocks until the result is there or `timeout` passed.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<RunResult> {
        let end = Instant::now() + timeout;
        let mut s = lock(&self.slot.m);
        loop {
            if let Some(r) = &s.result {
                return Some(r.clone());
            }
            let now = Instant::now();
            if now >= end {
                return None;
            }
            s = self
                .slot
                .cv
                .wait_timeout(s, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The result, if it is there.
    pub fn try_result(&self) -> Option<RunResult> {
        lock(&self.slot.m).result.clone()
    }

    /// The call's events as they happen, ending with its result (see
    /// [`Events`]). A call queued with [`Session::run_streaming`] streams
    /// everything; another call streams what happens after its events were
    /// asked for before it started, and holds its result only when asked
    /// for later (or a second time).
    pub fn events(&self) -> Events {
        let mut s = lock(&self.slot.m);
        if let Some(ev) = s.events.take() {
            return ev;
        }
        let (feed, ev) = EventFeed::new(&self.execution_id);
        match &s.result {
            Some(r) => feed.finish(r),
            None => {
                if s.feed.is_none() {
                    s.feed = Some(feed);
                }
            }
        }
        ev
    }
}

impl Future for CallHandle {
    type Output = RunResult;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<RunResult> {
        let mut s = lock(&self.slot.m);
        match &s.result {
            Some(r) => Poll::Ready(r.clone()),
            None => {
                if !s.wakers.iter().any(|w| w.will_wake(cx.waker())) {
                    s.wakers.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Public handles

/// Closes its session when the last [`Session`] clone is dropped.
#[derive(Debug)]
pub(crate) struct CloseOnDrop(pub(crate) Arc<Shared>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        close(&self.0);
    }
}

/// A persistent R session: one worker, one global environment. Cloning gives
/// another handle to the same session; dropping the last handle closes it.
#[derive(Debug, Clone)]
pub struct Session {
    pub(crate) handle: Arc<CloseOnDrop>,
}

impl Session {
    pub(super) fn shared(&self) -> &Arc<Shared> {
        &self.handle.0
    }

    /// The session's id.
    pub fn id(&self) -> &str {
        &self.shared().id
    }

    /// Where the session's files are, for `crate::files`: the host
    /// directory calls run in (unconfined, or an explicit one), else the
    /// live worker's pid and its directory inside its own root.
    pub(crate) fn files_place(&self) -> crate::files::Place {
        let sh = self.shared();
        let i = lock(&sh.inner);
        // A session to be restored gets its worker first: the restore
        // writes the checkpoint's files, and would overwrite what the
        // host put there meanwhile.
        if i.restore_next.is_some() || i.state == SessionState::Hibernated {
            return crate::files::Place::NoWorker;
        }
        if let Some(d) = &sh.working_dir {
            return crate::files::Place::Host(d.clone());
        }
        match (i.pid, &i.worker_dir) {
            (Some(pid), Some(dir)) => crate::files::Place::Worker {
                pid,
                dir: PathBuf::from(dir),
                generation: i.generation,
            },
            _ => crate::files::Place::NoWorker,
        }
    }

    /// Queues `code` and returns at once. Fails at once when the code is
    /// empty or over 256 KiB, the queue is full, or the session is closed.
    ///
    /// ```
    /// # let sup = rvisor::Supervisor::new(Default::default())?;
    /// let session = sup.session()?;
    /// let first = session.run("Sys.sleep(0.1); 'first'")?;
    /// let second = session.run("'second'")?; // waits behind the first
    /// assert_eq!(first.wait().console, "[1] \"first\"\n");
    /// assert_eq!(second.wait().console, "[1] \"second\"\n");
    /// assert!(matches!(session.run(""), Err(rvisor::Rejection::Invalid(_))));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn run(&self, code: &str) -> Result<CallHandle, Rejection> {
        self.run_with(code, &RunOptions::default())
    }

    /// [`Session::run`] with per-call overrides.
    pub fn run_with(&self, code: &str, over: &RunOptions) -> Result<CallHandle, Rejection> {
        self.queue_call(code, over, false)
    }

    /// [`Session::run`] for a caller that follows the call as it runs:
    /// [`CallHandle::events`] gives its console text, conditions, plot
    /// pages and progress while it runs, then its result (the same result
    /// as without streaming).
    pub fn run_streaming(&self, code: &str) -> Result<CallHandle, Rejection> {
        self.queue_call(code, &RunOptions::default(), true)
    }

    /// [`Session::run_streaming`] with per-call overrides.
    pub fn run_streaming_with(
        &self,
        code: &str,
        over: &RunOptions,
    ) -> Result<CallHandle, Rejection> {
        self.queue_call(code, over, true)
    }

    fn queue_call(
        &self,
        code: &str,
        over: &RunOptions,
        stream: bool,
    ) -> Result<CallHandle, Rejection> {
        let s = self.shared();
        let opts = CallOptions {
            timeout: Some(over.timeout.unwrap_or(s.opts.timeout)),
            grace: s.opts.grace,
            plot_width: over.plot_width.unwrap_or(s.opts.plot_width),
            plot_height: over.plot_height.unwrap_or(s.opts.plot_height),
            max_output_bytes: s.opts.max_output_bytes,
            working_dir: s.working_dir.clone(),
            // A session's worker lives on: no CPU limit that could not be lifted.
            cpu_limit: None,
            display: s.opts.display.over(&over.display),
        };
        validate_call(code, &opts).map_err(|e| Rejection::Invalid(e.to_string()))?;
        let slot = Arc::new(Slot::default());
        let execution_id = ids::execution_id();
        if stream {
            let (feed, events) = EventFeed::with_limits(&execution_id, over.stream_limits.clone());
            let mut st = lock(&slot.m);
            st.feed = Some(feed);
            st.events = Some(events);
        }
        {
            let mut i = lock(&s.inner);
            if i.closed {
                return Err(Rejection::Closed);
            }
            let waiting = i.queue.len();
            let busy = i.running.is_some() || waiting > 0;
            if busy && waiting >= s.opts.queue_limit {
                return Err(Rejection::QueueFull(waiting));
            }
            i.queue.push_back(Pending {
                execution_id: execution_id.clone(),
                code: code.into(),
                opts,
                slot: slot.clone(),
                cancel: CancelToken::new(),
            });
        }
        s.cv.notify_all();
        Ok(CallHandle { execution_id, slot })
    }

    /// The session's status.
    pub fn status(&self) -> SessionStatus {
        self.shared().status()
    }

    /// Stops the running call (outcome `cancelled`; the worker is killed if
    /// R does not answer within the grace period) and drops the queued ones
    /// (outcome `not_executed`). A call taken from the queue whose worker
    /// is still starting (or loading a checkpoint) resolves `cancelled` at
    /// once and never runs: a cancel is recorded with the call, not sent
    /// as a message that could miss it.
    ///
    /// ```
    /// # let sup = rvisor::Supervisor::new(Default::default())?;
    /// use rvisor::Outcome;
    /// let session = sup.session()?;
    /// session.run("kept <- TRUE")?.wait();
    /// let long = session.run("Sys.sleep(60)")?;
    /// let queued = session.run("1")?;
    /// while session.status().state != rvisor::SessionState::Running {
    ///     std::thread::yield_now();
    /// }
    /// session.cancel();
    /// assert_eq!(long.wait().outcome, Outcome::Cancelled);
    /// assert_eq!(queued.wait().outcome, Outcome::NotExecuted);
    /// assert_eq!(session.run("kept")?.wait().console, "[1] TRUE\n");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn cancel(&self) {
        let s = self.shared();
        let mut i = lock(&s.inner);
        i.drop_queue(
            Outcome::NotExecuted,
            "not executed: the session's calls were cancelled",
        );
        i.cancel_taken(Outcome::Cancelled, "cancelled before it ran");
    }

    /// Cancels one call, leaving the others alone: a queued call leaves the
    /// queue (outcome `cancelled`); the running one is cancelled as by
    /// [`Session::cancel`] (interrupt, kill after the grace period; not
    /// sent at all if its worker is still starting). False when the
    /// session has no such call (it ended already).
    pub fn cancel_call(&self, execution_id: &str) -> bool {
        let s = self.shared();
        let mut i = lock(&s.inner);
        if let Some(pos) = i.queue.iter().position(|p| p.execution_id == execution_id) {
            if let Some(p) = i.queue.remove(pos) {
                p.slot.resolve(RunResult::failed(
                    p.execution_id,
                    p.code.to_string(),
                    Outcome::Cancelled,
                    "cancelled before it ran".to_string(),
                ));
            }
            return true;
        }
        if i.running
            .as_ref()
            .is_some_and(|t| t.execution_id == execution_id)
        {
            return i.cancel_taken(Outcome::Cancelled, "cancelled before it ran");
        }
        false
    }

    /// Kills the session's worker now, for a host that must take its memory
    /// back (a budget): the running call ends as `worker_failed` with
    /// `why`, the next call gets a fresh worker (restored from the last
    /// checkpoint when there is one) and its result says why (reset reason
    /// [`KILLED_OVER_BUDGET`](super::KILLED_OVER_BUDGET)). False when the session holds no worker.
    pub fn kill_worker(&self, why: &str) -> bool {
        let s = self.shared();
        let mut i = lock(&s.inner);
        let Some(pid) = i.pid else { return false };
        i.kill_reason = Some(why.to_string());
        // SAFETY: kill(2) of the process group of this session's worker
        // (its own group, led by `pid`), as `Registry::kill_all` does. The
        // runner clears `pid` under this lock when it retires the worker;
        // a worker that ended a moment ago makes the call fail harmlessly
        // (its group is gone), and its pid cannot have been reused by
        // then unless the pid space wrapped in that moment.
        unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
        true
    }

    /// Interrupts the running call without dropping the queue (outcome
    /// `interrupted`; state kept). Used by interactive front ends (Ctrl-C).
    pub fn interrupt(&self) {
        let i = lock(&self.shared().inner);
        if let (Some(_), Some(int)) = (&i.running, &i.interrupter) {
            int.interrupt();
        }
    }

    /// Replaces the worker with a fresh one: the running call is cancelled,
    /// calls queued so far become `not_executed`; calls made after `reset()`
    /// run in the fresh session.
    pub fn reset(&self) {
        let s = self.shared();
        let i = lock(&s.inner);
        Self::replace_worker(
            s,
            i,
            "not executed: the session was reset before this call ran",
        );
    }

    /// Asks the runner for a new worker: queued calls become `not_executed`
    /// with `why`, the running call is cancelled.
    fn replace_worker(s: &Shared, mut i: MutexGuard<'_, Inner>, why: &str) {
        i.reset_requested = true;
        i.drop_queue(Outcome::NotExecuted, why);
        i.cancel_taken(
            Outcome::Cancelled,
            "cancelled before it ran: the session was reset",
        );
        drop(i);
        s.cv.notify_all();
    }

    /// Notes that the session's files changed outside a call (an upload
    /// committed, a file deleted): the checkpoint in the store no longer
    /// holds them as they are, so the next background checkpoint,
    /// hibernation or release writes a new one.
    pub fn files_changed(&self) {
        let s = self.shared();
        {
            let mut i = lock(&s.inner);
            i.dirty = true;
            i.files_epoch += 1;
            i.kept_listing = None;
        }
        s.cv.notify_all();
    }

    /// The key a listing of the files taken now is valid for, if no call
    /// is running (one could be changing the files as they are listed).
    pub(crate) fn listing_key(&self, generation: u64) -> Option<crate::files::ListingKey> {
        let i = lock(&self.shared().inner);
        (i.running.is_none() && i.generation == generation).then_some(crate::files::ListingKey {
            generation,
            calls: i.calls_taken,
            epoch: i.files_epoch,
        })
    }

    /// The kept listing, if it was taken under `key` within `max_files`.
    pub(crate) fn kept_listing(
        &self,
        key: crate::files::ListingKey,
        max_files: usize,
    ) -> Option<crate::files::Snapshot> {
        let i = lock(&self.shared().inner);
        i.kept_listing
            .as_ref()
            .filter(|k| k.key == key && k.max_files == max_files)
            .map(|k| k.snapshot.clone())
    }

    /// Keeps `snapshot`, taken under `key`, if nothing moved while it was
    /// taken (the key is still the current one and no call runs).
    pub(crate) fn keep_listing(
        &self,
        key: crate::files::ListingKey,
        max_files: usize,
        snapshot: &crate::files::Snapshot,
    ) {
        if self.listing_key(key.generation) != Some(key) {
            return;
        }
        lock(&self.shared().inner).kept_listing = Some(crate::files::KeptListing {
            key,
            max_files,
            snapshot: snapshot.clone(),
        });
    }

    /// Checkpoints the session's state now (after the running call, before
    /// the queued ones) into the supervisor's checkpoint store and returns
    /// what it holds. Costs nothing when no call ran since the last
    /// checkpoint (`written: false`). Blocks until it is done.
    pub fn checkpoint(&self) -> Result<CheckpointInfo, CheckpointError> {
        let s = self.shared();
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let mut i = lock(&s.inner);
            if i.closed {
                return Err(CheckpointError::Closed);
            }
            i.checkpoint_waiters.push(tx);
        }
        s.cv.notify_all();
        rx.recv().map_err(|_| CheckpointError::Closed)?
    }

    /// Rolls the session back to its last checkpoint: like
    /// [`Session::reset`] (the running call is cancelled, queued calls
    /// become `not_executed`), but the next worker loads the checkpoint.
    /// Fails when the session has none, or is closed.
    pub fn restore(&self) -> Result<(), crate::RestoreError> {
        let s = self.shared();
        let mut i = lock(&s.inner);
        if i.closed {
            return Err(crate::RestoreError::Closed);
        }
        if i.checkpoint.is_none() {
            return Err(crate::RestoreError::NoCheckpoint);
        }
        i.restore_requested = true;
        Self::replace_worker(
            s,
            i,
            "not executed: the session was rolled back to its checkpoint before this call ran",
        );
        Ok(())
    }

    /// Hibernates the session as soon as it is idle: checkpoint, worker
    /// released, state `hibernated`; the next call restores it. Does
    /// nothing without a checkpoint store or a worker.
    pub fn hibernate(&self) {
        let s = self.shared();
        lock(&s.inner).hibernate_requested = true;
        s.cv.notify_all();
    }

    /// Hibernates the session now if it is idle, and waits (at most
    /// `timeout`) until its worker has exited. `Ok` also when it holds no
    /// worker. `Err` says why not: no checkpoint store, the checkpoint
    /// failed (or failed before and is not due to be tried again: then it
    /// answers at once, see `SessionStatus.checkpoint`), a call arrived
    /// first, the session closed, or the timeout passed (the hibernation
    /// may still happen later).
    pub fn hibernate_and_wait(&self, timeout: Duration) -> Result<(), String> {
        let s = self.shared();
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let mut i = lock(&s.inner);
            if i.closed {
                return Err("the session is closed".into());
            }
            if let (Some(f), true) = (&i.failure, s.store.is_some() && i.pid.is_some()) {
                let when = match f.retry(i.unsaved_count) {
                    Retry::Due => None,
                    Retry::In(d) => Some(format!("for {:.0} s", d.as_secs_f64().ceil())),
                    Retry::AfterACall => Some("until a call changes its state".into()),
                };
                if let Some(when) = when {
                    return Err(format!(
                        "its state cannot be checkpointed ({}); not tried again {when}",
                        f.error
                    ));
                }
            }
            i.hibernate_requested = true;
            i.hibernate_waiters.push(tx);
        }
        s.cv.notify_all();
        match rx.recv_timeout(timeout) {
            Ok(out) => out,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(format!(
                "it did not hibernate within {:.1} s",
                timeout.as_secs_f64()
            )),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Err("the session closed before it hibernated".into())
            }
        }
    }

    /// Closes the session for good: the running call is cancelled, queued
    /// calls resolve as `closed`, the worker ends.
    pub fn close(&self) {
        close(self.shared());
    }

    /// Ends the session in this process without touching its checkpoint:
    /// neither written nor deleted. For a node that lost the session to
    /// another (which owns the checkpoint now). Returns at once.
    pub fn abandon(&self) {
        let s = self.shared();
        {
            let mut i = lock(&s.inner);
            i.keep_checkpoint = true;
            i.abandoned = true;
        }
        close(s);
    }

    /// Ends the session in this process but keeps it durable, for a
    /// server that stops or hands the session to another node: like
    /// [`Session::close`] (queued calls end as `closed`, saying to retry),
    /// but the running call is let finish, the state is checkpointed
    /// if it changed since the last checkpoint and the checkpoint stays in
    /// the store, for [`Supervisor::resume_session`]. Blocks until the
    /// worker is gone or `within` passed. The answer is the checkpoint
    /// written (`None`: nothing had changed, or the session never ran).
    pub fn release(&self, within: Duration) -> Result<Option<CheckpointInfo>, String> {
        let s = self.shared();
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let mut i = lock(&s.inner);
            if s.store.is_none() {
                return Err("the session has no checkpoint store to keep it in".into());
            }
            if i.closed {
                return Err("the session is closed".into());
            }
            i.keep_checkpoint = true;
            i.release_waiters.push(tx);
        }
        close(s);
        match rx.recv_timeout(within) {
            Ok(r) => r,
            Err(_) => Err(format!(
                "the session's worker did not stop within {:.1} s; its last checkpoint stays",
                within.as_secs_f64()
            )),
        }
    }
}
