//! The sessions-load row of `rvisor bench` (issue 15's targets): many
//! durable sessions, each holding distinct state, driven over HTTP by
//! several clients through a real `rvisor serve` with a live cap and a
//! memory budget, with a restart of the server in the middle.
//!
//! The driver starts `rvisor serve` itself (this binary, `--state-dir` in a
//! temporary directory removed at the end), creates the sessions (each
//! `x <- rnorm(S/8)` seeded by its index, and `chk`, a small object with
//! the index, the length and `sum(x)`), then runs rounds of calls in a
//! random session order from K client threads. Every call checks the
//! session's state: the index, `sum(x)` to 17 significant digits against
//! the value printed at creation, `identical(chk$sum, sum(x))`, and a call
//! counter the session keeps (so a restore from a stale checkpoint shows).
//! Half-way through the rounds it sends the server SIGTERM, waits for it to
//! exit and starts it again on the same port with the same state directory
//! and node id; the clients retry meanwhile. A last round calls every
//! session once more, after the restart. 429 and 503 answers are retried,
//! honouring `Retry-After`, for a bounded time. A sampler reads health's
//! `admission` object and sums the PSS of the `rvisor-worker` processes
//! under the server's pid (/proc), and keeps the maxima.
//!
//! What the server must offer for this to run: `--max-live-sessions` and
//! `--memory-budget-mb` (admission control), and restart survival (session
//! ids known again after a restart). A server without them fails the run
//! with a message that says which is missing, or reports the sessions it
//! lost; nothing is skipped silently.

mod load;
mod report;
mod server;
#[cfg(test)]
mod tests;

pub use report::table;

use load::{drive, Load};
use serde::Serialize;
use server::{free_bytes, Server, WorkDir};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Sessions to create and drive.
    pub sessions: usize,
    /// Bytes of distinct state per session (`rnorm(state_bytes / 8)`).
    pub state_bytes: usize,
    /// `--max-live-sessions` of the server; None: not passed (a server
    /// without admission control; nothing caps live workers then but
    /// hibernation).
    pub live: Option<usize>,
    /// Client threads.
    pub clients: usize,
    /// Rounds of calls (every session once per round, random order), before
    /// the last check round.
    pub rounds: usize,
    /// `--memory-budget-mb` of the server, checked against the maximum of
    /// the workers' memory; None: not passed.
    pub memory_budget_mb: Option<u64>,
    /// Restart the server half-way through the rounds.
    pub restart: bool,
    /// Before each round (and the check), wait until every session has
    /// hibernated (with a short `hibernate_after_secs`), so every call
    /// restores its session.
    pub hibernate_between_rounds: bool,
    /// `--hibernate-after-secs` of the server; None: its default.
    pub hibernate_after_secs: Option<f64>,
    /// Start the server with `--unconfined`.
    pub unconfined: bool,
    /// Where the temporary directory (state and data) goes.
    pub work_parent: PathBuf,
    /// The `rvisor` binary to serve with.
    pub rvisor: PathBuf,
    /// How long one call may keep being retried (429/503, server down).
    pub retry_for: Duration,
}

impl Config {
    /// The issue's targets: 1,000 sessions of 5 MB, 50 live, 4 clients.
    pub fn issue_targets() -> Config {
        Config {
            sessions: 1000,
            state_bytes: 5 << 20,
            live: Some(50),
            clients: 4,
            rounds: 2,
            memory_budget_mb: Some(DEFAULT_BUDGET_PER_LIVE_MB * 50),
            restart: true,
            hibernate_between_rounds: false,
            hibernate_after_secs: None,
            unconfined: false,
            work_parent: std::env::temp_dir(),
            rvisor: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("rvisor")),
            retry_for: Duration::from_secs(180),
        }
    }
}

/// The default memory budget per live session, MB. Measured here (PSS,
/// confined): a worker holding 1-5 MB of state takes 12-18 MB; 40 leaves
/// room for the zygotes and the spares, which the sum includes.
pub const DEFAULT_BUDGET_PER_LIVE_MB: u64 = 40;

/// Latency percentiles of one kind of call.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Latency {
    /// Calls measured.
    pub n: usize,
    /// Median, ms.
    pub p50_ms: Option<f64>,
    /// 95th percentile, ms.
    pub p95_ms: Option<f64>,
    /// 99th percentile, ms.
    pub p99_ms: Option<f64>,
}

impl Latency {
    fn of(mut v: Vec<f64>) -> Latency {
        if v.is_empty() {
            return Latency::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let pick = |q: f64| Some(v[((v.len() as f64 - 1.0) * q).round() as usize]);
        Latency {
            n: v.len(),
            p50_ms: pick(0.5),
            p95_ms: pick(0.95),
            p99_ms: pick(0.99),
        }
    }
}

/// One failed call.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    /// Session index (0-based).
    pub session: usize,
    /// `create`, `round N`, `check`.
    pub phase: String,
    /// What went wrong.
    pub error: String,
}

/// Workers' memory over the run.
#[derive(Debug, Clone, Serialize, Default)]
pub struct MemoryFigures {
    /// Samples taken (every 250 ms).
    pub samples: u64,
    /// Maximum of the summed PSS of every `rvisor-worker` process under the
    /// server (zygotes and spares included), MB.
    pub max_workers_pss_mb: f64,
    /// Most `rvisor-worker` processes at once (zygotes and spares included).
    pub max_worker_processes: usize,
    /// Processes whose PSS could not be read (at the sample with the most).
    pub pss_unreadable: usize,
    /// Maximum of the workers' memory health's `admission` object reports,
    /// MB (None: health has no such figure).
    pub max_admission_memory_mb: Option<f64>,
    /// Maximum of the live sessions health's `admission` object reports.
    pub max_admission_live: Option<u64>,
    /// The server's budget, MB.
    pub budget_mb: Option<u64>,
    /// Both maxima within the budget (None: no budget).
    pub within_budget: Option<bool>,
}

