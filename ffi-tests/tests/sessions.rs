//! Persistent sessions end to end: the `rvisor` library's Supervisor and
//! Session against real R workers, plus the `rvisor session --jsonl` CLI.
//!
//! Workers are confined by the OS (the default): R code sees no host files,
//! so it cannot announce progress through marker files. Instead a session
//! tool ([`Gate`]) tells the test that a call has started, and R waits for
//! the test's release by polling another tool. (The JSONL CLI has no tools:
//! there R creates a marker in its private directory, which the test reads
//! through `/proc/<pid>/root`.) No test sleeps and hopes: every wait polls
//! or blocks with a generous deadline. Durations are only bounded from
//! above to prove that nothing hung.

use rvisor::{
    Confinement, EnvPolicy, Outcome, Rejection, RunOptions, RunResult, Session, SessionOptions,
    SessionState, Supervisor, SupervisorConfig, Tool,
};
use rvisor_ffi_tests::{inside, parent_pid, wait_for};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long anything may take before the test calls it a hang.
const DEADLINE: Duration = Duration::from_secs(30);

/// The notice a result carries when it is the first of a new worker.
const FRESH_NOTICE: &str = "rvisor: started a fresh R session";

// ---------------------------------------------------------------------------
// Helpers

/// A supervisor with the default configuration: workers confined.
fn supervisor() -> Supervisor {
    Supervisor::new(SupervisorConfig::default()).expect("supervisor starts")
}

/// A confined supervisor whose workers may also read `dirs` (at the same
/// paths, executable: a test `.so` can be `dyn.load`ed from there).
fn supervisor_reading(dirs: &[&Path]) -> Supervisor {
    Supervisor::new(SupervisorConfig {
        confinement: Confinement {
            read_only: dirs.iter().map(|d| d.to_path_buf()).collect(),
            ..Confinement::default()
        },
        ..SupervisorConfig::default()
    })
    .expect("supervisor starts")
}

/// A supervisor whose workers are explicitly not confined (for tests whose
/// subject needs what confinement forbids, e.g. R signalling itself).
fn unconfined_supervisor() -> Supervisor {
    Supervisor::new(SupervisorConfig {
        confinement: Confinement::unconfined(),
        ..SupervisorConfig::default()
    })
    .expect("supervisor starts")
}

fn session(sup: &Supervisor) -> Session {
    sup.session().expect("session is created")
}

fn session_with(sup: &Supervisor, opts: SessionOptions) -> Session {
    sup.session_with(opts).expect("session is created")
}

/// A unique, new directory that can be exposed read-only to confined
/// workers (in cargo's scratch space for integration tests). It has the
/// default mode: a confined worker runs as its own unprivileged uid, so it
/// can only enter directories everyone may read.
fn exposed_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("rvisor-test-{name}-{}", rvisor::ids::random_hex(6)));
    std::fs::create_dir_all(&d).expect("create a test dir");
    d
}

/// A path as an R string literal.
fn r_str(p: &Path) -> String {
    let s = p.display().to_string();
    assert!(
        !s.contains('\'') && !s.contains('\\'),
        "temp path {s} needs quoting"
    );
    format!("'{s}'")
}

/// Lets R code tell the test that a call has started, and lets the test
/// release it, through session tools (a confined worker sees no host file).
/// Tools: `started()` (counts, wakes the test), `released()` (whether the
/// test released the gate) and `release()` (releases it, for R code of
/// another session).
#[derive(Default)]
struct Gate {
    /// (calls of `started`, released)
    state: Mutex<(usize, bool)>,
    cv: Condvar,
}

/// R code that announces its start, then runs until it is interrupted,
/// cancelled or closed. An interrupt can reach R while it still waits for
/// the answer to `started()` (the test acts as soon as the handler runs);
/// that ends the call as an interrupt too.
const BLOCK: &str = "invisible(tools$started()); repeat Sys.sleep(0.05)";

/// R code that announces its start, then waits until the gate is released.
const HOLD: &str = "invisible(tools$started()); while (!tools$released()) Sys.sleep(0.01)";

impl Gate {
    fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn tools(self: &Arc<Self>) -> Vec<Tool> {
        let g = self.clone();
        let started = Tool::new("started", "the call has started", json!({}), move |_| {
            g.state.lock().unwrap().0 += 1;
            g.cv.notify_all();
            Ok(Value::Null)
        })
        .unwrap();
        let g = self.clone();
        let released = Tool::new("released", "whether to go on", json!({}), move |_| {
            Ok(json!(g.state.lock().unwrap().1))
        })
        .unwrap();
        let g = self.clone();
        let release = Tool::new(
            "release",
            "lets the held call go on",
            json!({}),
            move |_| {
                g.release();
                Ok(Value::Null)
            },
        )
        .unwrap();
        vec![started, released, release]
    }

    /// Session options with the gate's tools.
    fn options(self: &Arc<Self>) -> SessionOptions {
        SessionOptions {
            tools: self.tools(),
            ..SessionOptions::default()
        }
    }

    /// Waits until `started()` was called `n` times in all.
    fn wait_started(&self, n: usize) {
        let end = Instant::now() + DEADLINE;
        let mut st = self.state.lock().unwrap();
        while st.0 < n {
            let now = Instant::now();
            assert!(now < end, "timed out waiting for call {n} to start");
            st = self.cv.wait_timeout(st, end - now).unwrap().0;
        }
    }

    fn release(&self) {
        self.state.lock().unwrap().1 = true;
        self.cv.notify_all();
    }
}

/// Polls until `cond` holds; panics with `what` after [`DEADLINE`].
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs `code` and waits for its result (at most [`DEADLINE`]).
fn run(s: &Session, code: &str) -> RunResult {
    let h = s.run(code).expect("call accepted");
    h.wait_timeout(DEADLINE)
        .unwrap_or_else(|| panic!("no result within {DEADLINE:?} for {code:?}"))
}

/// Waits for a handle's result (at most [`DEADLINE`]).
fn wait(h: &rvisor::CallHandle) -> RunResult {
    h.wait_timeout(DEADLINE)
        .unwrap_or_else(|| panic!("no result within {DEADLINE:?} for {}", h.execution_id()))
}

/// Runs `code`, asserts it completed and returns its console.
fn console(s: &Session, code: &str) -> String {
    let r = run(s, code);
    assert_eq!(r.outcome, Outcome::Complete, "{code}: {}", r.console);
    r.console
}

/// Whether a process is gone (no /proc entry, or a zombie: it has ended
/// and only waits to be reaped by its parent).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the ")" that closes the command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.trim_start().starts_with('Z'))
            .unwrap_or(false),
    }
}

fn sigkill(pid: u32) {
    // SAFETY: kill(2) has no memory-safety preconditions; the pid is a
    // process this test started (directly or through the supervisor).
    let rc = unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill({pid})");
}

// ---------------------------------------------------------------------------
// 1. persistence

