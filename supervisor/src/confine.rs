//! OS confinement of workers: the settings, the host probe, and the
//! per-worker uids (docs/confinement.md). The layers themselves are set up
//! by the zygote in each forked worker (`rvisor-worker`'s confine module).
//!
//! Two modes, chosen by who runs the supervisor: as root, each worker
//! switches to a host uid of its own; as an ordinary user ("rootless"),
//! the zygote runs in a user namespace of its own and forks each worker
//! into another one, which maps the supervisor's uid to the worker's uid
//! inside and nothing else.

use crate::error::{CgroupMissing, ConfineError, LimitsError, ReadOnlyRefusal};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// How workers are confined. `Confinement::default()` confines with every
/// layer; [`Confinement::unconfined`] is the explicit opt-out (trusted code
/// only), reported in health.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Confinement {
    /// Confine workers (false only by explicit opt-in).
    pub enabled: bool,
    /// Resource limits of each worker.
    pub limits: Limits,
    /// Let workers use the host's network (default: no network at all).
    pub network: bool,
    /// Host paths workers may read (besides what R needs).
    pub read_only: Vec<PathBuf>,
    /// First uid (and gid) of the range workers get theirs from.
    pub uid_base: u32,
    /// Size of that range. It is split in blocks of 1000 and each
    /// supervisor on the host holds one block (at most 1000 live workers
    /// per supervisor, `uid_count / 1000` supervisors at once).
    pub uid_count: u32,
    /// Memory and process limits through cgroups as well as rlimits.
    pub cgroups: CgroupMode,
    /// The programs R code may run (`system()`, `pipe()`, packages that
    /// call a program), each confined like the worker; the rest are
    /// refused.
    pub programs: Programs,
}

/// The programs that a confined worker may run: the operator's allow-list
/// (docs/confinement.md, "Programs"). Resolved once, when the supervisor
/// starts: a name through `PATH`, a path as given, every symlink followed
/// to the file itself. When the list is not empty, the shell R runs
/// programs through (`/bin/sh`) and the interpreters the kernel loads to
/// run them (the ELF interpreter, a script's `#!`) are allowed with it;
/// health lists them all (`sandbox.programs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Programs {
    /// Start from [`DEFAULT_PROGRAMS`], those of them that are installed.
    pub defaults: bool,
    /// More programs: a name (looked up on `PATH`) or an absolute path. One
    /// that cannot be found is a start-up error.
    pub allow: Vec<String>,
}

/// The programs allowed by default when they are installed: `pandoc`, so
/// that R Markdown reports render (`rmarkdown::render()`; it runs pandoc
/// through the shell). pandoc reads and writes documents; the programs it
/// runs when asked to (a `--filter`, a PDF engine such as pdflatex) are
/// refused unless allowed too.
pub const DEFAULT_PROGRAMS: &[&str] = &["pandoc"];

/// What `--allow-program` takes to clear the list (the default included).
pub const NO_PROGRAMS: &str = "none";

impl Default for Programs {
    fn default() -> Self {
        Self {
            defaults: true,
            allow: Vec::new(),
        }
    }
}

impl Programs {
    /// No programs at all: `execve` stays denied.
    pub fn none() -> Self {
        Self {
            defaults: false,
            allow: Vec::new(),
        }
    }

    /// Exactly these programs (names or absolute paths), no default.
    pub fn only<S: Into<String>>(programs: impl IntoIterator<Item = S>) -> Self {
        Self {
            defaults: false,
            allow: programs.into_iter().map(Into::into).collect(),
        }
    }

    /// The list that repeated `--allow-program` flags give: the default
    /// with each NAME or PATH added, where [`NO_PROGRAMS`] clears
    /// everything before it (the default included).
    pub fn from_flags<S: AsRef<str>>(flags: impl IntoIterator<Item = S>) -> Self {
        let mut p = Self::default();
        for f in flags {
            let f = f.as_ref().trim();
            if f == NO_PROGRAMS {
                p = Self::none();
            } else if !f.is_empty() {
                p.allow.push(f.to_string());
            }
        }
        p
    }
}

/// A program confined workers may run, as health lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AllowedProgram {
    /// The name it is known by (`pandoc`, `sh`).
    pub name: String,
    /// The path it runs as (`/usr/bin/pandoc`, `/bin/sh`).
    pub path: String,
    /// The file itself, every symlink resolved (`/usr/bin/dash`): the one
    /// file the worker may execute for it.
    pub file: String,
    /// Why it is allowed: `default` (installed, and the default list was
    /// kept), `allowed` (the operator's `--allow-program`), `shell` (R runs
    /// programs through `/bin/sh`), `interpreter` (the kernel loads it to
    /// run another allowed program: an ELF interpreter, a script's `#!`).
    pub reason: String,
}

/// Whether workers get cgroups (memory incl. their tmpfs, and pids).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CgroupMode {
    /// When the host offers writable v1 memory and pids controllers.
    #[default]
    Auto,
    /// Never (rlimits and the tmpfs cap only).
    Off,
    /// Refuse to start without them.
    Required,
}

/// Per-worker resource limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Limits {
    /// Address space (RLIMIT_AS), bytes.
    pub memory_bytes: u64,
    /// Processes and threads (RLIMIT_NPROC of the worker's own uid).
    pub processes: u64,
    /// Largest file written (RLIMIT_FSIZE), bytes.
    pub file_bytes: u64,
    /// Open files (RLIMIT_NOFILE).
    pub open_files: u64,
    /// Private tmpfs for the temporary and working directory, bytes.
    pub disk_bytes: u64,
    /// CPU seconds over a worker's whole life (calls have their own).
    pub cpu_seconds: Option<u64>,
}

