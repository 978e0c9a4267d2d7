//! A session's files through the service: list, upload, download and
//! delete, for the session's tenant only, within the file quotas
//! (`ServiceConfig::files`, rules in `rvisor::file_rules`), with the
//! tenant's bytes counted for its quota and `/v1/usage`.

use super::{lock, ErrorCode, Service, ServiceError};
use rvisor::file_rules::{self, FileLimits, FileRefusal};
use rvisor::files::{FileError, FileInfo, Upload};
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::time::{Duration, Instant};

/// How old the store's count of a tenant's files may be before it is read
/// again: what other nodes (or this one before a restart) stored counts
/// within this long; what this node does counts at once.
pub const STORED_FILE_BYTES_TTL: Duration = Duration::from_secs(5);

/// Largest file the JSON surfaces (`session --jsonl`, nng, MCP) carry
/// inline as base64, either way; a larger one is refused naming this
/// limit (HTTP streams files of any size up to `max_file_bytes`).
pub const INLINE_FILE_BYTES: u64 = 256 << 10;

/// What the service last saw of one session's files, or of one run's
/// stored artifacts.
#[derive(Debug, Clone)]
pub(super) struct Held {
    pub tenant: String,
    pub bytes: u64,
    /// An artifact set's expiry (Unix seconds): past it the bytes no longer
    /// count, and the set is deleted by the next sweep (artifacts.rs).
    pub expires_unix: Option<u64>,
}

/// The store's count of one tenant's files ([`Held`] by key) and when it
/// was read.
pub(super) type StoredCount = (Instant, HashMap<String, Held>);

impl Held {
    fn counts(&self, tenant: &str, now: u64) -> bool {
        self.tenant == tenant && self.expires_unix.is_none_or(|e| e > now)
    }
}

/// A file error as the service answers it: a broken name or kind rule is
/// `file_refused` (409), a size `too_large` (413), a session or tenant
/// quota `quota` (429), a missing file `not_found` (404).
pub fn file_error(e: FileError) -> ServiceError {
    match e {
        FileError::Refused(r) => {
            let code = match &r {
                FileRefusal::Name { .. } | FileRefusal::NotRegular { .. } => ErrorCode::FileRefused,
                FileRefusal::NotFound { .. } => ErrorCode::NotFound,
                r if r.is_quota() => ErrorCode::Quota,
                _ => ErrorCode::TooLarge,
            };
            ServiceError::new(code, r.to_string())
        }
        FileError::Unreachable(m) => ServiceError::new(ErrorCode::NoWorker, m),
        e @ FileError::Io { .. } => ServiceError::new(ErrorCode::Storage, e.to_string()),
    }
}

/// An upload to a session in progress: write to [`Upload::file`], count
/// with [`SessionUpload::add`], finish with [`Service::commit_upload`].
#[derive(Debug)]
pub struct SessionUpload {
    upload: Upload,
    tenant: String,
    id: String,
    /// The tenant's file bytes but this upload's (the file it replaces
    /// left out).
    tenant_others: u64,
    written: u64,
    limits: FileLimits,
}

impl SessionUpload {
    /// The file to write to.
    pub fn file(&self) -> Option<&File> {
        self.upload.file()
    }

    /// Counts `n` more bytes written, refusing past a limit (the file,
    /// the session, the tenant).
    pub fn add(&mut self, n: u64) -> Result<(), ServiceError> {
        self.written += n;
        self.upload
            .add(n)
            .and_then(|()| {
                file_rules::check_tenant(&self.limits, self.tenant_others + self.written)
            })
            .map_err(|r| file_error(r.into()))
    }
}

impl Service {
    /// The quotas of files.
    pub fn file_limits(&self) -> &FileLimits {
        &self.inner.cfg.files
    }

