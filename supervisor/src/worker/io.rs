//! The supervisor's side of a worker's link: the one thread that reads the
//! worker's socket (its frames, [`FrameReader`]) and its stdout and stderr
//! pipes ([`RawPipes`]), and hands what it read to the call loop as
//! [`LinkEvent`]s.

use super::LinkEvent;
use rvisor_protocol::bounds;
use rvisor_protocol::FromWorker;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Reads everything available from a non-blocking pipe into `buf`, keeping
/// at most `budget` more bytes (the rest is read and dropped, so the writer
/// never blocks on a full pipe). Returns whether the pipe is still open and
/// whether bytes were dropped.
fn drain_pipe(fd: &OwnedFd, buf: &mut Vec<u8>, budget: &mut usize) -> (bool, bool) {
    let mut chunk = [0u8; 16 * 1024];
    let mut dropped = false;
    loop {
        // SAFETY: read(2) into our buffer from a descriptor we own.
        let n = unsafe { libc::read(fd.as_raw_fd(), chunk.as_mut_ptr().cast(), chunk.len()) };
        if n > 0 {
            let n = n as usize;
            let keep = n.min(*budget);
            buf.extend_from_slice(&chunk[..keep]);
            *budget -= keep;
            dropped |= keep < n;
            continue;
        }
        if n == 0 {
            return (false, dropped);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return (true, dropped),
            _ => return (false, dropped),
        }
    }
}

/// A pollfd for a pipe that is still open (else one poll ignores).
fn pipe_pollfd(fd: &OwnedFd, open: bool) -> libc::pollfd {
    libc::pollfd {
        fd: if open { fd.as_raw_fd() } else { -1 },
        events: libc::POLLIN,
        revents: 0,
    }
}

/// The raw output side of the I/O thread: both pipes, what was read and not
/// yet sent, and how much more may be kept before the next frame
/// (`bounds::RAW_BYTES` per stream), so a flood from the worker or from a
/// process it left behind never grows the supervisor's memory, whether a
/// call is running (and consuming the events) or not.
struct RawPipes {
    pipes: [OwnedFd; 2],
    open: [bool; 2],
    bufs: [Vec<u8>; 2],
    budget: [usize; 2],
    dropped: [bool; 2],
}

