//! Connection discipline of `rvisor serve`, end to end: the real binary on
//! loopback with short timeouts, driven by raw sockets. A half-sent
//! request is dropped after the header timeout, an idle connection after
//! the idle timeout, connections over the caps are refused while the first
//! ones stay usable, SIGTERM is not held up by idle or half-open
//! connections (and cuts off a request that outlives the grace period),
//! and a second server on the same data directory is refused. The same
//! caps and idle timeout for the nng socket over IPC.
//!
//! No test sleeps and hopes: the server is ready when it says so on
//! stderr, and every wait polls a condition until a generous deadline.

use rvisor_ffi_tests::TestDir;
use serde_json::Value;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a server may take to start, or any wait to end, before the
/// test calls it a hang.
const DEADLINE: Duration = Duration::from_secs(60);

/// How often blocked reads come up to look at the clock.
const TICK: Duration = Duration::from_millis(50);

fn wait_for<T>(what: &str, f: impl FnMut() -> Option<T>) -> T {
    rvisor_ffi_tests::wait_for(what, DEADLINE, f)
}

// ---------------------------------------------------------------------------
// The server

/// A running `rvisor serve`, stopped (SIGTERM, then SIGKILL) on drop.
struct Server {
    child: Option<Child>,
    /// `127.0.0.1:PORT`, as the server printed it.
    http: String,
    /// The IPC socket, with `--nng`.
    nng: Option<PathBuf>,
    log: Arc<Mutex<String>>,
    data: PathBuf,
    _dir: Option<TestDir>,
}

