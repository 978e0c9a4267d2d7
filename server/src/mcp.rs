//! `rvisor mcp`: the Model Context Protocol over stdio, for agents.
//!
//! JSON-RPC 2.0, one message per line. The tools are thin wrappers over the
//! library's operations: health, packages, validation, one-shot runs (with
//! variables and data pointers), and one persistent session per connection.
//! Results come back as MCP content: console text, plots as images, the
//! RunResult as structured content, `isError` when the R code failed, timed
//! out or was refused.

use crate::http::{publish_tool, take_published, Published};
use crate::tables::{TableConfig, TableStore};
use rvisor::{ops, CallContext, CallOptions, RunOptions, RunResult, Session, Supervisor};
use serde_json::{json, Value};
use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

fn tools() -> Value {
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
    json!([
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
            "description": "Run an R script once in a fresh R session (nothing persists). For exploring, shaping and summarising data, not for fitting or searching for models. Prints, warnings, errors and plots come back; rvisor_result(x) returns structured JSON; rvisor_publish(df) returns a new data pointer.",
            "inputSchema": {"type": "object", "properties": {
                "script": {"type": "string"},
                "timeout_seconds": {"type": "number", "description": "1..300; default from the server"},
                "variables": vars,
                "dataframes": frames
            }, "required": ["script"]}
        },
        {
            "name": "run_r_code",
            "description": "Run R code in this conversation's persistent R session: variables, loaded packages and options stay between calls. Plots come back as images.",
            "inputSchema": {"type": "object", "properties": {
                "code": {"type": "string"},
                "timeout_seconds": {"type": "number", "description": "1..300; default from the server"}
            }, "required": ["code"]}
        },
        {
            "name": "reset_r_session",
            "description": "Start this conversation's R session over: all its variables are dropped.",
            "inputSchema": {"type": "object", "properties": {}}
        }
    ])
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
    if text.trim().is_empty() {
        text = format!("({})", r.outcome);
    }
    content.push(json!({"type": "text", "text": text}));
    for p in &r.plots {
        content.push(json!({"type": "image", "data": p.data_base64, "mimeType": p.mime}));
    }
    let failed = !r.success;
    json!({
        "content": content,
        "structuredContent": r,
        "isError": failed,
    })
}

fn text_result(v: &Value, is_error: bool) -> Value {
    json!({
        "content": [{"type": "text", "text": serde_json::to_string_pretty(v).unwrap_or_default()}],
        "structuredContent": v,
        "isError": is_error,
    })
}

struct State {
    sup: Supervisor,
    tables: Arc<TableStore>,
    session: Option<(Session, Published)>,
}

impl State {
    fn session(&mut self) -> Result<(Session, Published), String> {
        if let Some(s) = &self.session {
            return Ok(s.clone());
        }
        let published: Published = Arc::new(Mutex::new(Vec::new()));
        let mut opts = self.sup.config().defaults.clone();
        opts.tools.push(publish_tool(
            self.tables.clone(),
            TENANT.into(),
            published.clone(),
        ));
        let s = self.sup.session_with(opts).map_err(|e| e.to_string())?;
        self.session = Some((s, published));
        Ok(self.session.clone().unwrap_or_else(|| unreachable!()))
    }

    fn timeout(&self, args: &Value) -> Result<Duration, String> {
        let r = &self.sup.config().rules.timeout_seconds;
        match args.get("timeout_seconds").and_then(Value::as_f64) {
            None => Ok(Duration::from_secs(r.default)),
            Some(t) if t >= r.min as f64 && t <= r.max as f64 => Ok(Duration::from_secs_f64(t)),
            Some(t) => Err(format!(
                "timeout_seconds {t} is out of range: use {}..{}",
                r.min, r.max
            )),
        }
    }

