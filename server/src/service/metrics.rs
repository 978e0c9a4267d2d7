//! Metrics: calls by outcome and latency, requests by surface, each
//! tenant's own use (`/v1/usage`), the Prometheus text (`/metrics`).

use super::{lock, ErrorCode, Service, ServiceError};
use rvisor::RunResult;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The surface a request came in on (metrics label it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Surface {
    /// `rvisor serve`.
    Http,
    /// `rvisor serve --nng`.
    Nng,
    /// `rvisor mcp`.
    Mcp,
    /// `rvisor session --jsonl`.
    Jsonl,
}

impl Surface {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Surface::Http => "http",
            Surface::Nng => "nng",
            Surface::Mcp => "mcp",
            Surface::Jsonl => "jsonl",
        }
    }
}

const BUCKETS: [f64; 10] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0];

#[derive(Debug, Default)]
pub(super) struct Metrics {
    pub(super) by_outcome: Mutex<BTreeMap<String, u64>>,
    /// Call latency histogram: counts of calls at or under each bound (s).
    pub(super) buckets: [AtomicU64; 10],
    pub(super) sum_micros: AtomicU64,
    pub(super) count: AtomicU64,
    pub(super) requests: Mutex<BTreeMap<Surface, u64>>,
    /// Per tenant: what `/v1/usage` shows that tenant.
    pub(super) tenants: Mutex<HashMap<String, CallTotals>>,
    /// Calls of the last hour, by minute (overview.rs).
    pub(super) minutes: Mutex<super::overview::Minutes>,
}

/// One tenant's use of the service since it started.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct CallTotals {
    /// Calls by outcome (one-shot runs and session calls).
    pub calls: BTreeMap<String, u64>,
    /// CPU time the calls used, milliseconds.
    pub cpu_ms: f64,
    /// Wall time from request to result, milliseconds.
    pub wall_ms: f64,
}

/// What a tenant sees of its own use: `/v1/usage`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct UsageReport {
    /// The tenant.
    pub tenant: String,
    /// Sessions open now.
    pub sessions: usize,
    /// Tables stored now.
    pub tables: usize,
    /// Bytes those tables take.
    pub table_bytes: u64,
    /// Checkpoints of the tenant's sessions in the store (with
    /// `--state-dir` or `--store`; 0 otherwise).
    pub checkpoints: u64,
    /// Bytes they take, counted against `checkpoint_quota_bytes`.
    pub checkpoint_bytes: u64,
    /// The tenant's quota of checkpoint bytes (`null`: none, or no store).
    pub checkpoint_quota_bytes: Option<u64>,
    /// The cap on one checkpoint (`null`: no store).
    pub max_checkpoint_bytes: Option<u64>,
    /// Bytes of the tenant's files: its open sessions' working
    /// directories as last seen (listed, uploaded, changed by a call) and
    /// its stored artifacts (docs/files.md).
    #[serde(default)]
    pub file_bytes: u64,
    /// The tenant's quota of file bytes (`max_tenant_bytes`).
    #[serde(default)]
    pub file_quota_bytes: u64,
    /// Calls since the server started.
    #[serde(flatten)]
    pub since_start: CallTotals,
}

