//! Durable sessions of the service (docs/sessions.md): where their records
//! and checkpoints are kept, and which node owns each.
//!
//! Layout in the [`BlobStore`] (a local directory or a bucket shared by
//! every node):
//!
//! ```text
//! sessions/{tenant hex}/{session id}/record.json   what the service needs to resume it
//! sessions/{tenant hex}/{session id}/checkpoint    its state (written by the worker)
//! sessions/{tenant hex}/{session id}/history.json  what happened in it (service/history.rs)
//! sessions/{tenant hex}/{session id}/files.json    bytes of its files as last seen (service/files.rs)
//! sessions/{tenant hex}/{session id}/objects/...   its files over the checkpoint's cap, by sha256, and their list
//! leases/sessions/{session id}                     the owning node and until when
//! ```
//!
//! A record is written when a session is made and deleted when it is
//! closed; checkpoints are written by the sessions themselves through
//! [`SessionStore::checkpoints`]. With a node id, a node holds a lease on
//! every session it runs, renews them together, and a checkpoint is only
//! written while this node's lease is valid: a node that lost a session to
//! another (its lease expired while it was cut off) cannot overwrite the
//! new owner's checkpoint (docs/scale-out.md, "Ownership").
//!
//! A node asked for a session another live node holds (a router sent it
//! there: the owner's node came back, or the router's choice changed)
//! asks for it through the store (`handoff/{session id}`); the owner's
//! maintenance pass releases it (checkpoint, lease given up) and the
//! asking node takes it. Nodes never talk to each other directly.

use crate::blob::{tenant_key, BlobError, BlobStore, Lease, LeaseError, StoreUrl};
use rvisor::checkpoint::{mib, Allowance, CheckpointStore, StoreLimits, StoreUsage};
use rvisor::CheckpointError;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Default lease on a session: how long a node that stopped renewing
/// (killed, cut off) keeps it before another node may take it over.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// The shortest lease: a node counts its lease a second short (the record
/// keeps whole seconds) and writes a checkpoint only while a second more
/// is left, so a shorter lease would leave no time to write in.
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(3);

/// What the service keeps about a session so that it can be resumed after
/// a restart or on another node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// The session's id.
    pub id: String,
    /// Its tenant.
    pub tenant: String,
    /// Its name, for surfaces that address sessions by name.
    #[serde(default)]
    pub name: Option<String>,
    /// When it was made (Unix seconds).
    pub created_unix: u64,
    /// The options it was made with, as the service's `NewSession` in
    /// JSON (`None`: the server's defaults, as for named sessions).
    #[serde(default)]
    pub options: Option<serde_json::Value>,
}

/// Why a session could not be taken over.
#[derive(Debug)]
pub enum TakeError {
    /// Another node holds it until `expires_unix`.
    Held {
        /// The node.
        holder: String,
        /// Until when (Unix seconds).
        expires_unix: u64,
    },
    /// The store failed.
    Store(String),
}

/// The durable state of one service: records, checkpoints and leases.
#[derive(Debug)]
pub struct SessionStore {
    blob: BlobStore,
    /// This node's id; `None`: one node, no leases.
    node: Option<String>,
    lease_ttl: Duration,
    /// Session id -> our lease on it.
    leases: Mutex<HashMap<String, Held>>,
    /// Session id -> held while its lease is written (renewed, released),
    /// so that two writers of this node never race each other's e-tag
    /// (the loser would read that as the lease being lost).
    writing: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Gives a session's history (by id) to write beside each checkpoint
    /// of it (set by the service: [`SessionStore::set_history_source`]).
    history: HistorySlot,
}

/// A session's history to keep with its checkpoint: session id -> the
/// history's stored bytes (`None`: none to write).
pub type HistorySource = Arc<dyn Fn(&str) -> Option<Vec<u8>> + Send + Sync>;

/// Where the [`HistorySource`] is kept (set after the store is made).
#[derive(Default)]
struct HistorySlot(Mutex<Option<HistorySource>>);

impl std::fmt::Debug for HistorySlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = lock(&self.0).is_some();
        f.debug_tuple("HistorySlot").field(&set).finish()
    }
}

/// A lease this node holds, and until when it is surely ours by this
/// process's monotonic clock: from the moment its last write was *sent*,
/// the lease's time less a second (the record keeps whole seconds), so a
/// write that was slow to land never makes it look longer than it is.
#[derive(Debug, Clone)]
struct Held {
    lease: Lease,
    valid_until: Instant,
}

impl Held {
    fn new(lease: Lease, sent: Instant, ttl: Duration) -> Self {
        Self {
            lease,
            valid_until: sent + ttl.saturating_sub(Duration::from_secs(1)),
        }
    }
}

/// Why this node could not confirm that it still owns a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OwnershipError {
    /// Another node took the session over (or this node never held it):
    /// this node's copy must be dropped without writing.
    Lost,
    /// The store did not answer, so ownership could not be confirmed.
    Unconfirmed(String),
}

/// How many leases are renewed at once (each is one conditional write).
const RENEW_PARALLEL: usize = 8;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn record_key(tenant: &str, id: &str) -> String {
    format!("sessions/{}/{id}/record.json", tenant_key(tenant))
}

fn history_key(tenant: &str, id: &str) -> String {
    format!("sessions/{}/{id}/history.json", tenant_key(tenant))
}

fn files_key(tenant: &str, id: &str) -> String {
    format!("sessions/{}/{id}/files.json", tenant_key(tenant))
}

/// What `files.json` holds: the bytes of a session's files as the service
/// last saw them.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct FileBytes {
    bytes: u64,
}

