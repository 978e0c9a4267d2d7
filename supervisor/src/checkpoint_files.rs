//! A session's files too large for its checkpoint, kept beside it
//! (docs/files.md, "Durability"): the worker leaves a file out of the
//! checkpoint once the files it holds would pass
//! `SessionOptions::checkpoint_file_bytes` (`files_skipped`); with a store
//! that keeps objects ([`CheckpointStore::keeps_objects`]) the supervisor
//! then stores each such file as an object of the checkpoint's key named
//! by its sha256 (so checkpoints of the same session share it), lists them
//! in the object [`FILE_REFS_OBJECT`] once the checkpoint is stored, and
//! deletes the objects no checkpoint names any more. A restore copies them
//! back into the new worker's directory through the same descriptors and
//! checks as uploads (`crate::files::WorkDir`): only inside the worker's
//! root, only as regular files. Files go through scratch files and the
//! store's streaming calls, never whole in memory.

use crate::checkpoint::{CheckpointStore, FileRef, FileRefs, FILE_REFS_OBJECT};
use crate::file_rules::FileLimits;
use crate::files::WorkDir;
use std::io::{Read, Seek, Write};

/// No limit but the disk's: the files were the session's already.
fn unbounded() -> FileLimits {
    FileLimits {
        max_file_bytes: u64::MAX,
        max_call_bytes: u64::MAX,
        max_session_bytes: u64::MAX,
        max_tenant_bytes: u64::MAX,
        max_files: usize::MAX,
    }
}

/// The sha256 (hex) of the first `len` bytes of `f` from where it stands.
fn sha256_of(f: &mut std::fs::File, len: u64) -> std::io::Result<String> {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 64 << 10];
    let mut left = len;
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = f.read(&mut buf[..want])?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the file shrank while it was read",
            ));
        }
        h.update(&buf[..n]);
        left -= n as u64;
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// What a file was when it was last hashed (size, inode, modification
/// time in ns) and its sha256: an unchanged file is not read again.
pub(crate) type Hashed = std::collections::HashMap<String, ((u64, u64, i128), String)>;

fn stamp(f: &std::fs::File) -> std::io::Result<(u64, u64, i128)> {
    use std::os::unix::fs::MetadataExt;
    let m = f.metadata()?;
    Ok((
        m.size(),
        m.ino(),
        i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
    ))
}

/// Stores each of `names` (files of `dir` the checkpoint left out) as an
/// object of `key`, unless one of that content is there already; the
/// references, and for each file that could not be stored, its name and
/// why (it stays out of the checkpoint, as before). `hashed` keeps the
/// sha256 of files as they were, so an unchanged file is neither read nor
/// stored again.
pub(crate) fn store_beside(
    store: &dyn CheckpointStore,
    key: &str,
    dir: &WorkDir,
    names: &[String],
    hashed: &mut Hashed,
) -> (Vec<FileRef>, Vec<(String, String)>) {
    let have: std::collections::HashSet<String> = store
        .list_objects(key)
        .unwrap_or_default()
        .into_iter()
        .collect();
    hashed.retain(|n, _| names.contains(n));
    let mut refs = Vec::new();
    let mut failed = Vec::new();
    for name in names {
        let mut one = || -> Result<FileRef, String> {
            let (info, mut f) = dir.open(name).map_err(|e| e.to_string())?;
            let now = stamp(&f).map_err(|e| e.to_string())?;
            let sha256 = match hashed.get(name) {
                Some((was, sha)) if *was == now && now.0 == info.size => sha.clone(),
                _ => {
                    let sha = sha256_of(&mut f, info.size).map_err(|e| e.to_string())?;
                    hashed.insert(name.clone(), (now, sha.clone()));
                    sha
                }
            };
            if !have.contains(&sha256) {
                f.rewind().map_err(|e| e.to_string())?;
                store
                    .put_object(key, &sha256, &f, info.size)
                    .map_err(|e| format!("could not store it beside the checkpoint ({e})"))?;
            }
            Ok(FileRef {
                name: info.name,
                size: info.size,
                sha256,
            })
        };
        match one() {
            Ok(r) => refs.push(r),
            Err(why) => failed.push((name.clone(), why)),
        }
    }
    (refs, failed)
}

/// Writes `refs` as the list of `key`'s files beside its checkpoint (just
/// stored), then deletes the objects it does not name: the files of
/// earlier checkpoints that are gone or changed. With no files, the list
/// and every object go.
pub(crate) fn commit_refs(
    store: &dyn CheckpointStore,
    key: &str,
    refs: &FileRefs,
) -> std::io::Result<()> {
    let existing = store.list_objects(key)?;
    if refs.files.is_empty() {
        for name in existing {
            store.delete_object(key, &name)?;
        }
        return Ok(());
    }
    let json = serde_json::to_vec(refs).map_err(std::io::Error::other)?;
    let mut f = store.scratch()?;
    f.write_all(&json)?;
    f.rewind()?;
    store.put_object(key, FILE_REFS_OBJECT, &f, json.len() as u64)?;
    let named: std::collections::HashSet<&str> =
        refs.files.iter().map(|r| r.sha256.as_str()).collect();
    for name in existing {
        if name != FILE_REFS_OBJECT && !named.contains(name.as_str()) {
            store.delete_object(key, &name)?;
        }
    }
    Ok(())
}

/// Copies the files stored beside `key`'s checkpoint into `dir` (the
/// restored worker's directory); the names restored, and a warning for
/// each file that could not be (missing from the store, damaged, refused
/// by the directory), naming it: the session goes on without it.
pub(crate) fn restore_beside(
    store: &dyn CheckpointStore,
    key: &str,
    dir: &WorkDir,
) -> (Vec<String>, Vec<String>) {
    let mut warnings = Vec::new();
    let refs: FileRefs = match store.scratch().and_then(|f| {
        let got = store.get_object(key, FILE_REFS_OBJECT, &f)?;
        Ok(got.map(|_| f))
    }) {
        Ok(None) => return (Vec::new(), warnings),
        Ok(Some(f)) => match serde_json::from_reader(std::io::BufReader::new(f)) {
            Ok(r) => r,
            Err(e) => {
                warnings.push(format!(
                    "rvisor: the list of the session's files stored beside its checkpoint is \
                     damaged ({e}); the session was restored without them"
                ));
                return (Vec::new(), warnings);
            }
        },
        Err(e) => {
            warnings.push(format!(
                "rvisor: the session's files stored beside its checkpoint could not be read \
                 ({e}); the session was restored without them"
            ));
            return (Vec::new(), warnings);
        }
    };
    let limits = unbounded();
    let mut restored = Vec::new();
    for r in refs.files {
        let one = || -> Result<(), String> {
            let mut f = store
                .scratch()
                .map_err(|e| format!("could not stage it ({e})"))?;
            match store.get_object(key, &r.sha256, &f) {
                Ok(Some(len)) if len == r.size => {}
                Ok(Some(len)) => {
                    return Err(format!(
                        "its object in the store has {len} bytes, not {}",
                        r.size
                    ))
                }
                Ok(None) => return Err("its object is missing from the store".into()),
                Err(e) => return Err(format!("its object could not be read ({e})")),
            }
            f.rewind().map_err(|e| e.to_string())?;
            dir.put(&r.name, &mut f.take(r.size), &limits)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        match one() {
            Ok(()) => restored.push(r.name),
            Err(why) => warnings.push(format!(
                "rvisor: the file {:?} ({} bytes, stored beside the checkpoint) was not \
                 restored: {why}; the session was restored without it",
                r.name, r.size
            )),
        }
    }
    (restored, warnings)
}
