//! `rvisor serve`: the HTTP/JSON surface for agent platforms (CONTRACT.md).
//!
//! A thin adapter: every handler decodes its request, calls the
//! [`Service`] (health, packages, validate, one-shot runs, sessions,
//! tables) and encodes the answer; errors get the status of their code
//! (`ErrorCode::http_status`). Tenants come from bearer tokens; a session belongs to the tenant that made it and
//! is invisible to others (another tenant's id answers like an unknown one).

use crate::service::{
    ErrorCode, NewSession, RunScript, Service, ServiceConfig, ServiceError, SessionRun, Surface,
};
use crate::tables::TableFormat;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, MatchedPath, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use rvisor::{CancelOnDrop, CancelToken, RunResult, Supervisor};
use serde_json::json;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Instant;

mod console;
mod files;
mod history;
mod openapi;
mod packages;
mod watch;
pub use openapi::{
    document, openapi_json, service_document, CHECKPOINT_OPERATIONS, OPERATION_ERRORS,
    SESSION_LOOKUP, UNAUTHENTICATED,
};

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to listen on (default 127.0.0.1:8787).
    pub listen: SocketAddr,
    /// Bearer token -> tenant; `None` serves one local tenant without auth.
    pub tokens: Option<HashMap<String, String>>,
    /// Tenants whose tokens may read the server-wide `/metrics`.
    pub operators: Vec<String>,
    /// Sessions one tenant may hold open (one more: 429 `quota`).
    pub max_sessions_per_tenant: usize,
    /// Sessions of all tenants together.
    pub max_sessions: usize,
    /// Live sessions, calls per tenant, the workers' memory budget.
    pub admission: crate::admission::AdmissionConfig,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Largest table upload, in bytes.
    pub max_table_bytes: usize,
    /// Where tables are stored, their lifetime and quotas.
    pub tables: crate::tables::TableConfig,
    /// Also serve the same operations on an nng REQ/REP socket.
    pub nng: Option<crate::nng::NngUrl>,
    /// Connection caps, timeouts and the shutdown deadline of both
    /// listeners (defaults in [`crate::listen::ConnectionLimits`]).
    pub connections: crate::listen::ConnectionLimits,
    /// At SIGTERM: how long calls in flight get to finish while the node
    /// drains (still serving its sessions) before the listeners stop.
    /// `None`: the shutdown grace (`connections.shutdown_grace`), so one
    /// knob bounds a SIGTERM unless the two are set apart
    /// ([`ServeConfig::drain_grace()`]).
    pub drain_grace: Option<std::time::Duration>,
    /// Where sessions are kept durable (see
    /// [`crate::service::ServiceConfig::durable`]); its checkpoint store
    /// must be the supervisor's.
    pub durable: Option<std::sync::Arc<crate::durable::SessionStore>>,
    /// With `durable`: sessions unused this long are deleted.
    pub session_ttl: Option<std::time::Duration>,
    /// Bytes of streamed events (SSE, JSON lines) that may wait for slow
    /// clients, per stream and per tenant.
    pub streams: crate::service::StreamConfig,
    /// The byte and count quotas of session files and artifacts.
    pub files: rvisor::file_rules::FileLimits,
    /// Packages on demand (docs/packages.md): the installer of tenant
    /// libraries; `None`, installing is off.
    pub packages: Option<std::sync::Arc<rvisor_packages::Installer>>,
    /// How much history each session keeps (docs/console.md).
    pub history: crate::service::HistoryLimits,
}

impl ServeConfig {
    /// The drain grace in effect: the one set, else the shutdown grace.
    pub fn drain_grace(&self) -> std::time::Duration {
        self.drain_grace.unwrap_or(self.connections.shutdown_grace)
    }
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
            tokens: None,
            operators: Vec::new(),
            max_sessions_per_tenant: 32,
            max_sessions: 512,
            admission: crate::admission::AdmissionConfig::default(),
            max_body_bytes: 4 * 1024 * 1024,
            max_table_bytes: 256 * 1024 * 1024,
            tables: crate::tables::TableConfig::default(),
            drain_grace: None,
            nng: None,
            connections: crate::listen::ConnectionLimits::default(),
            durable: None,
            session_ttl: Some(crate::service::DEFAULT_SESSION_TTL),
            streams: crate::service::StreamConfig::default(),
            files: rvisor::file_rules::FileLimits::default(),
            packages: None,
            history: crate::service::HistoryLimits::default(),
        }
    }
}