fn lease_key(id: &str) -> String {
    format!("leases/sessions/{id}")
}

fn handoff_key(id: &str) -> String {
    format!("handoff/{id}")
}

/// The checkpoint key prefix of `tenant`'s sessions (the session adds its
/// id): see [`rvisor::SessionOptions::checkpoint_prefix`].
pub fn checkpoint_prefix(tenant: &str) -> String {
    format!("{}/", tenant_key(tenant))
}

impl SessionStore {
    /// The durable state in the store at `url`, for node `node` (`None`:
    /// a single server, no leases) with leases of `lease_ttl` (at least
    /// [`MIN_LEASE_TTL`]; [`DEFAULT_LEASE_TTL`]).
    pub fn open(
        url: &StoreUrl,
        node: Option<String>,
        lease_ttl: Duration,
    ) -> Result<Arc<Self>, BlobError> {
        Ok(Self::with(BlobStore::open(url)?, node, lease_ttl))
    }

    /// Over an open store, with leases of `lease_ttl`.
    pub fn with(blob: BlobStore, node: Option<String>, lease_ttl: Duration) -> Arc<Self> {
        Arc::new(Self {
            blob,
            node,
            lease_ttl: lease_ttl.max(MIN_LEASE_TTL),
            leases: Mutex::new(HashMap::new()),
            writing: Mutex::new(HashMap::new()),
            history: HistorySlot::default(),
        })
    }

    /// Where it is.
    pub fn url(&self) -> &StoreUrl {
        self.blob.url()
    }

    /// The lease length.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// How often this node renews its leases: a third of the lease, and
    /// often enough that a checkpoint may always be written between two
    /// renewals (the node counts a lease a second short, and writes only
    /// while a second more is left: with a 3 s lease, every half second).
    pub fn renew_every(&self) -> Duration {
        let slack = self.lease_ttl.saturating_sub(Duration::from_secs(2)) / 2;
        (self.lease_ttl / 3)
            .min(slack)
            .max(Duration::from_millis(200))
    }

    /// Whether this node takes leases (it has a node id).
    pub fn uses_leases(&self) -> bool {
        self.node.is_some()
    }

    /// The checkpoint store to give the supervisor
    /// ([`rvisor::SupervisorConfig::checkpoints`]): keys are
    /// `{tenant hex}/{session id}`, written only under this node's lease,
    /// within `limits`.
    pub fn checkpoints(self: &Arc<Self>, limits: CheckpointLimits) -> Arc<dyn CheckpointStore> {
        Arc::new(Checkpoints {
            store: self.clone(),
            limits,
            usage: Mutex::new(HashMap::new()),
        })
    }

    /// Writes `rec`.
    pub fn put_record(&self, rec: &SessionRecord) -> Result<(), BlobError> {
        let bytes = serde_json::to_vec(rec).unwrap_or_default();
        self.blob
            .put(&record_key(&rec.tenant, &rec.id), bytes)
            .map(|_| ())
    }

    /// The record of `tenant`'s session `id`, if there is one.
    pub fn get_record(&self, tenant: &str, id: &str) -> Result<Option<SessionRecord>, BlobError> {
        if !rvisor::ids::is_session_id(id) {
            return Ok(None);
        }
        let Some(b) = self.blob.get(&record_key(tenant, id))? else {
            return Ok(None);
        };
        Ok(serde_json::from_slice::<SessionRecord>(&b.bytes)
            .ok()
            .filter(|r| r.id == id && r.tenant == tenant))
    }

