//! `rvisor serve --nng URL` end to end: the real binary with real R
//! workers, driven by a real nng client (pynng, through the bridge
//! `tests/nng_peer.py`), over IPC and TCP.
//!
//! Every test starts its own server, so tests are independent. No test
//! sleeps and hopes: the server is ready when it says so on stderr, replies
//! are awaited with a deadline, and other waits poll a condition until a
//! deadline.

use base64::Engine as _;
use rvisor_ffi_tests::TestDir;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a server may take to start, a reply to arrive, or any other
/// wait to end before the test calls it a hang.
const DEADLINE: Duration = Duration::from_secs(90);

fn wait_for<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    rvisor_ffi_tests::wait_for(what, DEADLINE, f)
}

/// A new directory, with a short name so that an IPC socket path in it
/// stays far below the 108-byte limit.
fn short_dir() -> TestDir {
    TestDir::new("nng")
}

/// Alice's and Bob's tokens (tokens are at least 16 characters).
const TOK_A: &str = "alice-token-0123456789abcdef";
const TOK_B: &str = "bob-token-0123456789abcdefgh";

// ---------------------------------------------------------------------------
// Helpers

/// Polls `f` until it gives `Some`, or panics after [`DEADLINE`].
fn process_gone(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

fn sigterm(child: &Child) {
    // SAFETY: kill has no memory-safety preconditions; the pid is our own
    // child, which has not been waited for (so the pid is not reused).
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
}

/// A running `rvisor serve --nng`, stopped (SIGTERM, then SIGKILL) on drop.
struct Server {
    child: Option<Child>,
    /// The nng URL the server printed (with the real port for TCP).
    url: String,
    /// The HTTP address the server printed.
    http: String,
    /// Everything the server wrote to stderr so far.
    log: Arc<Mutex<String>>,
    dir: TestDir,
}

impl Server {
    /// A server on an IPC socket in its temp dir.
    fn ipc() -> Self {
        Self::start(|dir| format!("ipc://{}", dir.join("rvisor.sock").display()))
    }

    /// A server on TCP port 0.
    fn tcp() -> Self {
        Self::start(|_| "tcp://127.0.0.1:0".to_string())
    }

    /// A server on an IPC socket whose sessions checkpoint into its temp
    /// dir (`--state-dir`).
    fn durable() -> Self {
        let dir = short_dir();
        let url = format!("ipc://{}", dir.path().join("rvisor.sock").display());
        let state = dir.path().join("state").display().to_string();
        Self::try_start_with(dir, &url, &["--state-dir", &state]).unwrap_or_else(|(status, log)| {
            panic!("rvisor serve --nng {url} exited early ({status}):\n{log}")
        })
    }

    fn start(url: impl FnOnce(&Path) -> String) -> Self {
        let dir = short_dir();
        let url = url(dir.path());
        Self::try_start(dir, &url).unwrap_or_else(|(status, log)| {
            panic!("rvisor serve --nng {url} exited early ({status}):\n{log}")
        })
    }

    /// Starts the server and waits for its "listening on nng" line; the
    /// exit status and stderr if it exits first.
    fn try_start(dir: TestDir, url: &str) -> Result<Self, (ExitStatus, String)> {
        Self::try_start_with(dir, url, &[])
    }

    /// [`Server::try_start`] with `extra` flags for `rvisor serve`.
    fn try_start_with(
        dir: TestDir,
        url: &str,
        extra: &[&str],
    ) -> Result<Self, (ExitStatus, String)> {
        let tokens = dir.path().join("tokens");
        std::fs::write(&tokens, format!("{TOK_A} alice\n{TOK_B} bob\n"))
            .expect("write the token file");
        let mut child = Command::new(rvisor_ffi_tests::rvisor_bin())
            .args(["serve", "--listen", "127.0.0.1:0", "--tokens"])
            .arg(&tokens)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(["--nng", url])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("rvisor serve starts");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel::<String>();
        let stderr = child.stderr.take().expect("piped stderr");
        let sink = log.clone();
        // Reads stderr to the end (the pipe never fills), keeps it for
        // diagnostics and hands lines over until the receiver goes.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
                drop(l);
                let _ = tx.send(line);
            }
        });
        let mut server = Server {
            child: Some(child),
            url: String::new(),
            http: String::new(),
            log,
            dir,
        };
        let end = Instant::now() + DEADLINE;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(a) = line.strip_prefix("rvisor serve: listening on http://") {
                        server.http = a.to_string();
                    } else if let Some(u) = line.strip_prefix("rvisor serve: listening on nng ") {
                        assert!(
                            !server.http.is_empty(),
                            "the nng line comes after the HTTP line:\n{}",
                            server.log()
                        );
                        server.url = u.to_string();
                        return Ok(server);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!("rvisor serve was not ready in time:\n{}", server.log())
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let mut child = server.child.take().expect("the child");
                    let status = child.wait().expect("wait for rvisor serve");
                    return Err((status, server.log()));
                }
            }
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// A bridge connected to this server.
    fn peer(&self) -> Peer {
        Peer::start(&self.url)
    }

    /// SIGTERM; waits for the exit.
    fn stop(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("the server runs");
        sigterm(&child);
        wait_for("rvisor serve to exit after SIGTERM", || {
            child.try_wait().expect("try_wait")
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        // A graceful stop ends the R workers too; a kill if it hangs.
        sigterm(&child);
        let end = Instant::now() + Duration::from_secs(15);
        while Instant::now() < end {
            if !matches!(child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Fails (never skips) when pynng is missing.
fn require_pynng() {
    let out = Command::new("python3")
        .args(["-c", "import pynng"])
        .output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "pynng is missing: run `make setup` (it installs pynng, the nng client these tests use):\n{}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => panic!("python3 cannot run ({e}): run `make setup` (python3 with pynng is needed)"),
    }
}

/// The pynng bridge (`tests/nng_peer.py`): requests go in one per line,
/// each on a REQ context of its own; replies come back as they arrive.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    replies: Receiver<Value>,
    /// Replies that arrived while another was awaited, by id.
    stash: HashMap<String, Value>,
    next_id: u64,
}

impl Peer {
    fn start(url: &str) -> Self {
        require_pynng();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/nng_peer.py");
        let mut child = Command::new("python3")
            .arg(script)
            .arg(url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 nng_peer.py starts");
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, replies) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let v = serde_json::from_str(&line).unwrap_or_else(
                    |e| json!({"_bridge_error": format!("not JSON ({e}): {line}")}),
                );
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            stdin,
            replies,
            stash: HashMap::new(),
            next_id: 0,
        }
    }

    fn write_line(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("write to the bridge");
        self.stdin.flush().expect("flush the bridge's stdin");
    }

    /// Sends `req` as is, with an id added if it has none; returns the id.
    fn send(&mut self, mut req: Value) -> Value {
        if req.get("id").is_none() {
            self.next_id += 1;
            req["id"] = json!(self.next_id);
        }
        self.write_line(&req.to_string());
        req["id"].clone()
    }

    /// Sends `text` as the request's bytes, JSON or not.
    fn send_raw(&mut self, text: &str) {
        self.write_line(&json!({ "_raw": text }).to_string());
    }

    /// The reply with this id (other replies that arrive meanwhile are
    /// kept for their own wait).
    fn wait(&mut self, id: &Value) -> Value {
        let key = id.to_string();
        let end = Instant::now() + DEADLINE;
        loop {
            if let Some(a) = self.stash.remove(&key) {
                return a;
            }
            let left = end.saturating_duration_since(Instant::now());
            let v = match self.replies.recv_timeout(left) {
                Ok(a) => a,
                Err(RecvTimeoutError::Timeout) => panic!("no reply with id {key} in time"),
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("the bridge exited before the reply with id {key}")
                }
            };
            assert!(v.get("_bridge_error").is_none(), "the bridge failed: {v}");
            let got = v.get("id").map(Value::to_string).unwrap_or_default();
            self.stash.insert(got, v);
        }
    }

    /// Sends `req` as is (an id added if missing) and waits for its reply.
    fn request(&mut self, req: Value) -> Value {
        let id = self.send(req);
        self.wait(&id)
    }

    /// `req` with `token`, answered.
    fn call(&mut self, token: &str, mut req: Value) -> Value {
        req["token"] = json!(token);
        self.request(req)
    }

    /// Runs `code` in the tenant's session `name`; the RunResult.
    fn run_in(&mut self, token: &str, name: &str, code: &str) -> Value {
        let r = self.call(token, json!({"op": "run", "session": name, "code": code}));
        result(&r)
    }

    /// Runs `code` in alice's session `main`; the RunResult.
    fn run(&mut self, code: &str) -> Value {
        self.run_in(TOK_A, "main", code)
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body of a successful reply `{"id", KEY: body}`.
fn ok(reply: &Value, key: &str) -> Value {
    let obj = reply.as_object().expect("a reply is an object");
    assert!(reply.get("error").is_none(), "expected {key}, got {reply}");
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    let mut want = vec!["id", key];
    want.sort_unstable();
    assert_eq!(keys, want, "{reply}");
    reply[key].clone()
}

/// The RunResult of a reply, checked for the fields CONTRACT.md fixes.
fn result(reply: &Value) -> Value {
    let r = ok(reply, "result");
    for f in rvisor_ffi_tests::RUN_RESULT_FIELDS {
        assert!(r.get(f).is_some(), "RunResult field {f} missing: {r}");
    }
    r
}

/// Asserts an error reply `{"id", "error": {"code", "message"}}` with this
/// code; returns the message.
fn err(reply: &Value, code: &str) -> String {
    let obj = reply.as_object().expect("a reply is an object");
    assert_eq!(obj.len(), 2, "only id and error: {reply}");
    assert!(obj.contains_key("id"), "{reply}");
    assert_eq!(reply["error"]["code"], code, "{reply}");
    let message = reply["error"]["message"]
        .as_str()
        .expect("error.message is a string");
    assert!(!message.is_empty(), "{reply}");
    message.to_string()
}

fn console(r: &Value) -> &str {
    r["console"].as_str().expect("console is a string")
}

// ---------------------------------------------------------------------------
// Transports

#[test]
fn ipc_serves_and_its_socket_is_removed_on_exit() {
    let mut s = Server::ipc();
    let sock = s.dir.path().join("rvisor.sock");
    assert_eq!(s.url, format!("ipc://{}", sock.display()), "{}", s.log());
    assert!(sock.exists(), "the socket file exists while serving");
    let mut p = s.peer();
    let id = p.send(json!({"op": "health", "token": TOK_A}));
    let h = ok(&p.wait(&id), "health");
    assert_eq!(h["status"], "ok");
    let r = p.run("6 * 7");
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(console(&r), "[1] 42\n");
    let pid = ok(&p.call(TOK_A, json!({"op": "status"})), "status")["pid"]
        .as_u64()
        .expect("the session's worker pid");

    // A second server on the same live socket is refused, and leaves the
    // first one serving.
    let again = Server::try_start(short_dir(), &s.url);
    let Err((status, log)) = again else {
        panic!("a second server on a live socket started")
    };
    assert!(!status.success(), "{status}: {log}");
    assert!(log.contains("in use"), "{log}");
    assert_eq!(console(&p.run("6 * 7")), "[1] 42\n");

    drop(p);
    let status = s.stop();
    assert_eq!(status.code(), Some(0), "{status}: {}", s.log());
    assert!(!sock.exists(), "the socket file is removed on exit");
    wait_for("the session's worker to exit", || {
        process_gone(pid).then_some(())
    });
}

/// SIGTERM stops the server gracefully: requests already in flight (a
/// session run and a one-shot run) finish and are answered before it exits.
#[test]
fn requests_in_flight_at_sigterm_are_answered() {
    let mut s = Server::ipc();
    let mut p = s.peer();
    // The one-shot run publishes a table first, so the test can see that it
    // runs (a file appears in the server's table cache, which every
    // table it stores passes through).
    let data = s.dir.path().join("data").join("cache");
    let arrow_files = || {
        std::fs::read_dir(&data)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.path().extension().is_some_and(|x| x == "arrow"))
                    .count()
            })
            .unwrap_or(0)
    };
    let b = p.send(json!({"op": "run_script", "token": TOK_A,
        "script": "invisible(rvisor_publish(data.frame(a = 1))); Sys.sleep(2); 7 * 6"}));
    let a = p.send(json!({"op": "run", "token": TOK_A, "code": "Sys.sleep(2); 6 * 7"}));
    wait_for("the one-shot run to be running", || {
        (arrow_files() > 0).then_some(())
    });
    wait_for("the session run to be running", || {
        let st = ok(&p.call(TOK_A, json!({"op": "status"})), "status");
        (st["state"] == "running").then_some(())
    });
    sigterm(s.child.as_ref().expect("the server runs"));
    let ra = result(&p.wait(&a));
    let rb = result(&p.wait(&b));
    assert_eq!(ra["outcome"], "complete", "{ra}");
    assert_eq!(console(&ra), "[1] 42\n");
    assert_eq!(rb["outcome"], "complete", "{rb}");
    assert_eq!(console(&rb), "[1] 42\n");
    drop(p);
    let status = s.stop();
    assert_eq!(status.code(), Some(0), "{status}: {}", s.log());
}

