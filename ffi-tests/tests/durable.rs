//! Durable sessions end to end against real R: checkpoints, hibernation
//! and restore, restore after a kill, damaged checkpoints.
//!
//! Workers are confined (the default). Every wait is on a condition with a
//! deadline; no test asserts a duration.

use rvisor::checkpoint::{CheckpointStore, DirStore};
use rvisor::{
    Outcome, RunResult, Session, SessionOptions, SessionState, Supervisor, SupervisorConfig,
};
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

/// A confined supervisor whose sessions checkpoint into `dir`.
fn supervisor(dir: &std::path::Path) -> (Supervisor, Arc<DirStore>) {
    let store = Arc::new(DirStore::new(dir).unwrap());
    let sup = Supervisor::new(SupervisorConfig {
        checkpoints: Some(store.clone()),
        ..SupervisorConfig::default()
    })
    .expect("supervisor starts");
    (sup, store)
}

/// Session options with no automatic checkpoints or hibernation: the tests
/// ask for them.
fn manual() -> SessionOptions {
    SessionOptions {
        checkpoint_after: None,
        hibernate_after: None,
        ..SessionOptions::default()
    }
}

fn run(s: &Session, code: &str) -> RunResult {
    let r = s.run(code).expect("queued").wait();
    assert!(
        matches!(r.outcome, Outcome::Complete | Outcome::Error),
        "{code}: {:?} {:?} {}",
        r.outcome,
        r.error,
        r.console
    );
    r
}

fn ok(s: &Session, code: &str) -> RunResult {
    let r = run(s, code);
    assert_eq!(
        r.outcome,
        Outcome::Complete,
        "{code}: {:?} {}",
        r.error,
        r.console
    );
    r
}

fn wait_state(s: &Session, want: SessionState) {
    let end = Instant::now() + DEADLINE;
    while s.status().state != want {
        assert!(Instant::now() < end, "state stayed {:?}", s.status().state);
        std::thread::sleep(Duration::from_millis(10));
    }
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
    assert!(store.get(&info.key).unwrap().is_some());

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
    let mut bytes = store.get(&info.key).unwrap().unwrap();
    // Flip bytes inside the compressed state (after the magic, before the
    // manifest): the frame's checksum no longer matches.
    for b in &mut bytes[20..40] {
        *b ^= 0x5a;
    }
    store.put(&info.key, &bytes).unwrap();
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
