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

mod batch;
mod burst;
mod call;
mod cancel;
pub mod checkpoint;
mod checkpoint_files;
pub mod clock;
pub mod confine;
mod error;
pub mod events;
pub mod file_rules;
pub mod files;
mod gate;
pub mod html;
pub mod ids;
pub mod ops;
pub mod pool;
mod process;
mod raw;
pub mod rules;
pub mod session;
mod session_files;
mod spin;
mod supervisor;
mod tempdir;
#[cfg(test)]
mod testing;
pub mod tools;
pub mod worker;
pub mod zygote;

pub use batch::{Batch, BatchDone, BatchFiles, BatchJob, BatchOptions};
pub use call::CallOptions;
pub use call::{unix_newlines, validate_call, MAX_CODE_BYTES};
pub use cancel::{CancelOnDrop, CancelToken};
pub use confine::{
    AllowedProgram, CgroupMode, Confinement, Limits, Programs, DEFAULT_PROGRAMS, NO_PROGRAMS,
};
pub use error::{
    CallError, CgroupMissing, CheckpointError, ConfineError, Error, LimitsError, ReadOnlyRefusal,
    RestoreError, ValidateError, VariableError, WorkerFileError,
};
pub use events::{
    EventFeed, EventSink, Events, NextEvent, StreamBudget, StreamLimits,
    DEFAULT_STREAM_BUFFER_BYTES, MIN_STREAM_BUFFER_BYTES, STREAM_OWN_BYTES,
};
pub use gate::CallGate;
pub use ops::{
    Health, Package, PackagesError, Problem, SafetyRules, StyleEngine, StyleNote, Validation,
};
pub use pool::{Pool, PoolConfig, PoolMode, PoolStatus};
pub use process::{locate_worker, page_merging_state, ExitInfo, WorkerConfig};
pub use rvisor_protocol::timing;
pub use rvisor_protocol::{
    Artifact, CallEvent, Display, DisplayOptions, ErrorInfo, EventKind, Outcome, Plot, PlotFormat,
    RunResult, Segment, SessionInfo, StreamMode, Usage, DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_PLOT_HEIGHT, DEFAULT_PLOT_WIDTH, GIVE_BACK_IDLE_MS, MAX_PLOT_SIDE, RUN_RESULT_FIELDS,
};
pub use session::{
    CallHandle, EnvPolicy, Rejection, ResetInfo, RunOptions, RunningCall, Session, SessionOptions,
    SessionState, SessionStatus, Watch, WatchedCall, CHECKPOINT_FAILED, CHECKPOINT_RETRY,
    KILLED_OVER_BUDGET, MAX_CHECKPOINT_RETRY, MAX_WATCHERS, RESUMED_MOVED, RESUMED_RESTART,
};
pub use supervisor::{Supervisor, SupervisorConfig};
pub use tempdir::ScratchDir;
pub use tools::{CallContext, Tool, ToolCall, ToolHandler};
pub use worker::{Canceller, Interrupter, Worker};
