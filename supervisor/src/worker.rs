//! One worker process: spawn, hello, run calls with a deadline, interrupt,
//! kill. A worker is disposable; whoever owns it keeps anything that must
//! survive the worker (results, queue, metadata).
//!
//! The worker talks to its process through a [`Transport`] and hears from
//! it as [`LinkEvent`]s ([`io::LinkRx`]: a real process's socket, read by
//! the call loop itself, and what other threads send), so a call's state
//! machine (result, tool calls, cancel, deadline, kill) runs the same
//! against a fake worker in unit tests, whose events come over a channel.

use crate::call::{cpu_limit_result, mark_stopped, push_raw, validate_call, Stop};
use crate::error::{CheckpointError, Error, ValidateError};
use crate::events::EventSink;
use crate::ids;
use crate::process::{launch, OsTransport, Proc, TempDir, Transport};
use crate::tools::{CallContext, ToolCall};
use rvisor_protocol::bounds::{self, result_frame_limit};
use rvisor_protocol::{
    ErrorInfo, FromWorker, Outcome, RunRequest, RunResult, Segment, StateOutcome, StreamMode,
    ToWorker, WorkerHello, ENV_WORKER_FD, PROTOCOL_VERSION,
};
use rvisor_protocol::{ToolOutcome, DEFAULT_MAX_OUTPUT_BYTES, MAX_TOOL_RESULT_BYTES};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::call::CallOptions;
pub use crate::process::{locate_worker, ExitInfo, WorkerConfig};

mod io;
pub(crate) use io::{LinkRx, LinkTx};

/// What reaches a worker's call loop: frames from the worker, tool results
/// from handler threads, cancellation from other threads.
#[derive(Debug)]
pub(crate) enum LinkEvent {
    /// Raw output read from the worker's fds 1 and 2; always sent before
    /// the frame it precedes, so it is attached to the right result.
    Raw([Vec<u8>; 2]),
    /// Raw output was dropped on these streams (more than
    /// `bounds::RAW_BYTES` between two frames); sent before the next frame.
    RawDropped([bool; 2]),
    /// The worker announced a frame over the call's limit: the link
    /// stopped reading (it is closed) and the worker must be killed.
    Oversized(String),
    /// A frame, or the end of the link (`Err`).
    Frame(Result<FromWorker, String>),
    /// A tool handler's answer.
    ToolDone { call_id: u64, outcome: ToolOutcome },
    /// Cancel the call with this execution id. Read while that call runs,
    /// it interrupts it; read before (while the worker is idle, or busy
    /// with a checkpoint), it is kept for that call ([`Worker::run_call`]
    /// then sends nothing).
    Cancel(String),
}

/// Cancels a running call from another thread.
#[derive(Debug, Clone)]
pub struct Canceller {
    tx: LinkTx,
}

impl Canceller {
    /// Cancels the call with this execution id: if it runs, interrupt,
    /// and kill the worker if R does not answer within the grace period;
    /// if it is the next call of this worker, it is not sent. The result's
    /// outcome is `cancelled`.
    pub fn cancel(&self, execution_id: &str) {
        let _ = self.tx.send(LinkEvent::Cancel(execution_id.to_string()));
    }
}

/// Sends SIGINT to a worker from any thread (see [`Worker::interrupter`]).
#[derive(Clone)]
pub struct Interrupter {
    signal: Arc<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for Interrupter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interrupter").finish_non_exhaustive()
    }
}

impl Interrupter {
    /// Interrupts the running evaluation; R answers with outcome
    /// `interrupted` and keeps the session's state.
    pub fn interrupt(&self) {
        (self.signal)();
    }
}

/// Where a session's workers come from: the runner asks for one lazily,
/// and again after each reset. The supervisor's source takes them from the
/// pool; unit tests give workers over a fake transport.
pub(crate) trait WorkerSource: Send + 'static {
    /// A ready worker for the session's next generation.
    fn start(&mut self) -> Result<Worker, Error>;
    /// Forgets a worker that has ended or is being ended.
    fn forget(&mut self, w: &Worker);
    /// Forgets `w` when the returned function is called: a worker being
    /// ended on a thread of its own stays known (to be killed, its
    /// directory removed, if the process exits first) until it is gone.
    fn forget_later(&mut self, w: &Worker) -> Box<dyn FnOnce() + Send> {
        self.forget(w);
        Box::new(|| {})
    }
    /// Sees the code of each call the session is about to run, before a
    /// worker is started for it: a call naming a preloaded package makes
    /// this and later workers of the session come with the preloads.
    fn will_run(&mut self, _code: &str) {}
    /// A call in the worker has ended (after the first one the pool may
    /// refill the spare it was: `pool::RefillHold`).
    fn call_ended(&mut self) {}
    /// What worker `w`, being ended on a thread of its own after its
    /// session closed, waits for first (the pool's `after_burst`: not
    /// during a burst of new sessions).
    fn before_ending(&mut self, _w: &Worker) -> Box<dyn FnOnce() + Send> {
        Box::new(|| {})
    }
}

/// How a call is sent: its number, the events its caller follows, how
/// long the worker may poll for its next request after it (spin.rs).
struct Sending {
    seq: u64,
    stream: StreamMode,
    spin_us: u32,
}

