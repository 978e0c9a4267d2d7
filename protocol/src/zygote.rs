//! Messages between the supervisor and a zygote: an embedded R initialised
//! once that forks ready workers on request.

use serde::{Deserialize, Serialize};

/// Name of the environment variable that carries the zygote's control socket
/// (a file descriptor number inherited across exec).
pub const ENV_ZYGOTE_FD: &str = "RVISOR_ZYGOTE_FD";
/// Name of the environment variable listing packages the zygote preloads
/// (comma-separated).
pub const ENV_PRELOAD: &str = "RVISOR_PRELOAD";
/// Name of the environment variable that makes a zygote a *base* zygote:
/// it serves forks as soon as R is up, without preloading packages or
/// warming the plot devices; a [`ToZygote::Warm`] request then forks the
/// warm zygote that does (the pool's hand-over, ARCHITECTURE.md).
pub const ENV_ZYGOTE_BASE: &str = "RVISOR_ZYGOTE_BASE";
/// Name of the environment variable a retired base zygote re-executes
/// itself with ([`ToZygote::Retire`]): its control socket's descriptor,
/// then the pids of the confined workers it forked, comma-separated.
pub const ENV_ZYGOTE_RETIRED: &str = "RVISOR_ZYGOTE_RETIRED";

/// Supervisor to zygote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToZygote {
    /// First frame: the supervisor's protocol version.
    Hello {
        /// [`crate::PROTOCOL_VERSION`].
        protocol_version: u32,
    },
    /// Fork a worker. Three descriptors travel with this frame (SCM_RIGHTS):
    /// the worker's end of its socketpair, and the write ends of its stdout
    /// and stderr pipes.
    Fork(ForkRequest),
    /// Fork a *warm* zygote: a child of this one that preloads packages and
    /// warms the plot devices, then serves as a zygote of its own on the one
    /// descriptor that travels with this frame (its control socket: the
    /// supervisor sends it a [`ToZygote::Hello`] and it answers with its
    /// [`ZygoteHello`] once warm). This zygote answers with
    /// [`FromZygote::Forked`] (or `ForkFailed`) at once, and reports the
    /// child's end with [`FromZygote::Exited`] like any other child's. The
    /// child dies with this zygote (parent-death signal).
    Warm(WarmRequest),
    /// To a base zygote whose warm zygote serves: give up R and its heap
    /// (the process re-executes itself as a *retired* zygote, so the warm
    /// zygote's pages, which it shared, become that one's alone), keep
    /// reaping and reporting the children it has, and refuse forks. It
    /// answers [`FromZygote::Retired`] once it runs as such; the warm
    /// zygote still dies with it.
    Retire,
    /// To a warm zygote: put its heap in huge pages where its pages are its
    /// own (sent once its base zygote retired), so that its forks copy
    /// fewer page table entries. No answer.
    Compact,
}

/// What a warm zygote does before it serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WarmRequest {
    /// Supervisor's id for the request (echoed in the answer).
    pub worker_id: u64,
    /// Packages to load (`None`: ggplot2 when installed, failures ignored).
    pub preload: Option<Vec<String>>,
    /// Draw a plot with base graphics, grid and each preloaded plotting
    /// package, so a worker's first plot costs what later ones cost.
    pub warm_plots: bool,
}

/// What a forked worker needs besides its descriptors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkRequest {
    /// Supervisor's id for the request (echoed in the answer).
    pub worker_id: u64,
    /// The worker's private temporary directory (already created).
    pub temp_dir: String,
    /// The worker's whole environment (the zygote's is replaced).
    pub env: Vec<(String, String)>,
    /// Confine the worker with the OS before it serves (docs/confinement.md);
    /// `None` runs it unconfined.
    #[serde(default)]
    pub confine: Option<Confine>,
}

