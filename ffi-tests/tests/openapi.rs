//! The HTTP contract says what the server does: crafted requests to every
//! documented operation (no token, bad JSON, wrong types, not an object,
//! out-of-range values, unknown ids, ids that are not UTF-8, the success
//! cases) against the real router with real R workers, each answer checked
//! against the server's own /v1/openapi.json: its status is documented for
//! the operation, with the media type answered, and an error's code is one
//! the operation lists (`OPERATION_ERRORS`) and maps to that status.

use rvisor::{PoolConfig, SafetyRules, Supervisor, SupervisorConfig};
use rvisor_ffi_tests::TestDir;
use rvisor_server::http::{ServeConfig, CHECKPOINT_OPERATIONS, OPERATION_ERRORS, UNAUTHENTICATED};
use rvisor_server::service::ErrorCode;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Duration;

const TOKEN: &str = "openapi-token-0123456789abcdef";

/// The real router on 127.0.0.1:0, with a token, over a light confined
/// supervisor (no preloads, no spares); with a state directory when
/// `checkpoints` (no automatic checkpoints or hibernation).
struct Server {
    base: String,
    sup: Supervisor,
    rt: Option<tokio::runtime::Runtime>,
    _dir: TestDir,
}

impl Server {
    fn start(checkpoints: bool) -> Self {
        Self::start_with(checkpoints, Vec::new())
    }

