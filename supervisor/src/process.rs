//! Worker processes as the operating system sees them: how they are started
//! (clean environment, own process group, parent-death signal, private
//! temporary directory), how they end ([`ExitInfo`]), and the [`Transport`]
//! a `Worker` drives them through.
//!
//! This module sits below both `worker` (which talks to one process) and
//! `zygote` (which starts the zygote and forks workers): neither imports the
//! other through it.

use crate::confine::{AllowedProgram, Cgroups, Confinement, Limits, Uids};
use crate::error::{ConfineError, Error};
use rvisor_protocol::{write_frame, FrameError, ToWorker};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

/// Environment variables a worker inherits from the host: those that locate
/// programs, libraries, locales and time zones. Everything else (secrets!)
/// stays in the host.
const INHERITED_ENV: &[&str] = &[
    "PATH", "HOME", "LANG", "LANGUAGE", "TZ", "R_HOME", "USER", "LOGNAME",
];
const INHERITED_ENV_PREFIXES: &[&str] = &["LC_", "R_LIBS"];

/// The `argv[0]` workers and the zygote are started with.
const WORKER_ARG0: &str = "rvisor-worker";

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
    /// Library directories that go after R's own (site and base) on
    /// `.libPaths()`, which the worker adds before its first call (a
    /// tenant's packages, docs/packages.md); visible read-only to a
    /// confined worker.
    pub libpath_after: Vec<PathBuf>,
    /// Parent of the per-worker temporary directories.
    pub temp_root: PathBuf,
    /// Confine workers with the OS (set by the supervisor from its
    /// configuration; only the zygote forks confined workers).
    pub confine: Option<Confinement>,
    /// Per-worker cgroups of confined workers, when the host offers them.
    pub cgroups: Option<Arc<Cgroups>>,
    /// The uids confined workers get (this supervisor's host-wide block).
    pub uids: Option<Arc<Uids>>,
    /// The programs confined workers may run, resolved (set by the
    /// supervisor from `Confinement.programs`).
    pub programs: Vec<AllowedProgram>,
    /// Let the kernel merge identical pages of the workers' memory
    /// (same-page merging, KSM) across workers: after a full `gc()` most
    /// of a live session's heap is a copy of its zygote's that the
    /// collection wrote to, and merging shares the pages that stayed the
    /// same again. Off by default: a merged page is a side channel
    /// between the processes that share it, across sessions and tenants
    /// (docs/process-model.md, "Memory"). Needs Linux 6.4 or later and
    /// KSM on host-wide (`/sys/kernel/mm/ksm/run` 1, see
    /// [`crate::page_merging_state`]).
    pub merge_pages: bool,
    /// R's memory from malloc in transparent huge pages (glibc's
    /// `glibc.malloc.hugetlb=1` tunable, given to the worker or zygote
    /// process when it starts; forked workers inherit it): a quarter of
    /// the page faults while R starts and allocates (R's start 112 -> 88
    /// ms here), and a cheaper fork of a zygote whose heap is in huge
    /// pages, at the cost of memory kept in 2 MiB pages. For one-shot
    /// runs (`rvisor run`), whose worker lives for one call; off by
    /// default, as a live session's private memory would grow
    /// (docs/process-model.md, "R start-up"). Without transparent huge
    /// pages in the kernel (`never`), or with a glibc older than 2.35, it
    /// changes nothing.
    pub malloc_huge_pages: bool,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            worker_bin: None,
            startup_timeout: Duration::from_secs(60),
            env: Vec::new(),
            inherit_env: false,
            libpath: Vec::new(),
            libpath_after: Vec::new(),
            temp_root: std::env::temp_dir(),
            confine: None,
            cgroups: None,
            uids: None,
            programs: Vec::new(),
            merge_pages: false,
            malloc_huge_pages: false,
        }
    }
}

