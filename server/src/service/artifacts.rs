//! Run artifacts: a one-shot run's input files placed before its code
//! runs, and the files it wrote stored in the shared blob store for the
//! tenant (with the tables' TTL), so any node serves them
//! (`/v1/artifacts/{execution_id}/{name}`). Which files are artifacts:
//! every regular file new or changed in the run's working directory once
//! the code ended, R's `tempdir()` left out (docs/files.md). A run's
//! artifacts count against the tenant's quota of files until they expire;
//! they are stored only within it. Expired sets are deleted by a sweep
//! (`start_artifact_sweep`), read or not.

use super::files::{file_error, Held};
use super::{ErrorCode, Service, ServiceError};
use crate::blob::{tenant_key, BlobStore};
use rvisor::file_rules::{self, FileLimits};
use rvisor::files::{changed_files, RunFiles, Snapshot, WorkDir};
use rvisor::{Artifact, Outcome, RunResult};
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::time::{Duration, Instant};

/// How often the whole store is listed for expired artifact sets (those
/// this node does not count: stored before a restart, or by another node).
const LIST_EVERY: Duration = Duration::from_secs(600);

/// The longest wait between two sweeps of the artifact sets this node
/// stored (shorter with a shorter TTL).
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// A file given to a one-shot run, inline.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct InputFile {
    /// Its path in the run's working directory (`data/in.xlsx`).
    pub name: String,
    /// Its bytes, base64 (standard alphabet, padded).
    pub content_base64: String,
}

/// The stored record of one run's artifacts.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ArtifactSet {
    expires_unix: u64,
    artifacts: Vec<Artifact>,
}

fn set_key(tenant: &str, execution_id: &str) -> String {
    format!("artifacts/{}/{execution_id}.json", tenant_key(tenant))
}

/// The key of a run's artifacts among the tenant's file bytes.
fn bytes_key(execution_id: &str) -> String {
    format!("artifacts:{execution_id}")
}

fn object_key(tenant: &str, execution_id: &str, name: &str) -> String {
    format!("artifacts/{}/{execution_id}/{name}", tenant_key(tenant))
}

/// The `RunFiles` of a one-shot run through the service.
pub(super) struct OneShotFiles {
    pub inputs: Vec<(String, Vec<u8>)>,
    pub limits: FileLimits,
    pub store: BlobStore,
    pub tenant: String,
    pub ttl_secs: u64,
    pub before: Snapshot,
    /// The service, for the tenant's bytes (checked before storing, and
    /// counted once stored).
    pub svc: Service,
}

