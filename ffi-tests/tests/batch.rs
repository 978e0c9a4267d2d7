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

/// `--input` and a manifest line's `inputs` in, `--output-dir` out: every
/// job reads the common input, a job reads its own (and no other job sees
/// it), what each wrote is copied to DIR/<id>/ and listed in its result
/// line with the sha256 of the bytes saved; an input it did not change, a
/// job that wrote nothing and tempdir() give no artifacts; a failed job
/// still gives back what it wrote.
fn inputs_and_artifacts(confined: bool) {
    use sha2::Digest;
    let d = TestDir::new("rvisor-batch-files");
    write(d.path(), "data.csv", "x\n1\n2\n3\n");
    std::fs::create_dir(d.path().join("own")).unwrap();
    write(d.path(), "own/extra.txt", "seven\n");
    write(
        d.path(),
        "m.jsonl",
        concat!(
            r#"{"id": "sum", "code": "d <- read.csv('data.csv'); e <- readLines('extra.txt'); dir.create('out'); write.csv(data.frame(s = sum(d$x), e = e), 'out/sum.csv', row.names = FALSE); writeLines('t', file.path(tempdir(), 'scratch'))", "inputs": ["own/extra.txt"]}"#,
            "\n",
            r#"{"id": "nothing", "code": "cat(nrow(read.csv('data.csv')), file.exists('extra.txt'))"}"#,
            "\n",
            r#"{"id": "fails", "code": "writeLines('partial', 'p.txt'); stop('boom')"}"#,
            "\n",
        ),
    );
    let mut cmd = Command::new(rvisor_bin());
    if !confined {
        cmd.arg("--unconfined");
    }
    let out = cmd
        .args([
            "batch",
            "--manifest",
            "m.jsonl",
            "--input",
            "data.csv",
            "--output-dir",
            "outs",
            "--ordered",
            "-j",
            "2",
        ])
        .current_dir(d.path())
        .output()
        .expect("rvisor batch runs");
    assert_eq!(
        out.status.code(),
        Some(1),
        "one job failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let l = lines(&out.stdout);
    assert_eq!(l.len(), 3, "{l:?}");
    let sha = |b: &[u8]| -> String {
        sha2::Sha256::digest(b)
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect()
    };
    // sum: its own input and the common one read; one artifact.
    let r = &l[0]["result"];
    assert_eq!(r["outcome"], "complete", "{r}");
    let arts = r["artifacts"].as_array().expect("artifacts");
    assert_eq!(arts.len(), 1, "{r}");
    assert_eq!(arts[0]["name"], "out/sum.csv");
    let saved = std::fs::read(d.path().join("outs/sum/out/sum.csv")).unwrap();
    assert_eq!(saved, b"\"s\",\"e\"\n6,\"seven\"\n");
    assert_eq!(arts[0]["size"], saved.len());
    assert_eq!(arts[0]["sha256"], sha(&saved));
    assert!(arts[0]["uri"]
        .as_str()
        .unwrap()
        .ends_with("/outs/sum/out/sum.csv"));
    // nothing: the common input only; nothing written, nothing saved.
    let r = &l[1]["result"];
    assert_eq!(r["console"], "3 FALSE", "{r}");
    assert!(r.get("artifacts").is_none(), "{r}");
    assert!(!d.path().join("outs/nothing").exists());
    // fails: an error, and what it wrote before it.
    let r = &l[2]["result"];
    assert_eq!(r["outcome"], "error", "{r}");
    assert_eq!(r["artifacts"][0]["name"], "p.txt", "{r}");
    assert_eq!(
        std::fs::read(d.path().join("outs/fails/p.txt")).unwrap(),
        b"partial\n"
    );
    // A missing input is refused before anything runs, naming it.
    let out = batch(
        &["--manifest", "m.jsonl", "--input", "missing.csv"],
        d.path(),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("missing.csv") && err.contains("not a readable file"),
        "{err}"
    );
}

#[test]
fn unconfined_batch_takes_inputs_and_saves_each_jobs_artifacts() {
    inputs_and_artifacts(false);
}

#[test]
fn confined_batch_takes_inputs_and_saves_each_jobs_artifacts() {
    inputs_and_artifacts(true);
}
