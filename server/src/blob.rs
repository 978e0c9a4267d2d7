//! The shared blob store: the objects every node of a cluster sees (tables
//! today, session checkpoints later), over the `object_store` crate. A
//! local directory by default (one node, or several on one host), an
//! S3-compatible bucket with `--store s3://bucket/prefix` (endpoint and
//! credentials from the standard AWS variables: `AWS_ENDPOINT`,
//! `AWS_ALLOW_HTTP`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_REGION`).
//!
//! The interface is byte and file oriented and synchronous, so the table
//! store (called from blocking threads and tool threads) and, later, the
//! checkpoint code use it alike: put, put-if-absent, put-if-match (an
//! e-tag), get, get into a file, delete, list by prefix. The store runs its
//! I/O on a small runtime of its own, so a caller needs no runtime.
//!
//! [`BlobStore::acquire_lease`] and friends are the ownership primitive
//! (docs/scale-out.md): a small JSON object created if absent, or replaced
//! if its e-tag still matches, with a holder and an expiry.

use futures_util::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload, UpdateVersion};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Files at least this large go up in parts of this size (bounded memory).
const PART_BYTES: usize = 8 << 20;

/// A store key component for a tenant: its bytes in hex (tenant names are
/// free text; keys must not be).
pub fn tenant_key(tenant: &str) -> String {
    tenant.bytes().map(|b| format!("{b:02x}")).collect()
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// `put_if_absent`: the key exists.
    #[error("the object {0} exists already")]
    Exists(String),
    /// `put_if_match`: the object changed (or is gone) since its e-tag was read.
    #[error("the object {0} changed since it was read")]
    Changed(String),
    /// No such key.
    #[error("no object {0}")]
    NotFound(String),
    /// The store's address or settings are wrong.
    #[error("{0}")]
    Config(String),
    /// The store failed or could not be reached.
    #[error("the shared store failed: {0}")]
    Store(String),
    /// A local file could not be read or written.
    #[error("failed to {what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The cause.
        source: std::io::Error,
    },
}

/// The result of a spawned part upload (a task that panicked or was
/// cancelled is a failed part).
fn joined(r: Result<object_store::Result<()>, tokio::task::JoinError>) -> object_store::Result<()> {
    r.unwrap_or_else(|e| {
        Err(object_store::Error::Generic {
            store: "upload",
            source: Box::new(e),
        })
    })
}

fn store_error(key: &str, e: object_store::Error) -> BlobError {
    match e {
        object_store::Error::AlreadyExists { .. } => BlobError::Exists(key.to_string()),
        object_store::Error::Precondition { .. } | object_store::Error::NotModified { .. } => {
            BlobError::Changed(key.to_string())
        }
        object_store::Error::NotFound { .. } => BlobError::NotFound(key.to_string()),
        other => BlobError::Store(other.to_string()),
    }
}

/// One object of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobMeta {
    /// Its key (relative to the store's prefix).
    pub key: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its e-tag, when the store gives one.
    pub e_tag: Option<String>,
    /// When it was last written (Unix seconds), when the store says.
    pub modified_unix: Option<u64>,
}

/// An object's bytes with the e-tag they had.
#[derive(Debug, Clone)]
pub struct Blob {
    /// The bytes.
    pub bytes: Vec<u8>,
    /// The e-tag (the token for [`BlobStore::put_if_match`]).
    pub e_tag: Option<String>,
}

/// Where the store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// A local directory.
    Local(PathBuf),
    /// An S3-compatible bucket and a key prefix (may be empty).
    S3 {
        /// The bucket.
        bucket: String,
        /// Keys are put under this prefix.
        prefix: String,
    },
}

impl std::str::FromStr for StoreUrl {
    type Err = String;

    /// `s3://bucket/prefix`, `file:///dir` or a directory path.
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(format!("{s:?} names no bucket: write s3://BUCKET/PREFIX"));
            }
            return Ok(StoreUrl::S3 {
                bucket: bucket.to_string(),
                prefix: prefix.trim_matches('/').to_string(),
            });
        }
        let path = s.strip_prefix("file://").unwrap_or(s);
        if path.is_empty() || s.contains("://") && !s.starts_with("file://") {
            return Err(format!(
                "{s:?} is not a store: write s3://BUCKET/PREFIX or a directory"
            ));
        }
        Ok(StoreUrl::Local(PathBuf::from(path)))
    }
}