impl RunFiles for OneShotFiles {
    fn before(&mut self, dir: &WorkDir) -> Result<(), String> {
        for (name, bytes) in std::mem::take(&mut self.inputs) {
            dir.put(&name, &mut bytes.as_slice(), &self.limits)
                .map_err(|e| e.to_string())?;
        }
        self.before = dir
            .snapshot(self.limits.max_files)
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    fn after(&mut self, dir: &WorkDir, r: &mut RunResult) {
        if matches!(
            r.outcome,
            Outcome::Rejected | Outcome::StartupFailed | Outcome::StartupTimedOut
        ) {
            return;
        }
        let after = match dir.snapshot(self.limits.max_files) {
            Ok(a) => a,
            Err(e) => {
                r.warnings
                    .push(format!("rvisor: the run's files were not collected: {e}"));
                return;
            }
        };
        let changed = changed_files(&self.before, &after);
        if changed.is_empty() {
            return;
        }
        let total: u64 = changed.iter().map(|f| f.size).sum();
        if let Err(e) = changed
            .iter()
            .try_for_each(|f| file_rules::check_file_size(&self.limits, f.size))
            .and_then(|()| file_rules::check_call(&self.limits, total))
        {
            r.warnings
                .push(format!("rvisor: the run's files were not kept: {e}"));
            return;
        }
        // The tenant's quota, before anything is stored.
        let used = self.svc.tenant_file_bytes(&self.tenant);
        if let Err(e) = file_rules::check_tenant(&self.limits, used.saturating_add(total)) {
            r.warnings.push(format!(
                "rvisor: the run's artifacts were not kept: {e}; the run wrote {total} bytes and \
                 the tenant's files already hold {used} (stored artifacts count until they \
                 expire, {} s after their run)",
                self.ttl_secs
            ));
            return;
        }
        let mut out = Vec::with_capacity(changed.len());
        for f in changed {
            match self.store_one(dir, &r.execution_id, &f.name) {
                Ok(a) => out.push(a),
                Err(e) => r
                    .warnings
                    .push(format!("rvisor: artifact {:?} was not kept: {e}", f.name)),
            }
        }
        if out.is_empty() {
            return;
        }
        let expires_unix = rvisor::clock::unix_now() + self.ttl_secs;
        let set = ArtifactSet {
            expires_unix,
            artifacts: out.clone(),
        };
        let key = set_key(&self.tenant, &r.execution_id);
        match serde_json::to_vec(&set) {
            Ok(b) => {
                if let Err(e) = self.store.put(&key, b) {
                    r.warnings
                        .push(format!("rvisor: the run's artifacts were not kept: {e}"));
                    return;
                }
            }
            Err(e) => {
                r.warnings.push(format!("rvisor: {e}"));
                return;
            }
        }
        self.svc.note_file_bytes(
            &self.tenant,
            &bytes_key(&r.execution_id),
            out.iter().map(|a| a.size).sum(),
            Some(expires_unix),
        );
        r.artifacts = out;
    }
}

impl OneShotFiles {
    fn store_one(&self, dir: &WorkDir, execution_id: &str, name: &str) -> Result<Artifact, String> {
        use sha2::Digest;
        let (info, mut f) = dir.open(name).map_err(|e| e.to_string())?;
        let mut h = sha2::Sha256::new();
        let mut buf = vec![0u8; 64 << 10];
        let mut left = info.size;
        while left > 0 {
            let n = f.read(&mut buf).map_err(|e| e.to_string())?;
            if n == 0 {
                break;
            }
            let n = n.min(left as usize);
            h.update(&buf[..n]);
            left -= n as u64;
        }
        let sha256: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        self.store
            .put_from(
                &object_key(&self.tenant, execution_id, &info.name),
                &f,
                info.size,
                || true,
            )
            .map_err(|e| e.to_string())?;
        Ok(Artifact {
            uri: format!("/v1/artifacts/{execution_id}/{}", info.name),
            name: info.name,
            size: info.size,
            media_type: info.media_type,
            sha256,
        })
    }
}

/// Decodes a run's inline input files, checking their names and sizes.
pub(super) fn decode_inputs(
    files: &[InputFile],
    limits: &FileLimits,
) -> Result<Vec<(String, Vec<u8>)>, ServiceError> {
    use base64::Engine as _;
    if files.len() > limits.max_files {
        return Err(ServiceError::new(
            ErrorCode::TooLarge,
            format!(
                "the run has {} input files, over the limit max_files of {}; send fewer",
                files.len(),
                limits.max_files
            ),
        ));
    }
    let mut total = 0u64;
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let name = file_rules::check_name(&f.name).map_err(|e| file_error(e.into()))?;
        if out.iter().any(|(n, _): &(String, Vec<u8>)| *n == name) {
            return Err(ServiceError::conflict(format!(
                "the input file {name:?} is given twice; give each name once"
            )));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(&f.content_base64)
            .map_err(|e| {
                ServiceError::invalid(format!(
                    "files[{name:?}].content_base64 is not base64 ({e}); send the bytes base64-encoded"
                ))
            })?;
        file_rules::check_file_size(limits, bytes.len() as u64)
            .map_err(|e| file_error(e.into()))?;
        total += bytes.len() as u64;
        // One request's size: 413 (`file_error` would say 429 for none).
        file_rules::check_call(limits, total)
            .map_err(|e| ServiceError::new(ErrorCode::TooLarge, e.to_string()))?;
        out.push((name, bytes));
    }
    Ok(out)
}

impl Service {
    /// The artifact `name` of run `execution_id` of `tenant`: its record
    /// and the open file it was copied to (`spool`, removed once opened).
    /// Another tenant's, an expired one and an unknown one answer alike.
    pub fn artifact(
        &self,
        tenant: &str,
        execution_id: &str,
        name: &str,
    ) -> Result<(Artifact, std::fs::File), ServiceError> {
        let missing = || ServiceError::not_found("artifact");
        let name = file_rules::check_name(name).map_err(|_| missing())?;
        let store = self.inner.tables.store();
        let key = set_key(tenant, execution_id);
        let blob = store
            .get(&key)
            .map_err(|e| ServiceError::new(ErrorCode::Storage, e.to_string()))?
            .ok_or_else(missing)?;
        let set: ArtifactSet = serde_json::from_slice(&blob.bytes).map_err(|_| missing())?;
        if set.expires_unix <= rvisor::clock::unix_now() {
            // Expired unread so far (the sweep deletes the rest).
            self.delete_artifacts(tenant, execution_id, &set);
            return Err(missing());
        }
        let a = set
            .artifacts
            .into_iter()
            .find(|a| a.name == name)
            .ok_or_else(missing)?;
        let spool = self.inner.tables.spool_path();
        let got = store
            .get_to_file(&object_key(tenant, execution_id, &name), &spool)
            .map_err(|e| ServiceError::new(ErrorCode::Storage, e.to_string()));
        let opened = got.and_then(|found| {
            if !found {
                return Err(missing());
            }
            std::fs::File::open(&spool)
                .map_err(|e| ServiceError::new(ErrorCode::Storage, e.to_string()))
        });
        let _ = std::fs::remove_file(&spool);
        Ok((a, opened?))
    }

