//! `rvisor serve` end to end: the real HTTP router (and, once, the real
//! `rvisor serve` binary) against real R workers, driven over loopback by a
//! blocking HTTP client, checked against CONTRACT.md's HTTP section.
//!
//! Every test starts its own server on 127.0.0.1:0, so tests are
//! independent. No test sleeps and hopes: waits poll a condition (a server
//! answering, a session's state, a process exiting) until a deadline.
//! Durations are only bounded from above, to prove that nothing hung.

use base64::Engine as _;
use rvisor::ops::TimeoutRules;
use rvisor::{PoolConfig, SafetyRules, SessionOptions, Supervisor, SupervisorConfig};
use rvisor_ffi_tests::TestDir;
use rvisor_server::http::{read_tokens, ServeConfig};
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a wait may take before the test calls it a hang.
const DEADLINE: Duration = Duration::from_secs(60);

fn wait_for<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    rvisor_ffi_tests::wait_for(what, DEADLINE, f)
}

/// Alice's and Bob's bearer tokens (tokens are at least 16 characters).
const TOK_A: &str = "alice-token-0123456789abcdef";
const TOK_B: &str = "bob-token-0123456789abcdefgh";

// ---------------------------------------------------------------------------
// Helpers

/// A supervisor whose zygote preloads nothing and keeps no spares (workers
/// confined, as in production), so that tests stay light.
fn light_sup(rules: SafetyRules) -> Supervisor {
    Supervisor::new(SupervisorConfig {
        rules,
        pool: PoolConfig {
            zygote: true,
            spares: 0,
            preload: Some(Vec::new()),
            ..Default::default()
        },
        ..SupervisorConfig::default()
    })
    .expect("the supervisor starts")
}

fn tokens() -> HashMap<String, String> {
    HashMap::from([
        (TOK_A.to_string(), "alice".to_string()),
        (TOK_B.to_string(), "bob".to_string()),
    ])
}

/// The real router served on 127.0.0.1:0 by a background tokio runtime.
struct Server {
    base: String,
    sup: Supervisor,
    /// Where the server stores tables.
    tables_dir: PathBuf,
    rt: Option<tokio::runtime::Runtime>,
}

impl Server {
    fn start(sup: Supervisor, cfg: ServeConfig) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("the bound address");
        let tables_dir = cfg.tables.dir.clone();
        let app = rvisor_server::http::router(sup.clone(), cfg).expect("the router");
        rt.spawn(async move { axum::serve(listener, app).await });
        Self {
            base: format!("http://{addr}"),
            sup,
            tables_dir,
            rt: Some(rt),
        }
    }

    /// How many tables the server stores (for every tenant).
    fn stored_tables(&self) -> usize {
        // The store (a directory by default): tables/{tenant}/{pointer}.arrow.
        let tenants = std::fs::read_dir(self.tables_dir.join("store").join("tables"));
        tenants
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|t| std::fs::read_dir(t.path()).ok())
            .flat_map(|d| d.flatten())
            .filter(|e| e.path().extension().is_some_and(|x| x == "arrow"))
            .count()
    }

    /// Default rules, no auth (one local tenant).
    fn open() -> Self {
        Self::with_rules(SafetyRules::default())
    }

    fn with_rules(rules: SafetyRules) -> Self {
        Self::start(light_sup(rules), ServeConfig::default())
    }

    /// Default rules, tokens for alice and bob.
    fn authed() -> Self {
        Self::start(
            light_sup(SafetyRules::default()),
            ServeConfig {
                tokens: Some(tokens()),
                ..ServeConfig::default()
            },
        )
    }

    fn client(&self) -> Client {
        Client::new(&self.base, None)
    }

    fn client_as(&self, token: &str) -> Client {
        Client::new(&self.base, Some(token))
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

/// An HTTP answer.
#[derive(Debug)]
struct Resp {
    status: u16,
    content_type: String,
    text: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("not JSON ({e}): status {} {:?}", self.status, self.text))
    }

    /// Asserts a 200 JSON answer and returns its body.
    fn ok(&self) -> Value {
        assert_eq!(self.status, 200, "{}", self.text);
        self.json()
    }

    /// Asserts the contract's error shape with this status and code, and
    /// returns the message.
    fn error(&self, status: u16, code: &str) -> String {
        let (got, message) = self.error_with(status);
        assert_eq!(got, code, "{}", self.text);
        message
    }

    /// Asserts the contract's error shape with this status, and returns the
    /// code and the message.
    fn error_with(&self, status: u16) -> (String, String) {
        assert_eq!(self.status, status, "{}", self.text);
        assert!(
            self.content_type.starts_with("application/json"),
            "error content type {:?}: {}",
            self.content_type,
            self.text
        );
        let v = self.json();
        let e = &v["error"];
        let code = e["code"].as_str().expect("error.code is a string");
        let message = e["message"].as_str().expect("error.message is a string");
        assert!(!code.is_empty() && !message.is_empty(), "{v}");
        (code.to_string(), message.to_string())
    }
}

/// A blocking HTTP client for one base URL, optionally with a token.
#[derive(Clone)]
struct Client {
    agent: ureq::Agent,
    base: String,
    token: Option<String>,
}

impl Client {
    fn new(base: &str, token: Option<&str>) -> Self {
        Self {
            // A new connection for every request: the server answers some
            // errors (401, 413) before reading the request body, and hyper
            // then closes the keep-alive connection without saying so, which
            // a pooling client sees as an EOF on its next POST.
            agent: ureq::AgentBuilder::new()
                .max_idle_connections(0)
                .timeout_connect(Duration::from_secs(10))
                .timeout(Duration::from_secs(180))
                .build(),
            base: base.to_string(),
            token: token.map(str::to_string),
        }
    }

    fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&str>) -> Resp {
        let mut req = self.agent.request(method, &format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            req = req.set("Authorization", &format!("Bearer {t}"));
        }
        for (k, v) in headers {
            req = req.set(k, v);
        }
        let res = match body {
            Some(b) => req.send_string(b),
            None => req.call(),
        };
        let res = match res {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{method} {path}: {e}"),
        };
        let status = res.status();
        let content_type = res.header("content-type").unwrap_or("").to_string();
        let text = res.into_string().expect("a text body");
        Resp {
            status,
            content_type,
            text,
        }
    }

    fn get(&self, path: &str) -> Resp {
        self.send("GET", path, &[], None)
    }

    fn delete(&self, path: &str) -> Resp {
        self.send("DELETE", path, &[], None)
    }

    fn post(&self, path: &str, body: &Value) -> Resp {
        self.post_raw(path, &body.to_string())
    }

    fn post_raw(&self, path: &str, body: &str) -> Resp {
        self.send(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            Some(body),
        )
    }

    /// POST /v1/run; asserts 200 and returns the RunResult.
    fn run(&self, body: &Value) -> Value {
        self.post("/v1/run", body).ok()
    }

    /// POST /v1/sessions without a body; asserts 201 and returns the id.
    fn new_session(&self) -> String {
        let r = self.send("POST", "/v1/sessions", &[], None);
        assert_eq!(r.status, 201, "{}", r.text);
        r.json()["id"].as_str().expect("a session id").to_string()
    }

    /// POST /v1/sessions/{id}/run; asserts 200 and returns the RunResult.
    fn session_run(&self, id: &str, code: &str) -> Value {
        self.post(&format!("/v1/sessions/{id}/run"), &json!({ "code": code }))
            .ok()
    }
}

/// Polls `f` until it gives `Some`, or panics after [`DEADLINE`].
/// R code that leaves a trace on the host if it runs: it publishes a table
/// (through the run's publish tool), which the server stores. Runs are
/// confined, so R code cannot write host files; a stored table is how a
/// test proves that a script ran, or that it did not
/// ([`Server::stored_tables`]; use a [`table_server`] for a table store of
/// the test's own).
const RAN_PROBE: &str = "invisible(rvisor_publish(data.frame(ran = TRUE), name = 'ran'))";

// ---------------------------------------------------------------------------
// Health and packages

#[test]
fn health_reports_status_versions_and_the_default_rules() {
    let srv = Server::open();
    let r = srv.client().get("/v1/health");
    assert!(r.content_type.starts_with("application/json"), "{r:?}");
    let h = r.ok();
    assert_eq!(h["status"], "ok");
    assert_eq!(h["version"], env!("CARGO_PKG_VERSION"));
    let rv = h["r_version"].as_str().expect("r_version is a string");
    assert!(rv.starts_with("4."), "r_version {rv}");
    assert!(h["uptime_seconds"].as_f64().expect("uptime is a number") >= 0.0);
    let rules = &h["rules"];
    assert_eq!(rules["max_script_bytes"], rvisor::MAX_CODE_BYTES);
    assert_eq!(rules["max_nesting_depth"], 64);
    let forbidden: Vec<&str> = rules["forbidden_functions"]
        .as_array()
        .expect("forbidden_functions is an array")
        .iter()
        .map(|f| f.as_str().expect("a function name"))
        .collect();
    for f in ["system", "system2", "pipe", ".Call", "quit"] {
        assert!(forbidden.contains(&f), "{f} not in {forbidden:?}");
    }
    assert_eq!(
        rules["timeout_seconds"],
        json!({"default": 30, "min": 1, "max": 300})
    );
    assert_eq!(rules["max_dataframes"], 10);
    assert_eq!(rules["max_variables"], 50);
    assert!(h["workers"].is_object(), "{h}");
    assert!(h["sandbox"].is_object(), "{h}");
}

