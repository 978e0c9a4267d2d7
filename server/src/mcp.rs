//! `rvisor mcp`: the Model Context Protocol over stdio, for agents.
//!
//! JSON-RPC 2.0, one message per line. The tools are thin wrappers over the
//! [`Service`]'s operations, with the same checks as every other surface: health, packages, validation, one-shot runs (with
//! variables and data pointers), and one persistent session per connection
//! (with a checkpoint store, `rvisor mcp --state-dir`, also its checkpoint
//! and roll-back: `checkpoint_r_session`, `restore_r_session`).
//! Results come back as MCP content: console text, each table's Markdown
//! (compact, for the model) and an HTML value's text line, plots as
//! images (PNG) or embedded resources (SVG), HTML (widgets, tables) as
//! embedded `text/html` resources, the RunResult as structured content
//! (the run tools declare an `outputSchema`), `isError` when the R code
//! failed, timed out or was refused. While a run goes on, a call with
//! `_meta.progressToken` gets `notifications/progress` (from
//! `rvisor_progress()` and text progress bars), and after
//! `logging/setLevel` the console text comes as `notifications/message`
//! (logger `r`: stdout and messages `info`, stderr `notice`, warnings
//! `warning`, errors `error`).

use crate::service::{
    ErrorCode, RunScript, Service, ServiceConfig, ServiceError, SessionRun, Surface,
};
use crate::tables::TableConfig;
use rvisor::{CallEvent, CancelToken, EventKind, RunResult, Supervisor};
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// The protocol revisions this server speaks (newest first).
const PROTOCOL_VERSIONS: [&str; 3] = ["2025-06-18", "2025-03-26", "2024-11-05"];

/// The tenant of everything an MCP connection creates.
const TENANT: &str = "mcp";

const INSTRUCTIONS: &str = "R for data work. Call check_r_server_health first to learn the live \
limits (script size, timeouts, forbidden functions). Validate scripts with validate_r_script before \
running them: it is cheap and meant for a validate-fix loop. Use run_r_script (a fresh R each time) \
to explore, shape and summarise data, not to fit or search for models; pass tables by data pointer, \
never paste rows; omit variables that would be null. Use run_r_code for a conversation that keeps \
its variables, and reset_r_session to start it over.";

/// Added to [`INSTRUCTIONS`] when the server keeps checkpoints.
const DURABLE_INSTRUCTIONS: &str = " The session is durable: checkpoint_r_session before a risky \
step, restore_r_session to go back to it.";

