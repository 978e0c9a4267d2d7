//! A fake worker for unit tests: the real [`Worker`] call loop and session
//! runner over a [`Transport`] whose "process" is a thread following the
//! call's code as a script. No R, no root, no processes; the test learns
//! what the fake did through [`Note`]s, so it waits on events, not on time.
//!
//! Scripts (the whole code of a call):
//! - `wait`: blocks until an interrupt for this call (answers
//!   `interrupted`, like R) or a [`Fake::release`] (which says how to end);
//! - `hang`: ignores interrupts (tight C code); only a kill ends it;
//! - `crash`: writes to stderr and dies by SIGSEGV;
//! - `quit`: reports `worker_exited` as R's `quit()` does, then exits;
//! - `tool:NAME`: calls host tool NAME and prints its answer;
//! - `events`: sends two event frames (one of another call, which must be
//!   ignored), then completes;
//! - anything else: completes and prints `ran CODE`.
//!
//! A test can hold the fake at one [`Step`] of a call's life ([`Fake::hold`]):
//! the fake says so ([`Note::Held`]) and waits there until [`Fake::go`], so
//! a cancel (or anything else) lands exactly in that window.

use crate::error::Error;
use crate::process::{ExitInfo, TempDir, Transport};
use crate::worker::{LinkEvent, LinkRx, LinkTx, Worker, WorkerSource};
use rvisor_protocol::{
    ErrorInfo, FrameError, FromWorker, Outcome, RunResult, Segment, ToWorker, ToolOutcome,
    WorkerHello, PROTOCOL_VERSION,
};
use std::os::fd::RawFd;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a test waits for something the fake is expected to do.
const EXPECT: Duration = Duration::from_secs(10);

/// What the fake did, for the test to wait on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Note {
    /// A call with this code started (the fake received it).
    Started(String),
    /// An interrupt arrived (and was answered or ignored).
    Interrupted,
    /// The worker was killed.
    Killed,
    /// The worker was asked to shut down.
    Shutdown,
    /// The fake reached the step [`Fake::hold`] armed and waits there.
    Held(Step),
}

/// Where in a call's life [`Fake::hold`] stops the fake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// The source is asked for a worker (before its hello): the session's
    /// runner waits for the worker its call needs.
    Start,
    /// The runner asks whether the worker has ended (`try_wait`): its check
    /// for a worker that died while idle, after the call was taken from the
    /// queue and before it is sent.
    Poll,
    /// The worker loads a checkpoint (before it answers the restore).
    Restore,
    /// The call reached the worker, which has not begun it.
    Receive,
    /// The call has run; its result is about to be sent.
    Finish,
}

