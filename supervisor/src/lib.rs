//! rvisor: a supervisor for embedded R.
//!
//! The library starts worker processes that embed libR (the `rvisor-worker`
//! binary), sends them calls over a private socketpair and returns
//! [`RunResult`]s. It never links libR itself, and it has no async runtime,
//! HTTP, Arrow or CLI dependencies: the service and its network adapters are
//! the `rvisor-server` crate, the `rvisor` command is `rvisor-cli`.
//!
//! ```
//! use rvisor::{Supervisor, SupervisorConfig, Outcome};
//! let sup = Supervisor::new(SupervisorConfig::default())?;
//! let session = sup.session()?;
//! session.run("x <- 41")?;                   // queued, returns at once
//! let result = session.run("x + 1")?.wait(); // calls run in order
//! assert_eq!(result.outcome, Outcome::Complete);
//! assert_eq!(result.console, "[1] 42\n");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A one-off call on a worker of its own:
//!
//! ```
//! use rvisor::{CallOptions, Worker, WorkerConfig};
//! let mut worker = Worker::spawn(&WorkerConfig::default())?;
//! let result = worker.run("plot(1:10); log(-1)", &CallOptions::default());
//! assert_eq!(result.plots.len(), 1);
//! assert_eq!(result.warnings, ["In log(-1) : NaNs produced"]);
//! # Ok::<(), rvisor::Error>(())
//! ```

pub mod clock;
pub mod confine;
mod error;
pub mod html;
pub mod ids;
pub mod ops;
pub mod pool;
mod raw;
pub mod session;
pub mod tools;
pub mod worker;
pub mod zygote;

pub use confine::{CgroupMode, Confinement, Limits};
pub use error::Error;
pub use ops::{Health, Package, Problem, SafetyRules, StyleEngine, StyleNote, Validation};
pub use pool::{Pool, PoolConfig, PoolMode, PoolStatus};
pub use rvisor_protocol::{
    ErrorInfo, Outcome, Plot, RunResult, Segment, SessionInfo, Usage, DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_PLOT_HEIGHT, DEFAULT_PLOT_WIDTH, MAX_PLOT_SIDE, RUN_RESULT_FIELDS,
};
pub use session::{
    CallHandle, EnvPolicy, Rejection, ResetInfo, RunOptions, Session, SessionOptions, SessionState,
    SessionStatus, Supervisor, SupervisorConfig,
};
pub use tools::{CallContext, Tool, ToolCall, ToolHandler};
pub use worker::{
    locate_worker, CallOptions, Canceller, ExitInfo, Interrupter, Worker, WorkerConfig,
};

/// Largest accepted code, in bytes.
pub const MAX_CODE_BYTES: usize = 256 * 1024;

/// Checks a call before it is sent: non-empty code within
/// [`MAX_CODE_BYTES`], plot sides within 1..=[`MAX_PLOT_SIDE`], a non-zero
/// output cap. The message says what to change.
pub fn validate_call(code: &str, opts: &CallOptions) -> Result<(), String> {
    if code.trim().is_empty() {
        return Err("the code is empty; send at least one R expression".into());
    }
    if code.len() > MAX_CODE_BYTES {
        return Err(format!(
            "the code is {} bytes, over the limit of {MAX_CODE_BYTES} bytes; split it into \
             several calls or load data from files",
            code.len()
        ));
    }
    for (name, v) in [
        ("plot_width", opts.plot_width),
        ("plot_height", opts.plot_height),
    ] {
        if v == 0 || v > MAX_PLOT_SIDE {
            return Err(format!(
                "{name} is {v}; it must be between 1 and {MAX_PLOT_SIDE} pixels"
            ));
        }
    }
    if opts.max_output_bytes == 0 {
        return Err("max_output_bytes must be at least 1".into());
    }
    Ok(())
}