#[test]
fn health_rules_follow_the_config_and_are_enforced() {
    let rules = SafetyRules {
        max_script_bytes: 4321,
        max_nesting_depth: 9,
        forbidden_functions: vec!["Sys.time".into(), "nchar".into()],
        timeout_seconds: TimeoutRules {
            default: 7,
            min: 2,
            max: 60,
        },
        max_dataframes: 3,
        max_variables: 4,
    };
    let srv = Server::with_rules(rules.clone());
    let c = srv.client();
    let h = c.get("/v1/health").ok();
    assert_eq!(h["rules"], serde_json::to_value(&rules).unwrap(), "{h}");
    assert_eq!(h["rules"]["max_script_bytes"], 4321);
    assert_eq!(
        h["rules"]["forbidden_functions"],
        json!(["Sys.time", "nchar"])
    );

    // The reported rules are the ones in force.
    let v = c
        .post("/v1/validate", &json!({"script": "nchar('a')"}))
        .ok();
    assert_eq!(v["valid"], false, "{v}");
    assert_eq!(v["problems"][0]["kind"], "forbidden", "{v}");
    let v = c
        .post("/v1/validate", &json!({"script": "system('id')"}))
        .ok();
    assert_eq!(v["valid"], true, "system is not forbidden here: {v}");
    for t in [1, 61] {
        let m = c
            .post("/v1/run", &json!({"script": "1", "timeout_seconds": t}))
            .error(422, "invalid");
        assert!(m.contains("2..60"), "{m}");
    }
    let vars: Vec<Value> = (0..5)
        .map(|i| json!({"name": format!("v{i}"), "value": i}))
        .collect();
    let m = c
        .post("/v1/run", &json!({"script": "1", "variables": vars}))
        .error(422, "invalid");
    assert!(m.contains("at most 4"), "{m}");
    let dfs: Vec<Value> = (0..4)
        .map(|i| json!({"data_pointer": format!("p{i}"), "name": format!("d{i}")}))
        .collect();
    let m = c
        .post("/v1/run", &json!({"script": "1", "dataframes": dfs}))
        .error(422, "invalid");
    assert!(m.contains("at most 3"), "{m}");
}

#[test]
fn packages_lists_base_stats_and_ggplot2_with_version_and_library() {
    let srv = Server::open();
    let p = srv.client().get("/v1/packages").ok();
    let list = p["packages"].as_array().expect("packages is an array");
    let find = |name: &str| {
        list.iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("{name} not listed"))
    };
    for name in ["base", "stats", "ggplot2"] {
        let pkg = find(name);
        let version = pkg["version"].as_str().expect("version is a string");
        assert!(
            version.chars().next().is_some_and(|c| c.is_ascii_digit()),
            "{name} version {version:?}"
        );
        let lib = pkg["library"].as_str().expect("library is a string");
        assert!(
            Path::new(lib).join(name).join("DESCRIPTION").is_file(),
            "{name} is not in {lib}"
        );
    }
    assert!(find("base")["version"].as_str().unwrap().starts_with("4."));
}

// ---------------------------------------------------------------------------
// Validate

#[test]
fn validate_accepts_a_valid_script() {
    let srv = Server::open();
    let v = srv
        .client()
        .post(
            "/v1/validate",
            &json!({"script": "x <- c(1, 2, 3)\nmean(x)\n"}),
        )
        .ok();
    assert_eq!(v["valid"], true, "{v}");
    assert_eq!(v["problems"], json!([]), "{v}");
    assert!(v["style"].is_array(), "{v}");
}

#[test]
fn validate_reports_forbidden_calls_with_line_and_column() {
    let srv = Server::open();
    let v = srv
        .client()
        .post(
            "/v1/validate",
            &json!({"script": "x <- 1\ny <- system('id')\nz <- 2\n"}),
        )
        .ok();
    assert_eq!(v["valid"], false, "{v}");
    let p = &v["problems"][0];
    assert_eq!(p["kind"], "forbidden", "{v}");
    assert_eq!(
        (p["line"].clone(), p["column"].clone()),
        (json!(2), json!(6))
    );
    assert!(p["message"].as_str().unwrap().contains("system"), "{v}");
}

#[test]
fn validate_reports_syntax_errors_with_line_and_column() {
    let srv = Server::open();
    let v = srv
        .client()
        .post(
            "/v1/validate",
            &json!({"script": "x <- 1\ny <- (2 +\nz <- 3 3"}),
        )
        .ok();
    assert_eq!(v["valid"], false, "{v}");
    let p = &v["problems"][0];
    assert_eq!(p["kind"], "syntax", "{v}");
    assert_eq!(
        (p["line"].clone(), p["column"].clone()),
        (json!(3), json!(8))
    );
    assert!(p["message"].as_str().unwrap().contains("unexpected"), "{v}");
}

#[test]
fn validate_reports_empty_and_oversize_scripts() {
    let srv = Server::with_rules(SafetyRules {
        max_script_bytes: 100,
        ..SafetyRules::default()
    });
    let c = srv.client();
    for empty in ["", "  \n\t"] {
        let v = c.post("/v1/validate", &json!({ "script": empty })).ok();
        assert_eq!(v["valid"], false, "{v}");
        assert_eq!(v["problems"][0]["kind"], "empty", "{v}");
    }
    let big = "x <- 1\n".repeat(50);
    let v = c.post("/v1/validate", &json!({ "script": big })).ok();
    assert_eq!(v["valid"], false, "{v}");
    assert_eq!(v["problems"][0]["kind"], "size", "{v}");
    assert!(
        v["problems"][0]["message"]
            .as_str()
            .unwrap()
            .contains("100 bytes"),
        "{v}"
    );
    // The same limit stops a run before anything starts.
    let r = c.run(&json!({ "script": big }));
    assert_eq!(r["outcome"], "rejected", "{r}");
    assert_eq!(r["validation"]["problems"][0]["kind"], "size", "{r}");
}

#[test]
fn validate_style_notes_do_not_make_a_script_invalid() {
    let srv = Server::open();
    let long = format!("y <- \"{}\"", "a".repeat(90));
    let script = format!("x = 1\nz <- T\n{long}\n");
    let v = srv
        .client()
        .post("/v1/validate", &json!({ "script": script }))
        .ok();
    assert_eq!(v["valid"], true, "{v}");
    assert_eq!(v["problems"], json!([]), "{v}");
    let rules: HashSet<&str> = v["style"]
        .as_array()
        .expect("style is an array")
        .iter()
        .map(|s| s["rule"].as_str().expect("a rule"))
        .collect();
    for rule in [
        "assignment_linter",
        "T_and_F_symbol_linter",
        "line_length_linter",
    ] {
        assert!(rules.contains(rule), "{rule} not in {v}");
    }
    for s in v["style"].as_array().unwrap() {
        assert!(s["message"].is_string() && s["line"].is_u64(), "{s}");
    }
}

// ---------------------------------------------------------------------------
// One-shot runs

#[test]
fn run_returns_a_run_result_with_the_contract_fields() {
    let srv = Server::open();
    let r = srv.client().post("/v1/run", &json!({"script": "1 + 1"}));
    assert!(r.content_type.starts_with("application/json"), "{r:?}");
    let r = r.ok();
    for field in rvisor_ffi_tests::RUN_RESULT_FIELDS {
        assert!(r.get(field).is_some(), "no {field} in {r}");
    }
    assert_eq!(r["schema_version"], 1);
    assert!(!r["execution_id"].as_str().unwrap().is_empty(), "{r}");
    assert_eq!(r["code"], "1 + 1");
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(r["success"], true);
    assert_eq!(r["console"], "[1] 2\n", "{r}");
    assert!(r["segments"].is_array() && r["warnings"].is_array(), "{r}");
    assert!(r["error"].is_null(), "{r}");
    assert_eq!(r["plots"], json!([]));
    assert!(r["duration_ms"].is_number(), "{r}");
    assert!(r["r_version"].as_str().unwrap().starts_with("4."), "{r}");
    assert!(r["session"]["id"].is_string(), "{r}");
    assert!(r["usage"].is_object(), "{r}");
    assert_eq!(r["truncated"], false);
    assert!(r.get("validation").is_none(), "{r}");
}

#[test]
fn run_binds_variables_with_their_r_types() {
    let srv = Server::open();
    let script = "cat(class(n), class(x), class(s), class(b), class(big), sep = '|'); cat('\\n')\n\
                  cat(class(v), length(v), class(w), length(w), class(ss), length(ss), \
                  class(bb), length(bb), sep = '|'); cat('\\n')\n\
                  cat(n + 1L, x * 2, s, !b, sum(v), sum(w), paste(ss, collapse = '+'), \
                  sum(bb), sep = '|'); cat('\\n')\n";
    let r = srv.client().run(&json!({
        "script": script,
        "variables": [
            {"name": "n", "value": 3},
            {"name": "x", "value": 2.5},
            {"name": "s", "value": "hi there"},
            {"name": "b", "value": true},
            {"name": "big", "value": 3_000_000_000u64},
            {"name": "v", "value": [1, 2, 3]},
            {"name": "w", "value": [1.5, 2]},
            {"name": "ss", "value": ["a", "b"]},
            {"name": "bb", "value": [true, false, true]},
        ],
    }));
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(
        r["console"],
        "integer|numeric|character|logical|numeric\n\
         integer|3|numeric|2|character|2|logical|3\n\
         4|5|hi there|FALSE|6|3.5|a+b|2\n",
        "{r}"
    );
}

