//! Test-only pause points in a call's life, so that an end-to-end test can
//! land a cancel (a SIGINT) exactly at one step. Compiled into debug builds
//! only: in a release build [`at`] is empty and nothing reads the variable.
//!
//! With `RVISOR_TEST_PAUSE` set (to anything) in the worker's environment,
//! a call whose code starts with `#rvisor-test-pause:STEP` (an R comment)
//! stops at STEP:
//!
//! - `sent`: the call has reached the worker, which has not begun it (a
//!   tagged interrupt that arrives now must wait for the call);
//! - `binding`: its variables and tables are about to be bound;
//! - `parsing`: its code is about to be parsed;
//! - `result`: it has run and its result is about to be sent.
//!
//! There the worker sends one event of the call, stderr text
//! `rvisor-test-pause: STEP` (whether or not the call streams), then waits
//! until a SIGINT reaches it (tagged for this call or another, or not),
//! for at most a minute, and goes on. The environment variable is set by
//! the test for its own sessions (`EnvPolicy::Names`), so R code cannot
//! turn this on for a worker that was not started for it.
//! `ffi-tests/tests/cancel.rs` uses it.

/// The code prefix that selects a step.
#[cfg(debug_assertions)]
const MARK: &str = "#rvisor-test-pause:";

/// Stops call `execution_id` at `step` if the test asked for it in its
/// `code` (see the module).
#[cfg(debug_assertions)]
pub fn at(step: &str, execution_id: &str, code: &str) {
    use crate::{interrupt, link};
    use rvisor_protocol::{EventKind, FromWorker};
    use std::time::{Duration, Instant};
    if std::env::var_os("RVISOR_TEST_PAUSE").is_none() {
        return;
    }
    let wanted = code
        .strip_prefix(MARK)
        .and_then(|rest| rest.split_whitespace().next());
    if wanted != Some(step) {
        return;
    }
    let before = interrupt::arrivals();
    // SIGINT is blocked while the count is checked and unblocked by
    // ppoll(2) atomically as it waits, so one that comes between the two
    // is not missed; its handler runs here, at the step.
    // SAFETY: signal-mask calls on sets we own, on the worker's only
    // thread; the old mask is put back before returning.
    let old = unsafe {
        let mut block: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut block);
        libc::sigaddset(&mut block, libc::SIGINT);
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, &block, &mut old);
        old
    };
    let _ = link::send(&FromWorker::Events {
        execution_id: execution_id.to_string(),
        events: vec![EventKind::Stderr {
            text: format!("rvisor-test-pause: {step}\n"),
        }],
    });
    let end = Instant::now() + Duration::from_secs(60);
    while interrupt::arrivals() == before {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let ts = libc::timespec {
            tv_sec: left.as_secs() as libc::time_t,
            tv_nsec: left.subsec_nanos() as libc::c_long,
        };
        // SAFETY: ppoll with no descriptors, a timespec and a mask we own:
        // it waits until a signal's handler has run or the time is up.
        unsafe {
            let mut wait = old;
            libc::sigdelset(&mut wait, libc::SIGINT);
            libc::ppoll(std::ptr::null_mut(), 0, &ts, &wait);
        }
    }
    // SAFETY: puts back the mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
}

/// Release builds: no pause points.
#[cfg(not(debug_assertions))]
#[inline(always)]
pub fn at(_step: &str, _execution_id: &str, _code: &str) {}
