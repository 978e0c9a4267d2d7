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

use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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

/// The phases: create, rounds (with the restart), check.
fn drive(load: &Arc<Load>, progress: &mut dyn FnMut(&str)) -> Result<LoadReport, String> {
    let cfg = &load.cfg;
    progress("sessions-load: creating the sessions");
    let all: Vec<usize> = (0..cfg.sessions).collect();
    load.phase(&all, "create", |l, i| l.create(i));
    let mut rng = SplitMix(seed());
    let total_round_calls = cfg.sessions * cfg.rounds;
    let restarter = if cfg.restart {
        let load = load.clone();
        let at = (total_round_calls / 2).max(1);
        Some(std::thread::spawn(move || load.restart_when(at)))
    } else {
        None
    };
    let wait_hibernated = |progress: &mut dyn FnMut(&str)| {
        if cfg.hibernate_between_rounds {
            progress("sessions-load: waiting for every session to hibernate");
            load.wait_all_hibernated()
        } else {
            Ok(())
        }
    };
    for round in 1..=cfg.rounds {
        wait_hibernated(progress)?;
        progress(&format!("sessions-load: round {round} of {}", cfg.rounds));
        let order = rng.shuffled(cfg.sessions);
        load.phase(&order, &format!("round {round}"), |l, i| l.check(i));
    }
    let restart = match restarter {
        Some(t) => {
            // With no rounds the restart has no trigger: do it now.
            load.round_calls_done
                .fetch_add(total_round_calls.max(1), Ordering::SeqCst);
            Some(t.join().map_err(|_| "the restart thread panicked")??)
        }
        None => None,
    };
    wait_hibernated(progress)?;
    progress("sessions-load: checking every session");
    let order = rng.shuffled(cfg.sessions);
    load.phase(&order, "check", |l, i| l.check(i));

    // The last size too (the sampler looks every 2 s).
    load.state_dir_max
        .fetch_max(dir_bytes(&load.state_dir), Ordering::Relaxed);
    let st = load.stats.lock().map_err(|_| "stats poisoned")?;
    let sessions = &load.sessions;
    let lost: Vec<usize> = (0..cfg.sessions)
        .filter(|&i| sessions[i].lock().map(|s| s.lost).unwrap_or(true))
        .collect();
    let mut memory = load.memory.lock().map_err(|_| "memory poisoned")?.clone();
    memory.budget_mb = cfg.memory_budget_mb;
    // The budget governs the live sessions' workers, which health measures;
    // the /proc sum also counts the zygotes and spares.
    memory.within_budget = cfg.memory_budget_mb.map(|b| {
        memory
            .max_admission_memory_mb
            .is_some_and(|m| m <= b as f64)
    });
    let restart = restart.map(|mut r| {
        r.first_call_after = st.first_after_restart.clone();
        r
    });
    Ok(LoadReport {
        sessions: cfg.sessions,
        state_bytes: cfg.state_bytes,
        live_cap: cfg.live,
        clients: cfg.clients,
        rounds: cfg.rounds,
        calls: st.calls,
        calls_ok: st.calls_ok,
        failures: st.failures,
        failure_list: st.failure_list.clone(),
        retried_429: load.retried_429.load(Ordering::Relaxed),
        retried_503: load.retried_503.load(Ordering::Relaxed),
        retried_unreachable: load.retried_unreachable.load(Ordering::Relaxed),
        cut_by_restart: load.cut_by_restart.load(Ordering::Relaxed),
        cut_list: load.cut_list.lock().map(|l| l.clone()).unwrap_or_default(),
        lost_sessions: lost.len(),
        lost_list: lost.into_iter().take(100).collect(),
        restored_by_reason: st.restored_by_reason.clone(),
        reset_by_reason: st.reset_by_reason.clone(),
        latency_create: Latency::of(st.create_ms.clone()),
        latency_live: Latency::of(st.live_ms.clone()),
        latency_restored: Latency::of(st.restored_ms.clone()),
        latency_restored_with_retries: Latency::of(st.restored_total_ms.clone()),
        memory,
        restart,
        disk_free_mb: 0,
        state_dir_mb: load.state_dir_max.load(Ordering::Relaxed) as f64 / 1048576.0,
        wall_seconds: 0.0,
    })
}

/// What the driver knows of one session.
#[derive(Debug, Default)]
struct SessionSlot {
    id: Option<String>,
    /// `sum(x)` as printed at creation (17 significant digits).
    sum: String,
    /// Calls the session has counted.
    calls: u64,
    /// A call was cut (no answer): it may or may not have run.
    maybe_one_more: bool,
    lost: bool,
    /// Called since the restart.
    seen_after_restart: bool,
}

