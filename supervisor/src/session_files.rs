//! A session's files on the Rust library: `Session::files`, `put_file`,
//! `begin_upload`, `get_file`, `delete_file` (docs/files.md). Apart from
//! `files` (the descriptor-based access and the rules' use), which the
//! session's runner uses for one-shot runs, so imports point one way:
//! this module uses both.

use crate::file_rules::{self, FileLimits, FileRefusal};
use crate::files::*;
use crate::session::Session;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};

impl Session {
    /// The working directory's descriptor; a confined session without a
    /// live worker first gets one (a no-op call, which also restores a
    /// hibernated session, files included).
    fn files_root(&self) -> Result<OwnedFd, FileError> {
        for _ in 0..3 {
            let place = self.files_place();
            if place == Place::NoWorker {
                let h = self
                    .run("invisible(NULL)")
                    .map_err(|e| FileError::Unreachable(format!("no worker could start: {e}")))?;
                match h.wait_timeout(WORKER_WAIT) {
                    Some(r)
                        if !matches!(
                            r.outcome,
                            crate::Outcome::StartupFailed | crate::Outcome::StartupTimedOut
                        ) =>
                    {
                        continue
                    }
                    Some(r) => {
                        return Err(FileError::Unreachable(format!(
                            "its worker could not start: {}",
                            r.error.map(|e| e.message).unwrap_or_default()
                        )))
                    }
                    None => {
                        return Err(FileError::Unreachable(
                            "its worker did not start in time; retry".into(),
                        ))
                    }
                }
            }
            let fd = open_root(&place)?;
            // The worker may have been replaced while its root was opened.
            if self.files_place() == place {
                return Ok(fd);
            }
        }
        Err(FileError::Unreachable(
            "its worker kept being replaced; retry".into(),
        ))
    }

    /// The regular files of the working directory, sorted by name (at
    /// most `FileLimits::default().max_files`).
    pub fn files(&self) -> Result<Vec<FileInfo>, FileError> {
        let mut v: Vec<FileInfo> = self
            .snapshot(FileLimits::default().max_files)?
            .into_values()
            .map(|(_, i)| i)
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(v)
    }

    /// A listing to compare with a later one ([`changed_files`]).
    pub fn snapshot(&self, max_files: usize) -> Result<Snapshot, FileError> {
        list(self.files_root()?, max_files)
    }

    /// [`Session::snapshot`] without starting a worker: `Ok(None)` when
    /// the files cannot be reached without one (a confined session with
    /// no live worker, a hibernated one or one to be restored), or, with
    /// `generation`, when a confined session's worker is not that one
    /// any more (its files went with it; the new worker's are not the
    /// ones a call of the old one changed). Compare two with
    /// [`changed_files`] for the files a call changed.
    pub fn snapshot_if_live(
        &self,
        max_files: usize,
        generation: Option<u64>,
    ) -> Result<Option<Snapshot>, FileError> {
        let place = self.files_place();
        let key = match &place {
            Place::NoWorker => return Ok(None),
            Place::Worker { generation: g, .. } if generation.is_some_and(|want| want != *g) => {
                return Ok(None)
            }
            // Only a confined session's directory is reachable by nothing
            // but its worker and this API (a host directory is anyone's).
            Place::Worker { generation: g, .. } => self.listing_key(*g),
            Place::Host(_) => None,
        };
        if let Some(kept) = key.and_then(|k| self.kept_listing(k, max_files)) {
            return Ok(Some(kept));
        }
        let listed = list(open_root(&place)?, max_files)?;
        if let Some(k) = key {
            self.keep_listing(k, max_files, &listed);
        }
        Ok(Some(listed))
    }

    /// Starts an upload of `name` (checked and normalised), within
    /// `limits`: write it, then [`Upload::commit`].
    pub fn begin_upload(&self, name: &str, limits: &FileLimits) -> Result<Upload, FileError> {
        begin_upload_in(&|| self.files_root(), name, limits)
    }

    /// Writes `name` from `content`, atomically, within the default
    /// limits.
    pub fn put_file(&self, name: &str, content: &mut dyn Read) -> Result<FileInfo, FileError> {
        self.put_file_with(name, content, &FileLimits::default())
    }

    /// [`Session::put_file`] within `limits`.
    pub fn put_file_with(
        &self,
        name: &str,
        content: &mut dyn Read,
        limits: &FileLimits,
    ) -> Result<FileInfo, FileError> {
        let mut up = self.begin_upload(name, limits)?;
        copy_into(content, &mut up)?;
        let info = up.commit()?;
        self.files_changed();
        Ok(info)
    }

    /// Opens `name` for reading: its information and the open file
    /// (regular files only).
    pub fn get_file(&self, name: &str) -> Result<(FileInfo, File), FileError> {
        open_in(self.files_root()?, name)
    }

    /// Deletes `name` (a regular file; a symlink or FIFO R made is
    /// refused like any other use of it).
    pub fn delete_file(&self, name: &str) -> Result<(), FileError> {
        let name = file_rules::check_name(name)?;
        let (dirs, leaf) = split(&name);
        let dir = walk(self.files_root()?, &dirs, false)?;
        match lstatat(&dir, leaf).map_err(FileError::io("look at the file"))? {
            None => return Err(FileRefusal::NotFound { name }.into()),
            Some(st) if st.st_mode & libc::S_IFMT != libc::S_IFREG => {
                return Err(FileRefusal::NotRegular {
                    name,
                    kind: file_rules::kind_of(st.st_mode),
                }
                .into())
            }
            Some(_) => {}
        }
        let c = cstr(leaf);
        // SAFETY: `dir` is open and `c` a NUL-terminated name in it.
        if unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), 0) } != 0 {
            return Err(FileError::io("delete the file")(last_error()));
        }
        self.files_changed();
        Ok(())
    }
}