#[test]
fn run_rejects_invalid_variables_with_422() {
    let srv = Server::open();
    let c = srv.client();
    let bad = |vars: Value, needle: &str| {
        let m = c
            .post("/v1/run", &json!({"script": "1", "variables": vars}))
            .error(422, "invalid");
        assert!(m.contains(needle), "{needle:?} not in {m:?}");
    };
    bad(json!([{"name": "x", "value": null}]), "null");
    bad(json!([{"name": "x", "value": [1, null]}]), "null");
    bad(json!([{"name": "1x", "value": 1}]), "syntactic");
    bad(json!([{"name": "if", "value": 1}]), "syntactic");
    bad(json!([{"name": "a b", "value": 1}]), "syntactic");
    bad(json!([{"name": "x", "value": [1, "a"]}]), "mixes");
    bad(json!([{"name": "x", "value": [[1]]}]), "nested");
    bad(json!([{"name": "x", "value": {"a": 1}}]), "object");
    // A name given twice is a conflict no request schema can state: 409.
    let m = c
        .post(
            "/v1/run",
            &json!({"script": "1", "variables": [{"name": "x", "value": 1}, {"name": "x", "value": 2}]}),
        )
        .error(409, "conflict");
    assert!(m.contains("twice"), "{m}");
    let many: Vec<Value> = (0..51)
        .map(|i| json!({"name": format!("v{i}"), "value": i}))
        .collect();
    bad(json!(many), "at most 50");
    // Exactly 50 is fine.
    let fifty: Vec<Value> = (0..50)
        .map(|i| json!({"name": format!("v{i}"), "value": i}))
        .collect();
    let r = c.run(&json!({"script": "cat(v0 + v49)", "variables": fifty}));
    assert_eq!(r["console"], "49", "{r}");
}

#[test]
fn a_20000_byte_variable_or_data_frame_name_is_refused_and_the_server_runs_on() {
    let srv = Server::open();
    let c = srv.client();
    let long = "a".repeat(20_000);
    let m = c
        .post(
            "/v1/run",
            &json!({"script": "cat('ran')", "variables": [{"name": long, "value": 3}]}),
        )
        .error(422, "invalid");
    assert!(m.contains("10000 bytes") && m.len() < 1000, "{m:.200}");
    let m = c
        .post(
            "/v1/run",
            &json!({"script": "cat('ran')", "dataframes": [{"data_pointer": "p", "name": long}]}),
        )
        .error(422, "invalid");
    assert!(m.contains("10000 bytes") && m.len() < 1000, "{m:.200}");
    let r = c.run(&json!({"script": "cat(1 + 1)"}));
    assert_eq!(r["console"], "2", "{r}");
}

#[test]
fn run_rejects_timeouts_outside_1_to_300_seconds() {
    let srv = Server::open();
    let c = srv.client();
    for t in [json!(0), json!(301), json!(-1), json!(0.5), json!(1e9)] {
        let m = c
            .post("/v1/run", &json!({"script": "1", "timeout_seconds": t}))
            .error(422, "invalid");
        assert!(m.contains("timeout_seconds"), "{m}");
    }
    for t in [1, 300] {
        let r = c.run(&json!({"script": "cat('ok')", "timeout_seconds": t}));
        assert_eq!(r["console"], "ok", "{r}");
    }
}

