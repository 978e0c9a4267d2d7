//! `rvisor serve --nng URL`: the service over an nng REQ/REP socket, for
//! hosts that are not Rust (R with nanonext, Python with pynng, C with nng).
//!
//! The socket speaks the scalability protocols' wire format itself (no C
//! library): the SP header exchange, then length-prefixed messages (TCP:
//! 64-bit length; IPC: a type byte and a 64-bit length), and the REQ/REP
//! request-id backtrace, which a reply echoes. Each request is one JSON
//! object, the requests of `session --jsonl` plus the operations of the
//! HTTP service; each request is decoded into the service's own request
//! types and answered by the [`Service`] directly, so tenants, limits and
//! errors are those of every other surface (docs/nng.md lists the requests).

use crate::service::{ErrorCode, RunScript, Service, ServiceError, SessionRun, Surface};
use crate::tables::TableFormat;
use rvisor::CancelToken;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Where the socket listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NngUrl {
    /// `tcp://IP:PORT`
    Tcp(SocketAddr),
    /// `ipc:///absolute/path` (or `ipc://relative/path`): a Unix socket.
    Ipc(PathBuf),
}

/// An address that is not `tcp://IP:PORT` or `ipc://PATH`; the message
/// says what to write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NngUrlError(String);

impl std::str::FromStr for NngUrl {
    type Err = NngUrlError;

    fn from_str(s: &str) -> Result<Self, NngUrlError> {
        if let Some(rest) = s.strip_prefix("tcp://") {
            let rest = rest.replacen("localhost:", "127.0.0.1:", 1);
            rest.parse::<SocketAddr>().map(NngUrl::Tcp).map_err(|_| {
                NngUrlError(format!(
                    "{s:?} is not a TCP address: use tcp://IP:PORT, e.g. tcp://127.0.0.1:5555"
                ))
            })
        } else if let Some(rest) = s.strip_prefix("ipc://") {
            if rest.is_empty() {
                return Err(NngUrlError(format!(
                    "{s:?} has no path: use ipc:///path/to/socket"
                )));
            }
            Ok(NngUrl::Ipc(PathBuf::from(rest)))
        } else {
            Err(NngUrlError(format!(
                "{s:?} is not an nng address: use ipc:///path/to/socket or tcp://127.0.0.1:PORT"
            )))
        }
    }
}

impl std::fmt::Display for NngUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NngUrl::Tcp(a) => write!(f, "tcp://{a}"),
            NngUrl::Ipc(p) => write!(f, "ipc://{}", p.display()),
        }
    }
}

/// SP protocol numbers (nng's `NNG_REQ0_SELF` and `NNG_REP0_SELF`).
const PROTO_REQ: u16 = 0x30;
const PROTO_REP: u16 = 0x31;
/// Most hops a request's backtrace may carry (nng's default `maxttl`).
const MAX_HOPS: usize = 8;
/// Requests one connection may have in flight (REQ contexts); reading
/// pauses when they are all busy.
const MAX_IN_FLIGHT: usize = 64;
/// Time a peer has to send its SP header.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The 8-byte SP header: `\0SP\0`, protocol, two reserved bytes.
fn sp_header(proto: u16) -> [u8; 8] {
    let p = proto.to_be_bytes();
    [0, b'S', b'P', 0, p[0], p[1], 0, 0]
}

/// Splits a REQ message into its backtrace (the request id words, the
/// last one with its high bit set) and the body.
fn split_backtrace(msg: &[u8]) -> Option<(&[u8], &[u8])> {
    for hop in 0..MAX_HOPS {
        let end = (hop + 1) * 4;
        let word = msg.get(end - 4..end)?;
        if word[0] & 0x80 != 0 {
            return Some(msg.split_at(end));
        }
    }
    None
}

/// A message read off a connection.
enum Incoming {
    Message(Vec<u8>),
    /// Over the size limit: the body was skipped; its backtrace kept.
    TooLarge {
        backtrace: Vec<u8>,
        len: u64,
    },
}

