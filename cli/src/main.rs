//! The `rvisor` command: thin adapters over the rvisor library.

mod batch;
mod bench;
mod displays;
mod files;
#[cfg(feature = "kernel")]
mod kernel;
mod packages;
mod repl;

use anyhow::{bail, Context, Result};
use base64::Engine;
use clap::{Parser, Subcommand};
use rvisor::{CallOptions, Outcome, RunResult, Segment};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "rvisor",
    version,
    about = "Run R code fast, safely and with state"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    #[command(flatten)]
    confine: ConfineArgs,
    /// Load the preloads (ggplot2) into their zygote as soon as the server
    /// starts, rather than when a call first names one: the first such
    /// session is then as fast as the next, at ~100 MB held from the start
    /// even if no session uses them (docs/process-model.md, "Memory").
    #[arg(long, global = true)]
    preload_at_start: bool,
}

/// OS confinement of workers (every command that runs R).
#[derive(clap::Args, Debug, Clone)]
struct ConfineArgs {
    /// Run R without OS confinement: R code can do anything this user can.
    /// For trusted code only (health reports it).
    #[arg(long, global = true)]
    unconfined: bool,
    /// Address space per worker, MiB.
    #[arg(long, global = true, value_name = "MIB")]
    memory_mb: Option<u64>,
    /// Private disk (tmpfs) per worker for tempdir() and the work dir, MiB.
    #[arg(long, global = true, value_name = "MIB")]
    disk_mb: Option<u64>,
    /// Processes and threads per worker.
    #[arg(long, global = true, value_name = "N")]
    processes: Option<u64>,
    /// Let workers reach the network (default: none at all).
    #[arg(long, global = true)]
    network: bool,
    /// A host path workers may read (repeatable); it keeps its path inside.
    #[arg(long = "read-only", global = true, value_name = "PATH")]
    read_only: Vec<PathBuf>,
    /// A program workers may run (repeatable), confined like them: a name
    /// (looked up on PATH now) or an absolute path. Added to the default,
    /// pandoc when installed; `none` clears the list (the default too).
    /// The shell R runs programs through comes with any program.
    #[arg(long = "allow-program", global = true, value_name = "NAME|PATH")]
    allow_program: Vec<String>,
    /// Per-worker cgroups (memory, pids, CPU accounting): `auto` uses them
    /// when the host offers writable v1 controllers, `required` refuses to
    /// start without them, `off` never uses them.
    #[arg(long, global = true, default_value = "auto", value_parser = ["auto", "off", "required"])]
    cgroups: String,
}

static CONFINE: std::sync::OnceLock<rvisor::Confinement> = std::sync::OnceLock::new();

/// `--preload-at-start`, for [`base_config`].
static PRELOAD_AT_START: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl ConfineArgs {
    fn confinement(&self) -> Result<rvisor::Confinement> {
        if self.unconfined {
            eprintln!(
                "rvisor: WARNING: --unconfined: R code runs without OS confinement and can do \
                 anything this user can (read files, use the network, run programs)"
            );
            return Ok(rvisor::Confinement::unconfined());
        }
        let mut c = rvisor::Confinement::default();
        // The limits' own check (the library's, the server's) says what is
        // too small.
        if let Some(m) = self.memory_mb {
            c.limits.memory_bytes = m.saturating_mul(1 << 20);
        }
        if let Some(d) = self.disk_mb {
            c.limits.disk_bytes = d.saturating_mul(1 << 20);
        }
        if let Some(p) = self.processes {
            c.limits.processes = p;
        }
        if let Err(e) = c.limits.check() {
            bail!("{e} (--memory-mb, --disk-mb, --processes)");
        }
        c.network = self.network;
        c.cgroups = match self.cgroups.as_str() {
            "off" => rvisor::CgroupMode::Off,
            "required" => rvisor::CgroupMode::Required,
            _ => rvisor::CgroupMode::Auto,
        };
        for p in &self.read_only {
            let abs = std::fs::canonicalize(p)
                .with_context(|| format!("--read-only {}: no such path", p.display()))?;
            c.read_only.push(abs);
        }
        // Resolved (and refused, if a program is missing) when the
        // supervisor starts.
        c.programs = rvisor::Programs::from_flags(&self.allow_program);
        Ok(c)
    }
}

/// The supervisor configuration every command starts from (confinement
/// as given on the command line).
/// The preloaded zygote is made when a call first names a preload, unless
/// `--preload-at-start`.
fn base_config() -> rvisor::SupervisorConfig {
    rvisor::SupervisorConfig {
        confinement: CONFINE.get().cloned().unwrap_or_default(),
        pool: rvisor::PoolConfig {
            preload_on_first_use: !PRELOAD_AT_START.load(std::sync::atomic::Ordering::Relaxed),
            ..Default::default()
        },
        ..Default::default()
    }
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run an R script in a fresh worker and print its output.
    Run(RunArgs),
    /// Run many scripts (files, directories of *.R, a JSONL manifest),
    /// each in a fresh isolated worker, N at a time: one JSONL result line
    /// per script, plots per script, a summary at the end.
    Batch(batch::BatchArgs),
    /// One or more persistent sessions over JSON lines on stdin/stdout.
    Session {
        /// Speak JSON lines (the only mode so far; required for clarity).
        #[arg(long)]
        jsonl: bool,
        #[command(flatten)]
        opts: SessionArgs,
    },
    /// A Jupyter kernel (`--connection-file FILE`, as Jupyter starts it),
    /// or `rvisor kernel install` to write its kernelspec (docs/jupyter.md).
    #[cfg(feature = "kernel")]
    Kernel(kernel::KernelArgs),
    /// An interactive persistent R session (line editing, history, plots
    /// saved to files, Ctrl-C interrupts).
    Repl {
        /// Where plots are written.
        #[arg(long, default_value = "rvisor-plots")]
        plots_dir: PathBuf,
        #[command(flatten)]
        opts: SessionArgs,
    },
    /// The HTTP service for agents (CONTRACT.md): health, packages,
    /// validate, run, sessions, metrics.
    Serve {
        #[command(flatten)]
        args: Box<ServeArgs>,
    },
    /// MCP server over stdio for agents (tools: health, packages,
    /// validate, run_r_script, run_r_code, reset_r_session; with
    /// --state-dir also checkpoint_r_session, restore_r_session).
    Mcp {
        /// Where tables (data pointers) are stored.
        #[arg(long)]
        data_dir: Option<PathBuf>,
        /// Where the session keeps its checkpoints (docs/sessions.md): with
        /// it, the checkpoint_r_session and restore_r_session tools are
        /// offered, the idle session hibernates after
        /// --hibernate-after-secs, and a killed call restores the last
        /// checkpoint.
        #[arg(long, value_name = "DIR")]
        state_dir: Option<PathBuf>,
        /// With --state-dir: seconds the session may be idle before it
        /// hibernates (0: never).
        #[arg(long, default_value_t = 600.0, value_name = "SECS", value_parser = non_negative_secs)]
        hibernate_after_secs: f64,
        #[command(flatten)]
        packages: packages::PackageArgs,
    },
    /// Liveness, versions, the live safety rules, workers.
    Health {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Installed packages a script can library().
    Packages {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(subcommand)]
        action: Option<packages::PackagesCmd>,
    },
    /// Check a script without running it: syntax, forbidden functions,
    /// nesting depth, style. Exit code 0 only when valid.
    Validate {
        /// The script, or `-` for standard input.
        file: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Style engine (as for `serve --style`).
        #[arg(long, default_value = "auto", value_parser = STYLE_ENGINES)]
        style: String,
    },
    /// Measure rvisor's latency on standard workloads (table and JSON).
    Bench {
        /// Fewer samples.
        #[arg(long)]
        quick: bool,
        /// Print JSON only.
        #[arg(long)]
        json: bool,
        /// Run only these parts (comma-separated): latency (the workloads
        /// against the peers), startup (new processes to their first
        /// result), batch (scripts through `rvisor batch` vs Rscript),
        /// memory (live sessions after a full gc(), rvisor and Rserve).
        #[arg(long, value_delimiter = ',', value_parser = bench::SECTIONS)]
        only: Vec<String>,
        /// Repetitions of the startup and batch rows.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        reps: Option<u64>,
        /// Scripts of the batch row (R help examples).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        scripts: Option<u64>,
        /// With `--only instructions`: compare the counts with this
        /// baseline (perf/instructions.json) and exit 1 when a path's
        /// count rose past `--margin` (the regression guard).
        #[arg(long, value_name = "FILE")]
        baseline: Option<PathBuf>,
        /// With `--baseline`: the rise that counts as a regression (0.05: 5%).
        #[arg(long, default_value_t = 0.05, value_name = "FRACTION")]
        margin: f64,
        /// With `--baseline`: write the counts as the new baseline instead of
        /// comparing (commit it on its own, saying why).
        #[arg(long, requires = "baseline")]
        update_baseline: bool,
        #[command(flatten)]
        load: LoadArgs,
    },
}