/// The tools; the checkpoint tools only when `durable` (the server keeps
/// checkpoints), the install tool only when `installs` (the server has a
/// package repository), so a model is never offered a tool that cannot
/// work.
fn tools(rules: &rvisor::SafetyRules, durable: bool, installs: bool) -> Value {
    let t = &rules.timeout_seconds;
    let timeout = format!("{}..{} seconds; default {}", t.min, t.max, t.default);
    let vars = json!({
        "type": "array",
        "description": "Scalar or flat-array variables bound in R before the script runs. Omit null values.",
        "items": {"type": "object", "properties": {"name": {"type": "string"}, "value": {}}, "required": ["name", "value"]}
    });
    let frames = json!({
        "type": "array",
        "description": "Tables to load as data frames, by data pointer (never paste rows).",
        "items": {"type": "object", "properties": {"data_pointer": {"type": "string"}, "name": {"type": "string"}}, "required": ["data_pointer", "name"]}
    });
    let mut list = json!([
        {
            "name": "check_r_server_health",
            "description": "Call this first: liveness, R version, and the live safety rules (script size limit, nesting limit, forbidden functions, timeout default/min/max, data frame and variable limits).",
            "inputSchema": {"type": "object", "properties": {}}
        },
        {
            "name": "list_r_packages",
            "description": "Every installed R package a script can library(), with its version.",
            "inputSchema": {"type": "object", "properties": {}}
        },
        {
            "name": "validate_r_script",
            "description": "Check an R script without running it: syntax errors, forbidden functions and nesting depth (with line and column), plus style notes that never block. Cheap: use it in a validate-fix loop before run_r_script.",
            "inputSchema": {"type": "object", "properties": {"script": {"type": "string"}}, "required": ["script"]}
        },
        {
            "name": "run_r_script",
            "description": format!("Run an R script once in a fresh R session (nothing persists). For exploring, shaping and summarising data, not for fitting or searching for models. {RETURNS} rvisor_result(x) returns structured JSON; rvisor_publish(df) returns a new data pointer."),
            "inputSchema": {"type": "object", "properties": {
                "script": {"type": "string"},
                "timeout_seconds": {"type": "number", "description": timeout},
                "variables": vars,
                "dataframes": frames,
                "display": display_schema(),
                "files": {"type": "array", "description": "Files put in the run's working directory before the script runs (base64). The files the script writes come back as `artifacts` (name, size, media type, sha256, uri).", "items": {"type": "object", "properties": {"name": {"type": "string", "description": "a relative path, e.g. data/in.xlsx"}, "content_base64": {"type": "string"}}, "required": ["name", "content_base64"]}}
            }, "required": ["script"]},
            "outputSchema": output_schema()
        },
        {
            "name": "run_r_code",
            "description": format!("Run R code in this conversation's persistent R session: variables, loaded packages and options stay between calls. {RETURNS}"),
            "inputSchema": {"type": "object", "properties": {
                "code": {"type": "string"},
                "timeout_seconds": {"type": "number", "description": timeout},
                "display": display_schema()
            }, "required": ["code"]},
            "outputSchema": output_schema()
        },
        {
            "name": "reset_r_session",
            "description": "Start this conversation's R session over: all its variables are dropped.",
            "inputSchema": {"type": "object", "properties": {}}
        }
    ]);
    if durable {
        let more = json!([
            {
                "name": "checkpoint_r_session",
                "description": "Save this conversation's R session now (objects, packages, options, RNG, working-directory files), e.g. before a risky step; restore_r_session goes back to it. Names objects that cannot be saved (connections, external pointers). hibernate: true also frees its memory until the next run_r_code.",
                "inputSchema": {"type": "object", "properties": {
                    "hibernate": {"type": "boolean", "description": "Also release the R process until the next run_r_code (state kept). Default false."}
                }}
            },
            {
                "name": "restore_r_session",
                "description": "Roll this conversation's R session back to its last checkpoint_r_session: its objects and packages as they were then; everything done since is dropped.",
                "inputSchema": {"type": "object", "properties": {}}
            }
        ]);
        if let (Some(l), Value::Array(more)) = (list.as_array_mut(), more) {
            l.extend(more);
        }
    }
    if installs {
        if let Some(l) = list.as_array_mut() {
            l.push(json!({
                "name": "install_r_packages",
                "description": "Install R packages (with their dependencies) from the server's allowed repositories into this tenant's library; later runs and sessions can library() them. Prefer it to install.packages() in a script. Check list_r_packages first: it shows what is installed and what may be installed.",
                "inputSchema": {"type": "object", "properties": {
                    "packages": {"type": "array", "items": {"type": "string"}, "description": "Package names, e.g. [\"janitor\"]"},
                    "lockfile": {"type": "object", "description": "Instead of packages: a lockfile (GET /v1/packages/lockfile) to install exactly"}
                }}
            }));
        }
    }
    list
}

/// What the run tools' descriptions say comes back.
const RETURNS: &str = "Returns the console text (prints, messages, warnings, errors); a printed data frame or matrix also as a compact Markdown table (at most 20 rows and 20 columns unless display.max_rows/max_cols say otherwise); HTML values (htmlwidgets such as DT or plotly, htmltools tags, flextable) as self-contained text/html resources with a one-line text note; plots as PNG images (display.plot_format svg or both adds SVG resources); the whole RunResult, with every display's MIME bundle in displays, as structured content.";

