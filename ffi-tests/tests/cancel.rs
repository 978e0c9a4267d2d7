//! A cancel at every step of a call's life, against real R (issue 24: "a
//! cancel that never resolves"): queued, waiting for its worker, sent but
//! not begun, binding, parsing, evaluating (in `Sys.sleep` and in a busy
//! loop), in code that ignores interrupts, and as the result is sent. Every
//! call resolves, with the outcome its step gives, and the session goes on:
//! with its state when R answered the interrupt, in a fresh generation
//! (`reset_reason` "cancel") when its worker was killed.
//!
//! The steps inside the worker are hit exactly through its test-only pause
//! points (`embedded-worker/src/pause.rs`, debug builds only): a call whose
//! code starts with `#rvisor-test-pause:STEP` stops there, says so with an
//! event, and waits for a SIGINT, which the cancel sends. Sessions first run
//! a `Sys.sleep`, since R's `select()` wrapper then puts the worker's SIGINT
//! handler back without its siginfo (the tag of the next interrupt). A
//! `None` from a bounded wait is the failure: it is a hang detector, never a
//! timing assertion.

use rvisor::{
    CallContext, CallHandle, CallOptions, CancelToken, EventKind, EventSink, Outcome, RunResult,
    Session, SessionOptions, StreamMode, Supervisor, SupervisorConfig, WorkerConfig,
};
use rvisor_ffi_tests::rvisor_bin;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long anything may take before the test calls it a hang.
const DEADLINE: Duration = Duration::from_secs(60);

/// The variable that turns the worker's pause points on.
const PAUSE_VAR: &str = "RVISOR_TEST_PAUSE";

/// A confined supervisor whose workers (spares included) get [`PAUSE_VAR`].
fn supervisor() -> Supervisor {
    // One test per process (nextest): the variable is this test's alone.
    std::env::set_var(PAUSE_VAR, "1");
    Supervisor::new(SupervisorConfig {
        worker: WorkerConfig {
            env: vec![PAUSE_VAR.into()],
            ..WorkerConfig::default()
        },
        ..SupervisorConfig::default()
    })
    .expect("supervisor starts")
}

/// A session with state to keep, whose worker has run a `Sys.sleep` (so
/// R's select wrapper has swapped the SIGINT handler out and back once).
fn session(sup: &Supervisor, opts: SessionOptions) -> Session {
    let s = sup.session_with(opts).expect("session is created");
    let r = resolved(&s.run("kept <- 'yes'; Sys.sleep(0.01)").unwrap());
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    s
}

fn resolved(h: &CallHandle) -> RunResult {
    h.wait_timeout(DEADLINE)
        .unwrap_or_else(|| panic!("call {} never resolved", h.execution_id()))
}

/// Queues `code` as a streaming call and waits until it prints `text`
/// (a pause point's notice, or R's own output): the call is at that step.
fn run_until(s: &Session, code: &str, text: &str) -> CallHandle {
    let h = s.run_streaming(code).expect("call accepted");
    let (tx, rx) = mpsc::channel();
    let mut events = h.events();
    let want = text.to_string();
    std::thread::spawn(move || {
        for e in events.by_ref() {
            let hit = e.kind.console_text().is_some_and(|t| t.contains(&want));
            if hit || matches!(e.kind, EventKind::Result { .. }) {
                let _ = tx.send(hit);
                return;
            }
        }
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(true) => h,
        Ok(false) => panic!(
            "the call ended before it printed {text:?}: {:?}",
            h.try_result()
        ),
        Err(_) => panic!("the call never printed {text:?}"),
    }
}

fn pause_notice(step: &str) -> String {
    format!("rvisor-test-pause: {step}")
}

/// The session kept its worker and its state.
fn assert_kept(s: &Session, what: &str) {
    let r = resolved(&s.run("kept").unwrap());
    assert_eq!(r.console, "[1] \"yes\"\n", "{what}: {}", r.console);
    assert_eq!(r.session.generation, 1, "{what}: the same worker");
    assert!(s.status().last_reset.is_none(), "{what}");
}

fn assert_cancelled_and_kept(r: &RunResult, what: &str) {
    assert_eq!(r.outcome, Outcome::Cancelled, "{what}: {}", r.console);
    let msg = r.error.as_ref().map(|e| e.message.as_str()).unwrap_or("");
    assert!(
        msg.contains("variables are kept"),
        "{what}: R answered: {msg}"
    );
}

#[test]
fn a_cancel_at_each_step_inside_the_worker_interrupts_the_call_and_keeps_the_state() {
    let sup = supervisor();
    let s = session(&sup, SessionOptions::default());
    for step in ["sent", "binding", "parsing"] {
        let h = run_until(
            &s,
            &format!("#rvisor-test-pause:{step}\nran <- TRUE; Sys.sleep(600)"),
            &pause_notice(step),
        );
        s.cancel();
        let r = resolved(&h);
        assert_cancelled_and_kept(&r, step);
        assert_kept(&s, step);
        // Nothing of the code ran: the interrupt came first.
        let r = resolved(&s.run("exists('ran')").unwrap());
        assert_eq!(r.console, "[1] FALSE\n", "{step}");
    }
}

#[test]
fn a_cancel_while_r_evaluates_interrupts_it_in_sys_sleep_and_in_a_busy_loop() {
    let sup = supervisor();
    let s = session(&sup, SessionOptions::default());
    for (what, code) in [
        (
            "in Sys.sleep",
            "cat('evaluating\\n'); flush.console(); Sys.sleep(600)",
        ),
        (
            "in a loop",
            "cat('evaluating\\n'); flush.console(); repeat {}",
        ),
        (
            "in a loop after a sleep",
            "Sys.sleep(0.01); cat('evaluating\\n'); flush.console(); repeat {}",
        ),
    ] {
        let h = run_until(&s, code, "evaluating");
        s.cancel();
        assert_cancelled_and_kept(&resolved(&h), what);
        assert_kept(&s, what);
    }
}

#[test]
fn a_cancel_as_the_result_is_sent_leaves_the_result_and_the_next_call_alone() {
    let sup = supervisor();
    let s = session(&sup, SessionOptions::default());
    let h = run_until(
        &s,
        "#rvisor-test-pause:result\nlate <- 'set'",
        &pause_notice("result"),
    );
    s.cancel();
    let r = resolved(&h);
    assert_eq!(
        r.outcome,
        Outcome::Complete,
        "R had finished: {}",
        r.console
    );
    // The late interrupt hits nothing: the next calls run whole.
    let r = resolved(&s.run("Sys.sleep(0.2); late").unwrap());
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.console, "[1] \"set\"\n");
    assert_kept(&s, "result");
}

