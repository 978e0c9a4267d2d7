//! `rvisor batch`: many scripts for a harness, each in a fresh isolated
//! worker, N at a time; one JSONL line per script, a summary at the end.

use anyhow::{bail, Context, Result};
use base64::Engine;
use rvisor::{BatchJob, BatchOptions, CallContext, CallOptions, RunResult};
use serde_json::Value;
use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Arguments of `rvisor batch`.
#[derive(clap::Args, Debug)]
pub(crate) struct BatchArgs {
    /// Scripts, or directories whose `*.R` files are run (sorted).
    inputs: Vec<PathBuf>,
    /// A JSONL manifest instead of (or besides) inputs: one
    /// `{"id", "file" | "code", "timeout_seconds"?, "variables"?,
    /// "inputs"?}` per line (`inputs`: files put in that job's working
    /// directory, paths relative to the manifest).
    #[arg(long)]
    manifest: Option<PathBuf>,
    /// Scripts run at once (default: the number of cores).
    #[arg(long, short = 'j')]
    jobs: Option<usize>,
    /// Where the JSONL results go (default: standard output).
    #[arg(long, short = 'o')]
    out: Option<PathBuf>,
    /// Write each script's plots as OUT/<id>/plot-NNN.png.
    #[arg(long)]
    plots_dir: Option<PathBuf>,
    /// Put FILE in every job's working directory, under its file name,
    /// before it runs (repeatable; a manifest line adds its own
    /// `inputs`).
    #[arg(long = "input", value_name = "FILE")]
    input_files: Vec<PathBuf>,
    /// Copy the files each job wrote (new or changed in its working
    /// directory; tempdir() left out) into DIR/<id>/, and list them in its
    /// result line's `artifacts` (docs/files.md).
    #[arg(long, value_name = "DIR")]
    output_dir: Option<PathBuf>,
    /// Results in input order (default: as they finish).
    #[arg(long)]
    ordered: bool,
    /// Skip ids that already have a result in --out (appending the rest).
    #[arg(long, requires = "out")]
    resume: bool,
    /// Time limit per script in seconds (a manifest line may set its own).
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    /// Deterministic runs: set.seed(N), TZ=UTC and the C collation before
    /// each script, and no run-specific fields (execution ids, times,
    /// usage) in the output, so two runs compare byte for byte.
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// Workers load no packages beyond R's defaults before a script (as
    /// `rvisor run` and `Rscript`): by default the zygote preloads ggplot2
    /// and its dependencies, whose namespaces (and S3 methods) are then
    /// already loaded when a script starts.
    #[arg(long)]
    no_preload: bool,
}

/// One output line.
#[derive(serde::Serialize)]
struct Line<'a> {
    id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    file: Option<&'a str>,
    result: &'a RunResult,
}

/// One script as the batch knows it.
struct Item {
    id: String,
    file: Option<String>,
    job: BatchJob,
    /// Its own input files (a manifest line's `inputs`).
    inputs: Vec<PathBuf>,
}

/// `path` if it is a readable file, else an error naming `what`.
fn input_file(path: PathBuf, what: &str) -> Result<PathBuf> {
    if std::fs::File::open(&path).is_ok() && path.is_file() {
        Ok(path)
    } else {
        bail!("{what} {}: not a readable file", path.display())
    }
}

fn job(id: String, code: String, timeout: f64, variables: Vec<(String, Value)>) -> BatchJob {
    BatchJob {
        id,
        code,
        opts: CallOptions::one_shot((timeout > 0.0).then(|| Duration::from_secs_f64(timeout))),
        ctx: CallContext {
            variables,
            ..CallContext::default()
        },
    }
}

fn read_script(path: &Path) -> Result<String> {
    let bytes =
        std::fs::read(path).with_context(|| format!("failed to read {}", path.display()))?;
    String::from_utf8(bytes).map_err(|_| {
        anyhow::anyhow!(
            "{} is not UTF-8 text; convert it (e.g. iconv -t UTF-8)",
            path.display()
        )
    })
}