impl std::fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreUrl::Local(p) => write!(f, "{}", p.display()),
            StoreUrl::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

/// The runtime the store's I/O runs on; shut down without waiting when the
/// store goes (a runtime may not be dropped inside another one).
struct Runtime(Option<tokio::runtime::Runtime>);

impl Drop for Runtime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// The shared store. Cheap to clone.
#[derive(Clone)]
pub struct BlobStore {
    inner: Arc<dyn ObjectStore>,
    url: StoreUrl,
    /// For a local directory: its root, where conditional replacement
    /// takes a file lock (the local backend has no compare-and-swap).
    local_root: Option<PathBuf>,
    rt: Arc<Runtime>,
}

impl std::fmt::Debug for BlobStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobStore").field("url", &self.url).finish()
    }
}

impl BlobStore {
    /// Opens the store at `url` (a local directory is created).
    pub fn open(url: &StoreUrl) -> Result<Self, BlobError> {
        let (inner, local_root): (Arc<dyn ObjectStore>, _) = match url {
            StoreUrl::Local(dir) => {
                std::fs::create_dir_all(dir).map_err(|source| BlobError::Io {
                    what: "create the store directory",
                    source,
                })?;
                let dir = std::fs::canonicalize(dir).map_err(|source| BlobError::Io {
                    what: "find the store directory",
                    source,
                })?;
                let fs = object_store::local::LocalFileSystem::new_with_prefix(&dir)
                    .map_err(|e| BlobError::Config(e.to_string()))?;
                (Arc::new(fs), Some(dir))
            }
            StoreUrl::S3 { bucket, prefix } => {
                let s3 = object_store::aws::AmazonS3Builder::from_env()
                    .with_bucket_name(bucket)
                    .build()
                    .map_err(|e| {
                        BlobError::Config(format!(
                            "cannot use {url}: {e}; set AWS_REGION, AWS_ENDPOINT (and \
                             AWS_ALLOW_HTTP=true for http://), AWS_ACCESS_KEY_ID and \
                             AWS_SECRET_ACCESS_KEY"
                        ))
                    })?;
                let s: Arc<dyn ObjectStore> = if prefix.is_empty() {
                    Arc::new(s3)
                } else {
                    Arc::new(object_store::prefix::PrefixStore::new(s3, prefix.as_str()))
                };
                (s, None)
            }
        };
        Self::with(inner, url.clone(), local_root)
    }

    /// A store in memory (tests; one process).
    pub fn in_memory() -> Self {
        Self::with(
            Arc::new(object_store::memory::InMemory::new()),
            StoreUrl::Local(PathBuf::from(":memory:")),
            None,
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    fn with(
        inner: Arc<dyn ObjectStore>,
        url: StoreUrl,
        local_root: Option<PathBuf>,
    ) -> Result<Self, BlobError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("rvisor-store")
            .enable_all()
            .build()
            .map_err(|source| BlobError::Io {
                what: "start the store's I/O thread",
                source,
            })?;
        Ok(Self {
            inner,
            url,
            local_root,
            rt: Arc::new(Runtime(Some(rt))),
        })
    }

    /// Where the store is.
    pub fn url(&self) -> &StoreUrl {
        &self.url
    }

    /// Runs `fut` on the store's runtime and waits for it, from any thread
    /// (inside another runtime too).
    fn wait<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let Some(rt) = self.rt.0.as_ref() else {
            unreachable!("the runtime lives as long as the store")
        };
        rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        match rx.recv() {
            Ok(v) => v,
            // The task is only dropped unfinished when the runtime shuts
            // down, which happens after the last store handle is gone.
            Err(_) => unreachable!("the store's runtime stopped under a caller"),
        }
    }

    fn path(key: &str) -> ObjPath {
        ObjPath::from(key)
    }

    /// Stores `bytes` at `key`, replacing what was there; returns the e-tag.
    pub fn put(&self, key: &str, bytes: Vec<u8>) -> Result<Option<String>, BlobError> {
        self.put_mode(key, bytes, PutMode::Overwrite)
    }

    /// Stores `bytes` at `key` only if no object is there
    /// ([`BlobError::Exists`] otherwise); returns the e-tag.
    pub fn put_if_absent(&self, key: &str, bytes: Vec<u8>) -> Result<Option<String>, BlobError> {
        self.put_mode(key, bytes, PutMode::Create)
    }