impl Limits {
    /// Checks that R can run within these limits.
    pub fn check(&self) -> Result<(), LimitsError> {
        if self.memory_bytes < 512 << 20 {
            return Err(LimitsError::MemoryTooSmall {
                mib: self.memory_bytes >> 20,
            });
        }
        if self.processes == 0 || self.open_files < 64 {
            return Err(LimitsError::ProcessesOrFiles);
        }
        if self.disk_bytes < 1 << 20 || self.file_bytes < 1 << 20 {
            return Err(LimitsError::DiskTooSmall);
        }
        if self.cpu_seconds == Some(0) {
            return Err(LimitsError::CpuZero);
        }
        Ok(())
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_bytes: 4 << 30,
            processes: 64,
            file_bytes: 256 << 20,
            open_files: 1024,
            disk_bytes: 512 << 20,
            cpu_seconds: None,
        }
    }
}

impl Default for Confinement {
    fn default() -> Self {
        Self {
            enabled: true,
            limits: Limits::default(),
            network: false,
            read_only: Vec::new(),
            uid_base: 2_100_000_000,
            uid_count: 100_000,
            cgroups: CgroupMode::Auto,
            programs: Programs::default(),
        }
    }
}

impl Confinement {
    /// No OS confinement: R code can do whatever the supervisor's user can.
    pub fn unconfined() -> Self {
        Self {
            enabled: false,
            ..Self::default()
        }
    }
}

/// What confinement is in force, for health.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Sandbox {
    /// `confined` or `unconfined` (explicit opt-in).
    pub mode: String,
    /// How workers are confined: `root` (the supervisor runs as root; each
    /// worker has a host uid of its own) or `rootless` (it runs as an
    /// ordinary user; each worker has a user namespace of its own). Absent
    /// when unconfined.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privilege: Option<String>,
    /// The layers every worker gets, e.g. `namespaces: mount, pid, ...`.
    pub layers: Vec<String>,
    /// Per-worker limits (absent when unconfined).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<Limits>,
    /// Whether workers may reach the network.
    pub network: bool,
    /// The programs a worker may run (empty: none, `execve` is denied);
    /// absent when unconfined (workers run any program).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub programs: Option<Vec<AllowedProgram>>,
    /// Workers ask the kernel to merge their identical pages with each
    /// other's (`WorkerConfig::merge_pages`, `--merge-pages`): a side
    /// channel between sessions. Absent when off (the default).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub page_merging: bool,
}

/// The kernel's Landlock ABI version, or None.
fn landlock_abi() -> Option<i64> {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: landlock_create_ruleset(NULL, 0, VERSION) only returns the ABI
    // version (or an error); it takes no pointers we own.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    (v > 0).then_some(v)
}

/// Checks that this host can confine workers as `c` asks and resolves the
/// programs they may run (`temp_root`: the parent of the workers' private
/// directories, where no program may live); the answer lists the layers,
/// or says what is missing and what to do.
pub fn probe(c: &Confinement, temp_root: &Path) -> Result<Sandbox, ConfineError> {
    if !c.enabled {
        return Ok(Sandbox {
            page_merging: false,
            mode: "unconfined".into(),
            privilege: None,
            layers: Vec::new(),
            limits: None,
            network: true,
            programs: None,
        });
    }
    let programs = resolve_programs(&c.programs, temp_root)?;
    let rootless = rootless();
    if rootless {
        probe_user_namespaces()?;
    }
    let mut namespaces = vec!["mount", "pid", "ipc", "uts", "cgroup"];
    if !c.network {
        namespaces.push("net");
    }
    for ns in ["mnt", "pid", "ipc", "uts", "cgroup", "net"] {
        if !std::path::Path::new(&format!("/proc/self/ns/{ns}")).exists() {
            return Err(ConfineError::Namespaces {
                namespace: ns.to_string(),
            });
        }
    }
    let Some(abi) = landlock_abi() else {
        return Err(ConfineError::Landlock);
    };
    // SAFETY: prctl(PR_GET_SECCOMP) reads this process's seccomp mode.
    if unsafe { libc::prctl(libc::PR_GET_SECCOMP, 0, 0, 0, 0) } < 0 {
        return Err(ConfineError::Seccomp);
    }
    if c.uid_count == 0 || c.uid_base == 0 || c.uid_base.checked_add(c.uid_count).is_none() {
        return Err(ConfineError::UidRange {
            base: c.uid_base,
            count: c.uid_count,
        });
    }
    let l = &c.limits;
    let mut layers = Vec::new();
    if rootless {
        // SAFETY: getuid has no arguments and cannot fail.
        let uid = unsafe { libc::getuid() };
        layers.push(format!(
            "user namespace: one per worker, mapping only the supervisor's uid {uid} (to the worker's uid inside) and gid, setgroups denied; the zygote in a user namespace of its own"
        ));
        namespaces.insert(0, "user");
    }
    layers.push(format!("namespaces: {}", namespaces.join(", ")));
    layers.push(format!(
        "filesystem: new root of read-only binds, program directories (/usr/bin, /bin, ...) noexec but for the allowed programs, private tmpfs (nosuid, nodev, noexec) for tmp and work dir, own /proc and minimal /dev{}",
        if rootless { " (null, zero, full, random, urandom bound from the host)" } else { "" }
    ));
    layers.push(if rootless {
        "credentials: the supervisor's host uid, kept apart per worker by its user, pid and mount namespaces; no capabilities (every set and the bounding set cleared), no_new_privs, not dumpable".into()
    } else {
        format!("credentials: own uid/gid per worker from {}, no supplementary groups, no capabilities, no_new_privs, not dumpable", c.uid_base)
    });
    layers.push(programs_layer(&programs));
    let (executable, exec_calls) = if programs.is_empty() {
        ("nothing executable".to_string(), "execve")
    } else {
        (
            format!(
                "executable: only the {} allowed program files",
                programs.len()
            ),
            "execve let through for the allowed programs (Landlock refuses every other file); memfd_create",
        )
    };
    layers.extend([
            format!("landlock: ABI {abi} (files: read-only outside tmp/work dir, {executable}; TCP bind/connect denied; signals and abstract sockets scoped)"),
            format!("seccomp: {exec_calls}, ptrace, process_vm_*, mount, unshare/setns, bpf, keyctl, io_uring, perf, userfaultfd, non-Unix sockets and more denied"),
            format!(
                "rlimits: address space {} MiB, {} processes{}, file size {} MiB, {} open files, core 0{}",
                l.memory_bytes >> 20,
                l.processes,
                if rootless { " (counted in the worker's user namespace)" } else { "" },
                l.file_bytes >> 20,
                l.open_files,
                l.cpu_seconds.map(|s| format!(", CPU {s} s")).unwrap_or_default()
            ),
        ]);
    Ok(Sandbox {
        page_merging: false,
        mode: "confined".into(),
        privilege: Some(if rootless { "rootless" } else { "root" }.into()),
        layers,
        limits: Some(l.clone()),
        network: c.network,
        programs: Some(programs),
    })
}

