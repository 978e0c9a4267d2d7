//! Start-up timing marks for `rvisor bench` and for whoever wants to see
//! where a command's time goes: with `RVISOR_TIMING=/path/to/file` set, the
//! supervisor, the CLI and the zygote append one line per mark to that file,
//! `<unix time in microseconds> <pid> <label>`. Unset (the default), a mark
//! is one relaxed atomic load after the first call.
//!
//! Each line is one `write(2)` to a file opened with `O_APPEND`, so lines of
//! concurrent processes do not interleave. Confined workers cannot reach
//! the host's file and write no marks; their fork, start and calls are
//! marked on the supervisor's side.

use std::io::Write;
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// The variable that names the file marks go to.
pub const ENV_TIMING: &str = "RVISOR_TIMING";

// The labels, one constant each, so the process that writes a mark and
// `rvisor bench`, which splits a start-up by them, cannot disagree.

/// The CLI reached `main`.
pub const CLI_MAIN: &str = "cli.main";
/// The CLI is about to exit.
pub const CLI_EXIT: &str = "cli.exit";
/// `Supervisor::new` began.
pub const SUPERVISOR_NEW: &str = "supervisor.new";
/// The supervisor has located its worker and probed the host.
pub const SUPERVISOR_PROBED: &str = "supervisor.probed";
/// `Supervisor::new` returns.
pub const SUPERVISOR_READY: &str = "supervisor.ready";
/// The supervisor's shutdown began.
pub const SUPERVISOR_SHUTDOWN: &str = "supervisor.shutdown";
/// Its workers and zygote are gone.
pub const SUPERVISOR_SHUT: &str = "supervisor.shut";
/// A one-shot run asks the pool for a worker.
pub const RUN_ONCE_ACQUIRE: &str = "run_once.acquire";
/// It has one.
pub const RUN_ONCE_ACQUIRED: &str = "run_once.acquired";
/// Its call is sent.
pub const RUN_ONCE_CALL: &str = "run_once.call";
/// Its result is back.
pub const RUN_ONCE_RESULT: &str = "run_once.result";
/// The supervisor launches a zygote.
pub const ZYGOTE_LAUNCH: &str = "zygote.launch";
/// A zygote said hello (the base one first, then the warm one).
pub const ZYGOTE_HELLO: &str = "zygote.hello";
/// The supervisor sends a fork request.
pub const FORK_REQUEST: &str = "fork.request";
/// The zygote reported the forked worker's pid.
pub const FORK_FORKED: &str = "fork.forked";
/// The forked worker said hello.
pub const FORK_READY: &str = "fork.ready";
/// `rvisor-worker` reached `main` (twice for a zygote: it re-executes
/// itself for its stack).
pub const WORKER_MAIN: &str = "worker.main";
/// R's start-up begins.
pub const WORKER_R_START: &str = "worker.r_start";
/// R is up.
pub const WORKER_R_STARTED: &str = "worker.r_started";
/// The driver's warm-up begins.
pub const WORKER_WARM_UP: &str = "worker.warm_up";
/// The driver is warm.
pub const WORKER_WARMED_UP: &str = "worker.warmed_up";

fn target() -> Option<&'static str> {
    static PATH: OnceLock<Option<String>> = OnceLock::new();
    PATH.get_or_init(|| std::env::var(ENV_TIMING).ok().filter(|p| !p.is_empty()))
        .as_deref()
}

/// The file marks go to, when marks are on (to pass on to a zygote).
pub fn file() -> Option<&'static str> {
    target()
}

/// Microseconds since the Unix epoch (the clock marks use).
pub fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0)
}

/// Appends one mark, if marks are on; errors are ignored (timing must
/// never change what a command does).
pub fn mark(label: &str) {
    let Some(path) = target() else { return };
    let line = format!("{} {} {label}\n", now_us(), std::process::id());
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = f.write_all(line.as_bytes());
    }
}