/// What is wrong with a token file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenFileError {
    /// A token shorter than 16 characters.
    #[error("line {line}: tokens must be at least 16 characters")]
    ShortToken {
        /// 1-based.
        line: usize,
    },
    /// A line that is not `TOKEN TENANT`.
    #[error("line {line}: expected `TOKEN TENANT`")]
    Line {
        /// 1-based.
        line: usize,
    },
    /// No token at all.
    #[error("the token file has no tokens")]
    Empty,
}

/// Reads a token file: one `TOKEN TENANT` pair per line; `#` starts a
/// comment.
pub fn read_tokens(text: &str) -> Result<HashMap<String, String>, TokenFileError> {
    let mut map = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        match (parts.next(), parts.next(), parts.next()) {
            (Some(token), Some(tenant), None) if token.len() >= 16 => {
                map.insert(token.to_string(), tenant.to_string());
            }
            (Some(_), Some(_), None) => return Err(TokenFileError::ShortToken { line: n + 1 }),
            _ => return Err(TokenFileError::Line { line: n + 1 }),
        }
    }
    if map.is_empty() {
        return Err(TokenFileError::Empty);
    }
    Ok(map)
}

/// An error as the wire shows it: `{"error": {"code", "message"}}` with the
/// status of its code (`ErrorCode::http_status`, the one mapping).
#[derive(Debug)]
pub struct ApiError(ServiceError);

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        Self(e)
    }
}

impl ApiError {
    fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self(ServiceError::new(code, message))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0.code.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut res = (status, Json(json!({ "error": self.0.to_json() }))).into_response();
        if let Some(s) = self.0.retry_after_seconds {
            res.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from(s));
        } else if matches!(self.0.code, ErrorCode::Busy | ErrorCode::Draining) {
            res.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        // 401 and 413 are answered before the body is read; say that the
        // connection closes, or a keep-alive client sees a silent EOF.
        if matches!(
            status,
            StatusCode::UNAUTHORIZED | StatusCode::PAYLOAD_TOO_LARGE
        ) {
            res.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
        }
        res
    }
}

/// The error shape of every failure (for the OpenAPI document).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    error: ErrorDetail,
}

/// `code` is stable (e.g. `invalid`, `not_found`, `queue_full`); `message`
/// says what went wrong and what to do.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorDetail {
    code: String,
    message: String,
    /// With `quota` and `busy` from admission control: seconds until a
    /// retry may succeed (also the `Retry-After` header).
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_seconds: Option<u64>,
    /// More about some errors: with `package`, `reason` (the step that
    /// failed), `package`, `rule`, `log` (docs/packages.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    details: Option<serde_json::Value>,
}

#[utoipa::path(get, path = "/v1/openapi.json", tag = "operations", responses((status = 200, description = "This document (OpenAPI 3), as this server answers", content_type = "application/json", body = Object)))]
async fn openapi(State(st): State<Handlers>) -> Response {
    let doc = service_document(&st.service);
    (
        [(header::CONTENT_TYPE, "application/json")],
        serde_json::to_string_pretty(&doc).unwrap_or_default(),
    )
        .into_response()
}

/// A JSON object body whose rejections are `ApiError`s: malformed JSON is
/// 400, wrong types (or not an object) 422 naming the field, an oversize
/// body 413.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let limit = req
            .extensions()
            .get::<BodyTimeout>()
            .map_or(std::time::Duration::from_secs(30), |t| t.0);
        // A length announced over the limit is refused before the body is
        // read (the client may still be sending it; the answer closes).
        let max = req.extensions().get::<BodyLimit>().map(|l| l.0);
        let announced = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if let (Some(max), Some(n)) = (max, announced) {
            if n > max as u64 {
                return Err(ApiError::new(
                    ErrorCode::TooLarge,
                    format!("the request body is {n} bytes, over the limit of {max} bytes"),
                ));
            }
        }
        let read = Json::<crate::service::objects::Object<T>>::from_request(req, state);
        // A body that trickles in holds its connection: it gets a bound.
        let Ok(read) = tokio::time::timeout(limit, read).await else {
            return Err(body_timeout(limit));
        };
        match read {
            Ok(Json(v)) => Ok(ApiJson(v.0)),
            Err(JsonRejection::JsonDataError(e)) => {
                Err(ApiError::new(ErrorCode::Invalid, e.body_text()))
            }
            Err(JsonRejection::JsonSyntaxError(e)) => {
                Err(ApiError::new(ErrorCode::BadRequest, e.body_text()))
            }
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::new(
                ErrorCode::BadRequest,
                "send a JSON body with Content-Type: application/json",
            )),
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError::new(ErrorCode::TooLarge, e.body_text()))
            }
            Err(e) => Err(ApiError::new(ErrorCode::BadRequest, e.body_text())),
        }
    }
}