/// The restart in the middle.
#[derive(Debug, Clone, Serialize, Default)]
pub struct RestartFigures {
    /// Calls in flight when SIGTERM was sent.
    pub calls_in_flight: usize,
    /// SIGTERM to the process's exit, ms.
    pub sigterm_to_exit_ms: f64,
    /// How it exited.
    pub exit_status: String,
    /// Start of the new server to `/readyz` answering 200, ms.
    pub start_to_ready_ms: f64,
    /// Sessions called after the restart, by how their first result after
    /// it says they were restored (`session.restored.reason`; `live` if it
    /// was not restored, `failed` if the call failed).
    pub first_call_after: BTreeMap<String, u64>,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize, Default)]
pub struct LoadReport {
    /// Sessions.
    pub sessions: usize,
    /// Bytes of state per session.
    pub state_bytes: usize,
    /// The server's live cap.
    pub live_cap: Option<usize>,
    /// Client threads.
    pub clients: usize,
    /// Rounds (besides creation and the last check).
    pub rounds: usize,
    /// Calls made (creation included), each counted once however often it
    /// was retried.
    pub calls: u64,
    /// Calls that answered with the state intact.
    pub calls_ok: u64,
    /// Failed calls (each in `failure_list`, up to 100).
    pub failures: usize,
    /// The failures, up to 100.
    pub failure_list: Vec<Failure>,
    /// 429 answers retried.
    pub retried_429: u64,
    /// 503 answers retried.
    pub retried_503: u64,
    /// Connections refused and retried (the server down while it restarts).
    pub retried_unreachable: u64,
    /// Calls whose connection broke, with no answer, while the server
    /// restarted: retried, with the session's call counter allowed one
    /// further (the broken attempt may have run). Outside a restart a
    /// broken call is a failure.
    pub cut_by_restart: u64,
    /// Those calls, up to 20.
    pub cut_list: Vec<String>,
    /// Sessions whose state did not survive (unknown id, state gone or
    /// wrong: an R error, another sum or index, fewer calls counted than
    /// answered); the target is 0. A call the server could not run is a
    /// failure, not a loss.
    pub lost_sessions: usize,
    /// Their indices, up to 100.
    pub lost_list: Vec<usize>,
    /// Results that said `session.restored`, by reason.
    pub restored_by_reason: BTreeMap<String, u64>,
    /// Results (failed calls too) that said `session.reset_reason`: the
    /// session's worker had been replaced (killed, crashed, ...), by reason.
    pub reset_by_reason: BTreeMap<String, u64>,
    /// Creation calls (new session + building its state).
    pub latency_create: Latency,
    /// Calls to a live session (result not restored).
    pub latency_live: Latency,
    /// Calls that restored the session first (`session.restored` set).
    pub latency_restored: Latency,
    /// The same, counted from the first attempt (retries included).
    pub latency_restored_with_retries: Latency,
    /// Workers' memory.
    pub memory: MemoryFigures,
    /// The restart, if there was one.
    pub restart: Option<RestartFigures>,
    /// Free space where the state went, at the start, MB.
    pub disk_free_mb: u64,
    /// Largest size of the state directory during the run (sampled every
    /// 2 s), MB.
    pub state_dir_mb: f64,
    /// Wall time of the run, seconds.
    pub wall_seconds: f64,
}

/// Runs the load. Errors are what stopped it (a server that would not
/// start, a missing feature, no disk); what went wrong with calls is in
/// the report.
pub fn run(cfg: &Config, progress: &mut dyn FnMut(&str)) -> Result<LoadReport, String> {
    if cfg.sessions == 0 || cfg.clients == 0 || cfg.state_bytes < 8 {
        return Err("sessions-load needs at least 1 session, 1 client and 8 bytes of state".into());
    }
    let started = Instant::now();
    let need = (cfg.sessions as u64 * cfg.state_bytes as u64) / 10 * 12 + (512 << 20);
    let free = free_bytes(&cfg.work_parent)?;
    if free < need {
        return Err(format!(
            "sessions-load needs about {} MB free in {} for the checkpoints ({} sessions x {} \
             bytes of random doubles, which do not compress) and has {} MB: free space there, \
             set TMPDIR to a larger disk, or lower --sessions / --state-mb",
            need >> 20,
            cfg.work_parent.display(),
            cfg.sessions,
            cfg.state_bytes,
            free >> 20
        ));
    }
    let dir = WorkDir::new(&cfg.work_parent)?;
    progress(&format!(
        "sessions-load: {} sessions x {:.1} MB, live cap {}, {} clients, state in {} ({} MB free)",
        cfg.sessions,
        cfg.state_bytes as f64 / 1048576.0,
        cfg.live.map_or("none".into(), |n| n.to_string()),
        cfg.clients,
        dir.0.display(),
        free >> 20
    ));
    let server = Server::start(cfg, &dir.0, "127.0.0.1:0")?;
    let load = Arc::new(Load::new(cfg, server));
    let sampler = {
        let load = load.clone();
        std::thread::spawn(move || load.sample_until_stopped())
    };
    let result = drive(&load, progress);
    load.stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    load.stop_server();
    let mut report = result?;
    report.disk_free_mb = free >> 20;
    report.wall_seconds = started.elapsed().as_secs_f64();
    Ok(report)
}
