//! Bounded results: whatever R produces (a 250 MB error message, 10,000
//! warnings, a huge result block, 100 plots, a raw output flood), a call's
//! result stays within the caps of `rvisor_protocol::bounds` and the call's
//! `max_output_bytes`, says what was cut (`truncated_fields`), and the
//! session goes on; the supervisor's own memory stays small while it
//! happens (nextest runs each test in a process of its own, so the test
//! process's peak RSS, VmHWM, is this test's). A worker that sends a frame
//! over the limit is killed. Also: what a confined worker sees of its host
//! (temporary paths, command line, environment, mounts).

use rvisor::{
    CallOptions, Outcome, RunResult, Segment, Supervisor, SupervisorConfig, Worker, WorkerConfig,
};
use rvisor_ffi_tests::{run, worker, TestDir};
use rvisor_protocol::bounds;
use std::time::Duration;

/// This process's peak resident set size (VmHWM), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM");
    kb * 1024
}

/// Most the supervisor's peak RSS may grow during one of these calls.
const RSS_GROWTH: u64 = 64 * 1024 * 1024;

/// Runs `code` and checks that the supervisor's peak RSS grew by less than
/// [`RSS_GROWTH`] meanwhile; prints the growth.
fn run_bounded(w: &mut Worker, code: &str, opts: &CallOptions) -> RunResult {
    let before = peak_rss();
    let r = w.run(code, opts);
    let grown = peak_rss().saturating_sub(before);
    eprintln!(
        "{code:.60}: outcome {:?}, frame-sized parts {} bytes, supervisor peak RSS +{:.1} MiB",
        r.outcome,
        serde_json::to_vec(&r).map(|v| v.len()).unwrap_or(0),
        grown as f64 / (1024.0 * 1024.0)
    );
    assert!(
        grown < RSS_GROWTH,
        "the supervisor's peak RSS grew by {grown} bytes"
    );
    r
}

/// The whole result as JSON, and its size.
fn json_size(r: &RunResult) -> usize {
    serde_json::to_vec(r).expect("a result serialises").len()
}

fn has_field(r: &RunResult, f: &str) -> bool {
    r.truncated_fields.iter().any(|x| x == f)
}

/// The session is still usable after a bounded call.
fn still_usable(w: &mut Worker) {
    let r = run(w, "1 + 1");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_eq!(r.console, "[1] 2\n");
    assert!(!r.truncated, "{:?}", r.truncated_fields);
    assert!(r.truncated_fields.is_empty());
}

#[test]
fn a_250_mb_error_message_comes_back_cut_to_8_kib() {
    let mut w = worker();
    let opts = CallOptions::default();
    let r = run_bounded(
        &mut w,
        "stop(structure(class = c('error', 'condition'), \
         list(message = strrep('A', 2.5e8), call = NULL)))",
        &opts,
    );
    assert_eq!(r.outcome, Outcome::Error);
    let e = r.error.as_ref().expect("an error");
    assert!(e.message.len() <= bounds::ERROR_MESSAGE_BYTES);
    assert!(e.message.len() > 8000, "{}", e.message.len());
    assert!(e.message.bytes().all(|b| b == b'A'));
    assert!(r.truncated);
    assert!(has_field(&r, "error.message"), "{:?}", r.truncated_fields);
    // The segment and the console carry the same cut message.
    assert!(r.console.starts_with("Error: AAAA"), "{:.40}", r.console);
    assert!(r.console.len() < 9 * 1024);
    assert!(json_size(&r) < 64 * 1024, "{}", json_size(&r));
    still_usable(&mut w);

    // A message that is a million-element vector: its first element only.
    let r = run_bounded(
        &mut w,
        "stop(structure(class = c('error', 'condition'), \
         list(message = rep('B', 1e6), call = NULL)))",
        &opts,
    );
    assert_eq!(r.error.as_ref().unwrap().message, "B");
    still_usable(&mut w);
}