/// How the zygote confines a forked worker: every layer is set up in the
/// child before it reads its first request; a layer that fails ends the
/// child with a message on stderr (it never runs unconfined).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Confine {
    /// Unprivileged uid and gid of this worker (one per worker).
    pub uid: u32,
    /// See `uid`.
    pub gid: u32,
    /// Address space (RLIMIT_AS), bytes.
    pub memory_bytes: u64,
    /// Processes and threads of the worker's uid (RLIMIT_NPROC).
    pub processes: u64,
    /// Largest file the worker may write (RLIMIT_FSIZE), bytes.
    pub file_bytes: u64,
    /// Open descriptors (RLIMIT_NOFILE).
    pub open_files: u64,
    /// Size of the private tmpfs for the temporary and working directory.
    pub disk_bytes: u64,
    /// CPU seconds for the worker's whole life (RLIMIT_CPU); `None` for no
    /// limit beyond the per-call ones.
    #[serde(default)]
    pub cpu_seconds: Option<u64>,
    /// Keep the host's network (else a new network namespace: no network).
    pub network: bool,
    /// Host paths bound read-only into the worker's root (besides what R
    /// needs, which the zygote binds anyway).
    #[serde(default)]
    pub read_only: Vec<String>,
    /// CPUs for `options(mc.cores)` (`detectCores()` cannot shell out).
    pub cores: u32,
    /// `cgroup.procs` files the worker's relay joins (before it forks the
    /// worker, so the worker and its children are in them).
    #[serde(default)]
    pub cgroups: Vec<String>,
    /// Rootless mode (the supervisor is not root): the zygote forks the
    /// worker into a new user namespace as well as a new pid namespace, and
    /// the worker maps the zygote's uid/gid to `uid`/`gid` inside it
    /// instead of switching to a host uid of its own.
    #[serde(default)]
    pub rootless: bool,
    /// The programs the worker may run (the server's allow-list, resolved
    /// by the supervisor at start, with the shell and the interpreters they
    /// need). Empty: `execve` stays denied by seccomp and nothing runs.
    /// Otherwise each `file` is made executable for Landlock and in the
    /// worker's view, and nothing else is.
    #[serde(default)]
    pub programs: Vec<ProgramFile>,
}

/// One program a confined worker may run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgramFile {
    /// The name it is known by (`pandoc`, `sh`).
    pub name: String,
    /// The path it is run as (`/usr/bin/pandoc`, `/bin/sh`): the worker
    /// makes it lead to `file` inside when it would not.
    pub path: String,
    /// The file itself, every symlink resolved (`/usr/bin/dash`): what the
    /// kernel checks when it is executed.
    pub file: String,
    /// Why it is there: `default` or `allowed` (the server's list),
    /// `shell` (R runs programs through it), `interpreter` (the kernel
    /// loads it to run another one: an ELF interpreter or a script's `#!`).
    pub reason: String,
}

/// Zygote to supervisor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromZygote {
    /// The zygote is ready to fork.
    Hello(ZygoteHello),
    /// A worker was forked; it now waits for the supervisor's hello on its
    /// socket.
    Forked {
        /// From the request.
        worker_id: u64,
        /// The worker's process id.
        pid: u32,
    },
    /// fork() failed.
    ForkFailed {
        /// From the request.
        worker_id: u64,
        /// Why.
        message: String,
    },
    /// The zygote retired ([`ToZygote::Retire`]): it forks no more.
    Retired,
    /// A forked worker ended (the zygote, its parent, reaped it).
    Exited {
        /// Its process id.
        pid: u32,
        /// Exit status, if it exited.
        code: Option<i32>,
        /// Signal, if one killed it.
        signal: Option<i32>,
    },
}

/// What a ready zygote tells about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ZygoteHello {
    /// [`crate::PROTOCOL_VERSION`] of the zygote.
    pub protocol_version: u32,
    /// R's version.
    pub r_version: String,
    /// The zygote's process id.
    pub pid: u32,
    /// Packages loaded before forking.
    pub preloaded: Vec<String>,
    /// Packages asked for that could not be loaded, with why.
    pub failed: Vec<(String, String)>,
    /// Milliseconds from process start to ready (a warm zygote: from its
    /// fork to ready).
    pub startup_ms: f64,
    /// Where the start-up time went, in order (`r_start`, `warm_up`,
    /// `preload`, `plots`, `seccomp`), milliseconds each.
    #[serde(default)]
    pub phases_ms: Vec<(String, f64)>,
    /// Whether this zygote preloaded and warmed up (a warm zygote, or a
    /// zygote started without the base/warm split), as opposed to a base
    /// zygote that serves at once.
    #[serde(default)]
    pub warm: bool,
}
