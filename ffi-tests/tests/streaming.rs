//! Live output end to end: a session call's events (console text,
//! conditions, plot pages, progress) reach the library's event stream
//! while the call still runs, and the final result is the one the call
//! gives without streaming; `status` shows the running call.
//!
//! "While it still runs" is proved by a handshake, never by timing: R
//! prints, then waits until the test says it received the event (a
//! session tool, `tools$seen(n)`). Were the events held back until the
//! call ended, the call would never end and the test would fail at its
//! deadline.

use rvisor::{
    CallEvent, EventKind, Events, Outcome, Session, SessionOptions, Supervisor, SupervisorConfig,
    Tool,
};
use serde_json::{json, Value};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long anything may take before the test calls it a hang.
const DEADLINE: Duration = Duration::from_secs(30);

fn supervisor() -> Supervisor {
    Supervisor::new(SupervisorConfig::default()).expect("supervisor starts")
}

/// A session with the tool `seen(n)`: TRUE once the test acknowledged
/// event `n` (via the returned counter).
fn session(sup: &Supervisor) -> (Session, Arc<AtomicU64>) {
    let acked = Arc::new(AtomicU64::new(0));
    let a = acked.clone();
    let seen = Tool::new(
        "seen",
        "whether the test saw step n",
        json!({}),
        move |call| {
            let n = call.args.get(0).and_then(Value::as_u64).unwrap_or(u64::MAX);
            Ok(json!(a.load(Ordering::SeqCst) >= n))
        },
    )
    .unwrap();
    let s = sup
        .session_with(SessionOptions {
            tools: vec![seen],
            ..SessionOptions::default()
        })
        .expect("session");
    (s, acked)
}

/// R that waits for the test's acknowledgement of step `n`.
fn wait_seen(n: u64) -> String {
    format!("while (!tools$seen({n})) Sys.sleep(0.005)")
}

/// The next event other than `skip` kinds, within the deadline.
fn next_event(ev: &mut Events) -> CallEvent {
    ev.next_timeout(DEADLINE)
        .expect("an event before the deadline (was it held back until the call ended?)")
        .expect("the stream goes on until the result")
}

fn next_of(ev: &mut Events, kinds: &[&str]) -> CallEvent {
    loop {
        let e = next_event(ev);
        if kinds.contains(&e.kind.name()) || e.kind.name() == "result" {
            return e;
        }
    }
}

fn result_of(ev: &mut Events) -> rvisor::RunResult {
    loop {
        if let EventKind::Result { result } = next_event(ev).kind {
            assert!(ev.try_next().is_none(), "the result is the last event");
            return *result;
        }
    }
}

#[test]
fn printed_lines_arrive_one_by_one_while_the_call_runs() {
    let sup = supervisor();
    let (s, acked) = session(&sup);
    let code = format!(
        "for (i in 1:3) {{ cat('line', i, '\\n'); {} }}",
        wait_seen(0).replace("(0)", "(i)")
    );
    let h = s.run_streaming(&code).unwrap();
    let mut ev = h.events();
    let mut last_seq = 0;
    for i in 1..=3u64 {
        // cat() writes its pieces one by one: gather them up to the line's end.
        let mut line = String::new();
        while !line.ends_with('\n') {
            let e = next_of(&mut ev, &["stdout"]);
            assert!(e.seq > last_seq, "numbered in order");
            last_seq = e.seq;
            assert_eq!(e.execution_id, h.execution_id());
            let EventKind::Stdout { text } = e.kind else {
                panic!("the result came before line {i}: {e:?}");
            };
            line.push_str(&text);
        }
        assert_eq!(line, format!("line {i} \n"));
        // The call is still running: it waits for this acknowledgement.
        assert!(h.try_result().is_none());
        acked.store(i, Ordering::SeqCst);
    }
    let r = result_of(&mut ev);
    assert_eq!(r.outcome, Outcome::Complete);
    assert_eq!(r.console, "line 1 \nline 2 \nline 3 \n");
    assert_eq!(h.wait(), r, "the result event is the call's result");
}

#[test]
fn streamed_result_is_the_same_as_without_streaming() {
    let sup = supervisor();
    let code = "cat('out\\n'); message('note'); x <- log(-1); warning('w!'); \
                cat('err\\n', file = stderr()); print(1:3); cat(strrep('y', 70000), '\\n'); \
                rvisor_result(list(a = 1)); stop('boom')";
    let plain = sup.session().unwrap().run(code).unwrap().wait();
    let s = sup.session().unwrap();
    let h = s.run_streaming(code).unwrap();
    let events: Vec<CallEvent> = h.events().collect();
    let Some(EventKind::Result { result }) = events.last().map(|e| e.kind.clone()) else {
        panic!("the last event is the result");
    };
    let streamed = *result;
    assert_eq!(streamed.outcome, Outcome::Error);
    assert_eq!(streamed.console, plain.console);
    assert_eq!(streamed.segments, plain.segments);
    assert_eq!(streamed.warnings, plain.warnings);
    assert_eq!(streamed.error, plain.error);
    assert_eq!(streamed.result, plain.result);
    // The text events are the console as R wrote it (with the result
    // block, which the result takes out), in order.
    let text: String = events
        .iter()
        .filter_map(|e| e.kind.console_text())
        .collect();
    let block = "<<<RVISOR_RESULT_START>>>\n{\"a\":1}\n<<<RVISOR_RESULT_END>>>\n";
    let expected: String = plain
        .segments
        .iter()
        .filter_map(|s| match s {
            rvisor::Segment::Stdout { text }
            | rvisor::Segment::Stderr { text }
            | rvisor::Segment::Message { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    let text = text.replace(block, "");
    assert!(
        text == expected,
        "streamed text ({} bytes) differs from the result's ({} bytes): {:?} vs {:?}",
        text.len(),
        expected.len(),
        &text[..text.len().min(200)],
        &expected[..expected.len().min(200)]
    );
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.name()).collect();
    for k in ["stdout", "stderr", "message", "warning", "error", "result"] {
        assert!(kinds.contains(&k), "{k} in {kinds:?}");
    }
    let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as u64).collect::<Vec<_>>());
}

