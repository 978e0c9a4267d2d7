//! `rvisor bench --only memory`: what a live session costs after a full
//! `gc()`, rvisor next to Rserve, the same code in both.
//!
//! A full collection writes to every R object of the heap (mark bits, the
//! generation lists), so every page of the heap a worker was forked with
//! becomes its own: a session's cost after `gc()` is the size of the heap
//! it was forked with plus what it made. Measured as the servers run: the
//! proportional set size (PSS: a shared page counts 1/n in each of its n
//! processes) of the server's whole process tree from /proc (smaps_rollup),
//! divided by the sessions. rvisor: an `rvisor serve` started for the row
//! (the server, its zygotes, spares and workers); Rserve: a daemon started
//! for the row (which loaded nothing, as `Rserve::Rserve()` starts it) and
//! the child it forks per connection. The median private bytes of one
//! session's process (what one more costs) are beside it.
//! `RVISOR_BENCH_BASELINE=PATH` measures another `rvisor` binary (an
//! earlier build) the same way, in the same run, beside them.

use serde::Serialize;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Live sessions per measure (the figure: 8).
pub const SESSIONS: usize = 8;

/// The ggplot each case builds (rvisor captures it with its own PNG
/// device; Rserve's code writes the same plot to a PNG file, as its
/// latency workload does).
const GGPLOT: &str =
    "print(ggplot2::ggplot(mtcars, ggplot2::aes(wt, mpg)) + ggplot2::geom_point())";
const GC: &str = "v <- rnorm(1e5); invisible(gc())";

/// One measure: the calls each session makes, in order (the same for
/// Rserve, by id, in peers.R's `memory_cases`).
struct Case {
    id: &'static str,
    title: &'static str,
    calls: &'static [&'static str],
}

const CASES: &[Case] = &[
    Case {
        id: "gc",
        title: "`v <- rnorm(1e5); gc()`",
        calls: &[GC],
    },
    Case {
        id: "ggplot_gc",
        title: "a ggplot, then `v <- rnorm(1e5); gc()`",
        calls: &[GGPLOT, GC],
    },
    Case {
        id: "ggplot_later_gc",
        title: "`v <- rnorm(1e5)`, then a ggplot (ggplot2 loaded on first use), then `gc()`",
        calls: &["v <- rnorm(1e5)", GGPLOT, "invisible(gc())"],
    },
];

/// One row: a case on both systems.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Case id.
    pub case: String,
    /// What the sessions ran.
    pub title: String,
    /// rvisor: PSS of the server's process tree per session, bytes.
    pub rvisor_pss_per_session: Option<u64>,
    /// rvisor: median private bytes of a session's worker.
    pub rvisor_private: Option<u64>,
    /// The baseline binary (`RVISOR_BENCH_BASELINE`), the same measures.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_pss_per_session: Option<u64>,
    /// The baseline binary's median private bytes of a session's worker.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_private: Option<u64>,
    /// Rserve: PSS of the daemon's process tree per session, bytes.
    pub rserve_pss_per_session: Option<u64>,
    /// Rserve: median private bytes of a connection's process.
    pub rserve_private: Option<u64>,
    /// Why a figure is missing.
    pub note: Option<String>,
}

/// The memory section.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryReport {
    /// Live sessions per measure.
    pub sessions: usize,
    /// How it was measured.
    pub how: String,
    /// The baseline binary measured beside this one, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
    /// One row per case.
    pub rows: Vec<Row>,
}