    /// Every record in the store (unreadable ones are skipped with a
    /// warning).
    pub fn records(&self) -> Result<Vec<SessionRecord>, BlobError> {
        let mut out = Vec::new();
        for m in self.blob.list("sessions")? {
            if !m.key.ends_with("/record.json") {
                continue;
            }
            let Some(b) = self.blob.get(&m.key)? else {
                continue;
            };
            match serde_json::from_slice::<SessionRecord>(&b.bytes) {
                Ok(r) => out.push(r),
                Err(e) => tracing::warn!(
                    target: "rvisor::sessions",
                    key = %m.key,
                    "an unreadable session record is skipped: {e}"
                ),
            }
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// Where the histories written beside checkpoints come from (the
    /// service, service/history.rs): each checkpoint of a session that is
    /// stored is followed by its history, so the two go together through
    /// hibernation, a restart and a move to another node.
    pub fn set_history_source(&self, source: HistorySource) {
        *lock(&self.history.0) = Some(source);
    }

    /// Writes session `id`'s history (of the tenant whose key component
    /// is `tenant_hex`) from the history source, if it has one; only
    /// while this node may write the session (its lease), so a node that
    /// lost the session cannot overwrite the new owner's history. A
    /// failure is logged: the checkpoint stands without it.
    pub fn write_history(&self, tenant_hex: &str, id: &str) {
        let source = lock(&self.history.0).clone();
        let Some(bytes) = source.and_then(|f| f(id)) else {
            return;
        };
        if !self.may_write(id) {
            return;
        }
        let key = format!("sessions/{tenant_hex}/{id}/history.json");
        if let Err(e) = self.blob.put(&key, bytes) {
            tracing::warn!(target: "rvisor::sessions", session = id,
                "the session's history could not be stored beside its checkpoint: {e}");
        }
    }

    /// The stored history of `tenant`'s session `id`, if any.
    pub fn get_history(&self, tenant: &str, id: &str) -> Result<Option<Vec<u8>>, BlobError> {
        if !rvisor::ids::is_session_id(id) {
            return Ok(None);
        }
        Ok(self.blob.get(&history_key(tenant, id))?.map(|b| b.bytes))
    }

    /// Records that `tenant`'s session `id` holds `bytes` of files (as the
    /// service last saw them), so that the tenant's quota of files counts
    /// them after a restart and on every node of the store; only while
    /// this node may write the session (its lease).
    pub fn put_file_bytes(&self, tenant: &str, id: &str, bytes: u64) -> Result<(), BlobError> {
        if !rvisor::ids::is_session_id(id) || !self.may_write(id) {
            return Ok(());
        }
        let body = serde_json::to_vec(&FileBytes { bytes }).unwrap_or_default();
        self.blob.put(&files_key(tenant, id), body).map(|_| ())
    }

    /// The bytes of the files of `tenant`'s sessions as last recorded
    /// ([`SessionStore::put_file_bytes`]), by session id: one listing of
    /// the tenant's sessions, and one read per session `known` does not
    /// already answer for.
    pub fn file_bytes(
        &self,
        tenant: &str,
        known: impl Fn(&str) -> bool,
    ) -> Result<HashMap<String, u64>, BlobError> {
        let mut out = HashMap::new();
        for m in self
            .blob
            .list(&format!("sessions/{}", tenant_key(tenant)))?
        {
            let parts: Vec<&str> = m.key.split('/').collect();
            if parts.len() != 4 || parts[3] != "files.json" || known(parts[2]) {
                continue;
            }
            let Some(b) = self.blob.get(&m.key)? else {
                continue;
            };
            if let Ok(f) = serde_json::from_slice::<FileBytes>(&b.bytes) {
                out.insert(parts[2].to_string(), f.bytes);
            }
        }
        Ok(out)
    }

    /// Deletes everything kept of a closed session: record, checkpoint and
    /// lease.
    pub fn delete_session(&self, tenant: &str, id: &str) {
        self.delete_keys(&tenant_key(tenant), id);
    }

    /// Deletes session `id`'s objects (of the tenant whose key component
    /// is `tenant_hex`), and forgets our lease on it.
    fn delete_keys(&self, tenant_hex: &str, id: &str) {
        lock(&self.leases).remove(id);
        for k in [
            format!("sessions/{tenant_hex}/{id}/checkpoint"),
            format!("sessions/{tenant_hex}/{id}/unsaved.json"),
            format!("sessions/{tenant_hex}/{id}/record.json"),
            format!("sessions/{tenant_hex}/{id}/history.json"),
            format!("sessions/{tenant_hex}/{id}/files.json"),
            lease_key(id),
        ] {
            if let Err(e) = self.blob.delete(&k) {
                tracing::warn!(target: "rvisor::sessions", key = %k, "could not delete: {e}");
            }
        }
        // The files kept beside its checkpoints.
        let objects = format!("sessions/{tenant_hex}/{id}/objects");
        match self.blob.list(&objects) {
            Ok(all) => {
                for m in all {
                    if let Err(e) = self.blob.delete(&m.key) {
                        tracing::warn!(target: "rvisor::sessions", key = %m.key, "could not delete: {e}");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(target: "rvisor::sessions", key = %objects, "could not list: {e}")
            }
        }
    }

    /// Takes the lease on session `id` for this node (nothing to take
    /// without a node id). A lease another node holds is waited for up to
    /// `wait` (it expires when that node stopped renewing it).
    pub fn take(&self, id: &str, wait: Duration) -> Result<(), TakeError> {
        let Some(node) = &self.node else {
            return Ok(());
        };
        let deadline = Instant::now() + wait;
        loop {
            let sent = Instant::now();
            match self
                .blob
                .acquire_lease(&lease_key(id), node, self.lease_ttl)
            {
                Ok(l) => {
                    lock(&self.leases).insert(id.to_string(), Held::new(l, sent, self.lease_ttl));
                    return Ok(());
                }
                Err(LeaseError::Held {
                    holder,
                    expires_unix,
                }) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(TakeError::Held {
                            holder,
                            expires_unix,
                        });
                    }
                    // It ends when its holder releases it (a hand-off
                    // asked for) or stops renewing it: look again shortly.
                    std::thread::sleep((deadline - now).min(Duration::from_millis(200)));
                }
                // Another node took it in the same instant: its lease is
                // fresh now, so the next round waits for it or gives up.
                Err(LeaseError::Lost(_)) => {}
                Err(LeaseError::Store(e)) => return Err(TakeError::Store(e.to_string())),
            }
        }
    }

    /// Asks the node holding session `id` to hand it over (see the module
    /// docs).
    pub fn request_handoff(&self, id: &str) -> Result<(), BlobError> {
        let by = self.node.clone().unwrap_or_default();
        self.blob.put(&handoff_key(id), by.into_bytes()).map(|_| ())
    }

    /// Sessions this node holds that another node asked for.
    pub fn handoff_requests(&self) -> Result<Vec<String>, BlobError> {
        if self.node.is_none() {
            return Ok(Vec::new());
        }
        let held = lock(&self.leases);
        Ok(self
            .blob
            .list("handoff")?
            .into_iter()
            .filter_map(|m| m.key.strip_prefix("handoff/").map(str::to_string))
            .filter(|id| held.contains_key(id))
            .collect())
    }

    /// A hand-off request answered (the session released).
    pub fn handoff_done(&self, id: &str) {
        let _ = self.blob.delete(&handoff_key(id));
    }

    /// Gives up this node's lease on `id` (the session was handed off):
    /// another node may take it at once.
    pub fn release(&self, id: &str) {
        let w = self.writer(id);
        let _writing = lock(&w);
        let held = lock(&self.leases).remove(id);
        lock(&self.writing).remove(id);
        if let Some(held) = held {
            if let Err(e) = self.blob.release_lease(held.lease) {
                tracing::warn!(target: "rvisor::sessions", session = id, "releasing the lease: {e}");
            }
        }
    }

    /// Renews every lease this node holds, a few at a time; the answer is
    /// the sessions whose lease another node took (this node must drop
    /// them without writing). Runs on a thread that does nothing else, so
    /// that no call, checkpoint or hand-off can hold a renewal up.
    pub fn renew(&self) -> Vec<String> {
        let ids: Vec<String> = lock(&self.leases).keys().cloned().collect();
        let next = Mutex::new(ids.into_iter());
        let lost = Mutex::new(Vec::new());
        std::thread::scope(|sc| {
            for _ in 0..RENEW_PARALLEL {
                sc.spawn(|| loop {
                    let Some(id) = lock(&next).next() else { return };
                    if let Err(OwnershipError::Lost) = self.renew_one(&id) {
                        lock(&lost).push(id);
                    }
                });
            }
        });
        lost.into_inner().unwrap_or_else(|e| e.into_inner())
    }

    /// Renews this node's lease on session `id` now (one conditional
    /// write). `Lost`: another node has it (our entry is dropped).
    fn renew_one(&self, id: &str) -> Result<(), OwnershipError> {
        let w = self.writer(id);
        let _writing = lock(&w);
        // Read under the writer's lock: the e-tag of the last write.
        let Some(mut held) = lock(&self.leases).get(id).cloned() else {
            return Err(OwnershipError::Lost);
        };
        let sent = Instant::now();
        match self.blob.renew_lease(&mut held.lease, self.lease_ttl) {
            Ok(()) => {
                if let Some(l) = lock(&self.leases).get_mut(id) {
                    *l = Held::new(held.lease, sent, self.lease_ttl);
                }
                Ok(())
            }
            Err(LeaseError::Lost(_) | LeaseError::Held { .. }) => {
                lock(&self.leases).remove(id);
                lock(&self.writing).remove(id);
                Err(OwnershipError::Lost)
            }
            // The store did not answer: the lease runs on until it
            // expires; writes and calls check the expiry.
            Err(LeaseError::Store(e)) => {
                tracing::warn!(target: "rvisor::sessions", session = %id, "renewing the lease: {e}");
                Err(OwnershipError::Unconfirmed(e.to_string()))
            }
        }
    }

    /// The lock held while session `id`'s lease is written.
    fn writer(&self, id: &str) -> Arc<Mutex<()>> {
        lock(&self.writing)
            .entry(id.to_string())
            .or_default()
            .clone()
    }

    /// Makes this node's own view of its lease on `id` lapsed, as after
    /// a pause longer than the lease (tests).
    #[cfg(test)]
    fn lapse(&self, id: &str) {
        if let Some(h) = lock(&self.leases).get_mut(id) {
            h.valid_until = Instant::now() - Duration::from_secs(1);
        }
    }

    /// Whether this node surely holds session `id` for `margin` more, by
    /// its own clock (no store access). Always true without leases.
    pub fn holds(&self, id: &str, margin: Duration) -> bool {
        if self.node.is_none() {
            return true;
        }
        lock(&self.leases)
            .get(id)
            .is_some_and(|h| h.valid_until > Instant::now() + margin)
    }

    /// Confirms that this node still owns session `id`: at once when its
    /// lease surely runs for `margin` more, else by renewing it now. A
    /// renewal is a compare-and-swap on the lease's e-tag, so one that
    /// succeeds after a gap (this process was paused, or cut off from the
    /// store, past the lease) also proves that no other node took the
    /// lease meanwhile: ownership was never interrupted.
    pub fn confirm(&self, id: &str, margin: Duration) -> Result<(), OwnershipError> {
        if self.holds(id, margin) {
            return Ok(());
        }
        self.renew_one(id)
    }

    /// Whether this node may write session `id`'s checkpoint now: always
    /// without leases; with them, while our lease has a second to run.
    fn may_write(&self, id: &str) -> bool {
        if self.node.is_none() {
            return true;
        }
        lock(&self.leases).get(id).is_some_and(|h| {
            h.lease.record().expires_unix > rvisor::clock::unix_now() + 1
                && h.valid_until > Instant::now() + Duration::from_secs(1)
        })
    }

    /// Sessions whose newest object is older than `ttl` and not leased by
    /// a live node: (tenant hex, id) of each, for the TTL sweep.
    pub fn expired(&self, ttl: Duration) -> Result<Vec<(String, String)>, BlobError> {
        let now = rvisor::clock::unix_now();
        let mut newest: HashMap<(String, String), u64> = HashMap::new();
        for m in self.blob.list("sessions")? {
            let parts: Vec<&str> = m.key.split('/').collect();
            if parts.len() != 4 {
                continue;
            }
            let e = newest
                .entry((parts[1].to_string(), parts[2].to_string()))
                .or_default();
            *e = (*e).max(m.modified_unix.unwrap_or(now));
        }
        let mut out = Vec::new();
        for ((tenant, id), at) in newest {
            if now.saturating_sub(at) < ttl.as_secs() {
                continue;
            }
            if let Some(b) = self.blob.get(&lease_key(&id))? {
                let live = serde_json::from_slice::<crate::blob::LeaseRecord>(&b.bytes)
                    .is_ok_and(|l| l.expires_unix > now);
                if live {
                    continue;
                }
            }
            out.push((tenant, id));
        }
        Ok(out)
    }

    /// Deletes a session found by [`SessionStore::expired`].
    pub fn delete_expired(&self, tenant_hex: &str, id: &str) {
        self.delete_keys(tenant_hex, id);
    }
}

/// Limits of the checkpoints a node keeps in the store (docs/limits.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointLimits {
    /// Most bytes one checkpoint may take (compressed).
    pub max_bytes: u64,
    /// Most bytes one tenant's checkpoints may take together, in the store
    /// (`u64::MAX`: no quota).
    pub tenant_quota_bytes: u64,
    /// A local directory where checkpoints are staged on their way to and
    /// from the store, in files without a name.
    pub spool_dir: std::path::PathBuf,
}

/// Default of [`CheckpointLimits::tenant_quota_bytes`]: 4 GiB.
pub const DEFAULT_CHECKPOINT_QUOTA_BYTES: u64 = 4 << 30;

/// How old a listing of a tenant's checkpoints may be before the quota is
/// counted again from the store (this node's own writes count at once).
pub const QUOTA_LISTING_TTL: Duration = Duration::from_secs(10);

impl Default for CheckpointLimits {
    fn default() -> Self {
        Self {
            max_bytes: rvisor::checkpoint::DEFAULT_MAX_CHECKPOINT_BYTES,
            tenant_quota_bytes: DEFAULT_CHECKPOINT_QUOTA_BYTES,
            spool_dir: std::env::temp_dir(),
        }
    }
}

/// [`SessionStore::checkpoints`].
#[derive(Debug)]
struct Checkpoints {
    store: Arc<SessionStore>,
    limits: CheckpointLimits,
    /// Tenant hex -> the sizes of its checkpoints.
    usage: Mutex<HashMap<String, Listed>>,
}

/// The sizes of one tenant's checkpoints by session id, and when they were
/// listed.
type Listed = (Instant, HashMap<String, u64>);

/// A key's parts: the blob key of its checkpoint, its tenant hex and its
/// session id.
struct Key<'a> {
    blob: String,
    tenant: &'a str,
    id: &'a str,
}