#[test]
fn a_plot_page_arrives_before_the_call_ends() {
    let sup = supervisor();
    let (s, acked) = session(&sup);
    let code = format!("plot(1:10); plot(10:1); {}; plot(1:3)", wait_seen(1));
    let h = s.run_streaming(&code).unwrap();
    let mut ev = h.events();
    let e = next_of(&mut ev, &["plot"]);
    assert_eq!(e.kind, EventKind::Plot { index: 0 });
    assert!(h.try_result().is_none(), "the call still runs");
    acked.store(1, Ordering::SeqCst);
    let e = next_of(&mut ev, &["plot"]);
    assert_eq!(e.kind, EventKind::Plot { index: 1 });
    // The last page is finished by the end of the call: it comes before
    // the result.
    let e = next_of(&mut ev, &["plot"]);
    assert_eq!(e.kind, EventKind::Plot { index: 2 });
    let r = result_of(&mut ev);
    assert_eq!(r.plots.len(), 3);
}

#[test]
fn progress_from_rvisor_progress_and_txt_progress_bar() {
    let sup = supervisor();
    let (s, acked) = session(&sup);
    let code = format!(
        "rvisor_progress(1, 4, 'loading'); {}; \
         pb <- txtProgressBar(max = 4, style = 3); setTxtProgressBar(pb, 2); {}; \
         setTxtProgressBar(pb, 4); close(pb)",
        wait_seen(1),
        wait_seen(2)
    );
    let h = s.run_streaming(&code).unwrap();
    let mut ev = h.events();
    let e = next_of(&mut ev, &["progress"]);
    assert_eq!(
        e.kind,
        EventKind::Progress {
            value: 1.0,
            total: Some(4.0),
            message: Some("loading".into())
        }
    );
    acked.store(1, Ordering::SeqCst);
    // The bar is drawn at 0% first, then 50%.
    loop {
        let e = next_of(&mut ev, &["progress"]);
        let EventKind::Progress { value, total, .. } = e.kind else {
            panic!("the bar's progress comes before the result: {e:?}");
        };
        assert_eq!(total, Some(100.0));
        if value == 50.0 {
            break;
        }
        assert_eq!(value, 0.0);
    }
    assert!(h.try_result().is_none(), "the call still runs");
    acked.store(2, Ordering::SeqCst);
    let e = next_of(&mut ev, &["progress"]);
    assert!(
        matches!(e.kind, EventKind::Progress { value, .. } if value == 100.0),
        "{e:?}"
    );
    let r = result_of(&mut ev);
    assert_eq!(r.outcome, Outcome::Complete);
    // Not streamed, the helper does nothing and says nothing.
    let quiet = s.run("rvisor_progress(3)").unwrap().wait();
    assert_eq!(
        (quiet.outcome, quiet.console.as_str()),
        (Outcome::Complete, "")
    );
    let bad = s.run("rvisor_progress('x')").unwrap().wait();
    assert_eq!(bad.outcome, Outcome::Error);
    assert!(bad.error.unwrap().message.contains("one finite number"));
}

#[test]
fn status_shows_the_running_call_and_what_it_printed() {
    let sup = supervisor();
    let (s, acked) = session(&sup);
    assert!(s.status().running.is_none());
    // Not streamed: status still sees the output of a call that runs a while.
    let code = format!("for (i in 1:30) cat('row', i, '\\n'); {}", wait_seen(1));
    let h = s.run(&code).unwrap();
    let end = Instant::now() + DEADLINE;
    let running = loop {
        if let Some(r) = s.status().running {
            if r.output_tail.contains("row 30") {
                break r;
            }
        }
        assert!(
            Instant::now() < end,
            "status never showed the call's output"
        );
        std::thread::yield_now();
    };
    assert_eq!(running.execution_id, h.execution_id());
    assert!(running.output_tail.ends_with("row 30 \n"));
    assert_eq!(running.output_tail.lines().count(), 20, "the last 20 lines");
    assert!(running.elapsed_ms > 0.0);
    assert!(running.cpu_ms.is_some());
    let json = serde_json::to_value(s.status()).unwrap();
    assert_eq!(json["running"]["execution_id"], h.execution_id());
    acked.store(1, Ordering::SeqCst);
    let r = h.wait();
    assert_eq!(r.outcome, Outcome::Complete);
    assert!(s.status().running.is_none());
    assert_eq!(
        serde_json::to_value(s.status()).unwrap()["running"],
        Value::Null
    );
}

