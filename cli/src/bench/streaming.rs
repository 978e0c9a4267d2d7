//! Streaming figures of `rvisor bench`: how long a line printed by R
//! takes to reach a streaming client (HTTP SSE, `session --jsonl`), and
//! what streaming costs the 48 KB print workload and `1+1`, measured side
//! by side in one run.
//!
//! Latency: R prints its own clock (`Sys.time()`, microseconds) and the
//! client subtracts it from its clock on arrival (one machine, one clock).

use super::{ms, summarise, Stats};
use rvisor::{EventKind, Session};
use std::io::{BufRead, BufReader, Read, Write};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// R code printing `n` timestamps, `gap` seconds apart.
fn ticker(n: usize, gap: f64) -> String {
    format!(
        "for (i in seq_len({n})) {{ cat(sprintf('%.6f\\n', as.numeric(Sys.time()))); Sys.sleep({gap}) }}"
    )
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Milliseconds from each printed timestamp in `text` to `at`.
fn lags(text: &str, at: f64, out: &mut Vec<f64>) {
    for l in text.lines() {
        if let Ok(t) = l.trim().parse::<f64>() {
            out.push((at - t) * 1000.0);
        }
    }
}

/// Through `rvisor serve --no-auth` (this binary) on a free loopback
/// port: an SSE session run.
fn http_lags(n: usize) -> Result<Vec<f64>, String> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let dir = std::env::temp_dir().join(format!("rvisor-bench-{}", rvisor::ids::random_hex(6)));
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut server = std::process::Command::new(exe)
        .args([
            "serve",
            "--no-auth",
            "--listen",
            &addr.to_string(),
            "--data-dir",
        ])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let end = Instant::now() + Duration::from_secs(120);
    while std::net::TcpStream::connect(addr).is_err() {
        if Instant::now() > end || server.try_wait().ok().flatten().is_some() {
            let _ = server.kill();
            return Err("rvisor serve did not start".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let got = http_session_lags(addr, n);
    let _ = server.kill();
    let _ = server.wait();
    let _ = std::fs::remove_dir_all(dir);
    got
}

fn http_session_lags(addr: std::net::SocketAddr, n: usize) -> Result<Vec<f64>, String> {
    let post = |path: &str, accept: &str, body: &str| -> Result<std::net::TcpStream, String> {
        let mut tcp = std::net::TcpStream::connect(addr).map_err(|e| e.to_string())?;
        tcp.set_read_timeout(Some(Duration::from_secs(120)))
            .map_err(|e| e.to_string())?;
        write!(
            tcp,
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .map_err(|e| e.to_string())?;
        Ok(tcp)
    };
    let mut created = String::new();
    post("/v1/sessions", "application/json", "{}")?
        .read_to_string(&mut created)
        .map_err(|e| e.to_string())?;
    let body = created.split("\r\n\r\n").nth(1).unwrap_or("");
    // The body may be chunked: find the JSON object in it.
    let json = &body[body.find('{').unwrap_or(0)..body.rfind('}').map_or(0, |i| i + 1)];
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let id = v["id"].as_str().ok_or("no session id")?.to_string();
    let warm = serde_json::json!({"code": "1"}).to_string();
    let mut sink = String::new();
    post(&format!("/v1/sessions/{id}/run"), "application/json", &warm)?
        .read_to_string(&mut sink)
        .map_err(|e| e.to_string())?;
    let run = serde_json::json!({ "code": ticker(n, 0.02) }).to_string();
    let tcp = post(&format!("/v1/sessions/{id}/run"), "text/event-stream", &run)?;
    let mut out = Vec::new();
    for line in BufReader::new(tcp).lines() {
        let line = line.map_err(|e| e.to_string())?;
        let at = now_s();
        if let Some(data) = line.strip_prefix("data: ") {
            let e: serde_json::Value = serde_json::from_str(data).map_err(|e| e.to_string())?;
            if e["kind"] == "stdout" {
                lags(e["text"].as_str().unwrap_or(""), at, &mut out);
            } else if e.get("outcome").is_some() {
                break; // the result
            }
        }
    }
    Ok(out)
}

/// Through `rvisor session --jsonl` (this binary) as a child.
fn jsonl_lags(n: usize) -> Result<Vec<f64>, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = std::process::Command::new(exe)
        .args(["session", "--jsonl"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    writeln!(stdin, r#"{{"id": 0, "op": "run", "code": "1"}}"#).map_err(|e| e.to_string())?;
    let req = serde_json::json!({"id": 1, "op": "run", "stream": true, "code": ticker(n, 0.02)});
    let mut out = Vec::new();
    let mut sent = false;
    for line in stdout.lines() {
        let line = line.map_err(|e| e.to_string())?;
        let at = now_s();
        let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| e.to_string())?;
        if v["id"] == 0 && !sent {
            writeln!(stdin, "{req}").map_err(|e| e.to_string())?;
            stdin.flush().map_err(|e| e.to_string())?;
            sent = true;
        } else if v["id"] == 1 {
            if v["event"]["kind"] == "stdout" {
                lags(v["event"]["text"].as_str().unwrap_or(""), at, &mut out);
            } else if v.get("result").is_some() {
                break;
            }
        }
    }
    drop(stdin);
    let _ = child.kill();
    let _ = child.wait();
    Ok(out)
}

/// `code` in `s`, plain and streamed (events read to the end), alternating,
/// `k` of each.
fn side_by_side(s: &Session, code: &str, k: usize) -> Result<(Vec<f64>, Vec<f64>), String> {
    let (mut plain, mut streamed) = (Vec::new(), Vec::new());
    for _ in 0..k {
        let t = Instant::now();
        let r = s.run(code).map_err(|e| e.to_string())?.wait();
        plain.push(ms(t.elapsed()));
        let t = Instant::now();
        let mut last = None;
        for e in s.run_streaming(code).map_err(|e| e.to_string())?.events() {
            if let EventKind::Result { result } = e.kind {
                last = Some(result);
            }
        }
        streamed.push(ms(t.elapsed()));
        if last.map(|l| l.console) != Some(r.console) {
            return Err("the streamed result differs from the plain one".into());
        }
    }
    Ok((plain, streamed))
}

/// The streaming rows of the report.
pub fn figures(session: &Session, quick: bool) -> Vec<Stats> {
    let mut rows = Vec::new();
    let n = if quick { 50 } else { 200 };
    let row = |id: &str, got: Result<Vec<f64>, String>, note: &str| match got {
        Ok(v) => summarise(id, "rvisor", v, Some(note.into())),
        Err(e) => summarise(id, "rvisor", Vec::new(), Some(format!("cannot: {e}"))),
    };
    rows.push(row(
        "stream_latency_http_sse",
        http_lags(n),
        "cat() in R to the line read by an SSE client over loopback (ms)",
    ));
    rows.push(row(
        "stream_latency_jsonl",
        jsonl_lags(n),
        "cat() in R to the event line read from session --jsonl (ms)",
    ));
    let k = if quick { 20 } else { 60 };
    for (id, code) in [("print_df", "print(dat)"), ("one_plus_one", "1+1")] {
        match side_by_side(session, code, k * if id == "one_plus_one" { 5 } else { 1 }) {
            Ok((plain, streamed)) => {
                rows.push(summarise(
                    &format!("{id}_not_streamed"),
                    "rvisor",
                    plain,
                    Some("Session::run, alternating with the streamed calls".into()),
                ));
                rows.push(summarise(
                    &format!("{id}_streamed"),
                    "rvisor",
                    streamed,
                    Some("Session::run_streaming, every event read".into()),
                ));
            }
            Err(e) => rows.push(summarise(
                id,
                "rvisor",
                Vec::new(),
                Some(format!("cannot: {e}")),
            )),
        }
    }
    rows
}