#[test]
fn runs_and_sessions_take_tighter_limits_never_looser_ones() {
    let srv = Server::open();
    let c = srv.client();
    let alloc = "x <- raw(1.5e9); length(x)";
    // Looser than the server's 4 GiB, or too small for R: refused, nothing runs.
    let m = c
        .post(
            "/v1/run",
            &json!({"script": alloc, "limits": {"memory_mb": 8192}}),
        )
        .error(422, "invalid");
    assert!(m.contains("memory_mb"), "{m}");
    let m = c
        .post(
            "/v1/run",
            &json!({"script": alloc, "limits": {"memory_mb": 16}}),
        )
        .error(422, "invalid");
    assert!(m.contains("too small"), "{m}");
    c.post(
        "/v1/run",
        &json!({"script": "1", "limits": {"network": true}}),
    )
    .error(422, "invalid");
    // Tighter: the allocation the server's limit allows fails.
    let r = c.run(&json!({"script": alloc}));
    assert_eq!(r["outcome"], "complete", "{r}");
    let r = c.run(&json!({"script": alloc, "limits": {"memory_mb": 1024}}));
    assert_eq!(r["outcome"], "error", "{r}");
    assert!(
        r["console"].as_str().unwrap().contains("cannot allocate"),
        "{r}"
    );
    // Sessions take them too.
    let r = c.send(
        "POST",
        "/v1/sessions",
        &[("content-type", "application/json")],
        Some(&json!({"limits": {"memory_mb": 1024}}).to_string()),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json()["id"].as_str().unwrap().to_string();
    let r = c.session_run(&id, alloc);
    assert_eq!(r["outcome"], "error", "{r}");
}

#[test]
fn a_forbidden_script_is_rejected_with_its_validation() {
    let srv = table_server(None, 100);
    let script = format!("{RAN_PROBE}\nsystem('id')\n");
    let r = srv.client().run(&json!({ "script": script }));
    assert_eq!(r["outcome"], "rejected", "{r}");
    assert_eq!(r["success"], false, "{r}");
    let v = &r["validation"];
    assert_eq!(v["valid"], false, "{r}");
    let p = &v["problems"][0];
    assert_eq!(p["kind"], "forbidden", "{r}");
    assert_eq!(
        (p["line"].clone(), p["column"].clone()),
        (json!(2), json!(1))
    );
    let msg = r["error"]["message"].as_str().expect("an error message");
    assert!(msg.contains("line 2, column 1"), "{msg}");
    assert_eq!(srv.stored_tables(), 0, "a rejected script ran");
    // The probe itself runs (so the check above can fail).
    let r = srv.client().run(&json!({ "script": RAN_PROBE }));
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(srv.stored_tables(), 1, "{r}");
}

#[test]
fn a_plot_comes_back_as_a_png() {
    let srv = Server::open();
    let r = srv.client().run(&json!({"script": "plot(1:10)"}));
    assert_eq!(r["outcome"], "complete", "{r}");
    let plots = r["plots"].as_array().expect("plots is an array");
    assert_eq!(plots.len(), 1, "{r}");
    let p = &plots[0];
    assert_eq!(p["mime"], "image/png");
    assert!(p["width"].as_u64().unwrap() > 0 && p["height"].as_u64().unwrap() > 0);
    let png = base64::engine::general_purpose::STANDARD
        .decode(p["data_base64"].as_str().expect("data_base64"))
        .expect("valid base64");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
}

#[test]
fn a_run_past_its_timeout_is_timed_out() {
    let srv = Server::open();
    let r = srv
        .client()
        .run(&json!({"script": "Sys.sleep(30)", "timeout_seconds": 1}));
    assert_eq!(r["outcome"], "timed_out", "{r}");
    assert_eq!(r["success"], false, "{r}");
    assert_eq!(r["error"]["timed_out"], true, "{r}");
}

#[test]
fn unresolvable_data_pointers_are_one_generic_404_and_nothing_runs() {
    let srv = table_server(None, 100);
    let c = srv.client();
    let script = RAN_PROBE;
    let secret = "ptr-5ecret-d0e5-not-exist";
    let r = c.post(
        "/v1/run",
        &json!({
            "script": script,
            "dataframes": [{"data_pointer": secret, "name": "df"}],
        }),
    );
    let (_, m) = r.error_with(404);
    assert_eq!(r.json()["error"]["code"], "data_pointer_unresolved", "{m}");
    assert!(
        !r.text.contains(secret),
        "the answer names the pointer: {m}"
    );
    assert!(!m.contains("5ecret"), "{m}");
    assert_eq!(srv.stored_tables(), 0, "the script ran");

    let eleven: Vec<Value> = (0..11)
        .map(|i| json!({"data_pointer": format!("p{i}"), "name": format!("d{i}")}))
        .collect();
    let m = c
        .post("/v1/run", &json!({"script": "1", "dataframes": eleven}))
        .error(422, "invalid");
    assert!(m.contains("at most 10"), "{m}");

    let m = c
        .post(
            "/v1/run",
            &json!({"script": "1", "dataframes": [{"data_pointer": "p", "name": "2bad"}]}),
        )
        .error(422, "invalid");
    assert!(m.contains("syntactic"), "{m}");
    // A name bound by a variable and a data frame: a conflict.
    let m = c
        .post(
            "/v1/run",
            &json!({"script": "1", "variables": [{"name": "d", "value": 1}],
                    "dataframes": [{"data_pointer": "p", "name": "d"}]}),
        )
        .error(409, "conflict");
    assert!(m.contains("used twice"), "{m}");
    // Nor did the invalid requests run anything.
    assert_eq!(srv.stored_tables(), 0, "a script ran");
    // Then a good run still works (the probe's table proves it can run).
    let r = c.run(&json!({ "script": script }));
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(r["published"].as_array().map(Vec::len), Some(1), "{r}");
    assert_eq!(srv.stored_tables(), 1);
}

#[test]
fn accept_text_html_returns_an_html_fragment() {
    let srv = Server::open();
    let r = srv.client().send(
        "POST",
        "/v1/run",
        &[
            ("Content-Type", "application/json"),
            ("Accept", "text/html"),
        ],
        Some(&json!({"script": "cat('hello-from-r\\n')\nwarning('careful')"}).to_string()),
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.content_type.starts_with("text/html"), "{r:?}");
    assert!(r.text.contains("hello-from-r"), "{}", r.text);
    assert!(r.text.contains("careful"), "{}", r.text);
    assert!(r.text.trim_start().starts_with('<'), "{}", r.text);
    assert!(serde_json::from_str::<Value>(&r.text).is_err());
}

#[test]
fn one_run_does_not_see_the_variables_of_another() {
    let srv = Server::open();
    let c = srv.client();
    let r = c.run(&json!({"script": "leaked_secret <- 42; cat(exists('leaked_secret'))"}));
    assert_eq!(r["console"], "TRUE", "{r}");
    let r = c.run(&json!({"script": "cat(exists('leaked_secret'))"}));
    assert_eq!(r["console"], "FALSE", "{r}");
    // Nor a variable bound for the previous run.
    let r = c.run(&json!({"script": "1", "variables": [{"name": "bound_one", "value": 1}]}));
    assert_eq!(r["outcome"], "complete", "{r}");
    let r = c.run(&json!({"script": "cat(exists('bound_one'))"}));
    assert_eq!(r["console"], "FALSE", "{r}");
}

// ---------------------------------------------------------------------------
// Request errors

#[test]
fn malformed_json_is_400_with_the_error_shape() {
    let srv = Server::open();
    let c = srv.client();
    for path in ["/v1/run", "/v1/validate", "/v1/sessions"] {
        for body in ["{", "not json", "{,}", "\u{1}"] {
            c.post_raw(path, body).error(400, "bad_request");
        }
    }
    c.post_raw("/v1/run", "{\"script\": ")
        .error(400, "bad_request");
    c.post_raw("/v1/validate", "{\"script\": \"1\"")
        .error(400, "bad_request");
    c.post_raw("/v1/sessions", "{\"timeout_seconds\": 5,")
        .error(400, "bad_request");
    // A JSON body without the JSON content type.
    c.send(
        "POST",
        "/v1/run",
        &[("Content-Type", "text/plain")],
        Some("{\"script\": \"1\"}"),
    )
    .error(400, "bad_request");
}

#[test]
fn wrong_types_missing_and_unknown_fields_are_422() {
    let srv = Server::open();
    let c = srv.client();
    let m = c
        .post("/v1/run", &json!({"script": 5}))
        .error(422, "invalid");
    assert!(m.contains("script"), "{m}");
    let m = c
        .post("/v1/run", &json!({"script": "1", "bogus_field": 1}))
        .error(422, "invalid");
    assert!(m.contains("bogus_field"), "{m}");
    c.post("/v1/run", &json!({})).error(422, "invalid");
    c.post("/v1/run", &json!({"script": "1", "timeout_seconds": "5"}))
        .error(422, "invalid");
    c.post("/v1/validate", &json!({"script": ["1"]}))
        .error(422, "invalid");
    c.post("/v1/validate", &json!({"script": "1", "x": 1}))
        .error(422, "invalid");
    let id = c.new_session();
    c.post(&format!("/v1/sessions/{id}/run"), &json!({"script": "1"}))
        .error(422, "invalid");
    c.post("/v1/sessions", &json!({"bogus": 1}))
        .error(422, "invalid");
}

#[test]
fn a_body_over_max_body_bytes_is_413() {
    let srv = Server::start(
        light_sup(SafetyRules::default()),
        ServeConfig {
            max_body_bytes: 1024,
            ..ServeConfig::default()
        },
    );
    let c = srv.client();
    let big = json!({ "script": format!("x <- '{}'", "a".repeat(4000)) });
    c.post("/v1/run", &big).error(413, "too_large");
    c.post("/v1/validate", &big).error(413, "too_large");
    let id = c.new_session();
    c.post(
        &format!("/v1/sessions/{id}/run"),
        &json!({ "code": format!("x <- '{}'", "a".repeat(4000)) }),
    )
    .error(413, "too_large");
    c.post(
        "/v1/sessions",
        &json!({ "timeout_seconds": 5, "pad": "a".repeat(4000) }),
    )
    .error(413, "too_large");
    // Under the limit is fine.
    let r = c.run(&json!({"script": "cat('small')"}));
    assert_eq!(r["console"], "small", "{r}");
}

#[test]
fn an_unknown_route_is_404_json() {
    let srv = Server::open();
    let c = srv.client();
    c.get("/v1/nope").error(404, "not_found");
    c.get("/").error(404, "not_found");
    c.post("/v2/run", &json!({"script": "1"}))
        .error(404, "not_found");
}

// ---------------------------------------------------------------------------
// Sessions

#[test]
fn sessions_are_created_keep_state_and_report_status() {
    let srv = Server::open();
    let c = srv.client();
    let r = c.send("POST", "/v1/sessions", &[], None);
    assert_eq!(r.status, 201, "{}", r.text);
    let st = r.json();
    for field in [
        "id",
        "state",
        "generation",
        "queued",
        "last_reset",
        "pid",
        "working_dir",
    ] {
        assert!(st.get(field).is_some(), "no {field} in {st}");
    }
    assert_eq!(st["state"], "new", "{st}");
    assert_eq!(st["queued"], 0, "{st}");
    assert!(st["last_reset"].is_null(), "{st}");
    let id = st["id"].as_str().unwrap().to_string();

    let r = c.session_run(&id, "x <- 41");
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(r["session"]["id"], id.as_str(), "{r}");
    let r = c.session_run(&id, "x + 1");
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(r["console"], "[1] 42\n", "{r}");

    let st = c.get(&format!("/v1/sessions/{id}")).ok();
    assert_eq!(st["id"], id.as_str());
    assert_eq!(st["state"], "idle", "{st}");
    assert_eq!(st["generation"], 1, "{st}");
    assert!(st["pid"].as_u64().is_some_and(|p| p > 0), "{st}");
    assert!(st["working_dir"].is_string(), "{st}");

    // Health counts it.
    let h = c.get("/v1/health").ok();
    assert_eq!(h["workers"]["sessions"], 1, "{h}");

    // Session options are accepted, and checked.
    let r = c.post(
        "/v1/sessions",
        &json!({"timeout_seconds": 5, "plot_width": 400, "plot_height": 300}),
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let id2 = r.json()["id"].as_str().unwrap().to_string();
    assert_ne!(id, id2);
    let r = c.session_run(&id2, "plot(1)");
    assert_eq!(r["plots"][0]["width"], 400, "{r}");
    assert_eq!(r["plots"][0]["height"], 300, "{r}");
    // The other session's state is its own.
    let r = c.session_run(&id2, "cat(exists('x'))");
    assert_eq!(r["console"], "FALSE", "{r}");
    c.post("/v1/sessions", &json!({"timeout_seconds": 0}))
        .error(422, "invalid");
    c.post("/v1/sessions", &json!({"timeout_seconds": 301}))
        .error(422, "invalid");
    // A session run's timeout is checked too.
    c.post(
        &format!("/v1/sessions/{id}/run"),
        &json!({"code": "1", "timeout_seconds": 0}),
    )
    .error(422, "invalid");
}

#[test]
fn cancel_stops_an_in_flight_session_run() {
    let srv = Server::open();
    let c = srv.client();
    let id = c.new_session();
    let r = c.session_run(&id, "kept <- 'still here'");
    assert_eq!(r["outcome"], "complete", "{r}");

    let runner = {
        let c = c.clone();
        let id = id.clone();
        std::thread::spawn(move || {
            c.post(
                &format!("/v1/sessions/{id}/run"),
                &json!({"code": "Sys.sleep(60)", "timeout_seconds": 120}),
            )
            .ok()
        })
    };
    wait_for("the session to be running", || {
        let st = c.get(&format!("/v1/sessions/{id}")).ok();
        (st["state"] == "running").then_some(())
    });
    let st = c
        .post(&format!("/v1/sessions/{id}/cancel"), &json!({}))
        .ok();
    assert_eq!(st["id"], id.as_str(), "{st}");
    let started = Instant::now();
    let r = runner.join().expect("the runner thread");
    assert!(
        started.elapsed() < Duration::from_secs(50),
        "the run was not cut short"
    );
    assert_eq!(r["outcome"], "cancelled", "{r}");
    assert_eq!(r["success"], false, "{r}");

    // The session goes on.
    let r = c.session_run(&id, "cat('after')");
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(r["console"], "after", "{r}");
}

#[test]
fn a_full_session_queue_is_429_and_cancel_drops_the_queue() {
    let sup = Supervisor::new(SupervisorConfig {
        defaults: SessionOptions {
            queue_limit: 1,
            ..SessionOptions::default()
        },
        pool: PoolConfig {
            zygote: true,
            spares: 0,
            preload: Some(Vec::new()),
            ..Default::default()
        },
        ..SupervisorConfig::default()
    })
    .expect("the supervisor starts");
    let srv = Server::start(sup, ServeConfig::default());
    let c = srv.client();
    let id = c.new_session();
    let in_flight = |code: &'static str| {
        let c = c.clone();
        let id = id.clone();
        std::thread::spawn(move || {
            c.post(
                &format!("/v1/sessions/{id}/run"),
                &json!({"code": code, "timeout_seconds": 120}),
            )
            .ok()
        })
    };
    let status = || c.get(&format!("/v1/sessions/{id}")).ok();
    let long = in_flight("Sys.sleep(60)");
    wait_for("the session to be running", || {
        (status()["state"] == "running").then_some(())
    });
    let queued = in_flight("cat('queued')");
    wait_for("a call to be queued", || {
        (status()["queued"] == 1).then_some(())
    });
    let m = c
        .post(&format!("/v1/sessions/{id}/run"), &json!({"code": "1"}))
        .error(429, "queue_full");
    assert!(m.contains("queue"), "{m}");
    // An empty call is refused before it is queued.
    c.post(&format!("/v1/sessions/{id}/run"), &json!({"code": "  "}))
        .error(422, "invalid");

    c.post(&format!("/v1/sessions/{id}/cancel"), &json!({}))
        .ok();
    let r = long.join().expect("the long call's thread");
    assert_eq!(r["outcome"], "cancelled", "{r}");
    let r = queued.join().expect("the queued call's thread");
    assert_eq!(r["outcome"], "not_executed", "{r}");
    assert!(!r["console"].as_str().unwrap().contains("queued"), "{r}");
    let r = c.session_run(&id, "cat('next')");
    assert_eq!(r["console"], "next", "{r}");
}

#[test]
fn deleting_a_session_ends_its_in_flight_run() {
    let srv = Server::open();
    let c = srv.client();
    let id = c.new_session();
    let long = {
        let c = c.clone();
        let id = id.clone();
        std::thread::spawn(move || {
            c.post(
                &format!("/v1/sessions/{id}/run"),
                &json!({"code": "Sys.sleep(60)", "timeout_seconds": 120}),
            )
            .ok()
        })
    };
    let pid = wait_for("the session to be running", || {
        let st = c.get(&format!("/v1/sessions/{id}")).ok();
        (st["state"] == "running").then(|| st["pid"].as_u64().expect("a pid"))
    });
    let r = c.delete(&format!("/v1/sessions/{id}"));
    assert_eq!(r.status, 204, "{}", r.text);
    let r = long.join().expect("the long call's thread");
    assert_eq!(r["success"], false, "{r}");
    assert_ne!(r["outcome"], "complete", "{r}");
    c.get(&format!("/v1/sessions/{id}")).error(404, "not_found");
    wait_for("the session's worker to exit", || {
        process_gone(pid as u32).then_some(())
    });
}

#[test]
fn a_deleted_session_is_gone() {
    let srv = Server::open();
    let c = srv.client();
    let id = c.new_session();
    let r = c.session_run(&id, "1");
    assert_eq!(r["outcome"], "complete", "{r}");
    let pid = c.get(&format!("/v1/sessions/{id}")).ok()["pid"]
        .as_u64()
        .expect("a pid");

    let r = c.delete(&format!("/v1/sessions/{id}"));
    assert_eq!(r.status, 204, "{}", r.text);
    assert!(r.text.is_empty(), "{}", r.text);
    c.get(&format!("/v1/sessions/{id}")).error(404, "not_found");
    c.post(&format!("/v1/sessions/{id}/run"), &json!({"code": "1"}))
        .error(404, "not_found");
    c.post(&format!("/v1/sessions/{id}/cancel"), &json!({}))
        .error(404, "not_found");
    c.delete(&format!("/v1/sessions/{id}"))
        .error(404, "not_found");
    // Its worker goes away.
    wait_for("the session's worker to exit", || {
        process_gone(pid as u32).then_some(())
    });
}

#[test]
fn unknown_session_ids_are_404() {
    let srv = Server::open();
    let c = srv.client();
    for id in ["nope", "s-0000000000000000", "..%2F.."] {
        c.get(&format!("/v1/sessions/{id}")).error(404, "not_found");
        c.post(&format!("/v1/sessions/{id}/run"), &json!({"code": "1"}))
            .error(404, "not_found");
        c.post(&format!("/v1/sessions/{id}/cancel"), &json!({}))
            .error(404, "not_found");
        c.delete(&format!("/v1/sessions/{id}"))
            .error(404, "not_found");
    }
}

/// Whether a process no longer runs (gone, or a zombie waiting to be
/// reaped).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

// ---------------------------------------------------------------------------
// Tenants and auth

#[test]
fn token_files_are_parsed_and_short_tokens_refused() {
    let t = read_tokens(&format!(
        "# tokens\n{TOK_A} alice\n\n  {TOK_B}   bob  # the second\n"
    ))
    .expect("a valid file");
    assert_eq!(t, tokens());
    assert!(read_tokens("short-token alice\n").is_err());
    assert!(read_tokens("# nothing\n").is_err());
    assert!(read_tokens(&format!("{TOK_A}\n")).is_err());
    assert!(read_tokens(&format!("{TOK_A} alice extra\n")).is_err());
}

#[test]
fn requests_without_a_valid_token_are_401() {
    let srv = Server::authed();
    let anon = srv.client();
    let wrong = srv.client_as("not-a-token-0123456789abcdef");
    for c in [&anon, &wrong] {
        c.get("/v1/health").error(401, "unauthorized");
        c.get("/v1/packages").error(401, "unauthorized");
        c.get("/metrics").error(401, "unauthorized");
        c.post("/v1/run", &json!({"script": "1"}))
            .error(401, "unauthorized");
        c.post("/v1/validate", &json!({"script": "1"}))
            .error(401, "unauthorized");
        c.post("/v1/sessions", &json!({}))
            .error(401, "unauthorized");
        c.get("/v1/nope").error(401, "unauthorized");
    }
    // Not a bearer token, or a token as a different scheme.
    let r = anon.send(
        "GET",
        "/v1/health",
        &[("Authorization", &format!("Basic {TOK_A}"))],
        None,
    );
    r.error(401, "unauthorized");
    let r = anon.send("GET", "/v1/health", &[("Authorization", TOK_A)], None);
    r.error(401, "unauthorized");
    // The real tokens work.
    for t in [TOK_A, TOK_B] {
        assert_eq!(srv.client_as(t).get("/v1/health").ok()["status"], "ok");
    }
    let r = srv.client_as(TOK_A).run(&json!({"script": "cat(6 * 7)"}));
    assert_eq!(r["console"], "42", "{r}");
}

#[test]
fn another_tenants_session_answers_like_an_unknown_one() {
    let srv = Server::authed();
    let alice = srv.client_as(TOK_A);
    let bob = srv.client_as(TOK_B);
    let id = alice.new_session();
    let r = alice.session_run(&id, "secret <- 'alice-only'");
    assert_eq!(r["outcome"], "complete", "{r}");
    let before = alice.get(&format!("/v1/sessions/{id}")).ok();

    let unknown = "s-unknown-0000";
    type Probe<'a> = (&'a str, Box<dyn Fn(&Client, &str) -> Resp>);
    let probes: Vec<Probe> = vec![
        (
            "GET",
            Box::new(|c, id| c.get(&format!("/v1/sessions/{id}"))),
        ),
        (
            "run",
            Box::new(|c, id| {
                c.post(
                    &format!("/v1/sessions/{id}/run"),
                    &json!({"code": "cat(secret); rm(secret)"}),
                )
            }),
        ),
        (
            "cancel",
            Box::new(|c, id| c.post(&format!("/v1/sessions/{id}/cancel"), &json!({}))),
        ),
        (
            "DELETE",
            Box::new(|c, id| c.delete(&format!("/v1/sessions/{id}"))),
        ),
    ];
    for (what, probe) in &probes {
        let theirs = probe(&bob, &id);
        let none = probe(&bob, unknown);
        theirs.error(404, "not_found");
        none.error(404, "not_found");
        assert_eq!(
            (theirs.status, theirs.json()),
            (none.status, none.json()),
            "{what}: another tenant's session answers unlike an unknown one"
        );
        assert!(
            !theirs.text.contains("alice-only"),
            "{what}: {}",
            theirs.text
        );
    }

    // Alice's session is untouched and still hers.
    let after = alice.get(&format!("/v1/sessions/{id}")).ok();
    assert_eq!(after["state"], "idle", "{after}");
    assert_eq!(after["generation"], before["generation"], "{after}");
    assert_eq!(after["pid"], before["pid"], "{after}");
    assert!(after["last_reset"].is_null(), "{after}");
    let r = alice.session_run(&id, "cat(secret)");
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(r["console"], "alice-only", "{r}");
    // And bob's own sessions work alongside.
    let bobs = bob.new_session();
    let r = bob.session_run(&bobs, "cat(exists('secret'))");
    assert_eq!(r["console"], "FALSE", "{r}");
    alice
        .get(&format!("/v1/sessions/{bobs}"))
        .error(404, "not_found");
    let r = alice.delete(&format!("/v1/sessions/{id}"));
    assert_eq!(r.status, 204, "{}", r.text);
}

