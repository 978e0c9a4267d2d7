//! One worker process: spawn, hello, run calls with a deadline, interrupt,
//! kill. A worker is disposable; whoever owns it keeps anything that must
//! survive the worker (results, queue, metadata).

use crate::tools::{CallContext, ToolCall};
use crate::{ids, Error};
use rvisor_protocol::{
    read_frame, write_frame, ErrorInfo, FromWorker, Outcome, RunRequest, RunResult, Segment,
    ToWorker, WorkerHello, DEFAULT_MAX_OUTPUT_BYTES, DEFAULT_PLOT_HEIGHT, DEFAULT_PLOT_WIDTH,
    ENV_WORKER_FD, PROTOCOL_VERSION,
};
use rvisor_protocol::{ToolOutcome, MAX_TOOL_RESULT_BYTES};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// Environment variables a worker inherits from the host: those that locate
/// programs, libraries, locales and time zones. Everything else (secrets!)
/// stays in the host.
const INHERITED_ENV: &[&str] = &[
    "PATH", "HOME", "LANG", "LANGUAGE", "TZ", "R_HOME", "USER", "LOGNAME",
];
const INHERITED_ENV_PREFIXES: &[&str] = &["LC_", "R_LIBS"];

/// Stack limit set for the worker before exec (see the worker's main.rs).
const WORKER_STACK_BYTES: u64 = 64 * 1024 * 1024;

/// How to start workers.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The `rvisor-worker` binary.
    pub worker_bin: Option<PathBuf>,
    /// How long R may take to start.
    pub startup_timeout: Duration,
    /// Extra environment variable names R code may read.
    pub env: Vec<String>,
    /// Pass the host's whole environment (explicit opt-in; secrets included).
    pub inherit_env: bool,
    /// R library directories, in order (set as `R_LIBS`).
    pub libpath: Vec<PathBuf>,
    /// Parent of the per-worker temporary directories.
    pub temp_root: PathBuf,
    /// Confine workers with the OS (set by the supervisor from its
    /// configuration; only the zygote forks confined workers).
    pub confine: Option<crate::Confinement>,
    /// Per-worker cgroups of confined workers, when the host offers them.
    pub cgroups: Option<std::sync::Arc<crate::confine::Cgroups>>,
    /// The uids confined workers get (this supervisor's host-wide block).
    pub uids: Option<std::sync::Arc<crate::confine::Uids>>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            worker_bin: None,
            startup_timeout: Duration::from_secs(60),
            env: Vec::new(),
            inherit_env: false,
            libpath: Vec::new(),
            temp_root: std::env::temp_dir(),
            confine: None,
            cgroups: None,
            uids: None,
        }
    }
}

/// Per-call settings.
#[derive(Debug, Clone)]
pub struct CallOptions {
    /// Deadline of the call; `None` for no limit.
    pub timeout: Option<Duration>,
    /// How long R gets to answer an interrupt before the worker is killed.
    pub grace: Duration,
    /// Plot size in pixels.
    pub plot_width: u32,
    /// Plot size in pixels.
    pub plot_height: u32,
    /// Cap on console text plus plot bytes.
    pub max_output_bytes: u64,
    /// Directory to run in.
    pub working_dir: Option<PathBuf>,
    /// CPU time the call may use (enforced by the kernel, RLIMIT_CPU). Only
    /// for workers used once: the limit cannot be raised again.
    pub cpu_limit: Option<Duration>,
}

impl Default for CallOptions {
    fn default() -> Self {
        Self {
            timeout: Some(Duration::from_secs(30)),
            grace: Duration::from_secs(2),
            plot_width: DEFAULT_PLOT_WIDTH,
            plot_height: DEFAULT_PLOT_HEIGHT,
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES,
            working_dir: None,
            cpu_limit: None,
        }
    }
}

