//! OS confinement of a forked worker (docs/confinement.md).
//!
//! Runs in the worker (pid 1 of its own pid namespace), single-threaded,
//! before it reads its first request: as root, or (rootless mode) as the
//! owner of a new user namespace of its own, whose id maps it writes
//! first (`map_ids`). Layers, in order:
//! its cgroups and new mount, ipc, uts, cgroup and (unless network is on)
//! network namespaces, a new root (tmpfs with read-only binds of what R needs, a size-capped
//! private tmpfs for the temporary and working directory, a new /proc, a
//! minimal /dev), rlimits, an unprivileged uid/gid of its own with every
//! capability dropped, no_new_privs, Landlock, and seccomp last. Any failure
//! is returned: the caller ends the process rather than serve unconfined.
//!
//! Programs (docs/confinement.md, "Programs"): with an empty allow-list
//! seccomp denies `execve` and nothing runs. Otherwise seccomp lets
//! `execve` through and the allow-list is kept by the files: Landlock
//! grants Execute on the allowed files alone, and in the new root the
//! program directories are noexec with only those files bound back
//! executable.

use crate::caps;
use rvisor_protocol::{Confine, ProgramFile};
use std::ffi::CString;
use std::path::{Path, PathBuf};

/// Exit status of a confined worker that hit its CPU limit: as pid 1 of
/// its namespace it cannot die of SIGXCPU, so its handler exits with this
/// and the zygote reports it as SIGXCPU.
pub const EXIT_CPU_LIMIT: i32 = 128 + libc::SIGXCPU;

/// Host paths bound read-only into the new root when they exist (symlinks
/// are recreated as symlinks). R's BLAS link goes through /etc/alternatives.
const BINDS: &[&str] = &[
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/R",
    "/etc/fonts",
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/timezone",
    "/etc/locale.alias",
    "/etc/os-release",
    "/etc/nsswitch.conf",
    "/var/cache/fontconfig",
];

/// Directories that hold programs. In the new root each is bound again
/// noexec (its files stay readable), and the allowed programs in it are
/// bound back one by one with exec allowed: so no other file there can be
/// executed, mapped executable by the dynamic loader run as a program
/// (`ld.so /usr/bin/id`), or pass `access(X_OK)`, which is what `which`
/// and the shell's `test -x` look at. Symlinks among them (merged
/// /usr: `/bin -> usr/bin`) are left alone: they lead to one of the others.
const PROGRAM_DIRS: &[&str] = &[
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
    "/usr/games",
    "/usr/local/games",
];

/// Device nodes of the minimal /dev: the memory devices (major 1), by minor.
const DEVICES: &[(&str, u32)] = &[
    ("null", 3),
    ("zero", 5),
    ("full", 7),
    ("random", 8),
    ("urandom", 9),
];

fn err(what: impl std::fmt::Display) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

fn cstr(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("path {s:?} contains a NUL byte"))
}

fn path_str(p: &Path) -> Result<&str, String> {
    p.to_str()
        .ok_or_else(|| format!("path {} is not UTF-8", p.display()))
}

fn mount(
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), String> {
    let t = cstr(path_str(target)?)?;
    let s = src.map(cstr).transpose()?;
    let f = fstype.map(cstr).transpose()?;
    let d = data.map(cstr).transpose()?;
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: mount(2) with NUL-terminated strings that live across the call
    // (or null where the call allows it).
    let rc = unsafe { libc::mount(ptr(&s), t.as_ptr(), ptr(&f), flags, ptr(&d).cast()) };
    if rc != 0 {
        return Err(err(format!(
            "mount {} on {} ({})",
            src.unwrap_or("-"),
            target.display(),
            fstype.unwrap_or("bind/remount")
        )));
    }
    Ok(())
}

