//! A zygote's control loop, shared by the zygotes that fork (zygote.rs)
//! and a retired one (retired.rs): requests from the supervisor on the
//! control socket, and the children reaped and reported as SIGCHLD pokes a
//! self-pipe.

use crate::confine;
use rvisor_protocol::{fdpass, write_frame, FromZygote, ToZygote};
use std::collections::HashSet;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicI32, Ordering};

/// Write end of the self-pipe that SIGCHLD pokes.
pub(crate) static CHLD_PIPE: AtomicI32 = AtomicI32::new(-1);

extern "C" fn on_sigchld(_sig: libc::c_int) {
    let fd = CHLD_PIPE.load(Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: write(2) of one byte from a static to our own pipe;
        // async-signal-safe. A full pipe means a wake-up is pending anyway.
        unsafe { libc::write(fd, b"c".as_ptr().cast(), 1) };
    }
}

/// A self-pipe that SIGCHLD pokes, so poll() wakes up to reap; installs
/// the handler.
pub(crate) fn chld_pipe() -> Result<[RawFd; 2], String> {
    let mut pipe = [0 as RawFd; 2];
    // SAFETY: pipe2 fills the two-element array we own; sigaction installs
    // an async-signal-safe handler (a one-byte write to the pipe's write
    // end, published in CHLD_PIPE before the handler is installed).
    unsafe {
        if libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) != 0 {
            return Err("failed to create the SIGCHLD pipe".into());
        }
        CHLD_PIPE.store(pipe[1], Ordering::SeqCst);
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_sigchld as *const () as usize;
        libc::sigemptyset(&mut act.sa_mask);
        act.sa_flags = libc::SA_NOCLDSTOP;
        libc::sigaction(libc::SIGCHLD, &act, std::ptr::null_mut());
    }
    Ok(pipe)
}

/// A zygote's control loop: requests from `ctl` go to `handle`, children
/// are reaped (and reported) as SIGCHLD pokes `pipe`. Returns when the
/// supervisor closes the socket.
pub(crate) fn serve_control(
    mut ctl: UnixStream,
    pipe: [RawFd; 2],
    confined: &mut HashSet<libc::pid_t>,
    mut handle: impl FnMut(
        &mut UnixStream,
        ToZygote,
        Vec<OwnedFd>,
        &mut HashSet<libc::pid_t>,
    ) -> Result<(), String>,
) -> Result<(), String> {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: ctl.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: pipe[0],
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: poll on two pollfds we own.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            continue; // EINTR (SIGCHLD): reap below on the next round
        }
        if fds[1].revents != 0 {
            let mut buf = [0u8; 64];
            // SAFETY: read into our buffer from our non-blocking pipe.
            while unsafe { libc::read(pipe[0], buf.as_mut_ptr().cast(), buf.len()) } > 0 {}
            reap(&mut ctl, confined)?;
        }
        if fds[0].revents != 0 {
            let (req, fds) = match fdpass::recv_frame_with_fds::<_, ToZygote>(&mut ctl) {
                Ok(x) => x,
                Err(rvisor_protocol::FrameError::Closed) => return Ok(()),
                Err(e) => return Err(format!("failed to read a request: {e}")),
            };
            handle(&mut ctl, req, fds, confined)?;
        }
    }
}

/// Tells the supervisor that fork request `worker_id` failed, and why.
pub(crate) fn refuse_fork(
    ctl: &mut UnixStream,
    worker_id: u64,
    message: String,
) -> Result<(), String> {
    write_frame(ctl, &FromZygote::ForkFailed { worker_id, message }).map_err(|e| e.to_string())
}

/// Reaps every ended child and reports it. A confined worker cannot die of
/// SIGXCPU (pid 1 of its namespace): its handler exits with
/// `EXIT_CPU_LIMIT`, reported here as the signal.
pub(crate) fn reap(
    ctl: &mut UnixStream,
    confined: &mut HashSet<libc::pid_t>,
) -> Result<(), String> {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own children, non-blocking.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return Ok(());
        }
        let (code, signal) = if libc::WIFEXITED(status) {
            (Some(libc::WEXITSTATUS(status)), None)
        } else if libc::WIFSIGNALED(status) {
            (None, Some(libc::WTERMSIG(status)))
        } else {
            (None, None)
        };
        let (code, signal) = match (confined.remove(&pid), code) {
            (true, Some(confine::EXIT_CPU_LIMIT)) => (None, Some(libc::SIGXCPU)),
            _ => (code, signal),
        };
        let pid = pid as u32;
        write_frame(ctl, &FromZygote::Exited { pid, code, signal }).map_err(|e| e.to_string())?;
    }
}