/// A path parameter whose rejection (e.g. percent-encoding that is not
/// UTF-8) is an `ApiError`: 400 in the JSON error shape, where axum's own
/// answer is plain text.
#[derive(Debug)]
pub struct ApiPath(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for ApiPath {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(ApiPath(v)),
            Err(e) => Err(ApiError::new(
                ErrorCode::BadRequest,
                format!(
                    "{}; send the id as it was given (percent-encoded UTF-8)",
                    e.body_text()
                ),
            )),
        }
    }
}

/// What the handlers share.
#[derive(Clone)]
struct Handlers {
    service: Service,
    /// Largest table upload, in bytes.
    max_table_bytes: usize,
    /// Largest request body elsewhere, in bytes.
    max_body_bytes: usize,
    /// How long a body may take (see `ConnectionLimits::body_timeout`).
    body_timeout: std::time::Duration,
}

/// The body time bound, for extractors that do not see [`Handlers`].
#[derive(Debug, Clone, Copy)]
struct BodyTimeout(std::time::Duration);

/// The JSON body limit, for extractors that do not see [`Handlers`].
#[derive(Debug, Clone, Copy)]
struct BodyLimit(usize);

/// The tenant of the request (set by the auth layer).
#[derive(Debug, Clone)]
struct Tenant(String);

/// One structured log line per request (tracing): method, path, status,
/// latency, tenant.
async fn log_requests(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let t = Instant::now();
    let res = next.run(req).await;
    let tenant = res
        .extensions()
        .get::<Tenant>()
        .map(|t| t.0.clone())
        .unwrap_or_default();
    tracing::info!(
        target: "rvisor::http",
        %method,
        path,
        status = res.status().as_u16(),
        ms = t.elapsed().as_secs_f64() * 1000.0,
        tenant,
        "request"
    );
    res
}

/// The bearer check, around every route: a request whose route is one of
/// [`UNAUTHENTICATED`] goes through without a token (with a valid one it
/// is still the token's tenant's), every other one needs a valid token
/// when the server has tokens, else it is answered 401 before its body
/// is read. A request that matches no route needs one too (an unknown
/// path answers 401, not 404, to a caller without a token).
async fn auth(State(st): State<Handlers>, mut req: Request, next: Next) -> Response {
    st.service.count_request(Surface::Http);
    let open = req
        .extensions()
        .get::<MatchedPath>()
        .is_some_and(|p| UNAUTHENTICATED.contains(&p.as_str()));
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let tenant = match st
        .service
        .authenticate(given, "as `Authorization: Bearer <token>`")
    {
        Ok(t) => Some(t),
        Err(_) if open => None,
        Err(e) => return ApiError(e).into_response(),
    };
    if let Some(t) = &tenant {
        req.extensions_mut().insert(Tenant(t.clone()));
    }
    req.extensions_mut().insert(BodyTimeout(st.body_timeout));
    req.extensions_mut().insert(BodyLimit(st.max_body_bytes));
    let mut res = next.run(req).await;
    if let Some(t) = tenant {
        res.extensions_mut().insert(Tenant(t));
    }
    res
}

fn wants_html(h: &HeaderMap) -> bool {
    h.get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/html"))
}

fn result_response(h: &HeaderMap, r: RunResult) -> Response {
    if wants_html(h) {
        Html(rvisor::html::render(&r)).into_response()
    } else {
        Json(r).into_response()
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("the handler failed: {e}")))
}

#[utoipa::path(get, path = "/v1/health", tag = "operations", responses((status = 200, description = "Liveness, versions, the live safety rules, workers (a `sessions` count is added)", body = rvisor::ops::Health)))]
async fn health(State(st): State<Handlers>) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    Ok(Json(blocking(move || svc.health()).await?).into_response())
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ValidateBody {
    script: String,
}

#[utoipa::path(post, path = "/v1/validate", tag = "operations", request_body = ValidateBody, responses((status = 200, description = "Problems and style notes; nothing runs", body = rvisor::ops::Validation)))]
async fn validate(
    State(st): State<Handlers>,
    ApiJson(b): ApiJson<ValidateBody>,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let v = blocking(move || svc.validate(&b.script)).await?;
    Ok(Json(v).into_response())
}

