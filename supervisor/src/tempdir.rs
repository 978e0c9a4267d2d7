//! The directories of workers and zygotes (`rvisor-<hex>` under the temp
//! root), and the sweep of those whose supervisor was killed.
//!
//! A directory is removed when its [`TempDir`] is dropped; a supervisor
//! killed by SIGKILL or the OOM killer drops nothing, and its workers'
//! directories (R's session temp files among them) stayed behind for good.
//! Their names carry no pid (a confined worker sees its directory under
//! this path), so each directory has a lock file beside it, outside the
//! directory where its worker cannot reach it: `rvisor-<hex>.lock`, made
//! under a temporary name, `flock`ed, then renamed into place, so it only
//! ever appears held. The supervisor holds it as long as the directory
//! lives; the kernel lets go of it when the supervisor's process ends,
//! however it ends. [`sweep`], run when a supervisor starts, removes each
//! directory whose lock nobody holds, and never one whose supervisor still
//! runs (tests: `tempdir::tests`, `ffi-tests` `sessions.rs`
//! `a_killed_supervisors_directories_are_removed_by_the_next_one`).

use crate::error::Error;
use crate::ids;
use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// A private directory removed when dropped, with the lock that says its
/// supervisor is alive.
#[derive(Debug)]
pub(crate) struct TempDir {
    path: PathBuf,
    /// The held lock file and its path (None where the file system could
    /// not lock: the directory is then not swept, as before).
    lock: Option<(PathBuf, File)>,
}

impl TempDir {
    /// The directory.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// A new `rvisor-<random>` directory (mode 0700) under `root`, its lock
    /// held first. The name carries no host pid: a confined worker sees its
    /// directory under this path (docs/confinement.md).
    pub(crate) fn new(root: &Path) -> Result<Self, Error> {
        use std::os::unix::fs::DirBuilderExt;
        let name = format!("rvisor-{}", ids::random_hex(8));
        let lock = hold_lock(root, &name).ok();
        let path = root.join(&name);
        if let Err(source) = std::fs::DirBuilder::new().mode(0o700).create(&path) {
            if let Some((p, _)) = &lock {
                let _ = std::fs::remove_file(p);
            }
            return Err(Error::Io {
                what: "create the worker's temporary directory",
                source,
            });
        }
        Ok(Self { path, lock })
    }

    /// Removes the directory and its lock now, ahead of the drop (which
    /// then finds nothing to do): a process may exit before a thread that
    /// holds the last handle gets to drop it.
    pub(crate) fn remove_now(&self) {
        remove_with_lock(&self.path);
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // The directory goes while the lock is still held; then the lock.
        remove_with_lock(&self.path);
        drop(self.lock.take());
    }
}

/// A private directory of a host process (mode 0700, `rvisor-<hex>` under
/// the supervisor's temporary root): removed when dropped, and by the next
/// supervisor's sweep when the process is killed first, as the workers'
/// directories are ([`crate::Supervisor::scratch_dir`]; `session --jsonl`
/// keeps the tables its calls publish in one).
#[derive(Debug)]
pub struct ScratchDir(TempDir);

