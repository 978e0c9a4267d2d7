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