/// The health line for programs.
fn programs_layer(programs: &[AllowedProgram]) -> String {
    if programs.is_empty() {
        return "programs: none (execve denied; allow one with --allow-program NAME)".into();
    }
    let list: Vec<String> = programs
        .iter()
        .map(|p| match p.reason.as_str() {
            "default" | "allowed" => format!("{} ({})", p.name, p.file),
            why => format!("{} ({}, {why})", p.name, p.file),
        })
        .collect();
    format!(
        "programs: {}; each runs confined like the worker, and can itself run only these",
        list.join(", ")
    )
}

/// The directories a name is looked up in: the supervisor's `PATH`
/// (absolute entries only), else the workers' own.
fn search_path() -> Vec<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| WORKER_PATH.into());
    std::env::split_paths(&path)
        .filter(|d| d.is_absolute())
        .collect()
}

/// `PATH` in a confined worker (the directories of allowed programs that
/// live elsewhere are added to it).
pub const WORKER_PATH: &str = "/usr/local/bin:/usr/bin:/bin";

/// Whether `p` is a regular file (symlinks followed) with an execute bit.
fn executable_file(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Whether `file` starts with `#!`.
fn is_script(file: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 2];
    std::fs::File::open(file).is_ok_and(|mut f| f.read_exact(&mut head).is_ok() && &head == b"#!")
}

/// The interpreter the kernel loads to execute `file`: a script's `#!`
/// program, or an ELF file's `PT_INTERP` (the dynamic loader). None for a
/// static program, a relative interpreter or a file it cannot read.
fn interpreter_of(file: &Path) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(file).ok()?;
    // The kernel reads the first 256 bytes for a `#!` line too.
    let mut head = [0u8; 256];
    let n = f.read_at(&mut head, 0).ok()?;
    let head = &head[..n];
    if let Some(line) = head.strip_prefix(b"#!") {
        let line = line.split(|&b| b == b'\n').next().unwrap_or_default();
        let interp = String::from_utf8_lossy(line)
            .split_whitespace()
            .next()?
            .to_string();
        return interp.starts_with('/').then_some(interp);
    }
    // ELF, little-endian (the hosts rvisor runs on), 32 or 64 bits.
    if head.len() < 64 || &head[..4] != b"\x7fELF" || head[5] != 1 {
        return None;
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as u64;
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as u64;
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let wide = head[4] == 2;
    let (phoff, phentsize, phnum) = if wide {
        (u64_at(head, 32), u16_at(head, 54), u16_at(head, 56))
    } else {
        (u32_at(head, 28), u16_at(head, 42), u16_at(head, 44))
    };
    let min_entry = if wide { 56 } else { 32 };
    if phentsize < min_entry || phnum > 4096 {
        return None;
    }
    let mut ph = vec![0u8; phentsize as usize];
    for i in 0..phnum {
        f.read_exact_at(&mut ph, phoff.checked_add(i * phentsize)?)
            .ok()?;
        const PT_INTERP: u64 = 3;
        if u32_at(&ph, 0) != PT_INTERP {
            continue;
        }
        let (offset, size) = if wide {
            (u64_at(&ph, 8), u64_at(&ph, 32))
        } else {
            (u32_at(&ph, 4), u32_at(&ph, 16))
        };
        let mut name = vec![0u8; size.min(4096) as usize];
        f.read_exact_at(&mut name, offset).ok()?;
        let name = String::from_utf8(name).ok()?;
        let name = name.trim_end_matches('\0');
        return name.starts_with('/').then(|| name.to_string());
    }
    None
}

