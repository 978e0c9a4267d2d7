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
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rvisor::{RunResult, Supervisor};
use serde_json::json;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Instant;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Address to listen on (default 127.0.0.1:8787).
    pub listen: SocketAddr,
    /// Bearer token -> tenant; `None` serves one local tenant without auth.
    pub tokens: Option<HashMap<String, String>>,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Largest table upload, in bytes.
    pub max_table_bytes: usize,
    /// Where tables are stored, their lifetime and quotas.
    pub tables: crate::tables::TableConfig,
    /// Also serve the same operations on an nng REQ/REP socket.
    pub nng: Option<crate::nng::NngUrl>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
            tokens: None,
            max_body_bytes: 4 * 1024 * 1024,
            max_table_bytes: 256 * 1024 * 1024,
            tables: crate::tables::TableConfig::default(),
            nng: None,
        }
    }
}

/// Reads a token file: one `TOKEN TENANT` pair per line; `#` starts a
/// comment.
pub fn read_tokens(text: &str) -> Result<HashMap<String, String>, String> {
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
            (Some(_), Some(_), None) => {
                return Err(format!(
                    "line {}: tokens must be at least 16 characters",
                    n + 1
                ))
            }
            _ => return Err(format!("line {}: expected `TOKEN TENANT`", n + 1)),
        }
    }
    if map.is_empty() {
        return Err("the token file has no tokens".into());
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
        if self.0.code == ErrorCode::Busy {
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
}

/// The answer of GET /v1/packages.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct PackagesBody {
    packages: Vec<rvisor::ops::Package>,
}

/// The OpenAPI 3 document, generated from the types the handlers use.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(title = "rvisor", description = "Run R code fast, safely and with state: the HTTP surface (see CONTRACT.md)."),
    paths(health, packages, validate, run, create_session, session_run, session_status, session_cancel, session_reset, session_delete, table_create, table_get, table_delete),
    modifiers(&BearerAuth)
)]
struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let c = api.components.get_or_insert_with(Default::default);
        c.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        api.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new(
            "bearer",
            Vec::<String>::new(),
        )]);
    }
}

/// The OpenAPI document as JSON.
pub fn openapi_json() -> String {
    use utoipa::OpenApi;
    ApiDoc::openapi().to_pretty_json().unwrap_or_default()
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], openapi_json()).into_response()
}

/// A JSON body whose rejections are `ApiError`s: malformed JSON is 400,
/// wrong types 422 (naming the field), an oversize body 413.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(ApiJson(v)),
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

/// What the handlers share.
#[derive(Clone)]
struct Handlers {
    service: Service,
    /// Largest table upload, in bytes.
    max_table_bytes: usize,
}

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

async fn auth(State(st): State<Handlers>, mut req: Request, next: Next) -> Response {
    st.service.count_request(Surface::Http);
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let tenant = match st
        .service
        .authenticate(given, "as `Authorization: Bearer <token>`")
    {
        Ok(t) => t,
        Err(e) => return ApiError(e).into_response(),
    };
    req.extensions_mut().insert(Tenant(tenant.clone()));
    let mut res = next.run(req).await;
    res.extensions_mut().insert(Tenant(tenant));
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

#[utoipa::path(get, path = "/v1/health", tag = "operations", responses((status = 200, description = "Liveness, versions, the live safety rules, workers (a `sessions` count is added)", body = rvisor::ops::Health), (status = 401, body = ErrorBody)))]
async fn health(State(st): State<Handlers>) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    Ok(Json(blocking(move || svc.health()).await?).into_response())
}

#[utoipa::path(get, path = "/v1/packages", tag = "operations", responses((status = 200, description = "`{\"packages\": [Package]}`", body = PackagesBody), (status = 503, body = ErrorBody)))]
async fn packages(State(st): State<Handlers>) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let list = blocking(move || svc.packages()).await??;
    Ok(Json(json!({ "packages": list })).into_response())
}

#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ValidateBody {
    script: String,
}

#[utoipa::path(post, path = "/v1/validate", tag = "operations", request_body = ValidateBody, responses((status = 200, body = rvisor::ops::Validation), (status = 400, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn validate(
    State(st): State<Handlers>,
    ApiJson(b): ApiJson<ValidateBody>,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let v = blocking(move || svc.validate(&b.script)).await?;
    Ok(Json(v).into_response())
}