#[test]
fn a_cancel_of_a_queued_call_resolves_it_at_once_and_the_running_one_after() {
    let sup = supervisor();
    let s = session(&sup, SessionOptions::default());
    let running = run_until(
        &s,
        "cat('evaluating\\n'); flush.console(); Sys.sleep(600)",
        "evaluating",
    );
    let one = s.run("'one'").unwrap();
    let two = s.run("'two'").unwrap();
    assert!(s.cancel_call(one.execution_id()));
    let r = one.try_result().expect("resolved by cancel_call itself");
    assert_eq!(r.outcome, Outcome::Cancelled);
    s.cancel();
    let r = two.try_result().expect("resolved by cancel itself");
    assert_eq!(r.outcome, Outcome::NotExecuted);
    assert_cancelled_and_kept(&resolved(&running), "the running call");
    assert_kept(&s, "queued");
}

#[test]
fn a_cancel_of_code_that_ignores_interrupts_kills_the_worker_and_the_session_goes_on() {
    let sup = supervisor();
    let s = session(
        &sup,
        SessionOptions {
            grace: Duration::from_millis(500),
            ..SessionOptions::default()
        },
    );
    // Interrupts are suspended before the line is printed: a cancel that
    // reaches the worker as soon as the line does (while flush.console()
    // still runs) must find them suspended already.
    let h = run_until(
        &s,
        "suspendInterrupts({cat('evaluating\\n'); flush.console(); repeat {}})",
        "evaluating",
    );
    s.cancel();
    let r = resolved(&h);
    assert_eq!(r.outcome, Outcome::Cancelled, "{}", r.console);
    let msg = r.error.map(|e| e.message).unwrap_or_default();
    assert!(msg.contains("worker was killed"), "{msg}");
    let next = resolved(&s.run("exists('kept')").unwrap());
    assert_eq!(next.outcome, Outcome::Complete, "{}", next.console);
    assert!(next.console.ends_with("[1] FALSE\n"), "{}", next.console);
    assert_eq!(next.session.generation, 2);
    assert_eq!(next.session.reset_reason.as_deref(), Some("cancel"));
}

#[test]
fn a_cancel_while_the_worker_starts_resolves_the_call() {
    // Where the cancel lands (the queue, the worker's start, the send) is
    // not fixed here (the supervisor's unit tests hold each window); what
    // is: the call resolves as not run, and the session goes on.
    let sup = supervisor();
    for round in 0..5 {
        let s = sup.session().expect("session is created");
        if round % 2 == 1 {
            // After a reset the next worker is starting too.
            assert_eq!(resolved(&s.run("1").unwrap()).outcome, Outcome::Complete);
            s.reset();
        }
        let h = s.run("Sys.sleep(600)").unwrap();
        s.cancel();
        let r = resolved(&h);
        assert!(
            matches!(r.outcome, Outcome::Cancelled | Outcome::NotExecuted),
            "round {round}: {:?} {}",
            r.outcome,
            r.console
        );
        let next = resolved(&s.run("'after'").unwrap());
        assert_eq!(
            next.outcome,
            Outcome::Complete,
            "round {round}: {}",
            next.console
        );
    }
}