/// Resolves the allow-list (see [`Programs`]): the programs found, then
/// the shell and the interpreters they need, each file once. A program
/// given explicitly that cannot be found or used is an error saying why.
pub fn resolve_programs(
    p: &Programs,
    temp_root: &Path,
) -> Result<Vec<AllowedProgram>, ConfineError> {
    let dirs = search_path();
    let find = |name: &str| -> Option<PathBuf> {
        dirs.iter()
            .map(|d| d.join(name))
            .find(|c| executable_file(c))
    };
    let refuse = |program: &str, why: String| ConfineError::Program {
        program: program.to_string(),
        why,
    };
    let mut wanted: Vec<(String, PathBuf, &'static str)> = Vec::new();
    if p.defaults {
        for name in DEFAULT_PROGRAMS {
            if let Some(path) = find(name) {
                wanted.push((name.to_string(), path, "default"));
            }
        }
    }
    for entry in &p.allow {
        let entry = entry.trim();
        let path = if entry.contains('/') {
            let path = PathBuf::from(entry);
            if !path.is_absolute() {
                return Err(refuse(entry, "a path must be absolute".into()));
            }
            if !executable_file(&path) {
                return Err(refuse(
                    entry,
                    "no such executable file (a program must be a regular file with an execute bit)"
                        .into(),
                ));
            }
            path
        } else if entry.is_empty() || entry == "." || entry == ".." {
            return Err(refuse(entry, "not a program name".into()));
        } else {
            find(entry).ok_or_else(|| {
                refuse(
                    entry,
                    format!(
                        "no such program on PATH ({}); install it, or give its absolute path",
                        std::env::join_paths(&dirs)
                            .map(|p| p.to_string_lossy().into_owned())
                            .unwrap_or_default()
                    ),
                )
            })?
        };
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| entry.to_string());
        wanted.push((name, path, "allowed"));
    }
    if !wanted.is_empty() {
        wanted.push(("sh".into(), PathBuf::from("/bin/sh"), "shell"));
    }
    let temp_root = std::fs::canonicalize(temp_root).unwrap_or_else(|_| temp_root.to_path_buf());
    let mut out: Vec<AllowedProgram> = Vec::new();
    let mut i = 0;
    while i < wanted.len() {
        let (name, path, reason) = wanted[i].clone();
        i += 1;
        let shown = path.display().to_string();
        let file = std::fs::canonicalize(&path).map_err(|e| {
            refuse(
                &shown,
                match reason {
                    "shell" => format!("the shell R runs programs through cannot be used: {e}"),
                    _ => e.to_string(),
                },
            )
        })?;
        for kernel in ["/proc", "/sys", "/dev"] {
            if file.starts_with(kernel) {
                return Err(refuse(
                    &shown,
                    format!("{} is under {kernel}", file.display()),
                ));
            }
        }
        if file.starts_with(&temp_root) || file.starts_with("/tmp") {
            return Err(refuse(
                &shown,
                format!(
                    "{} is under {} or /tmp, which workers see as their own private scratch space; install it elsewhere",
                    file.display(),
                    temp_root.display()
                ),
            ));
        }
        let Some(file_str) = file.to_str().map(str::to_string) else {
            return Err(refuse(&shown, "its path is not UTF-8".into()));
        };
        if !rootless() {
            // Workers run as uids of their own: the file must be theirs to
            // execute (and, a script, to read).
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&file)
                .map(|m| m.permissions().mode() & 0o7777)
                .unwrap_or(0);
            let script = is_script(&file);
            let need = if script { 0o005 } else { 0o001 };
            if mode & need != need {
                return Err(refuse(
                    &shown,
                    format!(
                        "{} has mode {mode:o}: confined workers run as their own uid and cannot {} it; chmod o+{} it",
                        file.display(),
                        if script { "read and execute" } else { "execute" },
                        if script { "rx" } else { "x" }
                    ),
                ));
            }
        }
        if out.iter().any(|o| o.file == file_str) {
            continue;
        }
        if let Some(interp) = interpreter_of(&file) {
            let iname = Path::new(&interp)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| interp.clone());
            wanted.push((iname, PathBuf::from(interp), "interpreter"));
        }
        out.push(AllowedProgram {
            name,
            path: shown,
            file: file_str,
            reason: reason.into(),
        });
    }
    Ok(out)
}

/// Whether workers are confined rootless: the supervisor is not root.
pub fn rootless() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() != 0 }
}

