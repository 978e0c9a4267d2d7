//! Messages between the supervisor and a zygote: an embedded R initialised
//! once that forks ready workers on request.

use serde::{Deserialize, Serialize};

/// Name of the environment variable that carries the zygote's control socket
/// (a file descriptor number inherited across exec).
pub const ENV_ZYGOTE_FD: &str = "RVISOR_ZYGOTE_FD";
/// Name of the environment variable listing packages the zygote preloads
/// (comma-separated).
pub const ENV_PRELOAD: &str = "RVISOR_PRELOAD";

/// Supervisor to zygote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToZygote {
    /// First frame: the supervisor's protocol version.
    Hello {
        /// [`crate::PROTOCOL_VERSION`].
        protocol_version: u32,
    },
    /// Fork a worker. Three descriptors travel with this frame (SCM_RIGHTS):
    /// the worker's end of its socketpair, and the write ends of its stdout
    /// and stderr pipes.
    Fork(ForkRequest),
}

/// What a forked worker needs besides its descriptors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkRequest {
    /// Supervisor's id for the request (echoed in the answer).
    pub worker_id: u64,
    /// The worker's private temporary directory (already created).
    pub temp_dir: String,
    /// The worker's whole environment (the zygote's is replaced).
    pub env: Vec<(String, String)>,
}

/// Zygote to supervisor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromZygote {
    /// The zygote is ready to fork.
    Hello(ZygoteHello),
    /// A worker was forked; it now waits for the supervisor's hello on its
    /// socket.
    Forked {
        /// From the request.
        worker_id: u64,
        /// The worker's process id.
        pid: u32,
    },
    /// fork() failed.
    ForkFailed {
        /// From the request.
        worker_id: u64,
        /// Why.
        message: String,
    },
    /// A forked worker ended (the zygote, its parent, reaped it).
    Exited {
        /// Its process id.
        pid: u32,
        /// Exit status, if it exited.
        code: Option<i32>,
        /// Signal, if one killed it.
        signal: Option<i32>,
    },
}

/// What a ready zygote tells about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ZygoteHello {
    /// [`crate::PROTOCOL_VERSION`] of the zygote.
    pub protocol_version: u32,
    /// R's version.
    pub r_version: String,
    /// The zygote's process id.
    pub pid: u32,
    /// Packages loaded before forking.
    pub preloaded: Vec<String>,
    /// Packages asked for that could not be loaded, with why.
    pub failed: Vec<(String, String)>,
    /// Milliseconds from process start to ready.
    pub startup_ms: f64,
}
