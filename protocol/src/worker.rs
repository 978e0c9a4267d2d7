//! Messages between the supervisor and a worker over their socketpair.

use crate::{EventKind, RunResult, StreamMode};
use serde::{Deserialize, Serialize};

/// Name of the environment variable that carries the worker's end of the
/// socketpair (a file descriptor number inherited across exec).
pub const ENV_WORKER_FD: &str = "RVISOR_WORKER_FD";

/// Set (to `1`) in the environment of a zygote or worker whose memory the
/// kernel may merge with other processes' pages of the same content
/// (`WorkerConfig::merge_pages`): it asks for it with
/// `prctl(PR_SET_MEMORY_MERGE)` before R starts, and its forks inherit it.
pub const ENV_MERGE_PAGES: &str = "RVISOR_MERGE_PAGES";
/// glibc's tunables, which the dynamic loader reads as a process starts:
/// set for a worker or zygote whose malloc uses transparent huge pages
/// (`WorkerConfig::malloc_huge_pages`), then taken out of its environment
/// by the worker, as R code and the programs it runs have no use for it.
pub const ENV_GLIBC_TUNABLES: &str = "GLIBC_TUNABLES";
/// The value of [`ENV_GLIBC_TUNABLES`] for malloc in transparent huge pages.
pub const MALLOC_HUGE_PAGES_TUNABLE: &str = "glibc.malloc.hugetlb=1";
/// Largest tool request (serialised arguments) accepted, in bytes.
pub const MAX_TOOL_REQUEST_BYTES: usize = 256 * 1024;
/// Largest tool result (serialised JSON) accepted, in bytes.
pub const MAX_TOOL_RESULT_BYTES: usize = 8 * 1024 * 1024;

fn default_style() -> String {
    "auto".into()
}

fn unlimited() -> u64 {
    u64::MAX
}

/// Supervisor to worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToWorker {
    /// First frame: the supervisor's protocol version.
    Hello {
        /// [`crate::PROTOCOL_VERSION`] of the supervisor.
        protocol_version: u32,
    },
    /// Evaluate code.
    Run(RunRequest),
    /// The answer to a [`FromWorker::ToolCall`].
    ToolResult {
        /// The `call_id` of the tool call.
        call_id: u64,
        /// The handler's JSON result, or why it failed.
        #[serde(flatten)]
        outcome: ToolOutcome,
    },
    /// Check a script without running it (syntax, forbidden functions,
    /// nesting depth, style). Answered by [`FromWorker::Validation`].
    Validate {
        /// The script.
        script: String,
        /// Function names the script may not call or refer to.
        forbidden: Vec<String>,
        /// Deepest nesting of expressions allowed.
        max_nesting_depth: u32,
        /// Style checks: `none`, `builtin`, or `auto` (lintr when installed,
        /// else built-in).
        #[serde(default = "default_style")]
        style: String,
    },
    /// Finish and exit cleanly.
    Shutdown,
    /// Save the session's state (global environment, attached packages,
    /// loaded namespaces, changed options and environment variables, RNG
    /// state, working-directory files) into the pipe whose write end
    /// travels with this frame as a descriptor (SCM_RIGHTS), in the layout
    /// of [`crate::checkpoint`], then close it. A pipe, not a file: the
    /// worker's file-size limit (RLIMIT_FSIZE) does not apply to it, and
    /// the supervisor reads it as it comes. Answered by
    /// [`FromWorker::Checkpointed`].
    Checkpoint {
        /// The directory whose files are saved (the session's working
        /// directory; `None`: the worker's own directory).
        working_dir: Option<String>,
        /// Most bytes of working-directory files saved (larger files and
        /// those past the cap are listed in the manifest as skipped).
        max_file_bytes: u64,
        /// Most bytes the whole checkpoint may take (the store's cap, or
        /// what is left of the tenant's quota): the worker stops writing
        /// and fails as soon as it would pass it. The supervisor stops
        /// reading past it too.
        #[serde(default = "unlimited")]
        max_bytes: u64,
    },
    /// Load a checkpoint into this fresh worker before its first call: a
    /// regular file open for reading travels as a descriptor (the worker
    /// reads the manifest from its tail, then the state). Answered by
    /// [`FromWorker::Restored`].
    Restore {
        /// Where the saved files are written back (as for `Checkpoint`).
        working_dir: Option<String>,
    },
}

