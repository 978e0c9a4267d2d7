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
    let len = u32::try_from(payload.len()).map_err(|_| FrameError::TooLarge(payload.len()))?;
    if payload.len() > rvisor_protocol::MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(payload.len()));
    }
    LINK.with(|l| match l.borrow_mut().as_mut() {
        Some(s) => {
            write_all_vectored(s, &len.to_be_bytes(), payload)?;
            Ok(())
        }
        None => Err(FrameError::Closed),
    })
}

/// Writes `head` then `body` in as few writes as the socket takes: one
/// `writev` for a frame that fits its buffer. Written as two, the frame's
/// length arrived alone and woke the supervisor's reader twice per result.
fn write_all_vectored(
    s: &mut impl std::io::Write,
    head: &[u8],
    body: &[u8],
) -> std::io::Result<()> {
    use std::io::IoSlice;
    let mut sent = 0usize;
    let total = head.len() + body.len();
    while sent < head.len() {
        let bufs = [IoSlice::new(&head[sent..]), IoSlice::new(body)];
        match s.write_vectored(&bufs) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if sent < total {
        s.write_all(&body[sent - head.len()..])?;
    }
    Ok(())
}

/// Reads the next frame and the descriptors that came with it (a run's
/// tables), blocking.
pub fn recv_with_fds() -> Result<(ToWorker, Vec<std::os::fd::OwnedFd>), FrameError> {
    LINK.with(|l| match l.borrow_mut().as_mut() {
        Some(s) => rvisor_protocol::fdpass::recv_frame_with_fds(s),
        None => Err(FrameError::Closed),
    })
}

/// Whether a frame from the supervisor is waiting, or comes within
/// `timeout_ms` (0: now; the link closed counts as readable).
pub fn readable(timeout_ms: i32) -> bool {
    LINK.with(|l| match l.borrow().as_ref() {
        Some(s) => {
            let mut p = libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(s),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: poll on one pollfd of a descriptor the stream owns.
            unsafe { libc::poll(&mut p, 1, timeout_ms) != 0 }
        }
        None => true,
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

#[cfg(test)]
mod tests {
    use super::write_all_vectored;

    /// A writer that takes at most `step` bytes a call (a socket whose
    /// buffer is nearly full), counting its calls.
    struct Trickle {
        out: Vec<u8>,
        step: usize,
        calls: usize,
    }

    impl std::io::Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.calls += 1;
            let n = buf.len().min(self.step);
            self.out.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
            self.calls += 1;
            let mut n = 0;
            for b in bufs {
                let k = b.len().min(self.step - n);
                self.out.extend_from_slice(&b[..k]);
                n += k;
                if n == self.step {
                    break;
                }
            }
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_frame_goes_whole_and_in_order_however_the_writes_are_cut() {
        let body: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        for step in [1, 3, 4, 5, 700, 1004, 1 << 20] {
            let mut w = Trickle {
                out: Vec::new(),
                step,
                calls: 0,
            };
            write_all_vectored(&mut w, b"\0\0\x03\xe8", &body).unwrap();
            assert_eq!(&w.out[..4], b"\0\0\x03\xe8", "step {step}");
            assert_eq!(&w.out[4..], &body[..], "step {step}");
            if step >= 1004 {
                assert_eq!(w.calls, 1, "a frame that fits is one write");
            }
        }
    }
}
