//! Reset and restore reasons: the constants hosts match on, the reasons
//! of a worker's end, and their words in a result's notice.

use crate::process::ExitInfo;
use rvisor_protocol::{Outcome, RunResult};

pub(super) fn reset_words(reason: &str) -> &'static str {
    match reason {
        "timeout" => "the previous call ran past its timeout and R did not answer the interrupt, so its worker was killed",
        "cancel" => "a call was cancelled and R did not answer the interrupt, so its worker was killed",
        "crash" => "the previous worker crashed",
        "killed" => "the previous worker was killed from outside (possibly out of memory)",
        "quit" => "the code called quit()",
        "reset" => "the session was reset on request",
        "restore" => "the session was rolled back to its checkpoint on request",
        "exited" => "the previous worker exited",
        KILLED_OVER_BUDGET => "the server stopped the previous worker: the memory of its sessions was over the server's budget",
        r if r.starts_with("restore_failed") => "its checkpoint could not be restored",
        r if r.starts_with(CHECKPOINT_FAILED) => {
            "its state after the last checkpoint could not be saved"
        }
        _ => "the previous worker ended",
    }
}

/// How a restore that followed no reset came about, for the notice.
pub(super) fn restore_cause(reason: &str) -> &'static str {
    match reason {
        RESUMED_RESTART => "the server restarted; ",
        RESUMED_MOVED => "the session moved to this node (its node was drained or lost); ",
        _ => "woke the session from hibernation: ",
    }
}

/// The start of `reset_reason` when a session was restored from an older
/// checkpoint because its later state could not be saved (too large, over
/// quota, a store or worker failure): `checkpoint_failed: <why>`. The
/// result's `session.restored.lost_calls` names the calls whose work is
/// gone.
pub const CHECKPOINT_FAILED: &str = "checkpoint_failed";

/// [`Supervisor::resume_session`]'s reason when the same server (node)
/// was restarted.
pub const RESUMED_RESTART: &str = "restarted";
/// [`Supervisor::resume_session`]'s reason when another node took the
/// session over.
pub const RESUMED_MOVED: &str = "moved";

/// The reset reason of a worker the host killed with
/// [`Session::kill_worker`](super::Session::kill_worker) (admission: over a memory budget).
pub const KILLED_OVER_BUDGET: &str = "memory_budget";

/// The reset reason for a worker that ended by itself.
pub(super) fn exit_reason(exit: Option<ExitInfo>) -> &'static str {
    match exit.and_then(|e| e.signal) {
        Some(libc::SIGKILL) => "killed",
        Some(_) => "crash",
        None => "exited",
    }
}

/// The reset reason for a worker that ended during a call with `res`.
pub(super) fn call_end_reason(res: &RunResult, exit: Option<ExitInfo>) -> &'static str {
    match res.outcome {
        Outcome::TimedOut => "timeout",
        Outcome::Cancelled => "cancel",
        Outcome::WorkerExited
            if res
                .error
                .as_ref()
                .is_some_and(|e| e.message.starts_with("quit()")) =>
        {
            "quit"
        }
        _ => exit_reason(exit),
    }
}
