//! `execute_request`: one cell, one call of the kernel's session, its
//! events sent on iopub as they arrive (busy, execute_input, stream,
//! display_data, error, idle), then `execute_reply`.

use crate::displays::{Display, Outputs};
use crate::wire::Message;
use crate::Shell;
use rvisor::{EventKind, Outcome, RunResult, Segment};
use rvisor_server::service::SessionRun;
use serde_json::{json, Value};

/// What an execute asked for, from its content.
#[derive(Debug)]
struct Request {
    code: String,
    silent: bool,
    store_history: bool,
    /// The front end answers `input_request`s.
    allow_stdin: bool,
}

impl Request {
    fn of(content: &Value) -> Self {
        let silent = content["silent"].as_bool().unwrap_or(false);
        Self {
            code: content["code"].as_str().unwrap_or("").to_string(),
            silent,
            // A silent execute is never stored (the protocol's rule).
            store_history: !silent && content["store_history"].as_bool().unwrap_or(true),
            // Missing: false, as ipykernel reads it.
            allow_stdin: content["allow_stdin"].as_bool().unwrap_or(false),
        }
    }
}

/// How an execute ended, for the shell loop.
#[derive(Debug)]
pub(crate) enum Ended {
    Ok,
    /// It failed and asked (`stop_on_error`, the default) that the execute
    /// requests queued behind it be aborted: these are the requests that
    /// had arrived before its reply was sent (taken then, so that a request
    /// sent after the reply is never aborted, however late this thread
    /// runs).
    ErrorStop(Vec<Message>),
    Error,
}

/// Runs the cell of `msg`; sends its iopub messages and its reply.
pub(crate) fn execute(k: &mut Shell, msg: &Message) -> Ended {
    let req = Request::of(&msg.content);
    let stop_on_error = msg.content["stop_on_error"].as_bool().unwrap_or(true);
    let io = k.iopub.clone();
    *crate::lock(&k.cell) = crate::Cell {
        active: true,
        ..Default::default()
    };
    io.status(msg, "busy");
    if req.store_history {
        k.execution_count += 1;
        k.history.push(k.execution_count, &req.code);
    }
    let count = k.execution_count;
    if !req.silent {
        io.send(
            msg,
            "execute_input",
            json!({"code": req.code, "execution_count": count}),
        );
    }
    let (content, failed) = if req.code.trim().is_empty() {
        // Nothing to run (R's service refuses blank code): an empty cell
        // succeeds, as at R's prompt.
        (json!({"status": "ok"}), false)
    } else {
        k.input.begin_cell(msg, req.allow_stdin);
        let ran = run(k, msg, &req, count);
        k.input.end_cell();
        match ran {
            Ok(None) => (json!({"status": "ok"}), false),
            Ok(Some(error)) => (error, true),
            Err(e) => {
                let error = json!({
                    "status": "error",
                    "ename": format!("rvisor.{}", e.code.as_str()),
                    "evalue": e.message,
                    "traceback": [format!("rvisor: {}", e.message)],
                });
                if !req.silent {
                    io.send(msg, "error", error_broadcast(&error));
                }
                (error, true)
            }
        }
    };
    let mut reply = content;
    reply["execution_count"] = json!(count);
    if reply["status"] == "ok" {
        reply["user_expressions"] = json!({});
        reply["payload"] = json!([]);
    }
    *crate::lock(&k.cell) = crate::Cell::default();
    let ended = match (failed, stop_on_error) {
        (false, _) => Ended::Ok,
        (true, true) => Ended::ErrorStop(crate::waiting(k)),
        (true, false) => Ended::Error,
    };
    io.status(msg, "idle");
    k.reply(msg, "execute_reply", reply);
    ended
}

fn error_broadcast(reply: &Value) -> Value {
    json!({
        "ename": reply["ename"],
        "evalue": reply["evalue"],
        "traceback": reply["traceback"],
    })
}