/// The mount flags of the mount `p` is on that a user namespace may not
/// clear on a bind of it (noexec, nosuid, nodev, rdonly and the atime
/// flags are locked when a mount namespace is made by a less privileged
/// user namespace): a remount of the bind must repeat them.
fn locked_flags(p: &Path) -> Result<libc::c_ulong, String> {
    let c = cstr(path_str(p)?)?;
    // SAFETY: statvfs(3) with a NUL-terminated path that lives across the
    // call and a zeroed struct we own.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(err(format!("statvfs {}", p.display())));
    }
    let mut flags = 0;
    for (st_flag, ms_flag) in [
        (libc::ST_NOEXEC, libc::MS_NOEXEC),
        (libc::ST_NOSUID, libc::MS_NOSUID),
        (libc::ST_NODEV, libc::MS_NODEV),
        (libc::ST_RDONLY, libc::MS_RDONLY),
        (libc::ST_NOATIME, libc::MS_NOATIME),
        (libc::ST_NODIRATIME, libc::MS_NODIRATIME),
        (libc::ST_RELATIME, libc::MS_RELATIME),
    ] {
        if st.f_flag & st_flag != 0 {
            flags |= ms_flag;
        }
    }
    Ok(flags)
}

/// Binds `src` read-only at `dst` (nosuid, nodev; exec stays allowed:
/// shared libraries are mapped executable).
fn bind_ro(src: &Path, dst: &Path) -> Result<(), String> {
    bind_ro_with(src, dst, 0)
}

/// [`bind_ro`] with `extra` mount flags (`MS_NOEXEC`).
fn bind_ro_with(src: &Path, dst: &Path, extra: libc::c_ulong) -> Result<(), String> {
    let s = path_str(src)?;
    mount(Some(s), dst, None, libc::MS_BIND | libc::MS_REC, None)?;
    mount(
        None,
        dst,
        None,
        libc::MS_BIND
            | libc::MS_REMOUNT
            | libc::MS_RDONLY
            | libc::MS_NOSUID
            | libc::MS_NODEV
            | extra
            | locked_flags(src)?,
        None,
    )
}

/// The program directories noexec, then each allowed program's file bound
/// read-only at its own path with exec allowed (visible even where the
/// view would not show it), and the path it is run as leading to it.
/// After every other bind, so none covers these.
fn programs_view(root: &Path, programs: &[ProgramFile]) -> Result<(), String> {
    for d in PROGRAM_DIRS {
        let inside = under(root, d);
        match std::fs::symlink_metadata(&inside) {
            Ok(m) if m.is_dir() => bind_ro_with(Path::new(d), &inside, libc::MS_NOEXEC)?,
            _ => {}
        }
    }
    for p in programs {
        let file = Path::new(&p.file);
        let dst = under(root, &p.file);
        if std::fs::symlink_metadata(&dst).is_err() {
            if let Some(parent) = dst.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| format!("mkdir {}: {e}", parent.display()))?;
            }
            std::fs::write(&dst, b"").map_err(|e| format!("create {}: {e}", dst.display()))?;
        }
        bind_ro(file, &dst)?;
        let called = under(root, &p.path);
        if p.path != p.file && std::fs::symlink_metadata(&called).is_err() {
            if let Some(parent) = called.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| format!("mkdir {}: {e}", parent.display()))?;
            }
            std::os::unix::fs::symlink(file, &called)
                .map_err(|e| format!("symlink {}: {e}", called.display()))?;
        }
    }
    Ok(())
}

/// `root` + absolute `p`.
fn under(root: &Path, p: &str) -> PathBuf {
    root.join(p.trim_start_matches('/'))
}

/// Recreates host path `p` inside `root`: a symlink as the same symlink, a
/// directory or file as a read-only bind. Missing paths are skipped.
fn expose(root: &Path, p: &str) -> Result<(), String> {
    let Ok(meta) = std::fs::symlink_metadata(p) else {
        return Ok(());
    };
    let dst = under(root, p);
    if let Some(parent) = dst.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("mkdir {}: {e}", parent.display()))?;
    }
    if meta.file_type().is_symlink() {
        let target = std::fs::read_link(p).map_err(|e| format!("readlink {p}: {e}"))?;
        return std::os::unix::fs::symlink(&target, &dst)
            .map_err(|e| format!("symlink {}: {e}", dst.display()));
    }
    if meta.is_dir() {
        std::fs::create_dir_all(&dst).map_err(|e| format!("mkdir {}: {e}", dst.display()))?;
    } else {
        std::fs::write(&dst, b"").map_err(|e| format!("create {}: {e}", dst.display()))?;
    }
    bind_ro(Path::new(p), &dst)
}