/// The scripts of the inputs and the manifest, in order, with unique ids.
fn items(a: &BatchArgs) -> Result<Vec<Item>> {
    let mut out = Vec::new();
    for input in &a.inputs {
        let files = if input.is_dir() {
            let mut f: Vec<PathBuf> = std::fs::read_dir(input)
                .with_context(|| format!("failed to list {}", input.display()))?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "R" || x == "r"))
                .collect();
            f.sort();
            f
        } else {
            vec![input.clone()]
        };
        for f in files {
            let id = f.display().to_string();
            let code = read_script(&f)?;
            out.push(Item {
                file: Some(id.clone()),
                job: job(id.clone(), code, a.timeout, Vec::new()),
                id,
                inputs: Vec::new(),
            });
        }
    }
    if let Some(m) = &a.manifest {
        let text =
            std::fs::File::open(m).with_context(|| format!("failed to open {}", m.display()))?;
        let base = m.parent().unwrap_or(Path::new("."));
        for (n, line) in std::io::BufReader::new(text).lines().enumerate() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            let where_ = format!("{}:{}", m.display(), n + 1);
            let v: Value = serde_json::from_str(&line)
                .with_context(|| format!("{where_}: not a JSON object"))?;
            let file = v["file"].as_str().map(String::from);
            let code = match (&file, v["code"].as_str()) {
                (Some(f), None) => read_script(&base.join(f))?,
                (None, Some(c)) => c.to_string(),
                _ => bail!("{where_}: give either \"file\" or \"code\""),
            };
            let id = match v["id"].as_str().or(file.as_deref()) {
                Some(id) => id.to_string(),
                None => bail!("{where_}: a line with \"code\" needs an \"id\""),
            };
            let timeout = v["timeout_seconds"].as_f64().unwrap_or(a.timeout);
            let mut variables = Vec::new();
            match &v["variables"] {
                Value::Null => {}
                Value::Object(map) => {
                    variables.extend(map.iter().map(|(k, v)| (k.clone(), v.clone())))
                }
                Value::Array(list) => {
                    for x in list {
                        let (Some(name), Some(value)) = (x["name"].as_str(), x.get("value")) else {
                            bail!("{where_}: each variable needs \"name\" and \"value\"");
                        };
                        variables.push((name.to_string(), value.clone()));
                    }
                }
                _ => bail!("{where_}: \"variables\" is an object or a list of {{name, value}}"),
            }
            rvisor::ops::check_variables(&variables, &rvisor::SafetyRules::default())
                .map_err(|e| anyhow::anyhow!("{where_}: {e}"))?;
            let mut inputs = Vec::new();
            match &v["inputs"] {
                Value::Null => {}
                Value::Array(list) => {
                    for x in list {
                        let Some(p) = x.as_str() else {
                            bail!("{where_}: \"inputs\" is a list of file paths");
                        };
                        inputs.push(input_file(base.join(p), &format!("{where_}: the input"))?);
                    }
                }
                _ => bail!("{where_}: \"inputs\" is a list of file paths"),
            }
            out.push(Item {
                file,
                job: job(id.clone(), code, timeout, variables),
                id,
                inputs,
            });
        }
    }
    let mut seen = HashSet::new();
    for i in &out {
        if !seen.insert(i.id.clone()) {
            bail!(
                "the id {:?} is given twice; ids name results and plot directories",
                i.id
            );
        }
    }
    // Each job's artifacts go in a directory of its own.
    if a.output_dir.is_some() {
        let mut dirs = HashSet::new();
        for i in &out {
            if !dirs.insert(dir_name(&i.id)) {
                bail!(
                    "the ids {:?} and another map to the same directory {:?} of --output-dir; \
                     give them ids that differ in letters, digits, '-', '_' or '.'",
                    i.id,
                    dir_name(&i.id)
                );
            }
        }
    }
    if out.is_empty() {
        bail!("nothing to run: give scripts, directories of *.R files, or --manifest FILE.jsonl");
    }
    Ok(out)
}

/// The ids that already have a result line in `out`.
fn done_ids(out: &Path) -> HashSet<String> {
    let Ok(f) = std::fs::File::open(out) else {
        return HashSet::new();
    };
    std::io::BufReader::new(f)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str::<Value>(&l).ok())
        .filter(|v| v.get("result").is_some())
        .filter_map(|v| v["id"].as_str().map(String::from))
        .collect()
}

/// A result with what differs between two runs of the same script taken
/// out (for `--seed`): execution id, times, usage, worker pid.
fn deterministic(mut r: RunResult, id: &str) -> RunResult {
    r.execution_id = format!("batch:{id}");
    r.duration_ms = 0.0;
    r.usage = Default::default();
    r.session.id = "batch".into();
    r
}

