//! The flags of `rvisor bench` beyond its sections' own: the
//! sessions-load row's, and the instructions regression guard
//! (`--baseline`).

use crate::bench;
use anyhow::Result;
use std::path::Path;
use std::process::ExitCode;

/// The sessions-load row of `rvisor bench` (`--only sessions-load`):
/// defaults are issue 15's targets.
#[derive(Debug, clap::Args)]
pub(crate) struct LoadArgs {
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
    pub(crate) fn config(&self, unconfined: bool) -> Result<bench::sessions_load::Config, String> {
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

/// `rvisor bench --only instructions --baseline FILE`: the regression
/// guard (scripts/perf-guard.sh), or with `--update-baseline` a new
/// baseline.
pub(crate) fn instructions_guard(
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
    if let Err(e) = crate::out::line(instructions::table(&rows, margin)) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return ExitCode::SUCCESS;
        }
        eprintln!("rvisor bench: {e}");
        return ExitCode::from(2);
    }
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