/// The `display` argument of the run tools (rvisor::DisplayOptions).
fn display_schema() -> Value {
    json!({"type": "object", "additionalProperties": false,
           "description": "Rich results: tables as Markdown/HTML/JSON preview, HTML values, plot formats.",
           "properties": {
        "enabled": {"type": "boolean", "description": "false: text and PNG plots only (HTML values are then refused as unsupported_output). Default true."},
        "max_rows": {"type": "integer", "minimum": 1, "maximum": rvisor_protocol::display::MAX_TABLE_SIDE, "description": "Rows of a table shown (default 20)."},
        "max_cols": {"type": "integer", "minimum": 1, "maximum": rvisor_protocol::display::MAX_TABLE_SIDE, "description": "Columns of a table shown (default 20)."},
        "html_max_bytes": {"type": "integer", "minimum": 1, "description": "Most bytes of one value's HTML (default 5 MiB); past it the HTML is left out with a note."},
        "plot_format": {"type": "string", "enum": ["png", "svg", "both"], "description": "Plot images: png (default), svg or both."}
    }})
}

/// The run tools' `outputSchema`: a RunResult (CONTRACT.md). Open-ended
/// (no required fields, other properties allowed) so that a refusal's
/// `{"error": {code, message}}` conforms too.
fn output_schema() -> Value {
    json!({"type": "object", "properties": {
        "outcome": {"type": "string"},
        "success": {"type": "boolean"},
        "console": {"type": "string"},
        "segments": {"type": "array", "items": {"type": "object"}},
        "warnings": {"type": "array", "items": {"type": "string"}},
        "error": {"type": ["object", "null"]},
        "plots": {"type": "array", "items": {"type": "object", "properties": {
            "mime": {"type": "string"}, "width": {"type": "integer"},
            "height": {"type": "integer"}, "data_base64": {"type": "string"}}}},
        "displays": {"type": "array", "description": "MIME bundles shaped like Jupyter's display_data: data (MIME type to value) and metadata", "items": {"type": "object", "properties": {
            "data": {"type": "object"}, "metadata": {"type": "object"}}}},
        "result": {},
        "truncated": {"type": "boolean"},
        "duration_ms": {"type": "number"}
    }})
}

/// A result as MCP tool content.
fn result_content(r: &RunResult) -> Value {
    let mut content = Vec::new();
    let mut text = r.console.clone();
    if let Some(v) = &r.result {
        text.push_str(&format!("\nresult: {v}"));
    }
    for p in &r.published {
        text.push_str(&format!("\npublished: {p}"));
    }
    if text.trim().is_empty() && r.displays.is_empty() {
        text = format!("({})", r.outcome);
    }
    if !text.is_empty() {
        content.push(json!({"type": "text", "text": text}));
    }
    for (i, d) in r.displays.iter().enumerate() {
        let kind = d
            .metadata
            .get("rvisor")
            .and_then(|m| m.get("kind"))
            .and_then(Value::as_str)
            .unwrap_or("");
        let uri = |ext: &str| format!("rvisor://{}/display/{}.{ext}", r.execution_id, i + 1);
        let text_of = |mime: &str| d.data.get(mime).and_then(Value::as_str);
        if kind == "table" {
            if let Some(md) = text_of("text/markdown") {
                content.push(json!({"type": "text", "text": md}));
            }
        } else if kind == "html" {
            if let Some(t) = text_of("text/plain") {
                content.push(json!({"type": "text", "text": t}));
            }
        }
        if kind != "plot" {
            if let Some(html) = text_of("text/html") {
                content.push(json!({"type": "resource", "resource": {
                    "uri": uri("html"), "mimeType": "text/html", "text": html}}));
            }
        }
        if let Some(svg) = text_of("image/svg+xml") {
            content.push(json!({"type": "resource", "resource": {
                "uri": uri("svg"), "mimeType": "image/svg+xml", "text": svg}}));
        }
    }
    for p in r.plots.iter().filter(|p| p.mime == "image/png") {
        content.push(json!({"type": "image", "data": p.data_base64, "mimeType": p.mime}));
    }
    // The files the call wrote, as links the client reads with
    // resources/read (docs/files.md).
    for a in &r.artifacts {
        content.push(json!({
            "type": "resource_link",
            "uri": resource_uri(a),
            "name": a.name,
            "mimeType": a.media_type,
            "size": a.size,
        }));
    }
    let failed = !r.success;
    json!({
        "content": content,
        "structuredContent": r,
        "isError": failed,
    })
}

