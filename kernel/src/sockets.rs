//! The five sockets: bound from the connection file, iopub shared by the
//! shell and control threads, the heartbeat echoed on a thread of its own.

use crate::connection::ConnectionInfo;
use crate::error::KernelError;
use crate::wire::{Message, Signer};
use crate::Control;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

/// Largest message accepted on any socket: code is capped at 256 KiB
/// (`rvisor::MAX_CODE_BYTES`), so this leaves room for JSON and buffers.
const MAX_MESSAGE_BYTES: i64 = 16 << 20;

/// How often a waiting thread looks at the stop flag, ms.
pub(crate) const POLL_MS: i64 = 100;

/// Makes a socket of `kind` bound to `port`: on `listener` when one was
/// bound for it before (crate::listeners), else on a port libzmq binds.
pub(crate) fn bind(
    ctx: &zmq::Context,
    kind: zmq::SocketType,
    name: &'static str,
    conn: &ConnectionInfo,
    port: u16,
    listener: Option<std::os::fd::OwnedFd>,
) -> Result<zmq::Socket, KernelError> {
    let endpoint = conn.endpoint(port);
    let fail = |e: zmq::Error| KernelError::Socket {
        socket: name,
        endpoint: endpoint.clone(),
        why: e.to_string(),
    };
    let mut s = ctx.socket(kind).map_err(fail)?;
    s.set_maxmsgsize(MAX_MESSAGE_BYTES).map_err(fail)?;
    s.set_linger(1000).map_err(fail)?;
    if let Some(fd) = listener {
        crate::listeners::adopt(&mut s, fd).map_err(fail)?;
    }
    s.bind(&endpoint).map_err(fail)?;
    Ok(s)
}

/// The iopub socket: an XPUB, so subscriptions are seen and welcomed (JEP
/// 65), verbose so that every subscriber's is (libzmq passes only the
/// first of a topic otherwise); to its subscribers it is a PUB.
pub(crate) fn bind_iopub(
    ctx: &zmq::Context,
    conn: &ConnectionInfo,
    listener: Option<std::os::fd::OwnedFd>,
) -> Result<zmq::Socket, KernelError> {
    let s = bind(ctx, zmq::XPUB, "iopub", conn, conn.iopub_port, listener)?;
    s.set_xpub_verbose(true).map_err(|e| KernelError::Socket {
        socket: "iopub",
        endpoint: conn.endpoint(conn.iopub_port),
        why: e.to_string(),
    })?;
    Ok(s)
}

/// Receives one message from `s` if one comes within `timeout_ms`:
/// `Ok(None)` on a quiet spell, or at once when `wake` (the kernel's stop,
/// [`crate::Control`]) is readable: the caller checks its stop flag.
pub(crate) fn recv(
    s: &zmq::Socket,
    name: &'static str,
    timeout_ms: i64,
    wake: Option<std::os::fd::RawFd>,
) -> Result<Option<Vec<Vec<u8>>>, KernelError> {
    let io = |e: zmq::Error| KernelError::Io {
        what: "receive",
        socket: name,
        why: e.to_string(),
    };
    let mut items = vec![s.as_poll_item(zmq::POLLIN)];
    if let Some(fd) = wake {
        items.push(zmq::PollItem::from_fd(fd, zmq::POLLIN));
    }
    let n = zmq::poll(&mut items, timeout_ms).map_err(io)?;
    if n == 0 || !items[0].is_readable() {
        return Ok(None);
    }
    s.recv_multipart(0).map(Some).map_err(io)
}

/// Sends `m` on `s`, signed; a failure is reported on stderr (a front
/// end that went away must not stop the kernel).
pub(crate) fn send(s: &zmq::Socket, name: &str, m: &Message, signer: &Signer) {
    if let Err(e) = s.send_multipart(m.encode(signer), 0) {
        crate::log::say(&format!(
            "rvisor kernel: failed to send {} on {name}: {e}",
            m.msg_type()
        ));
    }
}