#[utoipa::path(post, path = "/v1/run", tag = "operations", request_body = RunScript, responses((status = 200, description = "A RunResult (outcome `rejected` with `validation` when the script fails validation); `Accept: text/html` gives an HTML fragment", body = rvisor_protocol::RunResult)))]
async fn run(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    headers: HeaderMap,
    ApiJson(b): ApiJson<RunScript>,
) -> Result<Response, ApiError> {
    if let Some(format) = crate::live::Format::wanted(&headers) {
        return run_streaming(st, tenant, b, format).await;
    }
    let svc = st.service.clone();
    // A client that closes its connection drops this future: the run is
    // then cancelled instead of running to its timeout.
    let cancel = CancelToken::new();
    let guard = CancelOnDrop::new(cancel.clone());
    let r = blocking(move || svc.run_script(&tenant, b, Surface::Http, &cancel)).await;
    guard.disarm();
    Ok(result_response(&headers, r??))
}

/// `/v1/run` streamed: the run's events as they happen. A request the
/// service refuses (nothing ran) is an ordinary error response: the
/// answer starts once the first event (or the result) is there.
async fn run_streaming(
    st: Handlers,
    tenant: String,
    b: RunScript,
    format: crate::live::Format,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let (feed, events) = svc.event_feed(&tenant);
    let cancel = CancelToken::new();
    // Dropped with this future or the body: the run is cancelled.
    let mut events = crate::service::ServiceEvents::of_run(events, cancel.clone());
    let mut task = tokio::task::spawn_blocking(move || {
        svc.run_script_streaming(&tenant, b, Surface::Http, &cancel, &feed)
            .map(|_| ())
    });
    tokio::select! {
        first = events.next() => match first {
            Some(e) => events.put_back(e),
            // The feed was dropped without a result: the request was
            // refused; the task says why.
            None => {
                (&mut task).await.map_err(|e| ApiError::new(ErrorCode::Internal, format!("the handler failed: {e}")))??;
            }
        },
        done = &mut task => {
            done.map_err(|e| ApiError::new(ErrorCode::Internal, format!("the handler failed: {e}")))??;
        }
    }
    Ok(crate::live::response(events, format))
}

