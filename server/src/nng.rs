//! `rvisor serve --nng URL`: the service over an nng REQ/REP socket, for
//! hosts that are not Rust (R with nanonext, Python with pynng, C with nng).
//!
//! The socket speaks the scalability protocols' wire format itself (no C
//! library): the SP header exchange, then length-prefixed messages (TCP:
//! 64-bit length; IPC: a type byte and a 64-bit length), and the REQ/REP
//! request-id backtrace, which a reply echoes. Each request is one JSON
//! object, the requests of `session --jsonl` plus the operations of the
//! HTTP service; every request is answered by handing it to the HTTP
//! router in-process, so tenants, limits and errors are the HTTP service's
//! own (docs/nng.md lists the requests).

use crate::http::Shared;
use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tower::ServiceExt;

/// Where the socket listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NngUrl {
    /// `tcp://IP:PORT`
    Tcp(SocketAddr),
    /// `ipc:///absolute/path` (or `ipc://relative/path`): a Unix socket.
    Ipc(PathBuf),
}

impl std::str::FromStr for NngUrl {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("tcp://") {
            let rest = rest.replacen("localhost:", "127.0.0.1:", 1);
            rest.parse::<SocketAddr>().map(NngUrl::Tcp).map_err(|_| {
                format!("{s:?} is not a TCP address: use tcp://IP:PORT, e.g. tcp://127.0.0.1:5555")
            })
        } else if let Some(rest) = s.strip_prefix("ipc://") {
            if rest.is_empty() {
                return Err(format!("{s:?} has no path: use ipc:///path/to/socket"));
            }
            Ok(NngUrl::Ipc(PathBuf::from(rest)))
        } else {
            Err(format!(
                "{s:?} is not an nng address: use ipc:///path/to/socket or tcp://127.0.0.1:PORT"
            ))
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
/// the HTTP service checks (timeouts, variables, plot sizes) pass through
/// as given, so they get the HTTP service's errors.
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
    variables: Option<Value>,
    #[serde(default)]
    dataframes: Option<Value>,
    #[serde(default)]
    data_pointer: Option<String>,
    #[serde(default)]
    csv: Option<String>,
    #[serde(default)]
    records: Option<Value>,
}

/// What the adapter shares between connections.
struct Service {
    router: Router,
    state: Shared,
    /// (tenant, session name) -> session id of the HTTP service.
    sessions: tokio::sync::Mutex<HashMap<(String, String), String>>,
    max_message: usize,
}

/// `{"id": ID, "error": {"code", "message"}}` (id first, as every reply).
fn error_reply(id: &Value, code: &str, message: &str) -> Vec<u8> {
    let error = json!({"code": code, "message": message});
    format!("{{\"id\":{id},\"error\":{error}}}").into_bytes()
}

/// `{"id": ID, "KEY": BODY}` built around the router's JSON bytes (field
/// order kept); an error body `{"error": ...}` becomes `{"id": ID, "error": ...}`.
fn wrap(id: &Value, key: &str, status: StatusCode, body: &[u8]) -> Vec<u8> {
    let id = id.to_string();
    if status.is_success() {
        let mut out = Vec::with_capacity(body.len() + id.len() + key.len() + 16);
        out.extend_from_slice(b"{\"id\":");
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(format!(",\"{key}\":").as_bytes());
        out.extend_from_slice(body);
        out.push(b'}');
        return out;
    }
    match body.strip_prefix(b"{") {
        Some(rest) if body.starts_with(b"{\"error\"") => {
            let mut out = Vec::with_capacity(body.len() + id.len() + 8);
            out.extend_from_slice(b"{\"id\":");
            out.extend_from_slice(id.as_bytes());
            out.push(b',');
            out.extend_from_slice(rest);
            out
        }
        _ => error_reply(
            &serde_json::from_str(&id).unwrap_or(Value::Null),
            "internal",
            &format!("the service answered {status} without an error body"),
        ),
    }
}

/// Drops the fields that were not given, so the HTTP service sees exactly
/// what the client sent.
fn body_of(fields: &[(&str, Option<Value>)]) -> Vec<u8> {
    let map: serde_json::Map<String, Value> = fields
        .iter()
        .filter_map(|(k, v)| v.clone().map(|v| (k.to_string(), v)))
        .collect();
    Value::Object(map).to_string().into_bytes()
}

impl Service {
    /// One request through the HTTP router.
    async fn http(
        &self,
        method: Method,
        uri: &str,
        token: Option<&str>,
        content_type: &str,
        body: Vec<u8>,
    ) -> (StatusCode, Vec<u8>) {
        let mut req = Request::builder()
            .method(method)
            .uri(uri)
            .header(header::CONTENT_TYPE, content_type);
        if let Some(t) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let req = match req.body(Body::from(body)) {
            Ok(r) => r,
            Err(e) => {
                return (
                    StatusCode::BAD_REQUEST,
                    json!({"error": {"code": "bad_request", "message": format!("cannot form the request: {e}")}})
                        .to_string()
                        .into_bytes(),
                )
            }
        };
        let res = match self.router.clone().oneshot(req).await {
            Ok(r) => r,
            Err(e) => match e {},
        };
        let status = res.status();
        let bytes = axum::body::to_bytes(res.into_body(), usize::MAX)
            .await
            .map(|b| b.to_vec())
            .unwrap_or_default();
        (status, bytes)
    }