impl<'a> Key<'a> {
    fn note(&self) -> String {
        format!("sessions/{}/{}/unsaved.json", self.tenant, self.id)
    }

    /// The folder of the objects beside the checkpoint (files over its
    /// cap, by sha256, and their list).
    fn objects(&self) -> String {
        format!("sessions/{}/{}/objects", self.tenant, self.id)
    }

    fn object(&self, name: &str) -> std::io::Result<String> {
        let ok = !name.is_empty()
            && name.len() <= 200
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !ok {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("object name {name:?}: use letters, digits, '-', '_' and '.'"),
            ));
        }
        Ok(format!("{}/{name}", self.objects()))
    }
}

impl Checkpoints {
    /// `{tenant hex}/{id}` -> its parts.
    fn split(key: &str) -> std::io::Result<Key<'_>> {
        match key.split_once('/') {
            Some((t, id))
                if !t.is_empty()
                    && t.bytes().all(|b| b.is_ascii_hexdigit())
                    && rvisor::ids::is_session_id(id) =>
            {
                Ok(Key {
                    blob: format!("sessions/{t}/{id}/checkpoint"),
                    tenant: t,
                    id,
                })
            }
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("checkpoint key {key:?} is not TENANT/SESSION"),
            )),
        }
    }

    fn key(key: &str) -> Result<Key<'_>, CheckpointError> {
        Self::split(key).map_err(|e| CheckpointError::Store(e.to_string()))
    }

    /// The sizes of tenant `t`'s checkpoints, from a listing at most
    /// [`QUOTA_LISTING_TTL`] old and this node's writes since.
    fn sizes(&self, t: &str) -> Result<HashMap<String, u64>, BlobError> {
        if let Some((at, sizes)) = lock(&self.usage).get(t) {
            if at.elapsed() < QUOTA_LISTING_TTL {
                return Ok(sizes.clone());
            }
        }
        let mut sizes = HashMap::new();
        for m in self.store.blob.list(&format!("sessions/{t}"))? {
            let parts: Vec<&str> = m.key.split('/').collect();
            if parts.len() == 4 && parts[3] == "checkpoint" {
                sizes.insert(parts[2].to_string(), m.size);
            }
        }
        lock(&self.usage).insert(t.to_string(), (Instant::now(), sizes.clone()));
        Ok(sizes)
    }

    /// Bytes of tenant `t`'s checkpoints other than session `id`'s (the
    /// one a new checkpoint of `id` replaces).
    fn used_by_others(&self, t: &str, id: &str) -> Result<u64, CheckpointError> {
        let sizes = self.sizes(t).map_err(|e| {
            CheckpointError::Store(format!("could not count the tenant's checkpoints ({e})"))
        })?;
        Ok(sizes
            .iter()
            .filter(|(k, _)| k.as_str() != id)
            .map(|(_, v)| v)
            .sum())
    }

    fn noted(&self, t: &str, id: &str, size: Option<u64>) {
        if let Some((_, sizes)) = lock(&self.usage).get_mut(t) {
            match size {
                Some(n) => sizes.insert(id.to_string(), n),
                None => sizes.remove(id),
            };
        }
    }

    fn over_quota(&self, used: u64) -> CheckpointError {
        let quota = self.limits.tenant_quota_bytes;
        CheckpointError::Quota(format!(
            "your sessions' checkpoints take {} MiB of your quota of {} MiB of checkpoints, and \
             this session's state does not fit in the {} MiB left: close sessions you no longer \
             need (their checkpoints are deleted) or remove large objects, then checkpoint \
             again; the operator sets the quota (rvisor serve --checkpoint-quota-mb); until \
             then a restart or a lost worker takes the session back to its last checkpoint",
            mib(used),
            mib(quota),
            quota.saturating_sub(used) >> 20
        ))
    }

    fn fenced() -> CheckpointError {
        CheckpointError::Fenced(
            "this node no longer holds the session's lease (another node took it over); its \
             checkpoint there is kept"
                .into(),
        )
    }
}

