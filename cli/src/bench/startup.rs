//! The cold-start rows of `rvisor bench`: a whole new process to its first
//! result, for each way users start rvisor (`session --jsonl`, `serve`,
//! `run`), confined and unconfined, side by side with `Rscript -e` and with
//! Rserve started, connected to and asked. Also the first ggplot of a new
//! session against a later one, and where `rvisor run`'s time goes (from
//! the `RVISOR_TIMING` marks of the CLI, the supervisor and the zygote).
//!
//! Every repetition runs every system once, in turn (interleaved), so
//! background load hits all alike; the tables give medians and the ratio
//! to `Rscript`. What a command leaves running after it ends (a killed
//! zygote still tearing its memory down, a server's workers, an Rserve
//! daemon being stopped) is waited for before the next row starts
//! ([`Adopter`]): one row's teardown does not land in the next one's time.

use super::{ms, rscript_calls, summarise, Peers, Stats};
use rvisor::timing::{
    CLI_EXIT, CLI_MAIN, FORK_FORKED, FORK_READY, FORK_REQUEST, RUN_ONCE_CALL, RUN_ONCE_RESULT,
    SUPERVISOR_NEW, SUPERVISOR_PROBED, SUPERVISOR_SHUT, SUPERVISOR_SHUTDOWN, WORKER_MAIN,
    WORKER_R_START, WORKER_R_STARTED, WORKER_WARMED_UP, ZYGOTE_HELLO, ZYGOTE_LAUNCH,
};
use rvisor::{Outcome, Supervisor, SupervisorConfig};
use serde::Serialize;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long one start may take before the bench gives up on it.
const START_DEADLINE: Duration = Duration::from_secs(120);

/// The ggplot of the plot rows (the same as the latency table's).
pub const GGPLOT: &str =
    "print(ggplot2::ggplot(mtcars, ggplot2::aes(wt, mpg)) + ggplot2::geom_point())";

/// One row of the cold-start table.
struct Row {
    id: &'static str,
    title: &'static str,
}

/// The rows, in table order; `rscript`/`rserve` are the references.
const ROWS: &[Row] = &[
    Row {
        id: "rscript",
        title: "`Rscript -e '1+1'` whole process (reference)",
    },
    Row {
        id: "rserve",
        title: "Rserve: start the server, connect, eval `1+1` (from R)",
    },
    Row {
        id: "session_jsonl",
        title: "`rvisor session --jsonl`: start -> first `1+1` result line",
    },
    Row {
        id: "serve",
        title: "`rvisor serve`: start -> first `POST /v1/run` `1+1` answered",
    },
    Row {
        id: "run",
        title: "`rvisor run one.R` (`1+1`) whole process",
    },
    Row {
        id: "session_jsonl_unconfined",
        title: "`rvisor session --jsonl --unconfined`: start -> first `1+1`",
    },
    Row {
        id: "serve_unconfined",
        title: "`rvisor serve --unconfined`: start -> first `/v1/run` `1+1`",
    },
    Row {
        id: "run_unconfined",
        title: "`rvisor run --unconfined one.R` whole process",
    },
    Row {
        id: "rscript_ggplot",
        title: "`Rscript -e` a ggplot to PNG, whole process (reference)",
    },
    Row {
        id: "session_jsonl_ggplot",
        title: "`rvisor session --jsonl`: start -> first ggplot result line",
    },
];

/// One phase of a command's time, from the timing marks.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// Which command: `run` or `session_jsonl`.
    pub command: String,
    /// From which mark to which.
    pub span: String,
    /// What happens in it.
    pub what: String,
    /// Median over the repetitions, milliseconds.
    pub median_ms: f64,
    /// Repetitions that had both marks.
    pub n: usize,
}

/// What the cold-start part measured.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Startup {
    /// One entry per row (workload = row id, system = who ran it).
    pub rows: Vec<Stats>,
    /// New-session rows inside one process (zygote warm): first result,
    /// first ggplot, a later ggplot.
    pub session: Vec<Stats>,
    /// Where the time of `rvisor run` and of `session --jsonl` goes.
    pub split: Vec<Phase>,
}