/// A sysctl's value, trimmed, if this kernel has it.
fn sysctl(path: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Rootless mode: checks that this process may make what a worker makes
/// (a user namespace mapping its own ids, then mount, ipc, uts, net,
/// cgroup and pid namespaces in it, and a tmpfs), in a child that tries.
/// When the kernel refuses, the error names the setting that blocks it.
fn probe_user_namespaces() -> Result<(), ConfineError> {
    let failed = match try_user_namespace() {
        Ok(()) => return Ok(()),
        Err(f) => f,
    };
    if sysctl("/proc/sys/kernel/unprivileged_userns_clone").as_deref() == Some("0") {
        return Err(ConfineError::UnprivilegedUsernsOff);
    }
    let max = sysctl("/proc/sys/user/max_user_namespaces");
    if max.as_deref() == Some("0") || failed.1.raw_os_error() == Some(libc::ENOSPC) {
        return Err(ConfineError::UserNamespaceLimit {
            value: max.unwrap_or_else(|| "unknown".into()),
        });
    }
    if sysctl("/proc/sys/kernel/apparmor_restrict_unprivileged_userns").as_deref() == Some("1") {
        return Err(ConfineError::AppArmorUserns);
    }
    Err(ConfineError::UserNamespace {
        step: failed.0,
        source: failed.1,
    })
}

/// The steps `try_user_namespace` takes, by the number its child reports.
const USERNS_STEPS: [&str; 6] = [
    "unshare(CLONE_NEWUSER)",
    "write /proc/self/setgroups",
    "write /proc/self/uid_map",
    "write /proc/self/gid_map",
    "unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET | CLONE_NEWCGROUP | CLONE_NEWPID)",
    "mount a tmpfs in the new mount namespace",
];

/// Forks a child that takes the steps of `USERNS_STEPS` and reports the
/// first that fails (its index and errno) on a pipe.
fn try_user_namespace() -> Result<(), (&'static str, std::io::Error)> {
    // SAFETY: getuid/getgid take no arguments and cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let texts = [
        c"/proc/self/setgroups".to_owned(),
        c"/proc/self/uid_map".to_owned(),
        c"/proc/self/gid_map".to_owned(),
    ];
    let contents: [Vec<u8>; 3] = [
        b"deny".to_vec(),
        format!("{uid} {uid} 1\n").into_bytes(),
        format!("{gid} {gid} 1\n").into_bytes(),
    ];
    let io_err = |what| (what, std::io::Error::last_os_error());
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io_err("create a pipe for the user namespace probe"));
    }
    let (rd, wr) = (fds[0], fds[1]);
    // SAFETY: the child makes only async-signal-safe system calls (unshare,
    // open, write, close, mount, _exit) on data prepared before the fork,
    // so forking this multithreaded process is sound; it never returns.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: in the child, see above; `report` writes five bytes of a
        // local array to our pipe and ends the child.
        unsafe {
            let report = |step: u8| -> ! {
                let errno = *libc::__errno_location();
                let mut msg = [step, 0, 0, 0, 0];
                msg[1..].copy_from_slice(&errno.to_ne_bytes());
                libc::write(wr, msg.as_ptr().cast(), msg.len());
                libc::_exit(1)
            };
            if libc::unshare(libc::CLONE_NEWUSER) != 0 {
                report(0);
            }
            for (i, (path, text)) in texts.iter().zip(&contents).enumerate() {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY);
                if fd < 0 || libc::write(fd, text.as_ptr().cast(), text.len()) < 0 {
                    report(1 + i as u8);
                }
                libc::close(fd);
            }
            let flags = libc::CLONE_NEWNS
                | libc::CLONE_NEWIPC
                | libc::CLONE_NEWUTS
                | libc::CLONE_NEWNET
                | libc::CLONE_NEWCGROUP
                | libc::CLONE_NEWPID;
            if libc::unshare(flags) != 0 {
                report(4);
            }
            let (root, tmp, tmpfs) = (c"/".as_ptr(), c"/tmp".as_ptr(), c"tmpfs".as_ptr());
            if libc::mount(
                std::ptr::null(),
                root,
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
                || libc::mount(
                    tmpfs,
                    tmp,
                    tmpfs,
                    libc::MS_NOSUID | libc::MS_NODEV,
                    std::ptr::null(),
                ) != 0
            {
                report(5);
            }
            libc::_exit(0)
        }
    }
    // SAFETY: closing our copy of the write end, which we own.
    unsafe { libc::close(wr) };
    if pid < 0 {
        // SAFETY: closing the read end, which we own.
        unsafe { libc::close(rd) };
        return Err(io_err("fork the user namespace probe"));
    }
    let mut msg = [0u8; 5];
    // SAFETY: read into a local buffer from our pipe; waitpid on our child.
    let n = unsafe {
        let n = libc::read(rd, msg.as_mut_ptr().cast(), msg.len());
        libc::close(rd);
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
        n
    };
    if n == msg.len() as isize {
        let errno = i32::from_ne_bytes([msg[1], msg[2], msg[3], msg[4]]);
        let step = USERNS_STEPS
            .get(msg[0] as usize)
            .copied()
            .unwrap_or("the probe");
        return Err((step, std::io::Error::from_raw_os_error(errno)));
    }
    Ok(())
}

/// Per-worker cgroups (v1 memory and pids controllers) under a group of
/// this supervisor's; removed when the worker ends, and at start-up when a
/// dead supervisor left them.
#[derive(Debug)]
pub struct Cgroups {
    /// This supervisor's group in each controller.
    parents: Vec<PathBuf>,
}

const CGROUP_ROOT: &str = "/sys/fs/cgroup";
const CGROUP_CONTROLLERS: [&str; 2] = ["memory", "pids"];
/// Used when mounted: the CPU time of a worker and all its children, for
/// per-call CPU limits (RLIMIT_CPU counts each process alone).
const CGROUP_OPTIONAL: [&str; 1] = ["cpuacct"];

fn write_value(dir: &std::path::Path, file: &str, value: &str) -> Result<(), ConfineError> {
    let path = dir.join(file);
    std::fs::write(&path, value).map_err(|source| ConfineError::Cgroup {
        what: format!("set {} to {value}", path.display()),
        path,
        source,
    })
}

impl Cgroups {
    /// This host's v1 memory and pids hierarchies, with a group for this
    /// supervisor in each; `Ok(None)` when they are missing and `mode` is
    /// `Auto`.
    pub fn detect(mode: CgroupMode) -> Result<Option<Cgroups>, ConfineError> {
        if mode == CgroupMode::Off {
            return Ok(None);
        }
        let missing = |why: CgroupMissing| {
            if mode == CgroupMode::Required {
                Err(ConfineError::CgroupsRequired(why))
            } else {
                Ok(None)
            }
        };
        let root = std::path::Path::new(CGROUP_ROOT);
        if root.join("cgroup.controllers").exists() {
            return missing(CgroupMissing::V2Only);
        }
        // One group per supervisor, not per process: a process may hold
        // several supervisors, and dropping one removes its group.
        static SUPERVISORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let own = format!(
            "rvisor-{}-{}",
            std::process::id(),
            SUPERVISORS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let mut parents = Vec::new();
        for c in CGROUP_CONTROLLERS {
            let base = root.join(c);
            if !base.join("cgroup.procs").exists() {
                return missing(CgroupMissing::NotMounted {
                    controller: c.to_string(),
                    path: base,
                });
            }
            sweep_stale(&base);
            let parent = base.join(&own);
            match std::fs::create_dir(&parent) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(source) => {
                    for p in &parents {
                        let _ = std::fs::remove_dir(p);
                    }
                    return missing(CgroupMissing::NotWritable {
                        path: parent,
                        source,
                    });
                }
            }
            parents.push(parent);
        }
        for c in CGROUP_OPTIONAL {
            let base = root.join(c);
            if base.join("cgroup.procs").exists() {
                sweep_stale(&base);
                let parent = base.join(&own);
                if std::fs::create_dir(&parent).is_ok() || parent.is_dir() {
                    parents.push(parent);
                }
            }
        }
        Ok(Some(Cgroups { parents }))
    }