#[test]
fn multibyte_messages_are_cut_on_character_boundaries() {
    let mut w = worker();
    // 3-byte characters: 8192 is not a multiple of 3. (R's own stop()
    // cuts its message at 8,170 bytes; a condition object is not cut.)
    let r = run_bounded(
        &mut w,
        "stop(structure(class = c('error', 'condition'), \
         list(message = strrep('\u{20ac}', 1e5), call = NULL)))",
        &CallOptions::default(),
    );
    let m = &r.error.as_ref().unwrap().message;
    assert!(m.len() <= bounds::ERROR_MESSAGE_BYTES && m.len() > 8000);
    assert!(m.chars().all(|c| c == '\u{20ac}'), "whole characters only");
    assert!(has_field(&r, "error.message"));
}

#[test]
fn a_huge_call_and_a_deep_traceback_are_cut() {
    let mut w = worker();
    let opts = CallOptions::default();
    // The call holds the evaluated argument: a 10 MB string.
    let r = run_bounded(
        &mut w,
        "f <- function(x) stop('boom'); do.call('f', list(strrep('C', 1e7)))",
        &opts,
    );
    assert_eq!(r.outcome, Outcome::Error);
    let e = r.error.as_ref().unwrap();
    assert_eq!(e.message, "boom");
    let call = e.call.as_deref().expect("a call");
    assert!(call.len() <= bounds::CALL_BYTES, "{}", call.len());
    assert!(call.starts_with("f(\"CCCC"), "{call:.60}");
    assert!(e
        .traceback
        .iter()
        .all(|f| f.len() <= bounds::TRACEBACK_FRAME_BYTES));
    assert!(has_field(&r, "error.call"), "{:?}", r.truncated_fields);
    assert!(has_field(&r, "error.traceback"), "{:?}", r.truncated_fields);
    still_usable(&mut w);

    let r = run_bounded(
        &mut w,
        "g <- function(n) if (n == 0) stop('deep') else g(n - 1); g(2000)",
        &opts,
    );
    let e = r.error.as_ref().unwrap();
    assert_eq!(e.message, "deep");
    assert_eq!(e.traceback.len(), bounds::TRACEBACK_FRAMES + 1);
    assert!(
        e.traceback.last().unwrap().starts_with("... and "),
        "{:?}",
        e.traceback.last()
    );
    assert!(has_field(&r, "error.traceback"));
    still_usable(&mut w);
}

#[test]
fn ten_thousand_warnings_keep_fifty_and_count_the_rest() {
    let mut w = worker();
    let r = run_bounded(
        &mut w,
        "for (i in 1:10000) warning(paste('w', i)); cat('done\\n')",
        &CallOptions::default(),
    );
    assert_eq!(r.outcome, Outcome::OutputTruncated, "{}", r.console);
    assert!(r.success, "the code itself completed");
    assert_eq!(r.warnings.len(), bounds::MAX_WARNINGS);
    assert_eq!(r.warnings[0], "w 1");
    assert!(
        r.console
            .contains("rvisor: 9950 more warnings were not kept (at most 50 per call)"),
        "{}",
        r.console
    );
    assert!(has_field(&r, "warnings"));
    still_usable(&mut w);
}