/// Finds the worker binary: `RVISOR_WORKER`, else next to the current
/// executable (or one level up, for test binaries in `target/*/deps`), else
/// on `PATH`.
pub fn locate_worker() -> Result<PathBuf, Error> {
    if let Some(p) = std::env::var_os("RVISOR_WORKER") {
        return Ok(PathBuf::from(p));
    }
    let mut looked = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        let mut dir = exe.parent().map(Path::to_path_buf);
        for _ in 0..2 {
            let Some(d) = dir else { break };
            let cand = d.join("rvisor-worker");
            if cand.is_file() {
                return Ok(cand);
            }
            looked.push(d.display().to_string());
            dir = d.parent().map(Path::to_path_buf);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for d in std::env::split_paths(&path) {
            let cand = d.join("rvisor-worker");
            if cand.is_file() {
                return Ok(cand);
            }
        }
        looked.push("PATH".into());
    }
    Err(Error::WorkerNotFound(looked.join(", ")))
}

/// A private directory removed when dropped.
#[derive(Debug)]
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }

    pub(crate) fn new(root: &Path) -> Result<Self, Error> {
        use std::os::unix::fs::DirBuilderExt;
        let p = root.join(format!(
            "rvisor-{}-{}",
            std::process::id(),
            ids::random_hex(6)
        ));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&p)
            .map_err(|source| Error::Io {
                what: "create the worker's temporary directory",
                source,
            })?;
        Ok(Self(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What reaches a worker's call loop: frames from the worker, tool results
/// from handler threads, cancellation from other threads.
#[derive(Debug)]
enum LinkEvent {
    /// Raw output read from the worker's fds 1 and 2; always sent before
    /// the frame it precedes, so it is attached to the right result.
    Raw([Vec<u8>; 2]),
    Frame(Result<FromWorker, String>),
    ToolDone {
        call_id: u64,
        outcome: ToolOutcome,
    },
    Cancel(String),
}

/// Why the supervisor interrupted a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Timeout,
    Cancel,
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
#[derive(Debug, Clone, Copy)]
pub struct Interrupter {
    pid: libc::pid_t,
}

impl Interrupter {
    /// Interrupts the running evaluation; R answers with outcome
    /// `interrupted` and keeps the session's state.
    pub fn interrupt(&self) {
        // SAFETY: kill(2) with a pid we spawned; see `Worker::interrupter`.
        unsafe { libc::kill(self.pid, libc::SIGINT) };
    }
}

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitInfo {
    /// Exit status, if it exited.
    pub code: Option<i32>,
    /// Signal, if one killed it.
    pub signal: Option<i32>,
}

impl ExitInfo {
    fn from_status(s: std::process::ExitStatus) -> Self {
        Self {
            code: s.code(),
            signal: s.signal(),
        }
    }

    /// "exit status 3", "killed by signal 9 (SIGKILL)".
    pub fn describe(&self) -> String {
        match (self.code, self.signal) {
            (_, Some(sig)) => {
                let name = match sig {
                    libc::SIGSEGV => " (SIGSEGV)",
                    libc::SIGKILL => " (SIGKILL)",
                    libc::SIGABRT => " (SIGABRT)",
                    libc::SIGBUS => " (SIGBUS)",
                    libc::SIGTERM => " (SIGTERM)",
                    libc::SIGXCPU => " (SIGXCPU)",
                    _ => "",
                };
                format!("killed by signal {sig}{name}")
            }
            (Some(code), None) => format!("exit status {code}"),
            (None, None) => "status unknown".into(),
        }
    }
}

/// The worker's process: a child we spawned, or one the zygote forked (the
/// zygote reaps it and tells us how it ended).
#[derive(Debug)]
pub(crate) enum Proc {
    Spawned(Child),
    Forked {
        pid: u32,
        zygote: std::sync::Arc<crate::zygote::ZygoteShared>,
        reaped: Option<ExitInfo>,
    },
}

impl Proc {
    fn id(&self) -> u32 {
        match self {
            Proc::Spawned(c) => c.id(),
            Proc::Forked { pid, .. } => *pid,
        }
    }

    fn try_wait(&mut self) -> Option<ExitInfo> {
        match self {
            Proc::Spawned(c) => c.try_wait().ok().flatten().map(ExitInfo::from_status),
            Proc::Forked {
                pid,
                zygote,
                reaped,
            } => {
                if reaped.is_none() {
                    *reaped = zygote.peek_exit(*pid);
                }
                *reaped
            }
        }
    }

    /// Waits for the end of a process that is dying or dead.
    fn wait(&mut self) -> Option<ExitInfo> {
        match self {
            Proc::Spawned(c) => c.wait().ok().map(ExitInfo::from_status),
            Proc::Forked {
                pid,
                zygote,
                reaped,
            } => {
                if reaped.is_none() {
                    *reaped = zygote.exit_of(*pid, Duration::from_secs(5));
                }
                *reaped
            }
        }
    }

    fn kill(&mut self) {
        let pid = self.id() as libc::pid_t;
        // SAFETY: kill(2) on the process group the worker leads (setpgid at
        // start) and on the worker itself, before we have seen it end, so
        // the ids are still its own.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// The environment a worker gets: the variables that locate programs,
/// libraries, locales and time zones, the names the config lists (or all,
/// with `inherit_env`), and `R_LIBS` from `libpath`.
pub(crate) fn worker_env(cfg: &WorkerConfig) -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    let mut out = Vec::new();
    for (k, v) in std::env::vars_os() {
        let Some(name) = k.to_str() else { continue };
        if name == "R_LIBS" && !cfg.libpath.is_empty() {
            continue;
        }
        let keep = cfg.inherit_env
            || INHERITED_ENV.contains(&name)
            || INHERITED_ENV_PREFIXES.iter().any(|p| name.starts_with(p))
            || cfg.env.iter().any(|e| e == name);
        if keep {
            out.push((k, v));
        }
    }
    if !cfg.libpath.is_empty() {
        if let Ok(joined) = std::env::join_paths(&cfg.libpath) {
            out.push(("R_LIBS".into(), joined));
        }
    }
    out
}

/// Sets what every exec'd worker (and the zygote) needs between fork and
/// exec: own process group, death with the spawning thread, the stack R
/// needs, and `fd` moved to fd 3.
pub(crate) fn prepare_child(cmd: &mut Command, fd: std::os::fd::RawFd) {
    let parent_pid = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and only makes
    // async-signal-safe system calls (setpgid, prctl, getrlimit, setrlimit,
    // dup2, fcntl, getppid, kill); it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // Own process group: a terminal's Ctrl-C does not reach R.
            libc::setpgid(0, 0);
            // Die with the supervisor.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != parent_pid {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            let mut cur: libc::rlimit = std::mem::zeroed();
            libc::getrlimit(libc::RLIMIT_STACK, &mut cur);
            let rl = libc::rlimit {
                rlim_cur: if cur.rlim_max == libc::RLIM_INFINITY {
                    WORKER_STACK_BYTES
                } else {
                    WORKER_STACK_BYTES.min(cur.rlim_max)
                },
                rlim_max: cur.rlim_max,
            };
            libc::setrlimit(libc::RLIMIT_STACK, &rl);
            if fd == 3 {
                libc::fcntl(3, libc::F_SETFD, 0);
            } else if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Starts the worker binary (as a worker or, with `fd_var` =
/// `RVISOR_ZYGOTE_FD`, as a zygote) with a clean environment, a private
/// temporary directory, and one end of a new socketpair as fd 3. Returns
/// the child, the supervisor's end of the socket, and the directory.
pub(crate) fn launch(
    cfg: &WorkerConfig,
    fd_var: &str,
    extra_env: &[(&str, String)],
    stdout: Stdio,
) -> Result<(Child, UnixStream, TempDir), Error> {
    let bin = match &cfg.worker_bin {
        Some(p) => p.clone(),
        None => locate_worker()?,
    };
    let tmp = TempDir::new(&cfg.temp_root)?;
    let (parent, child_end) = UnixStream::pair().map_err(|source| Error::Io {
        what: "create a socketpair for the worker",
        source,
    })?;
    let child_fd: OwnedFd = child_end.into();
    let mut cmd = Command::new(&bin);
    cmd.env_clear();
    for (k, v) in worker_env(cfg) {
        cmd.env(k, v);
    }
    cmd.envs(extra_env.iter().map(|(k, v)| (*k, v.as_str())));
    cmd.env("TMPDIR", tmp.path())
        .env(fd_var, "3")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped());
    prepare_child(&mut cmd, child_fd.as_raw_fd());
    let child = cmd.spawn().map_err(|source| Error::Spawn {
        path: bin.clone(),
        source,
    })?;
    drop(child_fd);
    Ok((child, parent, tmp))
}

/// A running worker.
#[derive(Debug)]
pub struct Worker {
    proc: Proc,
    stream: UnixStream,
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

    /// Says hello to a started worker process and waits for R to be ready.
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

        let mut w = Worker {
            proc,
            stream: parent,
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
        write_frame(
            &mut w.stream,
            &ToWorker::Hello {
                protocol_version: PROTOCOL_VERSION,
            },
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
                let status = w.proc.wait();
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
        self.proc.id()
    }

    /// Whether the worker was forked from the zygote.
    pub fn is_forked(&self) -> bool {
        matches!(self.proc, Proc::Forked { .. })
    }

    /// Whether the worker process has ended.
    pub fn is_alive(&mut self) -> bool {
        self.exit_status().is_none() && !self.exited
    }

    /// How the worker process ended, or `None` while it runs.
    pub fn exit_status(&mut self) -> Option<ExitInfo> {
        let status = self.proc.try_wait();
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
            pid: self.proc.id() as libc::pid_t,
        }
    }

    /// Sends SIGINT: R ends the running evaluation, keeping its state.
    pub fn interrupt(&self) {
        if !self.exited {
            // SAFETY: kill(2) on our own child's pid; it is not reaped yet
            // (`exited` is false), so the pid cannot have been reused.
            unsafe { libc::kill(self.proc.id() as libc::pid_t, libc::SIGINT) };
        }
    }

    /// Interrupts call `seq` only (see the worker's interrupt.rs): a signal
    /// that overtakes its call waits for it, a late one is dropped.
    fn interrupt_call(&self, seq: u64) {
        if self.exited {
            return;
        }
        let value = libc::sigval {
            sival_ptr: seq as usize as *mut libc::c_void,
        };
        // SAFETY: sigqueue(2) to our own unreaped child (pid not reused).
        unsafe { libc::sigqueue(self.proc.id() as libc::pid_t, libc::SIGINT, value) };
    }

    /// Ends a worker that will not be used again: SIGKILL and removal of its
    /// temporary directory now (so nothing it wrote outlives this call),
    /// reaping on a thread of its own (a forked worker's end is reported by
    /// the zygote a little later).
    pub fn discard(mut self) {
        if !self.exited {
            self.proc.kill();
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
        self.proc.kill();
        let _ = self.proc.wait();
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
        if let Err(message) = crate::validate_call(code, opts) {
            return RunResult::failed(execution_id, code.into(), Outcome::Rejected, message);
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
        let req = RunRequest {
            seq,
            execution_id: execution_id.clone(),
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
        // Tables travel as open files: a confined worker cannot see the store.
        if ctx.tables.len() > rvisor_protocol::fdpass::MAX_FDS {
            return RunResult::failed(
                execution_id,
                code.into(),
                Outcome::Rejected,
                format!(
                    "{} tables given; at most {} can be passed to one call",
                    ctx.tables.len(),
                    rvisor_protocol::fdpass::MAX_FDS
                ),
            );
        }
        let mut files = Vec::with_capacity(ctx.tables.len());
        for (name, path) in &ctx.tables {
            match std::fs::File::open(path) {
                Ok(f) => files.push(f),
                Err(e) => {
                    return RunResult::failed(
                        execution_id,
                        code.into(),
                        Outcome::Error,
                        format!("the data for '{name}' could not be opened ({e}); nothing ran"),
                    )
                }
            }
        }
        let fds: Vec<std::os::fd::RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        let sent = if fds.is_empty() {
            write_frame(&mut self.stream, &ToWorker::Run(req))
        } else {
            rvisor_protocol::fdpass::send_frame_with_fds(&self.stream, &ToWorker::Run(req), &fds)
        };
        drop(files);
        if let Err(e) = sent {
            return self.dead_result(execution_id, code, format!("failed to send the call ({e})"));
        }
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
                    if res.outcome == Outcome::Interrupted {
                        match stopping {
                            Some((Stop::Timeout, _)) => {
                                mark_timed_out(&mut res, opts.timeout, false)
                            }
                            Some((Stop::Cancel, _)) => mark_cancelled(&mut res, false),
                            None => {}
                        }
                    }
                    if res.outcome == Outcome::WorkerExited {
                        let _ = self.proc.wait();
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
                    if let Err(e) = write_frame(&mut self.stream, &msg) {
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
                        match why {
                            Stop::Timeout => mark_timed_out(&mut res, opts.timeout, true),
                            Stop::Cancel => mark_cancelled(&mut res, true),
                        }
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
                            self.kill();
                            self.collect_until_closed(Duration::from_secs(1));
                            let _ = self.proc.wait();
                            self.exited = true;
                            let raw = std::mem::take(&mut self.raw);
                            let mut res =
                                cpu_limit_result(execution_id, code, &self.hello.r_version, raw);
                            res.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
                            return res;
                        }
                        if limit_at.is_none_or(|t| Instant::now() < t) {
                            continue; // only the CPU poll
                        }
                    }
                    if stopping.is_none() {
                        self.interrupt_call(seq);
                        stopping = Some((Stop::Timeout, Instant::now() + opts.grace));
                        continue;
                    }
                    // R did not answer the interrupt (tight C code): kill.
                    let why = stopping.map(|s| s.0).unwrap_or(Stop::Timeout);
                    self.kill();
                    self.collect_until_closed(Duration::from_secs(1));
                    let mut res = RunResult::empty(execution_id, code.into());
                    res.r_version = self.hello.r_version.clone();
                    let [o, e] = std::mem::take(&mut self.raw);
                    push_raw(&mut res, o, e);
                    match why {
                        Stop::Timeout => mark_timed_out(&mut res, opts.timeout, true),
                        Stop::Cancel => mark_cancelled(&mut res, true),
                    }
                    res.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
                    return res;
                }
            }
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
    ) -> Result<serde_json::Value, String> {
        if self.exited || self.link_closed() {
            return Err("the worker is no longer running".into());
        }
        let msg = ToWorker::Validate {
            script: script.to_string(),
            forbidden: forbidden.to_vec(),
            max_nesting_depth,
            style: style.to_string(),
        };
        write_frame(&mut self.stream, &msg).map_err(|e| format!("failed to send: {e}"))?;
        let end = Instant::now() + timeout;
        loop {
            match self
                .events
                .recv_timeout(end.saturating_duration_since(Instant::now()))
            {
                Ok(LinkEvent::Raw(raw)) => self.keep_raw(raw),
                Ok(LinkEvent::Frame(Ok(FromWorker::Validation { json }))) => {
                    self.raw = [Vec::new(), Vec::new()];
                    return serde_json::from_str(&json).map_err(|e| format!("bad findings: {e}"));
                }
                Ok(LinkEvent::Frame(Err(e))) => {
                    self.link_closed = true;
                    return Err(format!("the worker ended: {e}"));
                }
                Ok(_) => {}
                Err(_) => {
                    self.kill();
                    return Err("validation did not finish in time".into());
                }
            }
        }
    }

    /// Asks the worker to exit and waits for it (kills it after `wait`).
    pub fn shutdown(mut self, wait: Duration) {
        let _ = write_frame(&mut self.stream, &ToWorker::Shutdown);
        let end = Instant::now() + wait;
        while Instant::now() < end {
            if self.proc.try_wait().is_some() {
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
        let st = self.proc.wait().unwrap_or(ExitInfo {
            code: None,
            signal: None,
        });
        self.exited = true;
        st
    }

    /// Whether the worker's end of the socket has closed (it died), asked
    /// of the kernel directly.
    fn peer_gone(&self) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: poll with a zero timeout on one pollfd we own; the
        // descriptor stays open (owned by `self.stream`).
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        n > 0 && pfd.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0
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
        // The I/O thread may not have seen the hang-up yet: ask the socket.
        self.link_closed || self.peer_gone()
    }

    /// The result of a call whose worker went away.
    fn dead_result(&mut self, execution_id: String, code: &str, why: String) -> RunResult {
        self.collect_until_closed(Duration::from_secs(1));
        let status = self.proc.wait();
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

/// The result of a call stopped at its CPU time limit: the raw output it
/// wrote, then the notice.
fn cpu_limit_result(
    execution_id: String,
    code: &str,
    r_version: &str,
    [out, err]: [Vec<u8>; 2],
) -> RunResult {
    let mut res = RunResult::empty(execution_id, code.into());
    res.r_version = r_version.to_string();
    push_raw(&mut res, out, err);
    let message =
        "the call used up its CPU time limit (counting the processes it started) and was stopped";
    res.push_segment(Segment::Stderr {
        text: format!("rvisor: {message}\n"),
    });
    res.outcome = Outcome::TimedOut;
    res.success = false;
    res.error = Some(ErrorInfo {
        timed_out: true,
        ..ErrorInfo::message(message)
    });
    res
}

fn mark_timed_out(res: &mut RunResult, timeout: Option<Duration>, killed: bool) {
    let secs = timeout.map(|t| t.as_secs_f64()).unwrap_or(0.0);
    let message = if killed {
        format!(
            "the call exceeded its timeout of {secs} s and R did not answer the interrupt, so \
             the worker was killed; the session's state is lost"
        )
    } else {
        format!(
            "the call exceeded its timeout of {secs} s and was interrupted; the session's \
             variables are kept"
        )
    };
    res.push_segment(Segment::Stderr {
        text: format!("rvisor: {message}\n"),
    });
    res.outcome = Outcome::TimedOut;
    res.success = false;
    let mut err = res.error.take().unwrap_or_default();
    err.message = message;
    err.timed_out = true;
    res.error = Some(err);
}

fn mark_cancelled(res: &mut RunResult, killed: bool) {
    let message = if killed {
        "the call was cancelled; R did not answer the interrupt, so the worker was killed and \
         the session's state is lost"
    } else {
        "the call was cancelled; the session's variables are kept"
    };
    res.push_segment(Segment::Stderr {
        text: format!("rvisor: {message}\n"),
    });
    res.outcome = Outcome::Cancelled;
    res.success = false;
    let mut err = res.error.take().unwrap_or_default();
    err.message = message.to_string();
    res.error = Some(err);
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

fn push_raw(res: &mut RunResult, out: Vec<u8>, err: Vec<u8>) {
    if !out.is_empty() {
        res.push_segment(Segment::Stdout {
            text: String::from_utf8_lossy(&out).into_owned(),
        });
    }
    if !err.is_empty() {
        res.push_segment(Segment::Stderr {
            text: String::from_utf8_lossy(&err).into_owned(),
        });
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
