//! The transport-neutral service: what HTTP, nng, MCP and `session --jsonl`
//! share, written once.
//!
//! [`Service`] owns tenants and their sessions (by id, and by name for the
//! surfaces that address sessions by name), one-shot runs with variables
//! and tables, validation, the table store, the request policy (timeouts
//! and limits a client may ask for, one definition each), the error codes
//! ([`ErrorCode`], mapped to HTTP statuses here and nowhere else) and the
//! metrics. An adapter decodes a request into the types of this module,
//! calls the service, and encodes the answer; it holds no rule of its own.

mod artifacts;
mod call;
mod error;
mod files;
mod history;
mod metrics;
mod node;
mod oneshot;
mod overview;
mod ownership;
pub mod packages;
mod policy;
mod publish;
mod request;
mod sessions;
mod streams;
mod tables;

pub use artifacts::InputFile;
pub use call::{PendingCall, ServiceEvents};
pub use error::{ErrorCode, ServiceError};
pub use files::{file_error, SessionUpload, INLINE_FILE_BYTES};
pub use history::{
    EntryKind, HistoryEntry, HistoryLimits, HistoryPage, SessionHistory, DEFAULT_HISTORY_BYTES,
    DEFAULT_HISTORY_ENTRIES, DEFAULT_HISTORY_ENTRY_BYTES, DEFAULT_HISTORY_PAGE, MAX_HISTORY_PAGE,
};
pub use metrics::{CallTotals, Surface, UsageReport};
pub use node::{DrainStatus, Readiness};
pub use overview::{AdminStats, MinuteStats, SessionSummary};
pub use policy::{check_bindings, check_timeout, tighter_limits};
pub use request::{
    objects, DataframeRef, LimitsRequest, NewSession, RunScript, SessionRun, Variable,
};
pub use streams::{StreamConfig, DEFAULT_TENANT_STREAM_BUFFER_BYTES};

use crate::durable::SessionStore;
use crate::tables::{TableConfig, TableStore};
use publish::Published;
use rvisor::{SafetyRules, Session, Supervisor};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------
// The service

/// How the service runs.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// Bearer token -> tenant; `None` serves one local tenant without auth.
    pub tokens: Option<HashMap<String, String>>,
    /// Where tables are stored, their lifetime and quotas.
    pub tables: TableConfig,
    /// Tenants whose tokens may read the server-wide metrics (with
    /// tokens; without them the one local user may).
    pub operators: Vec<String>,
    /// Sessions one tenant may hold open; one more is refused (429
    /// `quota`) until one closes.
    pub max_sessions_per_tenant: usize,
    /// Sessions of all tenants together.
    pub max_sessions: usize,
    /// Live sessions, calls per tenant and the workers' memory budget
    /// (`crate::admission`).
    pub admission: crate::admission::AdmissionConfig,
    /// Where sessions are kept durable (records, checkpoints, leases;
    /// docs/sessions.md). Its [`SessionStore::checkpoints`] must be the
    /// supervisor's checkpoint store. With it, sessions survive a restart
    /// (and move between nodes); without it they end with the process.
    pub durable: Option<Arc<SessionStore>>,
    /// With `durable`: a session unused this long (no checkpoint written,
    /// not leased by a live node) is deleted. `None`: kept until closed.
    pub session_ttl: Option<Duration>,
    /// Bytes of streamed events that may wait for slow clients, per
    /// stream and per tenant.
    pub streams: StreamConfig,
    /// The byte and count quotas of files (`rvisor::file_rules`).
    pub files: rvisor::file_rules::FileLimits,
    /// Packages on demand (packages.rs, docs/packages.md): the installer
    /// of tenant libraries; `None`, installing is off.
    pub packages: Option<Arc<rvisor_packages::Installer>>,
    /// How much history each session keeps (history.rs).
    pub history: HistoryLimits,
}

/// Default of [`ServiceConfig::session_ttl`]: 7 days.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            tokens: None,
            tables: TableConfig::default(),
            operators: Vec::new(),
            max_sessions_per_tenant: 32,
            max_sessions: 512,
            admission: crate::admission::AdmissionConfig::default(),
            durable: None,
            session_ttl: Some(DEFAULT_SESSION_TTL),
            streams: StreamConfig::default(),
            files: rvisor::file_rules::FileLimits::default(),
            packages: None,
            history: HistoryLimits::default(),
        }
    }
}

/// The tenant of every request when the service runs without tokens.
pub const LOCAL_TENANT: &str = "local";

#[derive(Debug)]
struct Entry {
    tenant: String,
    session: Session,
    published: Published,
    /// What happened in it (history.rs).
    history: Arc<SessionHistory>,
}

/// The service every surface calls. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Service {
    inner: Arc<ServiceState>,
}