/// A one-shot stop at one [`Step`]: armed by the test, passed by the fake.
#[derive(Debug, Default)]
struct Gate {
    /// The armed step, and whether the test said go.
    m: Mutex<(Option<Step>, bool)>,
    cv: Condvar,
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, (Option<Step>, bool)> {
        self.m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits here if `step` is the armed one (then disarms it): notes
    /// `Held(step)` and blocks until the test says go (at most [`EXPECT`],
    /// so a failing test cannot hold the fake for ever).
    fn pass(&self, step: Step, notes: &Sender<Note>) {
        let mut g = self.lock();
        if g.0 != Some(step) {
            return;
        }
        *g = (None, false);
        let _ = notes.send(Note::Held(step));
        let end = Instant::now() + EXPECT;
        while !g.1 {
            let now = Instant::now();
            if now >= end {
                return;
            }
            g = self
                .cv
                .wait_timeout(g, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// How a released `wait` call ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Release {
    /// Completes normally.
    Complete,
    /// Dies by SIGSEGV.
    Crash,
}

// Test-only and short-lived: a box per message would only add noise.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Input {
    Msg(ToWorker),
    Interrupt(Option<u64>),
    Release(Release),
    Kill,
}

/// Where the fake's end is recorded (the "zygote's" exit report).
#[derive(Debug, Default)]
struct ExitCell {
    exit: Mutex<Option<ExitInfo>>,
    cv: Condvar,
}

impl ExitCell {
    fn set(&self, e: ExitInfo) {
        let mut g = self.exit.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(e);
        }
        self.cv.notify_all();
    }

    fn get(&self) -> Option<ExitInfo> {
        *self.exit.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait(&self, wait: Duration) -> Option<ExitInfo> {
        let end = Instant::now() + wait;
        let mut g = self.exit.lock().unwrap_or_else(|e| e.into_inner());
        while g.is_none() {
            let now = Instant::now();
            if now >= end {
                return None;
            }
            g = self
                .cv
                .wait_timeout(g, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *g
    }
}

/// A started fake's input and where its end is recorded.
type Started = (Sender<Input>, Arc<ExitCell>);

#[derive(Debug)]
struct FakeTransport {
    pid: u32,
    input: Sender<Input>,
    exit: Arc<ExitCell>,
    gate: Arc<Gate>,
    notes: Sender<Note>,
}

impl Transport for FakeTransport {
    fn pid(&self) -> u32 {
        self.pid
    }

    fn is_forked(&self) -> bool {
        true
    }

    fn send(&mut self, msg: &ToWorker, _fds: &[RawFd]) -> Result<(), FrameError> {
        if self.exit.get().is_some() {
            return Err(FrameError::Closed);
        }
        self.input
            .send(Input::Msg(msg.clone()))
            .map_err(|_| FrameError::Closed)
    }

    fn peer_gone(&self) -> bool {
        self.exit.get().is_some()
    }

    fn interrupt(&self, seq: Option<u64>) {
        let _ = self.input.send(Input::Interrupt(seq));
    }

    fn interrupt_handle(&self) -> Arc<dyn Fn() + Send + Sync> {
        let input = Mutex::new(self.input.clone());
        Arc::new(move || {
            let _ = input
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .send(Input::Interrupt(None));
        })
    }

    fn kill(&mut self) {
        let _ = self.input.send(Input::Kill);
    }

    fn try_wait(&mut self) -> Option<ExitInfo> {
        self.gate.pass(Step::Poll, &self.notes);
        self.exit.get()
    }

    fn wait(&mut self) -> Option<ExitInfo> {
        self.exit.wait(Duration::from_secs(5))
    }
}

/// The fake "R process": answers frames as the scripts say.
struct FakeProcess {
    input: Receiver<Input>,
    events: LinkTx,
    exit: Arc<ExitCell>,
    notes: Sender<Note>,
    gate: Arc<Gate>,
    pid: u32,
}

impl FakeProcess {
    fn run(self) {
        while let Ok(input) = self.input.recv() {
            match input {
                Input::Msg(ToWorker::Hello { .. }) => self.frame(FromWorker::Hello(WorkerHello {
                    protocol_version: PROTOCOL_VERSION,
                    r_version: "0.0.0-fake".into(),
                    pid: self.pid,
                    r_tempdir: String::new(),
                    startup_ms: 0.0,
                })),
                Input::Msg(ToWorker::Run(req)) => {
                    self.gate.pass(Step::Receive, &self.notes);
                    let _ = self.notes.send(Note::Started(req.code.clone()));
                    if !self.call(req.seq, req.execution_id, &req.code) {
                        return;
                    }
                }
                Input::Msg(ToWorker::Shutdown) => {
                    let _ = self.notes.send(Note::Shutdown);
                    return self.end(ExitInfo {
                        code: Some(0),
                        signal: None,
                    });
                }
                Input::Msg(ToWorker::Restore { .. }) => {
                    // The checkpoint's contents do not matter to the fake.
                    self.gate.pass(Step::Restore, &self.notes);
                    self.frame(FromWorker::Restored {
                        outcome: rvisor_protocol::StateOutcome::Done("{}".into()),
                    });
                }
                Input::Kill => return self.killed(),
                Input::Interrupt(_) => {
                    // Between calls R drops a stale interrupt.
                    let _ = self.notes.send(Note::Interrupted);
                }
                Input::Msg(_) | Input::Release(_) => {}
            }
        }
    }

    fn frame(&self, f: FromWorker) {
        let _ = self.events.send(LinkEvent::Frame(Ok(f)));
    }

    /// The process ends: its exit is known before the link closes, as with
    /// a zygote's report that arrives first.
    fn end(&self, e: ExitInfo) {
        self.exit.set(e);
        let _ = self.events.send(LinkEvent::Frame(Err(
            "the peer closed the connection".into()
        )));
    }

    fn killed(&self) {
        let _ = self.notes.send(Note::Killed);
        self.end(ExitInfo {
            code: None,
            signal: Some(libc::SIGKILL),
        });
    }

    fn crash(&self) {
        let _ = self
            .events
            .send(LinkEvent::Raw([Vec::new(), b"*** segfault ***\n".to_vec()]));
        self.end(ExitInfo {
            code: None,
            signal: Some(libc::SIGSEGV),
        });
    }

    fn result(&self, execution_id: String, code: &str, outcome: Outcome, text: &str) {
        let mut r = RunResult::empty(execution_id, code.into());
        r.outcome = outcome;
        r.success = outcome == Outcome::Complete;
        r.push_segment(Segment::Stdout {
            text: format!("{text}\n"),
        });
        self.frame(FromWorker::Result(Box::new(r)));
    }

    /// Runs one call's script; false once the process has ended.
    fn call(&self, seq: u64, execution_id: String, code: &str) -> bool {
        match code {
            "wait" | "hang" => loop {
                match self.input.recv() {
                    Ok(Input::Interrupt(s)) => {
                        let _ = self.notes.send(Note::Interrupted);
                        let for_this_call = s.is_none_or(|s| s == seq);
                        if code == "wait" && for_this_call {
                            self.result(execution_id, code, Outcome::Interrupted, "interrupted");
                            return true;
                        }
                    }
                    Ok(Input::Release(Release::Complete)) => {
                        self.result(execution_id, code, Outcome::Complete, "released");
                        return true;
                    }
                    Ok(Input::Release(Release::Crash)) => {
                        self.crash();
                        return false;
                    }
                    Ok(Input::Kill) | Err(_) => {
                        self.killed();
                        return false;
                    }
                    Ok(Input::Msg(_)) => {}
                }
            },
            "crash" => {
                self.crash();
                false
            }
            "events" => {
                for (id, text) in [
                    ("another-call", "stray\n"),
                    (execution_id.as_str(), "live\n"),
                ] {
                    self.frame(FromWorker::Events {
                        execution_id: id.to_string(),
                        events: vec![
                            rvisor_protocol::EventKind::Stdout { text: text.into() },
                            rvisor_protocol::EventKind::Plot { index: 0 },
                        ],
                    });
                }
                self.result(execution_id, code, Outcome::Complete, "live");
                true
            }
            "quit" => {
                let mut r = RunResult::empty(execution_id, code.into());
                r.outcome = Outcome::WorkerExited;
                r.success = false;
                r.error = Some(ErrorInfo::message("quit() was called (status 0)"));
                self.frame(FromWorker::Result(Box::new(r)));
                self.end(ExitInfo {
                    code: Some(0),
                    signal: None,
                });
                false
            }
            _ => {
                if let Some(name) = code.strip_prefix("tool:") {
                    self.frame(FromWorker::ToolCall {
                        execution_id: execution_id.clone(),
                        call_id: 1,
                        name: name.to_string(),
                        args: serde_json::json!({}),
                    });
                    loop {
                        match self.input.recv() {
                            Ok(Input::Msg(ToWorker::ToolResult { outcome, .. })) => {
                                let text = match outcome {
                                    ToolOutcome::Value(v) => format!("value {v}"),
                                    ToolOutcome::Error(e) => format!("error {e}"),
                                };
                                self.result(execution_id, code, Outcome::Complete, &text);
                                return true;
                            }
                            Ok(Input::Kill) | Err(_) => {
                                self.killed();
                                return false;
                            }
                            Ok(_) => {}
                        }
                    }
                }
                self.gate.pass(Step::Finish, &self.notes);
                self.result(
                    execution_id,
                    code,
                    Outcome::Complete,
                    &format!("ran {code}"),
                );
                true
            }
        }
    }
}

/// The test's side of the fake workers a [`FakeSource`] starts.
#[derive(Debug, Clone)]
pub(crate) struct Fake {
    notes: Arc<Mutex<Receiver<Note>>>,
    notes_tx: Sender<Note>,
    /// The input of each started worker, in order.
    inputs: Arc<Mutex<Vec<Started>>>,
    /// Start failures still to give, before starts succeed again.
    fail_starts: Arc<Mutex<u32>>,
    /// Workers the source was told to forget.
    forgotten: Arc<Mutex<Vec<u32>>>,
    /// Where [`Fake::hold`] stops the fake.
    gate: Arc<Gate>,
}

impl Fake {
    pub(crate) fn new() -> Fake {
        let (notes_tx, notes) = mpsc::channel();
        Fake {
            notes: Arc::new(Mutex::new(notes)),
            notes_tx,
            inputs: Arc::default(),
            fail_starts: Arc::default(),
            forgotten: Arc::default(),
            gate: Arc::default(),
        }
    }

    /// Stops the fake the next time it reaches `step`, until [`Fake::go`];
    /// it notes [`Note::Held`] when it gets there.
    pub(crate) fn hold(&self, step: Step) {
        *self.gate.lock() = (Some(step), false);
    }

    /// Lets a held fake go on.
    pub(crate) fn go(&self) {
        self.gate.lock().1 = true;
        self.gate.cv.notify_all();
    }

    /// A worker over a fake transport, after the real handshake.
    pub(crate) fn worker(&self) -> Result<Worker, Error> {
        let (tx, rx) = mpsc::channel();
        let (events_tx, events) = LinkRx::channel();
        let exit = Arc::new(ExitCell::default());
        let pid = {
            let mut inputs = self.inputs.lock().unwrap_or_else(|e| e.into_inner());
            inputs.push((tx.clone(), exit.clone()));
            // Far above any pid_max: never a real process.
            100_000_000 + inputs.len() as u32
        };
        let process = FakeProcess {
            input: rx,
            events: events_tx.clone(),
            exit: exit.clone(),
            notes: self.notes_tx.clone(),
            gate: self.gate.clone(),
            pid,
        };
        std::thread::spawn(move || process.run());
        let transport = FakeTransport {
            pid,
            input: tx,
            exit,
            gate: self.gate.clone(),
            notes: self.notes_tx.clone(),
        };
        let tmp = TempDir::new(&std::env::temp_dir())?;
        Worker::handshake(
            Box::new(transport),
            (events_tx, events),
            tmp,
            EXPECT,
            Instant::now(),
        )
    }

    /// The next note; panics (failing the test) if none comes in time.
    pub(crate) fn next_note(&self) -> Note {
        match self
            .notes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .recv_timeout(EXPECT)
        {
            Ok(n) => n,
            Err(RecvTimeoutError::Timeout) => panic!("the fake worker did nothing"),
            Err(RecvTimeoutError::Disconnected) => panic!("the fake is gone"),
        }
    }

    /// Waits for `want`, skipping other notes.
    pub(crate) fn expect(&self, want: Note) {
        loop {
            if self.next_note() == want {
                return;
            }
        }
    }

    /// Notes so far, without waiting.
    pub(crate) fn notes_now(&self) -> Vec<Note> {
        self.notes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .try_iter()
            .collect()
    }

    fn input(&self, n: usize) -> Sender<Input> {
        self.inputs.lock().unwrap_or_else(|e| e.into_inner())[n - 1]
            .0
            .clone()
    }

    /// Ends the `wait` call of the `n`-th started worker (1-based).
    pub(crate) fn release(&self, n: usize, how: Release) {
        let _ = self.input(n).send(Input::Release(how));
    }

    /// Kills the `n`-th worker "from outside" (the OOM killer), and waits
    /// until it is dead.
    pub(crate) fn kill_from_outside(&self, n: usize) {
        let exit = self.inputs.lock().unwrap_or_else(|e| e.into_inner())[n - 1]
            .1
            .clone();
        let _ = self.input(n).send(Input::Kill);
        assert!(exit.wait(EXPECT).is_some(), "the fake did not die");
    }

    /// How many workers were started.
    pub(crate) fn started(&self) -> usize {
        self.inputs.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The next `n` starts fail.
    pub(crate) fn fail_next_starts(&self, n: u32) {
        *self.fail_starts.lock().unwrap_or_else(|e| e.into_inner()) = n;
    }

    /// Pids the source was told to forget.
    pub(crate) fn forgotten(&self) -> Vec<u32> {
        self.forgotten
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A worker source that starts fakes.
    pub(crate) fn source(&self) -> FakeSource {
        FakeSource { fake: self.clone() }
    }
}

/// Starts fake workers for a session runner.
#[derive(Debug)]
pub(crate) struct FakeSource {
    fake: Fake,
}

impl WorkerSource for FakeSource {
    fn start(&mut self) -> Result<Worker, Error> {
        {
            let mut n = self
                .fake
                .fail_starts
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if *n > 0 {
                *n -= 1;
                return Err(Error::Startup("no R on this fake host".into()));
            }
        }
        self.fake.gate.pass(Step::Start, &self.fake.notes_tx);
        self.fake.worker()
    }

    fn forget(&mut self, w: &Worker) {
        self.fake
            .forgotten
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(w.pid());
    }
}

/// Tests of one worker's call state machine.
mod worker_tests {
    use super::*;
    use crate::call::CallOptions;
    use crate::tools::{CallContext, Tool};

    fn opts(timeout_ms: u64, grace_ms: u64) -> CallOptions {
        CallOptions {
            timeout: Some(Duration::from_millis(timeout_ms)),
            grace: Duration::from_millis(grace_ms),
            ..CallOptions::default()
        }
    }

    #[test]
    fn a_call_returns_the_worker_result() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        let r = w.run("x", &CallOptions::default());
        assert_eq!(r.outcome, Outcome::Complete);
        assert_eq!(r.console, "ran x\n");
        assert!(w.is_alive());
    }

    #[test]
    fn event_frames_of_the_call_reach_its_sink_and_others_are_ignored() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        let (feed, events) = crate::EventFeed::new("e-1");
        let r = w.run_call_with_events(
            "e-1".into(),
            "events",
            &CallOptions::default(),
            &CallContext::default(),
            Some(&feed.sink()),
        );
        feed.finish(&r);
        let got: Vec<_> = events.map(|e| (e.seq, e.kind.name())).collect();
        assert_eq!(got, vec![(1, "stdout"), (2, "plot"), (3, "result")]);
        // Without a sink the frames are skipped and the result is the same.
        let plain = w.run_with_id("e-2".into(), "events", &CallOptions::default());
        assert_eq!(plain.console, r.console);
        assert_eq!(plain.outcome, Outcome::Complete);
    }

    #[test]
    fn a_timeout_r_answers_is_timed_out_and_keeps_the_worker() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        // Generous grace: the fake answers the interrupt at once.
        let r = w.run("wait", &opts(1, 60_000));
        assert_eq!(r.outcome, Outcome::TimedOut, "{}", r.console);
        let e = r.error.unwrap();
        assert!(e.timed_out);
        assert!(e.message.contains("variables are kept"), "{}", e.message);
        assert!(w.is_alive());
        assert_eq!(w.run("y", &CallOptions::default()).console, "ran y\n");
    }

    #[test]
    fn a_timeout_r_ignores_is_killed_after_the_grace_period() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        let r = w.run("hang", &opts(1, 1));
        assert_eq!(r.outcome, Outcome::TimedOut);
        let e = r.error.unwrap();
        assert!(e.message.contains("the worker was killed"), "{}", e.message);
        assert!(
            r.console.ends_with("the session's state is lost\n"),
            "{}",
            r.console
        );
        assert!(!w.is_alive());
        let notes = fake.notes_now();
        let interrupted = notes.iter().position(|n| *n == Note::Interrupted);
        let killed = notes.iter().position(|n| *n == Note::Killed);
        assert!(
            interrupted.is_some() && interrupted < killed,
            "interrupt first, then kill: {notes:?}"
        );
    }

    #[test]
    fn a_cancel_interrupts_only_its_own_call() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        let c = w.canceller();
        let t = std::thread::spawn({
            let fake = fake.clone();
            move || {
                fake.expect(Note::Started("wait".into()));
                c.cancel("some-other-call");
                c.cancel("the-call");
            }
        });
        let r = w.run_with_id("the-call".into(), "wait", &opts(10_000, 60_000));
        t.join().unwrap();
        assert_eq!(r.outcome, Outcome::Cancelled);
        assert!(r.error.unwrap().message.contains("variables are kept"));
        assert!(w.is_alive());
    }

    #[test]
    fn a_cancel_that_comes_after_its_call_does_not_touch_the_next() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        let r = w.run_with_id("first".into(), "x", &CallOptions::default());
        assert_eq!(r.outcome, Outcome::Complete);
        w.canceller().cancel("first");
        let r = w.run_with_id("second".into(), "y", &CallOptions::default());
        assert_eq!(r.outcome, Outcome::Complete);
        assert!(
            !fake.notes_now().contains(&Note::Interrupted),
            "a stale cancel sent an interrupt"
        );
    }

    #[test]
    fn a_cancel_sent_before_its_call_is_kept_through_an_idle_check() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        // Asked for before the call runs; the idle check (a session's
        // runner makes it before each call) drains the events meanwhile.
        w.canceller().cancel("the-call");
        assert!(!w.link_closed());
        let r = w.run_with_id("the-call".into(), "wait", &opts(10_000, 60_000));
        assert_eq!(r.outcome, Outcome::Cancelled, "{}", r.console);
        assert!(w.is_alive());
    }

