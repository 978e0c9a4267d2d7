//! Checkpoints of sessions and where they are kept.
//!
//! A checkpoint is one file, written by the worker (see
//! `rvisor_protocol::checkpoint` for its layout): the session's state,
//! compressed, and a [`Manifest`] the supervisor reads from the file's
//! tail without R and without reading the state.
//!
//! Stores take checkpoints as files, never as bytes in memory: the
//! supervisor reads the worker's pipe into a nameless scratch file the
//! store gives ([`CheckpointStore::scratch`]), the store keeps it
//! ([`CheckpointStore::put`]: a copy and a rename in a directory, an
//! upload in parts to a bucket), and a restore copies it back into a
//! scratch file whose descriptor the worker reads
//! ([`CheckpointStore::get`]). Keys are a session's id, prefixed by the
//! caller as it likes (e.g. with a tenant), so that a store can be a local
//! directory ([`DirStore`]) or a blob store implemented elsewhere.
//!
//! Each store says how large the next checkpoint of a key may be
//! ([`CheckpointStore::allowance`]: its cap on one checkpoint, and what is
//! left of a quota), so the worker stops writing as soon as it would pass
//! it, and the refusal names the limit.

use crate::error::CheckpointError;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io::{self, Seek};
use std::path::{Path, PathBuf};

/// Default cap on one checkpoint (compressed): 1 GiB.
pub const DEFAULT_MAX_CHECKPOINT_BYTES: u64 = 1 << 30;

/// How large the next checkpoint of a key may be, and what to answer
/// when it would be larger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allowance {
    /// Most bytes the checkpoint file may take.
    pub max_bytes: u64,
    /// The refusal when it would take more: which limit, and what to do.
    pub refusal: CheckpointError,
}

impl Allowance {
    /// The allowance of a store whose only limit is `max_bytes` per
    /// checkpoint.
    pub fn cap(max_bytes: u64) -> Self {
        Self {
            max_bytes,
            refusal: over_cap(max_bytes),
        }
    }
}

/// `n` bytes in MiB, rounded up, for messages.
pub fn mib(n: u64) -> u64 {
    n.div_ceil(1 << 20)
}

/// The refusal of a checkpoint over the cap of `max_bytes` per checkpoint.
pub fn over_cap(max_bytes: u64) -> CheckpointError {
    CheckpointError::TooLarge(format!(
        "the session's state is too large to checkpoint: compressed, it passes the cap of {} \
         MiB per checkpoint; remove or shrink large objects (rm(), or keep them in files that \
         are read again when needed) and its next checkpoint is taken, or ask the operator to \
         raise the cap (rvisor serve --checkpoint-max-mb); until then a restart or a lost \
         worker takes the session back to its last checkpoint",
        mib(max_bytes)
    ))
}

/// Checkpoints and bytes a store holds under a key prefix (a tenant's).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreUsage {
    /// Checkpoints.
    pub checkpoints: u64,
    /// Their bytes together.
    pub bytes: u64,
}

/// The limits a store puts on checkpoints.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreLimits {
    /// The cap on one checkpoint, bytes.
    pub max_checkpoint_bytes: u64,
    /// The quota of bytes of one tenant's checkpoints together, if any.
    pub tenant_quota_bytes: Option<u64>,
}

/// Where checkpoints are kept: files by key. Implementations must make
/// `put` atomic (a reader sees the old checkpoint or the new, never a
/// mix) so that a checkpoint killed half-way leaves the previous one
/// valid, and must not hold a checkpoint in memory whole.
pub trait CheckpointStore: std::fmt::Debug + Send + Sync {
    /// How large the next checkpoint of `key` may be (its cap per
    /// checkpoint, what is left of a quota), with the refusal to give when
    /// it would be larger.
    fn allowance(&self, key: &str) -> Result<Allowance, CheckpointError>;

    /// A new, empty file with no name (it is gone when closed), readable
    /// and writable, on a disk this store stages checkpoints on: a
    /// checkpoint is read into one as the worker writes it, and copied
    /// into one for a restore. By default in the system's temporary
    /// directory.
    fn scratch(&self) -> io::Result<File> {
        anonymous_file(&std::env::temp_dir())
    }