#[derive(Debug)]
struct ServiceState {
    sup: Supervisor,
    cfg: ServiceConfig,
    tables: Arc<TableStore>,
    /// Session id -> its tenant, the session, the tables it published.
    sessions: Mutex<HashMap<String, Entry>>,
    /// (tenant, name) -> session id, for surfaces that name sessions.
    names: Mutex<HashMap<(String, String), String>>,
    metrics: metrics::Metrics,
    /// Draining, and the calls in flight (docs/scale-out.md).
    drain: crate::cluster::Drain,
    /// The last answer of the shared store to readiness, and when.
    store_check: Mutex<Option<(Instant, Result<(), String>)>>,
    admission: Arc<crate::admission::Admission>,
    /// Dropped with the service: stops the admission's memory monitor.
    _monitor: std::sync::mpsc::Sender<()>,
    /// Who owns which session: per-session locks for takeovers and
    /// hand-offs, the hand-offs in progress, results not to acknowledge.
    owner: ownership::Ownership,
    /// When each tenant's library was last compared with the shared
    /// store's (packages.rs).
    package_sync: Mutex<HashMap<String, Instant>>,
    /// Held while sessions are released, so that a shutdown racing a
    /// drain's hand-off waits for its checkpoints.
    releasing: Mutex<()>,
    /// Tells the maintenance threads (leases; hand-offs and the TTL
    /// sweep; the artifact sweep) to stop.
    stop: Arc<(Mutex<bool>, Condvar)>,
    /// Tenant -> the budget its open streams share.
    streams: Mutex<HashMap<String, rvisor::StreamBudget>>,
    /// Session id (or `artifacts:{execution_id}`) -> its tenant and the
    /// bytes of its files when last seen (an artifact set's until it
    /// expires), for the tenant quota of files and `/v1/usage`.
    file_bytes: Mutex<HashMap<String, files::Held>>,
    /// Tenant -> the store's count of its files (`files::Held` by key, as
    /// `file_bytes`) and when it was read: what other nodes, or this one
    /// before a restart, stored.
    stored_file_bytes: Mutex<HashMap<String, files::StoredCount>>,
    /// The sessions' histories, for the store to write beside their
    /// checkpoints (history.rs).
    histories: history::Histories,
}

impl Drop for ServiceState {
    fn drop(&mut self) {
        let (m, cv) = &*self.stop;
        *lock(m) = true;
        cv.notify_all();
    }
}

