//! The session's unit tests, against the fake workers of `crate::testing`.

use super::*;
use crate::ids;
use crate::testing::{Fake, Note, Release, Step};

#[test]
fn rfc3339_shape() {
    let t = super::now_rfc3339();
    assert_eq!(t.len(), 20);
    assert!(t.starts_with("20"));
    assert!(t.ends_with('Z'));
}

#[test]
fn a_process_cpu_time_grows_as_it_works_and_an_ended_one_has_none() {
    let me = std::process::id();
    let before = super::proc_cpu_ms(me).expect("this process's CPU time");
    // Work until the clock moves (it is in nanoseconds: a few ms of work).
    let mut x = 0u64;
    let mut after = before;
    for round in 0..1000u64 {
        for i in 0..100_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i ^ round);
        }
        after = super::proc_cpu_ms(me).unwrap();
        if after > before {
            break;
        }
    }
    assert!(after > before, "{before} ms, then {after} ms ({x})");
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    assert_eq!(super::proc_cpu_ms(pid), None, "a reaped process");
}

/// A session whose workers are fakes (no R, no root).
fn session(fake: &Fake, opts: SessionOptions) -> Session {
    let shared = Shared::new("s-test".into(), opts, None, false);
    start_runner(shared, fake.source()).unwrap()
}

fn quick() -> SessionOptions {
    SessionOptions {
        timeout: Duration::from_secs(60),
        grace: Duration::from_secs(60),
        ..SessionOptions::default()
    }
}

/// Waits until the runner has taken the call and the fake started it.
fn started(fake: &Fake, code: &str) {
    fake.expect(Note::Started(code.into()));
}

#[test]
fn calls_run_in_order_and_the_first_says_fresh() {
    let fake = Fake::new();
    let s = session(&fake, quick());
    assert_eq!(s.status().state, SessionState::New);
    let a = s.run("a").unwrap();
    let b = s.run("b").unwrap();
    let (a, b) = (a.wait(), b.wait());
    assert_eq!(
        (a.console.as_str(), b.console.as_str()),
        ("ran a\n", "ran b\n")
    );
    assert!(a.session.fresh && !b.session.fresh);
    assert_eq!(a.session.reset_reason, None);
    assert_eq!((a.session.generation, b.session.generation), (1, 1));
    assert_eq!(a.session.id, "s-test");
    assert_eq!(fake.started(), 1);
}

#[test]
fn a_crash_resets_the_session_and_the_next_result_says_why() {
    let fake = Fake::new();
    let s = session(&fake, quick());
    let crashed = s.run("crash").unwrap().wait();
    assert_eq!(crashed.outcome, Outcome::WorkerFailed);
    let next = s.run("x").unwrap().wait();
    assert_eq!(next.outcome, Outcome::Complete);
    assert!(next.session.fresh);
    assert_eq!(next.session.reset_reason.as_deref(), Some("crash"));
    assert_eq!(next.session.generation, 2);
    assert!(
        next.console.starts_with(
            "rvisor: started a fresh R session (generation 2) because the previous worker \
             crashed; earlier variables are gone.\nran x\n"
        ),
        "{}",
        next.console
    );
    let st = s.status();
    assert_eq!(st.last_reset.map(|r| r.reason).as_deref(), Some("crash"));
    assert_eq!(st.generation, 2);
    // The dead worker was taken out of the registry.
    assert_eq!(fake.forgotten().len(), 1);
    let third = s.run("y").unwrap().wait();
    assert!(!third.session.fresh && third.session.reset_reason.is_none());
}

#[test]
fn a_timeout_r_ignores_kills_the_worker_after_the_grace_period() {
    let fake = Fake::new();
    let s = session(
        &fake,
        SessionOptions {
            timeout: Duration::from_millis(1),
            grace: Duration::from_millis(1),
            ..SessionOptions::default()
        },
    );
    let r = s.run("hang").unwrap().wait();
    assert_eq!(r.outcome, Outcome::TimedOut);
    assert!(r.error.unwrap().message.contains("the worker was killed"));
    let next = s.run("x").unwrap().wait();
    assert_eq!(next.session.reset_reason.as_deref(), Some("timeout"));
    assert_eq!(next.session.generation, 2);
    assert!(next
        .console
        .starts_with("rvisor: started a fresh R session"));
}