/// Arguments of `rvisor run`.
#[derive(clap::Args, Debug)]
struct RunArgs {
    /// The script, or `-` for standard input.
    file: String,
    /// Print one RunResult as JSON instead of the console output.
    #[arg(long)]
    json: bool,
    /// Time limit in seconds (0 = none).
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    /// Write plots as PNG files into this directory.
    #[arg(long)]
    plots_dir: Option<PathBuf>,
    /// Plot width in pixels.
    #[arg(long, default_value_t = rvisor::DEFAULT_PLOT_WIDTH)]
    width: u32,
    /// Plot height in pixels.
    #[arg(long, default_value_t = rvisor::DEFAULT_PLOT_HEIGHT)]
    height: u32,
    /// Bind an R variable before the script runs (repeatable). VALUE is
    /// JSON when it parses (42, true, [1,2], "text"), else a string.
    #[arg(long = "var", value_name = "NAME=VALUE")]
    vars: Vec<String>,
    /// Load a CSV file as a data frame before the script runs
    /// (repeatable); column types are inferred, NA and empty are missing.
    #[arg(long = "table", value_name = "NAME=FILE.csv")]
    tables: Vec<String>,
    #[command(flatten)]
    display: displays::DisplayArgs,
    /// Put FILE in the run's working directory, under its file name,
    /// before the script runs (repeatable). With it or --output-dir the
    /// script runs in a private directory, not the current one.
    #[arg(long = "input", value_name = "FILE")]
    inputs: Vec<PathBuf>,
    /// Copy the files the script wrote (new or changed in its working
    /// directory; tempdir() left out) into DIR, and list them as the
    /// result's `artifacts` (docs/files.md).
    #[arg(long, value_name = "DIR")]
    output_dir: Option<PathBuf>,
    /// A library after R's own on .libPaths() (repeatable), e.g. the one
    /// `rvisor packages install` names (read-only when confined).
    #[arg(long = "library-after", value_name = "DIR")]
    library_after: Vec<PathBuf>,
}

/// Session options shared by `session` and `repl`.
#[derive(clap::Args, Debug)]
struct SessionArgs {
    /// Time limit per call in seconds.
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    /// Calls that may wait behind the running one.
    #[arg(long, default_value_t = 16)]
    queue_limit: usize,
    /// Cap on output per call, in bytes.
    #[arg(long, default_value_t = rvisor::DEFAULT_MAX_OUTPUT_BYTES)]
    max_output_bytes: u64,
    /// Plot width in pixels.
    #[arg(long, default_value_t = rvisor::DEFAULT_PLOT_WIDTH)]
    plot_width: u32,
    /// Plot height in pixels.
    #[arg(long, default_value_t = rvisor::DEFAULT_PLOT_HEIGHT)]
    plot_height: u32,
    /// An environment variable R code may read (repeatable).
    #[arg(long = "env", value_name = "NAME")]
    env: Vec<String>,
    /// Let R code read the whole host environment (secrets included).
    #[arg(long)]
    inherit_env: bool,
    /// An R library directory (repeatable, in order).
    #[arg(long)]
    libpath: Vec<PathBuf>,
    /// A library after R's own on .libPaths() (repeatable), e.g. the one
    /// `rvisor packages install` names (read-only when confined).
    #[arg(long = "library-after", value_name = "DIR")]
    library_after: Vec<PathBuf>,
    /// Directory calls run in (default: a private one per session).
    #[arg(long)]
    working_dir: Option<PathBuf>,
    /// Where the session keeps its checkpoints: with it, the `checkpoint`
    /// op works and a killed call restores the last checkpoint
    /// (docs/sessions.md).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    #[command(flatten)]
    display: displays::DisplayArgs,
}

impl SessionArgs {
    /// The supervisor for these sessions: R's library path is fixed when R
    /// starts, so the zygote (the only maker of confined workers) gets it.
    fn supervisor_config(&self) -> rvisor::SupervisorConfig {
        let mut cfg = base_config();
        cfg.worker.libpath = self.libpath.clone();
        cfg
    }

    /// The checkpoint store of `--state-dir`.
    fn checkpoints(
        &self,
    ) -> Result<Option<std::sync::Arc<dyn rvisor::checkpoint::CheckpointStore>>> {
        self.state_dir.as_deref().map(state_store).transpose()
    }

    fn options(&self) -> Result<rvisor::SessionOptions> {
        if !(self.timeout > 0.0 && self.timeout.is_finite()) {
            bail!("--timeout must be a positive number of seconds");
        }
        Ok(rvisor::SessionOptions {
            timeout: Duration::from_secs_f64(self.timeout),
            queue_limit: self.queue_limit,
            max_output_bytes: self.max_output_bytes,
            plot_width: self.plot_width,
            plot_height: self.plot_height,
            env: if self.inherit_env {
                rvisor::EnvPolicy::Inherit
            } else {
                rvisor::EnvPolicy::Names(self.env.clone())
            },
            libpath: self.libpath.clone(),
            libpath_after: self.library_after.clone(),
            working_dir: self.working_dir.clone(),
            display: self.display.options(),
            ..rvisor::SessionOptions::default()
        })
    }
}

fn session_jsonl(args: &SessionArgs) -> Result<ExitCode> {
    let mut cfg = args.supervisor_config();
    cfg.defaults = args.options()?;
    cfg.checkpoints = args.checkpoints()?;
    // The per-call timeout range: the rules' own, stretched to the
    // session's timeout when that is longer (a local harness may run long
    // fits).
    let t = &mut cfg.rules.timeout_seconds;
    t.default = cfg.defaults.timeout.as_secs().max(1);
    t.max = t.max.max(cfg.defaults.timeout.as_secs_f64().ceil() as u64);
    let sup = rvisor::Supervisor::new(cfg)?;
    sup.cleanup_on_signals()?;
    let stdin = std::io::stdin().lock();
    rvisor_server::jsonl::serve(&sup, stdin, std::io::stdout())?;
    sup.shutdown();
    Ok(ExitCode::SUCCESS)
}

/// Prints a result's segments in order: stdout text to stdout, everything
/// else (stderr, messages, warnings, errors) to stderr; `on_plot` gets each
/// plot segment's plot, with stdout flushed first.
/// Prints a call's events as they come (stdout to stdout, the rest to
/// stderr) and returns its result and the console text printed.
/// `first`, if given, is an event already read from `events`.
pub(crate) fn follow_events(
    first: Option<rvisor::CallEvent>,
    events: rvisor::Events,
) -> Result<(RunResult, String)> {
    let mut printed = String::new();
    let mut live = BlockFilter::default();
    for e in first.into_iter().chain(events) {
        let seg = match e.kind {
            rvisor::EventKind::Result { result } => {
                let mut out = std::io::stdout().lock();
                out.write_all(live.finish().as_bytes())?;
                out.flush()?;
                return Ok((*result, printed));
            }
            rvisor::EventKind::Stdout { text } => {
                let mut out = std::io::stdout().lock();
                out.write_all(live.feed(&text).as_bytes())?;
                out.flush()?;
                printed.push_str(&text);
                continue;
            }
            rvisor::EventKind::Stderr { text } => Segment::Stderr { text },
            rvisor::EventKind::Message { text } => Segment::Message { text },
            rvisor::EventKind::Warning { message, call } => Segment::Warning { message, call },
            rvisor::EventKind::Error {
                message,
                call,
                traceback,
            } => Segment::Error {
                message,
                call,
                traceback,
            },
            _ => continue,
        };
        if let Some(t) = seg.console_text() {
            let mut err = std::io::stderr().lock();
            err.write_all(t.as_bytes())?;
            err.flush()?;
            printed.push_str(&t);
        }
    }
    bail!("the call ended without a result")
}