    /// The bytes of `tenant`'s files: its sessions' files as last seen
    /// (listed, uploaded, deleted or reported by a call) and its stored
    /// artifacts not yet expired (an expired set stops counting at once,
    /// before the sweep deletes it). What this node saw counts as it is;
    /// the rest (sessions and artifacts of other nodes, or of this node
    /// before a restart) comes from the store's count
    /// ([`Service::stored_file_bytes`]), at most
    /// [`STORED_FILE_BYTES_TTL`] old.
    pub fn tenant_file_bytes(&self, tenant: &str) -> u64 {
        let stored = self.stored_file_bytes(tenant);
        let now = rvisor::clock::unix_now();
        let local = lock(&self.inner.file_bytes);
        let mine: u64 = local
            .values()
            .filter(|h| h.counts(tenant, now))
            .map(|h| h.bytes)
            .sum();
        let others: u64 = stored
            .iter()
            .filter(|(k, h)| !local.contains_key(k.as_str()) && h.counts(tenant, now))
            .map(|(_, h)| h.bytes)
            .sum();
        mine + others
    }

    /// The store's count of `tenant`'s files, by key (session id, or
    /// `artifacts:{execution_id}`): the artifact sets not yet expired (one
    /// listing of the tenant's artifacts) and, with durable sessions, the
    /// bytes each session's `files.json` records (one listing, and a read
    /// per session this node has not seen). Kept for
    /// [`STORED_FILE_BYTES_TTL`]; a store that does not answer leaves the
    /// last count (or none), with a warning.
    pub(super) fn stored_file_bytes(&self, tenant: &str) -> HashMap<String, Held> {
        if let Some((at, held)) = lock(&self.inner.stored_file_bytes).get(tenant) {
            if at.elapsed() < STORED_FILE_BYTES_TTL {
                return held.clone();
            }
        }
        let counted = self.stored_artifact_bytes(tenant).and_then(|mut held| {
            if let Some(d) = &self.inner.cfg.durable {
                let sessions = d
                    .file_bytes(tenant, |id| lock(&self.inner.file_bytes).contains_key(id))
                    .map_err(|e| e.to_string())?;
                for (id, bytes) in sessions {
                    let h = Held {
                        tenant: tenant.to_string(),
                        bytes,
                        expires_unix: None,
                    };
                    held.insert(id, h);
                }
            }
            Ok(held)
        });
        let mut cache = lock(&self.inner.stored_file_bytes);
        match counted {
            Ok(held) => {
                cache.insert(tenant.to_string(), (Instant::now(), held.clone()));
                held
            }
            Err(e) => {
                tracing::warn!(target: "rvisor::files", tenant,
                    "the tenant's files could not be counted from the store: {e}");
                cache
                    .get(tenant)
                    .map(|(_, h)| h.clone())
                    .unwrap_or_default()
            }
        }
    }

    /// Records that session (or, with `expires_unix`, artifact set) `key`
    /// of `tenant` holds `bytes` of files. A durable session's bytes are
    /// written to the store too when they changed, so that they count
    /// after a restart and on other nodes.
    pub(super) fn note_file_bytes(
        &self,
        tenant: &str,
        key: &str,
        bytes: u64,
        expires_unix: Option<u64>,
    ) {
        let before = lock(&self.inner.file_bytes).insert(
            key.to_string(),
            Held {
                tenant: tenant.to_string(),
                bytes,
                expires_unix,
            },
        );
        let stored_before = || {
            lock(&self.inner.stored_file_bytes)
                .get(tenant)
                .and_then(|(_, m)| m.get(key).map(|h| h.bytes))
        };
        let changed = before.map(|h| h.bytes).or_else(stored_before) != Some(bytes);
        if let (Some(d), None, true) = (&self.inner.cfg.durable, expires_unix, changed) {
            if let Err(e) = d.put_file_bytes(tenant, key, bytes) {
                tracing::warn!(target: "rvisor::files", session = key,
                    "the bytes of the session's files could not be recorded in the store: {e}");
            }
        }
    }

    /// The keys (with their tenants) of the artifact sets
    /// (`artifacts:{execution_id}`) whose
    /// bytes this node counts and that expired by `now`.
    pub(super) fn expired_file_keys(&self, now: u64) -> Vec<(String, String)> {
        lock(&self.inner.file_bytes)
            .iter()
            .filter(|(_, h)| h.expires_unix.is_some_and(|e| e <= now))
            .map(|(k, h)| (k.clone(), h.tenant.clone()))
            .collect()
    }

