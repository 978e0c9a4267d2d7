//! The routes the web console reads (and any client may): a tenant's
//! sessions (`GET /v1/sessions`), a session's history, paged newest first
//! (`GET /v1/sessions/{id}/history`), and the operator's stats
//! (`GET /v1/admin/stats`). docs/console.md.

use super::{blocking, ApiError, ApiPath, Handlers, Tenant};
use crate::service::{ErrorCode, ServiceError};
use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::Json;

/// The query of a history page, as the document describes it (the
/// handler reads it with [`parse_query`], which answers 400 in the JSON
/// error shape where axum's `Query` answers plain text).
#[allow(dead_code)]
#[derive(Debug, Default, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct HistoryQuery {
    /// Entries of the page, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    limit: Option<u32>,
    /// The cursor of an older page: the `next` of the page before.
    #[param(minimum = 0)]
    before: Option<u64>,
}

/// Reads `limit` and `before` from a query string; anything malformed
/// (not a number, given twice, not UTF-8) is a 400 that says what to send.
fn parse_query(q: Option<&str>) -> Result<(Option<usize>, Option<u64>), ApiError> {
    let bad = |m: String| ApiError::from(ServiceError::new(ErrorCode::BadRequest, m));
    let (mut limit, mut before) = (None, None);
    for pair in q.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v).ok_or_else(|| {
            bad(format!(
                "the query parameter {k} is not percent-encoded UTF-8"
            ))
        })?;
        match k {
            "limit" => {
                if limit.is_some() {
                    return Err(bad("give limit once".into()));
                }
                let n = v.parse::<usize>().map_err(|_| {
                    bad(format!(
                        "limit must be a whole number from 1 to 100, not {v:?}"
                    ))
                })?;
                limit = Some(n);
            }
            "before" => {
                if before.is_some() {
                    return Err(bad("give before once".into()));
                }
                // As the document types it: a non-negative int64.
                let n = v
                    .parse::<i64>()
                    .ok()
                    .and_then(|n| u64::try_from(n).ok())
                    .ok_or_else(|| {
                        bad(format!(
                        "before must be the `next` cursor of an earlier page (a number), not {v:?}"
                    ))
                    })?;
                before = Some(n);
            }
            // Unknown parameters are ignored, as elsewhere.
            _ => {}
        }
    }
    Ok((limit, before))
}

/// `%XX` and `+` decoded; `None` when the result is not UTF-8 or an
/// escape is broken.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = s.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The caller's sessions.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct SessionList {
    /// Latest activity first.
    sessions: Vec<crate::service::SessionSummary>,
}

#[utoipa::path(get, path = "/v1/sessions", tag = "sessions", responses((status = 200, description = "The caller's sessions on this node, latest activity first: state (`running`, `idle`, `hibernated`...), idle time, the worker's memory, the last call. Another tenant's sessions are never listed", body = SessionList)))]
pub(super) async fn sessions_list(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let sessions = blocking(move || svc.list_sessions(&tenant)).await?;
    Ok(Json(SessionList { sessions }).into_response())
}

#[utoipa::path(get, path = "/v1/sessions/{id}/history", tag = "sessions", params(("id" = String, Path, description = "session id"), HistoryQuery), responses((status = 200, description = "A page of the session's history, newest first: its calls (code, console, displays, plots, files changed, outcome, times), resets and restores; `next` is the cursor of the older page (pass it as `before`), null at the oldest. Bounded per session (docs/console.md)", body = crate::service::HistoryPage)))]
pub(super) async fn session_history(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(id): ApiPath,
    RawQuery(q): RawQuery,
) -> Result<Response, ApiError> {
    let (limit, before) = parse_query(q.as_deref())?;
    let svc = st.service.clone();
    let page = blocking(move || svc.history(&tenant, &id, limit, before)).await??;
    Ok(Json(page).into_response())
}

#[utoipa::path(get, path = "/v1/admin/stats", tag = "operations", responses((status = 200, description = "For operators (`rvisor serve --operator TENANT`): this node, admission (live sessions, memory and its budget), and calls and latency by minute over the last hour", body = crate::service::AdminStats)))]
pub(super) async fn admin_stats(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    Ok(Json(blocking(move || svc.admin_stats(&tenant)).await??).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_parse_or_say_what_to_send() {
        assert_eq!(parse_query(None).ok(), Some((None, None)));
        let (l, b) = parse_query(Some("limit=5&before=12&x=y"))
            .ok()
            .unwrap_or_default();
        assert_eq!((l, b), (Some(5), Some(12)));
        for bad in [
            "limit=x",
            "limit=-1",
            "before=abc",
            "limit=1&limit=2",
            "limit=%FF",
            "limit=%4",
        ] {
            assert!(parse_query(Some(bad)).is_err(), "{bad}");
        }
    }
}
