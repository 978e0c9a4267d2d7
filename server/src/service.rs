//! The transport-neutral service: what HTTP, nng, MCP and `session --jsonl`
//! share, written once.
//!
//! [`Service`] owns tenants and their sessions (by id, and by name for the
//! surfaces that address sessions by name), one-shot runs with variables
//! and tables, validation, the table store, the request policy (timeouts
//! and limits a client may ask for, one definition each), the error codes
//! ([`ErrorCode`], mapped to HTTP statuses here and nowhere else) and the
//! metrics. An adapter decodes a request into the types of this module,
//! calls the service, and encodes the answer; it holds no rule of its own.

use crate::durable::{SessionRecord, SessionStore, TakeError};
use crate::tables::{TableConfig, TableError, TableFormat, TableMeta, TableStore};
use rvisor::{
    CallContext, CallEvent, CallHandle, CallOptions, CancelOnDrop, CancelToken, EventFeed,
    EventKind, Events, Outcome, RunOptions, RunResult, SafetyRules, Session, SessionOptions,
    SessionStatus, Supervisor,
};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------
// Errors

/// A stable error code, the same on every surface (`{"code", "message"}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorCode {
    /// The request could not be read (malformed JSON, wrong content type).
    BadRequest,
    /// No valid token.
    Unauthorized,
    /// A valid token that may not do this (server-wide metrics).
    Forbidden,
    /// No such session, table or route (for this tenant).
    NotFound,
    /// No session of that name (surfaces that address sessions by name).
    UnknownSession,
    /// The route does not take that method.
    MethodNotAllowed,
    /// The request is over a size limit.
    TooLarge,
    /// The request is well-formed but breaks a rule (a timeout out of
    /// range, a bad variable name...).
    Invalid,
    /// A data pointer of a run did not resolve (which one is not said).
    DataPointerUnresolved,
    /// The session's queue is full.
    QueueFull,
    /// The session is closed.
    Closed,
    /// A tenant quota is used up.
    Quota,
    /// The server is at a concurrency limit; retry shortly.
    Busy,
    /// No worker could be started.
    NoWorker,
    /// The table store failed.
    Storage,
    /// The node is draining (shutting down): it takes no new sessions or
    /// one-shot runs; retry, and a router sends the request to another
    /// node (503 with Retry-After).
    Draining,
    /// A bug or an unexpected failure of the server.
    Internal,
}

impl ErrorCode {
    /// Every code, for documentation and tests.
    pub const ALL: [ErrorCode; 17] = [
        ErrorCode::BadRequest,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::UnknownSession,
        ErrorCode::MethodNotAllowed,
        ErrorCode::TooLarge,
        ErrorCode::Invalid,
        ErrorCode::DataPointerUnresolved,
        ErrorCode::QueueFull,
        ErrorCode::Closed,
        ErrorCode::Quota,
        ErrorCode::Busy,
        ErrorCode::NoWorker,
        ErrorCode::Storage,
        ErrorCode::Draining,
        ErrorCode::Internal,
    ];

    /// The code on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::UnknownSession => "unknown_session",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::Invalid => "invalid",
            ErrorCode::DataPointerUnresolved => "data_pointer_unresolved",
            ErrorCode::QueueFull => "queue_full",
            ErrorCode::Closed => "closed",
            ErrorCode::Quota => "quota",
            ErrorCode::Busy => "busy",
            ErrorCode::NoWorker => "no_worker",
            ErrorCode::Storage => "storage",
            ErrorCode::Draining => "draining",
            ErrorCode::Internal => "internal",
        }
    }

    /// The HTTP status of this code: the one mapping every surface that
    /// speaks HTTP statuses uses (and the OpenAPI document lists).
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::NotFound | ErrorCode::UnknownSession | ErrorCode::Closed => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::TooLarge => 413,
            ErrorCode::Invalid | ErrorCode::DataPointerUnresolved => 422,
            ErrorCode::QueueFull | ErrorCode::Quota => 429,
            ErrorCode::Internal | ErrorCode::Storage => 500,
            ErrorCode::NoWorker | ErrorCode::Busy | ErrorCode::Draining => 503,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed request: a stable code and a message that says what went wrong
/// and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ServiceError {
    /// The stable code.
    pub code: ErrorCode,
    /// For a person or a model.
    pub message: String,
    /// When a retry may succeed, seconds (admission refusals): HTTP sends
    /// it as `Retry-After`, other surfaces in the error's JSON.
    pub retry_after_seconds: Option<u64>,
}

impl ServiceError {
    /// An error with `code`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retry_after_seconds: None,
        }
    }

    /// An admission refusal: 429 `quota` for a tenant's cap, 503 `busy` for
    /// a host cap, with when to retry.
    pub fn refused(r: crate::admission::Refusal) -> Self {
        let code = if r.limit.is_tenant_cap() {
            ErrorCode::Quota
        } else {
            ErrorCode::Busy
        };
        Self {
            code,
            message: r.message,
            retry_after_seconds: Some(r.retry_after_seconds),
        }
    }

    /// A rule was broken (422).
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Invalid, message)
    }

    /// `what` does not exist for this tenant (404).
    pub fn not_found(what: &str) -> Self {
        Self::new(ErrorCode::NotFound, format!("{what} not found"))
    }

    /// The request could not be read (400).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::BadRequest, message)
    }

    /// `{"code", "message"}` (and `retry_after_seconds` when set), as
    /// every surface carries it.
    pub fn to_json(&self) -> Value {
        let mut v = json!({"code": self.code.as_str(), "message": self.message});
        if let Some(s) = self.retry_after_seconds {
            v["retry_after_seconds"] = json!(s);
        }
        v
    }
}

impl From<rvisor::Rejection> for ServiceError {
    fn from(r: rvisor::Rejection) -> Self {
        let code = match &r {
            rvisor::Rejection::QueueFull(_) => ErrorCode::QueueFull,
            rvisor::Rejection::Closed => ErrorCode::Closed,
            _ => ErrorCode::Invalid,
        };
        Self::new(code, r.to_string())
    }
}

impl From<TableError> for ServiceError {
    fn from(e: TableError) -> Self {
        match e {
            TableError::Invalid(m) => Self::invalid(m),
            TableError::Quota(m) => Self::new(ErrorCode::Quota, m),
            TableError::TooLarge(m) => Self::new(ErrorCode::TooLarge, m),
            TableError::Busy(m) => Self::new(ErrorCode::Busy, m),
            e @ TableError::Io(_) => Self::new(ErrorCode::Storage, e.to_string()),
        }
    }
}

/// A session could not be made: bad options are the client's to fix, a
/// worker or host failure is the server's.
fn session_error(e: rvisor::Error) -> ServiceError {
    match e {
        rvisor::Error::Invalid(m) => ServiceError::invalid(m),
        e @ rvisor::Error::Settings(_) => ServiceError::invalid(e.to_string()),
        e @ (rvisor::Error::WorkerNotFound(_)
        | rvisor::Error::Spawn { .. }
        | rvisor::Error::Startup(_)
        | rvisor::Error::StartupTimeout(_)
        | rvisor::Error::Confinement(_)) => ServiceError::new(ErrorCode::NoWorker, e.to_string()),
        e => ServiceError::new(ErrorCode::Internal, e.to_string()),
    }
}

// ---------------------------------------------------------------------------
// Requests

/// A variable bound in R before a one-shot run.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Variable {
    /// A syntactic R name.
    pub name: String,
    /// A number, string, boolean or flat array of one of those.
    pub value: Value,
}

/// A table loaded as a data frame before a one-shot run.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DataframeRef {
    /// The pointer `POST /v1/tables` answered.
    pub data_pointer: String,
    /// The R name it is bound to.
    pub name: String,
}

/// Limits a client may ask for: each at most the server's own.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, serde::Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsRequest {
    /// Address space, MiB.
    #[serde(default, deserialize_with = "whole::opt_u64")]
    pub memory_mb: Option<u64>,
    /// Private disk (tmpfs), MiB.
    #[serde(default, deserialize_with = "whole::opt_u64")]
    pub disk_mb: Option<u64>,
    /// Processes and threads.
    #[serde(default, deserialize_with = "whole::opt_u64")]
    pub processes: Option<u64>,
    /// CPU seconds over the worker's life.
    #[serde(default, deserialize_with = "whole::opt_u64")]
    pub cpu_seconds: Option<u64>,
}

/// A one-shot run: a fresh worker, variables and tables bound first,
/// validated before anything runs.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RunScript {
    /// The R script.
    pub script: String,
    /// Wall and CPU time limit, seconds (the rules' range; default from the
    /// rules).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Variables bound before the script runs.
    #[serde(default, deserialize_with = "objects::vec")]
    pub variables: Vec<Variable>,
    /// Tables loaded as data frames before the script runs.
    #[serde(default, deserialize_with = "objects::vec")]
    pub dataframes: Vec<DataframeRef>,
    /// Tighter confinement limits for this run (never looser than the
    /// server's).
    #[serde(default, deserialize_with = "objects::opt")]
    pub limits: Option<LimitsRequest>,
}