    /// Forgets the files of session (or artifact set) `key`: closed, or
    /// deleted; the store's count forgets them too.
    pub(super) fn forget_file_bytes(&self, key: &str) {
        lock(&self.inner.file_bytes).remove(key);
        for (_, held) in lock(&self.inner.stored_file_bytes).values_mut() {
            held.remove(key);
        }
    }

    /// Session `id` left this node (released to the store, handed off):
    /// its bytes as last seen here stay in the store's count until it is
    /// next read (they are in its `files.json`).
    pub(super) fn release_file_bytes(&self, id: &str) {
        let Some(h) = lock(&self.inner.file_bytes).remove(id) else {
            return;
        };
        if let Some((_, held)) = lock(&self.inner.stored_file_bytes).get_mut(&h.tenant) {
            held.insert(id.to_string(), h);
        }
    }

    /// The files of session `id` of `tenant`, sorted by name.
    pub fn session_files(&self, tenant: &str, id: &str) -> Result<Vec<FileInfo>, ServiceError> {
        let s = self.session(tenant, id)?;
        let snap = s
            .snapshot(self.file_limits().max_files)
            .map_err(file_error)?;
        let mut v: Vec<FileInfo> = snap.into_values().map(|(_, i)| i).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        self.note_file_bytes(tenant, id, v.iter().map(|f| f.size).sum(), None);
        Ok(v)
    }

    /// Starts an upload of `name` to session `id` of `tenant`.
    pub fn begin_upload(
        &self,
        tenant: &str,
        id: &str,
        name: &str,
    ) -> Result<SessionUpload, ServiceError> {
        let s = self.session(tenant, id)?;
        let limits = *self.file_limits();
        // Its own statement: the guard must be gone before the store's
        // count is read, which takes the same lock (as one expression the
        // guard lived through `or_else`, and an upload to a session this
        // node had not counted, once the count was stale, hung forever).
        let seen = lock(&self.inner.file_bytes).get(id).map(|h| h.bytes);
        let this = seen
            .or_else(|| self.stored_file_bytes(tenant).get(id).map(|h| h.bytes))
            .unwrap_or(0);
        let upload = s.begin_upload(name, &limits).map_err(file_error)?;
        // The tenant's other sessions and artifacts, and this session's
        // other files as they are now (the file replaced left out).
        let tenant_others = self
            .tenant_file_bytes(tenant)
            .saturating_sub(this)
            .saturating_add(upload.others_bytes());
        file_rules::check_tenant(&limits, tenant_others).map_err(|r| file_error(r.into()))?;
        Ok(SessionUpload {
            upload,
            tenant: tenant.to_string(),
            id: id.to_string(),
            tenant_others,
            written: 0,
            limits,
        })
    }

    /// Puts an upload in place (atomically) once all of it is written.
    pub fn commit_upload(&self, up: SessionUpload) -> Result<FileInfo, ServiceError> {
        let SessionUpload {
            upload, tenant, id, ..
        } = up;
        let info = upload.commit().map_err(file_error)?;
        if let Ok(s) = self.session(&tenant, &id) {
            s.files_changed();
        }
        // The tenant's count, from what is there now.
        let _ = self.session_files(&tenant, &id);
        Ok(info)
    }

