//! What the tests of confined sessions share (`tests/confinement.rs`,
//! `tests/rootless.rs`): running code in a session with its result shown,
//! the `.attempt` verdicts of attack scripts, secrets, the host's view of a
//! worker process, and the check that an attack harmed nobody else.

use rvisor::{Outcome, RunResult, Session, Supervisor};
use std::collections::HashMap;
use std::time::Duration;

/// How long anything may take before a test calls it a hang.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// Whether this test runs rootless (not as root): workers then share the
/// test's host uid, each in a user namespace of its own.
pub fn rootless() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() != 0 }
}

/// Runs `code` in a session and waits for its result (at most
/// [`DEADLINE`]); prints both (nextest shows them when a test fails).
pub fn run(s: &Session, code: &str) -> RunResult {
    let h = s.run(code).expect("the call is accepted");
    let r = h
        .wait_timeout(DEADLINE)
        .unwrap_or_else(|| panic!("no result within {DEADLINE:?} for {code:?}"));
    show(code, &r);
    r
}

/// Prints a call and its result (nextest shows it when a test fails).
pub fn show(code: &str, r: &RunResult) {
    eprintln!(
        "--- code:\n{}\n--- outcome {:?}:\n{}",
        code.trim(),
        r.outcome,
        everything(r)
    );
}

/// Everything a result shows: console, error and the structured result.
pub fn everything(r: &RunResult) -> String {
    format!(
        "{}\n{:?}\n{:?}\n{:?}",
        r.console, r.error, r.result, r.warnings
    )
}

/// Runs `code`, asserts it completed and returns its console.
pub fn console(s: &Session, code: &str) -> String {
    let r = run(s, code);
    assert_eq!(r.outcome, Outcome::Complete, "{code}:\n{}", r.console);
    r.console
}

/// The pid of a session's worker (starting it if needed).
pub fn worker_pid(s: &Session) -> u32 {
    if s.status().pid.is_none() {
        console(s, "invisible(NULL)");
    }
    s.status().pid.expect("the worker runs")
}

/// A fresh random secret.
pub fn secret(what: &str) -> String {
    format!("rvisor-secret-{what}-{}", rvisor::ids::random_hex(12))
}

/// A field of `/proc/<pid>/status` (its whole value, trimmed).
pub fn status_field(pid: u32, field: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_string())
}

/// The real uid of host process `pid`.
pub fn uid_of(pid: u32) -> Option<u32> {
    status_field(pid, "Uid")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// R helper every attack script starts with: `.attempt(label, expr)` prints
/// one line `label => ALLOWED: <value>` or `label => DENIED: <error>`, with
/// the warnings R gave in brackets. A value is printed so that anything an
/// attack obtains ends up in the console, where the test looks for secrets.
pub const ATTEMPT: &str = r#"
.attempt <- function(label, expr) {
  warns <- character()
  res <- tryCatch(withCallingHandlers({
      v <- expr
      paste("ALLOWED:", paste(format(v), collapse = " "))
    }, warning = function(w) {
      warns <<- c(warns, conditionMessage(w))
      invokeRestart("muffleWarning")
    }),
    error = function(e) paste("DENIED:", conditionMessage(e)))
  cat(label, " => ", gsub("\n", " ", res),
      if (length(warns)) paste0(" [", gsub("\n", " ", paste(warns, collapse = "; ")), "]"),
      "\n", sep = "")
}
"#;

/// The `label => verdict` lines of an attack script's console.
pub fn verdicts(console: &str) -> HashMap<String, String> {
    console
        .lines()
        .filter_map(|l| l.split_once(" => "))
        .map(|(k, v)| (k.trim().to_string(), v.to_string()))
        .collect()
}

/// Asserts that every label in `labels` was attempted and denied.
pub fn assert_denied(console: &str, labels: &[&str]) {
    let v = verdicts(console);
    for l in labels {
        let verdict = v
            .get(*l)
            .unwrap_or_else(|| panic!("attack {l} did not report; console:\n{console}"));
        assert!(
            verdict.starts_with("DENIED"),
            "attack {l} was not denied: {verdict}\nconsole:\n{console}"
        );
    }
}

/// After session `a` attacked: session `b` (which set `b_state <- 'alive'`
/// in the worker `b_pid`) kept its state and its worker, the zygote is the
/// same, and `a` itself still answers.
pub fn assert_nobody_harmed(sup: &Supervisor, a: &Session, b: &Session, b_pid: u32, zygote: u32) {
    let rb = run(b, "cat(b_state)");
    assert_eq!(rb.console, "alive", "B was harmed: {}", everything(&rb));
    assert_eq!(rb.session.generation, 1, "B's worker was replaced");
    assert_eq!(b.status().pid, Some(b_pid), "B's worker changed");
    assert_eq!(
        sup.pool_status().zygote_pid,
        Some(zygote),
        "the zygote died"
    );
    assert_eq!(console(a, "cat(2 + 2)"), "4");
}