/// The iopub socket, shared by the shell and control threads.
#[derive(Clone)]
pub struct Iopub {
    sock: Arc<Mutex<zmq::Socket>>,
    signer: Signer,
}

impl std::fmt::Debug for Iopub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Iopub")
    }
}

impl Iopub {
    pub(crate) fn new(sock: zmq::Socket, signer: Signer) -> Self {
        Self {
            sock: Arc::new(Mutex::new(sock)),
            signer,
        }
    }

    /// Broadcasts `msg_type` with `content`, caused by `parent`.
    pub fn send(&self, parent: &Message, msg_type: &str, content: Value) {
        let m = parent.broadcast(msg_type, content);
        let s = self.sock.lock().unwrap_or_else(|p| p.into_inner());
        send(&s, "iopub", &m, &self.signer);
        self.welcome(&s);
    }

    /// Answers each new subscription waiting on the XPUB socket with an
    /// `iopub_welcome` (JEP 65: a client knows it is subscribed, and
    /// misses no message, once it has its welcome).
    fn welcome(&self, s: &zmq::Socket) {
        while let Ok(frame) = s.recv_bytes(zmq::DONTWAIT) {
            // 1 then the topic: a subscription; 0: one that ended.
            let Some((1, topic)) = frame.split_first() else {
                continue;
            };
            let none = Message {
                ids: vec![],
                header: json!({}),
                parent_header: json!({}),
                metadata: json!({}),
                content: json!({}),
                buffers: vec![],
            };
            let mut m = none.broadcast(
                "iopub_welcome",
                json!({"subscription": String::from_utf8_lossy(topic)}),
            );
            m.parent_header = json!({});
            m.ids = vec![topic.to_vec()];
            send(s, "iopub", &m, &self.signer);
        }
    }

    /// Welcomes subscribers until `stop` is set: woken by the socket's
    /// descriptor (libzmq's edge-triggered notice that its state changed),
    /// and at least every [`POLL_MS`] (a notice taken by a send of another
    /// thread, which welcomes under the same lock anyway).
    pub(crate) fn welcome_loop(&self, control: &Control) {
        let fd = {
            let s = self.sock.lock().unwrap_or_else(|p| p.into_inner());
            s.get_fd().ok()
        };
        let wake = control.wake_fd().unwrap_or(-1);
        while !control.stopped() {
            if let Some(fd) = fd {
                // A negative descriptor is ignored by poll(2).
                let mut pfd = [fd, wake].map(|fd| libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                });
                // SAFETY: poll on two pollfds we own; libzmq keeps its
                // descriptor open while the socket lives (it does until
                // this loop has ended: the socket is dropped after), and
                // the wake pipe lives as long as `control`.
                unsafe { libc::poll(pfd.as_mut_ptr(), 2, POLL_MS as i32) };
            } else {
                std::thread::sleep(std::time::Duration::from_millis(POLL_MS as u64));
            }
            let s = self.sock.lock().unwrap_or_else(|p| p.into_inner());
            self.welcome(&s);
        }
    }

    /// `status` `busy` or `idle` for `parent`.
    pub fn status(&self, parent: &Message, state: &str) {
        self.send(parent, "status", json!({"execution_state": state}));
    }

    /// A `stream` message (`stdout` or `stderr`).
    pub fn stream(&self, parent: &Message, name: &str, text: &str) {
        if !text.is_empty() {
            self.send(parent, "stream", json!({"name": name, "text": text}));
        }
    }
}

/// Echoes heartbeats on `sock` until `control` is stopped.
pub(crate) fn heartbeat(sock: zmq::Socket, control: &Control) {
    while !control.stopped() {
        match recv(&sock, "hb", POLL_MS, control.wake_fd()) {
            Ok(Some(frames)) => {
                if let Err(e) = sock.send_multipart(frames, 0) {
                    crate::log::say(&format!("rvisor kernel: failed to echo a heartbeat: {e}"));
                }
            }
            Ok(None) => {}
            Err(e) => {
                crate::log::say(&format!("rvisor kernel: {e}"));
                return;
            }
        }
    }
}
