//! The library's error types, one per layer: owned data only, messages that
//! read after "failed to ...". This module imports nothing from the crate,
//! so every other module can use it without a cycle.

use std::path::PathBuf;

/// What can go wrong in the supervisor library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The worker binary was not found.
    #[error(
        "failed to find the rvisor-worker binary (looked in {0}); build it with `cargo build` \
         or set RVISOR_WORKER to its path"
    )]
    WorkerNotFound(String),
    /// The worker process could not be started.
    #[error("failed to start the worker {path}: {source}")]
    Spawn {
        /// Worker binary.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The worker started but did not become ready.
    #[error("failed to start R in the worker: {0}")]
    Startup(String),
    /// The worker did not become ready in time.
    #[error("the worker did not become ready within {0:?}")]
    StartupTimeout(std::time::Duration),
    /// An operating-system call failed.
    #[error("failed to {what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        source: std::io::Error,
    },
    /// A request was invalid.
    #[error("{0}")]
    Invalid(String),
    /// Workers cannot be confined as configured on this host.
    // The inner error is in the message, so it is not also a `source`:
    // printers of error chains (anyhow's `{:#}`) said it twice.
    #[error("refusing to start: {0}")]
    Confinement(ConfineError),
    /// A session's own confinement settings (limits, network, working
    /// directory) cannot be used: the caller's to fix.
    #[error("{0}")]
    Settings(ConfineError),
}

/// Advice given with every failed host probe.
const CONFINE_ADVICE: &str = "fix the host as said, run rvisor as root, or opt out of OS \
                              confinement explicitly (`--unconfined`; library: \
                              `Confinement::unconfined()`) for trusted code only";

/// Advice when the kernel refuses unprivileged user namespaces.
const USERNS_ADVICE: &str = "rootless confinement (rvisor running as an ordinary user) gives \
                             each worker a user namespace of its own; run rvisor as root \
                             instead, or opt out of OS confinement explicitly \
                             (`--unconfined`; library: `Confinement::unconfined()`) for \
                             trusted code only";