#[test]
fn events_taken_after_the_call_hold_its_result() {
    let sup = supervisor();
    let s = sup.session().unwrap();
    let h = s.run("cat('a\\n')").unwrap();
    let r = h.clone().wait();
    // Taken after the call ended: the result alone.
    let events: Vec<CallEvent> = h.events().collect();
    assert_eq!(events.len(), 1);
    let EventKind::Result { result } = &events[0].kind else {
        panic!("{events:?}")
    };
    assert_eq!(**result, r);
    assert_eq!(result.console, "a\n");
}

#[test]
fn events_can_be_awaited_without_a_runtime_of_ours() {
    // A minimal executor: poll with a waker that unparks this thread.
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let sup = supervisor();
    let s = sup.session().unwrap();
    let mut ev = s
        .run_streaming("cat('x\\n'); Sys.sleep(0.05); cat('y\\n')")
        .unwrap()
        .events();
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut names = Vec::new();
    let end = Instant::now() + DEADLINE;
    loop {
        let mut fut = std::pin::pin!(ev.next_event());
        match fut.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(Some(e)) => names.push(e.kind.name()),
            std::task::Poll::Ready(None) => break,
            std::task::Poll::Pending => {
                assert!(Instant::now() < end, "no wake-up");
                std::thread::park_timeout(Duration::from_millis(100));
            }
        }
    }
    assert_eq!(names.last(), Some(&"result"));
    assert!(names.iter().filter(|n| **n == "stdout").count() >= 1);
}

// ---------------------------------------------------------------------------
// session --jsonl

/// `rvisor session --jsonl` as a child: its output lines on a channel.
struct Jsonl {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<Value>,
}

