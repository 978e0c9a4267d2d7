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