/// Why workers cannot be confined as configured: one variant per step of
/// the host probe and of the set-up (as Firecracker's jailer has one per
/// failing step), so callers can tell them apart.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfineError {
    /// Rootless: the Debian/Ubuntu switch for unprivileged user
    /// namespaces is off.
    #[error(
        "failed to create a user namespace: unprivileged user namespaces are turned off \
         (sysctl kernel.unprivileged_userns_clone = 0); turn them on with `sudo sysctl -w \
         kernel.unprivileged_userns_clone=1` (and in /etc/sysctl.d to keep it); {USERNS_ADVICE}"
    )]
    UnprivilegedUsernsOff,
    /// Rootless: the per-user limit of user namespaces is 0 (or reached).
    #[error(
        "failed to create a user namespace: the limit is {value} (sysctl \
         user.max_user_namespaces); raise it with `sudo sysctl -w \
         user.max_user_namespaces=15000` (and in /etc/sysctl.d to keep it); {USERNS_ADVICE}"
    )]
    UserNamespaceLimit {
        /// The sysctl's value.
        value: String,
    },
    /// Rootless: AppArmor restricts unprivileged user namespaces (Ubuntu
    /// 23.10 and later).
    #[error(
        "failed to create a user namespace: AppArmor restricts unprivileged user namespaces \
         (sysctl kernel.apparmor_restrict_unprivileged_userns = 1); allow them for rvisor with \
         an AppArmor profile granting `userns,` to the rvisor binary and to rvisor-worker \
         (docs/confinement.md has one), or turn the restriction off with `sudo sysctl -w \
         kernel.apparmor_restrict_unprivileged_userns=0`; {USERNS_ADVICE}"
    )]
    AppArmorUserns,
    /// Rootless: the kernel refused a user namespace for another reason
    /// (a container's seccomp profile or a missing CONFIG_USER_NS).
    #[error(
        "failed to create a user namespace ({step}): {source}; inside a container, the \
         runtime's seccomp profile or missing privileges usually forbid it (Docker: \
         `--security-opt seccomp=unconfined` or a profile that allows clone/unshare of user \
         namespaces; Kubernetes: a pod that allows user namespaces, or `hostUsers: false`); \
         {USERNS_ADVICE}"
    )]
    UserNamespace {
        /// What was tried: `unshare`, `write uid_map`, `unshare mount, ipc, ...`.
        step: &'static str,
        /// Why the kernel refused.
        source: std::io::Error,
    },
    /// The kernel lacks a namespace type.
    #[error(
        "this kernel has no {namespace} namespaces (/proc/self/ns/{namespace} is missing); \
         {CONFINE_ADVICE}"
    )]
    Namespaces {
        /// The missing namespace (`mnt`, `pid`, ...).
        namespace: String,
    },
    /// Landlock is not enabled.
    #[error(
        "Landlock is not enabled in this kernel (boot with lsm=...,landlock); {CONFINE_ADVICE}"
    )]
    Landlock,
    /// seccomp is not available.
    #[error("seccomp is not available in this kernel; {CONFINE_ADVICE}")]
    Seccomp,
    /// The configured uid range is unusable.
    #[error("the worker uid range {base}+{count} is empty or overflows")]
    UidRange {
        /// First uid.
        base: u32,
        /// How many.
        count: u32,
    },
    /// The host-wide uid block registry could not be used.
    #[error("failed to reserve worker uids: cannot {what} {path}: {source}")]
    UidRegistry {
        /// `create` or `open`.
        what: &'static str,
        /// The directory or file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Every uid block is held by another supervisor.
    #[error(
        "all {blocks} blocks of worker uids from {base} are held by other rvisor supervisors on \
         this host; raise Confinement.uid_count or use another uid_base"
    )]
    UidsExhausted {
        /// Blocks in the range.
        blocks: u32,
        /// First uid of the range.
        base: u32,
    },
    /// Cgroups were required but the host does not offer them.
    #[error("cgroups were required but {0}")]
    CgroupsRequired(CgroupMissing),
    /// A cgroup could not be created or set.
    #[error("failed to {what}: {source}")]
    Cgroup {
        /// What was being done, with the path (`create cgroup ...`, `set
        /// .../pids.max to 66`).
        what: String,
        /// The group or file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The limits leave R no room to run.
    #[error(transparent)]
    Limits(#[from] LimitsError),
    /// A program of the allow-list cannot be allowed.
    #[error("allowed program {program:?} (--allow-program, Confinement.programs): {why}")]
    Program {
        /// The name or path as configured (or the interpreter it needs).
        program: String,
        /// Why.
        why: String,
    },
    /// A read-only path is unusable.
    #[error("read-only path {path}: {why}")]
    ReadOnlyPath {
        /// The path as configured.
        path: PathBuf,
        /// Why it is refused.
        why: ReadOnlyRefusal,
    },
    /// A confined worker could not enter the working directory.
    #[error(
        "working_dir {dir}: confined workers run as their own uid and cannot {action} {blocked} \
         (mode {mode:o}); chmod o+rx it (o+x its parents) or pick another directory"
    )]
    NotEnterable {
        /// The working directory.
        dir: PathBuf,
        /// `read` or `pass through`.
        action: &'static str,
        /// The directory (it or an ancestor) that blocks.
        blocked: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A path could not be examined.
    #[error("{path}: {source}")]
    Path {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Per-session limits or network settings on an unconfined supervisor.
    #[error(
        "per-session limits and network settings need OS confinement, and this supervisor is \
         unconfined"
    )]
    OverridesNeedConfinement,
    /// Confinement without the zygote, which is what forks confined workers.
    #[error(
        "confined workers are forked by the zygote: enable PoolConfig.zygote, or opt out of \
         confinement with Confinement::unconfined() (trusted code only)"
    )]
    NeedsZygote,
}