#[test]
fn tcp_on_port_0_prints_the_real_port() {
    let s = Server::tcp();
    let port: u16 = s
        .url
        .strip_prefix("tcp://127.0.0.1:")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("not a TCP URL: {:?}\n{}", s.url, s.log()));
    assert_ne!(port, 0, "{}", s.log());
    assert!(
        s.http.starts_with("127.0.0.1:") && !s.http.ends_with(":0"),
        "{}",
        s.log()
    );
    let mut p = s.peer();
    let h = ok(&p.call(TOK_A, json!({"op": "health"})), "health");
    assert_eq!(h["status"], "ok");
    assert_eq!(p.run("x <- 41")["outcome"], "complete");
    assert_eq!(console(&p.run("x + 1")), "[1] 42\n");
}

// ---------------------------------------------------------------------------
// Auth, sessions, tenants

#[test]
fn requests_without_a_valid_token_are_unauthorized() {
    let s = Server::ipc();
    let mut p = s.peer();
    let requests = [
        json!({"op": "health"}),
        json!({"op": "packages"}),
        json!({"op": "validate", "script": "1"}),
        json!({"op": "run", "code": "1"}),
        json!({"op": "status"}),
        json!({"op": "cancel"}),
        json!({"op": "run_script", "script": "1"}),
        json!({"op": "put_table", "csv": "a\n1\n"}),
        json!({"op": "get_table", "data_pointer": "dp_x"}),
    ];
    for (n, req) in requests.iter().enumerate() {
        let mut anon = req.clone();
        anon["id"] = json!(format!("anon-{n}"));
        let r = p.request(anon);
        assert_eq!(r["id"], format!("anon-{n}"), "the id is echoed: {r}");
        err(&r, "unauthorized");
        let mut wrong = req.clone();
        wrong["token"] = json!("wrong-token-0123456789abcdef");
        err(&p.request(wrong), "unauthorized");
    }
    // Nothing was made for a caller without a token; a valid token works.
    let st = ok(&p.call(TOK_A, json!({"op": "status"})), "status");
    assert_eq!(st["state"], "new", "{st}");
    assert_eq!(st["generation"], 0, "no run happened: {st}");
    let r = p.run("1 + 1");
    assert_eq!(console(&r), "[1] 2\n");
    assert_eq!(
        ok(&p.call(TOK_A, json!({"op": "health"})), "health")["status"],
        "ok"
    );
}