/// Live standard output without the structured result block, which the
/// result removes from its console: lines from a start marker to its end
/// marker are not shown. A partial line that may still become a marker is
/// held until its line ends; any other text is shown as it comes (a
/// progress line without a newline too). An unterminated block is shown
/// after the call by [`print_rest`], as the result keeps it.
#[derive(Debug, Default)]
struct BlockFilter {
    inside: bool,
    pending: String,
}

const BLOCK_STARTS: [&str; 2] = ["<<<RVISOR_RESULT_START>>>", "<<<JUBE_RESULT_START>>>"];
const BLOCK_ENDS: [&str; 2] = ["<<<RVISOR_RESULT_END>>>", "<<<JUBE_RESULT_END>>>"];

impl BlockFilter {
    /// What of `text` to show now.
    fn feed(&mut self, text: &str) -> String {
        self.pending.push_str(text);
        let mut show = String::new();
        while let Some(nl) = self.pending.find('\n') {
            let line: String = self.pending.drain(..=nl).collect();
            let l = line.trim_end();
            if self.inside {
                self.inside = !BLOCK_ENDS.contains(&l);
            } else if BLOCK_STARTS.contains(&l) {
                self.inside = true;
            } else {
                show.push_str(&line);
            }
        }
        // The rest has no newline yet: show it unless it may be a marker.
        if !self.inside && !BLOCK_STARTS.iter().any(|m| m.starts_with(&self.pending)) {
            show.push_str(&std::mem::take(&mut self.pending));
        }
        show
    }

    /// At the call's end: what is held and not in a block.
    fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        if self.inside || BLOCK_STARTS.contains(&rest.trim_end()) {
            String::new()
        } else {
            rest
        }
    }
}

/// After [`follow_events`]: the plots, and the console text the stream
/// did not carry (a notice the supervisor put first, raw output of child
/// processes and C code after), each part where its segment goes: raw
/// standard output (a program's that `system()` ran) to stdout, as under
/// Rscript, the rest to stderr.
pub(crate) fn print_rest(
    r: &RunResult,
    printed: &str,
    mut on_plot: impl FnMut(&rvisor::Plot, &mut dyn Write) -> Result<()>,
) -> Result<()> {
    let parts: Vec<(bool, String)> = r
        .segments
        .iter()
        .filter_map(|s| Some((matches!(s, Segment::Stdout { .. }), s.console_text()?)))
        .collect();
    let all: String = parts.iter().map(|(_, t)| t.as_str()).collect();
    let streamed = without_result_block(printed);
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    if let Some(at) = all.find(streamed.as_str()) {
        let shown = at..at + streamed.len();
        let mut start = 0;
        for (to_stdout, text) in &parts {
            let end = start + text.len();
            // This segment's bytes before and after the streamed text.
            for range in [start..end.min(shown.start), start.max(shown.end)..end] {
                if range.start >= range.end {
                    continue;
                }
                let bytes = &all.as_bytes()[range];
                if *to_stdout {
                    err.flush()?;
                    out.write_all(bytes)?;
                } else {
                    out.flush()?;
                    err.write_all(bytes)?;
                }
            }
            start = end;
        }
    }
    out.flush()?;
    for p in &r.plots {
        on_plot(p, &mut err)?;
    }
    Ok(())
}

/// `text` without the structured result block (the result keeps it apart).
fn without_result_block(text: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in text.split_inclusive('\n') {
        let l = line.trim_end();
        if l == "<<<RVISOR_RESULT_START>>>" || l == "<<<JUBE_RESULT_START>>>" {
            inside = true;
        } else if inside && (l == "<<<RVISOR_RESULT_END>>>" || l == "<<<JUBE_RESULT_END>>>") {
            inside = false;
        } else if !inside {
            out.push_str(line);
        }
    }
    out
}

pub(crate) fn print_console(
    r: &RunResult,
    mut on_plot: impl FnMut(&rvisor::Plot, &mut dyn Write) -> Result<()>,
) -> Result<()> {
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    for seg in &r.segments {
        match seg {
            Segment::Stdout { text } => {
                err.flush()?;
                out.write_all(text.as_bytes())?;
            }
            Segment::Plot { index } => {
                if let Some(p) = r.plots.get(*index) {
                    out.flush()?;
                    on_plot(p, &mut err)?;
                }
            }
            other => {
                out.flush()?;
                if let Some(t) = other.console_text() {
                    err.write_all(t.as_bytes())?;
                }
            }
        }
    }
    out.flush()?;
    Ok(())
}

fn report(r: Result<ExitCode>) -> ExitCode {
    r.unwrap_or_else(|e| {
        eprintln!("rvisor: {e:#}");
        ExitCode::from(2)
    })
}

/// The names `--style` accepts ([`rvisor::StyleEngine::as_str`]).
const STYLE_ENGINES: [&str; 5] = ["auto", "rvisor", "lintr", "builtin", "none"];

fn supervisor_quiet() -> Result<rvisor::Supervisor> {
    supervisor_quiet_with(rvisor::StyleEngine::default())
}

fn supervisor_quiet_with(style: rvisor::StyleEngine) -> Result<rvisor::Supervisor> {
    // One-off commands need one worker: a zygote without preloads or spares
    // (workers are confined only when forked from it).
    let cfg = rvisor::SupervisorConfig {
        pool: rvisor::PoolConfig {
            zygote: true,
            spares: 0,
            preload: Some(Vec::new()),
            ..Default::default()
        },
        style,
        ..base_config()
    };
    Ok(rvisor::Supervisor::new(cfg)?)
}

/// The sessions-load row of `rvisor bench` (`--only sessions-load`):
/// defaults are issue 15's targets.
#[derive(Debug, clap::Args)]
struct LoadArgs {
    /// sessions-load: sessions to create and drive.
    #[arg(long, default_value_t = 1000, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    sessions: u64,
    /// sessions-load: MB of distinct state per session (random doubles).
    #[arg(long, default_value_t = 5.0, value_name = "MB")]
    state_mb: f64,
    /// sessions-load: the server's --max-live-sessions (0: not passed, for a
    /// server without admission control).
    #[arg(long, default_value_t = 50, value_name = "N")]
    live: u64,
    /// sessions-load: client threads.
    #[arg(long, default_value_t = 4, value_name = "K", value_parser = clap::value_parser!(u64).range(1..))]
    clients: u64,
    /// sessions-load: rounds of calls (each session once, random order)
    /// before the check of every session.
    #[arg(long, default_value_t = 2, value_name = "N")]
    rounds: u64,
    /// sessions-load: the server's --memory-budget-mb, checked against the
    /// workers' memory (default: 40 per live session; 0: not passed).
    #[arg(long, value_name = "MB")]
    memory_budget_mb: Option<u64>,
    /// sessions-load: no restart of the server in the middle.
    #[arg(long)]
    no_restart: bool,
    /// sessions-load: before each round wait until every session has
    /// hibernated, so every call restores its session (use with a short
    /// --load-hibernate-after-secs).
    #[arg(long)]
    hibernate_between_rounds: bool,
    /// sessions-load: the server's --hibernate-after-secs (default: the
    /// server's).
    #[arg(long, value_name = "SECS")]
    load_hibernate_after_secs: Option<f64>,
}

impl LoadArgs {
    fn config(&self, unconfined: bool) -> Result<bench::sessions_load::Config, String> {
        if !(self.state_mb.is_finite() && self.state_mb > 0.0 && self.state_mb <= 1024.0) {
            return Err(format!(
                "--state-mb {}: give a size from 0 to 1024 MB",
                self.state_mb
            ));
        }
        let live = (self.live > 0).then_some(self.live as usize);
        let budget = match self.memory_budget_mb {
            Some(0) => None,
            Some(b) => Some(b),
            None => live.map(|l| l as u64 * bench::sessions_load::DEFAULT_BUDGET_PER_LIVE_MB),
        };
        Ok(bench::sessions_load::Config {
            sessions: self.sessions as usize,
            state_bytes: (self.state_mb * 1048576.0) as usize,
            live,
            clients: self.clients as usize,
            rounds: self.rounds as usize,
            memory_budget_mb: budget,
            restart: !self.no_restart,
            hibernate_between_rounds: self.hibernate_between_rounds,
            hibernate_after_secs: self.load_hibernate_after_secs,
            unconfined,
            ..bench::sessions_load::Config::issue_targets()
        })
    }
}