/// Why the host offers no usable cgroups.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CgroupMissing {
    /// Only cgroups v2 is mounted.
    #[error(
        "this host has cgroups v2, which rvisor does not drive yet (v1 memory and pids \
         controllers are needed)"
    )]
    V2Only,
    /// A v1 controller is not mounted.
    #[error("the v1 {controller} controller is not mounted at {path}")]
    NotMounted {
        /// `memory` or `pids`.
        controller: String,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// This supervisor's group could not be created.
    #[error("{path} cannot be created: {source}")]
    NotWritable {
        /// The group.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Why a read-only path is refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadOnlyRefusal {
    /// Not absolute.
    #[error("it must be absolute")]
    NotAbsolute,
    /// It does not resolve.
    #[error("{0}")]
    Unresolvable(std::io::Error),
    /// A kernel view the host must not share.
    #[error("it is under {0}, which workers must not see from the host")]
    KernelView(&'static str),
    /// It would cover the workers' private directories.
    #[error(
        "it would cover the workers' private directories under {0}; expose a subdirectory instead"
    )]
    CoversTempRoot(PathBuf),
}

/// Limits in which R cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitsError {
    /// Less memory than a forked R worker maps.
    #[error(
        "memory limit {mib} MiB is too small: a forked R worker already maps ~350 MiB; use at \
         least 512 (1024 to load packages with native code)"
    )]
    MemoryTooSmall {
        /// The limit asked for, in MiB.
        mib: u64,
    },
    /// No process or too few open files.
    #[error("limits need at least 1 process and 64 open files")]
    ProcessesOrFiles,
    /// Disk or file size under 1 MiB.
    #[error("disk and file size limits must be at least 1 MiB")]
    DiskTooSmall,
    /// A CPU limit of 0 s.
    #[error("a CPU limit must be at least 1 second")]
    CpuZero,
}

/// A call refused before it was sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CallError {
    /// No code.
    #[error("the code is empty; send at least one R expression")]
    Empty,
    /// Code over `MAX_CODE_BYTES` (256 KiB).
    #[error(
        "the code is {bytes} bytes, over the limit of {limit} bytes; split it into several \
         calls or load data from files"
    )]
    TooLarge {
        /// The code's size.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// A plot side out of range.
    #[error("{name} is {value}; it must be between 1 and {max} pixels")]
    PlotSize {
        /// `plot_width` or `plot_height`.
        name: &'static str,
        /// The value given.
        value: u32,
        /// The largest side.
        max: u32,
    },
    /// An output cap of 0.
    #[error("max_output_bytes must be at least 1")]
    NoOutput,
    /// A display option out of range (the message names it and its range).
    #[error("{0}")]
    Display(String),
}

