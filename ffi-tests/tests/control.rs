//! Interrupts, timeouts, quit(), output caps, HTML-only values and the
//! structured result block.

use rvisor::{CallOptions, Outcome};
use rvisor_ffi_tests::{run, worker};
use std::time::Duration;

/// Interrupts the worker once R is inside the call: the code itself
/// announces that it started by writing a marker file, so no sleep-and-hope.
fn interrupt_when_started(
    w: &rvisor::Worker,
    marker: std::path::PathBuf,
) -> std::thread::JoinHandle<()> {
    let int = w.interrupter();
    std::thread::spawn(move || {
        let end = std::time::Instant::now() + Duration::from_secs(30);
        while !marker.exists() {
            assert!(std::time::Instant::now() < end, "the call never started");
            std::thread::sleep(Duration::from_millis(2));
        }
        int.interrupt();
    })
}

fn marker(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("rvisor-test-{name}-{}", rvisor::ids::random_hex(6)));
    let _ = std::fs::remove_file(&p);
    p
}

#[test]
fn interrupt_ends_a_loop_and_keeps_variables() {
    let mut w = worker();
    run(&mut w, "keep <- 'still here'");
    let m = marker("loop");
    let t = interrupt_when_started(&w, m.clone());
    let code = format!(
        "file.create('{}'); i <- 0; while (TRUE) i <- i + 1",
        m.display()
    );
    let r = w.run(
        &code,
        &CallOptions {
            timeout: None,
            ..CallOptions::default()
        },
    );
    t.join().unwrap();
    assert_eq!(r.outcome, Outcome::Interrupted, "{}", r.console);
    assert!(!r.success);
    let r = run(&mut w, "keep; exists('i')");
    assert_eq!(r.console, "[1] \"still here\"\n[1] TRUE\n");
}

#[test]
fn interrupt_ends_sys_sleep() {
    let mut w = worker();
    let m = marker("sleep");
    let t = interrupt_when_started(&w, m.clone());
    let code = format!(
        "x <- 1; file.create('{}'); Sys.sleep(60); x <- 2",
        m.display()
    );
    let r = w.run(
        &code,
        &CallOptions {
            timeout: None,
            ..CallOptions::default()
        },
    );
    t.join().unwrap();
    assert_eq!(r.outcome, Outcome::Interrupted);
    assert!(r.duration_ms < 30_000.0);
    assert_eq!(run(&mut w, "x").console, "[1] 1\n");
}

#[test]
fn an_interrupt_between_calls_does_not_hit_the_next_call() {
    let mut w = worker();
    run(&mut w, "1");
    w.interrupt();
    let r = run(&mut w, "for (i in 1:200000) NULL; 'done'");
    assert_eq!(r.outcome, Outcome::Complete);
}

#[test]
fn timeout_interrupts_first_and_keeps_the_session() {
    let mut w = worker();
    run(&mut w, "v <- 123");
    let opts = CallOptions {
        timeout: Some(Duration::from_millis(300)),
        ..CallOptions::default()
    };
    let r = w.run("while (TRUE) {}", &opts);
    assert_eq!(r.outcome, Outcome::TimedOut);
    let e = r.error.unwrap();
    assert!(e.timed_out);
    assert!(e.message.contains("variables are kept"), "{}", e.message);
    assert!(w.is_alive());
    assert_eq!(run(&mut w, "v").console, "[1] 123\n");
}

#[test]
fn quit_ends_the_worker_with_a_clear_result() {
    let mut w = worker();
    let r = run(&mut w, "cat('bye\\n'); quit(status = 3); cat('never\\n')");
    assert_eq!(r.outcome, Outcome::WorkerExited);
    assert!(!r.success);
    assert!(r.console.starts_with("bye\n"), "{}", r.console);
    assert!(!r.console.contains("never"));
    let msg = r.error.unwrap().message;
    assert!(msg.contains("quit() was called (status 3)"), "{msg}");
    assert!(!w.is_alive());
    // The next call on a dead worker says so instead of hanging.
    let r = run(&mut w, "1");
    assert_eq!(r.outcome, Outcome::WorkerFailed);
    let r2 = run(&mut worker(), "q()");
    assert_eq!(r2.outcome, Outcome::WorkerExited);
}

#[test]
fn output_flood_is_truncated_and_the_session_lives() {
    let mut w = worker();
    let opts = CallOptions {
        max_output_bytes: 10_000,
        ..CallOptions::default()
    };
    let r = w.run(
        "for (i in 1:5000) cat('line', i, '\\n'); z <- 'alive'",
        &opts,
    );
    assert_eq!(r.outcome, Outcome::OutputTruncated);
    assert!(r.truncated);
    assert!(r.success, "the code itself succeeded");
    assert!(r.console.len() <= 10_000);
    assert!(r.console.starts_with("line 1 \n"));
    assert_eq!(r.usage.output_bytes, 10_000);
    let r = run(&mut w, "z");
    assert_eq!(r.console, "[1] \"alive\"\n");
    assert!(!r.truncated);
}

