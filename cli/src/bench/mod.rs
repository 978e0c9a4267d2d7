//! `rvisor bench`: rvisor and its peers on the same workloads, in one run.
//!
//! Peers are what users would otherwise pick: `Rscript -e` per call, a
//! `callr::r_session`, and Rserve with RSclient on loopback. The callr and
//! Rserve calls are made from an R peer driver (`peers.R`, in a child
//! process), since that is how their users call them. Every round runs each
//! workload through every system in turn (interleaved), so background noise
//! hits all systems alike. Medians, p90 and p99 per system, and the ratio
//! peer/rvisor of the medians. A peer that cannot do a workload says so.

mod streaming;

use rvisor::{
    CallOptions, Outcome, PoolConfig, RunOptions, Session, SessionOptions, Supervisor,
    SupervisorConfig,
};
use serde::Serialize;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod batch_rows;
mod displays;
mod files;
pub mod instructions;
mod memory;
mod packages;
pub mod sessions_load;
mod startup;

const PEER_DRIVER: &str = include_str!("peers.R");

/// One workload of the table.
struct Workload {
    id: &'static str,
    title: &'static str,
    /// R code for rvisor and Rscript (None: measured specially).
    code: Option<&'static str>,
    /// Iterations per round: (rvisor/Rserve, callr, Rscript).
    per_round: (usize, usize, usize),
}

const WORKLOADS: &[Workload] = &[
    Workload {
        id: "one_plus_one",
        title: "1+1",
        code: Some("1+1"),
        per_round: (200, 30, 2),
    },
    Workload {
        id: "counter",
        title: "x <- x + 1 (persistent)",
        code: Some("x <- x + 1"),
        per_round: (200, 30, 0),
    },
    Workload {
        id: "colmeans",
        title: "summary(colMeans(matrix(rnorm(1e6),1000)))",
        code: Some("summary(colMeans(matrix(rnorm(1e6),1000)))"),
        per_round: (10, 5, 2),
    },
    Workload {
        id: "print_df",
        title: "print a 2,000-row data frame",
        code: Some("print(dat)"),
        per_round: (10, 5, 2),
    },
    Workload {
        id: "base_plot",
        title: "base plot to PNG (800x600)",
        code: Some("plot(rnorm(100))"),
        per_round: (10, 5, 2),
    },
    Workload {
        id: "ggplot",
        title: "ggplot to PNG (800x600)",
        code: Some("print(ggplot2::ggplot(mtcars, ggplot2::aes(wt, mpg)) + ggplot2::geom_point())"),
        per_round: (5, 3, 1),
    },
    Workload {
        id: "validate_100",
        title: "validate 100 lines (default engine: rvisor-lint)",
        code: None,
        per_round: (50, 0, 0),
    },
    Workload {
        id: "validate_100_lintr",
        title: "validate 100 lines (--style lintr)",
        code: None,
        per_round: (1, 0, 0),
    },
    Workload {
        id: "error_then_next",
        title: "stop(\"boom\") then the next call",
        code: None,
        per_round: (50, 10, 0),
    },
    Workload {
        id: "cold_start",
        title: "new session to first result",
        code: None,
        per_round: (10, 2, 2),
    },
    Workload {
        id: "timeout_recovery",
        title: "Sys.sleep(60) with a 1 s limit: deadline to result",
        code: None,
        per_round: (1, 1, 0),
    },
];

const SYSTEMS: [&str; 4] = ["rvisor", "callr", "rserve", "rscript"];

/// The validation workloads' script: 100 lines, half of them
/// `x1 <- mean(rnorm(11)); y1 = x1 * 2` (issue 19's), half `print(y1)`.
pub fn validate_script() -> String {
    (1..=50)
        .map(|i| {
            format!(
                "x{i} <- mean(rnorm({})); y{i} = x{i} * 2\nprint(y{i})\n",
                i + 10
            )
        })
        .collect()
}

/// Validations of `script` with `style`, through the service's validation
/// (what HTTP, nng, MCP and `rvisor validate` call); with the number of
/// style notes of the last one.
fn validate_calls(
    sup: &Supervisor,
    script: &str,
    style: rvisor::StyleEngine,
    n: usize,
) -> Result<(Vec<f64>, usize), String> {
    let mut out = Vec::with_capacity(n);
    let mut notes = 0;
    for _ in 0..n {
        let t = Instant::now();
        let v = if style.is_fast() {
            rvisor_server::service::validate(sup, script)
        } else {
            sup.validate_with(script, style)
        };
        out.push(ms(t.elapsed()));
        if !v.valid {
            return Err(format!("the script did not validate: {:?}", v.problems));
        }
        notes = v.style.len();
    }
    Ok((out, notes))
}

/// Summary of one workload on one system.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Stats {
    /// Workload id.
    pub workload: String,
    /// System: rvisor, callr, rserve, rscript.
    pub system: String,
    /// Samples taken.
    pub n: usize,
    /// Median, milliseconds (None when the system cannot do it).
    pub median_ms: Option<f64>,
    /// 90th percentile.
    pub p90_ms: Option<f64>,
    /// 99th percentile.
    pub p99_ms: Option<f64>,
    /// Why there is no number, or what it means.
    pub note: Option<String>,
}