/// The resource URI of an artifact: a one-shot run's stored artifact, or
/// a file of the conversation's session.
fn resource_uri(a: &rvisor::Artifact) -> String {
    match a.uri.strip_prefix("/v1/artifacts/") {
        Some(rest) => format!("{ARTIFACT_URI}{rest}"),
        None => format!("{FILE_URI}{}", a.name),
    }
}

/// Resources: the files of the conversation's session, and artifacts.
const FILE_URI: &str = "rvisor://session/main/files/";
const ARTIFACT_URI: &str = "rvisor://artifacts/";

/// `resources/list`: the files of the conversation's session (none
/// before it first ran).
fn list_resources(svc: &Service) -> Result<Value, (i64, String)> {
    let files = match svc.named_session(TENANT, "main", false) {
        Ok(Some(id)) => svc
            .session_files(TENANT, &id)
            .map_err(|e| (-32603, e.to_string()))?,
        _ => Vec::new(),
    };
    let resources: Vec<Value> = files
        .iter()
        .map(|f| {
            json!({"uri": format!("{FILE_URI}{}", f.name), "name": f.name,
                   "mimeType": f.media_type, "size": f.size})
        })
        .collect();
    Ok(json!({ "resources": resources }))
}

/// `resources/read` of a session file or an artifact (inline, at most
/// `INLINE_FILE_BYTES`): text for text types, else base64.
fn read_resource(svc: &Service, params: &Value) -> Result<Value, (i64, String)> {
    use base64::Engine as _;
    let uri = params.get("uri").and_then(Value::as_str).unwrap_or("");
    let (mime, bytes) = if let Some(name) = uri.strip_prefix(FILE_URI) {
        let id = match svc.named_session(TENANT, "main", false) {
            Ok(Some(id)) => id,
            _ => {
                return Err((
                    -32002,
                    format!("no resource {uri:?}: the session has not run"),
                ))
            }
        };
        let f = svc
            .get_file_inline(TENANT, &id, name)
            .map_err(|e| (-32002, e.to_string()))?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(f["content_base64"].as_str().unwrap_or(""))
            .unwrap_or_default();
        (f["media_type"].as_str().unwrap_or("").to_string(), bytes)
    } else if let Some((exec, name)) = uri
        .strip_prefix(ARTIFACT_URI)
        .and_then(|r| r.split_once('/'))
    {
        let (a, bytes) = svc
            .artifact_inline(TENANT, exec, name)
            .map_err(|e| (-32002, e.to_string()))?;
        (a.media_type, bytes)
    } else {
        return Err((
            -32002,
            format!("no resource {uri:?}; resources/list names them"),
        ));
    };
    let content = match String::from_utf8(bytes) {
        Ok(text) if mime.starts_with("text/") || mime == "application/json" => {
            json!({"uri": uri, "mimeType": mime, "text": text})
        }
        Ok(text) => json!({"uri": uri, "mimeType": mime,
            "blob": base64::engine::general_purpose::STANDARD.encode(text.as_bytes())}),
        Err(e) => json!({"uri": uri, "mimeType": mime,
            "blob": base64::engine::general_purpose::STANDARD.encode(e.as_bytes())}),
    };
    Ok(json!({ "contents": [content] }))
}