/// A directory name for `id`: path separators and odd bytes replaced.
fn dir_name(id: &str) -> String {
    id.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn write_plots(dir: &Path, id: &str, r: &RunResult) -> Result<()> {
    if r.plots.is_empty() {
        return Ok(());
    }
    let d = dir.join(dir_name(id));
    std::fs::create_dir_all(&d).with_context(|| format!("failed to create {}", d.display()))?;
    for (i, p) in r.plots.iter().enumerate() {
        let data = base64::engine::general_purpose::STANDARD.decode(&p.data_base64)?;
        let path = d.join(format!("plot-{:03}.png", i + 1));
        std::fs::write(&path, data)
            .with_context(|| format!("failed to write {}", path.display()))?;
    }
    Ok(())
}

/// The files around each job of `all`: `--input` and its own inputs in,
/// what it wrote out to `--output-dir`/<id>/. `None` without either.
fn job_files(a: &BatchArgs, all: &mut [Item]) -> Result<Option<rvisor::BatchFiles>> {
    let common = a
        .input_files
        .iter()
        .map(|p| input_file(p.clone(), "--input"))
        .collect::<Result<Vec<_>>>()?;
    if common.is_empty() && a.output_dir.is_none() && all.iter().all(|i| i.inputs.is_empty()) {
        return Ok(None);
    }
    let per_job: Vec<Vec<PathBuf>> = all
        .iter_mut()
        .map(|i| {
            let mut v = common.clone();
            v.append(&mut i.inputs);
            v
        })
        .collect();
    let out = a.output_dir.clone();
    Ok(Some(rvisor::BatchFiles(std::sync::Arc::new(
        move |index: usize, id: &str| -> Box<dyn rvisor::files::RunFiles> {
            Box::new(crate::files::CliFiles::new(
                per_job.get(index).cloned().unwrap_or_default(),
                out.as_ref().map(|d| d.join(dir_name(id))),
            ))
        },
    ))))
}

/// The packages the zygote preloads for `a` (None: the pool's default).
pub(crate) fn preload(a: &BatchArgs) -> Option<Vec<String>> {
    a.no_preload.then(Vec::new)
}

/// The number of scripts `a` runs at once.
pub(crate) fn parallel(a: &BatchArgs) -> usize {
    a.jobs
        .unwrap_or_else(|| BatchOptions::default().parallel)
        .max(1)
}

pub(crate) fn run(a: BatchArgs, sup: rvisor::Supervisor) -> Result<ExitCode> {
    let mut all = items(&a)?;
    if a.resume {
        let done = done_ids(a.out.as_deref().unwrap_or(Path::new("")));
        all.retain(|i| !done.contains(&i.id));
    }
    let total = all.len();
    if total == 0 {
        eprintln!("rvisor batch: nothing left to run: every id already has a result");
        return Ok(ExitCode::SUCCESS);
    }
    let files: Vec<(String, Option<String>)> =
        all.iter().map(|i| (i.id.clone(), i.file.clone())).collect();
    let run_files = job_files(&a, &mut all)?;
    let jobs: Vec<BatchJob> = all.into_iter().map(|i| i.job).collect();
    let mut out: Box<dyn Write> = match &a.out {
        Some(p) => Box::new(std::io::BufWriter::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(a.resume)
                .write(true)
                .truncate(!a.resume)
                .open(p)
                .with_context(|| format!("failed to open {}", p.display()))?,
        )),
        None => Box::new(crate::out::stdout()),
    };
    let preamble = a.seed.map(|s| {
        format!("set.seed({s}); Sys.setenv(TZ = \"UTC\"); invisible(Sys.setlocale(\"LC_COLLATE\", \"C\"))")
    });
    let started = Instant::now();
    let batch = sup.batch(
        jobs,
        BatchOptions {
            parallel: parallel(&a),
            preamble,
            files: run_files,
        },
    );
    let progress = std::io::stderr().is_terminal();
    let mut by_outcome: BTreeMap<String, usize> = BTreeMap::new();
    let mut slowest: Vec<(f64, String)> = Vec::new();
    let mut failed = 0usize;
    let mut finished = 0usize;
    let mut pending: BTreeMap<usize, String> = BTreeMap::new();
    let mut next_out = 0usize;
    for done in batch {
        finished += 1;
        let r = done.result;
        *by_outcome.entry(r.outcome.to_string()).or_default() += 1;
        if !r.success {
            failed += 1;
        }
        slowest.push((r.duration_ms, done.id.clone()));
        if let Some(dir) = &a.plots_dir {
            write_plots(dir, &done.id, &r)?;
        }
        let r = if a.seed.is_some() {
            deterministic(r, &done.id)
        } else {
            r
        };
        let file = files.get(done.index).and_then(|f| f.1.clone());
        // A struct, not a JSON map, so the fields keep their order (id
        // first, the result's fields as the contract lists them).
        let line = serde_json::to_string(&Line {
            id: &done.id,
            file: file.as_deref(),
            result: &r,
        })?;
        if a.ordered {
            pending.insert(done.index, line);
            while let Some(l) = pending.remove(&next_out) {
                writeln!(out, "{l}")?;
                next_out += 1;
            }
        } else {
            writeln!(out, "{line}")?;
        }
        out.flush()?;
        if progress {
            let secs = started.elapsed().as_secs_f64();
            let eta = secs / finished as f64 * (total - finished) as f64;
            eprint!(
                "\rrvisor batch: {finished}/{total} done, {failed} failed, {secs:.0} s, ETA {eta:.0} s   "
            );
        }
    }
    if progress {
        eprintln!();
    }
    drop(out);
    slowest.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut err = std::io::stderr().lock();
    writeln!(
        err,
        "rvisor batch: {finished} scripts in {:.1} s, {failed} failed",
        started.elapsed().as_secs_f64()
    )?;
    for (o, n) in &by_outcome {
        writeln!(err, "  {o:<20} {n}")?;
    }
    if !slowest.is_empty() {
        writeln!(err, "  slowest:")?;
        for (ms, id) in slowest.iter().take(5) {
            writeln!(err, "    {:>9.1} ms  {id}", ms)?;
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