#[test]
fn a_crash_drops_the_queue_as_not_executed() {
    let fake = Fake::new();
    let s = session(&fake, quick());
    let running = s.run("wait").unwrap();
    started(&fake, "wait");
    let queued = [s.run("q1").unwrap(), s.run("q2").unwrap()];
    assert_eq!(s.status().queued, 2);
    fake.release(1, Release::Crash);
    assert_eq!(running.wait().outcome, Outcome::WorkerFailed);
    for q in queued {
        let r = q.wait();
        assert_eq!(r.outcome, Outcome::NotExecuted);
        assert!(
            r.console
                .contains("the session was reset (the previous worker crashed)"),
            "{}",
            r.console
        );
    }
    assert!(!fake.notes_now().contains(&Note::Started("q1".into())));
    // Calls made after the reset run, in the fresh generation.
    let after = s.run("z").unwrap().wait();
    assert_eq!(after.session.generation, 2);
    assert_eq!(after.session.reset_reason.as_deref(), Some("crash"));
}

#[test]
fn cancel_while_queued_drops_the_queue_and_stops_the_running_call() {
    let fake = Fake::new();
    let s = session(&fake, quick());
    s.run("keep").unwrap().wait();
    let running = s.run("wait").unwrap();
    started(&fake, "wait");
    let queued = s.run("q").unwrap();
    s.cancel();
    // The queue is dropped at once, before the running call ends.
    let q = queued.try_result().expect("resolved by cancel() itself");
    assert_eq!(q.outcome, Outcome::NotExecuted);
    let r = running.wait();
    assert_eq!(r.outcome, Outcome::Cancelled);
    assert!(r.error.unwrap().message.contains("variables are kept"));
    // R answered the interrupt: same worker, same generation.
    let next = s.run("x").unwrap().wait();
    assert_eq!(next.session.generation, 1);
    assert!(!next.session.fresh);
    assert_eq!(fake.started(), 1);
}

#[test]
fn cancel_call_stops_one_call_and_leaves_the_others() {
    let fake = Fake::new();
    let s = session(&fake, quick());
    let running = s.run("wait").unwrap();
    started(&fake, "wait");
    let first = s.run("q1").unwrap();
    let second = s.run("q2").unwrap();
    // A queued call leaves the queue at once; the others stay.
    assert!(s.cancel_call(first.execution_id()));
    let q = first.try_result().expect("resolved by cancel_call itself");
    assert_eq!(q.outcome, Outcome::Cancelled);
    assert_eq!(s.status().queued, 1);
    // The running call is cancelled; the next queued one then runs.
    assert!(s.cancel_call(running.execution_id()));
    assert_eq!(running.wait().outcome, Outcome::Cancelled);
    let id = second.execution_id().to_string();
    assert_eq!(second.wait().outcome, Outcome::Complete);
    // A call that ended is not found.
    assert!(!s.cancel_call(&id));
    assert_eq!(fake.started(), 1, "R answered: same worker");
}

#[test]
fn cancel_of_a_call_r_ignores_kills_its_worker() {
    let fake = Fake::new();
    let s = session(
        &fake,
        SessionOptions {
            grace: Duration::from_millis(1),
            ..quick()
        },
    );
    let running = s.run("hang").unwrap();
    started(&fake, "hang");
    s.cancel();
    let r = running.wait();
    assert_eq!(r.outcome, Outcome::Cancelled);
    assert!(r.error.unwrap().message.contains("worker was killed"));
    let next = s.run("x").unwrap().wait();
    assert_eq!(next.session.reset_reason.as_deref(), Some("cancel"));
    assert_eq!(next.session.generation, 2);
}