    /// [`Server::start`] with these tenants as operators.
    fn start_with(checkpoints: bool, operators: Vec<String>) -> Self {
        let dir = TestDir::new("openapi");
        let store = checkpoints.then(|| {
            let s =
                rvisor::checkpoint::DirStore::new(dir.path().join("state")).expect("a state dir");
            std::sync::Arc::new(s) as std::sync::Arc<dyn rvisor::checkpoint::CheckpointStore>
        });
        let sup = Supervisor::new(SupervisorConfig {
            rules: SafetyRules::default(),
            pool: PoolConfig {
                zygote: true,
                spares: 0,
                preload: Some(Vec::new()),
                ..Default::default()
            },
            checkpoints: store,
            defaults: rvisor::SessionOptions {
                checkpoint_after: None,
                hibernate_after: None,
                ..rvisor::SessionOptions::default()
            },
            ..SupervisorConfig::default()
        })
        .expect("the supervisor starts");
        let mut cfg = ServeConfig {
            tokens: Some(HashMap::from([(TOKEN.to_string(), "t".to_string())])),
            operators,
            ..ServeConfig::default()
        };
        cfg.tables.dir = dir.path().join("tables");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("the bound address");
        let app = rvisor_server::http::router(sup.clone(), cfg).expect("the router");
        rt.spawn(async move { axum::serve(listener, app).await });
        Self {
            base: format!("http://{addr}"),
            sup,
            rt: Some(rt),
            _dir: dir,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
        self.sup.shutdown();
    }
}

struct Answer {
    status: u16,
    content_type: String,
    body: String,
}

fn send(
    base: &str,
    token: Option<&str>,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: Option<&str>,
) -> Answer {
    // A new connection per request: 401 and 413 close it.
    let agent = ureq::AgentBuilder::new()
        .max_idle_connections(0)
        .timeout(Duration::from_secs(120))
        .build();
    let mut req = agent.request(method, &format!("{base}{path}"));
    if let Some(t) = token {
        req = req.set("Authorization", &format!("Bearer {t}"));
    }
    if let Some(ct) = content_type {
        req = req.set("Content-Type", ct);
    }
    let res = match body {
        Some(b) => req.send_string(b),
        None => req.call(),
    };
    let res = match res {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {path}: {e}"),
    };
    Answer {
        status: res.status(),
        content_type: res.header("content-type").unwrap_or("").to_string(),
        body: res.into_string().unwrap_or_default(),
    }
}

/// POSTs a JSON request that announces `len` bytes of body and sends
/// none; the answer.
fn announce(base: &str, token: &str, path: &str, len: usize) -> Answer {
    use std::io::{Read, Write};
    let addr = base.trim_start_matches("http://");
    let mut c = std::net::TcpStream::connect(addr).expect("connect");
    write!(
        c,
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
    )
    .expect("send the head");
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut out = String::new();
    let _ = c.read_to_string(&mut out);
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let content_type = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    Answer {
        status,
        content_type,
        body: body.to_string(),
    }
}

/// Checks `a`, the answer to operation (`method`, `template`), against the
/// document; returns the answer's JSON body (or Null).
fn conforms(doc: &Value, method: &str, template: &str, what: &str, a: &Answer) -> Value {
    let responses = &doc["paths"][template][method]["responses"];
    assert!(
        responses.is_object(),
        "{method} {template} is not documented"
    );
    let documented = &responses[a.status.to_string()];
    assert!(
        documented.is_object(),
        "{method} {template} ({what}) answered {} which the document does not list: {}",
        a.status,
        a.body
    );
    let media = a.content_type.split(';').next().unwrap_or("").trim();
    if !a.body.is_empty() {
        assert!(
            documented["content"].get(media).is_some(),
            "{method} {template} ({what}): {} answered as {media:?}, documented {}",
            a.status,
            documented["content"]
        );
    }
    // A node not ready answers 503 with its readiness, not an error.
    if a.status < 400 || template == "/readyz" {
        return serde_json::from_str(&a.body).unwrap_or(Value::Null);
    }
    let v: Value = serde_json::from_str(&a.body)
        .unwrap_or_else(|e| panic!("{method} {template} ({what}): not JSON ({e}): {}", a.body));
    let code = v["error"]["code"].as_str().unwrap_or("");
    assert!(
        !v["error"]["message"].as_str().unwrap_or("").is_empty(),
        "{v}"
    );
    let c = ErrorCode::ALL
        .iter()
        .find(|c| c.as_str() == code)
        .unwrap_or_else(|| panic!("{method} {template} ({what}): unknown code {code:?}"));
    assert_eq!(
        c.http_status(),
        a.status,
        "{method} {template} ({what}): {v}"
    );
    let listed = OPERATION_ERRORS
        .iter()
        .find(|(m, p, _)| *m == method && *p == template)
        .map(|(_, _, codes)| *codes)
        .unwrap_or(&[]);
    assert!(
        *c == ErrorCode::Unauthorized || listed.contains(c),
        "{method} {template} ({what}): code {code} is not in OPERATION_ERRORS for it"
    );
    v
}

#[test]
fn every_answer_of_every_operation_is_documented() {
    // A server without a state directory: it offers no checkpoint
    // operations, and its document lists none.
    let s = Server::start(false);
    // Fetched as a client generator does, without a token.
    let doc: Value =
        serde_json::from_str(&send(&s.base, None, "GET", "/v1/openapi.json", None, None).body)
            .expect("the document is JSON");
    assert_eq!(doc["security"], json!([{"bearer": []}]));

    // Without a valid token, every operation answers 401, documented;
    // the orchestrators' probes and the document answer anyone.
    for (method, template, _) in OPERATION_ERRORS {
        if UNAUTHENTICATED.contains(template) {
            let a = send(&s.base, None, "GET", template, None, None);
            // Not ready yet is a documented answer too (the zygote starts).
            let ready = *template == "/readyz" && a.status == 503;
            assert!(
                a.status == 200 || ready,
                "{template} without a token: {}",
                a.body
            );
            conforms(&doc, method, template, "no token", &a);
            continue;
        }
        let path = template
            .replace("{id}", "s-0000000000000000")
            .replace("{pointer}", "dp_00");
        let offered = !CHECKPOINT_OPERATIONS.contains(&(*method, *template));
        assert_eq!(
            doc["paths"][template][method].is_object(),
            offered,
            "{method} {template}"
        );
        for token in [None, Some("not-the-token-0123456789")] {
            let a = send(&s.base, token, &method.to_uppercase(), &path, None, None);
            assert_eq!(a.status, 401, "{method} {path} without a valid token");
            if offered {
                conforms(&doc, method, template, "no token", &a);
            }
        }
    }

    let json_ct = Some("application/json");
    let check = |method: &str,
                 template: &str,
                 path: &str,
                 ct: Option<&str>,
                 body: Option<&str>,
                 want: u16| {
        let a = send(&s.base, Some(TOKEN), &method.to_uppercase(), path, ct, body);
        let what = format!("{path} {:?}", body.map(|b| &b[..b.len().min(60)]));
        assert_eq!(a.status, want, "{method} {what}: {}", a.body);
        conforms(&doc, method, template, &what, &a)
    };

    for (template, body, want) in [
        ("/v1/validate", "{\"script\": \"x <- 1\"}", 200),
        ("/v1/validate", "{", 400),
        ("/v1/validate", "[\"x\"]", 422),
        ("/v1/validate", "{\"script\": 1}", 422),
        ("/v1/run", "{\"script\": \"1 + 1\"}", 200),
        ("/v1/run", "{\"script\": \"(\"}", 200),
        (
            "/v1/run",
            "{\"script\": \"1\", \"timeout_seconds\": 0}",
            422,
        ),
        ("/v1/run", "{\"script\": \"1\", \"limits\": [null]}", 422),
        (
            "/v1/run",
            "{\"script\": \"1\", \"variables\": [[\"x\", 1]]}",
            422,
        ),
        (
            "/v1/run",
            "{\"script\": \"1\", \"variables\": [{\"name\": \"if\", \"value\": 1}]}",
            422,
        ),
        // What a run names does not exist: 404.
        (
            "/v1/run",
            "{\"script\": \"1\", \"dataframes\": [{\"data_pointer\": \"dp_0\", \"name\": \"d\"}]}",
            404,
        ),
        // Valid under the schema, but a name bound twice: 409.
        (
            "/v1/run",
            "{\"script\": \"1\", \"variables\": [{\"name\": \"x\", \"value\": 1}, {\"name\": \"x\", \"value\": 2}]}",
            409,
        ),
        (
            "/v1/run",
            "{\"script\": \"1\", \"limits\": {\"processes\": 8.0}}",
            200,
        ),
        ("/v1/sessions", "null", 201),
        ("/v1/sessions", "", 201),
        ("/v1/sessions", "{\"plot_width\": 640.0}", 201),
        ("/v1/sessions", "{\"plot_width\": 0}", 422),
        ("/v1/sessions", "{\"plot_width\": 6.5}", 422),
        ("/v1/sessions", "[]", 422),
        ("/v1/sessions", "\u{0}", 400),
    ] {
        check("post", template, template, json_ct, Some(body), want);
    }
    // Not JSON at all.
    check("post", "/v1/validate", "/v1/validate", None, Some("x"), 400);
    // Over the body limit.
    // Over the body limit: announced, not sent (a client still writing a
    // body the server has refused may see its answer lost to a reset).
    let a = announce(&s.base, TOKEN, "/v1/run", 5 << 20);
    assert_eq!(a.status, 413, "{}", a.body);
    conforms(&doc, "post", "/v1/run", "an announced 5 MiB body", &a);

    // A session: its routes with its id, an unknown id, an id that is not
    // UTF-8.
    let made = check(
        "post",
        "/v1/sessions",
        "/v1/sessions",
        json_ct,
        Some("{}"),
        201,
    );
    let id = made["id"].as_str().expect("a session id").to_string();
    let run = "/v1/sessions/{id}/run";
    let mine = format!("/v1/sessions/{id}/run");
    check(
        "post",
        run,
        &mine,
        json_ct,
        Some("{\"code\": \"x <- 1\"}"),
        200,
    );
    check("post", run, &mine, json_ct, Some("{\"code\": \"  \"}"), 422);
    check("post", run, &mine, json_ct, Some("0"), 422);
    check(
        "post",
        run,
        &mine,
        json_ct,
        Some("{\"code\": \"1\", \"timeout_seconds\": 1e9}"),
        422,
    );
    check(
        "post",
        run,
        "/v1/sessions/s-nope/run",
        json_ct,
        Some("{\"code\": \"1\"}"),
        404,
    );
    check(
        "post",
        run,
        "/v1/sessions/%FF/run",
        json_ct,
        Some("{\"code\": \"1\"}"),
        400,
    );
    for (method, template, suffix, ok) in [
        ("get", "/v1/sessions/{id}", "", 200),
        ("post", "/v1/sessions/{id}/cancel", "/cancel", 200),
        ("post", "/v1/sessions/{id}/reset", "/reset", 200),
        ("delete", "/v1/sessions/{id}", "", 204),
    ] {
        check(
            method,
            template,
            &format!("/v1/sessions/s-nope{suffix}"),
            None,
            None,
            404,
        );
        check(
            method,
            template,
            &format!("/v1/sessions/%FF{suffix}"),
            None,
            None,
            400,
        );
        check(
            method,
            template,
            &format!("/v1/sessions/{id}{suffix}"),
            None,
            None,
            ok,
        );
    }

    // The checkpoint operations this server does not offer answer as a
    // route it does not have (404 `not_found`), saying how to get them.
    let made = check(
        "post",
        "/v1/sessions",
        "/v1/sessions",
        json_ct,
        Some("{}"),
        201,
    );
    let id = made["id"].as_str().expect("a session id");
    for (_, template) in CHECKPOINT_OPERATIONS {
        let path = template.replace("{id}", id);
        let a = send(&s.base, Some(TOKEN), "POST", &path, None, None);
        assert_eq!(a.status, 404, "{path}: {}", a.body);
        let v: Value = serde_json::from_str(&a.body).expect("an error body");
        assert_eq!(v["error"]["code"], "not_found", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("--state-dir"),
            "{v}"
        );
    }

    // A table: stored, read, deleted; formats the server does not take.
    let t = "/v1/tables";
    let meta = check("post", t, t, Some("text/csv"), Some("a,b\n1,x\n2,y\n"), 201);
    let p = meta["data_pointer"]
        .as_str()
        .expect("a data pointer")
        .to_string();
    check("post", t, t, Some("text/plain"), Some("a\n1\n"), 400);
    check("post", t, t, json_ct, Some("[]"), 422);
    check("post", t, t, json_ct, Some("[{\"a\": 1}]"), 201);
    let one = "/v1/tables/{pointer}";
    check("get", one, &format!("/v1/tables/{p}"), None, None, 200);
    check("delete", one, &format!("/v1/tables/{p}"), None, None, 204);
    check("get", one, &format!("/v1/tables/{p}"), None, None, 404);
    check("delete", one, &format!("/v1/tables/{p}"), None, None, 404);
    check("get", one, "/v1/tables/%FF", None, None, 400);

    for (template, want) in [
        ("/v1/health", 200),
        ("/v1/packages", 200),
        ("/v1/openapi.json", 200),
        ("/v1/usage", 200),
        // The tenant is not an operator: the server-wide metrics are not its.
        ("/metrics", 403),
        ("/readyz", 200),
        ("/livez", 200),
    ] {
        check("get", template, template, None, None, want);
    }
    // Nor may it drain the node.
    let d = "/v1/admin/drain";
    check("post", d, d, None, None, 403);
}

#[test]
fn the_checkpoint_operations_answer_as_documented_with_a_state_dir() {
    let s = Server::start(true);
    let doc: Value = serde_json::from_str(
        &send(&s.base, Some(TOKEN), "GET", "/v1/openapi.json", None, None).body,
    )
    .expect("the document is JSON");
    let op = |template: &str, path: &str, want: u16| {
        let a = send(&s.base, Some(TOKEN), "POST", path, None, None);
        assert_eq!(a.status, want, "{path}: {}", a.body);
        conforms(&doc, "post", template, path, &a)
    };
    let (cp, hib, rest) = (
        "/v1/sessions/{id}/checkpoint",
        "/v1/sessions/{id}/hibernate",
        "/v1/sessions/{id}/restore",
    );
    for t in [cp, hib, rest] {
        op(t, &t.replace("{id}", "s-0000000000000000"), 404);
        op(t, &t.replace("{id}", "%FF"), 400);
    }
    let made = send(
        &s.base,
        Some(TOKEN),
        "POST",
        "/v1/sessions",
        Some("application/json"),
        Some("{}"),
    );
    let id = conforms(&doc, "post", "/v1/sessions", "new", &made)["id"]
        .as_str()
        .expect("a session id")
        .to_string();
    let at = |t: &str| t.replace("{id}", &id);
    // Nothing ran: nothing to keep, nothing to roll back to (409).
    let e = op(cp, &at(cp), 409);
    assert_eq!(e["error"]["code"], "conflict", "{e}");
    let e = op(rest, &at(rest), 409);
    assert_eq!(e["error"]["code"], "conflict", "{e}");
    let run = send(
        &s.base,
        Some(TOKEN),
        "POST",
        &format!("/v1/sessions/{id}/run"),
        Some("application/json"),
        Some("{\"code\": \"x <- 1\"}"),
    );
    conforms(&doc, "post", "/v1/sessions/{id}/run", "run", &run);
    let info = op(cp, &at(cp), 200);
    assert_eq!(info["written"], true, "{info}");
    op(rest, &at(rest), 200);
    op(hib, &at(hib), 200);
}

/// What a client generator needs from a server with tokens: the document
/// without a token (it holds no secrets), and in it, on each operation,
/// whether the operation needs the token, exactly as the server decides
/// it, with 401 documented where it is answered, and 429 where a quota or
/// a queue can refuse.
#[test]
fn the_document_is_public_and_says_which_operations_need_the_token() {
    let s = Server::start(true);
    let with = send(&s.base, Some(TOKEN), "GET", "/v1/openapi.json", None, None);
    assert_eq!(with.status, 200, "{}", with.body);
    let doc: Value = serde_json::from_str(&with.body).expect("the document is JSON");
    for token in [None, Some("not-the-token-0123456789")] {
        let a = send(&s.base, token, "GET", "/v1/openapi.json", None, None);
        assert_eq!(
            a.status, 200,
            "the document with token {token:?}: {}",
            a.body
        );
        assert!(
            a.content_type.starts_with("application/json"),
            "{}",
            a.content_type
        );
        let v: Value = serde_json::from_str(&a.body).expect("the document is JSON");
        assert_eq!(v, doc, "the same document with token {token:?}");
    }
    assert_eq!(
        doc["paths"]["/v1/openapi.json"]["get"]["security"],
        json!([])
    );
    assert!(doc["paths"]["/v1/openapi.json"]["get"]["responses"]
        .get("401")
        .is_none());

    // Every operation of the document: a bearer requirement exactly when
    // a request without a token is refused 401 (documented, parsed as the
    // error body).
    let mut protected = 0;
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, op) in item.as_object().expect("a path item") {
            if !["get", "post", "put", "patch", "delete"].contains(&method.as_str()) {
                continue;
            }
            let url = path
                .replace("{id}", "s-0000000000000000")
                .replace("{pointer}", "dp_00");
            let a = send(&s.base, None, &method.to_uppercase(), &url, None, None);
            let needs = op["security"] == json!([{"bearer": []}]);
            assert!(
                needs || op["security"] == json!([]),
                "{method} {path}: security {}",
                op["security"]
            );
            assert_eq!(
                a.status == 401,
                needs,
                "{method} {path}: answered {} without a token, security {}",
                a.status,
                op["security"]
            );
            if needs {
                protected += 1;
                let e = conforms(&doc, method, path, "no token", &a);
                assert_eq!(e["error"]["code"], "unauthorized", "{e}");
            }
        }
    }
    assert_eq!(protected, OPERATION_ERRORS.len() - UNAUTHENTICATED.len());
    // A path the server does not have still needs the token.
    assert_eq!(
        send(&s.base, None, "GET", "/v1/nothing", None, None).status,
        401
    );

    // 429 where a quota or a queue can refuse, with the error body.
    for (method, path) in [
        ("post", "/v1/sessions"),
        ("post", "/v1/sessions/{id}/run"),
        ("post", "/v1/sessions/{id}/checkpoint"),
        ("post", "/v1/tables"),
    ] {
        assert_eq!(
            doc["paths"][path][method]["responses"]["429"]["content"]["application/json"]["schema"]
                ["$ref"],
            "#/components/schemas/ErrorBody",
            "{method} {path}"
        );
    }
}

