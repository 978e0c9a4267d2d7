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
//! Memory has a host budget and, optionally, a cap per tenant. Over the
//! host budget each tenant's fair share is the budget over the tenants
//! with live workers, and only the tenants over their share (or their
//! cap) are made to give memory back: one tenant's growth never refuses
//! or stops another tenant's calls.
//!
//! A monitor thread ([`Admission::spawn_monitor`]) measures the live
//! workers' memory about once a second; while a tenant is over its cap or
//! the sum is over the budget it hibernates idle sessions (least recently
//! used first, the tenants over their share first), and when the running
//! calls themselves hold the memory it stops the largest running worker
//! of the tenant most over its share ([`rvisor::Session::kill_worker`]).
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
    /// Memory one tenant's live workers may use together, bytes
    /// (`u64::MAX`: only the host budget and its fair shares bound it).
    pub tenant_memory_bytes: u64,
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
            tenant_memory_bytes: u64::MAX,
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
    /// `tenant_memory_bytes`.
    TenantMemory,
    /// The host's memory budget is used up and the tenant holds more
    /// than its fair share of it (the budget over the tenants using it).
    FairShare,
}

impl Limit {
    /// The label in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::CallsPerTenant => "calls_per_tenant",
            Limit::LiveSessionsPerTenant => "live_sessions_per_tenant",
            Limit::LiveSessions => "live_sessions",
            Limit::MemoryBudget => "memory_budget",
            Limit::TenantMemory => "tenant_memory",
            Limit::FairShare => "fair_share",
        }
    }

    /// A tenant's own cap (429 `quota`: its own use is what to reduce),
    /// else a host cap (503 `busy`).
    pub fn is_tenant_cap(self) -> bool {
        matches!(
            self,
            Limit::CallsPerTenant
                | Limit::LiveSessionsPerTenant
                | Limit::TenantMemory
                | Limit::FairShare
        )
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
    /// Its worker's memory, when measured ([`Admission::measure`]).
    bytes: u64,
}

/// The live workers' memory, in all and by tenant.
#[derive(Debug, Default)]
struct Use {
    all: WorkerMemory,
    by_tenant: BTreeMap<String, u64>,
}

impl Use {
    fn of(&self, tenant: &str) -> u64 {
        self.by_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// The budget over the tenants with live workers (and `also`, the one
    /// asking, if it has none yet).
    fn fair_share(&self, budget: u64, also: Option<&str>) -> (u64, usize) {
        let mut n = self.by_tenant.values().filter(|b| **b > 0).count();
        if also.is_some_and(|t| self.of(t) == 0) {
            n += 1;
        }
        let n = n.max(1);
        (budget / n as u64, n)
    }
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

/// A tenant over a memory limit, as the monitor sees it.
struct Over {
    tenant: String,
    excess: u64,
    limit: Limit,
    what: String,
}

/// How long the monitor lets a worker it stopped exit before it measures
/// again.
const KILL_SETTLE: Duration = Duration::from_millis(100);

/// What [`Admission::memory_check`] found.
enum MemoryCheck {
    Fits,
    /// The limit passed, whose idle sessions may hibernate to make room,
    /// and what was passed.
    Over(Limit, Box<dyn Fn(&Seen) -> bool>, String),
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
    /// Workers the monitor stopped during a call, by the limit passed.
    kills: Mutex<BTreeMap<Limit, u64>>,
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
            kills: Mutex::new(BTreeMap::new()),
        }
    }

    /// The limits.
    pub fn config(&self) -> &AdmissionConfig {
        &self.cfg
    }

    fn budget(&self) -> Option<u64> {
        (self.cfg.memory_budget_bytes != u64::MAX).then_some(self.cfg.memory_budget_bytes)
    }

