//! The checkpoint failures of a session in a row ([`Failure`]) and when
//! an automatic checkpoint may be tried again.

use crate::checkpoint::{CheckpointFailure, CheckpointFailureKind};
use crate::error::CheckpointError;
use std::time::{Duration, Instant};

/// The first wait before background checkpoints, hibernation and
/// admission try a failed checkpoint again; it doubles with each failure
/// in a row, up to [`MAX_CHECKPOINT_RETRY`].
pub const CHECKPOINT_RETRY: Duration = Duration::from_secs(30);
/// The longest wait between automatic attempts of a failing checkpoint.
pub const MAX_CHECKPOINT_RETRY: Duration = Duration::from_secs(30 * 60);

/// The checkpoint failures of a session in a row.
#[derive(Debug, Clone)]
pub(super) struct Failure {
    pub(super) error: CheckpointError,
    /// When the first one happened (RFC 3339).
    pub(super) since: String,
    pub(super) attempts: u32,
    /// When automatic attempts may try again.
    pub(super) retry_at: Instant,
    /// `unsaved_count` at the last failure: a state too large is tried
    /// again only once a call has changed it.
    pub(super) calls_at: u64,
}

/// When an automatic checkpoint may be tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Retry {
    Due,
    In(Duration),
    AfterACall,
}

impl Failure {
    pub(super) fn retry(&self, calls_now: u64) -> Retry {
        if matches!(self.error, CheckpointError::TooLarge(_)) && calls_now == self.calls_at {
            return Retry::AfterACall;
        }
        match self.retry_at.checked_duration_since(Instant::now()) {
            Some(d) if !d.is_zero() => Retry::In(d),
            _ => Retry::Due,
        }
    }

    pub(super) fn report(&self, calls_now: u64) -> CheckpointFailure {
        CheckpointFailure {
            kind: CheckpointFailureKind::from(&self.error),
            reason: self.error.to_string(),
            since: self.since.clone(),
            attempts: self.attempts,
            retry_in_seconds: match self.retry(calls_now) {
                Retry::Due => Some(0.0),
                Retry::In(d) => Some(d.as_secs_f64()),
                Retry::AfterACall => None,
            },
        }
    }
}