/// A draining node refuses new one-shot runs and sessions with 503
/// `draining`, codes the document lists for those operations; existing
/// sessions still answer.
#[test]
fn a_draining_node_answers_as_documented() {
    let s = Server::start_with(false, vec!["t".to_string()]);
    let doc: Value =
        serde_json::from_str(&send(&s.base, None, "GET", "/v1/openapi.json", None, None).body)
            .expect("the document is JSON");
    let json_ct = Some("application/json");
    let made = send(
        &s.base,
        Some(TOKEN),
        "POST",
        "/v1/sessions",
        json_ct,
        Some("{}"),
    );
    let id = conforms(&doc, "post", "/v1/sessions", "before the drain", &made)["id"]
        .as_str()
        .expect("a session id")
        .to_string();
    let d = send(&s.base, Some(TOKEN), "POST", "/v1/admin/drain", None, None);
    assert_eq!(d.status, 200, "{}", d.body);
    conforms(&doc, "post", "/v1/admin/drain", "drain", &d);
    for (template, body) in [
        ("/v1/run", "{\"script\": \"1 + 1\"}"),
        ("/v1/sessions", "{}"),
    ] {
        let a = send(&s.base, Some(TOKEN), "POST", template, json_ct, Some(body));
        assert_eq!(a.status, 503, "{template}: {}", a.body);
        let e = conforms(&doc, "post", template, "draining", &a);
        assert_eq!(e["error"]["code"], "draining", "{e}");
    }
    let path = format!("/v1/sessions/{id}/run");
    let a = send(
        &s.base,
        Some(TOKEN),
        "POST",
        &path,
        json_ct,
        Some("{\"code\": \"1 + 1\"}"),
    );
    assert_eq!(a.status, 200, "{}", a.body);
    conforms(&doc, "post", "/v1/sessions/{id}/run", "draining", &a);
}