/// A running worker.
#[derive(Debug)]
pub struct Worker {
    transport: Box<dyn Transport>,
    events: LinkRx,
    events_tx: LinkTx,
    /// Raw output that arrived and has not been attached to a result yet.
    raw: [Vec<u8>; 2],
    /// Raw output was dropped since the last result (per stream).
    raw_dropped: [bool; 2],
    /// The output cap of the call running or last run.
    call_cap: u64,
    /// The link has reported its end.
    link_closed: bool,
    /// A cancel read while no call ran, by execution id: a state, so the
    /// call it names is not sent (the message was already consumed).
    cancel_asked: Option<String>,
    hello: WorkerHello,
    startup: Duration,
    exited: bool,
    call_seq: u64,
    /// Its last call was answered within `spin::WINDOW` of being sent: the
    /// next one polls for its answer that long before sleeping.
    quick: bool,
    /// Forked into OS confinement (its files are under /proc/PID/root).
    pub(crate) confined: bool,
    /// Its cgroup's CPU time (ns) of itself and its children, if counted.
    pub(crate) cpu_usage: Option<PathBuf>,
    _tmp: TempDir,
}

impl Worker {
    /// Starts a worker process (exec, R starts from scratch) and waits until
    /// R is ready.
    pub fn spawn(cfg: &WorkerConfig) -> Result<Self, Error> {
        if cfg.confine.is_some() {
            return Err(Error::Startup(
                "confined workers are forked by the zygote, which is not running (see the \
                 supervisor's log for why it stopped)"
                    .into(),
            ));
        }
        let t0 = Instant::now();
        let (mut child, parent, tmp) = launch(cfg, ENV_WORKER_FD, &[], Stdio::piped())?;

        let (Some(out), Some(err)) = (child.stdout.take(), child.stderr.take()) else {
            return Err(Error::Startup(
                "the worker's output pipes are missing".into(),
            ));
        };
        let pipes = [OwnedFd::from(out), OwnedFd::from(err)];
        let remaining = cfg.startup_timeout.saturating_sub(t0.elapsed());
        Self::connect(Proc::Spawned(child), parent, pipes, tmp, remaining, t0)
    }

    /// Opens the link of a started worker process (its pipes' thread
    /// starts), then says hello and waits for R to be ready.
    pub(crate) fn connect(
        proc: Proc,
        parent: UnixStream,
        pipes: [OwnedFd; 2],
        tmp: TempDir,
        startup_timeout: Duration,
        t0: Instant,
    ) -> Result<Self, Error> {
        let reader = parent.try_clone().map_err(|source| Error::Io {
            what: "clone the worker socket",
            source,
        })?;
        let link = LinkRx::open(reader, pipes, result_frame_limit(DEFAULT_MAX_OUTPUT_BYTES))
            .map_err(|source| Error::Io {
                what: "open the worker's link",
                source,
            })?;
        let transport = OsTransport {
            proc,
            stream: parent,
        };
        Self::handshake(Box::new(transport), link, tmp, startup_timeout, t0)
    }

    /// Says hello over `transport` and waits (up to `startup_timeout`) for
    /// the worker's answer on `events`.
    pub(crate) fn handshake(
        transport: Box<dyn Transport>,
        (events_tx, events): (LinkTx, LinkRx),
        tmp: TempDir,
        startup_timeout: Duration,
        t0: Instant,
    ) -> Result<Self, Error> {
        let mut w = Worker {
            transport,
            events,
            events_tx,
            raw: [Vec::new(), Vec::new()],
            raw_dropped: [false; 2],
            call_cap: DEFAULT_MAX_OUTPUT_BYTES,
            link_closed: false,
            cancel_asked: None,
            hello: WorkerHello {
                protocol_version: 0,
                r_version: String::new(),
                pid: 0,
                r_tempdir: String::new(),
                startup_ms: 0.0,
            },
            startup: Duration::ZERO,
            exited: false,
            call_seq: 0,
            quick: true,
            confined: false,
            cpu_usage: None,
            _tmp: tmp,
        };
        w.transport
            .send(
                &ToWorker::Hello {
                    protocol_version: PROTOCOL_VERSION,
                },
                &[],
            )
            .map_err(|e| Error::Startup(format!("the worker closed its link at once ({e})")))?;
        let first = loop {
            match w.events.recv_timeout(Some(startup_timeout)) {
                Ok(LinkEvent::Raw(raw)) => w.keep_raw(raw),
                Ok(LinkEvent::Cancel(id)) => w.cancel_asked = Some(id),
                Ok(LinkEvent::Frame(f)) => break Ok(f),
                Ok(LinkEvent::Oversized(why)) => {
                    w.kill();
                    return Err(Error::Startup(why));
                }
                Ok(_) => break Ok(Err("unexpected event".to_string())),
                Err(e) => break Err(e),
            }
        };
        match first {
            Ok(Ok(FromWorker::Hello(h))) if h.protocol_version == PROTOCOL_VERSION => {
                w.hello = h;
            }
            Ok(Ok(FromWorker::Hello(h))) => {
                w.kill();
                return Err(Error::Startup(format!(
                    "protocol mismatch: worker speaks {}, supervisor {PROTOCOL_VERSION}",
                    h.protocol_version
                )));
            }
            Ok(Ok(FromWorker::Fatal { message })) => {
                w.kill();
                return Err(Error::Startup(message));
            }
            Ok(Ok(other)) => {
                w.kill();
                return Err(Error::Startup(format!(
                    "unexpected first message {other:?}"
                )));
            }
            Ok(Err(_)) | Err(RecvTimeoutError::Disconnected) => {
                let status = w.transport.wait();
                w.exited = true;
                let [o, e] = std::mem::take(&mut w.raw);
                return Err(Error::Startup(format!(
                    "the worker exited during start-up ({}){}",
                    status
                        .map(|s| s.describe())
                        .unwrap_or_else(|| "status unknown".into()),
                    printed(&o, &e)
                )));
            }
            Err(RecvTimeoutError::Timeout) => {
                w.kill();
                return Err(Error::StartupTimeout(startup_timeout));
            }
        }
        w.startup = t0.elapsed();
        Ok(w)
    }

