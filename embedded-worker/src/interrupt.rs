//! SIGINT ends the running evaluation (R's own interrupt), nothing else.
//!
//! R's signal handlers are off (`R_SignalHandlers = 0`); ours only sets
//! `R_interrupts_pending`, which R polls in loops, `Sys.sleep` and most
//! long-running internals, then signals an `interrupt` condition that the
//! driver turns into outcome `interrupted` with the session intact.

use std::sync::atomic::{AtomicBool, Ordering};

static SEEN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_sig: libc::c_int) {
    SEEN.store(true, Ordering::SeqCst);
    // SAFETY: a store to an int that R polls; async-signal-safe (a plain
    // volatile write, no allocation, no locks).
    unsafe { std::ptr::write_volatile(std::ptr::addr_of_mut!(libR_sys::R_interrupts_pending), 1) };
}

/// Installs the handler. No SA_RESTART: a blocking `select()` inside
/// `Sys.sleep` must return early so R notices the interrupt.
pub fn install() {
    // SAFETY: sigaction with a zeroed struct, a valid handler and an empty
    // mask; the handler is async-signal-safe (see above).
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigint as *const () as usize;
        libc::sigemptyset(&mut act.sa_mask);
        act.sa_flags = 0;
        libc::sigaction(libc::SIGINT, &act, std::ptr::null_mut());
    }
}

/// Forgets interrupts that arrived between calls (e.g. a deadline that hit
/// just as the previous call finished), so they cannot hit the next call.
pub fn clear() {
    SEEN.store(false, Ordering::SeqCst);
    // SAFETY: on the R thread, between evaluations.
    unsafe { std::ptr::write_volatile(std::ptr::addr_of_mut!(libR_sys::R_interrupts_pending), 0) };
}

/// Whether SIGINT arrived since the last [`clear`].
pub fn seen() -> bool {
    SEEN.load(Ordering::SeqCst)
}