async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
    ipc: bool,
    max: usize,
) -> std::io::Result<Option<Incoming>> {
    let mut first = [0u8; 1];
    // A clean end of stream between messages is the peer hanging up.
    if r.read(&mut first).await? == 0 {
        return Ok(None);
    }
    let mut len = [0u8; 8];
    if ipc {
        if first[0] != 1 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("unexpected IPC message type {}", first[0]),
            ));
        }
        r.read_exact(&mut len).await?;
    } else {
        len[0] = first[0];
        r.read_exact(&mut len[1..]).await?;
    }
    let len = u64::from_be_bytes(len);
    if len > max as u64 {
        // Keep the backtrace (so the peer gets an answer), skip the rest.
        let keep = len.min((MAX_HOPS * 4) as u64);
        let mut head = vec![0u8; keep as usize];
        r.read_exact(&mut head).await?;
        let skipped =
            tokio::io::copy(&mut (&mut *r).take(len - keep), &mut tokio::io::sink()).await?;
        if skipped != len - keep {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let backtrace = split_backtrace(&head)
            .map(|(b, _)| b.to_vec())
            .unwrap_or_default();
        return Ok(Some(Incoming::TooLarge { backtrace, len }));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).await?;
    Ok(Some(Incoming::Message(body)))
}

fn frame(ipc: bool, backtrace: &[u8], body: &[u8]) -> Vec<u8> {
    let len = (backtrace.len() + body.len()) as u64;
    let mut out = Vec::with_capacity(len as usize + 9);
    if ipc {
        out.push(1);
    }
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(backtrace);
    out.extend_from_slice(body);
    out
}

/// One request; the fields an operation does not use are ignored. Values
/// the service checks (timeouts, variables, plot sizes) are decoded into
/// the service's request types as given, so they get the same errors as
/// on every other surface.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NngRequest {
    #[serde(default)]
    id: Value,
    op: String,
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    session: Option<String>,
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    script: Option<String>,
    #[serde(default)]
    timeout_seconds: Option<Value>,
    #[serde(default)]
    plot_width: Option<Value>,
    #[serde(default)]
    plot_height: Option<Value>,
    #[serde(default)]
    display: Option<Value>,
    #[serde(default)]
    variables: Option<Value>,
    #[serde(default)]
    dataframes: Option<Value>,
    /// Input files of a one-shot run (`run_script`): `[{"name",
    /// "content_base64"}]`, as `POST /v1/run` takes them.
    #[serde(default)]
    files: Option<Value>,
    #[serde(default)]
    data_pointer: Option<String>,
    #[serde(default)]
    csv: Option<String>,
    #[serde(default)]
    records: Option<Value>,
    /// A file's path (`put_file`, `get_file`, `delete_file`).
    #[serde(default)]
    path: Option<String>,
    /// A file's bytes, base64 (`put_file`).
    #[serde(default)]
    content_base64: Option<String>,
    /// Package names (`install_packages`).
    #[serde(default)]
    packages: Option<Value>,
    /// Entries of a `history` page (1 to 100, default 20).
    #[serde(default)]
    limit: Option<usize>,
    /// A `history` page's cursor: the `next` of the page before.
    #[serde(default)]
    before: Option<u64>,
    /// A lockfile (`install_packages`, instead of `packages`).
    #[serde(default)]
    lockfile: Option<Value>,
}

/// What the adapter shares between connections.
struct Adapter {
    service: Service,
    max_message: usize,
}

/// `{"id": ID, "error": {"code", "message"}}` (id first, as every reply).
fn error_reply(id: &Value, code: &str, message: &str) -> Vec<u8> {
    let error = json!({"code": code, "message": message});
    format!("{{\"id\":{id},\"error\":{error}}}").into_bytes()
}

/// `{"id": ID, "KEY": VALUE}` (id first, the value's own field order kept),
/// or the error reply.
fn reply<T: Serialize>(id: &Value, key: &str, answer: Result<T, ServiceError>) -> Vec<u8> {
    let value = match answer {
        Ok(v) => v,
        Err(e) => return format!("{{\"id\":{id},\"error\":{}}}", e.to_json()).into_bytes(),
    };
    match serde_json::to_vec(&value) {
        Ok(body) => {
            let mut out = Vec::with_capacity(body.len() + key.len() + 32);
            out.extend_from_slice(format!("{{\"id\":{id},\"{key}\":").as_bytes());
            out.extend_from_slice(&body);
            out.push(b'}');
            out
        }
        Err(e) => error_reply(
            id,
            ErrorCode::Internal.as_str(),
            &format!("failed to encode the reply: {e}"),
        ),
    }
}