    /// Creates worker `name`'s groups with `limits`; returns their
    /// directories (the worker writes itself into each `cgroup.procs`).
    pub(crate) fn create(&self, name: &str, limits: &Limits) -> Result<Vec<PathBuf>, ConfineError> {
        let mut dirs = Vec::new();
        let made = (|| {
            for parent in &self.parents {
                let dir = parent.join(name);
                std::fs::create_dir(&dir).map_err(|source| ConfineError::Cgroup {
                    what: format!("create cgroup {}", dir.display()),
                    path: dir.clone(),
                    source,
                })?;
                dirs.push(dir.clone());
                if parent.parent().is_some_and(|p| p.ends_with("cpuacct")) {
                    // Accounting only: read for per-call CPU limits.
                } else if parent.parent().is_some_and(|p| p.ends_with("memory")) {
                    // RAM of the process and of its tmpfs together.
                    let bytes = (limits.memory_bytes + limits.disk_bytes).to_string();
                    write_value(&dir, "memory.limit_in_bytes", &bytes)?;
                    if dir.join("memory.memsw.limit_in_bytes").exists() {
                        write_value(&dir, "memory.memsw.limit_in_bytes", &bytes)?;
                    }
                } else {
                    // The worker and its children (one spare slot).
                    write_value(&dir, "pids.max", &(limits.processes + 2).to_string())?;
                }
            }
            Ok(())
        })();
        match made {
            Ok(()) => Ok(dirs),
            Err(e) => {
                remove(&dirs);
                Err(e)
            }
        }
    }
}

/// The file with the CPU time (ns) of the worker whose groups are `dirs`.
pub(crate) fn cpu_usage_file(dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter()
        .find(|d| {
            d.parent()
                .and_then(|p| p.parent())
                .is_some_and(|p| p.ends_with("cpuacct"))
        })
        .map(|d| d.join("cpuacct.usage"))
}

/// Removes worker groups (their processes have ended).
pub(crate) fn remove(dirs: &[PathBuf]) {
    for d in dirs {
        // A dying process holds its group until the kernel has torn it
        // down (~1-3 ms here): retry often, for at most 100 ms (a shutting
        // down supervisor waits here for the worker it killed last).
        for _ in 0..400 {
            match std::fs::remove_dir(d) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(_) => std::thread::sleep(std::time::Duration::from_micros(250)),
            }
        }
    }
}

/// Removes a supervisor's group and its workers' groups.
fn remove_tree(parent: &std::path::Path) {
    if let Ok(children) = std::fs::read_dir(parent) {
        let dirs: Vec<PathBuf> = children
            .flatten()
            .filter(|c| c.path().is_dir())
            .map(|c| c.path())
            .collect();
        remove(&dirs);
    }
    let _ = std::fs::remove_dir(parent);
}

/// Removes groups of supervisors that are gone.
fn sweep_stale(base: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        // rvisor-PID-N (rvisor-PID before supervisors had groups of their own).
        let Some(pid) = name
            .strip_prefix("rvisor-")
            .and_then(|p| p.split('-').next())
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        // SAFETY: kill with signal 0 only checks that the process exists.
        let alive = pid == std::process::id() as i32 || unsafe { libc::kill(pid, 0) } == 0;
        if alive {
            continue;
        }
        remove_tree(&e.path());
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        for p in &self.parents {
            remove_tree(p);
        }
    }
}

/// Checks a host path a configuration wants to expose read-only: absolute,
/// existing, and neither a kernel view (/proc, /sys, /dev) nor the root or
/// an ancestor of the workers' private directories (`temp_root`), which it
/// would cover.
pub fn check_read_only(
    p: &std::path::Path,
    temp_root: &std::path::Path,
) -> Result<(), ConfineError> {
    let refuse = |why| ConfineError::ReadOnlyPath {
        path: p.to_path_buf(),
        why,
    };
    if !p.is_absolute() {
        return Err(refuse(ReadOnlyRefusal::NotAbsolute));
    }
    let real = std::fs::canonicalize(p).map_err(|e| refuse(ReadOnlyRefusal::Unresolvable(e)))?;
    let temp_root = std::fs::canonicalize(temp_root).unwrap_or_else(|_| temp_root.to_path_buf());
    for kernel in ["/proc", "/sys", "/dev"] {
        if real.starts_with(kernel) {
            return Err(refuse(ReadOnlyRefusal::KernelView(kernel)));
        }
    }
    if temp_root.starts_with(&real) || real == std::path::Path::new("/tmp") {
        return Err(refuse(ReadOnlyRefusal::CoversTempRoot(temp_root)));
    }
    Ok(())
}