    /// Deletes artifact set `execution_id` of `tenant` (its objects, then
    /// its record: a set whose objects could not all be deleted stays for
    /// the next listing sweep) and releases its bytes.
    fn delete_artifacts(&self, tenant: &str, execution_id: &str, set: &ArtifactSet) {
        let store = self.inner.tables.store();
        let mut all = true;
        for a in &set.artifacts {
            all &= store
                .delete(&object_key(tenant, execution_id, &a.name))
                .is_ok();
        }
        if all {
            let _ = store.delete(&set_key(tenant, execution_id));
        }
        self.forget_file_bytes(&bytes_key(execution_id));
    }

    /// Deletes the artifact sets this node counts that expired (read or
    /// not), releasing their bytes. One read of each expired set's record.
    pub(super) fn sweep_expired_artifacts(&self) {
        let store = self.inner.tables.store();
        for (key, tenant) in self.expired_file_keys(rvisor::clock::unix_now()) {
            let Some(execution_id) = key.strip_prefix("artifacts:") else {
                continue;
            };
            match store.get(&set_key(&tenant, execution_id)) {
                Ok(Some(blob)) => match serde_json::from_slice::<ArtifactSet>(&blob.bytes) {
                    Ok(set) => self.delete_artifacts(&tenant, execution_id, &set),
                    Err(_) => self.forget_file_bytes(&key),
                },
                // Deleted already (read once expired, maybe on another node).
                Ok(None) => self.forget_file_bytes(&key),
                // Kept for the next round; its bytes no longer count.
                Err(e) => tracing::warn!(target: "rvisor::files", execution_id,
                    "could not read an expired artifact set to delete it: {e}"),
            }
        }
    }

