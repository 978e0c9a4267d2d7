//! The batch row of `rvisor bench`: the same set of short scripts (R's own
//! help examples) through `rvisor batch -j N` and through one `Rscript`
//! process per script, N at a time, total wall time of each and the ratio.
//!
//! The scripts: every example of the base and recommended packages
//! (`tools::Rd2ex`, as `scripts/differential.R` extracts them), sorted by
//! package and topic; those that need a person, the network, other
//! programs or a long time are left out by their text; of the rest an
//! evenly spaced sample is run once under `Rscript` and the first `want`
//! that succeed within 5 s are kept. The choice is cached in the temporary
//! directory (by R version and count), so reruns measure the same scripts
//! without choosing again.
//!
//! Fairness: both sides render plots to PNG (Rscript with
//! `R_DEFAULT_DEVICE=png` in a working directory of its own per script,
//! rvisor into the result), both run `--vanilla`-like R, and each rvisor
//! batch run includes its own process start, zygote start and shutdown.

use super::{ms, Stats};
use serde::Serialize;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Writes every help example of the base and recommended packages into a
/// directory, one `pkg__topic.R` per help page that has examples; a
/// package that R does not attach by default is attached first, as
/// `example()` does.
const EXTRACT_R: &str = r#"
out <- commandArgs(trailingOnly = TRUE)[[1L]]
dir.create(out, showWarnings = FALSE, recursive = TRUE)
pkgs <- unique(c("base", "stats", "utils", "graphics", "grDevices", "methods",
                 rownames(installed.packages(priority = "recommended"))))
attached <- c("base", "stats", "utils", "graphics", "grDevices", "methods", "datasets")
for (p in pkgs) {
  db <- tryCatch(tools::Rd_db(p), error = function(e) list())
  for (nm in sort(names(db))) {
    topic <- gsub("[^A-Za-z0-9._-]", "_", sub("[.]Rd$", "", nm))
    f <- file.path(out, paste0(p, "__", topic, ".R"))
    tryCatch(tools::Rd2ex(db[[nm]], f, commentDontrun = TRUE, commentDonttest = TRUE),
             error = function(e) NULL)
    # As example() does: the package is attached first.
    if (file.exists(f) && !p %in% attached)
      writeLines(c(sprintf("library(%s)", p), readLines(f, warn = FALSE)), f)
  }
}
"#;

/// Text that marks an example as needing a person, the network, other
/// programs, the file system outside its directory, or a long time.
const SKIP: &[&str] = &[
    "Sys.sleep",
    "download",
    "url(",
    "http",
    "install.packages",
    "update.packages",
    "readline",
    "menu(",
    "browser",
    "file.choose",
    "demo(",
    "example(",
    "system(",
    "system2(",
    "shell(",
    "X11",
    "x11(",
    "tcltk",
    "parallel",
    "mclapply",
    "makeCluster",
    "help.start",
    "browseURL",
    "vignette",
    "RShowDoc",
    "Rprof",
    "debug",
    "trace(",
    "edit(",
    "fix(",
    "setwd(",
    "unlink(",
    "Sys.setenv",
    "Sys.setlocale",
    "interactive()",
    "dev.new",
    "locator(",
    "identify(",
    "q(",
    "quit(",
];

/// The longest an example may take under Rscript to be chosen.
const CHOICE_LIMIT: Duration = Duration::from_secs(5);
/// A script that takes longer than this in a measured run is killed.
const SCRIPT_DEADLINE: Duration = Duration::from_secs(60);

/// What the batch row measured.
#[derive(Debug, Clone, Serialize, Default)]
pub struct BatchRow {
    /// Scripts in the set.
    pub scripts: usize,
    /// Parallelism of both sides.
    pub jobs: usize,
    /// Repetitions (interleaved).
    pub reps: usize,
    /// `rvisor batch` whole process, per repetition.
    pub rvisor: Stats,
    /// Rscript per script, first start to last exit, per repetition.
    pub rscript: Stats,
    /// Scripts that succeeded in the last rvisor repetition.
    pub rvisor_ok: usize,
    /// Scripts that succeeded in the last Rscript repetition.
    pub rscript_ok: usize,
    /// Why there is no number, or what to know.
    pub note: Option<String>,
}