/// Checks that a confined worker (running as some other uid) can enter
/// directory `d`: it and every ancestor must be searchable by others.
pub fn check_enterable(d: &std::path::Path) -> Result<(), ConfineError> {
    use std::os::unix::fs::PermissionsExt;
    let path_error = |p: &std::path::Path| {
        let path = p.to_path_buf();
        move |source| ConfineError::Path { path, source }
    };
    let real = std::fs::canonicalize(d).map_err(path_error(d))?;
    if rootless() {
        // Rootless workers reach host files as the supervisor's own uid.
        return Ok(());
    }
    for a in real.ancestors() {
        let mode = std::fs::metadata(a)
            .map_err(path_error(a))?
            .permissions()
            .mode();
        let need = if a == real { 0o005 } else { 0o001 };
        if mode & need != need {
            return Err(ConfineError::NotEnterable {
                dir: d.to_path_buf(),
                action: if a == real { "read" } else { "pass through" },
                blocked: a.to_path_buf(),
                mode: mode & 0o7777,
            });
        }
    }
    Ok(())
}

/// The health line for cgroups.
pub(crate) fn cgroup_layer(l: &Limits, cgroups: Option<&Cgroups>) -> String {
    match cgroups {
        Some(cg) => format!(
            "cgroups v1: memory {} MiB (process and its tmpfs), {} pids per worker{}",
            (l.memory_bytes + l.disk_bytes) >> 20,
            l.processes + 2,
            if cg.parents.iter().any(|p| p.parent().is_some_and(|b| b.ends_with("cpuacct"))) {
                "; CPU accounting (a call's CPU limit counts the processes it starts)"
            } else {
                ""
            }
        ),
        None if rootless() => "cgroups: not used (rootless: the host's v1 memory and pids controllers are not delegated to this user); memory is bounded by the address-space rlimit and the tmpfs cap, processes by RLIMIT_NPROC in each worker's user namespace".into(),
        None => "cgroups: not used (turned off, or the host has no writable v1 memory and pids controllers)".into(),
    }
}

/// Uids per block: a supervisor reserves one block host-wide.
const UID_BLOCK: u32 = 1000;

/// Hands out one uid per live worker, from a block of uids this supervisor
/// holds host-wide (an flock on a file per block): the kernel counts
/// processes per uid across the whole host, so two supervisors must never
/// share one (a fork bomb in one would starve the other).
#[derive(Debug)]
pub struct Uids {
    used: Mutex<(HashSet<u32>, u32)>,
    base: u32,
    count: u32,
    _lock: Option<std::fs::File>,
}

impl Uids {
    /// A free block of `c`'s range, held while this value lives.
    pub(crate) fn reserve(c: &Confinement) -> Result<Uids, ConfineError> {
        use std::os::fd::AsRawFd;
        if rootless() {
            // The uids are inside each worker's own user namespace, mapped
            // to the supervisor's: nothing host-wide to hold.
            return Ok(Uids {
                used: Mutex::new((HashSet::new(), 0)),
                base: c.uid_base,
                count: c.uid_count.min(UID_BLOCK),
                _lock: None,
            });
        }
        let dir = if std::path::Path::new("/run").is_dir() {
            PathBuf::from("/run/rvisor/uid-blocks")
        } else {
            std::env::temp_dir().join("rvisor-uid-blocks")
        };
        std::fs::create_dir_all(&dir).map_err(|source| ConfineError::UidRegistry {
            what: "create",
            path: dir.clone(),
            source,
        })?;
        let size = c.uid_count.min(UID_BLOCK);
        let blocks = (c.uid_count / size).max(1);
        for b in 0..blocks {
            let base = c.uid_base + b * size;
            let path = dir.join(format!("{base}-{size}"));
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map_err(|source| ConfineError::UidRegistry {
                    what: "open",
                    path: path.clone(),
                    source,
                })?;
            // SAFETY: flock on a descriptor we own; released when it closes.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(Uids {
                    used: Mutex::new((HashSet::new(), 0)),
                    base,
                    count: size,
                    _lock: Some(f),
                });
            }
        }
        Err(ConfineError::UidsExhausted {
            blocks,
            base: c.uid_base,
        })
    }

    /// A range without a host-wide reservation (tests).
    #[cfg(test)]
    fn with_range(base: u32, count: u32) -> Uids {
        Uids {
            used: Mutex::new((HashSet::new(), 0)),
            base,
            count,
            _lock: None,
        }
    }

    /// How many uids this supervisor has.
    pub(crate) fn count(&self) -> u32 {
        self.count
    }

    /// A uid no live worker of this supervisor has.
    pub(crate) fn take(&self) -> Option<u32> {
        let mut g = self.used.lock().unwrap_or_else(|e| e.into_inner());
        let (used, next) = &mut *g;
        for _ in 0..self.count {
            let uid = self.base + (*next % self.count);
            *next = next.wrapping_add(1);
            if used.insert(uid) {
                return Some(uid);
            }
        }
        None
    }

    /// Gives `uid` back (its worker ended).
    pub(crate) fn give_back(&self, uid: u32) {
        self.used
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .remove(&uid);
    }
}