    /// Stores the `len` bytes of `src` (read from its start) under `key`,
    /// replacing what was there, atomically. Refuses, before it writes
    /// anything, a checkpoint its allowance does not cover.
    fn put(&self, key: &str, src: &File, len: u64) -> Result<(), CheckpointError>;

    /// Copies the checkpoint under `key` into `dst` (which it truncates
    /// first); its length, or `None` if there is none.
    fn get(&self, key: &str, dst: &File) -> io::Result<Option<u64>>;

    /// Removes `key`'s checkpoint and its note (no error if absent).
    fn delete(&self, key: &str) -> io::Result<()>;

    /// Every key.
    fn list(&self) -> io::Result<Vec<String>>;

    /// Keeps a small note beside `key`'s checkpoint, replacing any: what
    /// its state lacks ([`UnsavedCalls`], as JSON), so that a session
    /// restored from it later (after a restart, on another node) says
    /// which calls it lost. By default notes are not kept.
    fn put_note(&self, key: &str, note: &[u8]) -> io::Result<()> {
        let _ = (key, note);
        Ok(())
    }

    /// The note beside `key`'s checkpoint, if any.
    fn get_note(&self, key: &str) -> io::Result<Option<Vec<u8>>> {
        let _ = key;
        Ok(None)
    }

    /// Removes the note beside `key`'s checkpoint (no error if absent).
    fn delete_note(&self, key: &str) -> io::Result<()> {
        let _ = key;
        Ok(())
    }

    /// Whether it keeps objects beside checkpoints ([`CheckpointStore::put_object`]):
    /// a session's files too large for its checkpoint are then stored as
    /// objects and restored with it. By default it does not (they are left
    /// out, named in the manifest's `files_skipped`).
    fn keeps_objects(&self) -> bool {
        false
    }

    /// Stores the `len` bytes of `src` (read from where it stands) as object
    /// `name` beside `key`'s checkpoint, replacing any (`name`: letters,
    /// digits, `-`, `_`, `.`; a sha256 for files).
    fn put_object(&self, key: &str, name: &str, src: &File, len: u64) -> io::Result<()> {
        let _ = (key, name, src, len);
        Err(io::Error::other(
            "this store keeps no objects beside checkpoints",
        ))
    }

    /// Copies object `name` of `key` into `dst` (which it truncates
    /// first); its length, or `None` if there is none.
    fn get_object(&self, key: &str, name: &str, dst: &File) -> io::Result<Option<u64>> {
        let _ = (key, name, dst);
        Ok(None)
    }

    /// The names of `key`'s objects.
    fn list_objects(&self, key: &str) -> io::Result<Vec<String>> {
        let _ = key;
        Ok(Vec::new())
    }

    /// Removes object `name` of `key` (no error if absent).
    fn delete_object(&self, key: &str, name: &str) -> io::Result<()> {
        let _ = (key, name);
        Ok(())
    }

    /// Checkpoints and bytes under keys that start with `prefix`.
    fn usage(&self, prefix: &str) -> io::Result<StoreUsage>;

    /// Its limits (cheap: no I/O).
    fn limits(&self) -> StoreLimits;
}

/// A new file with no name in `dir` (`O_TMPFILE`; where the file system
/// lacks it, a file created and unlinked at once), mode 0600.
pub fn anonymous_file(dir: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
        .open(dir);
    match tmp {
        Ok(f) => Ok(f),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(e),
        Err(_) => {
            let path = dir.join(format!(".rvisor-scratch-{}", crate::ids::execution_id()));
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)?;
            std::fs::remove_file(&path)?;
            Ok(f)
        }
    }
}