    #[test]
    fn a_cancelled_token_stops_a_call_before_it_is_sent_or_while_it_runs() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        let token = crate::CancelToken::new();
        token.cancel();
        let ctx = CallContext {
            cancel: Some(token),
            ..CallContext::default()
        };
        let r = w.run_call("e1".into(), "wait", &opts(10_000, 60_000), &ctx);
        assert_eq!(r.outcome, Outcome::Cancelled, "{}", r.console);
        assert!(
            !fake.notes_now().contains(&Note::Started("wait".into())),
            "nothing was sent"
        );
        // A token cancelled while the call runs interrupts it.
        let token = crate::CancelToken::new();
        let t = std::thread::spawn({
            let (fake, token) = (fake.clone(), token.clone());
            move || {
                fake.expect(Note::Started("wait".into()));
                token.cancel();
            }
        });
        let ctx = CallContext {
            cancel: Some(token),
            ..CallContext::default()
        };
        let r = w.run_call("e2".into(), "wait", &opts(10_000, 60_000), &ctx);
        t.join().unwrap();
        assert_eq!(r.outcome, Outcome::Cancelled, "{}", r.console);
        assert!(r.error.unwrap().message.contains("variables are kept"));
    }

    #[test]
    fn a_crash_mid_call_is_worker_failed_with_what_it_printed() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        let r = w.run("crash", &CallOptions::default());
        assert_eq!(r.outcome, Outcome::WorkerFailed);
        assert!(r.console.starts_with("*** segfault ***\n"), "{}", r.console);
        assert!(r.console.contains("(SIGSEGV)"), "{}", r.console);
        assert!(!w.is_alive());
        let again = w.run("x", &CallOptions::default());
        assert_eq!(again.outcome, Outcome::WorkerFailed);
    }

    #[test]
    fn tool_calls_are_answered_by_their_handler() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        let tool = Tool::new("answer", "", serde_json::json!({}), |call| {
            Ok(serde_json::json!(call.session_id.len()))
        })
        .unwrap();
        let ctx = CallContext {
            session_id: "abc".into(),
            tools: Arc::new(vec![tool]),
            ..CallContext::default()
        };
        let r = w.run_call("e1".into(), "tool:answer", &CallOptions::default(), &ctx);
        assert_eq!(r.console, "value 3\n");
        let r = w.run_call("e2".into(), "tool:nope", &CallOptions::default(), &ctx);
        assert!(
            r.console.starts_with("error unknown tool 'nope'"),
            "{}",
            r.console
        );
    }

    #[test]
    fn bad_calls_are_rejected_before_they_are_sent() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        let r = w.run("  ", &CallOptions::default());
        assert_eq!(r.outcome, Outcome::Rejected);
        assert!(fake.notes_now().is_empty(), "nothing reached the worker");
    }

    #[test]
    fn quit_is_worker_exited_and_reaped() {
        let fake = Fake::new();
        let mut w = fake.worker().unwrap();
        let r = w.run("quit", &CallOptions::default());
        assert_eq!(r.outcome, Outcome::WorkerExited);
        assert!(!w.is_alive());
    }
}