#[test]
fn huge_warning_and_message_texts_are_cut() {
    let mut w = worker();
    let opts = CallOptions::default();
    let r = run_bounded(
        &mut w,
        "f <- function() warning(structure(class = c('warning', 'condition'), \
         list(message = strrep('W', 5e7), call = sys.call()))); f(); 1",
        &opts,
    );
    assert_eq!(r.outcome, Outcome::OutputTruncated, "{:.200}", r.console);
    assert_eq!(r.warnings.len(), 1);
    let w0 = &r.warnings[0];
    assert!(w0.starts_with("In f() : WWW"), "{w0:.40}");
    assert!(
        w0.len() <= bounds::WARNING_MESSAGE_BYTES + 16,
        "{}",
        w0.len()
    );
    assert!(has_field(&r, "warnings"));
    still_usable(&mut w);

    // A message is console text: cut at the call's output cap.
    let small = CallOptions {
        max_output_bytes: 100_000,
        ..CallOptions::default()
    };
    let r = run_bounded(&mut w, "message(strrep('M', 2e8)); cat('after\\n')", &small);
    assert_eq!(r.outcome, Outcome::OutputTruncated);
    assert!(r.console.len() <= 100_000, "{}", r.console.len());
    assert!(r.console.len() > 99_000, "{}", r.console.len());
    assert!(
        !r.console.contains("after"),
        "nothing is kept after the cap"
    );
    assert!(matches!(&r.segments[0], Segment::Message { text } if text.len() == r.console.len()));
    assert!(has_field(&r, "console"));
    assert!(r.usage.output_bytes <= 100_000);
    still_usable(&mut w);
}

#[test]
fn a_result_block_over_one_mib_gives_null_and_a_warning() {
    let mut w = worker();
    let r = run_bounded(
        &mut w,
        "cat('<<<RVISOR_RESULT_START>>>\\n\"', strrep('r', 2e6), '\"\\n<<<RVISOR_RESULT_END>>>\\n', \
         sep = ''); cat('after\\n')",
        &CallOptions::default(),
    );
    assert_eq!(r.result, None);
    assert!(has_field(&r, "result"), "{:?}", r.truncated_fields);
    assert!(r.truncated);
    assert_eq!(r.outcome, Outcome::OutputTruncated);
    assert!(
        r.warnings.iter().any(|w| w.contains("over the limit of")),
        "{:?}",
        r.warnings
    );
    assert!(r.console.starts_with("after\n"), "{:.80}", r.console);
    assert!(json_size(&r) < 64 * 1024);

    // Under the cap it is parsed as before.
    let r = run(
        &mut w,
        "cat('<<<RVISOR_RESULT_START>>>\\n\"', strrep('r', 1e5), '\"\\n<<<RVISOR_RESULT_END>>>\\n', sep = '')",
    );
    assert_eq!(r.outcome, Outcome::Complete);
    assert_eq!(
        r.result.as_ref().and_then(|v| v.as_str()).map(str::len),
        Some(100_000)
    );
    still_usable(&mut w);
}

#[test]
fn at_most_64_plot_pages_and_their_bytes_within_the_cap() {
    let mut w = worker();
    let r = run_bounded(
        &mut w,
        "for (i in 1:100) plot(i, main = i)",
        &CallOptions::default(),
    );
    assert_eq!(r.plots.len(), bounds::MAX_PLOTS, "{}", r.console);
    assert!(has_field(&r, "plots"));
    assert!(
        r.console
            .contains("rvisor: 36 more plot pages were not kept"),
        "{}",
        r.console
    );
    assert_eq!(r.outcome, Outcome::OutputTruncated);
    still_usable(&mut w);
    // No page of the dropped ones comes back with the next plot.
    let r = run(&mut w, "plot(1)");
    assert_eq!(r.plots.len(), 1, "{}", r.console);

    let tight = CallOptions {
        max_output_bytes: 60_000,
        ..CallOptions::default()
    };
    let r = run_bounded(
        &mut w,
        "for (i in 1:20) plot(rnorm(1000), main = i)",
        &tight,
    );
    let bytes: usize = r.plots.iter().map(|p| p.data_base64.len() * 3 / 4).sum();
    assert!(r.plots.len() < 20, "{}", r.plots.len());
    assert!(bytes <= 60_000, "{bytes}");
    assert!(r.usage.output_bytes <= 60_000);
    assert!(has_field(&r, "plots"));
    still_usable(&mut w);
}

