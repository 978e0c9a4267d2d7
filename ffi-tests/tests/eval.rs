//! Evaluation as at the R prompt: output order, conditions, printing, parse
//! errors, persistence, working directory, raw output.

use rvisor::{CallOptions, Outcome, Segment};
use rvisor_ffi_tests::{run, worker};

#[test]
fn one_plus_one_prints_like_the_prompt() {
    let mut w = worker();
    let r = run(&mut w, "1 + 1");
    assert_eq!(r.outcome, Outcome::Complete);
    assert!(r.success);
    assert_eq!(r.console, "[1] 2\n");
    assert_eq!(r.r_version.split('.').count(), 3);
    assert_eq!(r.schema_version, 1);
    assert_eq!(r.code, "1 + 1");
    assert!(!r.execution_id.is_empty());
}

#[test]
fn stdout_and_stderr_keep_their_order_and_streams() {
    let mut w = worker();
    let r = run(
        &mut w,
        r#"cat("out1\n"); cat("err1\n", file = stderr()); cat("out2\n"); message("msg")"#,
    );
    assert_eq!(r.console, "out1\nerr1\nout2\nmsg\n");
    assert_eq!(
        r.segments,
        vec![
            Segment::Stdout {
                text: "out1\n".into()
            },
            Segment::Stderr {
                text: "err1\n".into()
            },
            Segment::Stdout {
                text: "out2\n".into()
            },
            Segment::Message {
                text: "msg\n".into()
            },
        ]
    );
}

#[test]
fn warning_carries_its_call_and_prints_after_the_value() {
    let mut w = worker();
    let r = run(&mut w, "log(-1)");
    assert_eq!(r.outcome, Outcome::Complete);
    assert_eq!(r.warnings, vec!["In log(-1) : NaNs produced".to_string()]);
    assert_eq!(
        r.console,
        "[1] NaN\nWarning message:\nIn log(-1) : NaNs produced\n"
    );
    assert!(r.segments.iter().any(|s| matches!(s,
        Segment::Warning { message, call } if message == "NaNs produced" && call.as_deref() == Some("log(-1)"))));
}

#[test]
fn error_stops_like_source_with_call_and_traceback() {
    let mut w = worker();
    let r = run(
        &mut w,
        "f <- function() stop('boom')\ng <- function() f()\ncat('before\\n')\ng()\ncat('after\\n')",
    );
    assert_eq!(r.outcome, Outcome::Error);
    assert!(!r.success);
    let e = r.error.expect("error");
    assert_eq!(e.message, "boom");
    assert_eq!(e.call.as_deref(), Some("f()"));
    assert_eq!(e.traceback, vec!["stop(\"boom\")", "f()", "g()"]);
    assert!(r.console.contains("before\n"));
    assert!(r.console.contains("Error in f() : boom\n"));
    assert!(
        !r.console.contains("after"),
        "evaluation must stop at the first error"
    );
}

#[test]
fn errors_from_c_code_are_caught_too() {
    let mut w = worker();
    let r = run(&mut w, "1 + 'a'");
    assert_eq!(r.outcome, Outcome::Error);
    assert_eq!(
        r.error.unwrap().message,
        "non-numeric argument to binary operator"
    );
}

#[test]
fn parse_error_reports_line_and_column_and_runs_nothing() {
    let mut w = worker();
    let r = run(&mut w, "x <- 1\ny <- (2 +\nz <- 3 3");
    assert_eq!(r.outcome, Outcome::ParseError);
    let e = r.error.expect("error");
    assert_eq!(e.line, Some(3));
    assert_eq!(e.column, Some(8));
    assert!(e.message.contains("unexpected"), "{}", e.message);
    let r = run(&mut w, "exists('x')");
    assert_eq!(
        r.console, "[1] FALSE\n",
        "nothing of the bad script may run"
    );
}