/// Decodes the given fields (those not given are left out) into one of the
/// service's request types; a wrong type is `invalid`, naming the field.
fn decode<T: serde::de::DeserializeOwned>(
    fields: &[(&str, Option<Value>)],
) -> Result<T, ServiceError> {
    let map: serde_json::Map<String, Value> = fields
        .iter()
        .filter_map(|(k, v)| v.clone().map(|v| (k.to_string(), v)))
        .collect();
    serde_json::from_value(Value::Object(map))
        .map_err(|e| ServiceError::invalid(format!("invalid request: {e}")))
}

/// Runs blocking service work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ServiceError> + Send + 'static,
) -> Result<T, ServiceError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(ServiceError::new(
            ErrorCode::Internal,
            format!("the request failed: {e}"),
        ))
    })
}

impl Adapter {
    /// Answers one request. `cancel` stops the call it started when the
    /// peer goes away.
    async fn handle(&self, msg: &[u8], cancel: &CancelToken) -> Vec<u8> {
        self.service.count_request(Surface::Nng);
        let req: NngRequest = match serde_json::from_slice(msg) {
            Ok(r) => r,
            Err(e) => {
                let id = serde_json::from_slice::<Value>(msg)
                    .ok()
                    .and_then(|v| v.get("id").cloned())
                    .unwrap_or(Value::Null);
                return error_reply(
                    &id,
                    "bad_request",
                    &format!("invalid request: {e}; expected e.g. {{\"id\": 1, \"op\": \"run\", \"code\": \"1+1\", \"token\": \"...\"}}"),
                );
            }
        };
        let id = &req.id;
        let tenant = match self
            .service
            .authenticate(req.token.as_deref(), "in the request's \"token\" field")
        {
            Ok(t) => t,
            Err(e) => return reply::<Value>(id, "error", Err(e)),
        };
        let missing = |field: &str| {
            error_reply(
                id,
                "bad_request",
                &format!("op {:?} needs \"{field}\"", req.op),
            )
        };
        let svc = self.service.clone();
        match req.op.as_str() {
            "health" => reply(id, "health", blocking(move || Ok(svc.health())).await),
            "packages" => reply(id, "packages", blocking(move || svc.packages()).await),
            "install_packages" => {
                let mut body = serde_json::Map::new();
                if let Some(p) = req.packages.clone() {
                    body.insert("packages".into(), p);
                }
                if let Some(l) = req.lockfile.clone() {
                    body.insert("lockfile".into(), l);
                }
                reply(
                    id,
                    "installed",
                    blocking(move || svc.install_request(&tenant, &Value::Object(body))).await,
                )
            }
            "package_lockfile" => reply(
                id,
                "lockfile",
                blocking(move || svc.package_lockfile(&tenant)).await,
            ),
            "validate" => {
                let Some(script) = req.script.clone() else {
                    return missing("script");
                };
                reply(
                    id,
                    "validation",
                    blocking(move || Ok(svc.validate(&script))).await,
                )
            }
            // A one-shot run: `run_script`, or `run` with a script and no code.
            "run_script" | "run"
                if req.op == "run_script" || (req.code.is_none() && req.script.is_some()) =>
            {
                let Some(script) = req.script.clone() else {
                    return missing("script");
                };
                let run: RunScript = match decode(&[
                    ("script", Some(Value::String(script))),
                    ("timeout_seconds", req.timeout_seconds.clone()),
                    ("variables", req.variables.clone()),
                    ("dataframes", req.dataframes.clone()),
                    ("display", req.display.clone()),
                    ("files", req.files.clone()),
                ]) {
                    Ok(r) => r,
                    Err(e) => return reply::<Value>(id, "result", Err(e)),
                };
                let cancel = cancel.clone();
                reply(
                    id,
                    "result",
                    blocking(move || svc.run_script(&tenant, run, Surface::Nng, &cancel)).await,
                )
            }
            "run" | "status" | "cancel" | "reset" | "close" | "checkpoint" | "restore"
            | "hibernate" | "files" | "put_file" | "get_file" | "delete_file" | "history" => {
                self.session_op(&req, tenant, cancel).await
            }
            "put_table" => {
                let (format, body) = match (&req.csv, &req.records) {
                    (Some(csv), None) => (TableFormat::Csv, csv.clone().into_bytes()),
                    (None, Some(records)) => (TableFormat::Json, records.to_string().into_bytes()),
                    _ => {
                        return error_reply(
                            id,
                            "bad_request",
                            "put_table needs either \"csv\" (CSV text) or \"records\" (an array of objects)",
                        )
                    }
                };
                reply(
                    id,
                    "table",
                    blocking(move || svc.put_table(&tenant, format, &body)).await,
                )
            }
            "get_table" => match req.data_pointer.as_deref() {
                None => missing("data_pointer"),
                Some(p) => reply(id, "table", svc.get_table(&tenant, p)),
            },
            "delete_table" => match req.data_pointer.as_deref() {
                None => missing("data_pointer"),
                Some(p) => reply(id, "deleted", svc.delete_table(&tenant, p).map(|()| true)),
            },
            other => error_reply(
                id,
                "bad_request",
                &format!(
                    "unknown op {other:?}; use run, status, cancel, reset, close, checkpoint, \
                     restore, hibernate, history (sessions), health, packages, validate, run_script, \
                     put_table, get_table or delete_table"
                ),
            ),
        }
    }