/// The rvisor binary that runs the bench (the one measured).
fn rvisor_bin() -> Result<PathBuf, String> {
    std::env::current_exe().map_err(|e| format!("cannot find the rvisor binary: {e}"))
}

fn with_confinement(cmd: &mut Command, unconfined: bool) {
    if unconfined {
        cmd.arg("--unconfined");
    }
}

/// Kills and reaps a child that is still running (an abandoned start).
struct Reap(Child);

impl Drop for Reap {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

/// `rvisor session --jsonl`: the request is written at once; the time is
/// from spawning to the result line. Returns the time, and the moments of
/// the spawn and of the line (for the split).
fn session_jsonl_once(
    bin: &Path,
    unconfined: bool,
    code: &str,
    timing: Option<&Path>,
) -> Result<(f64, u128, u128), String> {
    let mut cmd = Command::new(bin);
    cmd.args(["session", "--jsonl"]);
    with_confinement(&mut cmd, unconfined);
    if let Some(t) = timing {
        cmd.env(rvisor::timing::ENV_TIMING, t);
    }
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let spawned = rvisor::timing::now_us();
    let t = Instant::now();
    let mut child = Reap(
        cmd.spawn()
            .map_err(|e| format!("cannot start rvisor: {e}"))?,
    );
    let mut stdin = child.0.stdin.take().ok_or("no stdin")?;
    let stdout = child.0.stdout.take().ok_or("no stdout")?;
    let req = serde_json::json!({"id": 1, "op": "run", "code": code});
    writeln!(stdin, "{req}").map_err(|e| format!("cannot write the request: {e}"))?;
    stdin.flush().map_err(|e| e.to_string())?;
    let mut lines = BufReader::new(stdout).lines();
    let line = lines
        .next()
        .ok_or("rvisor session ended before answering")?
        .map_err(|e| e.to_string())?;
    let d = ms(t.elapsed());
    let at = rvisor::timing::now_us();
    let v: serde_json::Value =
        serde_json::from_str(&line).map_err(|e| format!("not JSON: {e}: {line}"))?;
    if v["result"]["outcome"] != "complete" {
        return Err(format!("the first result was not complete: {line}"));
    }
    // End of input closes the session and the process.
    drop(stdin);
    let _ = child.0.wait();
    Ok((d, spawned, at))
}

/// A free loopback port (bound and released: another process could take
/// it in between, which the caller notices as a failed start).
fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// One HTTP/1.1 request on a new connection; the status and the body.
fn http(port: u16, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(START_DEADLINE))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    Ok((status, body.to_string()))
}