/// One call, as the worker receives it (already validated).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRequest {
    /// Unique id of the call.
    pub execution_id: String,
    /// Per-worker call number (from 1); the supervisor tags its SIGINTs
    /// with it (`sigqueue`) so an interrupt hits exactly this call.
    #[serde(default)]
    pub seq: u64,
    /// R code.
    pub code: String,
    /// Plot width in pixels.
    pub plot_width: u32,
    /// Plot height in pixels.
    pub plot_height: u32,
    /// Cap on console text plus plot bytes.
    pub max_output_bytes: u64,
    /// Directory to `setwd()` into before the call.
    pub working_dir: Option<String>,
    /// CPU seconds the call may use (RLIMIT_CPU; the worker cannot be
    /// reused after a call with a limit).
    #[serde(default)]
    pub cpu_limit_seconds: Option<u64>,
    /// Names of the tools R code may call as `tools$name(...)`.
    #[serde(default)]
    pub tools: Vec<String>,
    /// Variables bound in the global environment before the code runs
    /// (already checked: syntactic names, scalars or flat arrays, no null).
    #[serde(default)]
    pub variables: Vec<(String, serde_json::Value)>,
    /// Names of tables bound as data frames before the code runs. Their
    /// Arrow IPC files travel with this frame as descriptors (SCM_RIGHTS),
    /// one per name, in order: a confined worker cannot open the store.
    #[serde(default)]
    pub tables: Vec<String>,
    /// Which events to send while the call runs ([`FromWorker::Events`]).
    #[serde(default)]
    pub stream: StreamMode,
    /// Which rich results to make (tables, HTML values, plot formats).
    #[serde(default)]
    pub display: crate::DisplayOptions,
    /// How long, in microseconds, the worker may poll for its next request
    /// after it answers this one, before it sleeps (0: it sleeps at once).
    /// The supervisor asks for it when the host has a CPU to spare: a
    /// request that comes then is read at once, without the wake-up of a
    /// sleeping process (the supervisor's `spin.rs`).
    #[serde(default)]
    pub spin_us: u32,
}

/// What a tool handler produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolOutcome {
    /// The handler's result.
    Value(serde_json::Value),
    /// Why the call failed (unknown tool, handler error, limit); becomes an R error.
    Error(String),
}

/// Worker to supervisor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromWorker {
    /// Answer to [`ToWorker::Hello`] once R is ready.
    Hello(WorkerHello),
    /// The result of a [`ToWorker::Run`].
    Result(Box<RunResult>),
    /// R code called a host tool; the worker waits for [`ToWorker::ToolResult`].
    ToolCall {
        /// The call during which the tool was called.
        execution_id: String,
        /// Unique within the worker.
        call_id: u64,
        /// Tool name.
        name: String,
        /// Arguments as JSON (an object for named arguments, an array otherwise).
        args: serde_json::Value,
    },
    /// Events of the running call, in order (sent only when its
    /// [`RunRequest::stream`] asked for them), always before its result.
    Events {
        /// The call they belong to.
        execution_id: String,
        /// What happened, oldest first.
        events: Vec<EventKind>,
    },
    /// The answer to [`ToWorker::Validate`]: JSON with `problems`,
    /// `warnings` and `style` lists.
    Validation {
        /// The findings, as JSON text.
        json: String,
    },
    /// The answer to [`ToWorker::Checkpoint`].
    Checkpointed {
        /// The checkpoint's manifest (JSON text; see `rvisor::checkpoint`),
        /// or why nothing was written.
        #[serde(flatten)]
        outcome: StateOutcome,
    },
    /// The answer to [`ToWorker::Restore`].
    Restored {
        /// Names of saved objects not restored (JSON array text), or why
        /// the checkpoint could not be loaded.
        #[serde(flatten)]
        outcome: StateOutcome,
    },
    /// The worker cannot go on (e.g. protocol version mismatch).
    Fatal {
        /// Why.
        message: String,
    },
}

/// How a checkpoint or restore went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateOutcome {
    /// JSON text (the manifest, or the names of what was lost).
    Done(String),
    /// Why it failed.
    Failed(String),
}

/// What a ready worker tells about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerHello {
    /// [`crate::PROTOCOL_VERSION`] of the worker.
    pub protocol_version: u32,
    /// R's version, e.g. "4.2.2".
    pub r_version: String,
    /// The worker's process id.
    pub pid: u32,
    /// R's session temporary directory.
    pub r_tempdir: String,
    /// Milliseconds from process start to R ready.
    pub startup_ms: f64,
}
