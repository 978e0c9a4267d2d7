//! R as at the prompt: each top-level expression at frame 0 in the global
//! environment, `.Last.value`, `last.warning` (what `warnings()` shows),
//! the user's global calling handlers kept, `keep.source` read before each
//! expression as Rscript reads it,
//! inputs R would refuse checked before R sees them, a failed table
//! hydration that leaves the session alive, the working directory reset
//! per confined call, and R's recommended packages under confinement.

use rvisor::{Outcome, Segment};
use rvisor_ffi_tests::confined::run as session_run;
use rvisor_ffi_tests::{run, worker, TestDir};

#[test]
fn code_runs_at_frame_zero_with_no_call() {
    let mut w = worker();
    let r = run(
        &mut w,
        "cat('nframe:', sys.nframe(), '\\n')\nprint(sys.call())",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.console, "nframe: 0 \nNULL\n");
}

#[test]
fn parent_frame_of_a_top_level_call_is_the_global_environment() {
    let mut w = worker();
    let r = run(
        &mut w,
        "f <- function() parent.frame(2); environmentName(f())",
    );
    assert_eq!(r.console, "[1] \"R_GlobalEnv\"\n");
}

#[test]
fn the_run_as_script_guard_runs_main() {
    let mut w = worker();
    let r = run(
        &mut w,
        "main <- function() cat('main ran\\n')\nif (sys.nframe() == 0L) main()",
    );
    assert_eq!(r.console, "main ran\n");
}

#[test]
fn match_fun_without_descending_finds_no_function_as_in_r() {
    let mut w = worker();
    let r = run(&mut w, "outer <- 1:5; match.fun(outer, descend = FALSE)");
    assert_eq!(r.outcome, Outcome::Error, "{}", r.console);
    assert!(
        // R's own (odd) message: one "found non-function" per element.
        r.error.unwrap().message.contains("found non-function '1'"),
        "{}",
        r.console
    );
}

#[test]
fn top_level_return_is_an_error() {
    let mut w = worker();
    let r = run(&mut w, "return(1)\ncat('after\\n')");
    assert_eq!(r.outcome, Outcome::Error);
    assert_eq!(
        r.error.unwrap().message,
        "no function to return from, jumping to top level"
    );
    assert!(!r.console.contains("after"));
}

#[test]
fn last_value_is_set_within_and_across_calls() {
    let mut w = worker();
    let r = run(&mut w, "6 * 7\n.Last.value + 1");
    assert_eq!(r.console, "[1] 42\n[1] 43\n");
    let r = run(&mut w, "invisible(10)");
    assert_eq!(r.console, "");
    let r = run(&mut w, ".Last.value");
    assert_eq!(r.console, "[1] 10\n");
}