#[test]
fn s3_and_s4_print_methods_are_honoured() {
    let mut w = worker();
    let r = run(
        &mut w,
        r#"
        setClass("Person", representation(name = "character"))
        setMethod("show", "Person", function(object) cat("<Person:", object@name, ">\n"))
        new("Person", name = "Ada")
        print.money <- function(x, ...) cat("$", format(unclass(x), nsmall = 2), "\n")
        structure(3.5, class = "money")
        invisible(7)
        "#,
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.console, "<Person: Ada >\n$ 3.50 \n");
}

#[test]
fn variables_and_packages_persist_across_calls() {
    let mut w = worker();
    run(&mut w, "x <- 41; library(tools); options(digits = 4)");
    let r = run(&mut w, "x + 1; 'package:tools' %in% search(); pi");
    assert_eq!(r.console, "[1] 42\n[1] TRUE\n[1] 3.142\n");
}

#[test]
fn messages_and_warnings_inside_functions() {
    let mut w = worker();
    let r = run(
        &mut w,
        "f <- function(x) { warning('careful'); message('note'); x }\ny <- f(1)\ny",
    );
    assert_eq!(r.outcome, Outcome::Complete);
    assert_eq!(r.warnings, vec!["In f(1) : careful".to_string()]);
    assert_eq!(
        r.console,
        "note\nWarning message:\nIn f(1) : careful\n[1] 1\n"
    );
}

#[test]
fn suppressed_and_caught_conditions_stay_quiet() {
    let mut w = worker();
    let r = run(
        &mut w,
        "suppressWarnings(log(-1)); suppressMessages(message('x')); try(stop('quiet'), silent = TRUE); tryCatch(stop('e'), error = function(e) 'handled')",
    );
    assert_eq!(r.outcome, Outcome::Complete);
    assert_eq!(r.console, "[1] NaN\n[1] \"handled\"\n");
    assert!(r.warnings.is_empty());
}

#[test]
fn non_utf8_and_very_long_lines_are_kept() {
    let mut w = worker();
    let r = run(&mut w, "cat(rawToChar(as.raw(c(0x61, 0xff, 0x62))), '\\n'); cat(strrep('x', 200000), '\\n', sep = '')");
    assert_eq!(r.outcome, Outcome::Complete);
    assert!(
        r.console.starts_with("a\u{fffd}b"),
        "{:?}",
        &r.console[..10]
    );
    assert!(r.console.contains(&"x".repeat(200_000)));
    let r = run(&mut w, "cat('h\u{e9}llo \u{4e16}\u{754c}\\n')");
    assert_eq!(r.console, "h\u{e9}llo \u{4e16}\u{754c}\n");
}

#[test]
fn working_directory_is_reset_before_each_call() {
    let mut w = worker();
    let dir = std::env::temp_dir();
    let opts = CallOptions {
        working_dir: Some(dir.clone()),
        ..CallOptions::default()
    };
    w.run("setwd('/')", &opts);
    let r = w.run("cat(getwd())", &opts);
    assert_eq!(
        r.console,
        std::fs::canonicalize(&dir).unwrap().display().to_string()
    );
}

#[test]
fn raw_output_that_bypasses_the_console_is_returned() {
    let mut w = worker();
    let r = run(
        &mut w,
        "invisible(system('echo from-a-child; echo child-err 1>&2'))",
    );
    assert_eq!(r.outcome, Outcome::Complete);
    assert!(r.console.contains("from-a-child\n"), "{:?}", r.console);
    assert!(r.console.contains("child-err\n"), "{:?}", r.console);
    // The next call does not get the previous call's raw output.
    let r = run(&mut w, "1");
    assert_eq!(r.console, "[1] 1\n");
}

#[test]
fn usage_and_timing_are_reported() {
    let mut w = worker();
    let r = run(&mut w, "x <- sum(as.numeric(1:1e6)); cat('ok\\n')");
    assert!(r.duration_ms > 0.0);
    assert!(r.usage.peak_rss_bytes > 10_000_000);
    assert_eq!(r.usage.output_bytes, 3);
}

