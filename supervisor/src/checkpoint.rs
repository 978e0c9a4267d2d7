//! Checkpoints of sessions and where they are kept.
//!
//! A checkpoint is one file, written by the worker (see
//! `rvisor_protocol::checkpoint` for its layout): the session's state,
//! compressed, and a [`Manifest`] the supervisor reads without R. Stores
//! keep checkpoints as bytes by key (a session's id, prefixed by the
//! caller as it likes, e.g. with a tenant), so that a store can be a local
//! directory ([`DirStore`]) or a blob store implemented elsewhere.

use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};

/// Where checkpoints are kept: bytes by key. Implementations must make
/// `put` atomic (a reader sees the old bytes or the new, never a mix) so
/// that a checkpoint killed half-way leaves the previous one valid.
pub trait CheckpointStore: std::fmt::Debug + Send + Sync {
    /// Stores `bytes` under `key`, replacing what was there.
    fn put(&self, key: &str, bytes: &[u8]) -> io::Result<()>;
    /// The bytes under `key`, if any.
    fn get(&self, key: &str) -> io::Result<Option<Vec<u8>>>;
    /// Removes `key` (no error if it is absent).
    fn delete(&self, key: &str) -> io::Result<()>;
    /// Every key.
    fn list(&self) -> io::Result<Vec<String>>;
}

/// A [`CheckpointStore`] in a local directory: one file per key, written
/// to a temporary name and renamed into place.
#[derive(Debug, Clone)]
pub struct DirStore {
    dir: PathBuf,
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

impl DirStore {
    /// A store in `dir`, created if needed (mode 0700).
    pub fn new(dir: impl Into<PathBuf>) -> io::Result<Self> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = dir.into();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)?;
        Ok(DirStore { dir })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, key: &str) -> io::Result<PathBuf> {
        check_key(key)?;
        Ok(self.dir.join(format!("{key}.ckpt")))
    }
}

impl CheckpointStore for DirStore {
    fn put(&self, key: &str, bytes: &[u8]) -> io::Result<()> {
        use std::io::Write;
        let path = self.path(key)?;
        let tmp = self
            .dir
            .join(format!(".{key}.{}.tmp", crate::ids::execution_id()));
        let write = || -> io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_data()?;
            std::fs::rename(&tmp, &path)
        };
        let out = write();
        if out.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        out
    }

    fn get(&self, key: &str) -> io::Result<Option<Vec<u8>>> {
        match std::fs::read(self.path(key)?) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn delete(&self, key: &str) -> io::Result<()> {
        match std::fs::remove_file(self.path(key)?) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
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
    /// Working-directory files left out (over the cap or unreadable).
    pub files_skipped: Vec<String>,
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
        let (manifest, _) = rvisor_protocol::checkpoint::split(bytes)?;
        serde_json::from_slice(manifest)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dir_store_replaces_atomically_and_lists_its_keys() {
        let dir = std::env::temp_dir().join(format!("rvisor-store-{}", crate::ids::execution_id()));
        let s = DirStore::new(&dir).unwrap();
        assert_eq!(s.get("a").unwrap(), None);
        s.put("a", b"one").unwrap();
        s.put("a", b"two").unwrap();
        s.put("b-2", b"x").unwrap();
        assert_eq!(s.get("a").unwrap().as_deref(), Some(&b"two"[..]));
        assert_eq!(s.list().unwrap(), vec!["a".to_string(), "b-2".to_string()]);
        s.delete("a").unwrap();
        s.delete("a").unwrap();
        assert_eq!(s.list().unwrap(), vec!["b-2".to_string()]);
        assert!(s.put("../x", b"no").is_err());
        assert!(s.put(".hidden", b"no").is_err());
        // No temporary file is left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
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
}
