//! What the web console shows besides a session's history: a tenant's
//! sessions at a glance (`GET /v1/sessions`) and, for operators, the
//! node, its admission and its calls and latency minute by minute over
//! the last hour (`GET /v1/admin/stats`).

use super::{lock, ErrorCode, HistoryEntry, Service, ServiceError};
use rvisor::SessionState;
use serde::Serialize;
use std::collections::VecDeque;
use std::time::Duration;

/// Minutes of calls the stats keep.
const MINUTES: usize = 60;

/// A session as the list shows it.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct SessionSummary {
    /// Its id.
    pub id: String,
    /// Its name, for sessions addressed by name (nng, jsonl, MCP).
    pub name: Option<String>,
    /// `new`, `starting`, `idle`, `running`, `hibernated` or `closed`.
    pub state: String,
    /// Seconds since its last call ended; null while a call runs.
    pub idle_seconds: Option<f64>,
    /// Resident memory of its worker, bytes (null: no worker).
    pub memory_bytes: Option<u64>,
    /// Calls waiting behind the running one.
    pub queued: usize,
    /// The running call's id and the last lines it printed, if one runs.
    #[schema(value_type = Option<Object>)]
    pub running: Option<serde_json::Value>,
    /// Entries in its history, and how many left it.
    pub history_entries: usize,
    /// Its last call: code (first 200 bytes), outcome, when it ended.
    #[schema(value_type = Option<Object>)]
    pub last_call: Option<serde_json::Value>,
}

/// The calls of one minute.
#[derive(Debug, Clone, Default, PartialEq, Serialize, utoipa::ToSchema)]
pub struct MinuteStats {
    /// The minute's start, Unix seconds.
    pub minute_unix: u64,
    /// Calls that ended in it.
    pub calls: u64,
    /// Of those, calls that did not succeed.
    pub failed: u64,
    /// Mean latency (request to result), milliseconds (0 with no calls).
    pub mean_ms: f64,
    /// Slowest call, milliseconds.
    pub max_ms: f64,
}

/// The last hour of calls, by minute.
#[derive(Debug, Default)]
pub(super) struct Minutes {
    /// Oldest first; (minute, calls, failed, sum of ms, max ms).
    slots: VecDeque<MinuteStats>,
}

fn now_unix() -> u64 {
    rvisor::clock::unix_now()
}

impl Minutes {
    pub(super) fn record(&mut self, success: bool, took: Duration) {
        self.record_at(now_unix(), success, took);
    }

    fn record_at(&mut self, now: u64, success: bool, took: Duration) {
        let minute = now - now % 60;
        if self.slots.back().is_none_or(|s| s.minute_unix != minute) {
            self.slots.push_back(MinuteStats {
                minute_unix: minute,
                ..MinuteStats::default()
            });
        }
        while self.slots.len() > MINUTES {
            self.slots.pop_front();
        }
        if let Some(s) = self.slots.back_mut() {
            let ms = took.as_secs_f64() * 1000.0;
            // `mean_ms` holds the sum until it is reported.
            s.mean_ms += ms;
            s.max_ms = s.max_ms.max(ms);
            s.calls += 1;
            s.failed += u64::from(!success);
        }
    }

    /// Every minute of the hour up to `now`, oldest first, empty minutes
    /// included (a chart has one point per minute).
    fn report(&self, now: u64) -> Vec<MinuteStats> {
        let last = now - now % 60;
        (0..MINUTES as u64)
            .rev()
            .map(|back| {
                let minute = last.saturating_sub(back * 60);
                let mut m = self
                    .slots
                    .iter()
                    .find(|s| s.minute_unix == minute)
                    .cloned()
                    .unwrap_or(MinuteStats {
                        minute_unix: minute,
                        ..MinuteStats::default()
                    });
                if m.calls > 0 {
                    m.mean_ms /= m.calls as f64;
                }
                m
            })
            .collect()
    }
}

/// What an operator sees of the service (`GET /v1/admin/stats`).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct AdminStats {
    /// The nodes this node knows: itself (each node of a cluster answers
    /// for itself; ask each, or its router).
    #[schema(value_type = Vec<Object>)]
    pub nodes: Vec<serde_json::Value>,
    /// Admission: live and hibernated sessions, calls in flight, the
    /// workers' memory and its budget, refusals (as health's `admission`).
    #[schema(value_type = Object)]
    pub admission: serde_json::Value,
    /// Sessions of every tenant on this node.
    pub sessions: usize,
    /// Calls and latency by minute over the last hour, oldest first.
    pub minutes: Vec<MinuteStats>,
}