/// Copies the first `len` bytes of `src` into `dst` from their starts (in
/// the kernel where it can: no buffer of the checkpoint's size); the
/// bytes copied.
pub fn copy_file(src: &File, dst: &File, len: u64) -> io::Result<u64> {
    use std::io::Read;
    let (mut src, mut dst) = (src, dst);
    src.rewind()?;
    dst.rewind()?;
    dst.set_len(0)?;
    let n = io::copy(&mut src.take(len), &mut dst)?;
    dst.rewind()?;
    Ok(n)
}

/// A [`CheckpointStore`] in a local directory: one file per key, written
/// to a temporary name and renamed into place, and a cap on one
/// checkpoint ([`DEFAULT_MAX_CHECKPOINT_BYTES`]; no quota: one user).
#[derive(Debug, Clone)]
pub struct DirStore {
    dir: PathBuf,
    max_bytes: u64,
}

/// Keys are file names: letters, digits, `-`, `_` and `.` (not leading).
fn check_key(key: &str) -> io::Result<()> {
    let ok = !key.is_empty()
        && key.len() <= 200
        && !key.starts_with('.')
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("checkpoint key {key:?}: use letters, digits, '-', '_' and '.'"),
        ))
    }
}

fn store_error(what: &str, e: io::Error) -> CheckpointError {
    CheckpointError::Store(format!("could not {what} ({e})"))
}

impl DirStore {
    /// A store in `dir`, created if needed (mode 0700).
    pub fn new(dir: impl Into<PathBuf>) -> io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = dir.into();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        Ok(DirStore {
            dir,
            max_bytes: DEFAULT_MAX_CHECKPOINT_BYTES,
        })
    }

    /// The same store with a cap of `max_bytes` per checkpoint.
    pub fn with_max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file that holds `key`'s checkpoint (it may not exist).
    pub fn path_of(&self, key: &str) -> io::Result<PathBuf> {
        check_key(key)?;
        Ok(self.dir.join(format!("{key}.ckpt")))
    }

    fn objects_dir(&self, key: &str) -> io::Result<PathBuf> {
        check_key(key)?;
        Ok(self.dir.join(format!("{key}.objects")))
    }

    fn object_path(&self, key: &str, name: &str) -> io::Result<PathBuf> {
        check_key(name)?;
        Ok(self.objects_dir(key)?.join(name))
    }

    fn note_path(&self, key: &str) -> io::Result<PathBuf> {
        check_key(key)?;
        Ok(self.dir.join(format!("{key}.unsaved.json")))
    }

    /// Writes `fill`'s output to a temporary file and renames it to
    /// `path`, synced first; nothing is left behind on failure.
    fn replace(
        &self,
        key: &str,
        path: &Path,
        fill: impl FnOnce(&File) -> io::Result<()>,
    ) -> io::Result<()> {
        let tmp = self
            .dir
            .join(format!(".{key}.{}.tmp", crate::ids::execution_id()));
        let write = || -> io::Result<()> {
            let f = File::create(&tmp)?;
            fill(&f)?;
            f.sync_data()?;
            std::fs::rename(&tmp, path)
        };
        let out = write();
        if out.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        out
    }
}