/// `rvisor serve`: from spawning to the answer of the first `POST
/// /v1/run` (retried every 2 ms until the server listens).
fn serve_once(bin: &Path, unconfined: bool, data_dir: &Path) -> Result<f64, String> {
    let port = free_port()?;
    let mut cmd = Command::new(bin);
    cmd.arg("serve")
        .args(["--no-auth", "--shutdown-grace-secs", "0", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .arg("--data-dir")
        .arg(data_dir);
    with_confinement(&mut cmd, unconfined);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .env("RUST_LOG", "off");
    let t = Instant::now();
    let mut child = Reap(
        cmd.spawn()
            .map_err(|e| format!("cannot start rvisor: {e}"))?,
    );
    let body = r#"{"script": "1+1"}"#;
    let d = loop {
        match http(port, "POST", "/v1/run", body) {
            Ok((200, answer)) => {
                let d = ms(t.elapsed());
                if !answer.contains("\"outcome\":\"complete\"") {
                    return Err(format!("the first run did not complete: {answer}"));
                }
                break d;
            }
            Ok((status, answer)) => {
                return Err(format!("POST /v1/run answered {status}: {answer}"));
            }
            Err(_) if t.elapsed() < START_DEADLINE => {
                if let Ok(Some(st)) = child.0.try_wait() {
                    return Err(format!("rvisor serve ended at start ({st})"));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(format!("rvisor serve did not answer: {e}")),
        }
    };
    // SAFETY: kill(2) on the pid of our own child, not yet reaped.
    unsafe {
        libc::kill(child.0.id() as libc::pid_t, libc::SIGTERM);
    }
    let end = Instant::now() + Duration::from_secs(20);
    while Instant::now() < end {
        if let Ok(Some(_)) = child.0.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(d)
}

/// `rvisor run FILE`: the whole process, spawn to exit (times as for
/// [`session_jsonl_once`]).
fn run_once(
    bin: &Path,
    unconfined: bool,
    script: &Path,
    timing: Option<&Path>,
) -> Result<(f64, u128, u128), String> {
    let mut cmd = Command::new(bin);
    cmd.arg("run").arg(script);
    with_confinement(&mut cmd, unconfined);
    if let Some(t) = timing {
        cmd.env(rvisor::timing::ENV_TIMING, t);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let spawned = rvisor::timing::now_us();
    let t = Instant::now();
    let out = cmd
        .output()
        .map_err(|e| format!("cannot start rvisor: {e}"))?;
    let d = ms(t.elapsed());
    let at = rvisor::timing::now_us();
    if !out.status.success() || !String::from_utf8_lossy(&out.stdout).contains("[1] 2") {
        return Err(format!(
            "rvisor run failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        ));
    }
    Ok((d, spawned, at))
}

/// While the cold-start rows run, this process is the subreaper of what
/// the commands it starts leave behind (`PR_SET_CHILD_SUBREAPER`): their
/// orphans become its children, and [`Adopter::settle`] waits for them
/// after each row. Before, the `rvisor run` row followed the `serve` row,
/// whose zygotes and spares were still being torn down on the 2 cores
/// when `run` started (its R start 103-144 ms there, 88 ms alone).
struct Adopter {
    /// Children that are not a command's leftovers (the peer driver), or
    /// that did not end within [`SETTLE_WAIT`] once: not waited for again.
    keep: Vec<u32>,
}

/// Longest wait for one row's leftovers to end.
const SETTLE_WAIT: Duration = Duration::from_secs(5);

impl Adopter {
    fn start(keep: Vec<u32>) -> Adopter {
        // SAFETY: PR_SET_CHILD_SUBREAPER takes an integer flag and no
        // pointer; it only marks this process as its orphans' reaper.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        Adopter { keep }
    }

    /// This process's children, less the ones kept.
    fn leftovers(&self) -> Vec<u32> {
        let me = std::process::id();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| !self.keep.contains(pid))
            .filter(|pid| {
                // The parent is the 4th field, after the command's
                // parenthesised name (which may hold spaces).
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|st| {
                        let rest = &st[st.rfind(')')? + 1..];
                        rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                    })
                    == Some(me)
            })
            .collect()
    }

    /// Reaps the leftovers of the rows so far, waiting (bounded) for those
    /// still running.
    fn settle(&mut self) {
        let end = Instant::now() + SETTLE_WAIT;
        loop {
            let left = self.leftovers();
            if left.is_empty() {
                return;
            }
            for &pid in &left {
                let mut status = 0;
                // SAFETY: waits for a child of this process (its parent is
                // this process, read just above), without blocking;
                // `status` is a valid out-pointer.
                unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) };
            }
            if Instant::now() >= end {
                self.keep.extend(self.leftovers());
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Adopter {
    fn drop(&mut self) {
        self.settle();
        // SAFETY: as in `start`; orphans go to init again.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) };
    }
}

/// One timed command: spawned at, ended at (exit or result line), its
/// marks by label.
type Marks = (u128, u128, HashMap<String, Vec<u128>>);

/// The marks of one timed command: label -> times (in order).
fn read_marks(path: &Path) -> HashMap<String, Vec<u128>> {
    let mut m: HashMap<String, Vec<u128>> = HashMap::new();
    let text = std::fs::read_to_string(path).unwrap_or_default();
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let (Some(t), Some(_pid), Some(label)) = (it.next(), it.next(), it.next()) else {
            continue;
        };
        if let Ok(t) = t.parse() {
            m.entry(label.to_string()).or_default().push(t);
        }
    }
    for v in m.values_mut() {
        v.sort_unstable();
    }
    m
}

/// One end of a phase: the bench's own spawn and end times, or a mark
/// (`rvisor::timing`'s labels): its first or last line.
#[derive(Debug, Clone, Copy)]
enum At {
    /// The process was spawned.
    Spawn,
    /// `run` exited; `session --jsonl` printed its result line.
    End,
    /// The first mark of that label.
    First(&'static str),
    /// The last one (a zygote marks `worker.main` twice: it re-executes
    /// itself).
    Last(&'static str),
}
use At::{End, First, Last, Spawn};

impl std::fmt::Display for At {
    /// As the split's table names it: `spawn`, `end`, `label`, `label$`
    /// (the last).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            At::Spawn => f.write_str("spawn"),
            At::End => f.write_str("end"),
            At::First(l) => f.write_str(l),
            At::Last(l) => write!(f, "{l}$"),
        }
    }
}

/// The moment of `at` in one repetition.
fn mark_at(spawn: u128, end: u128, m: &HashMap<String, Vec<u128>>, at: At) -> Option<u128> {
    match at {
        At::Spawn => Some(spawn),
        At::End => Some(end),
        At::First(l) => m.get(l)?.first().copied(),
        At::Last(l) => m.get(l)?.last().copied(),
    }
}

/// The phases of the split: (from, to, what, which command).
/// `Spawn` and `End` are the bench's own times (process spawned; exit of
/// `run`, the result line of `session --jsonl`).
const PHASES: &[(At, At, &str, &str)] = &[
    (
        Spawn,
        First(CLI_MAIN),
        "exec rvisor: load the binary, reach main()",
        "both",
    ),
    (
        First(CLI_MAIN),
        First(SUPERVISOR_NEW),
        "parse flags, read the script",
        "both",
    ),
    (
        First(SUPERVISOR_NEW),
        First(SUPERVISOR_PROBED),
        "supervisor: locate the worker, probe confinement, cgroups, uids",
        "both",
    ),
    (
        First(SUPERVISOR_PROBED),
        First(ZYGOTE_LAUNCH),
        "pool: keeper thread asked to start the zygote",
        "both",
    ),
    (
        First(ZYGOTE_LAUNCH),
        First(WORKER_MAIN),
        "spawn the zygote process (fork + exec of rvisor-worker)",
        "both",
    ),
    (
        First(WORKER_MAIN),
        Last(WORKER_MAIN),
        "zygote re-executes itself for its 64 MiB stack",
        "both",
    ),
    (
        Last(WORKER_MAIN),
        First(WORKER_R_START),
        "zygote: hello from the supervisor",
        "both",
    ),
    (
        First(WORKER_R_START),
        First(WORKER_R_STARTED),
        "R init (setup_Rmainloop: base and default packages)",
        "both",
    ),
    (
        First(WORKER_R_STARTED),
        First(WORKER_WARMED_UP),
        "driver warm-up (JIT of the R-side driver)",
        "both",
    ),
    // The preloads and plot warm-up happen in the warm zygote, off this
    // path (its marks come later: the second `worker.warm_up` and
    // `zygote.hello`).
    (
        First(WORKER_WARMED_UP),
        First(ZYGOTE_HELLO),
        "base zygote: prepare confinement (seccomp), hello to the supervisor",
        "both",
    ),
    (
        First(ZYGOTE_HELLO),
        First(FORK_REQUEST),
        "supervisor: zygote ready -> first fork request",
        "both",
    ),
    (
        First(FORK_REQUEST),
        First(FORK_FORKED),
        "fork + confine (namespaces, uid, cgroups) until the zygote reports the pid",
        "both",
    ),
    (
        First(FORK_FORKED),
        First(FORK_READY),
        "confined worker: rest of confinement, hello",
        "both",
    ),
    (
        First(FORK_READY),
        First(RUN_ONCE_CALL),
        "hand the worker to the run",
        "run",
    ),
    (
        First(RUN_ONCE_CALL),
        First(RUN_ONCE_RESULT),
        "eval `1+1`: request, R, result",
        "run",
    ),
    (
        First(RUN_ONCE_RESULT),
        First(SUPERVISOR_SHUTDOWN),
        "after the result, until shutdown",
        "run",
    ),
    (
        First(SUPERVISOR_SHUTDOWN),
        First(SUPERVISOR_SHUT),
        "shutdown: kill the worker and the zygote, wait",
        "run",
    ),
    (
        First(SUPERVISOR_SHUT),
        First(CLI_EXIT),
        "print the result",
        "run",
    ),
    (
        First(CLI_EXIT),
        End,
        "process exit (destructors, teardown)",
        "run",
    ),
    (
        First(FORK_READY),
        End,
        "session: first call through the service, result line read",
        "session_jsonl",
    ),
];

/// Medians of the phases over the timed repetitions.
fn split(command: &str, reps: &[Marks]) -> Vec<Phase> {
    let mut out = Vec::new();
    for (from, to, what, which) in PHASES {
        if *which != "both" && *which != command {
            continue;
        }
        let mut v: Vec<f64> = reps
            .iter()
            .filter_map(|(spawn, end, m)| {
                let a = mark_at(*spawn, *end, m, *from)?;
                let b = mark_at(*spawn, *end, m, *to)?;
                (b >= a).then(|| (b - a) as f64 / 1000.0)
            })
            .collect();
        if v.is_empty() {
            continue;
        }
        v.sort_by(|a, b| a.total_cmp(b));
        out.push(Phase {
            command: command.into(),
            span: format!("{from} -> {to}"),
            what: (*what).into(),
            median_ms: v[v.len() / 2],
            n: v.len(),
        });
    }
    out
}

/// Runs the cold-start rows: `reps` interleaved repetitions.
pub fn run(reps: usize, progress: &mut dyn FnMut(&str)) -> Result<Startup, String> {
    let bin = rvisor_bin()?;
    let work = std::env::temp_dir().join(format!("rvisor-bench-startup-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(work.clone());
    let script = work.join("one.R");
    std::fs::write(&script, "1+1\n").map_err(|e| e.to_string())?;
    let data_dir = work.join("tables");
    let gg_rscript = format!("png(tempfile(), 800, 600); {GGPLOT}; invisible(dev.off())");
    let mut peers = Peers::start();

    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); ROWS.len()];
    let mut notes: Vec<Option<String>> = vec![None; ROWS.len()];
    // The confined `run` and `session --jsonl` rows write timing marks
    // (some 25 appends of one line: well under a millisecond), split below.
    let mut timed: HashMap<&str, Vec<Marks>> = HashMap::new();
    let mut adopter = Adopter::start(peers.as_ref().map(Peers::pid).into_iter().collect());
    for rep in 0..reps {
        progress(&format!("cold starts {}/{reps}", rep + 1));
        for (i, row) in ROWS.iter().enumerate() {
            if notes[i].is_some() {
                continue;
            }
            let got: Result<f64, String> = match row.id {
                "rscript" => rscript_calls("1+1", 1).map(|v| v[0]),
                "rscript_ggplot" => rscript_calls(&gg_rscript, 1).map(|v| v[0]),
                "rserve" => match peers.as_mut() {
                    None => Err("the peer driver did not start".into()),
                    Some(p) => p.ask("rserve", "process_start", 1).map(|v| v[0]),
                },
                "session_jsonl" | "run" => {
                    let marks = work.join(format!("marks-{}-{rep}", row.id));
                    let r = if row.id == "run" {
                        run_once(&bin, false, &script, Some(&marks))
                    } else {
                        session_jsonl_once(&bin, false, "1+1", Some(&marks))
                    };
                    r.map(|(d, spawned, end)| {
                        timed
                            .entry(row.id)
                            .or_default()
                            .push((spawned, end, read_marks(&marks)));
                        d
                    })
                }
                "session_jsonl_unconfined" => {
                    session_jsonl_once(&bin, true, "1+1", None).map(|x| x.0)
                }
                "session_jsonl_ggplot" => {
                    session_jsonl_once(&bin, false, GGPLOT, None).map(|x| x.0)
                }
                "serve" => serve_once(&bin, false, &data_dir),
                "serve_unconfined" => serve_once(&bin, true, &data_dir),
                "run_unconfined" => run_once(&bin, true, &script, None).map(|x| x.0),
                other => Err(format!("unknown row {other}")),
            };
            match got {
                Ok(v) => samples[i].push(v),
                Err(why) => notes[i] = Some(format!("cannot: {why}")),
            }
            adopter.settle();
        }
    }
    drop(peers);
    drop(adopter);
    let mut rows = Vec::new();
    for (i, row) in ROWS.iter().enumerate() {
        let system = match row.id {
            id if id.starts_with("rscript") => "rscript",
            "rserve" => "rserve",
            _ => "rvisor",
        };
        rows.push(summarise(
            row.id,
            system,
            std::mem::take(&mut samples[i]),
            notes[i].take(),
        ));
    }

    let mut split_out = Vec::new();
    for command in ["run", "session_jsonl"] {
        split_out.extend(split(command, timed.get(command).map_or(&[][..], |v| v)));
    }

    // Inside one process, zygote warm: a new session's first result, its
    // first ggplot, a later ggplot.
    progress("first ggplot of a new session vs a later one");
    let sup = Supervisor::new(SupervisorConfig::default()).map_err(|e| e.to_string())?;
    if !sup.pool().wait_ready(START_DEADLINE) {
        return Err(format!(
            "the zygote did not get ready: {:?}",
            sup.pool_status().last_error
        ));
    }
    let (mut first_result, mut first_gg, mut later_gg) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        sup.pool().wait_ready(Duration::from_secs(30));
        let t = Instant::now();
        let s = sup.session().map_err(|e| e.to_string())?;
        let r = s.run("1+1").map_err(|e| e.to_string())?.wait();
        if r.outcome != Outcome::Complete {
            return Err(format!("a new session's 1+1 ended with {}", r.outcome));
        }
        first_result.push(ms(t.elapsed()));
        for v in [&mut first_gg, &mut later_gg] {
            let t = Instant::now();
            let r = s.run(GGPLOT).map_err(|e| e.to_string())?.wait();
            if r.outcome != Outcome::Complete || r.plots.is_empty() {
                return Err(format!(
                    "the ggplot ended with {}: {}",
                    r.outcome, r.console
                ));
            }
            v.push(ms(t.elapsed()));
        }
    }
    sup.shutdown();
    let session = vec![
        summarise(
            "new_session_first_result",
            "rvisor",
            first_result,
            Some("zygote warm, a spare ready: new session, then 1+1".into()),
        ),
        summarise(
            "first_ggplot_new_session",
            "rvisor",
            first_gg,
            Some("the session's first ggplot (after its 1+1)".into()),
        ),
        summarise(
            "later_ggplot_same_session",
            "rvisor",
            later_gg,
            Some("the same ggplot again in that session".into()),
        ),
    ];
    Ok(Startup {
        rows,
        session,
        split: split_out,
    })
}

fn fmt(v: Option<f64>) -> String {
    super::fmt_ms(v)
}

/// The cold-start tables (Markdown).
pub fn table(s: &Startup) -> String {
    let mut out = String::from(
        "\n| cold start, whole new process | median (p90) ms | x Rscript `1+1` | n |\n| --- | --- | --- | --- |\n",
    );
    let median = |id: &str| {
        s.rows
            .iter()
            .find(|x| x.workload == id)
            .and_then(|x| x.median_ms)
    };
    let base = median("rscript");
    let base_gg = median("rscript_ggplot");
    for row in ROWS {
        let Some(x) = s.rows.iter().find(|x| x.workload == row.id) else {
            continue;
        };
        let reference = if row.id.ends_with("ggplot") {
            base_gg
        } else {
            base
        };
        let ratio = match (x.median_ms, reference) {
            (Some(m), Some(b)) if b > 0.0 => {
                let vs = if row.id.ends_with("ggplot") {
                    " (x Rscript ggplot)"
                } else {
                    ""
                };
                format!("{:.2}x{vs}", m / b)
            }
            _ => "-".into(),
        };
        let value = match (x.median_ms, &x.note) {
            (Some(_), _) => format!("{} ({})", fmt(x.median_ms), fmt(x.p90_ms)),
            (None, Some(n)) => n.clone(),
            (None, None) => "-".into(),
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            row.title, value, ratio, x.n
        ));
    }
    if !s.session.is_empty() {
        out.push_str(
            "\n| new session in a running rvisor | median (p90) ms | note |\n| --- | --- | --- |\n",
        );
        for x in &s.session {
            out.push_str(&format!(
                "| {} | {} ({}) | {} |\n",
                x.workload,
                fmt(x.median_ms),
                fmt(x.p90_ms),
                x.note.as_deref().unwrap_or("")
            ));
        }
        let m = |id: &str| {
            s.session
                .iter()
                .find(|x| x.workload == id)
                .and_then(|x| x.median_ms)
        };
        if let (Some(a), Some(b)) = (
            m("first_ggplot_new_session"),
            m("later_ggplot_same_session"),
        ) {
            if b > 0.0 {
                out.push_str(&format!(
                    "\nFirst ggplot of a new session / a later one: {:.2}x (target: at most 1.5x).\n",
                    a / b
                ));
            }
        }
    }
    for command in ["run", "session_jsonl"] {
        let phases: Vec<&Phase> = s.split.iter().filter(|p| p.command == command).collect();
        if phases.is_empty() {
            continue;
        }
        let total: f64 = phases.iter().map(|p| p.median_ms).sum();
        let title = if command == "run" {
            "where `rvisor run one.R` (confined) spends its time, spawn to exit"
        } else {
            "where `rvisor session --jsonl` (confined) spends its time, spawn to the first `1+1` result"
        };
        out.push_str(&format!(
            "\n| {title} | from -> to (marks) | median ms | share |\n| --- | --- | --- | --- |\n"
        ));
        for p in phases {
            out.push_str(&format!(
                "| {} | {} | {} | {:.0}% |\n",
                p.what,
                p.span,
                fmt(Some(p.median_ms)),
                if total > 0.0 {
                    100.0 * p.median_ms / total
                } else {
                    0.0
                }
            ));
        }
        out.push_str(&format!(
            "| sum of the medians | | {} | |\n",
            fmt(Some(total))
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_is_named_and_measured_by_its_marks() {
        let names: Vec<String> = PHASES
            .iter()
            .map(|(from, to, _, _)| format!("{from} -> {to}"))
            .collect();
        assert_eq!(names[0], "spawn -> cli.main");
        assert!(names.contains(&"worker.main -> worker.main$".to_string()));
        assert_eq!(names.last().map(String::as_str), Some("fork.ready -> end"));
        let m = HashMap::from([(WORKER_MAIN.to_string(), vec![10, 30])]);
        assert_eq!(mark_at(1, 99, &m, First(WORKER_MAIN)), Some(10));
        assert_eq!(mark_at(1, 99, &m, Last(WORKER_MAIN)), Some(30));
        assert_eq!(mark_at(1, 99, &m, Spawn), Some(1));
        assert_eq!(mark_at(1, 99, &m, End), Some(99));
        assert_eq!(mark_at(1, 99, &m, First(FORK_READY)), None);
    }
}
