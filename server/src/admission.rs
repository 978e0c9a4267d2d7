//! Admission control for sessions: how many sessions may hold a worker
//! (host-wide and per tenant), how many calls one tenant may have running
//! or queued, and how much memory the live workers may use together.
//!
//! A call to a session that holds no worker (new, or hibernated) is
//! admitted when a live slot and the memory budget allow it; otherwise the
//! least recently used *idle* live session (of the same tenant for the
//! per-tenant cap, of anyone for the host caps) is hibernated first, and
//! the call waits (bounded) until its worker has exited. Only when nothing
//! can be hibernated (every live session is busy, or there is no
//! checkpoint store) is the call refused: [`Refusal`], which the service
//! turns into 429 `quota` (a tenant's cap) or 503 `busy` (a host cap),
//! with a `retry_after_seconds`.
//!
//! A monitor thread ([`Admission::spawn_monitor`]) measures the live
//! workers' memory about once a second and hibernates idle sessions, least
//! recently used first, while the sum is over the budget.
//!
//! Memory is each worker's PSS (`/proc/PID/smaps_rollup`: shared pages
//! split between the processes that map them, so the zygote's heap is not
//! counted once per worker), or its RSS (`/proc/PID/statm`) when PSS is
//! not readable (a worker in another user namespace may forbid it); health
//! says which.
//!
//! The service hands this module its sessions as `(tenant, Session)`
//! pairs; the module reads their status and never holds the service's
//! locks. docs/sessions.md (admission) and docs/limits.md describe the
//! limits and their defaults.

use rvisor::{Session, SessionState, SessionStatus};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The admission limits. `usize::MAX` / `u64::MAX`: no limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Sessions holding a worker at once, host-wide.
    pub max_live_sessions: usize,
    /// Sessions of one tenant holding a worker at once.
    pub max_live_sessions_per_tenant: usize,
    /// Calls running or queued at once for one tenant, across its
    /// sessions.
    pub max_calls_per_tenant: usize,
    /// Memory the live workers may use together (PSS, else RSS), bytes.
    pub memory_budget_bytes: u64,
}

/// Default of [`AdmissionConfig::max_live_sessions`].
pub const DEFAULT_MAX_LIVE_SESSIONS: usize = 64;
/// Default of [`AdmissionConfig::max_live_sessions_per_tenant`].
pub const DEFAULT_MAX_LIVE_SESSIONS_PER_TENANT: usize = 16;
/// Default of [`AdmissionConfig::max_calls_per_tenant`].
pub const DEFAULT_MAX_CALLS_PER_TENANT: usize = 64;

/// How long a call waits for the hibernation that makes room for it.
pub const HIBERNATE_WAIT: Duration = Duration::from_secs(30);
/// How often the monitor measures the live workers' memory.
pub const MONITOR_PERIOD: Duration = Duration::from_secs(1);
/// `retry_after_seconds` when every live session is busy (a call ending
/// frees a slot, and calls are usually short).
pub const RETRY_AFTER_BUSY: u64 = 1;
/// `retry_after_seconds` when nothing can hibernate for want of a
/// checkpoint store (a slot frees only when a session closes).
pub const RETRY_AFTER_NO_STORE: u64 = 10;

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            max_live_sessions: DEFAULT_MAX_LIVE_SESSIONS,
            max_live_sessions_per_tenant: DEFAULT_MAX_LIVE_SESSIONS_PER_TENANT,
            max_calls_per_tenant: DEFAULT_MAX_CALLS_PER_TENANT,
            memory_budget_bytes: default_memory_budget().0,
        }
    }
}

impl AdmissionConfig {
    /// No caps on live sessions or calls (the memory budget stays): for a
    /// local harness that asks for each worker it uses (`session --jsonl`).
    pub fn uncapped_sessions(self) -> Self {
        Self {
            max_live_sessions: usize::MAX,
            max_live_sessions_per_tenant: usize::MAX,
            max_calls_per_tenant: usize::MAX,
            ..self
        }
    }
}