fn text_result(v: &Value, is_error: bool) -> Value {
    json!({
        "content": [{"type": "text", "text": serde_json::to_string_pretty(v).unwrap_or_default()}],
        "structuredContent": v,
        "isError": is_error,
    })
}

/// A service error as a tool result the model can read and act on.
fn error_result(e: &ServiceError) -> Value {
    text_result(&json!({ "error": e.to_json() }), true)
}

/// The answer of a session tool called before `run_r_code` made the session.
fn no_session(what: &str) -> Value {
    error_result(&ServiceError::new(
        ErrorCode::UnknownSession,
        format!("no session yet: run_r_code starts one; there is nothing to {what}"),
    ))
}

/// The arguments `keys` of a tool call decoded into a service request type
/// (other keys are ignored); a missing or mistyped argument is a protocol
/// error (-32602) that names it.
fn decode<T: serde::de::DeserializeOwned>(args: &Value, keys: &[&str]) -> Result<T, (i64, String)> {
    let map: serde_json::Map<String, Value> = keys
        .iter()
        .filter_map(|k| args.get(*k).map(|v| (k.to_string(), v.clone())))
        .collect();
    serde_json::from_value(Value::Object(map))
        .map_err(|e| (-32602, format!("invalid arguments: {e}")))
}

struct State {
    service: Service,
}

/// What a client asked to hear while a tool call runs.
#[derive(Debug, Clone, Default)]
struct Follow {
    /// `_meta.progressToken` of the call: progress notifications.
    progress_token: Option<Value>,
    /// The level set with `logging/setLevel`: console text as log messages.
    log_level: Option<usize>,
}

/// MCP's log levels, lowest first.
const LOG_LEVELS: [&str; 8] = [
    "debug",
    "info",
    "notice",
    "warning",
    "error",
    "critical",
    "alert",
    "emergency",
];

impl Follow {
    fn wanted(&self) -> bool {
        self.progress_token.is_some() || self.log_level.is_some()
    }

    /// The notification for `e`, if the client asked for its kind.
    fn notification(&self, e: &CallEvent) -> Option<Value> {
        if let EventKind::Progress {
            value,
            total,
            message,
        } = &e.kind
        {
            let token = self.progress_token.as_ref()?;
            let mut p = json!({"progressToken": token, "progress": value});
            if let Some(t) = total {
                p["total"] = json!(t);
            }
            if let Some(m) = message {
                p["message"] = json!(m);
            }
            return Some(
                json!({"jsonrpc": "2.0", "method": "notifications/progress", "params": p}),
            );
        }
        let (level, data) = match &e.kind {
            EventKind::Stdout { text } => (1, json!(text)),
            EventKind::Message { text } => (1, json!(text)),
            EventKind::Stderr { text } => (2, json!(text)),
            EventKind::Warning { message, call } => (3, json!({"warning": message, "call": call})),
            EventKind::Error { message, call, .. } => (4, json!({"error": message, "call": call})),
            EventKind::Plot { index } => (1, json!({"plot": index})),
            // Console text this client read too slowly to be sent: said
            // as a warning (the tool's result has all of it).
            EventKind::Lagged {
                first_seq,
                events,
                bytes,
                message,
            } => (
                3,
                json!({"lagged": message, "first_seq": first_seq, "events": events, "bytes": bytes}),
            ),
            _ => return None,
        };
        if level < self.log_level? {
            return None;
        }
        Some(json!({"jsonrpc": "2.0", "method": "notifications/message",
                    "params": {"level": LOG_LEVELS[level], "logger": "r", "data": data}}))
    }
}