#[test]
fn cancel_after_completion_changes_nothing() {
    let fake = Fake::new();
    let s = session(&fake, quick());
    let done = s.run("a").unwrap().wait();
    assert_eq!(done.outcome, Outcome::Complete);
    s.cancel();
    let next = s.run("b").unwrap().wait();
    assert_eq!(next.outcome, Outcome::Complete);
    assert_eq!(next.session.generation, 1);
    assert!(s.status().last_reset.is_none());
    assert!(!fake.notes_now().contains(&Note::Interrupted));
}

#[test]
fn close_while_running_resolves_everything_as_closed() {
    let fake = Fake::new();
    let s = session(&fake, quick());
    let running = s.run("wait").unwrap();
    started(&fake, "wait");
    let queued = s.run("q").unwrap();
    s.close();
    assert_eq!(s.status().state, SessionState::Closed);
    assert_eq!(queued.try_result().unwrap().outcome, Outcome::Closed);
    let r = running.wait();
    assert_eq!(r.outcome, Outcome::Closed);
    assert_eq!(
        r.error.unwrap().message,
        "the session was closed during the call"
    );
    assert_eq!(s.run("x").unwrap_err(), Rejection::Closed);
    // The runner ends the worker.
    fake.expect(Note::Shutdown);
}

#[test]
fn a_full_queue_is_refused() {
    let fake = Fake::new();
    let s = session(
        &fake,
        SessionOptions {
            queue_limit: 1,
            ..quick()
        },
    );
    let running = s.run("wait").unwrap();
    started(&fake, "wait");
    let queued = s.run("q").unwrap();
    let refused = s.run("r").unwrap_err();
    assert_eq!(refused, Rejection::QueueFull(1));
    assert_eq!(refused.code(), "queue_full");
    fake.release(1, Release::Complete);
    assert_eq!(running.wait().console, "released\n");
    assert_eq!(queued.wait().console, "ran q\n");
}

#[test]
fn a_worker_that_cannot_start_fails_the_call_not_the_session() {
    let fake = Fake::new();
    fake.fail_next_starts(1);
    let s = session(&fake, quick());
    let r = s.run("x").unwrap().wait();
    assert_eq!(r.outcome, Outcome::StartupFailed);
    assert!(
        r.console.contains("no R on this fake host"),
        "{}",
        r.console
    );
    assert_eq!(r.session.generation, 0);
    assert_eq!(s.status().state, SessionState::New);
    let ok = s.run("y").unwrap().wait();
    assert_eq!(ok.outcome, Outcome::Complete);
    assert_eq!(ok.session.generation, 1);
    assert!(ok.session.fresh);
}

#[test]
fn a_worker_killed_while_idle_is_replaced_before_the_next_call() {
    let fake = Fake::new();
    let s = session(&fake, quick());
    s.run("a").unwrap().wait();
    fake.kill_from_outside(1);
    let r = s.run("b").unwrap().wait();
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.session.reset_reason.as_deref(), Some("killed"));
    assert_eq!(r.session.generation, 2);
    assert_eq!(fake.started(), 2);
}

#[test]
fn quit_and_reset_start_a_fresh_generation() {
    let fake = Fake::new();
    let s = session(&fake, quick());
    assert_eq!(s.run("quit").unwrap().wait().outcome, Outcome::WorkerExited);
    let r = s.run("a").unwrap().wait();
    assert_eq!(r.session.reset_reason.as_deref(), Some("quit"));
    assert_eq!(r.session.generation, 2);
    s.reset();
    let r = s.run("b").unwrap().wait();
    assert_eq!(r.session.reset_reason.as_deref(), Some("reset"));
    assert_eq!(r.session.generation, 3);
    assert!(r.console.starts_with(
        "rvisor: started a fresh R session (generation 3) because the session was reset on request"
    ));
}