// ---------------------------------------------------------------------------
// Concurrency and metrics

#[test]
fn fifty_concurrent_runs_from_ten_clients_all_answer() {
    let srv = Server::open();
    let answers: Vec<(u64, Value)> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..10u64)
            .map(|t| {
                let c = srv.client();
                s.spawn(move || {
                    (0..5u64)
                        .map(|i| {
                            let k = t * 100 + i;
                            let r = c.run(&json!({
                                "script": "cat(k * 2L, tempdir(), sep = ' ')",
                                "variables": [{"name": "k", "value": k}],
                            }));
                            (k, r)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|h| h.join().expect("a client thread"))
            .collect()
    });
    assert_eq!(answers.len(), 50);
    // Every confined worker is pid 1 of its namespace: workers are told
    // apart by their temporary directories (one per worker, random names).
    let mut ids = HashSet::new();
    let mut tmps = HashSet::new();
    for (k, r) in &answers {
        assert_eq!(r["outcome"], "complete", "{r}");
        let console = r["console"].as_str().unwrap();
        let (double, tmp) = console.split_once(' ').expect("a number and a path");
        assert_eq!(double, (k * 2).to_string(), "{r}");
        tmps.insert(tmp.to_string());
        ids.insert(r["execution_id"].as_str().unwrap().to_string());
    }
    assert_eq!(ids.len(), 50, "execution ids are not unique");
    assert_eq!(tmps.len(), 50, "one-shot runs shared a worker");
    let m = srv.client().get("/metrics");
    assert!(
        m.text
            .contains("rvisor_calls_total{outcome=\"complete\"} 50\n"),
        "{}",
        m.text
    );
    // The spares the pool keeps now (raised by bursts), as health says.
    let gauge = |name: &str| -> u64 {
        m.text
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {}", m.text))
    };
    let health = srv.client().get("/v1/health").ok();
    assert_eq!(
        gauge("rvisor_spare_workers_target"),
        health["workers"]["spares_target"]
            .as_u64()
            .expect("spares_target"),
        "{health}"
    );
}

#[test]
fn a_tenant_opening_sessions_is_refused_at_its_cap_and_others_are_not() {
    let srv = Server::start(
        light_sup(SafetyRules::default()),
        ServeConfig {
            tokens: Some(tokens()),
            max_sessions_per_tenant: 3,
            ..ServeConfig::default()
        },
    );
    let alice = srv.client_as(TOK_A);
    let bob = srv.client_as(TOK_B);
    let ids: Vec<String> = (0..3).map(|_| alice.new_session()).collect();
    let r = alice.post("/v1/sessions", &json!({}));
    r.error(429, "quota");
    assert!(r.text.contains("close one"), "{}", r.text);
    // The cap is per tenant: bob is not affected.
    let _b = bob.new_session();
    // Closing one lets alice open another.
    let d = alice.send("DELETE", &format!("/v1/sessions/{}", ids[0]), &[], None);
    assert_eq!(d.status, 204, "{}", d.text);
    let _again = alice.new_session();
    let h = alice.get("/v1/health").json();
    assert_eq!(h["admission"]["max_sessions_per_tenant"], 3, "{h}");
}

#[test]
fn server_wide_metrics_need_an_operator_and_each_tenant_sees_only_its_own_usage() {
    let srv = Server::start(
        light_sup(SafetyRules::default()),
        ServeConfig {
            tokens: Some(tokens()),
            operators: vec!["bob".into()],
            ..ServeConfig::default()
        },
    );
    let alice = srv.client_as(TOK_A);
    let bob = srv.client_as(TOK_B);
    for script in ["1", "stop('boom')"] {
        alice.run(&json!({ "script": script }));
    }
    let id = alice.new_session();
    alice.session_run(&id, "x <- 1");
    // A tenant that is not an operator may not read every tenant's metrics.
    alice.get("/metrics").error(403, "forbidden");
    let m = bob.get("/metrics");
    assert_eq!(m.status, 200, "{}", m.text);
    assert!(
        m.text
            .contains("rvisor_calls_total{outcome=\"complete\"} 2"),
        "{}",
        m.text
    );
    // Each tenant's own usage, nobody else's.
    let u = alice.get("/v1/usage");
    assert_eq!(u.status, 200, "{}", u.text);
    let u = u.json();
    assert_eq!(u["tenant"], "alice");
    assert_eq!(u["sessions"], 1);
    assert_eq!(u["calls"]["complete"], 2, "{u}");
    assert_eq!(u["calls"]["error"], 1, "{u}");
    let b = bob.get("/v1/usage").json();
    assert_eq!(b["tenant"], "bob");
    assert_eq!(b["sessions"], 0);
    assert!(b["calls"].as_object().is_some_and(|c| c.is_empty()), "{b}");
}

#[test]
fn metrics_are_prometheus_text_with_outcomes_and_a_histogram() {
    let srv = Server::open();
    let c = srv.client();
    for script in ["1", "cat(2)", "stop('boom')", "system('id')"] {
        c.run(&json!({ "script": script }));
    }
    let id = c.new_session();
    c.session_run(&id, "x <- 1");
    let m = c.get("/metrics");
    assert_eq!(m.status, 200, "{}", m.text);
    assert!(m.content_type.starts_with("text/plain"), "{m:?}");
    let t = &m.text;
    for line in [
        "# TYPE rvisor_calls_total counter",
        "rvisor_calls_total{outcome=\"complete\"} 3",
        "rvisor_calls_total{outcome=\"error\"} 1",
        "rvisor_calls_total{outcome=\"rejected\"} 1",
        "# TYPE rvisor_call_seconds histogram",
        "rvisor_call_seconds_bucket{le=\"+Inf\"} 5",
        "rvisor_call_seconds_count 5",
        "rvisor_sessions 1",
    ] {
        assert!(t.lines().any(|l| l == line), "no line {line:?} in\n{t}");
    }
    // Buckets are cumulative: non-decreasing, and none above the count.
    let buckets: Vec<u64> = t
        .lines()
        .filter(|l| l.starts_with("rvisor_call_seconds_bucket{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse().expect("a count"))
        .collect();
    assert!(buckets.len() >= 2, "{t}");
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "{t}");
    assert_eq!(*buckets.last().unwrap(), 5);
    let sum: f64 = t
        .lines()
        .find_map(|l| l.strip_prefix("rvisor_call_seconds_sum "))
        .expect("a sum line")
        .parse()
        .expect("a number");
    assert!(sum > 0.0, "{t}");
    // Every sample line is `name{labels} value` or `name value`.
    for l in t.lines().filter(|l| !l.starts_with('#')) {
        let (_, v) = l.rsplit_once(' ').expect("name and value");
        v.parse::<f64>()
            .unwrap_or_else(|_| panic!("bad value in {l:?}"));
    }
}

// ---------------------------------------------------------------------------
// The real binary

/// The `rvisor` binary next to the test executable (target/debug/rvisor).
fn rvisor_bin() -> PathBuf {
    rvisor_ffi_tests::rvisor_bin()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Kills the child if the test fails before it exits.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

#[test]
fn the_binary_serves_with_auth_and_exits_0_on_sigterm() {
    let bin = rvisor_bin();
    let dir = TestDir::new("http-test-serve-bin");
    let token_file = dir.path().join("tokens");
    std::fs::write(
        &token_file,
        format!("# test tokens\n{TOK_A} alice\n{TOK_B} bob\n"),
    )
    .expect("write the token file");
    let log = dir.path().join("stderr.log");

    // The port is free when chosen but may be taken before the server binds
    // it: then try another.
    let (mut guard, base) = 'start: {
        for _ in 0..3 {
            let base = format!("127.0.0.1:{}", free_port());
            let child = Command::new(&bin)
                .args(["serve", "--listen", &base, "--tokens"])
                .arg(&token_file)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("a log file"))
                .spawn()
                .expect("rvisor serve starts");
            let mut guard = ChildGuard(Some(child));
            let base = format!("http://{base}");
            let probe = Client::new(&base, Some(TOK_A));
            let ready = wait_for("rvisor serve to answer /v1/health", || {
                let child = guard.0.as_mut().unwrap();
                if let Some(status) = child.try_wait().expect("try_wait") {
                    return Some(Err(status));
                }
                let r = probe
                    .agent
                    .get(&format!("{base}/v1/health"))
                    .set("Authorization", &format!("Bearer {TOK_A}"))
                    .call();
                match r {
                    Ok(r) if r.status() == 200 => Some(Ok(())),
                    _ => None,
                }
            });
            match ready {
                Ok(()) => break 'start (guard, base),
                Err(status) => {
                    let text = std::fs::read_to_string(&log).unwrap_or_default();
                    assert!(
                        text.contains("in use"),
                        "rvisor serve exited early ({status}): {text}"
                    );
                }
            }
        }
        panic!("no free port could be bound");
    };

    let anon = Client::new(&base, None);
    anon.get("/v1/health").error(401, "unauthorized");
    Client::new(&base, Some("wrong-token-0123456789abcdef"))
        .get("/v1/health")
        .error(401, "unauthorized");
    let alice = Client::new(&base, Some(TOK_A));
    let bob = Client::new(&base, Some(TOK_B));
    let h = alice.get("/v1/health").ok();
    assert_eq!(h["status"], "ok");
    let r = alice.run(&json!({"script": "cat(6 * 7)"}));
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(r["console"], "42", "{r}");
    let id = alice.new_session();
    let r = alice.session_run(&id, "y <- 1");
    assert_eq!(r["outcome"], "complete", "{r}");
    let pid = alice.get(&format!("/v1/sessions/{id}")).ok()["pid"]
        .as_u64()
        .expect("a worker pid") as u32;
    bob.get(&format!("/v1/sessions/{id}"))
        .error(404, "not_found");
    drop((anon, alice, bob));

    let child = guard.0.as_mut().unwrap();
    // SAFETY: kill has no memory-safety preconditions; the pid is our own
    // child, which has not been waited for (so the pid is not reused).
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    let status = wait_for("rvisor serve to exit after SIGTERM", || {
        child.try_wait().expect("try_wait")
    });
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(status.code(), Some(0), "{status}: {text}");
    assert!(text.contains("shutting down"), "{text}");
    // No R worker is left behind.
    wait_for("the session's worker to exit", || {
        process_gone(pid).then_some(())
    });
}

// --- tables and data pointers ----------------------------------------------

fn table_server(tokens: Option<HashMap<String, String>>, max_tables: usize) -> Server {
    let dir =
        std::env::temp_dir().join(format!("rvisor-http-tables-{}", rvisor::ids::random_hex(6)));
    Server::start(
        light_sup(SafetyRules::default()),
        ServeConfig {
            tokens,
            tables: rvisor_server::tables::TableConfig {
                dir,
                max_tables_per_tenant: max_tables,
                ..Default::default()
            },
            ..ServeConfig::default()
        },
    )
}

fn upload(c: &Client, content_type: &str, body: &str) -> Resp {
    c.send(
        "POST",
        "/v1/tables",
        &[("Content-Type", content_type)],
        Some(body),
    )
}

#[test]
fn a_csv_table_is_hydrated_with_every_column_type_and_nas() {
    let s = table_server(None, 100);
    let c = s.client();
    let csv = "i,d,b,s,dt,ts\n1,1.5,true,a,2024-01-02,2024-01-02T03:04:05\nNA,,false,,2024-02-03,\n3,2.5,NA,c,,2024-03-04T05:06:07\n";
    let r = upload(&c, "text/csv", csv);
    assert_eq!(r.status, 201, "{}", r.text);
    let meta = r.json();
    let pointer = meta["data_pointer"].as_str().unwrap().to_string();
    assert_eq!(meta["rows"], 3);
    let types: Vec<&str> = meta["columns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect();
    assert_eq!(
        types,
        [
            "integer",
            "double",
            "logical",
            "string",
            "date",
            "timestamp"
        ]
    );
    assert!(meta["expires_at"].as_str().unwrap().ends_with('Z'));
    let out = c.run(&json!({
        "script": "cat(vapply(t, function(x) class(x)[1], ''), '\\n'); cat(colSums(is.na(t)), '\\n'); cat(format(t$ts[3], tz = 'UTC'), '\\n')",
        "dataframes": [{"data_pointer": pointer, "name": "t"}]
    }));
    assert_eq!(out["outcome"], "complete", "{}", out["console"]);
    assert_eq!(
        out["console"],
        "integer numeric logical character Date POSIXct \n1 1 1 1 1 1 \n2024-03-04 05:06:07 \n"
    );
    // GET gives the metadata; DELETE removes it; then the pointer is gone.
    assert_eq!(c.get(&format!("/v1/tables/{pointer}")).ok()["rows"], 3);
    assert_eq!(c.delete(&format!("/v1/tables/{pointer}")).status, 204);
    c.get(&format!("/v1/tables/{pointer}"))
        .error(404, "not_found");
    let r = c.post(
        "/v1/run",
        &json!({"script": "1", "dataframes": [{"data_pointer": pointer, "name": "t"}]}),
    );
    let msg = r.error(404, "data_pointer_unresolved");
    assert!(!msg.contains(&pointer));
}

#[test]
fn json_records_become_a_data_frame() {
    let s = table_server(None, 100);
    let c = s.client();
    let r = upload(
        &c,
        "application/json",
        r#"[{"n": 1, "x": 2.5, "day": "2024-01-01", "ok": true, "s": "a"}, {"n": 2, "x": null, "day": "2024-01-02", "ok": false, "s": null}]"#,
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let pointer = r.json()["data_pointer"].as_str().unwrap().to_string();
    let out = c.run(&json!({
        "script": "cat(nrow(d), class(d$n), class(d$day), is.na(d$x[2]), is.na(d$s[2]), '\\n')",
        "dataframes": [{"data_pointer": pointer, "name": "d"}]
    }));
    assert_eq!(out["console"], "2 integer Date TRUE TRUE \n", "{}", out);
}

#[test]
fn bad_uploads_and_quotas_get_clear_errors() {
    let s = table_server(None, 1);
    let c = s.client();
    upload(&c, "application/json", "{\"not\": \"an array\"}").error(422, "invalid");
    upload(&c, "application/vnd.apache.arrow.stream", "garbage").error(422, "invalid");
    let (_, m) = upload(&c, "text/plain", "a\n1\n").error_with(400);
    assert!(m.contains("text/csv"));
    assert_eq!(upload(&c, "text/csv", "a\n1\n").status, 201);
    upload(&c, "text/csv", "a\n2\n").error(429, "quota");
}

#[test]
fn another_tenants_pointer_is_unknown_and_runs_nothing() {
    let s = table_server(Some(tokens()), 100);
    let alice = s.client_as(TOK_A);
    let bob = s.client_as(TOK_B);
    let r = upload(&alice, "text/csv", "a\n1\n");
    assert_eq!(r.status, 201, "{}", r.text);
    let pointer = r.json()["data_pointer"].as_str().unwrap().to_string();
    let unknown = bob.get("/v1/tables/dp_0000000000000000000000000000000000000000000000000");
    let foreign = bob.get(&format!("/v1/tables/{pointer}"));
    assert_eq!(
        (foreign.status, foreign.json()),
        (unknown.status, unknown.json())
    );
    assert_eq!(bob.delete(&format!("/v1/tables/{pointer}")).status, 404);
    assert_eq!(s.stored_tables(), 1, "alice's table");
    let r = bob.post(
        "/v1/run",
        &json!({"script": RAN_PROBE, "dataframes": [{"data_pointer": pointer, "name": "t"}]}),
    );
    let msg = r.error(404, "data_pointer_unresolved");
    assert!(!msg.contains(&pointer));
    assert_eq!(s.stored_tables(), 1, "nothing may run");
    // Alice still has it (and the same script runs for her).
    let out = alice.run(&json!({
        "script": format!("{RAN_PROBE}; nrow(t)"),
        "dataframes": [{"data_pointer": pointer, "name": "t"}]
    }));
    assert_eq!(out["console"], "[1] 1\n", "{out}");
    assert_eq!(s.stored_tables(), 2, "{out}");
}

#[test]
fn a_published_data_frame_is_a_pointer_the_next_run_can_use() {
    let s = table_server(Some(tokens()), 100);
    let alice = s.client_as(TOK_A);
    let out = alice.run(&json!({
        "script": "d <- data.frame(n = 1:3, day = as.Date('2024-01-01') + 0:2, s = c('a', NA, 'c')); p <- rvisor_publish(d, name = 'days'); cat(startsWith(p, 'dp_'), '\\n')"
    }));
    assert_eq!(out["outcome"], "complete", "{}", out["console"]);
    assert_eq!(out["console"], "TRUE \n");
    let published = out["published"].as_array().expect("published list");
    assert_eq!(published.len(), 1);
    assert_eq!(published[0]["name"], "days");
    assert_eq!(published[0]["rows"], 3);
    let pointer = published[0]["data_pointer"].as_str().unwrap().to_string();
    let next = alice.run(&json!({
        "script": "cat(class(t$n), class(t$day), is.na(t$s[2]), '\\n')",
        "dataframes": [{"data_pointer": pointer, "name": "t"}]
    }));
    assert_eq!(next["console"], "integer Date TRUE \n", "{next}");
    // The pointer is alice's: bob cannot use it.
    let r = s.client_as(TOK_B).post(
        "/v1/run",
        &json!({"script": "1", "dataframes": [{"data_pointer": pointer, "name": "t"}]}),
    );
    r.error(404, "data_pointer_unresolved");
}

#[test]
fn publishing_refuses_files_outside_the_sessions_tempdir() {
    let s = table_server(None, 100);
    let c = s.client();
    // R code that names a host file directly through the tool is refused.
    let out = c.run(&json!({
        "script": "tools$rvisor.publish(path = '/etc/passwd', name = 'x')"
    }));
    assert_eq!(out["outcome"], "error");
    assert!(
        out["error"]["message"]
            .as_str()
            .unwrap()
            .contains("temporary directory"),
        "{out}"
    );
    // So is a symlink to it inside the temp dir.
    let out = c.run(&json!({
        "script": "f <- file.path(tempdir(), 'link.csv'); file.symlink('/etc/passwd', f); tools$rvisor.publish(path = f, name = 'x')"
    }));
    assert_eq!(out["outcome"], "error", "{out}");
}

#[test]
fn the_openapi_document_lists_every_route_and_the_contract_types() {
    let s = Server::open();
    let doc = s.client().get("/v1/openapi.json").ok();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let paths = doc["paths"].as_object().unwrap();
    for p in [
        "/v1/health",
        "/v1/packages",
        "/v1/validate",
        "/v1/run",
        "/v1/sessions",
        "/v1/sessions/{id}",
        "/v1/sessions/{id}/run",
        "/v1/sessions/{id}/cancel",
        "/v1/tables",
        "/v1/tables/{pointer}",
    ] {
        assert!(paths.contains_key(p), "{p} missing");
    }
    // This server keeps no checkpoints: it offers (and lists) none of the
    // checkpoint operations; one with a state directory lists all three.
    for (_, p) in rvisor_server::http::CHECKPOINT_OPERATIONS {
        assert!(!paths.contains_key(*p), "{p} listed");
    }
    let dir = TestDir::new("http-doc-durable");
    let durable = durable_server(&dir);
    let durable_doc = durable.client().get("/v1/openapi.json").ok();
    for (_, p) in rvisor_server::http::CHECKPOINT_OPERATIONS {
        assert!(durable_doc["paths"].get(*p).is_some(), "{p} missing");
    }
    let run = &doc["components"]["schemas"]["RunResult"]["properties"];
    for key in [
        "schema_version",
        "execution_id",
        "outcome",
        "console",
        "segments",
        "plots",
        "session",
        "usage",
    ] {
        assert!(run.get(key).is_some(), "RunResult.{key} missing");
    }
    // A server without tokens requires none, and declares no scheme: a
    // generated client sends no token (one with tokens: tests/openapi.rs).
    assert!(
        doc["components"].get("securitySchemes").is_none(),
        "{}",
        doc["components"]
    );
    assert!(doc.get("security").is_none());
    for (path, item) in paths {
        for (method, op) in item.as_object().unwrap() {
            assert_eq!(op["security"], json!([]), "{method} {path}");
        }
    }
}

/// Property: whatever bytes arrive as a request body, every endpoint that
/// decodes JSON answers 400 or 422 with the error shape, never 5xx, and the
/// server goes on.
#[test]
fn garbage_bodies_are_client_errors_never_server_errors() {
    let s = Server::open();
    let c = s.client();
    let pieces = [
        "{",
        "}",
        "[",
        "]",
        "\"script\"",
        "\"code\"",
        ":",
        ",",
        "null",
        "1e999",
        "-0",
        "\"variables\"",
        "[{\"name\":",
        "\"value\"",
        "true",
        "\"dataframes\"",
        "\"timeout_seconds\"",
        "\"\\ud800\"",
        "\u{7f}",
        "\"x\"",
    ];
    let mut seed = 7u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize
    };
    for i in 0..120 {
        let n = 1 + next() % 10;
        let body: String = (0..n).map(|_| pieces[next() % pieces.len()]).collect();
        if serde_json::from_str::<Value>(&body)
            .map(|v| v.get("script").is_some() || v.get("code").is_some())
            .unwrap_or(false)
        {
            continue; // could be a valid request that runs R: not this test's business
        }
        let path = ["/v1/run", "/v1/validate", "/v1/sessions"][i % 3];
        let r = c.post_raw(path, &body);
        assert!(
            matches!(r.status, 400 | 413 | 422) || (path == "/v1/sessions" && r.status == 201),
            "{path} {body:?} -> {} {}",
            r.status,
            r.text
        );
        if r.status != 201 {
            r.error_with(r.status);
        }
    }
    assert_eq!(c.get("/v1/health").ok()["status"], "ok");
}

#[test]
fn a_cpu_bound_run_is_stopped_by_its_cpu_limit_too() {
    let s = Server::open();
    // A busy loop in R answers interrupts, so the wall clock ends it first:
    // either way the run is timed_out and the server goes on.
    let r = s
        .client()
        .run(&json!({"script": "repeat {}", "timeout_seconds": 1}));
    assert_eq!(r["outcome"], "timed_out", "{r}");
    assert_eq!(r["error"]["timed_out"], true);
}

// ---------------------------------------------------------------------------
// Durable sessions: checkpoint, hibernate, restore

/// A server whose sessions checkpoint into a state directory of the test's
/// own (`dir/state`), with no automatic checkpoints or hibernation: the
/// tests ask for them.
fn durable_server(dir: &TestDir) -> Server {
    let store = rvisor::checkpoint::DirStore::new(dir.path().join("state")).expect("a state dir");
    let sup = Supervisor::new(SupervisorConfig {
        pool: PoolConfig {
            zygote: true,
            spares: 0,
            preload: Some(Vec::new()),
            ..Default::default()
        },
        checkpoints: Some(std::sync::Arc::new(store)),
        defaults: SessionOptions {
            checkpoint_after: None,
            hibernate_after: None,
            ..SessionOptions::default()
        },
        ..SupervisorConfig::default()
    })
    .expect("the supervisor starts");
    let mut cfg = ServeConfig::default();
    cfg.tables.dir = dir.path().join("tables");
    Server::start(sup, cfg)
}

/// Waits until session `id` is hibernated; its status then.
fn wait_hibernated(c: &Client, id: &str) -> Value {
    wait_for("the session to hibernate", || {
        let st = c.get(&format!("/v1/sessions/{id}")).ok();
        (st["state"] == "hibernated").then_some(st)
    })
}

#[test]
fn a_session_checkpoints_hibernates_wakes_on_its_next_run_and_rolls_back() {
    let dir = TestDir::new("http-durable");
    let srv = durable_server(&dir);
    let c = srv.client();
    let id = c.new_session();
    let r = c.session_run(&id, "keep <- 'before'; library(splines)");
    assert_eq!(r["outcome"], "complete", "{r}");

    let info = c
        .post(&format!("/v1/sessions/{id}/checkpoint"), &json!({}))
        .ok();
    assert_eq!(info["written"], true, "{info}");
    assert!(
        info["manifest"]["objects"]
            .as_array()
            .is_some_and(|o| o.contains(&json!("keep"))),
        "{info}"
    );
    let st = c
        .post(&format!("/v1/sessions/{id}/hibernate"), &json!({}))
        .ok();
    assert_eq!(st["id"], id.as_str(), "{st}");
    let st = wait_hibernated(&c, &id);
    assert!(
        st["pid"].is_null(),
        "a hibernated session has no worker: {st}"
    );

    // The next run wakes it: the objects and the attached package are back.
    let r = c.session_run(&id, "cat(keep, 'package:splines' %in% search())");
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(r["session"]["restored"]["reason"], "hibernated", "{r}");
    assert!(r["session"]["reset_reason"].is_null(), "{r}");
    assert_eq!(r["session"]["fresh"], false, "{r}");
    assert!(
        r["console"].as_str().unwrap().ends_with("before TRUE"),
        "{r}"
    );
    let st = c.get(&format!("/v1/sessions/{id}")).ok();
    assert_eq!(st["state"], "idle", "{st}");
    assert!(st["pid"].as_u64().is_some(), "{st}");

    // Roll back: what came after the checkpoint is gone, what was in it
    // stays.
    c.session_run(&id, "after <- 1; keep <- 'changed'");
    let st = c
        .post(&format!("/v1/sessions/{id}/restore"), &json!({}))
        .ok();
    assert_eq!(st["id"], id.as_str(), "{st}");
    let r = c.session_run(&id, "cat(keep, exists('after'))");
    assert_eq!(r["session"]["restored"]["reason"], "restore", "{r}");
    assert_eq!(r["session"]["reset_reason"], "restore", "{r}");
    assert!(
        r["console"].as_str().unwrap().ends_with("before FALSE"),
        "{r}"
    );

    // A hibernated session rolls back too: to the checkpoint hibernation
    // took, without a worker in between.
    c.session_run(&id, "late <- 2");
    c.post(&format!("/v1/sessions/{id}/hibernate"), &json!({}))
        .ok();
    wait_hibernated(&c, &id);
    let st = c
        .post(&format!("/v1/sessions/{id}/restore"), &json!({}))
        .ok();
    assert!(st["pid"].is_null(), "{st}");
    let r = c.session_run(&id, "cat(keep, late)");
    assert_eq!(r["session"]["restored"]["reason"], "restore", "{r}");
    assert!(r["console"].as_str().unwrap().ends_with("before 2"), "{r}");

    // Unknown sessions are 404 for every durable operation.
    for op in ["checkpoint", "hibernate", "restore"] {
        c.post(&format!("/v1/sessions/s-0000000000000000/{op}"), &json!({}))
            .error(404, "not_found");
    }
}

#[test]
fn restore_or_checkpoint_with_nothing_to_keep_is_409_and_without_a_state_dir_404() {
    let dir = TestDir::new("http-durable-409");
    let srv = durable_server(&dir);
    let c = srv.client();
    let id = c.new_session();
    // Nothing ran yet: nothing to checkpoint, nothing to roll back to.
    let m = c
        .post(&format!("/v1/sessions/{id}/checkpoint"), &json!({}))
        .error(409, "conflict");
    assert!(m.contains("nothing to checkpoint"), "{m}");
    c.session_run(&id, "x <- 1");
    let m = c
        .post(&format!("/v1/sessions/{id}/restore"), &json!({}))
        .error(409, "conflict");
    assert!(m.contains("no checkpoint"), "{m}");
    // The session is untouched.
    let r = c.session_run(&id, "x");
    assert_eq!(r["console"], "[1] 1\n", "{r}");
    assert!(r["session"]["restored"].is_null(), "{r}");

    let plain = Server::open();
    let c = plain.client();
    let id = c.new_session();
    c.session_run(&id, "x <- 1");
    // A server without a state directory does not offer the three (its
    // document lists none of them): 404, saying how to get them.
    for op in ["checkpoint", "hibernate", "restore"] {
        let m = c
            .post(&format!("/v1/sessions/{id}/{op}"), &json!({}))
            .error(404, "not_found");
        assert!(m.contains("--state-dir"), "{op}: {m}");
    }
    let st = c.get(&format!("/v1/sessions/{id}")).ok();
    assert_eq!(st["state"], "idle", "{st}");
}

#[test]
fn a_checkpoint_file_cut_short_on_disk_gives_a_fresh_session_that_says_why() {
    // durable.rs damages the compressed state through the store; here the
    // file in the server's state directory is cut in half, so the manifest
    // at its end is gone, and the reason travels over HTTP.
    let dir = TestDir::new("http-durable-cut");
    let srv = durable_server(&dir);
    let c = srv.client();
    let id = c.new_session();
    c.session_run(&id, "x <- rnorm(1000)");
    let info = c
        .post(&format!("/v1/sessions/{id}/checkpoint"), &json!({}))
        .ok();
    let file = dir
        .path()
        .join("state")
        .join(format!("{}.ckpt", info["key"].as_str().expect("a key")));
    c.post(&format!("/v1/sessions/{id}/hibernate"), &json!({}))
        .ok();
    wait_hibernated(&c, &id);
    let bytes = std::fs::read(&file).expect("the checkpoint file");
    std::fs::write(&file, &bytes[..bytes.len() / 2]).expect("cut the file");

    let r = c.session_run(&id, "exists('x')");
    assert_eq!(r["outcome"], "complete", "{r}");
    let reason = r["session"]["reset_reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("restore_failed: "), "{r}");
    assert!(reason.contains("damaged"), "{r}");
    assert_eq!(r["session"]["fresh"], true, "{r}");
    assert!(r["session"]["restored"].is_null(), "{r}");
    let console = r["console"].as_str().unwrap();
    assert!(console.contains("could not be restored"), "{console}");
    assert!(console.ends_with("[1] FALSE\n"), "{console}");
    // The fresh session goes on.
    assert_eq!(c.session_run(&id, "1 + 1")["console"], "[1] 2\n");
}