impl Metrics {
    pub(super) fn record(&self, tenant: &str, r: &RunResult, took: Duration) {
        *lock(&self.by_outcome)
            .entry(r.outcome.to_string())
            .or_default() += 1;
        {
            let mut t = lock(&self.tenants);
            let u = t.entry(tenant.to_string()).or_default();
            *u.calls.entry(r.outcome.to_string()).or_default() += 1;
            u.cpu_ms += r.usage.cpu_ms;
            u.wall_ms += took.as_secs_f64() * 1000.0;
        }
        let secs = took.as_secs_f64();
        for (i, b) in BUCKETS.iter().enumerate() {
            if secs <= *b {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        lock(&self.minutes).record(r.success, took);
    }
}

impl Service {
    /// What `tenant`'s checkpoints take in the store, and its limits
    /// (`None` without a store, or when the store cannot be listed).
    pub(super) fn checkpoint_usage(&self, tenant: &str) -> Option<rvisor::checkpoint::StoreUsage> {
        let store = self.inner.sup.config().checkpoints.as_ref()?;
        let prefix = if self.inner.cfg.durable.is_some() {
            crate::durable::checkpoint_prefix(tenant)
        } else {
            String::new()
        };
        store.usage(&prefix).ok()
    }

    /// `tenant`'s own use: open sessions, stored tables, calls by outcome
    /// and the time they took since the server started.
    pub fn usage(&self, tenant: &str) -> UsageReport {
        let sessions = lock(&self.inner.sessions)
            .values()
            .filter(|e| e.tenant == tenant)
            .count();
        let (tables, table_bytes) = self.inner.tables.usage(tenant);
        let ckpt = self.checkpoint_usage(tenant);
        let limits = self
            .inner
            .sup
            .config()
            .checkpoints
            .as_ref()
            .map(|s| s.limits());
        UsageReport {
            tenant: tenant.to_string(),
            sessions,
            tables,
            table_bytes,
            checkpoints: ckpt.as_ref().map_or(0, |u| u.checkpoints),
            checkpoint_bytes: ckpt.as_ref().map_or(0, |u| u.bytes),
            checkpoint_quota_bytes: limits.and_then(|l| l.tenant_quota_bytes),
            max_checkpoint_bytes: limits.map(|l| l.max_checkpoint_bytes),
            file_bytes: self.tenant_file_bytes(tenant),
            file_quota_bytes: self.file_limits().max_tenant_bytes,
            since_start: lock(&self.inner.metrics.tenants)
                .get(tenant)
                .cloned()
                .unwrap_or_default(),
        }
    }

    /// The server-wide metrics, for an operator: every tenant's calls and
    /// sessions are in them, so with tokens only the tenants named in
    /// `ServiceConfig::operators` may read them.
    pub fn metrics_for(&self, tenant: &str) -> Result<String, ServiceError> {
        if !self.is_operator(tenant) {
            return Err(ServiceError::new(
                ErrorCode::Forbidden,
                "the server-wide metrics are for operators: use an operator's token \
                 (rvisor serve --operator TENANT); your own use is at /v1/usage",
            ));
        }
        Ok(self.metrics_text())
    }

    /// Prometheus text: calls by outcome, call latency, sessions, queue
    /// depth, spares, the zygote, requests by surface.
    pub fn metrics_text(&self) -> String {
        let m = &self.inner.metrics;
        let mut out = String::new();
        out.push_str(
            "# HELP rvisor_calls_total Calls by outcome.\n# TYPE rvisor_calls_total counter\n",
        );
        for (k, v) in lock(&m.by_outcome).iter() {
            out.push_str(&format!("rvisor_calls_total{{outcome=\"{k}\"}} {v}\n"));
        }
        out.push_str(
            "# HELP rvisor_call_seconds Call latency.\n# TYPE rvisor_call_seconds histogram\n",
        );
        for (i, b) in BUCKETS.iter().enumerate() {
            out.push_str(&format!(
                "rvisor_call_seconds_bucket{{le=\"{b}\"}} {}\n",
                m.buckets[i].load(Ordering::Relaxed)
            ));
        }
        let count = m.count.load(Ordering::Relaxed);
        out.push_str(&format!(
            "rvisor_call_seconds_bucket{{le=\"+Inf\"}} {count}\n"
        ));
        out.push_str(&format!(
            "rvisor_call_seconds_sum {}\n",
            m.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        ));
        out.push_str(&format!("rvisor_call_seconds_count {count}\n"));
        let pool = self.inner.sup.pool_status();
        let (n, queued) = {
            let sessions = lock(&self.inner.sessions);
            let queued: usize = sessions.values().map(|e| e.session.status().queued).sum();
            (sessions.len(), queued)
        };
        out.push_str(&format!(
            "# TYPE rvisor_sessions gauge\nrvisor_sessions {n}\n# TYPE rvisor_queue_depth gauge\nrvisor_queue_depth {queued}\n# TYPE rvisor_spare_workers gauge\nrvisor_spare_workers {}\n# TYPE rvisor_spare_workers_target gauge\nrvisor_spare_workers_target {}\n# TYPE rvisor_zygote_up gauge\nrvisor_zygote_up {}\n",
            pool.spares,
            pool.spares_target,
            u8::from(pool.mode == rvisor::PoolMode::Zygote),
        ));
        out.push_str(&self.inner.admission.metrics_text(self.sessions_view()));
        out.push_str(&self.streams_metrics_text());
        let requests = lock(&m.requests);
        out.push_str(
            "# HELP rvisor_requests_total Requests by surface.\n# TYPE rvisor_requests_total counter\n",
        );
        for (s, v) in requests.iter() {
            out.push_str(&format!(
                "rvisor_requests_total{{surface=\"{}\"}} {v}\n",
                s.as_str()
            ));
        }
        out.push_str(&format!(
            "# TYPE rvisor_http_requests_total counter\nrvisor_http_requests_total {}\n",
            requests.get(&Surface::Http).copied().unwrap_or(0)
        ));
        out
    }
}
