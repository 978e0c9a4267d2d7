//! `rvisor serve`: the HTTP/JSON surface for agent platforms (CONTRACT.md).
//!
//! A thin adapter: every handler calls the library (health, packages,
//! validate, one-shot runs, sessions) and maps its answers to HTTP. Tenants
//! come from bearer tokens; a session belongs to the tenant that made it and
//! is invisible to others (another tenant's id answers like an unknown one).

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rvisor::{ops, CallContext, CallOptions, Outcome, RunOptions, RunResult, Session, Supervisor};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tables published during calls: (execution id, table metadata).
pub(crate) type Published = Arc<Mutex<Vec<(String, Value)>>>;

/// Takes the tables published by call `execution_id`.
pub(crate) fn take_published(p: &Published, execution_id: &str) -> Vec<Value> {
    let mut all = p.lock().unwrap_or_else(|e| e.into_inner());
    let (mine, rest): (Vec<_>, Vec<_>) = all.drain(..).partition(|(id, _)| id == execution_id);
    *all = rest;
    mine.into_iter().map(|(_, v)| v).collect()
}

/// The built-in tool behind `rvisor_publish(df)`: stores the CSV the R
/// code wrote (in its own temporary directory) as a table of `tenant`, and
/// records it for the result's `published` list.
pub(crate) fn publish_tool(
    store: Arc<crate::tables::TableStore>,
    tenant: String,
    record: Published,
) -> rvisor::Tool {
    let tool = rvisor::Tool::new(
        "rvisor.publish",
        "Publish a data frame as a data pointer",
        json!({"type": "object", "properties": {"path": {"type": "string"}, "name": {"type": "string"}}}),
        move |call| {
            let path = call.args["path"].as_str().ok_or("path is missing")?;
            let name = call.args["name"].as_str().unwrap_or("");
            let bytes = rvisor::tools::read_worker_file(call, path)?;
            let meta = store
                .put(&tenant, crate::tables::TableFormat::Csv, &bytes)
                .map_err(|e| e.to_string())?;
            let mut v = serde_json::to_value(&meta).map_err(|e| e.to_string())?;
            if !name.is_empty() {
                v["name"] = json!(name);
            }
            record
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((call.execution_id.clone(), v.clone()));
            Ok(v)
        },
    );
    // The name is a constant that matches the rules.
    tool.unwrap_or_else(|e| unreachable!("{e}"))
}

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

/// An error as the wire shows it: `{"error": {"code", "message"}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
    fn not_found(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{what} not found"),
        )
    }
    fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status;
        let mut res = (
            status,
            Json(json!({"error": {"code": self.code, "message": self.message}})),
        )
            .into_response();
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
            Err(JsonRejection::JsonDataError(e)) => Err(ApiError::invalid(e.body_text())),
            Err(JsonRejection::JsonSyntaxError(e)) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                e.body_text(),
            )),
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                "send a JSON body with Content-Type: application/json",
            )),
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                e.body_text(),
            )),
            Err(e) => Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                e.body_text(),
            )),
        }
    }
}

#[derive(Debug, Default)]
struct Metrics {
    by_outcome: Mutex<BTreeMap<String, u64>>,
    /// Call latency histogram: counts of calls at or under each bound (s).
    buckets: [AtomicU64; 10],
    sum_micros: AtomicU64,
    count: AtomicU64,
    requests: AtomicU64,
}

const BUCKETS: [f64; 10] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0];

impl Metrics {
    fn record(&self, r: &RunResult, took: Duration) {
        *self
            .by_outcome
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(r.outcome.to_string())
            .or_default() += 1;
        let secs = took.as_secs_f64();
        for (i, b) in BUCKETS.iter().enumerate() {
            if secs <= *b {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }
}

pub(crate) struct AppState {
    sup: Supervisor,
    pub(crate) cfg: ServeConfig,
    tables: Arc<crate::tables::TableStore>,
    /// Session id -> (tenant, session, tables it published by execution id).
    sessions: Mutex<HashMap<String, (String, Session, Published)>>,
    metrics: Metrics,
}

pub(crate) type Shared = Arc<AppState>;

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

/// The tenant a token belongs to: `local` when the server runs without
/// auth, `None` for a missing or unknown token.
pub(crate) fn tenant_for(
    tokens: &Option<HashMap<String, String>>,
    given: Option<&str>,
) -> Option<String> {
    match tokens {
        None => Some("local".to_string()),
        Some(tokens) => given.map(str::trim).and_then(|t| tokens.get(t)).cloned(),
    }
}

async fn auth(State(st): State<Shared>, mut req: Request, next: Next) -> Response {
    st.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let Some(tenant) = tenant_for(&st.cfg.tokens, given) else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "send a valid token as `Authorization: Bearer <token>`",
        )
        .into_response();
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
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("the handler failed: {e}"),
        )
    })
}

