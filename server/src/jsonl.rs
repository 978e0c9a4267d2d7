//! `rvisor session --jsonl`: persistent sessions over JSON lines.
//!
//! One request per input line, one response per output line, matched by
//! `id`. Named sessions, timeouts and errors are the [`Service`]'s, as on
//! every other surface; the sessions are made with the supervisor's
//! session defaults (`SupervisorConfig::defaults`). Requests are read while calls run, so `cancel` works mid-run;
//! responses of different sessions may interleave. A bad line gets an error
//! line and the loop goes on.

use crate::service::{Service, ServiceConfig, ServiceError, SessionRun, Surface, LOCAL_TENANT};
use crate::tables::TableConfig;
use rvisor::Supervisor;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

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
    /// Display options of a run (docs/output-and-plots.md, "Displays").
    #[serde(default)]
    display: Option<rvisor::DisplayOptions>,
    #[serde(default)]
    session: Option<String>,
    /// A run sends `{"id", "event"}` lines while it runs, before its
    /// result line.
    #[serde(default)]
    stream: bool,
    /// A file's path (`put_file`, `get_file`, `delete_file`).
    #[serde(default)]
    path: Option<String>,
    /// A file's bytes, base64 (`put_file`).
    #[serde(default)]
    content_base64: Option<String>,
    /// Entries of a `history` page (1 to 100, default 20).
    #[serde(default)]
    limit: Option<usize>,
    /// A `history` page's cursor: the `next` of the page before.
    #[serde(default)]
    before: Option<u64>,
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
/// `{"id", "event"}`, in that order.
fn event_line(id: &Value, e: &rvisor::CallEvent) -> Value {
    #[derive(Serialize)]
    struct Line<'a> {
        id: &'a Value,
        event: &'a rvisor::CallEvent,
    }
    match serde_json::to_string(&Line { id, event: e }) {
        Ok(s) => Value::String(s),
        Err(e) => error_line(id, "internal", &format!("failed to encode an event: {e}")),
    }
}

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
/// `output`; then waits for running calls and closes the sessions. Tables
/// that calls publish live in a private directory removed at the end (or,
/// if this process is killed, by the next supervisor's sweep).
pub fn serve<R: BufRead, W: Write + Send + 'static>(
    sup: &Supervisor,
    input: R,
    output: W,
) -> std::io::Result<()> {
    let scratch = sup.scratch_dir().map_err(|e| {
        std::io::Error::other(format!(
            "could not make the directory for published tables: {e}"
        ))
    })?;
    let dir = scratch.path().to_path_buf();
    let service = Service::new(
        sup.clone(),
        ServiceConfig {
            tables: TableConfig {
                dir: dir.clone(),
                ..TableConfig::default()
            },
            // One local harness drives as many named sessions as it needs;
            // each is one worker it asked for.
            max_sessions_per_tenant: usize::MAX,
            max_sessions: usize::MAX,
            admission: crate::admission::AdmissionConfig::default().uncapped_sessions(),
            ..ServiceConfig::default()
        },
    )?;
    let served = serve_with(&service, input, output);
    service.close_all();
    drop(service);
    drop(scratch);
    served
}

fn error_of(id: &Value, e: &ServiceError) -> Value {
    json!({"id": id, "error": e.to_json()})
}

/// Work that waits for a call's result and writes it.
type Job = Box<dyn FnOnce() + Send>;