    /// What the worker said when it became ready.
    pub fn hello(&self) -> &WorkerHello {
        &self.hello
    }

    /// Time from spawn to ready.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// The worker's private temporary directory (removed when it ends).
    pub fn temp_dir(&self) -> &Path {
        self._tmp.path()
    }

    /// The worker's process id.
    pub fn pid(&self) -> u32 {
        self.transport.pid()
    }

    /// Whether the worker was forked from the zygote.
    pub fn is_forked(&self) -> bool {
        self.transport.is_forked()
    }

    /// Whether the worker process has ended.
    pub fn is_alive(&mut self) -> bool {
        self.exit_status().is_none() && !self.exited
    }

    /// How the worker process ended, or `None` while it runs.
    pub fn exit_status(&mut self) -> Option<ExitInfo> {
        let status = self.transport.try_wait();
        if status.is_some() {
            // Reaped: its pid may be reused, so never signal it again.
            self.exited = true;
        }
        status
    }

    /// A handle that can interrupt this worker from another thread while a
    /// call runs. Use it only while the worker is alive (its pid could be
    /// reused once the worker has been reaped).
    pub fn interrupter(&self) -> Interrupter {
        Interrupter {
            signal: self.transport.interrupt_handle(),
        }
    }

    /// Sends SIGINT: R ends the running evaluation, keeping its state.
    pub fn interrupt(&self) {
        // Never signal a reaped process: its pid may be reused.
        if !self.exited {
            self.transport.interrupt(None);
        }
    }

    /// Interrupts call `seq` only (see the worker's interrupt.rs): a signal
    /// that overtakes its call waits for it, a late one is dropped.
    fn interrupt_call(&self, seq: u64) {
        if !self.exited {
            self.transport.interrupt(Some(seq));
        }
    }

    /// Ends a worker that will not be used again: SIGKILL and removal of its
    /// temporary directory now (so nothing it wrote outlives this call),
    /// reaping on a thread of its own (a forked worker's end is reported by
    /// the zygote a little later).
    pub fn discard(mut self) {
        if !self.exited {
            self.transport.kill();
        }
        self._tmp.remove_now();
        let spawned = std::thread::Builder::new()
            .name("rvisor-discard".into())
            .spawn(move || drop(self));
        drop(spawned); // without a thread, the worker was reaped here
    }

    /// Kills the worker's process group and reaps it.
    pub fn kill(&mut self) {
        if self.exited {
            return;
        }
        self.transport.kill();
        let _ = self.transport.wait();
        self.exited = true;
    }

    /// Runs `code` and returns its result. Never fails: every problem
    /// (timeout, crash, broken link) is a result with its outcome.
    pub fn run(&mut self, code: &str, opts: &CallOptions) -> RunResult {
        self.run_call(ids::execution_id(), code, opts, &CallContext::default())
    }

    /// [`Worker::run`] with a caller-chosen execution id.
    pub fn run_with_id(
        &mut self,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
    ) -> RunResult {
        self.run_call(execution_id, code, opts, &CallContext::default())
    }

    /// A handle that cancels the call with a given execution id from any
    /// thread (see [`Canceller::cancel`]).
    pub fn canceller(&self) -> Canceller {
        Canceller {
            tx: self.events_tx.clone(),
        }
    }

    /// Runs one call with tools and cancellation: a cancel (through
    /// `ctx.cancel` or a [`Canceller`]) that came before the call was sent
    /// means it is not sent, and its result is `cancelled`.
    pub fn run_call(
        &mut self,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
    ) -> RunResult {
        self.run_call_with_events(execution_id, code, opts, ctx, None)
    }