    fn tenant_budget(&self) -> Option<u64> {
        (self.cfg.tenant_memory_bytes != u64::MAX).then_some(self.cfg.tenant_memory_bytes)
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
                    bytes: 0,
                }
            })
            .collect()
    }

    /// Measures every live worker of `seen` (kept in each `Seen`).
    fn measure(seen: &mut [Seen]) -> Use {
        let mut u = Use::default();
        for s in seen.iter_mut() {
            if let Some((b, how)) = s.status.pid.and_then(process_memory) {
                s.bytes = b;
                u.all.bytes += b;
                *u.by_tenant.entry(s.tenant.clone()).or_default() += b;
                match how {
                    Measure::Pss => u.all.pss += 1,
                    Measure::Rss => u.all.rss += 1,
                }
            }
        }
        u
    }

    fn memory(seen: &mut [Seen]) -> WorkerMemory {
        Self::measure(seen).all
    }

    /// The least recently used idle live session that `pick` accepts, not
    /// in `skip`, whose state can be checkpointed.
    fn victim<'a>(
        seen: &'a [Seen],
        pick: impl Fn(&Seen) -> bool,
        skip: &HashSet<String>,
    ) -> Option<&'a Seen> {
        seen.iter()
            .filter(|s| is_idle_live(&s.status))
            .filter(|s| pick(s))
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
            let mut seen = Self::look(sessions());
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
            // Whose idle sessions may hibernate to make room.
            let of_tenant = |t: &str| {
                let t = t.to_string();
                Box::new(move |s: &Seen| s.tenant == t) as Box<dyn Fn(&Seen) -> bool>
            };
            let anyone = || Box::new(|_: &Seen| true) as Box<dyn Fn(&Seen) -> bool>;
            let over = if live_mine >= cfg.max_live_sessions_per_tenant {
                Some((
                    Limit::LiveSessionsPerTenant,
                    of_tenant(tenant),
                    format!(
                        "you have {live_mine} sessions holding a worker, the most allowed at once \
                         (max_live_sessions_per_tenant {})",
                        cfg.max_live_sessions_per_tenant
                    ),
                ))
            } else if live_all >= cfg.max_live_sessions {
                Some((
                    Limit::LiveSessions,
                    anyone(),
                    format!(
                        "the server has {live_all} sessions holding a worker, the most it runs \
                         at once (max_live_sessions {})",
                        cfg.max_live_sessions
                    ),
                ))
            } else {
                match self.memory_check(&mut seen, tenant) {
                    MemoryCheck::Fits => None,
                    MemoryCheck::Over(limit, pick, what) => Some((limit, pick, what)),
                }
            };
            let Some((limit, pick, what)) = over else {
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
            let victim = Self::victim(&seen, &pick, &skip);
            let Some(v) = victim.filter(|_| Instant::now() < deadline) else {
                if limit == Limit::MemoryBudget {
                    // The host is over its budget, but not by this
                    // tenant, which is within its fair share: the
                    // tenants over theirs are made to give memory back
                    // (the monitor stops their calls if it must); this
                    // tenant is let in.
                    return Ok(queue());
                }
                let stuck = seen
                    .iter()
                    .filter(|s| pick(s))
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

    /// Whether one more worker for `tenant` fits the memory budgets, and
    /// if not, which limit it passes and whose idle sessions may
    /// hibernate to make room:
    /// - the tenant's own cap (`tenant_memory_bytes`): its own sessions;
    /// - the host budget, when the tenant holds more than its fair share
    ///   (the budget over the tenants with live workers): its own;
    /// - the host budget, when the tenant is within its fair share: the
    ///   sessions of the tenants over theirs, and if none can hibernate
    ///   the call is let in anyway (one tenant's growth must never lock
    ///   the others out).
    fn memory_check(&self, seen: &mut [Seen], tenant: &str) -> MemoryCheck {
        if self.budget().is_none() && self.tenant_budget().is_none() {
            return MemoryCheck::Fits;
        }
        let u = Self::measure(seen);
        let m = &u.all;
        // One more worker, estimated as the mean of the live ones or of
        // the settled workers seen hibernating, whichever is larger; with
        // none live the call is let in (the worker's own limits bound it).
        if m.workers() == 0 {
            return MemoryCheck::Fits;
        }
        let more =
            (m.bytes / m.workers() as u64).max(self.settled_worker_bytes.load(Ordering::Relaxed));
        let mine = u.of(tenant);
        let own = {
            let t = tenant.to_string();
            Box::new(move |s: &Seen| s.tenant == t) as Box<dyn Fn(&Seen) -> bool>
        };
        if let Some(cap) = self.tenant_budget() {
            if mine.saturating_add(more) > cap {
                return MemoryCheck::Over(
                    Limit::TenantMemory,
                    own,
                    format!(
                        "your sessions' workers use {} MiB, and one more would pass your share \
                         of the server's memory ({} MiB, tenant_memory_budget)",
                        mib(mine),
                        mib(cap)
                    ),
                );
            }
        }
        let Some(budget) = self.budget() else {
            return MemoryCheck::Fits;
        };
        if m.bytes.saturating_add(more) <= budget {
            return MemoryCheck::Fits;
        }
        let (fair, n) = u.fair_share(budget, Some(tenant));
        if mine.saturating_add(more) > fair {
            return MemoryCheck::Over(
                Limit::FairShare,
                own,
                format!(
                    "the live sessions' workers use {} MiB of the server's memory budget of {} \
                     MiB, and yours use {} MiB: one more would pass your fair share ({} MiB, the \
                     budget over the {n} tenants using it)",
                    mib(m.bytes),
                    mib(budget),
                    mib(mine),
                    mib(fair)
                ),
            );
        }
        let over_fair: HashSet<String> = u
            .by_tenant
            .iter()
            .filter(|(t, b)| **b > fair && t.as_str() != tenant)
            .map(|(t, _)| t.clone())
            .collect();
        MemoryCheck::Over(
            Limit::MemoryBudget,
            Box::new(move |s: &Seen| over_fair.contains(&s.tenant)),
            format!(
                "the live sessions' workers use {} MiB and one more would pass the server's \
                 memory budget of {} MiB",
                mib(m.bytes),
                mib(budget)
            ),
        )
    }

    /// One round of the memory monitor. While a tenant's live workers use
    /// more than its cap, or all of them more than the budget:
    /// - idle sessions hibernate, least recently used first: the sessions
    ///   of the tenants over their cap or fair share first, then (over the
    ///   budget) anyone's, down to 7/8 of the budget, together;
    /// - when nothing idle is left to hibernate and the memory is still
    ///   over, the largest worker running a call of the tenant most over
    ///   its cap or fair share is stopped: its call ends as
    ///   `worker_failed` saying why, and the session goes on from its last
    ///   checkpoint. Only tenants over their share lose calls this way.
    ///
    /// The number of sessions hibernated or stopped.
    pub fn relieve_memory(&self, sessions: impl Fn() -> Vec<(String, Session)>) -> usize {
        if self.budget().is_none() && self.tenant_budget().is_none() {
            return 0;
        }
        let mut skip = HashSet::new();
        let mut done = 0;
        loop {
            let mut seen = Self::look(sessions());
            let u = Self::measure(&mut seen);
            let overs = self.overs(&u);
            if overs.is_empty() {
                return done;
            }
            let mut batch: Vec<(String, Session, Limit)> = Vec::new();
            if self.can_hibernate {
                let mut taken = 0u64;
                for o in &overs {
                    let mut excess = o.excess;
                    while excess > 0 {
                        let Some(v) = Self::victim(&seen, |s| s.tenant == o.tenant, &skip) else {
                            break;
                        };
                        skip.insert(v.status.id.clone());
                        self.note_settled(v.bytes);
                        excess = excess.saturating_sub(v.bytes.max(1));
                        taken += v.bytes;
                        // Counted by the budget that is passed: a fair
                        // share is the host's budget divided.
                        let limit = match o.limit {
                            Limit::FairShare => Limit::MemoryBudget,
                            l => l,
                        };
                        batch.push((v.status.id.clone(), v.session.clone(), limit));
                    }
                }
                // Over the budget: anyone's idle sessions next, until what
                // hibernates covers the excess over 7/8 of it (room for
                // workers that grow after their calls).
                if let Some(budget) = self.budget().filter(|b| u.all.bytes > *b) {
                    let mut excess = (u.all.bytes - budget / 8 * 7).saturating_sub(taken);
                    while excess > 0 {
                        let Some(v) = Self::victim(&seen, |_| true, &skip) else {
                            break;
                        };
                        skip.insert(v.status.id.clone());
                        self.note_settled(v.bytes);
                        excess = excess.saturating_sub(v.bytes.max(1));
                        batch.push((v.status.id.clone(), v.session.clone(), Limit::MemoryBudget));
                    }
                }
            }
            if !batch.is_empty() {
                drop(seen);
                let ok = std::thread::scope(|scope| {
                    let waits: Vec<_> = batch
                        .iter()
                        .map(|(_, s, _)| {
                            scope.spawn(move || s.hibernate_and_wait(HIBERNATE_WAIT).is_ok())
                        })
                        .collect();
                    waits
                        .into_iter()
                        .map(|w| w.join().unwrap_or(false))
                        .collect::<Vec<bool>>()
                });
                for ((id, _, limit), ok) in batch.iter().zip(ok) {
                    if ok {
                        done += 1;
                        *lock(&self.hibernations).entry(*limit).or_default() += 1;
                        tracing::info!(target: "rvisor::admission", session = %id, used_mib = mib(u.all.bytes), limit = limit.as_str(), "memory over budget: hibernated");
                    }
                }
                continue;
            }
            // Nothing idle to hibernate: the calls themselves hold the
            // memory. Stop the largest running worker of the tenant most
            // over its share.
            let Some(o) = overs.iter().max_by_key(|o| o.excess) else {
                return done;
            };
            let Some(v) = seen
                .iter()
                .filter(|s| s.tenant == o.tenant && s.status.pid.is_some())
                .filter(|s| !is_idle_live(&s.status) && !skip.contains(&s.status.id))
                .max_by_key(|s| s.bytes)
            else {
                return done;
            };
            skip.insert(v.status.id.clone());
            let why = format!(
                "{}; this call's worker used {} MiB and was stopped to give the memory back (the \
                 session goes on from its last checkpoint, if it has one). Use less memory in \
                 one call, or close sessions you do not need",
                o.what,
                mib(v.bytes)
            );
            if v.session.kill_worker(&why) {
                done += 1;
                *lock(&self.kills).entry(o.limit).or_default() += 1;
                tracing::warn!(target: "rvisor::admission", session = %v.status.id, tenant = %o.tenant, worker_mib = mib(v.bytes), limit = o.limit.as_str(), "memory over budget: stopped a running call's worker");
            }
            drop(seen);
            // Let the killed worker's memory go before measuring again.
            std::thread::sleep(KILL_SETTLE);
        }
    }

    /// The tenants over their cap, and (over the host budget) over their
    /// fair share of it, with their excess and what it is.
    fn overs(&self, u: &Use) -> Vec<Over> {
        let mut out: Vec<Over> = Vec::new();
        if let Some(cap) = self.tenant_budget() {
            for (t, b) in u.by_tenant.iter().filter(|(_, b)| **b > cap) {
                out.push(Over {
                    tenant: t.clone(),
                    excess: b - cap,
                    limit: Limit::TenantMemory,
                    what: format!(
                        "your sessions' workers used {} MiB, over your share of the server's \
                         memory ({} MiB, tenant_memory_budget)",
                        mib(*b),
                        mib(cap)
                    ),
                });
            }
        }
        if let Some(budget) = self.budget().filter(|b| u.all.bytes > *b) {
            let (fair, n) = u.fair_share(budget, None);
            for (t, b) in u.by_tenant.iter().filter(|(_, b)| **b > fair) {
                if out.iter().any(|o| &o.tenant == t) {
                    continue;
                }
                out.push(Over {
                    tenant: t.clone(),
                    excess: b - fair,
                    limit: Limit::FairShare,
                    what: format!(
                        "the server's workers used {} MiB, over its memory budget of {} MiB, and \
                         your sessions' {} MiB were over your fair share of it ({} MiB, the \
                         budget over the {n} tenants using it)",
                        mib(u.all.bytes),
                        mib(budget),
                        mib(*b),
                        mib(fair)
                    ),
                });
            }
        }
        out
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
        if self.budget().is_none() && self.tenant_budget().is_none() {
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
        let mut seen = Self::look(sessions);
        let u = Self::measure(&mut seen);
        let m = &u.all;
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
            "tenant_memory_budget_bytes": self.tenant_budget(),
            "can_hibernate": self.can_hibernate,
            "live_sessions": live_by_tenant.values().sum::<usize>(),
            "hibernated_sessions": seen.iter().filter(|s| s.status.state == SessionState::Hibernated).count(),
            "live_sessions_of_busiest_tenant": live_by_tenant.values().max().copied().unwrap_or(0),
            "calls_in_flight": calls_by_tenant.values().sum::<usize>(),
            "calls_of_busiest_tenant": calls_by_tenant.values().max().copied().unwrap_or(0),
            "worker_memory_bytes": m.bytes,
            "worker_memory_measured": m.how(),
            "worker_memory_of_busiest_tenant_bytes": u.by_tenant.values().max().copied().unwrap_or(0),
            "refusals": self.counts(&self.refusals),
            "hibernations": self.counts(&self.hibernations),
            "stopped_calls": self.counts(&self.kills),
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
        let mut seen = Self::look(sessions);
        let m = Self::memory(&mut seen);
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
        out.push_str("# HELP rvisor_admission_stopped_calls_total Running calls whose workers were stopped to bring memory back under a budget, by limit.\n# TYPE rvisor_admission_stopped_calls_total counter\n");
        for (k, v) in lock(&self.kills).iter() {
            out.push_str(&format!(
                "rvisor_admission_stopped_calls_total{{limit=\"{}\"}} {v}\n",
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

    fn used(by: &[(&str, u64)]) -> Use {
        let mut u = Use::default();
        for (t, b) in by {
            u.by_tenant.insert(t.to_string(), *b);
            u.all.bytes += b;
            u.all.pss += 1;
        }
        u
    }

    #[test]
    fn fair_shares_divide_the_budget_over_the_tenants_using_it() {
        let u = used(&[("a", 900), ("b", 100)]);
        assert_eq!(u.fair_share(1000, None), (500, 2));
        // A tenant with no worker yet counts too when it asks.
        assert_eq!(u.fair_share(900, Some("c")), (300, 3));
        assert_eq!(u.fair_share(900, Some("a")), (450, 2));
        assert_eq!(Use::default().fair_share(800, None), (800, 1));
    }

    #[test]
    fn only_the_tenants_over_their_share_are_made_to_give_memory_back() {
        let adm = |budget: u64, tenant: u64| {
            Admission::new(
                AdmissionConfig {
                    memory_budget_bytes: budget,
                    tenant_memory_bytes: tenant,
                    ..AdmissionConfig::default()
                },
                true,
            )
        };
        // Over the budget (1000): a holds 900, over its fair share 500; b
        // is within its share and is left alone.
        let overs = adm(1000, u64::MAX).overs(&used(&[("a", 900), ("b", 200)]));
        assert_eq!(overs.len(), 1);
        assert_eq!((overs[0].tenant.as_str(), overs[0].excess), ("a", 400));
        assert_eq!(overs[0].limit, Limit::FairShare);
        assert!(overs[0].what.contains("fair share"), "{}", overs[0].what);
        // Under the budget: nobody, whatever the shares.
        assert!(adm(2000, u64::MAX)
            .overs(&used(&[("a", 900), ("b", 200)]))
            .is_empty());
        // A tenant cap binds on its own, under the host budget too.
        let overs = adm(u64::MAX, 300).overs(&used(&[("a", 900), ("b", 200)]));
        assert_eq!(overs.len(), 1);
        assert_eq!(
            (overs[0].limit, overs[0].excess),
            (Limit::TenantMemory, 600)
        );
        assert!(Limit::TenantMemory.is_tenant_cap() && Limit::FairShare.is_tenant_cap());
    }
}