#[test]
fn deep_recursion_ends_in_an_r_error_and_the_worker_lives() {
    let mut w = worker();
    let r = run(&mut w, "f <- function(n) f(n + 1); f(1)");
    assert_eq!(r.outcome, Outcome::Error, "{}", r.console);
    let msg = r.error.unwrap().message;
    assert!(
        msg.contains("C stack usage")
            || msg.contains("nested too deeply")
            || msg.contains("stack overflow"),
        "{msg}"
    );
    let r = run(
        &mut w,
        "options(expressions = 500000); f <- function(n) f(n + 1); f(1)",
    );
    assert_eq!(r.outcome, Outcome::Error, "{}", r.console);
    assert!(r.error.unwrap().message.contains("C stack usage"));
    assert_eq!(run(&mut w, "1 + 1").console, "[1] 2\n");
}

/// The call and traceback of an error are what R's deparse() writes for
/// them (one line; a longer call's first line and " ..."), whether the
/// worker writes them itself (calls of named functions on names and short
/// constants) or leaves them to R's deparser (operators, backticks,
/// non-ASCII strings, numbers in scientific notation, long calls).
#[test]
fn an_errors_call_and_traceback_are_what_deparse_writes() {
    let mut w = worker();
    let setup = run(
        &mut w,
        "f <- function(...) stop('x')\ng <- function(...) f(...)\n\
         d <- function(cl) { s <- deparse(cl, width.cutoff = 500L, nlines = 2L)\n\
         if (length(s) > 1L) paste0(s[[1L]], ' ...') else s }",
    );
    assert_eq!(setup.outcome, Outcome::Complete, "{}", setup.console);
    let long = format!("g({})", vec!["\"abcdefghij\""; 60].join(", "));
    let cases = [
        "g()".to_string(),
        r#"g("a\"b\\c\n\td", 'single', "")"#.into(),
        "g(1L, -2L, 0, 3, 99999, 1e5, 1500000, 1e15, 0.5, -7)".into(),
        "g(TRUE, FALSE, NA, NA_integer_, NA_real_, NA_character_, NULL, Inf, NaN)".into(),
        "g(n = 1, .x = 'a', x, T, ..1)".into(),
        "g(h(k(1, z = 2)), list())".into(),
        "g(base::paste('a'), 1 + 2, x[1], -y, `my var`, 'é', \"\\x01\")".into(),
        "g(function(x) x, if (TRUE) 1, {1}, (2), ~x)".into(),
        "g(`if`(TRUE, 1), `my fun`(1), 1:3, c(a = 1))".into(),
        long,
    ];
    for code in &cases {
        let r = run(&mut w, code);
        assert_eq!(r.outcome, Outcome::Error, "{code}: {}", r.console);
        let e = r.error.expect("error");
        assert_eq!(e.message, "x");
        assert_eq!(e.call.as_deref(), Some("f(...)"), "{code}");
        let expected = run(
            &mut w,
            &format!("cat(d(quote(stop('x'))), d(quote(f(...))), d(quote({code})), sep = '\\n')"),
        );
        assert_eq!(expected.outcome, Outcome::Complete, "{}", expected.console);
        let expected: Vec<&str> = expected.console.lines().collect();
        assert_eq!(e.traceback, expected, "{code}");
    }
    // With scipen set, R may write a whole number either way: R decides.
    let r = run(&mut w, "options(scipen = 5); g(1e5, 123)");
    let e = r.error.expect("error");
    let expected = run(&mut w, "cat(d(quote(g(1e5, 123))))");
    assert_eq!(e.traceback[2], expected.console);
    assert_eq!(e.traceback[2], "g(100000, 123)");
    // An error R's C code signals: the call is the primitive's.
    let r = run(
        &mut w,
        "options(scipen = 0); h <- function(v) sqrt(v); h('a')",
    );
    let e = r.error.expect("error");
    assert_eq!(e.call.as_deref(), Some("sqrt(v)"));
    assert_eq!(e.traceback, vec!["h(\"a\")"]);
}