/// Memory of an idle session.
#[derive(Debug, Clone, Serialize)]
pub struct Memory {
    /// System.
    pub system: String,
    /// Resident set size, bytes (median over sessions).
    pub rss_bytes: Option<u64>,
    /// Proportional set size, bytes (shared pages split among sharers: it
    /// depends on how many siblings share them).
    pub pss_bytes: Option<u64>,
    /// Private (unshared) bytes: what one more session costs.
    pub uss_bytes: Option<u64>,
    /// Private bytes after the session ran a full `gc()` (R's collector
    /// writes to every object, so a fork's heap pages become private).
    pub uss_after_gc_bytes: Option<u64>,
    /// 1 GiB / USS (idle).
    pub sessions_per_gib: Option<f64>,
}

/// Calls per second with several sessions at once.
#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    /// Concurrent sessions.
    pub sessions: usize,
    /// Completed `1+1` calls per second, all sessions together.
    pub calls_per_second: f64,
}

/// Everything one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Where it ran.
    pub machine: String,
    /// Rounds (each workload through each system per round).
    pub rounds: usize,
    /// Workloads x systems.
    pub stats: Vec<Stats>,
    /// Idle session memory.
    pub memory: Vec<Memory>,
    /// rvisor throughput.
    pub throughput: Vec<Throughput>,
    /// Extra rvisor figures: cold start without a spare, with plain
    /// spawning, first vs later ggplot, kill-to-next-call.
    pub extra: Vec<Stats>,
    /// Whole new processes to their first result, and where the time goes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub startup: Option<startup::Startup>,
    /// The same scripts through `rvisor batch` and Rscript per script.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<batch_rows::BatchRow>,
    /// Many durable sessions through `rvisor serve` with a live cap and a
    /// restart (`--only sessions-load`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sessions_load: Option<sessions_load::LoadReport>,
    /// Instructions per call of the hot paths under callgrind
    /// (`--only instructions`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instructions: Option<instructions::Counts>,
    /// Live sessions' memory after a full gc(), rvisor and Rserve
    /// (`--only memory`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_after_gc: Option<memory::MemoryReport>,
    /// A 100 MB file up and down over HTTP, and artifact listing
    /// (`--only files`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<files::FilesReport>,
}

/// Parts of the benchmark (`rvisor bench --only`). `sessions-load` runs
/// only when named (minutes, and gigabytes of checkpoints at its defaults),
/// and so does `instructions` (minutes under valgrind). `memory` (live
/// sessions after a full gc(), rvisor and Rserve: about a minute) runs by
/// default and with `--quick` too.
pub const SECTIONS: [&str; 9] = [
    "latency",
    "displays",
    "packages",
    "startup",
    "batch",
    "memory",
    "files",
    "sessions-load",
    "instructions",
];

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Fewer samples.
    pub quick: bool,
    /// The sections to run (of [`SECTIONS`]); empty: all.
    pub only: Vec<String>,
    /// Repetitions of the cold-start and batch rows (default: 10 and 3,
    /// quick 3 and 1).
    pub reps: Option<usize>,
    /// Scripts of the batch row (default 300, quick 40).
    pub scripts: Option<usize>,
    /// The sessions-load row's settings.
    pub load: sessions_load::Config,
}

impl Options {
    fn wants(&self, section: &str) -> bool {
        (self.only.is_empty() && !["sessions-load", "instructions"].contains(&section))
            || self.only.iter().any(|s| s == section)
    }
}

/// Runs the selected sections of the benchmark.
pub fn run_sections(o: &Options, progress: &mut dyn FnMut(&str)) -> Result<Report, String> {
    let mut report = if o.wants("latency") {
        run(o.quick, progress)?
    } else {
        Report {
            machine: machine(),
            rounds: 0,
            stats: Vec::new(),
            memory: Vec::new(),
            throughput: Vec::new(),
            extra: Vec::new(),
            startup: None,
            batch: None,
            sessions_load: None,
            instructions: None,
            memory_after_gc: None,
            files: None,
        }
    };
    if o.wants("displays") {
        report.extra.extend(displays::run(o.quick, progress)?);
    }
    if o.wants("packages") {
        report.extra.extend(packages::run(o.quick, progress)?);
    }
    if o.wants("startup") {
        // Peers are installed by the latency part only: without Rserve the
        // Rserve row says so.
        let reps = o.reps.unwrap_or(if o.quick { 3 } else { 10 });
        report.startup = Some(startup::run(reps, progress)?);
    }
    if o.wants("batch") {
        let reps = o.reps.unwrap_or(if o.quick { 1 } else { 3 });
        let scripts = o.scripts.unwrap_or(if o.quick { 40 } else { 300 });
        report.batch = Some(batch_rows::run(scripts, reps, progress)?);
    }
    if o.wants("memory") {
        ensure_peers(progress);
        let mut peers = Peers::start();
        report.memory_after_gc = Some(memory::run(peers.as_mut(), progress)?);
    }
    if o.wants("files") {
        let (reps, runs) = if o.quick { (2, 5) } else { (5, 20) };
        report.files = Some(files::run(reps, runs, progress)?);
    }
    if o.wants("sessions-load") {
        report.sessions_load = Some(sessions_load::run(&o.load, progress)?);
    }
    if o.wants("instructions") {
        report.instructions = Some(instructions::run(&[], progress)?);
    }
    Ok(report)
}