    /// [`Worker::run_call`], handing the call's events to `events` while
    /// it runs (the worker sends those its mode asks for; see
    /// [`crate::EventSink`]). The result is the same as without events.
    pub fn run_call_with_events(
        &mut self,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
        events: Option<&EventSink>,
    ) -> RunResult {
        if let Err(e) = validate_call(code, opts) {
            return RunResult::failed(execution_id, code.into(), Outcome::Rejected, e.to_string());
        }
        if self.exited {
            return RunResult::failed(
                execution_id,
                code.into(),
                Outcome::WorkerFailed,
                "the worker is no longer running".into(),
            );
        }
        // A cancel is a state, not only a message: a token cancelled (or a
        // cancel kept) before the call is sent means it is not sent, and
        // the token's hook wakes the call loop once it runs. The token is
        // read again after the hook is set, so a cancel between the two
        // is not missed.
        let token = ctx.cancel.as_ref();
        let cancelled = || token.is_some_and(crate::CancelToken::is_cancelled);
        let kept = self
            .cancel_asked
            .take()
            .is_some_and(|id| id == execution_id);
        let mut before = kept || cancelled();
        if let (false, Some(t)) = (before, token) {
            let (tx, id) = (self.events_tx.clone(), execution_id.clone());
            t.on_cancel(move || {
                let _ = tx.send(LinkEvent::Cancel(id));
            });
            before = cancelled();
        }
        if before {
            if let Some(t) = token {
                t.clear();
            }
            return RunResult::failed(
                execution_id,
                code.into(),
                Outcome::Cancelled,
                "cancelled before it ran".into(),
            );
        }
        self.call_seq += 1;
        let seq = self.call_seq;
        let mode = events.map_or(StreamMode::Off, EventSink::mode);
        // Polling instead of sleeping while a CPU is spare (spin.rs).
        let flight = crate::spin::Flight::start();
        let spare = flight.spare();
        let sent = Instant::now();
        let how = Sending {
            seq,
            stream: mode,
            spin_us: flight.spin_us(),
        };
        let res = match self.send_call(&how, &execution_id, code, opts, ctx) {
            Ok(()) => {
                if spare && self.quick {
                    self.events.poll_until(Some(sent + crate::spin::WINDOW));
                }
                let res = self.call_loop(seq, execution_id, code, opts, ctx, events);
                self.events.poll_until(None);
                self.quick = sent.elapsed() <= crate::spin::WINDOW;
                res
            }
            Err(failed) => *failed,
        };
        drop(flight);
        if let Some(t) = token {
            t.clear();
        }
        res
    }

    /// Sends call `seq`, with its tables as open files (a confined worker
    /// cannot see the store). `Err`: the call's result, nothing ran.
    fn send_call(
        &mut self,
        how: &Sending,
        execution_id: &str,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
    ) -> Result<(), Box<RunResult>> {
        let refuse = |outcome, message| {
            Box::new(RunResult::failed(
                execution_id.to_string(),
                code.into(),
                outcome,
                message,
            ))
        };
        if ctx.tables.len() > rvisor_protocol::fdpass::MAX_FDS {
            return Err(refuse(
                Outcome::Rejected,
                format!(
                    "{} tables given; at most {} can be passed to one call",
                    ctx.tables.len(),
                    rvisor_protocol::fdpass::MAX_FDS
                ),
            ));
        }
        let mut files = Vec::with_capacity(ctx.tables.len());
        for (name, path) in &ctx.tables {
            match std::fs::File::open(path) {
                Ok(f) => files.push(f),
                Err(e) => {
                    return Err(refuse(
                        Outcome::Error,
                        format!("the data for '{name}' could not be opened ({e}); nothing ran"),
                    ))
                }
            }
        }
        // The result frame may be at most this large; a worker that sends
        // more is killed (see `io::SockSide::read`).
        self.call_cap = opts.max_output_bytes;
        self.raw_dropped = [false; 2];
        self.events.set_frame_limit(
            result_frame_limit(opts.max_output_bytes)
                .max(result_frame_limit(DEFAULT_MAX_OUTPUT_BYTES)),
        );
        let req = RunRequest {
            seq: how.seq,
            execution_id: execution_id.to_string(),
            code: crate::call::unix_newlines(code).into_owned(),
            plot_width: opts.plot_width,
            plot_height: opts.plot_height,
            max_output_bytes: opts.max_output_bytes,
            cpu_limit_seconds: opts.cpu_limit.map(|d| d.as_secs().max(1)),
            working_dir: opts.working_dir.as_ref().map(|p| p.display().to_string()),
            tools: ctx.tools.iter().map(|t| t.name.clone()).collect(),
            variables: ctx.variables.clone(),
            tables: ctx.tables.iter().map(|(n, _)| n.clone()).collect(),
            stream: how.stream,
            display: opts.display,
            spin_us: how.spin_us,
        };
        let fds: Vec<std::os::fd::RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        let sent = self.transport.send(&ToWorker::Run(req), &fds);
        drop(files);
        sent.map_err(|e| {
            Box::new(self.dead_result(
                execution_id.to_string(),
                code,
                format!("failed to send the call ({e})"),
            ))
        })
    }