#[test]
fn variables_packages_and_options_persist_across_calls() {
    let sup = supervisor();
    let s = session(&sup);
    let r = run(
        &s,
        "x <- 41; library(tools); options(rvisor.test.opt = 'kept')",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(r.session.fresh, "first call runs on a fresh worker");
    assert_eq!(r.session.generation, 1);
    assert_eq!(r.session.id, s.id());
    assert_eq!(r.session.reset_reason, None);

    let r = run(
        &s,
        "x + 1\n'package:tools' %in% search()\nexists('file_path_sans_ext')\ngetOption('rvisor.test.opt')",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(
        r.console, "[1] 42\n[1] TRUE\n[1] TRUE\n[1] \"kept\"\n",
        "state of the first call is visible in the second"
    );
    assert!(!r.session.fresh);
    assert_eq!(r.session.generation, 1);
    assert!(!r.console.contains(FRESH_NOTICE));
}

// ---------------------------------------------------------------------------
// 2. ordering

/// R's protection stack has 50,000 slots. Each top-level expression once
/// left 2 on it, so one call of 30,000 expressions (or ~25,000 calls of
/// one) failed with "protection stack overflow", and so did every later
/// call of the session. (A debug worker, which the tests run, also stops
/// on any call that leaves a slot behind: eval.rs, `rebalance`.)
#[test]
fn a_long_session_does_not_wear_out_rs_protection_stack() {
    let sup = supervisor();
    let s = session(&sup);
    let code = format!("x <- 0\n{}x\n", "x<-x+1\n".repeat(30_000));
    let r = run(&s, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{:?}", r.error);
    assert!(r.console.contains("[1] 30000"), "{}", r.console);
    for _ in 0..3 {
        let r = run(&s, "x + 1");
        assert_eq!(r.outcome, Outcome::Complete, "{:?}", r.error);
        assert!(r.console.contains("[1] 30001"), "{}", r.console);
    }
}

#[test]
fn queued_calls_run_in_order_and_each_result_is_complete() {
    let sup = supervisor();
    let s = session(&sup);
    let handles: Vec<_> = (1..=6)
        .map(|i| {
            s.run(&format!(
                "if (!exists('v')) v <- integer(); v <- c(v, {i}L); cat(paste(v, collapse = ','))"
            ))
            .expect("call accepted")
        })
        .collect();
    let mut ids = std::collections::HashSet::new();
    for (i, h) in handles.iter().enumerate() {
        let r = wait(h);
        assert_eq!(
            r.outcome,
            Outcome::Complete,
            "call {}: {}",
            i + 1,
            r.console
        );
        let expected: Vec<String> = (1..=i + 1).map(|k| k.to_string()).collect();
        assert_eq!(
            r.console,
            expected.join(","),
            "call {} saw exactly the calls before it",
            i + 1
        );
        assert_eq!(r.execution_id, h.execution_id());
        assert!(
            ids.insert(r.execution_id.clone()),
            "execution ids are distinct"
        );
    }
    assert_eq!(ids.len(), 6);
    assert_eq!(console(&s, "v"), "[1] 1 2 3 4 5 6\n");
}

// ---------------------------------------------------------------------------
// 3. sessions run in parallel

#[test]
fn two_sessions_run_in_parallel() {
    let sup = supervisor();
    // One gate for both: A holds until B's code releases it.
    let gate = Gate::new();
    let a = session_with(&sup, gate.options());
    let b = session_with(&sup, gate.options());
    let ha = a
        .run_with(
            &format!("{HOLD}; 'A done'"),
            &RunOptions {
                timeout: Some(DEADLINE),
                ..RunOptions::default()
            },
        )
        .expect("call accepted");
    gate.wait_started(1);
    // A is now blocked until B's call releases it: B must not wait for A.
    let rb = run(&b, "invisible(tools$release()); 'B done'");
    assert_eq!(rb.outcome, Outcome::Complete, "{}", rb.console);
    assert_eq!(rb.console, "[1] \"B done\"\n");
    let ra = wait(&ha);
    assert_eq!(
        ra.outcome,
        Outcome::Complete,
        "A finished because B ran while A was blocked: {}",
        ra.console
    );
    assert_eq!(ra.console, "[1] \"A done\"\n");
    assert_ne!(ra.session.id, rb.session.id);
}

// ---------------------------------------------------------------------------
// 4. queue limit

#[test]
fn a_full_queue_rejects_at_once_and_accepted_calls_complete() {
    let sup = supervisor();
    let gate = Gate::new();
    let s = session_with(
        &sup,
        SessionOptions {
            queue_limit: 2,
            ..gate.options()
        },
    );
    let h1 = s
        .run(&format!("{HOLD}; 'one'"))
        .expect("first call accepted");
    gate.wait_started(1);
    let h2 = s.run("'two'").expect("second call queued");
    let h3 = s.run("'three'").expect("third call queued");
    assert_eq!(s.status().queued, 2);
    match s.run("'four'") {
        Err(Rejection::QueueFull(n)) => assert_eq!(n, 2),
        other => panic!("expected QueueFull, got {other:?}"),
    }
    let e = s.run("'four'").unwrap_err();
    assert_eq!(e.code(), "queue_full");
    assert!(e.to_string().contains("queue is full"), "{e}");
    // Nothing of the rejected calls was queued.
    assert_eq!(s.status().queued, 2);

    gate.release();
    for (h, want) in [(&h1, "one"), (&h2, "two"), (&h3, "three")] {
        let r = wait(h);
        assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
        assert_eq!(r.console, format!("[1] \"{want}\"\n"));
    }
    // The queue has room again.
    assert_eq!(console(&s, "'five'"), "[1] \"five\"\n");
}

// ---------------------------------------------------------------------------
// 5. rejections

#[test]
fn invalid_code_and_closed_sessions_are_rejected_at_once() {
    let sup = supervisor();
    let s = session(&sup);
    for empty in ["", "  \n\t "] {
        match s.run(empty) {
            Err(Rejection::Invalid(msg)) => {
                assert!(msg.contains("empty"), "helpful message: {msg}")
            }
            other => panic!("expected Invalid for {empty:?}, got {other:?}"),
        }
    }
    let big = format!("x <- '{}'", "a".repeat(256 * 1024));
    match s.run(&big) {
        Err(e @ Rejection::Invalid(_)) => {
            let msg = e.to_string();
            assert!(msg.contains("limit"), "helpful message: {msg}");
            assert!(msg.contains(&(256 * 1024).to_string()), "{msg}");
            assert_eq!(e.code(), "invalid");
        }
        other => panic!("expected Invalid for big code, got {other:?}"),
    }
    // Rejected calls never started a worker.
    assert_eq!(s.status().state, SessionState::New);
    assert_eq!(s.status().generation, 0);
    // The session still works.
    assert_eq!(console(&s, "1 + 1"), "[1] 2\n");

    s.close();
    match s.run("1") {
        Err(Rejection::Closed) => {}
        other => panic!("expected Closed, got {other:?}"),
    }
    assert_eq!(s.run("1").unwrap_err().code(), "closed");
}

// ---------------------------------------------------------------------------
// 6. timeout R answers

#[test]
fn a_timeout_r_answers_keeps_the_session() {
    let sup = supervisor();
    let s = session(&sup);
    assert_eq!(console(&s, "keep <- 'still here'"), "");
    let t0 = Instant::now();
    let h = s
        .run_with(
            "while (TRUE) {}",
            &RunOptions {
                timeout: Some(Duration::from_millis(500)),
                ..RunOptions::default()
            },
        )
        .unwrap();
    let r = wait(&h);
    assert!(t0.elapsed() < DEADLINE, "the timeout did not hang");
    assert_eq!(r.outcome, Outcome::TimedOut, "{}", r.console);
    assert!(!r.success);
    let err = r.error.as_ref().expect("error info");
    assert!(err.timed_out);
    assert!(err.message.contains("kept"), "{}", err.message);
    assert_eq!(r.session.generation, 1);

    let r = run(&s, "keep");
    assert_eq!(r.outcome, Outcome::Complete);
    assert_eq!(r.console, "[1] \"still here\"\n");
    assert!(!r.session.fresh);
    assert_eq!(r.session.generation, 1, "no new worker");
    assert_eq!(r.session.reset_reason, None);
    assert!(s.status().last_reset.is_none());
}

// ---------------------------------------------------------------------------
// 7. timeout on C code that ignores interrupts

/// Compiles `source` into `<name>.so` in a new directory with
/// `R CMD SHLIB`; returns the path of the shared library. Confined workers
/// can load it when its directory is exposed ([`supervisor_reading`]).
fn compile_c(name: &str, source: &str) -> PathBuf {
    let dir = exposed_dir(name);
    std::fs::write(dir.join(format!("{name}.c")), source).unwrap();
    let out = Command::new("R")
        .args(["CMD", "SHLIB", &format!("{name}.c")])
        .current_dir(&dir)
        .output()
        .expect("run R CMD SHLIB");
    assert!(
        out.status.success(),
        "R CMD SHLIB failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let so = dir.join(format!("{name}.so"));
    assert!(so.is_file(), "{} was built", so.display());
    so
}

/// A C function that spins forever without checking for interrupts.
fn compile_spin() -> PathBuf {
    compile_c(
        "spin",
        "void spin(int *n) { volatile unsigned long x = 0; for (;;) x++; }\n",
    )
}

#[test]
fn a_timeout_in_c_code_kills_the_worker_and_the_next_call_is_fresh() {
    let so = compile_spin();
    let sup = supervisor_reading(&[so.parent().unwrap()]);
    let s = session_with(
        &sup,
        SessionOptions {
            grace: Duration::from_millis(300),
            ..SessionOptions::default()
        },
    );
    let h = s
        .run_with(
            &format!("x <- 1; dyn.load({}); .C('spin', 0L)", r_str(&so)),
            &RunOptions {
                timeout: Some(Duration::from_millis(500)),
                ..RunOptions::default()
            },
        )
        .unwrap();
    // Queued behind the spinning call: dropped when its worker is killed.
    let queued = s.run("y <- 2").unwrap();
    let r = wait(&h);
    assert_eq!(r.outcome, Outcome::TimedOut, "{}", r.console);
    let err = r.error.as_ref().expect("error info");
    assert!(err.timed_out);
    assert!(err.message.contains("killed"), "{}", err.message);
    assert_eq!(r.session.generation, 1);

    let q = wait(&queued);
    assert_eq!(q.outcome, Outcome::NotExecuted, "{}", q.console);
    assert!(q.console.contains("not executed"), "{}", q.console);

    let r = run(&s, "exists('x')");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(r.session.fresh);
    assert_eq!(r.session.generation, 2);
    assert_eq!(r.session.reset_reason.as_deref(), Some("timeout"));
    assert!(
        r.console.starts_with(FRESH_NOTICE),
        "notice first: {}",
        r.console
    );
    assert!(r.console.ends_with("[1] FALSE\n"), "{}", r.console);
    let reset = s.status().last_reset.expect("a reset is recorded");
    assert_eq!(reset.reason, "timeout");
    assert!(reset.at.ends_with('Z'), "{}", reset.at);

    // The call after that is an ordinary one.
    let r = run(&s, "1");
    assert!(!r.session.fresh);
    assert_eq!(r.session.reset_reason, None);
    assert_eq!(r.console, "[1] 1\n");
    let _ = std::fs::remove_dir_all(so.parent().unwrap());
}

// ---------------------------------------------------------------------------
// 8. cancel

#[test]
fn cancel_stops_the_running_call_and_drops_the_queue() {
    let sup = supervisor();
    let gate = Gate::new();
    let s = session_with(&sup, gate.options());
    assert_eq!(console(&s, "before <- 'kept'"), "");
    let h1 = s
        .run_with(
            &format!("{BLOCK}; after <- TRUE"),
            &RunOptions {
                timeout: Some(Duration::from_secs(120)),
                ..RunOptions::default()
            },
        )
        .unwrap();
    gate.wait_started(1);
    let h2 = s.run("'two'").unwrap();
    let h3 = s.run("'three'").unwrap();
    s.cancel();

    let r1 = wait(&h1);
    assert_eq!(r1.outcome, Outcome::Cancelled, "{}", r1.console);
    assert!(!r1.success);
    for h in [&h2, &h3] {
        let r = wait(h);
        assert_eq!(r.outcome, Outcome::NotExecuted, "{}", r.console);
        assert_eq!(r.execution_id, h.execution_id());
    }

    // R answered the interrupt: same worker, same variables.
    let r = run(&s, "before; exists('after')");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.console, "[1] \"kept\"\n[1] FALSE\n");
    assert!(!r.session.fresh);
    assert_eq!(r.session.generation, 1);
    assert_eq!(r.session.reset_reason, None);
    assert!(s.status().last_reset.is_none());
}

#[test]
fn interrupt_stops_the_running_call_and_keeps_the_queue() {
    let sup = supervisor();
    let gate = Gate::new();
    let s = session_with(&sup, gate.options());
    let h1 = s.run(&format!("kept <- 1; {BLOCK}")).unwrap();
    gate.wait_started(1);
    let h2 = s.run("kept + 1").unwrap();
    s.interrupt();
    let r1 = wait(&h1);
    assert_eq!(r1.outcome, Outcome::Interrupted, "{}", r1.console);
    let r2 = wait(&h2);
    assert_eq!(
        r2.outcome,
        Outcome::Complete,
        "queued call still runs: {}",
        r2.console
    );
    assert_eq!(r2.console, "[1] 2\n");
    assert_eq!(r2.session.generation, 1);
}

/// An interrupt or a cancel that arrives while R waits for a tool's answer
/// ends the call as `interrupted` / `cancelled`, not as an R error (the
/// wait used to fail with "the tool call was interrupted", which the driver
/// raised as an error). Repeated: the interrupt lands at a different point
/// of the wait each time.
#[test]
fn an_interrupt_during_a_tool_call_is_an_interrupt_not_an_error() {
    let sup = supervisor();
    let gate = Gate::new();
    let mut opts = gate.options();
    let g = gate.clone();
    opts.tools.push(
        Tool::new(
            "slow",
            "announces itself, then takes a while",
            json!({}),
            move |_| {
                g.state.lock().unwrap().0 += 1;
                g.cv.notify_all();
                std::thread::sleep(Duration::from_millis(300));
                Ok(Value::Null)
            },
        )
        .unwrap(),
    );
    let s = session_with(&sup, opts);
    assert_eq!(console(&s, "kept <- 1"), "");
    for i in 1..=6 {
        let h = s.run("tools$slow(); repeat Sys.sleep(0.05)").unwrap();
        gate.wait_started(i);
        if i % 2 == 0 {
            s.cancel();
        } else {
            s.interrupt();
        }
        let r = wait(&h);
        let want = if i % 2 == 0 {
            Outcome::Cancelled
        } else {
            Outcome::Interrupted
        };
        assert_eq!(r.outcome, want, "round {i}: {}", r.console);
        // R answered: the worker was not killed (that would lose the state).
        assert!(!r.console.contains("killed"), "round {i}: {}", r.console);
        assert_eq!(r.session.generation, 1, "round {i}: state kept");
    }
    assert_eq!(console(&s, "kept"), "[1] 1\n");
}

#[test]
fn reset_starts_a_fresh_worker() {
    let sup = supervisor();
    let s = session(&sup);
    assert_eq!(console(&s, "x <- 1"), "");
    let old_pid = s.status().pid.unwrap();
    s.reset();
    wait_until("the reset to be recorded", || {
        s.status().last_reset.is_some()
    });
    assert_eq!(s.status().last_reset.unwrap().reason, "reset");
    let r = run(&s, "exists('x')");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(r.session.fresh);
    assert_eq!(r.session.generation, 2);
    assert_eq!(r.session.reset_reason.as_deref(), Some("reset"));
    assert!(r.console.starts_with(FRESH_NOTICE), "{}", r.console);
    assert!(r.console.ends_with("[1] FALSE\n"), "{}", r.console);
    assert_ne!(s.status().pid, Some(old_pid));
    wait_until("the old worker to end", || process_gone(old_pid));
}

// ---------------------------------------------------------------------------
// 9. crash

/// Sets a variable in `s`, then makes a call whose worker ends with
/// `signal` (`crash` makes it and returns its result), and checks the
/// failed result and the fresh next call.
fn check_crash(s: &Session, crash: impl FnOnce(&Session) -> RunResult, signal: &str, reason: &str) {
    assert_eq!(console(s, "x <- 1"), "");
    let r = crash(s);
    assert_eq!(r.outcome, Outcome::WorkerFailed, "{}", r.console);
    assert!(!r.success);
    let msg = &r.error.as_ref().expect("error info").message;
    assert!(msg.contains(signal), "names the signal ({signal}): {msg}");
    assert!(r.console.contains(signal), "{}", r.console);

    let r = run(s, "exists('x')");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(r.session.fresh);
    assert_eq!(r.session.generation, 2);
    assert_eq!(r.session.reset_reason.as_deref(), Some(reason));
    assert!(r.console.starts_with(FRESH_NOTICE), "{}", r.console);
    assert!(r.console.ends_with("[1] FALSE\n"), "{}", r.console);
    assert_eq!(s.status().last_reset.unwrap().reason, reason);
    assert_eq!(console(s, "1"), "[1] 1\n");
}

#[test]
fn a_segfault_mid_call_is_reported_and_the_next_call_is_fresh() {
    // A real invalid memory access. (`tools::pskill(Sys.getpid(), 11L)` is
    // not used: a SIGSEGV sent with kill(2) does not fault, and the Rust
    // runtime's SIGSEGV handler of the worker swallows the first one.)
    let so = compile_c(
        "crash",
        "void crash(int *n) { *(volatile int *) 0 = *n; }\n",
    );
    // The fault is the kernel's: it kills a confined worker too.
    let sup = supervisor_reading(&[so.parent().unwrap()]);
    let code = format!(
        "cat('before\\n'); dyn.load({}); .C('crash', 1L); cat('after\\n')",
        r_str(&so)
    );
    check_crash(
        &session(&sup),
        |s| run(s, &code),
        "signal 11 (SIGSEGV)",
        "crash",
    );
    let _ = std::fs::remove_dir_all(so.parent().unwrap());
}

#[test]
fn an_abort_signal_mid_call_is_a_crash() {
    // Unconfined on purpose: a confined worker is pid 1 of its own pid
    // namespace, so the kernel drops signals it sends itself, and a SIGABRT
    // from outside without a handler too. The subject is how the supervisor
    // reports a worker that died of SIGABRT.
    let sup = unconfined_supervisor();
    check_crash(
        &session(&sup),
        |s| run(s, "tools::pskill(Sys.getpid(), 6L); Sys.sleep(30)"),
        "signal 6 (SIGABRT)",
        "crash",
    );
}

#[test]
fn a_sigkill_mid_call_is_reported_as_killed() {
    // Unconfined on purpose: R code killing its own process (a confined
    // worker cannot signal itself; see the confined test below).
    let sup = unconfined_supervisor();
    check_crash(
        &session(&sup),
        |s| {
            run(
                s,
                "tools::pskill(Sys.getpid(), tools::SIGKILL); Sys.sleep(30)",
            )
        },
        "signal 9 (SIGKILL)",
        "killed",
    );
}

#[test]
fn a_confined_worker_sigkilled_mid_call_is_reported_as_killed() {
    // The confined equivalent: SIGKILL from outside (to the worker's host
    // pid) while the call runs.
    let sup = supervisor();
    let gate = Gate::new();
    check_crash(
        &session_with(&sup, gate.options()),
        |s| {
            let h = s.run(BLOCK).expect("call accepted");
            gate.wait_started(1);
            sigkill(s.status().pid.expect("a worker runs"));
            wait(&h)
        },
        "signal 9 (SIGKILL)",
        "killed",
    );
}

// ---------------------------------------------------------------------------
// 10. quit()

#[test]
fn quit_ends_the_worker_and_the_next_call_is_fresh() {
    let sup = supervisor();
    let s = session(&sup);
    let r = run(&s, "x <- 1; cat('bye\\n'); quit()");
    assert_eq!(r.outcome, Outcome::WorkerExited, "{}", r.console);
    assert!(r.console.contains("bye"), "{}", r.console);
    let r = run(&s, "exists('x')");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(r.session.fresh);
    assert_eq!(r.session.generation, 2);
    assert_eq!(r.session.reset_reason.as_deref(), Some("quit"));
    assert!(r.console.starts_with(FRESH_NOTICE), "{}", r.console);
    assert!(r.console.ends_with("[1] FALSE\n"), "{}", r.console);
}

// ---------------------------------------------------------------------------
// 11. secrets and start-up files

#[test]
fn host_secrets_are_hidden_unless_named() {
    let name = format!(
        "RVISOR_TEST_SECRET_{}",
        rvisor::ids::random_hex(4).to_uppercase()
    );
    std::env::set_var(&name, "hunter2");
    let sup = supervisor();

    let hidden = session(&sup);
    assert_eq!(
        console(&hidden, &format!("Sys.getenv('{name}')")),
        "[1] \"\"\n",
        "a host variable is not visible by default"
    );
    assert_eq!(
        console(&hidden, &format!("'{name}' %in% names(Sys.getenv())")),
        "[1] FALSE\n"
    );

    let named = session_with(
        &sup,
        SessionOptions {
            env: EnvPolicy::Names(vec![name.clone()]),
            ..SessionOptions::default()
        },
    );
    assert_eq!(
        console(&named, &format!("Sys.getenv('{name}')")),
        "[1] \"hunter2\"\n"
    );
    std::env::remove_var(&name);
}

#[test]
fn rprofile_and_renviron_are_not_read() {
    let var = format!(
        "RVISOR_TEST_RENVIRON_{}",
        rvisor::ids::random_hex(4).to_uppercase()
    );
    let files = |dir: &Path, tag: &str| {
        std::fs::write(
            dir.join(".Rprofile"),
            format!("cat('PROFILE-{tag}\\n'); profile_{tag} <- TRUE\n"),
        )
        .unwrap();
        std::fs::write(dir.join(".Renviron"), format!("{var}=from-{tag}\n")).unwrap();
    };
    // The working directory is visible to a confined worker (an explicit
    // working_dir is exposed read-only), so its files could be read: the
    // call checks that they are there.
    let wd = exposed_dir("wd");
    files(&wd, "wd");
    // The supervisor's HOME: the zygote starts R with it, and unconfined
    // workers get it. Its start-up files must not run either.
    // (nextest runs each test in its own process, so this is local.)
    let home = exposed_dir("home");
    files(&home, "home");
    std::env::set_var("HOME", &home);

    // `home` is R code for the HOME the worker should have; `in_home`, the
    // expected `file.exists` of the start-up files there.
    let check = |sup: &Supervisor, home: &str, in_home: &str| {
        let s = session_with(
            sup,
            SessionOptions {
                working_dir: Some(wd.clone()),
                ..SessionOptions::default()
            },
        );
        let r = run(
            &s,
            &format!(
                "cat(normalizePath(getwd()) == {}, Sys.getenv('HOME') == {home}, '\\n')\n\
                 cat(file.exists('.Rprofile', '.Renviron', file.path(Sys.getenv('HOME'), \
                 c('.Rprofile', '.Renviron'))), '\\n')\n\
                 exists('profile_wd'); exists('profile_home'); Sys.getenv('{var}')",
                r_str(&wd.canonicalize().unwrap()),
            ),
        );
        assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
        assert_eq!(
            r.console,
            format!("TRUE TRUE \nTRUE TRUE {in_home} \n[1] FALSE\n[1] FALSE\n[1] \"\"\n"),
            "the call ran in working_dir with HOME set, saw the start-up files, and none ran"
        );
        assert!(!r.console.contains("PROFILE"));
    };
    // Confined: HOME is the worker's private directory (where tempdir() is),
    // which has no start-up files.
    check(&supervisor(), "dirname(tempdir())", "FALSE FALSE");
    // Unconfined, HOME is passed to workers as it is.
    check(&unconfined_supervisor(), &r_str(&home), "TRUE TRUE");
    let _ = std::fs::remove_dir_all(&wd);
    let _ = std::fs::remove_dir_all(&home);
}

// ---------------------------------------------------------------------------
// 12. temp dir of a killed worker

#[test]
fn a_worker_killed_from_outside_is_replaced_and_its_tempdir_removed() {
    let sup = supervisor();
    let s = session(&sup);
    let r = run(&s, "x <- 1; cat(tempdir())");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    let old_tmp = PathBuf::from(&r.console);
    let pid = s.status().pid.expect("a worker runs");
    // R's tempdir is in the worker's private tmpfs; its directory on the
    // host (the mount point, R's tempdir's parent) is the session's
    // working directory.
    assert!(
        inside(pid, &old_tmp).is_dir(),
        "R's tempdir {} exists",
        old_tmp.display()
    );
    let old_dir = PathBuf::from(s.status().working_dir);
    assert_eq!(old_tmp.parent(), Some(old_dir.as_path()));
    assert!(old_dir.is_dir(), "{} exists on the host", old_dir.display());

    sigkill(pid);
    // The session notices the death before its next call (from the socket
    // itself, even before its link reader or the zygote's report).
    wait_until("the worker to die", || process_gone(pid));

    let r = run(&s, "exists('x')");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(r.session.fresh, "{r:?}");
    assert_eq!(r.session.generation, 2);
    let reason = r.session.reset_reason.clone().expect("a reset reason");
    assert!(
        reason == "killed" || reason == "crash",
        "reason is killed or crash: {reason}"
    );
    assert!(r.console.starts_with(FRESH_NOTICE), "{}", r.console);
    assert!(r.console.ends_with("[1] FALSE\n"), "{}", r.console);
    assert_ne!(s.status().pid, Some(pid));
    assert_ne!(PathBuf::from(s.status().working_dir), old_dir);
    wait_until("the old tempdir to be removed", || !old_dir.exists());
}

// ---------------------------------------------------------------------------
// 13. status

#[test]
fn status_follows_the_session_life_cycle() {
    let sup = supervisor();
    let gate = Gate::new();
    let s = session_with(&sup, gate.options());
    let st = s.status();
    assert_eq!(st.id, s.id());
    assert_eq!(st.state, SessionState::New);
    assert_eq!(st.generation, 0);
    assert_eq!(st.pid, None);
    assert_eq!(st.queued, 0);
    assert!(st.last_reset.is_none());
    // A confined session without an explicit working_dir works in its
    // worker's private directory, which exists once the worker does.
    assert_eq!(st.working_dir, "");

    let token = rvisor::ids::random_hex(8);
    let r = run(
        &s,
        &format!("writeLines('{token}', 'whoami.txt'); cat(getwd(), Sys.getpid(), sep = '\\n')"),
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    let lines: Vec<&str> = r.console.lines().collect();
    let st = s.status();
    assert_eq!(st.state, SessionState::Idle);
    assert_eq!(st.generation, 1);
    assert_eq!(lines[0], st.working_dir, "calls run in working_dir");
    assert!(Path::new(&st.working_dir).is_dir(), "{st:?}");
    // R sees itself as pid 1 of its own pid namespace; `pid` is the host
    // pid of the process that ran the call: the file it wrote is in that
    // process's root (and not on the host: the directory is private).
    assert_eq!(lines[1], "1");
    let pid = st.pid.expect("a worker pid");
    let wrote = Path::new(&st.working_dir).join("whoami.txt");
    assert_eq!(
        std::fs::read_to_string(inside(pid, &wrote)).expect("the file R wrote"),
        format!("{token}\n")
    );
    assert!(!wrote.exists(), "{} is private", wrote.display());

    let h = s.run(HOLD).unwrap();
    gate.wait_started(1);
    assert_eq!(s.status().state, SessionState::Running);
    let q = s.run("1").unwrap();
    assert_eq!(s.status().queued, 1);
    gate.release();
    assert_eq!(wait(&h).outcome, Outcome::Complete);
    assert_eq!(wait(&q).outcome, Outcome::Complete);
    assert_eq!(s.status().state, SessionState::Idle);
    assert_eq!(s.status().queued, 0);

    let wd = PathBuf::from(&st.working_dir);
    s.close();
    assert_eq!(s.status().state, SessionState::Closed);
    // The private working directory goes with the session.
    wait_until("the session's working dir to be removed", || !wd.exists());
    assert_eq!(s.status().pid, None);
}

#[test]
fn closing_a_session_resolves_its_running_and_queued_calls() {
    let sup = supervisor();
    let gate = Gate::new();
    let s = session_with(&sup, gate.options());
    let h1 = s.run(BLOCK).unwrap();
    gate.wait_started(1);
    let h2 = s.run("1").unwrap();
    let pid = s.status().pid.unwrap();
    s.close();
    let r1 = wait(&h1);
    // The running call ends as `closed` (not `cancelled` with "variables
    // are kept": the session is gone).
    assert_eq!(r1.outcome, Outcome::Closed, "{}", r1.console);
    assert!(r1.error.as_ref().unwrap().message.contains("closed"));
    let r2 = wait(&h2);
    assert_eq!(r2.outcome, Outcome::Closed, "{}", r2.console);
    wait_until("the worker to end", || process_gone(pid));
}

// ---------------------------------------------------------------------------
// 14. tools

#[derive(Debug, Default)]
struct Seen {
    calls: Vec<(String, String, String)>,
}

fn tools(seen: Arc<Mutex<Seen>>) -> Vec<Tool> {
    let add = Tool::new("add", "adds a and b", json!({}), move |call| {
        seen.lock().unwrap().calls.push((
            call.name.clone(),
            call.session_id.clone(),
            call.execution_id.clone(),
        ));
        let a = call.args["a"].as_f64().ok_or("a must be a number")?;
        let b = call.args["b"].as_f64().ok_or("b must be a number")?;
        Ok(json!(a + b))
    })
    .unwrap();
    let fail = Tool::new("fail", "always fails", json!({}), |_| {
        Err("no luck".to_string())
    })
    .unwrap();
    let echo = Tool::new("echo", "returns its arguments", json!({}), |call| {
        Ok(call.args.clone())
    })
    .unwrap();
    vec![add, fail, echo]
}

#[test]
fn tools_are_called_from_r_with_session_and_execution_ids() {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let sup = supervisor();
    let s = session_with(
        &sup,
        SessionOptions {
            tools: tools(seen.clone()),
            ..SessionOptions::default()
        },
    );
    let r = run(&s, "tools$add(a = 1, b = 2)");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.console, "[1] 3\n");
    let calls = seen.lock().unwrap().calls.clone();
    assert_eq!(
        calls,
        vec![(
            "add".to_string(),
            s.id().to_string(),
            r.execution_id.clone()
        )],
        "the handler saw this session and this call"
    );

    // Two tool calls in one R call share its execution id; the result is an
    // ordinary R value.
    let r = run(
        &s,
        "z <- tools$add(a = 10, b = 0.5) * 2; z; tools$add(a = z, b = -1)",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.console, "[1] 21\n[1] 20\n");
    let calls = seen.lock().unwrap().calls.clone();
    assert_eq!(calls.len(), 3);
    assert!(calls[1..].iter().all(|c| c.2 == r.execution_id));

    // A handler error is an R error (catchable by R code).
    let r = run(&s, "tools$fail()");
    assert_eq!(r.outcome, Outcome::Error, "{}", r.console);
    let msg = &r.error.as_ref().unwrap().message;
    assert!(msg.contains("no luck"), "{msg}");
    assert_eq!(
        console(&s, "tryCatch(tools$fail(), error = function(e) 'caught')"),
        "[1] \"caught\"\n"
    );

    // An unknown tool names the known ones.
    let r = run(&s, "tools$nope()");
    assert_eq!(r.outcome, Outcome::Error, "{}", r.console);
    let msg = &r.error.as_ref().unwrap().message;
    assert!(msg.contains("unknown tool"), "{msg}");
    assert!(msg.contains("add"), "{msg}");

    // A request over the limit never reaches the host.
    let before = seen.lock().unwrap().calls.len();
    let r = run(&s, "tools$echo(x = strrep('a', 300000))");
    assert_eq!(r.outcome, Outcome::Error, "{}", r.console);
    let msg = &r.error.as_ref().unwrap().message;
    assert!(msg.contains("limit"), "{msg}");
    assert_eq!(seen.lock().unwrap().calls.len(), before);

    // Nested values survive the round trip.
    let r = run(
        &s,
        "v <- tools$echo(n = 1:3, d = c(1.5, 2), s = c('a', 'b'), flag = TRUE, \
         inner = list(k = 'v', m = list(z = 7L)))\n\
         identical(v$n, 1:3); identical(v$d, c(1.5, 2)); identical(v$s, c('a', 'b'))\n\
         isTRUE(v$flag); identical(v$inner$k, 'v'); identical(v$inner$m$z, 7L)\n\
         sort(names(v))",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(
        r.console,
        "[1] TRUE\n[1] TRUE\n[1] TRUE\n[1] TRUE\n[1] TRUE\n[1] TRUE\n\
         [1] \"d\"     \"flag\"  \"inner\" \"n\"     \"s\"    \n"
    );
    // The session is unharmed by all that.
    assert_eq!(console(&s, "z"), "[1] 21\n");
}

// ---------------------------------------------------------------------------
// 15. handles as futures

struct ThreadWaker(std::thread::Thread);

impl std::task::Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Drives a future on this thread; panics after [`DEADLINE`].
fn block_on<F: std::future::Future>(fut: F) -> F::Output {
    let waker = std::task::Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    let end = Instant::now() + DEADLINE;
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        let now = Instant::now();
        assert!(now < end, "the future never resolved");
        // Woken by the waker; the timeout only guards against a hang.
        std::thread::park_timeout(end - now);
    }
}

#[test]
fn a_call_handle_is_a_future() {
    let sup = supervisor();
    let gate = Gate::new();
    let s = session_with(&sup, gate.options());
    let h = s.run("1 + 1").unwrap();
    let id = h.execution_id().to_string();
    let r = block_on(h);
    assert_eq!(r.outcome, Outcome::Complete);
    assert_eq!(r.console, "[1] 2\n");
    assert_eq!(r.execution_id, id);

    // Several awaited in one async block, in order.
    let (a, b) = block_on(async {
        let a = s.run("y <- 5; y").unwrap().await;
        let b = s.run("y * 2").unwrap().await;
        (a, b)
    });
    assert_eq!(a.console, "[1] 5\n");
    assert_eq!(b.console, "[1] 10\n");

    // A pending future wakes when the blocked call is released.
    let h = s.run(&format!("{HOLD}; 'released'")).unwrap();
    let releaser = {
        let gate = gate.clone();
        std::thread::spawn(move || {
            gate.wait_started(1);
            gate.release();
        })
    };
    let r = block_on(h);
    releaser.join().unwrap();
    assert_eq!(r.console, "[1] \"released\"\n");
}

#[test]
fn wait_timeout_is_none_while_running_and_some_after() {
    let sup = supervisor();
    let gate = Gate::new();
    let s = session_with(&sup, gate.options());
    let h = s.run(&format!("{HOLD}; 'done'")).unwrap();
    gate.wait_started(1);
    // The call cannot end before the gate is released.
    assert!(h.wait_timeout(Duration::from_millis(50)).is_none());
    assert!(h.try_result().is_none());
    gate.release();
    let r = h.wait_timeout(DEADLINE).expect("result after release");
    assert_eq!(r.console, "[1] \"done\"\n");
    assert_eq!(h.try_result().unwrap().execution_id, r.execution_id);
    // `wait` on a clone returns the same result.
    assert_eq!(h.clone().wait().execution_id, r.execution_id);
}

// ---------------------------------------------------------------------------
// 16-17. the JSONL CLI

/// `rvisor session --jsonl` as a child, with its output lines on a channel.
struct Cli {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    /// Lines read but not yet asked for.
    backlog: Vec<Value>,
}

impl Cli {
    fn start() -> Self {
        Self::start_in(None)
    }

    /// The CLI with its temporary root (`TMPDIR`) at `tmp`, when given.
    fn start_in(tmp: Option<&Path>) -> Self {
        let mut cmd = Command::new(rvisor_ffi_tests::rvisor_bin());
        cmd.args(["session", "--jsonl"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(t) = tmp {
            cmd.env("TMPDIR", t);
        }
        let mut child = cmd.spawn().expect("start the CLI");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            stdin: Some(stdin),
            lines,
            backlog: Vec::new(),
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("input is open");
        stdin.write_all(line.as_bytes()).unwrap();
        stdin.write_all(b"\n").unwrap();
        stdin.flush().unwrap();
    }

    /// Closes the CLI's input and waits for it to exit.
    fn finish(&mut self) -> std::process::ExitStatus {
        drop(self.stdin.take());
        let end = Instant::now() + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < end, "the CLI did not exit after EOF");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn send_json(&mut self, v: Value) {
        self.send(&v.to_string());
    }

    /// The response line whose `id` is `id` (others are kept for later).
    fn response(&mut self, id: &Value) -> Value {
        if let Some(i) = self.backlog.iter().position(|v| &v["id"] == id) {
            return self.backlog.remove(i);
        }
        let end = Instant::now() + DEADLINE;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let v: Value = serde_json::from_str(&line)
                        .unwrap_or_else(|e| panic!("response is JSON ({e}): {line}"));
                    if &v["id"] == id {
                        return v;
                    }
                    self.backlog.push(v);
                }
                Err(RecvTimeoutError::Timeout) => panic!("no response for id {id}"),
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("the CLI closed its output before answering id {id}")
                }
            }
        }
    }

    /// Sends a run and returns its result object.
    fn run(&mut self, id: u64, session: Option<&str>, code: &str) -> Value {
        let mut req = json!({"id": id, "op": "run", "code": code});
        if let Some(s) = session {
            req["session"] = json!(s);
        }
        self.send_json(req);
        let resp = self.response(&json!(id));
        assert!(resp.get("error").is_none(), "{resp}");
        resp["result"].clone()
    }

    /// Asks for a session's status and returns it.
    fn status(&mut self, id: u64, session: Option<&str>) -> Value {
        let mut req = json!({"id": id, "op": "status"});
        if let Some(s) = session {
            req["session"] = json!(s);
        }
        self.send_json(req);
        let resp = self.response(&json!(id));
        assert!(resp.get("error").is_none(), "{resp}");
        resp["status"].clone()
    }

    /// The host pid of a session's worker (after a call ran).
    fn worker_pid(&mut self, id: u64, session: Option<&str>) -> u32 {
        let st = self.status(id, session);
        st["pid"]
            .as_u64()
            .unwrap_or_else(|| panic!("no worker pid: {st}")) as u32
    }
}

impl Drop for Cli {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn no_worker_survives_a_killed_cli() {
    let mut cli = Cli::start();
    let result = cli.run(1, None, "x <- 1");
    assert_eq!(result["outcome"], "complete", "{result}");
    let pid = cli.worker_pid(2, None);
    assert!(!process_gone(pid), "the worker runs");
    // A confined worker's parent is the zygote, which made its namespace.
    let zygote = parent_pid(pid).expect("the worker's parent");
    assert!(!process_gone(zygote), "its parent runs");

    sigkill(cli.child.id());
    let _ = cli.child.wait();
    // The worker dies with its supervisor (parent-death signals). Whoever
    // reaps it then (init or a subreaper) may be slow, so a zombie counts as
    // gone.
    wait_until(&format!("worker {pid} to end"), || process_gone(pid));
    wait_until(&format!("the zygote {zygote} to end"), || {
        process_gone(zygote)
    });
}

#[test]
fn jsonl_bad_lines_get_errors_and_the_session_goes_on() {
    let mut cli = Cli::start();
    assert_eq!(cli.run(1, None, "x <- 7; x")["console"], "[1] 7\n");

    cli.send("this is not json");
    let resp = cli.response(&Value::Null);
    assert_eq!(resp["error"]["code"], "bad_request", "{resp}");
    assert!(resp["error"]["message"]
        .as_str()
        .unwrap()
        .contains("invalid request"));

    cli.send(r#"{"id": 2, "op": "fly"}"#);
    let resp = cli.response(&json!(2));
    assert_eq!(resp["error"]["code"], "bad_request", "{resp}");

    cli.send(r#"{"id": 3, "op": "run"}"#);
    let resp = cli.response(&json!(3));
    assert_eq!(resp["error"]["code"], "bad_request", "{resp}");

    cli.send(r#"{"id": 4, "op": "run", "code": "   "}"#);
    let resp = cli.response(&json!(4));
    assert_eq!(resp["error"]["code"], "invalid", "{resp}");

    let r = cli.run(5, None, "x + 1");
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(r["console"], "[1] 8\n", "state kept after the bad lines");
    assert_eq!(r["session"]["fresh"], false);

    cli.send(r#"{"id": 6, "op": "status"}"#);
    let resp = cli.response(&json!(6));
    assert_eq!(resp["status"]["state"], "idle", "{resp}");
    assert_eq!(resp["status"]["generation"], 1, "{resp}");
}

#[test]
fn jsonl_cancel_works_mid_run() {
    let mut cli = Cli::start();
    assert_eq!(cli.run(1, None, "keep <- 'yes'")["outcome"], "complete");
    // The CLI has no tools: R marks its start with a file in its private
    // working directory, which the test sees through the worker's root.
    let st = cli.status(10, None);
    let pid = st["pid"].as_u64().expect("a worker pid") as u32;
    let wd = st["working_dir"].as_str().expect("a working dir");
    assert!(!wd.is_empty(), "{st}");
    let started = inside(pid, &Path::new(wd).join("started"));
    assert!(!started.exists());
    cli.send_json(json!({"id": 2, "op": "run",
        "code": "invisible(file.create('started')); repeat Sys.sleep(0.05)"}));
    wait_until("the call to start", || started.exists());
    cli.send_json(json!({"id": 3, "op": "cancel"}));
    let status = cli.response(&json!(3));
    assert!(status.get("status").is_some(), "{status}");
    let run = cli.response(&json!(2));
    assert_eq!(run["result"]["outcome"], "cancelled", "{run}");
    assert_eq!(run["result"]["success"], false);
    let r = cli.run(4, None, "keep");
    assert_eq!(r["console"], "[1] \"yes\"\n", "{r}");
    assert_eq!(cli.worker_pid(5, None), pid, "the same worker");
}

#[test]
fn jsonl_a_busy_session_holds_back_no_other_sessions_result() {
    let mut cli = Cli::start();
    assert_eq!(cli.run(1, Some("a"), "invisible(0)")["outcome"], "complete");
    let st = cli.status(20, Some("a"));
    let pid = st["pid"].as_u64().expect("a worker pid") as u32;
    let wd = inside(
        pid,
        Path::new(st["working_dir"].as_str().expect("a working dir")),
    );
    // Session a's call waits for a file the test writes; its next call
    // queues behind it.
    cli.send_json(json!({"id": 2, "op": "run", "session": "a",
        "code": "invisible(file.create('started')); while (!file.exists('go')) Sys.sleep(0.02); 'first'"}));
    cli.send_json(json!({"id": 3, "op": "run", "session": "a", "code": "'second'"}));
    wait_until("a's call to start", || wd.join("started").exists());
    // Session b answers meanwhile, call after call.
    for id in 4..8 {
        let b = cli.run(id, Some("b"), "1+1");
        assert_eq!(b["console"], "[1] 2\n", "{b}");
    }
    let a = cli.status(8, Some("a"));
    assert_eq!(a["state"], "running", "{a}");
    std::fs::write(wd.join("go"), "").unwrap();
    let first = cli.response(&json!(2));
    assert_eq!(first["result"]["console"], "[1] \"first\"\n", "{first}");
    let second = cli.response(&json!(3));
    assert_eq!(second["result"]["console"], "[1] \"second\"\n", "{second}");
    assert!(cli.finish().success());
}

#[test]
fn jsonl_named_sessions_are_separate() {
    let mut cli = Cli::start();
    assert_eq!(
        cli.run(1, Some("a"), "x <- 'from a'")["outcome"],
        "complete"
    );
    let b = cli.run(2, Some("b"), "exists('x')");
    assert_eq!(b["console"], "[1] FALSE\n", "{b}");
    assert_eq!(
        cli.run(3, Some("b"), "x <- 'from b'")["outcome"],
        "complete"
    );
    let a = cli.run(4, Some("a"), "x");
    assert_eq!(a["console"], "[1] \"from a\"\n", "{a}");
    let b = cli.run(5, Some("b"), "x");
    assert_eq!(b["console"], "[1] \"from b\"\n", "{b}");
    assert_ne!(a["session"]["id"], b["session"]["id"]);

    // Each has its own worker (process and temporary directory).
    assert_ne!(cli.worker_pid(6, Some("a")), cli.worker_pid(7, Some("b")));
    let ta = cli.run(10, Some("a"), "cat(tempdir())");
    let tb = cli.run(11, Some("b"), "cat(tempdir())");
    assert_eq!(ta["outcome"], "complete", "{ta}");
    assert_ne!(ta["console"], tb["console"]);

    cli.send(r#"{"id": 8, "op": "status", "session": "nope"}"#);
    let st = cli.response(&json!(8));
    assert_eq!(
        st["status"]["state"], "new",
        "status creates the session: {st}"
    );
    cli.send(r#"{"id": 9, "op": "cancel", "session": "zzz"}"#);
    let e = cli.response(&json!(9));
    assert_eq!(e["error"]["code"], "unknown_session", "{e}");

    // Closing the input ends the CLI cleanly.
    let status = cli.finish();
    assert!(status.success(), "{status}");
}

#[test]
fn a_call_made_right_after_reset_runs_in_the_fresh_session() {
    let sup = rvisor::Supervisor::new(rvisor::SupervisorConfig::default()).expect("supervisor");
    let s = sup.session().expect("session");
    assert_eq!(s.run("x <- 1; x").unwrap().wait().console, "[1] 1\n");
    s.reset();
    let r = s.run("exists('x')").unwrap().wait();
    assert_eq!(r.outcome, rvisor::Outcome::Complete, "{}", r.console);
    assert!(r.session.fresh);
    assert_eq!(r.session.reset_reason.as_deref(), Some("reset"));
    assert!(r.console.ends_with("[1] FALSE\n"), "{}", r.console);
    assert!(r.console.starts_with("rvisor: started a fresh R session"));
}

/// The `rvisor-<16 hex>` directories (workers' and zygotes') under `root`
/// (not the CLI's own, such as its table store's).
fn worker_dirs(root: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_prefix("rvisor-"))
                    .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        })
        .collect();
    v.sort();
    v
}

/// A supervisor killed with SIGKILL runs no clean-up: its workers' and
/// zygotes' directories, and a `session --jsonl`'s directory of published
/// tables, stay in its temp root (they did for good before).
/// The next supervisor that starts on that root removes them, since
/// nobody holds their locks any more (supervisor/src/tempdir.rs), and
/// leaves those of a supervisor still running alone: its session goes on
/// using its directory.
#[test]
fn a_killed_supervisors_directories_are_removed_by_the_next_one() {
    use std::os::unix::fs::PermissionsExt;
    let dir = rvisor_ffi_tests::TestDir::new("rvisor-sweep");
    let root = dir.path().to_path_buf();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let on_root = || {
        let mut cfg = SupervisorConfig::default();
        cfg.worker.temp_root = root.clone();
        Supervisor::new(cfg).expect("supervisor starts")
    };

    // A live supervisor on the root, its session's file in its directory.
    let live = on_root();
    let s = live.session().expect("session");
    let r = run(
        &s,
        "f <- file.path(tempdir(), 'kept'); writeLines('here', f); file.exists(f)",
    );
    assert_eq!(r.console, "[1] TRUE\n", "{r:?}");
    // Its pool settled (the warm zygote has taken over from the base one,
    // whose spares it replaced, and every spare is made): from here on it
    // removes none of its directories by itself.
    wait_for("the live pool to settle", DEADLINE, || {
        let st = live.pool_status();
        (st.warm
            && st.spares >= st.spares_target
            && (st.preloaded.is_empty() || st.preloaded_spares >= st.preloaded_spares_target)
            && st.refills_held == 0)
            .then_some(())
    });
    let live_dirs = worker_dirs(&root);
    assert!(!live_dirs.is_empty());

    // A CLI on the same root: it runs a call, then is killed (SIGKILL, as
    // dropping a Cli does).
    let mut cli = Cli::start_in(Some(&root));
    let r = cli.run(1, None, "writeLines('x', file.path(tempdir(), 'f'))");
    assert_eq!(r["outcome"], "complete", "{r}");
    drop(cli);
    // What it left (up to the kill its own pool may still have replaced a
    // spare, removing that one's directory itself).
    let killed: Vec<PathBuf> = worker_dirs(&root)
        .into_iter()
        .filter(|d| !live_dirs.contains(d))
        .collect();
    assert!(
        !killed.is_empty(),
        "a killed supervisor leaves its directories behind"
    );
    // Among them the directory of the tables its calls publish (the
    // table store's `cache` is in it), a scratch directory of its own.
    assert!(
        killed.iter().any(|d| d.join("cache").is_dir()),
        "the killed CLI's table directory is one of {killed:?}"
    );

    // The next supervisor on the root removes them (in the background),
    // each directory first, then its lock.
    let _next = on_root();
    wait_for(
        "the killed supervisor's directories and their locks to go",
        DEADLINE,
        || {
            killed
                .iter()
                .all(|d| !d.exists() && !d.with_extension("lock").exists())
                .then_some(())
        },
    );
    // The live supervisor's are all there, and its session goes on.
    let gone: Vec<_> = live_dirs.iter().filter(|d| !d.exists()).collect();
    assert!(
        gone.is_empty(),
        "a live supervisor's directories were removed: {gone:?}"
    );
    let r = run(&s, "readLines(f)");
    assert_eq!(r.console, "[1] \"here\"\n", "{r:?}");
    drop(s);
    drop(live);
}