/// Runs the code, following its events; `Ok(Some(error content))` when
/// the call did not succeed.
fn run(
    k: &mut Shell,
    msg: &Message,
    req: &Request,
    count: u64,
) -> Result<Option<Value>, rvisor_server::service::ServiceError> {
    let io = k.iopub.clone();
    let call = SessionRun {
        code: req.code.clone(),
        timeout_seconds: None,
        plot_width: None,
        plot_height: None,
        display: None,
    };
    let pending = k
        .service
        .session_run_streaming(&k.tenant, &k.session_id, &call)?;
    {
        let mut c = crate::lock(&k.cell);
        let token = pending.cancel_token();
        if c.interrupted {
            token.cancel();
        }
        c.cancel = Some(token);
    }
    let mut events = pending.events();
    let mut result = None;
    let mut outputs = Outputs::default();
    let send = |d: Display| io.send(msg, d.msg_type(), d.content());
    while let Some(e) = events.next_blocking() {
        if req.silent && !matches!(e.kind, EventKind::Result { .. }) {
            continue;
        }
        let text = match e.kind {
            EventKind::Stdout { text } => Some(("stdout", text)),
            EventKind::Stderr { text } | EventKind::Message { text } => Some(("stderr", text)),
            EventKind::Warning { message, call } => {
                let seg = Segment::Warning { message, call };
                Some(("stderr", seg.console_text().unwrap_or_default()))
            }
            EventKind::Lagged { message, .. } => Some(("stderr", format!("rvisor: {message}\n"))),
            // Each display as it is made, in order with the text.
            EventKind::Display { index, display } => {
                outputs
                    .display(index, display.as_deref())
                    .into_iter()
                    .for_each(send);
                None
            }
            EventKind::Result { result: r } => {
                result = Some(*r);
                break;
            }
            // The error comes with the result (as `error`); a plot's PNG
            // is in the result too (and its display comes as a display).
            _ => None,
        };
        if let Some((name, text)) = text {
            outputs.release().into_iter().for_each(send);
            io.stream(msg, name, &text);
        }
    }
    let Some(r) = result else {
        return Ok(Some(json!({
            "status": "error",
            "ename": "rvisor.internal",
            "evalue": "the call ended without a result",
            "traceback": ["rvisor: the call ended without a result; run the cell again"],
        })));
    };
    if !req.silent {
        for notice in session_notices(&r) {
            io.stream(msg, "stderr", &notice);
        }
        // The last visible value is the cell's result (the session shows
        // values as displays: display option `values`); every other
        // display, plots and earlier values, is display_data, sent as it
        // came unless it could not be streamed. The result comes last, as
        // in every kernel (a plot made before the value is shown above
        // it).
        let (now, result) = outputs.finish(&r);
        now.into_iter().for_each(send);
        if let Some(d) = result {
            io.send(msg, "execute_result", d.result_content(count));
        }
    }
    let error = error_content(&r);
    if let (Some(e), false) = (&error, req.silent) {
        io.send(msg, "error", error_broadcast(e));
    }
    Ok(error)
}

/// What a person must know about the session behind this result: it is
/// new (earlier variables are gone), restored from a checkpoint, or it
/// ended (the next cell starts a new one).
pub(crate) fn session_notices(r: &RunResult) -> Vec<String> {
    let mut out = Vec::new();
    let s = &r.session;
    if let Some(rest) = &s.restored {
        out.push(format!(
            "rvisor: the R session was restored from its checkpoint of {} ({}); \
             variables made since then are gone\n",
            rest.checkpoint_at, rest.reason
        ));
    } else if s.fresh && s.reset_reason.is_some() {
        out.push(format!(
            "rvisor: this cell ran in a fresh R session (the previous one ended: {}); \
             variables from earlier cells are gone, run them again\n",
            s.reset_reason.as_deref().unwrap_or("reset")
        ));
    }
    if matches!(r.outcome, Outcome::WorkerExited | Outcome::WorkerFailed) {
        out.push(format!(
            "rvisor: the R session ended during this cell ({}); the next cell starts \
             in a fresh session\n",
            r.outcome
        ));
    }
    if r.truncated {
        out.push(format!(
            "rvisor: output was cut at the output cap ({}); print less, or write it to a file\n",
            if r.truncated_fields.is_empty() {
                "console".to_string()
            } else {
                r.truncated_fields.join(", ")
            }
        ));
    }
    out
}

/// The `execute_reply` content of a result that did not succeed, `None`
/// for one that did.
pub(crate) fn error_content(r: &RunResult) -> Option<Value> {
    if r.success {
        return None;
    }
    let ename = match r.outcome {
        Outcome::Error => "RError",
        Outcome::ParseError => "ParseError",
        Outcome::Interrupted | Outcome::Cancelled => "Interrupted",
        Outcome::TimedOut => "TimedOut",
        other => other.as_str(),
    };
    let info = r.error.clone().unwrap_or_default();
    let evalue = if info.message.is_empty() {
        match r.outcome {
            Outcome::Interrupted | Outcome::Cancelled => {
                "the cell was interrupted; the session keeps its state".to_string()
            }
            o => format!("the cell ended: {o}"),
        }
    } else {
        info.message.clone()
    };
    let mut traceback = vec![match &info.call {
        Some(call) => format!("Error in {call} : {evalue}"),
        None => format!("Error: {evalue}"),
    }];
    if !info.traceback.is_empty() {
        traceback.push("Traceback (innermost first):".to_string());
        for (i, f) in info.traceback.iter().enumerate() {
            traceback.push(format!("{}. {f}", i + 1));
        }
    }
    Some(json!({
        "status": "error",
        "ename": ename,
        "evalue": evalue,
        "traceback": traceback,
    }))
}