    /// The session id for `name`, made on first use when `create`.
    async fn session_id(
        &self,
        tenant: &str,
        name: &str,
        token: Option<&str>,
        create: bool,
    ) -> Result<Option<String>, (StatusCode, Vec<u8>)> {
        let mut map = self.sessions.lock().await;
        let key = (tenant.to_string(), name.to_string());
        if let Some(id) = map.get(&key) {
            // Closed through HTTP meanwhile? Then it is gone here too.
            if crate::http::find_session(&self.state, tenant, id).is_ok() {
                return Ok(Some(id.clone()));
            }
            map.remove(&key);
        }
        if !create {
            return Ok(None);
        }
        let (status, body) = self
            .http(
                Method::POST,
                "/v1/sessions",
                token,
                "application/json",
                Vec::new(),
            )
            .await;
        if !status.is_success() {
            return Err((status, body));
        }
        let id = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v["id"].as_str().map(String::from))
            .unwrap_or_default();
        map.insert(key, id.clone());
        Ok(Some(id))
    }

    async fn handle(&self, msg: &[u8]) -> Vec<u8> {
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
        let token = req.token.as_deref();
        let json_ct = "application/json";
        let missing = |field: &str| {
            error_reply(
                id,
                "bad_request",
                &format!("op {:?} needs \"{field}\"", req.op),
            )
        };
        match req.op.as_str() {
            "health" => {
                let (s, b) = self
                    .http(Method::GET, "/v1/health", token, json_ct, Vec::new())
                    .await;
                wrap(id, "health", s, &b)
            }
            "packages" => {
                let (s, b) = self
                    .http(Method::GET, "/v1/packages", token, json_ct, Vec::new())
                    .await;
                if s.is_success() {
                    let list = serde_json::from_slice::<Value>(&b)
                        .map(|v| v["packages"].to_string())
                        .unwrap_or_default();
                    wrap(id, "packages", s, list.as_bytes())
                } else {
                    wrap(id, "packages", s, &b)
                }
            }
            "validate" => {
                let Some(script) = req.script.clone() else {
                    return missing("script");
                };
                let body = body_of(&[("script", Some(Value::String(script)))]);
                let (s, b) = self
                    .http(Method::POST, "/v1/validate", token, json_ct, body)
                    .await;
                wrap(id, "validation", s, &b)
            }
            // A one-shot run: `run_script`, or `run` with a script and no code.
            "run_script" | "run"
                if req.op == "run_script" || (req.code.is_none() && req.script.is_some()) =>
            {
                let Some(script) = req.script.clone() else {
                    return missing("script");
                };
                let body = body_of(&[
                    ("script", Some(Value::String(script))),
                    ("timeout_seconds", req.timeout_seconds.clone()),
                    ("variables", req.variables.clone()),
                    ("dataframes", req.dataframes.clone()),
                ]);
                let (s, b) = self
                    .http(Method::POST, "/v1/run", token, json_ct, body)
                    .await;
                wrap(id, "result", s, &b)
            }
            "run" | "status" | "cancel" | "reset" | "close" => self.session_op(&req).await,
            "put_table" => {
                let (ct, body) = match (&req.csv, &req.records) {
                    (Some(csv), None) => ("text/csv", csv.clone().into_bytes()),
                    (None, Some(records)) => ("application/json", records.to_string().into_bytes()),
                    _ => {
                        return error_reply(
                            id,
                            "bad_request",
                            "put_table needs either \"csv\" (CSV text) or \"records\" (an array of objects)",
                        )
                    }
                };
                let (s, b) = self.http(Method::POST, "/v1/tables", token, ct, body).await;
                wrap(id, "table", s, &b)
            }
            "get_table" | "delete_table" => {
                let Some(p) = req.data_pointer.as_deref() else {
                    return missing("data_pointer");
                };
                let uri = format!("/v1/tables/{}", percent_path(p));
                if req.op == "get_table" {
                    let (s, b) = self
                        .http(Method::GET, &uri, token, json_ct, Vec::new())
                        .await;
                    wrap(id, "table", s, &b)
                } else {
                    let (s, b) = self
                        .http(Method::DELETE, &uri, token, json_ct, Vec::new())
                        .await;
                    wrap(id, "deleted", s, if s.is_success() { b"true" } else { &b })
                }
            }
            other => error_reply(
                id,
                "bad_request",
                &format!(
                    "unknown op {other:?}; use run, status, cancel, reset, close (sessions), \
                     health, packages, validate, run_script, put_table, get_table or delete_table"
                ),
            ),
        }
    }