fn io_err(e: BlobError) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

impl CheckpointStore for Checkpoints {
    fn allowance(&self, key: &str) -> Result<Allowance, CheckpointError> {
        let k = Self::key(key)?;
        let cap = Allowance::cap(self.limits.max_bytes);
        if self.limits.tenant_quota_bytes == u64::MAX {
            return Ok(cap);
        }
        let used = self.used_by_others(k.tenant, k.id)?;
        let room = self.limits.tenant_quota_bytes.saturating_sub(used);
        if room >= cap.max_bytes {
            return Ok(cap);
        }
        Ok(Allowance {
            max_bytes: room,
            refusal: self.over_quota(used),
        })
    }

    fn scratch(&self) -> std::io::Result<std::fs::File> {
        std::fs::create_dir_all(&self.limits.spool_dir)?;
        rvisor::checkpoint::anonymous_file(&self.limits.spool_dir)
    }

    fn put(&self, key: &str, src: &std::fs::File, len: u64) -> Result<(), CheckpointError> {
        let k = Self::key(key)?;
        if len > self.limits.max_bytes {
            return Err(rvisor::checkpoint::over_cap(self.limits.max_bytes));
        }
        if !self.store.may_write(k.id) {
            return Err(Self::fenced());
        }
        if self.limits.tenant_quota_bytes != u64::MAX {
            let used = self.used_by_others(k.tenant, k.id)?;
            if used.saturating_add(len) > self.limits.tenant_quota_bytes {
                return Err(self.over_quota(used));
            }
        }
        // Fenced twice: before the upload, and right before it is made
        // visible (an upload in parts can outlast the lease).
        let (store, id) = (self.store.clone(), k.id.to_string());
        let committed = self
            .store
            .blob
            .put_from(&k.blob, src, len, move || store.may_write(&id))
            .map_err(|e| CheckpointError::Store(format!("could not store the checkpoint ({e})")))?;
        if !committed {
            return Err(Self::fenced());
        }
        self.noted(k.tenant, k.id, Some(len));
        self.store.write_history(k.tenant, k.id);
        Ok(())
    }