    /// A sent call's state machine: waits for its result while answering
    /// tool calls, and turns a deadline or a cancel into a tagged interrupt,
    /// then (after the grace period) into a kill.
    fn call_loop(
        &mut self,
        seq: u64,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
        events: Option<&EventSink>,
    ) -> RunResult {
        let started = Instant::now();
        let deadline = opts.timeout.map(|t| started + t);
        // A CPU limit counts the processes the call starts too, when the
        // worker's cgroup keeps the account (RLIMIT_CPU is per process).
        let cpu_account = match (opts.cpu_limit, &self.cpu_usage) {
            (Some(limit), Some(f)) => read_cpu_ns(f).map(|at_start| (f.clone(), at_start, limit)),
            _ => None,
        };
        // Set once SIGINT was sent: why, and when to give up on R.
        let mut stopping: Option<(Stop, Instant)> = None;
        loop {
            let limit_at = match (stopping, deadline) {
                (Some((_, kill_at)), _) => Some(kill_at),
                (None, d) => d,
            };
            let until = match (&cpu_account, limit_at) {
                (Some(_), Some(t)) => Some(t.min(Instant::now() + CPU_POLL)),
                (Some(_), None) => Some(Instant::now() + CPU_POLL),
                (None, t) => t,
            };
            let event = self
                .events
                .recv_timeout(until.map(|t| t.saturating_duration_since(Instant::now())));
            match event {
                Ok(LinkEvent::Raw(raw)) => self.keep_raw(raw),
                Ok(LinkEvent::RawDropped(d)) => self.note_dropped(d),
                Ok(LinkEvent::Oversized(why)) => {
                    self.kill();
                    return self.dead_result(execution_id, code, why);
                }
                Ok(LinkEvent::Frame(Ok(FromWorker::Result(res)))) => {
                    let mut res = *res;
                    let used = res.usage.output_bytes;
                    self.attach_raw(&mut res, used);
                    if let (Outcome::Interrupted, Some((why, _))) = (res.outcome, stopping) {
                        mark_stopped(&mut res, why, opts.timeout, false);
                    }
                    if res.outcome == Outcome::WorkerExited {
                        let _ = self.transport.wait();
                        self.exited = true;
                    }
                    return res;
                }
                Ok(LinkEvent::Frame(Ok(FromWorker::ToolCall {
                    execution_id: eid,
                    call_id,
                    name,
                    args,
                }))) => {
                    if eid != execution_id || stopping.is_some() {
                        continue; // the call is ending; R will not wait for this
                    }
                    self.start_tool(ctx, eid, call_id, name, args);
                }
                Ok(LinkEvent::Frame(Ok(FromWorker::Events {
                    execution_id: eid,
                    events: batch,
                }))) => {
                    if let (Some(sink), true) = (events, eid == execution_id) {
                        for e in batch {
                            sink.emit(e);
                        }
                    }
                }
                Ok(LinkEvent::ToolDone { call_id, outcome }) => {
                    // Sent while stopping too: R may still wait for it (an
                    // interrupt that came before it started waiting); a
                    // result it no longer waits for is skipped.
                    let msg = ToWorker::ToolResult { call_id, outcome };
                    if let Err(e) = self.transport.send(&msg, &[]) {
                        if stopping.is_none() {
                            return self.dead_result(
                                execution_id,
                                code,
                                format!("failed to send a tool result ({e})"),
                            );
                        }
                    }
                }
                Ok(LinkEvent::Cancel(id)) => {
                    if id == execution_id && stopping.is_none() {
                        self.interrupt_call(seq);
                        stopping = Some((Stop::Cancel, Instant::now() + opts.grace));
                    }
                }
                Ok(LinkEvent::Frame(Ok(other))) => {
                    self.kill();
                    return self.dead_result(
                        execution_id,
                        code,
                        format!("the worker broke the protocol (sent {other:?})"),
                    );
                }
                Ok(LinkEvent::Frame(Err(_))) | Err(RecvTimeoutError::Disconnected) => {
                    self.link_closed = true;
                    let mut res = self.dead_result(execution_id, code, String::new());
                    if let Some((why, _)) = stopping {
                        // We were stopping it anyway: report why, not the crash.
                        mark_stopped(&mut res, why, opts.timeout, true);
                    }
                    return res;
                }
                Err(RecvTimeoutError::Timeout) => {
                    if let Some((f, at_start, limit)) = &cpu_account {
                        let used = read_cpu_ns(f)
                            .unwrap_or(*at_start)
                            .saturating_sub(*at_start);
                        if stopping.is_none() && u128::from(used) > limit.as_nanos() {
                            // Over the limit across its processes: no grace.
                            let (raw, cut) = self.kill_and_collect();
                            let mut res =
                                cpu_limit_result(execution_id, code, &self.hello.r_version, raw);
                            if cut {
                                res.mark_truncated("console");
                            }
                            res.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
                            return res;
                        }
                        if limit_at.is_none_or(|t| Instant::now() < t) {
                            continue; // only the CPU poll
                        }
                    }
                    let Some((why, _)) = stopping else {
                        self.interrupt_call(seq);
                        stopping = Some((Stop::Timeout, Instant::now() + opts.grace));
                        continue;
                    };
                    // R did not answer the interrupt (tight C code): kill.
                    let ([o, e], cut) = self.kill_and_collect();
                    let mut res = RunResult::empty(execution_id, code.into());
                    res.r_version = self.hello.r_version.clone();
                    push_raw(&mut res, o, e);
                    if cut {
                        res.mark_truncated("console");
                    }
                    mark_stopped(&mut res, why, opts.timeout, true);
                    res.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
                    return res;
                }
            }
        }
    }

    /// Kills the worker and returns the raw output it wrote on its way out
    /// (within the call's output cap) and whether some was cut.
    fn kill_and_collect(&mut self) -> ([Vec<u8>; 2], bool) {
        self.kill();
        self.collect_until_closed(Duration::from_secs(1));
        self.take_raw(0)
    }

    /// Takes the raw output kept for the current call, cut to what is left
    /// of its output cap after `used` bytes (at a character boundary), and
    /// whether some was cut or dropped.
    fn take_raw(&mut self, used: u64) -> ([Vec<u8>; 2], bool) {
        let raw = std::mem::take(&mut self.raw);
        let mut cut = std::mem::take(&mut self.raw_dropped).contains(&true);
        let mut room = usize::try_from(self.call_cap.saturating_sub(used)).unwrap_or(usize::MAX);
        let kept = raw.map(|bytes| {
            if bytes.len() <= room {
                room -= bytes.len();
                return bytes;
            }
            cut = true;
            let text = String::from_utf8_lossy(&bytes[..room.saturating_add(4).min(bytes.len())]);
            let (k, _) = bounds::cut(&text, room);
            room -= k.len();
            k.as_bytes().to_vec()
        });
        (kept, cut)
    }

