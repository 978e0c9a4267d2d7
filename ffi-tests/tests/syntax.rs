//! Syntax errors from validation are R's own: over a corpus of broken
//! scripts (missing brackets, stray operators, bad strings, bad escapes,
//! incomplete input), the message, line and column rvisor reports are those
//! `Rscript` gives for `parse()` of the same file, in validation and in a
//! run's parse error alike.

use rvisor::{Confinement, PoolConfig, Supervisor, SupervisorConfig};
use rvisor_ffi_tests::TestDir;
use std::process::Command;

const BROKEN: &[&str] = &[
    "x <- c(1, 2\ny <- 3\n",
    "f <- function(x) {\n  x + 1\n",
    "y <- (1 + 2))\n",
    "z <- 1 +* 2\n",
    "if (TRUE) { 1 } else else { 2 }\n",
    "s <- 'unterminated\n",
    "s <- \"bad \\q escape\"\n",
    "a b\n",
    "x <- 1\n  ]\n",
    "lst[[1]\n",
    "function(x, x) x\n",
    "x <<- <- 1\n",
    "5 -> -> y\n",
    "`unterminated\n",
    "x <- 0x\n",
    "x <- 1e\n",
    "\"\\u{110000}\"\n",
    "for i in 1:3 print(i)\n",
];

/// R's own first line for `parse(file)`: `FILE:LINE:COL: MESSAGE`.
fn r_parse_error(file: &std::path::Path) -> (Option<u32>, Option<u32>, String) {
    let out = Command::new("Rscript")
        .args([
            "--vanilla",
            "-e",
            "tryCatch({parse(commandArgs(TRUE)[1]); cat('ok')}, error = function(e) cat(conditionMessage(e)))",
        ])
        .arg(file)
        .output()
        .expect("Rscript runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let first = text.lines().next().unwrap_or("").to_string();
    let prefix = format!("{}:", file.display());
    match first.strip_prefix(&prefix) {
        Some(rest) => {
            let mut parts = rest.splitn(3, ':');
            let line = parts.next().and_then(|l| l.parse().ok());
            let col = parts.next().and_then(|c| c.parse().ok());
            let msg = parts.next().unwrap_or("").trim().to_string();
            (line, col, msg)
        }
        None => (None, None, first),
    }
}

#[test]
fn syntax_errors_are_rs_own_message_line_and_column() {
    let sup = Supervisor::new(SupervisorConfig {
        pool: PoolConfig {
            zygote: false,
            spares: 0,
            preload: Some(Vec::new()),
            ..Default::default()
        },
        confinement: Confinement::unconfined(),
        ..SupervisorConfig::default()
    })
    .expect("a supervisor");
    let dir = TestDir::new("rvisor-syntax");
    let mut compared = 0;
    let mut mismatches = Vec::new();
    for (i, script) in BROKEN.iter().enumerate() {
        let file = dir.path().join(format!("broken{i}.R"));
        std::fs::write(&file, script).unwrap();
        let (line, col, msg) = r_parse_error(&file);
        let v = sup.validate_with(script, rvisor::StyleEngine::None);
        let syntax: Vec<_> = v.problems.iter().filter(|p| p.kind == "syntax").collect();
        if msg == "ok" {
            assert!(
                syntax.is_empty(),
                "{script:?}: R parses it, rvisor says {syntax:?}"
            );
            continue;
        }
        assert!(
            !v.valid,
            "{script:?} is invalid for R ({msg}) but valid for rvisor"
        );
        let p = syntax
            .first()
            .unwrap_or_else(|| panic!("{script:?}: no syntax problem in {v:?}"));
        if (p.message.as_str(), p.line, p.column) != (msg.as_str(), line, col) {
            mismatches.push(format!(
                "{script:?}: rvisor {:?} at {:?}:{:?}, R {msg:?} at {line:?}:{col:?}",
                p.message, p.line, p.column
            ));
        }
        // A run reports the same place (nothing runs).
        let r = sup.run_once(script, &rvisor::CallOptions::default());
        let e = r
            .error
            .clone()
            .unwrap_or_else(|| panic!("{script:?}: no error in {r:?}"));
        if r.outcome != rvisor::Outcome::ParseError || (e.line, e.column) != (line, col) {
            mismatches.push(format!(
                "{script:?}: run {} at {:?}:{:?}, R {msg:?} at {line:?}:{col:?}",
                r.outcome, e.line, e.column
            ));
        }
        compared += 1;
    }
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
    assert!(compared >= 15, "only {compared} scripts were broken for R");
    sup.shutdown();
}

#[test]
fn a_script_that_is_not_utf8_is_refused_before_r_with_what_to_do() {
    let dir = TestDir::new("rvisor-syntax-latin1");
    let file = dir.path().join("latin1.R");
    // "café" in Latin-1: R would read it under a Latin-1 locale only.
    std::fs::write(&file, b"x <- \"caf\xe9\"\n").unwrap();
    let out = Command::new(rvisor_ffi_tests::rvisor_bin())
        .args(["--unconfined", "validate"])
        .arg(&file)
        .output()
        .expect("rvisor validate runs");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not UTF-8") && err.contains("iconv"), "{err}");
}
