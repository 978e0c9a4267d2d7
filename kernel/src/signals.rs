//! SIGINT (a front end's `interrupt_mode: signal`) and SIGTERM, turned
//! into calls on a thread: the handler only writes the signal's number to
//! a pipe (async-signal-safe); a thread reads it and acts.

use std::io::Read;
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicI32, Ordering};

/// The pipe's write end, for the handler (-1: none yet).
static PIPE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_signal(sig: libc::c_int) {
    let fd = PIPE.load(Ordering::Relaxed);
    if fd >= 0 {
        let b = sig as u8;
        // SAFETY: write(2) is async-signal-safe; `b` lives in this frame
        // for the call; `fd` is the pipe's write end, never closed.
        unsafe {
            libc::write(fd, (&b as *const u8).cast(), 1);
        }
    }
}

/// Calls `on_interrupt` for each SIGINT and `on_term` for SIGTERM, from a
/// thread of its own. Installed once per process.
pub fn watch(
    on_interrupt: impl Fn() + Send + 'static,
    on_term: impl Fn() + Send + 'static,
) -> std::io::Result<()> {
    let mut fds = [-1; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`, which has room for
    // them.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    PIPE.store(fds[1], Ordering::Relaxed);
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is a valid empty one; the handler
        // only loads an atomic and calls write(2); SA_RESTART keeps this
        // process's blocking calls (libzmq's poll) from failing with EINTR.
        let ok = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if ok != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    // SAFETY: `fds[0]` is the read end just made, owned by this File alone.
    let mut read = unsafe { std::fs::File::from_raw_fd(fds[0]) };
    std::thread::Builder::new()
        .name("rvisor-kernel-signals".into())
        .spawn(move || {
            let mut b = [0u8; 1];
            while read.read_exact(&mut b).is_ok() {
                if b[0] as libc::c_int == libc::SIGINT {
                    on_interrupt();
                } else {
                    on_term();
                }
            }
        })?;
    Ok(())
}