#[utoipa::path(get, path = "/v1/health", tag = "operations", responses((status = 200, description = "Liveness, versions, the live safety rules, workers (a `sessions` count is added)", body = rvisor::ops::Health), (status = 401, body = ErrorBody)))]
async fn health(State(st): State<Shared>) -> Result<Response, ApiError> {
    let sup = st.sup.clone();
    let h = blocking(move || sup.health()).await?;
    let mut v = serde_json::to_value(&h).unwrap_or_default();
    v["workers"]["sessions"] = json!(st.sessions.lock().unwrap_or_else(|e| e.into_inner()).len());
    Ok(Json(v).into_response())
}

#[utoipa::path(get, path = "/v1/packages", tag = "operations", responses((status = 200, description = "`{\"packages\": [Package]}`", body = PackagesBody), (status = 503, body = ErrorBody)))]
async fn packages(State(st): State<Shared>) -> Result<Response, ApiError> {
    let sup = st.sup.clone();
    match blocking(move || sup.packages()).await? {
        Ok(list) => Ok(Json(json!({ "packages": list })).into_response()),
        Err(e) => Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_worker",
            e,
        )),
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct ValidateBody {
    script: String,
}

#[utoipa::path(post, path = "/v1/validate", tag = "operations", request_body = ValidateBody, responses((status = 200, body = rvisor::ops::Validation), (status = 400, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn validate(
    State(st): State<Shared>,
    ApiJson(b): ApiJson<ValidateBody>,
) -> Result<Response, ApiError> {
    let sup = st.sup.clone();
    let v = blocking(move || sup.validate(&b.script)).await?;
    Ok(Json(v).into_response())
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct VariableBody {
    name: String,
    value: Value,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct DataframeBody {
    data_pointer: String,
    name: String,
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct RunBody {
    script: String,
    #[serde(default)]
    timeout_seconds: Option<f64>,
    #[serde(default)]
    variables: Vec<VariableBody>,
    #[serde(default)]
    dataframes: Vec<DataframeBody>,
    /// Tighter confinement limits for this run (never looser than the server's).
    #[serde(default)]
    limits: Option<LimitsBody>,
}

/// Limits a client may ask for: each at most the server's own.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct LimitsBody {
    /// Address space, MiB.
    #[serde(default)]
    memory_mb: Option<u64>,
    /// Private disk (tmpfs), MiB.
    #[serde(default)]
    disk_mb: Option<u64>,
    /// Processes and threads.
    #[serde(default)]
    processes: Option<u64>,
    /// CPU seconds over the worker's life.
    #[serde(default)]
    cpu_seconds: Option<u64>,
}

/// The server's limits tightened by `b`; a looser value is refused.
fn tighter_limits(
    st: &AppState,
    b: Option<&LimitsBody>,
) -> Result<Option<rvisor::Limits>, ApiError> {
    let Some(b) = b else { return Ok(None) };
    let Some(base) = st
        .sup
        .config()
        .worker
        .confine
        .as_ref()
        .map(|c| c.limits.clone())
    else {
        return Err(ApiError::invalid(
            "limits need OS confinement, and this server runs unconfined",
        ));
    };
    let mut l = base.clone();
    let over = |what: &str, asked: u64, max: u64, unit: &str| {
        ApiError::invalid(format!(
            "{what} {asked}{unit} is over the server's limit of {max}{unit}; ask for less"
        ))
    };
    if let Some(m) = b.memory_mb {
        if m > base.memory_bytes >> 20 {
            return Err(over("memory_mb", m, base.memory_bytes >> 20, " MiB"));
        }
        l.memory_bytes = m << 20;
    }
    if let Some(d) = b.disk_mb {
        if d > base.disk_bytes >> 20 {
            return Err(over("disk_mb", d, base.disk_bytes >> 20, " MiB"));
        }
        l.disk_bytes = d << 20;
    }
    if let Some(p) = b.processes {
        if p > base.processes {
            return Err(over("processes", p, base.processes, ""));
        }
        l.processes = p;
    }
    if let Some(c) = b.cpu_seconds {
        if let Some(max) = base.cpu_seconds.filter(|max| c > *max) {
            return Err(over("cpu_seconds", c, max, " s"));
        }
        l.cpu_seconds = Some(c);
    }
    l.check().map_err(ApiError::invalid)?;
    Ok(Some(l))
}

fn check_timeout(t: Option<f64>, rules: &ops::SafetyRules) -> Result<Duration, ApiError> {
    let r = &rules.timeout_seconds;
    match t {
        None => Ok(Duration::from_secs(r.default)),
        Some(t) if t.is_finite() && t >= r.min as f64 && t <= r.max as f64 => {
            Ok(Duration::from_secs_f64(t))
        }
        Some(t) => Err(ApiError::invalid(format!(
            "timeout_seconds {t} is out of range: use {}..{} seconds",
            r.min, r.max
        ))),
    }
}

#[utoipa::path(post, path = "/v1/run", tag = "operations", request_body = RunBody, responses((status = 200, description = "A RunResult (outcome `rejected` with `validation` when the script fails validation); `Accept: text/html` gives an HTML fragment", body = rvisor_protocol::RunResult), (status = 400, body = ErrorBody), (status = 413, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn run(
    State(st): State<Shared>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    headers: HeaderMap,
    ApiJson(b): ApiJson<RunBody>,
) -> Result<Response, ApiError> {
    let rules = st.sup.config().rules.clone();
    let timeout = check_timeout(b.timeout_seconds, &rules)?;
    let limits = tighter_limits(&st, b.limits.as_ref())?;
    if b.dataframes.len() > rules.max_dataframes {
        return Err(ApiError::invalid(format!(
            "{} dataframes given; at most {} are allowed",
            b.dataframes.len(),
            rules.max_dataframes
        )));
    }
    for d in &b.dataframes {
        if !ops::syntactic_name(&d.name) {
            return Err(ApiError::invalid(format!(
                "dataframe name {:?} is not a syntactic R name",
                d.name
            )));
        }
    }
    let variables: Vec<(String, Value)> =
        b.variables.into_iter().map(|v| (v.name, v.value)).collect();
    ops::check_variables(&variables, &rules).map_err(ApiError::invalid)?;
    let mut names = std::collections::HashSet::new();
    for d in &b.dataframes {
        if !names.insert(d.name.as_str()) || variables.iter().any(|(n, _)| n == &d.name) {
            return Err(ApiError::invalid(format!(
                "the name {:?} is used twice",
                d.name
            )));
        }
    }
    let pointers: Vec<&str> = b
        .dataframes
        .iter()
        .map(|d| d.data_pointer.as_str())
        .collect();
    // All or nothing, and one answer for every failure (unknown, expired,
    // deleted, another tenant's): it does not say which pointer or why.
    let Some(files) = st.tables.resolve(&tenant, &pointers) else {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "data_pointer_unresolved",
            "one or more data pointers could not be resolved; nothing ran",
        ));
    };
    let tables: Vec<(String, std::path::PathBuf)> = b
        .dataframes
        .iter()
        .map(|d| d.name.clone())
        .zip(files)
        .collect();
    let sup = st.sup.clone();
    let started = Instant::now();
    let script = b.script;
    let published: Published = Arc::new(Mutex::new(Vec::new()));
    let publish = publish_tool(st.tables.clone(), tenant.clone(), published.clone());
    let r = blocking(move || {
        // A run checks problems only; style notes are for /v1/validate.
        let v = sup.validate_with(&script, rvisor::ops::StyleEngine::None);
        let id = rvisor::ids::execution_id();
        if !v.valid {
            let summary: Vec<String> = v
                .problems
                .iter()
                .map(|p| match (p.line, p.column) {
                    (Some(l), Some(c)) => format!("line {l}, column {c}: {}", p.message),
                    _ => p.message.clone(),
                })
                .collect();
            let mut r = RunResult::failed(
                id,
                script,
                Outcome::Rejected,
                format!(
                    "the script failed validation and was not run: {}",
                    summary.join("; ")
                ),
            );
            r.validation = serde_json::to_value(&v).ok();
            return r;
        }
        let opts = CallOptions {
            timeout: Some(timeout),
            // Wall and CPU: a run may not use more CPU than its timeout.
            cpu_limit: Some(timeout),
            ..CallOptions::default()
        };
        let ctx = CallContext {
            variables,
            tables,
            tools: Arc::new(vec![publish]),
            ..CallContext::default()
        };
        sup.run_once_limited(id, &script, &opts, &ctx, limits.as_ref(), None)
    })
    .await?;
    let mut r = r;
    r.published = take_published(&published, &r.execution_id.clone());
    st.metrics.record(&r, started.elapsed());
    if matches!(r.outcome, Outcome::StartupFailed | Outcome::StartupTimedOut) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_worker",
            r.error.map(|e| e.message).unwrap_or_default(),
        ));
    }
    Ok(result_response(&headers, r))
}

