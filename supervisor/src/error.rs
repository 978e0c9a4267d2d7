//! The library's error type: owned data only, messages that read after
//! "failed to ...".

use std::path::PathBuf;

/// What can go wrong in the supervisor library.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The worker binary was not found.
    #[error(
        "failed to find the rvisor-worker binary (looked in {0}); build it with `cargo build` \
         or set RVISOR_WORKER to its path"
    )]
    WorkerNotFound(String),
    /// The worker process could not be started.
    #[error("failed to start the worker {path}: {source}")]
    Spawn {
        /// Worker binary.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The worker started but did not become ready.
    #[error("failed to start R in the worker: {0}")]
    Startup(String),
    /// The worker did not become ready in time.
    #[error("the worker did not become ready within {0:?}")]
    StartupTimeout(std::time::Duration),
    /// An operating-system call failed.
    #[error("failed to {what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        source: std::io::Error,
    },
    /// A request was invalid.
    #[error("{0}")]
    Invalid(String),
    /// Workers cannot be confined as configured on this host.
    #[error("refusing to start: {0}")]
    Confinement(String),
}
