//! One worker process: spawn, hello, run calls with a deadline, interrupt,
//! kill. A worker is disposable; whoever owns it keeps anything that must
//! survive the worker (results, queue, metadata).
//!
//! The worker talks to its process through a [`Transport`] and hears from
//! it through a channel of [`LinkEvent`]s (fed by the I/O thread of a real
//! process), so a call's state machine (result, tool calls, cancel,
//! deadline, kill) runs the same against a fake worker in unit tests.

use crate::call::{cpu_limit_result, mark_stopped, push_raw, validate_call, Stop};
use crate::error::{Error, ValidateError};
use crate::ids;
use crate::process::{launch, OsTransport, Proc, TempDir, Transport};
use crate::tools::{CallContext, ToolCall};
use rvisor_protocol::{
    read_frame, ErrorInfo, FromWorker, Outcome, RunRequest, RunResult, Segment, ToWorker,
    WorkerHello, ENV_WORKER_FD, PROTOCOL_VERSION,
};
use rvisor_protocol::{ToolOutcome, MAX_TOOL_RESULT_BYTES};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::call::CallOptions;
pub use crate::process::{locate_worker, ExitInfo, WorkerConfig};

/// What reaches a worker's call loop: frames from the worker, tool results
/// from handler threads, cancellation from other threads.
#[derive(Debug)]
pub(crate) enum LinkEvent {
    /// Raw output read from the worker's fds 1 and 2; always sent before
    /// the frame it precedes, so it is attached to the right result.
    Raw([Vec<u8>; 2]),
    /// A frame, or the end of the link (`Err`).
    Frame(Result<FromWorker, String>),
    /// A tool handler's answer.
    ToolDone { call_id: u64, outcome: ToolOutcome },
    /// Cancel the call with this execution id.
    Cancel(String),
}

/// Cancels a running call from another thread.
#[derive(Debug, Clone)]
pub struct Canceller {
    tx: Sender<LinkEvent>,
}

impl Canceller {
    /// Cancels the call with this execution id if it is the one running:
    /// interrupt, and kill the worker if R does not answer within the grace
    /// period. The result's outcome is `cancelled`.
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
}

/// A running worker.
#[derive(Debug)]
pub struct Worker {
    transport: Box<dyn Transport>,
    events: Receiver<LinkEvent>,
    events_tx: Sender<LinkEvent>,
    /// Raw output that arrived and has not been attached to a result yet.
    raw: [Vec<u8>; 2],
    /// The link's I/O thread has reported the end of the link.
    link_closed: bool,
    hello: WorkerHello,
    startup: Duration,
    exited: bool,
    call_seq: u64,
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