#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct SessionBody {
    #[serde(default)]
    timeout_seconds: Option<f64>,
    /// Tighter confinement limits for this session's workers.
    #[serde(default)]
    limits: Option<LimitsBody>,
    #[serde(default)]
    plot_width: Option<u32>,
    #[serde(default)]
    plot_height: Option<u32>,
}

#[utoipa::path(post, path = "/v1/sessions", tag = "sessions", request_body(content = Option<SessionBody>, description = "optional session options"), responses((status = 201, body = rvisor::SessionStatus), (status = 422, body = ErrorBody)))]
async fn create_session(
    State(st): State<Shared>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Response, ApiError> {
    // A body over the limit (or one that cannot be read) is answered as a
    // JSON error like every other endpoint; taking `Bytes` directly let
    // axum answer 413 in plain text.
    let body = body.map_err(body_error)?;
    // The body is optional: no body means default options.
    let b: SessionBody = if body.iter().all(u8::is_ascii_whitespace) {
        SessionBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            if e.is_data() {
                ApiError::invalid(format!("invalid session options: {e}"))
            } else {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("malformed JSON: {e}"),
                )
            }
        })?
    };
    let rules = &st.sup.config().rules;
    let timeout = check_timeout(b.timeout_seconds, rules)?;
    let mut opts = rvisor::SessionOptions {
        timeout,
        ..st.sup.config().defaults.clone()
    };
    if let Some(w) = b.plot_width {
        opts.plot_width = w;
    }
    if let Some(h) = b.plot_height {
        opts.plot_height = h;
    }
    opts.limits = tighter_limits(&st, b.limits.as_ref())?;
    let published: Published = Arc::new(Mutex::new(Vec::new()));
    opts.tools.push(publish_tool(
        st.tables.clone(),
        tenant.clone(),
        published.clone(),
    ));
    let s = st
        .sup
        .session_with(opts)
        .map_err(|e| ApiError::invalid(e.to_string()))?;
    let status = s.status();
    st.sessions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(s.id().to_string(), (tenant, s, published));
    Ok((StatusCode::CREATED, Json(status)).into_response())
}

