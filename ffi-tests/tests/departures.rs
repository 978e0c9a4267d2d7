//! Work stops when its client leaves: an HTTP client that closes its
//! connection, an MCP client whose input ends, an nng peer that hangs up.
//! Each test starts the real `rvisor` binary (unconfined: confinement is
//! not the subject), leaves in the middle of a call that would otherwise
//! run for a minute, and checks that the call was stopped (its outcome
//! counted as `cancelled`, its session idle with its state kept, or the
//! process gone), all within bounds far below the call's own timeout.

use rvisor_ffi_tests::{rvisor_bin, wait_for, ServeBin, TestDir};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Far below the calls' own timeouts (60 s): a call that ran on would not
/// be stopped in time.
const STOPPED_WITHIN: Duration = Duration::from_secs(20);

/// Plain HTTP/1.1 requests to the server, one connection each.
trait Http {
    fn request(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, String);
    fn send(&self, method: &str, path: &str, body: Option<&Value>) -> TcpStream;
    fn json(&self, method: &str, path: &str, body: Option<&Value>) -> Value;
    fn metric(&self, name: &str) -> f64;
}

impl Http for ServeBin {
    /// One request on a connection of its own; the whole answer.
    fn request(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
        let mut s = self.send(method, path, body);
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        let status = out
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
        (status, body)
    }

    /// Sends a request and returns the open connection, unanswered.
    fn send(&self, method: &str, path: &str, body: Option<&Value>) -> TcpStream {
        let mut s = TcpStream::connect(&self.addr).expect("connect");
        let body = body.map(Value::to_string).unwrap_or_default();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .expect("send");
        s
    }

    fn json(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let (status, text) = self.request(method, path, body);
        assert!(
            (200..300).contains(&status),
            "{method} {path}: {status} {text}"
        );
        serde_json::from_str(&text).unwrap_or(Value::Null)
    }

    fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.request("GET", "/metrics", None);
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    }
}

#[test]
fn an_http_client_that_leaves_cancels_its_one_shot_run() {
    let s = ServeBin::start(&[]);
    let conn = s.send(
        "POST",
        "/v1/run",
        Some(&json!({"script": "repeat {}", "timeout_seconds": 60})),
    );
    wait_for("the run's worker to be busy", STOPPED_WITHIN, || {
        busy_worker(s.child.id()).then_some(())
    });
    drop(conn);
    wait_for("the run to end as cancelled", STOPPED_WITHIN, || {
        (s.metric("rvisor_calls_total{outcome=\"cancelled\"}") >= 1.0).then_some(())
    });
}

#[test]
fn an_http_client_that_leaves_cancels_its_session_call_and_the_session_keeps_its_state() {
    let s = ServeBin::start(&[]);
    let created = s.json("POST", "/v1/sessions", None);
    let id = created["id"].as_str().expect("a session id").to_string();
    let run = format!("/v1/sessions/{id}/run");
    let r = s.json("POST", &run, Some(&json!({"code": "x <- 41"})));
    assert_eq!(r["outcome"], "complete", "{r}");
    let conn = s.send(
        "POST",
        &run,
        Some(&json!({"code": "Sys.sleep(60)", "timeout_seconds": 60})),
    );
    let status = format!("/v1/sessions/{id}");
    wait_for("the call to run", STOPPED_WITHIN, || {
        (s.json("GET", &status, None)["state"] == "running").then_some(())
    });
    drop(conn);
    wait_for("the session to be idle again", STOPPED_WITHIN, || {
        (s.json("GET", &status, None)["state"] == "idle").then_some(())
    });
    let r = s.json("POST", &run, Some(&json!({"code": "x + 1"})));
    assert_eq!(r["console"], "[1] 42\n", "state kept: {r}");
    assert_eq!(r["session"]["generation"], 1, "same worker: {r}");
}

#[test]
fn an_mcp_client_that_closes_its_input_stops_the_call_and_the_server() {
    let mut child = Command::new(rvisor_bin())
        .args(["--unconfined", "mcp"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("rvisor mcp starts");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let send = |stdin: &mut std::process::ChildStdin, v: Value| {
        writeln!(stdin, "{v}").expect("write");
        stdin.flush().expect("flush");
    };
    send(
        &mut stdin,
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18"}}),
    );
    let mut line = String::new();
    out.read_line(&mut line).expect("the initialize answer");
    // The call runs (it says so in a file: the worker is unconfined) before
    // the client leaves.
    let dir = TestDir::new("rvisor-departures-mcp");
    let flag = dir.path().join("started");
    let code = format!("writeLines('x', '{}'); repeat {{}}", flag.display());
    send(
        &mut stdin,
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": "run_r_code", "arguments": {"code": code, "timeout_seconds": 60}}}),
    );
    wait_for("the call to start", STOPPED_WITHIN, || {
        flag.exists().then_some(())
    });
    // The client goes away: its end of the pipe closes.
    drop(stdin);
    let status = wait_for("rvisor mcp to exit", STOPPED_WITHIN, || {
        child.try_wait().ok().flatten()
    });
    assert!(status.success(), "{status}");
}

/// Whether a worker of the supervisor `pid` runs R code: a grandchild
/// (the zygote is the child, workers are forked from it) in state R
/// (running). Spares and idle workers sleep.
fn busy_worker(pid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|e| {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            return false;
        };
        let grandchild = rvisor_ffi_tests::parent_pid(p)
            .and_then(rvisor_ffi_tests::parent_pid)
            .is_some_and(|g| g == pid);
        let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
        grandchild
            && stat
                .rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('R'))
    })
}

