//! `rvisor session --jsonl`: persistent sessions over JSON lines.
//!
//! One request per input line, one response per output line, matched by
//! `id`. Requests are read while calls run, so `cancel` works mid-run;
//! responses of different sessions may interleave. A bad line gets an error
//! line and the loop goes on.

use rvisor::{RunOptions, Session, SessionOptions, Supervisor};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Request {
    #[serde(default)]
    id: Value,
    op: String,
    #[serde(default)]
    code: Option<String>,
    #[serde(default)]
    timeout_seconds: Option<f64>,
    #[serde(default)]
    plot_width: Option<u32>,
    #[serde(default)]
    plot_height: Option<u32>,
    #[serde(default)]
    session: Option<String>,
}

/// Largest accepted request line (the code limit plus room for JSON).
const MAX_LINE_BYTES: usize = rvisor::MAX_CODE_BYTES * 2 + 64 * 1024;

/// One response line; fields keep the order of the contract.
#[derive(Debug, Serialize)]
struct Response<'a> {
    id: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    result: Option<&'a rvisor::RunResult>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<&'a rvisor::SessionStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<Value>,
}

fn error_line(id: &Value, code: &str, message: &str) -> Value {
    json!({"id": id, "error": {"code": code, "message": message}})
}

fn result_line(id: &Value, r: &rvisor::RunResult) -> Value {
    to_line(&Response {
        id,
        result: Some(r),
        status: None,
        error: None,
    })
}

fn status_line(id: &Value, s: &rvisor::SessionStatus) -> Value {
    to_line(&Response {
        id,
        result: None,
        status: Some(s),
        error: None,
    })
}

/// Serialises through a raw string so field order is kept.
fn to_line(r: &Response<'_>) -> Value {
    match serde_json::to_string(r)
        .and_then(|s| serde_json::from_str::<Box<serde_json::value::RawValue>>(&s))
    {
        Ok(raw) => Value::String(raw.get().to_string()),
        Err(e) => error_line(
            r.id,
            "internal",
            &format!("failed to encode the response: {e}"),
        ),
    }
}