fn write_file(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("write {}: {e}", path.display()))
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), String> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid))
        .map_err(|e| format!("chown {}: {e}", path.display()))
}

/// Builds the new root on `work` (the worker's temporary directory, which
/// keeps its path inside) and pivots into it.
fn filesystem(c: &Confine, work: &str) -> Result<(), String> {
    let root = PathBuf::from(work);
    // Nothing mounted here propagates back to the host.
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;
    mount(
        Some("tmpfs"),
        &root,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV,
        Some("size=4m,mode=0755"),
    )?;
    for p in BINDS {
        expose(&root, p)?;
    }
    let etc = root.join("etc");
    std::fs::create_dir_all(&etc).map_err(|e| format!("mkdir {}: {e}", etc.display()))?;
    write_file(
        &etc.join("passwd"),
        &format!(
            "root:x:0:0:root:/:/usr/sbin/nologin\nrvisor:x:{}:{}:rvisor worker:{work}:/usr/sbin/nologin\n",
            c.uid, c.gid
        ),
    )?;
    write_file(
        &etc.join("group"),
        &format!("root:x:0:\nrvisor:x:{}:\n", c.gid),
    )?;
    write_file(&etc.join("hostname"), "rvisor\n")?;
    write_file(
        &etc.join("hosts"),
        "127.0.0.1 localhost rvisor\n::1 localhost\n",
    )?;

    // The private, size-capped scratch space: /tmp, and the temporary
    // directory at its host path (the same tmpfs, so one cap for both).
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp).map_err(|e| format!("mkdir {}: {e}", tmp.display()))?;
    mount(
        Some("tmpfs"),
        &tmp,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        Some(&format!(
            "size={},mode=0700,uid={},gid={}",
            c.disk_bytes.max(1 << 20),
            c.uid,
            c.gid
        )),
    )?;
    let inside = under(&root, work);
    std::fs::create_dir_all(&inside).map_err(|e| format!("mkdir {}: {e}", inside.display()))?;
    if inside.starts_with(&tmp) {
        chown(&inside, c.uid, c.gid)?;
    } else {
        mount(Some(path_str(&tmp)?), &inside, None, libc::MS_BIND, None)?;
    }

    // Host paths the configuration exposes, after the scratch space so that
    // paths under /tmp stay visible (the supervisor refuses paths that
    // would cover the scratch space itself).
    for p in &c.read_only {
        expose(&root, p)?;
    }
    programs_view(&root, &c.programs)?;

    // A /proc of this pid namespace only.
    let proc_dir = root.join("proc");
    std::fs::create_dir_all(&proc_dir).map_err(|e| format!("mkdir {}: {e}", proc_dir.display()))?;
    mount(
        Some("proc"),
        &proc_dir,
        Some("proc"),
        libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
        None,
    )?;

    // A minimal /dev.
    let dev = root.join("dev");
    std::fs::create_dir_all(&dev).map_err(|e| format!("mkdir {}: {e}", dev.display()))?;
    mount(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("size=64k,mode=0755"),
    )?;
    // As root: made as device nodes rather than bound from the host's
    // /dev: a bind shows the host's devtmpfs (its size, half the host's
    // memory) in the worker's mountinfo. Rootless: bound, since a user
    // namespace may not make device nodes (and its tmpfs would not open
    // them).
    for (d, minor) in DEVICES {
        let dst = dev.join(d);
        if c.rootless {
            let src = Path::new("/dev").join(d);
            std::fs::write(&dst, b"").map_err(|e| format!("create {}: {e}", dst.display()))?;
            mount(Some(path_str(&src)?), &dst, None, libc::MS_BIND, None)?;
            mount(
                None,
                &dst,
                None,
                libc::MS_BIND
                    | libc::MS_REMOUNT
                    | libc::MS_NOSUID
                    | libc::MS_NOEXEC
                    | (locked_flags(&src)? & !libc::MS_NODEV),
                None,
            )?;
            continue;
        }
        let path = cstr(path_str(&dst)?)?;
        // SAFETY: mknod(2) with a NUL-terminated path that lives across the
        // call; the numbers are the fixed ones of the memory devices.
        let rc = unsafe {
            libc::mknod(
                path.as_ptr(),
                libc::S_IFCHR | 0o666,
                libc::makedev(1, *minor),
            )
        };
        if rc != 0 {
            return Err(err(format!("mknod {}", dst.display())));
        }
        // The umask applies to mknod: everyone may read and write these.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o666))
            .map_err(|e| format!("chmod {}: {e}", dst.display()))?;
    }
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(target, dev.join(name))
            .map_err(|e| format!("symlink /dev/{name}: {e}"))?;
    }
    mount(
        None,
        &dev,
        None,
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NOEXEC,
        None,
    )?;

    // Into the new root; the old one is detached.
    std::env::set_current_dir(&root).map_err(|e| format!("chdir {}: {e}", root.display()))?;
    let dot = cstr(".")?;
    // SAFETY: pivot_root(".", ".") stacks the old root on the new one, and
    // umount2 detaches it (pivot_root(2)); both take valid C strings.
    unsafe {
        if libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) != 0 {
            return Err(err("pivot_root"));
        }
        if libc::umount2(dot.as_ptr(), libc::MNT_DETACH) != 0 {
            return Err(err("detach the old root"));
        }
    }
    std::env::set_current_dir("/").map_err(|e| format!("chdir /: {e}"))?;
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
        None,
    )?;
    let host = b"rvisor";
    // SAFETY: sethostname with a buffer and its length (own uts namespace).
    if unsafe { libc::sethostname(host.as_ptr().cast(), host.len()) } != 0 {
        return Err(err("sethostname"));
    }
    Ok(())
}

