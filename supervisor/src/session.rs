//! Persistent sessions: one worker, one R global environment, one queue.
//!
//! A [`Supervisor`] hands out [`Session`]s. Each session has a runner thread
//! that owns its worker and takes calls from its queue in order, so calls of
//! one session run one after another while sessions run in parallel. Handles
//! ([`CallHandle`]) resolve with a [`RunResult`] whatever happens: every
//! failure is an outcome, never a lost call.
//!
//! State machine of a session (see ARCHITECTURE.md):
//! `new` --first call--> `starting` --> `running` <--> `idle`;
//! a reset (timeout kill, cancel kill, crash, `quit()`, [`Session::reset`])
//! goes back to `starting` with the next generation; `close()` --> `closed`.

use crate::call::CallOptions;
use crate::cancel::CancelToken;
use crate::checkpoint::{
    CheckpointInfo, CheckpointState, CheckpointStatus, CheckpointStore, FileRefs, Manifest,
    UnsavedCalls,
};
use crate::error::CheckpointError;
use crate::error::Error;
use crate::events::{EventFeed, EventSink, Tail};
use crate::tools::CallContext;
use crate::worker::{Interrupter, Worker, WorkerSource};
use rvisor_protocol::{Outcome, RunResult, StreamMode};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What `status` reads of the running call while it runs.
#[derive(Debug)]
struct LiveCall {
    execution_id: String,
    started: Instant,
    pid: u32,
    cpu_at_start: Option<f64>,
    tail: Mutex<Tail>,
    /// The feeds of the session's watchers ([`Session::watch`]).
    watch: Vec<EventFeed>,
}

impl LiveCall {
    fn report(&self) -> RunningCall {
        let cpu_ms = match (self.cpu_at_start, proc_cpu_ms(self.pid)) {
            (Some(a), Some(b)) => Some((b - a).max(0.0)),
            _ => None,
        };
        RunningCall {
            execution_id: self.execution_id.clone(),
            elapsed_ms: self.started.elapsed().as_secs_f64() * 1000.0,
            cpu_ms,
            output_tail: self.tail.lock().unwrap_or_else(|e| e.into_inner()).get(),
        }
    }
}

/// CPU time (user + system) process `pid` used, in milliseconds: its
/// CPU-time clock (two system calls; reading `/proc/PID/stat` was three,
/// and a twentieth of a kernel cell's host time), read at every call's
/// start.
fn proc_cpu_ms(pid: u32) -> Option<f64> {
    let pid = libc::pid_t::try_from(pid).ok()?;
    let mut clock: libc::clockid_t = 0;
    // SAFETY: clock_getcpuclockid writes a clockid_t we own; any pid may
    // be asked (an ended one fails with ESRCH).
    if unsafe { libc::clock_getcpuclockid(pid, &mut clock) } != 0 {
        return None;
    }
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes a timespec we own.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    Some(ts.tv_sec as f64 * 1000.0 + ts.tv_nsec as f64 / 1e6)
}

// ---------------------------------------------------------------------------
// Session internals

#[derive(Debug)]
struct Pending {
    execution_id: String,
    code: Arc<str>,
    opts: CallOptions,
    slot: Arc<Slot>,
    /// This call's cancel: a state the runner and the call loop read, so a
    /// cancel that comes before the worker has the call is not lost.
    cancel: CancelToken,
}

/// The call the runner took from the queue, until it has its result.
#[derive(Debug)]
struct Taken {
    execution_id: String,
    code: Arc<str>,
    slot: Arc<Slot>,
    cancel: CancelToken,
    /// Handed to the worker: from now on a cancel interrupts it (through
    /// `cancel`); before, the cancel resolves it and nothing is sent.
    sent: bool,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) state: SessionState,
    generation: u64,
    queue: VecDeque<Pending>,
    /// The call out of the queue: starting its worker, or running.
    running: Option<Taken>,
    last_reset: Option<ResetInfo>,
    /// Set by a reset, reported (and cleared) by the next result.
    unreported_reset: Option<String>,
    /// The next result is the first of its generation.
    fresh: bool,
    pid: Option<u32>,
    /// The worker's own directory (a confined session's working directory).
    worker_dir: Option<String>,
    interrupter: Option<Interrupter>,
    reset_requested: bool,
    closed: bool,
    /// The running call's progress, for status.
    live: Option<Arc<LiveCall>>,
    /// Who follows the session's calls ([`Session::watch`]).
    watchers: Vec<Watcher>,
    /// A call ran since the last checkpoint.
    dirty: bool,
    /// Execution ids of the calls that completed since the checkpoint in
    /// the store (the most recent `MAX_LOST_CALLS`), and how many in all:
    /// what a restore now would lose.
    unsaved_calls: VecDeque<String>,
    unsaved_count: u64,
    /// The checkpoint failures in a row, while they last (the state stays
    /// dirty: a release tries once more rather than keep an older
    /// checkpoint silently).
    failure: Option<Failure>,
    /// A note of unsaved calls may be beside the checkpoint in the store.
    note_written: bool,
    /// What the next result's notice says about calls a restore lost.
    lost_words: Option<String>,
    /// When the last call ended (or the worker started).
    idle_since: Instant,
    /// The manifest of the checkpoint in the store, if this session wrote
    /// (or was resumed from) one.
    pub(crate) checkpoint: Option<crate::checkpoint::Manifest>,
    /// Bytes of that checkpoint, when known.
    checkpoint_len: Option<u64>,
    /// Restore the checkpoint into the next worker, and why (`hibernated`,
    /// or the reset reason).
    pub(crate) restore_next: Option<String>,
    /// Set by a restore, reported (and cleared) by the next result.
    unreported_restore: Option<rvisor_protocol::Restored>,
    /// Why the last restore failed, for the next result's notice.
    restore_failure: Option<String>,
    /// What the last checkpoint or restore could not do with the files
    /// kept beside checkpoints, for the next result's warnings.
    file_warnings: Vec<String>,
    /// The sha256 of the files kept beside checkpoints as they were.
    beside_hashed: crate::checkpoint_files::Hashed,
    /// Callers of [`Session::checkpoint`] waiting for the runner.
    checkpoint_waiters: Vec<std::sync::mpsc::Sender<Result<CheckpointInfo, CheckpointError>>>,
    /// Set by [`Session::hibernate`].
    hibernate_requested: bool,
    /// Callers of [`Session::hibernate_and_wait`] waiting for the runner.
    hibernate_waiters: Vec<std::sync::mpsc::Sender<Result<(), String>>>,
    /// Set by [`Session::restore`] (with `reset_requested`).
    restore_requested: bool,
    /// Set by [`Session::release`]: the session ends here but stays
    /// durable (checkpointed if it changed, the checkpoint kept).
    keep_checkpoint: bool,
    /// Set by [`Session::abandon`]: kept, but not written either.
    abandoned: bool,
    /// Callers of [`Session::release`] waiting for the runner to end.
    release_waiters: Vec<std::sync::mpsc::Sender<Result<Option<CheckpointInfo>, String>>>,
    /// Set by [`Session::kill_worker`]: why the host killed the worker,
    /// for the running call's result and the next result's notice.
    kill_reason: Option<String>,
    /// Calls taken from the queue so far, and changes the files API made
    /// ([`Session::files_changed`]): with the generation, what a kept
    /// listing of the files is valid for.
    calls_taken: u64,
    files_epoch: u64,
    /// The files as the last listing taken while no call ran found them:
    /// a call's listing after it ends is the next call's listing before
    /// it, rather than a second walk of the worker's directory.
    kept_listing: Option<crate::files::KeptListing>,
}