impl WorkerConfig {
    /// Gives this configuration its own limits and network access.
    /// Refused for unconfined workers, which have no limits to set.
    pub(crate) fn apply_overrides(
        &mut self,
        limits: Option<&Limits>,
        network: Option<bool>,
    ) -> Result<(), ConfineError> {
        if limits.is_none() && network.is_none() {
            return Ok(());
        }
        let Some(c) = self.confine.as_mut() else {
            return Err(ConfineError::OverridesNeedConfinement);
        };
        if let Some(l) = limits {
            l.check()?;
            c.limits = l.clone();
        }
        if let Some(n) = network {
            c.network = n;
        }
        Ok(())
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

pub(crate) use crate::tempdir::TempDir;

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitInfo {
    /// Exit status, if it exited.
    pub code: Option<i32>,
    /// Signal, if one killed it.
    pub signal: Option<i32>,
}

impl ExitInfo {
    /// An end we know nothing about.
    pub(crate) const UNKNOWN: ExitInfo = ExitInfo {
        code: None,
        signal: None,
    };

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

/// Who reaps forked workers and reports how they ended (the zygote's
/// reader), so that a forked worker's process does not depend on the zygote
/// module.
pub(crate) trait ExitReports: Send + Sync + std::fmt::Debug {
    /// How worker `pid` ended, waiting up to `wait` for the news.
    fn exit_of(&self, pid: u32, wait: Duration) -> Option<ExitInfo>;
    /// Whether worker `pid` has ended or is doomed (non-blocking).
    fn peek_exit(&self, pid: u32) -> Option<ExitInfo>;
}

/// The worker's process: a child we spawned, or one the zygote forked (the
/// zygote reaps it and tells us how it ended).
#[derive(Debug)]
pub(crate) enum Proc {
    Spawned(Child),
    Forked {
        pid: u32,
        reports: Arc<dyn ExitReports>,
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
                reports,
                reaped,
            } => {
                if reaped.is_none() {
                    *reaped = reports.peek_exit(*pid);
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
                reports,
                reaped,
            } => {
                if reaped.is_none() {
                    *reaped = reports.exit_of(*pid, Duration::from_secs(5));
                }
                *reaped
            }
        }
    }

    fn kill(&mut self) {
        let pid = self.id() as libc::pid_t;
        // SAFETY: kill(2) on the process group the worker leads (setpgid at
        // start) and on the worker itself; callers only kill a worker they
        // have not seen end (`Worker::exited`), so the ids are still its own.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// What a `Worker` does to its process and link, apart from
/// reading: the link's incoming side is a channel of events fed by an I/O
/// thread (or, in tests, by a fake worker), so the whole call state machine
/// runs against this trait. The caller never signals a process it has seen
/// end.
pub(crate) trait Transport: Send + std::fmt::Debug {
    /// The worker's process id.
    fn pid(&self) -> u32;
    /// Whether the worker was forked from the zygote.
    fn is_forked(&self) -> bool;
    /// Sends one frame, with file descriptors when `fds` is not empty.
    fn send(&mut self, msg: &ToWorker, fds: &[RawFd]) -> Result<(), FrameError>;
    /// Whether the worker's end of the link has closed (asked directly,
    /// not through the event channel).
    fn peer_gone(&self) -> bool;
    /// SIGINT; tagged with the call's sequence number when `seq` is given
    /// (see the worker's interrupt.rs).
    fn interrupt(&self, seq: Option<u64>);
    /// An untagged SIGINT usable from any thread while the worker lives.
    fn interrupt_handle(&self) -> Arc<dyn Fn() + Send + Sync>;
    /// SIGKILL to the worker's process group.
    fn kill(&mut self);
    /// How the process ended, or `None` while it runs.
    fn try_wait(&mut self) -> Option<ExitInfo>;
    /// Waits (bounded) for a dying process to end.
    fn wait(&mut self) -> Option<ExitInfo>;
}

/// A real worker process and its socket.
#[derive(Debug)]
pub(crate) struct OsTransport {
    pub(crate) proc: Proc,
    pub(crate) stream: UnixStream,
}

impl Transport for OsTransport {
    fn pid(&self) -> u32 {
        self.proc.id()
    }

    fn is_forked(&self) -> bool {
        matches!(self.proc, Proc::Forked { .. })
    }

    fn send(&mut self, msg: &ToWorker, fds: &[RawFd]) -> Result<(), FrameError> {
        if fds.is_empty() {
            write_frame(&mut self.stream, msg)
        } else {
            rvisor_protocol::fdpass::send_frame_with_fds(&self.stream, msg, fds)
        }
    }

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

    fn interrupt(&self, seq: Option<u64>) {
        let pid = self.proc.id() as libc::pid_t;
        match seq {
            // SAFETY: kill(2) on our own child's pid; the caller has not
            // seen it end (not reaped), so the pid cannot have been reused.
            None => unsafe {
                libc::kill(pid, libc::SIGINT);
            },
            Some(seq) => {
                let value = libc::sigval {
                    sival_ptr: seq as usize as *mut libc::c_void,
                };
                // SAFETY: sigqueue(2) to our own unreaped child (pid not
                // reused); the value is an integer, not a pointer R reads.
                unsafe { libc::sigqueue(pid, libc::SIGINT, value) };
            }
        }
    }

    fn interrupt_handle(&self) -> Arc<dyn Fn() + Send + Sync> {
        let pid = self.proc.id() as libc::pid_t;
        Arc::new(move || {
            // SAFETY: kill(2) with a pid we spawned or forked; the handle is
            // documented as valid only while the worker is alive (not
            // reaped), so the pid is still the worker's.
            unsafe { libc::kill(pid, libc::SIGINT) };
        })
    }

    fn kill(&mut self) {
        self.proc.kill();
    }

    fn try_wait(&mut self) -> Option<ExitInfo> {
        self.proc.try_wait()
    }

    fn wait(&mut self) -> Option<ExitInfo> {
        self.proc.wait()
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
    if !cfg.libpath_after.is_empty() {
        if let Ok(joined) = std::env::join_paths(&cfg.libpath_after) {
            out.push(("RVISOR_LIBS_AFTER".into(), joined));
        }
    }
    out
}

/// The files and lines that map this process's uid and gid to themselves
/// in a new user namespace (setgroups denied first, as an unprivileged
/// gid map requires).
fn identity_maps() -> [(std::ffi::CString, Vec<u8>); 3] {
    // SAFETY: getuid/getgid take no arguments and cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    [
        (c"/proc/self/setgroups".to_owned(), b"deny".to_vec()),
        (
            c"/proc/self/uid_map".to_owned(),
            format!("{uid} {uid} 1\n").into_bytes(),
        ),
        (
            c"/proc/self/gid_map".to_owned(),
            format!("{gid} {gid} 1\n").into_bytes(),
        ),
    ]
}

/// Sets what every exec'd worker (and the zygote) needs between fork and
/// exec: own process group, death with the spawning thread, the stack R
/// needs, and `fd` moved to fd 3. With `user_ns` (a rootless zygote) the
/// child also enters a new user namespace that maps its uid and gid to
/// themselves, so that its forked workers' memory belongs to that
/// namespace (`mm->user_ns`): the supervisor, which owns it, may read a
/// non-dumpable worker's `/proc/<pid>/root`, and a worker, in a sibling
/// namespace below it, may not read another's.
fn prepare_child(cmd: &mut Command, fd: RawFd, user_ns: bool) {
    let parent_pid = std::process::id() as libc::pid_t;
    let maps = user_ns.then(identity_maps);
    // SAFETY: the closure runs between fork and exec and only makes
    // async-signal-safe system calls (setpgid, prctl, getrlimit, setrlimit,
    // dup2, fcntl, getppid, kill, unshare, open, write, close) on data
    // prepared before the fork; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // First: the credentials of the new namespace are settled
            // before the parent-death signal is armed.
            if let Some(maps) = &maps {
                if libc::unshare(libc::CLONE_NEWUSER) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                for (path, text) in maps {
                    let f = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if f < 0 || libc::write(f, text.as_ptr().cast(), text.len()) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    libc::close(f);
                }
            }
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
    // argv[0] without the binary's host path: a forked worker's
    // /proc/self/cmdline is the zygote's, and R code can read it.
    cmd.arg0(WORKER_ARG0);
    cmd.env_clear();
    let env = worker_env(cfg);
    let host_tunables = env
        .iter()
        .any(|(k, _)| k == rvisor_protocol::ENV_GLIBC_TUNABLES);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.envs(extra_env.iter().map(|(k, v)| (*k, v.as_str())));
    if cfg.merge_pages {
        cmd.env(rvisor_protocol::ENV_MERGE_PAGES, "1");
    }
    if cfg.malloc_huge_pages && !host_tunables {
        // Read by the dynamic loader as the process starts; the worker
        // then takes it out of its environment (R code and the programs
        // it runs do not see it). Tunables the host passes on purpose
        // (`env`, `inherit_env`) are left as they are.
        cmd.env(
            rvisor_protocol::ENV_GLIBC_TUNABLES,
            rvisor_protocol::MALLOC_HUGE_PAGES_TUNABLE,
        );
    }
    cmd.env("TMPDIR", tmp.path())
        .env(fd_var, "3")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped());
    // A rootless zygote runs in a user namespace of its own (see
    // prepare_child); workers spawned directly are never confined.
    let user_ns = fd_var == rvisor_protocol::ENV_ZYGOTE_FD
        && cfg.confine.is_some()
        && crate::confine::rootless();
    prepare_child(&mut cmd, child_fd.as_raw_fd(), user_ns);
    let child = cmd.spawn().map_err(|source| Error::Spawn {
        path: bin.clone(),
        source,
    })?;
    drop(child_fd);
    Ok((child, parent, tmp))
}

/// A pipe, both ends close-on-exec.
pub(crate) fn pipe() -> Result<(OwnedFd, OwnedFd), Error> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the array we own; on success both descriptors are
    // new and become owned here, exactly once.
    unsafe {
        if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(Error::Io {
                what: "create a pipe",
                source: std::io::Error::last_os_error(),
            });
        }
        use std::os::fd::FromRawFd;
        Ok((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])))
    }
}

/// Whether the host merges the pages of processes that ask for it
/// ([`WorkerConfig::merge_pages`]): `Err` says why not and what to do.
pub fn page_merging_state() -> Result<(), String> {
    const RUN: &str = "/sys/kernel/mm/ksm/run";
    match std::fs::read_to_string(RUN) {
        Ok(v) if v.trim() == "1" => Ok(()),
        Ok(v) => Err(format!(
            "the kernel's same-page merging is off ({RUN} is {}): nothing is merged until \
             root turns it on (`echo 1 > {RUN}`)",
            v.trim()
        )),
        Err(e) => Err(format!(
            "this kernel has no same-page merging ({RUN}: {e}); it needs CONFIG_KSM and \
             Linux 6.4 or later"
        )),
    }
}
