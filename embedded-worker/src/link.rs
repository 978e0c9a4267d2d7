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
}

/// Makes `stream` the link for this (the R) thread.
pub fn install(stream: UnixStream) {
    LINK.with(|l| *l.borrow_mut() = Some(stream));
}

/// Sends one frame to the supervisor.
pub fn send(msg: &FromWorker) -> Result<(), FrameError> {
    LINK.with(|l| match l.borrow_mut().as_mut() {
        Some(s) => write_frame(s, msg),
        None => Err(FrameError::Closed),
    })
}

/// Sends one frame whose JSON payload is already serialised (a result,
/// sized by `eval::result_frame`).
pub fn send_payload(payload: &[u8]) -> Result<(), FrameError> {
    use std::io::Write;
    let len = u32::try_from(payload.len()).map_err(|_| FrameError::TooLarge(payload.len()))?;
    if payload.len() > rvisor_protocol::MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(payload.len()));
    }
    LINK.with(|l| match l.borrow_mut().as_mut() {
        Some(s) => {
            s.write_all(&len.to_be_bytes())?;
            s.write_all(payload)?;
            s.flush()?;
            Ok(())
        }
        None => Err(FrameError::Closed),
    })
}

/// Reads the next frame and the descriptors that came with it (a run's
/// tables), blocking.
pub fn recv_with_fds() -> Result<(ToWorker, Vec<std::os::fd::OwnedFd>), FrameError> {
    LINK.with(|l| match l.borrow_mut().as_mut() {
        Some(s) => rvisor_protocol::fdpass::recv_frame_with_fds(s),
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

/// Flushes C stdio, so output written with printf by native code is in the
/// pipe before the result frame: the supervisor drains fds 1 and 2 right
/// after reading the frame.
pub fn flush_stdio() {
    // SAFETY: fflush(NULL) flushes every C stdio stream.
    unsafe {
        libc::fflush(std::ptr::null_mut());
    }
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
        // An interrupt may have come before the poll started (then poll is
        // not woken by it): check first, and wake up now and then to check.
        if crate::interrupt::seen() {
            return ToolOutcome::Error("the tool call was interrupted".into());
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd we own; the fd stays open (owned by LINK).
        let n = unsafe { libc::poll(&mut pfd, 1, 20) };
        if n <= 0 {
            continue; // a timeout or EINTR: check for an interrupt above
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