#[test]
fn state_persists_per_session_name_and_per_tenant() {
    let s = Server::ipc();
    let mut p = s.peer();
    let r = p.run("x <- 41");
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(r["success"], true);
    assert_eq!(r["session"]["generation"], 1);
    let main_id = r["session"]["id"].clone();
    let r = p.run("x + 1");
    assert_eq!(console(&r), "[1] 42\n", "{r}");
    assert_eq!(r["session"]["id"], main_id, "the same session");
    assert_eq!(r["session"]["fresh"], false, "{r}");

    // Named sessions are independent (and run side by side).
    let a = p.call(
        TOK_A,
        json!({"op": "run", "session": "a", "code": "x <- 'in a'"}),
    );
    assert_eq!(result(&a)["outcome"], "complete");
    let ids = [
        p.send(json!({"op": "run", "session": "a", "code": "x", "token": TOK_A})),
        p.send(json!({"op": "run", "session": "b", "code": "exists('x')", "token": TOK_A})),
        p.send(json!({"op": "run", "code": "x", "token": TOK_A})),
    ];
    let [a, b, m] = ids.map(|id| result(&p.wait(&id)));
    assert_eq!(console(&a), "[1] \"in a\"\n", "{a}");
    assert_eq!(console(&b), "[1] FALSE\n", "{b}");
    assert_eq!(console(&m), "[1] 41\n", "{m}");
    assert_ne!(a["session"]["id"], main_id);
    assert_ne!(b["session"]["id"], a["session"]["id"]);

    // Bob's "main" is not Alice's.
    let r = p.run_in(TOK_B, "main", "x");
    assert_eq!(r["outcome"], "error", "{r}");
    assert_eq!(r["success"], false);
    let msg = r["error"]["message"].as_str().expect("an error message");
    assert!(msg.contains("not found"), "{r}");
    assert_ne!(r["session"]["id"], main_id);
    // Nor can Bob reach Alice's named sessions.
    err(
        &p.call(TOK_B, json!({"op": "cancel", "session": "a"})),
        "unknown_session",
    );
    assert_eq!(console(&p.run("x")), "[1] 41\n", "Alice's x is untouched");
}

/// A one-shot run over nng takes input files, as `POST /v1/run` does, and
/// gives back what it wrote as artifacts.
#[test]
fn a_one_shot_run_takes_input_files_and_gives_back_artifacts() {
    let s = Server::ipc();
    let mut p = s.peer();
    let input = base64::engine::general_purpose::STANDARD.encode("a,b\n1,2\n3,4\n");
    let r = p.call(
        TOK_A,
        json!({"op": "run_script",
               "script": "d <- read.csv('in.csv'); write.csv(d * 10, 'out.csv', row.names = FALSE); cat(sum(d))",
               "files": [{"name": "in.csv", "content_base64": input}]}),
    );
    let r = result(&r);
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(console(&r), "10", "{r}");
    let artifacts = r["artifacts"].as_array().expect("artifacts");
    let out = artifacts
        .iter()
        .find(|a| a["name"] == "out.csv")
        .unwrap_or_else(|| panic!("out.csv among the artifacts: {r}"));
    assert_eq!(out["size"], "\"a\",\"b\"\n10,20\n30,40\n".len(), "{out}");
    // A bad file is refused before anything runs.
    let bad = p.call(
        TOK_A,
        json!({"op": "run_script", "script": "1",
               "files": [{"name": "../x", "content_base64": input}]}),
    );
    assert!(err(&bad, "file_refused").contains("../x"), "{bad}");
}