#[derive(Debug)]
pub(crate) struct Shared {
    id: String,
    opts: SessionOptions,
    /// Where calls run; `None`: in the worker's own private directory
    /// (confined sessions without an explicit one).
    working_dir: Option<PathBuf>,
    owns_working_dir: bool,
    ctx: CallContext,
    pub(crate) inner: Mutex<Inner>,
    cv: Condvar,
    /// Where checkpoints go (none: the session is not durable).
    pub(crate) store: Option<Arc<dyn CheckpointStore>>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn now_rfc3339() -> String {
    crate::clock::rfc3339(crate::clock::unix_now())
}

impl Inner {
    /// Counts a call that completed in the worker: its work is in the
    /// state, not yet in the store.
    fn note_call(&mut self, execution_id: &str) {
        self.dirty = true;
        self.unsaved_count += 1;
        self.unsaved_calls.push_back(execution_id.to_string());
        while self.unsaved_calls.len() > rvisor_protocol::MAX_LOST_CALLS {
            self.unsaved_calls.pop_front();
        }
    }

    /// The store holds the state as it is now (a checkpoint was stored,
    /// or the state was restored from one, or started empty).
    fn saved(&mut self) {
        self.dirty = false;
        self.unsaved_calls.clear();
        self.unsaved_count = 0;
        self.failure = None;
    }

    /// When the next automatic checkpoint may be tried.
    fn checkpoint_retry(&self) -> Retry {
        self.failure
            .as_ref()
            .map_or(Retry::Due, |f| f.retry(self.unsaved_count))
    }

    /// Records a failed checkpoint (one more in a row).
    fn checkpoint_failed(&mut self, e: &CheckpointError) {
        let attempts = self.failure.as_ref().map_or(0, |f| f.attempts) + 1;
        let wait = CHECKPOINT_RETRY
            .saturating_mul(1 << (attempts - 1).min(16))
            .min(MAX_CHECKPOINT_RETRY);
        let since = self
            .failure
            .as_ref()
            .map_or_else(now_rfc3339, |f| f.since.clone());
        self.failure = Some(Failure {
            error: e.clone(),
            since,
            attempts,
            retry_at: Instant::now() + wait,
            calls_at: self.unsaved_count,
        });
    }

    /// The note that goes beside the checkpoint when the state after it
    /// could not be saved.
    fn unsaved_note(&self, reason: &str) -> UnsavedCalls {
        UnsavedCalls {
            checkpoint_created_at: self.checkpoint.as_ref().map_or(0.0, |m| m.created_at),
            calls: self.unsaved_calls.iter().cloned().collect(),
            count: self.unsaved_count,
            reason: reason.to_string(),
            at: now_rfc3339(),
        }
    }

    fn checkpoint_status(&self) -> CheckpointStatus {
        let known = self.checkpoint.as_ref().filter(|m| m.created_at > 0.0);
        CheckpointStatus {
            state: match (&self.failure, &self.checkpoint) {
                (Some(_), _) => CheckpointState::Failed,
                (None, None) => CheckpointState::None,
                (None, Some(_)) if self.dirty => CheckpointState::Behind,
                (None, Some(_)) => CheckpointState::Current,
            },
            taken_at: known.map(|m| m.taken_at()),
            bytes: known.and(self.checkpoint_len),
            calls_since: self.unsaved_count,
            failure: self.failure.as_ref().map(|f| f.report(self.unsaved_count)),
        }
    }

    /// Records that the worker is being replaced, for status and the next
    /// result.
    fn record_reset(&mut self, reason: &str) {
        self.last_reset = Some(ResetInfo {
            reason: reason.to_string(),
            at: now_rfc3339(),
        });
        self.unreported_reset = Some(reason.to_string());
        self.pid = None;
        self.interrupter = None;
    }

    /// Makes `w` the session's worker: the next generation, whose first
    /// result says it is fresh.
    fn install(&mut self, w: &Worker) {
        self.generation += 1;
        self.fresh = true;
        self.pid = Some(w.pid());
        self.worker_dir = Some(w.temp_dir().display().to_string());
        self.interrupter = Some(w.interrupter());
    }