    /// Replaces the object at `key` only if its e-tag is still `e_tag`
    /// ([`BlobError::Changed`] otherwise); returns the new e-tag.
    pub fn put_if_match(
        &self,
        key: &str,
        bytes: Vec<u8>,
        e_tag: &str,
    ) -> Result<Option<String>, BlobError> {
        let Some(root) = &self.local_root else {
            return self.put_mode(
                key,
                bytes,
                PutMode::Update(UpdateVersion {
                    e_tag: Some(e_tag.to_string()),
                    version: None,
                }),
            );
        };
        // A local directory: compare and replace under an exclusive file
        // lock that every rvisor process using this directory takes.
        let lock = LocalLock::take(root)?;
        let current = self.head(key)?.and_then(|m| m.e_tag);
        if current.as_deref() != Some(e_tag) {
            return Err(BlobError::Changed(key.to_string()));
        }
        let put = self.put(key, bytes);
        drop(lock);
        put
    }

    fn put_mode(
        &self,
        key: &str,
        bytes: Vec<u8>,
        mode: PutMode,
    ) -> Result<Option<String>, BlobError> {
        let store = self.inner.clone();
        let (k, path) = (key.to_string(), Self::path(key));
        let create = matches!(mode, PutMode::Create);
        let lock = match (&self.local_root, create) {
            // Creation must not race a locked compare-and-replace.
            (Some(root), true) => Some(LocalLock::take(root)?),
            _ => None,
        };
        let r = self.wait(async move {
            let opts = PutOptions {
                mode,
                ..PutOptions::default()
            };
            store
                .put_opts(&path, PutPayload::from(bytes), opts)
                .await
                .map(|r| r.e_tag)
                .map_err(|e| store_error(&k, e))
        });
        drop(lock);
        r
    }

    /// Uploads the file at `src` to `key` (in parts: bounded memory).
    pub fn put_file(&self, key: &str, src: &Path) -> Result<(), BlobError> {
        let io = |what| move |source| BlobError::Io { what, source };
        let file = std::fs::File::open(src).map_err(io("open the file to upload"))?;
        let len = file
            .metadata()
            .map_err(io("read the file to upload"))?
            .len();
        self.put_from(key, &file, len, || true).map(|_| ())
    }

    /// Uploads the first `len` bytes of `src` (from its start; its offset
    /// is not used) to `key`, replacing what was there: at once when
    /// small, else in parts of [`PART_BYTES`] (bounded memory, at most two
    /// in flight). `commit` is asked right before the object is made
    /// visible (the last moment a write can be called off): `false` aborts
    /// it, nothing changes, and the answer is `Ok(false)`.
    pub fn put_from(
        &self,
        key: &str,
        src: &std::fs::File,
        len: u64,
        commit: impl Fn() -> bool + Send + 'static,
    ) -> Result<bool, BlobError> {
        use std::os::unix::fs::FileExt;
        let io = |what| move |source| BlobError::Io { what, source };
        if len < PART_BYTES as u64 {
            let mut buf = vec![0u8; len as usize];
            src.read_exact_at(&mut buf, 0)
                .map_err(io("read the file to upload"))?;
            if !commit() {
                return Ok(false);
            }
            return self.put(key, buf).map(|_| true);
        }
        let file = src.try_clone().map_err(io("read the file to upload"))?;
        let store = self.inner.clone();
        let (k, path) = (key.to_string(), Self::path(key));
        self.wait(async move {
            let mut upload = store
                .put_multipart(&path)
                .await
                .map_err(|e| store_error(&k, e))?;
            // One part uploads while the next is read: at most two parts
            // in memory, each handed to the store as it is (no copy).
            let mut in_flight: Option<tokio::task::JoinHandle<object_store::Result<()>>> = None;
            let mut at = 0u64;
            let mut failed = None;
            while at < len && failed.is_none() {
                let n = (len - at).min(PART_BYTES as u64) as usize;
                let mut part = vec![0u8; n];
                // Small blocking reads of a local file, one part at a time.
                if let Err(e) = file.read_exact_at(&mut part, at) {
                    failed = Some(io("read the file to upload")(e));
                    break;
                }
                if let Some(prev) = in_flight.take() {
                    if let Err(e) = joined(prev.await) {
                        failed = Some(store_error(&k, e));
                        break;
                    }
                }
                in_flight = Some(tokio::spawn(upload.put_part(PutPayload::from(part))));
                at += n as u64;
            }
            if let (None, Some(last)) = (&failed, in_flight.take()) {
                if let Err(e) = joined(last.await) {
                    failed = Some(store_error(&k, e));
                }
            }
            if let Some(e) = failed {
                let _ = upload.abort().await;
                return Err(e);
            }
            if !commit() {
                upload.abort().await.map_err(|e| store_error(&k, e))?;
                return Ok(false);
            }
            upload.complete().await.map_err(|e| store_error(&k, e))?;
            Ok(true)
        })
    }