    /// Runs one tool call; `Err` is a protocol error (unknown tool, bad
    /// arguments), `Ok` a tool result (which may be `isError`).
    fn call(&mut self, name: &str, args: &Value) -> Result<Value, (i64, String)> {
        let bad = |m: String| (-32602, m);
        let rules = self.sup.config().rules.clone();
        match name {
            "check_r_server_health" => Ok(text_result(&json!(self.sup.health()), false)),
            "list_r_packages" => match self.sup.packages() {
                Ok(p) => Ok(text_result(&json!({ "packages": p }), false)),
                Err(e) => Ok(text_result(&json!({ "error": e }), true)),
            },
            "validate_r_script" => {
                let script = args
                    .get("script")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("script (a string) is required".into()))?;
                let v = self.sup.validate(script);
                let invalid = !v.valid;
                Ok(text_result(&json!(v), invalid))
            }
            "run_r_script" => {
                let script = args
                    .get("script")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("script (a string) is required".into()))?;
                let timeout = self.timeout(args).map_err(bad)?;
                let mut variables = Vec::new();
                if let Some(list) = args.get("variables").and_then(Value::as_array) {
                    for v in list {
                        let name = v
                            .get("name")
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad("each variable needs a name".into()))?;
                        variables.push((
                            name.to_string(),
                            v.get("value").cloned().unwrap_or(Value::Null),
                        ));
                    }
                }
                if let Err(e) = ops::check_variables(&variables, &rules) {
                    return Ok(text_result(&json!({ "error": e }), true));
                }
                let mut tables = Vec::new();
                if let Some(list) = args.get("dataframes").and_then(Value::as_array) {
                    if list.len() > rules.max_dataframes {
                        return Ok(text_result(
                            &json!({"error": format!("at most {} dataframes", rules.max_dataframes)}),
                            true,
                        ));
                    }
                    let mut names = Vec::new();
                    let mut pointers = Vec::new();
                    for d in list {
                        let (Some(p), Some(n)) = (
                            d.get("data_pointer").and_then(Value::as_str),
                            d.get("name").and_then(Value::as_str),
                        ) else {
                            return Err(bad("each dataframe needs data_pointer and name".into()));
                        };
                        if !ops::syntactic_name(n) {
                            return Ok(text_result(
                                &json!({"error": format!("{n:?} is not a syntactic R name")}),
                                true,
                            ));
                        }
                        names.push(n.to_string());
                        pointers.push(p.to_string());
                    }
                    let refs: Vec<&str> = pointers.iter().map(String::as_str).collect();
                    match self.tables.resolve(TENANT, &refs) {
                        Some(files) => tables = names.into_iter().zip(files).collect(),
                        None => {
                            return Ok(text_result(
                                &json!({"error": "one or more data pointers could not be resolved; nothing ran"}),
                                true,
                            ))
                        }
                    }
                }
                let v = self.sup.validate_with(script, ops::StyleEngine::None);
                if !v.valid {
                    return Ok(text_result(
                        &json!({"error": "the script failed validation and was not run", "validation": v}),
                        true,
                    ));
                }
                let published: Published = Arc::new(Mutex::new(Vec::new()));
                let ctx = CallContext {
                    variables,
                    tables,
                    tools: Arc::new(vec![publish_tool(
                        self.tables.clone(),
                        TENANT.into(),
                        published.clone(),
                    )]),
                    ..CallContext::default()
                };
                let opts = CallOptions {
                    timeout: Some(timeout),
                    cpu_limit: Some(timeout),
                    ..CallOptions::default()
                };
                let mut r =
                    self.sup
                        .run_once_with(rvisor::ids::execution_id(), script, &opts, &ctx);
                r.published = take_published(&published, &r.execution_id.clone());
                Ok(result_content(&r))
            }
            "run_r_code" => {
                let code = args
                    .get("code")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad("code (a string) is required".into()))?;
                let timeout = self.timeout(args).map_err(bad)?;
                let (s, published) = self.session().map_err(|e| (-32603, e))?;
                match s.run_with(
                    code,
                    &RunOptions {
                        timeout: Some(timeout),
                        ..RunOptions::default()
                    },
                ) {
                    Ok(h) => {
                        let mut r = h.wait();
                        r.published = take_published(&published, &r.execution_id.clone());
                        Ok(result_content(&r))
                    }
                    Err(e) => Ok(text_result(&json!({"error": e.to_string()}), true)),
                }
            }
            "reset_r_session" => {
                let status = match &self.session {
                    Some((s, _)) => {
                        s.reset();
                        json!({"reset": true, "status": s.status()})
                    }
                    None => {
                        json!({"reset": false, "message": "no session yet: the next run_r_code starts one"})
                    }
                };
                Ok(text_result(&status, false))
            }
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

/// Serves MCP over `input`/`output` until the input ends.
pub fn serve<R: BufRead, W: Write>(
    sup: &Supervisor,
    tables: TableConfig,
    input: R,
    mut output: W,
) -> std::io::Result<()> {
    let store = Arc::new(TableStore::open(tables)?);
    let mut st = State {
        sup: sup.clone(),
        tables: store,
        session: None,
    };
    for line in input.lines() {
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
                    "capabilities": {"tools": {"listChanged": false}},
                    "serverInfo": {"name": "rvisor", "version": env!("CARGO_PKG_VERSION")},
                    "instructions": INSTRUCTIONS,
                }))
            }
            "ping" => Ok(json!({})),
            "tools/list" => Ok(json!({ "tools": tools() })),
            "tools/call" => {
                let name = params.get("name").and_then(Value::as_str).unwrap_or("");
                let args = params.get("arguments").cloned().unwrap_or(json!({}));
                st.call(name, &args)
            }
            other => Err((-32601, format!("method {other:?} not found"))),
        };
        reply(&mut output, &id, result)?;
    }
    if let Some((s, _)) = &st.session {
        s.close();
    }
    Ok(())
}
