//! The worker's end of the socketpair to its supervisor.
//!
//! Held in a thread-local of the R thread because R's callbacks (`quit()`,
//! tool calls from R code) must send frames from inside an evaluation.

use rvisor_protocol::{read_frame, write_frame, FrameError, FromWorker, ToWorker, ToolOutcome};
use std::cell::RefCell;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

thread_local! {
    static LINK: RefCell<Option<UnixStream>> = const { RefCell::new(None) };
    static SYNC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Makes `stream` the link for this (the R) thread.
pub fn install(stream: UnixStream, sync_token: Option<String>) {
    LINK.with(|l| *l.borrow_mut() = Some(stream));
    SYNC.with(|s| *s.borrow_mut() = sync_token);
}

/// Sends one frame to the supervisor.
pub fn send(msg: &FromWorker) -> Result<(), FrameError> {
    LINK.with(|l| match l.borrow_mut().as_mut() {
        Some(s) => write_frame(s, msg),
        None => Err(FrameError::Closed),
    })
}

/// Reads the next frame from the supervisor (blocking).
pub fn recv() -> Result<ToWorker, FrameError> {
    LINK.with(|l| match l.borrow_mut().as_mut() {
        Some(s) => read_frame(s),
        None => Err(FrameError::Closed),
    })
}

/// Writes the sync token to fds 1 and 2, after flushing C stdio, so the
/// supervisor knows that all raw output of the call before it has arrived.
pub fn write_sync() {
    SYNC.with(|s| {
        let Some(token) = s.borrow().clone() else {
            return;
        };
        let bytes = format!("\x1e{token}\x1e");
        // SAFETY: fflush(NULL) flushes every C stdio stream; write() of a
        // buffer we own to the inherited fds 1 and 2.
        unsafe {
            libc::fflush(std::ptr::null_mut());
            for fd in [1, 2] {
                libc::write(fd, bytes.as_ptr().cast(), bytes.len());
            }
        }
    });
}

/// Waits for the result of tool call `call_id`. Returns early with an error
/// when SIGINT arrives (timeout or cancel), so R can act on the interrupt;
/// a result that comes later is skipped by the main loop.
pub fn wait_tool_result(call_id: u64) -> ToolOutcome {
    loop {
        let fd = LINK.with(|l| l.borrow().as_ref().map(|s| s.as_raw_fd()));
        let Some(fd) = fd else {
            return ToolOutcome::Error("the link to the supervisor is closed".into());
        };
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd we own; the fd stays open (owned by LINK).
        let n = unsafe { libc::poll(&mut pfd, 1, -1) };
        if n < 0 {
            if crate::interrupt::seen() {
                return ToolOutcome::Error("the tool call was interrupted".into());
            }
            continue;
        }
        match recv() {
            Ok(ToWorker::ToolResult {
                call_id: id,
                outcome,
            }) if id == call_id => return outcome,
            Ok(ToWorker::ToolResult { .. }) => continue, // a stale answer
            Ok(other) => {
                return ToolOutcome::Error(format!(
                    "the supervisor sent {other:?} while a tool call was waiting"
                ))
            }
            Err(e) => return ToolOutcome::Error(format!("the link to the supervisor failed: {e}")),
        }
    }
}