#[test]
fn warnings_shows_the_last_expression_that_warned_as_at_the_prompt() {
    // R (interactive and Rscript alike) sets last.warning after each
    // top-level expression that deferred warnings; warnings() prints it.
    let mut w = worker();
    let r = run(&mut w, "exists('last.warning', envir = baseenv())");
    assert_eq!(r.console, "[1] FALSE\n");
    let r = run(&mut w, "x <- log(-1)");
    assert_eq!(r.warnings, vec!["In log(-1) : NaNs produced".to_string()]);
    let r = run(&mut w, "warnings()");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.console, "Warning message:\nIn log(-1) : NaNs produced\n");
    // A call, and an expression, without warnings leave it as it was.
    let r = run(&mut w, "1 + 1\nnames(last.warning)");
    assert_eq!(r.console, "[1] 2\n[1] \"NaNs produced\"\n");
    // An expression that warns replaces it, within the same call too,
    // with every warning it deferred and their calls.
    let r = run(
        &mut w,
        "f <- function() { warning('a'); warning('b') }\nf()\n\
         str(last.warning)",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(
        r.console
            .ends_with("List of 2\n $ a: language f()\n $ b: language f()\n"),
        "{:?}",
        r.console
    );
    // An error after a warning: the warning is still R's record.
    let r = run(
        &mut w,
        "g <- function() { warning('before'); stop('boom') }\ng()",
    );
    assert_eq!(r.outcome, Outcome::Error);
    let r = run(&mut w, "cat(names(last.warning))");
    assert_eq!(r.console, "before");
    // warn = 1 prints at once and keeps no record; warn < 0 ignores.
    let r = run(
        &mut w,
        "options(warn = 1); warning('now'); options(warn = -1); warning('never')\n\
         options(warn = 0); cat(names(last.warning))",
    );
    assert!(r.console.ends_with("before"), "{:?}", r.console);
    // At most getOption('nwarnings') per expression, as R keeps.
    let r = run(
        &mut w,
        "for (i in 1:60) warning(paste('w', i))\ncat(length(last.warning), names(last.warning)[50])",
    );
    let out: String = r
        .segments
        .iter()
        .filter_map(|s| match s {
            Segment::Stdout { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(out, "50 w 50", "{}", r.console);
}

#[test]
fn task_callbacks_run_after_each_top_level_expression_as_in_r() {
    // R's REPL and Rscript run them after each expression (its value
    // printed first), from the one that added the callback on, across
    // calls, until the callback returns FALSE. The expected text is
    // Rscript's for the same lines.
    let mut w = worker();
    let r = run(
        &mut w,
        "n <- 0\n\
         id <- addTaskCallback(function(expr, value, ok, visible) {\n\
           n <<- n + 1; cat('after', deparse(expr)[1], visible, '\\n'); n < 4 })\n\
         1 + 1\n\
         invisible(2)",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(
        r.console,
        "after id <- addTaskCallback(function(expr, value, ok, visible) { FALSE \n\
         [1] 2\nafter 1 + 1 TRUE \nafter invisible(2) FALSE \n"
    );
    let r = run(
        &mut w,
        "x <- 3\ny <- 4\ncat(n, getTaskCallbackNames(), '\\n')",
    );
    assert_eq!(r.console, "after x <- 3 FALSE \n4  \n");
}

#[test]
fn user_global_calling_handlers_work_and_persist_across_calls() {
    let mut w = worker();
    let r = run(
        &mut w,
        "seen <- character()\n\
         globalCallingHandlers(message = function(m) seen <<- c(seen, conditionMessage(m)))\n\
         message('one')",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    // The user's handler ran and R's (rvisor's) reporting still did too.
    assert!(r
        .segments
        .iter()
        .any(|s| matches!(s, Segment::Message { text } if text == "one\n")));
    let r = run(&mut w, "message('two'); cat(seen, sep = '|')");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(r.console.ends_with("one\n|two\n"), "{:?}", r.console);
    // Warnings and errors are still reported with the user's handlers set.
    let r = run(&mut w, "log(-1); stop('boom')");
    assert_eq!(r.warnings, vec!["In log(-1) : NaNs produced".to_string()]);
    assert_eq!(r.error.unwrap().message, "boom");
    let r = run(
        &mut w,
        "globalCallingHandlers(NULL); message('three'); cat(length(seen))",
    );
    assert!(r.console.ends_with("2"), "{:?}", r.console);
}

#[test]
fn tracebacks_are_unchanged() {
    let mut w = worker();
    let r = run(
        &mut w,
        "f <- function() stop('boom')\ng <- function() f()\ng()",
    );
    let e = r.error.expect("error");
    assert_eq!(e.call.as_deref(), Some("f()"));
    assert_eq!(e.traceback, vec!["stop(\"boom\")", "f()", "g()"]);
    assert_eq!(r.console, "Error in f() : boom\n");
    let r = run(&mut w, "y_not_there");
    let e = r.error.expect("error");
    assert_eq!(e.call, None);
    assert_eq!(r.console, "Error: object 'y_not_there' not found\n");
}

#[test]
fn errors_in_print_methods_and_interrupt_free_calls_report_once() {
    let mut w = worker();
    let r = run(
        &mut w,
        "print.boom <- function(x, ...) stop('no print')\nstructure(1, class = 'boom')",
    );
    assert_eq!(r.outcome, Outcome::Error);
    assert_eq!(r.console, "Error in print.boom(x) : no print\n");
    assert_eq!(run(&mut w, "1 + 1").console, "[1] 2\n");
}

/// What Rscript prints on stdout for `code` (a file of that text, run from
/// a clean environment as the differential test runs it).
fn rscript(code: &str) -> String {
    let dir = TestDir::new("rscript");
    let file = dir.path().join("code.R");
    std::fs::write(&file, code).expect("write the script");
    let out = std::process::Command::new("Rscript")
        .arg("--vanilla")
        .arg(&file)
        .env("LANG", "C.UTF-8")
        .output()
        .expect("Rscript runs");
    assert!(
        out.status.success(),
        "Rscript failed on {code:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// A call's standard output (the console holds stderr too).
fn stdout(r: &rvisor::RunResult) -> String {
    r.segments
        .iter()
        .filter_map(|s| match s {
            Segment::Stdout { text } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

/// Prints what R kept of `f`'s source: the srcref's eight numbers, its
/// srcfile's lines and filename, and the function as printed.
const SHOW_SOURCE: &str = "show <- function(f) { s <- attr(f, 'srcref'); \
    if (is.null(s)) return(cat('no srcref\\n')); print(as.integer(s)); \
    sf <- attr(s, 'srcfile'); print(sf$lines); print(sf$filename); \
    print(class(sf)); print(ls(sf, all.names = TRUE)); print(f) }\n";

#[test]
fn keep_source_applies_to_the_expressions_after_it_as_under_rscript() {
    // Rscript parses one top-level expression at a time with the options
    // then in force; its srcrefs count lines from the expression's own
    // text (from after the previous `;` or newline, its trailing comment
    // included). Comment lines, `;`, a `;` inside a comment, a function
    // spanning lines, UTF-8, and keep.source turned off again mid-line.
    let lines = [
        "f0 <- function(x) x   # before: kept as deparsed",
        "# a comment line",
        "options(keep.source = TRUE)",
        "x <- 1 # c; y <- 2",
        "",
        "a <- 1; f1 <- function(a,",
        "                       b) {",
        "  a + b  # the sum",
        "}; f2 <- function() \"\u{e9}t\u{e9}\" # accents",
        "\tf3 <- function() 3; options(keep.source = FALSE); f4 <- function() 4",
        "for (f in list(f0, f1, f2, f3, f4)) show(f)",
        "is.null(utils::getParseData(f1))",
        "names(attributes(body(f1)))",
    ];
    let code = format!("{SHOW_SOURCE}{}\n", lines.join("\n"));
    let expected = rscript(&code);
    assert!(
        expected.contains("a + b  # the sum"),
        "Rscript kept f1's source:\n{expected}"
    );
    let mut w = worker();
    let r = run(&mut w, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(stdout(&r), expected);
    // Without keep.source (Rscript's default) nothing is kept.
    let code = format!("{SHOW_SOURCE}g <- function(x) {{\n  x # gone\n}}\nshow(g)\ng\n");
    let expected = rscript(&code);
    assert!(expected.starts_with("no srcref\n"), "{expected}");
    let r = run(&mut w, &code);
    assert_eq!(stdout(&r), expected);
}

#[test]
fn keep_source_set_in_one_call_applies_to_the_next() {
    let mut w = worker();
    let r = run(&mut w, "options(keep.source = TRUE)");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    let r = run(
        &mut w,
        "\n# why\nf <- function(x) {\n  x * 2 # doubled\n}\nf\nas.integer(attr(f, 'srcref'))",
    );
    // Lines count from the expression's own first line (Rscript's too:
    // blank and comment lines are parsed apart); `function` is column 6.
    assert_eq!(
        stdout(&r),
        "function(x) {\n  x * 2 # doubled\n}\n[1] 1 6 3 1 6 1 1 3\n",
        "{}",
        r.console
    );
    // A syntax error anywhere still runs nothing, and says where.
    let r = run(&mut w, "cat('ran')\nf <- function( {\n");
    assert_eq!(r.outcome, Outcome::ParseError, "{}", r.console);
    assert_eq!(stdout(&r), "", "{}", r.console);
    let e = r.error.expect("the parse error");
    assert_eq!((e.line, e.column), (Some(2), Some(16)), "{}", e.message);
    // Errors and tracebacks read as without source references.
    let r = run(
        &mut w,
        "h <- function() stop('boom')\nk <- function() h()\nk()",
    );
    let e = r.error.expect("error");
    assert_eq!(e.call.as_deref(), Some("h()"));
    assert_eq!(e.traceback, vec!["stop(\"boom\")", "h()", "k()"]);
}

#[test]
fn r_s_remove_source_example_runs_as_under_rscript() {
    // utils' own example of removeSource() sets keep.source = TRUE and
    // checks, in the same script, that the function after it has a srcref.
    let example =
        rscript("tools::Rd2ex(utils:::.getHelpFile(help('removeSource', package = 'utils')))");
    assert!(example.contains("options(keep.source = TRUE)"), "{example}");
    let expected = rscript(&example);
    let mut w = worker();
    let r = run(&mut w, &example);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(stdout(&r), expected);
}

/// Runs `cat('ran')` with `ctx`, which the worker must refuse before any
/// code runs (as a host that skips the supervisor's checks would send it):
/// an error whose message says each of `says`, and nothing printed.
fn refused_before_anything_ran(w: &mut rvisor::Worker, ctx: &rvisor::CallContext, says: &[&str]) {
    let r = w.run_call(
        rvisor::ids::execution_id(),
        "cat('ran')",
        &rvisor::CallOptions::default(),
        ctx,
    );
    assert_eq!(r.outcome, Outcome::Error, "{}", r.console);
    let m = r.error.expect("the refusal is an error").message;
    for s in says {
        assert!(m.contains(s), "{m:?} does not say {s:?}");
    }
    assert!(
        !r.segments
            .iter()
            .any(|s| matches!(s, Segment::Stdout { .. })),
        "the code ran: {}",
        r.console
    );
}

#[test]
fn a_name_over_r_s_limit_is_refused_by_the_worker_and_it_lives() {
    // A host that skips the supervisor's checks: the worker refuses it.
    let mut w = worker();
    let name = "a".repeat(20_000);
    let ctx = rvisor::CallContext {
        variables: vec![(name, serde_json::json!(3))],
        ..Default::default()
    };
    refused_before_anything_ran(&mut w, &ctx, &["10000 bytes", "nothing ran"]);
    assert_eq!(run(&mut w, "1 + 1").console, "[1] 2\n");
}

#[test]
fn a_string_r_cannot_hold_is_refused_and_the_worker_lives() {
    let mut w = worker();
    let ctx = rvisor::CallContext {
        variables: vec![("x".into(), serde_json::json!("a\u{0}b"))],
        ..Default::default()
    };
    refused_before_anything_ran(&mut w, &ctx, &["NUL"]);
    assert_eq!(run(&mut w, "1 + 1").console, "[1] 2\n");
}

#[test]
fn a_table_whose_hydration_fails_is_an_error_and_the_worker_lives() {
    let dir = rvisor_ffi_tests::TestDir::new("prompt-table");
    let csv = dir.path().join("t.csv");
    // A NUL inside a value: R strings cannot hold it.
    std::fs::write(&csv, "a,b\n1,x\n2,\"y\u{0}z\"\n").unwrap();
    let arrow = dir.path().join("t.arrow");
    rvisor_server::tables::convert_file(rvisor_server::tables::TableFormat::Csv, &csv, &arrow)
        .expect("the CSV converts");
    let mut w = worker();
    let ctx = rvisor::CallContext {
        tables: vec![("df".into(), arrow)],
        ..Default::default()
    };
    refused_before_anything_ran(&mut w, &ctx, &["could not be loaded", "nothing ran"]);
    let r = run(
        &mut w,
        "exists('df', envir = globalenv(), inherits = FALSE)",
    );
    assert_eq!(r.console, "[1] FALSE\n");
}

fn confined() -> rvisor::Supervisor {
    rvisor::Supervisor::new(rvisor::SupervisorConfig {
        confinement: rvisor::Confinement {
            uid_base: 2_050_000_000 + (std::process::id() % 1_000_000) * 16,
            uid_count: 16,
            ..rvisor::Confinement::default()
        },
        ..rvisor::SupervisorConfig::default()
    })
    .expect("a confined supervisor")
}

#[test]
fn setwd_does_not_last_into_the_next_confined_call() {
    let sup = confined();
    let s = sup.session().expect("a session");
    let start = session_run(&s, "cat(getwd())").console;
    assert!(!start.is_empty());
    let r = session_run(
        &s,
        "d <- file.path(tempdir(), 'sub'); dir.create(d); setwd(d); cat(getwd())",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_ne!(r.console, start);
    assert_eq!(session_run(&s, "cat(getwd())").console, start);
}

#[test]
fn recommended_packages_load_confined() {
    let sup = confined();
    let s = sup.session().expect("a session");
    let r = session_run(
        &s,
        "library(MASS); library(lattice); library(Matrix); library(survival)\n\
         cat(nrow(MASS::Boston), '\\n')",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(r.console.contains("506"), "{}", r.console);
}

#[test]
fn r_s_doc_share_and_include_directories_are_where_r_says_confined() {
    // The `R` front-end script exports them; embedded R had none, so
    // strwrap()'s and news()'s examples failed only under rvisor.
    let sup = confined();
    let s = sup.session().expect("a session");
    let r = session_run(
        &s,
        "cat(file.exists(file.path(R.home('doc'), 'THANKS')), \
         dir.exists(R.home('share')), file.exists(file.path(R.home('include'), 'R.h')), '\\n')\n\
         x <- strwrap(readLines(file.path(R.home('doc'), 'THANKS'))[1:3], 30)\n\
         cat(length(x) > 0, '\\n')",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.console, "TRUE TRUE TRUE \nTRUE \n");
}

#[test]
fn windows_line_endings_run_as_under_rscript_on_every_path() {
    // Code written on Windows (or sent by a client that ends lines with CR
    // LF): Rscript reads it as LF, a multi-line string included; R's own
    // parse(text =) would refuse the CR as "unexpected input".
    let code = "x <- 1\r\ny <- 2\r\ncat(x + y, '\\n')\r\ns <- 'a\r\nb'\r\ncat(nchar(s), '\\n')\r\n";
    let expected = rscript(code);
    assert_eq!(expected, "3 \n3 \n");
    let mut w = worker();
    let r = run(&mut w, code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(stdout(&r), expected);
    // A syntax error is reported on its line, as with LF.
    let r = run(&mut w, "x <- 1\r\ny <- (2\r\n");
    assert_eq!(r.outcome, Outcome::ParseError, "{}", r.console);
    // Sessions, one-shot runs and validation: the same through the
    // supervisor.
    let sup = confined();
    let s = sup.session().expect("a session");
    let r = session_run(&s, code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(stdout(&r), expected);
    let r = sup.run_once(code, &rvisor::CallOptions::one_shot(None));
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(stdout(&r), expected);
    let v = sup.validate(code);
    assert!(v.valid, "{:?}", v.problems);
    let v = sup.validate("x <- 1\r\ny <- (2\r\n");
    assert!(!v.valid);
    assert_eq!(v.problems[0].kind, "syntax", "{:?}", v.problems);
    assert_eq!(v.problems[0].line, Some(3), "{:?}", v.problems);
}
