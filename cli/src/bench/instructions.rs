//! The instruction counts of the hot paths (`rvisor bench --only
//! instructions`), and the regression guard built on them
//! (`scripts/perf-guard.sh`, run by `.ci/run`).
//!
//! Times on the shared machines here drift by tens of percent; instruction
//! counts do not. Each path runs in a worker of its own under valgrind's
//! callgrind, which counts only what runs inside the worker's
//! `serve::answer_call` (`--toggle-collect`): one call from its request to
//! its result sent, R's evaluation, the driver, the plot device and the
//! result's encoding included, R's start-up not. Each path runs twice: its
//! first [`WARM_UP`] calls alone, then those and more: the first run's
//! count over its calls is the path's cost when new (the first call's
//! one-time work, such as R's just-in-time compilation of the driver's
//! handlers on the first errors, or loading the PNG device), the
//! difference over the extra calls its cost once warm.
//!
//! The new-session path ([`NEW_SESSION`]) is counted in the worker a
//! session gets: forked by a warm zygote running under callgrind, from the
//! fork to its first result (`1 + 1`) sent, the child's set-up (its
//! environment, temporary directory, plot directory, the hello) and the
//! call included. What the kernel does for it (the fork's page copies,
//! the namespaces of a confined worker) is no instruction of the worker's
//! and is timed by `rvisor bench` ("new session to first result"); the
//! supervisor's side, on threads whose interleaving varies, is not counted.
//!
//! The guard compares the figures with a committed baseline
//! (`perf/instructions.json`) and fails when one rose past the margin;
//! updating the baseline is a commit of its own (`--update`).

use rvisor::{CallOptions, Outcome, Worker, WorkerConfig};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Paths measured with displays off: `print_data_frame` is the printing
/// path its baseline was made for; `display_data_frame` is the same call
/// with its display (the driver's HTML, Markdown and JSON preview of a
/// plain table, which loads no package), so the two side by side are
/// what a table's display costs. (A table repr has to write loads repr,
/// whose allocations would make R collect garbage inside the measured
/// calls: `rvisor bench --only displays` times those.)
const TEXT_ONLY: &[&str] = &["print_data_frame"];

/// The paths measured: name, code, calls.
pub const PATHS: &[(&str, &str, usize)] = &[
    ("one_plus_one", "1 + 1", 40),
    ("error_then_next", "stop('boom')", 20),
    ("print_data_frame", "head(mtcars, 20)", 20),
    ("display_data_frame", "head(mtcars, 20)", 20),
    (
        "lm_summary",
        "summary(lm(mpg ~ wt + hp, data = mtcars))",
        10,
    ),
    (
        "base_plot",
        "plot(mtcars$wt, mtcars$mpg, main = 'cars'); abline(lm(mpg ~ wt, mtcars))",
        6,
    ),
];

/// The new-session path's name, and its sessions: the first is
/// `first_calls`, the mean of the others `instructions_per_call`.
pub const NEW_SESSION: (&str, usize) = ("new_session", 4);

/// R's initial heap for the measurements (`R_NSIZE` cons cells,
/// `R_VSIZE` bytes of vectors): no collection runs during the calls.
const GC_FREE_HEAP: [(&str, &str); 2] = [("R_NSIZE", "8000000"), ("R_VSIZE", "2G")];

/// Calls of a path before it counts as warm.
pub const WARM_UP: usize = 3;

/// A measured path.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Count {
    /// Instructions per call once warm (callgrind's `Ir`, inside the
    /// worker's call).
    pub instructions_per_call: u64,
    /// Instructions per call of the first [`WARM_UP`] calls.
    #[serde(default)]
    pub first_calls: u64,
    /// Warm calls measured.
    pub calls: usize,
}

/// The figures of one run, by path.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Counts {
    /// How they were made (valgrind's version, the worker's build), so a
    /// baseline made otherwise is not compared blindly.
    pub how: String,
    /// The processor they were counted on, for the record. Not part of
    /// `how`: under valgrind, glibc and BLAS pick their kernels by the
    /// features valgrind's virtual CPU reports, which hide the model (an AMD
    /// EPYC baseline and an Intel Xeon run agree within 0.2% on every path).
    #[serde(default)]
    pub processor: String,
    /// By path name.
    pub paths: BTreeMap<String, Count>,
}

fn valgrind() -> Result<PathBuf, String> {
    for d in ["/usr/bin", "/usr/local/bin"] {
        let p = Path::new(d).join("valgrind");
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(
        "valgrind is missing: install it (Debian: apt-get install valgrind; \
         scripts/setup.sh does)"
            .into(),
    )
}

/// The processor's model (`/proc/cpuinfo`).
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_string())
        })
        .unwrap_or_else(|| "unknown processor".into())
}

