//! The supervisor's side of a worker's link. The call loop reads the
//! worker's socket itself ([`LinkRx`], frames through a [`FrameReader`]):
//! a result wakes the thread that waits for it, with no hand-over between
//! threads. A thread of the link's own reads the worker's stdout and
//! stderr pipes as they fill ([`RawPipes`], shared with the call loop),
//! so a flood never blocks the worker; at each frame the call loop drains
//! them too, so what a call printed before its result is that result's.
//! Tool results and cancels from other threads come through a channel
//! ([`LinkTx`]) whose sends wake the call loop's poll (an eventfd).

use super::LinkEvent;
use rvisor_protocol::bounds;
use rvisor_protocol::FromWorker;
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Reads everything available from a non-blocking pipe into `buf`, keeping
/// at most `budget` more bytes (the rest is read and dropped, so the writer
/// never blocks on a full pipe), through `chunk`. Returns whether the pipe
/// is still open and whether bytes were dropped.
fn drain_pipe(
    fd: &OwnedFd,
    buf: &mut Vec<u8>,
    budget: &mut usize,
    chunk: &mut [u8],
) -> (bool, bool) {
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

/// The raw output side of the link: both pipes, what was read and not yet
/// handed over, and how much more may be kept before the next frame
/// (`bounds::RAW_BYTES` per stream), so a flood from the worker or from a
/// process it left behind never grows the supervisor's memory, whether a
/// call is running (and consuming the events) or not.
struct RawPipes {
    pipes: [OwnedFd; 2],
    open: [bool; 2],
    bufs: [Vec<u8>; 2],
    budget: [usize; 2],
    dropped: [bool; 2],
    /// What each read(2) reads into (allocated once).
    chunk: Box<[u8]>,
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
            chunk: vec![0u8; 16 * 1024].into_boxed_slice(),
        }
    }

    /// Drains pipe `i` if it is open.
    fn drain(&mut self, i: usize) {
        if self.open[i] {
            let (open, dropped) = drain_pipe(
                &self.pipes[i],
                &mut self.bufs[i],
                &mut self.budget[i],
                &mut self.chunk,
            );
            self.open[i] = open;
            self.dropped[i] |= dropped;
        }
    }

    /// Hands over what was read (and what was dropped) as events.
    fn flush(&mut self, out: &mut dyn FnMut(LinkEvent)) {
        if !self.bufs[0].is_empty() || !self.bufs[1].is_empty() {
            out(LinkEvent::Raw(std::mem::take(&mut self.bufs)));
        }
        if self.dropped.contains(&true) {
            out(LinkEvent::RawDropped(std::mem::take(&mut self.dropped)));
        }
    }

    /// A frame came: everything before it belongs to that frame's call, and
    /// the next call gets a full budget.
    fn frame_boundary(&mut self, out: &mut dyn FnMut(LinkEvent)) {
        self.drain(0);
        self.drain(1);
        self.flush(out);
        self.budget = [bounds::RAW_BYTES; 2];
    }

    /// The worker is gone: collect what it printed on its way out (a crash
    /// report), waiting briefly for the pipes to close (a background child
    /// may hold them open).
    fn finish(&mut self, out: &mut dyn FnMut(LinkEvent)) {
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
        self.flush(out);
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

    /// Reads what the socket has (it polled readable), without waiting:
    /// a part of a frame is kept until the rest comes. Once a frame's
    /// length is known and its payload is larger than the room left, the
    /// room is made for all of it.
    fn fill(&mut self, sock: &UnixStream, limit: u64) -> Result<(), ReadError> {
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
        loop {
            let room = &mut self.buf[self.end..];
            // SAFETY: recv(2) into the part of our buffer past `end`, from a
            // socket we hold open; MSG_DONTWAIT keeps the call loop's own
            // poll the only place it waits.
            let n = unsafe {
                libc::recv(
                    sock.as_raw_fd(),
                    room.as_mut_ptr().cast(),
                    room.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n > 0 {
                self.end += n as usize;
                return Ok(());
            }
            if n == 0 {
                return Err(ReadError::Link(if self.has_partial() {
                    "the link ended inside a frame".into()
                } else {
                    "the peer closed the connection".into()
                }));
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::Interrupted => {}
                std::io::ErrorKind::WouldBlock => return Ok(()),
                _ => return Err(ReadError::Link(format!("failed to read a frame: {e}"))),
            }
        }
    }
}

/// The sending side of a worker's link events (tool results, cancels,
/// raw output handed over in pieces): a channel, and for a real worker the
/// eventfd that wakes its call loop's poll.
#[derive(Debug, Clone)]
pub(crate) struct LinkTx {
    tx: Sender<LinkEvent>,
    wake: Option<Arc<OwnedFd>>,
}

impl LinkTx {
    /// Queues `ev` for the call loop and wakes it. `Err`: the worker (its
    /// call loop's side) is gone.
    pub(crate) fn send(&self, ev: LinkEvent) -> Result<(), ()> {
        self.tx.send(ev).map_err(|_| ())?;
        if let Some(w) = &self.wake {
            let one = 1u64;
            // SAFETY: write(2) of 8 bytes from a local to an eventfd we hold
            // open; a full counter (EAGAIN) already wakes the poll.
            unsafe { libc::write(w.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
        Ok(())
    }
}

/// The call loop's side of a worker's link: the events other threads sent
/// ([`LinkTx`]) and, for a real worker, its socket, read here.
pub(crate) struct LinkRx {
    rx: Receiver<LinkEvent>,
    sock: Option<SockSide>,
    /// See [`LinkRx::poll_until`].
    poll_until: Option<Instant>,
}

impl std::fmt::Debug for LinkRx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkRx")
            .field("socket", &self.sock.as_ref().map(|s| s.sock.as_raw_fd()))
            .finish_non_exhaustive()
    }
}

/// A real worker's socket as the call loop reads it.
struct SockSide {
    sock: UnixStream,
    frames: FrameReader,
    raw: Arc<Mutex<RawPipes>>,
    wake: Arc<OwnedFd>,
    /// Events read and not yet returned, in order.
    pending: VecDeque<LinkEvent>,
    /// The link ended (EOF, a broken frame, an oversized one): the socket
    /// is read no more.
    ended: bool,
    /// The largest frame read (set from the output cap of each call).
    limit: u64,
    /// Dropped with this side: the pipes' thread then ends.
    _stop: OwnedFd,
}

fn lock(raw: &Mutex<RawPipes>) -> MutexGuard<'_, RawPipes> {
    raw.lock().unwrap_or_else(|e| e.into_inner())
}

impl SockSide {
    /// Reads what the socket has and turns every whole frame into events
    /// (the pipes drained before each, so its call's raw output comes
    /// first).
    fn read(&mut self) {
        if let Err(e) = self.frames.fill(&self.sock, self.limit) {
            if let ReadError::Link(e) = e {
                self.end(e);
            }
            return;
        }
        while let Some(frame) = self.frames.take(self.limit) {
            let pending = &mut self.pending;
            match frame {
                Ok(frame) => {
                    lock(&self.raw).frame_boundary(&mut |ev| pending.push_back(ev));
                    pending.push_back(LinkEvent::Frame(Ok(frame)));
                }
                Err(ReadError::Oversized { len, limit }) => {
                    let _ = self.sock.shutdown(std::net::Shutdown::Both);
                    lock(&self.raw).flush(&mut |ev| pending.push_back(ev));
                    let why = format!(
                        "the worker sent a frame of {len} bytes, over this call's limit of \
                         {limit} bytes (4 x max_output_bytes + {} MiB); it was killed",
                        bounds::FRAME_OVERHEAD_BYTES >> 20
                    );
                    pending.push_back(LinkEvent::Oversized(why.clone()));
                    pending.push_back(LinkEvent::Frame(Err(why)));
                    self.ended = true;
                    return;
                }
                Err(ReadError::Link(e)) => {
                    self.end(e);
                    return;
                }
            }
        }
    }

    /// The link ended: what the worker printed on its way out, then the end.
    fn end(&mut self, why: String) {
        let pending = &mut self.pending;
        lock(&self.raw).finish(&mut |ev| pending.push_back(ev));
        pending.push_back(LinkEvent::Frame(Err(why)));
        self.ended = true;
    }
}

impl LinkRx {
    /// A link of events only (a fake worker's, in unit tests).
    #[cfg(test)]
    pub(crate) fn channel() -> (LinkTx, LinkRx) {
        let (tx, rx) = mpsc::channel();
        (
            LinkTx { tx, wake: None },
            LinkRx {
                rx,
                sock: None,
                poll_until: None,
            },
        )
    }

    /// The link of a real worker: its socket (a clone of the one requests
    /// are written to) and its stdout and stderr pipes, whose thread it
    /// starts.
    pub(crate) fn open(
        sock: UnixStream,
        pipes: [OwnedFd; 2],
        limit: u64,
    ) -> std::io::Result<(LinkTx, LinkRx)> {
        // SAFETY: eventfd(2) returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just created and is owned here alone.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let (stop_r, stop_w) = super::pipe()?;
        let (tx, rx) = mpsc::channel();
        let tx = LinkTx {
            tx,
            wake: Some(wake.clone()),
        };
        let raw = Arc::new(Mutex::new(RawPipes::new(pipes)));
        let (thread_raw, thread_tx) = (raw.clone(), tx.clone());
        std::thread::Builder::new()
            .name("rvisor-worker-io".into())
            .spawn(move || pipes_thread(&thread_raw, &stop_r, &thread_tx))?;
        let side = SockSide {
            sock,
            frames: FrameReader::new(),
            raw,
            wake,
            pending: VecDeque::new(),
            ended: false,
            limit,
            _stop: stop_w,
        };
        Ok((
            tx,
            LinkRx {
                rx,
                sock: Some(side),
                poll_until: None,
            },
        ))
    }

    /// The largest frame read from now on.
    pub(crate) fn set_frame_limit(&mut self, limit: u64) {
        if let Some(s) = &mut self.sock {
            s.limit = limit;
        }
    }

    /// An event already there (sent, or read before), without reading the
    /// socket.
    pub(crate) fn try_recv(&mut self) -> Option<LinkEvent> {
        if let Some(ev) = self.sock.as_mut().and_then(|s| s.pending.pop_front()) {
            return Some(ev);
        }
        self.rx.try_recv().ok()
    }

    /// Until when [`LinkRx::recv_timeout`] polls the socket (yielding the
    /// CPU between polls) before it sleeps in `poll` (spin.rs). `None`:
    /// it sleeps at once.
    pub(crate) fn poll_until(&mut self, until: Option<Instant>) {
        self.poll_until = until;
    }

    /// The next event, waiting at most `wait` (`None`: as long as it takes).
    pub(crate) fn recv_timeout(
        &mut self,
        wait: Option<Duration>,
    ) -> Result<LinkEvent, RecvTimeoutError> {
        let end = wait.and_then(|w| Instant::now().checked_add(w));
        loop {
            if let Some(ev) = self.sock.as_mut().and_then(|s| s.pending.pop_front()) {
                return Ok(ev);
            }
            match self.rx.try_recv() {
                Ok(ev) => return Ok(ev),
                Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
                Err(TryRecvError::Empty) => {}
            }
            let left = end.map(|e| e.saturating_duration_since(Instant::now()));
            let side = match &mut self.sock {
                Some(s) if !s.ended => s,
                // Nothing more to read: only what other threads send.
                _ => {
                    return match left {
                        Some(l) => self.rx.recv_timeout(l),
                        None => self.rx.recv().map_err(|_| RecvTimeoutError::Disconnected),
                    }
                }
            };
            if left.is_some_and(|l| l.is_zero()) {
                return Err(RecvTimeoutError::Timeout);
            }
            let mut fds = [
                libc::pollfd {
                    fd: side.sock.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: side.wake.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // Whole milliseconds, rounded up: a deadline is never early.
            let ms = left.map_or(-1, |l| {
                i32::try_from(l.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
            });
            let polling = self.poll_until.is_some_and(|t| Instant::now() < t);
            // SAFETY: poll on two pollfds we own.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, if polling { 0 } else { ms }) };
            if n == 0 && polling {
                // SAFETY: sched_yield takes no arguments.
                unsafe { libc::sched_yield() };
                continue;
            }
            if n <= 0 {
                continue; // EINTR, or the time is up (checked above)
            }
            if fds[1].revents != 0 {
                let mut count = 0u64;
                // SAFETY: read(2) of the eventfd's 8-byte counter into a
                // local; it resets it (sends before this are in the channel).
                unsafe { libc::read(side.wake.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
            }
            if fds[0].revents != 0 {
                side.read();
            }
        }
    }
}

/// The pipes' thread: reads the worker's stdout and stderr as they fill,
/// so the worker (or a process it left behind) never blocks on a full
/// pipe, and hands them to the call loop in pieces of at most 1 MiB, the
/// rest waiting for the next frame. It ends when both pipes close or the
/// link's reading side is dropped (`stop` hangs up).
fn pipes_thread(raw: &Mutex<RawPipes>, stop: &OwnedFd, tx: &LinkTx) {
    loop {
        let mut fds = {
            let r = lock(raw);
            if !r.open.contains(&true) {
                return;
            }
            [
                pipe_pollfd(&r.pipes[0], r.open[0]),
                pipe_pollfd(&r.pipes[1], r.open[1]),
                libc::pollfd {
                    fd: stop.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ]
        };
        // SAFETY: poll on three pollfds we own (negative fds are ignored).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 3, -1) };
        if n < 0 {
            continue; // EINTR
        }
        if fds[2].revents != 0 {
            return;
        }
        let mut r = lock(raw);
        for (i, fd) in fds[..2].iter().enumerate() {
            if fd.revents != 0 {
                r.drain(i);
            }
        }
        // Hand over in pieces: the call loop keeps at most its share.
        if r.bufs[0].len() + r.bufs[1].len() > 1024 * 1024 {
            r.flush(&mut |ev| {
                let _ = tx.send(ev);
            });
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

    /// Reads `n` frames as the call loop does: what is whole first, then
    /// a read.
    fn read_frames(
        reader: &mut FrameReader,
        sock: &UnixStream,
        n: usize,
        limit: u64,
    ) -> Result<Vec<FromWorker>, String> {
        let mut got = Vec::new();
        while got.len() < n {
            match reader.take(limit) {
                Some(Ok(f)) => got.push(f),
                Some(Err(ReadError::Link(e))) => return Err(e),
                Some(Err(ReadError::Oversized { len, .. })) => return Err(format!("over: {len}")),
                None => {
                    let mut pfd = libc::pollfd {
                        fd: sock.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    };
                    // SAFETY: poll on one pollfd we own.
                    unsafe { libc::poll(&mut pfd, 1, -1) };
                    reader.fill(sock, limit).map_err(|e| match e {
                        ReadError::Link(e) => e,
                        ReadError::Oversized { .. } => unreachable!("fill does not judge sizes"),
                    })?
                }
            }
        }
        Ok(got)
    }

    #[test]
    fn frames_are_split_and_joined_however_they_arrive() {
        let (mut a, b) = UnixStream::pair().unwrap();
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
        let got = read_frames(&mut reader, &b, msgs.len(), u64::MAX).unwrap();
        writer.join().unwrap();
        assert_eq!(got, msgs);
        assert!(!reader.has_partial());
        assert_eq!(reader.buf.len(), READ_CHUNK, "back to its usual size");
    }

    #[test]
    fn an_oversized_frame_is_refused_from_its_length_and_an_end_is_told_apart() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let small = tool_call(1, serde_json::json!(1));
        let large = tool_call(2, serde_json::Value::String("y".repeat(1000)));
        a.write_all(&frame(&small)).unwrap();
        // Only the length of the large one: it is refused without its payload.
        a.write_all(&frame(&large)[..4]).unwrap();
        let mut reader = FrameReader::new();
        let got = read_frames(&mut reader, &b, 1, 500).unwrap();
        assert_eq!(got, vec![small]);
        let over = read_frames(&mut reader, &b, 1, 500).unwrap_err();
        assert!(over.starts_with("over: "), "{over}");

        // A link that ends inside a frame, and one that ends between frames.
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&frame(&large)[..10]).unwrap();
        drop(a);
        let e = read_frames(&mut FrameReader::new(), &b, 1, u64::MAX).unwrap_err();
        assert!(e.contains("inside a frame"), "{e}");
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let e = read_frames(&mut FrameReader::new(), &b, 1, u64::MAX).unwrap_err();
        assert!(e.contains("closed"), "{e}");
    }
}