    /// `run` (with code), `status`, `cancel`, `reset`, `close`,
    /// `checkpoint`, `restore`, `hibernate` on the tenant's session named
    /// `session` (default `main`), made by the first `run` or `status` as in
    /// `session --jsonl`.
    async fn session_op(&self, req: &NngRequest, tenant: String, cancel: &CancelToken) -> Vec<u8> {
        let id = &req.id;
        let name = req.session.clone().unwrap_or_else(|| "main".into());
        let create = matches!(req.op.as_str(), "run" | "status" | "files" | "put_file");
        if req.op == "run" && req.code.is_none() {
            return error_reply(
                id,
                "bad_request",
                "a run request needs \"code\" (or \"script\" for a one-shot run)",
            );
        };
        let svc = &self.service;
        let sid = match svc.named_session(&tenant, &name, create) {
            Ok(Some(sid)) => sid,
            Ok(None) => {
                return error_reply(
                    id,
                    ErrorCode::UnknownSession.as_str(),
                    &format!("no session named {name:?}; a run creates it"),
                )
            }
            Err(e) => return reply::<Value>(id, "status", Err(e)),
        };
        match req.op.as_str() {
            "run" => {
                let run: SessionRun = match decode(&[
                    ("code", req.code.clone().map(Value::String)),
                    ("timeout_seconds", req.timeout_seconds.clone()),
                    ("plot_width", req.plot_width.clone()),
                    ("plot_height", req.plot_height.clone()),
                    ("display", req.display.clone()),
                ]) {
                    Ok(r) => r,
                    Err(e) => return reply::<Value>(id, "result", Err(e)),
                };
                // Admission may wait for an idle session to hibernate.
                let queued = {
                    let (svc, tenant, sid) = (svc.clone(), tenant.clone(), sid.clone());
                    blocking(move || svc.session_run(&tenant, &sid, &run)).await
                };
                match queued {
                    Ok(call) => {
                        let token = call.cancel_token();
                        cancel.on_cancel(move || token.cancel());
                        let r = call.finish().await;
                        match svc.handed_off(&r) {
                            Some(e) => reply::<Value>(id, "result", Err(e)),
                            None => reply(id, "result", Ok(r)),
                        }
                    }
                    Err(e) => reply::<Value>(id, "result", Err(e)),
                }
            }
            "status" => reply(id, "status", svc.session_status(&tenant, &sid)),
            "cancel" => reply(id, "status", svc.cancel(&tenant, &sid)),
            "reset" => reply(id, "status", svc.reset(&tenant, &sid)),
            // Taken after the running call: off the connection's task, so
            // the peer's other requests (a cancel) are answered meanwhile.
            "checkpoint" => {
                let svc = svc.clone();
                reply(
                    id,
                    "checkpoint",
                    blocking(move || svc.checkpoint(&tenant, &sid)).await,
                )
            }
            "restore" => reply(id, "status", svc.restore(&tenant, &sid)),
            "hibernate" => reply(id, "status", svc.hibernate(&tenant, &sid)),
            "history" => {
                let svc = svc.clone();
                let (limit, before) = (req.limit, req.before);
                reply(
                    id,
                    "history",
                    blocking(move || svc.history(&tenant, &sid, limit, before)).await,
                )
            }
            // Small files inline as base64 (docs/files.md); blocking file
            // system work off the connection's task.
            "files" | "put_file" | "get_file" | "delete_file" => {
                let (svc, op) = (svc.clone(), req.op.clone());
                let (path, content) = (req.path.clone(), req.content_base64.clone());
                let answer = blocking(move || {
                    let path = || {
                        path.clone().ok_or_else(|| {
                            ServiceError::bad_request(format!("{op} needs \"path\""))
                        })
                    };
                    match op.as_str() {
                        "files" => svc
                            .session_files(&tenant, &sid)
                            .map(|f| serde_json::to_value(f).unwrap_or_default()),
                        "put_file" => path().and_then(|p| {
                            svc.put_file_inline(&tenant, &sid, &p, content.as_deref().unwrap_or(""))
                                .map(|f| serde_json::to_value(f).unwrap_or_default())
                        }),
                        "get_file" => path().and_then(|p| svc.get_file_inline(&tenant, &sid, &p)),
                        _ => path().and_then(|p| {
                            svc.delete_session_file(&tenant, &sid, &p)
                                .map(|()| Value::String(p))
                        }),
                    }
                })
                .await;
                let key = match req.op.as_str() {
                    "files" => "files",
                    "delete_file" => "deleted",
                    _ => "file",
                };
                reply(id, key, answer)
            }
            // close: answer with the closed session's status, as jsonl does.
            _ => reply(id, "status", svc.close(&tenant, &sid)),
        }
    }
}