/// Options of `rvisor serve`.
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8787")]
    listen: std::net::SocketAddr,
    /// Token file: one `TOKEN TENANT` pair per line.
    #[arg(long, conflicts_with = "no_auth")]
    tokens: Option<PathBuf>,
    /// Serve without authentication (one local user).
    #[arg(long)]
    no_auth: bool,
    /// A tenant (of the token file) whose tokens may read the server-wide
    /// /metrics (repeatable); other tenants see only their own /v1/usage.
    #[arg(long = "operator", value_name = "TENANT", requires = "tokens")]
    operators: Vec<String>,
    /// Sessions one tenant may hold open; one more is refused (429) until
    /// one closes.
    #[arg(long, default_value_t = 32, value_name = "N")]
    max_sessions_per_tenant: usize,
    /// Sessions of all tenants together.
    #[arg(long, default_value_t = 512, value_name = "N")]
    max_sessions: usize,
    /// Sessions holding a worker at once, host-wide (0: no cap). A call to
    /// a session without one first hibernates the least recently used
    /// idle session (with --state-dir), else is refused (503, Retry-After).
    #[arg(long, default_value_t = rvisor_server::admission::DEFAULT_MAX_LIVE_SESSIONS, value_name = "N")]
    max_live_sessions: usize,
    /// Sessions of one tenant holding a worker at once (0: no cap); over
    /// it that tenant's idle sessions hibernate first, else 429.
    #[arg(long, default_value_t = rvisor_server::admission::DEFAULT_MAX_LIVE_SESSIONS_PER_TENANT, value_name = "N")]
    max_live_sessions_per_tenant: usize,
    /// Calls running or queued at once for one tenant, across its sessions
    /// (0: no cap); one more is refused (429, Retry-After).
    #[arg(long, default_value_t = rvisor_server::admission::DEFAULT_MAX_CALLS_PER_TENANT, value_name = "N")]
    max_calls_per_tenant: usize,
    /// Memory the live workers may use together, MiB (PSS, else RSS; 0: no
    /// budget). Default: 3/4 of the cgroup's memory.max or of MemTotal,
    /// whichever is smaller. Over it idle sessions hibernate, least
    /// recently used first (the tenants over their fair share first), and
    /// if the calls themselves hold the memory, the largest running call
    /// of the tenant most over its fair share is stopped.
    #[arg(long, value_name = "MIB")]
    memory_budget_mb: Option<u64>,
    /// Memory one tenant's live workers may use together, MiB (default:
    /// none beyond the budget and its fair shares). Over it the tenant's
    /// idle sessions hibernate, then its largest running call is stopped;
    /// a call that would need one more worker is refused (429 `quota`).
    #[arg(long, value_name = "MIB")]
    tenant_memory_budget_mb: Option<u64>,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 * 1024 * 1024)]
    max_body_bytes: usize,
    /// Where tables (data pointers) are stored; they survive restarts.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// How long a data pointer lives, in hours.
    #[arg(long, default_value_t = 24.0)]
    table_ttl_hours: f64,
    /// Where sessions are kept durable on this host (docs/sessions.md):
    /// with it, sessions are checkpointed when idle, hibernate (worker
    /// released) after --hibernate-after-secs, a killed call restores the
    /// last checkpoint, and a restart of the server (SIGTERM, SIGINT)
    /// keeps every session: the same ids go on. Several nodes keep
    /// sessions in the shared --store instead.
    #[arg(long, value_name = "DIR", conflicts_with = "store")]
    state_dir: Option<PathBuf>,
    /// With --state-dir or --store: days a session may go unused (no call,
    /// not running on any node) before it is deleted (0: kept until
    /// closed).
    #[arg(long, default_value_t = 7.0, value_name = "DAYS", value_parser = non_negative_secs)]
    session_ttl_days: f64,
    /// With --store and a node id: seconds a node's lease on a session
    /// lasts without renewal (renewed every third of it); after a node is
    /// lost, another takes its sessions over once their leases expire
    /// (at least 3).
    #[arg(long, default_value_t = 10.0, value_name = "SECS", value_parser = positive_secs)]
    lease_secs: f64,
    /// With --state-dir or --store: the most one session's checkpoint may
    /// take, MiB (compressed). A state over it is not checkpointed: the
    /// session says so in its status (`checkpoint.failure`), keeps its
    /// worker, and is not picked for hibernation again until it changed.
    #[arg(long, default_value_t = 1024, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    checkpoint_max_mb: u64,
    /// With --state-dir or --store: the most one tenant's checkpoints may
    /// take together in the store, MiB (0: no quota). A checkpoint that
    /// would pass it is refused (429 `quota` when asked for).
    #[arg(long, default_value_t = 4096, value_name = "MIB")]
    checkpoint_quota_mb: u64,
    /// With --state-dir: seconds a session may be idle before it hibernates
    /// (0: never).
    #[arg(long, default_value_t = 600.0, value_name = "SECS", value_parser = non_negative_secs)]
    hibernate_after_secs: f64,
    /// Style notes of /v1/validate: `auto` or `rvisor` (lintr's default
    /// linters in Rust, rvisor-lint: ~1 ms for 100 lines), `lintr` (lintr
    /// itself when installed: the thorough engine and the reference, ~1-2 s
    /// for 100 lines), `builtin` (the R driver's few rules) or `none`.
    #[arg(long, default_value = "auto", value_parser = STYLE_ENGINES)]
    style: String,
    /// Also serve on an nng REQ/REP socket (ipc:///path or
    /// tcp://127.0.0.1:PORT) for hosts that are not Rust: JSON requests
    /// with a "token" field (docs/nng.md).
    #[arg(long, value_name = "URL")]
    nng: Option<rvisor_server::nng::NngUrl>,
    /// HTTP: seconds a client has to send a request's headers (from
    /// connecting, or from the first byte of a later request); slower
    /// connections are dropped.
    #[arg(long, default_value_t = 10.0, value_name = "SECS", value_parser = positive_secs)]
    header_timeout_secs: f64,
    /// HTTP: seconds a request body may take to arrive (JSON bodies in
    /// all, uploads between two pieces).
    #[arg(long, default_value_t = 30.0, value_name = "SECS", value_parser = positive_secs)]
    body_timeout_secs: f64,
    /// HTTP: seconds a kept-alive connection may wait for its next request.
    #[arg(long, default_value_t = 60.0, value_name = "SECS", value_parser = positive_secs)]
    idle_timeout_secs: f64,
    /// nng: seconds a connection may stay silent with no request in flight.
    #[arg(long, default_value_t = 300.0, value_name = "SECS", value_parser = positive_secs)]
    nng_idle_timeout_secs: f64,
    /// Open connections per listener (HTTP, nng); more are closed at once
    /// (HTTP: with a 503).
    #[arg(long, default_value_t = 1024, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// Open connections per client IP address per listener.
    #[arg(long, default_value_t = 64, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_connections_per_ip: u32,
    /// At SIGINT/SIGTERM: seconds requests in flight get to finish before
    /// every connection is closed.
    #[arg(long, default_value_t = 30.0, value_name = "SECS", value_parser = non_negative_secs)]
    shutdown_grace_secs: f64,
    /// This node's id when several serve behind one router
    /// (docs/scale-out.md): session ids become `ID.s-...`. `hostname`
    /// takes `nN` from a StatefulSet pod's name (`rvisor-2` gives n2).
    /// Default: $RVISOR_NODE_ID, else none (ids `s-...`).
    #[arg(long, value_name = "ID")]
    node_id: Option<String>,
    /// The store shared by several nodes, of tables and durable sessions:
    /// `s3://BUCKET/PREFIX` (endpoint and credentials from AWS_ENDPOINT,
    /// AWS_ALLOW_HTTP, AWS_REGION, AWS_ACCESS_KEY_ID,
    /// AWS_SECRET_ACCESS_KEY) or a directory. Default: $RVISOR_STORE, else
    /// tables in DATA_DIR/store and sessions durable only with --state-dir.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// At SIGTERM: seconds calls in flight get to finish while the node
    /// drains (readiness false, new sessions and runs refused with 503,
    /// existing sessions still answered) before it stops. Default: the
    /// shutdown grace (one knob unless the two are set apart).
    #[arg(long, value_name = "SECS", value_parser = non_negative_secs)]
    drain_grace_secs: Option<f64>,
    /// Streamed calls (SSE, JSON lines): KiB of one stream's events that
    /// may wait for a client reading more slowly than its call writes (at
    /// least 256). Past it the client gets one `lagged` event in place of
    /// the events it missed; the call never waits, and its result, which
    /// holds all of its output, still comes last.
    #[arg(long, default_value_t = (rvisor::DEFAULT_STREAM_BUFFER_BYTES >> 10) as u64, value_name = "KIB", value_parser = buffer_kib)]
    stream_buffer_kb: u64,
    /// The same for all open streams of one tenant together (0: no
    /// tenant bound, each stream keeps its own).
    #[arg(long, default_value_t = (rvisor_server::service::DEFAULT_TENANT_STREAM_BUFFER_BYTES >> 10) as u64, value_name = "KIB", value_parser = tenant_buffer_kib)]
    tenant_stream_buffer_kb: u64,
    /// Entries of each session's history (the console's, and `GET
    /// /v1/sessions/{id}/history`; docs/console.md); past it the oldest
    /// leave (1 to 10,000).
    #[arg(long, default_value_t = rvisor_server::service::DEFAULT_HISTORY_ENTRIES as u64, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=10_000))]
    history_entries: u64,
    /// KiB of each session's history (64 to 1,048,576); past it the
    /// oldest entries leave. One entry holds at most a quarter of it.
    #[arg(long, default_value_t = (rvisor_server::service::DEFAULT_HISTORY_BYTES >> 10) as u64, value_name = "KIB", value_parser = clap::value_parser!(u64).range(64..=1_048_576))]
    history_kb: u64,
    #[command(flatten)]
    packages: packages::PackageArgs,
}