impl State {
    /// Runs one tool call; `Err` is a protocol error (unknown tool, bad
    /// arguments), `Ok` a tool result (which may be `isError`). While it
    /// runs, `notify` gets the notifications `follow` asks for.
    fn call(
        &mut self,
        name: &str,
        args: &Value,
        cancel: &CancelToken,
        follow: &Follow,
        notify: &mut dyn FnMut(&Value),
    ) -> Result<Value, (i64, String)> {
        let svc = &self.service;
        svc.count_request(Surface::Mcp);
        match name {
            "check_r_server_health" => Ok(text_result(&svc.health(), false)),
            "list_r_packages" => match svc.packages_report(TENANT) {
                Ok(p) => Ok(text_result(&p, false)),
                Err(e) => Ok(error_result(&e)),
            },
            "install_r_packages" => match svc.install_request(TENANT, args) {
                Ok(installed) => Ok(text_result(&json!({ "installed": installed }), false)),
                Err(e) if e.code == crate::service::ErrorCode::Invalid => Err((-32602, e.message)),
                Err(e) => Ok(error_result(&e)),
            },
            "validate_r_script" => {
                let script = args
                    .get("script")
                    .and_then(Value::as_str)
                    .ok_or_else(|| (-32602, "script (a string) is required".to_string()))?;
                let v = svc.validate(script);
                let invalid = !v.valid;
                Ok(text_result(&json!(v), invalid))
            }
            "run_r_script" => {
                let req: RunScript = decode(
                    args,
                    &[
                        "script",
                        "timeout_seconds",
                        "variables",
                        "dataframes",
                        "display",
                        "files",
                    ],
                )?;
                let ran = if follow.wanted() {
                    let (feed, mut events) = svc.event_feed(TENANT);
                    let (svc, cancel) = (svc.clone(), cancel.clone());
                    let run = std::thread::spawn(move || {
                        svc.run_script_streaming(TENANT, req, Surface::Mcp, &cancel, &feed)
                    });
                    // A refused request feeds nothing: the loop ends with
                    // the thread (the feed is dropped), without a result.
                    for e in events.by_ref() {
                        if let Some(n) = follow.notification(&e) {
                            notify(&n);
                        }
                    }
                    run.join().unwrap_or_else(|_| {
                        Err(ServiceError::new(
                            ErrorCode::Internal,
                            "the run failed inside the server",
                        ))
                    })
                } else {
                    svc.run_script(TENANT, req, Surface::Mcp, cancel)
                };
                match ran {
                    Ok(r) => Ok(result_content(&r)),
                    Err(e) => Ok(error_result(&e)),
                }
            }
            "run_r_code" => {
                let req: SessionRun = decode(args, &["code", "timeout_seconds", "display"])?;
                // The files the call changed come back in its artifacts
                // (the service's), as resource links (docs/files.md).
                let call = svc.named_session(TENANT, "main", true).and_then(|id| {
                    let id = id.unwrap_or_default();
                    if follow.wanted() {
                        svc.session_run_streaming(TENANT, &id, &req)
                    } else {
                        svc.session_run(TENANT, &id, &req)
                    }
                });
                match call {
                    Ok(call) if follow.wanted() => {
                        let token = call.cancel_token();
                        cancel.on_cancel(move || token.cancel());
                        let mut events = call.events();
                        while let Some(e) = events.next_blocking() {
                            if let EventKind::Result { result } = &e.kind {
                                return Ok(result_content(result));
                            }
                            if let Some(n) = follow.notification(&e) {
                                notify(&n);
                            }
                        }
                        Err((-32603, "the call ended without a result".to_string()))
                    }
                    Ok(call) => {
                        let token = call.cancel_token();
                        cancel.on_cancel(move || token.cancel());
                        Ok(result_content(&call.wait()))
                    }
                    Err(e) => Ok(error_result(&e)),
                }
            }
            "reset_r_session" => {
                let status = match svc.named_session(TENANT, "main", false) {
                    Ok(Some(id)) => match svc.reset(TENANT, &id) {
                        Ok(status) => json!({"reset": true, "status": status}),
                        Err(e) => return Ok(error_result(&e)),
                    },
                    Ok(None) => {
                        json!({"reset": false, "message": "no session yet: the next run_r_code starts one"})
                    }
                    Err(e) => return Ok(error_result(&e)),
                };
                Ok(text_result(&status, false))
            }
            "checkpoint_r_session" => {
                let hibernate = match args.get("hibernate") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(_) => return Err((-32602, "hibernate must be a boolean".to_string())),
                };
                let id = match svc.named_session(TENANT, "main", false) {
                    Ok(Some(id)) => id,
                    Ok(None) => return Ok(no_session("checkpoint")),
                    Err(e) => return Ok(error_result(&e)),
                };
                let info = match svc.checkpoint(TENANT, &id) {
                    Ok(info) => info,
                    Err(e) => return Ok(error_result(&e)),
                };
                let mut answer = json!({"checkpoint": info, "hibernating": hibernate});
                if hibernate {
                    match svc.hibernate(TENANT, &id) {
                        Ok(status) => answer["status"] = json!(status),
                        Err(e) => return Ok(error_result(&e)),
                    }
                }
                Ok(text_result(&answer, false))
            }
            "restore_r_session" => match svc.named_session(TENANT, "main", false) {
                Ok(Some(id)) => match svc.restore(TENANT, &id) {
                    Ok(status) => Ok(text_result(
                        &json!({"restored": true, "status": status,
                                "message": "the next run_r_code starts from the last checkpoint"}),
                        false,
                    )),
                    Err(e) => Ok(error_result(&e)),
                },
                Ok(None) => Ok(no_session("restore")),
                Err(e) => Ok(error_result(&e)),
            },
            other => Err((-32602, format!("unknown tool {other:?}; see tools/list"))),
        }
    }
}