/// The host's memory for workers and where the figure came from: the
/// smaller of this process's cgroup limit (v2 `memory.max`, or v1
/// `memory.limit_in_bytes`) and `MemTotal`.
pub fn host_memory() -> (u64, &'static str) {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| meminfo_kib(&m, "MemTotal:"))
        .map(|k| k * 1024);
    match (cgroup_limit(), total) {
        (Some(c), Some(t)) if c < t => (c, "cgroup"),
        (_, Some(t)) => (t, "meminfo"),
        (Some(c), None) => (c, "cgroup"),
        // Nothing readable: a conservative 4 GiB.
        (None, None) => (4 << 30, "assumed"),
    }
}

/// The default budget: three quarters of [`host_memory`], leaving a
/// quarter for the supervisor, the zygotes, the table store and the page
/// cache; and where the figure came from.
pub fn default_memory_budget() -> (u64, &'static str) {
    let (m, from) = host_memory();
    (m / 4 * 3, from)
}

fn meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l[key.len()..].split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// This process's cgroup memory limit, if it has one.
fn cgroup_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut limits = Vec::new();
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        let file = if controllers.is_empty() {
            format!("/sys/fs/cgroup/{path}/memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            format!("/sys/fs/cgroup/memory/{path}/memory.limit_in_bytes")
        } else {
            continue;
        };
        if let Some(v) = std::fs::read_to_string(file)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
        {
            // v1 says "no limit" with a huge number.
            if v < 1 << 60 {
                limits.push(v);
            }
        }
    }
    limits.into_iter().min()
}

/// How a worker's memory was measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// Proportional set size (`/proc/PID/smaps_rollup`).
    Pss,
    /// Resident set size (`/proc/PID/statm`): PSS was not readable.
    Rss,
}

/// The memory of process `pid`: PSS when readable, else RSS. `None`: the
/// process is gone.
pub fn process_memory(pid: u32) -> Option<(u64, Measure)> {
    if let Some(kib) = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|t| meminfo_kib(&t, "Pss:"))
    {
        return Some((kib * 1024, Measure::Pss));
    }
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = u64::try_from(page).ok().filter(|p| *p > 0).unwrap_or(4096);
    Some((pages * page, Measure::Rss))
}

/// The live workers' memory in all, and how it was measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerMemory {
    /// Bytes, summed over the live workers.
    pub bytes: u64,
    /// Workers measured by PSS.
    pub pss: usize,
    /// Workers measured by RSS.
    pub rss: usize,
}

impl WorkerMemory {
    /// `pss`, `rss`, `pss+rss` (some of each) or `none` (no live worker).
    pub fn how(&self) -> &'static str {
        match (self.pss > 0, self.rss > 0) {
            (true, false) => "pss",
            (false, true) => "rss",
            (true, true) => "pss+rss",
            (false, false) => "none",
        }
    }

    fn workers(&self) -> usize {
        self.pss + self.rss
    }
}

/// The limit a call ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Limit {
    /// `max_calls_per_tenant`.
    CallsPerTenant,
    /// `max_live_sessions_per_tenant`.
    LiveSessionsPerTenant,
    /// `max_live_sessions`.
    LiveSessions,
    /// `memory_budget_bytes`.
    MemoryBudget,
}

impl Limit {
    /// The label in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::CallsPerTenant => "calls_per_tenant",
            Limit::LiveSessionsPerTenant => "live_sessions_per_tenant",
            Limit::LiveSessions => "live_sessions",
            Limit::MemoryBudget => "memory_budget",
        }
    }

    /// A tenant's own cap (429 `quota`), else a host cap (503 `busy`).
    pub fn is_tenant_cap(self) -> bool {
        matches!(self, Limit::CallsPerTenant | Limit::LiveSessionsPerTenant)
    }
}

/// A call admission refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The limit.
    pub limit: Limit,
    /// What was hit and what to do.
    pub message: String,
    /// When to try again, seconds.
    pub retry_after_seconds: u64,
}

/// One session as admission sees it.
struct Seen {
    tenant: String,
    session: Session,
    status: SessionStatus,
}

/// Holds (or will hold) a worker: it has one, is starting one, or has a
/// call queued that will start one.
fn is_live(st: &SessionStatus) -> bool {
    st.state != SessionState::Closed
        && (st.pid.is_some()
            || matches!(st.state, SessionState::Starting | SessionState::Running)
            || st.queued > 0)
}

/// Can be hibernated now: a worker, nothing running or queued.
fn is_idle_live(st: &SessionStatus) -> bool {
    st.state == SessionState::Idle && st.pid.is_some() && st.idle_seconds.is_some()
}

