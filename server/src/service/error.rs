//! The service's errors: a stable [`ErrorCode`] per failure, its HTTP
//! status (here and nowhere else), and [`ServiceError`], the `{code,
//! message}` every surface carries.

use crate::tables::TableError;
use serde_json::{json, Value};

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
    /// A data pointer of a run did not resolve (which one is not said):
    /// what the run names does not exist for the caller (404, as an
    /// unknown table or session).
    DataPointerUnresolved,
    /// The request conflicts with itself or with the state of what it
    /// names: a name bound twice by one run, a restore of a session that
    /// has no checkpoint (409). Rules a request schema cannot state.
    Conflict,
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
    /// A file name or kind broke a rule of files (a `..` part, an
    /// absolute path, a symlink or FIFO R made...): the message says which
    /// (409; `rvisor::file_rules`).
    FileRefused,
    /// Installing packages failed or was refused (a policy rule, an unknown
    /// package, a checksum, a failed build...): `details.reason` says which
    /// step, the message what to do (422; docs/packages.md).
    Package,
    /// A download's `Range` lies outside the file (416, with
    /// `Content-Range: bytes */size`; docs/files.md).
    RangeNotSatisfiable,
    /// A bug or an unexpected failure of the server.
    Internal,
}

impl ErrorCode {
    /// Every code, for documentation and tests.
    pub const ALL: [ErrorCode; 21] = [
        ErrorCode::BadRequest,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::UnknownSession,
        ErrorCode::MethodNotAllowed,
        ErrorCode::TooLarge,
        ErrorCode::Invalid,
        ErrorCode::DataPointerUnresolved,
        ErrorCode::Conflict,
        ErrorCode::QueueFull,
        ErrorCode::Closed,
        ErrorCode::Quota,
        ErrorCode::Busy,
        ErrorCode::NoWorker,
        ErrorCode::Storage,
        ErrorCode::Draining,
        ErrorCode::FileRefused,
        ErrorCode::Package,
        ErrorCode::RangeNotSatisfiable,
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
            ErrorCode::Conflict => "conflict",
            ErrorCode::QueueFull => "queue_full",
            ErrorCode::Closed => "closed",
            ErrorCode::Quota => "quota",
            ErrorCode::Busy => "busy",
            ErrorCode::NoWorker => "no_worker",
            ErrorCode::Storage => "storage",
            ErrorCode::Draining => "draining",
            ErrorCode::FileRefused => "file_refused",
            ErrorCode::Package => "package",
            ErrorCode::RangeNotSatisfiable => "range_not_satisfiable",
            ErrorCode::Internal => "internal",
        }
    }

    /// The HTTP status of this code: the one mapping every surface that
    /// speaks HTTP statuses uses (and the OpenAPI document lists). 422 is
    /// for what the operation's request schema forbids (the document
    /// writes each rule it can into the schema); a request the schema
    /// allows is refused only for what a schema cannot state: something it
    /// names that does not exist (404), a conflict (409), a size or a
    /// quota (413, 429), the server's state (503), or, for a table upload,
    /// content its format's parser cannot read (422: docs/http.md).
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::NotFound
            | ErrorCode::UnknownSession
            | ErrorCode::Closed
            | ErrorCode::DataPointerUnresolved => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::Conflict | ErrorCode::FileRefused => 409,
            ErrorCode::TooLarge => 413,
            ErrorCode::RangeNotSatisfiable => 416,
            ErrorCode::Invalid | ErrorCode::Package => 422,
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
    /// More about the failure, in the error's JSON as `details` (package
    /// errors: the step, the package, the rule, the build's log).
    pub details: Option<Value>,
}

impl ServiceError {
    /// An error with `code`.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            retry_after_seconds: None,
            details: None,
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
            details: None,
        }
    }

    /// A rule was broken (422).
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Invalid, message)
    }

    /// The request conflicts with itself or with what it names (409).
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Conflict, message)
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
        if let Some(d) = &self.details {
            v["details"] = d.clone();
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

impl From<rvisor::CheckpointError> for ServiceError {
    fn from(e: rvisor::CheckpointError) -> Self {
        use rvisor::CheckpointError as C;
        let code = match &e {
            C::TooLarge(_) => ErrorCode::TooLarge,
            C::Quota(_) => ErrorCode::Quota,
            // Another node owns the session now: a router sends the retry
            // there.
            C::Fenced(_) => ErrorCode::Busy,
            C::Store(_) => ErrorCode::Storage,
            C::NothingYet => ErrorCode::Conflict,
            C::NoStore => ErrorCode::NotFound,
            C::Closed => ErrorCode::Closed,
            _ => ErrorCode::Internal,
        };
        Self::new(code, e.to_string())
    }
}

/// A session could not be made: bad options are the client's to fix, a
/// worker or host failure is the server's.
pub(super) fn session_error(e: rvisor::Error) -> ServiceError {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_code_has_one_status_and_a_distinct_name() {
        let mut names = HashSet::new();
        for c in ErrorCode::ALL {
            assert!(names.insert(c.as_str()), "{c} twice");
            assert!((400..600).contains(&c.http_status()), "{c}");
        }
    }
}
