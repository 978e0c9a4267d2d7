//! Durable sessions end to end against real R: checkpoints, hibernation
//! and restore, restore after a kill, damaged checkpoints.
//!
//! Workers are confined (the default). Every wait is on a condition with a
//! deadline; no test asserts a duration.

use rvisor::checkpoint::{CheckpointStore, DirStore};
use rvisor::{Outcome, RunResult, SessionOptions, SessionState, Supervisor, SupervisorConfig};
use rvisor_ffi_tests::durable::{manual, ok, supervisor, wait_state};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long anything may take before the test calls it a hang.
const DEADLINE: Duration = Duration::from_secs(60);

/// A fresh state directory under the system's temporary directory.
fn state_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "rvisor-durable-{tag}-{}-{}",
        std::process::id(),
        rvisor::ids::random_hex(4)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The state every restore test builds: objects, a closure, an attached
/// package, an option, an environment variable, the RNG mid-stream, a file.
const BUILD: &str = r#"
x <- 1:10
df <- data.frame(a = 1:3, b = c("p", "q", "r"))
f <- function(n) n + length(x)
e <- new.env(); e$v <- 42; e2 <- e
library(splines)
options(digits = 4, rvisor.test = "kept")
Sys.setenv(RVISOR_TEST_VAR = "yes")
RNGkind("L'Ecuyer-CMRG")
set.seed(7); invisible(runif(3))
writeLines(c("line 1", "line 2"), "notes.txt")
dir.create("sub"); saveRDS(1:3, "sub/v.rds")
"#;

/// What the state must look like (the same in a twin that never slept).
const CHECK: &str = r#"cat(sum(x), nrow(df), f(1), identical(e, e2), e2$v,
  "package:splines" %in% search(), getOption("digits"), getOption("rvisor.test"),
  Sys.getenv("RVISOR_TEST_VAR"), RNGkind()[1], readLines("notes.txt")[2],
  sum(readRDS("sub/v.rds")), "\n")
cat(format(runif(3), digits = 15), "\n")"#;

