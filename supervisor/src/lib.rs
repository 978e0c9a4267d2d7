//! rvisor: a supervisor for embedded R.
//!
//! The library starts worker processes that embed libR (the `rvisor-worker`
//! binary), sends them calls over a private socketpair and returns
//! [`RunResult`]s. It never links libR itself. The `rvisor` binary is a thin
//! command-line adapter over this library.
//!
//! ```no_run
//! use rvisor::{Worker, WorkerConfig, CallOptions};
//! let mut worker = Worker::spawn(&WorkerConfig::default())?;
//! let result = worker.run("1 + 1", &CallOptions::default());
//! assert_eq!(result.console, "[1] 2\n");
//! # Ok::<(), rvisor::Error>(())
//! ```

mod error;
pub mod ids;
mod raw;
pub mod worker;

pub use error::Error;
pub use rvisor_protocol::{
    ErrorInfo, Outcome, Plot, RunResult, Segment, SessionInfo, Usage, DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_PLOT_HEIGHT, DEFAULT_PLOT_WIDTH, MAX_PLOT_SIDE,
};
pub use worker::{locate_worker, CallOptions, Worker, WorkerConfig};

/// Largest accepted code, in bytes.
pub const MAX_CODE_BYTES: usize = 256 * 1024;