#[test]
fn raw_output_floods_count_against_the_cap() {
    let mut w = worker();
    let opts = CallOptions {
        timeout: Some(Duration::from_secs(120)),
        ..CallOptions::default()
    };
    // 300 MB through a child process straight to fd 1.
    let r = run_bounded(
        &mut w,
        "system('yes | head -c 300000000'); cat('r-side\\n')",
        &opts,
    );
    assert_eq!(r.outcome, Outcome::OutputTruncated, "{:.200}", r.console);
    assert!(
        r.console.len() as u64 <= opts.max_output_bytes,
        "{}",
        r.console.len()
    );
    assert!(r.console.starts_with("r-side\ny\ny\n"), "{:.40}", r.console);
    assert!(r.usage.output_bytes <= opts.max_output_bytes);
    assert!(has_field(&r, "console"));
    still_usable(&mut w);

    // R writing to fd 1 itself, bypassing the console; and fd 2.
    let r = run_bounded(
        &mut w,
        "for (i in 1:4) cat(strrep('o', 1e7), file = '/dev/stdout'); \
         for (i in 1:4) cat(strrep('e', 1e7), file = '/dev/stderr')",
        &opts,
    );
    assert!(r.console.len() as u64 <= opts.max_output_bytes);
    assert!(has_field(&r, "console"));
    still_usable(&mut w);

    // Between calls: a background process floods while nothing runs.
    let r = run(&mut w, "system('yes | head -c 100000000 &')");
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    let before = peak_rss();
    std::thread::sleep(Duration::from_secs(2));
    let r = run(&mut w, "Sys.sleep(0.5); 1");
    let grown = peak_rss().saturating_sub(before);
    assert!(r.console.len() as u64 <= opts.max_output_bytes);
    assert!(grown < RSS_GROWTH, "{grown}");
    eprintln!(
        "idle flood: supervisor peak RSS +{:.1} MiB",
        grown as f64 / 1048576.0
    );
}

#[test]
fn text_that_json_escaping_blows_up_still_fits_its_frame() {
    let mut w = worker();
    // 8 MB of control characters: 48 MB as JSON, twice (console and
    // segments), over the frame limit of 40 MiB: the worker keeps less.
    let r = run_bounded(&mut w, "cat(strrep('\\001', 8e6))", &CallOptions::default());
    assert_eq!(r.outcome, Outcome::OutputTruncated, "{:.100}", r.console);
    assert!(has_field(&r, "console"));
    assert!(!r.console.is_empty());
    assert!(r.console.bytes().all(|b| b == 1));
    let limit = bounds::result_frame_limit(CallOptions::default().max_output_bytes);
    assert!((json_size(&r) as u64) < limit, "{}", json_size(&r));
    still_usable(&mut w);
}

/// A fake worker (python) that says hello, then answers a call with a
/// frame header announcing 1 GB.
const HOSTILE_WORKER: &str = r#"#!/usr/bin/env python3
import json, os, struct, sys, time
fd = int(os.environ["RVISOR_WORKER_FD"])
sock = os.fdopen(fd, "r+b", buffering=0)
def read_frame():
    n = struct.unpack(">I", sock.read(4))[0]
    data = b""
    while len(data) < n:
        data += sock.read(n - len(data))
    return json.loads(data)
def send(obj):
    data = json.dumps(obj).encode()
    sock.write(struct.pack(">I", len(data)) + data)
hello = read_frame()
send({"type": "hello", "protocol_version": hello["protocol_version"], "r_version": "4.2.2",
      "pid": os.getpid(), "r_tempdir": "/tmp", "startup_ms": 1.0})
read_frame()
sock.write(struct.pack(">I", 1_000_000_000))
sock.write(b"{" * 65536)
time.sleep(60)
"#;

