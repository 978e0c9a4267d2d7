//! The builder: `R CMD INSTALL` of one checked tarball into a staging
//! library, in a process of its own, confined (`confine.rs`: Landlock,
//! seccomp, no network, no capabilities as root), with a clean
//! environment, rlimits and a timeout after which its whole process group
//! is killed.

use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::{confine, PackageError};

/// Most bytes of a build's output kept for its error.
const LOG_BYTES: u64 = 16 << 10;

/// How a build runs.
#[derive(Debug, Clone)]
pub struct BuildSettings {
    /// The `R` program.
    pub r: PathBuf,
    /// Longest a build may take (also its CPU-time limit).
    pub timeout: Duration,
    /// Libraries the build sees, after the staging one (the tenant's, so
    /// dependencies installed before are found; the site ones are R's own).
    pub libraries: Vec<PathBuf>,
    /// R's home and its own libraries: read-only in the build, like the
    /// system's directories.
    pub r_dirs: Vec<PathBuf>,
}

/// Installs `tarball` of `package` into `staging` (a library directory);
/// `scratch` is the build's own temporary and home directory.
pub fn install(
    s: &BuildSettings,
    package: &str,
    tarball: &Path,
    staging: &Path,
    scratch: &Path,
) -> Result<(), PackageError> {
    std::fs::create_dir_all(scratch).map_err(PackageError::io("create the build's directory"))?;
    let log_path = scratch.join("build.log");
    let log = std::fs::File::create(&log_path).map_err(PackageError::io("create the build log"))?;
    let log2 = log
        .try_clone()
        .map_err(PackageError::io("open the build log"))?;
    let mut reads = s.libraries.clone();
    reads.extend(s.r_dirs.iter().cloned());
    reads.extend(s.r.parent().map(Path::to_path_buf));
    reads.push(tarball.to_path_buf());
    let confinement = confine::prepare(&reads, &[staging.to_path_buf(), scratch.to_path_buf()])?;
    let mut cmd = Command::new(&s.r);
    let libs = std::env::join_paths(
        std::iter::once(staging.to_path_buf()).chain(s.libraries.iter().cloned()),
    )
    .map_err(|e| PackageError::Io {
        what: "join the build's library path".into(),
        source: std::io::Error::other(e),
    })?;
    cmd.args(["CMD", "INSTALL", "--no-docs", "--no-html", "--no-multiarch"])
        .arg(format!("--library={}", staging.display()))
        .arg(tarball)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", scratch)
        .env("TMPDIR", scratch)
        .env("LC_ALL", "C")
        .env("R_LIBS", libs)
        .env("R_LIBS_USER", scratch.join("no-user-library"))
        .current_dir(scratch)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2);
    let cpu = s.timeout.as_secs().max(1);
    // SAFETY: between fork and exec only async-signal-safe calls are made
    // (setsid, setrlimit, and the confinement's system calls), on values
    // computed before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let lim = |res, v: u64| {
                let r = libc::rlimit {
                    rlim_cur: v,
                    rlim_max: v,
                };
                libc::setrlimit(res, &r)
            };
            // CPU time: a loop in a build script ends even if the wall
            // clock timeout were missed; 4 GiB per written file.
            lim(libc::RLIMIT_CPU, cpu);
            lim(libc::RLIMIT_FSIZE, 4 << 30);
            confinement.enter()
        });
    }
    let mut child = cmd.spawn().map_err(PackageError::io(format!(
        "start R CMD INSTALL ({})",
        s.r.display()
    )))?;
    let pid = child.id() as i32;
    let (tx, rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let st = child.wait();
        let _ = tx.send(st);
    });
    let status = match rx.recv_timeout(s.timeout) {
        Ok(st) => Some(st.map_err(PackageError::io("wait for R CMD INSTALL"))?),
        Err(_) => {
            // SAFETY: kill of the build's own process group (setsid made
            // its leader `pid`); no memory is involved.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            None
        }
    };
    let _ = waiter.join();
    let log = read_tail(&log_path);
    match status {
        Some(st) if st.success() => Ok(()),
        Some(st) => Err(PackageError::Build {
            package: package.into(),
            detail: format!(
                "R CMD INSTALL ended with {st}; its output ends with:\n{}",
                tail_lines(&log, 20)
            ),
            log,
        }),
        None => Err(PackageError::Build {
            package: package.into(),
            detail: format!(
                "the build took longer than {} s and was stopped",
                s.timeout.as_secs()
            ),
            log,
        }),
    }
}

fn read_tail(p: &Path) -> String {
    let Ok(mut f) = std::fs::File::open(p) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(LOG_BYTES)));
    let mut b = Vec::new();
    let _ = f.read_to_end(&mut b);
    String::from_utf8_lossy(&b).into_owned()
}

fn tail_lines(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