/// A stream buffer in KiB: at least [`rvisor::MIN_STREAM_BUFFER_BYTES`]
/// (room for the largest single events), at most 1 GiB.
fn buffer_kib(s: &str) -> Result<u64, String> {
    let min = (rvisor::MIN_STREAM_BUFFER_BYTES >> 10) as u64;
    match s.parse::<u64>() {
        Ok(v) if (min..=1 << 20).contains(&v) => Ok(v),
        _ => Err(format!(
            "{s:?}: give a size in KiB from {min} (room for the largest single events) to 1048576"
        )),
    }
}

/// [`buffer_kib`], or 0 for none.
fn tenant_buffer_kib(s: &str) -> Result<u64, String> {
    match s {
        "0" => Ok(0),
        _ => buffer_kib(s).map_err(|e| format!("{e}, or 0 for no tenant bound")),
    }
}

/// The node id of `serve`: the flag, else $RVISOR_NODE_ID; `hostname`
/// means the pod ordinal of the host name.
fn node_id(flag: Option<String>) -> Result<Option<String>> {
    let Some(v) = flag.or_else(|| {
        std::env::var("RVISOR_NODE_ID")
            .ok()
            .filter(|v| !v.is_empty())
    }) else {
        return Ok(None);
    };
    let id = if v == "hostname" {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("failed to read the host name for --node-id hostname")?;
        rvisor_server::cluster::NodeId::from_hostname(host.trim())
    } else {
        rvisor_server::cluster::NodeId::parse(&v)
    };
    Ok(Some(
        id.map_err(|e| anyhow::anyhow!("--node-id: {e}"))?
            .to_string(),
    ))
}

/// A number of seconds above zero (and below a century).
fn positive_secs(s: &str) -> Result<f64, String> {
    match non_negative_secs(s)? {
        0.0 => Err("must be above 0 seconds".into()),
        v => Ok(v),
    }
}

/// A number of seconds, 0 or more (and below a century).
/// A cap flag: 0 means no cap.
fn uncapped(n: usize) -> usize {
    if n == 0 {
        usize::MAX
    } else {
        n
    }
}

fn non_negative_secs(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..3.2e9).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds (e.g. 10 or 0.5)")),
    }
}

fn serve(a: ServeArgs) -> Result<ExitCode> {
    let tokens = match (a.tokens, a.no_auth) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("failed to read the token file {}", path.display()))?;
            Some(rvisor_server::http::read_tokens(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?)
        }
        (None, true) => None,
        (None, false) => bail!(
            "choose how clients authenticate: --tokens FILE (lines of `TOKEN TENANT`) or --no-auth for a single local user"
        ),
    };
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("rvisor=info")),
        )
        .init();
    let node_id = node_id(a.node_id)?;
    let store = match a
        .store
        .or_else(|| std::env::var("RVISOR_STORE").ok().filter(|v| !v.is_empty()))
    {
        Some(s) => Some(
            s.parse::<rvisor_server::blob::StoreUrl>()
                .map_err(|e| anyhow::anyhow!("--store: {e}"))?,
        ),
        None => None,
    };
    let durable = match (&a.state_dir, &store) {
        (Some(dir), _) => Some(
            rvisor_server::durable::SessionStore::open(
                &rvisor_server::blob::StoreUrl::Local(dir.clone()),
                None,
                rvisor_server::durable::DEFAULT_LEASE_TTL,
            )
            .map_err(|e| anyhow::anyhow!("--state-dir {}: {e}", dir.display()))?,
        ),
        (None, Some(url)) => Some({
            let min = rvisor_server::durable::MIN_LEASE_TTL;
            if a.lease_secs < min.as_secs_f64() {
                anyhow::bail!(
                    "--lease-secs {} is too short: a lease needs at least {} s (a node writes \
                     checkpoints only while a second of it is left); use --lease-secs {} or more",
                    a.lease_secs,
                    min.as_secs(),
                    min.as_secs()
                );
            }
            rvisor_server::durable::SessionStore::open(
                url,
                node_id.clone(),
                Duration::from_secs_f64(a.lease_secs),
            )
            .map_err(|e| anyhow::anyhow!("--store {url}: {e}"))?
        }),
        (None, None) => None,
    };
    let installer = a.packages.installer(
        a.state_dir.as_deref(),
        a.data_dir.as_deref(),
        &base_config().worker.libpath,
    )?;
    let mut tables = rvisor_server::tables::TableConfig::default();
    if let Some(dir) = a.data_dir {
        tables.dir = dir;
    }
    let checkpoint_limits = rvisor_server::durable::CheckpointLimits {
        max_bytes: a.checkpoint_max_mb.saturating_mul(1 << 20),
        tenant_quota_bytes: match a.checkpoint_quota_mb {
            0 => u64::MAX,
            m => m.saturating_mul(1 << 20),
        },
        // Staged next to the state directory's files, else in the data
        // directory: a local disk, not memory.
        spool_dir: match &a.state_dir {
            Some(d) => d.clone(),
            None => tables.dir.join("checkpoint-spool"),
        },
    };
    let checkpoints = durable.as_ref().map(|d| d.checkpoints(checkpoint_limits));
    let defaults = rvisor::SessionOptions {
        hibernate_after: (a.hibernate_after_secs > 0.0)
            .then(|| Duration::from_secs_f64(a.hibernate_after_secs)),
        ..Default::default()
    };
    let sup = rvisor::Supervisor::new(rvisor::SupervisorConfig {
        style: rvisor::StyleEngine::parse(&a.style).unwrap_or_default(),
        node_id,
        checkpoints,
        defaults,
        ..base_config()
    })?;
    tables.store = store;
    tables.ttl = Duration::from_secs_f64(a.table_ttl_hours.max(0.0) * 3600.0);
    if let Some(t) = &tokens {
        for o in &a.operators {
            if !t.values().any(|tenant| tenant == o) {
                bail!("--operator {o}: no token in the token file belongs to tenant {o:?}");
            }
        }
    }
    let cfg = rvisor_server::http::ServeConfig {
        listen: a.listen,
        operators: a.operators.clone(),
        max_sessions_per_tenant: a.max_sessions_per_tenant,
        max_sessions: a.max_sessions,
        admission: rvisor_server::admission::AdmissionConfig {
            max_live_sessions: uncapped(a.max_live_sessions),
            max_live_sessions_per_tenant: uncapped(a.max_live_sessions_per_tenant),
            max_calls_per_tenant: uncapped(a.max_calls_per_tenant),
            memory_budget_bytes: match a.memory_budget_mb {
                None => rvisor_server::admission::default_memory_budget().0,
                Some(0) => u64::MAX,
                Some(m) => m.saturating_mul(1 << 20),
            },
            tenant_memory_bytes: match a.tenant_memory_budget_mb {
                None | Some(0) => u64::MAX,
                Some(m) => m.saturating_mul(1 << 20),
            },
        },
        tokens,
        max_body_bytes: a.max_body_bytes,
        tables,
        nng: a.nng,
        connections: rvisor_server::listen::ConnectionLimits {
            header_timeout: Duration::from_secs_f64(a.header_timeout_secs),
            body_timeout: Duration::from_secs_f64(a.body_timeout_secs),
            idle_timeout: Duration::from_secs_f64(a.idle_timeout_secs),
            nng_idle_timeout: Duration::from_secs_f64(a.nng_idle_timeout_secs),
            max_connections: a.max_connections as usize,
            max_connections_per_ip: a.max_connections_per_ip as usize,
            shutdown_grace: Duration::from_secs_f64(a.shutdown_grace_secs),
        },
        drain_grace: a.drain_grace_secs.map(Duration::from_secs_f64),
        durable,
        session_ttl: (a.session_ttl_days > 0.0)
            .then(|| Duration::from_secs_f64(a.session_ttl_days * 86400.0)),
        streams: rvisor_server::service::StreamConfig {
            per_stream_bytes: (a.stream_buffer_kb as usize) << 10,
            per_tenant_bytes: match a.tenant_stream_buffer_kb {
                0 => usize::MAX,
                k => (k as usize) << 10,
            },
        },
        packages: installer,
        history: rvisor_server::service::HistoryLimits {
            max_entries: a.history_entries as usize,
            max_bytes: (a.history_kb as usize) << 10,
            max_entry_bytes: ((a.history_kb as usize) << 10) / 4,
        },
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("failed to start the async runtime")?;
    let served = rt.block_on(rvisor_server::http::serve(sup, cfg));
    // The server has closed its connections and shut the supervisor down; a
    // blocking handler still finishing must not keep the process alive.
    rt.shutdown_timeout(Duration::from_secs(5));
    served.context("the server failed")?;
    Ok(ExitCode::SUCCESS)
}