    /// Cancels the call the runner took from the queue, if any: one not
    /// sent yet resolves now with `outcome` and `message` (nothing ran;
    /// the runner then skips it); a sent one is interrupted through its
    /// token (its worker killed after the grace period). False when no
    /// call is out of the queue.
    fn cancel_taken(&mut self, outcome: Outcome, message: &str) -> bool {
        let Some(t) = &self.running else {
            return false;
        };
        t.cancel.cancel();
        if !t.sent {
            t.slot.resolve(RunResult::failed(
                t.execution_id.clone(),
                t.code.to_string(),
                outcome,
                message.to_string(),
            ));
        }
        true
    }

    /// Resolves every queued call with `outcome` and `message`.
    fn drop_queue(&mut self, outcome: Outcome, message: &str) {
        for p in self.queue.drain(..) {
            p.slot.resolve(RunResult::failed(
                p.execution_id,
                p.code.to_string(),
                outcome,
                message.to_string(),
            ));
        }
    }

    /// Records a reset: queued calls become `not_executed`.
    fn note_reset(&mut self, reason: &str) {
        self.record_reset(reason);
        self.drop_queue(
            Outcome::NotExecuted,
            &format!(
                "not executed: the session was reset ({}) before this call ran",
                reset_words(reason)
            ),
        );
    }

    /// Says in `res` which session and generation it belongs to, and, for
    /// the first result after a reset, why the session is fresh.
    fn stamp(&mut self, id: &str, res: &mut RunResult) {
        if self.closed && res.outcome == Outcome::Cancelled {
            // Cancelled because the session was closed: say so, rather
            // than that the session's variables are kept.
            let msg = "the session was closed during the call";
            res.outcome = Outcome::Closed;
            res.push_segment(crate::Segment::Stderr {
                text: format!("rvisor: {msg}\n"),
            });
            res.error = Some(crate::ErrorInfo::message(msg));
        }
        res.session.id = id.to_string();
        res.session.generation = self.generation;
        res.session.fresh = std::mem::take(&mut self.fresh);
        let restored = self.unreported_restore.take();
        let reset = self.unreported_reset.take();
        if let Some(reason) = &reset {
            res.session.reset_reason = Some(reason.clone());
            if restored.is_none() {
                res.prepend_notice(&format!(
                    "rvisor: started a fresh R session (generation {}) because {}; earlier variables are gone.",
                    self.generation,
                    reset_words(reason)
                ));
            }
        }
        res.warnings.append(&mut self.file_warnings);
        if let Some(why) = self.restore_failure.take() {
            res.prepend_notice(&format!(
                "rvisor: the session's checkpoint could not be restored: {why}."
            ));
        }
        if let Some(r) = restored {
            // The state came back: not a fresh session.
            res.session.fresh = false;
            let cause = match &reset {
                Some(reason) if !reason.starts_with(CHECKPOINT_FAILED) => format!(
                    "a new worker (generation {}) replaced the previous one because {}; ",
                    self.generation,
                    reset_words(reason)
                ),
                _ => restore_cause(&r.reason).to_string(),
            };
            let lost = if r.lost.is_empty() {
                String::new()
            } else {
                format!("; not restored: {}", r.lost.join(", "))
            };
            let calls = self.lost_words.take().unwrap_or_default();
            res.prepend_notice(&format!(
                "rvisor: {cause}restored the state from the checkpoint of {} ({:.1} s old){lost}{calls}.",
                r.checkpoint_at, r.checkpoint_age_seconds
            ));
            res.session.restored = Some(r);
        }
    }
}

impl Shared {
    /// Whether the session's files are its own to checkpoint: a directory
    /// given by the caller outlives the session's workers.
    fn owns_files(&self) -> bool {
        self.working_dir.is_none() || self.owns_working_dir
    }

    /// Where the files of `w`, the session's worker, are: the host
    /// directory calls run in, else `w`'s directory inside its root.
    fn work_dir_of(&self, w: &Worker) -> crate::files::WorkDir {
        let place = match &self.working_dir {
            Some(d) => crate::files::Place::Host(d.clone()),
            None => crate::files::Place::Worker {
                pid: w.pid(),
                dir: w.temp_dir().to_path_buf(),
                generation: lock(&self.inner).generation,
            },
        };
        crate::files::WorkDir::new(place)
    }

    /// A new session's state; its tools come from `opts`.
    pub(crate) fn new(
        id: String,
        opts: SessionOptions,
        working_dir: Option<PathBuf>,
        owns_working_dir: bool,
    ) -> Arc<Self> {
        Arc::new(Shared {
            ctx: CallContext {
                session_id: id.clone(),
                tools: Arc::new(opts.tools.clone()),
                variables: Vec::new(),
                tables: Vec::new(),
                cancel: None,
                libraries_after: Vec::new(),
            },
            id,
            opts,
            working_dir,
            owns_working_dir,
            inner: Mutex::new(Inner {
                state: SessionState::New,
                generation: 0,
                queue: VecDeque::new(),
                running: None,
                last_reset: None,
                worker_dir: None,
                unreported_reset: None,
                fresh: false,
                pid: None,
                interrupter: None,
                reset_requested: false,
                closed: false,
                live: None,
                watchers: Vec::new(),
                dirty: false,
                unsaved_calls: VecDeque::new(),
                unsaved_count: 0,
                failure: None,
                note_written: false,
                lost_words: None,
                idle_since: Instant::now(),
                checkpoint: None,
                checkpoint_len: None,
                restore_next: None,
                unreported_restore: None,
                restore_failure: None,
                file_warnings: Vec::new(),
                beside_hashed: Default::default(),
                checkpoint_waiters: Vec::new(),
                hibernate_requested: false,
                hibernate_waiters: Vec::new(),
                restore_requested: false,
                keep_checkpoint: false,
                abandoned: false,
                release_waiters: Vec::new(),
                kill_reason: None,
                calls_taken: 0,
                files_epoch: 0,
                kept_listing: None,
            }),
            cv: Condvar::new(),
            store: None,
        })
    }