/// Runs `files` through Rscript, `jobs` at a time. Returns the wall time
/// (first start to last exit) and, per file, success and milliseconds.
fn rscript_pool(files: &[PathBuf], jobs: usize, deadline: Duration) -> (f64, Vec<(bool, f64)>) {
    let next = AtomicUsize::new(0);
    let out = Mutex::new(vec![(false, 0.0); files.len()]);
    let root = std::env::temp_dir().join(format!(
        "rvisor-bench-rscript-{}-{}",
        std::process::id(),
        rvisor::ids::random_hex(4)
    ));
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(f) = files.get(i) else { break };
                let t = Instant::now();
                let dir = root.join(i.to_string());
                let ok = std::fs::create_dir_all(&dir).is_ok()
                    && run_bounded(
                        Command::new("Rscript")
                            .arg("--vanilla")
                            .arg(f)
                            .current_dir(&dir)
                            .env("R_DEFAULT_DEVICE", "png"),
                        deadline,
                    );
                let d = ms(t.elapsed());
                if let Ok(mut o) = out.lock() {
                    o[i] = (ok, d);
                }
            });
        }
    });
    let wall = ms(t.elapsed());
    let _ = std::fs::remove_dir_all(&root);
    (wall, out.into_inner().unwrap_or_default())
}

/// Runs a command to its end (killed after `deadline`); true on success.
fn run_bounded(cmd: &mut Command, deadline: Duration) -> bool {
    let Ok(mut child) = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    else {
        return false;
    };
    let end = Instant::now() + deadline;
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return st.success(),
            Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(1)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
        }
    }
}

fn r_version() -> String {
    Command::new("Rscript")
        .args([
            "--vanilla",
            "-e",
            "cat(R.version$major, R.version$minor, sep = '.')",
        ])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The chosen scripts (cached), in a directory of their own.
fn choose(want: usize, jobs: usize, progress: &mut dyn FnMut(&str)) -> Result<PathBuf, String> {
    // v2: examples of packages not attached by default begin with library().
    let cache = std::env::temp_dir().join(format!("rvisor-bench-examples-v2-R{}", r_version()));
    let chosen = cache.join(format!("chosen-{want}"));
    let stamp = chosen.join(".complete");
    if stamp.exists() {
        return Ok(chosen);
    }
    let all = cache.join("all");
    if !all.join(".complete").exists() {
        progress("extracting R's help examples (tools::Rd2ex)");
        let _ = std::fs::remove_dir_all(&all);
        let script = cache.join("extract.R");
        std::fs::create_dir_all(&cache).map_err(|e| e.to_string())?;
        std::fs::write(&script, EXTRACT_R).map_err(|e| e.to_string())?;
        let st = Command::new("Rscript")
            .arg("--vanilla")
            .arg(&script)
            .arg(&all)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| format!("cannot run Rscript: {e}"))?;
        if !st.success() {
            return Err("extracting the help examples failed".into());
        }
        std::fs::write(all.join(".complete"), "").map_err(|e| e.to_string())?;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&all)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "R"))
        .filter(|p| {
            let Ok(text) = std::fs::read_to_string(p) else {
                return false;
            };
            let code = text
                .lines()
                .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
                .count();
            code > 0 && text.len() <= 3000 && !SKIP.iter().any(|s| text.contains(s))
        })
        .collect();
    files.sort();
    // An evenly spaced sample, half again as many as wanted: some fail.
    let n = (want * 3 / 2).min(files.len());
    let sample: Vec<PathBuf> = if n == files.len() {
        files
    } else {
        (0..n)
            .map(|i| files[i * (files.len() - 1) / n.saturating_sub(1).max(1)].clone())
            .collect()
    };
    progress(&format!(
        "choosing {want} scripts: running {} candidates under Rscript once",
        sample.len()
    ));
    let (_, res) = rscript_pool(&sample, jobs, CHOICE_LIMIT);
    let keep: Vec<&PathBuf> = sample
        .iter()
        .zip(&res)
        .filter(|(_, (ok, _))| *ok)
        .map(|(f, _)| f)
        .take(want)
        .collect();
    let _ = std::fs::remove_dir_all(&chosen);
    std::fs::create_dir_all(&chosen).map_err(|e| e.to_string())?;
    for f in &keep {
        if let Some(name) = f.file_name() {
            std::fs::copy(f, chosen.join(name)).map_err(|e| e.to_string())?;
        }
    }
    std::fs::write(&stamp, "").map_err(|e| e.to_string())?;
    Ok(chosen)
}