#[utoipa::path(post, path = "/v1/sessions", tag = "sessions", request_body(content = Option<NewSession>, description = "Optional session options: no body, an empty one or `null` mean the defaults"), responses((status = 201, description = "The new session", body = rvisor::SessionStatus)))]
async fn create_session(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    // Read here, with the body limit and a time bound, so that a body over
    // the limit (or one that cannot be read) is answered as a JSON error like
    // every other endpoint.
    let read = axum::body::to_bytes(body, st.max_body_bytes);
    let Ok(read) = tokio::time::timeout(st.body_timeout, read).await else {
        return Err(body_timeout(st.body_timeout));
    };
    let body = read.map_err(|e| {
        let too_large = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
        if too_large {
            ApiError::new(
                ErrorCode::TooLarge,
                format!(
                    "the request body is over the limit of {} bytes",
                    st.max_body_bytes
                ),
            )
        } else {
            ApiError::new(
                ErrorCode::BadRequest,
                format!("the request body could not be read: {e}"),
            )
        }
    })?;
    // The body is optional: none, an empty one or `null` mean default
    // options (the OpenAPI schema is `NewSession` or null).
    let b: NewSession = if body.iter().all(u8::is_ascii_whitespace) {
        NewSession::default()
    } else {
        serde_json::from_slice::<Option<crate::service::objects::Object<NewSession>>>(&body)
            .map(|b| b.map(|b| b.0).unwrap_or_default())
            .map_err(|e| {
                if e.is_data() {
                    ApiError::new(ErrorCode::Invalid, format!("invalid session options: {e}"))
                } else {
                    ApiError::new(ErrorCode::BadRequest, format!("malformed JSON: {e}"))
                }
            })?
    };
    let status = st.service.create_session(&tenant, b)?;
    Ok((StatusCode::CREATED, Json(status)).into_response())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/run", tag = "sessions", params(("id" = String, Path, description = "session id")), request_body = SessionRun, responses((status = 200, description = "A RunResult; `Accept: text/html` gives an HTML fragment", body = rvisor_protocol::RunResult)))]
async fn session_run(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(id): ApiPath,
    headers: HeaderMap,
    ApiJson(b): ApiJson<SessionRun>,
) -> Result<Response, ApiError> {
    // Queueing may read the store (a session resumed from it), wait for a
    // worker to be released, or (admission) wait for an idle session to
    // hibernate: off the async threads.
    let svc = st.service.clone();
    if let Some(format) = crate::live::Format::wanted(&headers) {
        let call = blocking(move || svc.session_run_streaming(&tenant, &id, &b)).await??;
        return Ok(crate::live::response(call.events(), format));
    }
    let service = svc.clone();
    let call = blocking(move || svc.session_run(&tenant, &id, &b)).await??;
    let r = call.finish().await;
    if let Some(e) = service.handed_off(&r) {
        return Err(e.into());
    }
    Ok(result_response(&headers, r))
}

#[utoipa::path(get, path = "/v1/sessions/{id}", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, description = "The session's status", body = rvisor::SessionStatus)))]
async fn session_status(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(id): ApiPath,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    Ok(Json(blocking(move || svc.session_status(&tenant, &id)).await??).into_response())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/cancel", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, description = "Cancelled: the running call and the queue; the status after", body = rvisor::SessionStatus)))]
async fn session_cancel(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(id): ApiPath,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    Ok(Json(blocking(move || svc.cancel(&tenant, &id)).await??).into_response())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/reset", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, description = "Started over with a fresh worker; the status after", body = rvisor::SessionStatus)))]
async fn session_reset(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(id): ApiPath,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    Ok(Json(blocking(move || svc.reset(&tenant, &id)).await??).into_response())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/checkpoint", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, description = "Checkpointed (after the running call) into the server's state directory: the key, the bytes stored, whether it was written (false: nothing ran since the last one) and its manifest", body = rvisor::checkpoint::CheckpointInfo)))]
async fn session_checkpoint(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(id): ApiPath,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let info = blocking(move || svc.checkpoint(&tenant, &id)).await??;
    Ok(Json(info).into_response())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/hibernate", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, description = "Hibernates the session once it is idle (after the running call): checkpointed, worker released, state `hibernated`; the next run restores it (`session.restored.reason` `hibernated`). The status when asked", body = rvisor::SessionStatus)))]
async fn session_hibernate(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(id): ApiPath,
) -> Result<Response, ApiError> {
    Ok(Json(st.service.hibernate(&tenant, &id)?).into_response())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/restore", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, description = "Rolled back to the session's last checkpoint: the running call is cancelled, queued calls are not executed, and the next run starts from the checkpoint (`session.restored.reason` `restore`); the status after", body = rvisor::SessionStatus)))]
async fn session_restore(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(id): ApiPath,
) -> Result<Response, ApiError> {
    Ok(Json(st.service.restore(&tenant, &id)?).into_response())
}

#[utoipa::path(delete, path = "/v1/sessions/{id}", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 204, description = "Closed")))]
async fn session_delete(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(id): ApiPath,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    blocking(move || svc.close(&tenant, &id)).await??;
    Ok(StatusCode::NO_CONTENT.into_response())
}

fn body_timeout(t: std::time::Duration) -> ApiError {
    ApiError::new(
        ErrorCode::BadRequest,
        format!(
            "the request body did not arrive within {} s; send it without pauses",
            t.as_secs_f64()
        ),
    )
}

/// The table format named by a content type.
fn table_format(content_type: &str) -> Result<TableFormat, ServiceError> {
    if content_type.starts_with("text/csv") {
        Ok(TableFormat::Csv)
    } else if content_type.starts_with("application/json") {
        Ok(TableFormat::Json)
    } else if content_type.starts_with("application/vnd.apache.arrow.stream") {
        Ok(TableFormat::ArrowStream)
    } else {
        Err(ServiceError::bad_request(
            "send the table as text/csv, application/json (an array of records) or application/vnd.apache.arrow.stream",
        ))
    }
}

#[utoipa::path(post, path = "/v1/tables", tag = "tables", request_body(content = String, description = "CSV (text/csv), a JSON array of records (application/json) or an Arrow IPC stream (application/vnd.apache.arrow.stream)"), responses((status = 201, description = "The stored table", body = crate::tables::TableMeta)))]
async fn table_create(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let format = table_format(ct)?;
    // An announced length over the limit is refused before anything is read.
    let announced = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = announced.filter(|n| *n > st.max_table_bytes as u64) {
        return Err(ApiError::new(
            ErrorCode::TooLarge,
            format!(
                "the upload is {n} bytes, over the limit of {} bytes; send a smaller table",
                st.max_table_bytes
            ),
        ));
    }
    // The body goes to a file as it arrives (never whole in memory), and
    // the conversion reads it from there in batches.
    let spool = Spool(st.service.spool_path());
    receive(body, &spool.0, st.max_table_bytes, st.body_timeout).await?;
    let svc = st.service.clone();
    let path = spool.0.clone();
    let meta = blocking(move || svc.put_table_file(&tenant, format, &path)).await??;
    Ok((StatusCode::CREATED, Json(meta)).into_response())
}

/// An upload's spool file, removed when the request ends.
struct Spool(std::path::PathBuf);

impl Drop for Spool {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Writes `body` to `path`, refusing it (413) as soon as it passes `max`
/// bytes and (400) when it sends nothing for `idle`.
async fn receive(
    body: axum::body::Body,
    path: &std::path::Path,
    max: usize,
    idle: std::time::Duration,
) -> Result<(), ApiError> {
    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;
    let storage = |e: std::io::Error| {
        ApiError::new(
            ErrorCode::Storage,
            format!("failed to store the upload: {e}"),
        )
    };
    let mut file = tokio::fs::File::create(path).await.map_err(storage)?;
    let mut body = body;
    let mut got = 0usize;
    loop {
        let frame = match tokio::time::timeout(idle, body.frame()).await {
            Err(_) => {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    format!(
                        "the upload sent nothing for {} s; send the body without pauses",
                        idle.as_secs_f64()
                    ),
                ))
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    format!("the upload could not be read: {e}"),
                ))
            }
            Ok(Some(Ok(f))) => f,
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        got += data.len();
        if got > max {
            return Err(ApiError::new(
                ErrorCode::TooLarge,
                format!("the upload is over the limit of {max} bytes; send a smaller table"),
            ));
        }
        file.write_all(&data).await.map_err(storage)?;
    }
    file.flush().await.map_err(storage)?;
    Ok(())
}

#[utoipa::path(get, path = "/v1/tables/{pointer}", tag = "tables", params(("pointer" = String, Path, description = "data pointer")), responses((status = 200, description = "The table's metadata", body = crate::tables::TableMeta)))]
async fn table_get(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(p): ApiPath,
) -> Result<Response, ApiError> {
    Ok(Json(st.service.get_table(&tenant, &p)?).into_response())
}

#[utoipa::path(delete, path = "/v1/tables/{pointer}", tag = "tables", params(("pointer" = String, Path, description = "data pointer")), responses((status = 204, description = "Deleted")))]
async fn table_delete(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(p): ApiPath,
) -> Result<Response, ApiError> {
    st.service.delete_table(&tenant, &p)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

#[utoipa::path(get, path = "/metrics", tag = "operations", responses((status = 200, description = "Prometheus text: every tenant's calls and sessions, so with tokens only an operator's token reads it (`rvisor serve --operator TENANT`)", content_type = "text/plain", body = String)))]
async fn metrics(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
) -> Result<Response, ApiError> {
    let text = st.service.metrics_for(&tenant)?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

#[utoipa::path(get, path = "/v1/usage", tag = "operations", responses((status = 200, description = "The caller's own use: open sessions, stored tables, calls by outcome and their CPU and wall time since the server started", body = crate::service::UsageReport)))]
async fn usage(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
) -> Response {
    Json(st.service.usage(&tenant)).into_response()
}

#[utoipa::path(get, path = "/livez", tag = "operations", responses((status = 200, description = "The process is alive (no token needed; for an orchestrator's liveness probe)", body = Object)))]
async fn livez() -> Response {
    Json(json!({"status": "alive"})).into_response()
}

#[utoipa::path(get, path = "/readyz", tag = "operations", responses(
    (status = 200, description = "The node takes new work: workers can be made, the shared store answers, it is not draining (no token needed; for a readiness probe and a router)", body = crate::service::Readiness),
    (status = 503, description = "The node takes no new work now; `reasons` says why", body = crate::service::Readiness)
))]
async fn readyz(State(st): State<Handlers>) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let r = blocking(move || svc.readiness()).await?;
    let status = if r.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    Ok((status, Json(r)).into_response())
}

#[utoipa::path(post, path = "/v1/admin/drain", tag = "operations", responses((status = 200, description = "The node drains: readiness goes false, new sessions and one-shot runs get 503 `draining`, existing sessions keep answering (an operator's token: `rvisor serve --operator TENANT`)", body = crate::service::DrainStatus)))]
async fn admin_drain(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
) -> Result<Response, ApiError> {
    Ok(Json(st.service.drain_for(&tenant)?).into_response())
}

async fn not_found() -> ApiError {
    ServiceError::not_found("route").into()
}

async fn wrong_method() -> ApiError {
    ApiError::new(
        ErrorCode::MethodNotAllowed,
        "this path does not take that method; see CONTRACT.md for the routes",
    )
}

/// The service `cfg` describes, over `sup`.
pub fn service(sup: Supervisor, cfg: &ServeConfig) -> std::io::Result<Service> {
    Service::new(
        sup,
        ServiceConfig {
            tokens: cfg.tokens.clone(),
            tables: cfg.tables.clone(),
            operators: cfg.operators.clone(),
            max_sessions_per_tenant: cfg.max_sessions_per_tenant,
            max_sessions: cfg.max_sessions,
            admission: cfg.admission.clone(),
            durable: cfg.durable.clone(),
            session_ttl: cfg.session_ttl,
            streams: cfg.streams.clone(),
            files: cfg.files,
            packages: cfg.packages.clone(),
            history: cfg.history,
        },
    )
}

/// The router, for tests and for `serve`.
pub fn router(sup: Supervisor, cfg: ServeConfig) -> std::io::Result<Router> {
    Ok(routes(service(sup, &cfg)?, &cfg))
}

/// The HTTP routes over `service`, with `cfg`'s body limits.
pub fn routes(service: Service, cfg: &ServeConfig) -> Router {
    let st = Handlers {
        service,
        max_table_bytes: cfg.max_table_bytes,
        max_body_bytes: cfg.max_body_bytes,
        body_timeout: cfg.connections.body_timeout,
    };
    // Table uploads get their own (larger) body limit.
    let uploads = Router::new()
        .route("/v1/tables", post(table_create))
        .layer(DefaultBodyLimit::max(cfg.max_table_bytes));
    // File uploads stream to the file and count their own bytes against
    // the file quotas (`Service::begin_upload`).
    let files = Router::new()
        .route(
            "/v1/sessions/{id}/files/{*path}",
            put(files::file_put)
                .get(files::file_get)
                .delete(files::file_delete),
        )
        .layer(DefaultBodyLimit::disable());
    let rest = Router::new()
        .route("/v1/health", get(health))
        .route("/v1/sessions/{id}/files", get(files::files_list))
        .route(
            "/v1/artifacts/{execution_id}/{*name}",
            get(files::artifact_get),
        )
        .route("/v1/packages", get(packages::packages))
        .route("/v1/packages/install", post(packages::packages_install))
        .route("/v1/packages/lockfile", get(packages::packages_lockfile))
        .route("/v1/validate", post(validate))
        .route("/v1/run", post(run))
        .route(
            "/v1/sessions",
            post(create_session).get(history::sessions_list),
        )
        .route("/v1/sessions/{id}/history", get(history::session_history))
        .route("/v1/sessions/{id}/watch", get(watch::session_watch))
        .route("/v1/admin/stats", get(history::admin_stats))
        .route(
            "/v1/sessions/{id}",
            get(session_status).delete(session_delete),
        )
        .route("/v1/sessions/{id}/run", post(session_run))
        .route("/v1/sessions/{id}/cancel", post(session_cancel))
        .route("/v1/sessions/{id}/reset", post(session_reset))
        .route("/v1/sessions/{id}/checkpoint", post(session_checkpoint))
        .route("/v1/sessions/{id}/hibernate", post(session_hibernate))
        .route("/v1/sessions/{id}/restore", post(session_restore))
        .route("/v1/tables/{pointer}", get(table_get).delete(table_delete))
        .route("/metrics", get(metrics))
        .route("/v1/usage", get(usage))
        .route("/v1/openapi.json", get(openapi))
        .route("/v1/admin/drain", post(admin_drain))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .layer(DefaultBodyLimit::max(cfg.max_body_bytes));
    // One auth layer around every route: it lets the routes of
    // `UNAUTHENTICATED` (the probes, the OpenAPI document) through without
    // a token, by the path they matched, the table the document's
    // `security` is written from.
    uploads
        .merge(files)
        .merge(rest)
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::from_fn_with_state(st.clone(), auth))
        // The web console's files need no token (they hold none, and the
        // sign-in page must load before there is one); outside the auth
        // layer, and out of the OpenAPI document (they are not the API).
        .merge(console::routes())
        .layer(middleware::from_fn(log_requests))
        .with_state(st)
}

/// Runs the server until SIGINT or SIGTERM. First takes the data
/// directory's lock (one server per directory), then binds. At the signal
/// both listeners stop accepting at once and close connections with no
/// request in flight; requests in flight get `connections.shutdown_grace`
/// to finish, then every remaining connection is closed and the supervisor
/// shut down.
pub async fn serve(sup: Supervisor, cfg: ServeConfig) -> std::io::Result<()> {
    // Held until this function returns; the kernel drops it if we die.
    let _lock = crate::listen::lock_data_dir(&cfg.tables.dir)?;
    // Sessions kept in a local directory without leases: one server.
    let _state_lock = match cfg.durable.as_ref().map(|d| (d.url(), d.uses_leases())) {
        Some((crate::blob::StoreUrl::Local(dir), false)) if *dir != cfg.tables.dir => {
            Some(crate::listen::lock_data_dir(dir)?)
        }
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot listen on {}: {e}", cfg.listen))
        })?;
    let addr = listener.local_addr()?;
    if cfg.tokens.is_none() && !addr.ip().is_loopback() {
        eprintln!(
            "rvisor serve: WARNING: --no-auth on {addr}, which is not loopback: anyone who can reach \
             this address can run R code as this user. Use --tokens FILE."
        );
    }
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // An nng message carries a table as a JSON string: room for escaping.
    let max_message = cfg.max_body_bytes.max(cfg.max_table_bytes) * 2 + 64 * 1024;
    let svc = service(sup.clone(), &cfg)?;
    let app = routes(svc.clone(), &cfg);
    // The nng socket is bound before either address is printed, so a
    // client (or test) that sees the lines can connect to both.
    let mut nng = None;
    if let Some(url) = &cfg.nng {
        let l = crate::nng::Listener::bind(url)
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {url}: {e}")))?;
        nng = Some(l);
    }
    eprintln!("rvisor serve: listening on http://{addr}");
    let nng = nng.map(|l| {
        eprintln!("rvisor serve: listening on nng {}", l.url());
        tokio::spawn(l.run(
            svc.clone(),
            max_message,
            cfg.connections.clone(),
            stop_rx.clone(),
        ))
    });
    let http = tokio::spawn(crate::listen::serve_http(
        listener,
        app,
        cfg.connections.clone(),
        stop_rx,
    ));
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    let mut term = std::pin::pin!(term);
    let drain = tokio::select! {
        _ = tokio::signal::ctrl_c() => false,
        _ = &mut term => true,
    };
    if drain {
        drain_then_stop(&svc, cfg.drain_grace()).await;
    }
    eprintln!(
        "rvisor serve: shutting down (requests in flight get {} s)",
        cfg.connections.shutdown_grace.as_secs_f64()
    );
    let _ = stop_tx.send(true);
    // Both listeners drain at once, each within the grace period; the nng
    // listener's end removes an IPC socket file.
    let _ = http.await;
    if let Some(task) = nng {
        let _ = task.await;
    }
    // Durable sessions are kept (a drain has released them already);
    // others end here.
    let s = sup.clone();
    let _ = tokio::task::spawn_blocking(move || {
        svc.release_all(std::time::Duration::from_secs(10));
        s.shutdown()
    })
    .await;
    Ok(())
}