fn valgrind_version(vg: &Path) -> String {
    std::process::Command::new(vg)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The callgrind output's total of `Ir` (the `totals:` or `summary:` line).
fn total_ir(out: &Path) -> Result<u64, String> {
    let text = std::fs::read_to_string(out)
        .map_err(|e| format!("could not read callgrind's output {}: {e}", out.display()))?;
    text.lines()
        .find_map(|l| {
            l.strip_prefix("totals:")
                .or_else(|| l.strip_prefix("summary:"))
        })
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no totals in callgrind's output {}", out.display()))
}

/// Writes `path`, a script that runs the worker under callgrind with
/// `args` (collection off until a toggle turns it on).
/// RVISOR_WORKER_WARM: the worker compiles its driver and warms its
/// condition handlers as the warm zygote does, so the calls counted are
/// those of a session's worker.
fn write_wrapper(path: &Path, vg: &Path, worker: &Path, args: &str) -> Result<(), String> {
    std::fs::write(
        path,
        format!(
            "#!/bin/sh\nRVISOR_WORKER_WARM=1 exec {} --tool=callgrind --collect-atstart=no \
             {args} -q {} \"$@\"\n",
            vg.display(),
            worker.display()
        ),
    )
    .map_err(|e| format!("could not write {}: {e}", path.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| e.to_string())
}

/// Runs `code` `calls` times in a worker under callgrind and returns the
/// instructions of those calls.
fn measure(vg: &Path, dir: &Path, name: &str, code: &str, calls: usize) -> Result<u64, String> {
    let worker = rvisor::locate_worker().map_err(|e| e.to_string())?;
    let out = dir.join(format!("{name}.{calls}.callgrind"));
    let wrapper = dir.join(format!("{name}.sh"));
    write_wrapper(
        &wrapper,
        vg,
        &worker,
        &format!(
            "--toggle-collect='*serve::answer_call*' --callgrind-out-file={}",
            out.display()
        ),
    )?;
    let mut w = Worker::spawn(&WorkerConfig {
        worker_bin: Some(wrapper),
        // R starts some 30 to 50 times slower under valgrind.
        startup_timeout: Duration::from_secs(600),
        // A heap large enough that R never collects during the calls
        // (its start-up sizes, read from the environment): where a
        // collection falls depends on everything allocated before it, so
        // one more allocation anywhere would move a collection's cost
        // from one path to another, and the counts would say nothing.
        env: GC_FREE_HEAP.iter().map(|(k, _)| k.to_string()).collect(),
        ..WorkerConfig::default()
    })
    .map_err(|e| format!("the worker did not start under valgrind: {e}"))?;
    let opts = CallOptions {
        timeout: Some(Duration::from_secs(600)),
        display: rvisor::DisplayOptions {
            enabled: TEXT_ONLY.contains(&name).then_some(false),
            ..rvisor::DisplayOptions::default()
        },
        ..CallOptions::default()
    };
    // R says on the console at each collection from here on (a constant
    // cost in the count, once per path).
    w.run("invisible(gcinfo(TRUE))", &opts);
    for i in 0..calls {
        let r = w.run(code, &opts);
        if r.console.contains("Garbage collection") {
            return Err(format!(
                "{name}: R collected garbage during call {i}, which makes the count depend \
                 on what came before it; give the measurement a larger heap (GC_FREE_HEAP)"
            ));
        }
        let expected = if name == "error_then_next" {
            Outcome::Error
        } else {
            Outcome::Complete
        };
        if r.outcome != expected {
            return Err(format!(
                "{name}: call {i} ended {:?} under valgrind: {}",
                r.outcome, r.console
            ));
        }
    }
    // Callgrind writes its figures when the worker exits.
    w.shutdown(Duration::from_secs(120));
    total_ir(&out)
}

/// The new-session path: sessions of a supervisor whose zygotes run under
/// callgrind (no spares: each session's worker is forked when its first
/// call comes), each one call, `1 + 1`. Callgrind follows the forks (one
/// output per process) and counts each worker from its set-up after the
/// fork (`become_worker`) to the end of its first call, where it writes
/// that part (`--dump-after`). Returns each session's count.
fn measure_new_session(vg: &Path, dir: &Path, sessions: usize) -> Result<Vec<u64>, String> {
    let worker = rvisor::locate_worker().map_err(|e| e.to_string())?;
    let prefix = dir.join("new_session");
    let wrapper = dir.join("new_session.sh");
    write_wrapper(
        &wrapper,
        vg,
        &worker,
        &format!(
            "--toggle-collect='*zygote::become_worker*' --dump-after='*serve::answer_call*' \
             --callgrind-out-file={}.%p",
            prefix.display()
        ),
    )?;
    let sup = rvisor::Supervisor::new(rvisor::SupervisorConfig {
        worker: WorkerConfig {
            worker_bin: Some(wrapper),
            startup_timeout: Duration::from_secs(600),
            env: GC_FREE_HEAP.iter().map(|(k, _)| k.to_string()).collect(),
            ..WorkerConfig::default()
        },
        pool: rvisor::PoolConfig {
            spares: 0,
            // The warm zygote, without the preloaded one (made only when a
            // call names ggplot2, which none does here).
            preload_on_first_use: true,
            ..rvisor::PoolConfig::default()
        },
        // The confinement's layers are system calls, and a confined
        // worker is pid 1 of its namespace (one callgrind file name for
        // all): its cost is timed by the bench's no-spare rows instead.
        confinement: rvisor::Confinement::unconfined(),
        ..rvisor::SupervisorConfig::default()
    })
    .map_err(|e| format!("the supervisor did not start under valgrind: {e}"))?;
    if !sup.pool().wait_ready(Duration::from_secs(900)) {
        return Err("the zygote did not come up under valgrind".into());
    }
    let mut out = Vec::new();
    for i in 0..sessions {
        let s = sup.session().map_err(|e| e.to_string())?;
        let r = s.run("1 + 1").map_err(|e| e.to_string())?.wait();
        if r.outcome != Outcome::Complete || r.console.trim() != "[1] 2" {
            return Err(format!(
                "new_session: session {i}'s first call ended {:?} under valgrind: {}",
                r.outcome, r.console
            ));
        }
        let pid = s
            .status()
            .pid
            .ok_or_else(|| format!("new_session: session {i} has no worker pid"))?;
        s.close();
        // The part written when the first call ended: `<prefix>.<pid>.1`
        // (callgrind numbers the dumps of a process from 1).
        let part = PathBuf::from(format!("{}.{pid}.1", prefix.display()));
        let end = std::time::Instant::now() + Duration::from_secs(120);
        while !part.is_file() {
            if std::time::Instant::now() >= end {
                return Err(format!(
                    "new_session: callgrind wrote no part for worker {pid} ({})",
                    part.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        out.push(total_ir_when_written(&part)?);
    }
    sup.shutdown();
    Ok(out)
}

/// [`total_ir`] of a file callgrind may still be writing: read again until
/// it has its totals (within a minute).
fn total_ir_when_written(out: &Path) -> Result<u64, String> {
    let end = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match total_ir(out) {
            Ok(n) => return Ok(n),
            Err(e) if std::time::Instant::now() >= end => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Measures every path (of `only`, when given).
pub fn run(only: &[String], progress: &mut dyn FnMut(&str)) -> Result<Counts, String> {
    let vg = valgrind()?;
    // RVISOR_INSTRUCTIONS_ONLY=a,b measures those paths alone (with
    // RVISOR_INSTRUCTIONS_KEEP, to profile one path without the others).
    let from_env: Vec<String> = std::env::var("RVISOR_INSTRUCTIONS_ONLY")
        .map(|v| v.split(',').map(|p| p.trim().to_string()).collect())
        .unwrap_or_default();
    let only = if only.is_empty() { &from_env[..] } else { only };
    for (k, v) in GC_FREE_HEAP {
        // Read by the workers started below (their environment lists
        // these names); nothing else in this process reads them.
        std::env::set_var(k, v);
    }
    // RVISOR_INSTRUCTIONS_KEEP=DIR keeps callgrind's outputs there, to read
    // with callgrind_annotate (where a path's instructions go).
    let keep = std::env::var_os("RVISOR_INSTRUCTIONS_KEEP").map(PathBuf::from);
    let dir = keep.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("rvisor-instructions-{}", std::process::id()))
    });
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let worker = rvisor::locate_worker().map_err(|e| e.to_string())?;
    let mut counts = Counts {
        processor: cpu_model(),
        how: format!(
            "{}; worker of the {} build",
            valgrind_version(&vg),
            // target/<profile>/rvisor-worker
            worker
                .parent()
                .and_then(Path::file_name)
                .map_or_else(|| "?".into(), |p| p.to_string_lossy().into_owned())
        ),
        paths: BTreeMap::new(),
    };
    for (name, code, calls) in PATHS {
        if !only.is_empty() && !only.iter().any(|o| o == name) {
            continue;
        }
        progress(&format!(
            "instructions: {name} ({WARM_UP} first calls, then {calls} more, under callgrind)"
        ));
        let first = measure(&vg, &dir, name, code, WARM_UP)?;
        let all = measure(&vg, &dir, name, code, WARM_UP + calls)?;
        counts.paths.insert(
            name.to_string(),
            Count {
                instructions_per_call: all.saturating_sub(first) / *calls as u64,
                first_calls: first / WARM_UP as u64,
                calls: *calls,
            },
        );
    }
    let (name, sessions) = NEW_SESSION;
    if only.is_empty() || only.iter().any(|o| o == name) {
        progress(&format!(
            "instructions: {name} ({sessions} sessions, a worker forked by a zygote under callgrind \
             for each, to its first result)"
        ));
        let each = measure_new_session(&vg, &dir, sessions)?;
        let later = &each[1..];
        counts.paths.insert(
            name.to_string(),
            Count {
                instructions_per_call: later.iter().sum::<u64>() / later.len().max(1) as u64,
                first_calls: each[0],
                calls: later.len(),
            },
        );
    }
    if keep.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(counts)
}

/// One figure's comparison with its baseline.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Compared {
    /// The path.
    pub path: String,
    /// Baseline instructions per call.
    pub baseline: u64,
    /// Now.
    pub now: u64,
    /// now / baseline.
    pub ratio: f64,
    /// Over the margin.
    pub regressed: bool,
}

/// Compares `now` with `baseline`: a path whose count rose by more than
/// `margin` (0.05: 5%) has regressed. Paths missing on either side are
/// skipped (a new path gets its baseline with `--update`).
pub fn compare(baseline: &Counts, now: &Counts, margin: f64) -> Vec<Compared> {
    let mut out = Vec::new();
    for (path, c) in &now.paths {
        let Some(b) = baseline.paths.get(path) else {
            continue;
        };
        for (what, base, now) in [
            ("warm", b.instructions_per_call, c.instructions_per_call),
            ("first calls", b.first_calls, c.first_calls),
        ] {
            if base == 0 {
                continue; // a baseline made before this figure existed
            }
            let ratio = now as f64 / base as f64;
            out.push(Compared {
                path: format!("{path} ({what})"),
                baseline: base,
                now,
                ratio,
                regressed: ratio > 1.0 + margin,
            });
        }
    }
    out
}

/// The comparison as a table.
pub fn table(rows: &[Compared], margin: f64) -> String {
    let mut out = format!(
        "| path | baseline (instructions per call) | now | ratio | over {:.0}%? |\n| --- | ---: | ---: | ---: | --- |\n",
        margin * 100.0
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {:.3} | {} |\n",
            r.path,
            r.baseline,
            r.now,
            r.ratio,
            if r.regressed { "REGRESSED" } else { "ok" }
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(v: &[(&str, u64)]) -> Counts {
        Counts {
            how: String::new(),
            processor: String::new(),
            paths: v
                .iter()
                .map(|(p, n)| {
                    (
                        p.to_string(),
                        Count {
                            instructions_per_call: *n,
                            first_calls: *n * 2,
                            calls: 1,
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn a_rise_past_the_margin_is_a_regression_and_a_fall_is_not() {
        let base = counts(&[("a", 1000), ("b", 1000), ("c", 1000)]);
        let now = counts(&[("a", 1049), ("b", 1051), ("c", 500), ("new", 9)]);
        let rows = compare(&base, &now, 0.05);
        assert_eq!(rows.len(), 6);
        let regressed: Vec<&str> = rows
            .iter()
            .filter(|r| r.regressed)
            .map(|r| r.path.as_str())
            .collect();
        assert_eq!(regressed, vec!["b (warm)", "b (first calls)"]);
        assert!(table(&rows, 0.05).contains("| b (warm) | 1000 | 1051 | 1.051 | REGRESSED |"));
    }

    #[test]
    fn callgrind_totals_are_read() {
        let dir = std::env::temp_dir().join(format!("rvisor-ir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("out");
        std::fs::write(&f, "version: 1\nevents: Ir\nfl=x\n0 5\ntotals: 123456\n").unwrap();
        assert_eq!(total_ir(&f), Ok(123456));
        std::fs::write(&f, "events: Ir\n").unwrap();
        assert!(total_ir(&f).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }
}