/// Runs every case on rvisor and on Rserve (through the peer driver).
pub fn run(
    peers: Option<&mut super::Peers>,
    progress: &mut dyn FnMut(&str),
) -> Result<MemoryReport, String> {
    let mut peers = peers;
    let rvisor = std::env::current_exe().map_err(|e| e.to_string())?;
    let baseline = std::env::var_os("RVISOR_BENCH_BASELINE").map(PathBuf::from);
    let mut rows = Vec::new();
    for case in CASES {
        progress(&format!("memory: {} (rvisor)", case.id));
        let mut notes = Vec::new();
        let (rv_pss, rv_priv) = match rvisor_case(&rvisor, case) {
            Ok((p, u)) => (Some(p), Some(u)),
            Err(e) => {
                notes.push(format!("rvisor: {e}"));
                (None, None)
            }
        };
        let (base_pss, base_priv) = match &baseline {
            None => (None, None),
            Some(b) => {
                progress(&format!("memory: {} (baseline {})", case.id, b.display()));
                match rvisor_case(b, case) {
                    Ok((p, u)) => (Some(p), Some(u)),
                    Err(e) => {
                        notes.push(format!("baseline: {e}"));
                        (None, None)
                    }
                }
            }
        };
        progress(&format!("memory: {} (Rserve)", case.id));
        let (rs_pss, rs_priv) = match peers.as_deref_mut() {
            None => {
                notes.push("Rserve: the peer driver did not start".into());
                (None, None)
            }
            Some(p) => match p.ask("rserve", &format!("pss_{}", case.id), SESSIONS) {
                Ok(v) if v.len() >= 2 => (Some(v[0] as u64), Some(v[1] as u64)),
                Ok(v) => {
                    notes.push(format!("Rserve: unexpected answer {v:?}"));
                    (None, None)
                }
                Err(e) => {
                    notes.push(format!("Rserve: {e}"));
                    (None, None)
                }
            },
        };
        rows.push(Row {
            case: case.id.into(),
            title: case.title.into(),
            rvisor_pss_per_session: rv_pss,
            rvisor_private: rv_priv,
            baseline_pss_per_session: base_pss,
            baseline_private: base_priv,
            rserve_pss_per_session: rs_pss,
            rserve_private: rs_priv,
            note: (!notes.is_empty()).then(|| notes.join("; ")),
        });
    }
    // The opt-in: the cases without and with ggplot2 on a server whose
    // workers' identical pages the kernel merges (each session's `v` is
    // its own random numbers: forked workers have their own streams).
    for (k, case) in CASES.iter().enumerate().take(2) {
        progress(&format!("memory: {} with --merge-pages (rvisor)", case.id));
        let (pss, private, note) = match rvisor::page_merging_state() {
            Err(why) => (None, None, Some(format!("rvisor: not measured: {why}"))),
            Ok(()) => match rvisor_case_with(&rvisor, case, true) {
                Ok((p, u)) => (Some(p), Some(u), None),
                Err(e) => (None, None, Some(format!("rvisor: {e}"))),
            },
        };
        let same = rows.get(k).cloned();
        rows.push(Row {
            case: format!("{}_merge_pages", case.id),
            title: format!(
                "{}, `rvisor serve --merge-pages` (opt-in; after ksmd's next three scans)",
                case.title
            ),
            rvisor_pss_per_session: pss,
            rvisor_private: private,
            baseline_pss_per_session: None,
            baseline_private: None,
            rserve_pss_per_session: same.as_ref().and_then(|r| r.rserve_pss_per_session),
            rserve_private: same.as_ref().and_then(|r| r.rserve_private),
            note,
        });
    }
    Ok(MemoryReport {
        sessions: SESSIONS,
        how: format!(
            "{SESSIONS} live sessions each; PSS (smaps_rollup) of the server's whole process tree \
             / sessions: rvisor serve (server, zygotes, spares, workers), an Rserve daemon started \
             for the row (nothing preloaded) with its per-connection children; private: the \
             median session process's private bytes"
        ),
        baseline: baseline.map(|b| b.display().to_string()),
        rows,
    })
}

/// How long after the last call the memory of live sessions is read: the
/// workers' idle time before they give back their copies of their
/// zygote's unchanged pages, then 0.5 s for the give-back (15-25 ms of
/// comparison after a full collection) and the freed memory to settle.
pub fn given_back_wait() -> Duration {
    Duration::from_millis(u64::from(rvisor::GIVE_BACK_IDLE_MS) + 500)
}

/// PSS per session of a fresh `rvisor serve`'s tree after `case`, and the
/// median private bytes of the sessions' workers.
fn rvisor_case(bin: &std::path::Path, case: &Case) -> Result<(u64, u64), String> {
    rvisor_case_with(bin, case, false)
}