    /// Starts the I/O thread of a started worker process, then says hello
    /// and waits for R to be ready.
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
        let (events_tx, events) = mpsc::channel();
        let tx = events_tx.clone();
        std::thread::Builder::new()
            .name("rvisor-worker-io".into())
            .spawn(move || io_thread(reader, pipes, tx))
            .map_err(|source| Error::Io {
                what: "start the worker I/O thread",
                source,
            })?;
        let transport = OsTransport {
            proc,
            stream: parent,
        };
        Self::handshake(
            Box::new(transport),
            (events_tx, events),
            tmp,
            startup_timeout,
            t0,
        )
    }

    /// Says hello over `transport` and waits (up to `startup_timeout`) for
    /// the worker's answer on `events`.
    pub(crate) fn handshake(
        transport: Box<dyn Transport>,
        (events_tx, events): (Sender<LinkEvent>, Receiver<LinkEvent>),
        tmp: TempDir,
        startup_timeout: Duration,
        t0: Instant,
    ) -> Result<Self, Error> {
        let mut w = Worker {
            transport,
            events,
            events_tx,
            raw: [Vec::new(), Vec::new()],
            link_closed: false,
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
            match w.events.recv_timeout(startup_timeout) {
                Ok(LinkEvent::Raw(raw)) => w.keep_raw(raw),
                Ok(LinkEvent::Frame(f)) => break Ok(f),
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
        let _ = std::fs::remove_dir_all(self._tmp.path());
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

    /// Runs one call with tools and cancellation.
    pub fn run_call(
        &mut self,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
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
        self.call_seq += 1;
        let seq = self.call_seq;
        if let Err(failed) = self.send_call(seq, &execution_id, code, opts, ctx) {
            return *failed;
        }
        self.call_loop(seq, execution_id, code, opts, ctx)
    }

    /// Sends call `seq`, with its tables as open files (a confined worker
    /// cannot see the store). `Err`: the call's result, nothing ran.
    fn send_call(
        &mut self,
        seq: u64,
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
        let req = RunRequest {
            seq,
            execution_id: execution_id.to_string(),
            code: code.to_string(),
            plot_width: opts.plot_width,
            plot_height: opts.plot_height,
            max_output_bytes: opts.max_output_bytes,
            cpu_limit_seconds: opts.cpu_limit.map(|d| d.as_secs().max(1)),
            working_dir: opts.working_dir.as_ref().map(|p| p.display().to_string()),
            tools: ctx.tools.iter().map(|t| t.name.clone()).collect(),
            variables: ctx.variables.clone(),
            tables: ctx.tables.iter().map(|(n, _)| n.clone()).collect(),
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
            let event = match until {
                Some(t) => self
                    .events
                    .recv_timeout(t.saturating_duration_since(Instant::now())),
                None => self
                    .events
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected),
            };
            match event {
                Ok(LinkEvent::Raw(raw)) => self.keep_raw(raw),
                Ok(LinkEvent::Frame(Ok(FromWorker::Result(res)))) => {
                    let mut res = *res;
                    let [o, e] = std::mem::take(&mut self.raw);
                    push_raw(&mut res, o, e);
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
                            let raw = self.kill_and_collect();
                            let mut res =
                                cpu_limit_result(execution_id, code, &self.hello.r_version, raw);
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
                    let [o, e] = self.kill_and_collect();
                    let mut res = RunResult::empty(execution_id, code.into());
                    res.r_version = self.hello.r_version.clone();
                    push_raw(&mut res, o, e);
                    mark_stopped(&mut res, why, opts.timeout, true);
                    res.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
                    return res;
                }
            }
        }
    }

    /// Kills the worker and returns the raw output it wrote on its way out.
    fn kill_and_collect(&mut self) -> [Vec<u8>; 2] {
        self.kill();
        self.collect_until_closed(Duration::from_secs(1));
        std::mem::take(&mut self.raw)
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
            script: script.to_string(),
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
                .recv_timeout(end.saturating_duration_since(Instant::now()))
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
                Ok(_) => {}
                Err(_) => {
                    self.kill();
                    return Err(ValidateError::Timeout);
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
        for (mine, new) in self.raw.iter_mut().zip(raw) {
            let room = MAX_RAW_BYTES.saturating_sub(mine.len());
            mine.extend_from_slice(&new[..new.len().min(room)]);
        }
    }

    /// Waits (bounded) for the I/O thread to report the end of the link,
    /// keeping the raw output that came with it.
    fn collect_until_closed(&mut self, wait: Duration) {
        let end = Instant::now() + wait;
        while !self.link_closed {
            match self
                .events
                .recv_timeout(end.saturating_duration_since(Instant::now()))
            {
                Ok(LinkEvent::Raw(raw)) => self.keep_raw(raw),
                Ok(LinkEvent::Frame(Err(_))) => self.link_closed = true,
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
        while let Ok(ev) = self.events.try_recv() {
            match ev {
                LinkEvent::Raw(raw) => self.keep_raw(raw),
                LinkEvent::Frame(Err(_)) => self.link_closed = true,
                _ => {}
            }
        }
        // The I/O thread may not have seen the hang-up yet: ask the link.
        self.link_closed || self.transport.peer_gone()
    }

    /// The result of a call whose worker went away.
    fn dead_result(&mut self, execution_id: String, code: &str, why: String) -> RunResult {
        self.collect_until_closed(Duration::from_secs(1));
        let status = self.transport.wait();
        self.exited = true;
        let [o, e] = std::mem::take(&mut self.raw);
        if status.is_some_and(|s| s.signal == Some(libc::SIGXCPU)) {
            return cpu_limit_result(execution_id, code, &self.hello.r_version, [o, e]);
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

/// CPU time (ns) in a cgroup's `cpuacct.usage`.
fn read_cpu_ns(f: &Path) -> Option<u64> {
    std::fs::read_to_string(f).ok()?.trim().parse().ok()
}

/// Most raw output kept per stream and call.
const MAX_RAW_BYTES: usize = 16 * 1024 * 1024;

/// Reads everything available from a non-blocking pipe into `buf`.
/// Returns false once the pipe is closed.
fn drain_pipe(fd: &OwnedFd, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 16 * 1024];
    loop {
        // SAFETY: read(2) into our buffer from a descriptor we own.
        let n = unsafe { libc::read(fd.as_raw_fd(), chunk.as_mut_ptr().cast(), chunk.len()) };
        if n > 0 {
            let room = MAX_RAW_BYTES.saturating_sub(buf.len());
            buf.extend_from_slice(&chunk[..(n as usize).min(room)]);
            continue;
        }
        if n == 0 {
            return false;
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return true,
            _ => return false,
        }
    }
}

/// A pollfd for a pipe that is still open (else one poll ignores).
fn pipe_pollfd(fd: &OwnedFd, open: bool) -> libc::pollfd {
    libc::pollfd {
        fd: if open { fd.as_raw_fd() } else { -1 },
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Drains both pipes that are still open, noting those that closed.
fn drain_open(pipes: &[OwnedFd; 2], open: &mut [bool; 2], bufs: &mut [Vec<u8>; 2]) {
    for i in 0..2 {
        if open[i] {
            open[i] = drain_pipe(&pipes[i], &mut bufs[i]);
        }
    }
}

/// The one thread that reads a worker's socket and its stdout/stderr
/// pipes. Reading all three in one thread is what makes raw output land in
/// the right result without any marker: everything the call wrote to its
/// fds (itself, or child processes it waited for) is in the pipes before
/// the worker sends the result frame, so draining the pipes right after
/// reading that frame gets all of it.
fn io_thread(mut sock: UnixStream, pipes: [OwnedFd; 2], tx: Sender<LinkEvent>) {
    for p in &pipes {
        // SAFETY: fcntl on descriptors we own.
        unsafe {
            let flags = libc::fcntl(p.as_raw_fd(), libc::F_GETFL);
            libc::fcntl(p.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
    }
    let mut open = [true, true];
    let mut bufs: [Vec<u8>; 2] = [Vec::new(), Vec::new()];
    let flush = |bufs: &mut [Vec<u8>; 2], tx: &Sender<LinkEvent>| {
        if !bufs[0].is_empty() || !bufs[1].is_empty() {
            let _ = tx.send(LinkEvent::Raw(std::mem::take(bufs)));
        }
    };
    loop {
        let mut fds = [
            libc::pollfd {
                fd: sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            pipe_pollfd(&pipes[0], open[0]),
            pipe_pollfd(&pipes[1], open[1]),
        ];
        // SAFETY: poll on three pollfds we own (negative fds are ignored).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 3, -1) };
        if n < 0 {
            continue; // EINTR
        }
        for i in 0..2 {
            if open[i] && fds[i + 1].revents != 0 {
                open[i] = drain_pipe(&pipes[i], &mut bufs[i]);
            }
        }
        // A pipe flood must not grow without bound between frames.
        if bufs[0].len() + bufs[1].len() > 1024 * 1024 {
            flush(&mut bufs, &tx);
        }
        if fds[0].revents == 0 {
            continue;
        }
        match read_frame::<_, FromWorker>(&mut sock) {
            Ok(frame) => {
                drain_open(&pipes, &mut open, &mut bufs);
                flush(&mut bufs, &tx);
                if tx.send(LinkEvent::Frame(Ok(frame))).is_err() {
                    return;
                }
            }
            Err(e) => {
                // The worker is gone: collect what it printed on its way
                // out (a crash report), waiting briefly for the pipes to
                // close (a background child may hold them open).
                let end = Instant::now() + Duration::from_millis(200);
                while open.iter().any(|o| *o) {
                    let left = end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    let mut pfds = [
                        pipe_pollfd(&pipes[0], open[0]),
                        pipe_pollfd(&pipes[1], open[1]),
                    ];
                    // SAFETY: poll on two pollfds we own.
                    unsafe { libc::poll(pfds.as_mut_ptr(), 2, left.as_millis().max(1) as i32) };
                    drain_open(&pipes, &mut open, &mut bufs);
                }
                flush(&mut bufs, &tx);
                let _ = tx.send(LinkEvent::Frame(Err(e.to_string())));
                return;
            }
        }
    }
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