impl ScratchDir {
    pub(crate) fn new(root: &Path) -> Result<Self, Error> {
        TempDir::new(root).map(ScratchDir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

/// The lock file beside directory `dir`: `<dir>.lock`.
fn lock_path(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    dir.with_file_name(name)
}

/// Removes a worker's directory `dir` and then the lock file beside it
/// (held or not: a lock without its directory protects nothing).
pub(crate) fn remove_with_lock(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_file(lock_path(dir));
}

/// `flock(fd, LOCK_EX | LOCK_NB)`: whether this open file now holds it.
fn try_lock(file: &File) -> bool {
    // SAFETY: flock(2) on a descriptor `file` owns and keeps open.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Makes `root/<name>.lock`, held by the returned file: created under a
/// temporary name, locked, then renamed, so no one sees it unheld.
fn hold_lock(root: &Path, name: &str) -> std::io::Result<(PathBuf, File)> {
    let new = root.join(format!("{name}.lock.new"));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&new)?;
    if !try_lock(&file) {
        let e = std::io::Error::last_os_error();
        let _ = std::fs::remove_file(&new);
        return Err(e);
    }
    let path = lock_path(&root.join(name));
    if let Err(e) = std::fs::rename(&new, &path) {
        let _ = std::fs::remove_file(&new);
        return Err(e);
    }
    Ok((path, file))
}

/// The directory name a lock file is for: `rvisor-<16 hex>` from
/// `rvisor-<16 hex>.lock` or `.lock.new`.
fn locked_name(file_name: &str) -> Option<&str> {
    let stem = file_name
        .strip_suffix(".lock")
        .or_else(|| file_name.strip_suffix(".lock.new"))?;
    let hex = stem.strip_prefix("rvisor-")?;
    (hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit())).then_some(stem)
}

/// Removes, under `root`, each `rvisor-<hex>` directory whose lock file
/// (ours: owned by this process's user) nobody holds, then the lock file.
/// Directories without a lock file (made before locks, or whose
/// supervisor died between the two) are left alone. Returns how many
/// directories' locks it removed.
pub(crate) fn sweep(root: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(root) else {
        return 0;
    };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let mut swept = 0;
    for e in entries.flatten() {
        let file_name = e.file_name();
        let Some(name) = file_name.to_str().and_then(locked_name) else {
            continue;
        };
        let lock_path = e.path();
        let Ok(file) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
            .open(&lock_path)
        else {
            continue;
        };
        match file.metadata() {
            Ok(m) if m.is_file() && m.uid() == me => {}
            _ => continue,
        }
        // Held: its supervisor runs (or the lock cannot be taken: left).
        if !try_lock(&file) {
            continue;
        }
        // remove_dir_all does not follow a symlink put in its place.
        match std::fs::remove_dir_all(root.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => continue, // kept with its lock: a later sweep retries
        }
        let _ = std::fs::remove_file(&lock_path);
        swept += 1;
    }
    swept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        let r = std::env::temp_dir().join(format!("rvisor-sweep-test-{}", ids::random_hex(6)));
        std::fs::create_dir(&r).unwrap();
        r
    }

    /// A directory and lock as a killed supervisor leaves them: the lock
    /// file exists and nobody holds it.
    fn orphan(root: &Path) -> PathBuf {
        let name = format!("rvisor-{}", ids::random_hex(8));
        let dir = root.join(&name);
        std::fs::create_dir(&dir).unwrap();
        std::fs::create_dir(dir.join("Rtmp1")).unwrap();
        std::fs::write(dir.join("Rtmp1").join("file"), b"left").unwrap();
        std::fs::write(root.join(format!("{name}.lock")), b"").unwrap();
        dir
    }

    #[test]
    fn a_held_directory_is_kept_and_an_orphan_is_removed() {
        let r = root();
        let live = TempDir::new(&r).unwrap();
        assert!(live.lock.is_some(), "the lock is held");
        std::fs::write(live.path().join("work"), b"x").unwrap();
        let dead = orphan(&r);
        // Neither a directory without a lock nor other names are touched.
        let unlocked = r.join(format!("rvisor-{}", ids::random_hex(8)));
        std::fs::create_dir(&unlocked).unwrap();
        std::fs::write(r.join("rvisor-notes.lock"), b"").unwrap();

        assert_eq!(sweep(&r), 1);
        assert!(!dead.exists(), "the orphan's directory is gone");
        assert!(!dead.with_extension("lock").exists());
        assert!(live.path().join("work").exists(), "the live one is kept");
        assert!(unlocked.exists());
        assert!(r.join("rvisor-notes.lock").exists());

        // Dropped: its directory and its lock go.
        let (p, lock) = (
            live.path().to_path_buf(),
            live.lock.as_ref().unwrap().0.clone(),
        );
        drop(live);
        assert!(!p.exists() && !lock.exists());
        assert_eq!(sweep(&r), 0);
        std::fs::remove_dir_all(&r).unwrap();
    }

    #[test]
    fn a_symlink_in_an_orphans_place_is_removed_not_followed() {
        let r = root();
        let target = root();
        std::fs::write(target.join("keep"), b"x").unwrap();
        let name = format!("rvisor-{}", ids::random_hex(8));
        std::os::unix::fs::symlink(&target, r.join(&name)).unwrap();
        std::fs::write(r.join(format!("{name}.lock")), b"").unwrap();
        assert_eq!(sweep(&r), 1);
        assert!(
            target.join("keep").exists(),
            "the link's target is untouched"
        );
        assert!(std::fs::symlink_metadata(r.join(&name)).is_err());
        std::fs::remove_dir_all(&r).unwrap();
        std::fs::remove_dir_all(&target).unwrap();
    }

    #[test]
    fn removed_ahead_of_its_drop_the_directory_takes_its_lock_along() {
        let r = root();
        let d = TempDir::new(&r).unwrap();
        let (dir, lock) = (d.path().to_path_buf(), d.lock.as_ref().unwrap().0.clone());
        std::fs::write(dir.join("f"), b"x").unwrap();
        d.remove_now();
        assert!(!dir.exists() && !lock.exists());
        drop(d); // finds nothing left, and says nothing
        assert_eq!(std::fs::read_dir(&r).unwrap().count(), 0);
        std::fs::remove_dir(&r).unwrap();
    }

    #[test]
    fn lock_names_are_read_strictly() {
        assert_eq!(
            locked_name("rvisor-0123456789abcdef.lock"),
            Some("rvisor-0123456789abcdef")
        );
        assert_eq!(
            locked_name("rvisor-0123456789abcdef.lock.new"),
            Some("rvisor-0123456789abcdef")
        );
        for bad in [
            "rvisor-0123456789abcdef",
            "rvisor-0123.lock",
            "rvisor-0123456789abcdeg.lock",
            "other-0123456789abcdef.lock",
            "rvisor-../../etc.lock",
        ] {
            assert_eq!(locked_name(bad), None, "{bad}");
        }
    }
}