    /// The object at `key` with its e-tag, `None` if there is none.
    pub fn get(&self, key: &str) -> Result<Option<Blob>, BlobError> {
        let store = self.inner.clone();
        let (k, path) = (key.to_string(), Self::path(key));
        self.wait(async move {
            match store.get(&path).await {
                Ok(r) => {
                    let e_tag = r.meta.e_tag.clone();
                    let bytes = r.bytes().await.map_err(|e| store_error(&k, e))?;
                    Ok(Some(Blob {
                        bytes: bytes.to_vec(),
                        e_tag,
                    }))
                }
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(store_error(&k, e)),
            }
        })
    }

    /// Downloads `key` into the file `dst` (through `dst.part`, renamed
    /// when complete); false if there is no such object.
    pub fn get_to_file(&self, key: &str, dst: &Path) -> Result<bool, BlobError> {
        let store = self.inner.clone();
        let (k, path) = (key.to_string(), Self::path(key));
        let part = dst.with_extension("part");
        let (part2, dst2) = (part.clone(), dst.to_path_buf());
        let r = self.wait(async move {
            let io = |what| move |source| BlobError::Io { what, source };
            let got = match store.get(&path).await {
                Ok(r) => r,
                Err(object_store::Error::NotFound { .. }) => return Ok(false),
                Err(e) => return Err(store_error(&k, e)),
            };
            let mut out = std::io::BufWriter::new(
                std::fs::File::create(&part2).map_err(io("create the cached file"))?,
            );
            let mut stream = got.into_stream();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| store_error(&k, e))?;
                std::io::Write::write_all(&mut out, &chunk).map_err(io("write the cached file"))?;
            }
            std::io::Write::flush(&mut out).map_err(io("write the cached file"))?;
            drop(out);
            std::fs::rename(&part2, &dst2).map_err(io("move the cached file in place"))?;
            Ok(true)
        });
        if !matches!(r, Ok(true)) {
            let _ = std::fs::remove_file(&part);
        }
        r
    }

    /// Downloads `key` into `dst` (truncated first, written from its
    /// start, in the chunks the store sends: bounded memory); its length,
    /// `None` if there is no such object.
    pub fn get_into(&self, key: &str, dst: &std::fs::File) -> Result<Option<u64>, BlobError> {
        use std::io::Seek;
        let io = |what| move |source| BlobError::Io { what, source };
        let mut out = dst
            .try_clone()
            .map_err(io("open the file to download into"))?;
        out.rewind()
            .and_then(|_| out.set_len(0))
            .map_err(io("empty the file to download into"))?;
        let store = self.inner.clone();
        let (k, path) = (key.to_string(), Self::path(key));
        let got = self.wait(async move {
            let got = match store.get(&path).await {
                Ok(r) => r,
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(store_error(&k, e)),
            };
            let mut n = 0u64;
            let mut stream = got.into_stream();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| store_error(&k, e))?;
                std::io::Write::write_all(&mut out, &chunk)
                    .map_err(io("write the downloaded file"))?;
                n += chunk.len() as u64;
            }
            Ok(Some(n))
        })?;
        let mut back = dst;
        back.rewind().map_err(io("read the downloaded file"))?;
        Ok(got)
    }

    /// The size and e-tag of `key`, `None` if there is none.
    pub fn head(&self, key: &str) -> Result<Option<BlobMeta>, BlobError> {
        let store = self.inner.clone();
        let (k, path) = (key.to_string(), Self::path(key));
        self.wait(async move {
            match store.head(&path).await {
                Ok(m) => Ok(Some(BlobMeta {
                    key: k,
                    size: m.size,
                    e_tag: m.e_tag,
                    modified_unix: u64::try_from(m.last_modified.timestamp()).ok(),
                })),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(store_error(&k, e)),
            }
        })
    }

    /// Deletes `key`; no error if it is not there.
    pub fn delete(&self, key: &str) -> Result<(), BlobError> {
        let store = self.inner.clone();
        let (k, path) = (key.to_string(), Self::path(key));
        self.wait(async move {
            match store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(store_error(&k, e)),
            }
        })
    }

    /// Every object whose key starts with the folder `prefix` (`a/b`
    /// lists `a/b/...`), in no particular order.
    pub fn list(&self, prefix: &str) -> Result<Vec<BlobMeta>, BlobError> {
        let store = self.inner.clone();
        let (k, path) = (prefix.to_string(), Self::path(prefix));
        self.wait(async move {
            let p = if k.is_empty() { None } else { Some(&path) };
            let mut out = Vec::new();
            let mut s = store.list(p);
            while let Some(m) = s.next().await {
                match m {
                    Ok(m) => out.push(BlobMeta {
                        key: m.location.to_string(),
                        size: m.size,
                        e_tag: m.e_tag,
                        modified_unix: u64::try_from(m.last_modified.timestamp()).ok(),
                    }),
                    // A local directory that does not exist yet lists empty.
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(store_error(&k, e)),
                }
            }
            Ok(out)
        })
    }

    /// Whether the store answers now, within `within` (readiness).
    pub fn reachable(&self, within: Duration) -> Result<(), BlobError> {
        let store = self.inner.clone();
        self.wait(async move {
            // A listing, not a HEAD: S3 answers a HEAD in a missing bucket
            // with the same 404 as a missing key.
            let probe = async {
                match store
                    .list_with_delimiter(Some(&ObjPath::from("rvisor-probe")))
                    .await
                {
                    Ok(_) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(BlobError::Store(e.to_string())),
                }
            };
            match tokio::time::timeout(within, probe).await {
                Ok(r) => r,
                Err(_) => Err(BlobError::Store(format!(
                    "no answer within {} s",
                    within.as_secs_f64()
                ))),
            }
        })
    }

    // -----------------------------------------------------------------
    // Leases

    /// Takes the lease at `key` for `holder` until `ttl` from now: created
    /// if absent; taken over if it has expired (or `holder` holds it
    /// already). Another holder's live lease is [`LeaseError::Held`]; a
    /// race lost to another node taking it at the same time too.
    pub fn acquire_lease(
        &self,
        key: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Lease, LeaseError> {
        self.acquire_lease_at(key, holder, ttl, rvisor::clock::unix_now())
    }

    pub(crate) fn acquire_lease_at(
        &self,
        key: &str,
        holder: &str,
        ttl: Duration,
        now: u64,
    ) -> Result<Lease, LeaseError> {
        let record = LeaseRecord {
            holder: holder.to_string(),
            expires_unix: now + ttl.as_secs().max(1),
        };
        match self.put_if_absent(key, record.to_bytes()) {
            Ok(e_tag) => return Ok(Lease::new(key, record, e_tag)),
            Err(BlobError::Exists(_)) => {}
            Err(e) => return Err(LeaseError::Store(e)),
        }
        let Some(current) = self.get(key).map_err(LeaseError::Store)? else {
            // Released and deleted meanwhile: try once more from scratch.
            return match self.put_if_absent(key, record.to_bytes()) {
                Ok(e_tag) => Ok(Lease::new(key, record, e_tag)),
                Err(BlobError::Exists(_)) => Err(LeaseError::Lost(key.to_string())),
                Err(e) => Err(LeaseError::Store(e)),
            };
        };
        let seen = LeaseRecord::parse(&current.bytes);
        if let Some(seen) = &seen {
            if seen.holder != holder && seen.expires_unix > now {
                return Err(LeaseError::Held {
                    holder: seen.holder.clone(),
                    expires_unix: seen.expires_unix,
                });
            }
        }
        let Some(tag) = current.e_tag else {
            return Err(LeaseError::Store(BlobError::Store(
                "the store gives no e-tags, which leases need".into(),
            )));
        };
        match self.put_if_match(key, record.to_bytes(), &tag) {
            Ok(e_tag) => Ok(Lease::new(key, record, e_tag)),
            Err(BlobError::Changed(_) | BlobError::NotFound(_)) => {
                Err(LeaseError::Lost(key.to_string()))
            }
            Err(e) => Err(LeaseError::Store(e)),
        }
    }

    /// Extends `lease` to `ttl` from now, if it is still ours:
    /// [`LeaseError::Lost`] if another node took it (it had expired).
    pub fn renew_lease(&self, lease: &mut Lease, ttl: Duration) -> Result<(), LeaseError> {
        self.renew_lease_at(lease, ttl, rvisor::clock::unix_now())
    }

    fn renew_lease_at(&self, lease: &mut Lease, ttl: Duration, now: u64) -> Result<(), LeaseError> {
        let record = LeaseRecord {
            holder: lease.record.holder.clone(),
            expires_unix: now + ttl.as_secs().max(1),
        };
        let tag = lease.e_tag.clone().unwrap_or_default();
        match self.put_if_match(&lease.key, record.to_bytes(), &tag) {
            Ok(e_tag) => {
                lease.record = record;
                lease.e_tag = e_tag;
                Ok(())
            }
            Err(BlobError::Changed(_) | BlobError::NotFound(_)) => {
                Err(LeaseError::Lost(lease.key.clone()))
            }
            Err(e) => Err(LeaseError::Store(e)),
        }
    }

    /// Gives `lease` up (it reads as expired), if it is still ours.
    pub fn release_lease(&self, lease: Lease) -> Result<(), LeaseError> {
        let record = LeaseRecord {
            holder: lease.record.holder.clone(),
            expires_unix: 0,
        };
        let tag = lease.e_tag.clone().unwrap_or_default();
        match self.put_if_match(&lease.key, record.to_bytes(), &tag) {
            Ok(_) => Ok(()),
            Err(BlobError::Changed(_) | BlobError::NotFound(_)) => Err(LeaseError::Lost(lease.key)),
            Err(e) => Err(LeaseError::Store(e)),
        }
    }
}

