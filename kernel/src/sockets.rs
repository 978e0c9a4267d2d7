//! The five sockets: bound from the connection file, iopub shared by the
//! shell and control threads, the heartbeat echoed on a thread of its own.

use crate::connection::ConnectionInfo;
use crate::error::KernelError;
use crate::wire::{Message, Signer};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Largest message accepted on any socket: code is capped at 256 KiB
/// (`rvisor::MAX_CODE_BYTES`), so this leaves room for JSON and buffers.
const MAX_MESSAGE_BYTES: i64 = 16 << 20;

/// How often a waiting thread looks at the stop flag, ms.
pub(crate) const POLL_MS: i64 = 100;

/// Makes a socket of `kind` bound to `port`.
pub(crate) fn bind(
    ctx: &zmq::Context,
    kind: zmq::SocketType,
    name: &'static str,
    conn: &ConnectionInfo,
    port: u16,
) -> Result<zmq::Socket, KernelError> {
    let endpoint = conn.endpoint(port);
    let fail = |e: zmq::Error| KernelError::Socket {
        socket: name,
        endpoint: endpoint.clone(),
        why: e.to_string(),
    };
    let s = ctx.socket(kind).map_err(fail)?;
    s.set_maxmsgsize(MAX_MESSAGE_BYTES).map_err(fail)?;
    s.set_linger(1000).map_err(fail)?;
    s.bind(&endpoint).map_err(fail)?;
    Ok(s)
}

/// Receives one message from `s` if one comes within [`POLL_MS`]:
/// `Ok(None)` on a quiet spell (the caller checks its stop flag).
pub(crate) fn recv(
    s: &zmq::Socket,
    name: &'static str,
    timeout_ms: i64,
) -> Result<Option<Vec<Vec<u8>>>, KernelError> {
    let io = |e: zmq::Error| KernelError::Io {
        what: "receive",
        socket: name,
        why: e.to_string(),
    };
    let mut items = [s.as_poll_item(zmq::POLLIN)];
    let n = zmq::poll(&mut items, timeout_ms).map_err(io)?;
    if n == 0 {
        return Ok(None);
    }
    s.recv_multipart(0).map(Some).map_err(io)
}

/// Sends `m` on `s`, signed; a failure is reported on stderr (a front
/// end that went away must not stop the kernel).
pub(crate) fn send(s: &zmq::Socket, name: &str, m: &Message, signer: &Signer) {
    if let Err(e) = s.send_multipart(m.encode(signer), 0) {
        eprintln!(
            "rvisor kernel: failed to send {} on {name}: {e}",
            m.msg_type()
        );
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

/// Echoes heartbeats on `sock` until `stop` is set.
pub(crate) fn heartbeat(sock: zmq::Socket, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match recv(&sock, "hb", POLL_MS) {
            Ok(Some(frames)) => {
                if let Err(e) = sock.send_multipart(frames, 0) {
                    eprintln!("rvisor kernel: failed to echo a heartbeat: {e}");
                }
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("rvisor kernel: {e}");
                return;
            }
        }
    }
}