/// Why a worker's file could not be read for a tool (the R code named it).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerFileError {
    /// The path leads outside the worker's temporary directory.
    #[error("the file must be in the R session's temporary directory (tempdir())")]
    OutsideTempDir,
    /// The path has a NUL byte.
    #[error("the path contains a NUL byte")]
    Nul,
    /// The worker (its root or directory) is gone.
    #[error("the worker is gone: {0}")]
    WorkerGone(std::io::Error),
    /// Opening failed (missing, a symlink, no permission).
    #[error("cannot open {path}: {source}")]
    Open {
        /// The path R gave.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Examining the opened file failed.
    #[error("cannot check {path}: {source}")]
    Check {
        /// The path R gave.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Not a regular file, or too large.
    #[error("{path} must be a regular file of at most {max_mib} MiB")]
    NotRegular {
        /// The path R gave.
        path: String,
        /// The size limit.
        max_mib: u64,
    },
    /// Reading failed.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The path R gave.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// The handler boundary: tool errors travel to R as strings.
impl From<WorkerFileError> for String {
    fn from(e: WorkerFileError) -> String {
        e.to_string()
    }
}

/// Why a validation request to a worker failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ValidateError {
    /// The worker had already ended.
    #[error("the worker is no longer running")]
    NotRunning,
    /// The request could not be sent.
    #[error("failed to send: {0}")]
    Send(rvisor_protocol::FrameError),
    /// The worker ended during validation.
    #[error("the worker ended: {0}")]
    Ended(String),
    /// The worker's findings were not valid JSON.
    #[error("bad findings: {0}")]
    BadFindings(String),
    /// No answer in time (the worker was killed).
    #[error("validation did not finish in time")]
    Timeout,
    /// No validation worker could be started.
    #[error("no validation worker could start: {0}")]
    NoWorker(String),
}

/// Why a session cannot be rolled back to its checkpoint
/// ([`crate::Session::restore`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RestoreError {
    /// The session is closed.
    #[error("the session is closed")]
    Closed,
    /// No checkpoint was taken yet (or loaded) for this session.
    #[error("the session has no checkpoint to restore; take one first")]
    NoCheckpoint,
}

/// Why variables cannot be bound for a run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VariableError {
    /// Too many.
    #[error("{given} variables given; at most {max} are allowed")]
    TooMany {
        /// How many were given.
        given: usize,
        /// The limit.
        max: usize,
    },
    /// Not a syntactic name.
    #[error(
        "variable name {0:?} is not a syntactic R name (letters, digits, '.', '_'; not starting \
         with a digit or '_'; not a reserved word)"
    )]
    BadName(String),
    /// A name longer than R's symbol limit (`rules::MAX_NAME_BYTES`).
    #[error("variable name {head:?}... is {bytes} bytes long; R limits names to 10000 bytes")]
    TooLong {
        /// The name's first characters.
        head: String,
        /// Its length in bytes.
        bytes: usize,
    },
    /// Given twice.
    #[error("variable {0:?} is given twice")]
    Duplicate(String),
    /// Null.
    #[error("variable {0:?} is null; omit it or give a value")]
    Null(String),
    /// An object.
    #[error(
        "variable {0:?} is an object; use a number, string, boolean or an array of one of those \
         (tables go by data pointer)"
    )]
    Object(String),
    /// An array with a null.
    #[error("variable {0:?} contains null; omit the element or use a value")]
    NullElement(String),
    /// A nested array or object.
    #[error("variable {0:?} contains nested arrays or objects; use a flat array")]
    Nested(String),
    /// Mixed element types.
    #[error("variable {0:?} mixes types; an array must hold numbers, strings or booleans only")]
    Mixed(String),
}

/// Why a checkpoint was not taken or not stored. The checkpoint already in
/// the store (if any) stays valid whatever the cause. Each message says
/// what went wrong and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The checkpoint would pass the store's cap on one checkpoint.
    #[error("{0}")]
    TooLarge(String),
    /// It would pass the tenant's quota of checkpoint bytes.
    #[error("{0}")]
    Quota(String),
    /// This node no longer holds the session's lease (another node took
    /// it over, or the lease ran out while the store was unreachable).
    #[error("{0}")]
    Fenced(String),
    /// The store failed.
    #[error("{0}")]
    Store(String),
    /// The worker did not write it (R failed, the worker ended or did not
    /// answer in time).
    #[error("{0}")]
    Worker(String),
    /// The supervisor keeps no checkpoints.
    #[error(
        "this session has no checkpoint store; start the supervisor with one \
         (SupervisorConfig::checkpoints, rvisor serve --state-dir)"
    )]
    NoStore,
    /// No call has run in the session yet: it has no state to keep.
    #[error("nothing to checkpoint: no call has run in this session yet")]
    NothingYet,
    /// The session is closed (or closed before the checkpoint was taken).
    #[error("the session is closed")]
    Closed,
}