/// How long a conditional write to a local directory store waits for the
/// store's lock file before it fails.
const LOCAL_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// An exclusive lock on `{root}/.rvisor-store.lock`, held until dropped:
/// conditional writes to a local directory store take it, so processes
/// sharing the directory on one host cannot interleave a compare and a
/// replace. (On a network file system flock may not hold; use S3 there.)
struct LocalLock {
    _file: std::fs::File,
}

impl LocalLock {
    fn take(root: &Path) -> Result<Self, BlobError> {
        use std::os::fd::AsRawFd;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(root.join(".rvisor-store.lock"))
            .map_err(|source| BlobError::Io {
                what: "open the store's lock file",
                source,
            })?;
        // Not a blocking lock: a process paused (SIGSTOP, a debugger)
        // while it holds it would stall every node on the directory until
        // it resumed. Past the wait, the write fails and its caller
        // retries (a lease renewal next round, a call with a 5xx).
        let deadline = std::time::Instant::now() + LOCAL_LOCK_WAIT;
        loop {
            // SAFETY: `f` is an open file we own for the whole call; flock
            // only takes its descriptor and touches no memory of ours.
            let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if r == 0 {
                return Ok(Self { _file: f });
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => continue,
                std::io::ErrorKind::WouldBlock if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                std::io::ErrorKind::WouldBlock => {
                    return Err(BlobError::Store(format!(
                        "the store directory {} is locked by another process for more than {} \
                         s (a node paused or stuck while writing a lease?); retry shortly",
                        root.display(),
                        LOCAL_LOCK_WAIT.as_secs()
                    )))
                }
                _ => {
                    return Err(BlobError::Io {
                        what: "lock the store's lock file",
                        source: e,
                    })
                }
            }
        }
    }
}

