//! The driver: its phases ([`drive`]) and its shared state ([`Load`]):
//! the sessions as the driver knows them, the calls over HTTP with their
//! retries and checks, the restart, the sampler of health and the
//! workers' memory, and the random session order.

use super::server::{dir_bytes, workers_pss, Server};
use super::{Config, Failure, Latency, LoadReport, MemoryFigures, RestartFigures};
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The phases: create, rounds (with the restart), check.
pub(super) fn drive(
    load: &Arc<Load>,
    progress: &mut dyn FnMut(&str),
) -> Result<LoadReport, String> {
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
pub(super) struct SessionSlot {
    pub(super) id: Option<String>,
    /// `sum(x)` as printed at creation (17 significant digits).
    pub(super) sum: String,
    /// Calls the session has counted.
    pub(super) calls: u64,
    /// A call was cut (no answer): it may or may not have run.
    pub(super) maybe_one_more: bool,
    pub(super) lost: bool,
    /// Called since the restart.
    pub(super) seen_after_restart: bool,
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
pub(super) struct Load {
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
    pub(super) stop: AtomicBool,
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
    pub(super) fn new(cfg: &Config, server: Server) -> Load {
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
    pub(super) fn verify(
        slot: &mut SessionSlot,
        i: usize,
        r: &Value,
        maybe_ran: bool,
    ) -> Result<(), String> {
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

    pub(super) fn stop_server(&self) {
        if let Ok(mut g) = self.server.lock() {
            if let Some(mut s) = g.take() {
                let _ = s.terminate(Duration::from_secs(60));
            }
        }
    }

    /// Samples the workers' memory every 250 ms until the run stops.
    pub(super) fn sample_until_stopped(&self) {
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
pub(super) fn admission_figures(a: &Value) -> (Option<f64>, Option<u64>) {
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
pub(super) fn parse_ok(r: &Value) -> Result<(u64, String, u64, bool), String> {
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

/// A small seeded generator for the session order (printed seeds are not
/// needed: the order only has to be random, the checks do not depend on it).
pub(super) struct SplitMix(pub(super) u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// `0..n` in a random order (Fisher-Yates).
    pub(super) fn shuffled(&mut self, n: usize) -> Vec<usize> {
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
