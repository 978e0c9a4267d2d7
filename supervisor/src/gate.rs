//! A session's call gate: a check the runner makes right before each call
//! runs and right after it ends, for a host that must know the session is
//! still its own (a node that holds the session under a lease, and may
//! have lost it to another node while it was paused or cut off).

use std::fmt::Debug;

/// Called by a session's runner thread, with no lock of the session held,
/// around every call (see [`crate::SessionOptions::call_gate`]).
pub trait CallGate: Send + Sync + Debug {
    /// Before call `execution_id` of session `session` starts (before its
    /// worker is started or restored, if it needs one). `Err(why)`: the
    /// call does not run; it resolves as `not_executed` with `why`.
    fn before_call(&self, session: &str, execution_id: &str) -> Result<(), String>;

    /// After call `execution_id` ended, before its result is handed over.
    /// The gate may record that the result must not be acknowledged (the
    /// host answers it as it sees fit).
    fn after_call(&self, session: &str, execution_id: &str);
}
