//! SIGINT ends the running evaluation (R's own interrupt), nothing else.
//!
//! R's signal handlers are off (`R_SignalHandlers = 0`); ours only sets
//! `R_interrupts_pending`, which R polls in loops, `Sys.sleep` and most
//! long-running internals, then signals an `interrupt` condition that the
//! driver turns into outcome `interrupted` with the session intact.
//!
//! The supervisor tags its interrupts with the call's sequence number
//! (`sigqueue`), because a signal can overtake the call it is meant for (a
//! cancel right after the call was sent) or arrive after it (a deadline as
//! the call finishes). A tagged interrupt hits exactly its own call: if it
//! arrives early it waits for that call to start; if late, it is dropped.
//! An untagged SIGINT (a person's `kill -INT`) hits whatever runs.
//!
//! R takes the handler over for a moment: its `select()` wrapper
//! (`R_SelectEx`, used by `Sys.sleep` and R's event loop) installs a
//! handler of its own with `signal(2)` around each wait and puts ours back
//! the same way, which drops `SA_SIGINFO` (and adds `SA_RESTART`). Ours
//! then runs without its siginfo (the tag cannot be read), so it treats
//! such a signal as untagged and installs itself again in full; and it is
//! installed in full again at the end of every call ([`end_call`]), before
//! the worker answers, so an interrupt that overtakes the next call is
//! always read with its tag.

use crate::r;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static SEEN: AtomicBool = AtomicBool::new(false);
/// Sequence number of the call being evaluated (0 between calls).
static CURRENT: AtomicU64 = AtomicU64::new(0);
/// Sequence number of the last call the supervisor asked to interrupt.
static REQUESTED: AtomicU64 = AtomicU64::new(0);
/// SIGINTs that reached this handler, whatever they hit (the test-only
/// pause points wait for one: `pause`).
static ARRIVED: AtomicU64 = AtomicU64::new(0);

fn set_pending() {
    SEEN.store(true, Ordering::SeqCst);
    // Async-signal-safe: atomics and one volatile store (r.rs).
    r::set_interrupt_pending(true);
}

/// Whether SIGINT's current action is this handler with `SA_SIGINFO`
/// (then the kernel filled in its siginfo). Async-signal-safe: sigaction(2)
/// is.
fn installed_in_full() -> bool {
    // SAFETY: sigaction with a null new action only reads the current one
    // into a zeroed struct we own.
    unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGINT, std::ptr::null(), &mut cur) == 0
            && cur.sa_flags & libc::SA_SIGINFO != 0
    }
}

extern "C" fn on_sigint(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    ARRIVED.fetch_add(1, Ordering::SeqCst);
    if !installed_in_full() {
        // Put back by R's `signal()`: `info` points at whatever was on the
        // stack, so there is no tag to read. Only the supervisor's
        // interrupt for the running call can come now (one for an earlier
        // call reaches the worker before it reads the next one): hit what
        // runs, as an untagged interrupt does.
        install();
        set_pending();
        return;
    }
    // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler
    // (checked above); si_value is meaningful only for SI_QUEUE, which we
    // check first.
    let tag = unsafe {
        if !info.is_null() && (*info).si_code == libc::SI_QUEUE {
            (*info).si_value().sival_ptr as u64
        } else {
            0
        }
    };
    if tag == 0 {
        set_pending();
        return;
    }
    REQUESTED.store(tag, Ordering::SeqCst);
    if CURRENT.load(Ordering::SeqCst) == tag {
        set_pending();
    }
}

/// Installs the handler (again: idempotent, async-signal-safe). No
/// SA_RESTART: a blocking `select()` inside `Sys.sleep` must return early
/// so R notices the interrupt.
pub fn install() {
    // SAFETY: sigaction with a zeroed struct, a valid SA_SIGINFO handler and
    // an empty mask; the handler is async-signal-safe (atomics, sigaction
    // and a volatile store only).
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigint as *const () as usize;
        libc::sigemptyset(&mut act.sa_mask);
        act.sa_flags = libc::SA_SIGINFO;
        libc::sigaction(libc::SIGINT, &act, std::ptr::null_mut());
    }
}

/// Starts call `seq`: forgets untagged interrupts that arrived between
/// calls, and applies a tagged one that arrived before the call started.
pub fn begin_call(seq: u64) {
    SEEN.store(false, Ordering::SeqCst);
    // On the R thread, between evaluations: no R code polls the flag now.
    r::set_interrupt_pending(false);
    CURRENT.store(seq, Ordering::SeqCst);
    if seq != 0 && REQUESTED.load(Ordering::SeqCst) == seq {
        set_pending();
    }
}

/// Ends the call (before its result is sent): later tagged interrupts for
/// it are dropped, one that came after R's last check of the flag is
/// forgotten (it would hit the worker's next R code: a checkpoint), and
/// the handler is installed in full again for the next call.
pub fn end_call() {
    CURRENT.store(0, Ordering::SeqCst);
    // On the R thread, after the call's last R code.
    r::set_interrupt_pending(false);
    install();
}

/// Whether an interrupt hit the current call.
pub fn seen() -> bool {
    SEEN.load(Ordering::SeqCst)
}

/// How many SIGINTs have reached the worker so far.
#[cfg(debug_assertions)]
pub fn arrivals() -> u64 {
    ARRIVED.load(Ordering::SeqCst)
}