    /// Writes `name` in session `id` from `content` (the surfaces that
    /// carry small files inline).
    pub fn put_session_file(
        &self,
        tenant: &str,
        id: &str,
        name: &str,
        content: &mut dyn Read,
    ) -> Result<FileInfo, ServiceError> {
        let mut up = self.begin_upload(tenant, id, name)?;
        let mut file = up
            .file()
            .and_then(|f| f.try_clone().ok())
            .ok_or_else(|| ServiceError::new(ErrorCode::Internal, "the upload has no file"))?;
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = content.read(&mut buf).map_err(|e| {
                ServiceError::bad_request(format!("the file's content could not be read: {e}"))
            })?;
            if n == 0 {
                break;
            }
            up.add(n as u64)?;
            std::io::Write::write_all(&mut file, &buf[..n]).map_err(|e| {
                file_error(FileError::Io {
                    what: "write the file",
                    source: e,
                })
            })?;
        }
        self.commit_upload(up)
    }

    /// Opens `name` of session `id` for reading.
    pub fn get_session_file(
        &self,
        tenant: &str,
        id: &str,
        name: &str,
    ) -> Result<(FileInfo, File), ServiceError> {
        let s = self.session(tenant, id)?;
        let (info, f) = s.get_file(name).map_err(file_error)?;
        file_rules::check_file_size(self.file_limits(), info.size)
            .map_err(|r| file_error(r.into()))?;
        Ok((info, f))
    }

    /// Deletes `name` of session `id`.
    pub fn delete_session_file(
        &self,
        tenant: &str,
        id: &str,
        name: &str,
    ) -> Result<(), ServiceError> {
        let s = self.session(tenant, id)?;
        s.delete_file(name).map_err(file_error)?;
        let _ = self.session_files(tenant, id);
        Ok(())
    }
}

impl Service {
    /// `name` of session `id` with its bytes inline (base64), for the
    /// JSON surfaces: `{name, size, media_type, modified, content_base64}`.
    pub fn get_file_inline(
        &self,
        tenant: &str,
        id: &str,
        name: &str,
    ) -> Result<serde_json::Value, ServiceError> {
        use base64::Engine as _;
        let (info, f) = self.get_session_file(tenant, id, name)?;
        if info.size > INLINE_FILE_BYTES {
            return Err(ServiceError::new(
                ErrorCode::TooLarge,
                format!(
                    "{:?} is {} bytes, over the inline limit of {INLINE_FILE_BYTES} bytes; \
                     download it over HTTP (GET /v1/sessions/{{id}}/files/{})",
                    info.name, info.size, info.name
                ),
            ));
        }
        let mut bytes = Vec::with_capacity(info.size as usize);
        f.take(info.size).read_to_end(&mut bytes).map_err(|e| {
            file_error(FileError::Io {
                what: "read the file",
                source: e,
            })
        })?;
        let mut v = serde_json::to_value(&info).unwrap_or_default();
        v["content_base64"] = base64::engine::general_purpose::STANDARD
            .encode(&bytes)
            .into();
        Ok(v)
    }

    /// Writes `name` of session `id` from base64 `content`, for the JSON
    /// surfaces (at most [`INLINE_FILE_BYTES`]).
    pub fn put_file_inline(
        &self,
        tenant: &str,
        id: &str,
        name: &str,
        content_base64: &str,
    ) -> Result<FileInfo, ServiceError> {
        use base64::Engine as _;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(content_base64)
            .map_err(|e| {
                ServiceError::invalid(format!(
                    "content_base64 is not base64 ({e}); send the bytes base64-encoded"
                ))
            })?;
        if bytes.len() as u64 > INLINE_FILE_BYTES {
            return Err(ServiceError::new(
                ErrorCode::TooLarge,
                format!(
                    "the file is {} bytes, over the inline limit of {INLINE_FILE_BYTES} bytes; \
                     upload it over HTTP (PUT /v1/sessions/{{id}}/files/{{path}})",
                    bytes.len()
                ),
            ));
        }
        self.put_session_file(tenant, id, name, &mut bytes.as_slice())
    }
}