fn remove(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

impl CheckpointStore for DirStore {
    fn allowance(&self, _key: &str) -> Result<Allowance, CheckpointError> {
        Ok(Allowance::cap(self.max_bytes))
    }

    fn scratch(&self) -> io::Result<File> {
        anonymous_file(&self.dir)
    }

    fn put(&self, key: &str, src: &File, len: u64) -> Result<(), CheckpointError> {
        if len > self.max_bytes {
            return Err(over_cap(self.max_bytes));
        }
        let path = self
            .path_of(key)
            .map_err(|e| CheckpointError::Store(e.to_string()))?;
        self.replace(key, &path, |f| {
            let n = copy_file(src, f, len)?;
            if n != len {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the staged checkpoint has {n} of its {len} bytes"),
                ));
            }
            Ok(())
        })
        .map_err(|e| {
            store_error(
                &format!("store the checkpoint in {}", self.dir.display()),
                e,
            )
        })
    }

    fn get(&self, key: &str, dst: &File) -> io::Result<Option<u64>> {
        let f = match File::open(self.path_of(key)?) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let len = f.metadata()?.len();
        copy_file(&f, dst, len).map(Some)
    }

    fn delete(&self, key: &str) -> io::Result<()> {
        remove(&self.path_of(key)?)?;
        remove(&self.note_path(key)?)?;
        match std::fs::remove_dir_all(self.objects_dir(key)?) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    fn keeps_objects(&self) -> bool {
        true
    }

    fn put_object(&self, key: &str, name: &str, src: &File, len: u64) -> io::Result<()> {
        use std::io::Read;
        use std::os::unix::fs::DirBuilderExt;
        let path = self.object_path(key, name)?;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(self.objects_dir(key)?)?;
        self.replace(key, &path, |mut f| {
            let n = io::copy(&mut src.take(len), &mut f)?;
            if n != len {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("the object has {n} of its {len} bytes"),
                ));
            }
            Ok(())
        })
    }

    fn get_object(&self, key: &str, name: &str, dst: &File) -> io::Result<Option<u64>> {
        let f = match File::open(self.object_path(key, name)?) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let len = f.metadata()?.len();
        copy_file(&f, dst, len).map(Some)
    }

    fn list_objects(&self, key: &str) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        let dir = match std::fs::read_dir(self.objects_dir(key)?) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e),
        };
        for e in dir {
            let name = e?.file_name().to_string_lossy().into_owned();
            if check_key(&name).is_ok() {
                out.push(name);
            }
        }
        out.sort();
        Ok(out)
    }

    fn delete_object(&self, key: &str, name: &str) -> io::Result<()> {
        remove(&self.object_path(key, name)?)
    }

    fn list(&self) -> io::Result<Vec<String>> {
        let mut keys = Vec::new();
        for e in std::fs::read_dir(&self.dir)? {
            let name = e?.file_name().to_string_lossy().into_owned();
            if let Some(k) = name.strip_suffix(".ckpt") {
                if check_key(k).is_ok() {
                    keys.push(k.to_string());
                }
            }
        }
        keys.sort();
        Ok(keys)
    }

    fn put_note(&self, key: &str, note: &[u8]) -> io::Result<()> {
        use std::io::Write;
        let path = self.note_path(key)?;
        self.replace(key, &path, |mut f| f.write_all(note))
    }

    fn get_note(&self, key: &str) -> io::Result<Option<Vec<u8>>> {
        match std::fs::read(self.note_path(key)?) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn delete_note(&self, key: &str) -> io::Result<()> {
        remove(&self.note_path(key)?)
    }

    fn usage(&self, prefix: &str) -> io::Result<StoreUsage> {
        let mut u = StoreUsage::default();
        for key in self.list()? {
            if !key.starts_with(prefix) {
                continue;
            }
            if let Ok(m) = std::fs::metadata(self.path_of(&key)?) {
                u.checkpoints += 1;
                u.bytes += m.len();
            }
        }
        Ok(u)
    }

    fn limits(&self) -> StoreLimits {
        StoreLimits {
            max_checkpoint_bytes: self.max_bytes,
            tenant_quota_bytes: None,
        }
    }
}

/// What a checkpoint in the store lacks: the calls that ran after it whose
/// state was not saved, and why. Kept as a note beside the checkpoint
/// ([`CheckpointStore::put_note`]) whenever a checkpoint fails, so that a
/// session restored from the older one later says which calls it lost.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct UnsavedCalls {
    /// `created_at` of the checkpoint in the store it is about (0: none).
    pub checkpoint_created_at: f64,
    /// The calls' execution ids, oldest first, at most
    /// `rvisor_protocol::MAX_LOST_CALLS` (the most recent).
    pub calls: Vec<String>,
    /// How many in all.
    pub count: u64,
    /// Why their state was not saved.
    pub reason: String,
    /// When this was written (RFC 3339, UTC).
    pub at: String,
}

/// An object the checkpoint does not hold.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Unsaved {
    /// Its name in the global environment.
    pub name: String,
    /// `connection` or `external pointer`.
    pub reason: String,
}