/// `rvisor serve` with an nng IPC socket in a new directory named `name`,
/// once the socket exists.
fn nng_server(name: &str) -> (ServeBin, std::path::PathBuf, TestDir) {
    let dir = TestDir::new(name);
    let sock = dir.path().join("r.sock");
    let url = format!("ipc://{}", sock.display());
    let s = ServeBin::start(&["--nng", &url]);
    wait_for("the nng socket", STOPPED_WITHIN, || {
        sock.exists().then_some(())
    });
    (s, sock, dir)
}

/// An nng connection: the SP handshake of a REQ peer done.
fn nng_connect(sock: &std::path::Path) -> std::os::unix::net::UnixStream {
    let mut c = std::os::unix::net::UnixStream::connect(sock).expect("connect");
    c.write_all(&[0, b'S', b'P', 0, 0, 0x30, 0, 0])
        .expect("SP header");
    let mut head = [0u8; 8];
    c.read_exact(&mut head).expect("the server's SP header");
    c
}

/// Sends `body` as request `id` (REQ's header: the id with the top bit set).
fn nng_send(c: &mut std::os::unix::net::UnixStream, id: u8, body: &Value) {
    let body = body.to_string();
    let mut msg = vec![1u8];
    msg.extend_from_slice(&((4 + body.len()) as u64).to_be_bytes());
    msg.extend_from_slice(&[0x80, 0, 0, id]);
    msg.extend_from_slice(body.as_bytes());
    c.write_all(&msg).expect("the request");
}

/// Reads one reply: its JSON body.
fn nng_recv(c: &mut std::os::unix::net::UnixStream) -> Value {
    let mut kind = [0u8; 1];
    c.read_exact(&mut kind).expect("a reply");
    let mut len = [0u8; 8];
    c.read_exact(&mut len).expect("its length");
    let mut msg = vec![0u8; u64::from_be_bytes(len) as usize];
    c.read_exact(&mut msg).expect("its body");
    serde_json::from_slice(&msg[4..]).expect("JSON")
}

/// A session call whose nng peer hangs up is cancelled, and the session
/// (by name, for the same tenant) keeps its state for the next peer.
#[test]
fn an_nng_peer_that_hangs_up_cancels_its_session_call_and_the_session_keeps_its_state() {
    let (s, sock, _dir) = nng_server("rvisor-departures-nng-session");
    let mut c = nng_connect(&sock);
    nng_send(
        &mut c,
        1,
        &json!({"id": 1, "op": "run", "session": "keep", "code": "kept <- 42"}),
    );
    let r = nng_recv(&mut c);
    assert_eq!(r["result"]["outcome"], "complete", "{r}");
    nng_send(
        &mut c,
        2,
        &json!({"id": 2, "op": "run", "session": "keep", "code": "repeat {}", "timeout_seconds": 60}),
    );
    wait_for("the call's worker to be busy", STOPPED_WITHIN, || {
        busy_worker(s.child.id()).then_some(())
    });
    drop(c);
    wait_for("the call to end as cancelled", STOPPED_WITHIN, || {
        (s.metric("rvisor_calls_total{outcome=\"cancelled\"}") >= 1.0).then_some(())
    });
    let mut c = nng_connect(&sock);
    nng_send(
        &mut c,
        3,
        &json!({"id": 3, "op": "run", "session": "keep", "code": "cat(kept)"}),
    );
    let r = nng_recv(&mut c);
    assert_eq!(r["result"]["console"], "42", "{r}");
    assert_eq!(
        r["result"]["session"]["generation"], 1,
        "the same worker: {r}"
    );
}

#[test]
fn an_nng_peer_that_hangs_up_cancels_its_call() {
    let (s, sock, _dir) = nng_server("rvisor-departures-nng");
    let mut c = nng_connect(&sock);
    nng_send(
        &mut c,
        1,
        &json!({"id": 1, "op": "run_script", "script": "repeat {}", "timeout_seconds": 60}),
    );
    wait_for("the run's worker", STOPPED_WITHIN, || {
        busy_worker(s.child.id()).then_some(())
    });
    drop(c);
    wait_for("the run to end as cancelled", STOPPED_WITHIN, || {
        (s.metric("rvisor_calls_total{outcome=\"cancelled\"}") >= 1.0).then_some(())
    });
}