/// Runs the batch row: `want` scripts, `reps` interleaved repetitions.
pub fn run(want: usize, reps: usize, progress: &mut dyn FnMut(&str)) -> Result<BatchRow, String> {
    let jobs = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    let bin = std::env::current_exe().map_err(|e| format!("cannot find rvisor: {e}"))?;
    let dir = choose(want, jobs, progress)?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| e.to_string())?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "R"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err("no help example ran under Rscript".into());
    }
    let out = std::env::temp_dir().join(format!("rvisor-bench-batch-{}.jsonl", std::process::id()));
    let (mut rv, mut rs) = (Vec::new(), Vec::new());
    let (mut rvisor_ok, mut rscript_ok) = (0, 0);
    for rep in 0..reps {
        progress(&format!(
            "batch {}/{reps}: {} scripts, {jobs} at a time, rvisor batch then Rscript",
            rep + 1,
            files.len()
        ));
        let _ = std::fs::remove_file(&out);
        let t = Instant::now();
        let st = Command::new(&bin)
            .arg("batch")
            .arg("-j")
            .arg(jobs.to_string())
            .args(["--timeout", "30", "-o"])
            .arg(&out)
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| format!("cannot start rvisor batch: {e}"))?;
        rv.push(ms(t.elapsed()));
        let lines = std::fs::read_to_string(&out).unwrap_or_default();
        let results = lines.lines().count();
        if results != files.len() {
            return Err(format!(
                "rvisor batch ({st}) wrote {results} results for {} scripts",
                files.len()
            ));
        }
        rvisor_ok = lines
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["result"]["success"] == true)
            .count();
        let (wall, res) = rscript_pool(&files, jobs, SCRIPT_DEADLINE);
        rs.push(wall);
        rscript_ok = res.iter().filter(|(ok, _)| *ok).count();
    }
    let _ = std::fs::remove_file(&out);
    let note = (files.len() < want).then(|| {
        format!(
            "only {} of the {want} wanted examples ran under Rscript",
            files.len()
        )
    });
    Ok(BatchRow {
        scripts: files.len(),
        jobs,
        reps,
        rvisor: super::summarise("batch", "rvisor", rv, None),
        rscript: super::summarise("batch", "rscript", rs, None),
        rvisor_ok,
        rscript_ok,
        note,
    })
}

/// The batch table (Markdown).
pub fn table(b: &BatchRow) -> String {
    let mut s = format!(
        "\n| {} R help examples, {} at a time ({} reps) | median (p90) ms | succeeded | Rscript / rvisor |\n| --- | --- | --- | --- |\n",
        b.scripts, b.jobs, b.reps
    );
    let ratio = match (b.rvisor.median_ms, b.rscript.median_ms) {
        (Some(r), Some(s)) if r > 0.0 => format!("{:.2}x", s / r),
        _ => "-".into(),
    };
    s.push_str(&format!(
        "| `rvisor batch -j {}` (whole process, confined) | {} ({}) | {}/{} | {ratio} |\n",
        b.jobs,
        super::fmt_ms(b.rvisor.median_ms),
        super::fmt_ms(b.rvisor.p90_ms),
        b.rvisor_ok,
        b.scripts
    ));
    s.push_str(&format!(
        "| `Rscript` per script, {} at a time | {} ({}) | {}/{} | 1x |\n",
        b.jobs,
        super::fmt_ms(b.rscript.median_ms),
        super::fmt_ms(b.rscript.p90_ms),
        b.rscript_ok,
        b.scripts
    ));
    if let Some(n) = &b.note {
        s.push_str(&format!("\n{n}\n"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rscript_pool_reports_each_script() {
        let dir = std::env::temp_dir().join(format!("rvisor-bench-pool-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ok = dir.join("ok.R");
        let bad = dir.join("bad.R");
        std::fs::write(&ok, "plot(1:3)\n").unwrap();
        std::fs::write(&bad, "stop('no')\n").unwrap();
        let (_, res) = rscript_pool(&[ok, bad], 2, SCRIPT_DEADLINE);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(res.len(), 2);
        assert!(res[0].0, "plot(1:3) succeeds under Rscript");
        assert!(!res[1].0, "stop() fails under Rscript");
    }
}