    fn get(&self, key: &str, dst: &std::fs::File) -> std::io::Result<Option<u64>> {
        let k = Self::split(key)?;
        self.store.blob.get_into(&k.blob, dst).map_err(io_err)
    }

    fn delete(&self, key: &str) -> std::io::Result<()> {
        let k = Self::split(key)?;
        if !self.store.may_write(k.id) {
            // Not ours any more: the new owner's checkpoint stays.
            return Ok(());
        }
        self.store.blob.delete(&k.note()).map_err(io_err)?;
        self.store.blob.delete(&k.blob).map_err(io_err)?;
        self.noted(k.tenant, k.id, None);
        for m in self.store.blob.list(&k.objects()).map_err(io_err)? {
            self.store.blob.delete(&m.key).map_err(io_err)?;
        }
        Ok(())
    }

    fn keeps_objects(&self) -> bool {
        true
    }

    fn put_object(
        &self,
        key: &str,
        name: &str,
        src: &std::fs::File,
        len: u64,
    ) -> std::io::Result<()> {
        let k = Self::split(key)?;
        let obj = k.object(name)?;
        let (store, id) = (self.store.clone(), k.id.to_string());
        let committed = self
            .store
            .blob
            .put_from(&obj, src, len, move || store.may_write(&id))
            .map_err(io_err)?;
        if !committed {
            return Err(std::io::Error::other(Self::fenced().to_string()));
        }
        Ok(())
    }

    fn get_object(
        &self,
        key: &str,
        name: &str,
        dst: &std::fs::File,
    ) -> std::io::Result<Option<u64>> {
        let k = Self::split(key)?;
        self.store
            .blob
            .get_into(&k.object(name)?, dst)
            .map_err(io_err)
    }

    fn list_objects(&self, key: &str) -> std::io::Result<Vec<String>> {
        let k = Self::split(key)?;
        let prefix = format!("{}/", k.objects());
        let mut out: Vec<String> = self
            .store
            .blob
            .list(&k.objects())
            .map_err(io_err)?
            .into_iter()
            .filter_map(|m| m.key.strip_prefix(&prefix).map(str::to_string))
            .collect();
        out.sort();
        Ok(out)
    }

    fn delete_object(&self, key: &str, name: &str) -> std::io::Result<()> {
        let k = Self::split(key)?;
        if !self.store.may_write(k.id) {
            return Ok(());
        }
        self.store.blob.delete(&k.object(name)?).map_err(io_err)
    }

    fn list(&self) -> std::io::Result<Vec<String>> {
        let mut out = Vec::new();
        for m in self.store.blob.list("sessions").map_err(io_err)? {
            let parts: Vec<&str> = m.key.split('/').collect();
            if parts.len() == 4 && parts[3] == "checkpoint" {
                out.push(format!("{}/{}", parts[1], parts[2]));
            }
        }
        out.sort();
        Ok(out)
    }

    fn put_note(&self, key: &str, note: &[u8]) -> std::io::Result<()> {
        let k = Self::split(key)?;
        if !self.store.may_write(k.id) {
            return Ok(());
        }
        self.store
            .blob
            .put(&k.note(), note.to_vec())
            .map(|_| ())
            .map_err(io_err)
    }

    fn get_note(&self, key: &str) -> std::io::Result<Option<Vec<u8>>> {
        let k = Self::split(key)?;
        Ok(self
            .store
            .blob
            .get(&k.note())
            .map_err(io_err)?
            .map(|b| b.bytes))
    }