    /// `run` (with code), `status`, `cancel`, `reset`, `close` on the
    /// tenant's session named `session` (default `main`), made by the first
    /// `run` or `status` as in `session --jsonl`.
    async fn session_op(&self, req: &NngRequest) -> Vec<u8> {
        let id = &req.id;
        let token = req.token.as_deref();
        let Some(tenant) = crate::http::tenant_for(&self.state.cfg.tokens, token) else {
            return error_reply(
                id,
                "unauthorized",
                "send a valid token in the request's \"token\" field",
            );
        };
        let name = req.session.clone().unwrap_or_else(|| "main".into());
        let create = matches!(req.op.as_str(), "run" | "status");
        if req.op == "run" && req.code.is_none() {
            return error_reply(
                id,
                "bad_request",
                "a run request needs \"code\" (or \"script\" for a one-shot run)",
            );
        }
        let sid = match self.session_id(&tenant, &name, token, create).await {
            Ok(Some(sid)) => sid,
            Ok(None) => {
                return error_reply(
                    id,
                    "unknown_session",
                    &format!("no session named {name:?}; a run creates it"),
                )
            }
            Err((s, b)) => return wrap(id, "status", s, &b),
        };
        let json_ct = "application/json";
        match req.op.as_str() {
            "run" => {
                let body = body_of(&[
                    ("code", req.code.clone().map(Value::String)),
                    ("timeout_seconds", req.timeout_seconds.clone()),
                    ("plot_width", req.plot_width.clone()),
                    ("plot_height", req.plot_height.clone()),
                ]);
                let uri = format!("/v1/sessions/{sid}/run");
                let (s, b) = self.http(Method::POST, &uri, token, json_ct, body).await;
                wrap(id, "result", s, &b)
            }
            "status" => {
                let uri = format!("/v1/sessions/{sid}");
                let (s, b) = self
                    .http(Method::GET, &uri, token, json_ct, Vec::new())
                    .await;
                wrap(id, "status", s, &b)
            }
            "cancel" | "reset" => {
                let uri = format!("/v1/sessions/{sid}/{}", req.op);
                let (s, b) = self
                    .http(Method::POST, &uri, token, json_ct, Vec::new())
                    .await;
                wrap(id, "status", s, &b)
            }
            _ => {
                // close: answer with the closed session's status, as jsonl does.
                let session = crate::http::find_session(&self.state, &tenant, &sid).ok();
                let uri = format!("/v1/sessions/{sid}");
                let (s, b) = self
                    .http(Method::DELETE, &uri, token, json_ct, Vec::new())
                    .await;
                // Forget the name only if it still means this session: a
                // `run` racing this close may already have made a new one
                // under the name, which must stay reachable (and closable).
                let key = (tenant, name);
                let mut map = self.sessions.lock().await;
                if map.get(&key) == Some(&sid) {
                    map.remove(&key);
                }
                drop(map);
                match (s.is_success(), session) {
                    (true, Some((session, _))) => {
                        let status = serde_json::to_vec(&session.status()).unwrap_or_default();
                        wrap(id, "status", s, &status)
                    }
                    _ => wrap(id, "status", s, &b),
                }
            }
        }
    }
}