/// The threads that wait for results while requests go on being read.
/// A session's plain calls are waited for by one thread of that session,
/// in order (a session runs its calls in order, so each result is written
/// as soon as it is ready): a thread started per call cost about as much
/// as a `1+1`. Streamed calls and checkpoints get a thread each.
#[derive(Default)]
struct Waiters {
    by_session: HashMap<String, mpsc::Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl Waiters {
    /// Runs `job` after the jobs already given for session `sid`.
    fn in_order(&mut self, sid: &str, job: Job) {
        let job = match self.by_session.get(sid) {
            Some(tx) => match tx.send(job) {
                Ok(()) => return,
                Err(mpsc::SendError(job)) => job,
            },
            None => job,
        };
        let (tx, rx) = mpsc::channel::<Job>();
        let _ = tx.send(job);
        self.by_session.insert(sid.to_string(), tx);
        self.threads.push(std::thread::spawn(move || {
            for job in rx {
                job();
            }
        }));
    }

    /// Runs `job` on a thread of its own.
    fn alone(&mut self, job: impl FnOnce() + Send + 'static) {
        self.threads.push(std::thread::spawn(job));
        self.threads.retain(|h| !h.is_finished());
    }

    /// Session `sid` takes no more calls: its thread ends after the
    /// results it waits for.
    fn closed(&mut self, sid: &str) {
        self.by_session.remove(sid);
    }

    /// Waits until every result has been written.
    fn finish(mut self) {
        self.by_session.clear();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

fn serve_with<R: BufRead, W: Write + Send + 'static>(
    service: &Service,
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
    let tenant = LOCAL_TENANT;
    let mut waiters = Waiters::default();
    for line in input.split(b'\n') {
        let line = line?;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        service.count_request(Surface::Jsonl);
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
        if !matches!(
            req.op.as_str(),
            "run"
                | "status"
                | "cancel"
                | "reset"
                | "close"
                | "checkpoint"
                | "restore"
                | "hibernate"
                | "files"
                | "put_file"
                | "get_file"
                | "delete_file"
                | "history"
        ) {
            emit(&error_line(
                &req.id,
                "bad_request",
                &format!(
                    "unknown op {:?}; use run, status, cancel, reset, close, checkpoint, restore, hibernate, files, put_file, get_file, delete_file or history",
                    req.op
                ),
            ));
            continue;
        }
        let name = req.session.clone().unwrap_or_else(|| "main".into());
        let create = matches!(req.op.as_str(), "run" | "status" | "files" | "put_file");
        let sid = match service.named_session(tenant, &name, create) {
            Ok(Some(sid)) => sid,
            Ok(None) => {
                emit(&error_line(
                    &req.id,
                    "unknown_session",
                    &format!("no session named {name:?}; a run creates it"),
                ));
                continue;
            }
            Err(e) => {
                emit(&error_of(&req.id, &e));
                continue;
            }
        };
        if let Some(line) = file_op(service, tenant, &sid, &req) {
            emit(&line);
            continue;
        }
        if req.op == "history" {
            // As of now: calls still queued are entered when they end.
            emit(
                &match service.history(tenant, &sid, req.limit, req.before) {
                    Ok(page) => json!({"id": req.id, "history": page}),
                    Err(e) => error_of(&req.id, &e),
                },
            );
            continue;
        }
        let answer = match req.op.as_str() {
            "run" => {
                let Some(code) = req.code else {
                    emit(&error_line(
                        &req.id,
                        "bad_request",
                        "a run request needs \"code\"",
                    ));
                    continue;
                };
                let run = SessionRun {
                    code,
                    timeout_seconds: req.timeout_seconds,
                    plot_width: req.plot_width,
                    plot_height: req.plot_height,
                    display: req.display,
                };
                let queued = if req.stream {
                    service.session_run_streaming(tenant, &sid, &run)
                } else {
                    service.session_run(tenant, &sid, &run)
                };
                match queued {
                    Ok(call) => {
                        let emit = emit.clone();
                        let id = req.id.clone();
                        let stream = req.stream;
                        if !stream {
                            waiters.in_order(
                                &sid,
                                Box::new(move || emit(&result_line(&id, &call.wait()))),
                            );
                            continue;
                        }
                        waiters.alone(move || {
                            let mut events = call.events();
                            while let Some(e) = events.next_blocking() {
                                match &e.kind {
                                    rvisor::EventKind::Result { result } => {
                                        emit(&result_line(&id, result))
                                    }
                                    _ => emit(&event_line(&id, &e)),
                                }
                            }
                        });
                        continue;
                    }
                    Err(e) => Err(e),
                }
            }
            "checkpoint" => {
                // Taken after the running call: answered from a thread so
                // that requests (a cancel) are still read meanwhile.
                let (emit, service) = (emit.clone(), service.clone());
                let (id, tenant, sid) = (req.id.clone(), tenant.to_string(), sid.clone());
                waiters.alone(move || match service.checkpoint(&tenant, &sid) {
                    Ok(info) => emit(&json!({"id": id, "checkpoint": info})),
                    Err(e) => emit(&error_of(&id, &e)),
                });
                continue;
            }
            "restore" => service.restore(tenant, &sid),
            "hibernate" => service.hibernate(tenant, &sid),
            "status" => service.session_status(tenant, &sid),
            "cancel" => service.cancel(tenant, &sid),
            "reset" => service.reset(tenant, &sid),
            _ => {
                waiters.closed(&sid);
                service.close(tenant, &sid)
            }
        };
        match answer {
            Ok(status) => emit(&status_line(&req.id, &status)),
            Err(e) => emit(&error_of(&req.id, &e)),
        }
    }
    waiters.finish();
    Ok(())
}

/// The file ops of a session (small files inline as base64; docs/files.md):
/// `files` -> `{"id", "files"}`, `put_file` and `get_file` -> `{"id",
/// "file"}`, `delete_file` -> `{"id", "deleted"}`. `None`: not a file op.
fn file_op(service: &Service, tenant: &str, sid: &str, req: &Request) -> Option<Value> {
    let id = &req.id;
    let path = || {
        req.path.as_deref().ok_or_else(|| {
            crate::service::ServiceError::bad_request(format!("{} needs \"path\"", req.op))
        })
    };
    let answer = match req.op.as_str() {
        "files" => service
            .session_files(tenant, sid)
            .map(|f| json!({"id": id, "files": f})),
        "put_file" => path().and_then(|p| {
            let content = req.content_base64.as_deref().unwrap_or("");
            service
                .put_file_inline(tenant, sid, p, content)
                .map(|f| json!({"id": id, "file": f}))
        }),
        "get_file" => path().and_then(|p| {
            service
                .get_file_inline(tenant, sid, p)
                .map(|f| json!({"id": id, "file": f}))
        }),
        "delete_file" => path().and_then(|p| {
            service
                .delete_session_file(tenant, sid, p)
                .map(|()| json!({"id": id, "deleted": p}))
        }),
        _ => return None,
    };
    Some(answer.unwrap_or_else(|e| error_of(id, &e)))
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
        serve(&sup, input.as_bytes(), sink.clone()).unwrap();
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