/// Resident memory of process `pid`, bytes.
fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn state_name(s: SessionState) -> &'static str {
    match s {
        SessionState::New => "new",
        SessionState::Starting => "starting",
        SessionState::Idle => "idle",
        SessionState::Running => "running",
        SessionState::Hibernated => "hibernated",
        SessionState::Closed => "closed",
    }
}

fn last_call(e: &HistoryEntry) -> serde_json::Value {
    let (code, _) = rvisor_protocol::bounds::cut(&e.code, 200);
    serde_json::json!({
        "code": code,
        "outcome": e.outcome,
        "ended_at": e.ended_at,
        "duration_ms": e.duration_ms,
    })
}

impl Service {
    /// `tenant`'s sessions on this node, newest activity first: state,
    /// idle time, memory, last call. Sessions of other tenants are never
    /// listed.
    pub fn list_sessions(&self, tenant: &str) -> Vec<SessionSummary> {
        let mine: Vec<_> = lock(&self.inner.sessions)
            .iter()
            .filter(|(_, e)| e.tenant == tenant)
            .map(|(id, e)| (id.clone(), e.session.clone(), e.history.clone()))
            .collect();
        let names = lock(&self.inner.names).clone();
        let mut out: Vec<(u64, SessionSummary)> = mine
            .into_iter()
            .map(|(id, s, h)| {
                let st = s.status();
                let last = h.last_call();
                let name = names
                    .iter()
                    .find(|((t, _), v)| t == tenant && **v == id)
                    .map(|((_, n), _)| n.clone());
                let summary = SessionSummary {
                    name,
                    state: state_name(st.state).to_string(),
                    idle_seconds: st.idle_seconds,
                    memory_bytes: st.pid.and_then(rss_bytes),
                    queued: st.queued,
                    running: st
                        .running
                        .as_ref()
                        .and_then(|r| serde_json::to_value(r).ok()),
                    history_entries: h.counts().0,
                    last_call: last.as_ref().map(last_call),
                    id,
                };
                (last.map_or(0, |e| e.ended_unix_ms), summary)
            })
            .collect();
        out.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.id.cmp(&b.1.id)));
        out.into_iter().map(|(_, s)| s).collect()
    }

    /// The operator's view (`tenant` must be an operator): this node, its
    /// admission, its calls of the last hour by minute.
    pub fn admin_stats(&self, tenant: &str) -> Result<AdminStats, ServiceError> {
        if !self.is_operator(tenant) {
            return Err(ServiceError::new(
                ErrorCode::Forbidden,
                "the service's stats are for operators: use an operator's token \
                 (rvisor serve --operator TENANT); your own use is at /v1/usage",
            ));
        }
        let sessions = lock(&self.inner.sessions).len();
        let mut admission = self.inner.admission.report(self.sessions_view());
        admission["max_sessions"] = serde_json::json!(self.inner.cfg.max_sessions);
        admission["max_sessions_per_tenant"] =
            serde_json::json!(self.inner.cfg.max_sessions_per_tenant);
        let health = self.inner.sup.health();
        let node = serde_json::json!({
            "node_id": self.inner.sup.config().node_id,
            "this": true,
            "draining": self.inner.drain.is_draining(),
            "sessions": sessions,
            "version": health.version,
            "r_version": health.r_version,
            "uptime_seconds": health.uptime_seconds,
        });
        Ok(AdminStats {
            nodes: vec![node],
            admission,
            sessions,
            minutes: lock(&self.inner.metrics.minutes).report(now_unix()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minutes_cover_the_hour_with_empty_ones_and_old_ones_leave() {
        let mut m = Minutes::default();
        let t0 = 1_000_000 * 60;
        m.record_at(t0 + 5, true, Duration::from_millis(10));
        m.record_at(t0 + 50, false, Duration::from_millis(30));
        m.record_at(t0 + 125, true, Duration::from_millis(7));
        let r = m.report(t0 + 130);
        assert_eq!(r.len(), MINUTES);
        let last = &r[MINUTES - 1];
        assert_eq!((last.minute_unix, last.calls), (t0 + 120, 1));
        let first = &r[MINUTES - 3];
        assert_eq!((first.calls, first.failed), (2, 1));
        assert!((first.mean_ms - 20.0).abs() < 1e-9);
        assert!((first.max_ms - 30.0).abs() < 1e-9);
        assert_eq!(r[MINUTES - 2].calls, 0);
        // An hour later they are gone from the report.
        let later = m.report(t0 + 3 * 3600);
        assert!(later.iter().all(|s| s.calls == 0));
        // A clock at the epoch (unreadable) gives minutes, not a panic.
        assert_eq!(m.report(0).len(), MINUTES);
    }
}