/// Escapes a data pointer for a URL path segment (pointers are plain
/// tokens; anything else simply fails to resolve).
fn percent_path(p: &str) -> String {
    p.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Serves one connection: SP header exchange, then requests answered as
/// they finish (several may be in flight with REQ contexts).
async fn connection<S>(
    svc: Arc<Service>,
    stream: S,
    ipc: bool,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(stream);
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
    let writer = tokio::spawn(async move {
        while let Some(buf) = rx.recv().await {
            if wr.write_all(&buf).await.is_err() {
                break;
            }
        }
    });
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    let result = loop {
        // At shutdown no new request is read; those in flight finish and
        // are answered before the connection closes.
        let read = tokio::select! {
            m = read_message(&mut rd, ipc, svc.max_message) => m,
            _ = shutdown.wait_for(|stop| *stop) => break Ok(()),
        };
        let msg = match read {
            Ok(Some(m)) => m,
            Ok(None) => break Ok(()),
            Err(e) => break Err(e),
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
        tokio::spawn(async move {
            let reply = svc.handle(&body).await;
            let _ = tx.send(frame(ipc, &backtrace, &reply)).await;
            drop(permit);
        });
    };
    drop(tx);
    let _ = writer.await;
    result
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

    /// Accepts connections until the task is dropped.
    /// Accepts connections until `shutdown` turns true; then stops
    /// accepting, lets the requests in flight finish and be answered, and
    /// returns (dropping the listener removes an IPC socket file).
    pub(crate) async fn run(
        self,
        router: Router,
        state: Shared,
        max_message: usize,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) {
        let svc = Arc::new(Service {
            router,
            state,
            sessions: tokio::sync::Mutex::new(HashMap::new()),
            max_message,
        });
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let accept = async {
                match &self.inner {
                    ListenerKind::Tcp(l) => l.accept().await.map(|(s, _)| {
                        let _ = s.set_nodelay(true);
                        (Box::new(s) as Box<dyn Stream>, false)
                    }),
                    ListenerKind::Ipc(l) => l
                        .accept()
                        .await
                        .map(|(s, _)| (Box::new(s) as Box<dyn Stream>, true)),
                }
            };
            let accepted = tokio::select! {
                a = accept => a,
                _ = shutdown.wait_for(|stop| *stop) => break,
            };
            match accepted {
                Ok((s, ipc)) => {
                    connections.spawn(log_end(connection(svc.clone(), s, ipc, shutdown.clone())));
                }
                Err(e) => {
                    tracing::warn!(target: "rvisor::nng", error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            // Forget connections that ended.
            while connections.try_join_next().is_some() {}
        }
        while connections.join_next().await.is_some() {}
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
            let e = bad.parse::<NngUrl>().unwrap_err();
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
    fn replies_wrap_the_service_json_and_keep_the_id() {
        let id = json!(7);
        let ok = wrap(&id, "status", StatusCode::OK, br#"{"state":"idle"}"#);
        assert_eq!(
            serde_json::from_slice::<Value>(&ok).unwrap(),
            json!({"id": 7, "status": {"state": "idle"}})
        );
        let err = wrap(
            &json!("a"),
            "result",
            StatusCode::UNPROCESSABLE_ENTITY,
            br#"{"error":{"code":"invalid","message":"m"}}"#,
        );
        assert_eq!(
            serde_json::from_slice::<Value>(&err).unwrap(),
            json!({"id": "a", "error": {"code": "invalid", "message": "m"}})
        );
        let odd = wrap(&id, "x", StatusCode::BAD_GATEWAY, b"");
        assert_eq!(
            serde_json::from_slice::<Value>(&odd).unwrap()["error"]["code"],
            "internal"
        );
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