/// Sets both limits of `resource` to `value`, or to the current hard
/// limit when that is lower and this worker cannot raise it (rootless):
/// tighter than asked, never looser.
fn rlimit(resource: libc::__rlimit_resource_t, value: u64, name: &str) -> Result<(), String> {
    let mut cur = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills a struct we own.
    if unsafe { libc::getrlimit(resource, &mut cur) } != 0 {
        return Err(err(format!("getrlimit {name}")));
    }
    let value = value.min(cur.rlim_max);
    let rl = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: setrlimit with a struct we own.
    if unsafe { libc::setrlimit(resource, &rl) } != 0 {
        return Err(err(format!("setrlimit {name}={value}")));
    }
    Ok(())
}

fn limits(c: &Confine) -> Result<(), String> {
    rlimit(libc::RLIMIT_AS, c.memory_bytes, "AS")?;
    rlimit(libc::RLIMIT_NPROC, c.processes, "NPROC")?;
    rlimit(libc::RLIMIT_FSIZE, c.file_bytes, "FSIZE")?;
    rlimit(libc::RLIMIT_NOFILE, c.open_files, "NOFILE")?;
    rlimit(libc::RLIMIT_CORE, 0, "CORE")?;
    if let Some(cpu) = c.cpu_seconds {
        // Soft limit: SIGXCPU (see EXIT_CPU_LIMIT); one second later SIGKILL.
        let rl = libc::rlimit {
            rlim_cur: cpu,
            rlim_max: cpu + 1,
        };
        // SAFETY: setrlimit with a struct we own.
        if unsafe { libc::setrlimit(libc::RLIMIT_CPU, &rl) } != 0 {
            return Err(err("setrlimit CPU"));
        }
    }
    Ok(())
}