/// SIGTERM's drain (docs/scale-out.md): readiness goes false and new work
/// is refused while the listeners keep serving existing sessions; calls in
/// flight get `grace` to finish (a second SIGTERM or a SIGINT cuts it
/// short); then the hand-off step runs and the caller stops the listeners.
async fn drain_then_stop(svc: &Service, grace: std::time::Duration) {
    let st = svc.start_drain();
    eprintln!(
        "rvisor serve: draining: {} sessions, {} calls in flight; calls get {} s to finish",
        st.sessions,
        st.calls_in_flight,
        grace.as_secs_f64()
    );
    let s = svc.clone();
    let waited = tokio::task::spawn_blocking(move || s.finish_drain(grace));
    let again = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = waited => {}
        _ = again => eprintln!("rvisor serve: a second SIGTERM: stopping now"),
        _ = tokio::signal::ctrl_c() => eprintln!("rvisor serve: SIGINT: stopping now"),
    }
}

#[cfg(test)]
mod config_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_drain_grace_is_the_shutdown_grace_unless_set() {
        let mut cfg = ServeConfig::default();
        assert_eq!(cfg.drain_grace(), Duration::from_secs(30));
        cfg.connections.shutdown_grace = Duration::from_secs(7);
        assert_eq!(cfg.drain_grace(), Duration::from_secs(7));
        cfg.drain_grace = Some(Duration::from_secs(300));
        assert_eq!(cfg.drain_grace(), Duration::from_secs(300));
        assert_eq!(cfg.connections.shutdown_grace, Duration::from_secs(7));
    }
}