fn reply(
    out: &mut impl Write,
    id: &Value,
    result: Result<Value, (i64, String)>,
) -> std::io::Result<()> {
    let msg = match result {
        Ok(r) => json!({"jsonrpc": "2.0", "id": id, "result": r}),
        Err((code, message)) => {
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
        }
    };
    serde_json::to_writer(&mut *out, &msg)?;
    out.write_all(b"\n")?;
    out.flush()
}

/// Calls in flight, by JSON-RPC request id: what the input reader cancels
/// when the client sends `notifications/cancelled` or goes away.
type InFlight = Arc<Mutex<Vec<(Value, CancelToken)>>>;

/// Reads `input` on a thread of its own, so that the end of the input (the
/// client went away) and `notifications/cancelled` are seen while a call
/// runs: either cancels the calls in flight.
fn read_input<R: BufRead + Send + 'static>(
    input: R,
    in_flight: InFlight,
    gone: Arc<AtomicBool>,
) -> std::sync::mpsc::Receiver<std::io::Result<String>> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in input.lines() {
            if let Ok(l) = &line {
                if let Some(id) = cancelled_request(l) {
                    for (_, t) in lock(&in_flight).iter().filter(|(i, _)| *i == id) {
                        t.cancel();
                    }
                    continue;
                }
            }
            if tx.send(line).is_err() {
                return;
            }
        }
        // The client closed its end: nobody will read an answer.
        gone.store(true, Ordering::SeqCst);
        for (_, t) in lock(&in_flight).iter() {
            t.cancel();
        }
    });
    rx
}

/// The request id of a `notifications/cancelled` line.
fn cancelled_request(line: &str) -> Option<Value> {
    if !line.contains("notifications/cancelled") {
        return None;
    }
    let v: Value = serde_json::from_str(line).ok()?;
    if v.get("method")? != "notifications/cancelled" {
        return None;
    }
    v.get("params")?.get("requestId").cloned()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Serves MCP over `input`/`output` until the input ends. When it ends
/// while a call runs, the call is cancelled and the server returns.
pub fn serve<R: BufRead + Send + 'static, W: Write>(
    sup: &Supervisor,
    tables: TableConfig,
    input: R,
    output: W,
) -> std::io::Result<()> {
    serve_with(
        sup,
        ServiceConfig {
            tables,
            ..ServiceConfig::default()
        },
        input,
        output,
    )
}