/// Rootless mode, first of all: maps `outer_uid`/`outer_gid` (the
/// zygote's ids, the only ones an unprivileged process may map) to the
/// worker's `uid`/`gid` inside the user namespace the zygote forked it
/// into. `setgroups` is denied first, as the kernel requires of an
/// unprivileged gid map (and so that no one in here can drop a group to
/// get past a "deny group" permission).
pub fn map_ids(c: &Confine, outer_uid: u32, outer_gid: u32) -> Result<(), String> {
    if c.uid == 0 || c.gid == 0 {
        return Err("refusing to map a confined worker to uid or gid 0".into());
    }
    let write = |file: &str, text: String| {
        std::fs::write(file, &text).map_err(|e| format!("write {text:?} to {file}: {e}"))
    };
    write("/proc/self/setgroups", "deny".into())?;
    write("/proc/self/uid_map", format!("{} {outer_uid} 1\n", c.uid))?;
    write("/proc/self/gid_map", format!("{} {outer_gid} 1\n", c.gid))?;
    Ok(())
}

/// Drops to the worker's own uid/gid with no capabilities at all. As
/// root the uid switch clears the capabilities; rootless, the worker
/// already has its (mapped) uid and holds every capability of its own
/// user namespace, which are cleared explicitly.
fn credentials(c: &Confine) -> Result<(), String> {
    if c.uid == 0 || c.gid == 0 {
        return Err("refusing to run a confined worker as uid or gid 0".into());
    }
    // SAFETY: prctl/setgroups/setres[ug]id/capset on this single-threaded
    // process with plain integer arguments and structs we own.
    unsafe {
        libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0);
        for cap in 0..64 {
            // EINVAL past the last capability this kernel knows.
            libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
        }
        // Rootless: setgroups is denied in this user namespace (map_ids);
        // the supplementary groups are the zygote's, unmapped here.
        if !c.rootless && libc::setgroups(0, std::ptr::null()) != 0 {
            return Err(err("setgroups"));
        }
        if libc::setresgid(c.gid, c.gid, c.gid) != 0 {
            return Err(err("setresgid"));
        }
        if libc::setresuid(c.uid, c.uid, c.uid) != 0 {
            return Err(err("setresuid"));
        }
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
        if c.rootless {
            // No capabilities in any set (version 3: two 32-bit halves).
            let mut header = caps::CapHeader {
                version: caps::LINUX_CAPABILITY_VERSION_3,
                pid: 0,
            };
            let data = [caps::CapData::default(); 2];
            if libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) != 0 {
                return Err(err("capset"));
            }
        }
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return Err(err("no_new_privs"));
        }
        // Changing credentials clears the parent-death signal: re-arm it.
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        if libc::geteuid() != c.uid || libc::getegid() != c.gid {
            return Err("the uid change did not take".into());
        }
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    for field in ["CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"] {
        let value = status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .map(str::trim);
        if value.is_some_and(|v| v.chars().any(|ch| ch != '0')) {
            return Err(format!(
                "capabilities remain after the uid change ({field} {value:?})"
            ));
        }
    }
    Ok(())
}

/// Landlock: read anything in the new root (it holds only what was bound),
/// write only the scratch space and /dev; execute only the allowed
/// programs' files (none when the list is empty); no TCP; no signals or
/// abstract sockets outside the domain.
fn landlock(work: &str, programs: &[ProgramFile]) -> Result<String, String> {
    use landlock::{
        path_beneath_rules, Access, AccessFs, AccessNet, CompatLevel, Compatible, PathBeneath,
        PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
    };
    let abi = ABI::V6;
    let read = AccessFs::from_read(abi) & !AccessFs::Execute;
    let write = AccessFs::from_all(abi) & !AccessFs::Execute;
    // Each file on its own (never a directory: that would make all of it
    // executable); a file that cannot be opened is an error, not a rule
    // left out.
    let mut exec = Vec::new();
    for p in programs {
        let fd = PathFd::new(&p.file).map_err(|e| format!("landlock: {}: {e}", p.file))?;
        exec.push(PathBeneath::new(fd, AccessFs::Execute | AccessFs::ReadFile));
    }
    let status = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(abi))
        .and_then(|r| r.handle_access(AccessNet::from_all(abi)))
        .and_then(|r| r.scope(Scope::from_all(abi)))
        .and_then(|r| r.create())
        .and_then(|r| r.add_rules(path_beneath_rules(["/"], read)))
        .and_then(|r| r.add_rules(path_beneath_rules(["/tmp", work, "/dev"], write)))
        .and_then(|r| r.add_rules(exec.into_iter().map(Ok::<_, landlock::RulesetError>)))
        .and_then(|r| r.restrict_self())
        .map_err(|e| format!("landlock: {e}"))?;
    match status.ruleset {
        RulesetStatus::FullyEnforced => Ok("full".into()),
        RulesetStatus::PartiallyEnforced => Ok("partial".into()),
        _ => Err("landlock is not enforced by this kernel".into()),
    }
}