/// A session's files over nng: put, read by R, written (the call's result
/// lists it), listed, fetched back byte for byte, deleted; a bad name is
/// refused.
#[test]
fn session_files_go_in_and_out() {
    let s = Server::ipc();
    let mut p = s.peer();
    let b64 = base64::engine::general_purpose::STANDARD;
    let bytes: Vec<u8> = (0u8..=255).collect();
    let put = p.call(
        TOK_A,
        json!({"op": "put_file", "path": "data/in.bin", "content_base64": b64.encode(&bytes)}),
    );
    let f = ok(&put, "file");
    assert_eq!(f["size"], 256, "{f}");
    let r = p.run("length(readBin('data/in.bin', 'raw', 1000))");
    assert_eq!(console(&r), "[1] 256\n", "{r}");
    // The call's result lists the file it wrote (docs/files.md).
    let r = p.run("writeBin(as.raw(1:3), 'out.bin')");
    let arts = r["artifacts"].as_array().expect("artifacts");
    assert_eq!(arts.len(), 1, "{r}");
    assert_eq!(arts[0]["name"], "out.bin", "{r}");
    assert_eq!(arts[0]["size"], 3, "{r}");
    {
        use sha2::Digest;
        let sha: String = sha2::Sha256::digest([1u8, 2, 3])
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(arts[0]["sha256"], sha, "{r}");
    }
    let r = p.run("1 + 1");
    assert!(r.get("artifacts").is_none(), "nothing written: {r}");
    let list = p.call(TOK_A, json!({"op": "files"}));
    let names = ok(&list, "files").to_string();
    assert!(
        names.contains("data/in.bin") && names.contains("out.bin"),
        "{names}"
    );
    let got = p.call(TOK_A, json!({"op": "get_file", "path": "out.bin"}));
    let got = ok(&got, "file");
    let content = b64
        .decode(got["content_base64"].as_str().expect("content_base64"))
        .expect("base64");
    assert_eq!(content, vec![1u8, 2, 3], "{got}");
    let del = p.call(TOK_A, json!({"op": "delete_file", "path": "out.bin"}));
    assert_eq!(ok(&del, "deleted"), "out.bin");
    let r = p.run("file.exists('out.bin')");
    assert_eq!(console(&r), "[1] FALSE\n", "{r}");
    let bad = p.call(
        TOK_A,
        json!({"op": "put_file", "path": "/etc/x", "content_base64": ""}),
    );
    assert!(err(&bad, "file_refused").contains("/etc/x"), "{bad}");
}

#[test]
fn a_plot_comes_back_as_png() {
    let s = Server::ipc();
    let mut p = s.peer();
    let r = p.call(
        TOK_A,
        json!({"op": "run", "code": "plot(1:10)", "plot_width": 400, "plot_height": 300}),
    );
    let r = result(&r);
    assert_eq!(r["outcome"], "complete", "{r}");
    let plots = r["plots"].as_array().expect("plots is an array");
    assert_eq!(plots.len(), 1, "{r}");
    assert_eq!(plots[0]["mime"], "image/png");
    assert_eq!(plots[0]["width"], 400);
    assert_eq!(plots[0]["height"], 300);
    let png = base64::engine::general_purpose::STANDARD
        .decode(plots[0]["data_base64"].as_str().expect("data_base64"))
        .expect("valid base64");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(r["segments"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["kind"] == "plot" && s["index"] == 0));

    // A larger result than nng's default 1 MiB receive limit arrives whole.
    let r = p.run("x <- strrep('a', 3e6); cat(x); invisible(NULL)");
    assert_eq!(r["outcome"], "complete", "{}", r["error"]);
    assert_eq!(console(&r).len(), 3_000_000);
}