pub(crate) fn find_session(
    st: &AppState,
    tenant: &str,
    id: &str,
) -> Result<(Session, Published), ApiError> {
    match st
        .sessions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(id)
    {
        Some((owner, s, p)) if owner == tenant => Ok((s.clone(), p.clone())),
        _ => Err(ApiError::not_found("session")),
    }
}

#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct SessionRunBody {
    code: String,
    #[serde(default)]
    timeout_seconds: Option<f64>,
    /// Plot size in pixels for this call (the session's otherwise).
    #[serde(default)]
    plot_width: Option<u32>,
    #[serde(default)]
    plot_height: Option<u32>,
}

#[utoipa::path(post, path = "/v1/sessions/{id}/run", tag = "sessions", params(("id" = String, Path, description = "session id")), request_body = SessionRunBody, responses((status = 200, body = rvisor_protocol::RunResult), (status = 404, body = ErrorBody), (status = 429, body = ErrorBody)))]
async fn session_run(
    State(st): State<Shared>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(id): Path<String>,
    headers: HeaderMap,
    ApiJson(b): ApiJson<SessionRunBody>,
) -> Result<Response, ApiError> {
    let (s, published) = find_session(&st, &tenant, &id)?;
    let timeout = match b.timeout_seconds {
        None => None,
        t => Some(check_timeout(t, &st.sup.config().rules)?),
    };
    let started = Instant::now();
    let handle = s
        .run_with(
            &b.code,
            &RunOptions {
                timeout,
                plot_width: b.plot_width,
                plot_height: b.plot_height,
            },
        )
        .map_err(|e| match e {
            rvisor::Rejection::QueueFull(_) => {
                ApiError::new(StatusCode::TOO_MANY_REQUESTS, "queue_full", e.to_string())
            }
            rvisor::Rejection::Closed => ApiError::not_found("session"),
            other => ApiError::invalid(other.to_string()),
        })?;
    let mut r = handle.await;
    r.published = take_published(&published, &r.execution_id.clone());
    st.metrics.record(&r, started.elapsed());
    Ok(result_response(&headers, r))
}

