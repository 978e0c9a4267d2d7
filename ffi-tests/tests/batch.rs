//! `rvisor batch` end to end: directory and manifest input, per-script
//! timeouts, a crashing script that does not stop the batch, `--resume`,
//! ordered output, isolation between scripts, plots per script, and
//! deterministic reruns equal byte for byte. The workers are unconfined
//! (confinement is not the subject; it is the same pool either way).

use rvisor_ffi_tests::{rvisor_bin, TestDir};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

fn batch(args: &[&str], dir: &Path) -> Output {
    Command::new(rvisor_bin())
        .arg("--unconfined")
        .arg("batch")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("rvisor batch runs")
}

fn lines(text: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(text)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).expect("write a script");
}

#[test]
fn a_directory_runs_each_script_alone_in_order_and_a_failure_does_not_stop_it() {
    let d = TestDir::new("rvisor-batch-dir");
    let s = d.path().join("scripts");
    std::fs::create_dir(&s).unwrap();
    write(&s, "a.R", "x <- 41\ncat(x + 1, '\\n')\nplot(1:3)\n");
    write(&s, "b.R", "stop('boom')\n");
    write(&s, "c.R", "cat(exists('x'), '\\n')\n");
    write(&s, "d.R", "tools::pskill(Sys.getpid(), 9L)\n");
    write(&s, "e.R", "cat('after the crash\\n')\n");
    write(&s, "notes.txt", "not a script");
    let out = batch(
        &["scripts", "-j", "2", "--ordered", "--plots-dir", "plots"],
        d.path(),
    );
    assert_eq!(out.status.code(), Some(1), "a script failed: exit 1");
    let l = lines(&out.stdout);
    let ids: Vec<&str> = l.iter().map(|v| v["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        [
            "scripts/a.R",
            "scripts/b.R",
            "scripts/c.R",
            "scripts/d.R",
            "scripts/e.R"
        ]
    );
    assert_eq!(l[0]["result"]["console"], "42 \n");
    assert_eq!(l[1]["result"]["outcome"], "error");
    assert_eq!(
        l[2]["result"]["console"], "FALSE \n",
        "isolated: no x from a.R"
    );
    assert!(
        ["worker_exited", "worker_failed"].contains(&l[3]["result"]["outcome"].as_str().unwrap()),
        "{}",
        l[3]
    );
    assert_eq!(l[4]["result"]["console"], "after the crash\n");
    assert!(d.path().join("plots/scripts_a.R/plot-001.png").is_file());
    let summary = String::from_utf8_lossy(&out.stderr);
    assert!(summary.contains("5 scripts"), "{summary}");
    assert!(summary.contains("error"), "{summary}");
}

#[test]
fn a_manifest_sets_code_variables_and_timeouts_and_resume_runs_only_the_rest() {
    let d = TestDir::new("rvisor-batch-manifest");
    write(d.path(), "s.R", "cat(n * 2, '\\n')\n");
    write(
        d.path(),
        "m.jsonl",
        concat!(
            r#"{"id": "file", "file": "s.R", "variables": {"n": 21}}"#,
            "\n",
            r#"{"id": "slow", "code": "Sys.sleep(30)", "timeout_seconds": 1}"#,
            "\n",
        ),
    );
    let out = batch(&["--manifest", "m.jsonl", "--out", "r.jsonl"], d.path());
    assert_eq!(out.status.code(), Some(1), "the slow one timed out");
    let first = std::fs::read(d.path().join("r.jsonl")).unwrap();
    let l = lines(&first);
    let by_id = |id: &str| l.iter().find(|v| v["id"] == id).cloned().unwrap();
    assert_eq!(by_id("file")["result"]["console"], "42 \n");
    assert_eq!(by_id("slow")["result"]["outcome"], "timed_out");
    // One more line; --resume runs only it and keeps the first results.
    let mut m = std::fs::read_to_string(d.path().join("m.jsonl")).unwrap();
    m.push_str("{\"id\": \"new\", \"code\": \"cat('new\\\\n')\"}\n");
    std::fs::write(d.path().join("m.jsonl"), m).unwrap();
    let out = batch(
        &["--manifest", "m.jsonl", "--out", "r.jsonl", "--resume"],
        d.path(),
    );
    assert_eq!(out.status.code(), Some(0), "only the new one ran");
    let after = std::fs::read(d.path().join("r.jsonl")).unwrap();
    assert!(
        after.starts_with(&first),
        "earlier results kept as they were"
    );
    let l = lines(&after);
    assert_eq!(l.len(), 3);
    assert_eq!(l[2]["id"], "new");
    assert_eq!(l[2]["result"]["console"], "new\n");
}

#[test]
fn seeded_runs_are_equal_byte_for_byte() {
    let d = TestDir::new("rvisor-batch-seed");
    for i in 0..4 {
        write(
            d.path(),
            &format!("s{i}.R"),
            "cat(round(runif(3), 6), '\\n'); print(format(as.POSIXct(0, origin = '1970-01-01'), tz = ''))\n",
        );
    }
    let run = |out: &str| {
        let o = batch(
            &[".", "--seed", "7", "--ordered", "-j", "2", "--out", out],
            d.path(),
        );
        assert_eq!(
            o.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::read(d.path().join(out)).unwrap()
    };
    let a = run("a.jsonl");
    let b = run("b.jsonl");
    assert_eq!(
        String::from_utf8_lossy(&a),
        String::from_utf8_lossy(&b),
        "two seeded runs differ"
    );
    let l = lines(&a);
    assert_eq!(l.len(), 4);
    // The same seed in every fresh worker: the same numbers in each script.
    assert_eq!(l[0]["result"]["console"], l[3]["result"]["console"]);
    assert!(
        l[0]["result"]["console"]
            .as_str()
            .unwrap()
            .contains("1970-01-01"),
        "TZ is UTC: {}",
        l[0]
    );
}

#[test]
fn bad_input_says_what_to_fix() {
    let d = TestDir::new("rvisor-batch-bad");
    let out = batch(&[], d.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing to run"));
    write(d.path(), "m.jsonl", "{\"code\": \"1\"}\n");
    let out = batch(&["--manifest", "m.jsonl"], d.path());
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("needs an \"id\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