/// The checkpoint store of `--state-dir DIR`.
fn state_store(
    dir: &std::path::Path,
) -> Result<std::sync::Arc<dyn rvisor::checkpoint::CheckpointStore>> {
    let store = rvisor::checkpoint::DirStore::new(dir)
        .with_context(|| format!("--state-dir {}: cannot create or open it", dir.display()))?;
    Ok(std::sync::Arc::new(store))
}

fn mcp(
    data_dir: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    hibernate_after_secs: f64,
    packages: &packages::PackageArgs,
) -> Result<ExitCode> {
    let installer = packages.installer(
        state_dir.as_deref(),
        data_dir.as_deref(),
        &base_config().worker.libpath,
    )?;
    let checkpoints = state_dir.as_deref().map(state_store).transpose()?;
    let defaults = rvisor::SessionOptions {
        hibernate_after: (hibernate_after_secs > 0.0)
            .then(|| Duration::from_secs_f64(hibernate_after_secs)),
        ..Default::default()
    };
    let sup = rvisor::Supervisor::new(rvisor::SupervisorConfig {
        checkpoints,
        defaults,
        ..base_config()
    })?;
    sup.cleanup_on_signals()?;
    // Without --data-dir the connection's tables live in a directory of its
    // own, removed at the end: two MCP servers (two agent windows) must not
    // share one table index.
    let mut tables = rvisor_server::tables::TableConfig::default();
    let private = data_dir.is_none().then(|| {
        std::env::temp_dir().join(format!("rvisor-mcp-tables-{}", rvisor::ids::random_hex(6)))
    });
    match (data_dir, &private) {
        (Some(dir), _) => tables.dir = dir,
        (None, Some(dir)) => tables.dir = dir.clone(),
        (None, None) => {}
    }
    // Read on a thread of the server's own, so the end of the input is
    // seen (and cancels the call in flight) while a call runs.
    let stdin = std::io::BufReader::new(std::io::stdin());
    let cfg = rvisor_server::service::ServiceConfig {
        tables,
        packages: installer,
        ..Default::default()
    };
    let served = rvisor_server::mcp::serve_with(&sup, cfg, stdin, std::io::stdout().lock());
    if let Some(dir) = private {
        let _ = std::fs::remove_dir_all(dir);
    }
    served?;
    sup.shutdown();
    Ok(ExitCode::SUCCESS)
}