impl std::fmt::Debug for LocalLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LocalLock")
    }
}

// Closing the descriptor (dropping the File) releases the flock.

/// What a lease object holds.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LeaseRecord {
    /// Who holds it (a node id).
    pub holder: String,
    /// Until when (Unix seconds); 0: released.
    pub expires_unix: u64,
}

impl LeaseRecord {
    fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    fn parse(b: &[u8]) -> Option<Self> {
        serde_json::from_slice(b).ok()
    }
}

/// A lease this node holds: renew it before it expires.
#[derive(Debug, Clone)]
pub struct Lease {
    key: String,
    record: LeaseRecord,
    e_tag: Option<String>,
}

impl Lease {
    fn new(key: &str, record: LeaseRecord, e_tag: Option<String>) -> Self {
        Self {
            key: key.to_string(),
            record,
            e_tag,
        }
    }

    /// The lease's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Who holds it and until when.
    pub fn record(&self) -> &LeaseRecord {
        &self.record
    }
}

/// Why a lease could not be taken or kept.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Another holder has it until `expires_unix`.
    #[error("held by {holder} until {expires_unix}")]
    Held {
        /// The other holder.
        holder: String,
        /// When its lease ends (Unix seconds).
        expires_unix: u64,
    },
    /// Another holder took it between our read and our write (or after
    /// ours expired): this node must drop what the lease guarded.
    #[error("the lease {0} was taken by another node")]
    Lost(String),
    /// The store failed.
    #[error(transparent)]
    Store(BlobError),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local() -> (BlobStore, PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("rvisor-blob-test-{}", rvisor::ids::random_hex(6)));
        (BlobStore::open(&StoreUrl::Local(dir.clone())).unwrap(), dir)
    }

    fn stores() -> Vec<(BlobStore, Option<PathBuf>)> {
        let (l, dir) = local();
        vec![(BlobStore::in_memory(), None), (l, Some(dir))]
    }

    #[test]
    fn urls_parse_and_bad_ones_say_how_to_write_them() {
        assert_eq!(
            "s3://b/a/b/".parse::<StoreUrl>().unwrap(),
            StoreUrl::S3 {
                bucket: "b".into(),
                prefix: "a/b".into()
            }
        );
        assert_eq!(
            "/var/x".parse::<StoreUrl>().unwrap(),
            StoreUrl::Local("/var/x".into())
        );
        assert_eq!(
            "file:///var/x".parse::<StoreUrl>().unwrap(),
            StoreUrl::Local("/var/x".into())
        );
        assert!("s3://"
            .parse::<StoreUrl>()
            .unwrap_err()
            .contains("s3://BUCKET"));
        assert!("gs://b"
            .parse::<StoreUrl>()
            .unwrap_err()
            .contains("s3://BUCKET"));
    }

    #[test]
    fn put_get_list_delete_and_conditional_writes() {
        for (s, dir) in stores() {
            assert!(s.get("a/x").unwrap().is_none());
            s.put("a/x", b"1".to_vec()).unwrap();
            s.put_if_absent("a/y", b"2".to_vec()).unwrap();
            s.put("b/z", b"3".to_vec()).unwrap();
            assert!(matches!(
                s.put_if_absent("a/y", b"again".to_vec()),
                Err(BlobError::Exists(_))
            ));
            let got = s.get("a/y").unwrap().unwrap();
            assert_eq!(got.bytes, b"2");
            let tag = got.e_tag.clone().expect("e-tag");
            s.put_if_match("a/y", b"22".to_vec(), &tag).unwrap();
            // The old e-tag no longer matches.
            assert!(matches!(
                s.put_if_match("a/y", b"stale".to_vec(), &tag),
                Err(BlobError::Changed(_))
            ));
            assert_eq!(s.get("a/y").unwrap().unwrap().bytes, b"22");
            let mut keys: Vec<String> = s.list("a").unwrap().into_iter().map(|m| m.key).collect();
            keys.sort();
            assert_eq!(keys, ["a/x", "a/y"]);
            assert_eq!(s.head("b/z").unwrap().unwrap().size, 1);
            s.delete("a/x").unwrap();
            s.delete("a/x").unwrap();
            assert!(s.get("a/x").unwrap().is_none());
            assert!(s.list("nothing").unwrap().is_empty());
            s.reachable(Duration::from_secs(5)).unwrap();
            if let Some(d) = dir {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }

    #[test]
    fn files_go_up_in_parts_and_come_back_whole() {
        let (s, dir) = local();
        let src = dir.join("big.bin");
        // Over one part, not a multiple of it.
        let data: Vec<u8> = (0..(PART_BYTES + 12_345))
            .map(|i| (i % 251) as u8)
            .collect();
        std::fs::write(&src, &data).unwrap();
        s.put_file("t/big", &src).unwrap();
        let dst = dir.join("back.bin");
        assert!(s.get_to_file("t/big", &dst).unwrap());
        assert_eq!(std::fs::read(&dst).unwrap(), data);
        assert!(!s.get_to_file("t/none", &dir.join("none.bin")).unwrap());
        assert!(!dir.join("none.part").exists());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn an_upload_from_a_file_is_called_off_at_its_commit_and_the_old_object_stays() {
        use std::io::{Read, Write};
        for (s, dir) in stores() {
            for size in [100usize, PART_BYTES + 7] {
                let key = format!("ckpt/{size}");
                s.put(&key, b"old".to_vec()).unwrap();
                let mut src = rvisor::checkpoint::anonymous_file(&std::env::temp_dir()).unwrap();
                let data: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
                src.write_all(&data).unwrap();
                let len = data.len() as u64;
                assert!(!s.put_from(&key, &src, len, || false).unwrap());
                assert_eq!(s.get(&key).unwrap().unwrap().bytes, b"old");
                assert!(s.put_from(&key, &src, len, || true).unwrap());
                let dst = rvisor::checkpoint::anonymous_file(&std::env::temp_dir()).unwrap();
                assert_eq!(s.get_into(&key, &dst).unwrap(), Some(len));
                let mut back = Vec::new();
                (&dst).read_to_end(&mut back).unwrap();
                assert!(back == data, "{size} bytes came back different");
                assert_eq!(s.get_into("ckpt/none", &dst).unwrap(), None);
            }
            if let Some(d) = dir {
                // No part of a called-off upload is left in the directory.
                let names: Vec<String> = std::fs::read_dir(d.join("ckpt"))
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect();
                assert_eq!(names.len(), 2, "{names:?}");
            }
        }
    }

    #[test]
    fn a_lease_is_exclusive_until_it_expires_then_the_old_holder_has_lost_it() {
        for (s, dir) in stores() {
            let ttl = Duration::from_secs(30);
            let now = 1_000_000;
            let mut a = s.acquire_lease_at("lease/s1", "n1", ttl, now).unwrap();
            assert_eq!(a.record().holder, "n1");
            // Live: another node is refused and told who holds it.
            match s.acquire_lease_at("lease/s1", "n2", ttl, now + 10) {
                Err(LeaseError::Held {
                    holder,
                    expires_unix,
                }) => {
                    assert_eq!(holder, "n1");
                    assert_eq!(expires_unix, now + 30);
                }
                other => panic!("{other:?}"),
            }
            // The holder renews.
            s.renew_lease_at(&mut a, ttl, now + 20).unwrap();
            assert!(matches!(
                s.acquire_lease_at("lease/s1", "n2", ttl, now + 40),
                Err(LeaseError::Held { .. })
            ));
            // Expired: n2 takes it over...
            let b = s.acquire_lease_at("lease/s1", "n2", ttl, now + 51).unwrap();
            assert_eq!(b.record().holder, "n2");
            // ...and n1, back from a pause, finds it has lost it.
            assert!(matches!(
                s.renew_lease_at(&mut a, ttl, now + 52),
                Err(LeaseError::Lost(_))
            ));
            assert!(matches!(s.release_lease(a), Err(LeaseError::Lost(_))));
            // A released lease is free at once.
            s.release_lease(b).unwrap();
            let c = s.acquire_lease_at("lease/s1", "n3", ttl, now + 53).unwrap();
            assert_eq!(c.record().holder, "n3");
            if let Some(d) = dir {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }

    #[test]
    fn racing_takeovers_of_an_expired_lease_leave_one_winner() {
        let (s, dir) = local();
        let ttl = Duration::from_secs(30);
        s.acquire_lease_at("lease/r", "old", ttl, 100).unwrap();
        let winners: Vec<bool> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..6)
                .map(|i| {
                    let s = s.clone();
                    sc.spawn(move || {
                        s.acquire_lease_at("lease/r", &format!("n{i}"), ttl, 1000)
                            .is_ok()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(winners.iter().filter(|w| **w).count(), 1, "{winners:?}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_lock_held_elsewhere_fails_the_write_after_a_bounded_wait_instead_of_stalling() {
        let dir =
            std::env::temp_dir().join(format!("rvisor-blob-lock-{}", rvisor::ids::random_hex(6)));
        let store = BlobStore::open(&StoreUrl::Local(dir.clone())).unwrap();
        let root = std::fs::canonicalize(&dir).unwrap();
        // Another holder (a node paused while it writes a lease): flock
        // locks belong to an open file, so this one conflicts as another
        // process's would.
        let held = LocalLock::take(&root).unwrap();
        let t = std::time::Instant::now();
        let e = store
            .put_if_absent("leases/sessions/x", b"{}".to_vec())
            .unwrap_err();
        assert!(t.elapsed() >= LOCAL_LOCK_WAIT, "{:?}", t.elapsed());
        assert!(
            e.to_string().contains("is locked by another process"),
            "{e}"
        );
        drop(held);
        store
            .put_if_absent("leases/sessions/x", b"{}".to_vec())
            .unwrap();
        let _ = std::fs::remove_dir_all(dir);
    }
}