#[utoipa::path(get, path = "/v1/sessions/{id}", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, body = rvisor::SessionStatus), (status = 404, body = ErrorBody)))]
async fn session_status(
    State(st): State<Shared>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    Ok(Json(find_session(&st, &tenant, &id)?.0.status()).into_response())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/cancel", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, body = rvisor::SessionStatus), (status = 404, body = ErrorBody)))]
async fn session_cancel(
    State(st): State<Shared>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let (s, _) = find_session(&st, &tenant, &id)?;
    s.cancel();
    Ok(Json(s.status()).into_response())
}

#[utoipa::path(post, path = "/v1/sessions/{id}/reset", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, body = rvisor::SessionStatus), (status = 404, body = ErrorBody)))]
async fn session_reset(
    State(st): State<Shared>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let (s, _) = find_session(&st, &tenant, &id)?;
    // The fresh worker is put in place before the next call runs.
    s.reset();
    Ok(Json(s.status()).into_response())
}

#[utoipa::path(delete, path = "/v1/sessions/{id}", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 204, description = "closed"), (status = 404, body = ErrorBody)))]
async fn session_delete(
    State(st): State<Shared>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let (s, _) = find_session(&st, &tenant, &id)?;
    st.sessions
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&id);
    s.close();
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// A body that could not be read (over the limit: 413) as a JSON error;
/// taking `Bytes` directly would let axum answer in plain text.
fn body_error(e: axum::extract::rejection::BytesRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", e.body_text())
    } else {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.body_text())
    }
}

#[utoipa::path(post, path = "/v1/tables", tag = "tables", request_body(content = String, description = "CSV (text/csv), a JSON array of records (application/json) or an Arrow IPC stream (application/vnd.apache.arrow.stream)"), responses((status = 201, body = crate::tables::TableMeta), (status = 413, body = ErrorBody), (status = 422, body = ErrorBody), (status = 429, body = ErrorBody)))]
async fn table_create(
    State(st): State<Shared>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    headers: HeaderMap,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(body_error)?;
    use crate::tables::{TableError, TableFormat};
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let format = if ct.starts_with("text/csv") {
        TableFormat::Csv
    } else if ct.starts_with("application/json") {
        TableFormat::Json
    } else if ct.starts_with("application/vnd.apache.arrow.stream") {
        TableFormat::ArrowStream
    } else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "send the table as text/csv, application/json (an array of records) or application/vnd.apache.arrow.stream",
        ));
    };
    let store = st.tables.clone();
    match blocking(move || store.put(&tenant, format, &body)).await? {
        Ok(meta) => Ok((StatusCode::CREATED, Json(meta)).into_response()),
        Err(TableError::Invalid(m)) => Err(ApiError::invalid(m)),
        Err(TableError::Quota(m)) => Err(ApiError::new(StatusCode::TOO_MANY_REQUESTS, "quota", m)),
        Err(e @ TableError::Io(_)) => Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "storage",
            e.to_string(),
        )),
    }
}

#[utoipa::path(get, path = "/v1/tables/{pointer}", tag = "tables", params(("pointer" = String, Path, description = "data pointer")), responses((status = 200, body = crate::tables::TableMeta), (status = 404, body = ErrorBody)))]
async fn table_get(
    State(st): State<Shared>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(p): Path<String>,
) -> Result<Response, ApiError> {
    st.tables
        .get(&tenant, &p)
        .map(|m| Json(m).into_response())
        .ok_or_else(|| ApiError::not_found("table"))
}

