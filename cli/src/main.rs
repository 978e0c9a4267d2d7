//! The `rvisor` command: thin adapters over the rvisor library.

mod batch;
mod bench;
mod bench_cmd;
mod console;
mod displays;
mod files;
#[cfg(feature = "kernel")]
mod kernel;
mod ops;
mod out;
mod packages;
mod repl;
mod run;
mod serve;
mod session_jsonl;

use anyhow::{bail, Context, Result};
use bench_cmd::{instructions_guard, LoadArgs};
use clap::{Parser, Subcommand};
use console::{follow_events, print_console, print_rest};
use ops::{ops_health, ops_packages, ops_validate};
use run::{run, RunArgs};
use serve::{mcp, non_negative_secs, serve, ServeArgs};
use session_jsonl::{session_jsonl, SessionArgs};
use std::path::PathBuf;
use std::process::ExitCode;

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
    /// Let the kernel merge identical memory pages across workers
    /// (same-page merging, KSM): live sessions after a full gc() share
    /// most of their heap again. Opens a side channel between sessions
    /// (and tenants): a process can tell that another holds a page of the
    /// same content. Needs Linux 6.4+ and /sys/kernel/mm/ksm/run set to 1
    /// by root (docs/process-model.md, "Memory").
    #[arg(long, global = true)]
    merge_pages: bool,
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

/// `--merge-pages`, for [`base_config`].
static MERGE_PAGES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

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
        worker: rvisor::WorkerConfig {
            merge_pages: MERGE_PAGES.load(std::sync::atomic::Ordering::Relaxed),
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

/// A command's status, with its error on stderr (status 2), or a quiet
/// success when its reader went away ([`out::exit`]).
fn report(r: Result<ExitCode>) -> ExitCode {
    out::exit(r)
}

/// The names `--style` accepts ([`rvisor::StyleEngine::as_str`]).
const STYLE_ENGINES: [&str; 5] = ["auto", "rvisor", "lintr", "builtin", "none"];

fn supervisor_quiet() -> Result<rvisor::Supervisor> {
    supervisor_quiet_with(rvisor::StyleEngine::default())
}

fn supervisor_quiet_with(style: rvisor::StyleEngine) -> Result<rvisor::Supervisor> {
    // One-off commands need one worker: confined, a zygote without preloads
    // or spares (workers are confined only when forked from it); unconfined,
    // the worker itself. An unconfined pool with a zygote spawns a worker
    // while the zygote's R still starts (a server must not wait), so a
    // one-off command started R twice at once: twice Rscript's CPU, and
    // 1.2x its wall time on 2 cores.
    let mut base = base_config();
    // Its worker lives for one call: R's memory in huge pages makes R
    // start and allocate faster (WorkerConfig::malloc_huge_pages).
    base.worker.malloc_huge_pages = true;
    let cfg = rvisor::SupervisorConfig {
        pool: rvisor::PoolConfig {
            zygote: base.confinement.enabled,
            spares: 0,
            preload: Some(Vec::new()),
            ..Default::default()
        },
        style,
        ..base
    };
    Ok(rvisor::Supervisor::new(cfg)?)
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
    MERGE_PAGES.store(cli.merge_pages, std::sync::atomic::Ordering::Relaxed);
    if cli.merge_pages {
        eprintln!(
            "rvisor: --merge-pages: identical memory pages of workers may be merged; a merged \
             page is a side channel between sessions (and tenants) that share it"
        );
        if let Err(why) = rvisor::page_merging_state() {
            eprintln!("rvisor: WARNING: --merge-pages: {why}");
        }
    }
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
            report(run())
        }
        Cmd::Session { jsonl, opts } => {
            if !jsonl {
                eprintln!("rvisor session: pass --jsonl (JSON lines on stdin/stdout); for an interactive session use `rvisor repl`");
                return ExitCode::from(2);
            }
            report(session_jsonl(&opts))
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
                Ok(r) => report((|| {
                    if !json {
                        out::line(bench::table(&r))?;
                    }
                    out::line(serde_json::to_string(&r).unwrap_or_default())?;
                    Ok(ExitCode::SUCCESS)
                })()),
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
        Cmd::Run(args) => report(run(&args)),
    }
}
