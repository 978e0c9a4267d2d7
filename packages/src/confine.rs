//! The builder's confinement: what `R CMD INSTALL` (and the compiler,
//! `make` and the shell it runs) may touch.
//!
//! Prepared in the supervisor before the fork (the Landlock ruleset and
//! the seccomp program are built there, since building them allocates);
//! the child only enters it, with system calls that are safe between fork
//! and exec:
//!
//! - **Landlock** (no privilege needed): files may be read and programs
//!   run only under the system's directories, R's home and libraries and
//!   the libraries the build is given (read-only); written only in the
//!   build's own directory (its staging library and scratch space, where
//!   `configure` scripts and their test programs also run) and `/dev`.
//!   TCP connect and bind are denied (ABI 4), as are signals and abstract
//!   Unix sockets outside the build (ABI 6).
//! - **seccomp**: sockets other than Unix ones (UDP, raw, netlink),
//!   io_uring (which can open sockets), ptrace, other processes' memory,
//!   BPF, perf, keys and kernel modules fail with EPERM.
//! - **As root**: a new network namespace (only a loopback that is down),
//!   then every capability dropped from the bounding, permitted,
//!   effective and inheritable sets, so R runs as a uid 0 that cannot
//!   pass file permissions, mount, change owners or load modules.
//!   `no_new_privs` keeps set-uid programs from gaining any.
//!
//! A kernel without Landlock gets the rest; [`BuilderSandbox`] says what
//! is enforced (health shows it).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::PackageError;

/// Directories a build reads and runs programs from, besides R's own and
/// the libraries it is given. Missing ones are left out.
const SYSTEM_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/proc", "/sys",
];

/// What the builder's confinement enforces on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BuilderSandbox {
    /// Landlock's ABI, 0 when the kernel has none.
    pub landlock_abi: i64,
    /// Files outside the build's directories cannot be read or written
    /// (Landlock).
    pub filesystem: bool,
    /// The build cannot open network connections: a network namespace
    /// (root), or Landlock's TCP rules (ABI 4) with seccomp's refusal of
    /// other sockets.
    pub network: bool,
    /// Runs as root without any capability (only as root).
    pub capabilities_dropped: bool,
}

impl BuilderSandbox {
    /// What this process can give a build.
    pub fn here() -> Self {
        let abi = landlock_abi();
        let root = is_root();
        BuilderSandbox {
            landlock_abi: abi,
            filesystem: abi >= 1,
            network: root || abi >= 4,
            capabilities_dropped: root,
        }
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Landlock's ABI version, 0 without Landlock.
fn landlock_abi() -> i64 {
    // SAFETY: landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    // reads no memory and only returns the ABI version (or an error).
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<u8>(),
            0usize,
            1u32,
        )
    };
    v.max(0)
}

/// A confinement ready to be entered by a child between fork and exec.
#[derive(Debug)]
pub struct Prepared {
    ruleset: Option<OwnedFd>,
    seccomp: seccompiler::BpfProgram,
    root: bool,
    last_cap: u32,
}

/// Prepares the confinement of a build that reads `read` (besides the
/// system's directories) and writes `write` (where it may also run what
/// it made).
pub fn prepare(read: &[PathBuf], write: &[PathBuf]) -> Result<Prepared, PackageError> {
    let root = is_root();
    let ruleset = if landlock_abi() >= 1 {
        Some(ruleset(read, write)?)
    } else {
        None
    };
    let last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(63);
    Ok(Prepared {
        ruleset,
        seccomp: seccomp_program()?,
        root,
        last_cap,
    })
}

fn refused(what: &str, e: impl std::fmt::Display) -> PackageError {
    PackageError::Io {
        what: format!("prepare the builder's confinement ({what})"),
        source: io::Error::other(e.to_string()),
    }
}

fn ruleset(read: &[PathBuf], write: &[PathBuf]) -> Result<OwnedFd, PackageError> {
    use landlock::{
        path_beneath_rules, Access, AccessFs, AccessNet, CompatLevel, Compatible, Ruleset,
        RulesetAttr, RulesetCreatedAttr, Scope, ABI,
    };
    let abi = ABI::V6;
    let reads: Vec<&Path> = SYSTEM_DIRS
        .iter()
        .map(Path::new)
        .chain(read.iter().map(PathBuf::as_path))
        .collect();
    let writes: Vec<&Path> = write
        .iter()
        .map(PathBuf::as_path)
        .chain([Path::new("/dev")])
        .collect();
    let created = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(abi))
        .and_then(|r| r.handle_access(AccessNet::from_all(abi)))
        .and_then(|r| r.scope(Scope::from_all(abi)))
        .and_then(|r| r.create())
        // path_beneath_rules leaves out paths that cannot be opened (a
        // missing /lib32), and gives files only the rights files have.
        .and_then(|r| r.add_rules(path_beneath_rules(reads, AccessFs::from_read(abi))))
        .and_then(|r| r.add_rules(path_beneath_rules(writes, AccessFs::from_all(abi))))
        .map_err(|e| refused("landlock", e))?;
    Option::<OwnedFd>::from(created)
        .ok_or_else(|| refused("landlock", "the kernel made no ruleset"))
}