#[test]
fn truncated_error_is_still_an_error() {
    let mut w = worker();
    let opts = CallOptions {
        max_output_bytes: 100,
        ..CallOptions::default()
    };
    let r = w.run("cat(strrep('x', 500)); stop('late')", &opts);
    assert_eq!(r.outcome, Outcome::Error);
    assert!(r.truncated);
    assert!(!r.success);
}

#[test]
fn html_only_values_are_unsupported_output() {
    let mut w = worker();
    let code =
        "w <- structure(list(x = 1), class = c('datatables', 'htmlwidget'))\nw\ncat('after\\n')";
    // With displays off, as before displays existed (with displays on,
    // HTML-only values are displays: tests/displays.rs).
    let off = rvisor::CallOptions {
        display: rvisor::DisplayOptions {
            enabled: Some(false),
            ..Default::default()
        },
        ..Default::default()
    };
    let r = w.run(code, &off);
    assert_eq!(r.outcome, Outcome::UnsupportedOutput, "{}", r.console);
    assert!(!r.success);
    assert!(r.console.contains("renders only as HTML"));
    assert!(r.console.contains("print the underlying data"));
    assert!(r.console.contains("after\n"), "later expressions still run");
    // Printing the data is fine.
    let r = run(&mut w, "print(unclass(w)$x)");
    assert_eq!(r.outcome, Outcome::Complete);
}

#[test]
fn result_block_is_parsed_and_removed_from_the_console() {
    let mut w = worker();
    let r = run(
        &mut w,
        "cat('text\\n<<<RVISOR_RESULT_START>>>\\n{\"mean\": 2.5, \"n\": [1,2]}\\n<<<RVISOR_RESULT_END>>>\\n')",
    );
    assert_eq!(r.outcome, Outcome::Complete);
    assert_eq!(
        r.result,
        Some(serde_json::json!({"mean": 2.5, "n": [1, 2]}))
    );
    assert_eq!(r.console, "text\n");
}

#[test]
fn result_helper_serialises_lists_and_data_frames() {
    let mut w = worker();
    let r = run(
        &mut w,
        "rvisor_result(list(n = 3L, ok = TRUE, name = 'a', xs = c(1.5, NA), df = data.frame(a = 1:2, b = c('x', 'y'))))",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    let v = r.result.expect("result");
    assert_eq!(v["n"], 3);
    assert_eq!(v["ok"], true);
    assert_eq!(v["name"], "a");
    assert_eq!(v["xs"], serde_json::json!([1.5, null]));
    assert_eq!(
        v["df"],
        serde_json::json!([{"a": 1, "b": "x"}, {"a": 2, "b": "y"}])
    );
    assert_eq!(r.console, "");
    // The built-in serializer (used without jsonlite) gives the same JSON.
    let r = run(
        &mut w,
        "cat('<<<RVISOR_RESULT_START>>>\\n', as.environment('rvisor')$.rvisor_to_json(list(n = 3L, ok = TRUE, name = 'a\"b', xs = c(1.5, NA), df = data.frame(a = 1:2, b = c('x', 'y')))), '\\n<<<RVISOR_RESULT_END>>>\\n', sep = '')",
    );
    let v2 = r.result.expect("built-in result");
    assert_eq!(v2["n"], 3);
    assert_eq!(v2["name"], "a\"b");
    assert_eq!(v2["xs"], serde_json::json!([1.5, null]));
    assert_eq!(v2["df"], v["df"]);
}

#[test]
fn jube_markers_and_invalid_json() {
    let mut w = worker();
    let r = run(
        &mut w,
        "cat('<<<JUBE_RESULT_START>>>\\n[1, 2]\\n<<<JUBE_RESULT_END>>>\\n')",
    );
    assert_eq!(r.result, Some(serde_json::json!([1, 2])));
    let r = run(
        &mut w,
        "cat('<<<RVISOR_RESULT_START>>>\\n{not json\\n<<<RVISOR_RESULT_END>>>\\n')",
    );
    assert_eq!(r.result, None);
    assert_eq!(r.outcome, Outcome::Complete);
    assert!(
        r.warnings.iter().any(|w| w.contains("not valid JSON")),
        "{:?}",
        r.warnings
    );
}

#[test]
fn a_cpu_limit_stops_code_that_ignores_interrupts() {
    // The kernel's RLIMIT_CPU ends a call whatever it runs; the wall clock
    // is out of the way (no timeout) so the CPU limit is what stops it.
    let mut w = worker();
    let opts = CallOptions {
        timeout: None,
        cpu_limit: Some(Duration::from_secs(1)),
        ..CallOptions::default()
    };
    let r = w.run("x <- 0; repeat { x <- x + 1 }", &opts);
    assert_eq!(r.outcome, Outcome::TimedOut, "{}", r.console);
    let e = r.error.unwrap();
    assert!(e.timed_out);
    assert!(e.message.contains("CPU time"), "{}", e.message);
    assert!(r.usage.cpu_ms >= 0.0);
}