impl RawPipes {
    fn new(pipes: [OwnedFd; 2]) -> Self {
        for p in &pipes {
            // SAFETY: fcntl on descriptors we own.
            unsafe {
                let flags = libc::fcntl(p.as_raw_fd(), libc::F_GETFL);
                libc::fcntl(p.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        RawPipes {
            pipes,
            open: [true, true],
            bufs: [Vec::new(), Vec::new()],
            budget: [bounds::RAW_BYTES; 2],
            dropped: [false; 2],
        }
    }

    /// Drains pipe `i` if it is open.
    fn drain(&mut self, i: usize) {
        if self.open[i] {
            let (open, dropped) =
                drain_pipe(&self.pipes[i], &mut self.bufs[i], &mut self.budget[i]);
            self.open[i] = open;
            self.dropped[i] |= dropped;
        }
    }

    /// Sends what was read (and what was dropped) to the call loop.
    fn flush(&mut self, tx: &Sender<LinkEvent>) {
        if !self.bufs[0].is_empty() || !self.bufs[1].is_empty() {
            let _ = tx.send(LinkEvent::Raw(std::mem::take(&mut self.bufs)));
        }
        if self.dropped.contains(&true) {
            let _ = tx.send(LinkEvent::RawDropped(std::mem::take(&mut self.dropped)));
        }
    }

    /// A frame came: everything before it belongs to that frame's call, and
    /// the next call gets a full budget.
    fn frame_boundary(&mut self, tx: &Sender<LinkEvent>) {
        self.drain(0);
        self.drain(1);
        self.flush(tx);
        self.budget = [bounds::RAW_BYTES; 2];
    }

    /// The worker is gone: collect what it printed on its way out (a crash
    /// report), waiting briefly for the pipes to close (a background child
    /// may hold them open).
    fn finish(&mut self, tx: &Sender<LinkEvent>) {
        let end = Instant::now() + Duration::from_millis(200);
        while self.open.iter().any(|o| *o) {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let mut pfds = [
                pipe_pollfd(&self.pipes[0], self.open[0]),
                pipe_pollfd(&self.pipes[1], self.open[1]),
            ];
            // SAFETY: poll on two pollfds we own.
            unsafe { libc::poll(pfds.as_mut_ptr(), 2, left.as_millis().max(1) as i32) };
            self.drain(0);
            self.drain(1);
        }
        self.flush(tx);
    }
}

/// Why reading a frame stopped.
enum ReadError {
    /// The link ended or broke.
    Link(String),
    /// The length prefix announced more than the limit: nothing was read.
    Oversized { len: u64, limit: u64 },
}

/// The socket's frames (the frame format of `rvisor_protocol::read_frame`),
/// read in as few reads as they arrived in: a frame that came whole (its
/// length and its payload, one write of the worker's) is one read, and
/// frames that came together are split here. A frame longer than `limit`
/// is refused from its length, before its payload is read or allocated.
struct FrameReader {
    /// Read from the socket: `buf[start..end]` is not yet taken.
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

/// What one read asks for, and what the buffer keeps between frames.
const READ_CHUNK: usize = 64 * 1024;

impl FrameReader {
    fn new() -> Self {
        FrameReader {
            buf: vec![0; READ_CHUNK],
            start: 0,
            end: 0,
        }
    }

    /// Whether part of a frame is read and not yet taken.
    fn has_partial(&self) -> bool {
        self.end > self.start
    }

    /// The length its prefix announces for the next frame, once read.
    fn next_len(&self) -> Option<u64> {
        let head = self.buf.get(self.start..self.start + 4)?;
        (self.end - self.start >= 4)
            .then(|| u64::from(u32::from_be_bytes([head[0], head[1], head[2], head[3]])))
    }

    /// The next frame if it was read whole, taken out of the buffer; an
    /// oversized length is an error at once; None: more must be read.
    fn take(&mut self, limit: u64) -> Option<Result<FromWorker, ReadError>> {
        let len = self.next_len()?;
        if len > limit {
            return Some(Err(ReadError::Oversized { len, limit }));
        }
        let frame_end = self.start + 4 + len as usize;
        if frame_end > self.end {
            return None;
        }
        let frame = serde_json::from_slice(&self.buf[self.start + 4..frame_end])
            .map_err(|e| ReadError::Link(format!("failed to decode a frame: {e}")));
        self.start = frame_end;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.buf.len() > READ_CHUNK {
                // Back to its usual size after a large frame.
                self.buf.truncate(READ_CHUNK);
                self.buf.shrink_to_fit();
            }
        }
        Some(frame)
    }

    /// Reads what the socket has (it polled readable). Once a frame's
    /// length is known and its payload is larger than the room left, the
    /// room is made and the rest of it read at once, as the worker is
    /// sending it.
    fn fill(&mut self, sock: &mut UnixStream, limit: u64) -> Result<(), ReadError> {
        use std::io::Read;
        let need = match self.next_len() {
            Some(len) if len <= limit => 4 + len as usize,
            _ => 4,
        };
        if self.start + need > self.buf.len() {
            // Move the partial frame to the front, and grow for a large one.
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if need > self.buf.len() {
                self.buf.resize(need, 0);
            }
        }
        let big = need > READ_CHUNK;
        loop {
            let got = if big {
                let to = self.start + need;
                sock.read_exact(&mut self.buf[self.end..to])
                    .map(|()| to - self.end)
            } else {
                sock.read(&mut self.buf[self.end..])
            };
            match got {
                Ok(0) if self.has_partial() => {
                    return Err(ReadError::Link("the link ended inside a frame".into()))
                }
                Ok(0) => return Err(ReadError::Link("the peer closed the connection".into())),
                Ok(n) => {
                    self.end += n;
                    return Ok(());
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    return Err(ReadError::Link("the link ended inside a frame".into()))
                }
                Err(e) => return Err(ReadError::Link(format!("failed to read a frame: {e}"))),
            }
        }
    }
}

/// The one thread that reads a worker's socket and its stdout/stderr
/// pipes. Reading all three in one thread is what makes raw output land in
/// the right result without any marker: everything the call wrote to its
/// fds (itself, or child processes it waited for) is in the pipes before
/// the worker sends the result frame, so draining the pipes right after
/// reading that frame gets all of it. Frames are read up to `frame_limit`
/// bytes (set per call from its output cap); a larger one is never read:
/// the thread reports it and stops, and the call loop kills the worker.
pub(super) fn io_thread(
    mut sock: UnixStream,
    pipes: [OwnedFd; 2],
    tx: Sender<LinkEvent>,
    frame_limit: Arc<AtomicU64>,
) {
    let mut raw = RawPipes::new(pipes);
    let mut frames = FrameReader::new();
    loop {
        // The frames read whole so far, in order; after each, the pipes
        // are drained (what the call printed before its result is its).
        let limit = frame_limit.load(Ordering::Relaxed);
        while let Some(frame) = frames.take(limit) {
            match frame {
                Ok(frame) => {
                    raw.frame_boundary(&tx);
                    if tx.send(LinkEvent::Frame(Ok(frame))).is_err() {
                        return;
                    }
                }
                Err(ReadError::Oversized { len, limit }) => {
                    let _ = sock.shutdown(std::net::Shutdown::Both);
                    raw.flush(&tx);
                    let why = format!(
                        "the worker sent a frame of {len} bytes, over this call's limit of \
                         {limit} bytes (4 x max_output_bytes + {} MiB); it was killed",
                        bounds::FRAME_OVERHEAD_BYTES >> 20
                    );
                    let _ = tx.send(LinkEvent::Oversized(why.clone()));
                    let _ = tx.send(LinkEvent::Frame(Err(why)));
                    return;
                }
                Err(ReadError::Link(e)) => {
                    raw.finish(&tx);
                    let _ = tx.send(LinkEvent::Frame(Err(e)));
                    return;
                }
            }
        }
        let mut fds = [
            libc::pollfd {
                fd: sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            pipe_pollfd(&raw.pipes[0], raw.open[0]),
            pipe_pollfd(&raw.pipes[1], raw.open[1]),
        ];
        // SAFETY: poll on three pollfds we own (negative fds are ignored).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 3, -1) };
        if n < 0 {
            continue; // EINTR
        }
        for i in 0..2 {
            if fds[i + 1].revents != 0 {
                raw.drain(i);
            }
        }
        // Hand over in pieces: the call loop keeps at most its share.
        if raw.bufs[0].len() + raw.bufs[1].len() > 1024 * 1024 {
            raw.flush(&tx);
        }
        if fds[0].revents == 0 {
            continue;
        }
        if let Err(e) = frames.fill(&mut sock, limit) {
            let ReadError::Link(e) = e else { continue };
            raw.finish(&tx);
            let _ = tx.send(LinkEvent::Frame(Err(e)));
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn frame(msg: &FromWorker) -> Vec<u8> {
        let payload = serde_json::to_vec(msg).unwrap();
        let mut out = (payload.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(&payload);
        out
    }

    fn tool_call(i: u64, args: serde_json::Value) -> FromWorker {
        FromWorker::ToolCall {
            execution_id: format!("e{i}"),
            call_id: i,
            name: "t".into(),
            args,
        }
    }

    /// Reads `n` frames as the I/O thread does: what is whole first, then
    /// a read.
    fn read_frames(
        reader: &mut FrameReader,
        sock: &mut UnixStream,
        n: usize,
        limit: u64,
    ) -> Result<Vec<FromWorker>, String> {
        let mut got = Vec::new();
        while got.len() < n {
            match reader.take(limit) {
                Some(Ok(f)) => got.push(f),
                Some(Err(ReadError::Link(e))) => return Err(e),
                Some(Err(ReadError::Oversized { len, .. })) => return Err(format!("over: {len}")),
                None => reader.fill(sock, limit).map_err(|e| match e {
                    ReadError::Link(e) => e,
                    ReadError::Oversized { .. } => unreachable!("fill does not judge sizes"),
                })?,
            }
        }
        Ok(got)
    }

    #[test]
    fn frames_are_split_and_joined_however_they_arrive() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        // Small frames, a large one (several reads, a grown buffer), small
        // again: sent in pieces of every size across frame boundaries.
        let big = serde_json::Value::String("x".repeat(3 * READ_CHUNK));
        let msgs: Vec<FromWorker> = (0..20)
            .map(|i| {
                if i == 7 {
                    tool_call(i, big.clone())
                } else {
                    tool_call(i, serde_json::json!([i]))
                }
            })
            .collect();
        let bytes: Vec<u8> = msgs.iter().flat_map(frame).collect();
        let writer = std::thread::spawn(move || {
            let mut at = 0;
            let mut step = 1;
            while at < bytes.len() {
                let end = (at + step).min(bytes.len());
                a.write_all(&bytes[at..end]).unwrap();
                at = end;
                step = step * 7 % 1013 + 1;
            }
        });
        let mut reader = FrameReader::new();
        let got = read_frames(&mut reader, &mut b, msgs.len(), u64::MAX).unwrap();
        writer.join().unwrap();
        assert_eq!(got, msgs);
        assert!(!reader.has_partial());
        assert_eq!(reader.buf.len(), READ_CHUNK, "back to its usual size");
    }

    #[test]
    fn an_oversized_frame_is_refused_from_its_length_and_an_end_is_told_apart() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let small = tool_call(1, serde_json::json!(1));
        let large = tool_call(2, serde_json::Value::String("y".repeat(1000)));
        a.write_all(&frame(&small)).unwrap();
        // Only the length of the large one: it is refused without its payload.
        a.write_all(&frame(&large)[..4]).unwrap();
        let mut reader = FrameReader::new();
        let got = read_frames(&mut reader, &mut b, 1, 500).unwrap();
        assert_eq!(got, vec![small]);
        let over = read_frames(&mut reader, &mut b, 1, 500).unwrap_err();
        assert!(over.starts_with("over: "), "{over}");

        // A link that ends inside a frame, and one that ends between frames.
        let (mut a, mut b) = UnixStream::pair().unwrap();
        a.write_all(&frame(&large)[..10]).unwrap();
        drop(a);
        let e = read_frames(&mut FrameReader::new(), &mut b, 1, u64::MAX).unwrap_err();
        assert!(e.contains("inside a frame"), "{e}");
        let (a, mut b) = UnixStream::pair().unwrap();
        drop(a);
        let e = read_frames(&mut FrameReader::new(), &mut b, 1, u64::MAX).unwrap_err();
        assert!(e.contains("closed"), "{e}");
    }
}