/// System calls a build never needs: sockets other than Unix ones first
/// (the network), then what could reach other processes or the kernel.
fn seccomp_program() -> Result<seccompiler::BpfProgram, PackageError> {
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
    };
    use std::collections::BTreeMap;
    let denied: &[libc::c_long] = &[
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
    ];
    let arch: seccompiler::TargetArch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| refused("seccomp", format!("{e:?}")))?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        denied.iter().map(|nr| (*nr, Vec::new())).collect();
    let not_unix = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Ne,
        libc::AF_UNIX as u64,
    )
    .and_then(|c| SeccompRule::new(vec![c]))
    .map_err(|e| refused("seccomp", e))?;
    rules.insert(libc::SYS_socket, vec![not_unix]);
    SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(|e| refused("seccomp", e))?
    .try_into()
    .map_err(|e| refused("seccomp", format!("{e:?}")))
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

impl Prepared {
    /// Enters the confinement. Called in the child between fork and exec:
    /// only system calls, on values made before the fork, no allocation.
    pub fn enter(&self) -> io::Result<()> {
        let check = |rc: libc::c_long| {
            if rc < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        };
        if self.root {
            // SAFETY: unshare in the child, which has one thread.
            check(unsafe { libc::unshare(libc::CLONE_NEWNET) } as libc::c_long)?;
            for cap in 0..=self.last_cap {
                // SAFETY: PR_CAPBSET_DROP takes a capability number and
                // reads no memory; numbers this kernel lacks fail with
                // EINVAL, which is ignored.
                unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
            }
            let mut header = CapHeader {
                version: LINUX_CAPABILITY_VERSION_3,
                pid: 0,
            };
            let data = [CapData {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            }; 2];
            // SAFETY: capset reads a v3 header and two data structs, which
            // live on this stack for the call.
            check(unsafe {
                libc::syscall(
                    libc::SYS_capset,
                    &mut header as *mut CapHeader,
                    data.as_ptr(),
                )
            })?;
        }
        // SAFETY: PR_SET_NO_NEW_PRIVS reads no memory.
        check(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } as libc::c_long)?;
        if let Some(fd) = &self.ruleset {
            // SAFETY: landlock_restrict_self takes the ruleset's descriptor
            // (alive while `self` is) and flags 0; it reads no memory.
            check(unsafe {
                libc::syscall(libc::SYS_landlock_restrict_self, fd.as_raw_fd(), 0u32)
            })?;
        }
        seccompiler::apply_filter(&self.seccomp).map_err(|e| match e {
            seccompiler::Error::Prctl(e) | seccompiler::Error::Seccomp(e) => e,
            _ => io::Error::from_raw_os_error(libc::EINVAL),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    /// Runs `script` with /bin/sh under a confinement that reads `read`
    /// and writes `write`; its exit status and stderr.
    fn confined(read: &[PathBuf], write: &[PathBuf], script: &str) -> (bool, String) {
        let p = prepare(read, write).expect("prepare");
        let mut c = Command::new("/bin/sh");
        c.arg("-c").arg(script);
        // SAFETY: enter() makes only system calls on values made before
        // the fork.
        unsafe { c.pre_exec(move || p.enter()) };
        let out = c.output().expect("run sh");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    #[test]
    fn a_build_writes_only_its_own_directory_and_reads_nothing_outside_what_it_is_given() {
        if !BuilderSandbox::here().filesystem {
            eprintln!("skipped: this kernel has no Landlock");
            return;
        }
        let base = std::env::temp_dir().join(format!("rvisor-builder-{}", std::process::id()));
        let own = base.join("build");
        let given = base.join("library");
        let other = base.join("other-tenant");
        for d in [&own, &given, &other] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(given.join("DESCRIPTION"), "Package: given\n").unwrap();
        std::fs::write(other.join("secret"), "tenant B's\n").unwrap();
        let read = [given.clone()];
        let write = [own.clone()];
        let (ok, err) = confined(
            &read,
            &write,
            &format!(
                "echo made > {own}/out && cat {given}/DESCRIPTION >/dev/null && printf '#!/bin/sh\\nexit 0\\n' > {own}/conftest && chmod +x {own}/conftest && {own}/conftest",
                own = own.display(),
                given = given.display()
            ),
        );
        assert!(
            ok,
            "its own directory is writable and what it was given readable: {err}"
        );
        assert_eq!(std::fs::read_to_string(own.join("out")).unwrap(), "made\n");
        let (ok, _) = confined(&read, &write, &format!("cat {}/secret", other.display()));
        assert!(!ok, "another tenant's file cannot be read");
        let (ok, _) = confined(
            &read,
            &write,
            &format!("echo x > {}/planted", other.display()),
        );
        assert!(!ok, "nothing outside its directory can be written");
        assert!(!other.join("planted").exists());
        let (ok, _) = confined(&read, &write, &format!("echo x > {}/x", given.display()));
        assert!(!ok, "the libraries it reads are read-only");
        let (ok, _) = confined(&read, &write, "echo x > /tmp/rvisor-builder-planted");
        assert!(!ok, "/tmp is not the build's");
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn a_build_as_root_has_no_capabilities_and_no_network() {
        if !is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let (ok, err) = confined(
            &[],
            &[],
            "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb):' /proc/self/status | grep -v '0000000000000000' && exit 1; test \"$(tail -n +3 /proc/net/dev | wc -l)\" = 1",
        );
        assert!(
            ok,
            "no capability is left and only loopback is there: {err}"
        );
    }
}