impl Service {
    /// A listing of session `id`'s files to compare with a later one
    /// (`rvisor::files::changed_files`), taken only when no worker has to
    /// start for it: empty for a session that never ran, `None` when its
    /// files cannot be reached without a worker (a confined session
    /// without a live one, a hibernated session: a worker started here
    /// would take the `restored` or `reset_reason` of the next result).
    /// An unconfined session's directory is listed with or without one.
    pub fn session_snapshot(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<Option<rvisor::files::Snapshot>, ServiceError> {
        let s = self.session(tenant, id)?;
        let st = s.status();
        if st.state == rvisor::SessionState::New {
            return Ok(Some(rvisor::files::Snapshot::new()));
        }
        s.snapshot_if_live(self.file_limits().max_files, None)
            .map_err(file_error)
    }

    /// The bytes of artifact `name` of run `execution_id`, inline (at
    /// most [`INLINE_FILE_BYTES`]), with its record.
    pub fn artifact_inline(
        &self,
        tenant: &str,
        execution_id: &str,
        name: &str,
    ) -> Result<(rvisor::Artifact, Vec<u8>), ServiceError> {
        let (a, f) = self.artifact(tenant, execution_id, name)?;
        if a.size > INLINE_FILE_BYTES {
            return Err(ServiceError::new(
                ErrorCode::TooLarge,
                format!(
                    "artifact {:?} is {} bytes, over the inline limit of {INLINE_FILE_BYTES} bytes; \
                     fetch it over HTTP ({})",
                    a.name, a.size, a.uri
                ),
            ));
        }
        let mut bytes = Vec::with_capacity(a.size as usize);
        f.take(a.size).read_to_end(&mut bytes).map_err(|e| {
            file_error(FileError::Io {
                what: "read the artifact",
                source: e,
            })
        })?;
        Ok((a, bytes))
    }
}

impl Service {
    /// What a session call changed: the files of session `id` new or
    /// changed since `before` (taken when the call was queued), added to
    /// `r.artifacts` with their sha256 and the session file's path as
    /// `uri` (docs/files.md), and returned for the session's history.
    /// The listing is taken only here and only while the files can be
    /// reached without starting a worker, so a call that failed or timed
    /// out reports what it wrote as long as its directory is still there
    /// (unconfined: always; confined: while its worker lives). Bounded:
    /// at most `max_files` files, and their bytes hashed up to
    /// `max_call_bytes`; past that the rest are left out and a warning
    /// says so.
    pub(super) fn call_changes(
        &self,
        id: &str,
        before: &rvisor::files::Snapshot,
        r: &mut rvisor::RunResult,
    ) -> Option<Vec<FileInfo>> {
        let (s, tenant) = {
            let sessions = lock(&self.inner.sessions);
            let e = sessions.get(id)?;
            (e.session.clone(), e.tenant.clone())
        };
        let limits = self.file_limits();
        // A confined session's files only while the worker that ran the
        // call lives (a timeout's kill takes them with it).
        let ran_on = Some(r.session.generation).filter(|g| *g > 0);
        let after = match s.snapshot_if_live(limits.max_files, ran_on) {
            Ok(a) => a?,
            Err(e) => {
                r.warnings.push(format!(
                    "rvisor: the files the call changed are not listed: {e}; list the \
                     session's files (GET /v1/sessions/{id}/files)"
                ));
                return None;
            }
        };
        // The tenant's bytes as a call reports them.
        self.note_file_bytes(&tenant, id, after.values().map(|(_, f)| f.size).sum(), None);
        let changed = rvisor::files::changed_files(before, &after);
        let mut hashed = 0u64;
        let mut left_out = 0usize;
        for f in &changed {
            if hashed.saturating_add(f.size) > limits.max_call_bytes {
                left_out += 1;
                continue;
            }
            // A file gone or replaced since the listing is not reported.
            let Ok((info, file)) = s.get_file(&f.name) else {
                continue;
            };
            let Some(sha256) = sha256_hex(file, info.size) else {
                continue;
            };
            hashed += info.size;
            r.artifacts.push(rvisor::Artifact {
                uri: format!("/v1/sessions/{id}/files/{}", info.name),
                name: info.name,
                size: info.size,
                media_type: info.media_type,
                sha256,
            });
        }
        if left_out > 0 {
            r.warnings.push(format!(
                "rvisor: {left_out} more files the call changed are not in its artifacts (their \
                 bytes together pass max_call_bytes of {}); list the session's files \
                 (GET /v1/sessions/{id}/files)",
                limits.max_call_bytes
            ));
        }
        Some(changed)
    }
}

/// SHA-256 of the first `size` bytes of `f`, lowercase hex; `None` when
/// it cannot be read.
pub(crate) fn sha256_hex(f: File, size: u64) -> Option<String> {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let mut r = f.take(size);
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = r.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Some(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