/// Starts `rvisor --unconfined serve --no-auth` on a free loopback port
/// with its data in `data` and the extra `args`; waits for its "listening"
/// lines. The exit status and stderr if it exits first.
fn try_start(
    data: &std::path::Path,
    nng: Option<&PathBuf>,
    args: &[&str],
) -> Result<Server, (ExitStatus, String)> {
    let mut cmd = std::process::Command::new(rvisor_ffi_tests::rvisor_bin());
    cmd.args([
        "--unconfined",
        "serve",
        "--no-auth",
        "--listen",
        "127.0.0.1:0",
        "--style",
        "builtin",
    ])
    .arg("--data-dir")
    .arg(data)
    .args(args)
    .env("RUST_LOG", "rvisor=info")
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    if let Some(sock) = nng {
        cmd.arg("--nng").arg(format!("ipc://{}", sock.display()));
    }
    let mut child = cmd.spawn().expect("rvisor serve starts");
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = mpsc::channel::<String>();
    let stderr = child.stderr.take().expect("piped stderr");
    let sink = log.clone();
    // Reads stderr to the end (the pipe never fills), keeps it for the
    // assertions and hands lines over while someone listens.
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
        http: String::new(),
        nng: nng.cloned(),
        log,
        data: data.to_path_buf(),
        _dir: None,
    };
    let end = Instant::now() + DEADLINE;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Some(a) = line.strip_prefix("rvisor serve: listening on http://") {
                    server.http = a.to_string();
                    if nng.is_none() {
                        return Ok(server);
                    }
                } else if line.starts_with("rvisor serve: listening on nng ") {
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

impl Server {
    /// A server with a data directory of its own.
    fn start(args: &[&str]) -> Server {
        Self::start_with(false, args)
    }

    /// A server with `--nng ipc://...` too.
    fn start_nng(args: &[&str]) -> Server {
        Self::start_with(true, args)
    }

    fn start_with(nng: bool, args: &[&str]) -> Server {
        // A short name: the IPC socket path stays far below 108 bytes.
        let dir = TestDir::new("conn");
        let sock = nng.then(|| dir.path().join("s.sock"));
        let mut s = try_start(&dir.path().join("data"), sock.as_ref(), args)
            .unwrap_or_else(|(status, log)| panic!("rvisor serve exited early ({status}):\n{log}"));
        s._dir = Some(dir);
        s
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("the server runs")
    }

    fn connect(&self) -> TcpStream {
        let s = TcpStream::connect(&self.http).expect("connect to the server");
        s.set_read_timeout(Some(TICK)).expect("a read timeout");
        s
    }

    fn connect_nng(&self) -> UnixStream {
        let path = self.nng.as_ref().expect("a server with --nng");
        let s = UnixStream::connect(path).expect("connect to the nng socket");
        s.set_read_timeout(Some(TICK)).expect("a read timeout");
        s
    }

    fn sigterm(&mut self) {
        let pid = self.child().id();
        // SAFETY: kill has no memory-safety preconditions; the pid is our
        // own child, not yet waited for (so it is not reused).
        let rc = unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    }

    /// Waits for the server to exit (after SIGTERM); its status and how
    /// long that took.
    fn exited(&mut self, since: Instant) -> (ExitStatus, Duration) {
        let mut child = self.child.take().expect("the server runs");
        let status = wait_for("rvisor serve to exit", || {
            child.try_wait().expect("try_wait")
        });
        (status, since.elapsed())
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
        // SAFETY: as in `sigterm`: our own child, not yet waited for.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
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

// ---------------------------------------------------------------------------
// Raw sockets

/// What a read on a socket found.
#[derive(Debug, PartialEq)]
enum Got {
    Data(Vec<u8>),
    /// The peer closed the connection (EOF or reset).
    Closed,
    /// Nothing yet.
    Nothing,
}

fn read_once(s: &mut impl Read) -> Got {
    let mut buf = [0u8; 4096];
    match s.read(&mut buf) {
        Ok(0) => Got::Closed,
        Ok(n) => Got::Data(buf[..n].to_vec()),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => Got::Nothing,
        Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => {
            Got::Closed
        }
        Err(e) => panic!("read: {e}"),
    }
}

/// Reads until the server closes the connection (failing on any data);
/// the time that took.
fn until_closed(what: &str, s: &mut impl Read) -> Duration {
    let t = Instant::now();
    wait_for(what, || match read_once(s) {
        Got::Closed => Some(t.elapsed()),
        Got::Nothing => None,
        Got::Data(d) => panic!("{what}: unexpected data {:?}", String::from_utf8_lossy(&d)),
    })
}

/// True if the connection is still open (nothing to read, no EOF).
fn still_open(s: &mut impl Read) -> bool {
    read_once(s) == Got::Nothing
}

/// An HTTP response: status, headers (lower-case names), body.
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

/// Reads one response (headers and a Content-Length body); `None` if the
/// connection closed first.
fn read_response(s: &mut impl Read) -> Option<Response> {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        assert!(buf.len() < 64 * 1024, "a response head over 64 KiB");
        match wait_for("a response", || match read_once(s) {
            Got::Nothing => None,
            r => Some(r),
        }) {
            Got::Data(d) => buf.extend(d),
            _ => return None,
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {head}"));
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("no content-length: {head}"));
    assert!(len < 16 << 20, "a response body over 16 MiB");
    let mut body = buf[head_end..].to_vec();
    while body.len() < len {
        match wait_for("a response body", || match read_once(s) {
            Got::Nothing => None,
            r => Some(r),
        }) {
            Got::Data(d) => body.extend(d),
            _ => return None,
        }
    }
    Some(Response {
        status,
        headers,
        body,
    })
}

/// Sends a request on a kept-alive connection and reads its response.
fn request(s: &mut TcpStream, method: &str, path: &str, body: Option<&str>) -> Response {
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send a request");
    read_response(s).expect("a response before the connection closed")
}

/// A request that touches no R: an unknown route answers 404.
fn probe(s: &mut TcpStream) {
    let r = request(s, "GET", "/nowhere", None);
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "not_found");
}

/// The SP header of a REQ socket (`\0SP\0`, protocol 0x0030, 2 zero bytes).
const SP_REQ: [u8; 8] = [0, b'S', b'P', 0, 0x00, 0x30, 0, 0];

/// Exchanges SP headers on an IPC connection: the server's (REP) first.
fn handshake(s: &mut UnixStream) {
    let mut got = Vec::new();
    while got.len() < 8 {
        match wait_for("the server's SP header", || match read_once(s) {
            Got::Nothing => None,
            r => Some(r),
        }) {
            Got::Data(d) => got.extend(d),
            Got::Closed => panic!("the nng connection closed before its SP header"),
            Got::Nothing => unreachable!(),
        }
    }
    assert_eq!(got, [0, b'S', b'P', 0, 0x00, 0x31, 0, 0], "a REP header");
    s.write_all(&SP_REQ).expect("send the SP header");
}

/// Sends one IPC request (type 1, 64-bit length, request id, body) and
/// reads its reply as JSON.
fn nng_request(s: &mut UnixStream, id: u32, body: &str) -> Value {
    let mut msg = vec![1u8];
    msg.extend(((4 + body.len()) as u64).to_be_bytes());
    msg.extend((id | 0x8000_0000).to_be_bytes());
    msg.extend(body.as_bytes());
    s.write_all(&msg).expect("send an nng request");
    let mut got = Vec::new();
    loop {
        if got.len() >= 9 {
            let len = u64::from_be_bytes(got[1..9].try_into().unwrap()) as usize;
            assert!(len < 16 << 20, "a reply over 16 MiB");
            if got.len() >= 9 + len {
                assert_eq!(got[0], 1, "an IPC message");
                assert_eq!(
                    &got[9..13],
                    &(id | 0x8000_0000).to_be_bytes(),
                    "the request id"
                );
                return serde_json::from_slice(&got[13..9 + len]).expect("a JSON reply");
            }
        }
        match wait_for("an nng reply", || match read_once(s) {
            Got::Nothing => None,
            r => Some(r),
        }) {
            Got::Data(d) => got.extend(d),
            _ => panic!("the nng connection closed before the reply"),
        }
    }
}

/// An nng request that touches no R: an unknown op is answered at once.
fn nng_probe(s: &mut UnixStream, id: u32) {
    let r = nng_request(s, id, r#"{"id": 7, "op": "nothing"}"#);
    assert_eq!(r["error"]["code"], "bad_request", "{r}");
}

// ---------------------------------------------------------------------------
// HTTP

#[test]
fn a_half_sent_request_line_is_dropped_after_the_header_timeout() {
    let s = Server::start(&["--header-timeout-secs", "1", "--idle-timeout-secs", "30"]);
    let mut half = s.connect();
    half.write_all(b"GET /nowhere HT")
        .expect("send half a request line");
    // A connection that never sends anything gets the same time.
    let mut silent = s.connect();
    let took = until_closed("the half-sent request to be dropped", &mut half);
    assert!(
        took >= Duration::from_millis(800),
        "dropped too early: {took:?}"
    );
    assert!(
        took < Duration::from_secs(8),
        "not dropped in time: {took:?}"
    );
    until_closed("the silent connection to be dropped", &mut silent);
    // A request sent whole in time is answered.
    probe(&mut s.connect());
}

#[test]
fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    let s = Server::start(&["--header-timeout-secs", "1", "--idle-timeout-secs", "3"]);
    let mut c = s.connect();
    probe(&mut c);
    // Kept alive: a second request on the same connection.
    probe(&mut c);
    let took = until_closed("the idle connection to be closed", &mut c);
    // The idle timeout, not the (shorter) header timeout.
    assert!(
        took >= Duration::from_millis(2500),
        "closed too early: {took:?}"
    );
    assert!(
        took < Duration::from_secs(20),
        "not closed in time: {took:?}"
    );
}

#[test]
fn connections_over_the_per_ip_cap_are_refused_while_the_first_stay_usable() {
    let s = Server::start(&[
        "--max-connections-per-ip",
        "2",
        "--header-timeout-secs",
        "60",
    ]);
    let mut a = s.connect();
    let mut b = s.connect();
    probe(&mut a);
    probe(&mut b);
    // A third from the same address: a 503 and the connection closes.
    for _ in 0..3 {
        let mut c = s.connect();
        // A reset may overtake the answer (None): refused all the same.
        if let Some(r) = read_response(&mut c) {
            assert_eq!(r.status, 503);
            assert_eq!(r.header("connection"), Some("close"));
            let e = r.json();
            assert_eq!(e["error"]["code"], "busy", "{e}");
            let msg = e["error"]["message"].as_str().unwrap_or_default();
            assert!(msg.contains("--max-connections-per-ip"), "{msg}");
            until_closed("the refused connection to close", &mut c);
        }
    }
    // The first two are untouched.
    probe(&mut a);
    probe(&mut b);
    assert!(still_open(&mut a) && still_open(&mut b));
    // The server logs before it closes; our reader thread may lag.
    wait_for("the refusal to be logged", || {
        s.log().contains("connections refused").then_some(())
    });
    // Closing one makes room for a new one.
    drop(a);
    let mut d = wait_for("room for a new connection", || {
        let mut d = s.connect();
        d.write_all(b"GET /nowhere HTTP/1.1\r\nhost: t\r\n\r\n")
            .ok()?;
        let r = read_response(&mut d)?;
        (r.status == 404).then_some(d)
    });
    probe(&mut d);
}

#[test]
fn sigterm_is_not_held_up_by_idle_or_half_sent_connections() {
    let mut s = Server::start_nng(&[
        "--header-timeout-secs",
        "120",
        "--idle-timeout-secs",
        "120",
        "--nng-idle-timeout-secs",
        "120",
        "--shutdown-grace-secs",
        "30",
    ]);
    let mut idle = s.connect();
    probe(&mut idle);
    let mut half = s.connect();
    half.write_all(b"POST /v1/run HTTP/1.1\r\nhost: t\r\ncontent-le")
        .expect("send half the headers");
    let mut silent = s.connect();
    let mut nng_idle = s.connect_nng();
    handshake(&mut nng_idle);
    nng_probe(&mut nng_idle, 1);
    let mut nng_half = s.connect_nng();
    handshake(&mut nng_half);
    nng_half
        .write_all(&[1, 0, 0, 0, 0, 0, 0, 0, 100, 0x80, 0, 0])
        .expect("send half an nng message");
    // Every connection is open and accounted for.
    for c in [&mut idle, &mut half, &mut silent] {
        assert!(still_open(c));
    }
    assert!(still_open(&mut nng_idle) && still_open(&mut nng_half));

    let t = Instant::now();
    s.sigterm();
    let (status, took) = s.exited(t);
    assert_eq!(status.code(), Some(0), "{status}:\n{}", s.log());
    assert!(
        took < Duration::from_secs(30),
        "exited after {took:?}, past the grace period:\n{}",
        s.log()
    );
    for c in [&mut idle, &mut half, &mut silent] {
        until_closed("the connection to be closed at shutdown", c);
    }
    until_closed("the nng connection to be closed", &mut nng_idle);
    until_closed("the nng connection to be closed", &mut nng_half);
    assert!(s.log().contains("shutting down"), "{}", s.log());
}

#[test]
fn a_request_running_past_the_grace_period_is_cut_off_at_shutdown() {
    let mut s = Server::start(&["--shutdown-grace-secs", "2"]);
    let mut c = s.connect();
    let r = request(&mut c, "POST", "/v1/sessions", None);
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let id = r.json()["id"].as_str().expect("a session id").to_string();
    let mut runner = s.connect();
    let body = r#"{"code": "Sys.sleep(120); 1", "timeout_seconds": 300}"#;
    let req = format!(
        "POST /v1/sessions/{id}/run HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    runner.write_all(req.as_bytes()).expect("send the run");
    wait_for("the run to be running", || {
        let st = request(&mut c, "GET", &format!("/v1/sessions/{id}"), None).json();
        (st["state"] == "running").then_some(())
    });
    let t = Instant::now();
    s.sigterm();
    let (status, took) = s.exited(t);
    assert_eq!(status.code(), Some(0), "{status}:\n{}", s.log());
    assert!(
        took < Duration::from_secs(30),
        "exited after {took:?}: the grace period is 2 s:\n{}",
        s.log()
    );
    assert!(
        took >= Duration::from_millis(1500),
        "the request got no grace: {took:?}"
    );
    // The run's connection was closed without an answer.
    assert!(read_response(&mut runner).is_none());
    let log = s.log();
    assert!(
        log.contains("shutdown grace period"),
        "the cut-off is logged:\n{log}"
    );
}

#[test]
fn a_second_server_on_the_same_data_directory_is_refused() {
    let mut first = Server::start(&[]);
    let pid = first.child().id();
    let second = try_start(&first.data, None, &[]);
    let Err((status, log)) = second else {
        panic!("a second server on {} started", first.data.display())
    };
    assert!(!status.success(), "{status}: {log}");
    assert!(
        log.contains(&format!("another rvisor serve (pid {pid})")),
        "the message names the other server:\n{log}"
    );
    assert!(
        log.contains(&first.data.display().to_string()),
        "the message names the directory:\n{log}"
    );
    // The first one still serves; once it is gone, the directory is free.
    probe(&mut first.connect());
    let t = Instant::now();
    first.sigterm();
    let (status, _) = first.exited(t);
    assert_eq!(status.code(), Some(0), "{status}");
    let third = try_start(&first.data, None, &[]).unwrap_or_else(|(status, log)| {
        panic!("a server after the first exited was refused ({status}):\n{log}")
    });
    drop(third);
}

// ---------------------------------------------------------------------------
// nng over IPC

#[test]
fn nng_connections_over_the_cap_are_closed_while_the_first_stay_usable() {
    let s = Server::start_nng(&["--max-connections", "2"]);
    let mut a = s.connect_nng();
    handshake(&mut a);
    let mut b = s.connect_nng();
    handshake(&mut b);
    nng_probe(&mut a, 1);
    nng_probe(&mut b, 1);
    // A third is closed before any SP header.
    let mut c = s.connect_nng();
    until_closed("the connection over the cap to be closed", &mut c);
    nng_probe(&mut a, 2);
    nng_probe(&mut b, 2);
    // The server logs before it closes; our reader thread may lag.
    wait_for("the refusal to be logged", || {
        s.log().contains("connections refused").then_some(())
    });
    // Room again once one closes.
    drop(a);
    let mut d = wait_for("room for a new nng connection", || {
        let mut d = s.connect_nng();
        let mut head = [0u8; 8];
        d.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        d.read_exact(&mut head).ok()?;
        d.set_read_timeout(Some(TICK)).ok()?;
        d.write_all(&SP_REQ).ok()?;
        Some(d)
    });
    nng_probe(&mut d, 1);
}

#[test]
fn an_idle_nng_connection_is_closed_after_the_idle_timeout() {
    let s = Server::start_nng(&["--nng-idle-timeout-secs", "2"]);
    let mut c = s.connect_nng();
    handshake(&mut c);
    nng_probe(&mut c, 1);
    let took = until_closed("the idle nng connection to be closed", &mut c);
    assert!(
        took >= Duration::from_millis(1500),
        "closed too early: {took:?}"
    );
    assert!(
        took < Duration::from_secs(20),
        "not closed in time: {took:?}"
    );
    // Half a message is no request in flight: the same timeout.
    let mut half = s.connect_nng();
    handshake(&mut half);
    half.write_all(&[1, 0, 0, 0]).expect("send half a header");
    until_closed("the half-sent nng message to be dropped", &mut half);
}