#[utoipa::path(post, path = "/v1/run", tag = "operations", request_body = RunScript, responses((status = 200, description = "A RunResult (outcome `rejected` with `validation` when the script fails validation); `Accept: text/html` gives an HTML fragment", body = rvisor_protocol::RunResult), (status = 400, body = ErrorBody), (status = 413, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn run(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    headers: HeaderMap,
    ApiJson(b): ApiJson<RunScript>,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let r = blocking(move || svc.run_script(&tenant, b, Surface::Http)).await??;
    Ok(result_response(&headers, r))
}

#[utoipa::path(post, path = "/v1/sessions", tag = "sessions", request_body(content = Option<NewSession>, description = "optional session options"), responses((status = 201, body = rvisor::SessionStatus), (status = 422, body = ErrorBody)))]
async fn create_session(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Response, ApiError> {
    // A body over the limit (or one that cannot be read) is answered as a
    // JSON error like every other endpoint; taking `Bytes` directly let
    // axum answer 413 in plain text.
    let body = body.map_err(body_error)?;
    // The body is optional: no body means default options.
    let b: NewSession = if body.iter().all(u8::is_ascii_whitespace) {
        NewSession::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
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

#[utoipa::path(post, path = "/v1/sessions/{id}/run", tag = "sessions", params(("id" = String, Path, description = "session id")), request_body = SessionRun, responses((status = 200, body = rvisor_protocol::RunResult), (status = 404, body = ErrorBody), (status = 429, body = ErrorBody)))]
async fn session_run(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(id): Path<String>,
    headers: HeaderMap,
    ApiJson(b): ApiJson<SessionRun>,
) -> Result<Response, ApiError> {
    let call = st.service.session_run(&tenant, &id, &b)?;
    Ok(result_response(&headers, call.finish().await))
}

#[utoipa::path(get, path = "/v1/sessions/{id}", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, body = rvisor::SessionStatus), (status = 404, body = ErrorBody)))]
async fn session_status(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(st.service.session_status(&tenant, &id)?).into_response())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/cancel", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, body = rvisor::SessionStatus), (status = 404, body = ErrorBody)))]
async fn session_cancel(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(st.service.cancel(&tenant, &id)?).into_response())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/reset", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, body = rvisor::SessionStatus), (status = 404, body = ErrorBody)))]
async fn session_reset(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(st.service.reset(&tenant, &id)?).into_response())
}

#[utoipa::path(delete, path = "/v1/sessions/{id}", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 204, description = "closed"), (status = 404, body = ErrorBody)))]
async fn session_delete(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    st.service.close(&tenant, &id)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A body that could not be read (over the limit: 413) as a JSON error;
/// taking `Bytes` directly would let axum answer in plain text.
fn body_error(e: axum::extract::rejection::BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(ErrorCode::TooLarge, e.body_text())
    } else {
        ApiError::new(ErrorCode::BadRequest, e.body_text())
    }
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

#[utoipa::path(post, path = "/v1/tables", tag = "tables", request_body(content = String, description = "CSV (text/csv), a JSON array of records (application/json) or an Arrow IPC stream (application/vnd.apache.arrow.stream)"), responses((status = 201, body = crate::tables::TableMeta), (status = 413, body = ErrorBody), (status = 422, body = ErrorBody), (status = 429, body = ErrorBody)))]
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
    // The body goes to a file as it arrives (never whole in memory), and
    // the conversion reads it from there in batches.
    let spool = Spool(st.service.spool_path());
    receive(body, &spool.0, st.max_table_bytes).await?;
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

/// How long an upload may send nothing before it is dropped.
const BODY_IDLE: std::time::Duration = std::time::Duration::from_secs(30);

/// Writes `body` to `path`, refusing it (413) as soon as it passes `max`
/// bytes and (408-like 400) when it stalls for [`BODY_IDLE`].
async fn receive(
    body: axum::body::Body,
    path: &std::path::Path,
    max: usize,
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
        let frame = match tokio::time::timeout(BODY_IDLE, body.frame()).await {
            Err(_) => {
                return Err(ApiError::new(
                    ErrorCode::BadRequest,
                    format!(
                        "the upload sent nothing for {} s; send the body without pauses",
                        BODY_IDLE.as_secs()
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

#[utoipa::path(get, path = "/v1/tables/{pointer}", tag = "tables", params(("pointer" = String, Path, description = "data pointer")), responses((status = 200, body = crate::tables::TableMeta), (status = 404, body = ErrorBody)))]
async fn table_get(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(p): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(st.service.get_table(&tenant, &p)?).into_response())
}

#[utoipa::path(delete, path = "/v1/tables/{pointer}", tag = "tables", params(("pointer" = String, Path, description = "data pointer")), responses((status = 204, description = "deleted"), (status = 404, body = ErrorBody)))]
async fn table_delete(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(p): Path<String>,
) -> Result<Response, ApiError> {
    st.service.delete_table(&tenant, &p)?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

async fn metrics(State(st): State<Handlers>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.service.metrics_text(),
    )
        .into_response()
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
    };
    // Table uploads get their own (larger) body limit.
    let uploads = Router::new()
        .route("/v1/tables", post(table_create))
        .layer(DefaultBodyLimit::max(cfg.max_table_bytes));
    let rest = Router::new()
        .route("/v1/health", get(health))
        .route("/v1/packages", get(packages))
        .route("/v1/validate", post(validate))
        .route("/v1/run", post(run))
        .route("/v1/sessions", post(create_session))
        .route(
            "/v1/sessions/{id}",
            get(session_status).delete(session_delete),
        )
        .route("/v1/sessions/{id}/run", post(session_run))
        .route("/v1/sessions/{id}/cancel", post(session_cancel))
        .route("/v1/sessions/{id}/reset", post(session_reset))
        .route("/v1/tables/{pointer}", get(table_get).delete(table_delete))
        .route("/metrics", get(metrics))
        .route("/v1/openapi.json", get(openapi))
        .layer(DefaultBodyLimit::max(cfg.max_body_bytes));
    uploads
        .merge(rest)
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::from_fn_with_state(st.clone(), auth))
        .layer(middleware::from_fn(log_requests))
        .with_state(st)
}

/// Runs the server until SIGINT or SIGTERM, then stops accepting, lets
/// running requests finish (bounded by their call timeouts) and shuts the
/// supervisor down.
pub async fn serve(sup: Supervisor, cfg: ServeConfig) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(cfg.listen).await?;
    let addr = listener.local_addr()?;
    if cfg.tokens.is_none() && !addr.ip().is_loopback() {
        eprintln!(
            "rvisor serve: WARNING: --no-auth on {addr}, which is not loopback: anyone who can reach \
             this address can run R code as this user. Use --tokens FILE."
        );
    }
    eprintln!("rvisor serve: listening on http://{addr}");
    let nng_url = cfg.nng.clone();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // An nng message carries a table as a JSON string: room for escaping.
    let max_message = cfg.max_body_bytes.max(cfg.max_table_bytes) * 2 + 64 * 1024;
    let svc = service(sup.clone(), &cfg)?;
    let app = routes(svc.clone(), &cfg);
    let nng = match nng_url {
        Some(url) => {
            let l = crate::nng::Listener::bind(&url).await.map_err(|e| {
                std::io::Error::new(e.kind(), format!("cannot listen on {url}: {e}"))
            })?;
            eprintln!("rvisor serve: listening on nng {}", l.url());
            Some(tokio::spawn(l.run(svc, max_message, stop_rx)))
        }
        None => None,
    };
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let term = async {
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(mut s) => {
                        s.recv().await;
                    }
                    Err(_) => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term => {}
            }
            eprintln!("rvisor serve: shutting down");
            let _ = stop_tx.send(true);
        })
        .await?;
    if let Some(task) = nng {
        // Requests in flight finish (bounded by their call timeouts); the
        // listener's end removes an IPC socket file.
        let _ = task.await;
    }
    let s = sup.clone();
    let _ = tokio::task::spawn_blocking(move || s.shutdown()).await;
    Ok(())
}