#[derive(Debug, Default)]
struct Stats {
    calls: u64,
    calls_ok: u64,
    failures: usize,
    failure_list: Vec<Failure>,
    restored_by_reason: BTreeMap<String, u64>,
    reset_by_reason: BTreeMap<String, u64>,
    first_after_restart: BTreeMap<String, u64>,
    create_ms: Vec<f64>,
    live_ms: Vec<f64>,
    restored_ms: Vec<f64>,
    restored_total_ms: Vec<f64>,
}

/// The shared state of a run.
struct Load {
    cfg: Config,
    server: Mutex<Option<Server>>,
    /// Odd while the server restarts (SIGTERM sent, the new one not ready).
    restart_epoch: AtomicU64,
    /// Calls whose connection broke while the server restarted, retried.
    cut_by_restart: AtomicU64,
    cut_list: Mutex<Vec<String>>,
    /// `IP:PORT` of the server (the same after the restart).
    addr: String,
    /// The server's pid, 0 while it is down.
    pid: AtomicU32,
    sessions: Vec<Mutex<SessionSlot>>,
    stats: Mutex<Stats>,
    memory: Mutex<MemoryFigures>,
    in_flight: AtomicUsize,
    round_calls_done: AtomicUsize,
    /// The old server has exited: answers come from the new one.
    restarted: AtomicBool,
    retried_429: AtomicU64,
    retried_503: AtomicU64,
    retried_unreachable: AtomicU64,
    stop: AtomicBool,
    /// Where the checkpoints go, and its largest size seen (bytes).
    state_dir: PathBuf,
    state_dir_max: AtomicU64,
}

/// How one attempt ended.
enum Attempt {
    Answer(Value),
    /// An HTTP error status, with `Retry-After` (seconds) and the body's
    /// error.
    Status(u16, Option<u64>, String),
    /// The connection could not be made: nothing was sent.
    Unreachable(String),
    /// Sent, but no answer came (the connection broke).
    Cut(String),
}

impl Load {
    fn new(cfg: &Config, server: Server) -> Load {
        let pid = server.child.id();
        let addr = server.addr.clone();
        let state_dir = server.dir.join("state");
        Load {
            cfg: cfg.clone(),
            server: Mutex::new(Some(server)),
            addr,
            pid: AtomicU32::new(pid),
            sessions: (0..cfg.sessions)
                .map(|_| Mutex::new(SessionSlot::default()))
                .collect(),
            stats: Mutex::new(Stats::default()),
            memory: Mutex::new(MemoryFigures::default()),
            in_flight: AtomicUsize::new(0),
            restart_epoch: AtomicU64::new(0),
            cut_by_restart: AtomicU64::new(0),
            cut_list: Mutex::new(Vec::new()),
            round_calls_done: AtomicUsize::new(0),
            restarted: AtomicBool::new(false),
            retried_429: AtomicU64::new(0),
            retried_503: AtomicU64::new(0),
            retried_unreachable: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            state_dir,
            state_dir_max: AtomicU64::new(0),
        }
    }

    /// Runs `f` for every index of `order`, from `clients` threads taking
    /// them in turn.
    fn phase(
        &self,
        order: &[usize],
        name: &str,
        f: impl Fn(&Load, usize) -> Result<(), String> + Sync,
    ) {
        let queue = Mutex::new(order.iter().copied().collect::<VecDeque<_>>());
        std::thread::scope(|s| {
            for _ in 0..self.cfg.clients {
                s.spawn(|| loop {
                    let next = queue.lock().ok().and_then(|mut q| q.pop_front());
                    let Some(i) = next else { break };
                    if let Err(e) = f(self, i) {
                        self.fail(i, name, e);
                    }
                    if name.starts_with("round") {
                        self.round_calls_done.fetch_add(1, Ordering::SeqCst);
                    }
                });
            }
        });
    }

    fn fail(&self, session: usize, phase: &str, error: String) {
        if let Ok(mut st) = self.stats.lock() {
            st.failures += 1;
            if st.failure_list.len() < 100 {
                st.failure_list.push(Failure {
                    session,
                    phase: phase.to_string(),
                    error,
                });
            }
        }
    }

