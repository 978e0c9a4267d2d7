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
