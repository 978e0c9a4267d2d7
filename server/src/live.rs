//! A run's events as an HTTP response body while the call runs:
//! Server-Sent Events (`text/event-stream`: `id` is the event's `seq`,
//! `event` its kind, `data` its JSON; the last event, `result`, carries
//! the RunResult itself) or JSON lines (`application/x-ndjson`: one
//! event per line, the last of kind `result`). Dropping the body (the
//! client closed the connection) drops the events, which cancels the call.
//! The body takes an event only when hyper has room to write it (its
//! buffer, ~400 KiB), so what a slow client has not read waits in the
//! call's bounded feed; such a client gets `lagged` events in place of
//! the ones it missed (docs/streaming.md).

use crate::service::ServiceEvents;
use axum::body::Bytes;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use rvisor::{CallEvent, EventKind};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

/// How often an SSE stream with nothing to say sends a comment, so a
/// client that left is noticed (and its call cancelled) within this time.
pub const SSE_KEEPALIVE: Duration = Duration::from_secs(5);

/// The two streaming encodings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `text/event-stream`.
    Sse,
    /// `application/x-ndjson`.
    Ndjson,
}

impl Format {
    /// The streaming format the `Accept` header asks for, if any.
    pub fn wanted(h: &HeaderMap) -> Option<Self> {
        let accept = h.get(header::ACCEPT)?.to_str().ok()?;
        if accept.contains("text/event-stream") {
            Some(Format::Sse)
        } else if accept.contains("application/x-ndjson") {
            Some(Format::Ndjson)
        } else {
            None
        }
    }

    fn content_type(self) -> &'static str {
        match self {
            Format::Sse => "text/event-stream",
            Format::Ndjson => "application/x-ndjson",
        }
    }
}

/// One event in `format`.
pub fn encode(format: Format, e: &CallEvent) -> String {
    match (format, &e.kind) {
        (Format::Sse, EventKind::Result { result }) => format!(
            "id: {}\nevent: result\ndata: {}\n\n",
            e.seq,
            serde_json::to_string(result).unwrap_or_else(|_| "null".into())
        ),
        (Format::Sse, kind) => format!(
            "id: {}\nevent: {}\ndata: {}\n\n",
            e.seq,
            kind.name(),
            serde_json::to_string(e).unwrap_or_else(|_| "null".into())
        ),
        (Format::Ndjson, _) => {
            let mut line = serde_json::to_string(e).unwrap_or_else(|_| "null".into());
            line.push('\n');
            line
        }
    }
}

struct EventBody {
    events: ServiceEvents,
    format: Format,
    done: bool,
    keepalive: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl http_body::Body for EventBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let format = self.format;
        match self.events.poll_next(cx) {
            Poll::Ready(Some(e)) => {
                if matches!(e.kind, EventKind::Result { .. }) {
                    self.done = true;
                }
                if let Some(k) = self.keepalive.as_mut() {
                    k.as_mut()
                        .reset(tokio::time::Instant::now() + SSE_KEEPALIVE);
                }
                let text = encode(format, &e);
                Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from(text)))))
            }
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => {
                let Some(k) = self.keepalive.as_mut() else {
                    return Poll::Pending;
                };
                match k.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        k.as_mut()
                            .reset(tokio::time::Instant::now() + SSE_KEEPALIVE);
                        Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
                            b": keep-alive\n\n",
                        )))))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

use std::future::Future;

/// The streaming response of a run.
pub fn response(events: ServiceEvents, format: Format) -> Response {
    let keepalive = (format == Format::Sse).then(|| Box::pin(tokio::time::sleep(SSE_KEEPALIVE)));
    let body = EventBody {
        events,
        format,
        done: false,
        keepalive,
    };
    let mut res = axum::body::Body::new(body).into_response();
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(format.content_type()),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Proxies that buffer (nginx) pass the events on at once.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_frames() {
        let e = CallEvent {
            execution_id: "x".into(),
            seq: 2,
            kind: EventKind::Stdout { text: "a\n".into() },
        };
        assert_eq!(
            encode(Format::Sse, &e),
            "id: 2\nevent: stdout\ndata: {\"execution_id\":\"x\",\"seq\":2,\"kind\":\"stdout\",\"text\":\"a\\n\"}\n\n"
        );
        assert_eq!(
            encode(Format::Ndjson, &e),
            "{\"execution_id\":\"x\",\"seq\":2,\"kind\":\"stdout\",\"text\":\"a\\n\"}\n"
        );
        let r = CallEvent {
            execution_id: "x".into(),
            seq: 3,
            kind: EventKind::Result {
                result: Box::new(rvisor::RunResult::empty("x".into(), "1".into())),
            },
        };
        let s = encode(Format::Sse, &r);
        assert!(
            s.starts_with("id: 3\nevent: result\ndata: {\"schema_version\":1,"),
            "{s}"
        );
    }
}