/// Its checkpoint failed and is not due to be tried again (too large, over
/// quota, ...): hibernating it would only fail again, at the cost of
/// serialising its state, so it is not picked.
fn cannot_checkpoint(st: &SessionStatus) -> bool {
    st.checkpoint
        .as_ref()
        .is_some_and(|c| c.blocks_hibernation())
}

/// Calls running or queued in the session.
fn calls(st: &SessionStatus) -> usize {
    if st.state == SessionState::Closed {
        return 0;
    }
    // Not idle with nothing queued: one call is running. With calls
    // queued, one runs too once the runner has taken the first.
    let running = st.idle_seconds.is_none()
        && (st.queued == 0 || matches!(st.state, SessionState::Running | SessionState::Starting));
    st.queued + usize::from(running)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn mib(b: u64) -> u64 {
    b >> 20
}

/// Admission control: the limits, the gate that makes check-and-queue
/// atomic, and the counters for metrics.
#[derive(Debug)]
pub struct Admission {
    cfg: AdmissionConfig,
    /// Whether sessions can hibernate (the supervisor has a checkpoint
    /// store).
    can_hibernate: bool,
    /// Held while a call is checked and queued, so racing calls cannot
    /// pass a cap together (released while waiting for a hibernation).
    gate: Mutex<()>,
    refusals: Mutex<BTreeMap<Limit, u64>>,
    /// Hibernations admission asked for, by the limit that needed room
    /// (the monitor's under `memory_budget` too).
    hibernations: Mutex<BTreeMap<Limit, u64>>,
    /// Moving average of the memory of idle workers picked to hibernate.
    settled_worker_bytes: AtomicU64,
}

impl Admission {
    /// Admission with `cfg`; `can_hibernate` when the supervisor keeps
    /// checkpoints.
    pub fn new(cfg: AdmissionConfig, can_hibernate: bool) -> Self {
        Self {
            cfg,
            can_hibernate,
            gate: Mutex::new(()),
            refusals: Mutex::new(BTreeMap::new()),
            hibernations: Mutex::new(BTreeMap::new()),
            settled_worker_bytes: AtomicU64::new(0),
        }
    }

    /// The limits.
    pub fn config(&self) -> &AdmissionConfig {
        &self.cfg
    }

    fn budget(&self) -> Option<u64> {
        (self.cfg.memory_budget_bytes != u64::MAX).then_some(self.cfg.memory_budget_bytes)
    }

    fn look(sessions: Vec<(String, Session)>) -> Vec<Seen> {
        sessions
            .into_iter()
            .map(|(tenant, session)| {
                let status = session.status();
                Seen {
                    tenant,
                    session,
                    status,
                }
            })
            .collect()
    }

    fn memory(seen: &[Seen]) -> WorkerMemory {
        let mut m = WorkerMemory::default();
        for s in seen {
            if let Some((b, how)) = s.status.pid.and_then(process_memory) {
                m.bytes += b;
                match how {
                    Measure::Pss => m.pss += 1,
                    Measure::Rss => m.rss += 1,
                }
            }
        }
        m
    }

    /// The least recently used idle live session, of `tenant` if given,
    /// not in `skip`, whose state can be checkpointed.
    fn victim<'a>(
        seen: &'a [Seen],
        tenant: Option<&str>,
        skip: &HashSet<String>,
    ) -> Option<&'a Seen> {
        seen.iter()
            .filter(|s| is_idle_live(&s.status))
            .filter(|s| tenant.is_none_or(|t| s.tenant == t))
            .filter(|s| !skip.contains(&s.status.id))
            .filter(|s| !cannot_checkpoint(&s.status))
            .max_by(|a, b| {
                let (x, y) = (a.status.idle_seconds, b.status.idle_seconds);
                x.unwrap_or(0.0).total_cmp(&y.unwrap_or(0.0))
            })
    }

    fn refuse(&self, limit: Limit, message: String, retry_after_seconds: u64) -> Refusal {
        *lock(&self.refusals).entry(limit).or_default() += 1;
        Refusal {
            limit,
            message,
            retry_after_seconds,
        }
    }

    /// Admits a call of `tenant` to session `target` (one of `sessions()`)
    /// and runs `queue` while the gate is held, so that the call is counted
    /// before anyone else is checked. Hibernates idle sessions to make
    /// room when needed (waiting for each, bounded); `Err` when nothing
    /// can.
    pub fn admit<T>(
        &self,
        sessions: impl Fn() -> Vec<(String, Session)>,
        tenant: &str,
        target: &str,
        queue: impl FnOnce() -> T,
    ) -> Result<T, Refusal> {
        let deadline = Instant::now() + HIBERNATE_WAIT;
        let mut skip = HashSet::new();
        loop {
            let gate = lock(&self.gate);
            let seen = Self::look(sessions());
            let cfg = &self.cfg;
            let mine: Vec<&Seen> = seen.iter().filter(|s| s.tenant == tenant).collect();
            let calls_now: usize = mine.iter().map(|s| calls(&s.status)).sum();
            if calls_now >= cfg.max_calls_per_tenant {
                return Err(self.refuse(
                    Limit::CallsPerTenant,
                    format!(
                        "you have {calls_now} calls running or queued across your sessions, the \
                         most allowed at once (max_calls_per_tenant {}); wait for one to finish, \
                         then retry",
                        cfg.max_calls_per_tenant
                    ),
                    RETRY_AFTER_BUSY,
                ));
            }
            let live_target = seen
                .iter()
                .find(|s| s.status.id == target)
                .is_none_or(|s| is_live(&s.status));
            if live_target {
                return Ok(queue());
            }
            let live_mine = mine.iter().filter(|s| is_live(&s.status)).count();
            let live_all = seen.iter().filter(|s| is_live(&s.status)).count();
            let over = if live_mine >= cfg.max_live_sessions_per_tenant {
                Some((
                    Limit::LiveSessionsPerTenant,
                    Some(tenant),
                    format!(
                        "you have {live_mine} sessions holding a worker, the most allowed at once \
                         (max_live_sessions_per_tenant {})",
                        cfg.max_live_sessions_per_tenant
                    ),
                ))
            } else if live_all >= cfg.max_live_sessions {
                Some((
                    Limit::LiveSessions,
                    None,
                    format!(
                        "the server has {live_all} sessions holding a worker, the most it runs \
                         at once (max_live_sessions {})",
                        cfg.max_live_sessions
                    ),
                ))
            } else {
                self.budget().and_then(|budget| {
                    let m = Self::memory(&seen);
                    // One more worker, estimated as the mean of the live
                    // ones or of the settled workers seen hibernating,
                    // whichever is larger; with none live the call is let
                    // in (the worker's own limits bound it).
                    let more = (m.bytes / m.workers().max(1) as u64)
                        .max(self.settled_worker_bytes.load(Ordering::Relaxed));
                    (m.workers() > 0 && m.bytes.saturating_add(more) > budget).then(|| {
                        (
                            Limit::MemoryBudget,
                            None,
                            format!(
                                "the live sessions' workers use {} MiB and one more would pass \
                                 the server's memory budget of {} MiB",
                                mib(m.bytes),
                                mib(budget)
                            ),
                        )
                    })
                })
            };
            let Some((limit, of_tenant, what)) = over else {
                return Ok(queue());
            };
            let advice = if limit.is_tenant_cap() {
                "wait for a call to finish or close one of your sessions, then retry"
            } else {
                "retry shortly"
            };
            if !self.can_hibernate {
                return Err(self.refuse(
                    limit,
                    format!(
                        "{what}; this server keeps no checkpoints (start it with --state-dir \
                         DIR), so no idle session can be hibernated to make room: {advice}"
                    ),
                    RETRY_AFTER_NO_STORE,
                ));
            }
            let victim = Self::victim(&seen, of_tenant, &skip);
            let Some(v) = victim.filter(|_| Instant::now() < deadline) else {
                let stuck = seen
                    .iter()
                    .filter(|s| of_tenant.is_none_or(|t| s.tenant == t))
                    .filter(|s| is_idle_live(&s.status) && cannot_checkpoint(&s.status))
                    .count();
                let why = if stuck == 0 {
                    "every one of them is running a call, so none can be hibernated to make \
                     room"
                        .to_string()
                } else {
                    format!(
                        "none can be hibernated to make room: {stuck} idle one{} cannot be \
                         checkpointed (its status's checkpoint.failure says why), the others \
                         are running calls",
                        if stuck == 1 { "" } else { "s" }
                    )
                };
                return Err(self.refuse(
                    limit,
                    format!("{what}, and {why}: {advice}"),
                    RETRY_AFTER_BUSY,
                ));
            };
            let (id, session) = (v.status.id.clone(), v.session.clone());
            if let Some((bytes, _)) = v.status.pid.and_then(process_memory) {
                self.note_settled(bytes);
            }
            drop(seen);
            drop(gate);
            let left = deadline.saturating_duration_since(Instant::now());
            // Each session is asked once per call: one that hibernated
            // and still looks live (it got a call) is not asked again.
            skip.insert(id.clone());
            match session.hibernate_and_wait(left) {
                Ok(()) => {
                    *lock(&self.hibernations).entry(limit).or_default() += 1;
                    tracing::info!(target: "rvisor::admission", session = %id, limit = limit.as_str(), "hibernated to make room");
                }
                Err(why) => {
                    tracing::debug!(target: "rvisor::admission", session = %id, %why, "could not hibernate");
                }
            }
        }
    }

    /// One round of the memory monitor: while the live workers use more
    /// than the budget, hibernate the least recently used idle session.
    /// The number hibernated.
    pub fn relieve_memory(&self, sessions: impl Fn() -> Vec<(String, Session)>) -> usize {
        let Some(budget) = self.budget().filter(|_| self.can_hibernate) else {
            return 0;
        };
        let mut skip = HashSet::new();
        let mut done = 0;
        loop {
            let seen = Self::look(sessions());
            let m = Self::memory(&seen);
            if m.bytes <= budget {
                return done;
            }
            // Idle sessions, least recently used first, until their memory
            // covers the excess over 7/8 of the budget (room for the
            // workers that grow after their calls): hibernated together,
            // so the host is back under in about one hibernation's time.
            let mut excess = m.bytes - budget / 8 * 7;
            let mut batch = Vec::new();
            while excess > 0 {
                let Some(v) = Self::victim(&seen, None, &skip) else {
                    break;
                };
                skip.insert(v.status.id.clone());
                let bytes = v.status.pid.and_then(process_memory).map_or(0, |m| m.0);
                self.note_settled(bytes);
                excess = excess.saturating_sub(bytes.max(1));
                batch.push((v.status.id.clone(), v.session.clone()));
            }
            drop(seen);
            if batch.is_empty() {
                return done;
            }
            let ok = std::thread::scope(|scope| {
                let waits: Vec<_> = batch
                    .iter()
                    .map(|(_, s)| scope.spawn(move || s.hibernate_and_wait(HIBERNATE_WAIT).is_ok()))
                    .collect();
                waits
                    .into_iter()
                    .map(|w| w.join().unwrap_or(false))
                    .collect::<Vec<bool>>()
            });
            for ((id, _), ok) in batch.iter().zip(ok) {
                if ok {
                    done += 1;
                    *lock(&self.hibernations)
                        .entry(Limit::MemoryBudget)
                        .or_default() += 1;
                    tracing::info!(target: "rvisor::admission", session = %id, used_mib = mib(m.bytes), budget_mib = mib(budget), "memory over budget: hibernated");
                }
            }
        }
    }

    /// Remembers the memory of a worker that settled (idle after calls):
    /// a moving average admission uses to estimate the next worker, since
    /// a freshly forked one shares most pages and measures small at first.
    fn note_settled(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let old = self.settled_worker_bytes.load(Ordering::Relaxed);
        let new = if old == 0 {
            bytes
        } else {
            old / 4 * 3 + bytes / 4
        };
        self.settled_worker_bytes.store(new, Ordering::Relaxed);
    }

    /// Starts the memory monitor: a round every [`MONITOR_PERIOD`] until
    /// `stop` says stop (its sender dropped with the service) or
    /// `sessions` gives `None` (the service is gone). Nothing starts
    /// without a budget or a checkpoint store.
    pub fn spawn_monitor(
        self: &Arc<Self>,
        sessions: impl Fn() -> Option<Vec<(String, Session)>> + Send + 'static,
        stop: Receiver<()>,
    ) {
        if self.budget().is_none() || !self.can_hibernate {
            return;
        }
        let me = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("rvisor-admission".into())
            .spawn(move || loop {
                match stop.recv_timeout(MONITOR_PERIOD) {
                    Err(RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
                let Some(a) = me.upgrade() else { return };
                if sessions().is_none() {
                    return;
                }
                a.relieve_memory(|| sessions().unwrap_or_default());
            });
        if let Err(e) = spawned {
            tracing::warn!(target: "rvisor::admission", "the memory monitor did not start: {e}");
        }
    }

    /// Health's `admission` object: each limit (null: none) and its use now.
    pub fn report(&self, sessions: Vec<(String, Session)>) -> Value {
        let seen = Self::look(sessions);
        let m = Self::memory(&seen);
        let mut live_by_tenant: BTreeMap<&str, usize> = BTreeMap::new();
        let mut calls_by_tenant: BTreeMap<&str, usize> = BTreeMap::new();
        for s in &seen {
            if is_live(&s.status) {
                *live_by_tenant.entry(&s.tenant).or_default() += 1;
            }
            *calls_by_tenant.entry(&s.tenant).or_default() += calls(&s.status);
        }
        let cap = |n: usize| (n != usize::MAX).then_some(n);
        let c = &self.cfg;
        json!({
            "max_live_sessions": cap(c.max_live_sessions),
            "max_live_sessions_per_tenant": cap(c.max_live_sessions_per_tenant),
            "max_calls_per_tenant": cap(c.max_calls_per_tenant),
            "memory_budget_bytes": self.budget(),
            "can_hibernate": self.can_hibernate,
            "live_sessions": live_by_tenant.values().sum::<usize>(),
            "hibernated_sessions": seen.iter().filter(|s| s.status.state == SessionState::Hibernated).count(),
            "live_sessions_of_busiest_tenant": live_by_tenant.values().max().copied().unwrap_or(0),
            "calls_in_flight": calls_by_tenant.values().sum::<usize>(),
            "calls_of_busiest_tenant": calls_by_tenant.values().max().copied().unwrap_or(0),
            "worker_memory_bytes": m.bytes,
            "worker_memory_measured": m.how(),
            "refusals": self.counts(&self.refusals),
            "hibernations": self.counts(&self.hibernations),
        })
    }

    fn counts(&self, m: &Mutex<BTreeMap<Limit, u64>>) -> Value {
        lock(m)
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), json!(v)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }

    /// Prometheus text: live and hibernated sessions, workers' memory, the
    /// budget and the caps (gauges), refusals and hibernations by limit
    /// (counters).
    pub fn metrics_text(&self, sessions: Vec<(String, Session)>) -> String {
        let seen = Self::look(sessions);
        let m = Self::memory(&seen);
        let live = seen.iter().filter(|s| is_live(&s.status)).count();
        let hibernated = seen
            .iter()
            .filter(|s| s.status.state == SessionState::Hibernated)
            .count();
        let mut out = format!(
            "# HELP rvisor_live_sessions Sessions holding a worker.\n# TYPE rvisor_live_sessions gauge\nrvisor_live_sessions {live}\n\
             # HELP rvisor_hibernated_sessions Sessions checkpointed with no worker.\n# TYPE rvisor_hibernated_sessions gauge\nrvisor_hibernated_sessions {hibernated}\n\
             # HELP rvisor_worker_memory_bytes Memory of the live workers (PSS, else RSS).\n# TYPE rvisor_worker_memory_bytes gauge\nrvisor_worker_memory_bytes {}\n",
            m.bytes
        );
        if let Some(b) = self.budget() {
            out.push_str(&format!(
                "# HELP rvisor_memory_budget_bytes The live workers' memory budget.\n# TYPE rvisor_memory_budget_bytes gauge\nrvisor_memory_budget_bytes {b}\n"
            ));
        }
        out.push_str("# HELP rvisor_admission_limit Admission caps (absent: none).\n# TYPE rvisor_admission_limit gauge\n");
        for (name, v) in [
            ("max_live_sessions", self.cfg.max_live_sessions),
            (
                "max_live_sessions_per_tenant",
                self.cfg.max_live_sessions_per_tenant,
            ),
            ("max_calls_per_tenant", self.cfg.max_calls_per_tenant),
        ] {
            if v != usize::MAX {
                out.push_str(&format!("rvisor_admission_limit{{limit=\"{name}\"}} {v}\n"));
            }
        }
        out.push_str("# HELP rvisor_admission_refusals_total Calls refused by admission, by limit.\n# TYPE rvisor_admission_refusals_total counter\n");
        for (k, v) in lock(&self.refusals).iter() {
            out.push_str(&format!(
                "rvisor_admission_refusals_total{{limit=\"{}\"}} {v}\n",
                k.as_str()
            ));
        }
        out.push_str("# HELP rvisor_admission_hibernations_total Sessions hibernated to make room, by limit.\n# TYPE rvisor_admission_hibernations_total counter\n");
        for (k, v) in lock(&self.hibernations).iter() {
            out.push_str(&format!(
                "rvisor_admission_hibernations_total{{limit=\"{}\"}} {v}\n",
                k.as_str()
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_own_memory_are_read() {
        let (m, from) = host_memory();
        assert!(m > 64 << 20, "{m} from {from}");
        assert!(default_memory_budget().0 < m);
        let (bytes, _) = process_memory(std::process::id()).expect("this process");
        assert!(bytes > 0);
        assert_eq!(process_memory(u32::MAX), None);
        assert_eq!(meminfo_kib("Pss:   1234 kB\n", "Pss:"), Some(1234));
    }

    #[test]
    fn measurements_name_how() {
        let mut m = WorkerMemory::default();
        assert_eq!(m.how(), "none");
        m.pss = 1;
        assert_eq!(m.how(), "pss");
        m.rss = 2;
        assert_eq!(m.how(), "pss+rss");
    }

    fn status(
        state: SessionState,
        pid: Option<u32>,
        queued: usize,
        idle: Option<f64>,
    ) -> SessionStatus {
        SessionStatus {
            id: "s".into(),
            state,
            generation: 1,
            queued,
            last_reset: None,
            pid,
            working_dir: String::new(),
            running: None,
            idle_seconds: idle,
            checkpoint: None,
        }
    }

    #[test]
    fn a_session_whose_checkpoint_fails_is_not_picked_to_hibernate() {
        use rvisor::checkpoint::{
            CheckpointFailure, CheckpointFailureKind, CheckpointState, CheckpointStatus,
        };
        let failed = |retry: Option<f64>| CheckpointStatus {
            state: CheckpointState::Failed,
            taken_at: None,
            bytes: None,
            calls_since: 1,
            failure: Some(CheckpointFailure {
                kind: CheckpointFailureKind::TooLarge,
                reason: "too large".into(),
                since: String::new(),
                attempts: 1,
                retry_in_seconds: retry,
            }),
        };
        let mut st = status(SessionState::Idle, Some(7), 0, Some(100.0));
        assert!(!cannot_checkpoint(&st));
        st.checkpoint = Some(failed(None));
        assert!(cannot_checkpoint(&st), "too large, no call since");
        st.checkpoint = Some(failed(Some(12.0)));
        assert!(cannot_checkpoint(&st), "backing off");
        st.checkpoint = Some(failed(Some(0.0)));
        assert!(!cannot_checkpoint(&st), "due again");
    }

    #[test]
    fn live_idle_and_calls_follow_the_status() {
        let idle = status(SessionState::Idle, Some(7), 0, Some(3.0));
        assert!(is_live(&idle) && is_idle_live(&idle));
        assert_eq!(calls(&idle), 0);
        let running = status(SessionState::Running, Some(7), 2, None);
        assert!(is_live(&running) && !is_idle_live(&running));
        assert_eq!(calls(&running), 3);
        let asleep = status(SessionState::Hibernated, None, 0, Some(9.0));
        assert!(!is_live(&asleep));
        assert_eq!(calls(&asleep), 0);
        // A call queued to a hibernated session: live (it will start a
        // worker), one call, not running yet.
        let waking = status(SessionState::Hibernated, None, 1, None);
        assert!(is_live(&waking));
        assert_eq!(calls(&waking), 1);
        let closed = status(SessionState::Closed, None, 0, None);
        assert!(!is_live(&closed));
        assert_eq!(calls(&closed), 0);
    }

    #[test]
    fn limits_say_which_kind_of_refusal() {
        assert!(Limit::CallsPerTenant.is_tenant_cap());
        assert!(Limit::LiveSessionsPerTenant.is_tenant_cap());
        assert!(!Limit::LiveSessions.is_tenant_cap());
        assert!(!Limit::MemoryBudget.is_tenant_cap());
        let u = AdmissionConfig::default().uncapped_sessions();
        assert_eq!(u.max_live_sessions, usize::MAX);
        assert_eq!(u.memory_budget_bytes, default_memory_budget().0);
    }
}
