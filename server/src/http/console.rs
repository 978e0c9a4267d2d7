//! The web console's files (docs/console.md): plain HTML, JavaScript and
//! CSS from `server/console/`, compiled in, served under `/ui/` with no
//! token (they hold none) and a strict Content-Security-Policy. The
//! console itself talks to the same API as every client, with the token
//! the person signs in with in an `Authorization` header.
//!
//! HTML made by R code is never shown in the console's own document: it
//! goes into `/ui/frame.html`, loaded in an iframe with
//! `sandbox="allow-scripts"` (no `allow-same-origin`) and served with a
//! CSP `sandbox` directive of its own, so even opened on its own it runs
//! in an opaque origin that can read neither the console's storage nor
//! its DOM, and may fetch nothing.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

/// The console's own pages: scripts and styles only from this origin, no
/// inline script, frames only from this origin (the display frame),
/// connections only to this origin (the API), not framable.
pub const CONSOLE_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self' data: blob:; connect-src 'self'; frame-src 'self'; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

/// The frame of HTML displays: always sandboxed (an opaque origin, even
/// when opened on its own), scripts and styles only inline or as data
/// URIs (a display inlines its dependencies so), no connections at all.
pub const FRAME_CSP: &str = "sandbox allow-scripts; default-src 'none'; \
    script-src 'unsafe-inline' 'unsafe-eval' data:; style-src 'unsafe-inline' data:; \
    img-src data: blob:; font-src data:; media-src data:; connect-src 'none'; \
    form-action 'none'; base-uri 'none'";

const INDEX: &str = include_str!("../../console/index.html");
const APP_JS: &str = include_str!("../../console/app.js");
const APP_CSS: &str = include_str!("../../console/app.css");
const FRAME: &str = include_str!("../../console/frame.html");

fn page(body: &'static str, content_type: &'static str, csp: &'static str) -> Response {
    let mut res = (StatusCode::OK, body).into_response();
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(csp),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    res
}

/// The console's routes (merged outside the auth layer).
pub(super) fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route(
            "/ui/",
            get(|| async { page(INDEX, "text/html; charset=utf-8", CONSOLE_CSP) }),
        )
        .route(
            "/ui/app.js",
            get(|| async { page(APP_JS, "text/javascript; charset=utf-8", CONSOLE_CSP) }),
        )
        .route(
            "/ui/app.css",
            get(|| async { page(APP_CSS, "text/css; charset=utf-8", CONSOLE_CSP) }),
        )
        .route(
            "/ui/frame.html",
            get(|| async { page(FRAME, "text/html; charset=utf-8", FRAME_CSP) }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_console_has_no_inline_script_and_the_frame_is_always_sandboxed() {
        // The CSP forbids inline script in the console: its page must not
        // need any.
        assert!(!INDEX.contains("<script>"), "inline script in index.html");
        assert!(!INDEX.contains("onclick"), "inline handler in index.html");
        assert!(!CONSOLE_CSP.contains("unsafe-inline"));
        assert!(FRAME_CSP.starts_with("sandbox allow-scripts;"));
        assert!(!FRAME_CSP.contains("allow-same-origin"));
        assert!(FRAME_CSP.contains("connect-src 'none'"));
        // The app never puts the token in a URL.
        assert!(!APP_JS.contains("?token"));
        assert!(APP_JS.contains("sessionStorage"));
    }
}
