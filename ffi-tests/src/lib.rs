//! Helpers shared by the tests against real R.

use rvisor::{CallOptions, RunResult, Worker, WorkerConfig};

/// Starts a worker (the binary built next to the test executable).
pub fn worker() -> Worker {
    Worker::spawn(&WorkerConfig::default()).expect("worker starts")
}

/// Runs `code` with default options.
pub fn run(w: &mut Worker, code: &str) -> RunResult {
    w.run(code, &CallOptions::default())
}

/// The `rvisor` binary next to the test executable (`target/debug/rvisor`).
pub fn rvisor_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test executable");
    let bin = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("target/debug")
        .join("rvisor");
    assert!(
        bin.is_file(),
        "{} is missing: run `cargo build --workspace` first",
        bin.display()
    );
    bin
}

/// The RunResult fields CONTRACT.md fixes; every surface must carry them.
pub const RUN_RESULT_FIELDS: [&str; 16] = [
    "schema_version",
    "execution_id",
    "code",
    "outcome",
    "success",
    "console",
    "segments",
    "warnings",
    "error",
    "plots",
    "result",
    "duration_ms",
    "r_version",
    "session",
    "usage",
    "truncated",
];
