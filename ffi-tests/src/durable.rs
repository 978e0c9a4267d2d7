//! Helpers of the durable-session tests (durable.rs, checkpoints.rs):
//! a supervisor checkpointing into a directory, session options that leave
//! checkpoints to the test, and waits on a session's state.

use rvisor::checkpoint::DirStore;
use rvisor::{
    Outcome, RunResult, Session, SessionOptions, SessionState, Supervisor, SupervisorConfig,
};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How long a session may take to reach a state before a test calls it a
/// hang.
const STATE_DEADLINE: Duration = Duration::from_secs(120);

/// A confined supervisor (the default) whose sessions checkpoint into
/// `dir`, and its store.
pub fn supervisor(dir: &Path) -> (Supervisor, Arc<DirStore>) {
    let store = Arc::new(DirStore::new(dir).unwrap());
    let sup = Supervisor::new(SupervisorConfig {
        checkpoints: Some(store.clone()),
        ..SupervisorConfig::default()
    })
    .expect("supervisor starts");
    (sup, store)
}

/// Session options with no automatic checkpoints or hibernation: the tests
/// ask for them.
pub fn manual() -> SessionOptions {
    SessionOptions {
        checkpoint_after: None,
        hibernate_after: None,
        ..SessionOptions::default()
    }
}

/// Runs `code` in `s` and asserts that it completed.
pub fn ok(s: &Session, code: &str) -> RunResult {
    let r = s.run(code).expect("queued").wait();
    assert_eq!(
        r.outcome,
        Outcome::Complete,
        "{code}: {:?} {}",
        r.error,
        r.console
    );
    r
}

/// Waits until `s` is in state `want`.
pub fn wait_state(s: &Session, want: SessionState) {
    crate::wait_for(&format!("state {want:?}"), STATE_DEADLINE, || {
        (s.status().state == want).then_some(())
    })
}