    fn agent() -> ureq::Agent {
        // No pooled connections: a refused connection then always means
        // nothing was sent, and a broken one that the call was in flight.
        ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(5))
            .timeout(Duration::from_secs(600))
            .max_idle_connections(0)
            .build()
    }

    fn attempt(&self, method: &str, path: &str, body: &Value) -> Attempt {
        let url = format!("http://{}{path}", self.addr);
        let req = Self::agent().request(method, &url);
        let r = if body.is_null() {
            req.call()
        } else {
            req.set("Content-Type", "application/json")
                .send_string(&body.to_string())
        };
        match r {
            Ok(res) => match res.into_string() {
                Ok(text) => match serde_json::from_str(&text) {
                    Ok(v) => Attempt::Answer(v),
                    Err(e) => {
                        Attempt::Cut(format!("an answer that is not JSON ({e}): {text:.200}"))
                    }
                },
                Err(e) => Attempt::Cut(format!("the answer broke off: {e}")),
            },
            Err(ureq::Error::Status(code, res)) => {
                let retry = res
                    .header("Retry-After")
                    .and_then(|v| v.trim().parse::<u64>().ok());
                let text = res.into_string().unwrap_or_default();
                let msg = serde_json::from_str::<Value>(&text)
                    .ok()
                    .and_then(|v| {
                        let e = &v["error"];
                        Some(format!(
                            "{}: {}",
                            e["code"].as_str()?,
                            e["message"].as_str()?
                        ))
                    })
                    .unwrap_or(text);
                Attempt::Status(code, retry, msg)
            }
            Err(ureq::Error::Transport(t)) => {
                if t.kind() == ureq::ErrorKind::ConnectionFailed {
                    Attempt::Unreachable(t.to_string())
                } else {
                    Attempt::Cut(t.to_string())
                }
            }
        }
    }

    /// One call, retried on 429/503 (after `Retry-After`, at most 5 s per
    /// wait) and while the server cannot be reached, for at most
    /// `retry_for`; a connection that broke while the server restarted is
    /// retried too (a request the old server had accepted but not read is
    /// reset when its listener closes; the client cannot tell whether it
    /// ran). Returns the answer, the time of the attempt that got it, and
    /// whether an earlier attempt may have run.
    fn call(
        &self,
        method: &str,
        path: &str,
        body: &Value,
    ) -> Result<(Value, f64, bool), CallError> {
        let end = Instant::now() + self.cfg.retry_for;
        let mut maybe_ran = false;
        loop {
            let t = Instant::now();
            let epoch = self.restart_epoch.load(Ordering::SeqCst);
            self.in_flight.fetch_add(1, Ordering::SeqCst);
            let a = self.attempt(method, path, body);
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            let took = t.elapsed().as_secs_f64() * 1000.0;
            let restarting = epoch % 2 == 1 || self.restart_epoch.load(Ordering::SeqCst) != epoch;
            let (wait, why) = match a {
                Attempt::Answer(v) => return Ok((v, took, maybe_ran)),
                Attempt::Status(code @ (429 | 503), retry, msg) => {
                    if code == 429 {
                        self.retried_429.fetch_add(1, Ordering::Relaxed);
                    } else {
                        self.retried_503.fetch_add(1, Ordering::Relaxed);
                    }
                    let secs = retry.unwrap_or(1).clamp(0, 5);
                    (
                        Duration::from_secs(secs).max(Duration::from_millis(50)),
                        format!("{code} {msg}"),
                    )
                }
                Attempt::Status(code, _, msg) => return Err(CallError::Status(code, msg)),
                Attempt::Unreachable(e) => {
                    self.retried_unreachable.fetch_add(1, Ordering::Relaxed);
                    (Duration::from_millis(100), format!("unreachable: {e}"))
                }
                Attempt::Cut(e) if restarting => {
                    maybe_ran = true;
                    self.cut_by_restart.fetch_add(1, Ordering::Relaxed);
                    if let Ok(mut l) = self.cut_list.lock() {
                        if l.len() < 20 {
                            l.push(format!("{method} {path}: {e}"));
                        }
                    }
                    (
                        Duration::from_millis(100),
                        format!("cut by the restart: {e}"),
                    )
                }
                Attempt::Cut(e) => return Err(CallError::Cut(e)),
            };
            if Instant::now() + wait > end {
                return Err(CallError::GaveUp(format!(
                    "still refused after {:.0} s of retries: {why}",
                    self.cfg.retry_for.as_secs_f64()
                )));
            }
            std::thread::sleep(wait);
        }
    }

    /// Creates session `i` and builds its state.
    fn create(&self, i: usize) -> Result<(), String> {
        let t = Instant::now();
        self.count_call();
        let (status, _, _) = self
            .call("POST", "/v1/sessions", &json!({}))
            .map_err(|e| format!("new session: {e}"))?;
        let id = status["id"]
            .as_str()
            .ok_or_else(|| format!("new session: no id in {status}"))?
            .to_string();
        let n = self.cfg.state_bytes / 8;
        let code = format!(
            "set.seed({seed}); x <- rnorm({n}); calls <- 0L\n\
             chk <- list(i = {i}L, n = length(x), sum = sum(x))\n\
             cat(sprintf(\"OK %d %.17g %d TRUE\\n\", chk$i, chk$sum, calls))",
            seed = i + 1
        );
        let mut slot = self.sessions[i].lock().map_err(|_| "slot poisoned")?;
        slot.id = Some(id.clone());
        let (r, _, _) = self
            .call(
                "POST",
                &format!("/v1/sessions/{id}/run"),
                &json!({"code": code}),
            )
            .map_err(|e| format!("building the state: {e}"))?;
        let (got_i, sum, calls, _) = parse_ok(&r)?;
        if got_i != i as u64 || calls != 0 {
            return Err(format!(
                "building the state printed session {got_i}, {calls} calls"
            ));
        }
        slot.sum = sum;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        if let Ok(mut st) = self.stats.lock() {
            st.calls_ok += 1;
            st.create_ms.push(ms);
        }
        Ok(())
    }

    fn count_call(&self) {
        if let Ok(mut st) = self.stats.lock() {
            st.calls += 1;
        }
    }

    /// Calls session `i` and checks its state.
    fn check(&self, i: usize) -> Result<(), String> {
        let mut slot = self.sessions[i].lock().map_err(|_| "slot poisoned")?;
        let Some(id) = slot.id.clone() else {
            return Err("never created".into());
        };
        self.count_call();
        let code = "calls <- calls + 1L\n\
                    cat(sprintf(\"OK %d %.17g %d %s\\n\", chk$i, sum(x), calls,\n  \
                    identical(chk$sum, sum(x)) && length(x) == chk$n))";
        let t = Instant::now();
        let outcome = self.call(
            "POST",
            &format!("/v1/sessions/{id}/run"),
            &json!({"code": code}),
        );
        let total = t.elapsed().as_secs_f64() * 1000.0;
        // Answered by the new server: the old one had exited before the
        // flag was set.
        let first_after = self.restarted.load(Ordering::SeqCst) && !slot.seen_after_restart;
        if first_after {
            slot.seen_after_restart = true;
        }
        if let Ok((r, _, _)) = &outcome {
            if let Some(why) = r["session"]["reset_reason"].as_str() {
                if let Ok(mut st) = self.stats.lock() {
                    *st.reset_by_reason.entry(why.to_string()).or_default() += 1;
                }
            }
        }
        let verdict = match outcome {
            Err(CallError::Cut(e)) => {
                slot.maybe_one_more = true;
                Err(format!("the call was in flight and got no answer: {e}"))
            }
            Err(CallError::Status(404, msg)) => {
                slot.lost = true;
                Err(format!("session {id} is unknown (404): {msg}"))
            }
            Err(e) => Err(e.to_string()),
            Ok((r, took, maybe_ran)) => match Self::verify(&mut slot, i, &r, maybe_ran) {
                Ok(()) => {
                    let restored = r["session"]["restored"]["reason"]
                        .as_str()
                        .map(str::to_string);
                    if let Ok(mut st) = self.stats.lock() {
                        st.calls_ok += 1;
                        match &restored {
                            Some(reason) => {
                                *st.restored_by_reason.entry(reason.clone()).or_default() += 1;
                                st.restored_ms.push(took);
                                st.restored_total_ms.push(total);
                            }
                            None => st.live_ms.push(took),
                        }
                        if first_after {
                            *st.first_after_restart
                                .entry(restored.unwrap_or_else(|| "live".into()))
                                .or_default() += 1;
                        }
                    }
                    return Ok(());
                }
                Err(e) => {
                    // An R error (`x` gone) or a wrong state is a lost
                    // session; a call the server could not run (a worker
                    // that did not start, a timeout) is a failure that may
                    // or may not have counted.
                    match r["outcome"].as_str() {
                        Some("complete" | "error") => slot.lost = true,
                        _ => slot.maybe_one_more = true,
                    }
                    Err(e)
                }
            },
        };
        if first_after {
            if let Ok(mut st) = self.stats.lock() {
                *st.first_after_restart.entry("failed".into()).or_default() += 1;
            }
        }
        verdict
    }

    /// The state a result shows against what the session must hold.
    /// `maybe_ran`: an earlier attempt of this call may have run, so the
    /// counter may be one further.
    fn verify(slot: &mut SessionSlot, i: usize, r: &Value, maybe_ran: bool) -> Result<(), String> {
        slot.maybe_one_more |= maybe_ran;
        let (got_i, sum, calls, intact) = parse_ok(r)?;
        let s = &r["session"];
        if s["fresh"].as_bool() == Some(true) {
            return Err(format!(
                "the session came back fresh (reset_reason {}): its state is gone",
                s["reset_reason"]
            ));
        }
        if got_i != i as u64 || sum != slot.sum || !intact {
            return Err(format!(
                "state not intact: printed session {got_i} sum {sum} intact {intact}, \
                 want session {i} sum {}",
                slot.sum
            ));
        }
        let want = slot.calls + 1;
        if calls == want || (slot.maybe_one_more && calls == want + 1) {
            slot.calls = calls;
            slot.maybe_one_more = false;
            Ok(())
        } else {
            Err(format!(
                "the session counted {calls} calls, want {want}{}: a restore from an older \
                 checkpoint lost calls (restored {}, reset_reason {})",
                if slot.maybe_one_more {
                    " or one more"
                } else {
                    ""
                },
                s["restored"],
                s["reset_reason"]
            ))
        }
    }

    /// Waits until every session says `hibernated` (bounded: 5 minutes).
    fn wait_all_hibernated(&self) -> Result<(), String> {
        let end = Instant::now() + Duration::from_secs(300);
        for (i, slot) in self.sessions.iter().enumerate() {
            let Some(id) = slot.lock().ok().and_then(|s| s.id.clone()) else {
                continue;
            };
            let status = |l: &Load| l.call("GET", &format!("/v1/sessions/{id}"), &Value::Null);
            // A session whose status cannot be read is left to its calls,
            // which report what is wrong with it.
            while let Ok((v, _, _)) = status(self) {
                let state = v["state"].as_str().unwrap_or("").to_string();
                if state == "hibernated" {
                    break;
                }
                if Instant::now() > end {
                    return Err(format!(
                        "session {i} ({id}) is still {state:?} 5 minutes after its last call: \
                         --hibernate-between-rounds needs a server that hibernates idle \
                         sessions (--state-dir with a short --hibernate-after-secs)"
                    ));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// Waits until `at` round calls are done, then restarts the server.
    fn restart_when(&self, at: usize) -> Result<RestartFigures, String> {
        while self.round_calls_done.load(Ordering::SeqCst) < at {
            if self.stop.load(Ordering::Relaxed) {
                return Err("stopped before the restart".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut guard = self.server.lock().map_err(|_| "server poisoned")?;
        let Some(mut old) = guard.take() else {
            return Err("no server to restart".into());
        };
        let mut fig = RestartFigures {
            calls_in_flight: self.in_flight.load(Ordering::SeqCst),
            ..RestartFigures::default()
        };
        self.restart_epoch.fetch_add(1, Ordering::SeqCst);
        let t = Instant::now();
        let status = old.terminate(Duration::from_secs(180));
        // Calls see the restart as over even if it failed.
        let status = status.inspect_err(|_| {
            self.restart_epoch.fetch_add(1, Ordering::SeqCst);
        })?;
        fig.sigterm_to_exit_ms = t.elapsed().as_secs_f64() * 1000.0;
        fig.exit_status = status;
        self.pid.store(0, Ordering::SeqCst);
        self.restarted.store(true, Ordering::SeqCst);
        let t = Instant::now();
        let new = Server::start(&self.cfg, &old.dir, &self.addr);
        self.restart_epoch.fetch_add(1, Ordering::SeqCst);
        let new = new?;
        fig.start_to_ready_ms = t.elapsed().as_secs_f64() * 1000.0;
        self.pid.store(new.child.id(), Ordering::SeqCst);
        *guard = Some(new);
        Ok(fig)
    }

    fn stop_server(&self) {
        if let Ok(mut g) = self.server.lock() {
            if let Some(mut s) = g.take() {
                let _ = s.terminate(Duration::from_secs(60));
            }
        }
    }

    /// Samples the workers' memory every 250 ms until the run stops.
    fn sample_until_stopped(&self) {
        let mut tick = 0u64;
        while !self.stop.load(Ordering::Relaxed) {
            if tick % 8 == 0 {
                self.state_dir_max
                    .fetch_max(dir_bytes(&self.state_dir), Ordering::Relaxed);
            }
            tick += 1;
            let pid = self.pid.load(Ordering::SeqCst);
            if pid != 0 {
                let (pss, n, unreadable) = workers_pss(pid);
                let adm = self.admission();
                if let Ok(mut m) = self.memory.lock() {
                    m.samples += 1;
                    m.max_workers_pss_mb = m.max_workers_pss_mb.max(pss as f64 / 1048576.0);
                    if n > m.max_worker_processes {
                        m.max_worker_processes = n;
                        m.pss_unreadable = unreadable;
                    }
                    if let Some((mem, live)) = adm {
                        if let Some(mb) = mem {
                            m.max_admission_memory_mb =
                                Some(m.max_admission_memory_mb.unwrap_or(0.0).max(mb));
                        }
                        if let Some(l) = live {
                            m.max_admission_live = Some(m.max_admission_live.unwrap_or(0).max(l));
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Health's admission object: (workers' memory MB, live sessions), when
    /// it has them.
    fn admission(&self) -> Option<(Option<f64>, Option<u64>)> {
        let h: Value = ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(2))
            .build()
            .get(&format!("http://{}/v1/health", self.addr))
            .call()
            .ok()?
            .into_string()
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())?;
        Some(admission_figures(&h["admission"]))
    }
}

/// The workers' memory (MB) and the live sessions in health's `admission`
/// object (`worker_memory_bytes`, `live_sessions`; docs/sessions.md).
fn admission_figures(a: &Value) -> (Option<f64>, Option<u64>) {
    (
        a["worker_memory_bytes"].as_f64().map(|b| b / 1048576.0),
        a["live_sessions"].as_u64(),
    )
}

#[derive(Debug)]
enum CallError {
    Status(u16, String),
    Cut(String),
    GaveUp(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Status(code, msg) => write!(f, "HTTP {code}: {msg}"),
            CallError::Cut(e) => write!(f, "no answer: {e}"),
            CallError::GaveUp(e) => f.write_str(e),
        }
    }
}

/// The `OK i sum calls intact` line of a result: the result must be
/// complete.
fn parse_ok(r: &Value) -> Result<(u64, String, u64, bool), String> {
    let console = r["console"].as_str().unwrap_or("");
    if r["outcome"] != "complete" {
        let err = r["error"]["message"].as_str().unwrap_or("");
        return Err(format!(
            "outcome {} (reset_reason {}): {err} {}",
            r["outcome"],
            r["session"]["reset_reason"],
            console.chars().take(300).collect::<String>()
        ));
    }
    let line = console
        .lines()
        .find_map(|l| l.strip_prefix("OK "))
        .ok_or_else(|| format!("no OK line in the console: {console:.300}"))?;
    let t: Vec<&str> = line.split_whitespace().collect();
    let bad = || format!("an unreadable OK line: {line}");
    if t.len() != 4 {
        return Err(bad());
    }
    Ok((
        t[0].parse().map_err(|_| bad())?,
        t[1].to_string(),
        t[2].parse().map_err(|_| bad())?,
        t[3] == "TRUE",
    ))
}

/// `rvisor serve` started by the driver.
struct Server {
    child: Child,
    addr: String,
    dir: PathBuf,
    /// The last lines of its standard error (for error messages).
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
}

impl Server {
    /// Starts `rvisor serve` on `listen` with the state in `dir/state` and
    /// waits until `/readyz` answers 200.
    fn start(cfg: &Config, dir: &Path, listen: &str) -> Result<Server, String> {
        let mut cmd = Command::new(&cfg.rvisor);
        if cfg.unconfined {
            cmd.arg("--unconfined");
        }
        // Room above the sessions for one retried creation per client.
        let n = (cfg.sessions + cfg.clients).to_string();
        cmd.args(["serve", "--no-auth", "--listen", listen, "--node-id", "n1"])
            .args(["--max-sessions", &n, "--max-sessions-per-tenant", &n])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["--drain-grace-secs", "60", "--style", "builtin"]);
        if let Some(l) = cfg.live {
            cmd.args(["--max-live-sessions", &l.to_string()]);
        }
        if let Some(b) = cfg.memory_budget_mb {
            cmd.args(["--memory-budget-mb", &b.to_string()]);
        }
        if let Some(h) = cfg.hibernate_after_secs {
            cmd.args(["--hibernate-after-secs", &h.to_string()]);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", cfg.rvisor.display()))?;
        let stderr = child.stderr.take().ok_or("no stderr")?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let tail = tail.clone();
            // RVISOR_LOAD_SERVER_LOG=FILE keeps the server's whole log.
            let mut log = std::env::var_os("RVISOR_LOAD_SERVER_LOG").and_then(|p| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .ok()
            });
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if let Some(f) = log.as_mut() {
                        use std::io::Write;
                        let _ = writeln!(f, "{line}");
                    }
                    if let Some(a) = line.split("listening on http://").nth(1) {
                        let _ = tx.send(a.trim().to_string());
                    }
                    if let Ok(mut t) = tail.lock() {
                        if t.len() == 30 {
                            t.pop_front();
                        }
                        t.push_back(line);
                    }
                }
            });
        }
        let mut server = Server {
            child,
            addr: String::new(),
            dir: dir.to_path_buf(),
            stderr_tail: tail,
        };
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(a) => server.addr = a,
            Err(_) => {
                let _ = server.terminate(Duration::from_secs(10));
                return Err(server.why_not_started(cfg));
            }
        }
        let end = Instant::now() + Duration::from_secs(180);
        let url = format!("http://{}/readyz", server.addr);
        loop {
            if ureq::get(&url)
                .timeout(Duration::from_secs(5))
                .call()
                .is_ok()
            {
                return Ok(server);
            }
            if Instant::now() > end {
                let _ = server.terminate(Duration::from_secs(10));
                return Err(format!(
                    "rvisor serve did not become ready within 180 s: {}",
                    server.tail()
                ));
            }
            if let Ok(Some(st)) = server.child.try_wait() {
                return Err(format!(
                    "rvisor serve exited ({st}) before it was ready: {}",
                    server.tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn tail(&self) -> String {
        self.stderr_tail
            .lock()
            .map(|t| t.iter().cloned().collect::<Vec<_>>().join("\n"))
            .unwrap_or_default()
    }

    /// Why the server did not listen, naming a missing feature when its
    /// flag was refused.
    fn why_not_started(&self, cfg: &Config) -> String {
        // The reader thread may still be copying the last lines.
        let end = Instant::now() + Duration::from_secs(2);
        while Instant::now() < end && self.tail().is_empty() {
            std::thread::sleep(Duration::from_millis(20));
        }
        let tail = self.tail();
        for (flag, feature, instead) in [
            (
                "--max-live-sessions",
                "admission control (a host-wide cap of live sessions, issue 15)",
                "--live 0 runs without a live cap",
            ),
            (
                "--memory-budget-mb",
                "admission control (the live workers' memory budget, issue 15)",
                "--memory-budget-mb 0 runs without a budget",
            ),
        ] {
            if tail.contains(flag) && tail.contains("unexpected argument") {
                return format!(
                    "this rvisor serve ({}) has no {flag}: it lacks {feature}, which the \
                     sessions-load targets need; build a binary that has it ({instead}, \
                     and measures less)",
                    cfg.rvisor.display()
                );
            }
        }
        format!("rvisor serve did not start listening: {tail}")
    }

    /// SIGTERM, then waits for the exit (SIGKILL after `grace`); the exit
    /// status, or why it had to be killed.
    fn terminate(&mut self, grace: Duration) -> Result<String, String> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Ok(format!("already exited: {st}"));
        }
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: `pid` is our own child, not yet reaped (try_wait saw it
        // running), so the id cannot name another process.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let end = Instant::now() + grace;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => return Ok(st.to_string()),
                Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(10)),
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(format!(
                        "rvisor serve did not exit within {:.0} s of SIGTERM (killed): {}",
                        grace.as_secs_f64(),
                        self.tail()
                    ));
                }
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The run's temporary directory, removed when dropped.
struct WorkDir(PathBuf);

impl WorkDir {
    fn new(parent: &Path) -> Result<WorkDir, String> {
        let d = parent.join(format!(
            "rvisor-sessions-load-{}-{}",
            std::process::id(),
            rvisor::ids::random_hex(4)
        ));
        std::fs::create_dir_all(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
        Ok(WorkDir(d))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Free bytes for an unprivileged writer on the file system of `dir`.
fn free_bytes(dir: &Path) -> Result<u64, String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| format!("{} has a NUL byte", dir.display()))?;
    // SAFETY: statvfs is plain old data; an all-zero value is valid.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path that lives across the call and
    // `st` is a valid, writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(format!(
            "cannot read the free space of {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Bytes of the files under `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Summed PSS (bytes) of the `rvisor-worker` processes under `root`, their
/// number, and how many of them could not be read.
fn workers_pss(root: u32) -> (u64, usize, usize) {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut comm: HashMap<u32, String> = HashMap::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return (0, 0, 0);
    };
    for e in rd.filter_map(Result::ok) {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        let ppid = stat[close + 1..]
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pp) = ppid {
            children.entry(pp).or_default().push(pid);
        }
        comm.insert(pid, name);
    }
    let (mut total, mut n, mut unreadable) = (0u64, 0usize, 0usize);
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        if let Some(c) = children.get(&p) {
            stack.extend(c);
        }
        if p == root || comm.get(&p).map(String::as_str) != Some("rvisor-worker") {
            continue;
        }
        n += 1;
        let pss = std::fs::read_to_string(format!("/proc/{p}/smaps_rollup"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Pss:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            });
        match pss {
            Some(kb) => total += kb * 1024,
            None => unreadable += 1,
        }
    }
    (total, n, unreadable)
}

/// A small seeded generator for the session order (printed seeds are not
/// needed: the order only has to be random, the checks do not depend on it).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// `0..n` in a random order (Fisher-Yates).
    fn shuffled(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        v
    }
}

fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        ^ u64::from(std::process::id())
}

fn fmt(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| {
        if x < 100.0 {
            format!("{x:.1}")
        } else {
            format!("{x:.0}")
        }
    })
}

/// The report as Markdown.
pub fn table(r: &LoadReport) -> String {
    let mut s = format!(
        "\nsessions-load: {} sessions x {:.1} MB of state, live cap {}, {} clients, {} rounds \
         + a check of every session; {:.0} s in all.\n\n",
        r.sessions,
        r.state_bytes as f64 / 1048576.0,
        r.live_cap.map_or("none".into(), |n| n.to_string()),
        r.clients,
        r.rounds,
        r.wall_seconds
    );
    s.push_str("| figure | value |\n| --- | --- |\n");
    let mut row = |k: &str, v: String| s.push_str(&format!("| {k} | {v} |\n"));
    row("calls (ok / made)", format!("{} / {}", r.calls_ok, r.calls));
    row("failures", r.failures.to_string());
    row("lost sessions (target 0)", r.lost_sessions.to_string());
    row(
        "retried: 429 / 503 / unreachable / cut by the restart",
        format!(
            "{} / {} / {} / {}",
            r.retried_429, r.retried_503, r.retried_unreachable, r.cut_by_restart
        ),
    );
    for (name, l) in [
        (
            "create (new session + state) ms p50 / p95 / p99",
            &r.latency_create,
        ),
        ("call to a live session ms p50 / p95 / p99", &r.latency_live),
        (
            "call that restored the session ms p50 / p95 / p99",
            &r.latency_restored,
        ),
        (
            "the same with retries ms p50 / p95 / p99",
            &r.latency_restored_with_retries,
        ),
    ] {
        row(
            name,
            format!(
                "{} / {} / {} (n {})",
                fmt(l.p50_ms),
                fmt(l.p95_ms),
                fmt(l.p99_ms),
                l.n
            ),
        );
    }
    let reasons = |m: &BTreeMap<String, u64>| {
        if m.is_empty() {
            "-".to_string()
        } else {
            m.iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    row("restored results by reason", reasons(&r.restored_by_reason));
    row(
        "results after a worker was replaced, by reset_reason",
        reasons(&r.reset_by_reason),
    );
    let m = &r.memory;
    row(
        "workers' memory max: PSS sum / health (MB)",
        format!(
            "{:.0} / {} ({} processes at most, {} samples)",
            m.max_workers_pss_mb,
            fmt(m.max_admission_memory_mb),
            m.max_worker_processes,
            m.samples
        ),
    );
    row(
        "memory budget (MB)",
        match (m.budget_mb, m.within_budget) {
            (Some(b), Some(true)) => format!("{b}: within"),
            (Some(b), _) => format!("{b}: EXCEEDED"),
            (None, _) => "none".into(),
        },
    );
    row(
        "live sessions max (health)",
        m.max_admission_live.map_or("-".into(), |n| n.to_string()),
    );
    if let Some(x) = &r.restart {
        row(
            "restart: SIGTERM to exit / start to ready (ms)",
            format!(
                "{:.0} / {:.0} ({} calls in flight; {})",
                x.sigterm_to_exit_ms, x.start_to_ready_ms, x.calls_in_flight, x.exit_status
            ),
        );
        row("first call after the restart", reasons(&x.first_call_after));
    }
    row(
        "state directory, largest (MB)",
        format!("{:.0}", r.state_dir_mb),
    );
    for f in r.failure_list.iter().take(10) {
        s.push_str(&format!(
            "\n- session {} ({}): {}",
            f.session, f.phase, f.error
        ));
    }
    if !r.failure_list.is_empty() {
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_figures_are_read_from_health() {
        let a = json!({"max_live_sessions": 50, "live_sessions": 7,
                       "memory_budget_bytes": 4096, "worker_memory_bytes": 3145728,
                       "refusals": {"live_sessions": 191}});
        assert_eq!(admission_figures(&a), (Some(3.0), Some(7)));
        assert_eq!(admission_figures(&json!({"max_sessions": 5})), (None, None));
    }

    #[test]
    fn ok_lines_are_read_after_a_restore_notice() {
        let r = json!({"outcome": "complete",
                       "console": "rvisor: woke the session\nOK 3 -12.5 4 TRUE\n",
                       "session": {}});
        assert_eq!(parse_ok(&r).unwrap(), (3, "-12.5".into(), 4, true));
        let e = json!({"outcome": "error", "console": "", "error": {"message": "object 'x' not found"},
                       "session": {"reset_reason": null}});
        assert!(parse_ok(&e).unwrap_err().contains("object 'x' not found"));
    }

    fn answer(line: &str, fresh: bool) -> Value {
        json!({"outcome": "complete", "console": format!("{line}\n"),
               "session": {"fresh": fresh, "reset_reason": null, "restored": null}})
    }

    #[test]
    fn verify_checks_index_sum_and_the_call_counter() {
        let mut slot = SessionSlot {
            sum: "-12.5".into(),
            calls: 1,
            ..SessionSlot::default()
        };
        assert!(Load::verify(&mut slot, 3, &answer("OK 3 -12.5 2 TRUE", false), false).is_ok());
        assert_eq!(slot.calls, 2);
        // Another session's state, another sum, a broken checksum, fresh.
        for (line, fresh) in [
            ("OK 4 -12.5 3 TRUE", false),
            ("OK 3 -12.49 3 TRUE", false),
            ("OK 3 -12.5 3 FALSE", false),
            ("OK 3 -12.5 3 TRUE", true),
        ] {
            let e = Load::verify(&mut slot, 3, &answer(line, fresh), false);
            assert!(e.is_err(), "{line} {fresh}");
        }
        // A restore from an older checkpoint: the counter went back.
        let e = Load::verify(&mut slot, 3, &answer("OK 3 -12.5 2 TRUE", false), false);
        assert!(e.unwrap_err().contains("lost calls"));
        // A call that may have run: one further is accepted, once.
        assert!(Load::verify(&mut slot, 3, &answer("OK 3 -12.5 4 TRUE", false), true).is_ok());
        assert_eq!(slot.calls, 4);
        assert!(!slot.maybe_one_more);
        assert!(Load::verify(&mut slot, 3, &answer("OK 3 -12.5 6 TRUE", false), false).is_err());
    }

    #[test]
    fn shuffled_is_a_permutation() {
        let mut v = SplitMix(7).shuffled(100);
        v.sort_unstable();
        assert_eq!(v, (0..100).collect::<Vec<_>>());
    }
}
