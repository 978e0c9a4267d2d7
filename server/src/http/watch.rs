//! `GET /v1/sessions/{id}/watch`: a session's calls as they run, whoever
//! queued them, as Server-Sent Events, for a person following an agent's
//! session (the web console; docs/console.md). First `watching` (the
//! session id: from here on every call that starts is seen), then per
//! call a `call` event (its execution id and code) followed by its events
//! as a streaming caller gets them (`stdout`, `stderr`, `plot`,
//! `display`, ..., `lagged` for a slow reader) and its `result`. A
//! comment every few seconds keeps the connection; the stream ends when
//! the session closes. Closing it never cancels a call.

use super::{blocking, ApiError, ApiPath, Handlers, Tenant};
use crate::live::{encode, Format, SSE_KEEPALIVE};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use rvisor::{Events, WatchedCall};
use std::convert::Infallible;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

/// How often the thread that hands calls to the stream checks that its
/// client is still there.
const HAND_OVER_CHECK: Duration = Duration::from_secs(1);

#[utoipa::path(get, path = "/v1/sessions/{id}/watch", tag = "sessions", params(("id" = String, Path, description = "session id")), responses((status = 200, description = "Server-Sent Events of the session's calls from now on, whoever queued them: `watching`, then for each call `call` (`execution_id`, `code`) and its events as `Accept: text/event-stream` on a run gives them, ending with `result`. Closing the stream never cancels a call (docs/console.md)", content_type = "text/event-stream", body = String)))]
pub(super) async fn session_watch(
    State(st): State<Handlers>,
    axum::Extension(Tenant(tenant)): axum::Extension<Tenant>,
    ApiPath(id): ApiPath,
) -> Result<Response, ApiError> {
    let svc = st.service.clone();
    let sid = id.clone();
    let watch = blocking(move || svc.watch(&tenant, &sid)).await??;
    // The watch is a blocking receiver: a thread hands its calls to the
    // stream, and ends when the session closes or the client left.
    let (tx, rx) = tokio::sync::mpsc::channel::<WatchedCall>(1);
    std::thread::Builder::new()
        .name("rvisor-watch".into())
        .spawn(move || loop {
            match watch.recv_timeout(HAND_OVER_CHECK) {
                Ok(call) => {
                    if tx.blocking_send(call).is_err() {
                        break;
                    }
                }
                Err(RecvTimeoutError::Timeout) if tx.is_closed() => break,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        })
        .map_err(|e| {
            ApiError::from(crate::service::ServiceError::new(
                crate::service::ErrorCode::Internal,
                format!("could not start the watch: {e}"),
            ))
        })?;
    let first = format!(
        "event: watching\ndata: {}\n\n",
        serde_json::json!({ "session_id": id })
    );
    let stream = futures_util::stream::unfold(
        (Some(first), rx, None::<Events>),
        |(mut first, mut rx, mut current)| async move {
            if let Some(f) = first.take() {
                return Some((Ok::<_, Infallible>(Bytes::from(f)), (None, rx, current)));
            }
            let keepalive = || Bytes::from_static(b": keep-alive\n\n");
            loop {
                if let Some(events) = current.as_mut() {
                    match tokio::time::timeout(SSE_KEEPALIVE, events.next_event()).await {
                        Ok(Some(e)) => {
                            let frame = Bytes::from(encode(Format::Sse, &e));
                            return Some((Ok(frame), (None, rx, current)));
                        }
                        Ok(None) => current = None,
                        Err(_) => return Some((Ok(keepalive()), (None, rx, current))),
                    }
                    continue;
                }
                return match tokio::time::timeout(SSE_KEEPALIVE, rx.recv()).await {
                    Ok(Some(call)) => {
                        let head = format!(
                            "event: call\ndata: {}\n\n",
                            serde_json::json!({
                                "execution_id": call.execution_id,
                                "code": call.code,
                            })
                        );
                        Some((Ok(Bytes::from(head)), (None, rx, Some(call.events))))
                    }
                    Ok(None) => None,
                    Err(_) => Some((Ok(keepalive()), (None, rx, None))),
                };
            }
        },
    );
    let mut res = axum::body::Body::from_stream(stream).into_response();
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(res)
}