    fn status(&self) -> SessionStatus {
        let i = lock(&self.inner);
        SessionStatus {
            id: self.id.clone(),
            // `close()` only flags the session; the runner thread sets the
            // state later. Report `closed` at once, so that status() right
            // after close() does not still say idle or running.
            state: if i.closed {
                SessionState::Closed
            } else {
                i.state
            },
            generation: i.generation,
            queued: i.queue.len(),
            last_reset: i.last_reset.clone(),
            pid: i.pid,
            working_dir: match &self.working_dir {
                Some(d) => d.display().to_string(),
                None => i.worker_dir.clone().unwrap_or_default(),
            },
            running: i.live.as_ref().map(|l| l.report()),
            idle_seconds: (!i.closed && i.running.is_none() && i.queue.is_empty())
                .then(|| i.idle_since.elapsed().as_secs_f64()),
            checkpoint: self.store.as_ref().map(|_| i.checkpoint_status()),
        }
    }

    /// Waits for the next call; handles reset requests meanwhile. `None`:
    /// the session is closed.
    fn next_call(
        &self,
        worker: &mut Option<Worker>,
        source: &mut impl WorkerSource,
    ) -> Option<Pending> {
        let mut i = lock(&self.inner);
        loop {
            if i.closed {
                return None;
            }
            if i.reset_requested {
                i.reset_requested = false;
                // The queue was dropped by reset() itself: calls queued
                // after it belong to the fresh session.
                if std::mem::take(&mut i.restore_requested) && i.checkpoint.is_some() {
                    i.record_reset("restore");
                    i.restore_next = Some("restore".into());
                    i.dirty = false;
                } else {
                    i.record_reset("reset");
                    i.restore_next = None;
                    // An empty state: nothing to lose, nothing failing.
                    i.saved();
                }
                let had = i.checkpoint.is_some() || i.note_written;
                if i.restore_next.is_none() && had {
                    i.checkpoint = None;
                    i.checkpoint_len = None;
                    i.note_written = false;
                    if let Some(store) = &self.store {
                        let _ = store.delete(&self.checkpoint_key());
                    }
                }
                if let Some(w) = worker.take() {
                    drop(i);
                    retire(source, w, false);
                    i = lock(&self.inner);
                }
                continue;
            }
            if !i.checkpoint_waiters.is_empty() {
                let waiters = std::mem::take(&mut i.checkpoint_waiters);
                drop(i);
                let out = self.take_checkpoint(worker, source);
                for w in waiters {
                    let _ = w.send(out.clone());
                }
                i = lock(&self.inner);
                continue;
            }
            if let Some(p) = i.queue.pop_front() {
                if !i.hibernate_waiters.is_empty() {
                    // The session is busy again: a waiting hibernation is
                    // called off (the caller picks another session).
                    i.hibernate_requested = false;
                    for w in std::mem::take(&mut i.hibernate_waiters) {
                        let _ = w.send(Err("a call arrived before it could hibernate".into()));
                    }
                }
                i.calls_taken += 1;
                i.running = Some(Taken {
                    execution_id: p.execution_id.clone(),
                    code: p.code.clone(),
                    slot: p.slot.clone(),
                    cancel: p.cancel.clone(),
                    sent: false,
                });
                i.state = if worker.is_some() {
                    SessionState::Running
                } else {
                    SessionState::Starting
                };
                return Some(p);
            }
            if worker.is_some() {
                i.state = SessionState::Idle;
            }
            // Idle: checkpoint a changed state, hibernate a long-idle one.
            let mut wake: Option<Duration> = None;
            if !i.hibernate_waiters.is_empty() && (self.store.is_none() || worker.is_none()) {
                let out = match (&self.store, worker.is_some()) {
                    (None, _) => Err("the session has no checkpoint store".to_string()),
                    // No worker: there is nothing to release.
                    (Some(_), _) => Ok(()),
                };
                i.hibernate_requested = false;
                for w in std::mem::take(&mut i.hibernate_waiters) {
                    let _ = w.send(out.clone());
                }
            }
            if self.store.is_some() && worker.is_some() {
                let idle = i.idle_since.elapsed();
                // A failed checkpoint is tried again automatically only
                // when due (a backoff; a state too large only once a call
                // changed it); asked-for hibernations always try.
                let due = match i.checkpoint_retry() {
                    Retry::Due => Some(Duration::ZERO),
                    Retry::In(d) => Some(d),
                    Retry::AfterACall => None,
                };
                let hibernate_in = self
                    .opts
                    .hibernate_after
                    .map(|h| h.saturating_sub(idle))
                    .and_then(|h| due.map(|d| h.max(d)));
                if i.hibernate_requested || hibernate_in == Some(Duration::ZERO) {
                    i.hibernate_requested = false;
                    drop(i);
                    let out = self.hibernate(worker, source);
                    i = lock(&self.inner);
                    for w in std::mem::take(&mut i.hibernate_waiters) {
                        let _ = w.send(out.clone());
                    }
                    continue;
                }
                let checkpoint_in = self
                    .opts
                    .checkpoint_after
                    .filter(|_| i.dirty)
                    .map(|c| c.saturating_sub(idle))
                    .and_then(|c| due.map(|d| c.max(d)));
                if checkpoint_in == Some(Duration::ZERO) {
                    drop(i);
                    // A failure is recorded (and backs off) inside.
                    let _ = self.take_checkpoint(worker, source);
                    i = lock(&self.inner);
                    continue;
                }
                wake = [hibernate_in, checkpoint_in].into_iter().flatten().min();
            }
            i = match wake {
                Some(d) => {
                    self.cv
                        .wait_timeout(i, d)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.cv.wait(i).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }

    /// The store's key of this session's checkpoint.
    fn checkpoint_key(&self) -> String {
        format!("{}{}", self.opts.checkpoint_prefix, self.id)
    }

    /// Checkpoints the session's state into its store, unless no call ran
    /// since the last checkpoint (then that one is the answer). The
    /// worker's checkpoint streams into a scratch file of the store, which
    /// the store then keeps: it is never in memory whole. A failure is
    /// recorded for status (and backs off automatic attempts), and the
    /// calls the stored checkpoint lacks are noted beside it.
    fn take_checkpoint(
        &self,
        worker: &mut Option<Worker>,
        source: &mut impl WorkerSource,
    ) -> Result<CheckpointInfo, CheckpointError> {
        let Some(store) = self.store.clone() else {
            return Err(CheckpointError::NoStore);
        };
        let key = self.checkpoint_key();
        {
            let i = lock(&self.inner);
            if let (false, Some(m)) = (i.dirty, &i.checkpoint) {
                return Ok(CheckpointInfo {
                    key,
                    bytes: i.checkpoint_len.unwrap_or(m.compressed_bytes),
                    written: false,
                    manifest: m.clone(),
                });
            }
        }
        let Some(w) = worker.as_mut() else {
            return Err(CheckpointError::NothingYet);
        };
        let out = self.write_checkpoint(store.as_ref(), &key, w);
        if let Some(status) = died_idle(w) {
            if let Some(w) = worker.take() {
                source.forget(&w);
            }
            let reason = exit_reason(Some(status));
            let mut i = lock(&self.inner);
            i.record_reset(reason);
            if self.opts.restore_after_kill && i.checkpoint.is_some() {
                i.restore_next = Some(reason.to_string());
            }
        }
        let mut i = lock(&self.inner);
        match out {
            Ok((manifest, len)) => {
                i.saved();
                i.checkpoint = Some(manifest.clone());
                i.checkpoint_len = Some(len);
                let note = std::mem::take(&mut i.note_written);
                drop(i);
                if note {
                    // What it said is saved now.
                    let _ = store.delete_note(&key);
                }
                Ok(CheckpointInfo {
                    key,
                    bytes: len,
                    written: true,
                    manifest,
                })
            }
            Err(e) => {
                i.checkpoint_failed(&e);
                let note = (i.unsaved_count > 0 && !matches!(e, CheckpointError::Fenced(_)))
                    .then(|| i.unsaved_note(&e.to_string()));
                drop(i);
                if let Some(note) = note {
                    let json = serde_json::to_vec(&note).unwrap_or_default();
                    if store.put_note(&key, &json).is_ok() {
                        lock(&self.inner).note_written = true;
                    }
                }
                Err(e)
            }
        }
    }

    /// Has `w` write the checkpoint into a scratch file of `store`, within
    /// the store's allowance, and stores it; its manifest and length.
    fn write_checkpoint(
        &self,
        store: &dyn CheckpointStore,
        key: &str,
        w: &mut Worker,
    ) -> Result<(Manifest, u64), CheckpointError> {
        let staging = |e: std::io::Error| {
            CheckpointError::Store(format!("could not stage the checkpoint ({e})"))
        };
        let allowance = store.allowance(key)?;
        // Nothing left of a quota: refused before the worker does any work.
        if allowance.max_bytes == 0 {
            return Err(allowance.refusal);
        }
        let scratch = store.scratch().map_err(staging)?;
        // A directory given by the caller outlives the session's workers.
        let file_bytes = if self.owns_files() {
            self.opts.checkpoint_file_bytes
        } else {
            0
        };
        let len = w
            .checkpoint(
                self.working_dir.as_deref(),
                file_bytes,
                &scratch,
                allowance.max_bytes,
                self.opts.startup_timeout,
            )
            .map_err(|e| match e {
                CheckpointError::TooLarge(_) => allowance.refusal.clone(),
                CheckpointError::Worker(why) => {
                    CheckpointError::Worker(format!("the checkpoint failed: {why}"))
                }
                e => e,
            })?;
        let mut manifest = Manifest::read_from(&mut &scratch)
            .map_err(|why| CheckpointError::Worker(format!("the checkpoint failed: {why}")))?;
        // Files past the checkpoint's cap, beside it (a store that keeps
        // objects; a directory the session owns).
        let beside = (file_bytes > 0 && store.keeps_objects()).then(|| {
            let dir = self.work_dir_of(w);
            let mut hashed = std::mem::take(&mut lock(&self.inner).beside_hashed);
            let out = crate::checkpoint_files::store_beside(
                store,
                key,
                &dir,
                &manifest.files_skipped,
                &mut hashed,
            );
            lock(&self.inner).beside_hashed = hashed;
            out
        });
        store.put(key, &scratch, len)?;
        if let Some((refs, failed)) = beside {
            let stored: Vec<String> = refs.iter().map(|r| r.name.clone()).collect();
            let list = FileRefs {
                checkpoint_created_at: manifest.created_at,
                files: refs,
            };
            let mut warnings: Vec<String> = failed
                .iter()
                .map(|(name, why)| {
                    format!("rvisor: the file {name:?} is not in the session's checkpoint: {why}")
                })
                .collect();
            match crate::checkpoint_files::commit_refs(store, key, &list) {
                Ok(()) => {
                    manifest.files_skipped.retain(|f| !stored.contains(f));
                    manifest.files_beside = stored;
                }
                Err(e) => warnings.push(format!(
                    "rvisor: the session's files over the checkpoint's cap were not kept \
                     beside it ({e}); a restore will lack them"
                )),
            }
            lock(&self.inner).file_warnings.extend(warnings);
        }
        Ok((manifest, len))
    }

    /// Checkpoints the session and releases its worker (it has exited
    /// when this returns); the next call restores it. If the checkpoint
    /// fails, or a call came in meanwhile, the worker stays.
    fn hibernate(
        &self,
        worker: &mut Option<Worker>,
        source: &mut impl WorkerSource,
    ) -> Result<(), String> {
        // A failure is recorded (and backs off automatic attempts); the
        // next idle period may try again when it is due.
        if let Err(e) = self.take_checkpoint(worker, source) {
            lock(&self.inner).idle_since = Instant::now();
            return Err(e.to_string());
        }
        let mut i = lock(&self.inner);
        if !i.queue.is_empty() || i.closed {
            return Err("a call arrived before it could hibernate".into());
        }
        i.state = SessionState::Hibernated;
        i.pid = None;
        i.interrupter = None;
        i.restore_next = Some("hibernated".into());
        drop(i);
        if let Some(w) = worker.take() {
            source.forget(&w);
            w.shutdown(Duration::from_millis(200));
        }
        Ok(())
    }

    /// A worker for the session's next generation, with the last
    /// checkpoint loaded when the session comes back from hibernation or a
    /// kill. A checkpoint that cannot be loaded gives a fresh worker (the
    /// one that tried may hold part of it) and the next result says why.
    fn start_worker(&self, source: &mut impl WorkerSource) -> Result<Worker, Error> {
        let mut w = source.start()?;
        let Some(reason) = lock(&self.inner).restore_next.take() else {
            let mut i = lock(&self.inner);
            i.install(&w);
            // Empty: no call's work to lose, nothing to save yet.
            i.dirty = false;
            i.unsaved_calls.clear();
            i.unsaved_count = 0;
            i.idle_since = Instant::now();
            return Ok(w);
        };
        match self.load_checkpoint(&mut w) {
            Ok((mut m, len, note)) => {
                // The files kept beside the checkpoint, before any call.
                if let (Some(store), true) = (&self.store, self.owns_files()) {
                    let dir = self.work_dir_of(&w);
                    let (restored, warnings) = crate::checkpoint_files::restore_beside(
                        store.as_ref(),
                        &self.checkpoint_key(),
                        &dir,
                    );
                    m.files_beside = restored;
                    lock(&self.inner).file_warnings.extend(warnings);
                }
                let mut i = lock(&self.inner);
                // The calls the restored state lacks: known here since the
                // checkpoint, else from the note a failed checkpoint left
                // (after a restart or a move), if it is about this one.
                let note_found = note.is_some();
                let note = note.filter(|n| n.checkpoint_created_at == m.created_at);
                let (lost, count, why) = if i.unsaved_count > 0 {
                    let why = i.failure.as_ref().map(|f| f.error.to_string());
                    (
                        i.unsaved_calls.iter().cloned().collect(),
                        i.unsaved_count,
                        why,
                    )
                } else if let Some(n) = note.filter(|n| n.count > 0) {
                    (n.calls, n.count, Some(n.reason))
                } else {
                    (Vec::new(), 0, None)
                };
                if count > 0 {
                    if let (None, Some(why)) = (&i.unreported_reset, &why) {
                        // Not a kill: the state was rolled back because
                        // it could not be saved. Say so in reset_reason.
                        i.record_reset(&format!("{CHECKPOINT_FAILED}: {why}"));
                    }
                    let ids: Vec<&str> = lost.iter().map(String::as_str).collect();
                    i.lost_words = Some(format!(
                        "; the work of {count} call{} after it is gone{} ({}{})",
                        if count == 1 { "" } else { "s" },
                        why.as_deref()
                            .map(|w| format!(": its state could not be saved: {w}"))
                            .unwrap_or_default(),
                        if count as usize > ids.len() {
                            "the last: "
                        } else {
                            ""
                        },
                        ids.join(", ")
                    ));
                }
                i.install(&w);
                i.saved();
                i.idle_since = Instant::now();
                i.unreported_restore = Some(rvisor_protocol::Restored {
                    checkpoint_age_seconds: m.age_seconds(),
                    checkpoint_at: m.taken_at(),
                    lost: m.unsaved.iter().map(|u| u.name.clone()).collect(),
                    reason,
                    lost_calls: lost,
                    lost_call_count: count,
                });
                // A resumed session knew only that a checkpoint existed.
                i.checkpoint = Some(m);
                i.checkpoint_len = Some(len);
                let had_note = std::mem::take(&mut i.note_written) || note_found;
                drop(i);
                if had_note {
                    // Reported now: a later restore of the same checkpoint
                    // does not report these calls again.
                    if let Some(store) = &self.store {
                        let _ = store.delete_note(&self.checkpoint_key());
                    }
                }
                Ok(w)
            }
            Err(why) => {
                retire(source, w, false);
                let w = source.start()?;
                let mut i = lock(&self.inner);
                if i.unreported_reset.is_none() {
                    i.record_reset(&format!("restore_failed: {why}"));
                }
                i.install(&w);
                i.restore_failure = Some(why);
                i.checkpoint = None;
                i.checkpoint_len = None;
                i.saved();
                i.idle_since = Instant::now();
                Ok(w)
            }
        }
    }

    /// Loads the session's checkpoint from its store into `w` (through a
    /// scratch file whose descriptor the worker reads); its manifest,
    /// length, and the note of unsaved calls beside it, if any.
    fn load_checkpoint(
        &self,
        w: &mut Worker,
    ) -> Result<(Manifest, u64, Option<UnsavedCalls>), String> {
        let store = self
            .store
            .as_ref()
            .ok_or_else(|| "the session has no checkpoint store".to_string())?;
        let key = self.checkpoint_key();
        // The note matters when this process does not know the calls
        // (a resumed session knows nothing of its checkpoint yet) or
        // wrote one; other restores skip the read.
        let want_note = {
            let i = lock(&self.inner);
            i.note_written || i.checkpoint.as_ref().is_none_or(|m| m.created_at == 0.0)
        };
        let note: Option<UnsavedCalls> = want_note
            .then(|| store.get_note(&key).ok().flatten())
            .flatten()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let scratch = store
            .scratch()
            .map_err(|e| format!("could not stage it from the store ({e})"))?;
        let Some(len) = store
            .get(&key, &scratch)
            .map_err(|e| format!("could not read it from the store ({e})"))?
        else {
            let never = note
                .filter(|n| n.count > 0)
                .map(|n| format!("; its state was never saved: {}", n.reason))
                .unwrap_or_default();
            return Err(format!("the store has no checkpoint {key:?}{never}"));
        };
        let m = Manifest::read_from(&mut &scratch)?;
        w.restore(
            &scratch,
            self.working_dir.as_deref(),
            self.opts.startup_timeout,
        )?;
        Ok((m, len, note))
    }

    /// The result of `call` when no worker could start for it.
    fn startup_failure(&self, call: Pending, e: Error) {
        let outcome = match e {
            Error::StartupTimeout(_) => Outcome::StartupTimedOut,
            _ => Outcome::StartupFailed,
        };
        let mut r = RunResult::failed(
            call.execution_id,
            call.code.to_string(),
            outcome,
            e.to_string(),
        );
        r.session.id = self.id.clone();
        let mut i = lock(&self.inner);
        r.session.generation = i.generation;
        i.running = None;
        i.state = SessionState::New;
        drop(i);
        call.slot.resolve(r);
    }

    /// The result of `call` when the call gate refused it: nothing ran.
    fn refused(&self, call: Pending, has_worker: bool, why: String) {
        let mut r = RunResult::failed(
            call.execution_id,
            call.code.to_string(),
            Outcome::NotExecuted,
            why,
        );
        r.session.id = self.id.clone();
        let mut i = lock(&self.inner);
        r.session.generation = i.generation;
        i.running = None;
        i.state = match (has_worker, i.restore_next.as_deref()) {
            (true, _) => SessionState::Idle,
            (false, Some("hibernated")) => SessionState::Hibernated,
            (false, _) => SessionState::New,
        };
        drop(i);
        call.slot.resolve(r);
    }

    /// The running call's sink: its console text feeds `status`; a
    /// streaming call's events also go to its feed.
    fn live_sink(&self, call: &Pending, pid: u32) -> EventSink {
        let mut i = lock(&self.inner);
        let watch = watch::start(&mut i.watchers, &call.execution_id, &call.code);
        let live = Arc::new(LiveCall {
            execution_id: call.execution_id.clone(),
            started: Instant::now(),
            pid,
            cpu_at_start: proc_cpu_ms(pid),
            tail: Mutex::new(Tail::default()),
            watch,
        });
        i.live = Some(live.clone());
        drop(i);
        let feed = lock(&call.slot.m).feed.clone();
        let mode = if feed.is_some() || !live.watch.is_empty() {
            StreamMode::Full
        } else {
            StreamMode::Tail
        };
        EventSink::new(mode, move |e| {
            if let Some(t) = e.console_text() {
                live.tail.lock().unwrap_or_else(|e| e.into_inner()).push(t);
            }
            for w in &live.watch {
                w.push(e.clone());
            }
            if let Some(f) = &feed {
                f.push(e);
            }
        })
    }

    /// The runner thread: owns the worker, runs calls in order.
    fn runner(self: Arc<Self>, mut source: impl WorkerSource) {
        let mut worker: Option<Worker> = None;
        while let Some(call) = self.next_call(&mut worker, &mut source) {
            // The host's gate (a node's lease on the session): a call the
            // gate refuses runs nowhere, not even into a restore.
            if let Some(gate) = &self.opts.call_gate {
                if let Err(why) = gate.before_call(&self.id, &call.execution_id) {
                    self.refused(call, worker.is_some(), why);
                    continue;
                }
            }
            // A worker that died while idle (killed from outside, e.g. by the
            // OOM killer) is replaced before this call runs; without this
            // check the call was sent to the dead worker and failed. Queued
            // calls keep their place: none of them was running.
            if let Some(status) = worker.as_mut().and_then(died_idle) {
                if let Some(w) = worker.take() {
                    source.forget(&w);
                }
                let mut i = lock(&self.inner);
                let reason = match i.kill_reason.take() {
                    Some(_) => KILLED_OVER_BUDGET,
                    None => exit_reason(Some(status)),
                };
                i.record_reset(reason);
                if self.opts.restore_after_kill && i.checkpoint.is_some() {
                    i.restore_next = Some(reason.to_string());
                }
                i.state = SessionState::Starting;
            }

            // Start a worker if there is none (lazily, or after a reset):
            // with the preloads if this call (or an earlier one) names one.
            source.will_run(&call.code);
            if worker.is_none() {
                match self.start_worker(&mut source) {
                    Ok(w) => {
                        let mut i = lock(&self.inner);
                        i.state = SessionState::Running;
                        worker = Some(w);
                    }
                    Err(e) => {
                        self.startup_failure(call, e);
                        continue;
                    }
                }
            }
            let Some(w) = worker.as_mut() else { continue };
            // A cancel that came while the call waited for its worker has
            // resolved it (`Inner::cancel_taken`): nothing is sent. From
            // here on a cancel interrupts it, through its token.
            {
                let mut i = lock(&self.inner);
                match i.running.as_mut() {
                    Some(t) if !t.cancel.is_cancelled() => t.sent = true,
                    _ => {
                        i.running = None;
                        i.state = if i.queue.is_empty() {
                            SessionState::Idle
                        } else {
                            SessionState::Running
                        };
                        i.idle_since = Instant::now();
                        continue;
                    }
                }
            }
            let ctx = CallContext {
                cancel: Some(call.cancel.clone()),
                ..self.ctx.clone()
            };
            let sink = self.live_sink(&call, w.pid());
            let mut res = w.run_call_with_events(
                call.execution_id.clone(),
                &call.code,
                &call.opts,
                &ctx,
                Some(&sink),
            );
            let alive = w.is_alive();
            let exit = if alive { None } else { w.exit_status() };

            let mut i = lock(&self.inner);
            i.running = None;
            let watched = i.live.take();
            i.stamp(&self.id, &mut res);
            i.dirty = true;
            if alive {
                i.note_call(&res.execution_id);
            }
            i.idle_since = Instant::now();
            if alive {
                i.state = if i.queue.is_empty() {
                    SessionState::Idle
                } else {
                    SessionState::Running
                };
            } else {
                if let Some(w) = worker.take() {
                    source.forget(&w);
                }
                let killed = i.kill_reason.take();
                let reason = match &killed {
                    Some(why) => {
                        let msg = format!("the R worker was stopped during the call: {why}");
                        res.push_segment(crate::Segment::Stderr {
                            text: format!("rvisor: {msg}\n"),
                        });
                        res.error = Some(crate::ErrorInfo::message(msg));
                        KILLED_OVER_BUDGET
                    }
                    None => call_end_reason(&res, exit),
                };
                i.note_reset(reason);
                if self.opts.restore_after_kill && i.checkpoint.is_some() && reason != "quit" {
                    i.restore_next = Some(reason.to_string());
                }
                i.state = SessionState::Starting;
            }
            let respawn = !alive && !i.closed;
            drop(i);
            if let Some(gate) = &self.opts.call_gate {
                gate.after_call(&self.id, &res.execution_id);
            }
            for w in watched.iter().flat_map(|l| &l.watch) {
                w.finish(&res);
            }
            call.slot.resolve(res);
            // Its result is out: the pool may refill the spare this worker
            // was, if it held that back for the first call.
            source.call_ended();

            // After a reset, start the next worker at once so the next call
            // does not pay for it (if it fails, the next call tries again).
            if respawn {
                if let Ok(w) = self.start_worker(&mut source) {
                    let mut i = lock(&self.inner);
                    if i.running.is_none() && i.queue.is_empty() {
                        i.state = SessionState::Idle;
                    }
                    worker = Some(w);
                }
            }
        }
        // Released (not closed): the state that changed since the last
        // checkpoint is saved before the worker goes. A state that was too
        // large and has not changed since is not tried again (it would
        // only cost the release its serialisation): the note of its
        // unsaved calls is in the store already.
        let (keep, save, hopeless) = {
            let i = lock(&self.inner);
            let save = i.keep_checkpoint && !i.abandoned && i.dirty;
            let hopeless = (save && i.checkpoint_retry() == Retry::AfterACall)
                .then(|| i.failure.as_ref().map(|f| f.error.to_string()))
                .flatten();
            (i.keep_checkpoint, save, hopeless)
        };
        let released = match hopeless {
            Some(why) => Err(format!(
                "its state cannot be checkpointed ({why}); its last checkpoint stays and the \
                 calls since are noted beside it"
            )),
            None if save && worker.is_some() => self
                .take_checkpoint(&mut worker, &mut source)
                .map(Some)
                .map_err(|e| e.to_string()),
            None => Ok(None),
        };
        if let Some(w) = worker.take() {
            retire(&mut source, w, true);
        }
        // Gone before a release is answered: the session may be resumed in
        // this process at once, into a directory of the same name.
        if let (true, Some(d)) = (self.owns_working_dir, &self.working_dir) {
            let _ = std::fs::remove_dir_all(d);
        }
        let mut i = lock(&self.inner);
        i.state = SessionState::Closed;
        i.pid = None;
        i.checkpoint_waiters.clear();
        i.hibernate_waiters.clear();
        let kept = i.checkpoint.is_some() || i.note_written;
        if let (Some(store), true, false) = (&self.store, kept, keep) {
            // A closed session's checkpoint is of no use to anyone.
            let _ = store.delete(&self.checkpoint_key());
        }
        for w in std::mem::take(&mut i.release_waiters) {
            let _ = w.send(released.clone());
        }
        i.drop_queue(
            Outcome::Closed,
            "the session was closed before this call ran",
        );
        drop(i);
    }
}

/// Starts the runner thread of a session with workers from `source`.
pub(crate) fn start_runner(
    shared: Arc<Shared>,
    source: impl WorkerSource,
) -> Result<Session, Error> {
    let runner = shared.clone();
    std::thread::Builder::new()
        .name(format!("rvisor-session-{}", shared.id))
        .spawn(move || runner.runner(source))
        .map_err(|source| Error::Io {
            what: "start the session thread",
            source,
        })?;
    Ok(Session {
        handle: Arc::new(CloseOnDrop(shared)),
    })
}

pub(crate) fn close(shared: &Shared) {
    let mut i = lock(&shared.inner);
    if i.closed {
        return;
    }
    i.closed = true;
    // Watchers see the stream end.
    i.watchers.clear();
    // A released session lets its running call finish (its work goes into
    // the last checkpoint); a closed or abandoned one cancels it.
    let released = i.keep_checkpoint && !i.abandoned;
    if !released {
        i.cancel_taken(
            Outcome::Closed,
            "the session was closed before this call ran",
        );
    }
    i.drop_queue(
        Outcome::Closed,
        if released {
            "the session was handed off (its server is stopping) before this call ran; \
             retry the call: the session goes on from its checkpoint"
        } else {
            "the session was closed before this call ran"
        },
    );
    drop(i);
    shared.cv.notify_all();
}

mod failure;
mod handle;
mod options;
mod reasons;
#[cfg(test)]
mod tests;
mod watch;
mod workers;

use failure::{Failure, Retry};
pub use failure::{CHECKPOINT_RETRY, MAX_CHECKPOINT_RETRY};
pub(crate) use handle::CloseOnDrop;
use handle::Slot;
pub use handle::{CallHandle, Rejection, Session};
pub use options::{
    EnvPolicy, ResetInfo, RunOptions, RunningCall, SessionOptions, SessionState, SessionStatus,
    DEFAULT_CHECKPOINT_AFTER, DEFAULT_CHECKPOINT_FILE_BYTES, DEFAULT_HIBERNATE_AFTER,
};
use reasons::{call_end_reason, exit_reason, reset_words, restore_cause};
pub use reasons::{CHECKPOINT_FAILED, KILLED_OVER_BUDGET, RESUMED_MOVED, RESUMED_RESTART};
use watch::Watcher;
pub use watch::{Watch, WatchedCall, MAX_WATCHERS};
use workers::{died_idle, retire};
pub(crate) use workers::{PoolSource, Registry};