/// Options of a new session.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, serde::Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewSession {
    /// Time limit per call, seconds (the rules' range).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Tighter confinement limits for this session's workers.
    #[serde(default, deserialize_with = "objects::opt")]
    pub limits: Option<LimitsRequest>,
    /// Plot width in pixels.
    #[serde(default, deserialize_with = "whole::opt_u32")]
    pub plot_width: Option<u32>,
    /// Plot height in pixels.
    #[serde(default, deserialize_with = "whole::opt_u32")]
    pub plot_height: Option<u32>,
}

/// One call in a session.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionRun {
    /// The R code: not blank, at most 256 KiB.
    pub code: String,
    /// Time limit for this call, seconds (the session's otherwise).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
    /// Plot width in pixels for this call (the session's otherwise).
    #[serde(default, deserialize_with = "whole::opt_u32")]
    pub plot_width: Option<u32>,
    /// Plot height in pixels for this call (the session's otherwise).
    #[serde(default, deserialize_with = "whole::opt_u32")]
    pub plot_height: Option<u32>,
}

/// Serde helpers for whole numbers: JSON may spell one `3` or `3.0`, and
/// JSON Schema (so the OpenAPI document's `integer`) calls both integers.
mod whole {
    use serde::de::{self, Deserializer, Visitor};
    use std::fmt;

    struct Whole(u64);

    impl<'de> Visitor<'de> for Whole {
        type Value = Option<u64>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "a whole number from 0 to {} (or null)", self.0)
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            if v <= self.0 {
                Ok(Some(v))
            } else {
                Err(E::invalid_value(de::Unexpected::Unsigned(v), &self))
            }
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            match u64::try_from(v) {
                Ok(v) => self.visit_u64(v),
                Err(_) => Err(E::invalid_value(de::Unexpected::Signed(v), &self)),
            }
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            // `u64::MAX as f64` is 2^64, itself out of range.
            if v.fract() == 0.0 && v >= 0.0 && v < u64::MAX as f64 {
                self.visit_u64(v as u64)
            } else {
                Err(E::invalid_value(de::Unexpected::Float(v), &self))
            }
        }
    }

    /// Up to `i64::MAX` (the OpenAPI `int64`): no limit needs more.
    pub(super) fn opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        d.deserialize_option(Whole(i64::MAX.unsigned_abs()))
    }

    pub(super) fn opt_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
        let v = d.deserialize_option(Whole(u32::MAX.into()))?;
        // In range by the visitor's bound.
        Ok(v.map(|v| u32::try_from(v).unwrap_or(u32::MAX)))
    }
}

/// Serde helpers for objects: a derived struct also decodes from an array
/// of its fields in order (`[null, null]` as a `LimitsRequest`), which the
/// OpenAPI document does not allow and no client means. These decode a
/// request type from a JSON object only.
pub mod objects {
    use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
    use std::fmt;
    use std::marker::PhantomData;

    /// A `T` that was written as a JSON object.
    #[derive(Debug)]
    pub struct Object<T>(pub T);

    struct ObjectVisitor<T>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
        type Value = Object<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object")
        }

        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
            T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Object)
        }
    }

    impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_map(ObjectVisitor(PhantomData))
        }
    }

    struct OptVisitor<T>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for OptVisitor<T> {
        type Value = Option<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON object or null")
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            Object::<T>::deserialize(d).map(|o| Some(o.0))
        }
    }

    struct VecVisitor<T>(PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for VecVisitor<T> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an array of JSON objects")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(Object(v)) = seq.next_element::<Object<T>>()? {
                out.push(v);
            }
            Ok(out)
        }
    }

    /// An optional object: absent or `null` is `None`.
    pub(super) fn opt<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        d.deserialize_option(OptVisitor(PhantomData))
    }

    /// An array of objects.
    pub(super) fn vec<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Vec<T>, D::Error> {
        d.deserialize_seq(VecVisitor(PhantomData))
    }
}

// ---------------------------------------------------------------------------
// Policy: one definition of each rule a request is checked against

/// Checks a requested timeout against the rules' range; `None` gives the
/// rules' default.
pub fn check_timeout(t: Option<f64>, rules: &SafetyRules) -> Result<Duration, ServiceError> {
    let r = &rules.timeout_seconds;
    match t {
        None => Ok(Duration::from_secs(r.default)),
        Some(t) if t.is_finite() && t >= r.min as f64 && t <= r.max as f64 => {
            Ok(Duration::from_secs_f64(t))
        }
        Some(t) => Err(ServiceError::invalid(format!(
            "timeout_seconds {t} is out of range: use {}..{} seconds",
            r.min, r.max
        ))),
    }
}