// -----------------------------------------------------------------------
// A cancel at every step of a call's life resolves the call. The fake is
// held at the step (`Fake::hold`), the cancel lands there, and the call
// must resolve while the fake still waits, or once it goes on.

/// How long a test waits for a result before calling it lost.
const RESOLVES: Duration = Duration::from_secs(10);

/// The ways of cancelling a call.
#[derive(Debug, Clone, Copy)]
enum How {
    Cancel,
    CancelCall,
    Close,
    Reset,
}

const EVERY_WAY: [How; 4] = [How::Cancel, How::CancelCall, How::Close, How::Reset];

fn cancel(s: &Session, h: &CallHandle, how: How) {
    match how {
        How::Cancel => s.cancel(),
        How::CancelCall => assert!(s.cancel_call(h.execution_id()), "the call is known"),
        How::Close => s.close(),
        How::Reset => s.reset(),
    }
}

/// What a call that never ran resolves as when cancelled `how`.
fn not_run(how: How) -> Outcome {
    match how {
        How::Close => Outcome::Closed,
        _ => Outcome::Cancelled,
    }
}

fn resolved(h: &CallHandle, what: &str) -> RunResult {
    h.wait_timeout(RESOLVES)
        .unwrap_or_else(|| panic!("{what}: the call never resolved"))
}

#[test]
fn a_cancel_while_the_worker_starts_resolves_the_call_at_once_and_nothing_runs() {
    for how in EVERY_WAY {
        let fake = Fake::new();
        let s = session(&fake, quick());
        fake.hold(Step::Start);
        let h = s.run("wait").unwrap();
        fake.expect(Note::Held(Step::Start));
        cancel(&s, &h, how);
        // Resolved while the worker is still starting.
        let r = resolved(&h, &format!("{how:?} while starting"));
        assert_eq!(r.outcome, not_run(how), "{how:?}: {}", r.console);
        assert_eq!(r.execution_id, h.execution_id());
        fake.go();
        if matches!(how, How::Close) {
            fake.expect(Note::Shutdown);
            assert!(!fake.notes_now().contains(&Note::Started("wait".into())));
            continue;
        }
        // The session goes on; the cancelled call never reached R.
        let next = s.run("x").unwrap().wait();
        assert_eq!(next.console.lines().last(), Some("ran x"), "{how:?}");
        assert!(next.session.fresh, "{how:?}: the first call that ran");
        let notes = fake.notes_now();
        assert!(
            !notes.contains(&Note::Started("wait".into())),
            "{how:?}: {notes:?}"
        );
    }
}