/// [`serve`] with a whole service configuration (its tables, packages on
/// demand...).
pub fn serve_with<R: BufRead + Send + 'static, W: Write>(
    sup: &Supervisor,
    cfg: ServiceConfig,
    input: R,
    mut output: W,
) -> std::io::Result<()> {
    let service = Service::new(sup.clone(), cfg)?;
    let in_flight: InFlight = Arc::new(Mutex::new(Vec::new()));
    let gone = Arc::new(AtomicBool::new(false));
    let lines = read_input(input, in_flight.clone(), gone.clone());
    let durable = sup.config().checkpoints.is_some();
    let mut st = State { service };
    let mut log_level: Option<usize> = None;
    for line in lines {
        if gone.load(Ordering::SeqCst) {
            break;
        }
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let msg: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                reply(
                    &mut output,
                    &Value::Null,
                    Err((-32700, format!("parse error: {e}"))),
                )?;
                continue;
            }
        };
        let id = msg.get("id").cloned();
        let method = msg.get("method").and_then(Value::as_str).unwrap_or("");
        let params = msg.get("params").cloned().unwrap_or(Value::Null);
        let Some(id) = id else {
            continue; // a notification (initialized, cancelled...): no answer
        };
        let result = match method {
            "initialize" => {
                let asked = params
                    .get("protocolVersion")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let version = PROTOCOL_VERSIONS
                    .iter()
                    .find(|v| **v == asked)
                    .unwrap_or(&PROTOCOL_VERSIONS[0]);
                Ok(json!({
                    "protocolVersion": version,
                    "capabilities": {"tools": {"listChanged": false}, "resources": {"listChanged": false}, "logging": {}},
                    "serverInfo": {"name": "rvisor", "version": env!("CARGO_PKG_VERSION")},
                    "instructions": if durable {
                        format!("{INSTRUCTIONS}{DURABLE_INSTRUCTIONS}")
                    } else {
                        INSTRUCTIONS.to_string()
                    },
                }))
            }
            "ping" => Ok(json!({})),
            "logging/setLevel" => {
                match params
                    .get("level")
                    .and_then(Value::as_str)
                    .and_then(|l| LOG_LEVELS.iter().position(|x| *x == l))
                {
                    Some(i) => {
                        log_level = Some(i);
                        Ok(json!({}))
                    }
                    None => Err((
                        -32602,
                        format!("level must be one of {}", LOG_LEVELS.join(", ")),
                    )),
                }
            }
            "tools/list" => Ok(json!({ "tools": tools(
                    st.service.rules(),
                    durable,
                    !st.service.package_policy().is_null(),
                ) })),
            "resources/list" => list_resources(&st.service),
            "resources/read" => read_resource(&st.service, &params),
            "tools/call" => {
                let name = params.get("name").and_then(Value::as_str).unwrap_or("");
                let args = params.get("arguments").cloned().unwrap_or(json!({}));
                let cancel = CancelToken::new();
                lock(&in_flight).push((id.clone(), cancel.clone()));
                if gone.load(Ordering::SeqCst) {
                    cancel.cancel();
                }
                let follow = Follow {
                    progress_token: params
                        .get("_meta")
                        .and_then(|m| m.get("progressToken"))
                        .cloned(),
                    log_level,
                };
                let out = &mut output;
                let mut notify = |n: &Value| {
                    let _ = serde_json::to_writer(&mut *out, n);
                    let _ = out.write_all(b"\n");
                    let _ = out.flush();
                };
                let r = st.call(name, &args, &cancel, &follow, &mut notify);
                lock(&in_flight).retain(|(i, _)| *i != id);
                r
            }
            other => Err((-32601, format!("method {other:?} not found"))),
        };
        reply(&mut output, &id, result)?;
    }
    st.service.close_all();
    Ok(())
}