/// The protocol's per-worker confinement for a worker with `uid`.
pub(crate) fn request(
    c: &Confinement,
    uid: u32,
    libpath: &[PathBuf],
    cgroups: &[PathBuf],
    programs: &[AllowedProgram],
) -> rvisor_protocol::Confine {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1);
    rvisor_protocol::Confine {
        uid,
        gid: uid,
        memory_bytes: c.limits.memory_bytes,
        processes: c.limits.processes,
        file_bytes: c.limits.file_bytes,
        open_files: c.limits.open_files,
        disk_bytes: c.limits.disk_bytes,
        cpu_seconds: c.limits.cpu_seconds,
        network: c.network,
        read_only: c
            .read_only
            .iter()
            .chain(libpath)
            .map(|p| p.display().to_string())
            .collect(),
        cores,
        cgroups: cgroups
            .iter()
            .map(|d| d.join("cgroup.procs").display().to_string())
            .collect(),
        rootless: rootless(),
        programs: programs
            .iter()
            .map(|p| rvisor_protocol::ProgramFile {
                name: p.name.clone(),
                path: p.path.clone(),
                file: p.file.clone(),
                reason: p.reason.clone(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_are_unique_among_live_workers_and_reused_after() {
        let u = Uids::with_range(5000, 3);
        let a = u.take().unwrap();
        let b = u.take().unwrap();
        let d = u.take().unwrap();
        let mut all = vec![a, b, d];
        all.sort();
        assert_eq!(all, vec![5000, 5001, 5002]);
        assert_eq!(u.take(), None, "the range is used up");
        u.give_back(b);
        assert_eq!(u.take(), Some(b));
    }

    #[test]
    fn two_supervisors_never_hold_the_same_uid_block() {
        // A range of its own, so parallel tests do not meet here.
        let c = Confinement {
            uid_base: 1_900_000_000 + (std::process::id() % 1000) * 3000,
            uid_count: 2000,
            ..Confinement::default()
        };
        let first = Uids::reserve(&c).unwrap();
        let second = Uids::reserve(&c).unwrap();
        assert_ne!(first.base, second.base);
        let err = Uids::reserve(&c).unwrap_err();
        assert!(
            matches!(err, ConfineError::UidsExhausted { blocks: 2, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("held by other rvisor supervisors"));
        drop(first);
        let again = Uids::reserve(&c).unwrap();
        assert_eq!(again.base, c.uid_base, "a released block is free again");
    }

    #[test]
    fn allow_program_flags_add_to_the_default_and_none_clears() {
        assert_eq!(Programs::from_flags::<&str>([]), Programs::default());
        assert_eq!(
            Programs::from_flags(["git", "/usr/bin/R"]),
            Programs {
                defaults: true,
                allow: vec!["git".into(), "/usr/bin/R".into()],
            }
        );
        assert_eq!(Programs::from_flags(["none"]), Programs::none());
        assert_eq!(Programs::from_flags(["git", "none"]), Programs::none());
        assert_eq!(
            Programs::from_flags(["none", "git"]),
            Programs::only(["git"])
        );
    }

    #[test]
    fn programs_resolve_to_their_files_with_the_shell_and_interpreters() {
        let dir = std::env::temp_dir();
        assert!(resolve_programs(&Programs::none(), &dir)
            .unwrap()
            .is_empty());
        let sh = std::fs::canonicalize("/bin/sh").unwrap();
        let list = resolve_programs(&Programs::only(["sh"]), &dir).unwrap();
        let files: Vec<&str> = list.iter().map(|p| p.file.as_str()).collect();
        assert_eq!(list[0].name, "sh");
        assert_eq!(list[0].reason, "allowed");
        assert_eq!(list[0].file, sh.to_str().unwrap());
        // The shell is there once, and so is the ELF interpreter it needs.
        assert_eq!(
            files.iter().filter(|f| **f == sh.to_str().unwrap()).count(),
            1
        );
        let interp = interpreter_of(&sh).expect("the shell is dynamically linked");
        let interp = std::fs::canonicalize(interp).unwrap();
        let entry = list
            .iter()
            .find(|p| p.file == interp.to_str().unwrap())
            .expect("the ELF interpreter is allowed with the shell");
        assert_eq!(entry.reason, "interpreter");
    }

    #[test]
    fn a_script_brings_its_interpreter_and_a_missing_program_is_an_error() {
        // Outside /tmp, which workers see as their own (and which a
        // checkout under /tmp would put target/ in).
        let d =
            PathBuf::from("/var/tmp").join(format!("rvisor-programs-unit-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let script = d.join("tool");
        std::fs::write(&script, "#! /usr/bin/env sh\necho hi\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(interpreter_of(&script).as_deref(), Some("/usr/bin/env"));
        let list = resolve_programs(
            &Programs::only([script.to_str().unwrap()]),
            Path::new("/tmp"),
        )
        .unwrap();
        assert_eq!(list[0].name, "tool");
        let env = std::fs::canonicalize("/usr/bin/env").unwrap();
        let entry = list.iter().find(|p| p.file == env.to_str().unwrap());
        assert_eq!(
            entry.map(|e| e.reason.as_str()),
            Some("interpreter"),
            "{list:?}"
        );
        assert!(list.iter().any(|p| p.reason == "shell"), "{list:?}");

        let err = resolve_programs(
            &Programs::only(["rvisor-no-such-program"]),
            Path::new("/tmp"),
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("rvisor-no-such-program") && msg.contains("PATH"),
            "{msg}"
        );
        let err = resolve_programs(&Programs::only(["bin/sh"]), Path::new("/tmp")).unwrap_err();
        assert!(err.to_string().contains("absolute"), "{err}");
        // Under the workers' temporary root: refused.
        let err = resolve_programs(&Programs::only([script.to_str().unwrap()]), &d).unwrap_err();
        assert!(err.to_string().contains("scratch space"), "{err}");
        // As root, workers have uids of their own: a file only its owner
        // may execute is refused.
        if !rootless() {
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o750)).unwrap();
            let err = resolve_programs(
                &Programs::only([script.to_str().unwrap()]),
                Path::new("/tmp"),
            )
            .unwrap_err();
            assert!(err.to_string().contains("chmod o+rx"), "{err}");
        }
        // The default list skips what is not installed.
        let _ = resolve_programs(&Programs::default(), Path::new("/tmp")).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn unconfined_is_reported_as_such() {
        let s = probe(&Confinement::unconfined(), Path::new("/tmp")).unwrap();
        assert_eq!(s.mode, "unconfined");
        assert!(s.layers.is_empty());
    }
}