/// Serves requests from `input` until it ends, writing responses to
/// `output`; then waits for running calls and closes the sessions.
pub fn serve<R: BufRead, W: Write + Send + 'static>(
    sup: &Supervisor,
    opts: SessionOptions,
    input: R,
    output: W,
) -> std::io::Result<()> {
    let out = Arc::new(Mutex::new(output));
    let emit = {
        let out = out.clone();
        move |v: &Value| {
            let mut o = out.lock().unwrap_or_else(|e| e.into_inner());
            // Pre-serialised lines travel as strings (to keep field order).
            match v {
                Value::String(line) => {
                    let _ = o.write_all(line.as_bytes());
                }
                other => {
                    let _ = serde_json::to_writer(&mut *o, other);
                }
            }
            let _ = o.write_all(b"\n");
            let _ = o.flush();
        }
    };
    let mut sessions: HashMap<String, Session> = HashMap::new();
    let mut waiters = Vec::new();
    for line in input.split(b'\n') {
        let line = line?;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if line.len() > MAX_LINE_BYTES {
            emit(&error_line(
                &Value::Null,
                "too_large",
                &format!(
                    "request line of {} bytes is over the limit of {MAX_LINE_BYTES} bytes",
                    line.len()
                ),
            ));
            continue;
        }
        let req: Request = match serde_json::from_slice(&line) {
            Ok(r) => r,
            Err(e) => {
                // Echo the id if the line is JSON with one.
                let id = serde_json::from_slice::<Value>(&line)
                    .ok()
                    .and_then(|v| v.get("id").cloned())
                    .unwrap_or(Value::Null);
                emit(&error_line(&id, "bad_request", &format!("invalid request: {e}; expected e.g. {{\"id\": 1, \"op\": \"run\", \"code\": \"1+1\"}}")));
                continue;
            }
        };
        let name = req.session.clone().unwrap_or_else(|| "main".into());
        let session = match sessions.get(&name) {
            Some(s) => s.clone(),
            None if req.op == "run" || req.op == "status" => match sup.session_with(opts.clone()) {
                Ok(s) => {
                    sessions.insert(name.clone(), s.clone());
                    s
                }
                Err(e) => {
                    emit(&error_line(&req.id, "session_failed", &e.to_string()));
                    continue;
                }
            },
            None => {
                emit(&error_line(
                    &req.id,
                    "unknown_session",
                    &format!("no session named {name:?}; a run creates it"),
                ));
                continue;
            }
        };
        match req.op.as_str() {
            "run" => {
                let Some(code) = req.code else {
                    emit(&error_line(
                        &req.id,
                        "bad_request",
                        "a run request needs \"code\"",
                    ));
                    continue;
                };
                let timeout = match req.timeout_seconds {
                    None => None,
                    Some(t) if t > 0.0 && t.is_finite() && t <= 86_400.0 => {
                        Some(Duration::from_secs_f64(t))
                    }
                    Some(t) => {
                        emit(&error_line(
                            &req.id,
                            "invalid",
                            &format!("timeout_seconds {t} must be > 0 and at most 86400"),
                        ));
                        continue;
                    }
                };
                let over = RunOptions {
                    timeout,
                    plot_width: req.plot_width,
                    plot_height: req.plot_height,
                };
                match session.run_with(&code, &over) {
                    Ok(handle) => {
                        let emit = emit.clone();
                        let id = req.id.clone();
                        waiters.push(std::thread::spawn(move || {
                            let r = handle.wait();
                            emit(&result_line(&id, &r));
                        }));
                    }
                    Err(e) => emit(&error_line(&req.id, e.code(), &e.to_string())),
                }
            }
            "status" => emit(&status_line(&req.id, &session.status())),
            "cancel" => {
                session.cancel();
                emit(&status_line(&req.id, &session.status()));
            }
            "reset" => {
                session.reset();
                emit(&status_line(&req.id, &session.status()));
            }
            "close" => {
                session.close();
                sessions.remove(&name);
                emit(&status_line(&req.id, &session.status()));
            }
            other => emit(&error_line(
                &req.id,
                "bad_request",
                &format!("unknown op {other:?}; use run, status, cancel, reset or close"),
            )),
        }
        waiters.retain(|h: &std::thread::JoinHandle<()>| !h.is_finished());
    }
    for h in waiters {
        let _ = h.join();
    }
    for s in sessions.values() {
        s.close();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A Write that keeps what it gets, for reading the responses back.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A small deterministic generator (no dependency, reproducible).
    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    #[test]
    fn malformed_lines_get_one_error_line_each_and_never_panic() {
        let sup = Supervisor::new(rvisor::SupervisorConfig {
            pool: rvisor::PoolConfig {
                zygote: false,
                ..Default::default()
            },
            confinement: rvisor::Confinement::unconfined(),
            ..Default::default()
        })
        .expect("a supervisor (build the workspace first: the worker binary must exist)");
        let pieces = [
            "{",
            "}",
            "[",
            "]",
            "\"id\"",
            ":",
            ",",
            "\"op\"",
            "\"run\"",
            "\"status\"",
            "\"cancel\"",
            "\"close\"",
            "\"code\"",
            "null",
            "1e999",
            "-1",
            "\"session\"",
            "\"\\u0000\"",
            "true",
            "\"timeout_seconds\"",
            "0",
            "\"plot_width\"",
            "99999",
            "\"x\"",
            "{\"id\":",
            "\u{fffd}",
        ];
        let mut seed = 42u64;
        let mut input = String::new();
        let mut expected = 0;
        for _ in 0..300 {
            let n = 1 + lcg(&mut seed) % 12;
            let mut line = String::new();
            for _ in 0..n {
                line.push_str(pieces[(lcg(&mut seed) as usize) % pieces.len()]);
            }
            // Lines that could be valid requests (and start R) are skipped:
            // this test is about decoding.
            if line.contains("\"op\"") && serde_json::from_str::<Value>(&line).is_ok() {
                continue;
            }
            if line.trim().is_empty() {
                continue;
            }
            input.push_str(&line.replace('\n', " "));
            input.push('\n');
            expected += 1;
        }
        let sink = Sink::default();
        serve(
            &sup,
            rvisor::SessionOptions::default(),
            input.as_bytes(),
            sink.clone(),
        )
        .unwrap();
        assert!(
            expected > 100,
            "the generator made too few lines: {expected}"
        );
        let out = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), expected, "one response per request line");
        for l in lines {
            let v: Value = serde_json::from_str(l).expect("every response is JSON");
            assert!(v["error"]["code"].is_string(), "{l}");
            assert!(v["error"]["message"].is_string(), "{l}");
        }
        sup.shutdown();
    }
}