/// Durable sessions: a session holding 10 MB of R objects checkpointed
/// (the call that takes it, the worker's own part in the note), then
/// hibernated and woken by its next call (restore + the call's result).
fn durable_rows(k: usize) -> Result<Vec<Stats>, String> {
    let dir = std::env::temp_dir().join(format!("rvisor-bench-state-{}", std::process::id()));
    let store = Arc::new(rvisor::checkpoint::DirStore::new(&dir).map_err(|e| e.to_string())?);
    let sup = Supervisor::new(SupervisorConfig {
        checkpoints: Some(store),
        ..SupervisorConfig::default()
    })
    .map_err(|e| e.to_string())?;
    sup.pool().wait_ready(Duration::from_secs(120));
    let s = sup
        .session_with(SessionOptions {
            checkpoint_after: None,
            hibernate_after: None,
            ..SessionOptions::default()
        })
        .map_err(|e| e.to_string())?;
    let built = s
        .run("big <- rnorm(1.25e6); invisible(gc())")
        .map_err(|e| e.to_string())?
        .wait();
    if built.outcome != Outcome::Complete {
        return Err(format!("the durable bench's state: {}", built.console));
    }
    let (mut checkpoint, mut worker_part, mut restore) = (Vec::new(), Vec::new(), Vec::new());
    let mut bytes = 0;
    for i in 0..k.max(3) {
        s.run(&format!("big[1] <- {i}"))
            .map_err(|e| e.to_string())?
            .wait();
        let t = Instant::now();
        let info = s.checkpoint().map_err(|e| e.to_string())?;
        checkpoint.push(ms(t.elapsed()));
        worker_part.push(info.manifest.checkpoint_ms);
        bytes = info.bytes;
        s.hibernate();
        let end = Instant::now() + Duration::from_secs(30);
        while s.status().state != rvisor::SessionState::Hibernated {
            if Instant::now() > end {
                return Err("the session did not hibernate".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        sup.pool().wait_ready(Duration::from_secs(30));
        let t = Instant::now();
        let r = s.run("big[1]").map_err(|e| e.to_string())?.wait();
        if r.outcome == Outcome::Complete && r.session.restored.is_some() {
            restore.push(ms(t.elapsed()));
        }
    }
    worker_part.sort_by(|a, b| a.total_cmp(b));
    let worker_median = worker_part
        .get(worker_part.len() / 2)
        .copied()
        .unwrap_or(0.0);
    s.close();
    drop(sup);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(vec![
        summarise(
            "checkpoint_10mb_session",
            "rvisor",
            checkpoint,
            Some(format!(
                "Session::checkpoint of 10 MB of doubles: {bytes} bytes stored; \
                 the worker's serialise + LZ4 + write: {worker_median:.1} ms median"
            )),
        ),
        summarise(
            "restore_10mb_session_next_call",
            "rvisor",
            restore,
            Some("hibernated session: spare + restore + the call's result".into()),
        ),
    ])
}

fn summarise(workload: &str, system: &str, mut ms: Vec<f64>, note: Option<String>) -> Stats {
    if ms.is_empty() {
        return Stats {
            workload: workload.into(),
            system: system.into(),
            n: 0,
            median_ms: None,
            p90_ms: None,
            p99_ms: None,
            note,
        };
    }
    ms.sort_by(|a, b| a.total_cmp(b));
    let pick = |q: f64| ms[((ms.len() as f64 - 1.0) * q).round() as usize];
    Stats {
        workload: workload.into(),
        system: system.into(),
        n: ms.len(),
        median_ms: Some(pick(0.5)),
        p90_ms: Some(pick(0.9)),
        p99_ms: Some(pick(0.99)),
        note,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The R peer driver in a child process.
pub(crate) struct Peers {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peers {
    /// The driver's process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    fn start() -> Option<Peers> {
        let path =
            std::env::temp_dir().join(format!("rvisor-bench-peers-{}.R", std::process::id()));
        std::fs::write(&path, PEER_DRIVER).ok()?;
        let mut child = Command::new("Rscript")
            .arg("--vanilla")
            .arg(&path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let stdin = child.stdin.take()?;
        let stdout = BufReader::new(child.stdout.take()?);
        Some(Peers {
            child,
            stdin,
            stdout,
        })
    }

    /// Sends one request; returns the samples or why there are none.
    pub(crate) fn ask(&mut self, peer: &str, workload: &str, n: usize) -> Result<Vec<f64>, String> {
        writeln!(self.stdin, "{peer} {workload} {n}").map_err(|e| e.to_string())?;
        self.stdin.flush().map_err(|e| e.to_string())?;
        loop {
            let mut line = String::new();
            if self
                .stdout
                .read_line(&mut line)
                .map_err(|e| e.to_string())?
                == 0
            {
                return Err("the peer driver ended".into());
            }
            let line = line.trim();
            if let Some(rest) = line.strip_prefix("OK") {
                return Ok(rest
                    .split_whitespace()
                    .filter_map(|t| t.parse().ok())
                    .collect());
            }
            if let Some(rest) = line.strip_prefix("NA") {
                return Err(rest.trim().to_string());
            }
            // Anything else is chatter from a peer (Rserve prints); skip.
        }
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        let end = Instant::now() + Duration::from_secs(10);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Makes sure the peers are installed: installs the Debian packages when
/// running as root, otherwise says how.
pub fn ensure_peers(progress: &mut dyn FnMut(&str)) {
    let have = |pkg: &str| {
        Command::new("Rscript")
            .args([
                "-e",
                &format!("quit(status = !requireNamespace('{pkg}', quietly = TRUE))"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    };
    let mut missing = Vec::new();
    for (pkg, deb) in [
        ("callr", "r-cran-callr"),
        ("Rserve", "r-cran-rserve"),
        ("RSclient", "r-cran-rsclient"),
        ("ggplot2", "r-cran-ggplot2"),
    ] {
        if !have(pkg) {
            missing.push(deb);
        }
    }
    if missing.is_empty() {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        progress(&format!(
            "peers missing; install them with: sudo apt-get install --no-install-recommends {}",
            missing.join(" ")
        ));
        return;
    }
    progress(&format!("installing peers: {}", missing.join(" ")));
    let _ = Command::new("apt-get")
        .args(["update", "-q"])
        .stdout(Stdio::null())
        .status();
    let _ = Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdout(Stdio::null())
        .status();
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines().next().map(|l| {
                l.split_whitespace()
                    .nth(1)
                    .unwrap_or("0")
                    .parse::<u64>()
                    .unwrap_or(0)
            })
        })
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{cores} cores, {cpu}, {:.0} GiB, Linux {}",
        mem as f64 / 1048576.0,
        kernel.trim()
    )
}

/// The session the workloads run in. It runs a ggplot workload, and says
/// so first: its first call names ggplot2, so its worker comes from the
/// preloaded zygote, as such a session's does.
fn rvisor_session(sup: &Supervisor) -> Result<Session, String> {
    let s = sup.session().map_err(|e| e.to_string())?;
    for code in [
        "invisible(loadNamespace('ggplot2'))",
        "x <- 0",
        "dat <- data.frame(a = 1:2000, b = rnorm(2000), c = sample(letters, 2000, TRUE))",
    ] {
        s.run(code).map_err(|e| e.to_string())?.wait();
    }
    Ok(s)
}

fn rvisor_calls(s: &Session, code: &str, n: usize, over: &RunOptions) -> Result<Vec<f64>, String> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let r = s.run_with(code, over).map_err(|e| e.to_string())?.wait();
        out.push(ms(t.elapsed()));
        if !matches!(r.outcome, Outcome::Complete) {
            return Err(format!("`{code}` ended with {}: {}", r.outcome, r.console));
        }
    }
    Ok(out)
}

fn rscript_calls(code: &str, n: usize) -> Result<Vec<f64>, String> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let st = Command::new("Rscript")
            .args(["--vanilla", "-e", code])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| format!("failed to run Rscript: {e}"))?;
        out.push(ms(t.elapsed()));
        if !st.success() {
            return Err(format!("Rscript -e '{code}' failed"));
        }
    }
    Ok(out)
}

/// RSS, PSS and private bytes of a process.
fn smaps(pid: u32) -> Option<(u64, u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let kb = |key: &str| -> Option<u64> {
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
    };
    Some((
        kb("Rss:")? * 1024,
        kb("Pss:")? * 1024,
        (kb("Private_Clean:")? + kb("Private_Dirty:")?) * 1024,
    ))
}

/// Runs the benchmark. `quick`: 3 rounds, shorter throughput runs.
pub fn run(quick: bool, progress: &mut dyn FnMut(&str)) -> Result<Report, String> {
    let rounds = if quick { 3 } else { 10 };
    ensure_peers(progress);
    let sup = Supervisor::new(SupervisorConfig::default()).map_err(|e| e.to_string())?;
    progress("starting the zygote");
    if !sup.pool().wait_ready(Duration::from_secs(120)) {
        progress(&format!(
            "zygote not ready: {:?}; measuring with plain spawning",
            sup.pool_status().last_error
        ));
    }
    let session = rvisor_session(&sup)?;
    let mut peers = Peers::start();
    if peers.is_none() {
        progress("the peer driver (Rscript) did not start: peers are not measured");
    }

    let mut samples: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); SYSTEMS.len()]; WORKLOADS.len()];
    let mut notes: Vec<Vec<Option<String>>> = vec![vec![None; SYSTEMS.len()]; WORKLOADS.len()];
    let fast = RunOptions::default();
    let plot_800 = RunOptions {
        plot_width: Some(800),
        plot_height: Some(600),
        ..RunOptions::default()
    };
    let mut kept_all = true;

    for round in 0..rounds {
        progress(&format!("round {}/{rounds}", round + 1));
        for (wi, w) in WORKLOADS.iter().enumerate() {
            for (si, system) in SYSTEMS.iter().enumerate() {
                if notes[wi][si]
                    .as_deref()
                    .is_some_and(|n| n.starts_with("cannot"))
                {
                    continue;
                }
                let (k_fast, k_callr, k_rscript) = w.per_round;
                let got: Result<Vec<f64>, String> = match *system {
                    _ if w.id.starts_with("validate") && *system != "rvisor" => {
                        Err("cannot: no validation without running".into())
                    }
                    "rvisor" => match w.id {
                        "validate_100" | "validate_100_lintr" => {
                            let style = if w.id == "validate_100" {
                                rvisor::StyleEngine::Auto
                            } else {
                                rvisor::StyleEngine::Lintr
                            };
                            validate_calls(&sup, &validate_script(), style, k_fast).map(|(v, n)| {
                                notes[wi][si] = Some(format!("{n} style notes"));
                                v
                            })
                        }
                        "error_then_next" => (0..k_fast)
                            .map(|_| {
                                let t = Instant::now();
                                let e = session
                                    .run("stop('boom')")
                                    .map_err(|e| e.to_string())?
                                    .wait();
                                let n = session.run("1+1").map_err(|e| e.to_string())?.wait();
                                if e.outcome != Outcome::Error || n.outcome != Outcome::Complete {
                                    return Err("unexpected outcome".to_string());
                                }
                                Ok(ms(t.elapsed()))
                            })
                            .collect(),
                        "cold_start" => (0..k_fast)
                            .map(|_| {
                                let t = Instant::now();
                                let s = sup.session().map_err(|e| e.to_string())?;
                                let r = s.run("1+1").map_err(|e| e.to_string())?.wait();
                                let d = ms(t.elapsed());
                                if r.outcome != Outcome::Complete {
                                    return Err(format!("cold start ended with {}", r.outcome));
                                }
                                Ok(d)
                            })
                            .collect(),
                        "timeout_recovery" => {
                            let s = sup
                                .session_with(SessionOptions {
                                    timeout: Duration::from_secs(1),
                                    ..SessionOptions::default()
                                })
                                .map_err(|e| e.to_string())?;
                            s.run("keep_me <- 42").map_err(|e| e.to_string())?.wait();
                            let t = Instant::now();
                            let r = s.run("Sys.sleep(60)").map_err(|e| e.to_string())?.wait();
                            let late = ms(t.elapsed()) - 1000.0;
                            let kept = s
                                .run("exists('keep_me')")
                                .map_err(|e| e.to_string())?
                                .wait();
                            kept_all &=
                                kept.console.contains("TRUE") && r.outcome == Outcome::TimedOut;
                            Ok(vec![late])
                        }
                        // The plot workloads draw 800x600 pages on every
                        // system (rvisor's default is 1000x650: a third
                        // more pixels to render, compress and send).
                        "base_plot" | "ggplot" => {
                            rvisor_calls(&session, w.code.unwrap_or(""), k_fast, &plot_800)
                        }
                        _ => rvisor_calls(&session, w.code.unwrap_or("1+1"), k_fast, &fast),
                    },
                    "callr" | "rserve" => match peers.as_mut() {
                        None => Err("cannot: the peer driver did not start".into()),
                        Some(p) => {
                            let k = if *system == "callr" { k_callr } else { k_fast };
                            p.ask(system, w.id, k.max(1)).map(|mut v| {
                                if w.id == "timeout_recovery" {
                                    // The driver appends -1 (state kept) or -2.
                                    if v.last().is_some_and(|x| *x < 0.0) {
                                        let flag = v.pop().unwrap_or(-2.0);
                                        notes[wi][si] = Some(if flag == -1.0 {
                                            "interrupt to next result; state kept".into()
                                        } else {
                                            "state lost".into()
                                        });
                                    }
                                }
                                v
                            })
                        }
                    },
                    _ => match (w.code, k_rscript) {
                        (_, 0) if w.id == "counter" => {
                            Err("cannot persist state between calls".into())
                        }
                        (_, 0) if w.id == "error_then_next" => {
                            Err("cannot: every call is a new process".into())
                        }
                        (_, 0) => Err("cannot: no session to keep".into()),
                        (Some(code), k) => {
                            let code = if w.id == "print_df" {
                                "dat <- data.frame(a = 1:2000, b = rnorm(2000), c = sample(letters, 2000, TRUE)); print(dat)".to_string()
                            } else if w.id == "base_plot" || w.id == "ggplot" {
                                format!(
                                    "png(tempfile(), 800, 600); {}; invisible(dev.off())",
                                    w.code.unwrap_or("")
                                )
                            } else {
                                code.to_string()
                            };
                            rscript_calls(&code, k)
                        }
                        (None, k) => rscript_calls("1+1", k),
                    },
                };
                match got {
                    Ok(v) => samples[wi][si].extend(v),
                    Err(why) => {
                        let why = if why.starts_with("cannot") {
                            why
                        } else {
                            format!("cannot: {why}")
                        };
                        notes[wi][si] = Some(why);
                    }
                }
            }
        }
    }
    if !kept_all {
        notes[WORKLOADS.len() - 1][0] =
            Some("WARNING: a variable did not survive the timeout".into());
    } else {
        notes[WORKLOADS.len() - 1][0] = Some("interrupted, variables kept".into());
    }

    let mut stats = Vec::new();
    for (wi, w) in WORKLOADS.iter().enumerate() {
        for (si, system) in SYSTEMS.iter().enumerate() {
            let v = std::mem::take(&mut samples[wi][si]);
            let note = notes[wi][si].take();
            let note = if v.is_empty() {
                note
            } else {
                note.filter(|n| !n.starts_with("cannot"))
            };
            stats.push(summarise(w.id, system, v, note));
        }
    }

    // Idle memory.
    progress("measuring idle memory");
    let mut memory = Vec::new();
    let idle: Vec<Session> = (0..5).filter_map(|_| sup.session().ok()).collect();
    let (mut rss, mut pss, mut uss, mut gc_uss) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for s in &idle {
        let _ = s.run("1+1").map(|h| h.wait());
    }
    for s in &idle {
        if let Some((r, p, u)) = s.status().pid.and_then(smaps) {
            rss.push(r);
            pss.push(p);
            uss.push(u);
        }
    }
    for s in &idle {
        let _ = s.run("invisible(gc())").map(|h| h.wait());
    }
    // Measured as the memory section does, once the workers have given
    // back their copies of their zygote's pages that a full collection
    // left unchanged (embedded-worker's heap_image.rs).
    std::thread::sleep(memory::given_back_wait());
    for s in &idle {
        if let Some((_, _, u)) = s.status().pid.and_then(smaps) {
            gc_uss.push(u);
        }
    }
    for v in [&mut rss, &mut pss, &mut uss, &mut gc_uss] {
        v.sort_unstable();
    }
    let med = |v: &Vec<u64>| v.get(v.len() / 2).copied();
    memory.push(Memory {
        system: "rvisor".into(),
        rss_bytes: med(&rss),
        pss_bytes: med(&pss),
        uss_bytes: med(&uss),
        uss_after_gc_bytes: med(&gc_uss),
        sessions_per_gib: med(&uss)
            .filter(|u| *u > 0)
            .map(|u| (1u64 << 30) as f64 / u as f64),
    });
    drop(idle);
    if let Some(p) = peers.as_mut() {
        for system in ["callr", "rserve"] {
            let m = p.ask(system, "memory", 1).ok();
            let (r, ps, us) = match m.as_deref() {
                Some([r, ps, us, ..]) if r.is_finite() && ps.is_finite() && us.is_finite() => {
                    (Some(*r as u64), Some(*ps as u64), Some(*us as u64))
                }
                _ => (None, None, None),
            };
            memory.push(Memory {
                system: system.into(),
                rss_bytes: r,
                pss_bytes: ps,
                uss_bytes: us,
                uss_after_gc_bytes: None,
                sessions_per_gib: us
                    .filter(|u| *u > 0)
                    .map(|u| (1u64 << 30) as f64 / u as f64),
            });
        }
    }
    drop(peers);

    // Throughput with 1, 2, 8 sessions.
    progress("measuring throughput");
    let mut throughput = Vec::new();
    let span = Duration::from_secs(if quick { 1 } else { 3 });
    for n in [1usize, 2, 8] {
        let sessions: Vec<Session> = (0..n).filter_map(|_| rvisor_session(&sup).ok()).collect();
        let count = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = sessions
            .iter()
            .map(|s| {
                let (s, count, stop) = (s.clone(), count.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if let Ok(h) = s.run("1+1") {
                            if h.wait().outcome == Outcome::Complete {
                                count.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                })
            })
            .collect();
        let t = Instant::now();
        std::thread::sleep(span);
        stop.store(true, Ordering::Relaxed);
        let elapsed = t.elapsed();
        for th in threads {
            let _ = th.join();
        }
        throughput.push(Throughput {
            sessions: n,
            calls_per_second: count.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64(),
        });
    }

    // Extra rvisor figures.
    progress("measuring cold starts without spares, first ggplot, kill recovery");
    let mut extra = Vec::new();
    let k = if quick { 8 } else { 20 };
    let confined = rvisor::Confinement::default;
    let unconfined = rvisor::Confinement::unconfined;
    for (label, pool, confinement) in [
        (
            "cold_start_spare_no_preload",
            PoolConfig {
                preload: Some(Vec::new()),
                ..PoolConfig::default()
            },
            confined(),
        ),
        (
            "cold_start_no_spare",
            PoolConfig {
                spares: 0,
                ..PoolConfig::default()
            },
            confined(),
        ),
        // The same without cgroups, and without OS confinement: the
        // differences are what each costs a new worker.
        (
            "cold_start_no_spare_no_cgroups",
            PoolConfig {
                spares: 0,
                ..PoolConfig::default()
            },
            rvisor::Confinement {
                cgroups: rvisor::confine::CgroupMode::Off,
                ..confined()
            },
        ),
        (
            "cold_start_no_spare_unconfined",
            PoolConfig {
                spares: 0,
                ..PoolConfig::default()
            },
            unconfined(),
        ),
        (
            "cold_start_plain_spawn",
            PoolConfig {
                zygote: false,
                ..PoolConfig::default()
            },
            unconfined(),
        ),
    ] {
        let sup2 = Supervisor::new(SupervisorConfig {
            pool,
            confinement,
            ..SupervisorConfig::default()
        })
        .map_err(|e| e.to_string())?;
        sup2.pool().wait_ready(Duration::from_secs(120));
        let mut v = Vec::new();
        for _ in 0..k {
            // Each cold start in the steady state: spares topped up.
            sup2.pool().wait_ready(Duration::from_secs(30));
            let t = Instant::now();
            let s = sup2.session().map_err(|e| e.to_string())?;
            let r = s.run("1+1").map_err(|e| e.to_string())?.wait();
            if r.outcome == Outcome::Complete {
                v.push(ms(t.elapsed()));
            }
        }
        let note = match label {
            "cold_start_spare_no_preload" => {
                "new session, a spare ready (zygote without ggplot2), then 1+1"
            }
            "cold_start_no_spare" => "no spare: fork + every confinement layer + cgroups, then 1+1",
            "cold_start_no_spare_no_cgroups" => {
                "no spare: fork + confinement without cgroups, then 1+1"
            }
            "cold_start_no_spare_unconfined" => "no spare: fork only (unconfined), then 1+1",
            _ => "no zygote: exec + R start (unconfined), then 1+1",
        };
        extra.push(summarise(label, "rvisor", v, Some(note.into())));
    }
    let (mut first, mut later, mut on_first_use) = (Vec::new(), Vec::new(), Vec::new());
    let gg = "print(ggplot2::ggplot(mtcars, ggplot2::aes(wt, mpg)) + ggplot2::geom_point())";
    for _ in 0..k.min(8) {
        // A session that names ggplot2 (its worker comes with it preloaded).
        let s = sup.session().map_err(|e| e.to_string())?;
        s.run("library(ggplot2)").map_err(|e| e.to_string())?.wait();
        let t = Instant::now();
        s.run(gg).map_err(|e| e.to_string())?.wait();
        first.push(ms(t.elapsed()));
        let t = Instant::now();
        s.run(gg).map_err(|e| e.to_string())?.wait();
        later.push(ms(t.elapsed()));
        // One whose earlier calls did not: ggplot2 is loaded on first use.
        let s = sup.session().map_err(|e| e.to_string())?;
        s.run("1").map_err(|e| e.to_string())?.wait();
        let t = Instant::now();
        s.run(gg).map_err(|e| e.to_string())?.wait();
        on_first_use.push(ms(t.elapsed()));
    }
    extra.push(summarise(
        "first_ggplot_in_new_session",
        "rvisor",
        first,
        Some("after library(ggplot2), the session's first call".into()),
    ));
    extra.push(summarise(
        "later_ggplot_same_session",
        "rvisor",
        later,
        None,
    ));
    extra.push(summarise(
        "first_ggplot_loaded_on_first_use",
        "rvisor",
        on_first_use,
        Some(
            "after `1`: the session's earlier calls did not name ggplot2, so its worker \
             has it not preloaded and loads it"
                .into(),
        ),
    ));
    // A worker killed and replaced (what a timeout kill or a reset does),
    // then the next call.
    let mut kill = Vec::new();
    let s = sup.session().map_err(|e| e.to_string())?;
    s.run("1").map_err(|e| e.to_string())?.wait();
    for _ in 0..k {
        sup.pool().wait_ready(Duration::from_secs(30));
        let t = Instant::now();
        s.reset();
        let r = s.run("1+1").map_err(|e| e.to_string())?.wait();
        if r.outcome == Outcome::Complete && r.session.fresh {
            kill.push(ms(t.elapsed()));
        }
    }
    extra.push(summarise(
        "worker_killed_to_next_result",
        "rvisor",
        kill,
        Some("reset (kill + spare hand-over), then 1+1".into()),
    ));
    extra.extend(durable_rows(k)?);
    // The worker's own round trip (no session queue), for reference.
    let mut w = sup
        .pool()
        .acquire(&sup.config().worker)
        .map_err(|e| e.to_string())?;
    let opts = CallOptions::default();
    let mut direct = Vec::new();
    for _ in 0..(200 * rounds) {
        let t = Instant::now();
        w.run("1+1", &opts);
        direct.push(ms(t.elapsed()));
    }
    extra.push(summarise(
        "one_plus_one_worker_direct",
        "rvisor",
        direct,
        Some("Worker::run, no session queue".into()),
    ));

    progress("measuring streaming: latency to clients, cost");
    extra.extend(streaming::figures(&session, quick));

    Ok(Report {
        machine: machine(),
        rounds,
        stats,
        memory,
        throughput,
        extra,
        startup: None,
        batch: None,
        sessions_load: None,
        instructions: None,
        memory_after_gc: None,
        files: None,
    })
}

fn fmt_ms(v: Option<f64>) -> String {
    match v {
        Some(x) if x < 1.0 => format!("{x:.3}"),
        Some(x) if x < 100.0 => format!("{x:.2}"),
        Some(x) => format!("{x:.0}"),
        None => "-".into(),
    }
}

/// Renders the report as Markdown tables (README-ready).
pub fn table(r: &Report) -> String {
    let mut s = latency_table(r);
    if let Some(x) = &r.startup {
        s.push_str(&startup::table(x));
    }
    if let Some(b) = &r.batch {
        s.push_str(&batch_rows::table(b));
    }
    if let Some(m) = &r.memory_after_gc {
        s.push_str(&memory::table(m));
    }
    if let Some(f) = &r.files {
        s.push_str(&files::table(f));
    }
    if let Some(l) = &r.sessions_load {
        s.push_str(&sessions_load::table(l));
    }
    if let Some(c) = &r.instructions {
        s.push_str(&format!(
            "\n## Instructions per call (callgrind, inside the worker's call)\n\n{}\n\n| path | warm: instructions per call | first {} calls: per call | warm calls |\n| --- | ---: | ---: | ---: |\n",
            c.how,
            instructions::WARM_UP
        ));
        for (p, n) in &c.paths {
            s.push_str(&format!(
                "| {p} | {} | {} | {} |\n",
                n.instructions_per_call, n.first_calls, n.calls
            ));
        }
    }
    s
}

/// The latency tables (workloads x systems, memory, throughput, extra).
fn latency_table(r: &Report) -> String {
    if r.stats.is_empty() {
        return format!("Machine: {}.\n", r.machine);
    }
    let mut s = format!(
        "Machine: {}; {} rounds, interleaved.\n\n",
        r.machine, r.rounds
    );
    s.push_str("| workload | rvisor median (p90, p99) ms | callr median ms (x rvisor) | Rserve median ms (x rvisor) | Rscript median ms (x rvisor) |\n");
    s.push_str("| --- | --- | --- | --- | --- |\n");
    for w in WORKLOADS {
        let get = |sys: &str| {
            r.stats
                .iter()
                .find(|x| x.workload == w.id && x.system == sys)
        };
        let rv = get("rvisor");
        let base = rv.and_then(|x| x.median_ms);
        let mut row = format!("| {} | ", w.title);
        match rv {
            Some(x) if x.median_ms.is_some() => {
                row.push_str(&format!(
                    "{} ({}, {})",
                    fmt_ms(x.median_ms),
                    fmt_ms(x.p90_ms),
                    fmt_ms(x.p99_ms)
                ));
                if let Some(n) = &x.note {
                    row.push_str(&format!("; {n}"));
                }
            }
            Some(x) => row.push_str(x.note.as_deref().unwrap_or("-")),
            None => row.push('-'),
        }
        for sys in ["callr", "rserve", "rscript"] {
            row.push_str(" | ");
            match get(sys) {
                Some(x) if x.median_ms.is_some() => {
                    let m = x.median_ms.unwrap_or(0.0);
                    match base {
                        Some(b) if b > 0.0 && w.id != "timeout_recovery" => {
                            row.push_str(&format!("{} ({:.1}x)", fmt_ms(Some(m)), m / b))
                        }
                        _ => row.push_str(&fmt_ms(Some(m))),
                    }
                    if let Some(n) = &x.note {
                        row.push_str(&format!("; {n}"));
                    }
                }
                Some(x) => row.push_str(x.note.as_deref().unwrap_or("-")),
                None => row.push('-'),
            }
        }
        row.push_str(" |\n");
        s.push_str(&row);
    }
    s.push_str("\n| idle session | RSS MB | PSS MB | private MB | private MB after gc() | sessions per GiB (by private) |\n| --- | --- | --- | --- | --- | --- |\n");
    for m in &r.memory {
        let mb = |b: Option<u64>| {
            b.map(|b| format!("{:.1}", b as f64 / 1048576.0))
                .unwrap_or_else(|| "-".into())
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            m.system,
            mb(m.rss_bytes),
            mb(m.pss_bytes),
            mb(m.uss_bytes),
            mb(m.uss_after_gc_bytes),
            m.sessions_per_gib
                .map(|x| format!("{x:.0}"))
                .unwrap_or_else(|| "-".into())
        ));
    }
    s.push_str("\n| concurrent rvisor sessions | 1+1 calls per second |\n| --- | --- |\n");
    for t in &r.throughput {
        s.push_str(&format!("| {} | {:.0} |\n", t.sessions, t.calls_per_second));
    }
    s.push_str("\n| rvisor extra | median (p90, p99) ms | note |\n| --- | --- | --- |\n");
    for x in &r.extra {
        s.push_str(&format!(
            "| {} | {} ({}, {}) | {} |\n",
            x.workload,
            fmt_ms(x.median_ms),
            fmt_ms(x.p90_ms),
            fmt_ms(x.p99_ms),
            x.note.as_deref().unwrap_or("")
        ));
    }
    s
}