impl Jsonl {
    fn start() -> Self {
        use std::io::BufRead;
        let mut child = std::process::Command::new(rvisor_ffi_tests::rvisor_bin())
            .args(["session", "--jsonl"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start rvisor session --jsonl");
        let stdin = child.stdin.take().unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let v: Value = serde_json::from_str(&line).expect("each line is JSON");
                if tx.send(v).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            stdin: Some(stdin),
            lines,
        }
    }

    fn send(&mut self, v: Value) {
        use std::io::Write;
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{v}").unwrap();
        stdin.flush().unwrap();
    }

    fn line(&mut self) -> Value {
        self.lines
            .recv_timeout(DEADLINE)
            .expect("a line before the deadline")
    }
}

impl Drop for Jsonl {
    /// Ends it as a harness does, by closing its stdin (a killed one
    /// cannot remove its zygote's and workers' directories from /tmp);
    /// killed if it has not ended within the deadline.
    fn drop(&mut self) {
        drop(self.stdin.take());
        let end = Instant::now() + DEADLINE;
        while Instant::now() < end {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn jsonl_stream_sends_event_lines_before_the_result_line() {
    let mut cli = Jsonl::start();
    cli.send(json!({"id": "st", "op": "status"}));
    let st = cli.line();
    let pid = st["status"]["pid"].as_u64();
    // The worker starts with the first run: learn its pid and directory.
    let pid = match pid {
        Some(p) => p as u32,
        None => {
            cli.send(json!({"id": 0, "op": "run", "code": "1"}));
            assert_eq!(cli.line()["result"]["outcome"], "complete");
            cli.send(json!({"id": "st2", "op": "status"}));
            cli.line()["status"]["pid"].as_u64().expect("a worker") as u32
        }
    };
    cli.send(json!({"id": "st3", "op": "status"}));
    let wd = cli.line()["status"]["working_dir"]
        .as_str()
        .unwrap()
        .to_string();
    let ack = |n: u32| {
        let p = rvisor_ffi_tests::inside(pid, &std::path::Path::new(&wd).join(format!("ack{n}")));
        std::fs::write(p, "").expect("write the acknowledgement into the worker's directory");
    };
    cli.send(json!({"id": 7, "op": "run", "stream": true,
        "code": "for (i in 1:2) { cat(sprintf('tick %d\\n', i)); \
                 while (!file.exists(paste0('ack', i))) Sys.sleep(0.005) }"}));
    for i in 1..=2u32 {
        let l = cli.line();
        assert_eq!(l["id"], 7, "{l}");
        let ev = &l["event"];
        assert_eq!(ev["kind"], "stdout", "{l}");
        assert_eq!(ev["text"], format!("tick {i}\n"));
        assert!(ev["execution_id"].is_string() && ev["seq"].as_u64().is_some());
        ack(i);
    }
    let last = cli.line();
    assert_eq!(last["id"], 7);
    assert_eq!(last["result"]["outcome"], "complete", "{last}");
    assert_eq!(last["result"]["console"], "tick 1\ntick 2\n");
    // Without "stream", a run answers with its result line only.
    cli.send(json!({"id": 8, "op": "run", "code": "cat('quiet\\n')"}));
    let l = cli.line();
    assert_eq!(l["id"], 8);
    assert_eq!(l["result"]["console"], "quiet\n");
}

// ---------------------------------------------------------------------------
// HTTP: text/event-stream and application/x-ndjson

/// The real router on 127.0.0.1:0, served by a runtime of its own.
struct Http {
    addr: std::net::SocketAddr,
    _rt: tokio::runtime::Runtime,
    _dir: rvisor_ffi_tests::TestDir,
}

impl Http {
    fn start() -> Self {
        let dir = rvisor_ffi_tests::TestDir::new("streaming-http");
        let mut cfg = rvisor_server::http::ServeConfig::default();
        cfg.tables.dir = dir.path().join("tables");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let app = rvisor_server::http::router(supervisor(), cfg).unwrap();
        rt.spawn(async move { axum::serve(listener, app).await });
        Self {
            addr,
            _rt: rt,
            _dir: dir,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn post(&self, path: &str, body: Value) -> Value {
        ureq::post(&self.url(path))
            .send_json(body)
            .expect("a 2xx answer")
            .into_json()
            .unwrap()
    }

    fn get(&self, path: &str) -> Value {
        ureq::get(&self.url(path))
            .call()
            .unwrap()
            .into_json()
            .unwrap()
    }

    /// Sends a POST with `accept` and returns the open connection, its
    /// status and headers read.
    fn open_stream(&self, path: &str, accept: &str, body: Value) -> Stream {
        open_stream(&self.addr.to_string(), path, accept, body)
    }
}

/// Sends a POST with `accept` to the server at `addr` and returns the
/// open connection, its status and headers read.
fn open_stream(addr: &str, path: &str, accept: &str, body: Value) -> Stream {
    use std::io::{BufRead, Write};
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(DEADLINE)).unwrap();
    let body = body.to_string();
    write!(
        tcp,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = std::io::BufReader::new(tcp);
    let mut status = String::new();
    r.read_line(&mut status).unwrap();
    let mut headers = Vec::new();
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        if l == "\r\n" || l.is_empty() {
            break;
        }
        headers.push(l.trim().to_ascii_lowercase());
    }
    Stream {
        status: status
            .split_whitespace()
            .nth(1)
            .unwrap_or("")
            .parse()
            .unwrap_or(0),
        headers,
        r,
        buf: String::new(),
    }
}

/// A chunked HTTP response read as it arrives.
struct Stream {
    status: u16,
    headers: Vec<String>,
    r: std::io::BufReader<std::net::TcpStream>,
    buf: String,
}

impl Stream {
    /// Reads one more chunk into the buffer; false at the end.
    fn chunk(&mut self) -> bool {
        use std::io::{BufRead, Read};
        let mut size = String::new();
        self.r
            .read_line(&mut size)
            .expect("a chunk before the deadline");
        let n = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
        if n == 0 {
            return false;
        }
        let mut data = vec![0; n + 2];
        self.r.read_exact(&mut data).unwrap();
        self.buf.push_str(std::str::from_utf8(&data[..n]).unwrap());
        true
    }

    /// The next piece ending with `sep` (an SSE event, a JSON line).
    fn next_piece(&mut self, sep: &str) -> Option<String> {
        loop {
            if let Some(i) = self.buf.find(sep) {
                let piece = self.buf[..i].to_string();
                self.buf.drain(..i + sep.len());
                return Some(piece);
            }
            if !self.chunk() {
                return None;
            }
        }
    }

    /// The next SSE event (comments skipped): (id, event, data).
    fn sse(&mut self) -> (u64, String, Value) {
        loop {
            let piece = self.next_piece("\n\n").expect("an event before the end");
            let (mut id, mut event, mut data) = (0, String::new(), Value::Null);
            for line in piece.lines() {
                if let Some(v) = line.strip_prefix("id: ") {
                    id = v.parse().unwrap();
                } else if let Some(v) = line.strip_prefix("event: ") {
                    event = v.to_string();
                } else if let Some(v) = line.strip_prefix("data: ") {
                    data = serde_json::from_str(v).unwrap();
                }
            }
            if !event.is_empty() {
                return (id, event, data);
            }
        }
    }
}

#[test]
fn http_sse_streams_a_session_call_line_by_line() {
    let http = Http::start();
    let s = http.post("/v1/sessions", json!({}));
    let sid = s["id"].as_str().unwrap().to_string();
    let first = http.post(
        &format!("/v1/sessions/{sid}/run"),
        json!({"code": "kept <- 42"}),
    );
    assert_eq!(first["outcome"], "complete");
    let st = http.get(&format!("/v1/sessions/{sid}"));
    let pid = st["pid"].as_u64().unwrap() as u32;
    let wd = st["working_dir"].as_str().unwrap().to_string();
    let ack = |n: u32| {
        let p = rvisor_ffi_tests::inside(pid, &std::path::Path::new(&wd).join(format!("ack{n}")));
        std::fs::write(p, "").unwrap();
    };
    let code = "for (i in 1:2) { cat(sprintf('tick %d\\n', i)); \
                while (!file.exists(paste0('ack', i))) Sys.sleep(0.005) }; kept";
    let mut st = http.open_stream(
        &format!("/v1/sessions/{sid}/run"),
        "text/event-stream",
        json!({ "code": code }),
    );
    assert_eq!(st.status, 200);
    assert!(
        st.headers
            .iter()
            .any(|h| h == "content-type: text/event-stream"),
        "{:?}",
        st.headers
    );
    let mut last_id = 0;
    for i in 1..=2u32 {
        let (id, event, data) = st.sse();
        assert!(id > last_id);
        last_id = id;
        assert_eq!(event, "stdout");
        assert_eq!(data["kind"], "stdout");
        assert_eq!(data["text"], format!("tick {i}\n"));
        // Still running: status shows it.
        let running = http.get(&format!("/v1/sessions/{sid}"));
        assert_eq!(running["state"], "running");
        assert_eq!(running["running"]["execution_id"], data["execution_id"]);
        ack(i);
    }
    let (id, event, result) = loop {
        let e = st.sse();
        if e.1 == "result" {
            break e;
        }
        assert_eq!(e.1, "stdout", "only the result may follow: {e:?}");
    };
    assert!(id > last_id);
    assert_eq!(event, "result");
    assert_eq!(result["outcome"], "complete", "{result}");
    assert_eq!(result["console"], "tick 1\ntick 2\n[1] 42\n");
    assert!(
        st.next_piece("\n\n").is_none(),
        "the stream ends after the result"
    );
}

#[test]
fn http_ndjson_streams_a_one_shot_run_and_errors_stay_errors() {
    let http = Http::start();
    let mut st = http.open_stream(
        "/v1/run",
        "application/x-ndjson",
        json!({"script": "cat('a\\n'); rvisor_progress(1, 2); message('m'); 1 + 1"}),
    );
    assert_eq!(st.status, 200);
    assert!(st
        .headers
        .iter()
        .any(|h| h == "content-type: application/x-ndjson"));
    let mut kinds = Vec::new();
    let result = loop {
        let line = st.next_piece("\n").expect("a line before the end");
        let v: Value = serde_json::from_str(&line).unwrap();
        assert!(v["seq"].as_u64().unwrap() as usize == kinds.len() + 1);
        kinds.push(v["kind"].as_str().unwrap().to_string());
        if v["kind"] == "result" {
            break v["result"].clone();
        }
    };
    assert_eq!(result["outcome"], "complete");
    assert_eq!(result["console"], "a\nm\n[1] 2\n");
    for k in ["stdout", "progress", "message"] {
        assert!(kinds.iter().any(|x| x == k), "{k} in {kinds:?}");
    }
    // A request refused before anything runs is an ordinary error answer.
    let mut bad = http.open_stream(
        "/v1/run",
        "text/event-stream",
        json!({"script": "1", "timeout_seconds": 0}),
    );
    assert_eq!(bad.status, 422);
    assert!(bad
        .headers
        .iter()
        .any(|h| h.starts_with("content-type: application/json")));
    let _ = &mut bad;
}

#[test]
fn http_client_that_closes_the_stream_cancels_the_call_and_the_session_keeps_its_state() {
    let http = Http::start();
    let s = http.post("/v1/sessions", json!({}));
    let sid = s["id"].as_str().unwrap().to_string();
    assert_eq!(
        http.post(
            &format!("/v1/sessions/{sid}/run"),
            json!({"code": "kept <- 42"})
        )["outcome"],
        "complete"
    );
    let generation = http.get(&format!("/v1/sessions/{sid}"))["generation"].clone();
    let mut st = http.open_stream(
        &format!("/v1/sessions/{sid}/run"),
        "text/event-stream",
        json!({"code": "repeat { cat('.\\n'); Sys.sleep(0.02) }"}),
    );
    let (_, event, _) = st.sse();
    assert_eq!(event, "stdout");
    drop(st); // the client leaves
    let end = Instant::now() + DEADLINE;
    loop {
        let status = http.get(&format!("/v1/sessions/{sid}"));
        if status["state"] == "idle" {
            assert_eq!(
                status["generation"], generation,
                "the worker was not replaced"
            );
            assert!(status["last_reset"].is_null(), "{status}");
            break;
        }
        assert!(Instant::now() < end, "the call was not cancelled: {status}");
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = http.post(&format!("/v1/sessions/{sid}/run"), json!({"code": "kept"}));
    assert_eq!(r["console"], "[1] 42\n");
}

// ---------------------------------------------------------------------------
// Clients that read slowly, or not at all: bounded, and given back

/// A series of the server's `/metrics` (its line without labels).
fn metric(addr: &str, name: &str) -> u64 {
    let text = ureq::get(&format!("http://{addr}/metrics"))
        .call()
        .expect("/metrics answers")
        .into_string()
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{name} is not in /metrics:\n{text}")) as u64
}

/// Six SSE clients that never read past the head of their stream and one
/// that reads nothing until its call has printed everything, each call
/// printing 8 MB (just under the output cap), with 256 KiB per stream and
/// 1 MiB per tenant: the server holds the bounds, not the output (before
/// the bound it held what the kernel's socket buffers could not take,
/// ~4 MB a stream, and its memory grew by that much); the reader that
/// lags is told exactly which events it missed and still gets the result
/// with all of them; and when the clients leave, the memory goes back to
/// the system (before, the server stayed ~190 MiB above where it started:
/// glibc kept the freed results and events).
#[test]
fn clients_that_do_not_read_hold_only_their_bound_and_their_memory_goes_back_when_they_leave() {
    const NOT_READING: usize = 6;
    const LINES: usize = 8000; // of 1000 bytes each
    const MIB: u64 = 1 << 20;
    // How far the server's memory may be above where it started (the
    // workers' pipe threads, the allocator's slack), far below what the
    // streams would hold without their bound (~27 MiB).
    const MARGIN: u64 = 16 * MIB;
    let serve = rvisor_ffi_tests::ServeBin::start(&[
        "--stream-buffer-kb",
        "256",
        "--tenant-stream-buffer-kb",
        "1024",
    ]);
    let addr = serve.addr.clone();
    // The server's workers are unconfined: they see this directory.
    let dir = rvisor_ffi_tests::TestDir::new("slow-clients");
    let printed = |k: usize| dir.path().join(format!("printed-{k}"));
    let go = dir.path().join("go");
    let script = |k: usize| {
        format!(
            "x <- strrep('x', 999); for (i in 1:{LINES}) cat(x, '\\n', sep = ''); \
             invisible(file.create('{}')); while (!file.exists('{}')) Sys.sleep(0.01)",
            printed(k).display(),
            go.display()
        )
    };
    let run = |k: usize| {
        let st = open_stream(
            &addr,
            "/v1/run",
            "text/event-stream",
            json!({"script": script(k), "timeout_seconds": 120}),
        );
        assert_eq!(st.status, 200);
        st
    };
    // What every later run reuses is there before the baseline.
    let warm: Value = ureq::post(&format!("http://{addr}/v1/run"))
        .set("Accept", "text/event-stream")
        .send_json(json!({"script": "cat('warm\\n')"}))
        .unwrap()
        .into_string()
        .map(|body| {
            let data = body.rsplit("data: ").next().unwrap_or("").trim();
            serde_json::from_str(data).unwrap()
        })
        .unwrap();
    assert_eq!(warm["outcome"], "complete", "{warm}");
    let health: Value = ureq::get(&format!("http://{addr}/v1/health"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(
        health["streams"]["max_bytes_per_stream"], 262144,
        "{health}"
    );
    assert_eq!(health["streams"]["max_bytes_per_tenant"], 1048576);
    let baseline = serve.rss();

    let stalled: Vec<Stream> = (0..NOT_READING).map(run).collect();
    let mut slow = run(NOT_READING);
    let (first, event, data) = slow.sse();
    assert_eq!((first, event.as_str()), (1, "stdout"), "{data}");
    let mut text = data["text"].as_str().unwrap().len() as u64;
    rvisor_ffi_tests::wait_for("every call to print its output", 2 * DEADLINE, || {
        (0..=NOT_READING).all(|k| printed(k).exists()).then_some(())
    });

    // All printed, nothing read: the bounds hold, not the output.
    assert_eq!(metric(&addr, "rvisor_streams_open"), NOT_READING as u64 + 1);
    let buffered = metric(&addr, "rvisor_stream_buffered_bytes");
    let bound = MIB + (NOT_READING as u64 + 1) * rvisor::STREAM_OWN_BYTES as u64;
    assert!(
        buffered <= bound,
        "{buffered} bytes of events held for the clients, over the bound of {bound}"
    );
    assert!(metric(&addr, "rvisor_stream_dropped_events_total") > 0);
    let grown = serve.rss().saturating_sub(baseline);
    eprintln!(
        "server: {} MiB at the start, +{} MiB with {} clients not reading ({buffered} bytes \
         held for them)",
        baseline / MIB,
        grown / MIB,
        NOT_READING + 1
    );
    assert!(
        grown < MARGIN,
        "the server grew by {} MiB while its clients did not read (bound: {} KiB of events)",
        grown / MIB,
        bound / 1024
    );

    // The calls end. The reader that lagged reads on: every event it was
    // sent, one notice for each run of events it missed, then the result,
    // which has them all.
    std::fs::write(&go, "").unwrap();
    let mut next = first + 1;
    let mut notices = 0;
    let result = loop {
        let (id, event, data) = slow.sse();
        match event.as_str() {
            "stdout" => {
                assert_eq!(id, next, "events in order, none missing unsaid");
                text += data["text"].as_str().unwrap().len() as u64;
            }
            "lagged" => {
                assert_eq!(data["first_seq"].as_u64(), Some(next), "{data}");
                assert_eq!(data["events"].as_u64(), Some(id - next + 1), "{data}");
                assert!(
                    data["message"]
                        .as_str()
                        .unwrap()
                        .contains("the final result holds all of the call's output"),
                    "{data}"
                );
                text += data["bytes"].as_u64().unwrap();
                notices += 1;
            }
            "result" => {
                assert_eq!(id, next, "the result follows the last event");
                break data;
            }
            other => panic!("unexpected event {other}: {data}"),
        }
        next = id + 1;
    };
    assert!(
        notices > 0,
        "a reader 8 MB behind with 256 KiB was not told"
    );
    assert_eq!(result["outcome"], "complete", "{}", result["error"]);
    let console = result["console"].as_str().unwrap();
    assert_eq!(console.len(), LINES * 1000);
    assert_eq!(
        text,
        console.len() as u64,
        "the text read and the text said missed are the console"
    );

    // The clients leave (their results were waiting for them): nothing is
    // held for them any more, and the memory is the system's again.
    drop(stalled);
    drop(slow);
    rvisor_ffi_tests::wait_for("the streams to close", DEADLINE, || {
        (metric(&addr, "rvisor_streams_open") == 0).then_some(())
    });
    assert_eq!(metric(&addr, "rvisor_stream_buffered_bytes"), 0);
    // Freed as the server notices each client has gone: waited for, with
    // the deadline as the hang detector.
    let end = Instant::now() + DEADLINE;
    let after = loop {
        let rss = serve.rss();
        if rss < baseline + MARGIN {
            break rss;
        }
        assert!(
            Instant::now() < end,
            "the server stayed at {} MiB after its clients left ({} MiB at the start): the \
             memory held for them was not given back",
            rss / MIB,
            baseline / MIB
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!(
        "server: {} MiB after the clients left (peak {} MiB)",
        after / MIB,
        serve.peak_rss() / MIB
    );
}

// ---------------------------------------------------------------------------
// Displays: each comes with its bundle when it is made

/// The kinds of `events` (JSON), consecutive stdout joined, with the
/// stdout text of each run.
fn display_runs(events: &[Value]) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for e in events {
        let kind = e["kind"].as_str().unwrap().to_string();
        match (kind.as_str(), out.last_mut()) {
            ("stdout", Some((k, text))) if k == "stdout" => {
                text.push_str(e["text"].as_str().unwrap())
            }
            ("progress", _) => {}
            _ => {
                let text = e["text"].as_str().unwrap_or("").to_string();
                out.push((kind, text));
            }
        }
    }
    out
}

/// `cat("a"); rvisor_display(head(mtcars)); cat("b")` as JSON events:
/// stdout a (then the table's text, which the console keeps), the display
/// with its bundle (the result's `displays[0]`, HTML and all), stdout b,
/// the result.
fn check_display_events(events: &[Value]) {
    let runs = display_runs(events);
    let kinds: Vec<&str> = runs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        ["stdout", "display", "stdout", "result"],
        "{events:?}"
    );
    assert!(runs[0].1.starts_with("a\n"), "{runs:?}");
    assert_eq!(runs[2].1, "b\n");
    let d = events.iter().find(|e| e["kind"] == "display").unwrap();
    assert_eq!(d["index"], 0);
    assert!(
        d["display"]["data"]["text/html"]
            .as_str()
            .is_some_and(|h| h.contains("<table") && h.contains("Mazda RX4")),
        "{d}"
    );
    let result = &events.last().unwrap()["result"];
    assert_eq!(result["outcome"], "complete", "{result}");
    assert_eq!(d["display"], result["displays"][0], "the result's display");
    assert_eq!(
        result["segments"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["kind"] == "display")
            .unwrap(),
        &json!({"kind": "display", "index": 0}),
        "the segment stays {{kind, index}}"
    );
}

const DISPLAY_CODE: &str = "cat('a\\n'); rvisor_display(head(mtcars)); cat('b\\n')";

#[test]
fn a_display_arrives_with_its_bundle_while_the_call_runs() {
    let sup = supervisor();
    let (s, acked) = session(&sup);
    let code = format!(
        "cat('a\\n'); rvisor_display(head(mtcars)); {}; cat('b\\n'); plot(1:3)",
        wait_seen(1)
    );
    let h = s.run_streaming(&code).unwrap();
    let mut ev = h.events();
    let mut events = Vec::new();
    let display = loop {
        let e = next_of(&mut ev, &["stdout", "display"]);
        match &e.kind {
            EventKind::Display {
                index,
                display: Some(d),
            } => break (*index, (**d).clone()),
            EventKind::Stdout { .. } => events.push(e),
            _ => panic!("the display comes with its bundle, before the result: {e:?}"),
        }
    };
    // The call waits for this acknowledgement: the display was sent when
    // it was made, not with the result.
    assert!(h.try_result().is_none(), "the call still runs");
    acked.store(1, Ordering::SeqCst);
    let text: String = events
        .iter()
        .filter_map(|e| e.kind.console_text())
        .collect();
    assert!(text.starts_with("a\n"), "{text:?}");
    assert_eq!(display.0, 0);
    assert!(display.1.data["text/html"]
        .as_str()
        .unwrap()
        .contains("<table"));
    let e = next_of(&mut ev, &["stdout", "display"]);
    assert_eq!(e.kind.console_text(), Some("b\n"), "{e:?}");
    // A plot page: its plot event, then its display (made at the end of
    // the call), then the result.
    let e = next_of(&mut ev, &["plot", "display"]);
    assert_eq!(e.kind, EventKind::Plot { index: 0 });
    let e = next_of(&mut ev, &["display"]);
    let EventKind::Display {
        index: 1,
        display: Some(plot),
    } = e.kind
    else {
        panic!("the plot's display with its image: {e:?}");
    };
    assert!(plot.data.contains_key("image/png"), "{:?}", plot.metadata);
    let r = result_of(&mut ev);
    assert_eq!(r.outcome, Outcome::Complete);
    assert_eq!(r.displays.len(), 2);
    assert_eq!(
        r.displays[0], display.1,
        "the streamed display is the result's"
    );
    assert_eq!(r.displays[1], *plot);
}

#[test]
fn json_surfaces_stream_displays_with_their_bundles() {
    // HTTP, one JSON line per event.
    let http = Http::start();
    let mut st = http.open_stream(
        "/v1/run",
        "application/x-ndjson",
        json!({ "script": DISPLAY_CODE }),
    );
    assert_eq!(st.status, 200);
    let mut events = Vec::new();
    loop {
        let line = st.next_piece("\n").expect("a line before the end");
        let v: Value = serde_json::from_str(&line).unwrap();
        let done = v["kind"] == "result";
        events.push(v);
        if done {
            break;
        }
    }
    check_display_events(&events);

    // session --jsonl: the events in {"id", "event"} lines.
    let mut cli = Jsonl::start();
    cli.send(json!({"id": 1, "op": "run", "stream": true, "code": DISPLAY_CODE}));
    let mut events = Vec::new();
    loop {
        let l = cli.line();
        assert_eq!(l["id"], 1, "{l}");
        if let Some(r) = l.get("result") {
            events.push(json!({"kind": "result", "result": r}));
            break;
        }
        events.push(l["event"].clone());
    }
    check_display_events(&events);
}

/// A result's segments in short: stdout's text trimmed, `plot N`,
/// `display N`.
fn segment_words(r: &rvisor::RunResult) -> Vec<String> {
    r.segments
        .iter()
        .map(|s| match s {
            rvisor::Segment::Stdout { text } => text.trim().to_string(),
            rvisor::Segment::Plot { index } => format!("plot {index}"),
            rvisor::Segment::Display { index } => format!("display {index}"),
            other => format!("{other:?}"),
        })
        .collect()
}

/// A plot page is read as soon as it is finished (the next page began),
/// not when the call ends: its display, with its image, reaches the
/// stream while the call still waits for the test, and the result keeps
/// every page with its display in the order they were drawn.
#[test]
fn a_finished_plot_page_arrives_while_the_call_runs() {
    let sup = supervisor();
    let (s, acked) = session(&sup);
    let code = format!(
        "for (i in 1:3) {{ plot(i); cat('drew', i, '\\n'); {} }}",
        wait_seen(0).replace("(0)", "(i - 1)")
    );
    let h = s.run_streaming(&code).unwrap();
    let mut ev = h.events();
    let mut streamed = Vec::new();
    for page in 0..2usize {
        let e = next_of(&mut ev, &["display"]);
        let EventKind::Display {
            index,
            display: Some(d),
        } = e.kind
        else {
            panic!("page {page}'s display with its image, before the result: {e:?}");
        };
        assert_eq!(index, page);
        assert!(d.data.contains_key("image/png"), "{:?}", d.metadata);
        // Page `page` is finished once page `page + 1` began, and the call
        // waits for this acknowledgement before it draws the next one.
        assert!(h.try_result().is_none(), "the call still runs");
        streamed.push(*d);
        acked.store(page as u64 + 1, Ordering::SeqCst);
    }
    let r = result_of(&mut ev);
    assert_eq!(r.outcome, Outcome::Complete, "{:?}", r.error);
    assert_eq!(r.plots.len(), 3);
    assert_eq!(r.displays.len(), 3);
    assert_eq!(r.displays[..2], streamed[..]);
    assert_eq!(
        segment_words(&r),
        [
            "drew 1",
            "plot 0",
            "display 0",
            "drew 2",
            "plot 1",
            "display 1",
            "drew 3",
            "plot 2",
            "display 2"
        ],
        "each page where it was finished"
    );
}

/// A page of several panels (`par(mfrow)`) runs the page hook for each
/// panel, and its file exists, empty, while it is drawn on: it is read
/// once the device has written it (the next page began), whole, and no
/// page is lost or read twice.
#[test]
fn a_page_of_several_panels_is_read_once_it_is_written() {
    let sup = supervisor();
    let (s, _) = session(&sup);
    let h = s
        .run_streaming(
            "par(mfrow = c(2, 2)); for (i in 1:4) plot(i); cat('four\\n'); \
             par(mfrow = c(1, 1)); plot(5); cat('five\\n'); plot(6)",
        )
        .unwrap();
    let mut ev = h.events();
    // Each page's `plot` event, in order, with its index among the result's
    // plots: the page hook runs for each of the 4 panels, and only the
    // first begins a page (it once counted 4 pages there, and sent indices
    // past the result's plots).
    let mut plot_events = Vec::new();
    let r = loop {
        match next_event(&mut ev).kind {
            EventKind::Plot { index } => plot_events.push(index),
            EventKind::Result { result } => break *result,
            _ => {}
        }
    };
    assert_eq!(r.outcome, Outcome::Complete, "{:?}", r.error);
    assert_eq!(r.plots.len(), 3, "the 4-panel page, plot 5 and plot 6");
    assert_eq!(plot_events, [0, 1, 2]);
    use base64::Engine;
    for p in &r.plots {
        let png = base64::engine::general_purpose::STANDARD
            .decode(&p.data_base64)
            .unwrap();
        assert!(
            png.starts_with(b"\x89PNG") && png.len() > 1000,
            "{} bytes",
            png.len()
        );
    }
    assert_eq!(
        segment_words(&r),
        [
            "four",
            "plot 0",
            "display 0",
            "five",
            "plot 1",
            "display 1",
            "plot 2",
            "display 2"
        ]
    );
}