/// The server's limits tightened by `asked`; a looser value is refused.
/// `base` is `None` when the server runs unconfined.
pub fn tighter_limits(
    base: Option<&rvisor::Limits>,
    asked: Option<&LimitsRequest>,
) -> Result<Option<rvisor::Limits>, ServiceError> {
    let Some(b) = asked else { return Ok(None) };
    let Some(base) = base else {
        return Err(ServiceError::invalid(
            "limits need OS confinement, and this server runs unconfined",
        ));
    };
    let mut l = base.clone();
    let over = |what: &str, asked: u64, max: u64, unit: &str| {
        ServiceError::invalid(format!(
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
    l.check()
        .map_err(|e| ServiceError::invalid(e.to_string()))?;
    Ok(Some(l))
}

/// Checks the names a one-shot run binds: at most `max_dataframes` tables,
/// syntactic names, the variables' own rules, and no name used twice
/// (between tables, or between a table and a variable).
pub fn check_bindings(
    variables: &[(String, Value)],
    table_names: &[&str],
    rules: &SafetyRules,
) -> Result<(), ServiceError> {
    if table_names.len() > rules.max_dataframes {
        return Err(ServiceError::invalid(format!(
            "{} dataframes given; at most {} are allowed",
            table_names.len(),
            rules.max_dataframes
        )));
    }
    for n in table_names {
        if let Some(why) = rvisor::ops::name_problem(n) {
            return Err(ServiceError::invalid(format!("dataframe name: {why}")));
        }
    }
    rvisor::ops::check_variables(variables, rules)
        .map_err(|e| ServiceError::invalid(e.to_string()))?;
    let mut names = HashSet::new();
    for n in table_names {
        if !names.insert(*n) || variables.iter().any(|(v, _)| v == n) {
            return Err(ServiceError::invalid(format!(
                "the name {n:?} is used twice"
            )));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Published tables

/// Tables published during calls: (execution id, table metadata).
type Published = Arc<Mutex<Vec<(String, Value)>>>;

/// Every session of `st` with its tenant (the map's lock is held only to
/// copy the handles).
fn live_view(st: &ServiceState) -> Vec<(String, Session)> {
    lock(&st.sessions)
        .values()
        .map(|e| (e.tenant.clone(), e.session.clone()))
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes the tables published by call `execution_id`.
fn take_published(p: &Published, execution_id: &str) -> Vec<Value> {
    let mut all = lock(p);
    let (mine, rest): (Vec<_>, Vec<_>) = all.drain(..).partition(|(id, _)| id == execution_id);
    *all = rest;
    mine.into_iter().map(|(_, v)| v).collect()
}

/// The built-in tool behind `rvisor_publish(df)`: stores the CSV the R
/// code wrote (in its own temporary directory) as a table of `tenant`, and
/// records it for the result's `published` list.
fn publish_tool(store: Arc<TableStore>, tenant: String, record: Published) -> rvisor::Tool {
    let tool = rvisor::Tool::new(
        "rvisor.publish",
        "Publish a data frame as a data pointer",
        json!({"type": "object", "properties": {"path": {"type": "string"}, "name": {"type": "string"}}}),
        move |call| {
            let path = call.args["path"].as_str().ok_or("path is missing")?;
            let name = call.args["name"].as_str().unwrap_or("");
            // Copied to a spool file in pieces, then converted in bounded
            // memory: a big data frame is never whole in the supervisor.
            let mut src = rvisor::tools::open_worker_file(call, path).map_err(|e| e.to_string())?;
            let spool = store.spool_path();
            let copied = std::fs::File::create(&spool)
                .and_then(|mut dst| std::io::copy(&mut src, &mut dst))
                .map_err(|e| format!("failed to copy the published table: {e}"));
            let meta = copied.and_then(|_| {
                store
                    .put_file(&tenant, TableFormat::Csv, &spool)
                    .map_err(|e| e.to_string())
            });
            let _ = std::fs::remove_file(&spool);
            let meta = meta?;
            let mut v = serde_json::to_value(&meta).map_err(|e| e.to_string())?;
            if !name.is_empty() {
                v["name"] = json!(name);
            }
            lock(&record).push((call.execution_id.clone(), v.clone()));
            Ok(v)
        },
    );
    // The name is a constant that matches the rules.
    tool.unwrap_or_else(|e| unreachable!("{e}"))
}

// ---------------------------------------------------------------------------
// Metrics

/// The surface a request came in on (metrics label it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Surface {
    /// `rvisor serve`.
    Http,
    /// `rvisor serve --nng`.
    Nng,
    /// `rvisor mcp`.
    Mcp,
    /// `rvisor session --jsonl`.
    Jsonl,
}

impl Surface {
    fn as_str(self) -> &'static str {
        match self {
            Surface::Http => "http",
            Surface::Nng => "nng",
            Surface::Mcp => "mcp",
            Surface::Jsonl => "jsonl",
        }
    }
}

const BUCKETS: [f64; 10] = [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 300.0];

#[derive(Debug, Default)]
struct Metrics {
    by_outcome: Mutex<BTreeMap<String, u64>>,
    /// Call latency histogram: counts of calls at or under each bound (s).
    buckets: [AtomicU64; 10],
    sum_micros: AtomicU64,
    count: AtomicU64,
    requests: Mutex<BTreeMap<Surface, u64>>,
    /// Per tenant: what `/v1/usage` shows that tenant.
    tenants: Mutex<HashMap<String, CallTotals>>,
}

/// One tenant's use of the service since it started.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct CallTotals {
    /// Calls by outcome (one-shot runs and session calls).
    pub calls: BTreeMap<String, u64>,
    /// CPU time the calls used, milliseconds.
    pub cpu_ms: f64,
    /// Wall time from request to result, milliseconds.
    pub wall_ms: f64,
}

/// What a tenant sees of its own use: `/v1/usage`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct UsageReport {
    /// The tenant.
    pub tenant: String,
    /// Sessions open now.
    pub sessions: usize,
    /// Tables stored now.
    pub tables: usize,
    /// Bytes those tables take.
    pub table_bytes: u64,
    /// Calls since the server started.
    #[serde(flatten)]
    pub since_start: CallTotals,
}

impl Metrics {
    fn record(&self, tenant: &str, r: &RunResult, took: Duration) {
        *lock(&self.by_outcome)
            .entry(r.outcome.to_string())
            .or_default() += 1;
        {
            let mut t = lock(&self.tenants);
            let u = t.entry(tenant.to_string()).or_default();
            *u.calls.entry(r.outcome.to_string()).or_default() += 1;
            u.cpu_ms += r.usage.cpu_ms;
            u.wall_ms += took.as_secs_f64() * 1000.0;
        }
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

// ---------------------------------------------------------------------------
// The service

/// How the service runs.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// Bearer token -> tenant; `None` serves one local tenant without auth.
    pub tokens: Option<HashMap<String, String>>,
    /// Where tables are stored, their lifetime and quotas.
    pub tables: TableConfig,
    /// Tenants whose tokens may read the server-wide metrics (with
    /// tokens; without them the one local user may).
    pub operators: Vec<String>,
    /// Sessions one tenant may hold open; one more is refused (429
    /// `quota`) until one closes.
    pub max_sessions_per_tenant: usize,
    /// Sessions of all tenants together.
    pub max_sessions: usize,
    /// Live sessions, calls per tenant and the workers' memory budget
    /// (`crate::admission`).
    pub admission: crate::admission::AdmissionConfig,
    /// Where sessions are kept durable (records, checkpoints, leases;
    /// docs/sessions.md). Its [`SessionStore::checkpoints`] must be the
    /// supervisor's checkpoint store. With it, sessions survive a restart
    /// (and move between nodes); without it they end with the process.
    pub durable: Option<Arc<SessionStore>>,
    /// With `durable`: a session unused this long (no checkpoint written,
    /// not leased by a live node) is deleted. `None`: kept until closed.
    pub session_ttl: Option<Duration>,
}

/// Default of [`ServiceConfig::session_ttl`]: 7 days.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

impl Default for ServiceConfig {
    fn default() -> Self {
        Self {
            tokens: None,
            tables: TableConfig::default(),
            operators: Vec::new(),
            max_sessions_per_tenant: 32,
            max_sessions: 512,
            admission: crate::admission::AdmissionConfig::default(),
            durable: None,
            session_ttl: Some(DEFAULT_SESSION_TTL),
        }
    }
}

/// `/readyz`: whether the node takes new work, and why not.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Readiness {
    /// All checks pass.
    pub ready: bool,
    /// This node's id (`rvisor serve --node-id`), if it has one.
    pub node_id: Option<String>,
    /// Workers can be made (the zygote is up).
    pub zygote: bool,
    /// The shared store answered.
    pub store: bool,
    /// The node is draining.
    pub draining: bool,
    /// Why it is not ready (empty when it is).
    pub reasons: Vec<String>,
}

/// `POST /v1/admin/drain`: the drain's state.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct DrainStatus {
    /// This node's id, if it has one.
    pub node_id: Option<String>,
    /// Whether the node is draining.
    pub draining: bool,
    /// Sessions open on this node.
    pub sessions: usize,
    /// Calls running or queued now (session calls and one-shot runs).
    pub calls_in_flight: usize,
}

/// How long one session's release (its last checkpoint) may take at a
/// drain or shutdown.
const RELEASE_WITHIN: Duration = Duration::from_secs(30);

/// How often the store is swept for sessions past the TTL (at most; more
/// often for a shorter TTL).
const SESSION_SWEEP_EVERY: Duration = Duration::from_secs(600);

/// The tenant of every request when the service runs without tokens.
pub const LOCAL_TENANT: &str = "local";

#[derive(Debug)]
struct Entry {
    tenant: String,
    session: Session,
    published: Published,
}

/// The service every surface calls. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Service {
    inner: Arc<ServiceState>,
}

#[derive(Debug)]
struct ServiceState {
    sup: Supervisor,
    cfg: ServiceConfig,
    tables: Arc<TableStore>,
    /// Session id -> its tenant, the session, the tables it published.
    sessions: Mutex<HashMap<String, Entry>>,
    /// (tenant, name) -> session id, for surfaces that name sessions.
    names: Mutex<HashMap<(String, String), String>>,
    metrics: Metrics,
    /// Draining, and the calls in flight (docs/scale-out.md).
    drain: crate::cluster::Drain,
    /// The last answer of the shared store to readiness, and when.
    store_check: Mutex<Option<(Instant, Result<(), String>)>>,
    admission: Arc<crate::admission::Admission>,
    /// Dropped with the service: stops the admission's memory monitor.
    _monitor: std::sync::mpsc::Sender<()>,
    /// Held while a session is resumed from the store, so that two
    /// requests for it resume it once.
    adopting: Mutex<()>,
    /// Held while sessions are released, so that a shutdown racing a
    /// drain's hand-off waits for its checkpoints.
    releasing: Mutex<()>,
    /// Tells the maintenance thread (leases, TTL sweep) to stop.
    stop: Arc<(Mutex<bool>, Condvar)>,
}

impl Drop for ServiceState {
    fn drop(&mut self) {
        let (m, cv) = &*self.stop;
        *lock(m) = true;
        cv.notify_all();
    }
}

/// A session call in flight: resolve it with [`PendingCall::wait`] or
/// `.await` ([`PendingCall::finish`]); either records the metrics and
/// attaches the tables the call published.
#[derive(Debug)]
pub struct PendingCall {
    handle: CallHandle,
    published: Published,
    started: Instant,
    service: Service,
    cancel: CancelToken,
    tenant: String,
    /// Counts the call as in flight (a drain waits for it) until it ends.
    in_flight: crate::cluster::InFlight,
}

impl PendingCall {
    /// The call's execution id.
    pub fn execution_id(&self) -> &str {
        self.handle.execution_id()
    }

    fn complete(
        published: &Published,
        service: &Service,
        tenant: &str,
        started: Instant,
        mut r: RunResult,
    ) -> RunResult {
        r.published = take_published(published, &r.execution_id.clone());
        service.inner.metrics.record(tenant, &r, started.elapsed());
        r
    }

    /// Cancels this call alone (queued: it leaves the queue; running: it
    /// is interrupted); the session and its other calls go on.
    pub fn cancel_token(&self) -> CancelToken {
        self.cancel.clone()
    }

    /// Blocks until the call ends.
    pub fn wait(self) -> RunResult {
        let r = self.handle.wait();
        self.cancel.clear();
        drop(self.in_flight);
        Self::complete(
            &self.published,
            &self.service,
            &self.tenant,
            self.started,
            r,
        )
    }

    /// The call's events as they happen, ending with its result (with the
    /// tables it published; the metrics are recorded then). Dropping the
    /// stream before the result cancels the call (a client that left).
    /// Only a call queued with [`Service::session_run_streaming`] streams
    /// its events; others give their result alone.
    pub fn events(self) -> ServiceEvents {
        let PendingCall {
            handle,
            published,
            started,
            service,
            cancel,
            tenant,
            in_flight,
        } = self;
        ServiceEvents {
            events: handle.events(),
            guard: Some(CancelOnDrop::new(cancel.clone())),
            cancel,
            done: Some((published, service, tenant, started)),
            ahead: None,
            in_flight: Some(in_flight),
        }
    }

    /// Waits for the call without blocking a thread. If this future is
    /// dropped before the call ends (an HTTP client that closed its
    /// connection), the call is cancelled.
    pub async fn finish(self) -> RunResult {
        let PendingCall {
            handle,
            published,
            started,
            service,
            cancel,
            tenant,
            in_flight,
        } = self;
        let guard = CancelOnDrop::new(cancel.clone());
        let r = handle.await;
        guard.disarm();
        cancel.clear();
        drop(in_flight);
        Self::complete(&published, &service, &tenant, started, r)
    }
}

/// The events of a session call ([`PendingCall::events`]).
#[derive(Debug)]
pub struct ServiceEvents {
    events: Events,
    guard: Option<CancelOnDrop>,
    cancel: CancelToken,
    done: Option<(Published, Service, String, Instant)>,
    /// An event read ahead (see [`ServiceEvents::put_back`]).
    ahead: Option<CallEvent>,
    /// A session call counts as in flight (a drain waits for it) until its
    /// result has passed.
    in_flight: Option<crate::cluster::InFlight>,
}

impl ServiceEvents {
    /// The events of a one-shot run fed by [`Service::run_script_streaming`]
    /// with `cancel`: dropping them before the result cancels the run.
    pub fn of_run(events: Events, cancel: CancelToken) -> Self {
        Self {
            events,
            guard: Some(CancelOnDrop::new(cancel.clone())),
            cancel,
            done: None,
            in_flight: None,
            ahead: None,
        }
    }

    /// Makes `e` (just read) the next event again.
    pub fn put_back(&mut self, e: CallEvent) {
        self.ahead = Some(e);
    }

    /// The call's execution id.
    pub fn execution_id(&self) -> &str {
        self.events.execution_id()
    }

    fn finish(&mut self, mut e: CallEvent) -> CallEvent {
        if let EventKind::Result { result } = &mut e.kind {
            if let Some(g) = self.guard.take() {
                g.disarm();
            }
            self.cancel.clear();
            self.in_flight = None;
            if let Some((published, service, tenant, started)) = self.done.take() {
                let r = std::mem::replace(
                    result.as_mut(),
                    RunResult::empty(String::new(), String::new()),
                );
                **result = PendingCall::complete(&published, &service, &tenant, started, r);
            }
        }
        e
    }

    /// Blocks until the next event; `None` after the result.
    pub fn next_blocking(&mut self) -> Option<CallEvent> {
        if let Some(e) = self.ahead.take() {
            return Some(e);
        }
        let e = self.events.next()?;
        Some(self.finish(e))
    }

    /// The next event without blocking a thread; `None` after the result.
    pub async fn next(&mut self) -> Option<CallEvent> {
        if let Some(e) = self.ahead.take() {
            return Some(e);
        }
        let e = self.events.next_event().await?;
        Some(self.finish(e))
    }

    /// The poll form of [`ServiceEvents::next`].
    pub fn poll_next(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<CallEvent>> {
        if let Some(e) = self.ahead.take() {
            return std::task::Poll::Ready(Some(e));
        }
        match self.events.poll_next(cx) {
            std::task::Poll::Ready(Some(e)) => std::task::Poll::Ready(Some(self.finish(e))),
            other => other,
        }
    }
}

impl Service {
    /// A service over `sup`, with its table store opened (or made) in
    /// `cfg.tables.dir`.
    pub fn new(sup: Supervisor, cfg: ServiceConfig) -> std::io::Result<Self> {
        let tables = Arc::new(TableStore::open(cfg.tables.clone())?);
        let admission = Arc::new(crate::admission::Admission::new(
            cfg.admission.clone(),
            sup.config().checkpoints.is_some(),
        ));
        let (stop_monitor, monitor_stopped) = std::sync::mpsc::channel();
        let svc = Self {
            inner: Arc::new(ServiceState {
                sup,
                cfg,
                tables,
                sessions: Mutex::new(HashMap::new()),
                names: Mutex::new(HashMap::new()),
                metrics: Metrics::default(),
                drain: crate::cluster::Drain::default(),
                store_check: Mutex::new(None),
                admission: admission.clone(),
                _monitor: stop_monitor,
                adopting: Mutex::new(()),
                releasing: Mutex::new(()),
                stop: Arc::new((Mutex::new(false), Condvar::new())),
            }),
        };
        if let Some(d) = svc.inner.cfg.durable.clone() {
            svc.resume_all(&d).map_err(|e| {
                std::io::Error::other(format!(
                    "could not read the sessions kept in {}: {e}",
                    d.url()
                ))
            })?;
            svc.start_maintenance(d);
        }
        let state = Arc::downgrade(&svc.inner);
        admission.spawn_monitor(
            move || state.upgrade().map(|st| live_view(&st)),
            monitor_stopped,
        );
        Ok(svc)
    }

    /// Every session with its tenant, for admission control.
    fn sessions_view(&self) -> Vec<(String, Session)> {
        live_view(&self.inner)
    }

    /// The supervisor underneath.
    pub fn supervisor(&self) -> &Supervisor {
        &self.inner.sup
    }

    /// The rules every request is checked against (health reports them).
    pub fn rules(&self) -> &SafetyRules {
        &self.inner.sup.config().rules
    }

    /// Whether requests need a token.
    pub fn requires_auth(&self) -> bool {
        self.inner.cfg.tokens.is_some()
    }

    /// The tenant of `token` (the local tenant when the service has no
    /// tokens). `how` tells the client where its surface takes the token.
    pub fn authenticate(&self, token: Option<&str>, how: &str) -> Result<String, ServiceError> {
        match &self.inner.cfg.tokens {
            None => Ok(LOCAL_TENANT.to_string()),
            Some(map) => token
                .map(str::trim)
                .and_then(|t| map.get(t))
                .cloned()
                .ok_or_else(|| {
                    ServiceError::new(ErrorCode::Unauthorized, format!("send a valid token {how}"))
                }),
        }
    }

    /// Counts a request of `surface`.
    pub fn count_request(&self, surface: Surface) {
        *lock(&self.inner.metrics.requests)
            .entry(surface)
            .or_default() += 1;
    }

    /// Liveness, versions, the live rules and workers, with the number of
    /// open sessions.
    pub fn health(&self) -> Value {
        let mut h = self.inner.sup.health();
        h.style_engine = style_engine(self.inner.sup.config().style);
        let mut v = serde_json::to_value(&h).unwrap_or_default();
        v["workers"]["sessions"] = json!(lock(&self.inner.sessions).len());
        // The service's own admission limits and their use, beside the
        // request rules.
        let mut admission = self.inner.admission.report(self.sessions_view());
        admission["max_sessions_per_tenant"] = json!(self.inner.cfg.max_sessions_per_tenant);
        admission["max_sessions"] = json!(self.inner.cfg.max_sessions);
        v["admission"] = admission;
        v["node_id"] = json!(self.inner.sup.config().node_id);
        v["draining"] = json!(self.inner.drain.is_draining());
        v
    }

    /// Refuses new work while the node drains (retryable: another node
    /// takes it).
    fn admit(&self) -> Result<(), ServiceError> {
        if self.inner.drain.is_draining() {
            return Err(ServiceError::new(
                ErrorCode::Draining,
                "this node is draining (shutting down) and takes no new sessions or runs; retry \
                 in a moment: a router sends the request to another node. Existing sessions of \
                 this node still answer until it exits",
            ));
        }
        Ok(())
    }

    /// The drain state: draining, calls in flight.
    pub fn drain_state(&self) -> &crate::cluster::Drain {
        &self.inner.drain
    }

    /// Starts draining (SIGTERM, `POST /v1/admin/drain`): readiness goes
    /// false, new sessions and one-shot runs are refused with `draining`,
    /// existing sessions keep answering. Idempotent. The answer is the
    /// drain's state.
    pub fn start_drain(&self) -> DrainStatus {
        if self.inner.drain.start() {
            tracing::info!(target: "rvisor::cluster", "draining: new sessions and runs are refused");
        }
        self.drain_status()
    }

    /// What a drain has left: sessions open, calls in flight.
    pub fn drain_status(&self) -> DrainStatus {
        DrainStatus {
            node_id: self.inner.sup.config().node_id.clone(),
            draining: self.inner.drain.is_draining(),
            sessions: lock(&self.inner.sessions).len(),
            calls_in_flight: self.inner.drain.in_flight(),
        }
    }

    /// Blocks until the calls in flight have ended or `grace` has passed
    /// (true: none left), then runs the hand-off step. Sessions stay open:
    /// the caller exits, which ends them.
    pub fn finish_drain(&self, grace: Duration) -> bool {
        let idle = self.inner.drain.wait_idle(grace);
        if !idle {
            tracing::warn!(
                target: "rvisor::cluster",
                calls = self.inner.drain.in_flight(),
                "the drain grace ended with calls still running; they end with the process"
            );
        }
        self.hand_off();
        idle
    }

    /// The drain's hand-off step: every session is checkpointed into the
    /// store and its lease released, so that a restart of this node or
    /// another node restores it on its next call. Without a store a
    /// drained node's sessions end with it (their next call answers 404).
    fn hand_off(&self) {
        if self.inner.cfg.durable.is_some() {
            self.release_all(RELEASE_WITHIN);
            return;
        }
        let n = lock(&self.inner.sessions).len();
        if n > 0 {
            tracing::warn!(
                target: "rvisor::cluster",
                sessions = n,
                "sessions are not handed off (the server keeps no state: --state-dir or --store): \
                 they end with this node"
            );
        }
    }

    /// Whether this node should get new work (`/readyz`): workers can be
    /// made (the zygote is up, or spawning is allowed), the shared store
    /// answers, and the node is not draining. Cheap: the store's answer is
    /// kept for a second.
    pub fn readiness(&self) -> Readiness {
        let pool = self.inner.sup.pool_status();
        let zygote = match pool.mode {
            rvisor::PoolMode::Zygote => true,
            rvisor::PoolMode::Spawn => !self.inner.sup.config().pool.zygote,
            rvisor::PoolMode::Starting => false,
        };
        let store = {
            let mut c = lock(&self.inner.store_check);
            match &*c {
                Some((at, r)) if at.elapsed() < Duration::from_secs(1) => r.clone(),
                _ => {
                    let r = self
                        .inner
                        .tables
                        .store()
                        .reachable(Duration::from_secs(2))
                        .map_err(|e| e.to_string());
                    *c = Some((Instant::now(), r.clone()));
                    r
                }
            }
        };
        let draining = self.inner.drain.is_draining();
        let mut reasons = Vec::new();
        if !zygote {
            reasons.push(format!(
                "workers cannot be made yet (pool {:?}{})",
                pool.mode,
                pool.last_error
                    .as_deref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            ));
        }
        if let Err(e) = &store {
            reasons.push(format!("the shared store does not answer: {e}"));
        }
        if draining {
            reasons.push("the node is draining".into());
        }
        Readiness {
            ready: reasons.is_empty(),
            node_id: self.inner.sup.config().node_id.clone(),
            zygote,
            store: store.is_ok(),
            draining,
            reasons,
        }
    }

    /// Installed packages a script can `library()`.
    pub fn packages(&self) -> Result<Vec<rvisor::Package>, ServiceError> {
        self.inner
            .sup
            .packages()
            .map_err(|e| ServiceError::new(ErrorCode::NoWorker, e.to_string()))
    }

    /// Validation with style notes: runs nothing. Every surface (HTTP, nng,
    /// MCP, `rvisor validate`) comes here.
    pub fn validate(&self, script: &str) -> rvisor::Validation {
        validate(&self.inner.sup, script)
    }

    /// A one-shot run in a fresh worker, for `tenant`. Blocks until it
    /// ends. A script that fails validation is not run: the answer is a
    /// result with outcome `rejected` and the validation.
    ///
    /// `cancel` stops the run from another thread (the client left): it
    /// then ends as `cancelled`.
    pub fn run_script(
        &self,
        tenant: &str,
        req: RunScript,
        surface: Surface,
        cancel: &CancelToken,
    ) -> Result<RunResult, ServiceError> {
        self.run_script_events(tenant, req, surface, cancel, None)
    }

    /// [`Service::run_script`] streamed: the run's events go to `feed`
    /// while it runs, its result last (also when it was rejected). `Err`
    /// (nothing ran, nothing was fed): the request itself was refused.
    pub fn run_script_streaming(
        &self,
        tenant: &str,
        req: RunScript,
        surface: Surface,
        cancel: &CancelToken,
        feed: &EventFeed,
    ) -> Result<RunResult, ServiceError> {
        let r = self.run_script_events(tenant, req, surface, cancel, Some(feed))?;
        feed.finish(&r);
        Ok(r)
    }

    fn run_script_events(
        &self,
        tenant: &str,
        req: RunScript,
        surface: Surface,
        cancel: &CancelToken,
        feed: Option<&EventFeed>,
    ) -> Result<RunResult, ServiceError> {
        let _ = surface;
        self.admit()?;
        let _in_flight = self.inner.drain.enter();
        let sup = &self.inner.sup;
        let rules = self.rules();
        let timeout = check_timeout(req.timeout_seconds, rules)?;
        let limits = tighter_limits(self.server_limits(), req.limits.as_ref())?;
        let variables: Vec<(String, Value)> = req
            .variables
            .into_iter()
            .map(|v| (v.name, v.value))
            .collect();
        let names: Vec<&str> = req.dataframes.iter().map(|d| d.name.as_str()).collect();
        check_bindings(&variables, &names, rules)?;
        let pointers: Vec<&str> = req
            .dataframes
            .iter()
            .map(|d| d.data_pointer.as_str())
            .collect();
        // All or nothing, and one answer for every failure (unknown,
        // expired, deleted, another tenant's): it does not say which
        // pointer or why.
        let Some(files) = self.inner.tables.resolve(tenant, &pointers) else {
            return Err(ServiceError::new(
                ErrorCode::DataPointerUnresolved,
                "one or more data pointers could not be resolved; nothing ran",
            ));
        };
        let tables: Vec<(String, PathBuf)> =
            names.iter().map(|n| n.to_string()).zip(files).collect();
        let started = Instant::now();
        let script = req.script;
        let id = match feed {
            Some(f) => f.execution_id().to_string(),
            None => rvisor::ids::execution_id(),
        };
        // A run checks problems only; style notes are for validation.
        let v = sup.validate_with(&script, rvisor::StyleEngine::None);
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
            self.inner.metrics.record(tenant, &r, started.elapsed());
            return Ok(r);
        }
        let published: Published = Arc::new(Mutex::new(Vec::new()));
        let publish = publish_tool(
            self.inner.tables.clone(),
            tenant.to_string(),
            published.clone(),
        );
        let opts = CallOptions::one_shot(Some(timeout));
        let ctx = CallContext {
            variables,
            tables,
            tools: Arc::new(vec![publish]),
            cancel: Some(cancel.clone()),
            ..CallContext::default()
        };
        let mut r = match feed {
            None => sup.run_once_limited(id, &script, &opts, &ctx, limits.as_ref(), None),
            Some(f) => {
                sup.run_once_streaming(id, &script, &opts, &ctx, limits.as_ref(), None, &f.sink())
            }
        };
        r.published = take_published(&published, &r.execution_id.clone());
        self.inner.metrics.record(tenant, &r, started.elapsed());
        if matches!(r.outcome, Outcome::StartupFailed | Outcome::StartupTimedOut) {
            return Err(ServiceError::new(
                ErrorCode::NoWorker,
                r.error.map(|e| e.message).unwrap_or_default(),
            ));
        }
        Ok(r)
    }

    fn server_limits(&self) -> Option<&rvisor::Limits> {
        self.inner
            .sup
            .config()
            .worker
            .confine
            .as_ref()
            .map(|c| &c.limits)
    }

    /// A new session of `tenant`.
    pub fn create_session(
        &self,
        tenant: &str,
        req: NewSession,
    ) -> Result<SessionStatus, ServiceError> {
        let s = self.open(tenant, Some(req), None)?;
        Ok(s.status())
    }

    /// The options of a session made with `req` (`None`: the server's
    /// defaults, as for named sessions).
    fn session_options(&self, req: Option<&NewSession>) -> Result<SessionOptions, ServiceError> {
        let defaults = self.inner.sup.config().defaults.clone();
        let Some(req) = req else {
            return Ok(defaults);
        };
        let mut opts = SessionOptions {
            timeout: check_timeout(req.timeout_seconds, self.rules())?,
            ..defaults
        };
        if let Some(w) = req.plot_width {
            opts.plot_width = w;
        }
        if let Some(h) = req.plot_height {
            opts.plot_height = h;
        }
        opts.limits = tighter_limits(self.server_limits(), req.limits.as_ref())?;
        Ok(opts)
    }

    /// A new session of `tenant`, made with `req` and named `name`; kept
    /// durable (record, lease) when the service has a store.
    fn open(
        &self,
        tenant: &str,
        req: Option<NewSession>,
        name: Option<&str>,
    ) -> Result<Session, ServiceError> {
        self.admit()?;
        let opts = self.session_options(req.as_ref())?;
        let (s, _) = self.insert_session(tenant, opts, true, |sup, opts| sup.session_with(opts))?;
        if let Some(d) = &self.inner.cfg.durable {
            let rec = SessionRecord {
                id: s.id().to_string(),
                tenant: tenant.to_string(),
                name: name.map(str::to_string),
                created_unix: rvisor::clock::unix_now(),
                options: req.map(|r| serde_json::to_value(r).unwrap_or_default()),
            };
            let kept = d
                .take(s.id(), Duration::ZERO)
                .map_err(|e| format!("{e:?}"))
                .and_then(|()| d.put_record(&rec).map_err(|e| e.to_string()));
            if let Err(e) = kept {
                lock(&self.inner.sessions).remove(s.id());
                s.close();
                d.delete_session(tenant, s.id());
                return Err(ServiceError::new(
                    ErrorCode::Storage,
                    format!(
                        "the session could not be recorded in the store {} ({e}); \
                         nothing was kept, retry when the store answers",
                        d.url()
                    ),
                ));
            }
        }
        Ok(s)
    }

    /// Makes a session with `make` and enters it in the map of `tenant`,
    /// within the session caps when it is `new` (a session resumed from
    /// the store exists already: lowering a cap must not make it
    /// unreachable).
    fn insert_session(
        &self,
        tenant: &str,
        mut opts: SessionOptions,
        new: bool,
        make: impl FnOnce(&Supervisor, SessionOptions) -> Result<Session, rvisor::Error>,
    ) -> Result<(Session, Published), ServiceError> {
        let published: Published = Arc::new(Mutex::new(Vec::new()));
        opts.tools.push(publish_tool(
            self.inner.tables.clone(),
            tenant.to_string(),
            published.clone(),
        ));
        if self.inner.cfg.durable.is_some() {
            // The store keys checkpoints by tenant (a bare supervisor
            // store, as `session --jsonl` has, by session id).
            opts.checkpoint_prefix = crate::durable::checkpoint_prefix(tenant);
        }
        // Admission: counted and inserted under one lock, so racing
        // creations cannot pass the caps together.
        let mut sessions = lock(&self.inner.sessions);
        let cfg = &self.inner.cfg;
        let mine = sessions.values().filter(|e| e.tenant == tenant).count();
        if new && mine >= cfg.max_sessions_per_tenant {
            return Err(ServiceError::new(
                ErrorCode::Quota,
                format!(
                    "you have {mine} sessions open, the most allowed; close one \
                     (DELETE /v1/sessions/{{id}}) before opening another"
                ),
            ));
        }
        if new && sessions.len() >= cfg.max_sessions {
            return Err(ServiceError::new(
                ErrorCode::Quota,
                format!(
                    "the server holds {} sessions, the most it admits; retry later",
                    sessions.len()
                ),
            ));
        }
        let s = make(&self.inner.sup, opts).map_err(session_error)?;
        sessions.insert(
            s.id().to_string(),
            Entry {
                tenant: tenant.to_string(),
                session: s.clone(),
                published: published.clone(),
            },
        );
        Ok((s, published))
    }

    fn find(&self, tenant: &str, id: &str) -> Result<(Session, Published), ServiceError> {
        match lock(&self.inner.sessions).get(id) {
            Some(e) if e.tenant == tenant => return Ok((e.session.clone(), e.published.clone())),
            // Another tenant's session answers exactly like an unknown one.
            Some(_) => return Err(ServiceError::not_found("session")),
            None => {}
        }
        match &self.inner.cfg.durable {
            Some(d) => self.adopt(d, tenant, id),
            None => Err(ServiceError::not_found("session")),
        }
    }

    /// A session this process does not hold but the store keeps (this
    /// server restarted and lost it to another node earlier, or its node
    /// was drained or lost): taken over (its lease, waiting for a dead
    /// owner's to expire) and resumed from its checkpoint.
    fn adopt(
        &self,
        d: &Arc<SessionStore>,
        tenant: &str,
        id: &str,
    ) -> Result<(Session, Published), ServiceError> {
        let _one = lock(&self.inner.adopting);
        if let Some(e) = lock(&self.inner.sessions).get(id) {
            return if e.tenant == tenant {
                Ok((e.session.clone(), e.published.clone()))
            } else {
                Err(ServiceError::not_found("session"))
            };
        }
        let storage = |e: String| {
            ServiceError::new(
                ErrorCode::Storage,
                format!("the session store {} failed ({e}); retry shortly", d.url()),
            )
        };
        let Some(rec) = d
            .get_record(tenant, id)
            .map_err(|e| storage(e.to_string()))?
        else {
            return Err(ServiceError::not_found("session"));
        };
        self.admit()?;
        // Held by a live node: ask it to hand the session over, then wait
        // for its release (or for the lease of a dead one to run out).
        let mut took = d.take(id, Duration::ZERO);
        if matches!(took, Err(TakeError::Held { .. })) {
            if let Err(e) = d.request_handoff(id) {
                return Err(storage(e.to_string()));
            }
            took = d.take(id, d.lease_ttl() + Duration::from_secs(2));
            d.handoff_done(id);
        }
        match took {
            Ok(()) => {}
            Err(TakeError::Held {
                holder,
                expires_unix,
            }) => {
                return Err(ServiceError::new(
                    ErrorCode::Busy,
                    format!(
                        "session {id} is running on node {holder}, which holds it for {} s more; \
                         retry, or send the request to that node",
                        expires_unix.saturating_sub(rvisor::clock::unix_now())
                    ),
                ))
            }
            Err(TakeError::Store(e)) => return Err(storage(e)),
        }
        let reason = match (
            crate::cluster::node_of(id),
            &self.inner.sup.config().node_id,
        ) {
            (Some(n), Some(me)) if n != me => rvisor::RESUMED_MOVED,
            _ => rvisor::RESUMED_RESTART,
        };
        let found = self.resume(tenant, &rec, reason);
        if found.is_err() {
            d.release(id);
        }
        found
    }

    /// Enters the session of `rec` from the store (its state is restored
    /// by its next call).
    fn resume(
        &self,
        tenant: &str,
        rec: &SessionRecord,
        reason: &str,
    ) -> Result<(Session, Published), ServiceError> {
        let req = match &rec.options {
            Some(v) => Some(NewSession::deserialize(v).map_err(|e| {
                ServiceError::new(
                    ErrorCode::Storage,
                    format!(
                        "the stored record of session {} is unreadable ({e})",
                        rec.id
                    ),
                )
            })?),
            None => None,
        };
        let opts = self.session_options(req.as_ref())?;
        let found = self.insert_session(tenant, opts, false, |sup, opts| {
            sup.resume_session(&rec.id, opts, reason)
        })?;
        if let Some(name) = &rec.name {
            lock(&self.inner.names).insert((tenant.to_string(), name.clone()), rec.id.clone());
        }
        tracing::info!(target: "rvisor::sessions", session = %rec.id, reason, "resumed from the store");
        Ok(found)
    }

    /// At start: every session the store keeps for this node (all of them
    /// for a server without a node id), resumed lazily (nothing is read
    /// but the records until a session's next call). A session another
    /// live node holds is left to it.
    fn resume_all(&self, d: &Arc<SessionStore>) -> Result<(), crate::blob::BlobError> {
        let me = self.inner.sup.config().node_id.clone();
        let mut resumed = 0;
        for rec in d.records()? {
            let mine = match (&me, crate::cluster::node_of(&rec.id)) {
                (Some(me), Some(n)) => n == me,
                (None, _) => true,
                (Some(_), None) => false,
            };
            if !mine || d.take(&rec.id, Duration::ZERO).is_err() {
                continue;
            }
            match self.resume(&rec.tenant, &rec, rvisor::RESUMED_RESTART) {
                Ok(_) => resumed += 1,
                Err(e) => {
                    d.release(&rec.id);
                    tracing::warn!(target: "rvisor::sessions", session = %rec.id, "not resumed: {e}");
                }
            }
        }
        if resumed > 0 {
            eprintln!(
                "rvisor serve: {resumed} sessions kept in {} go on (restored at their next call)",
                d.url()
            );
        }
        Ok(())
    }

    /// The thread that renews this node's leases (dropping the sessions
    /// another node took) and deletes sessions past the TTL. Ends with the
    /// service.
    fn start_maintenance(&self, d: Arc<SessionStore>) {
        let weak = Arc::downgrade(&self.inner);
        let stop = self.inner.stop.clone();
        let ttl = self.inner.cfg.session_ttl;
        let every = d.lease_ttl() / 3;
        let spawned = std::thread::Builder::new()
            .name("rvisor-durable".into())
            .spawn(move || {
                let mut last_sweep: Option<Instant> = None;
                loop {
                    {
                        let (m, cv) = &*stop;
                        let g = lock(m);
                        let (g, _) = cv
                            .wait_timeout_while(g, every, |stopped| !*stopped)
                            .unwrap_or_else(|e| e.into_inner());
                        if *g {
                            return;
                        }
                    }
                    let Some(inner) = weak.upgrade() else { return };
                    let svc = Service { inner };
                    svc.answer_handoffs(&d);
                    for id in d.renew() {
                        tracing::warn!(target: "rvisor::sessions", session = %id,
                            "another node took this session over (our lease lapsed): dropping our copy");
                        if let Some(e) = svc.forget(&id) {
                            e.session.abandon();
                        }
                    }
                    let sweep_every = ttl.map_or(SESSION_SWEEP_EVERY, |t| t.min(SESSION_SWEEP_EVERY));
                    let sweep_due = last_sweep.is_none_or(|t| t.elapsed() >= sweep_every);
                    if let (Some(ttl), true) = (ttl, sweep_due) {
                        last_sweep = Some(Instant::now());
                        svc.sweep_expired(&d, ttl);
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(target: "rvisor::sessions", "no lease renewal thread: {e}");
        }
    }

    /// Releases the sessions other nodes asked for (after their running
    /// call; see `durable`'s module docs).
    fn answer_handoffs(&self, d: &SessionStore) {
        let asked = match d.handoff_requests() {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(target: "rvisor::sessions", "could not read hand-off requests: {e}");
                return;
            }
        };
        for id in asked {
            if let Some(e) = self.forget(&id) {
                if let Err(why) = e.session.release(RELEASE_WITHIN) {
                    tracing::warn!(target: "rvisor::sessions", session = %id,
                        "handed off without a new checkpoint ({why})");
                }
                tracing::info!(target: "rvisor::sessions", session = %id, "handed off to another node on request");
            }
            d.release(&id);
        }
    }

    /// Deletes sessions unused for `ttl` that no node runs.
    fn sweep_expired(&self, d: &SessionStore, ttl: Duration) {
        let expired = match d.expired(ttl) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(target: "rvisor::sessions", "the TTL sweep could not list the store: {e}");
                return;
            }
        };
        for (tenant_hex, id) in expired {
            if let Some(e) = self.forget(&id) {
                // Ours but unused that long (hibernated): closed for good.
                e.session.close();
            }
            d.delete_expired(&tenant_hex, &id);
            tracing::info!(target: "rvisor::sessions", session = %id, "deleted: unused past the session TTL");
        }
    }

    /// Ends every session in this process but keeps each in the store
    /// (checkpointed if it changed, its lease released), so that a restart
    /// or another node goes on with it. Without a store: closes them.
    pub fn release_all(&self, within: Duration) {
        let Some(d) = self.inner.cfg.durable.clone() else {
            self.close_all();
            return;
        };
        // The node is stopping: nothing new starts, and calls that find
        // their session gone are told to retry (they go on elsewhere).
        self.inner.drain.start();
        let _one = lock(&self.inner.releasing);
        let all: Vec<(String, Entry)> = lock(&self.inner.sessions).drain().collect();
        lock(&self.inner.names).clear();
        if all.is_empty() {
            return;
        }
        let started = Instant::now();
        let n = all.len();
        let queue = Mutex::new(all);
        let written = std::sync::atomic::AtomicUsize::new(0);
        let failed = std::sync::atomic::AtomicUsize::new(0);
        // A few at a time: each checkpoint is one worker's work.
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| loop {
                    let Some((id, e)) = lock(&queue).pop() else {
                        return;
                    };
                    match e.session.release(within) {
                        Ok(Some(_)) => {
                            written.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(None) => {}
                        Err(why) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(target: "rvisor::sessions", session = %id,
                                "not checkpointed at release ({why}); its last checkpoint stays");
                        }
                    }
                    d.release(&id);
                });
            }
        });
        eprintln!(
            "rvisor serve: {n} sessions kept in {} ({} checkpointed now, {} kept their last \
             checkpoint) in {:.2} s",
            d.url(),
            written.load(Ordering::Relaxed),
            failed.load(Ordering::Relaxed),
            started.elapsed().as_secs_f64()
        );
    }

    /// The session `id` of `tenant`.
    pub fn session(&self, tenant: &str, id: &str) -> Result<Session, ServiceError> {
        Ok(self.find(tenant, id)?.0)
    }

    /// The session named `name` of `tenant` (for surfaces that address
    /// sessions by name: nng, `session --jsonl`, MCP); made with the
    /// server's defaults on first use when `create`. `Ok(None)`: no such
    /// name and `create` was false.
    pub fn named_session(
        &self,
        tenant: &str,
        name: &str,
        create: bool,
    ) -> Result<Option<String>, ServiceError> {
        let mut names = lock(&self.inner.names);
        let key = (tenant.to_string(), name.to_string());
        if let Some(id) = names.get(&key) {
            // Closed by id meanwhile? Then the name is free again.
            if self.find(tenant, id).is_ok() {
                return Ok(Some(id.clone()));
            }
            names.remove(&key);
        }
        if !create {
            return Ok(None);
        }
        let s = self.open(tenant, None, Some(name))?;
        let id = s.id().to_string();
        names.insert(key, id.clone());
        Ok(Some(id))
    }

    /// Queues a call in session `id` of `tenant`.
    pub fn session_run(
        &self,
        tenant: &str,
        id: &str,
        req: &SessionRun,
    ) -> Result<PendingCall, ServiceError> {
        self.queue_session_run(tenant, id, req, false)
    }

    /// [`Service::session_run`] for a caller that follows the call as it
    /// runs ([`PendingCall::events`]).
    pub fn session_run_streaming(
        &self,
        tenant: &str,
        id: &str,
        req: &SessionRun,
    ) -> Result<PendingCall, ServiceError> {
        self.queue_session_run(tenant, id, req, true)
    }

    fn queue_session_run(
        &self,
        tenant: &str,
        id: &str,
        req: &SessionRun,
        stream: bool,
    ) -> Result<PendingCall, ServiceError> {
        let (s, published) = self.find(tenant, id)?;
        // Counted from here: a drain waits for calls already accepted.
        let in_flight = self.inner.drain.enter();
        let timeout = match req.timeout_seconds {
            None => None,
            t => Some(check_timeout(t, self.rules())?),
        };
        let started = Instant::now();
        let over = RunOptions {
            timeout,
            plot_width: req.plot_width,
            plot_height: req.plot_height,
        };
        // Admission: a session without a worker gets one only within the
        // live caps and the memory budget (idle sessions hibernate to make
        // room); a tenant's calls are capped. Checked and queued at once.
        let queued = self
            .inner
            .admission
            .admit(
                || self.sessions_view(),
                tenant,
                id,
                || {
                    if stream {
                        s.run_streaming_with(&req.code, &over)
                    } else {
                        s.run_with(&req.code, &over)
                    }
                },
            )
            .map_err(ServiceError::refused)?;
        let handle = queued.map_err(|e| match e {
            // Released under the caller by a drain or shutdown: it goes on
            // after a restart or on another node, so the call is retryable.
            rvisor::Rejection::Closed if self.inner.drain.is_draining() => ServiceError::new(
                ErrorCode::Draining,
                "this node is stopping and has handed the session off; retry in a moment \
                 (a router sends the call to the node that has it now)",
            ),
            // A session closed under the caller is gone for it.
            rvisor::Rejection::Closed => ServiceError::not_found("session"),
            other => other.into(),
        })?;
        let cancel = CancelToken::new();
        {
            let id = handle.execution_id().to_string();
            cancel.on_cancel(move || {
                s.cancel_call(&id);
            });
        }
        Ok(PendingCall {
            handle,
            published,
            started,
            service: self.clone(),
            cancel,
            tenant: tenant.to_string(),
            in_flight,
        })
    }

    /// The status of session `id`.
    pub fn session_status(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        Ok(self.session(tenant, id)?.status())
    }

    /// Cancels the running call and drops the queue of session `id`.
    pub fn cancel(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        let s = self.session(tenant, id)?;
        s.cancel();
        Ok(s.status())
    }

    /// Starts session `id` over with a fresh worker.
    pub fn reset(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        let s = self.session(tenant, id)?;
        // The fresh worker is put in place before the next call runs.
        s.reset();
        Ok(s.status())
    }

    /// Checkpoints session `id` now (after its running call) and says what
    /// the checkpoint holds; `written: false` when nothing ran since the
    /// last one. Blocks until it is done. `invalid` when the server keeps
    /// no checkpoints (no `--state-dir`), `internal` when the worker or the
    /// store failed.
    pub fn checkpoint(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<rvisor::checkpoint::CheckpointInfo, ServiceError> {
        let s = self.session(tenant, id)?;
        if self.inner.sup.config().checkpoints.is_none() {
            return Err(ServiceError::invalid(
                "this server keeps no checkpoints; start it with --state-dir DIR",
            ));
        }
        s.checkpoint()
            .map_err(|e| ServiceError::new(ErrorCode::Internal, e))
    }

    /// Rolls session `id` back to its last checkpoint (the next worker
    /// loads it); `invalid` when it has none.
    pub fn restore(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        let s = self.session(tenant, id)?;
        if self.inner.sup.config().checkpoints.is_none() {
            return Err(ServiceError::invalid(
                "this server keeps no checkpoints; start it with --state-dir DIR",
            ));
        }
        s.restore().map_err(ServiceError::invalid)?;
        Ok(s.status())
    }

    /// Hibernates session `id` once it is idle (checkpoint, worker
    /// released); the next call restores it.
    pub fn hibernate(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        let s = self.session(tenant, id)?;
        if self.inner.sup.config().checkpoints.is_none() {
            return Err(ServiceError::invalid(
                "this server keeps no checkpoints; start it with --state-dir DIR",
            ));
        }
        s.hibernate();
        Ok(s.status())
    }

    /// The retryable error for a call's result `r` when the call never ran
    /// because its session was handed off (this node drains): 503
    /// `draining`, so that the client (or a router) retries where the
    /// session is now. `None` for every other result.
    pub fn handed_off(&self, r: &RunResult) -> Option<ServiceError> {
        (r.outcome == rvisor::Outcome::Closed && self.inner.drain.is_draining()).then(|| {
            let why = r
                .error
                .as_ref()
                .map_or_else(|| r.console.trim().to_string(), |e| e.message.clone());
            ServiceError::new(ErrorCode::Draining, why)
        })
    }

    /// Takes session `id` out of the service's maps (the caller ends it),
    /// with any name that still means it (a racing `named_session` may
    /// already have made a new one under the name, which stays reachable).
    fn forget(&self, id: &str) -> Option<Entry> {
        let e = lock(&self.inner.sessions).remove(id);
        lock(&self.inner.names).retain(|_, v| v != id);
        e
    }

    /// Closes session `id`; its running and queued calls end as `closed`.
    /// The answer is the closed session's status.
    pub fn close(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        let s = self.session(tenant, id)?;
        self.forget(id);
        s.close();
        if let Some(d) = &self.inner.cfg.durable {
            d.delete_session(tenant, id);
        }
        Ok(s.status())
    }

    /// Stores a table for `tenant`.
    pub fn put_table(
        &self,
        tenant: &str,
        format: TableFormat,
        bytes: &[u8],
    ) -> Result<TableMeta, ServiceError> {
        Ok(self.inner.tables.put(tenant, format, bytes)?)
    }

    /// Stores the upload spooled in file `src` for `tenant` (bounded
    /// memory; see `TableStore::put_file`).
    pub fn put_table_file(
        &self,
        tenant: &str,
        format: TableFormat,
        src: &std::path::Path,
    ) -> Result<TableMeta, ServiceError> {
        Ok(self.inner.tables.put_file(tenant, format, src)?)
    }

    /// A fresh spool path for an upload on its way in (the caller removes
    /// it).
    pub fn spool_path(&self) -> PathBuf {
        self.inner.tables.spool_path()
    }

    /// A table's metadata.
    pub fn get_table(&self, tenant: &str, pointer: &str) -> Result<TableMeta, ServiceError> {
        self.inner
            .tables
            .get(tenant, pointer)
            .ok_or_else(|| ServiceError::not_found("table"))
    }

    /// Deletes a table.
    pub fn delete_table(&self, tenant: &str, pointer: &str) -> Result<(), ServiceError> {
        if self.inner.tables.delete(tenant, pointer) {
            Ok(())
        } else {
            Err(ServiceError::not_found("table"))
        }
    }

    /// Closes every session for good (their checkpoints are deleted; at
    /// the end of a surface that keeps nothing: see
    /// [`Service::release_all`]).
    pub fn close_all(&self) {
        let all: Vec<Entry> = lock(&self.inner.sessions).drain().map(|(_, e)| e).collect();
        lock(&self.inner.names).clear();
        for e in all {
            e.session.close();
        }
    }

    /// `tenant`'s own use: open sessions, stored tables, calls by outcome
    /// and the time they took since the server started.
    pub fn usage(&self, tenant: &str) -> UsageReport {
        let sessions = lock(&self.inner.sessions)
            .values()
            .filter(|e| e.tenant == tenant)
            .count();
        let (tables, table_bytes) = self.inner.tables.usage(tenant);
        UsageReport {
            tenant: tenant.to_string(),
            sessions,
            tables,
            table_bytes,
            since_start: lock(&self.inner.metrics.tenants)
                .get(tenant)
                .cloned()
                .unwrap_or_default(),
        }
    }

    /// The server-wide metrics, for an operator: every tenant's calls and
    /// sessions are in them, so with tokens only the tenants named in
    /// `ServiceConfig::operators` may read them.
    pub fn metrics_for(&self, tenant: &str) -> Result<String, ServiceError> {
        if !self.is_operator(tenant) {
            return Err(ServiceError::new(
                ErrorCode::Forbidden,
                "the server-wide metrics are for operators: use an operator's token \
                 (rvisor serve --operator TENANT); your own use is at /v1/usage",
            ));
        }
        Ok(self.metrics_text())
    }

    /// Whether `tenant` may use the operator's operations (server-wide
    /// metrics, drain): a tenant named by `ServiceConfig::operators`, or
    /// the one local user without tokens.
    fn is_operator(&self, tenant: &str) -> bool {
        match &self.inner.cfg.tokens {
            None => true,
            Some(_) => self.inner.cfg.operators.iter().any(|o| o == tenant),
        }
    }

    /// Starts draining this node, for an operator (`POST /v1/admin/drain`).
    pub fn drain_for(&self, tenant: &str) -> Result<DrainStatus, ServiceError> {
        if !self.is_operator(tenant) {
            return Err(ServiceError::new(
                ErrorCode::Forbidden,
                "draining a node is for operators: use an operator's token \
                 (rvisor serve --operator TENANT)",
            ));
        }
        Ok(self.start_drain())
    }

    /// Prometheus text: calls by outcome, call latency, sessions, queue
    /// depth, spares, the zygote, requests by surface.
    pub fn metrics_text(&self) -> String {
        let m = &self.inner.metrics;
        let mut out = String::new();
        out.push_str(
            "# HELP rvisor_calls_total Calls by outcome.\n# TYPE rvisor_calls_total counter\n",
        );
        for (k, v) in lock(&m.by_outcome).iter() {
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
        let pool = self.inner.sup.pool_status();
        let (n, queued) = {
            let sessions = lock(&self.inner.sessions);
            let queued: usize = sessions.values().map(|e| e.session.status().queued).sum();
            (sessions.len(), queued)
        };
        out.push_str(&format!(
            "# TYPE rvisor_sessions gauge\nrvisor_sessions {n}\n# TYPE rvisor_queue_depth gauge\nrvisor_queue_depth {queued}\n# TYPE rvisor_spare_workers gauge\nrvisor_spare_workers {}\n# TYPE rvisor_zygote_up gauge\nrvisor_zygote_up {}\n",
            pool.spares,
            u8::from(pool.mode == rvisor::PoolMode::Zygote),
        ));
        out.push_str(&self.inner.admission.metrics_text(self.sessions_view()));
        let requests = lock(&m.requests);
        out.push_str(
            "# HELP rvisor_requests_total Requests by surface.\n# TYPE rvisor_requests_total counter\n",
        );
        for (s, v) in requests.iter() {
            out.push_str(&format!(
                "rvisor_requests_total{{surface=\"{}\"}} {v}\n",
                s.as_str()
            ));
        }
        out.push_str(&format!(
            "# TYPE rvisor_http_requests_total counter\nrvisor_http_requests_total {}\n",
            requests.get(&Surface::Http).copied().unwrap_or(0)
        ));
        out
    }
}

/// The style engine health reports: `rvisor-lint <version>` for the fast
/// (default) engine, else the configured name (`lintr`, `builtin`, `none`;
/// a validation answer names lintr with its version).
pub fn style_engine(style: rvisor::StyleEngine) -> String {
    if style.is_fast() {
        rvisor_lint::engine()
    } else {
        style.as_str().to_string()
    }
}

/// Validation as every surface gets it: R's parser, forbidden functions and
/// nesting depth in the supervisor's validation worker (blocking problems,
/// exactly as R sees them), and style notes from the configured engine. The
/// default engine is `rvisor-lint`, lintr's default linters in Rust: it
/// runs here, so the core crate carries no grammar and the worker does no
/// style work; `lintr` and `builtin` run in the worker.
pub fn validate(sup: &Supervisor, script: &str) -> rvisor::Validation {
    let engine = sup.config().style;
    if !engine.is_fast() {
        return sup.validate(script);
    }
    let mut v = sup.validate_with(script, rvisor::StyleEngine::None);
    if v.problems
        .iter()
        .any(|p| p.kind == "empty" || p.kind == "size")
    {
        return v;
    }
    v.style = rvisor_lint::lint(script)
        .into_iter()
        .map(|n| rvisor::StyleNote {
            rule: n.rule,
            message: n.message,
            line: Some(n.line),
            column: Some(n.column),
        })
        .collect();
    v.style_engine = rvisor_lint::engine();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_one_status_and_a_distinct_name() {
        let mut names = HashSet::new();
        for c in ErrorCode::ALL {
            assert!(names.insert(c.as_str()), "{c} twice");
            assert!((400..600).contains(&c.http_status()), "{c}");
        }
    }

    #[test]
    fn timeouts_follow_the_rules_range() {
        let rules = SafetyRules::default();
        let r = &rules.timeout_seconds;
        assert_eq!(
            check_timeout(None, &rules),
            Ok(Duration::from_secs(r.default))
        );
        assert!(check_timeout(Some(r.min as f64), &rules).is_ok());
        assert!(check_timeout(Some(r.max as f64), &rules).is_ok());
        for bad in [0.0, r.max as f64 + 1.0, f64::NAN, f64::INFINITY, -1.0] {
            let e = check_timeout(Some(bad), &rules).unwrap_err();
            assert_eq!(e.code, ErrorCode::Invalid);
            assert!(e.message.contains("timeout_seconds"), "{}", e.message);
        }
    }

    #[test]
    fn limits_only_tighten() {
        let base = rvisor::Limits::default();
        assert_eq!(tighter_limits(Some(&base), None), Ok(None));
        let tighter = LimitsRequest {
            memory_mb: Some(1024),
            ..Default::default()
        };
        let l = tighter_limits(Some(&base), Some(&tighter))
            .unwrap()
            .unwrap();
        assert_eq!(l.memory_bytes, 1024 << 20);
        let looser = LimitsRequest {
            processes: Some(base.processes + 1),
            ..Default::default()
        };
        let e = tighter_limits(Some(&base), Some(&looser)).unwrap_err();
        assert!(
            e.message.contains("over the server's limit"),
            "{}",
            e.message
        );
        let e = tighter_limits(None, Some(&tighter)).unwrap_err();
        assert!(e.message.contains("unconfined"), "{}", e.message);
    }

    #[test]
    fn bindings_refuse_reused_and_bad_names() {
        let rules = SafetyRules::default();
        let vars = vec![("n".to_string(), json!(1))];
        assert!(check_bindings(&vars, &["d"], &rules).is_ok());
        for (tables, what) in [
            (vec!["n"], "used twice"),
            (vec!["d", "d"], "used twice"),
            (vec!["1x"], "not a syntactic R name"),
        ] {
            let e = check_bindings(&vars, &tables, &rules).unwrap_err();
            assert!(e.message.contains(what), "{tables:?}: {}", e.message);
        }
        let many: Vec<String> = (0..=rules.max_dataframes)
            .map(|i| format!("d{i}"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(check_bindings(&[], &many, &rules).is_err());
    }
}