    /// Deletes every expired artifact set in the shared store, this node's
    /// or not, and the objects of a run whose record was never written
    /// (its node died midway) once they are an hour old.
    pub(super) fn sweep_stored_artifacts(&self) {
        let store = self.inner.tables.store();
        let all = match store.list("artifacts") {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(target: "rvisor::files", "the artifact sweep could not list the store: {e}");
                return;
            }
        };
        let now = rvisor::clock::unix_now();
        // `artifacts/{tenant}/{execution_id}`: a set's record is that
        // `.json`, its objects are below it.
        let set_of = |key: &str| -> Option<String> {
            let mut p = key.splitn(4, '/');
            let (a, t, e, _) = (p.next()?, p.next()?, p.next()?, p.next()?);
            Some(format!("{a}/{t}/{e}"))
        };
        let records: std::collections::HashSet<&str> = all
            .iter()
            .filter_map(|o| o.key.strip_suffix(".json"))
            .filter(|stem| stem.split('/').count() == 3)
            .collect();
        // A record is read only once it may have expired (written a TTL
        // ago): a listing costs one read per expired set, not per set.
        let ttl = self.inner.tables.config().ttl.as_secs();
        let due: std::collections::HashSet<&str> = all
            .iter()
            .filter(|o| o.modified_unix.is_none_or(|t| t + ttl <= now))
            .filter_map(|o| o.key.strip_suffix(".json"))
            .collect();
        let mut expired = std::collections::HashSet::new();
        for stem in records.intersection(&due) {
            let Ok(Some(blob)) = store.get(&format!("{stem}.json")) else {
                continue;
            };
            if let Ok(set) = serde_json::from_slice::<ArtifactSet>(&blob.bytes) {
                if set.expires_unix <= now {
                    expired.insert(stem.to_string());
                }
            }
        }
        let mut kept = std::collections::HashSet::new();
        for o in &all {
            let Some(stem) = set_of(&o.key) else { continue };
            let orphan =
                !records.contains(stem.as_str()) && o.modified_unix.is_some_and(|t| t + 3600 < now);
            if (expired.contains(&stem) || orphan) && store.delete(&o.key).is_err() {
                kept.insert(stem);
            }
        }
        for stem in expired {
            if !kept.contains(&stem) {
                let _ = store.delete(&format!("{stem}.json"));
            }
            if let Some(execution_id) = stem.rsplit('/').next() {
                self.forget_file_bytes(&bytes_key(execution_id));
            }
        }
    }

    /// The store's count of `tenant`'s artifact sets not yet expired, by
    /// `artifacts:{execution_id}`: one listing of the tenant's artifacts
    /// (a set counts the bytes of its objects once its record is written;
    /// it expires a TTL after that record, and a record that may have
    /// expired is read for its exact expiry).
    pub(super) fn stored_artifact_bytes(
        &self,
        tenant: &str,
    ) -> Result<std::collections::HashMap<String, Held>, String> {
        let store = self.inner.tables.store();
        let prefix = format!("artifacts/{}", tenant_key(tenant));
        let listed = store.list(&prefix).map_err(|e| e.to_string())?;
        let ttl = self.inner.tables.config().ttl.as_secs();
        let now = rvisor::clock::unix_now();
        let mut records = std::collections::HashMap::new();
        let mut sizes = std::collections::HashMap::<&str, u64>::new();
        for o in &listed {
            let Some(rest) = o
                .key
                .strip_prefix(&prefix)
                .and_then(|r| r.strip_prefix('/'))
            else {
                continue;
            };
            match rest.split_once('/') {
                Some((eid, _)) => *sizes.entry(eid).or_default() += o.size,
                None => {
                    if let Some(eid) = rest.strip_suffix(".json") {
                        records.insert(eid, o.modified_unix);
                    }
                }
            }
        }
        let mut out = std::collections::HashMap::new();
        for (eid, modified) in records {
            let expires = match modified {
                Some(t) if t + ttl > now => t + ttl,
                _ => match store.get(&set_key(tenant, eid)) {
                    Ok(Some(b)) => match serde_json::from_slice::<ArtifactSet>(&b.bytes) {
                        Ok(set) => set.expires_unix,
                        Err(_) => continue,
                    },
                    _ => continue,
                },
            };
            if expires > now {
                let h = Held {
                    tenant: tenant.to_string(),
                    bytes: sizes.get(eid).copied().unwrap_or(0),
                    expires_unix: Some(expires),
                };
                out.insert(bytes_key(eid), h);
            }
        }
        Ok(out)
    }

    /// The artifact sweep's thread: this node's expired sets every
    /// `min(TTL, 60 s)` (at least 1 s), the whole store every 10 minutes.
    pub(super) fn start_artifact_sweep(&self) {
        let every = self
            .inner
            .tables
            .config()
            .ttl
            .clamp(Duration::from_secs(1), SWEEP_EVERY);
        let mut listed: Option<Instant> = None;
        self.every("rvisor-artifacts", every, move |svc| {
            svc.sweep_expired_artifacts();
            if listed.is_none_or(|t| t.elapsed() >= LIST_EVERY) {
                listed = Some(Instant::now());
                svc.sweep_stored_artifacts();
            }
        });
    }
}