#[test]
fn a_cancel_of_a_one_shot_run_while_it_binds_its_variables_stops_it() {
    let sup = supervisor();
    let (tx, rx) = mpsc::channel();
    let sink = EventSink::new(StreamMode::Full, move |e| {
        if let Some(t) = e.console_text() {
            let _ = tx.send(t.to_string());
        }
    });
    let token = CancelToken::new();
    let ctx = CallContext {
        variables: vec![("v".into(), json!([1, 2, 3]))],
        cancel: Some(token.clone()),
        ..CallContext::default()
    };
    let run = std::thread::spawn({
        let sup = sup.clone();
        move || {
            sup.run_once_streaming(
                rvisor::ids::execution_id(),
                "#rvisor-test-pause:binding\nSys.sleep(600)",
                &CallOptions::one_shot(Some(Duration::from_secs(120))),
                &ctx,
                None,
                None,
                &sink,
            )
        }
    });
    let notice = pause_notice("binding");
    loop {
        let t = rx
            .recv_timeout(DEADLINE)
            .expect("the run reached its binding");
        if t.contains(&notice) {
            break;
        }
    }
    token.cancel();
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(run.join());
    });
    let r = done_rx
        .recv_timeout(DEADLINE)
        .expect("the run resolves")
        .expect("the run's thread");
    assert_eq!(r.outcome, Outcome::Cancelled, "{}", r.console);
}

/// `rvisor session --jsonl` as issue 24 drove it: per fresh named session,
/// `x <- 1`, then a long `Sys.sleep` and a `cancel` `d` ms later, twice
/// (the second after R's select wrapper has had the SIGINT handler), for
/// `d` = 0, 10, ..., 190. Every call resolves, as cancelled (or not
/// executed, when the cancel found it still queued), and the session goes
/// on.
#[test]
fn jsonl_a_cancel_d_ms_after_a_run_always_resolves_it() {
    let mut child = Command::new(rvisor_bin())
        .args(["session", "--jsonl", "--timeout", "120"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("rvisor session --jsonl starts");
    let mut stdin = child.stdin.take().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    // Lines are read on a thread, so a missing answer is a timeout here.
    let (tx, rx) = mpsc::channel::<Value>();
    std::thread::spawn(move || {
        for line in stdout.lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str(&line) {
                if tx.send(v).is_err() {
                    return;
                }
            }
        }
    });
    let mut pending: Vec<Value> = Vec::new();
    let mut answer = |id: u64| -> Value {
        loop {
            if let Some(i) = pending.iter().position(|v| v["id"] == json!(id)) {
                return pending.remove(i);
            }
            match rx.recv_timeout(DEADLINE) {
                Ok(v) => pending.push(v),
                Err(_) => panic!("no answer to request {id}: the call never resolved"),
            }
        }
    };
    let mut send = |v: Value| {
        writeln!(stdin, "{v}").unwrap();
        stdin.flush().unwrap();
    };
    let mut id = 0u64;
    for d in (0..200).step_by(10) {
        let session = format!("s{d}");
        id += 1;
        send(json!({"id": id, "op": "run", "code": "x <- 1", "session": session}));
        assert_eq!(answer(id)["result"]["outcome"], "complete", "d = {d}");
        for round in 0..2 {
            let run = id + 1;
            id += 2;
            send(json!({"id": run, "op": "run", "code": "Sys.sleep(600)", "session": session}));
            std::thread::sleep(Duration::from_millis(d));
            send(json!({"id": id, "op": "cancel", "session": session}));
            assert!(
                answer(id).get("status").is_some(),
                "d = {d}: cancel answered"
            );
            let r = answer(run);
            let outcome = r["result"]["outcome"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            assert!(
                outcome == "cancelled" || outcome == "not_executed",
                "d = {d}, round {round}: {r}"
            );
            id += 1;
            send(json!({"id": id, "op": "run", "code": "x", "session": session}));
            let r = answer(id);
            assert_eq!(r["result"]["outcome"], "complete", "d = {d}: {r}");
            assert_eq!(
                r["result"]["console"], "[1] 1\n",
                "d = {d}, round {round}: R answered, the state is kept: {r}"
            );
        }
    }
    // The end of the input ends the CLI.
    drop(stdin);
    let status = child.wait().expect("the CLI ends");
    assert!(status.success(), "{status}");
}