/// What a checkpoint holds, as the worker wrote it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default)]
pub struct Manifest {
    /// Layout version (1).
    pub format: u32,
    /// When it was taken (seconds since the Unix epoch).
    pub created_at: f64,
    /// R's version, e.g. "4.2.2"; a worker with another refuses it.
    pub r_version: String,
    /// Names of the global environment's objects saved.
    pub objects: Vec<String>,
    /// Bytes of the objects serialised.
    pub objects_bytes: f64,
    /// Bytes of the whole state serialised (before compression).
    pub state_bytes: u64,
    /// Bytes of the state compressed.
    pub compressed_bytes: u64,
    /// Objects not saved, by name, and why.
    pub unsaved: Vec<Unsaved>,
    /// Attached packages, in search() order.
    pub attached: Vec<String>,
    /// Loaded namespaces and their versions.
    pub packages: std::collections::BTreeMap<String, String>,
    /// Working-directory files saved (relative paths).
    pub files: Vec<String>,
    /// Working-directory files left out (over the cap or unreadable), and
    /// not stored beside it either.
    pub files_skipped: Vec<String>,
    /// Working-directory files over the cap stored as objects beside the
    /// checkpoint (a store that keeps objects), restored with it: their
    /// relative paths. Not in the checkpoint file: its [`FileRefs`].
    pub files_beside: Vec<String>,
    /// Options the session changed.
    pub options_changed: Vec<String>,
    /// Environment variables the session changed or removed.
    pub env_changed: Vec<String>,
    /// How long the worker took to write it, in milliseconds.
    pub checkpoint_ms: f64,
}

impl Manifest {
    /// The manifest of checkpoint `bytes`, or why they are not a checkpoint.
    pub fn read(bytes: &[u8]) -> Result<Manifest, String> {
        Self::read_from(&mut io::Cursor::new(bytes))
    }

    /// The manifest of the checkpoint file `f`, read from its tail (the
    /// state is not read), or why it is not a checkpoint.
    pub fn read_from<F: io::Read + io::Seek>(f: &mut F) -> Result<Manifest, String> {
        let (_, manifest) = rvisor_protocol::checkpoint::read_manifest(f)?;
        serde_json::from_slice(&manifest)
            .map_err(|e| format!("the checkpoint's manifest is damaged ({e})"))
    }

    /// Seconds since it was taken.
    pub fn age_seconds(&self) -> f64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        (now - self.created_at).max(0.0)
    }

    /// When it was taken (RFC 3339, UTC).
    pub fn taken_at(&self) -> String {
        crate::clock::rfc3339(self.created_at.max(0.0) as u64)
    }
}

/// Name of the object that lists a checkpoint's files stored beside it.
pub const FILE_REFS_OBJECT: &str = "files.json";

/// One file stored beside a checkpoint, as an object named by its sha256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRef {
    /// Its path in the working directory.
    pub name: String,
    /// Its bytes.
    pub size: u64,
    /// sha256 of its bytes (hex): the object's name.
    pub sha256: String,
}

/// The files stored beside a checkpoint (object [`FILE_REFS_OBJECT`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FileRefs {
    /// `created_at` of the checkpoint they go with.
    pub checkpoint_created_at: f64,
    /// The files.
    pub files: Vec<FileRef>,
}

/// A checkpoint just taken: where it went and what it holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckpointInfo {
    /// The store's key.
    pub key: String,
    /// Bytes stored.
    pub bytes: u64,
    /// False when nothing changed since the last checkpoint, which was
    /// kept.
    pub written: bool,
    /// What it holds.
    pub manifest: Manifest,
}

/// Where a session's checkpoint stands (`SessionStatus.checkpoint`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CheckpointState {
    /// No checkpoint yet: a lost worker or a restart starts it empty.
    None,
    /// The store holds the session's state as it is.
    Current,
    /// Calls ran since the checkpoint in the store; a background
    /// checkpoint follows when the session is idle.
    Behind,
    /// The last checkpoint failed (`failure` says why): the store holds
    /// an older state, or none.
    Failed,
}

