//! A real MCP client conversation with `rvisor mcp` over stdio.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    next: u64,
}

impl Client {
    fn start() -> Self {
        Self::start_with(&[])
    }

    /// `rvisor mcp` with `extra` flags.
    fn start_with(extra: &[&std::ffi::OsStr]) -> Self {
        let bin = rvisor_ffi_tests::rvisor_bin();
        let dir = std::env::temp_dir().join(format!("rvisor-mcp-{}", rvisor::ids::random_hex(6)));
        let mut child = Command::new(bin)
            .arg("mcp")
            .arg("--data-dir")
            .arg(dir)
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("rvisor mcp starts");
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Self {
            child,
            stdin,
            stdout,
            next: 0,
        }
    }

    fn send(&mut self, msg: &Value) {
        writeln!(self.stdin, "{msg}").unwrap();
        self.stdin.flush().unwrap();
    }

    fn read(&mut self) -> Value {
        let mut line = String::new();
        assert!(
            self.stdout.read_line(&mut line).unwrap() > 0,
            "the server closed stdout"
        );
        serde_json::from_str(&line).unwrap()
    }

    fn request(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = self.next;
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        let r = self.read();
        assert_eq!(r["id"], id);
        assert_eq!(r["jsonrpc"], "2.0");
        r
    }

    fn call(&mut self, tool: &str, args: Value) -> Value {
        let r = self.request("tools/call", json!({"name": tool, "arguments": args}));
        r.get("result")
            .cloned()
            .unwrap_or_else(|| panic!("no result: {r}"))
    }