/// The last time a connection showed life: a byte from its peer, or a
/// reply of it sent.
#[derive(Debug)]
struct Activity(std::sync::Mutex<std::time::Instant>);

impl Activity {
    fn touch(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = std::time::Instant::now();
    }

    fn last(&self) -> std::time::Instant {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves once the connection has had no byte from its peer for
    /// `idle` while none of its requests is in flight (all `slots` free).
    async fn idle(&self, slots: &tokio::sync::Semaphore, idle: Duration) {
        loop {
            let at = self.last() + idle;
            if std::time::Instant::now() < at {
                tokio::time::sleep_until(at.into()).await;
            } else if slots.available_permits() == MAX_IN_FLIGHT {
                return;
            } else {
                // A request is running; its reply touches the activity.
                tokio::time::sleep(idle).await;
            }
        }
    }
}

/// A reader that records its peer's [`Activity`].
struct Watched<R> {
    inner: R,
    activity: Arc<Activity>,
}

impl<R: AsyncRead + Unpin> AsyncRead for Watched<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

/// Aborts a task when dropped: a connection closed from outside (the
/// shutdown deadline) takes its writer, and so its socket, with it.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves one connection: SP header exchange, then requests answered as
/// they finish (several may be in flight with REQ contexts). It closes
/// when the peer hangs up, after `idle` without a byte from the peer and
/// with nothing in flight, or at shutdown once its requests are answered.
async fn connection<S>(
    svc: Arc<Adapter>,
    stream: S,
    ipc: bool,
    idle: Duration,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (rd, mut wr) = tokio::io::split(stream);
    let activity = Arc::new(Activity(std::sync::Mutex::new(std::time::Instant::now())));
    let mut rd = Watched {
        inner: rd,
        activity: activity.clone(),
    };
    wr.write_all(&sp_header(PROTO_REP)).await?;
    let mut head = [0u8; 8];
    tokio::time::timeout(HANDSHAKE_TIMEOUT, rd.read_exact(&mut head))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no SP header"))??;
    if head[..4] != [0, b'S', b'P', 0] || head[6..] != [0, 0] {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the peer is not an nng/SP socket",
        ));
    }
    let proto = u16::from_be_bytes([head[4], head[5]]);
    if proto != PROTO_REQ {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("the peer speaks SP protocol {proto:#x}; this is a REP socket: connect with REQ (0x30)"),
        ));
    }
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(MAX_IN_FLIGHT);
    let mut writer = AbortOnDrop(tokio::spawn(async move {
        while let Some(buf) = rx.recv().await {
            if wr.write_all(&buf).await.is_err() {
                break;
            }
        }
    }));
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    // The calls of the requests in flight, cancelled if the peer leaves
    // before they are answered (nobody would read the answers).
    let pending: Arc<std::sync::Mutex<HashMap<u64, CancelToken>>> = Arc::default();
    let mut next_request = 0u64;
    let mut peer_left = false;
    let result = loop {
        // At shutdown no new request is read; those in flight finish and
        // are answered before the connection closes.
        let read = tokio::select! {
            m = read_message(&mut rd, ipc, svc.max_message) => m,
            _ = crate::listen::stopped(&mut shutdown) => break Ok(()),
            _ = activity.idle(&slots, idle) => break Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("idle for {} s with no request in flight", idle.as_secs_f64()),
            )),
        };
        let msg = match read {
            Ok(Some(m)) => m,
            Ok(None) => {
                peer_left = true;
                break Ok(());
            }
            Err(e) => {
                peer_left = true;
                break Err(e);
            }
        };
        let (backtrace, body) = match msg {
            Incoming::TooLarge { backtrace, len } => {
                if backtrace.is_empty() {
                    continue;
                }
                let reply = error_reply(
                    &Value::Null,
                    "too_large",
                    &format!(
                        "request of {len} bytes is over the limit of {} bytes; upload big tables with put_table in parts or over HTTP",
                        svc.max_message
                    ),
                );
                let _ = tx.send(frame(ipc, &backtrace, &reply)).await;
                continue;
            }
            Incoming::Message(m) => match split_backtrace(&m) {
                // nng drops a request without a valid backtrace; so do we.
                None => continue,
                Some((bt, body)) => (bt.to_vec(), body.to_vec()),
            },
        };
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break Ok(());
        };
        let svc = svc.clone();
        let tx = tx.clone();
        let activity = activity.clone();
        let cancel = CancelToken::new();
        let key = next_request;
        next_request += 1;
        lock(&pending).insert(key, cancel.clone());
        let pending = pending.clone();
        tokio::spawn(async move {
            let reply = svc.handle(&body, &cancel).await;
            lock(&pending).remove(&key);
            let _ = tx.send(frame(ipc, &backtrace, &reply)).await;
            // The idle time of the connection counts from its last reply.
            activity.touch();
            drop(permit);
        });
    };
    if peer_left {
        for (_, c) in lock(&pending).drain() {
            c.cancel();
        }
    }
    drop(tx);
    let _ = (&mut writer.0).await;
    result
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A bound nng listener.
#[derive(Debug)]
pub struct Listener {
    url: NngUrl,
    inner: ListenerKind,
}