/// Why checkpoints of a session fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CheckpointFailureKind {
    /// Over the cap on one checkpoint.
    TooLarge,
    /// Over the tenant's quota of checkpoint bytes.
    Quota,
    /// This node no longer holds the session's lease.
    Lease,
    /// The store failed.
    Store,
    /// The worker did not write it.
    Worker,
}

impl From<&CheckpointError> for CheckpointFailureKind {
    fn from(e: &CheckpointError) -> Self {
        match e {
            CheckpointError::TooLarge(_) => Self::TooLarge,
            CheckpointError::Quota(_) => Self::Quota,
            CheckpointError::Fenced(_) => Self::Lease,
            CheckpointError::Worker(_) => Self::Worker,
            // A store that refused the key, or (not recorded as failures)
            // nothing to checkpoint, no store, a closed session.
            _ => Self::Store,
        }
    }
}

/// The checkpoint failures of a session, while they last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckpointFailure {
    /// What kind of failure.
    pub kind: CheckpointFailureKind,
    /// What went wrong and what to do.
    pub reason: String,
    /// When the first of these failures in a row happened (RFC 3339, UTC).
    pub since: String,
    /// Failed attempts in a row.
    pub attempts: u32,
    /// Seconds until background checkpoints, hibernation and admission try
    /// again (0: due); `null`: not before a call has changed the state (a
    /// state too large stays too large).
    pub retry_in_seconds: Option<f64>,
}

/// A session's checkpoint as `status` shows it (only with a checkpoint
/// store).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckpointStatus {
    /// Where it stands.
    pub state: CheckpointState,
    /// When the checkpoint in the store was taken (RFC 3339, UTC), if
    /// known.
    pub taken_at: Option<String>,
    /// Its bytes, if known.
    pub bytes: Option<u64>,
    /// Calls that completed since it: a restore now would lose their work.
    pub calls_since: u64,
    /// Why the last attempts failed (state `failed`).
    pub failure: Option<CheckpointFailure>,
}