fn ops_health(json: bool) -> Result<ExitCode> {
    let sup = supervisor_quiet()?;
    let mut h = sup.health();
    h.style_engine = rvisor_server::service::style_engine(sup.config().style);
    if json {
        println!("{}", serde_json::to_string_pretty(&h)?);
    } else {
        println!(
            "status: {}\nrvisor {} with R {}",
            h.status, h.version, h.r_version
        );
        println!(
            "workers: {:?} mode; sandbox: {}{}",
            h.workers.mode,
            h.sandbox.mode,
            h.sandbox
                .privilege
                .as_deref()
                .map(|p| format!(" ({p})"))
                .unwrap_or_default()
        );
        for layer in &h.sandbox.layers {
            println!("  {layer}");
        }
        if let Some(programs) = &h.sandbox.programs {
            if programs.is_empty() {
                println!("programs: none (--allow-program NAME allows one)");
            } else {
                println!("programs workers may run:");
                for p in programs {
                    println!("  {:<24} {:<32} {}", p.name, p.file, p.reason);
                }
            }
        }
        let r = &h.rules;
        println!(
            "rules: scripts up to {} bytes, nesting up to {}, timeout {} s ({}..{}), up to {} data frames and {} variables",
            r.max_script_bytes, r.max_nesting_depth, r.timeout_seconds.default, r.timeout_seconds.min,
            r.timeout_seconds.max, r.max_dataframes, r.max_variables
        );
        println!("forbidden functions: {}", r.forbidden_functions.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}

fn ops_packages(json: bool) -> Result<ExitCode> {
    let list = supervisor_quiet()?
        .packages()
        .map_err(|e| anyhow::anyhow!(e))?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "packages": list }))?
        );
    } else {
        for p in &list {
            println!("{:<24} {:<12} {}", p.name, p.version, p.library);
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn ops_validate(file: &str, json: bool, style: &str) -> Result<ExitCode> {
    let script = read_code(file)?;
    let style = rvisor::StyleEngine::parse(style).unwrap_or_default();
    // The service's validation, as HTTP, nng and MCP get it.
    let v = rvisor_server::service::validate(&supervisor_quiet_with(style)?, &script);
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        let at = |l: Option<u32>, c: Option<u32>| match (l, c) {
            (Some(l), Some(c)) => format!("{file}:{l}:{c}: "),
            (Some(l), None) => format!("{file}:{l}: "),
            _ => format!("{file}: "),
        };
        for p in &v.problems {
            println!("{}error [{}] {}", at(p.line, p.column), p.kind, p.message);
        }
        for p in &v.warnings {
            println!("{}warning [{}] {}", at(p.line, p.column), p.kind, p.message);
        }
        for s in &v.style {
            println!("{}style [{}] {}", at(s.line, s.column), s.rule, s.message);
        }
        println!("{}", if v.valid { "valid" } else { "invalid" });
    }
    Ok(if v.valid {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// The commands that serve until stopped (servers and kernels).
fn long_running(cmd: &Cmd) -> bool {
    #[cfg(feature = "kernel")]
    if matches!(cmd, Cmd::Kernel(_)) {
        return true;
    }
    matches!(
        cmd,
        Cmd::Serve { .. } | Cmd::Mcp { .. } | Cmd::Session { .. }
    )
}

fn main() -> ExitCode {
    // Start-up timing marks (off unless RVISOR_TIMING names a file):
    // `rvisor bench` splits a command's time with them.
    rvisor::timing::mark(rvisor::timing::CLI_MAIN);
    let code = command();
    rvisor::timing::mark(rvisor::timing::CLI_EXIT);
    code
}

fn command() -> ExitCode {
    let cli = Cli::parse();
    PRELOAD_AT_START.store(cli.preload_at_start, std::sync::atomic::Ordering::Relaxed);
    match cli.confine.confinement() {
        Ok(c) => {
            let _ = CONFINE.set(c);
        }
        Err(e) => {
            eprintln!("rvisor: {e:#}");
            return ExitCode::from(2);
        }
    }
    if long_running(&cli.cmd) {
        // Long-running servers: the memory of large results (and of slow
        // clients' streams) goes back to the system once freed.
        rvisor_server::heap::tune_for_serving();
    }
    match cli.cmd {
        Cmd::Serve { args } => report(serve(*args)),
        #[cfg(feature = "kernel")]
        Cmd::Kernel(args) => report(kernel::main(args)),
        Cmd::Mcp {
            data_dir,
            state_dir,
            hibernate_after_secs,
            packages,
        } => report(mcp(data_dir, state_dir, hibernate_after_secs, &packages)),
        Cmd::Health { json } => report(ops_health(json)),
        Cmd::Packages {
            action: Some(a), ..
        } => report(packages::run(a)),
        Cmd::Packages { json, action: None } => report(ops_packages(json)),
        Cmd::Validate { file, json, style } => report(ops_validate(&file, json, &style)),
        Cmd::Repl { plots_dir, opts } => {
            let run = || -> Result<ExitCode> {
                let session_opts = opts.options()?;
                let sup = rvisor::Supervisor::new(opts.supervisor_config())?;
                let session = sup.session_with(session_opts)?;
                repl::run(session, plots_dir)
            };
            match run() {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("rvisor: {e:#}");
                    ExitCode::from(2)
                }
            }
        }
        Cmd::Session { jsonl, opts } => {
            if !jsonl {
                eprintln!("rvisor session: pass --jsonl (JSON lines on stdin/stdout); for an interactive session use `rvisor repl`");
                return ExitCode::from(2);
            }
            match session_jsonl(&opts) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("rvisor: {e:#}");
                    ExitCode::from(2)
                }
            }
        }
        Cmd::Bench {
            quick,
            json,
            only,
            reps,
            scripts,
            baseline,
            margin,
            update_baseline,
            load,
        } => {
            let mut progress = |m: &str| eprintln!("bench: {m}");
            if let Some(file) = baseline {
                return instructions_guard(&file, margin, update_baseline, &mut progress);
            }
            let load = match load.config(cli.confine.unconfined) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("rvisor bench: {e}");
                    return ExitCode::from(2);
                }
            };
            let opts = bench::Options {
                quick,
                only,
                reps: reps.map(|n| n as usize),
                scripts: scripts.map(|n| n as usize),
                load,
            };
            match bench::run_sections(&opts, &mut progress) {
                Ok(report) => {
                    if !json {
                        println!("{}", bench::table(&report));
                    }
                    println!("{}", serde_json::to_string(&report).unwrap_or_default());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("rvisor bench: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Cmd::Batch(args) => report((|| {
            // A spare per job slot, so each script starts on a ready worker.
            let mut cfg = base_config();
            cfg.pool.spares = batch::parallel(&args);
            if let Some(p) = batch::preload(&args) {
                // The scripts named them: load them before the first starts.
                cfg.pool.preload = Some(p);
                cfg.pool.preload_on_first_use = false;
            }
            let sup = rvisor::Supervisor::new(cfg)?;
            sup.cleanup_on_signals()?;
            let code = batch::run(args, sup.clone());
            sup.shutdown();
            code
        })()),
        Cmd::Run(args) => match run(&args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("rvisor: {e:#}");
                ExitCode::from(2)
            }
        },
    }
}

/// `rvisor bench --only instructions --baseline FILE`: the regression
/// guard (scripts/perf-guard.sh), or with `--update-baseline` a new
/// baseline.
fn instructions_guard(
    file: &Path,
    margin: f64,
    update: bool,
    progress: &mut dyn FnMut(&str),
) -> ExitCode {
    use bench::instructions;
    let now = match instructions::run(&[], progress) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rvisor bench: {e}");
            return ExitCode::from(1);
        }
    };
    if update {
        let text = serde_json::to_string_pretty(&now).unwrap_or_default() + "\n";
        return match std::fs::write(file, text) {
            Ok(()) => {
                eprintln!(
                    "rvisor bench: wrote the baseline {} ({} paths); commit it on its own",
                    file.display(),
                    now.paths.len()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("rvisor bench: could not write {}: {e}", file.display());
                ExitCode::from(1)
            }
        };
    }
    let baseline: instructions::Counts = match std::fs::read_to_string(file)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
    {
        Ok(b) => b,
        Err(e) => {
            eprintln!(
                "rvisor bench: could not read the baseline {} ({e}); make one with \
                 --update-baseline",
                file.display()
            );
            return ExitCode::from(2);
        }
    };
    let rows = instructions::compare(&baseline, &now, margin);
    println!("{}", instructions::table(&rows, margin));
    if baseline.how != now.how {
        // Another valgrind or build counts otherwise: the figures are not
        // comparable, so they do not fail. (The processor is not part of
        // `how`: see instructions::Counts::processor.)
        eprintln!(
            "rvisor bench: the baseline was made with {:?} and this run with {:?}: the counts \
             are shown but not held to it. Make a baseline with this valgrind and \
             build (scripts/perf-guard.sh --update) and commit it",
            baseline.how, now.how
        );
        return ExitCode::SUCCESS;
    }
    let regressed: Vec<&str> = rows
        .iter()
        .filter(|r| r.regressed)
        .map(|r| r.path.as_str())
        .collect();
    if regressed.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "rvisor bench: instructions per call rose more than {:.0}% on {}: find the change \
             that did it, or, if the cost is wanted, update the baseline in a commit of its own \
             (scripts/perf-guard.sh --update) saying why",
            margin * 100.0,
            regressed.join(", ")
        );
        ExitCode::from(1)
    }
}

fn read_code(file: &str) -> Result<String> {
    let mut bytes = Vec::new();
    if file == "-" {
        std::io::stdin()
            .read_to_end(&mut bytes)
            .context("failed to read the script from stdin")?;
    } else {
        bytes = std::fs::read(file).with_context(|| format!("failed to read {file}"))?;
    }
    String::from_utf8(bytes).map_err(|_| {
        anyhow::anyhow!("{file} is not UTF-8 text; convert it (e.g. iconv -t UTF-8) and retry")
    })
}