#[test]
fn a_frame_over_the_limit_kills_the_worker() {
    let dir = TestDir::new("hostile-worker");
    let bin = dir.path().join("rvisor-worker");
    std::fs::write(&bin, HOSTILE_WORKER).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut w = Worker::spawn(&WorkerConfig {
        worker_bin: Some(bin),
        ..WorkerConfig::default()
    })
    .expect("the fake worker says hello");
    let before = peak_rss();
    let t0 = std::time::Instant::now();
    let r = w.run("1", &CallOptions::default());
    let grown = peak_rss().saturating_sub(before);
    assert_eq!(r.outcome, Outcome::WorkerFailed, "{}", r.console);
    let msg = &r.error.as_ref().unwrap().message;
    assert!(
        msg.contains("the worker sent a frame of 1000000000 bytes, over this call's limit of"),
        "{msg}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(!w.is_alive());
    assert!(grown < 16 * 1024 * 1024, "{grown}");
}

// ---------------------------------------------------------------------------
// What a confined worker sees of its host.

#[test]
fn a_confined_worker_sees_no_host_pid_or_path() {
    let sup = Supervisor::new(SupervisorConfig::default()).expect("a confined supervisor");
    let s = sup.session().expect("a session");
    let code = r#"
        cat("tempdir:", tempdir(), "\n")
        cat("wd:", getwd(), "\n")
        cat("args:", commandArgs(), "\n")
        z <- function(f) tryCatch({
          r <- readBin(f, "raw", 65536); r[r == 0] <- as.raw(32); trimws(rawToChar(r))
        }, error = function(e) "unreadable", warning = function(w) "unreadable")
        cat("cmdline:", z("/proc/self/cmdline"), "\n")
        cat("environ:", z("/proc/self/environ"), "\n")
        e <- Sys.getenv(); cat("env:", paste(names(e), e, sep = "="), "\n")
        cat("exe:", Sys.readlink("/proc/self/exe"), "\n")
        cat("mountinfo:", readLines("/proc/self/mountinfo"), sep = "\n")
    "#;
    let h = s.run(code).expect("accepted");
    let r = h.wait_timeout(Duration::from_secs(60)).expect("a result");
    eprintln!("{}", r.console);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    let pid = std::process::id().to_string();
    let target = std::env::current_exe().unwrap();
    let target = target.parent().unwrap().parent().unwrap().parent().unwrap();
    let target = target.to_str().unwrap();
    for line in r.console.lines() {
        // /proc/self/exe names the binary's host path (docs/confinement.md).
        if line.starts_with("mountinfo:") || line.starts_with("exe:") || !line.contains(':') {
            continue;
        }
        for word in line.split(|c: char| !c.is_ascii_digit()) {
            assert_ne!(word, pid, "the supervisor's pid in {line:.200}");
        }
        assert!(!line.contains(target), "the target dir in {line:.300}");
    }
    let get = |k: &str| {
        r.console
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap_or("")
            .trim()
            .to_string()
    };
    // The scratch space keeps the path of its host directory, which is
    // `<temp root>/rvisor-<random>`: no pid.
    let tmp = get("tempdir:");
    assert!(
        tmp.starts_with(std::env::temp_dir().to_str().unwrap()),
        "{tmp}"
    );
    assert!(tmp.ends_with("/Rtmp"), "{tmp}");
    assert_eq!(get("cmdline:"), "rvisor-worker");
    assert_eq!(get("environ:"), "unreadable", "not dumpable: root's file");
    // The mounts show neither the host's devtmpfs (its size is half the
    // host's memory) nor any host directory but the bound system paths.
    let mounts: Vec<&str> = r
        .console
        .lines()
        .skip_while(|l| !l.starts_with("mountinfo:"))
        .skip(1)
        .collect();
    assert!(mounts.len() > 5, "{mounts:?}");
    assert!(!mounts.iter().any(|m| m.contains("devtmpfs")), "{mounts:?}");
    assert!(!mounts.iter().any(|m| m.contains(target)), "{mounts:?}");
    assert!(!mounts.iter().any(|m| m.contains("rvisor-")), "{mounts:?}");
    // The devices work as devices.
    let r = s
        .run("writeLines('x', '/dev/null'); length(readBin('/dev/urandom', 'raw', 16))")
        .unwrap()
        .wait_timeout(Duration::from_secs(60))
        .unwrap();
    assert!(r.console.starts_with("[1] 16\n"), "{}", r.console);
}