#[utoipa::path(delete, path = "/v1/tables/{pointer}", tag = "tables", params(("pointer" = String, Path, description = "data pointer")), responses((status = 204, description = "deleted"), (status = 404, body = ErrorBody)))]
async fn table_delete(
    State(st): State<Shared>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    Path(p): Path<String>,
) -> Result<Response, ApiError> {
    if st.tables.delete(&tenant, &p) {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::not_found("table"))
    }
}

async fn metrics(State(st): State<Shared>) -> Response {
    let m = &st.metrics;
    let mut out = String::new();
    out.push_str(
        "# HELP rvisor_calls_total Calls by outcome.\n# TYPE rvisor_calls_total counter\n",
    );
    for (k, v) in m
        .by_outcome
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
    {
        out.push_str(&format!("rvisor_calls_total{{outcome=\"{k}\"}} {v}\n"));
    }
    out.push_str(
        "# HELP rvisor_call_seconds Call latency.\n# TYPE rvisor_call_seconds histogram\n",
    );
    for (i, b) in BUCKETS.iter().enumerate() {
        out.push_str(&format!(
            "rvisor_call_seconds_bucket{{le=\"{b}\"}} {}\n",
            m.buckets[i].load(Ordering::Relaxed)
        ));
    }
    let count = m.count.load(Ordering::Relaxed);
    out.push_str(&format!(
        "rvisor_call_seconds_bucket{{le=\"+Inf\"}} {count}\n"
    ));
    out.push_str(&format!(
        "rvisor_call_seconds_sum {}\n",
        m.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
    ));
    out.push_str(&format!("rvisor_call_seconds_count {count}\n"));
    let pool = st.sup.pool_status();
    let sessions = st.sessions.lock().unwrap_or_else(|e| e.into_inner());
    let queued: usize = sessions.values().map(|(_, s, _)| s.status().queued).sum();
    out.push_str(&format!(
        "# TYPE rvisor_sessions gauge\nrvisor_sessions {}\n# TYPE rvisor_queue_depth gauge\nrvisor_queue_depth {queued}\n# TYPE rvisor_spare_workers gauge\nrvisor_spare_workers {}\n# TYPE rvisor_zygote_up gauge\nrvisor_zygote_up {}\n# TYPE rvisor_http_requests_total counter\nrvisor_http_requests_total {}\n",
        sessions.len(),
        pool.spares,
        u8::from(pool.mode == rvisor::PoolMode::Zygote),
        m.requests.load(Ordering::Relaxed)
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

async fn not_found() -> ApiError {
    ApiError::not_found("route")
}

async fn wrong_method() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this path does not take that method; see CONTRACT.md for the routes",
    )
}

/// The router, for tests and for `serve`.
pub fn router(sup: Supervisor, cfg: ServeConfig) -> std::io::Result<Router> {
    Ok(build(sup, cfg)?.0)
}

/// The router and the state its handlers share (the nng adapter needs both).
fn build(sup: Supervisor, cfg: ServeConfig) -> std::io::Result<(Router, Shared)> {
    let max_body = cfg.max_body_bytes;
    let max_table = cfg.max_table_bytes;
    let tables = Arc::new(crate::tables::TableStore::open(cfg.tables.clone())?);
    let st = Arc::new(AppState {
        sup,
        cfg,
        tables,
        sessions: Mutex::new(HashMap::new()),
        metrics: Metrics::default(),
    });
    // Table uploads get their own (larger) body limit.
    let uploads = Router::new()
        .route("/v1/tables", post(table_create))
        .layer(DefaultBodyLimit::max(max_table));
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
        .layer(DefaultBodyLimit::max(max_body));
    let app = uploads
        .merge(rest)
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::from_fn_with_state(st.clone(), auth))
        .layer(middleware::from_fn(log_requests))
        .with_state(st.clone());
    Ok((app, st))
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
    let (app, st) = build(sup.clone(), cfg)?;
    let nng = match nng_url {
        Some(url) => {
            let l = crate::nng::Listener::bind(&url).await.map_err(|e| {
                std::io::Error::new(e.kind(), format!("cannot listen on {url}: {e}"))
            })?;
            eprintln!("rvisor serve: listening on nng {}", l.url());
            Some(tokio::spawn(l.run(app.clone(), st, max_message, stop_rx)))
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