#[test]
fn hibernate_and_restore_bring_back_objects_packages_options_rng_and_files() {
    let dir = state_dir("hib");
    let (sup, store) = supervisor(&dir);
    let s = sup.session_with(manual()).unwrap();
    let twin = sup.session_with(manual()).unwrap();
    ok(&s, BUILD);
    ok(&twin, BUILD);

    let info = s.checkpoint().expect("checkpoint");
    assert!(info.written);
    let m = &info.manifest;
    for name in ["x", "df", "f", "e", "e2", ".Random.seed"] {
        assert!(
            m.objects.iter().any(|o| o == name),
            "{name} in {:?}",
            m.objects
        );
    }
    assert!(
        m.attached.iter().any(|p| p == "splines"),
        "{:?}",
        m.attached
    );
    assert!(m.options_changed.iter().any(|o| o == "rvisor.test"));
    assert!(m.env_changed.iter().any(|o| o == "RVISOR_TEST_VAR"));
    assert!(m.files.iter().any(|f| f == "notes.txt"), "{:?}", m.files);
    assert!(m.files.iter().any(|f| f == "sub/v.rds"), "{:?}", m.files);
    assert!(store.path_of(&info.key).unwrap().is_file());

    // Nothing ran since: the same checkpoint, not written again.
    let again = s.checkpoint().unwrap();
    assert!(!again.written);

    s.hibernate();
    wait_state(&s, SessionState::Hibernated);
    assert_eq!(s.status().pid, None);

    let back = ok(&s, CHECK);
    let restored = back.session.restored.clone().expect("restored");
    assert_eq!(restored.reason, "hibernated");
    assert!(restored.lost.is_empty(), "{:?}", restored.lost);
    assert!(!back.session.fresh);
    assert!(
        back.console.contains("woke the session from hibernation"),
        "{}",
        back.console
    );
    let want = ok(&twin, CHECK);
    // The same values, the same RNG stream: the restored session's output
    // equals the twin's that never slept (after the one notice line).
    let body: String = back
        .console
        .lines()
        .filter(|l| !l.starts_with("rvisor:"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(body, want.console);
    assert!(
        want.console
            .starts_with("55 3 11 TRUE 42 TRUE 4 kept yes L'Ecuyer-CMRG line 2 6"),
        "{}",
        want.console
    );
    // Only the first result after the restore says so.
    assert!(ok(&s, "1").session.restored.is_none());
    s.close();
    twin.close();
    drop(sup);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn objects_that_cannot_be_saved_are_named_and_the_rest_comes_back() {
    let dir = state_dir("unsaved");
    let (sup, _store) = supervisor(&dir);
    let s = sup.session_with(manual()).unwrap();
    ok(
        &s,
        "keep <- 1:3; con <- textConnection('abc'); xp <- methods:::.newExternalptr()
         nested <- list(a = 1, p = xp)",
    );
    let info = s.checkpoint().unwrap();
    let mut unsaved: Vec<(String, String)> = info
        .manifest
        .unsaved
        .iter()
        .map(|u| (u.name.clone(), u.reason.clone()))
        .collect();
    unsaved.sort();
    assert_eq!(
        unsaved,
        vec![
            ("con".to_string(), "connection".to_string()),
            ("nested".to_string(), "external pointer".to_string()),
            ("xp".to_string(), "external pointer".to_string()),
        ]
    );
    s.hibernate();
    wait_state(&s, SessionState::Hibernated);
    let r = ok(
        &s,
        "cat(sum(keep), exists('con'), exists('xp'), exists('nested'), '\\n')",
    );
    let restored = r.session.restored.expect("restored");
    let mut lost = restored.lost.clone();
    lost.sort();
    assert_eq!(lost, vec!["con", "nested", "xp"]);
    assert!(r.console.contains("not restored: "), "{}", r.console);
    assert!(
        r.console.ends_with("6 FALSE FALSE FALSE \n"),
        "{}",
        r.console
    );
    drop(sup);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_call_killed_at_its_timeout_restores_the_last_checkpoint() {
    let dir = state_dir("kill");
    let (sup, _store) = supervisor(&dir);
    let s = sup
        .session_with(SessionOptions {
            grace: Duration::from_millis(300),
            ..manual()
        })
        .unwrap();
    ok(&s, "a <- 'checkpointed'; set.seed(1)");
    let info = s.checkpoint().unwrap();
    ok(&s, "b <- 'after the checkpoint'");
    // R holds interrupts off: the timeout's interrupt goes unanswered and
    // the worker is killed after the grace period.
    let killed = s
        .run_with(
            "suspendInterrupts(repeat {})",
            &rvisor::RunOptions {
                timeout: Some(Duration::from_millis(500)),
                ..Default::default()
            },
        )
        .unwrap()
        .wait();
    assert_eq!(killed.outcome, Outcome::TimedOut, "{}", killed.console);
    let r = ok(&s, "cat(a, exists('b'), runif(1), '\\n')");
    assert_eq!(r.session.reset_reason.as_deref(), Some("timeout"));
    assert!(!r.session.fresh);
    assert_eq!(r.session.generation, 2);
    let restored = r.session.restored.clone().expect("restored");
    assert_eq!(restored.reason, "timeout");
    assert_eq!(restored.checkpoint_at, info.manifest.taken_at());
    assert!(
        r.console
            .contains("restored the state from the checkpoint of"),
        "{}",
        r.console
    );
    assert!(
        r.console.ends_with("checkpointed FALSE 0.2655087 \n"),
        "{}",
        r.console
    );
    drop(sup);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_damaged_checkpoint_gives_a_fresh_session_that_says_why() {
    let dir = state_dir("damaged");
    let (sup, store) = supervisor(&dir);
    let s = sup.session_with(manual()).unwrap();
    ok(&s, "x <- rnorm(1000)");
    let info = s.checkpoint().unwrap();
    s.hibernate();
    wait_state(&s, SessionState::Hibernated);
    let path = store.path_of(&info.key).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    // Flip bytes inside the compressed state (after the magic, before the
    // manifest): the frame's checksum no longer matches.
    for b in &mut bytes[20..40] {
        *b ^= 0x5a;
    }
    std::fs::write(&path, &bytes).unwrap();
    let r = ok(&s, "exists('x')");
    let reason = r.session.reset_reason.clone().unwrap_or_default();
    assert!(reason.starts_with("restore_failed: "), "{reason}");
    assert!(reason.contains("damaged"), "{reason}");
    assert!(r.session.fresh);
    assert!(r.session.restored.is_none());
    assert!(r.console.contains("could not be restored"), "{}", r.console);
    assert!(r.console.ends_with("[1] FALSE\n"), "{}", r.console);
    // The session goes on.
    assert_eq!(ok(&s, "1 + 1").console, "[1] 2\n");
    drop(sup);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_idle_session_hibernates_by_itself_and_a_closed_one_leaves_no_checkpoint() {
    let dir = state_dir("idle");
    let (sup, store) = supervisor(&dir);
    let s = sup
        .session_with(SessionOptions {
            hibernate_after: Some(Duration::from_millis(300)),
            checkpoint_after: Some(Duration::from_millis(100)),
            ..SessionOptions::default()
        })
        .unwrap();
    ok(&s, "v <- 'slept'");
    wait_state(&s, SessionState::Hibernated);
    assert_eq!(store.list().unwrap(), vec![s.id().to_string()]);
    let r = ok(&s, "v");
    assert_eq!(r.session.restored.expect("restored").reason, "hibernated");
    assert!(r.console.ends_with("[1] \"slept\"\n"), "{}", r.console);
    s.close();
    let end = Instant::now() + DEADLINE;
    while !store.list().unwrap().is_empty() {
        assert!(
            Instant::now() < end,
            "the checkpoint of a closed session stays"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(sup);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn session_jsonl_checkpoints_and_rolls_back_to_the_checkpoint() {
    use std::io::{BufRead, BufReader, Write};
    let dir = state_dir("jsonl");
    let mut child = std::process::Command::new(rvisor_ffi_tests::rvisor_bin())
        .args(["session", "--jsonl", "--state-dir"])
        .arg(&dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the CLI");
    let mut stdin = child.stdin.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut ask = move |req: serde_json::Value| -> serde_json::Value {
        writeln!(stdin, "{req}").unwrap();
        let line = lines.recv_timeout(DEADLINE).expect("an answer");
        serde_json::from_str(&line).unwrap()
    };
    let r = ask(serde_json::json!({"id": 1, "op": "run", "code": "v <- 'saved'"}));
    assert_eq!(r["result"]["outcome"], "complete", "{r}");
    let c = ask(serde_json::json!({"id": 2, "op": "checkpoint"}));
    assert_eq!(c["checkpoint"]["written"], true, "{c}");
    assert!(
        c["checkpoint"]["manifest"]["objects"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("v")),
        "{c}"
    );
    ask(serde_json::json!({"id": 3, "op": "run", "code": "v <- 'changed'; w <- 1"}));
    let st = ask(serde_json::json!({"id": 4, "op": "restore"}));
    assert!(st.get("error").is_none(), "{st}");
    let r = ask(serde_json::json!({"id": 5, "op": "run", "code": "cat(v, exists('w'))"}));
    let r = &r["result"];
    assert_eq!(r["session"]["restored"]["reason"], "restore", "{r}");
    assert_eq!(r["session"]["reset_reason"], "restore", "{r}");
    assert!(
        r["console"].as_str().unwrap().ends_with("saved FALSE"),
        "{r}"
    );
    drop(ask);
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(dir);
}

// ---------------------------------------------------------------------------
// Restarts of `rvisor serve`

/// A JSON answer of the server (any status).
fn http(method: &str, url: &str, body: Option<serde_json::Value>) -> (u16, serde_json::Value) {
    let req = ureq::request(method, url).timeout(DEADLINE);
    let r = match body {
        Some(b) => req.send_json(b),
        None => req.call(),
    };
    let r = match r {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {url}: {e}"),
    };
    let status = r.status();
    let text = r.into_string().unwrap_or_default();
    (
        status,
        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null),
    )
}

/// `rvisor serve` keeping sessions in `state`.
fn serve_with_state(state: &std::path::Path) -> rvisor_ffi_tests::ServeBin {
    rvisor_ffi_tests::ServeBin::start(&[
        "--state-dir",
        state.to_str().unwrap(),
        "--hibernate-after-secs",
        "0",
    ])
}

/// Sends SIGTERM to the server.
fn terminate(s: &rvisor_ffi_tests::ServeBin) {
    // SAFETY: kill(2) of our own child process, which has not been reaped
    // (we hold its Child); no memory is involved.
    unsafe { libc::kill(s.child.id() as libc::pid_t, libc::SIGTERM) };
}

/// The server's exit (within the deadline).
fn exited(mut s: rvisor_ffi_tests::ServeBin) -> std::process::ExitStatus {
    rvisor_ffi_tests::wait_for("the server to exit after SIGTERM", DEADLINE, || {
        s.child.try_wait().ok().flatten()
    })
}

/// SIGTERM, then the exit.
fn stop(s: rvisor_ffi_tests::ServeBin) -> std::process::ExitStatus {
    terminate(&s);
    exited(s)
}

fn session_run(base: &str, id: &str, code: &str) -> serde_json::Value {
    let (status, r) = http(
        "POST",
        &format!("{base}/v1/sessions/{id}/run"),
        Some(serde_json::json!({ "code": code })),
    );
    assert_eq!(status, 200, "{code}: {r}");
    assert_eq!(r["outcome"], "complete", "{code}: {r}");
    r
}

#[test]
fn a_restart_of_the_server_keeps_every_session_and_the_call_in_flight_finishes() {
    let state = state_dir("restart");
    let gate = state.join("gate");
    let srv = serve_with_state(&state);
    let base = format!("http://{}", srv.addr);
    let new_session = |base: &str, body: serde_json::Value| {
        let (status, s) = http("POST", &format!("{base}/v1/sessions"), Some(body));
        assert_eq!(status, 201, "{s}");
        s["id"].as_str().unwrap().to_string()
    };
    // One session with state, one with its own options, one never used.
    let a = new_session(&base, serde_json::json!({}));
    let b = new_session(&base, serde_json::json!({"plot_width": 321}));
    let unused = new_session(&base, serde_json::json!({}));
    session_run(&base, &a, BUILD);
    let before = session_run(&base, &a, CHECK)["console"].clone();
    session_run(&base, &b, "kept <- 'b'");
    // A call in flight at SIGTERM: the drain lets it finish.
    let in_flight = {
        let (base, a, gate) = (base.clone(), a.clone(), gate.display().to_string());
        std::thread::spawn(move || {
            session_run(
                &base,
                &a,
                &format!("while (!file.exists('{gate}')) Sys.sleep(0.02); late <- 'done'"),
            )
        })
    };
    rvisor_ffi_tests::wait_for("the call to run", DEADLINE, || {
        let (_, st) = http("GET", &format!("{base}/v1/sessions/{a}"), None);
        (st["state"] == "running").then_some(())
    });
    terminate(&srv);
    // Draining: new sessions are refused while the call still runs.
    rvisor_ffi_tests::wait_for("the drain", DEADLINE, || {
        let (status, _) = http(
            "POST",
            &format!("{base}/v1/sessions"),
            Some(serde_json::json!({})),
        );
        (status == 503).then_some(())
    });
    std::fs::write(&gate, "").unwrap();
    let finished = in_flight.join().unwrap();
    assert_eq!(finished["outcome"], "complete", "{finished}");
    assert!(exited(srv).success());

    let srv = serve_with_state(&state);
    let base = format!("http://{}", srv.addr);
    let (_, st) = http("GET", &format!("{base}/v1/sessions/{a}"), None);
    assert_eq!(st["state"], "hibernated", "{st}");
    // The state, with the call that finished during the drain, comes back;
    // the RNG stream goes on where it was.
    let r = session_run(&base, &a, &format!("{CHECK}\ncat(late, '\\n')"));
    let restored = &r["session"]["restored"];
    assert_eq!(restored["reason"], "restarted", "{r}");
    assert_eq!(r["session"]["fresh"], false, "{r}");
    let console = r["console"].as_str().unwrap();
    let before = before.as_str().unwrap();
    assert!(
        console.contains(before.lines().next().unwrap()),
        "{console} vs {before}"
    );
    assert!(console.contains("the server restarted"), "{console}");
    assert!(console.contains("done"), "{console}");
    // Options of the session survive with it.
    let r = session_run(&base, &b, "cat(kept); plot(1:3)");
    assert!(r["console"].as_str().unwrap().ends_with("b"), "{r}");
    assert_eq!(r["plots"][0]["width"], 321, "{r}");
    let r = session_run(&base, &unused, "cat(exists('x'))");
    assert!(r["console"].as_str().unwrap().contains("FALSE"), "{r}");
    // A session closed after the restart stays closed after the next.
    let (status, _) = http("DELETE", &format!("{base}/v1/sessions/{b}"), None);
    assert_eq!(status, 204);
    assert!(stop(srv).success());
    let srv = serve_with_state(&state);
    let base = format!("http://{}", srv.addr);
    let (status, _) = http("GET", &format!("{base}/v1/sessions/{b}"), None);
    assert_eq!(status, 404);
    let r = session_run(&base, &a, "cat(sum(x))");
    assert!(r["console"].as_str().unwrap().ends_with("55"), "{r}");
    drop(srv);
    let _ = std::fs::remove_dir_all(&state);
}

/// Installs a tiny package `name` (one exported function, `hello()`) into
/// the library `lib` with `R CMD INSTALL`.
fn install_tiny_package(lib: &std::path::Path, name: &str) {
    let src = lib.with_extension("src").join(name);
    std::fs::create_dir_all(src.join("R")).unwrap();
    std::fs::write(
        src.join("DESCRIPTION"),
        format!(
            "Package: {name}\nVersion: 0.1.0\nTitle: A Test Package\nDescription: Used by the durable tests.\n\
             License: MIT\nAuthor: rvisor\nMaintainer: rvisor <rvisor@example.org>\nEncoding: UTF-8\n"
        ),
    )
    .unwrap();
    std::fs::write(src.join("NAMESPACE"), "export(hello)\n").unwrap();
    std::fs::write(
        src.join("R").join("hello.R"),
        "hello <- function() 'hi from the package'\n",
    )
    .unwrap();
    // `--library=LIB` in one argument: R CMD INSTALL reads `--library LIB`
    // as a flag it does not know and installs into the site library.
    let mut to = std::ffi::OsString::from("--library=");
    to.push(lib);
    let out = std::process::Command::new("R")
        .args(["CMD", "INSTALL", "--no-test-load"])
        .arg(to)
        .arg(&src)
        .output()
        .expect("R CMD INSTALL runs");
    assert!(
        out.status.success(),
        "R CMD INSTALL failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(lib.with_extension("src"));
    assert!(
        lib.join(name).join("DESCRIPTION").is_file(),
        "{name} was not installed into {}",
        lib.display()
    );
}

#[test]
fn a_checkpoint_whose_package_is_gone_gives_a_fresh_session_that_names_it() {
    let dir = state_dir("pkg-gone");
    let lib = dir.join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    install_tiny_package(&lib, "rvisortiny");
    // R's library path is fixed when R starts: the zygote gets it, and the
    // session asks for the same one.
    let store = Arc::new(DirStore::new(dir.join("state")).unwrap());
    let sup = Supervisor::new(SupervisorConfig {
        worker: rvisor::WorkerConfig {
            libpath: vec![lib.clone()],
            ..rvisor::WorkerConfig::default()
        },
        checkpoints: Some(store.clone()),
        ..SupervisorConfig::default()
    })
    .expect("supervisor starts");
    let s = sup
        .session_with(SessionOptions {
            libpath: vec![lib.clone()],
            ..manual()
        })
        .unwrap();
    let r = ok(&s, "library(rvisortiny); kept <- hello(); cat(kept)");
    assert!(r.console.ends_with("hi from the package"), "{}", r.console);
    let info = s.checkpoint().unwrap();
    assert!(
        info.manifest.attached.iter().any(|p| p == "rvisortiny"),
        "{:?}",
        info.manifest.attached
    );
    s.hibernate();
    wait_state(&s, SessionState::Hibernated);
    std::fs::remove_dir_all(lib.join("rvisortiny")).unwrap();

    let r = ok(&s, "exists('kept')");
    let reason = r.session.reset_reason.clone().unwrap_or_default();
    assert!(reason.starts_with("restore_failed: "), "{reason}");
    assert!(
        reason.contains("package rvisortiny is no longer installed; install it again"),
        "the reason names the package and what to do: {reason}"
    );
    assert!(r.session.fresh, "{:?}", r.session);
    assert!(r.session.restored.is_none());
    assert!(
        r.console.contains("could not be restored") && r.console.contains("rvisortiny"),
        "{}",
        r.console
    );
    assert!(r.console.ends_with("[1] FALSE\n"), "{}", r.console);
    // The fresh session goes on.
    assert_eq!(ok(&s, "1 + 1").console, "[1] 2\n");
    drop(sup);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_session_unused_past_the_ttl_is_deleted_and_a_used_one_is_kept() {
    let state = state_dir("ttl");
    // A TTL of 5 s (in days, as the flag takes it).
    let ttl = ["--session-ttl-days", "0.0000579"];
    let start = |state: &std::path::Path| {
        rvisor_ffi_tests::ServeBin::start(
            &[
                &[
                    "--state-dir",
                    state.to_str().unwrap(),
                    "--hibernate-after-secs",
                    "0",
                ][..],
                &ttl[..],
            ]
            .concat(),
        )
    };
    let srv = start(&state);
    let base = format!("http://{}", srv.addr);
    let (_, s) = http(
        "POST",
        &format!("{base}/v1/sessions"),
        Some(serde_json::json!({})),
    );
    let old = s["id"].as_str().unwrap().to_string();
    session_run(&base, &old, "x <- 1");
    let (status, _) = http(
        "POST",
        &format!("{base}/v1/sessions/{old}/checkpoint"),
        None,
    );
    assert_eq!(status, 200);
    assert!(stop(srv).success());
    let record = std::fs::read_dir(state.join("sessions"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path()
        .join(&old)
        .join("record.json");
    assert!(record.exists(), "{}", record.display());
    // Past the TTL with the server down, the session is deleted by the
    // next server's sweep, from the store too.
    rvisor_ffi_tests::wait_for("the TTL to pass", DEADLINE, || {
        let age = std::fs::metadata(&record)
            .ok()?
            .modified()
            .ok()?
            .elapsed()
            .ok()?;
        (age > Duration::from_secs(6)).then_some(())
    });
    let srv = start(&state);
    let base = format!("http://{}", srv.addr);
    // A session used now is younger than the TTL when the sweep comes.
    let (_, s) = http(
        "POST",
        &format!("{base}/v1/sessions"),
        Some(serde_json::json!({})),
    );
    let used = s["id"].as_str().unwrap().to_string();
    session_run(&base, &used, "y <- 2");
    rvisor_ffi_tests::wait_for("the expired session to go", DEADLINE, || {
        let (status, _) = http("GET", &format!("{base}/v1/sessions/{old}"), None);
        (status == 404).then_some(())
    });
    assert!(!record.exists());
    let (status, st) = http("GET", &format!("{base}/v1/sessions/{used}"), None);
    assert_eq!(status, 200, "{st}");
    drop(srv);
    let _ = std::fs::remove_dir_all(&state);
}

/// R code that waits until the test opens its gate ([`open_gate`]), then
/// sets `kept`.
const GATED: &str = "while (!file.exists('gate')) Sys.sleep(0.02); kept <- 'yes'";

/// Opens the gate of the [`GATED`] call running in the session of `st`: a
/// file in its working directory, reached through the worker's root.
fn open_gate(st: &rvisor::SessionStatus) {
    let pid = st.pid.expect("a worker runs the gated call");
    let path = format!("/proc/{pid}/root{}/gate", st.working_dir);
    std::fs::write(&path, "go").unwrap_or_else(|e| panic!("open the gate {path}: {e}"));
}

#[test]
fn hibernate_and_wait_returns_once_the_worker_has_exited_and_idle_time_is_reported() {
    let dir = state_dir("hwait");
    let (sup, _store) = supervisor(&dir);
    let s = sup.session_with(manual()).unwrap();
    let busy = s.run(GATED).unwrap();
    let end = Instant::now() + DEADLINE;
    while s.status().running.is_none() {
        assert!(Instant::now() < end, "the call never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        s.status().idle_seconds,
        None,
        "a running session is not idle"
    );
    open_gate(&s.status());
    assert_eq!(busy.wait().outcome, Outcome::Complete);
    let st = s.status();
    assert!(st.idle_seconds.is_some(), "{st:?}");
    let pid = st.pid.expect("a live worker");
    s.hibernate_and_wait(DEADLINE).expect("it hibernates");
    let st = s.status();
    assert_eq!(st.state, SessionState::Hibernated);
    assert_eq!(st.pid, None);
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "worker {pid} still runs after hibernate_and_wait"
    );
    // Already without a worker: nothing to wait for.
    s.hibernate_and_wait(DEADLINE)
        .expect("a second time is a no-op");
    let r = ok(&s, "kept");
    assert_eq!(r.session.restored.expect("restored").reason, "hibernated");
    assert!(r.console.ends_with("[1] \"yes\"\n"), "{}", r.console);
    drop(sup);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn hibernate_and_wait_without_a_store_says_so_and_keeps_the_worker() {
    let sup = Supervisor::new(SupervisorConfig::default()).expect("supervisor starts");
    let s = sup.session().unwrap();
    ok(&s, "1");
    let e = s.hibernate_and_wait(DEADLINE).unwrap_err();
    assert!(e.contains("no checkpoint store"), "{e}");
    assert_eq!(s.status().state, SessionState::Idle);
}

// ---------------------------------------------------------------------------
// Admission control (server/src/admission.rs) over a real supervisor

mod admission {
    use super::*;
    use rvisor_server::admission::AdmissionConfig;
    use rvisor_server::service::{ErrorCode, NewSession, Service, ServiceConfig, SessionRun};
    use rvisor_server::tables::TableConfig;
    use serde_json::{json, Value};

    fn service(sup: Supervisor, dir: &std::path::Path, admission: AdmissionConfig) -> Service {
        Service::new(
            sup,
            ServiceConfig {
                tables: TableConfig {
                    dir: dir.join("tables"),
                    ..TableConfig::default()
                },
                admission,
                ..ServiceConfig::default()
            },
        )
        .expect("the service starts")
    }

    fn caps(live: usize, per_tenant: usize) -> AdmissionConfig {
        AdmissionConfig {
            max_live_sessions: live,
            max_live_sessions_per_tenant: per_tenant,
            max_calls_per_tenant: usize::MAX,
            memory_budget_bytes: u64::MAX,
            tenant_memory_bytes: u64::MAX,
        }
    }

    fn open(svc: &Service, tenant: &str) -> String {
        svc.create_session(tenant, NewSession::default())
            .expect("a session")
            .id
    }

    fn call(svc: &Service, tenant: &str, id: &str, code: &str) -> RunResult {
        let req = SessionRun {
            code: code.into(),
            timeout_seconds: None,
            plot_width: None,
            plot_height: None,
            display: None,
        };
        let r = svc
            .session_run(tenant, id, &req)
            .unwrap_or_else(|e| panic!("{code}: refused: {e}"))
            .wait();
        assert_eq!(r.outcome, Outcome::Complete, "{code}: {:?}", r.error);
        r
    }

    fn state(svc: &Service, tenant: &str, id: &str) -> SessionState {
        svc.session_status(tenant, id).unwrap().state
    }

    #[test]
    fn a_third_session_hibernates_the_least_recently_used_idle_one_and_it_comes_back() {
        let dir = state_dir("adm-lru");
        let (sup, _store) = supervisor(&dir);
        let svc = service(sup, &dir, caps(2, usize::MAX));
        let t = "local";
        let (a, b, c) = (open(&svc, t), open(&svc, t), open(&svc, t));
        call(&svc, t, &a, "v <- 'from a'");
        call(&svc, t, &b, "v <- 'from b'");
        let h = svc.health();
        assert_eq!(h["admission"]["live_sessions"], 2, "{h}");
        assert!(
            h["admission"]["worker_memory_bytes"].as_u64().unwrap() > 0,
            "{h}"
        );
        let how = h["admission"]["worker_memory_measured"].as_str().unwrap();
        assert!(["pss", "rss", "pss+rss"].contains(&how), "{h}");
        // c needs a worker: a (idle longest) hibernates to make room.
        call(&svc, t, &c, "v <- 'from c'");
        assert_eq!(state(&svc, t, &a), SessionState::Hibernated);
        assert_eq!(state(&svc, t, &b), SessionState::Idle);
        // a comes back with its objects; b is now the least recently used.
        let r = call(&svc, t, &a, "v");
        assert_eq!(
            r.session.restored.as_ref().expect("restored").reason,
            "hibernated"
        );
        assert!(r.console.ends_with("[1] \"from a\"\n"), "{}", r.console);
        assert_eq!(state(&svc, t, &b), SessionState::Hibernated);
        assert_eq!(state(&svc, t, &c), SessionState::Idle);
        let h = svc.health();
        let adm = &h["admission"];
        assert_eq!(adm["max_live_sessions"], 2, "{h}");
        assert_eq!(adm["live_sessions"], 2, "{h}");
        assert_eq!(adm["hibernated_sessions"], 1, "{h}");
        assert_eq!(adm["hibernations"]["live_sessions"], 2, "{h}");
        let m = svc.metrics_text();
        for line in [
            "rvisor_live_sessions 2\n",
            "rvisor_hibernated_sessions 1\n",
            "rvisor_admission_limit{limit=\"max_live_sessions\"} 2\n",
            "rvisor_admission_hibernations_total{limit=\"live_sessions\"} 2\n",
        ] {
            assert!(m.contains(line), "{line:?} not in\n{m}");
        }
        assert!(m.contains("rvisor_worker_memory_bytes "), "{m}");
        svc.close_all();
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_per_tenant_cap_hibernates_only_that_tenants_sessions() {
        let dir = state_dir("adm-tenant");
        let (sup, _store) = supervisor(&dir);
        let svc = service(sup, &dir, caps(usize::MAX, 1));
        let bob = open(&svc, "bob");
        let (a1, a2) = (open(&svc, "alice"), open(&svc, "alice"));
        // bob's session is the least recently used of all.
        call(&svc, "bob", &bob, "x <- 1");
        call(&svc, "alice", &a1, "x <- 'a1'");
        call(&svc, "alice", &a2, "x <- 'a2'");
        assert_eq!(state(&svc, "alice", &a1), SessionState::Hibernated);
        assert_eq!(state(&svc, "bob", &bob), SessionState::Idle);
        let h = svc.health();
        assert_eq!(h["admission"]["live_sessions_of_busiest_tenant"], 1, "{h}");
        assert_eq!(
            h["admission"]["hibernations"]["live_sessions_per_tenant"], 1,
            "{h}"
        );
        let r = call(&svc, "alice", &a1, "x");
        assert!(r.console.ends_with("[1] \"a1\"\n"), "{}", r.console);
        assert_eq!(state(&svc, "alice", &a2), SessionState::Hibernated);
        assert_eq!(state(&svc, "bob", &bob), SessionState::Idle);
        svc.close_all();
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Threads of this process named as the admission's memory monitor
    /// (`comm` holds 15 bytes of the name).
    fn monitors() -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|c| c.trim() == "rvisor-admissio")
            .count()
    }

    #[test]
    fn over_the_memory_budget_the_monitor_hibernates_idle_sessions() {
        let dir = state_dir("adm-mem");
        let (sup, _store) = supervisor(&dir);
        // Less than any worker: whatever is idle must go.
        let svc = service(
            sup,
            &dir,
            AdmissionConfig {
                memory_budget_bytes: 1 << 20,
                ..caps(usize::MAX, usize::MAX)
            },
        );
        let t = "local";
        let a = open(&svc, t);
        // Nothing is live: the first call is let in whatever the budget.
        call(&svc, t, &a, "kept <- 'through the squeeze'");
        // Hibernated, and counted once its worker has exited.
        let end = Instant::now() + DEADLINE;
        let h = loop {
            let h = svc.health();
            if state(&svc, t, &a) == SessionState::Hibernated
                && h["admission"]["hibernations"]["memory_budget"].as_u64() >= Some(1)
            {
                break h;
            }
            assert!(
                Instant::now() < end,
                "the monitor did not hibernate the session: {h}"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(h["admission"]["memory_budget_bytes"], 1 << 20, "{h}");
        let r = call(&svc, t, &a, "kept");
        assert!(
            r.console.ends_with("[1] \"through the squeeze\"\n"),
            "{}",
            r.console
        );
        assert!(svc
            .metrics_text()
            .contains("rvisor_memory_budget_bytes 1048576\n"));
        assert_eq!(monitors(), 1, "one monitor thread per service");
        svc.close_all();
        // The monitor ends with the service.
        drop(svc);
        let end = Instant::now() + DEADLINE;
        while monitors() > 0 {
            assert!(
                Instant::now() < end,
                "the memory monitor outlived its service"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Queues `code` in `tenant`'s session `id` and waits for its result
    /// on a thread of its own.
    fn call_on_thread(
        svc: &Service,
        tenant: &str,
        id: &str,
        code: &str,
    ) -> std::thread::JoinHandle<RunResult> {
        let req = SessionRun {
            code: code.into(),
            timeout_seconds: None,
            plot_width: None,
            plot_height: None,
            display: None,
        };
        let pending = svc
            .session_run(tenant, id, &req)
            .unwrap_or_else(|e| panic!("{code}: refused: {e}"));
        std::thread::spawn(move || pending.wait())
    }

    /// Holds about `mib` MiB in R during a long call (each page touched).
    fn hold(mib: u32) -> String {
        format!(
            "big <- numeric({} * 131072); big[] <- 1; Sys.sleep(120)",
            mib
        )
    }

    #[test]
    fn one_tenants_calls_over_the_budget_are_stopped_and_never_lock_another_tenant_out() {
        let dir = state_dir("adm-fair");
        let (sup, _store) = supervisor(&dir);
        let budget: u64 = 300 << 20;
        let svc = service(
            sup,
            &dir,
            AdmissionConfig {
                memory_budget_bytes: budget,
                ..caps(usize::MAX, usize::MAX)
            },
        );
        let (a1, a2) = (open(&svc, "alice"), open(&svc, "alice"));
        call(&svc, "alice", &a1, "kept <- 'a1'");
        call(&svc, "alice", &a2, "kept <- 'a2'");
        // alice's two calls hold 200 MiB each: over the budget by
        // themselves, with nothing idle to hibernate.
        let calls = [
            call_on_thread(&svc, "alice", &a1, &hold(200)),
            call_on_thread(&svc, "alice", &a2, &hold(200)),
        ];
        // bob, within his fair share, is let in all the same, whatever the
        // moment (before the fix: 503 busy while alice's calls ran).
        let bob = open(&svc, "bob");
        let r = call(&svc, "bob", &bob, "1 + 1");
        assert_eq!(r.console, "[1] 2\n");
        // alice's calls are stopped (before the fix they ran on, 2 min),
        // each saying why.
        for h in calls {
            let r = h.join().expect("alice's call");
            assert_eq!(r.outcome, Outcome::WorkerFailed, "{:?}", r.error);
            let msg = &r.error.as_ref().expect("an error").message;
            assert!(
                msg.contains("over its memory budget of 300 MiB") && msg.contains("fair share"),
                "{msg}"
            );
        }
        // Their sessions go on; the next result says what happened.
        let r = call(&svc, "alice", &a1, "exists('big')");
        assert_eq!(
            r.session.reset_reason.as_deref(),
            Some(rvisor::KILLED_OVER_BUDGET),
            "{r:?}"
        );
        assert!(
            r.console
                .contains("memory of its sessions was over the server's budget"),
            "{}",
            r.console
        );
        let h = svc.health();
        assert!(
            h["admission"]["stopped_calls"]["fair_share"].as_u64() >= Some(1),
            "{h}"
        );
        assert!(
            h["admission"]["worker_memory_bytes"].as_u64().unwrap() <= budget,
            "{h}"
        );
        assert!(svc
            .metrics_text()
            .contains("rvisor_admission_stopped_calls_total{limit=\"fair_share\"}"));
        // bob was never refused.
        assert!(
            h["admission"]["refusals"].as_object().unwrap().is_empty(),
            "{h}"
        );
        svc.close_all();
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_tenant_over_its_own_memory_share_loses_only_its_own_call() {
        let dir = state_dir("adm-tenant-mem");
        let (sup, _store) = supervisor(&dir);
        let svc = service(
            sup,
            &dir,
            AdmissionConfig {
                tenant_memory_bytes: 150 << 20,
                ..caps(usize::MAX, usize::MAX)
            },
        );
        let (a, b) = (open(&svc, "alice"), open(&svc, "bob"));
        call(&svc, "bob", &b, "mine <- 'bob'");
        let big = call_on_thread(&svc, "alice", &a, &hold(200));
        let bob_too = call_on_thread(&svc, "bob", &b, "Sys.sleep(3); mine");
        let r = big.join().expect("alice's call");
        assert_eq!(r.outcome, Outcome::WorkerFailed, "{:?}", r.error);
        let msg = &r.error.as_ref().expect("an error").message;
        assert!(
            msg.contains("over your share of the server's memory (150 MiB"),
            "{msg}"
        );
        let r = bob_too.join().expect("bob's call");
        assert_eq!(r.outcome, Outcome::Complete, "{:?}", r.error);
        assert!(r.console.ends_with("[1] \"bob\"\n"), "{}", r.console);
        let h = svc.health();
        assert_eq!(
            h["admission"]["tenant_memory_budget_bytes"],
            150 << 20,
            "{h}"
        );
        assert!(
            h["admission"]["stopped_calls"]["tenant_memory"].as_u64() >= Some(1),
            "{h}"
        );
        svc.close_all();
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn without_a_store_a_live_cap_refuses_and_says_how_to_lift_it() {
        let dir = state_dir("adm-nostore");
        let sup = Supervisor::new(SupervisorConfig::default()).expect("supervisor starts");
        let svc = service(sup, &dir, caps(1, usize::MAX));
        let t = "local";
        let (a, b) = (open(&svc, t), open(&svc, t));
        call(&svc, t, &a, "x <- 1");
        let req = SessionRun {
            code: "1".into(),
            timeout_seconds: None,
            plot_width: None,
            plot_height: None,
            display: None,
        };
        let e = svc.session_run(t, &b, &req).unwrap_err();
        assert_eq!(e.code, ErrorCode::Busy, "{e}");
        assert!(e.message.contains("max_live_sessions 1"), "{}", e.message);
        assert!(e.message.contains("--state-dir"), "{}", e.message);
        assert!(e.retry_after_seconds.is_some());
        let j = e.to_json();
        assert_eq!(j["code"], "busy");
        assert_eq!(j["retry_after_seconds"], json!(e.retry_after_seconds));
        assert_eq!(state(&svc, t, &a), SessionState::Idle);
        // The live session itself is still served.
        call(&svc, t, &a, "x");
        let h: Value = svc.health();
        assert_eq!(h["admission"]["refusals"]["live_sessions"], 1, "{h}");
        assert_eq!(h["admission"]["can_hibernate"], false, "{h}");
        svc.close_all();
        let _ = std::fs::remove_dir_all(dir);
    }
}

// ---------------------------------------------------------------------------
// Admission over HTTP: the real `rvisor serve`

mod admission_http {
    use super::*;
    use rvisor_ffi_tests::ServeBin;
    use serde_json::{json, Value};

    /// An answer: status, Retry-After, body.
    struct Answer {
        status: u16,
        retry_after: Option<String>,
        body: Value,
    }

    fn post(base: &str, path: &str, body: &Value) -> Answer {
        let r = match ureq::post(&format!("{base}{path}"))
            .timeout(DEADLINE)
            .send_json(body.clone())
        {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("POST {path}: {e}"),
        };
        Answer {
            status: r.status(),
            retry_after: r.header("Retry-After").map(str::to_string),
            body: r.into_json().unwrap_or(Value::Null),
        }
    }

    fn get(base: &str, path: &str) -> String {
        ureq::get(&format!("{base}{path}"))
            .timeout(DEADLINE)
            .call()
            .expect("GET")
            .into_string()
            .unwrap()
    }

    fn status(base: &str, id: &str) -> rvisor::SessionStatus {
        serde_json::from_str(&get(base, &format!("/v1/sessions/{id}"))).unwrap()
    }

    #[test]
    fn with_every_live_session_busy_calls_get_503_or_429_with_retry_after() {
        let dir = state_dir("adm-http");
        let srv = ServeBin::start(&[
            "--state-dir",
            dir.to_str().unwrap(),
            "--max-live-sessions",
            "2",
            "--max-calls-per-tenant",
            "3",
        ]);
        let base = format!("http://{}", srv.addr);
        let ids: Vec<String> = (0..3)
            .map(|_| {
                let a = post(&base, "/v1/sessions", &json!({}));
                assert_eq!(a.status, 201, "{}", a.body);
                a.body["id"].as_str().unwrap().to_string()
            })
            .collect();
        // Two sessions hold their workers with a call blocked on a gate.
        let blocked: Vec<_> = ids[..2]
            .iter()
            .map(|id| {
                let (base, path) = (base.clone(), format!("/v1/sessions/{id}/run"));
                std::thread::spawn(move || post(&base, &path, &json!({"code": GATED})))
            })
            .collect();
        let end = Instant::now() + DEADLINE;
        while !ids[..2]
            .iter()
            .all(|id| status(&base, id).running.is_some())
        {
            assert!(Instant::now() < end, "the gated calls never ran");
            std::thread::sleep(Duration::from_millis(20));
        }
        // A third session needs a worker and none can hibernate: 503.
        let run_c = format!("/v1/sessions/{}/run", ids[2]);
        let a = post(&base, &run_c, &json!({"code": "1"}));
        assert_eq!(a.status, 503, "{}", a.body);
        assert_eq!(a.body["error"]["code"], "busy", "{}", a.body);
        let msg = a.body["error"]["message"].as_str().unwrap();
        assert!(msg.contains("max_live_sessions 2"), "{msg}");
        assert!(msg.contains("retry"), "{msg}");
        let secs = a.body["error"]["retry_after_seconds"]
            .as_u64()
            .expect("retry_after_seconds");
        assert_eq!(a.retry_after, Some(secs.to_string()));
        // A call queued behind a live session's call is admitted (three in
        // flight, the tenant's most); one more is over the tenant's cap.
        let queued = {
            let (base, path) = (base.clone(), format!("/v1/sessions/{}/run", ids[0]));
            std::thread::spawn(move || post(&base, &path, &json!({"code": "kept"})))
        };
        while status(&base, &ids[0]).queued == 0 {
            assert!(Instant::now() < end, "the second call was not queued");
            std::thread::sleep(Duration::from_millis(20));
        }
        let a = post(
            &base,
            &format!("/v1/sessions/{}/run", ids[1]),
            &json!({"code": "1"}),
        );
        assert_eq!(a.status, 429, "{}", a.body);
        assert_eq!(a.body["error"]["code"], "quota", "{}", a.body);
        let msg = a.body["error"]["message"].as_str().unwrap();
        assert!(msg.contains("max_calls_per_tenant 3"), "{msg}");
        assert!(a.retry_after.is_some(), "429 without Retry-After");
        let h: Value = serde_json::from_str(&get(&base, "/v1/health")).unwrap();
        let adm = &h["admission"];
        assert_eq!(adm["calls_in_flight"], 3, "{h}");
        assert_eq!(adm["live_sessions"], 2, "{h}");
        assert_eq!(adm["max_calls_per_tenant"], 3, "{h}");
        // The gates open: the calls finish, and the third session's call
        // now hibernates an idle one to make room.
        for id in &ids[..2] {
            open_gate(&status(&base, id));
        }
        for b in blocked {
            let a = b.join().unwrap();
            assert_eq!(a.body["outcome"], "complete", "{}", a.body);
        }
        let a = queued.join().unwrap();
        assert_eq!(a.body["console"], "[1] \"yes\"\n", "{}", a.body);
        let a = post(&base, &run_c, &json!({"code": "1"}));
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.body["outcome"], "complete", "{}", a.body);
        let m = get(&base, "/metrics");
        for line in [
            "rvisor_admission_refusals_total{limit=\"live_sessions\"} 1\n",
            "rvisor_admission_refusals_total{limit=\"calls_per_tenant\"} 1\n",
            "rvisor_admission_hibernations_total{limit=\"live_sessions\"} 1\n",
            "rvisor_live_sessions 2\n",
            "rvisor_hibernated_sessions 1\n",
        ] {
            assert!(m.contains(line), "{line:?} not in\n{m}");
        }
        drop(srv);
        let _ = std::fs::remove_dir_all(dir);
    }
}