impl CheckpointStatus {
    /// Whether hibernating the session now is pointless: its checkpoint
    /// failed and is not due to be tried again (admission and the memory
    /// monitor pick other sessions).
    pub fn blocks_hibernation(&self) -> bool {
        self.failure
            .as_ref()
            .is_some_and(|f| f.retry_in_seconds.is_none_or(|s| s > 0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn file_with(s: &DirStore, bytes: &[u8]) -> File {
        let mut f = s.scratch().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    fn read(s: &DirStore, key: &str) -> Option<Vec<u8>> {
        let f = s.scratch().unwrap();
        let len = s.get(key, &f).unwrap()?;
        let mut out = Vec::new();
        (&f).read_to_end(&mut out).unwrap();
        assert_eq!(out.len() as u64, len);
        Some(out)
    }

    #[test]
    fn the_dir_store_replaces_atomically_and_lists_its_keys() {
        let dir = std::env::temp_dir().join(format!("rvisor-store-{}", crate::ids::execution_id()));
        let s = DirStore::new(&dir).unwrap();
        assert_eq!(read(&s, "a"), None);
        s.put("a", &file_with(&s, b"one"), 3).unwrap();
        s.put("a", &file_with(&s, b"two"), 3).unwrap();
        s.put("b-2", &file_with(&s, b"x"), 1).unwrap();
        assert_eq!(read(&s, "a").as_deref(), Some(&b"two"[..]));
        assert_eq!(s.list().unwrap(), vec!["a".to_string(), "b-2".to_string()]);
        s.put_note("a", b"{}").unwrap();
        assert_eq!(s.get_note("a").unwrap().as_deref(), Some(&b"{}"[..]));
        let u = s.usage("").unwrap();
        assert_eq!((u.checkpoints, u.bytes), (2, 4));
        assert_eq!(s.usage("b").unwrap().bytes, 1);
        s.delete("a").unwrap();
        s.delete("a").unwrap();
        assert_eq!(s.get_note("a").unwrap(), None);
        assert_eq!(s.list().unwrap(), vec!["b-2".to_string()]);
        assert!(s.put("../x", &file_with(&s, b"no"), 2).is_err());
        assert!(s.put(".hidden", &file_with(&s, b"no"), 2).is_err());
        // No temporary or scratch file is left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_dir_store_keeps_objects_beside_a_checkpoint_until_it_is_deleted() {
        use std::io::Seek;
        let dir = std::env::temp_dir().join(format!("rvisor-store-{}", crate::ids::execution_id()));
        let s = DirStore::new(&dir).unwrap();
        assert!(s.keeps_objects());
        assert!(s.list_objects("k").unwrap().is_empty());
        s.put("k", &file_with(&s, b"ck"), 2).unwrap();
        let mut src = file_with(&s, b"object bytes");
        src.rewind().unwrap();
        s.put_object("k", "abc123", &src, 12).unwrap();
        assert!(s.put_object("k", "../x", &src, 0).is_err());
        assert_eq!(s.list_objects("k").unwrap(), vec!["abc123".to_string()]);
        let dst = s.scratch().unwrap();
        assert_eq!(s.get_object("k", "abc123", &dst).unwrap(), Some(12));
        let mut out = Vec::new();
        (&dst).read_to_end(&mut out).unwrap();
        assert_eq!(out, b"object bytes");
        assert_eq!(s.get_object("k", "gone", &dst).unwrap(), None);
        s.delete_object("k", "abc123").unwrap();
        s.delete_object("k", "abc123").unwrap();
        assert!(s.list_objects("k").unwrap().is_empty());
        s.put_object("k", "def", &file_with(&s, b""), 0).unwrap();
        // The checkpoint's key is still the only one listed.
        assert_eq!(s.list().unwrap(), vec!["k".to_string()]);
        s.delete("k").unwrap();
        assert!(s.list_objects("k").unwrap().is_empty());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_checkpoint_over_the_cap_is_refused_and_the_old_one_stays() {
        let dir = std::env::temp_dir().join(format!("rvisor-store-{}", crate::ids::execution_id()));
        let s = DirStore::new(&dir).unwrap().with_max_bytes(4);
        assert_eq!(s.allowance("k").unwrap(), Allowance::cap(4));
        s.put("k", &file_with(&s, b"old"), 3).unwrap();
        let e = s.put("k", &file_with(&s, b"too big"), 7).unwrap_err();
        assert!(matches!(e, CheckpointError::TooLarge(_)), "{e:?}");
        assert!(e.to_string().contains("--checkpoint-max-mb"), "{e}");
        assert_eq!(read(&s, "k").as_deref(), Some(&b"old"[..]));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_damaged_checkpoint_has_no_manifest() {
        assert!(Manifest::read(b"not a checkpoint").is_err());
        let mut f = rvisor_protocol::checkpoint::MAGIC.to_vec();
        let m = br#"{"r_version":"4.2.2","objects":["x"]}"#;
        f.extend_from_slice(m);
        f.extend_from_slice(&(m.len() as u32).to_be_bytes());
        let m = Manifest::read(&f).unwrap();
        assert_eq!(m.objects, vec!["x".to_string()]);
        assert_eq!(m.r_version, "4.2.2");
    }

    #[test]
    fn hibernation_waits_while_a_failure_is_not_due() {
        let failed = |retry: Option<f64>| CheckpointStatus {
            state: CheckpointState::Failed,
            taken_at: None,
            bytes: None,
            calls_since: 1,
            failure: Some(CheckpointFailure {
                kind: CheckpointFailureKind::TooLarge,
                reason: "x".into(),
                since: "t".into(),
                attempts: 1,
                retry_in_seconds: retry,
            }),
        };
        assert!(failed(None).blocks_hibernation());
        assert!(failed(Some(5.0)).blocks_hibernation());
        assert!(!failed(Some(0.0)).blocks_hibernation());
        let ok = CheckpointStatus {
            failure: None,
            ..failed(None)
        };
        assert!(!ok.blocks_hibernation());
    }
}