#[test]
fn a_cancel_while_a_hibernated_session_restores_resolves_the_call_at_once() {
    let dir = std::env::temp_dir().join(format!("rvisor-test-{}", ids::random_hex(6)));
    let store = Arc::new(crate::checkpoint::DirStore::new(&dir).unwrap());
    // A checkpoint file the fake "loads": only its manifest is read here.
    let mut file = rvisor_protocol::checkpoint::MAGIC.to_vec();
    file.extend_from_slice(b"STATE{}");
    file.extend_from_slice(&2u32.to_be_bytes());
    for how in [How::Cancel, How::CancelCall] {
        // A session of its own each time: the one before deletes its
        // checkpoint as it closes, on its runner thread, which under load
        // could come after this one's checkpoint was put (the restore then
        // found none and the fake was never asked to restore).
        let id = format!("s-test-{how:?}");
        let staged = crate::checkpoint::anonymous_file(&dir).unwrap();
        std::io::Write::write_all(&mut &staged, &file).unwrap();
        store.put(&id, &staged, file.len() as u64).unwrap();
        let fake = Fake::new();
        let mut shared = Shared::new(id, quick(), None, false);
        Arc::get_mut(&mut shared).unwrap().store = Some(store.clone());
        {
            let mut i = lock(&shared.inner);
            i.checkpoint = Some(Manifest::default());
            i.restore_next = Some("hibernated".into());
            i.state = SessionState::Hibernated;
        }
        let s = start_runner(shared, fake.source()).unwrap();
        fake.hold(Step::Restore);
        let h = s.run("wait").unwrap();
        fake.expect(Note::Held(Step::Restore));
        cancel(&s, &h, how);
        let r = resolved(&h, &format!("{how:?} while restoring"));
        assert_eq!(r.outcome, Outcome::Cancelled, "{how:?}: {}", r.console);
        fake.go();
        // The restore goes on, and the next call runs on the state.
        let next = s.run("x").unwrap().wait();
        assert_eq!(next.console.lines().last(), Some("ran x"), "{how:?}");
        assert!(next.session.restored.is_some(), "{how:?}");
        assert!(!fake.notes_now().contains(&Note::Started("wait".into())));
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_cancel_after_the_call_left_the_queue_and_before_it_was_sent_is_not_lost() {
    for how in EVERY_WAY {
        let fake = Fake::new();
        let s = session(&fake, quick());
        s.run("keep").unwrap().wait();
        // The runner stops at its check for a worker that died while
        // idle: the call is out of the queue, not sent yet.
        fake.hold(Step::Poll);
        let h = s.run("wait").unwrap();
        fake.expect(Note::Held(Step::Poll));
        cancel(&s, &h, how);
        fake.go();
        let r = resolved(&h, &format!("{how:?} before the send"));
        assert_eq!(r.outcome, not_run(how), "{how:?}: {}", r.console);
        if matches!(how, How::Close) {
            continue;
        }
        let next = s.run("x").unwrap().wait();
        assert_eq!(next.console.lines().last(), Some("ran x"), "{how:?}");
        assert!(!fake.notes_now().contains(&Note::Started("wait".into())));
    }
}

#[test]
fn a_cancel_that_overtakes_its_call_interrupts_it_when_it_begins() {
    for how in [How::Cancel, How::CancelCall] {
        let fake = Fake::new();
        let s = session(&fake, quick());
        s.run("keep").unwrap().wait();
        fake.hold(Step::Receive);
        let h = s.run("wait").unwrap();
        fake.expect(Note::Held(Step::Receive));
        cancel(&s, &h, how);
        fake.go();
        let r = resolved(&h, &format!("{how:?} as the call arrived"));
        assert_eq!(r.outcome, Outcome::Cancelled, "{how:?}: {}", r.console);
        assert!(r.error.unwrap().message.contains("variables are kept"));
        let next = s.run("x").unwrap().wait();
        assert_eq!(
            next.session.generation, 1,
            "{how:?}: R answered, same worker"
        );
    }
}

#[test]
fn a_cancel_as_the_result_is_sent_leaves_the_result_and_the_next_call_alone() {
    for how in [How::Cancel, How::CancelCall] {
        let fake = Fake::new();
        let s = session(&fake, quick());
        fake.hold(Step::Finish);
        let h = s.run("x").unwrap();
        fake.expect(Note::Held(Step::Finish));
        cancel(&s, &h, how);
        fake.go();
        // R had finished: its result stands.
        let r = resolved(&h, &format!("{how:?} as the result was sent"));
        assert_eq!(r.outcome, Outcome::Complete, "{how:?}: {}", r.console);
        // The late interrupt does not touch the next call: only the
        // release ends it.
        let next = s.run("wait").unwrap();
        started(&fake, "wait");
        fake.release(1, Release::Complete);
        let next = resolved(&next, "the next call");
        assert_eq!(next.console, "released\n", "{how:?}");
        assert_eq!(next.session.generation, 1);
    }
}

#[test]
fn interrupt_stops_the_call_but_keeps_the_queue() {
    let fake = Fake::new();
    let s = session(&fake, quick());
    let running = s.run("wait").unwrap();
    started(&fake, "wait");
    let queued = s.run("q").unwrap();
    s.interrupt();
    assert_eq!(running.wait().outcome, Outcome::Interrupted);
    assert_eq!(queued.wait().console, "ran q\n");
}