fn run(args: &RunArgs) -> Result<ExitCode> {
    let RunArgs {
        file,
        json,
        timeout,
        plots_dir,
        width,
        height,
        vars,
        tables: table_args,
        display,
        inputs,
        output_dir,
        library_after,
    } = args;
    let with_files = !inputs.is_empty() || output_dir.is_some();
    for p in inputs {
        if !p.is_file() {
            bail!("--input {}: not a readable file", p.display());
        }
    }
    let (json, timeout, width, height) = (*json, *timeout, *width, *height);
    let code = read_code(file)?;
    // Tables go through the same conversion as uploads, into a private
    // directory that lives as long as this command.
    let table_dir =
        std::env::temp_dir().join(format!("rvisor-run-tables-{}", rvisor::ids::random_hex(6)));
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(table_dir.clone());
    let mut table_files = Vec::new();
    for t in table_args {
        let Some((name, path)) = t.split_once('=') else {
            bail!("--table {t:?}: expected NAME=FILE.csv");
        };
        table_files.push((name, path));
    }
    let mut variables = Vec::new();
    for v in vars {
        let Some((name, value)) = v.split_once('=') else {
            bail!("--var {v:?}: expected NAME=VALUE");
        };
        let value = serde_json::from_str(value)
            .unwrap_or_else(|_| serde_json::Value::String(value.to_string()));
        variables.push((name.to_string(), value));
    }
    // The same checks as a one-shot run of the service (names, values,
    // counts, no name used twice), before a name becomes a file name.
    let names: Vec<&str> = table_files.iter().map(|(n, _)| *n).collect();
    rvisor_server::service::check_bindings(&variables, &names, &rvisor::SafetyRules::default())
        .map_err(|e| anyhow::anyhow!("--var/--table: {e}"))?;
    let mut tables = Vec::new();
    for (name, path) in table_files {
        std::fs::metadata(path).with_context(|| format!("failed to read {path}"))?;
        std::fs::create_dir_all(&table_dir)?;
        let out = table_dir.join(format!("{name}.arrow"));
        rvisor_server::tables::convert_file(
            rvisor_server::tables::TableFormat::Csv,
            std::path::Path::new(path),
            &out,
        )
        .map_err(|e| anyhow::anyhow!("--table {name}: {e}"))?;
        tables.push((name.to_string(), out));
    }
    let ctx = rvisor::CallContext {
        variables,
        tables,
        libraries_after: library_after.clone(),
        ..Default::default()
    };
    if !(timeout >= 0.0 && timeout.is_finite()) {
        bail!("--timeout must be a number of seconds >= 0 (0 means no limit)");
    }
    let mut opts = CallOptions {
        timeout: (timeout > 0.0).then(|| Duration::from_secs_f64(timeout)),
        plot_width: width,
        plot_height: height,
        display: display.options(),
        ..CallOptions::default()
    };
    let execution_id = rvisor::ids::execution_id();
    // The console text printed while the run went on (not with --json).
    let mut streamed: Option<String> = None;
    // The library's own call checks (one definition): a bad plot size is a
    // flag error; empty or oversize code is a rejected run, no R started.
    let checked = rvisor::validate_call(&code, &opts);
    if let Err(e @ rvisor::CallError::PlotSize { .. }) = &checked {
        bail!("--width/--height: {e}");
    }
    if let Err(e @ rvisor::CallError::Display(_)) = &checked {
        bail!("--max-rows/--max-cols: {e}");
    }
    let result = if let Err(e) = checked {
        RunResult::failed(execution_id, code, Outcome::Rejected, e.to_string())
    } else {
        let sup = supervisor_quiet()?;
        // Unconfined, the script runs in the current directory; confined, in
        // its private one (pass --read-only PATH to let it read host files).
        let cwd = std::env::current_dir().ok();
        let working_dir = match &sup.config().worker.confine {
            None => cwd,
            Some(c) => cwd.filter(|d| c.read_only.iter().any(|r| d.starts_with(r))),
        };
        // With files, the script runs in the worker's private directory.
        opts.working_dir = working_dir.filter(|_| !with_files);
        let mut files = files::CliFiles::new(inputs.clone(), output_dir.clone());
        let mut r = if json {
            if with_files {
                sup.run_once_with_files(
                    execution_id,
                    &code,
                    &opts,
                    &ctx,
                    None,
                    None,
                    None,
                    &mut files,
                )
            } else {
                sup.run_once_with(execution_id, &code, &opts, &ctx)
            }
        } else {
            // Printed as it comes, all of it: this reader always reads
            // (a slow terminal slows the printing, not the call), and the
            // output cap bounds the text.
            let (feed, events) =
                rvisor::EventFeed::with_limits(&execution_id, rvisor::StreamLimits::unbounded());
            let run = {
                let (sup, code, opts) = (sup.clone(), code.clone(), opts.clone());
                std::thread::spawn(move || {
                    let sink = feed.sink();
                    let r = if with_files {
                        sup.run_once_with_files(
                            execution_id,
                            &code,
                            &opts,
                            &ctx,
                            None,
                            None,
                            Some(&sink),
                            &mut files,
                        )
                    } else {
                        sup.run_once_streaming(execution_id, &code, &opts, &ctx, None, None, &sink)
                    };
                    feed.finish(&r);
                    r
                })
            };
            let (_, printed) = follow_events(None, events)?;
            let r = run
                .join()
                .map_err(|_| anyhow::anyhow!("the run failed inside rvisor"))?;
            streamed = Some(printed);
            r
        };
        r.session.id = "run".into();
        sup.shutdown();
        r
    };

    let mut saved = Vec::new();
    if let Some(dir) = &plots_dir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("failed to create {}", dir.display()))?;
        for (i, p) in result.plots.iter().enumerate() {
            if p.mime != "image/png" {
                continue; // SVG pages are written with the displays
            }
            let path = dir.join(format!("plot-{:03}.png", i + 1));
            let data = base64::engine::general_purpose::STANDARD.decode(&p.data_base64)?;
            std::fs::write(&path, data)
                .with_context(|| format!("failed to write {}", path.display()))?;
            saved.push(path);
        }
        saved.extend(displays::save(&result, dir, &mut 0, 0)?);
    }

    if json {
        let mut out = std::io::stdout().lock();
        serde_json::to_writer(&mut out, &result)?;
        writeln!(out)?;
    } else {
        match &streamed {
            Some(printed) => print_rest(&result, printed, |_, _| Ok(()))?,
            None => print_console(&result, |_, _| Ok(()))?,
        }
        let mut err = std::io::stderr().lock();
        // An HTML value has no console text: its line says what it was.
        for d in &result.displays {
            let kind = d.metadata.get("rvisor").and_then(|m| m.get("kind"));
            if kind.and_then(|k| k.as_str()) == Some("html") {
                if let Some(t) = d.data.get("text/plain").and_then(|t| t.as_str()) {
                    writeln!(err, "rvisor: {t}")?;
                }
            }
        }
        if result.truncated {
            writeln!(err, "rvisor: output truncated at the output limit")?;
        }
        for p in &saved {
            writeln!(err, "rvisor: saved {}", p.display())?;
        }
        for a in &result.artifacts {
            writeln!(
                err,
                "rvisor: file saved to {} ({} bytes)",
                a.uri.trim_start_matches("file://"),
                a.size
            )?;
        }
        if plots_dir.is_none() && !result.plots.is_empty() {
            writeln!(
                err,
                "rvisor: {} plot(s) not saved; pass --plots-dir DIR to write them as PNG files",
                result.plots.len()
            )?;
        }
        if let Some(v) = &result.result {
            writeln!(err, "rvisor: result = {v}")?;
        }
    }
    Ok(if result.success {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

#[cfg(test)]
mod block_filter_tests {
    use super::BlockFilter;

    fn shown(chunks: &[&str]) -> String {
        let mut f = BlockFilter::default();
        let mut out: String = chunks.iter().map(|c| f.feed(c)).collect();
        out.push_str(&f.finish());
        out
    }

    #[test]
    fn a_block_is_left_out_however_the_chunks_split_it() {
        let text =
            "before\n<<<RVISOR_RESULT_START>>>\n{\"a\": 1}\n<<<RVISOR_RESULT_END>>>\nafter\n";
        assert_eq!(shown(&[text]), "before\nafter\n");
        let bytes: Vec<String> = text.chars().map(String::from).collect();
        let chunks: Vec<&str> = bytes.iter().map(String::as_str).collect();
        assert_eq!(shown(&chunks), "before\nafter\n");
        assert_eq!(
            shown(&[
                "x <<<RVISOR_RESULT_START>>>\n",
                "<<<JUBE_RESULT_START>>>\n1\n<<<JUBE_RESULT_END>>>\n"
            ]),
            "x <<<RVISOR_RESULT_START>>>\n"
        );
    }

    #[test]
    fn other_text_is_shown_at_once_and_an_open_block_is_held() {
        let mut f = BlockFilter::default();
        assert_eq!(f.feed("step 1"), "step 1");
        assert_eq!(f.feed("\n<<<"), "\n");
        assert_eq!(f.feed("x\n"), "<<<x\n");
        assert_eq!(f.feed("<<<RVISOR_RESULT_START>>>\nhalf"), "");
        assert_eq!(f.finish(), "");
    }
}
