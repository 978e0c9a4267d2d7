//! The durable-sessions load test (issue 15's targets, CI-sized): many
//! sessions with distinct state through a real `rvisor serve`, driven by
//! `rvisor bench --only sessions-load` (cli/src/bench/sessions_load.rs),
//! whose report these tests check. The driver checks every call's state
//! itself (the session's index, `sum(x)` to 17 digits against the value of
//! its creation, a call counter); a test here fails on any failed call.
//!
//! Confined workers (the default), as root. Every wait is on a condition
//! with a deadline; no test asserts a duration.

use rvisor_ffi_tests::rvisor_bin;
use serde_json::Value;
use std::process::Command;

/// Runs the sessions-load row with `args`; its JSON report (the last line
/// of standard output). Fails the test with the driver's message if it
/// could not run.
fn load(args: &[&str]) -> Value {
    let out = Command::new(rvisor_bin())
        .args(["bench", "--only", "sessions-load", "--json"])
        .args(args)
        .output()
        .expect("rvisor bench starts");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "rvisor bench --only sessions-load {args:?} failed ({}): {stderr}",
        out.status
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    let report: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    report["sessions_load"].clone()
}

/// Every call answered with the state intact and no session lost.
fn assert_all_intact(r: &Value, sessions: u64, rounds: u64) {
    // Creation, the rounds, the check of every session.
    let calls = sessions * (rounds + 2);
    assert_eq!(r["failures"], 0, "failed calls: {:#}", r["failure_list"]);
    assert_eq!(r["calls"], calls, "{r:#}");
    assert_eq!(r["calls_ok"], calls, "{r:#}");
    assert_eq!(r["lost_sessions"], 0, "lost: {:#}", r["lost_list"]);
}

#[test]
fn sessions_hibernated_between_rounds_come_back_intact_under_concurrent_clients() {
    // Runs on a server without admission control: every session hibernates
    // by itself (1 s idle) before each round, so every call of the rounds
    // and the check restores its session while other clients call theirs.
    let r = load(&[
        "--sessions",
        "24",
        "--state-mb",
        "1",
        "--clients",
        "3",
        "--rounds",
        "2",
        "--live",
        "0",
        "--memory-budget-mb",
        "0",
        "--no-restart",
        "--load-hibernate-after-secs",
        "1",
        "--hibernate-between-rounds",
    ]);
    assert_all_intact(&r, 24, 2);
    // Two rounds and the check: 72 calls, each a restore after hibernation.
    assert_eq!(
        r["restored_by_reason"],
        serde_json::json!({"hibernated": 72}),
        "{r:#}"
    );
    assert_eq!(r["latency_restored"]["n"], 72, "{r:#}");
    assert_eq!(r["latency_live"]["n"], 0, "{r:#}");
    assert!(r["restart"].is_null());
    // The sampler saw the workers (zygotes, spares, sessions) under the
    // server and read their memory.
    assert!(r["memory"]["samples"].as_u64() > Some(0), "{r:#}");
    assert!(
        r["memory"]["max_worker_processes"].as_u64() > Some(1),
        "{r:#}"
    );
    assert!(
        r["memory"]["max_workers_pss_mb"].as_f64() > Some(1.0),
        "{r:#}"
    );
    assert!(r["state_dir_mb"].as_f64() > Some(0.0), "{r:#}");
}

#[test]
fn forty_sessions_six_live_survive_a_restart_with_their_state_within_the_budget() {
    // Six live sessions of debug-build workers with 1 MB each measure
    // 60-75 MB of PSS apiece: the live cap binds, and the budget (100 MB a
    // worker) is the backstop that must hold as health measures it.
    let budget = 6 * 100;
    let r = load(&[
        "--sessions",
        "40",
        "--state-mb",
        "1",
        "--clients",
        "3",
        "--rounds",
        "2",
        "--live",
        "6",
        "--memory-budget-mb",
        &budget.to_string(),
    ]);
    // Calls in flight at SIGTERM finish or get a clear, retryable error;
    // no session is lost.
    assert_all_intact(&r, 40, 2);
    let restart = &r["restart"];
    assert!(restart.is_object(), "{r:#}");
    // Every session's first result after the restart says it was
    // restored, because of the restart.
    assert_eq!(
        restart["first_call_after"],
        serde_json::json!({"restarted": 40}),
        "{r:#}"
    );
    // With 6 live of 40, calls to hibernated sessions hibernate the least
    // recently used idle ones, and restore.
    assert!(
        r["restored_by_reason"]["hibernated"].as_u64() > Some(0),
        "{r:#}"
    );
    let m = &r["memory"];
    // Never more than the cap live (health's count).
    let live = m["max_admission_live"].as_u64();
    assert!(live.is_some(), "health reports no live sessions: {m:#}");
    assert!(live <= Some(6), "{m:#}");
    // The live workers' memory, as health reports it, stayed within the
    // budget.
    assert_eq!(m["budget_mb"], budget, "{m:#}");
    assert!(
        m["max_admission_memory_mb"].is_number(),
        "health reports no workers' memory: {m:#}"
    );
    assert_eq!(m["within_budget"], true, "{m:#}");
}