/// [`rvisor_case`], with `merge`: a server with `--merge-pages`, measured
/// once the kernel's merging thread has scanned everything three times
/// since the calls ended ([`wait_for_merging`]).
fn rvisor_case_with(bin: &std::path::Path, case: &Case, merge: bool) -> Result<(u64, u64), String> {
    let server = Serve::start(bin, if merge { &["--merge-pages"] } else { &[] })?;
    // The preloaded zygote and both kinds of spares, as a server that has
    // been up a while has them.
    server.wait_pool()?;
    // A server that makes the preloaded zygote on first use: where the
    // row's sessions use ggplot2, one session named it before (a server
    // that serves such sessions has its preloaded zygote), ended before
    // the row's sessions start.
    if case.calls.iter().any(|c| c.contains("ggplot")) {
        let s = server.post("/v1/sessions", &json!({}))?;
        let id = s["id"]
            .as_str()
            .ok_or_else(|| format!("no session id in {s}"))?;
        server.post(
            &format!("/v1/sessions/{id}/run"),
            &json!({ "code": "library(ggplot2)" }),
        )?;
        server.delete(&format!("/v1/sessions/{id}"))?;
        server.wait_pool()?;
    }
    let mut ids = Vec::new();
    for _ in 0..SESSIONS {
        let s = server.post("/v1/sessions", &json!({}))?;
        ids.push(
            s["id"]
                .as_str()
                .ok_or_else(|| format!("no session id in {s}"))?
                .to_string(),
        );
    }
    for code in case.calls {
        for id in &ids {
            let r = server.post(&format!("/v1/sessions/{id}/run"), &json!({ "code": code }))?;
            if r["outcome"] != "complete" {
                return Err(format!(
                    "`{code}` ended {}: {:.300}",
                    r["outcome"], r["console"]
                ));
            }
        }
    }
    // What the last calls freed is freed, spares forked meanwhile are up,
    // and the workers, idle, gave back their copies of their zygote's
    // pages that the collection left unchanged.
    std::thread::sleep(given_back_wait());
    if merge {
        wait_for_merging(Duration::from_secs(420))?;
    }
    let mut private = Vec::new();
    for id in &ids {
        let st = server.get(&format!("/v1/sessions/{id}"))?;
        if let Some(pid) = st["pid"].as_u64() {
            if let Some(r) = rollup(pid as u32) {
                private.push(r.private);
            }
        }
    }
    let total: u64 = tree(server.child.id())
        .into_iter()
        .filter_map(rollup)
        .map(|r| r.pss)
        .sum();
    private.sort_unstable();
    let median = private.get(private.len() / 2).copied().unwrap_or(0);
    Ok((total / SESSIONS as u64, median))
}