    /// Appends the call's raw output to its result (after the `used` bytes
    /// the worker counted), marking a cut.
    fn attach_raw(&mut self, res: &mut RunResult, used: u64) {
        let ([o, e], cut) = self.take_raw(used);
        res.usage.output_bytes += (o.len() + e.len()) as u64;
        push_raw(res, o, e);
        if cut {
            res.mark_truncated("console");
            if res.outcome == Outcome::Complete {
                res.outcome = Outcome::OutputTruncated;
            }
        }
    }

    /// Notes raw output the link dropped.
    fn note_dropped(&mut self, dropped: [bool; 2]) {
        for (mine, d) in self.raw_dropped.iter_mut().zip(dropped) {
            *mine |= d;
        }
    }

    /// Runs a tool handler on its own thread; its answer comes back as a
    /// [`LinkEvent::ToolDone`], so a slow handler never holds up deadlines.
    fn start_tool(
        &self,
        ctx: &CallContext,
        execution_id: String,
        call_id: u64,
        name: String,
        args: serde_json::Value,
    ) {
        let tx = self.events_tx.clone();
        let Some(tool) = ctx.tools.iter().find(|t| t.name == name).cloned() else {
            let known: Vec<&str> = ctx.tools.iter().map(|t| t.name.as_str()).collect();
            let msg = format!(
                "unknown tool '{name}'; this session's tools: {}",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            );
            let _ = tx.send(LinkEvent::ToolDone {
                call_id,
                outcome: ToolOutcome::Error(msg),
            });
            return;
        };
        let call = ToolCall {
            session_id: ctx.session_id.clone(),
            execution_id,
            name,
            args,
            worker_temp_dir: self.temp_dir().to_path_buf(),
            worker_root: self
                .confined
                .then(|| format!("/proc/{}/root", self.pid()).into()),
        };
        let spawned = std::thread::Builder::new()
            .name("rvisor-tool".into())
            .spawn(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    (tool.handler)(&call)
                }));
                let outcome = match result {
                    Ok(Ok(v)) => {
                        let size = serde_json::to_vec(&v)
                            .map(|b| b.len())
                            .unwrap_or(usize::MAX);
                        if size > MAX_TOOL_RESULT_BYTES {
                            ToolOutcome::Error(format!(
                                "the result of tool '{}' is {size} bytes, over the limit of \
                             {MAX_TOOL_RESULT_BYTES} bytes",
                                call.name
                            ))
                        } else {
                            ToolOutcome::Value(v)
                        }
                    }
                    Ok(Err(msg)) => {
                        ToolOutcome::Error(format!("tool '{}' failed: {msg}", call.name))
                    }
                    Err(_) => ToolOutcome::Error(format!(
                        "tool '{}' failed: its handler panicked",
                        call.name
                    )),
                };
                let _ = tx.send(LinkEvent::ToolDone { call_id, outcome });
            });
        if spawned.is_err() {
            let _ = self.events_tx.send(LinkEvent::ToolDone {
                call_id,
                outcome: ToolOutcome::Error("failed to start a thread for the tool call".into()),
            });
        }
    }

    /// Checks `script` without running it (see `ToWorker::Validate`).
    pub fn validate(
        &mut self,
        script: &str,
        forbidden: &[String],
        max_nesting_depth: u32,
        style: &str,
        timeout: Duration,
    ) -> Result<serde_json::Value, ValidateError> {
        if self.exited || self.link_closed() {
            return Err(ValidateError::NotRunning);
        }
        let msg = ToWorker::Validate {
            script: crate::call::unix_newlines(script).into_owned(),
            forbidden: forbidden.to_vec(),
            max_nesting_depth,
            style: style.to_string(),
        };
        self.transport
            .send(&msg, &[])
            .map_err(ValidateError::Send)?;
        let end = Instant::now() + timeout;
        loop {
            match self
                .events
                .recv_timeout(Some(end.saturating_duration_since(Instant::now())))
            {
                Ok(LinkEvent::Raw(raw)) => self.keep_raw(raw),
                Ok(LinkEvent::Frame(Ok(FromWorker::Validation { json }))) => {
                    self.raw = [Vec::new(), Vec::new()];
                    return serde_json::from_str(&json)
                        .map_err(|e| ValidateError::BadFindings(e.to_string()));
                }
                Ok(LinkEvent::Frame(Err(e))) => {
                    self.link_closed = true;
                    return Err(ValidateError::Ended(e));
                }
                Ok(LinkEvent::Oversized(why)) => {
                    self.kill();
                    self.link_closed = true;
                    return Err(ValidateError::Ended(why));
                }
                Ok(LinkEvent::Cancel(id)) => self.cancel_asked = Some(id),
                Ok(_) => {}
                Err(_) => {
                    self.kill();
                    return Err(ValidateError::Timeout);
                }
            }
        }
    }

    /// Has the worker write its session's state (see
    /// `ToWorker::Checkpoint`) into `out`, at most `max_bytes` of it, and
    /// returns the checkpoint's length. The worker writes into a pipe (so
    /// a confined worker writes without seeing any host path, and its
    /// file-size limit does not apply) that a thread of this call copies
    /// into `out` as it comes, in the kernel, stopping one byte past
    /// `max_bytes`: a checkpoint over it is `CheckpointError::TooLarge`
    /// (with a message the caller replaces by its store's refusal) as soon
    /// as it passes. The worker is killed if it does not answer within
    /// `timeout`.
    pub fn checkpoint(
        &mut self,
        working_dir: Option<&Path>,
        max_file_bytes: u64,
        out: &std::fs::File,
        max_bytes: u64,
        timeout: Duration,
    ) -> Result<u64, CheckpointError> {
        use std::io::{Read, Seek};
        let fail = |what: &str, e: std::io::Error| {
            CheckpointError::Worker(format!("could not {what} for the checkpoint ({e})"))
        };
        let (reader, writer) = pipe().map_err(|e| fail("create a pipe", e))?;
        let mut sink = out
            .try_clone()
            .map_err(|e| fail("open the staging file", e))?;
        sink.rewind()
            .and_then(|_| sink.set_len(0))
            .map_err(|e| fail("empty the staging file", e))?;
        // A File over the pipe: std copies from it with splice(2).
        let mut source = std::fs::File::from(reader);
        let limit = max_bytes.saturating_add(1);
        let (tx, copied) = mpsc::channel();
        std::thread::Builder::new()
            .name("rvisor-ckpt-read".into())
            .spawn(move || {
                let n = std::io::copy(&mut (&mut source).take(limit), &mut sink);
                // Dropping the read end here makes a worker still writing
                // past the cap get EPIPE.
                drop(source);
                let _ = tx.send(n);
            })
            .map_err(|e| fail("start the thread that reads it", e))?;
        let msg = ToWorker::Checkpoint {
            working_dir: working_dir.map(|p| p.display().to_string()),
            max_file_bytes,
            max_bytes,
        };
        let started = Instant::now();
        let answer = self.state_exchange(&msg, writer.as_raw_fd(), timeout);
        // Our copy of the write end must go, or the reader never sees the
        // end of the file.
        drop(writer);
        // The worker closes its end when it answers (or when it dies);
        // one that holds it open past the deadline is killed.
        let left = timeout
            .saturating_sub(started.elapsed())
            .max(Duration::from_secs(1));
        let n = match copied.recv_timeout(left) {
            Ok(n) => n,
            Err(_) => {
                self.kill();
                copied
                    .recv_timeout(Duration::from_secs(5))
                    .unwrap_or_else(|_| {
                        Err(std::io::Error::other(
                            "the worker kept the checkpoint's pipe open after it answered",
                        ))
                    })
            }
        };
        match (n, answer) {
            // Past the cap, or failed right at it (the worker stops there).
            (Ok(n), a) if n > max_bytes || (n == max_bytes && a.is_err()) => Err(
                CheckpointError::TooLarge(format!("the checkpoint passed {max_bytes} bytes")),
            ),
            (_, Err(why)) => Err(CheckpointError::Worker(why)),
            (Err(e), Ok(_)) => Err(fail("read the worker's pipe", e)),
            (Ok(n), Ok(_)) => Ok(n),
        }
    }

    /// Loads the checkpoint in `file` into this worker (before its first
    /// call). The worker gets a descriptor of it open for reading only,
    /// and reads the manifest from its tail, then the state.
    pub fn restore(
        &mut self,
        file: &std::fs::File,
        working_dir: Option<&Path>,
        timeout: Duration,
    ) -> Result<(), String> {
        // Its own, read-only open of the file (an anonymous file too can
        // be opened again through /proc); the descriptor as it is else.
        let own = std::fs::File::open(format!("/proc/self/fd/{}", file.as_raw_fd()));
        let fd = own.as_ref().map_or(file.as_raw_fd(), |f| f.as_raw_fd());
        let msg = ToWorker::Restore {
            working_dir: working_dir.map(|p| p.display().to_string()),
        };
        self.state_exchange(&msg, fd, timeout).map(|_| ())
    }

    /// Sends a checkpoint or restore request with descriptor `fd` attached
    /// and waits for its answer.
    fn state_exchange(
        &mut self,
        msg: &ToWorker,
        fd: std::os::fd::RawFd,
        timeout: Duration,
    ) -> Result<String, String> {
        if self.exited || self.link_closed() {
            return Err("the worker is not running".into());
        }
        self.transport
            .send(msg, &[fd])
            .map_err(|e| format!("could not send the request to the worker ({e})"))?;
        let end = Instant::now() + timeout;
        loop {
            match self
                .events
                .recv_timeout(Some(end.saturating_duration_since(Instant::now())))
            {
                Ok(LinkEvent::Raw(raw)) => self.keep_raw(raw),
                Ok(LinkEvent::Frame(Ok(
                    FromWorker::Checkpointed { outcome } | FromWorker::Restored { outcome },
                ))) => {
                    self.raw = [Vec::new(), Vec::new()];
                    return match outcome {
                        StateOutcome::Done(json) => Ok(json),
                        StateOutcome::Failed(why) => Err(why),
                    };
                }
                Ok(LinkEvent::Frame(Err(e))) => {
                    self.link_closed = true;
                    return Err(format!("the worker ended ({e})"));
                }
                Ok(LinkEvent::Oversized(why)) => {
                    self.kill();
                    self.link_closed = true;
                    return Err(why);
                }
                Ok(LinkEvent::Cancel(id)) => self.cancel_asked = Some(id),
                Ok(_) => {}
                Err(_) => {
                    self.kill();
                    return Err(format!(
                        "the worker did not answer within {} s and was killed",
                        timeout.as_secs_f64()
                    ));
                }
            }
        }
    }

    /// Asks the worker to exit and waits for it (kills it after `wait`).
    pub fn shutdown(mut self, wait: Duration) {
        let _ = self.transport.send(&ToWorker::Shutdown, &[]);
        let end = Instant::now() + wait;
        while Instant::now() < end {
            if self.transport.try_wait().is_some() {
                self.exited = true;
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        self.kill();
    }

    /// Keeps raw output for the next result (bounded).
    fn keep_raw(&mut self, raw: [Vec<u8>; 2]) {
        for ((mine, new), dropped) in self.raw.iter_mut().zip(raw).zip(&mut self.raw_dropped) {
            let room = bounds::RAW_BYTES.saturating_sub(mine.len());
            *dropped |= new.len() > room;
            mine.extend_from_slice(&new[..new.len().min(room)]);
        }
    }

    /// Waits (bounded) for the link to report its end,
    /// keeping the raw output that came with it.
    fn collect_until_closed(&mut self, wait: Duration) {
        let end = Instant::now() + wait;
        while !self.link_closed {
            match self
                .events
                .recv_timeout(Some(end.saturating_duration_since(Instant::now())))
            {
                Ok(LinkEvent::Raw(raw)) => self.keep_raw(raw),
                Ok(LinkEvent::RawDropped(d)) => self.note_dropped(d),
                Ok(LinkEvent::Frame(Err(_))) => self.link_closed = true,
                Ok(LinkEvent::Cancel(id)) => self.cancel_asked = Some(id),
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }

    /// Waits (bounded) for a dying worker's exit status.
    pub fn wait_exit(&mut self) -> ExitInfo {
        let st = self.transport.wait().unwrap_or(ExitInfo::UNKNOWN);
        self.exited = true;
        st
    }

    /// Whether the worker's link has closed while no call was running (the
    /// worker died while idle). Drains stale events of earlier calls.
    pub fn link_closed(&mut self) -> bool {
        while let Some(ev) = self.events.try_recv() {
            match ev {
                LinkEvent::Raw(raw) => self.keep_raw(raw),
                LinkEvent::RawDropped(d) => self.note_dropped(d),
                LinkEvent::Frame(Err(_)) => self.link_closed = true,
                LinkEvent::Oversized(_) => {
                    self.kill();
                    self.link_closed = true;
                }
                // Kept for the call it names (a session's runner checks
                // for a dead worker after taking a call from the queue).
                LinkEvent::Cancel(id) => self.cancel_asked = Some(id),
                _ => {}
            }
        }
        // The link may not have been read since the hang-up: ask the socket.
        self.link_closed || self.transport.peer_gone()
    }

    /// The result of a call whose worker went away.
    fn dead_result(&mut self, execution_id: String, code: &str, why: String) -> RunResult {
        self.collect_until_closed(Duration::from_secs(1));
        let status = self.transport.wait();
        self.exited = true;
        let ([o, e], cut) = self.take_raw(0);
        if status.is_some_and(|s| s.signal == Some(libc::SIGXCPU)) {
            let mut res = cpu_limit_result(execution_id, code, &self.hello.r_version, [o, e]);
            if cut {
                res.mark_truncated("console");
            }
            return res;
        }
        let (outcome, what) = match status {
            Some(s) if s.signal.is_some() => (Outcome::WorkerFailed, s.describe()),
            Some(s) => (Outcome::WorkerExited, s.describe()),
            None => (Outcome::WorkerFailed, "status unknown".into()),
        };
        let mut message = format!("the R worker ended during the call ({what})");
        if !why.is_empty() {
            message = format!("{message}: {why}");
        }
        let mut res = RunResult::empty(execution_id, code.into());
        res.r_version = self.hello.r_version.clone();
        push_raw(&mut res, o, e);
        if cut {
            res.mark_truncated("console");
        }
        res.push_segment(Segment::Stderr {
            text: format!("rvisor: {message}\n"),
        });
        res.outcome = outcome;
        res.success = false;
        res.error = Some(ErrorInfo::message(message));
        res
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How often a call with a CPU limit reads its cgroup's CPU account.
const CPU_POLL: Duration = Duration::from_millis(100);

/// A pipe, both ends closed on exec: (read end, write end).
fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    use std::os::fd::FromRawFd;
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into the array we own; on
    // success they are fresh and owned by nobody else.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created by pipe2 and are owned
    // here alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// CPU time (ns) in a cgroup's `cpuacct.usage`.
fn read_cpu_ns(f: &Path) -> Option<u64> {
    std::fs::read_to_string(f).ok()?.trim().parse().ok()
}

fn printed(out: &[u8], err: &[u8]) -> String {
    let mut s = String::new();
    for b in [out, err] {
        let t = String::from_utf8_lossy(b);
        let t = t.trim();
        if !t.is_empty() {
            s.push_str("; it printed: ");
            s.push_str(t);
        }
    }
    s
}