#[test]
fn an_r_error_is_an_error_outcome() {
    let s = Server::ipc();
    let mut p = s.peer();
    p.run("kept <- TRUE");
    let r = p.run("f <- function() stop('boom from f'); f()");
    assert_eq!(r["outcome"], "error", "{r}");
    assert_eq!(r["success"], false);
    assert!(
        r["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("boom from f")),
        "{r}"
    );
    assert!(console(&r).contains("boom from f"), "{r}");
    assert!(r["segments"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["kind"] == "error"));
    let r = p.run("kept");
    assert_eq!(console(&r), "[1] TRUE\n", "an R error keeps the session");
    assert_eq!(r["session"]["generation"], 1);
}

// ---------------------------------------------------------------------------
// Timeout, cancel, reset, close

#[test]
fn a_timeout_interrupts_the_call_and_keeps_the_session() {
    let s = Server::ipc();
    let mut p = s.peer();
    p.run("x <- 7");
    let t = Instant::now();
    let r = p.call(
        TOK_A,
        json!({"op": "run", "code": "Sys.sleep(30)", "timeout_seconds": 1}),
    );
    let took = t.elapsed();
    let r = result(&r);
    assert_eq!(r["outcome"], "timed_out", "{r}");
    assert_eq!(r["success"], false);
    assert_eq!(r["error"]["timed_out"], true, "{r}");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    let r = p.run("x");
    assert_eq!(console(&r), "[1] 7\n", "state survives a timeout: {r}");
    assert_eq!(r["session"]["generation"], 1, "the same worker: {r}");
    assert_eq!(r["session"]["reset_reason"], Value::Null);
}

#[test]
fn cancel_stops_a_running_call_while_other_requests_are_answered() {
    let s = Server::ipc();
    let mut p = s.peer();
    let first = p.run("kept <- 'yes'");
    let sid = first["session"]["id"].clone();
    let t = Instant::now();
    let run = p.send(json!({"op": "run", "code": "Sys.sleep(30)", "token": TOK_A}));
    // Other requests on the same connection are answered while it runs.
    wait_for("the session to be running", || {
        let st = ok(&p.call(TOK_A, json!({"op": "status"})), "status");
        (st["state"] == "running").then_some(())
    });
    let h = p.send(json!({"op": "health", "token": TOK_A}));
    assert_eq!(ok(&p.wait(&h), "health")["status"], "ok");
    let cancel = p.send(json!({"op": "cancel", "token": TOK_A}));
    let c = p.wait(&cancel);
    assert_eq!(ok(&c, "status")["id"], sid, "{c}");
    let r = result(&p.wait(&run));
    let took = t.elapsed();
    assert_eq!(r["outcome"], "cancelled", "{r}");
    assert_eq!(r["success"], false);
    assert!(took < Duration::from_secs(20), "took {took:?}");
    let r = p.run("kept");
    assert_eq!(console(&r), "[1] \"yes\"\n", "cancel keeps the state: {r}");
    // Cancelling an idle session is harmless.
    let st = ok(&p.call(TOK_A, json!({"op": "cancel"})), "status");
    assert_eq!(st["state"], "idle", "{st}");
}

#[test]
fn reset_gives_a_fresh_session() {
    let s = Server::ipc();
    let mut p = s.peer();
    let r = p.run("x <- 1");
    let sid = r["session"]["id"].clone();
    let st = ok(&p.call(TOK_A, json!({"op": "reset"})), "status");
    assert_eq!(st["id"], sid, "{st}");
    let r = p.run("exists('x')");
    assert!(console(&r).ends_with("[1] FALSE\n"), "{r}");
    assert_eq!(r["session"]["id"], sid, "the same session, a new worker");
    assert_eq!(r["session"]["fresh"], true, "{r}");
    assert_eq!(r["session"]["reset_reason"], "reset", "{r}");
    assert_eq!(r["session"]["generation"], 2, "{r}");
    let st = ok(&p.call(TOK_A, json!({"op": "status"})), "status");
    assert_eq!(st["last_reset"]["reason"], "reset", "{st}");
    // Resetting a session that does not exist is an error.
    err(
        &p.call(TOK_A, json!({"op": "reset", "session": "nope"})),
        "unknown_session",
    );
}

#[test]
fn checkpoint_hibernate_and_restore_answer_as_in_jsonl() {
    let mut s = Server::durable();
    let mut p = s.peer();
    p.run("keep <- 'before'");
    let c = ok(&p.call(TOK_A, json!({"op": "checkpoint"})), "checkpoint");
    assert_eq!(c["written"], true, "{c}");
    assert!(
        c["manifest"]["objects"]
            .as_array()
            .is_some_and(|o| o.contains(&json!("keep"))),
        "{c}"
    );
    let st = ok(&p.call(TOK_A, json!({"op": "hibernate"})), "status");
    let sid = st["id"].clone();
    wait_for("the session to hibernate", || {
        let st = ok(&p.call(TOK_A, json!({"op": "status"})), "status");
        (st["state"] == "hibernated").then_some(())
    });
    let r = p.run("cat(keep)");
    assert_eq!(r["session"]["id"], sid, "{r}");
    assert_eq!(r["session"]["restored"]["reason"], "hibernated", "{r}");
    assert!(console(&r).ends_with("before"), "{r}");

    // Roll back to the checkpoint.
    p.run("after <- 1");
    ok(&p.call(TOK_A, json!({"op": "restore"})), "status");
    let r = p.run("cat(keep, exists('after'))");
    assert_eq!(r["session"]["restored"]["reason"], "restore", "{r}");
    assert!(console(&r).ends_with("before FALSE"), "{r}");

    // Another tenant's name is its own: bob has no session to restore.
    err(&p.call(TOK_B, json!({"op": "restore"})), "unknown_session");
    let m = err(
        &p.call(TOK_A, json!({"op": "restore", "session": "fresh-one"})),
        "unknown_session",
    );
    assert!(m.contains("fresh-one"), "{m}");
    // A session with no checkpoint cannot be rolled back: a conflict.
    p.run_in(TOK_A, "other", "y <- 1");
    let m = err(
        &p.call(TOK_A, json!({"op": "restore", "session": "other"})),
        "conflict",
    );
    assert!(m.contains("no checkpoint"), "{m}");
    assert!(s.stop().success(), "{}", s.log());
}

#[test]
fn without_a_state_dir_the_durable_ops_say_to_start_the_server_with_one() {
    let s = Server::ipc();
    let mut p = s.peer();
    p.run("x <- 1");
    for op in ["checkpoint", "hibernate", "restore"] {
        let m = err(&p.call(TOK_A, json!({ "op": op })), "not_found");
        assert!(m.contains("--state-dir"), "{op}: {m}");
    }
}

#[test]
fn close_ends_the_session_and_forgets_its_name() {
    let s = Server::ipc();
    let mut p = s.peer();
    let r = p.run_in(TOK_A, "work", "x <- 1");
    let sid = r["session"]["id"].clone();
    let pid = ok(
        &p.call(TOK_A, json!({"op": "status", "session": "work"})),
        "status",
    )["pid"]
        .as_u64()
        .expect("a worker pid");
    let st = ok(
        &p.call(TOK_A, json!({"op": "close", "session": "work"})),
        "status",
    );
    assert_eq!(st["state"], "closed", "{st}");
    assert_eq!(st["id"], sid, "{st}");
    wait_for("the closed session's worker to exit", || {
        process_gone(pid).then_some(())
    });
    for op in ["cancel", "reset", "close"] {
        let m = err(
            &p.call(TOK_A, json!({"op": op, "session": "work"})),
            "unknown_session",
        );
        assert!(m.contains("work"), "{m}");
    }
    // A run makes a new session under the name.
    let r = p.run_in(TOK_A, "work", "exists('x')");
    assert_eq!(console(&r), "[1] FALSE\n", "{r}");
    assert_ne!(r["session"]["id"], sid);

    // Closing a session ends its running call.
    let run =
        p.send(json!({"op": "run", "session": "work", "code": "Sys.sleep(30)", "token": TOK_A}));
    wait_for("the session to be running", || {
        let st = ok(
            &p.call(TOK_A, json!({"op": "status", "session": "work"})),
            "status",
        );
        (st["state"] == "running").then_some(())
    });
    let st = ok(
        &p.call(TOK_A, json!({"op": "close", "session": "work"})),
        "status",
    );
    assert_eq!(st["state"], "closed", "{st}");
    let r = result(&p.wait(&run));
    assert_eq!(r["outcome"], "closed", "{r}");
    assert_eq!(r["success"], false);
}

/// A `run` and a `close` of the same name sent together, many times: each
/// pair ends in one order or the other, and no session is left that the
/// name no longer reaches (a close used to forget the session a racing run
/// had just made, which then lived on, unreachable, until the server
/// stopped).
#[test]
fn a_run_racing_a_close_leaves_no_unreachable_session() {
    let s = Server::ipc();
    let mut p = s.peer();
    for _ in 0..300 {
        let run = p.send(json!({"op": "run", "session": "w", "code": "1", "token": TOK_A}));
        let close = p.send(json!({"op": "close", "session": "w", "token": TOK_A}));
        let r = p.wait(&run);
        match r.get("result") {
            Some(res) => assert!(
                ["complete", "closed"].contains(&res["outcome"].as_str().unwrap_or("")),
                "{r}"
            ),
            // The run found the session that the close then ended.
            None => {
                err(&r, "not_found");
            }
        }
        let c = p.wait(&close);
        match c.get("status") {
            Some(st) => assert_eq!(st["state"], "closed", "{c}"),
            None => {
                err(&c, "unknown_session");
            }
        }
    }
    let _ = p.call(TOK_A, json!({"op": "close", "session": "w"}));
    let h = ok(&p.call(TOK_A, json!({"op": "health"})), "health");
    assert_eq!(
        h["workers"]["sessions"], 0,
        "sessions left over: {}",
        h["workers"]
    );
}

// ---------------------------------------------------------------------------
// Operations, one-shot runs, tables

#[test]
fn health_packages_and_validate() {
    let s = Server::tcp();
    let mut p = s.peer();
    let h = ok(&p.call(TOK_A, json!({"op": "health"})), "health");
    assert_eq!(h["status"], "ok");
    assert!(
        h["r_version"].as_str().is_some_and(|v| v.starts_with('4')),
        "{h}"
    );
    let forbidden = h["rules"]["forbidden_functions"]
        .as_array()
        .expect("rules.forbidden_functions");
    assert!(forbidden.iter().any(|f| f == "system"), "{h}");
    assert_eq!(h["rules"]["timeout_seconds"]["min"], 1);
    assert_eq!(h["rules"]["timeout_seconds"]["max"], 300);

    let pk = ok(&p.call(TOK_A, json!({"op": "packages"})), "packages");
    let list = pk.as_array().expect("packages is an array");
    let stats = list
        .iter()
        .find(|x| x["name"] == "stats")
        .unwrap_or_else(|| panic!("no stats: {pk}"));
    assert!(
        stats["version"].is_string() && stats["library"].is_string(),
        "{stats}"
    );

    let v = ok(
        &p.call(
            TOK_A,
            json!({"op": "validate", "script": "x <- 1\nsystem(\"ls\")"}),
        ),
        "validation",
    );
    assert_eq!(v["valid"], false, "{v}");
    let problem = v["problems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["kind"] == "forbidden")
        .unwrap_or_else(|| panic!("no forbidden problem: {v}"))
        .clone();
    assert_eq!(problem["line"], 2, "{v}");
    assert!(
        problem["message"].as_str().unwrap().contains("system"),
        "{v}"
    );
    let v = ok(
        &p.call(TOK_A, json!({"op": "validate", "script": "x <- 1"})),
        "validation",
    );
    assert_eq!(v["valid"], true, "{v}");
}

#[test]
fn one_shot_runs_take_variables_and_tables() {
    let s = Server::ipc();
    let mut p = s.peer();
    let t = p.call(
        TOK_A,
        json!({"op": "put_table", "csv": "a,b\n1,x\n2,y\n3,z\n"}),
    );
    let t = ok(&t, "table");
    assert_eq!(t["rows"], 3, "{t}");
    assert_eq!(t["columns"][0]["name"], "a", "{t}");
    assert!(t["expires_at"].is_string(), "{t}");
    let pointer = t["data_pointer"]
        .as_str()
        .expect("a data pointer")
        .to_string();

    let r = p.call(
        TOK_A,
        json!({"op": "run_script", "script": "sum(df$a) * k", "timeout_seconds": 10,
               "variables": [{"name": "k", "value": 7}],
               "dataframes": [{"data_pointer": pointer, "name": "df"}]}),
    );
    let r = result(&r);
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(console(&r), "[1] 42\n", "{r}");
    assert_eq!(r["session"]["fresh"], true, "a one-shot run is fresh: {r}");

    // Records work too; `run` with a script and no code is a one-shot run,
    // which does not see the session.
    let t = p.call(
        TOK_A,
        json!({"op": "put_table", "records": [{"v": 1.5}, {"v": 2.5}]}),
    );
    let t = ok(&t, "table");
    assert_eq!(t["rows"], 2, "{t}");
    p.run("v <- 'session'");
    let r = p.call(
        TOK_A,
        json!({"op": "run", "script": "cat(exists('v'), sum(d$v))",
               "dataframes": [{"data_pointer": t["data_pointer"], "name": "d"}]}),
    );
    let r = result(&r);
    assert_eq!(console(&r), "FALSE 4", "{r}");

    // The validation rules apply to one-shot runs.
    let r = result(&p.call(TOK_A, json!({"op": "run_script", "script": "system('id')"})));
    assert_eq!(r["outcome"], "rejected", "{r}");
    assert_eq!(r["success"], false);
}

#[test]
fn tables_belong_to_their_tenant() {
    let s = Server::ipc();
    let mut p = s.peer();
    let t = ok(
        &p.call(TOK_A, json!({"op": "put_table", "csv": "a\n1\n2\n"})),
        "table",
    );
    let pointer = t["data_pointer"].clone();

    // Bob can neither use, see nor delete Alice's table.
    let bob_run = json!({"op": "run_script", "script": "nrow(d)",
                         "dataframes": [{"data_pointer": pointer, "name": "d"}]});
    err(&p.call(TOK_B, bob_run.clone()), "data_pointer_unresolved");
    err(
        &p.call(TOK_B, json!({"op": "get_table", "data_pointer": pointer})),
        "not_found",
    );
    err(
        &p.call(
            TOK_B,
            json!({"op": "delete_table", "data_pointer": pointer}),
        ),
        "not_found",
    );
    // An unknown pointer answers the same.
    err(
        &p.call(
            TOK_A,
            json!({"op": "run_script", "script": "1",
                   "dataframes": [{"data_pointer": "dp_unknown", "name": "d"}]}),
        ),
        "data_pointer_unresolved",
    );

    let got = ok(
        &p.call(TOK_A, json!({"op": "get_table", "data_pointer": pointer})),
        "table",
    );
    assert_eq!(got["data_pointer"], pointer);
    assert_eq!(got["rows"], 2);
    let r = result(&p.call(TOK_A, bob_run.clone()));
    assert_eq!(console(&r), "[1] 2\n", "Alice can use it: {r}");
    let d = p.call(
        TOK_A,
        json!({"op": "delete_table", "data_pointer": pointer}),
    );
    assert_eq!(ok(&d, "deleted"), true);
    err(
        &p.call(TOK_A, json!({"op": "get_table", "data_pointer": pointer})),
        "not_found",
    );
    err(
        &p.call(
            TOK_A,
            json!({"op": "delete_table", "data_pointer": pointer}),
        ),
        "not_found",
    );
    err(&p.call(TOK_A, bob_run), "data_pointer_unresolved");
}

// ---------------------------------------------------------------------------
// Bad requests and bad peers

#[test]
fn invalid_requests_get_the_services_error_codes() {
    let s = Server::ipc();
    let mut p = s.peer();
    let one_shot = |extra: Value| {
        let mut req = json!({"op": "run_script", "script": "1"});
        for (k, v) in extra.as_object().unwrap() {
            req[k] = v.clone();
        }
        req
    };
    for t in [json!(0), json!(301), json!(-1), json!("soon")] {
        let r = p.call(TOK_A, one_shot(json!({"timeout_seconds": t})));
        err(&r, "invalid");
    }
    let m = err(
        &p.call(
            TOK_A,
            json!({"op": "run", "code": "1", "timeout_seconds": 0}),
        ),
        "invalid",
    );
    assert!(m.contains("timeout_seconds"), "{m}");
    err(
        &p.call(
            TOK_A,
            one_shot(json!({"variables": [{"name": "1bad", "value": 1}]})),
        ),
        "invalid",
    );
    err(
        &p.call(
            TOK_A,
            one_shot(json!({"variables": [{"name": "k", "value": null}]})),
        ),
        "invalid",
    );

    // Malformed JSON: no id to echo.
    p.send_raw("{not json");
    let r = p.wait(&Value::Null);
    assert_eq!(r["id"], Value::Null);
    let m = err(&r, "bad_request");
    assert!(
        m.contains("expected e.g."),
        "the message shows a request: {m}"
    );
    p.send_raw("[1, 2]");
    err(&p.wait(&Value::Null), "bad_request");

    // Well-formed but wrong: the id is echoed.
    let r = p.call(TOK_A, json!({"id": "u1", "op": "frobnicate"}));
    assert_eq!(r["id"], "u1");
    assert!(err(&r, "bad_request").contains("unknown op"), "{r}");
    let r = p.call(
        TOK_A,
        json!({"id": "u2", "op": "run", "code": "1", "cod": "2"}),
    );
    assert_eq!(r["id"], "u2");
    assert!(err(&r, "bad_request").contains("cod"), "{r}");
    let r = p.call(TOK_A, json!({"id": 3, "op": "run"}));
    assert_eq!(r["id"], 3);
    assert!(err(&r, "bad_request").contains("code"), "{r}");
    err(&p.call(TOK_A, json!({"code": "1"})), "bad_request");
    err(&p.call(TOK_A, json!({"op": "validate"})), "bad_request");
    err(&p.call(TOK_A, json!({"op": "run_script"})), "bad_request");
    err(&p.call(TOK_A, json!({"op": "get_table"})), "bad_request");
    err(&p.call(TOK_A, json!({"op": "put_table"})), "bad_request");
    err(
        &p.call(
            TOK_A,
            json!({"op": "put_table", "csv": "a\n1\n", "records": [{"a": 1}]}),
        ),
        "bad_request",
    );

    // None of that harmed the connection or made a session.
    let st = ok(&p.call(TOK_A, json!({"op": "status"})), "status");
    assert_eq!(st["generation"], 0, "{st}");
    assert_eq!(console(&p.run("1 + 1")), "[1] 2\n");
}

/// Connects to the server's IPC socket, sends `header`, and returns what
/// the server sent before it closed the connection.
fn raw_exchange(sock: &Path, header: &[u8]) -> Vec<u8> {
    let mut c = std::os::unix::net::UnixStream::connect(sock).expect("connect to the socket");
    c.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("a read timeout");
    c.write_all(header).expect("send a header");
    let mut got = Vec::new();
    match c.read_to_end(&mut got) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!("the server did not close the connection: {e} (got {got:?})"),
    }
    got
}

#[test]
fn a_peer_that_is_not_req_is_refused() {
    let s = Server::ipc();
    let sock = s.dir.path().join("rvisor.sock");
    // The server's SP header says REP (0x31); a PAIR peer (0x10) or a
    // stranger is then hung up on.
    let rep_header = [0, b'S', b'P', 0, 0, 0x31, 0, 0];
    let got = raw_exchange(&sock, &[0, b'S', b'P', 0, 0, 0x10, 0, 0]);
    assert_eq!(got, rep_header);
    let got = raw_exchange(&sock, b"GET / HTTP/1.1\r\n\r\n");
    assert_eq!(got, rep_header);
    wait_for("the server to log the refusal", || {
        s.log().contains("SP protocol 0x10").then_some(())
    });

    // A real nng PAIR socket gets no answer.
    require_pynng();
    let script = r#"
import sys, pynng
with pynng.Pair0(send_timeout=1000, recv_timeout=1000) as s:
    s.dial(sys.argv[1], block=False)
    try:
        s.send(b'{"id": 1, "op": "health"}')
        print("answered:", s.recv())
    except pynng.Timeout:
        print("refused")
"#;
    let out = Command::new("python3")
        .args(["-c", script, &s.url])
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim() == "refused",
        "{}: {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );

    // A REQ client is served as before.
    let mut p = s.peer();
    let h = ok(&p.call(TOK_A, json!({"op": "health"})), "health");
    assert_eq!(h["status"], "ok");
    assert_eq!(console(&p.run("6 * 7")), "[1] 42\n");
}

/// REQ/REP cannot push: a client follows a long call through `status`,
/// whose `running` shows the call and the last lines it printed.
#[test]
fn status_shows_the_output_of_the_running_call_so_far() {
    let s = Server::ipc();
    let mut p = s.peer();
    p.run("1");
    let run = p.send(json!({"op": "run", "token": TOK_A,
        "code": "for (i in 1:25) cat('row', i, '\\n'); repeat Sys.sleep(0.05)"}));
    let running = wait_for("status to show the call's output", || {
        let st = ok(&p.call(TOK_A, json!({"op": "status"})), "status");
        let r = st["running"].clone();
        r["output_tail"]
            .as_str()
            .is_some_and(|t| t.ends_with("row 25 \n"))
            .then_some(r)
    });
    let tail = running["output_tail"].as_str().unwrap();
    assert_eq!(tail.lines().count(), 20, "the last 20 lines: {tail}");
    assert!(tail.starts_with("row 6 \n"), "{tail}");
    assert!(running["elapsed_ms"].as_f64().unwrap() > 0.0);
    assert!(running["execution_id"].is_string());
    ok(&p.call(TOK_A, json!({"op": "cancel"})), "status");
    let r = result(&p.wait(&run));
    assert_eq!(r["outcome"], "cancelled");
    assert_eq!(r["execution_id"], running["execution_id"]);
    let st = ok(&p.call(TOK_A, json!({"op": "status"})), "status");
    assert!(st["running"].is_null(), "{st}");
}

#[test]
fn history_answers_pages_of_the_named_session_for_its_tenant_only() {
    let s = Server::ipc();
    let mut p = s.peer();
    for i in 1..=3 {
        assert_eq!(p.run(&format!("cat({i})"))["outcome"], "complete");
    }
    let page = ok(
        &p.call(TOK_A, json!({"op": "history", "limit": 2})),
        "history",
    );
    let codes: Vec<&str> = page["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["code"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(codes, ["cat(3)", "cat(2)"], "{page}");
    let older = ok(
        &p.call(TOK_A, json!({"op": "history", "before": page["next"]})),
        "history",
    );
    assert_eq!(older["entries"][0]["console"], "1", "{older}");
    // Bob has no session named main until he makes one.
    err(&p.call(TOK_B, json!({"op": "history"})), "unknown_session");
}

/// Rich results over nng: a table as HTML, Markdown, a typed JSON preview
/// and its text, an HTML value, SVG plots, the display options of a
/// session call and of a one-shot run, and a bad option refused.
#[test]
fn displays_come_back_with_the_display_options_of_the_request() {
    let s = Server::ipc();
    let mut p = s.peer();
    let r = p.call(
        TOK_A,
        json!({"op": "run", "code": "head(mtcars, 5)", "display": {"max_rows": 2}}),
    );
    let r = result(&r);
    assert_eq!(r["outcome"], "complete", "{r}");
    let d = &r["displays"][0];
    assert!(
        d["data"]["text/html"]
            .as_str()
            .unwrap()
            .contains("<table class=\"dataframe\">"),
        "{d}"
    );
    assert!(d["data"]["text/markdown"]
        .as_str()
        .unwrap()
        .contains("A data.frame: 5 × 11"));
    assert!(d["data"]["text/plain"]
        .as_str()
        .unwrap()
        .contains("Hornet Sportabout"));
    let preview = &d["data"]["application/json"];
    assert_eq!(preview["nrow"], 5, "{preview}");
    assert_eq!(preview["rows"].as_array().unwrap().len(), 2);
    assert_eq!(preview["columns"][0]["name"], "mpg");
    assert_eq!(preview["columns"][0]["type"], "numeric");
    assert_eq!(preview["truncated"], true);
    assert_eq!(d["metadata"]["rvisor"]["kind"], "table");
    assert!(r["segments"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["kind"] == "display" && s["index"] == 0));

    // An HTML value, and an SVG plot beside its PNG.
    let r = p.call(
        TOK_A,
        json!({"op": "run", "code": "rvisor_display(htmltools::tags$b('bold')); plot(1:3)",
               "display": {"plot_format": "both"}}),
    );
    let r = result(&r);
    assert_eq!(r["outcome"], "complete", "{r}");
    let displays = r["displays"].as_array().unwrap();
    let html = displays
        .iter()
        .find(|d| d["metadata"]["rvisor"]["kind"] == "html")
        .unwrap_or_else(|| panic!("an html display: {r}"));
    assert!(html["data"]["text/html"]
        .as_str()
        .unwrap()
        .contains("<b>bold</b>"));
    let plot = displays
        .iter()
        .find(|d| d["metadata"]["rvisor"]["kind"] == "plot")
        .unwrap_or_else(|| panic!("a plot display: {r}"));
    assert!(plot["data"]["image/svg+xml"]
        .as_str()
        .unwrap()
        .contains("<svg"));
    let png = base64::engine::general_purpose::STANDARD
        .decode(plot["data"]["image/png"].as_str().unwrap())
        .unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
    assert_eq!(r["plots"][0]["mime"], "image/png");

    // Turned off, a table is text only.
    let r = p.call(
        TOK_A,
        json!({"op": "run", "code": "head(mtcars, 2)", "display": {"enabled": false}}),
    );
    let r = result(&r);
    assert!(r.get("displays").is_none(), "{r}");
    assert!(console(&r).contains("Mazda RX4 Wag"));

    // One-shot runs take the same options.
    let r = p.call(
        TOK_A,
        json!({"op": "run_script", "script": "plot(1:2)", "display": {"plot_format": "svg"}}),
    );
    let r = result(&r);
    assert_eq!(r["plots"][0]["mime"], "image/svg+xml", "{r}");
    assert!(r["displays"][0]["data"]["image/svg+xml"]
        .as_str()
        .unwrap()
        .contains("<svg"));

    // A bad option is refused, saying what to change; the session goes on.
    let bad = p.call(
        TOK_A,
        json!({"op": "run", "code": "1", "display": {"max_rows": 0}}),
    );
    let text = bad.to_string();
    assert!(text.contains("max_rows"), "{bad}");
    assert_eq!(p.run("1 + 1")["outcome"], "complete");
}