/// seccomp-bpf, last: system calls R never needs fail with EPERM; sockets
/// other than Unix ones and clone into new namespaces too; clone3 says
/// ENOSYS so glibc falls back to clone, whose flags a filter can read.
/// Without programs (`exec` false) execve and execveat are denied too:
/// nothing runs programs after start-up. With programs they pass (Landlock
/// decides which file may be executed) and memfd_create and memfd_secret
/// are denied instead: Landlock does not check the execution of a memfd,
/// so one written by the worker would run any code as a program.
fn seccomp_programs(exec: bool) -> Result<Vec<seccompiler::BpfProgram>, String> {
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
    };
    use std::collections::BTreeMap;
    let exec_calls: &[libc::c_long] = if exec {
        &[libc::SYS_memfd_create, libc::SYS_memfd_secret]
    } else {
        &[libc::SYS_execve, libc::SYS_execveat]
    };
    let denied: &[libc::c_long] = &[
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_bpf,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_perf_event_open,
        libc::SYS_userfaultfd,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_reboot,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_acct,
        libc::SYS_quotactl,
        libc::SYS_name_to_handle_at,
        libc::SYS_open_by_handle_at,
        libc::SYS_open_tree,
        libc::SYS_move_mount,
        libc::SYS_fsopen,
        libc::SYS_fsconfig,
        libc::SYS_fsmount,
        libc::SYS_fspick,
        libc::SYS_mount_setattr,
        libc::SYS_settimeofday,
        libc::SYS_clock_settime,
        libc::SYS_clock_adjtime,
        libc::SYS_adjtimex,
        libc::SYS_sethostname,
        libc::SYS_setdomainname,
        libc::SYS_iopl,
        libc::SYS_ioperm,
        libc::SYS_pidfd_getfd,
        libc::SYS_fanotify_init,
        libc::SYS_syslog,
        libc::SYS_uselib,
        libc::SYS_kcmp,
        libc::SYS_vhangup,
        libc::SYS_lookup_dcookie,
    ];
    let arch: seccompiler::TargetArch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| format!("seccomp: {e:?}"))?;
    let cond = |arg: u8, op: SeccompCmpOp, v: u64| {
        SeccompCondition::new(arg, SeccompCmpArgLen::Qword, op, v)
            .map_err(|e| format!("seccomp: {e}"))
    };
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in denied.iter().chain(exec_calls) {
        rules.insert(*nr, vec![]);
    }
    let not_unix = || -> Result<Vec<SeccompRule>, String> {
        Ok(vec![SeccompRule::new(vec![cond(
            0,
            SeccompCmpOp::Ne,
            libc::AF_UNIX as u64,
        )?])
        .map_err(|e| format!("seccomp: {e}"))?])
    };
    rules.insert(libc::SYS_socket, not_unix()?);
    rules.insert(libc::SYS_socketpair, not_unix()?);
    let mut clone_rules = Vec::new();
    for flag in [
        libc::CLONE_NEWUSER,
        libc::CLONE_NEWNS,
        libc::CLONE_NEWPID,
        libc::CLONE_NEWNET,
        libc::CLONE_NEWIPC,
        libc::CLONE_NEWUTS,
        libc::CLONE_NEWCGROUP,
    ] {
        let f = flag as u64;
        clone_rules.push(
            SeccompRule::new(vec![cond(0, SeccompCmpOp::MaskedEq(f), f)?])
                .map_err(|e| format!("seccomp: {e}"))?,
        );
    }
    rules.insert(libc::SYS_clone, clone_rules);
    let deny = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| format!("seccomp: {e}"))?;
    let clone3 = SeccompFilter::new(
        [(libc::SYS_clone3, vec![])].into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(|e| format!("seccomp: {e}"))?;
    [clone3, deny]
        .into_iter()
        .map(|f| f.try_into().map_err(|e| format!("seccomp: {e:?}")))
        .collect()
}