#[derive(Debug)]
enum ListenerKind {
    Tcp(tokio::net::TcpListener),
    Ipc(tokio::net::UnixListener),
}

impl Listener {
    /// Binds `url`. A stale IPC socket file (nobody listening) is replaced;
    /// a live one is an error.
    pub async fn bind(url: &NngUrl) -> std::io::Result<Listener> {
        let inner = match url {
            NngUrl::Tcp(addr) => ListenerKind::Tcp(tokio::net::TcpListener::bind(addr).await?),
            NngUrl::Ipc(path) => {
                if path.exists() {
                    if tokio::net::UnixStream::connect(path).await.is_ok() {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::AddrInUse,
                            format!("{} is in use by another server", path.display()),
                        ));
                    }
                    std::fs::remove_file(path)?;
                }
                ListenerKind::Ipc(tokio::net::UnixListener::bind(path)?)
            }
        };
        let url = match (&inner, url) {
            (ListenerKind::Tcp(l), _) => NngUrl::Tcp(l.local_addr()?),
            (_, u) => u.clone(),
        };
        Ok(Listener { url, inner })
    }

    /// The address bound (with the real port for `tcp://...:0`).
    pub fn url(&self) -> &NngUrl {
        &self.url
    }

    /// Accepts connections until `shutdown` turns true, within the caps of
    /// `limits` (over them a connection is closed at once, before the SP
    /// header); then stops accepting, lets the requests in flight finish
    /// and be answered for at most `limits.shutdown_grace`, closes what is
    /// left and returns (dropping the listener removes an IPC socket file).
    pub async fn run(
        self,
        service: Service,
        max_message: usize,
        limits: crate::listen::ConnectionLimits,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let svc = Arc::new(Adapter {
            service,
            max_message,
        });
        let gate = crate::listen::Gate::new("nng", &limits);
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let accept = async {
                match &self.inner {
                    ListenerKind::Tcp(l) => l.accept().await.map(|(s, peer)| {
                        let _ = s.set_nodelay(true);
                        (Box::new(s) as Box<dyn Stream>, false, Some(peer.ip()))
                    }),
                    ListenerKind::Ipc(l) => l
                        .accept()
                        .await
                        .map(|(s, _)| (Box::new(s) as Box<dyn Stream>, true, None)),
                }
            };
            let accepted = tokio::select! {
                a = accept => a,
                _ = crate::listen::stopped(&mut shutdown) => break,
            };
            match accepted {
                // Over the caps the stream is dropped here: closed.
                Ok((s, ipc, peer)) => {
                    if let Ok(permit) = gate.admit(peer) {
                        let conn = connection(
                            svc.clone(),
                            s,
                            ipc,
                            limits.nng_idle_timeout,
                            shutdown.clone(),
                        );
                        connections.spawn(async move {
                            log_end(conn).await;
                            drop(permit);
                        });
                    }
                }
                Err(e) => crate::listen::accept_failed("nng", &e).await,
            }
            // Forget connections that ended.
            while connections.try_join_next().is_some() {}
        }
        let left = crate::listen::drain(&mut connections, limits.shutdown_grace).await;
        if left > 0 {
            tracing::warn!(
                target: "rvisor::nng",
                connections = left,
                grace_secs = limits.shutdown_grace.as_secs_f64(),
                "requests still running after the shutdown grace period: their connections were closed"
            );
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let NngUrl::Ipc(p) = &self.url {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A TCP or Unix stream.
trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

async fn log_end(f: impl std::future::Future<Output = std::io::Result<()>>) {
    if let Err(e) = f.await {
        tracing::info!(target: "rvisor::nng", error = %e, "connection closed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_or_say_what_to_write() {
        assert_eq!(
            "tcp://127.0.0.1:5555".parse::<NngUrl>(),
            Ok(NngUrl::Tcp("127.0.0.1:5555".parse().unwrap()))
        );
        assert_eq!(
            "tcp://localhost:7".parse::<NngUrl>(),
            Ok(NngUrl::Tcp("127.0.0.1:7".parse().unwrap()))
        );
        assert_eq!(
            "ipc:///tmp/r.sock".parse::<NngUrl>(),
            Ok(NngUrl::Ipc("/tmp/r.sock".into()))
        );
        for bad in ["", "tcp://", "tcp://host", "ipc://", "http://x", "/tmp/x"] {
            let e = bad.parse::<NngUrl>().unwrap_err().to_string();
            assert!(e.contains("ipc://") || e.contains("tcp://"), "{bad}: {e}");
        }
    }

    #[test]
    fn backtraces_end_at_the_word_with_the_high_bit() {
        let msg = [0x80, 0, 0, 7, b'{', b'}'];
        assert_eq!(split_backtrace(&msg), Some((&msg[..4], &msg[4..])));
        // Two hops (a device in between).
        let msg = [0, 0, 0, 1, 0x80, 0, 0, 9, b'x'];
        assert_eq!(split_backtrace(&msg), Some((&msg[..8], &msg[8..])));
        // Too short, or too many hops: dropped.
        assert_eq!(split_backtrace(&[0x80, 0]), None);
        assert_eq!(split_backtrace(&[0u8; 40]), None);
    }

    #[test]
    fn replies_put_the_id_first_and_carry_service_errors() {
        let id = json!(7);
        let ok = reply(&id, "status", Ok(json!({"state": "idle"})));
        assert!(
            ok.starts_with(b"{\"id\":7,"),
            "{}",
            String::from_utf8_lossy(&ok)
        );
        assert_eq!(
            serde_json::from_slice::<Value>(&ok).unwrap(),
            json!({"id": 7, "status": {"state": "idle"}})
        );
        let err = reply::<Value>(&json!("a"), "result", Err(ServiceError::invalid("m")));
        assert_eq!(
            serde_json::from_slice::<Value>(&err).unwrap(),
            json!({"id": "a", "error": {"code": "invalid", "message": "m"}})
        );
    }

    #[test]
    fn fields_decode_into_the_service_types_or_name_what_is_wrong() {
        let r: SessionRun = decode(&[("code", Some(json!("1"))), ("plot_width", None)]).unwrap();
        assert_eq!(r.code, "1");
        assert_eq!(r.plot_width, None);
        let e = decode::<SessionRun>(&[
            ("code", Some(json!("1"))),
            ("plot_width", Some(json!("wide"))),
        ])
        .unwrap_err();
        assert_eq!(e.code, ErrorCode::Invalid);
        assert!(e.message.contains("invalid request"), "{}", e.message);
        let r: SessionRun = decode(&[
            ("code", Some(json!("1"))),
            (
                "display",
                Some(json!({"max_rows": 3, "plot_format": "svg"})),
            ),
        ])
        .unwrap();
        let d = r.display.unwrap();
        assert_eq!(d.max_rows, Some(3));
        assert_eq!(d.plot_format, Some(rvisor::PlotFormat::Svg));
        let e = decode::<SessionRun>(&[
            ("code", Some(json!("1"))),
            ("display", Some(json!({"rows": 3}))),
        ])
        .unwrap_err();
        assert!(e.message.contains("rows"), "{}", e.message);
    }

    #[tokio::test]
    async fn an_oversize_message_is_skipped_with_its_backtrace_kept() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        let big = vec![b'x'; 5000];
        let mut msg = frame(false, &[0x80, 0, 0, 3], &big);
        msg.extend(frame(false, &[0x80, 0, 0, 4], b"{}"));
        a.write_all(&msg).await.unwrap();
        drop(a);
        match read_message(&mut b, false, 1024).await.unwrap() {
            Some(Incoming::TooLarge { backtrace, len }) => {
                assert_eq!(backtrace, [0x80, 0, 0, 3]);
                assert_eq!(len, 5004);
            }
            _ => panic!("expected an oversize message"),
        }
        // The stream stays in step: the next message reads whole.
        match read_message(&mut b, false, 1024).await.unwrap() {
            Some(Incoming::Message(m)) => assert_eq!(m, [0x80, 0, 0, 4, b'{', b'}']),
            _ => panic!("expected the next message"),
        }
        assert!(read_message(&mut b, false, 1024).await.unwrap().is_none());
    }

    #[test]
    fn frames_carry_the_length_and_the_ipc_type_byte() {
        let f = frame(false, &[0x80, 0, 0, 1], b"ab");
        assert_eq!(&f[..8], &6u64.to_be_bytes());
        assert_eq!(&f[8..], &[0x80, 0, 0, 1, b'a', b'b']);
        let f = frame(true, &[0x80, 0, 0, 1], b"ab");
        assert_eq!(f[0], 1);
        assert_eq!(&f[1..9], &6u64.to_be_bytes());
    }
}