    fn initialize(&mut self) -> Value {
        let r = self.request(
            "initialize",
            json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "1"}}),
        );
        self.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        r
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn text(result: &Value) -> String {
    result["content"][0]["text"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[test]
fn a_full_conversation_uses_every_tool() {
    let mut c = Client::start();
    let init = c.initialize();
    assert_eq!(init["result"]["protocolVersion"], "2025-06-18");
    assert_eq!(init["result"]["serverInfo"]["name"], "rvisor");
    assert!(init["result"]["capabilities"]["tools"].is_object());

    let tools = c.request("tools/list", json!({}));
    let list = tools["result"]["tools"].as_array().unwrap();
    let names: Vec<&str> = list.iter().map(|t| t["name"].as_str().unwrap()).collect();
    for n in [
        "check_r_server_health",
        "list_r_packages",
        "validate_r_script",
        "run_r_script",
        "run_r_code",
        "reset_r_session",
    ] {
        assert!(names.contains(&n), "{n} missing");
    }
    for t in list {
        assert_eq!(t["inputSchema"]["type"], "object", "{t}");
    }
    let desc = |n: &str| {
        list.iter().find(|t| t["name"] == n).unwrap()["description"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert!(desc("check_r_server_health").contains("first"));
    assert!(desc("validate_r_script").contains("validate-fix loop"));
    assert!(desc("run_r_script").contains("not for fitting"));

    let h = c.call("check_r_server_health", json!({}));
    assert_eq!(h["isError"], false);
    assert_eq!(h["structuredContent"]["status"], "ok");
    assert!(h["structuredContent"]["rules"]["forbidden_functions"].is_array());

    let p = c.call("list_r_packages", json!({}));
    assert!(p["structuredContent"]["packages"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["name"] == "stats"));

    let v = c.call(
        "validate_r_script",
        json!({"script": "x <- 1\nsystem('id')"}),
    );
    assert_eq!(v["isError"], true);
    assert_eq!(v["structuredContent"]["problems"][0]["line"], 2);
    let ok = c.call("validate_r_script", json!({"script": "x <- 1"}));
    assert_eq!(ok["isError"], false);

    // One-shot with variables, a plot, and a published table that the next
    // run reads back by pointer.
    let r = c.call(
        "run_r_script",
        json!({"script": "plot(1:n); cat(label, '\\n'); p <- rvisor_publish(data.frame(a = 1:n))",
               "variables": [{"name": "n", "value": 3}, {"name": "label", "value": "hi"}]}),
    );
    assert_eq!(r["isError"], false, "{r}");
    assert!(text(&r).starts_with("hi \n"), "{}", text(&r));
    let images: Vec<&Value> = r["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["type"] == "image")
        .collect();
    assert_eq!(images.len(), 1);
    assert_eq!(images[0]["mimeType"], "image/png");
    assert_eq!(r["structuredContent"]["outcome"], "complete");
    let pointer = r["structuredContent"]["published"][0]["data_pointer"]
        .as_str()
        .unwrap()
        .to_string();
    let r = c.call(
        "run_r_script",
        json!({"script": "sum(d$a)", "dataframes": [{"data_pointer": pointer, "name": "d"}]}),
    );
    assert_eq!(text(&r), "[1] 6\n");
    let r = c.call(
        "run_r_script",
        json!({"script": "1", "dataframes": [{"data_pointer": "dp_nope", "name": "d"}]}),
    );
    assert_eq!(r["isError"], true);
    let r = c.call("run_r_script", json!({"script": "system('id')"}));
    assert_eq!(r["isError"], true, "a forbidden script is refused: {r}");

    // The persistent session: state, an error, a timeout, a reset.
    assert_eq!(
        c.call("run_r_code", json!({"code": "x <- 41"}))["isError"],
        false
    );
    assert_eq!(
        text(&c.call("run_r_code", json!({"code": "x + 1"}))),
        "[1] 42\n"
    );
    let e = c.call("run_r_code", json!({"code": "stop('boom')"}));
    assert_eq!(e["isError"], true);
    assert!(text(&e).contains("boom"));
    let t = c.call(
        "run_r_code",
        json!({"code": "Sys.sleep(30)", "timeout_seconds": 1}),
    );
    assert_eq!(t["isError"], true);
    assert_eq!(t["structuredContent"]["outcome"], "timed_out");
    assert_eq!(
        text(&c.call("run_r_code", json!({"code": "x"}))),
        "[1] 41\n",
        "state kept after the timeout"
    );
    let reset = c.call("reset_r_session", json!({}));
    assert_eq!(reset["isError"], false);
    let gone = c.call("run_r_code", json!({"code": "exists('x')"}));
    assert!(text(&gone).ends_with("[1] FALSE\n"), "{}", text(&gone));
    assert_eq!(
        gone["structuredContent"]["session"]["reset_reason"],
        "reset"
    );
}

#[test]
fn protocol_errors_are_json_rpc_errors() {
    let mut c = Client::start();
    c.initialize();
    let r = c.request(
        "tools/call",
        json!({"name": "no_such_tool", "arguments": {}}),
    );
    assert_eq!(r["error"]["code"], -32602);
    let r = c.request("no/such/method", json!({}));
    assert_eq!(r["error"]["code"], -32601);
    let r = c.request("tools/call", json!({"name": "run_r_code", "arguments": {}}));
    assert_eq!(r["error"]["code"], -32602, "missing code");
    c.stdin.write_all(b"{not json\n").unwrap();
    c.stdin.flush().unwrap();
    assert_eq!(c.read()["error"]["code"], -32700);
    assert!(
        c.request("ping", json!({}))["result"].is_object(),
        "the server goes on"
    );
}

/// Progress (with the call's progress token) and console text (after
/// `logging/setLevel`) arrive while the call runs: the test cancels the
/// endless call only once it has heard both, so a server that held them
/// back until the call ended would leave it running to its timeout.
#[test]
fn progress_and_log_notifications_arrive_while_a_call_runs() {
    for tool in ["run_r_code", "run_r_script"] {
        let mut c = Client::start();
        c.initialize();
        if tool == "run_r_code" {
            // State set before the call that is cancelled must survive it
            // (set before logging is on: no notifications come with it).
            assert_eq!(
                c.call("run_r_code", json!({"code": "kept <- 42"}))["isError"],
                false
            );
        }
        let r = c.request("logging/setLevel", json!({"level": "info"}));
        assert_eq!(r["result"], json!({}), "{r}");
        let code = "rvisor_progress(1, 2, 'half'); cat('ready\\n'); repeat Sys.sleep(0.02)";
        let key = if tool == "run_r_code" {
            "code"
        } else {
            "script"
        };
        c.send(
            &json!({"jsonrpc": "2.0", "id": 99, "method": "tools/call", "params": {
            "name": tool, "arguments": {key: code, "timeout_seconds": 120},
            "_meta": {"progressToken": "tok-1"}}}),
        );
        let mut progress = None;
        let mut ready = false;
        while progress.is_none() || !ready {
            let m = c.read();
            assert!(m.get("id").is_none(), "{tool}: the call ended first: {m}");
            match m["method"].as_str() {
                Some("notifications/progress") => progress = Some(m["params"].clone()),
                Some("notifications/message") => {
                    assert_eq!(m["params"]["logger"], "r");
                    if m["params"]["data"] == "ready\n" {
                        assert_eq!(m["params"]["level"], "info");
                        ready = true;
                    }
                }
                other => panic!("{tool}: unexpected {other:?}: {m}"),
            }
        }
        assert_eq!(
            progress.unwrap(),
            json!({"progressToken": "tok-1", "progress": 1.0, "total": 2.0, "message": "half"})
        );
        c.send(
            &json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": 99, "reason": "enough"}}),
        );
        let r = loop {
            let m = c.read();
            if m.get("id").is_some() {
                break m;
            }
        };
        assert_eq!(r["id"], 99);
        assert_eq!(
            r["result"]["structuredContent"]["outcome"], "cancelled",
            "{tool}: {r}"
        );
        assert_eq!(r["result"]["isError"], true);
        if tool == "run_r_code" {
            // Logging is on: the console text comes as notifications too.
            c.send(&json!({"jsonrpc": "2.0", "id": 100, "method": "tools/call",
                "params": {"name": "run_r_code", "arguments": {"code": "cat(kept)"}}}));
            let after = loop {
                let m = c.read();
                if m.get("id").is_some() {
                    break m;
                }
            };
            assert_eq!(after["id"], 100);
            assert!(
                text(&after["result"]).contains("42"),
                "the session kept its state after the cancel: {after}"
            );
        }
    }
}

#[test]
fn without_a_token_or_a_log_level_a_call_sends_no_notifications() {
    let mut c = Client::start();
    c.initialize();
    let r = c.call(
        "run_r_code",
        json!({"code": "rvisor_progress(1); cat('x\\n')"}),
    );
    assert_eq!(r["structuredContent"]["console"], "x\n", "{r}");
}

/// Whether a process no longer runs (gone, or a zombie waiting to be
/// reaped).
fn process_gone(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

#[test]
fn with_a_state_dir_the_session_checkpoints_rolls_back_and_hibernates() {
    let state = rvisor_ffi_tests::TestDir::new("mcp-state");
    let mut c = Client::start_with(&[
        std::ffi::OsStr::new("--state-dir"),
        state.path().as_os_str(),
    ]);
    let init = c.initialize();
    let instructions = init["result"]["instructions"].as_str().unwrap();
    assert!(
        instructions.contains("checkpoint_r_session"),
        "{instructions}"
    );
    let tools = c.request("tools/list", json!({}));
    let names: Vec<&str> = tools["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"checkpoint_r_session"), "{names:?}");
    assert!(names.contains(&"restore_r_session"), "{names:?}");

    // Nothing to checkpoint before the first run_r_code.
    let none = c.call("checkpoint_r_session", json!({}));
    assert_eq!(none["isError"], true, "{none}");
    assert_eq!(
        none["structuredContent"]["error"]["code"], "unknown_session",
        "{none}"
    );

    c.call("run_r_code", json!({"code": "keep <- 'before'"}));
    let cp = c.call("checkpoint_r_session", json!({}));
    assert_eq!(cp["isError"], false, "{cp}");
    assert_eq!(
        cp["structuredContent"]["checkpoint"]["written"], true,
        "{cp}"
    );
    assert!(
        cp["structuredContent"]["checkpoint"]["manifest"]["objects"]
            .as_array()
            .is_some_and(|o| o.contains(&json!("keep"))),
        "{cp}"
    );

    // Roll back: the object assigned after the checkpoint is gone.
    c.call(
        "run_r_code",
        json!({"code": "after <- 1; keep <- 'changed'"}),
    );
    let back = c.call("restore_r_session", json!({}));
    assert_eq!(back["isError"], false, "{back}");
    assert_eq!(back["structuredContent"]["restored"], true, "{back}");
    let r = c.call("run_r_code", json!({"code": "cat(keep, exists('after'))"}));
    assert_eq!(
        r["structuredContent"]["session"]["restored"]["reason"], "restore",
        "{r}"
    );
    assert!(text(&r).ends_with("before FALSE"), "{}", text(&r));

    // Checkpoint and hibernate: the worker goes, the next call brings the
    // state back.
    let h = c.call("checkpoint_r_session", json!({"hibernate": true}));
    assert_eq!(h["isError"], false, "{h}");
    assert_eq!(h["structuredContent"]["hibernating"], true, "{h}");
    // The status is of when it was asked: the worker may be gone already
    // (no pid, state hibernated), else it goes.
    match h["structuredContent"]["status"]["pid"].as_u64() {
        Some(pid) => rvisor_ffi_tests::wait_for(
            "the hibernated session's worker to exit",
            std::time::Duration::from_secs(60),
            || process_gone(pid).then_some(()),
        ),
        None => assert_eq!(
            h["structuredContent"]["status"]["state"], "hibernated",
            "no pid, so the worker must be gone: {h}"
        ),
    }
    let r = c.call("run_r_code", json!({"code": "cat(keep)"}));
    assert_eq!(
        r["structuredContent"]["session"]["restored"]["reason"], "hibernated",
        "{r}"
    );
    assert!(text(&r).ends_with("before"), "{}", text(&r));
    let bad = c.request(
        "tools/call",
        json!({"name": "checkpoint_r_session", "arguments": {"hibernate": "yes"}}),
    );
    assert_eq!(bad["error"]["code"], -32602, "{bad}");
}

#[test]
fn without_a_state_dir_no_checkpoint_tools_are_offered() {
    let mut c = Client::start();
    c.initialize();
    let tools = c.request("tools/list", json!({}));
    let names: Vec<&str> = tools["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"run_r_code"), "{names:?}");
    assert!(!names.contains(&"checkpoint_r_session"), "{names:?}");
    assert!(!names.contains(&"restore_r_session"), "{names:?}");
}

#[test]
fn rich_results_come_as_markdown_resources_images_and_structured_content() {
    let mut c = Client::start();
    c.initialize();
    let tools = c.request("tools/list", json!({}));
    let list = tools["result"]["tools"].as_array().unwrap();
    for name in ["run_r_code", "run_r_script"] {
        let t = list.iter().find(|t| t["name"] == name).unwrap();
        assert!(
            t["outputSchema"]["properties"]["displays"].is_object(),
            "{t}"
        );
        assert!(t["inputSchema"]["properties"]["display"].is_object());
        let d = t["description"].as_str().unwrap();
        assert!(d.contains("Markdown") && d.contains("text/html"), "{d}");
    }
    let r = c.call(
        "run_r_code",
        json!({"code": "head(mtcars, 8)\nhtmltools::tags$b('bold')\nplot(1:3)",
               "display": {"max_rows": 3, "plot_format": "both"}}),
    );
    assert_eq!(r["isError"], false, "{r}");
    let content = r["content"].as_array().unwrap();
    let kinds: Vec<&str> = content
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect();
    // Console, the table's Markdown, its HTML, the tag's line and HTML,
    // the SVG page, the PNG page.
    assert_eq!(
        kinds,
        ["text", "text", "resource", "text", "resource", "resource", "image"],
        "{r}"
    );
    let md = content[1]["text"].as_str().unwrap();
    assert!(md.contains("| Mazda RX4 |"), "{md}");
    assert!(md.contains("8 × 11"), "{md}");
    assert!(!md.contains("Hornet Sportabout"), "cut at 3 rows: {md}");
    assert_eq!(content[2]["resource"]["mimeType"], "text/html");
    assert!(content[4]["resource"]["text"]
        .as_str()
        .unwrap()
        .contains("<b>bold</b>"));
    assert_eq!(content[5]["resource"]["mimeType"], "image/svg+xml");
    assert_eq!(content[6]["mimeType"], "image/png");
    let s = &r["structuredContent"];
    assert_eq!(s["displays"].as_array().unwrap().len(), 3);
    assert_eq!(s["displays"][0]["data"]["application/json"]["nrow"], 8);
    assert_eq!(s["segments"][1]["kind"], "display");
}