type Filters = std::sync::OnceLock<Result<Vec<seccompiler::BpfProgram>, String>>;

/// The seccomp programs (without programs to run, and with), compiled once
/// in the zygote before it forks (a worker then only installs one).
static SECCOMP: [Filters; 2] = [Filters::new(), Filters::new()];

/// Work that every confined worker needs and that can be done once, in
/// the zygote, before forking.
pub fn prepare() {
    for exec in [false, true] {
        let _ = SECCOMP[exec as usize].get_or_init(|| seccomp_programs(exec));
    }
}

fn seccomp(exec: bool) -> Result<(), String> {
    let progs = SECCOMP[exec as usize]
        .get_or_init(|| seccomp_programs(exec))
        .as_ref()
        .map_err(Clone::clone)?;
    for prog in progs {
        seccompiler::apply_filter(prog).map_err(|e| format!("seccomp: {e}"))?;
    }
    Ok(())
}

/// Joins the worker's cgroups (so that its children are in them too, and
/// the new cgroup namespace is rooted there), then enters new mount, ipc,
/// uts, cgroup and (unless network is on) network namespaces. The pid
/// namespace was made by the zygote when it forked this process.
fn namespaces(c: &Confine) -> Result<(), String> {
    for procs in &c.cgroups {
        join_cgroup(procs)?;
    }
    let mut flags =
        libc::CLONE_NEWNS | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWCGROUP;
    if !c.network {
        flags |= libc::CLONE_NEWNET;
    }
    // SAFETY: unshare in this single-threaded process.
    if unsafe { libc::unshare(flags) } != 0 {
        return Err(err("unshare the worker's namespaces"));
    }
    Ok(())
}

/// Moves this process into the cgroup whose `cgroup.procs` is `procs`.
///
/// A write to `cgroup.procs` moves a whole thread group under the
/// kernel's cgroup threadgroup rwsem taken for writing, and the first
/// such taking after a quiet spell waits for an RCU grace period: 5-16 ms
/// here, most of a confined fork's time. A cgroup v1 `tasks` file moves
/// one thread, and "0" (the writing thread itself) takes no such lock
/// (~0.3 ms). The worker is single-threaded here (a fork has only the
/// forking thread, and the `unshare` of its mount namespace right after
/// would fail with another thread sharing its file system state), so that
/// thread is the whole process. Without a `tasks` file it could write
/// (cgroup v2, a subtree delegated without it), `cgroup.procs` as before.
fn join_cgroup(procs: &str) -> Result<(), String> {
    if let Some(dir) = procs.strip_suffix("/cgroup.procs") {
        if std::fs::write(format!("{dir}/tasks"), "0").is_ok() {
            return Ok(());
        }
    }
    // "0": the writing process, whatever its pid in this namespace.
    std::fs::write(procs, "0").map_err(|e| format!("could not join the cgroup {procs}: {e}"))
}

extern "C" fn on_sigxcpu(_sig: libc::c_int) {
    // SAFETY: _exit is async-signal-safe.
    unsafe { libc::_exit(EXIT_CPU_LIMIT) }
}

/// Confines this process; `work` is its temporary/working directory (a
/// host path that stays the same inside).
pub fn apply(c: &Confine, work: &str) -> Result<(), String> {
    namespaces(c)?;
    filesystem(c, work)?;
    limits(c)?;
    credentials(c)?;
    // As pid 1 of its namespace the worker ignores SIGXCPU by default.
    // SAFETY: installs an async-signal-safe handler.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigxcpu as *const () as usize;
        libc::sigemptyset(&mut act.sa_mask);
        libc::sigaction(libc::SIGXCPU, &act, std::ptr::null_mut());
    }
    landlock(work, &c.programs)?;
    seccomp(!c.programs.is_empty())?;
    Ok(())
}
