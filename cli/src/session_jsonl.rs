//! `rvisor session --jsonl`: persistent sessions over JSON lines on
//! stdin/stdout, and the session flags it shares with `repl` and `kernel`.

use crate::serve::state_store;
use crate::{base_config, displays};
use anyhow::{bail, Result};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Session options shared by `session` and `repl`.
#[derive(clap::Args, Debug)]
pub(crate) struct SessionArgs {
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
    pub(crate) fn supervisor_config(&self) -> rvisor::SupervisorConfig {
        let mut cfg = base_config();
        cfg.worker.libpath = self.libpath.clone();
        cfg
    }

    /// The host variables R code may read: `--env` names, or all of them
    /// with `--inherit-env` (`None`). For the kernel host's key.
    #[cfg(feature = "kernel")]
    pub(crate) fn env_names(&self) -> Option<&[String]> {
        (!self.inherit_env).then_some(self.env.as_slice())
    }

    /// The checkpoint store of `--state-dir`.
    pub(crate) fn checkpoints(
        &self,
    ) -> Result<Option<std::sync::Arc<dyn rvisor::checkpoint::CheckpointStore>>> {
        self.state_dir.as_deref().map(state_store).transpose()
    }

    pub(crate) fn options(&self) -> Result<rvisor::SessionOptions> {
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

pub(crate) fn session_jsonl(args: &SessionArgs) -> Result<ExitCode> {
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
    rvisor_server::jsonl::serve(&sup, stdin, crate::out::shared_stdout())?;
    sup.shutdown();
    Ok(ExitCode::SUCCESS)
}