/// Waits until `ksmd` finished three more full scans (at most `within`):
/// a page is merged once two scans in a row found it unchanged, and the
/// first count may end a scan that was under way. A scan takes what the
/// host's `/sys/kernel/mm/ksm/pages_to_scan` and `sleep_millisecs` make
/// it (Debian's 100 pages per 20 ms: ~10 s for the sessions without
/// ggplot2, ~1 min with it).
fn wait_for_merging(within: Duration) -> Result<(), String> {
    let scans = || -> Result<u64, String> {
        std::fs::read_to_string("/sys/kernel/mm/ksm/full_scans")
            .map_err(|e| format!("cannot read ksmd's scans: {e}"))?
            .trim()
            .parse::<u64>()
            .map_err(|e| format!("ksmd's scans: {e}"))
    };
    let start = scans()?;
    let end = Instant::now() + within;
    while scans()? < start + 3 {
        if Instant::now() > end {
            return Err(format!(
                "ksmd did not scan three times within {} s",
                within.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// Proportional and private bytes of one process.
struct Rollup {
    pss: u64,
    private: u64,
}

fn rollup(pid: u32) -> Option<Rollup> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let kb = |key: &str| -> u64 {
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    Some(Rollup {
        pss: kb("Pss:") * 1024,
        private: (kb("Private_Clean:") + kb("Private_Dirty:")) * 1024,
    })
}

/// `root` and every process below it (by the parent pids in /proc).
fn tree(root: u32) -> Vec<u32> {
    let mut parent_of = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(ppid) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    // The fields after the command name, which may hold spaces.
                    let rest = &s[s.rfind(')')? + 2..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
            {
                parent_of.push((pid, ppid));
            }
        }
    }
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        out.extend(parent_of.iter().filter(|(_, pp)| *pp == p).map(|(c, _)| *c));
        i += 1;
    }
    out
}

/// An `rvisor serve` of this binary on a free loopback port, ended when
/// dropped.
struct Serve {
    child: Child,
    addr: String,
    _dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Serve {
    fn start(bin: &std::path::Path, extra: &[&str]) -> Result<Serve, String> {
        let dir = std::env::temp_dir().join(format!(
            "rvisor-bench-memory-{}-{}",
            std::process::id(),
            rvisor::ids::random_hex(4)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let dir = TempDir(dir);
        let mut child = Command::new(bin)
            .args(["serve", "--no-auth", "--listen", "127.0.0.1:0"])
            .args(extra)
            .arg("--data-dir")
            .arg(dir.0.join("data"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let stderr = child.stderr.take().ok_or("no stderr")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(a) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(a.trim().to_string());
                }
            }
        });
        let mut serve = Serve {
            child,
            addr: String::new(),
            _dir: dir,
        };
        serve.addr = rx
            .recv_timeout(Duration::from_secs(120))
            .map_err(|_| "rvisor serve did not start listening".to_string())?;
        Ok(serve)
    }

    /// Waits until the pool has its warm and preloaded zygotes and the
    /// spares of both (or the preloaded one cannot come).
    fn wait_pool(&self) -> Result<(), String> {
        let end = Instant::now() + Duration::from_secs(180);
        loop {
            if let Ok(h) = self.get("/v1/health") {
                let w = &h["workers"];
                let target = w["spares_target"].as_u64().unwrap_or(0);
                let preloaded = w["preloaded_zygote_pid"].as_u64().is_some();
                let spares = w["spares"].as_u64().unwrap_or(0) >= target;
                // (An older server has no preloaded_spares_target.)
                let pre_target = w["preloaded_spares_target"].as_u64().unwrap_or(target);
                let pre_spares = w["preloaded_spares"].as_u64().unwrap_or(0) >= pre_target;
                // An older server (one zygote) has no preloaded_zygote_pid.
                let one_zygote = w.get("preloaded_zygote_pid").is_none();
                // Nor does one that makes it when a call first names a
                // preload, until one has.
                let not_yet = w["preload_awaits_first_use"] == true;
                if w["warm"] == true
                    && spares
                    && ((preloaded && pre_spares) || one_zygote || not_yet)
                {
                    return Ok(());
                }
            }
            if Instant::now() > end {
                return Err("the pool did not become ready within 180 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn agent() -> ureq::Agent {
        ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(5))
            .timeout(Duration::from_secs(300))
            .build()
    }

    fn get(&self, path: &str) -> Result<Value, String> {
        Self::agent()
            .get(&format!("http://{}{path}", self.addr))
            .call()
            .map_err(|e| e.to_string())?
            .into_string()
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
    }

    fn post(&self, path: &str, body: &Value) -> Result<Value, String> {
        Self::agent()
            .post(&format!("http://{}{path}", self.addr))
            .set("Content-Type", "application/json")
            .send_string(&body.to_string())
            .map_err(|e| e.to_string())?
            .into_string()
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
    }

    fn delete(&self, path: &str) -> Result<(), String> {
        Self::agent()
            .delete(&format!("http://{}{path}", self.addr))
            .call()
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: our own child, not yet reaped, so the pid is its own.
            unsafe { libc::kill(pid, libc::SIGTERM) };
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
}

/// The section as Markdown.
pub fn table(m: &MemoryReport) -> String {
    let mb = |b: Option<u64>| {
        b.map(|b| format!("{:.1}", b as f64 / 1048576.0))
            .unwrap_or_else(|| "-".into())
    };
    let (base_head, base_rule) = match &m.baseline {
        Some(b) => (format!(" baseline {b} PSS MB (private) |"), " ---: |"),
        None => (String::new(), ""),
    };
    let mut s = format!(
        "\n## Memory of a live session after a full gc()\n\n{}.\n\n| sessions ran | rvisor PSS MB per session (private) |{base_head} Rserve PSS MB per session (private) | rvisor / Rserve |\n| --- | ---: |{base_rule} ---: | ---: |\n",
        m.how
    );
    for r in &m.rows {
        let ratio = match (r.rvisor_pss_per_session, r.rserve_pss_per_session) {
            (Some(a), Some(b)) if b > 0 => format!("{:.2}x", a as f64 / b as f64),
            _ => "-".into(),
        };
        let base = match &m.baseline {
            Some(_) => format!(
                " {} ({}) |",
                mb(r.baseline_pss_per_session),
                mb(r.baseline_private)
            ),
            None => String::new(),
        };
        s.push_str(&format!(
            "| {} | {} ({}) |{base} {} ({}) | {ratio}{} |\n",
            r.title,
            mb(r.rvisor_pss_per_session),
            mb(r.rvisor_private),
            mb(r.rserve_pss_per_session),
            mb(r.rserve_private),
            r.note
                .as_deref()
                .map(|n| format!("; {n}"))
                .unwrap_or_default()
        ));
    }
    s
}