    fn delete_note(&self, key: &str) -> std::io::Result<()> {
        let k = Self::split(key)?;
        if !self.store.may_write(k.id) {
            return Ok(());
        }
        self.store.blob.delete(&k.note()).map_err(io_err)
    }

    fn usage(&self, prefix: &str) -> std::io::Result<StoreUsage> {
        let tenant = prefix.trim_end_matches('/');
        let sizes = self.sizes(tenant).map_err(io_err)?;
        Ok(StoreUsage {
            checkpoints: sizes.len() as u64,
            bytes: sizes.values().sum(),
        })
    }

    fn limits(&self) -> StoreLimits {
        StoreLimits {
            max_checkpoint_bytes: self.limits.max_bytes,
            tenant_quota_bytes: (self.limits.tenant_quota_bytes != u64::MAX)
                .then_some(self.limits.tenant_quota_bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(tenant: &str, id: &str) -> SessionRecord {
        SessionRecord {
            id: id.into(),
            tenant: tenant.into(),
            name: Some("main".into()),
            created_unix: 1,
            options: Some(serde_json::json!({"timeout_seconds": 5.0})),
        }
    }

    fn limits() -> CheckpointLimits {
        CheckpointLimits::default()
    }

    fn put(cp: &Arc<dyn CheckpointStore>, key: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
        use std::io::Write;
        let mut f = cp.scratch().unwrap();
        f.write_all(bytes).unwrap();
        cp.put(key, &f, bytes.len() as u64)
    }

    fn get(cp: &Arc<dyn CheckpointStore>, key: &str) -> Option<Vec<u8>> {
        use std::io::Read;
        let f = cp.scratch().unwrap();
        cp.get(key, &f).unwrap()?;
        let mut out = Vec::new();
        (&f).read_to_end(&mut out).unwrap();
        Some(out)
    }

    #[test]
    fn records_and_checkpoints_are_kept_by_tenant_and_deleted_together() {
        let s = SessionStore::with(BlobStore::in_memory(), None, DEFAULT_LEASE_TTL);
        s.put_record(&rec("a", "s-1")).unwrap();
        s.put_record(&rec("b/c", "s-2")).unwrap();
        let cp = s.checkpoints(limits());
        let key = format!("{}s-1", checkpoint_prefix("a"));
        put(&cp, &key, b"state").unwrap();
        cp.put_note(&key, b"{}").unwrap();
        assert_eq!(get(&cp, &key).as_deref(), Some(&b"state"[..]));
        assert_eq!(s.get_record("a", "s-1").unwrap(), Some(rec("a", "s-1")));
        // Another tenant's id answers like an unknown one.
        assert_eq!(s.get_record("b/c", "s-1").unwrap(), None);
        assert_eq!(s.get_record("a", "../x").unwrap(), None);
        assert_eq!(s.records().unwrap().len(), 2);
        assert_eq!(cp.list().unwrap(), vec![format!("{}/s-1", tenant_key("a"))]);
        s.delete_session("a", "s-1");
        assert_eq!(s.get_record("a", "s-1").unwrap(), None);
        assert!(cp.list().unwrap().is_empty());
        assert_eq!(cp.get_note(&key).unwrap(), None);
        assert!(put(&cp, "no-tenant", b"x").is_err());
    }

    #[test]
    fn a_tenants_checkpoints_are_held_to_its_quota_and_each_to_the_cap() {
        let s = SessionStore::with(BlobStore::in_memory(), None, DEFAULT_LEASE_TTL);
        let cp = s.checkpoints(CheckpointLimits {
            max_bytes: 8,
            tenant_quota_bytes: 10,
            ..limits()
        });
        let (k1, k2) = (
            format!("{}s-1", checkpoint_prefix("a")),
            format!("{}s-2", checkpoint_prefix("a")),
        );
        let other = format!("{}s-3", checkpoint_prefix("b"));
        assert_eq!(cp.allowance(&k1).unwrap().max_bytes, 8);
        put(&cp, &k1, b"123456").unwrap();
        // Another tenant's checkpoints do not count.
        put(&cp, &other, b"12345678").unwrap();
        // 4 bytes left for a second session of tenant a.
        let a = cp.allowance(&k2).unwrap();
        assert_eq!(a.max_bytes, 4);
        assert!(
            matches!(a.refusal, CheckpointError::Quota(_)),
            "{:?}",
            a.refusal
        );
        let e = put(&cp, &k2, b"12345").unwrap_err();
        assert!(matches!(e, CheckpointError::Quota(_)), "{e:?}");
        assert!(e.to_string().contains("--checkpoint-quota-mb"), "{e}");
        put(&cp, &k2, b"1234").unwrap();
        // Replacing a checkpoint counts only the one it replaces.
        put(&cp, &k1, b"123456").unwrap();
        let e = put(&cp, &k1, b"123456789").unwrap_err();
        assert!(matches!(e, CheckpointError::TooLarge(_)), "{e:?}");
        assert_eq!(get(&cp, &k1).as_deref(), Some(&b"123456"[..]));
        let u = cp.usage(&checkpoint_prefix("a")).unwrap();
        assert_eq!((u.checkpoints, u.bytes), (2, 10));
        assert_eq!(
            cp.limits(),
            StoreLimits {
                max_checkpoint_bytes: 8,
                tenant_quota_bytes: Some(10)
            }
        );
        // Deleting one gives its room back at once.
        cp.delete(&k2).unwrap();
        assert_eq!(cp.allowance(&k2).unwrap().max_bytes, 4);
    }

    #[test]
    fn a_node_writes_only_under_its_lease_and_loses_it_to_another() {
        let blob = BlobStore::in_memory();
        let ttl = MIN_LEASE_TTL;
        let n1 = SessionStore::with(blob.clone(), Some("n1".into()), ttl);
        let n2 = SessionStore::with(blob, Some("n2".into()), ttl);
        let (c1, c2) = (n1.checkpoints(limits()), n2.checkpoints(limits()));
        let key = format!("{}n1.s-1", checkpoint_prefix("t"));
        // No lease yet: no write.
        assert!(matches!(
            put(&c1, &key, b"x"),
            Err(CheckpointError::Fenced(_))
        ));
        n1.take("n1.s-1", Duration::ZERO).unwrap();
        put(&c1, &key, b"one").unwrap();
        // n2 cannot take a live lease without waiting for it.
        assert!(matches!(
            n2.take("n1.s-1", Duration::ZERO),
            Err(TakeError::Held { ref holder, .. }) if holder == "n1"
        ));
        // Released (a drain): n2 takes it at once, and n1 finds it lost.
        n1.release("n1.s-1");
        n2.take("n1.s-1", Duration::ZERO).unwrap();
        put(&c2, &key, b"two").unwrap();
        assert!(put(&c1, &key, b"stale").is_err());
        assert_eq!(get(&c1, &key).as_deref(), Some(&b"two"[..]));
        assert!(n2.renew().is_empty());
    }

    #[test]
    fn a_lapsed_lease_nobody_took_is_confirmed_by_a_renewal() {
        let n1 = SessionStore::with(
            BlobStore::in_memory(),
            Some("n1".into()),
            Duration::from_secs(6),
        );
        n1.take("n1.s-1", Duration::ZERO).unwrap();
        assert!(n1.holds("n1.s-1", Duration::from_secs(1)));
        assert_eq!(n1.confirm("n1.s-1", Duration::from_secs(1)), Ok(()));
        // Paused past the lease: its own clock says it may have lost it.
        n1.lapse("n1.s-1");
        assert!(!n1.holds("n1.s-1", Duration::ZERO));
        assert!(!n1.may_write("n1.s-1"));
        // Nobody took it: the compare-and-swap renewal proves it, and the
        // lease runs again.
        assert_eq!(n1.confirm("n1.s-1", Duration::from_secs(1)), Ok(()));
        assert!(n1.holds("n1.s-1", Duration::from_secs(1)));
        assert!(n1.may_write("n1.s-1"));
        // A session this node never held is not its own.
        assert_eq!(
            n1.confirm("n1.s-2", Duration::ZERO),
            Err(OwnershipError::Lost)
        );
    }

    #[test]
    fn a_lease_another_node_took_after_it_expired_is_lost_for_good() {
        let blob = BlobStore::in_memory();
        let ttl = Duration::from_secs(6);
        let n1 = SessionStore::with(blob.clone(), Some("n1".into()), ttl);
        n1.take("n1.s-1", Duration::ZERO).unwrap();
        // n2 takes the lease once it has expired (seen from 100 s later).
        let later = rvisor::clock::unix_now() + 100;
        blob.acquire_lease_at(&lease_key("n1.s-1"), "n2", ttl, later)
            .unwrap();
        n1.lapse("n1.s-1");
        assert_eq!(
            n1.confirm("n1.s-1", Duration::ZERO),
            Err(OwnershipError::Lost)
        );
        assert!(!n1.may_write("n1.s-1"));
        assert!(!n1.holds("n1.s-1", Duration::ZERO));
        // And it stays lost: no renewal brings it back.
        assert!(n1.renew().is_empty());
        assert_eq!(
            n1.confirm("n1.s-1", Duration::ZERO),
            Err(OwnershipError::Lost)
        );
    }

    #[test]
    fn renewals_racing_on_one_lease_never_read_as_lost() {
        let n1 = SessionStore::with(
            BlobStore::in_memory(),
            Some("n1".into()),
            Duration::from_secs(6),
        );
        for i in 0..4 {
            n1.take(&format!("n1.s-{i}"), Duration::ZERO).unwrap();
        }
        // The renewal thread and calls confirming lapsed leases at once:
        // each write must use the e-tag of the one before it.
        std::thread::scope(|sc| {
            for t in 0..6 {
                let n1 = &n1;
                sc.spawn(move || {
                    for round in 0..40 {
                        let id = format!("n1.s-{}", (t + round) % 4);
                        if t % 2 == 0 {
                            assert!(
                                n1.renew().is_empty(),
                                "a renewal read its own lease as lost"
                            );
                        } else {
                            n1.lapse(&id);
                            assert_eq!(n1.confirm(&id, Duration::ZERO), Ok(()), "{id}");
                        }
                    }
                });
            }
        });
        for i in 0..4 {
            assert!(n1.holds(&format!("n1.s-{i}"), Duration::from_secs(1)));
        }
    }

    #[test]
    fn renewals_come_often_enough_that_a_checkpoint_can_always_be_written() {
        // A lease counts a second short from its renewal, and a checkpoint
        // needs a second more: the next renewal must land before that.
        for secs in [3, 4, 5, 6, 10, 30, 60] {
            let s = SessionStore::with(
                BlobStore::in_memory(),
                Some("n1".into()),
                Duration::from_secs(secs),
            );
            let every = s.renew_every();
            let writable_for = Duration::from_secs(secs) - Duration::from_secs(2);
            assert!(
                every * 2 <= writable_for,
                "{secs} s lease renewed every {every:?}"
            );
            assert!(
                every <= Duration::from_secs(secs) / 3,
                "{secs} s: {every:?}"
            );
        }
    }
}
