//! A session's files: list, upload (atomic), download and delete the
//! regular files of its working directory, from the host, without ever
//! following a path the worker controls.
//!
//! The directory is reached from a descriptor: the host directory calls
//! run in (unconfined sessions and explicit working directories), or, for
//! a confined worker's private tmpfs, `/proc/<pid>/root` of the live
//! worker (its own root, in its mount namespace) and then the worker's
//! directory inside it. Every component below that descriptor is opened
//! with `openat(..., O_NOFOLLOW)`, names never hold `..`
//! (`crate::file_rules::check_name`), and a file is used only once
//! `fstat` on its open descriptor says it is regular: a symlink, FIFO or
//! device that R code made is refused, never followed, and a FIFO is
//! opened non-blocking so it cannot stall the host. The rules and quotas
//! are in `crate::file_rules`.

use crate::file_rules::{self, FileLimits, FileRefusal, UPLOAD_PREFIX};
use std::collections::HashMap;
use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::Duration;

/// Where a session's files are (see `Session::files_place`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Place {
    /// A host directory the supervisor made or was given.
    Host(PathBuf),
    /// Inside a live confined worker's root.
    Worker {
        /// Its host pid.
        pid: u32,
        /// Its directory, inside its root.
        dir: PathBuf,
        /// Its generation (to notice a worker replaced meanwhile).
        generation: u64,
    },
    /// A confined session with no live worker (not started, hibernated).
    NoWorker,
}

/// One file of a session's working directory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileInfo {
    /// Its path relative to the working directory (`/` between parts,
    /// Unicode NFC).
    pub name: String,
    /// Bytes.
    pub size: u64,
    /// From its extension (`application/octet-stream` when unknown).
    pub media_type: String,
    /// Last modification, RFC 3339 (UTC).
    pub modified: String,
}

/// A file operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// A rule or quota of `crate::file_rules`.
    #[error(transparent)]
    Refused(#[from] FileRefusal),
    /// The session could not bring up a worker to reach its files.
    #[error("the session's files cannot be reached: {0}")]
    Unreachable(String),
    /// The file system failed.
    #[error("could not {what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

impl FileError {
    pub(crate) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> FileError {
        move |source| match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => {
                FileError::Unreachable(format!(
                    "{what}: the session's disk is full ({source}); delete files or open the \
                     session with a larger limits.disk_bytes"
                ))
            }
            _ => FileError::Io { what, source },
        }
    }
}

pub(crate) fn cstr(s: &str) -> CString {
    // Names passed `check_name`, which refuses NUL.
    CString::new(s).unwrap_or_default()
}