/// Every session of `st` with its tenant (the map's lock is held only to
/// copy the handles).
fn live_view(st: &ServiceState) -> Vec<(String, Session)> {
    lock(&st.sessions)
        .values()
        .map(|e| (e.tenant.clone(), e.session.clone()))
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Service {
    /// A service over `sup`, with its table store opened (or made) in
    /// `cfg.tables.dir`.
    pub fn new(sup: Supervisor, cfg: ServiceConfig) -> std::io::Result<Self> {
        let tables = Arc::new(TableStore::open(cfg.tables.clone())?);
        let admission = Arc::new(crate::admission::Admission::new(
            cfg.admission.clone(),
            sup.config().checkpoints.is_some(),
        ));
        let (stop_monitor, monitor_stopped) = std::sync::mpsc::channel();
        let svc = Self {
            inner: Arc::new(ServiceState {
                sup,
                cfg,
                tables,
                sessions: Mutex::new(HashMap::new()),
                names: Mutex::new(HashMap::new()),
                metrics: metrics::Metrics::default(),
                drain: crate::cluster::Drain::default(),
                store_check: Mutex::new(None),
                admission: admission.clone(),
                _monitor: stop_monitor,
                owner: ownership::Ownership::default(),
                package_sync: Mutex::new(HashMap::new()),
                releasing: Mutex::new(()),
                stop: Arc::new((Mutex::new(false), Condvar::new())),
                streams: Mutex::new(HashMap::new()),
                file_bytes: Mutex::new(HashMap::new()),
                stored_file_bytes: Mutex::new(HashMap::new()),
                histories: Arc::default(),
            }),
        };
        if let Some(d) = svc.inner.cfg.durable.clone() {
            d.set_history_source(history::history_source(svc.inner.histories.clone()));
            // Sessions past the TTL go before the rest are resumed and
            // before any request could adopt one.
            if let Some(ttl) = svc.inner.cfg.session_ttl {
                svc.sweep_expired(&d, ttl);
            }
            svc.resume_all(&d).map_err(|e| {
                std::io::Error::other(format!(
                    "could not read the sessions kept in {}: {e}",
                    d.url()
                ))
            })?;
            svc.start_maintenance(d);
        }
        // Expired artifact sets go, read or not (artifacts.rs).
        svc.start_artifact_sweep();
        let state = Arc::downgrade(&svc.inner);
        admission.spawn_monitor(
            move || state.upgrade().map(|st| live_view(&st)),
            monitor_stopped,
        );
        Ok(svc)
    }

    /// Every session with its tenant, for admission control.
    pub(super) fn sessions_view(&self) -> Vec<(String, Session)> {
        live_view(&self.inner)
    }

    /// The supervisor underneath.
    pub fn supervisor(&self) -> &Supervisor {
        &self.inner.sup
    }

    /// The rules every request is checked against (health reports them).
    pub fn rules(&self) -> &SafetyRules {
        &self.inner.sup.config().rules
    }

    /// Whether requests need a token.
    pub fn requires_auth(&self) -> bool {
        self.inner.cfg.tokens.is_some()
    }

    /// The tenant of `token` (the local tenant when the service has no
    /// tokens). `how` tells the client where its surface takes the token.
    pub fn authenticate(&self, token: Option<&str>, how: &str) -> Result<String, ServiceError> {
        match &self.inner.cfg.tokens {
            None => Ok(LOCAL_TENANT.to_string()),
            Some(map) => token
                .map(str::trim)
                .and_then(|t| map.get(t))
                .cloned()
                .ok_or_else(|| {
                    ServiceError::new(ErrorCode::Unauthorized, format!("send a valid token {how}"))
                }),
        }
    }

    /// Counts a request of `surface`.
    pub fn count_request(&self, surface: Surface) {
        *lock(&self.inner.metrics.requests)
            .entry(surface)
            .or_default() += 1;
    }

    /// Liveness, versions, the live rules and workers, with the number of
    /// open sessions.
    pub fn health(&self) -> Value {
        let mut h = self.inner.sup.health();
        h.style_engine = style_engine(self.inner.sup.config().style);
        let mut v = serde_json::to_value(&h).unwrap_or_default();
        v["workers"]["sessions"] = json!(lock(&self.inner.sessions).len());
        // The service's own admission limits and their use, beside the
        // request rules.
        let mut admission = self.inner.admission.report(self.sessions_view());
        admission["max_sessions_per_tenant"] = json!(self.inner.cfg.max_sessions_per_tenant);
        admission["max_sessions"] = json!(self.inner.cfg.max_sessions);
        v["admission"] = admission;
        v["streams"] = self.streams_report();
        // The limits on checkpoints (a tenant's own use is in /v1/usage).
        v["checkpoints"] = match self.inner.sup.config().checkpoints.as_ref() {
            None => Value::Null,
            Some(store) => json!(store.limits()),
        };
        v["node_id"] = json!(self.inner.sup.config().node_id);
        v["draining"] = json!(self.inner.drain.is_draining());
        // Packages on demand: repositories, allow/deny, caps (null: off).
        v["package_install"] = self.package_policy();
        v
    }

    /// Installed packages a script can `library()`.
    pub fn packages(&self) -> Result<Vec<rvisor::Package>, ServiceError> {
        self.inner
            .sup
            .packages()
            .map_err(|e| ServiceError::new(ErrorCode::NoWorker, e.to_string()))
    }

    /// Validation with style notes: runs nothing. Every surface (HTTP, nng,
    /// MCP, `rvisor validate`) comes here.
    pub fn validate(&self, script: &str) -> rvisor::Validation {
        validate(&self.inner.sup, script)
    }

    /// Whether `tenant` may use the operator's operations (server-wide
    /// metrics, drain): a tenant named by `ServiceConfig::operators`, or
    /// the one local user without tokens.
    pub(super) fn is_operator(&self, tenant: &str) -> bool {
        match &self.inner.cfg.tokens {
            None => true,
            Some(_) => self.inner.cfg.operators.iter().any(|o| o == tenant),
        }
    }
}

/// The style engine health reports: `rvisor-lint <version>` for the fast
/// (default) engine, else the configured name (`lintr`, `builtin`, `none`;
/// a validation answer names lintr with its version).
pub fn style_engine(style: rvisor::StyleEngine) -> String {
    if style.is_fast() {
        rvisor_lint::engine()
    } else {
        style.as_str().to_string()
    }
}

/// Validation as every surface gets it: R's parser, forbidden functions and
/// nesting depth in the supervisor's validation worker (blocking problems,
/// exactly as R sees them), and style notes from the configured engine. The
/// default engine is `rvisor-lint`, lintr's default linters in Rust: it
/// runs here, so the core crate carries no grammar and the worker does no
/// style work; `lintr` and `builtin` run in the worker.
pub fn validate(sup: &Supervisor, script: &str) -> rvisor::Validation {
    let engine = sup.config().style;
    if !engine.is_fast() {
        return sup.validate(script);
    }
    let mut v = sup.validate_with(script, rvisor::StyleEngine::None);
    if v.problems
        .iter()
        .any(|p| p.kind == "empty" || p.kind == "size")
    {
        return v;
    }
    v.style = rvisor_lint::lint(&rvisor::unix_newlines(script))
        .into_iter()
        .map(|n| rvisor::StyleNote {
            rule: n.rule,
            message: n.message,
            line: Some(n.line),
            column: Some(n.column),
        })
        .collect();
    v.style_engine = rvisor_lint::engine();
    v
}
