//! The public option and status types of a session: [`SessionOptions`]
//! (and their defaults), per-call [`RunOptions`], and what `status`
//! reports ([`SessionStatus`], [`ResetInfo`], [`RunningCall`]).

use crate::checkpoint::CheckpointStatus;
use crate::events::StreamLimits;
use crate::tools::Tool;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Which host environment variables R code may read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum EnvPolicy {
    /// Only the variables that locate programs, libraries, locales and time
    /// zones, plus these names.
    Names(Vec<String>),
    /// The whole host environment (explicit opt-in: secrets included).
    Inherit,
    /// Only the locating variables.
    #[default]
    Minimal,
}

/// Options of a session.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Time limit per call (default 30 s).
    pub timeout: Duration,
    /// How long R may take to start (default 60 s).
    pub startup_timeout: Duration,
    /// How long R gets to answer an interrupt before its worker is killed.
    pub grace: Duration,
    /// Calls that may wait behind the running one (default 16).
    pub queue_limit: usize,
    /// Cap on output per call (default 8 MiB).
    pub max_output_bytes: u64,
    /// Plot width in pixels (default 1000).
    pub plot_width: u32,
    /// Plot height in pixels (default 650).
    pub plot_height: u32,
    /// Rich results of the session's calls (default: on, PNG plots; a
    /// call's [`RunOptions::display`] overrides it field by field).
    pub display: rvisor_protocol::DisplayOptions,
    /// Environment variables R code may read.
    pub env: EnvPolicy,
    /// R library directories, in order.
    pub libpath: Vec<PathBuf>,
    /// Library directories after R's own on `.libPaths()` (a tenant's
    /// packages); unlike `libpath`, they need not match the zygote's.
    pub libpath_after: Vec<PathBuf>,
    /// Working directory; by default a private directory that lives as long
    /// as the session.
    pub working_dir: Option<PathBuf>,
    /// Tools R code may call as `tools$name(...)`.
    pub tools: Vec<Tool>,
    /// This session's confinement limits (default: the supervisor's).
    /// Needs a confined supervisor; its workers are forked on demand (the
    /// pool's spares have the supervisor's limits).
    pub limits: Option<crate::Limits>,
    /// Network access for this session (default: the supervisor's).
    pub network: Option<bool>,
    /// With a checkpoint store ([`SupervisorConfig::checkpoints`]): how
    /// long the session may be idle, after a call changed its state,
    /// before it is checkpointed in the background (default 2 s; `None`:
    /// only on request and at hibernation).
    pub checkpoint_after: Option<Duration>,
    /// With a checkpoint store: how long the session may be idle before it
    /// is checkpointed and its worker released (state `hibernated`; the
    /// next call restores it). Default 10 minutes; `None`: never.
    pub hibernate_after: Option<Duration>,
    /// With a checkpoint store: when a worker ends during a call (timeout
    /// past the grace, cancel kill, crash, killed from outside), restore
    /// the last checkpoint into the next worker instead of starting empty
    /// (default true). `quit()` and [`Session::reset`](super::Session::reset) always start empty.
    pub restore_after_kill: bool,
    /// Most bytes of working-directory files a checkpoint saves (default
    /// 64 MiB; files past it are listed in the manifest as skipped). A
    /// session with an explicit `working_dir` saves none: the directory
    /// outlives its workers.
    pub checkpoint_file_bytes: u64,
    /// Put before the session's id to make its key in the checkpoint
    /// store (default: none, the key is the id). The service keys
    /// checkpoints by tenant this way.
    pub checkpoint_prefix: String,
    /// Checked right before each call runs and after it ends (see
    /// [`crate::CallGate`]): the service's lease check on a node of many.
    pub call_gate: Option<Arc<dyn crate::CallGate>>,
}

/// Default of [`SessionOptions::hibernate_after`]: 10 minutes.
pub const DEFAULT_HIBERNATE_AFTER: Duration = Duration::from_secs(600);
/// Default of [`SessionOptions::checkpoint_after`]: 2 seconds.
pub const DEFAULT_CHECKPOINT_AFTER: Duration = Duration::from_secs(2);
/// Default of [`SessionOptions::checkpoint_file_bytes`]: 64 MiB.
pub const DEFAULT_CHECKPOINT_FILE_BYTES: u64 = 64 << 20;