pub(crate) fn last_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// `openat(dir, name, flags)` as an owned descriptor.
fn openat(
    dir: &OwnedFd,
    name: &str,
    flags: libc::c_int,
    mode: libc::c_uint,
) -> std::io::Result<OwnedFd> {
    let c = cstr(name);
    // SAFETY: `dir` is an open descriptor, `c` a NUL-terminated string
    // that outlives the call; the result is checked before it is owned.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags | libc::O_CLOEXEC, mode) };
    if fd < 0 {
        return Err(last_error());
    }
    // SAFETY: `fd` was just returned by openat and is owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn fstat(fd: &impl AsRawFd) -> std::io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open and `st` is a valid, writable `stat`.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(last_error());
    }
    Ok(st)
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`: `None` when absent.
pub(crate) fn lstatat(dir: &OwnedFd, name: &str) -> std::io::Result<Option<libc::stat>> {
    let c = cstr(name);
    // SAFETY: an all-zero `stat` is a valid value to be overwritten.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `dir` is open, `c` NUL-terminated, `st` writable; the call
    // does not follow a final symlink.
    let r = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            c.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if r != 0 {
        let e = last_error();
        return if e.raw_os_error() == Some(libc::ENOENT) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(Some(st))
}

/// R's temporary directory inside a worker's directory (`tempdir()`):
/// neither listed nor an artifact.
pub const R_TEMP_DIR: &str = "Rtmp";

const DIR_FLAGS: libc::c_int = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;

fn mtime(st: &libc::stat) -> String {
    crate::clock::rfc3339(st.st_mtime.max(0) as u64)
}

/// The working directory's descriptor, for `place`.
pub(crate) fn open_root(place: &Place) -> Result<OwnedFd, FileError> {
    match place {
        Place::Host(d) => {
            let c = CString::new(d.as_os_str().as_bytes()).map_err(|_| {
                FileError::Unreachable("the working directory's path holds NUL".into())
            })?;
            // SAFETY: `c` is NUL-terminated and outlives the call; the
            // result is checked before it is owned.
            let fd = unsafe { libc::open(c.as_ptr(), DIR_FLAGS | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(FileError::io("open the working directory")(last_error()));
            }
            // SAFETY: a fresh descriptor owned by no one else.
            Ok(unsafe { OwnedFd::from_raw_fd(fd) })
        }
        Place::Worker { pid, dir, .. } => {
            // The worker's root: a magic link the kernel resolves to the
            // root of its mount namespace, not a path the worker wrote.
            let root = format!("/proc/{pid}/root");
            let c = cstr(&root);
            // SAFETY: as above.
            let fd = unsafe {
                libc::open(
                    c.as_ptr(),
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
                )
            };
            if fd < 0 {
                return Err(FileError::Unreachable(format!(
                    "the worker ended while its files were opened ({}); retry",
                    last_error()
                )));
            }
            // SAFETY: a fresh descriptor owned by no one else.
            let mut cur = unsafe { OwnedFd::from_raw_fd(fd) };
            // Below the root every part is opened without following a
            // symlink: the worker may have replaced its own directory.
            for part in dir.iter().skip(1) {
                let part = part.to_string_lossy();
                cur = openat(&cur, &part, DIR_FLAGS, 0)
                    .map_err(FileError::io("open the worker's directory"))?;
            }
            Ok(cur)
        }
        Place::NoWorker => Err(FileError::Unreachable(
            "the session has no live worker".into(),
        )),
    }
}

/// Opens the directories of `parts` below `root` (making them when
/// `create`), never following a symlink.
pub(crate) fn walk(root: OwnedFd, parts: &[&str], create: bool) -> Result<OwnedFd, FileError> {
    let mut cur = root;
    for part in parts {
        match openat(&cur, part, DIR_FLAGS, 0) {
            Ok(fd) => cur = fd,
            Err(e) if create && e.raw_os_error() == Some(libc::ENOENT) => {
                let c = cstr(part);
                // SAFETY: `cur` is open, `c` NUL-terminated.
                if unsafe { libc::mkdirat(cur.as_raw_fd(), c.as_ptr(), 0o755) } != 0 {
                    let e = last_error();
                    if e.raw_os_error() != Some(libc::EEXIST) {
                        return Err(FileError::io("make a directory")(e));
                    }
                }
                let next =
                    openat(&cur, part, DIR_FLAGS, 0).map_err(FileError::io("open a directory"))?;
                chown_like(&next, &cur);
                cur = next;
            }
            Err(e) => return Err(not_a_dir(part, &cur, e)),
        }
    }
    Ok(cur)
}

fn not_a_dir(part: &str, dir: &OwnedFd, e: std::io::Error) -> FileError {
    match e.raw_os_error() {
        Some(libc::ENOENT) => FileRefusal::NotFound {
            name: part.to_string(),
        }
        .into(),
        Some(libc::ELOOP) | Some(libc::ENOTDIR) => {
            let kind = lstatat(dir, part)
                .ok()
                .flatten()
                .map_or("special file", |st| file_rules::kind_of(st.st_mode));
            FileRefusal::NotRegular {
                name: part.to_string(),
                kind,
            }
            .into()
        }
        _ => FileError::io("open a directory")(e),
    }
}

/// Gives `fd` the owner of `dir` (a confined worker's own uid), so R can
/// rewrite what the host put there. Best effort: a rootless host cannot,
/// and needs not (it is the same user).
fn chown_like(fd: &OwnedFd, dir: &OwnedFd) {
    if let Ok(st) = fstat(dir) {
        // SAFETY: `fd` is an open descriptor; failure is harmless.
        unsafe { libc::fchown(fd.as_raw_fd(), st.st_uid, st.st_gid) };
    }
}

/// Splits a checked name into its directories and its last part.
pub(crate) fn split(name: &str) -> (Vec<&str>, &str) {
    let mut parts: Vec<&str> = name.split('/').collect();
    let leaf = parts.pop().unwrap_or_default();
    (parts, leaf)
}

/// What a listing saw of one file: for changes between two listings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    size: u64,
    mtime_ns: i128,
    ino: u64,
}

/// A listing of a working directory: name -> stamp (regular files only).
pub type Snapshot = HashMap<String, (Stamp, FileInfo)>;

/// What a listing of a confined session's files was taken under: its
/// worker, how many calls it had taken, and how many changes the files
/// API had made. While all three are the same and no call runs, nothing
/// but a process the session left in the background can have changed the
/// files, so the listing is still the files as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ListingKey {
    pub(crate) generation: u64,
    pub(crate) calls: u64,
    pub(crate) epoch: u64,
}

/// The last listing a session took while idle, with its key and bound.
#[derive(Debug, Clone)]
pub(crate) struct KeptListing {
    pub(crate) key: ListingKey,
    pub(crate) max_files: usize,
    pub(crate) snapshot: Snapshot,
}

/// Lists the regular files below `root`, at most `max` (one more is an
/// error), at most `file_rules::MAX_DEPTH` deep.
pub(crate) fn list(root: OwnedFd, max: usize) -> Result<Snapshot, FileError> {
    let mut out = Snapshot::new();
    let mut stack: Vec<(OwnedFd, String, usize)> = vec![(root, String::new(), 0)];
    while let Some((dir, prefix, depth)) = stack.pop() {
        let dup = {
            // SAFETY: `dir` is open; fdopendir takes over the duplicate.
            let d = unsafe { libc::dup(dir.as_raw_fd()) };
            if d < 0 {
                return Err(FileError::io("list the working directory")(last_error()));
            }
            d
        };
        // SAFETY: `dup` is an open directory descriptor we own; on
        // success the DIR stream owns it, on failure we close it.
        let stream = unsafe { libc::fdopendir(dup) };
        if stream.is_null() {
            // SAFETY: fdopendir failed, so `dup` is still ours to close.
            unsafe { libc::close(dup) };
            return Err(FileError::io("list the working directory")(last_error()));
        }
        let mut names = Vec::new();
        loop {
            // SAFETY: `stream` is a valid DIR stream used by this thread only.
            let ent = unsafe { libc::readdir(stream) };
            if ent.is_null() {
                break;
            }
            // SAFETY: readdir returned a valid entry whose d_name is NUL
            // terminated; it is copied before the next readdir.
            let name = unsafe { std::ffi::CStr::from_ptr((*ent).d_name.as_ptr()) };
            let name = name.to_string_lossy().into_owned();
            if name == "." || name == ".." || name.starts_with(UPLOAD_PREFIX) {
                continue;
            }
            // R's temporary directory (`tempdir()`) is not the session's.
            if depth == 0 && name == R_TEMP_DIR {
                continue;
            }
            names.push(name);
        }
        // SAFETY: `stream` is valid and closed once (this closes `dup`).
        unsafe { libc::closedir(stream) };
        for name in names {
            let Ok(Some(st)) = lstatat(&dir, &name) else {
                continue;
            };
            let full = format!("{prefix}{name}");
            match st.st_mode & libc::S_IFMT {
                libc::S_IFREG => {
                    if out.len() >= max {
                        return Err(FileRefusal::TooMany { max }.into());
                    }
                    let stamp = Stamp {
                        size: st.st_size as u64,
                        mtime_ns: i128::from(st.st_mtime) * 1_000_000_000
                            + i128::from(st.st_mtime_nsec),
                        ino: st.st_ino,
                    };
                    let info = FileInfo {
                        media_type: file_rules::media_type(&full).to_string(),
                        name: full.clone(),
                        size: st.st_size as u64,
                        modified: mtime(&st),
                    };
                    out.insert(full, (stamp, info));
                }
                libc::S_IFDIR if depth + 1 < file_rules::MAX_DEPTH => {
                    if let Ok(sub) = openat(&dir, &name, DIR_FLAGS, 0) {
                        stack.push((sub, format!("{full}/"), depth + 1));
                    }
                }
                // Symlinks, FIFOs, devices, sockets: not listed, never
                // followed.
                _ => {}
            }
        }
    }
    Ok(out)
}

/// An upload in progress: a temporary file in the target's directory,
/// renamed over the target by [`Upload::commit`]; dropped uncommitted, it
/// is removed (nothing is half written).
#[derive(Debug)]
pub struct Upload {
    dir: OwnedFd,
    tmp: String,
    leaf: String,
    name: String,
    file: Option<File>,
    written: u64,
    limits: FileLimits,
    /// The bytes and count of the session's other files.
    others: (u64, usize),
}

impl Upload {
    /// The file being written (to write it asynchronously, e.g. through
    /// `tokio::fs::File::from_std` of a clone); count what is written
    /// with [`Upload::add`].
    pub fn file(&self) -> Option<&File> {
        self.file.as_ref()
    }

    /// The name it will have.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The bytes of the session's other files (the one it replaces left
    /// out), as they were when it began.
    pub fn others_bytes(&self) -> u64 {
        self.others.0
    }

    /// Counts `n` bytes written through a clone of [`Upload::file`],
    /// refusing once the file is over its limit.
    pub fn add(&mut self, n: u64) -> Result<(), FileRefusal> {
        self.written += n;
        file_rules::check_file_size(&self.limits, self.written)?;
        file_rules::check_session(
            &self.limits,
            self.others.0 + self.written,
            self.others.1 + 1,
        )
    }

    /// Renames the file over its target, once complete.
    pub fn commit(mut self) -> Result<FileInfo, FileError> {
        let file = self
            .file
            .take()
            .ok_or_else(|| FileError::Unreachable("the upload was already committed".into()))?;
        file.sync_data().map_err(FileError::io("write the file"))?;
        let st = fstat(&file).map_err(FileError::io("write the file"))?;
        let size = st.st_size as u64;
        file_rules::check_file_size(&self.limits, size)?;
        file_rules::check_session(&self.limits, self.others.0 + size, self.others.1 + 1)?;
        let (from, to) = (cstr(&self.tmp), cstr(&self.leaf));
        // SAFETY: `dir` is open; both names are NUL-terminated single
        // components of it, so the rename stays in that directory.
        let r = unsafe {
            libc::renameat(
                self.dir.as_raw_fd(),
                from.as_ptr(),
                self.dir.as_raw_fd(),
                to.as_ptr(),
            )
        };
        if r != 0 {
            return Err(FileError::io("put the file in place")(last_error()));
        }
        self.tmp.clear();
        Ok(FileInfo {
            media_type: file_rules::media_type(&self.name).to_string(),
            name: std::mem::take(&mut self.name),
            size,
            modified: mtime(&st),
        })
    }
}

impl Write for Upload {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let f = self
            .file
            .as_mut()
            .ok_or_else(|| std::io::Error::other("the upload is closed"))?;
        let n = f.write(buf)?;
        self.add(n as u64).map_err(std::io::Error::other)?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        if !self.tmp.is_empty() {
            let c = cstr(&self.tmp);
            // SAFETY: `dir` is open and `c` a NUL-terminated name in it.
            unsafe { libc::unlinkat(self.dir.as_raw_fd(), c.as_ptr(), 0) };
        }
    }
}

pub(crate) fn begin_upload_in(
    root: &dyn Fn() -> Result<OwnedFd, FileError>,
    name: &str,
    limits: &FileLimits,
) -> Result<Upload, FileError> {
    let name = file_rules::check_name(name)?;
    let existing = list(root()?, limits.max_files)?;
    let (bytes, count) = existing
        .iter()
        .filter(|(n, _)| **n != name)
        .fold((0, 0), |(b, c), (_, (s, _))| (b + s.size, c + 1));
    file_rules::check_session(limits, bytes, count + 1)?;
    let (dirs, leaf) = split(&name);
    let dir = walk(root()?, &dirs, true)?;
    if let Some(st) = lstatat(&dir, leaf).map_err(FileError::io("look at the file"))? {
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(FileRefusal::NotRegular {
                name,
                kind: file_rules::kind_of(st.st_mode),
            }
            .into());
        }
    }
    let tmp = format!("{UPLOAD_PREFIX}{}", crate::ids::random_hex(16));
    let fd = openat(
        &dir,
        &tmp,
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
        0o644,
    )
    .map_err(FileError::io("create the file"))?;
    chown_like(&fd, &dir);
    Ok(Upload {
        leaf: leaf.to_string(),
        name: name.clone(),
        dir,
        tmp,
        file: Some(File::from(fd)),
        written: 0,
        limits: *limits,
        others: (bytes, count),
    })
}

pub(crate) fn open_in(root: OwnedFd, name: &str) -> Result<(FileInfo, File), FileError> {
    let name = file_rules::check_name(name)?;
    let (dirs, leaf) = split(&name);
    let dir = walk(root, &dirs, false)?;
    // Non-blocking, so a FIFO cannot hold the open; never a symlink.
    let fd = openat(
        &dir,
        leaf,
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
        0,
    )
    .map_err(|e| not_a_file(&name, &dir, leaf, e))?;
    let st = fstat(&fd).map_err(FileError::io("read the file"))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(FileRefusal::NotRegular {
            name,
            kind: file_rules::kind_of(st.st_mode),
        }
        .into());
    }
    // SAFETY: `fd` is open; clearing O_NONBLOCK on a regular file
    // changes nothing but is tidy for whoever reads it.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, libc::O_RDONLY) };
    let info = FileInfo {
        media_type: file_rules::media_type(&name).to_string(),
        name,
        size: st.st_size as u64,
        modified: mtime(&st),
    };
    Ok((info, File::from(fd)))
}

fn not_a_file(name: &str, dir: &OwnedFd, leaf: &str, e: std::io::Error) -> FileError {
    match e.raw_os_error() {
        Some(libc::ENOENT) => FileRefusal::NotFound {
            name: name.to_string(),
        }
        .into(),
        Some(libc::ELOOP) | Some(libc::ENXIO) => FileRefusal::NotRegular {
            name: name.to_string(),
            kind: lstatat(dir, leaf)
                .ok()
                .flatten()
                .map_or("special file", |st| file_rules::kind_of(st.st_mode)),
        }
        .into(),
        _ => FileError::io("open the file")(e),
    }
}

/// The files of `after` that are new or changed since `before` (size,
/// modification time or inode), sorted by name.
pub fn changed_files(before: &Snapshot, after: &Snapshot) -> Vec<FileInfo> {
    let mut v: Vec<FileInfo> = after
        .iter()
        .filter(|(n, (s, _))| before.get(*n).is_none_or(|(b, _)| b != s))
        .map(|(_, (_, i))| i.clone())
        .collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}

/// How long [`Session::files`] and the others wait for a worker to start
/// (or a hibernated session to restore) before a confined session's files
/// can be reached.
pub const WORKER_WAIT: Duration = Duration::from_secs(120);

/// A worker's directory reached from the host, for a one-shot run's
/// [`RunFiles`]: the same rules as a session's files.
#[derive(Debug)]
pub struct WorkDir {
    place: Place,
}

impl WorkDir {
    pub(crate) fn new(place: Place) -> Self {
        Self { place }
    }

    /// Its regular files (at most `max_files`).
    pub fn snapshot(&self, max_files: usize) -> Result<Snapshot, FileError> {
        list(open_root(&self.place)?, max_files)
    }

    /// Writes `name` from `content`, atomically, within `limits`.
    pub fn put(
        &self,
        name: &str,
        content: &mut dyn Read,
        limits: &FileLimits,
    ) -> Result<FileInfo, FileError> {
        let mut up = begin_upload_in(&|| open_root(&self.place), name, limits)?;
        copy_into(content, &mut up)?;
        up.commit()
    }

    /// Opens `name` for reading (regular files only).
    pub fn open(&self, name: &str) -> Result<(FileInfo, File), FileError> {
        open_in(open_root(&self.place)?, name)
    }
}

pub(crate) fn copy_into(content: &mut dyn Read, up: &mut Upload) -> Result<(), FileError> {
    if let Err(e) = std::io::copy(content, up) {
        if let Some(r) = e.get_ref().and_then(|r| r.downcast_ref::<FileRefusal>()) {
            return Err(r.clone().into());
        }
        return Err(FileError::io("write the file")(e));
    }
    Ok(())
}

/// What a one-shot run does with files around its call
/// (`Supervisor::run_once_with_files`): inputs placed before the code
/// runs, artifacts collected after, while the worker still lives.
pub trait RunFiles {
    /// Before the call; an error refuses the run (nothing runs).
    fn before(&mut self, dir: &WorkDir) -> Result<(), String>;
    /// After the call, with its result (to add `artifacts`).
    fn after(&mut self, dir: &WorkDir, result: &mut crate::RunResult);
}