impl Default for SessionOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(30),
            startup_timeout: Duration::from_secs(60),
            grace: Duration::from_secs(2),
            queue_limit: 16,
            max_output_bytes: crate::DEFAULT_MAX_OUTPUT_BYTES,
            plot_width: crate::DEFAULT_PLOT_WIDTH,
            plot_height: crate::DEFAULT_PLOT_HEIGHT,
            display: rvisor_protocol::DisplayOptions::default(),
            env: EnvPolicy::Minimal,
            libpath: Vec::new(),
            libpath_after: Vec::new(),
            working_dir: None,
            tools: Vec::new(),
            limits: None,
            network: None,
            checkpoint_after: Some(DEFAULT_CHECKPOINT_AFTER),
            hibernate_after: Some(DEFAULT_HIBERNATE_AFTER),
            restore_after_kill: true,
            checkpoint_file_bytes: DEFAULT_CHECKPOINT_FILE_BYTES,
            checkpoint_prefix: String::new(),
            call_gate: None,
        }
    }
}

/// Per-call overrides of the session's options.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Time limit of this call.
    pub timeout: Option<Duration>,
    /// Plot width of this call.
    pub plot_width: Option<u32>,
    /// Plot height of this call.
    pub plot_height: Option<u32>,
    /// Display options of this call, over the session's field by field.
    pub display: rvisor_protocol::DisplayOptions,
    /// How many bytes of a streaming call's events may wait for its
    /// reader ([`Session::run_streaming_with`](super::Session::run_streaming_with); default
    /// [`crate::DEFAULT_STREAM_BUFFER_BYTES`]): past them a reader that
    /// lags loses the events in between and is told so
    /// ([`crate::EventKind::Lagged`]); the call never waits for its reader.
    pub stream_limits: StreamLimits,
}

/// Where a session is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    /// No call yet; no worker.
    New,
    /// A worker is starting.
    Starting,
    /// Ready, nothing running.
    Idle,
    /// A call is running.
    Running,
    /// Checkpointed, no worker; the next call restores the state.
    Hibernated,
    /// Closed for good.
    Closed,
}

/// The last reset of a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ResetInfo {
    /// Why: `timeout`, `cancel`, `crash`, `killed`, `quit`, `reset`.
    pub reason: String,
    /// When (RFC 3339, UTC).
    pub at: String,
}

/// A session's status (CONTRACT.md `SessionStatus`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionStatus {
    /// Session id.
    pub id: String,
    /// Life-cycle state.
    pub state: SessionState,
    /// Incremented each time a new worker starts (0 before the first).
    pub generation: u64,
    /// Calls waiting behind the running one.
    pub queued: usize,
    /// The last reset, if any.
    pub last_reset: Option<ResetInfo>,
    /// The worker's process id, when one runs.
    pub pid: Option<u32>,
    /// The directory calls run in.
    pub working_dir: String,
    /// The call running now, if any: its id, how long it has run, the CPU
    /// it used and the last lines it printed.
    #[serde(default)]
    pub running: Option<RunningCall>,
    /// Seconds since the last call ended (or the worker started); `None`
    /// while a call runs or calls are queued, and once closed. Admission
    /// control hibernates the longest-idle live sessions first.
    #[serde(default)]
    pub idle_seconds: Option<f64>,
    /// With a checkpoint store: where the session's checkpoint stands
    /// (current, behind, failed and why); `None` without one.
    #[serde(default)]
    pub checkpoint: Option<CheckpointStatus>,
}

/// The running call of a session, as `status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunningCall {
    /// The call's execution id.
    pub execution_id: String,
    /// Milliseconds since the call started in its worker.
    pub elapsed_ms: f64,
    /// CPU milliseconds the worker used since (10 ms steps), when known.
    pub cpu_ms: Option<f64>,
    /// The last lines it printed (at most 20 lines and 4 KiB; sent by the
    /// worker at most every 250 ms, once the call has run that long).
    pub output_tail: String,
}
