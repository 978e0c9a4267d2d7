//! Checkpoints at their limits, against real R: a state larger than the
//! worker's file-size limit, a checkpoint over the cap or the tenant's
//! quota (refused early, marked in the status, not picked again for
//! hibernation, and the calls it lost named after a restart), the memory
//! a checkpoint costs the server, kill -9 of the worker and of the server
//! while a checkpoint is being written, and hand-crafted checkpoints
//! restored into a confined worker.
//!
//! Sizes stay small (a cap of 32 MiB, states of at most 64 MiB); every
//! wait is on a condition with a deadline; no test asserts a duration.

use rvisor::checkpoint::Manifest;
use rvisor::{RunResult, Session, SessionOptions, SessionState, Supervisor};
use rvisor_ffi_tests::durable::{ok, supervisor, wait_state};
use rvisor_ffi_tests::{wait_for, ServeBin, TestDir};
use serde_json::{json, Value};
use std::path::Path;
use std::time::{Duration, Instant};

/// How long anything may take before the test calls it a hang.
const DEADLINE: Duration = Duration::from_secs(120);

const MIB: u64 = 1 << 20;

/// Session options with no automatic checkpoints or hibernation, and a
/// minute per call.
fn manual() -> SessionOptions {
    SessionOptions {
        timeout: Duration::from_secs(60),
        ..rvisor_ffi_tests::durable::manual()
    }
}

/// `n` MiB of doubles that LZ4 cannot shrink much.
fn random_mib(name: &str, n: u64) -> String {
    format!("set.seed(42); {name} <- runif({})", n * MIB / 8)
}

// ---------------------------------------------------------------------------
// Finding 4: over the worker's file-size limit

#[test]
fn a_state_larger_than_the_workers_file_size_limit_is_checkpointed_and_restored() {
    let dir = TestDir::new("rvisor-ckpt-fsize");
    let (sup, store) = supervisor(dir.path());
    // A worker that may write files of 4 MiB at most, holding 16 MiB.
    let s = sup
        .session_with(SessionOptions {
            limits: Some(rvisor::Limits {
                file_bytes: 4 * MIB,
                ..rvisor::Limits::default()
            }),
            ..manual()
        })
        .unwrap();
    ok(&s, &format!("{}; total <- sum(x)", random_mib("x", 16)));
    // The limit holds for the session's own files (a write past it fails
    // with EFBIG)...
    let r = ok(
        &s,
        "f <- file.path(tempdir(), 'big'); suppressWarnings(writeBin(raw(5 * 2^20), f)); \
         cat(file.size(f)); unlink(f)",
    );
    assert_eq!(r.console, (4 * MIB).to_string());
    // ...but not for its checkpoint, which goes through a pipe.
    let info = s.checkpoint().expect("the checkpoint is taken");
    assert!(info.bytes > 4 * MIB, "{} bytes", info.bytes);
    let on_disk = std::fs::metadata(store.path_of(&info.key).unwrap()).unwrap();
    assert_eq!(on_disk.len(), info.bytes);
    let st = s.status().checkpoint.expect("a durable session reports it");
    assert_eq!(st.state, rvisor::checkpoint::CheckpointState::Current);
    assert_eq!(st.bytes, Some(info.bytes));
    s.hibernate();
    wait_state(&s, SessionState::Hibernated);
    let r = ok(&s, "cat(identical(sum(x), total), length(x), '\\n')");
    assert_eq!(r.session.restored.expect("restored").reason, "hibernated");
    assert!(
        r.console.ends_with(&format!("TRUE {} \n", 16 * MIB / 8)),
        "{}",
        r.console
    );
}

// ---------------------------------------------------------------------------
// `rvisor serve`

/// A JSON answer of the server (any status).
fn http(method: &str, url: &str, body: Option<Value>) -> (u16, Value) {
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
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

fn serve(state: &Path, extra: &[&str]) -> ServeBin {
    let mut args = vec![
        "--state-dir",
        state.to_str().unwrap(),
        "--hibernate-after-secs",
        "0",
    ];
    args.extend_from_slice(extra);
    ServeBin::start(&args)
}

fn new_session(base: &str) -> String {
    let (status, s) = http("POST", &format!("{base}/v1/sessions"), Some(json!({})));
    assert_eq!(status, 201, "{s}");
    s["id"].as_str().unwrap().to_string()
}

fn call(base: &str, id: &str, code: &str) -> Value {
    let (status, r) = http(
        "POST",
        &format!("{base}/v1/sessions/{id}/run"),
        Some(json!({ "code": code, "timeout_seconds": 120 })),
    );
    assert_eq!(status, 200, "{code}: {r}");
    assert_eq!(r["outcome"], "complete", "{code}: {r}");
    r
}

fn status(base: &str, id: &str) -> Value {
    let (code, st) = http("GET", &format!("{base}/v1/sessions/{id}"), None);
    assert_eq!(code, 200, "{st}");
    st
}

fn checkpoint_state(base: &str, id: &str) -> String {
    status(base, id)["checkpoint"]["state"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// SIGTERM, then the exit.
fn stop(mut s: ServeBin) {
    // SAFETY: kill(2) of our own child process, which has not been reaped
    // (we hold its Child); no memory is involved.
    unsafe { libc::kill(s.child.id() as libc::pid_t, libc::SIGTERM) };
    wait_for("the server to exit after SIGTERM", DEADLINE, || {
        s.child.try_wait().ok().flatten()
    });
}

#[test]
fn a_checkpoint_over_the_cap_is_refused_marked_not_retried_and_a_restart_names_the_lost_call() {
    let state = TestDir::new("rvisor-ckpt-cap");
    let srv = serve(
        state.path(),
        &["--checkpoint-max-mb", "32", "--max-live-sessions", "1"],
    );
    let base = format!("http://{}", srv.addr);
    let id = new_session(&base);
    call(&base, &id, "small <- 'v1'");
    // The background checkpoint (2 s after a call) saves it.
    wait_for("the first checkpoint", DEADLINE, || {
        (checkpoint_state(&base, &id) == "current").then_some(())
    });
    // 64 MiB of random doubles: about 53 MiB compressed, over the cap.
    let big = call(
        &base,
        &id,
        &format!("{}; small <- 'v2'", random_mib("big", 64)),
    );
    let big_call = big["execution_id"].as_str().unwrap().to_string();
    let asked = Instant::now();
    let (code, e) = http("POST", &format!("{base}/v1/sessions/{id}/checkpoint"), None);
    let refused_in = asked.elapsed();
    assert_eq!(code, 413, "{e}");
    assert_eq!(e["error"]["code"], "too_large", "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("cap of 32 MiB per checkpoint"), "{msg}");
    assert!(msg.contains("--checkpoint-max-mb"), "{msg}");
    eprintln!("an over-cap checkpoint was refused in {refused_in:?}");

    let st = status(&base, &id);
    let ck = &st["checkpoint"];
    assert_eq!(ck["state"], "failed", "{st}");
    assert_eq!(ck["calls_since"], 1, "{st}");
    assert_eq!(ck["failure"]["kind"], "too_large", "{st}");
    // Not tried again before a call changes the state.
    assert!(ck["failure"]["retry_in_seconds"].is_null(), "{st}");
    let attempts = ck["failure"]["attempts"].as_u64().unwrap();
    assert_eq!(st["state"], "idle", "{st}");

    // Another session needs the one live slot: the idle session cannot be
    // checkpointed, so it is not hibernated (nor tried), and the call is
    // refused at once saying why.
    let other = new_session(&base);
    for _ in 0..3 {
        let (code, e) = http(
            "POST",
            &format!("{base}/v1/sessions/{other}/run"),
            Some(json!({"code": "1"})),
        );
        assert_eq!(code, 503, "{e}");
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains("cannot be checkpointed"), "{msg}");
    }
    let st = status(&base, &id);
    assert_eq!(st["state"], "idle", "{st}");
    assert_eq!(
        st["checkpoint"]["failure"]["attempts"].as_u64(),
        Some(attempts),
        "admission tried to checkpoint it again: {st}"
    );

    // A restart: the release tries once more and fails; the session comes
    // back from the checkpoint of v1, and its first result says which
    // call's work is gone and why.
    stop(srv);
    let srv = serve(state.path(), &["--checkpoint-max-mb", "32"]);
    let base = format!("http://{}", srv.addr);
    let r = call(&base, &id, "cat(small, exists('big'), '\\n')");
    assert!(
        r["console"].as_str().unwrap().ends_with("v1 FALSE \n"),
        "{r}"
    );
    let restored = &r["session"]["restored"];
    assert_eq!(restored["reason"], "restarted", "{r}");
    assert_eq!(restored["lost_call_count"], 1, "{r}");
    assert_eq!(restored["lost_calls"], json!([big_call]), "{r}");
    let reset = r["session"]["reset_reason"].as_str().unwrap_or_default();
    assert!(reset.starts_with("checkpoint_failed: "), "{r}");
    assert!(reset.contains("cap of 32 MiB"), "{r}");
    assert!(
        r["console"]
            .as_str()
            .unwrap()
            .contains("the work of 1 call after it is gone"),
        "{r}"
    );
    // Reported once: the state is the checkpoint's now, nothing is behind.
    let r = call(&base, &id, "small");
    assert!(r["session"]["restored"].is_null(), "{r}");
    assert!(r["session"]["reset_reason"].is_null(), "{r}");
}

#[test]
fn a_tenants_checkpoints_are_held_to_its_quota_and_a_closed_session_frees_it() {
    let state = TestDir::new("rvisor-ckpt-quota");
    let srv = serve(state.path(), &["--checkpoint-quota-mb", "20"]);
    let base = format!("http://{}", srv.addr);
    let (a, b) = (new_session(&base), new_session(&base));
    // About 13 MiB compressed each: one fits in 20 MiB, two do not.
    call(&base, &a, &random_mib("x", 16));
    call(&base, &b, &random_mib("x", 16));
    let ckpt = |id: &str| http("POST", &format!("{base}/v1/sessions/{id}/checkpoint"), None);
    let (code, info) = ckpt(&a);
    assert_eq!(code, 200, "{info}");
    let a_bytes = info["bytes"].as_u64().unwrap();
    let (code, e) = ckpt(&b);
    assert_eq!(code, 429, "{e}");
    assert_eq!(e["error"]["code"], "quota", "{e}");
    let msg = e["error"]["message"].as_str().unwrap();
    assert!(msg.contains("quota of 20 MiB"), "{msg}");
    assert!(msg.contains("--checkpoint-quota-mb"), "{msg}");
    assert!(msg.contains("close sessions"), "{msg}");
    let st = status(&base, &b);
    assert_eq!(st["checkpoint"]["failure"]["kind"], "quota", "{st}");

    let (_, u) = http("GET", &format!("{base}/v1/usage"), None);
    assert_eq!(u["checkpoints"], 1, "{u}");
    assert_eq!(u["checkpoint_bytes"], a_bytes, "{u}");
    assert_eq!(u["checkpoint_quota_bytes"], 20 * MIB, "{u}");
    assert_eq!(u["max_checkpoint_bytes"], 1024 * MIB, "{u}");
    let (_, h) = http("GET", &format!("{base}/v1/health"), None);
    assert_eq!(h["checkpoints"]["tenant_quota_bytes"], 20 * MIB, "{h}");

    // Closing a frees its share; b's checkpoint then fits.
    let (code, _) = http("DELETE", &format!("{base}/v1/sessions/{a}"), None);
    assert_eq!(code, 204);
    wait_for("a's checkpoint to be gone", DEADLINE, || {
        let (_, u) = http("GET", &format!("{base}/v1/usage"), None);
        (u["checkpoint_bytes"] == 0).then_some(())
    });
    let (code, info) = ckpt(&b);
    assert_eq!(code, 200, "{info}");
    assert_eq!(checkpoint_state(&base, &b), "current");
}

/// What a checkpoint may cost the server in memory whatever its size: the
/// store's upload holds two parts of 8 MiB at most (one uploading, the
/// next read), plus room for the allocator. Holding the checkpoint itself
/// (as the server did) costs its size, twice.
const UPLOAD_BUFFERS: u64 = 24 * MIB;

/// Resets the peak resident memory of process `pid` (VmHWM) to its
/// current resident memory.
fn reset_peak(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("clear_refs");
}

fn vm(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap()
}

#[test]
fn a_checkpoint_and_its_restore_cost_the_server_no_copy_of_it_in_memory() {
    let state = TestDir::new("rvisor-ckpt-rss");
    let srv = serve(state.path(), &[]);
    let base = format!("http://{}", srv.addr);
    let pid = srv.child.id();
    let id = new_session(&base);
    call(&base, &id, &random_mib("x", 48));
    // Whatever the background checkpoint did, the next one is asked for
    // with the memory peak reset.
    call(&base, &id, "x[1] <- 0");
    reset_peak(pid);
    let before = vm(pid, "VmRSS:");
    let (code, info) = http("POST", &format!("{base}/v1/sessions/{id}/checkpoint"), None);
    assert_eq!(code, 200, "{info}");
    let bytes = info["bytes"].as_u64().unwrap();
    assert!(bytes > 32 * MIB, "{info}");
    let grew = vm(pid, "VmHWM:").saturating_sub(before);
    eprintln!(
        "checkpoint of {} MiB: server peak RSS {} -> {} MiB",
        bytes >> 20,
        before >> 20,
        (before + grew) >> 20
    );
    assert!(
        grew < UPLOAD_BUFFERS,
        "the server's peak memory grew by {} MiB for a checkpoint of {} MiB",
        grew >> 20,
        bytes >> 20
    );
    // The restore goes the other way: store -> file -> worker.
    let (code, _) = http("POST", &format!("{base}/v1/sessions/{id}/hibernate"), None);
    assert_eq!(code, 200);
    wait_for("hibernation", DEADLINE, || {
        (status(&base, &id)["state"] == "hibernated").then_some(())
    });
    reset_peak(pid);
    let before = vm(pid, "VmRSS:");
    let r = call(&base, &id, "cat(length(x), '\\n')");
    assert_eq!(r["session"]["restored"]["reason"], "hibernated", "{r}");
    let grew = vm(pid, "VmHWM:").saturating_sub(before);
    eprintln!(
        "restore: server peak RSS {} -> {} MiB",
        before >> 20,
        (before + grew) >> 20
    );
    assert!(
        grew < UPLOAD_BUFFERS,
        "the server's peak memory grew by {} MiB for a restore of {} MiB",
        grew >> 20,
        bytes >> 20
    );
}

#[test]
fn a_checkpoint_and_its_restore_cost_the_supervisor_no_copy_of_it_in_memory() {
    // This process is the supervisor: its sessions' checkpoints go into a
    // directory (a copy in the kernel and a rename: no buffer at all).
    let dir = TestDir::new("rvisor-ckpt-rss-lib");
    let (sup, _store) = supervisor(dir.path());
    let s = sup.session_with(manual()).unwrap();
    ok(&s, &random_mib("x", 48));
    let me = std::process::id();
    reset_peak(me);
    let before = vm(me, "VmRSS:");
    let info = s.checkpoint().expect("checkpoint");
    assert!(info.bytes > 32 * MIB, "{info:?}");
    let grew = vm(me, "VmHWM:").saturating_sub(before);
    eprintln!(
        "checkpoint of {} MiB: supervisor peak RSS {} -> {} MiB",
        info.bytes >> 20,
        before >> 20,
        (before + grew) >> 20
    );
    assert!(grew < 8 * MIB, "peak memory grew by {} MiB", grew >> 20);
    s.hibernate();
    wait_state(&s, SessionState::Hibernated);
    reset_peak(me);
    let before = vm(me, "VmRSS:");
    let r = ok(&s, "cat(length(x), '\\n')");
    assert_eq!(r.session.restored.expect("restored").reason, "hibernated");
    let grew = vm(me, "VmHWM:").saturating_sub(before);
    assert!(grew < 8 * MIB, "peak memory grew by {} MiB", grew >> 20);
}

// ---------------------------------------------------------------------------
// Kill -9 while a checkpoint is written

/// Bytes process `pid` has written so far (`wchar` of /proc/PID/io).
fn written(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/io"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("wchar:"))?
        .trim()
        .parse()
        .ok()
}

/// Waits until worker `pid` has written `n` more bytes than `from`
/// (it is writing its checkpoint), then kills `victim` with SIGKILL.
/// False if the worker was gone first (the checkpoint was done).
fn kill_mid_write(pid: u32, from: u64, n: u64, victim: u32) -> bool {
    let end = Instant::now() + DEADLINE;
    loop {
        match written(pid) {
            Some(w) if w >= from + n => {
                // SAFETY: kill(2) of a process this test started (or the
                // supervisor it runs started); no memory is involved.
                unsafe { libc::kill(victim as libc::pid_t, libc::SIGKILL) };
                return true;
            }
            Some(_) => {}
            None => return false,
        }
        assert!(
            Instant::now() < end,
            "the worker never wrote its checkpoint"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn kill_9_of_the_worker_while_it_writes_a_checkpoint_leaves_the_previous_one_valid() {
    let dir = TestDir::new("rvisor-ckpt-kill-worker");
    let (sup, store) = supervisor(dir.path());
    let s = sup.session_with(manual()).unwrap();
    ok(&s, "v <- 'first'");
    let first = s.checkpoint().expect("first checkpoint");
    let path = store.path_of(&first.key).unwrap();
    let before = std::fs::read(&path).unwrap();
    let mut lost = None;
    for round in 0..5 {
        // A large state (written for a few seconds), and a changed marker.
        let r = ok(
            &s,
            &format!("{}; v <- 'second {round}'", random_mib("big", 48)),
        );
        let pid = s.status().pid.expect("a worker");
        let from = written(pid).unwrap();
        let s2 = s.clone();
        let taking = std::thread::spawn(move || s2.checkpoint());
        let killed = kill_mid_write(pid, from, 4 * MIB, pid);
        let out = taking.join().unwrap();
        if let (true, Err(e)) = (killed, out) {
            assert!(matches!(e, rvisor::CheckpointError::Worker(_)), "{e:?}");
            lost = Some(r.execution_id);
            break;
        }
        // The checkpoint finished before the kill landed: try again.
    }
    let lost = lost.expect("a kill landed while the checkpoint was written");
    // The store still holds the first checkpoint, byte for byte, and no
    // partial file.
    assert!(std::fs::read(&path).unwrap() == before);
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names
            .iter()
            .all(|n| n.ends_with(".ckpt") || n.ends_with(".unsaved.json")),
        "{names:?}"
    );
    let r = ok(&s, "cat(v, exists('big'), '\\n')");
    assert_eq!(r.session.reset_reason.as_deref(), Some("killed"));
    let restored = r.session.restored.expect("restored");
    assert_eq!(restored.checkpoint_at, first.manifest.taken_at());
    assert_eq!(restored.lost_calls.last(), Some(&lost));
    assert!(r.console.ends_with("first FALSE \n"), "{}", r.console);
}

#[test]
fn kill_9_of_the_server_while_a_checkpoint_is_written_leaves_the_previous_one_valid() {
    let state = TestDir::new("rvisor-ckpt-kill-server");
    let mut killed = false;
    let mut id = String::new();
    for round in 0..5 {
        let srv = serve(state.path(), &[]);
        let base = format!("http://{}", srv.addr);
        if id.is_empty() {
            id = new_session(&base);
            call(&base, &id, "v <- 'first'");
            let (code, info) = http("POST", &format!("{base}/v1/sessions/{id}/checkpoint"), None);
            assert_eq!(code, 200, "{info}");
        }
        call(
            &base,
            &id,
            &format!("{}; v <- 'second {round}'", random_mib("big", 48)),
        );
        let pid = status(&base, &id)["pid"].as_u64().unwrap() as u32;
        let from = written(pid).unwrap();
        let url = format!("{base}/v1/sessions/{id}/checkpoint");
        // Answered (the checkpoint was done first), or cut off.
        let asking = std::thread::spawn(move || ureq::post(&url).timeout(DEADLINE).call().is_ok());
        killed = kill_mid_write(pid, from, 4 * MIB, srv.child.id());
        let answer = asking.join().unwrap();
        drop(srv);
        if killed && !answer {
            break;
        }
        // Finished before the kill: stop this server and try again (the
        // session comes back from what it saved).
        killed = false;
    }
    assert!(killed, "a kill landed while the checkpoint was written");
    // The checkpoint in the store is the first one, whole.
    let ckpt = std::fs::read_dir(state.path().join("sessions"))
        .unwrap()
        .flat_map(|t| std::fs::read_dir(t.unwrap().path()).unwrap())
        .map(|s| s.unwrap().path().join("checkpoint"))
        .find(|p| p.is_file())
        .expect("the checkpoint is there");
    let m = Manifest::read_from(&mut std::fs::File::open(&ckpt).unwrap()).expect("valid");
    assert!(!m.objects.contains(&"big".to_string()), "{:?}", m.objects);
    let srv = serve(state.path(), &[]);
    let base = format!("http://{}", srv.addr);
    let r = call(&base, &id, "cat(v, exists('big'), '\\n')");
    assert_eq!(r["session"]["restored"]["reason"], "restarted", "{r}");
    assert!(
        r["console"].as_str().unwrap().ends_with("first FALSE \n"),
        "{r}"
    );
}

// ---------------------------------------------------------------------------
// Hand-crafted checkpoints restored into a confined worker

/// Rewrites the checkpoint at `path`: its state decompressed, changed by
/// `edit`, compressed again, with the manifest's sizes to match (or a
/// manifest changed by `manifest`).
fn craft(path: &Path, edit: impl FnOnce(&mut Vec<u8>), manifest: impl FnOnce(&mut Value)) {
    use std::io::{Read, Write};
    let mut f = std::fs::File::open(path).unwrap();
    let (layout, m) = rvisor_protocol::checkpoint::read_manifest(&mut f).unwrap();
    let all = std::fs::read(path).unwrap();
    let frame =
        &all[layout.frame_offset as usize..(layout.frame_offset + layout.frame_len) as usize];
    let mut state = Vec::new();
    lz4_flex::frame::FrameDecoder::new(frame)
        .read_to_end(&mut state)
        .unwrap();
    edit(&mut state);
    let mut enc = lz4_flex::frame::FrameEncoder::with_frame_info(
        lz4_flex::frame::FrameInfo::new().content_checksum(true),
        Vec::new(),
    );
    enc.write_all(&state).unwrap();
    let frame = enc.finish().unwrap();
    let mut m: Value = serde_json::from_slice(&m).unwrap();
    m["state_bytes"] = json!(state.len());
    m["compressed_bytes"] = json!(frame.len());
    manifest(&mut m);
    let m = m.to_string();
    let mut out = rvisor_protocol::checkpoint::MAGIC.to_vec();
    out.extend_from_slice(&frame);
    out.extend_from_slice(m.as_bytes());
    out.extend_from_slice(&(m.len() as u32).to_be_bytes());
    std::fs::write(path, out).unwrap();
}

/// Replaces the one occurrence of `from` in `bytes` by `to` (same length).
fn replace_once(bytes: &mut [u8], from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len());
    let at: Vec<usize> = (0..=bytes.len() - from.len())
        .filter(|&i| &bytes[i..i + from.len()] == from)
        .collect();
    assert_eq!(
        at.len(),
        1,
        "{:?} occurs {} times",
        String::from_utf8_lossy(from),
        at.len()
    );
    bytes[at[0]..at[0] + from.len()].copy_from_slice(to);
}

/// A hibernated session whose checkpoint holds `x` and the file `name`
/// (created in its working directory), for `craft` to change.
fn hibernated_with_file(sup: &Supervisor, name: &str) -> (Session, String) {
    let s = sup.session_with(manual()).unwrap();
    let (dir, _) = name.rsplit_once('/').unwrap_or(("", name));
    ok(
        &s,
        &format!(
            "x <- 'crafted'; if (nzchar('{dir}')) dir.create('{dir}'); writeLines('data', '{name}')"
        ),
    );
    let info = s.checkpoint().unwrap();
    assert!(
        info.manifest.files.contains(&name.to_string()),
        "{:?}",
        info.manifest.files
    );
    s.hibernate();
    wait_state(&s, SessionState::Hibernated);
    (s, info.key)
}

/// The next call of a session whose restore must be refused: a fresh
/// worker, `restore_failed` saying `why`, nothing of the checkpoint.
fn assert_refused(s: &Session, why: &str) -> RunResult {
    let r = ok(s, "cat(exists('x'), '\\n')");
    let reason = r.session.reset_reason.clone().unwrap_or_default();
    assert!(reason.starts_with("restore_failed: "), "{reason}");
    assert!(reason.contains(why), "{why:?} not in {reason}");
    assert!(r.session.fresh);
    assert!(r.session.restored.is_none());
    assert!(r.console.ends_with("FALSE \n"), "{}", r.console);
    r
}

#[test]
fn a_checkpoint_naming_a_file_outside_the_working_directory_is_refused() {
    let dir = TestDir::new("rvisor-ckpt-dotdot");
    let (sup, store) = supervisor(dir.path());
    // Each crafted path has its made one's length: the state is edited in
    // place.
    for (made, crafted) in [
        ("zz/escaped.txt", "../escaped.txt"),
        ("zz/zzzzzz.txt", "z/../../x.txt"),
        ("zzzz/abs.txt", "/tmp/abs.txt"),
    ] {
        let (s, key) = hibernated_with_file(&sup, made);
        craft(
            &store.path_of(&key).unwrap(),
            |st| replace_once(st, made.as_bytes(), crafted.as_bytes()),
            |m| m["files"] = json!([crafted]),
        );
        assert_refused(&s, "would be written outside the working directory");
        // The fresh worker goes on.
        assert_eq!(ok(&s, "1 + 1").console, "[1] 2\n");
        s.close();
    }
}

#[test]
fn a_checkpoint_whose_file_path_holds_a_nul_is_refused() {
    let dir = TestDir::new("rvisor-ckpt-nul");
    let (sup, store) = supervisor(dir.path());
    let (s, key) = hibernated_with_file(&sup, "nulXname.txt");
    craft(
        &store.path_of(&key).unwrap(),
        |st| replace_once(st, b"nulXname.txt", b"nul\0name.txt"),
        |_| {},
    );
    assert_refused(&s, "nul");
}

#[test]
fn a_checkpoint_writing_through_a_symbolic_link_is_refused() {
    let dir = TestDir::new("rvisor-ckpt-link");
    let (sup, store) = supervisor(dir.path());
    // A session whose working directory (the host's, read-only inside)
    // holds a link to a directory outside it.
    let wd = TestDir::new("rvisor-ckpt-link-wd");
    let outside = TestDir::new("rvisor-ckpt-link-outside");
    std::os::unix::fs::symlink(outside.path(), wd.path().join("ln")).unwrap();
    let s = sup
        .session_with(SessionOptions {
            working_dir: Some(wd.path().to_path_buf()),
            ..manual()
        })
        .unwrap();
    ok(&s, "x <- 1");
    let key = s.checkpoint().unwrap().key;
    s.hibernate();
    wait_state(&s, SessionState::Hibernated);
    // Its checkpoint, replaced by one (of another session) with a file
    // whose path goes through the link.
    let (donor, donor_key) = hibernated_with_file(&sup, "zz/pwned.txt");
    let path = store.path_of(&key).unwrap();
    std::fs::copy(store.path_of(&donor_key).unwrap(), &path).unwrap();
    craft(
        &path,
        |st| replace_once(st, b"zz/pwned.txt", b"ln/pwned.txt"),
        |m| m["files"] = json!(["ln/pwned.txt"]),
    );
    assert_refused(&s, "through a symbolic link");
    assert!(!outside.path().join("pwned.txt").exists());
    donor.close();
}

#[test]
fn a_checkpoint_with_a_huge_manifest_or_a_huge_claimed_state_is_refused() {
    let dir = TestDir::new("rvisor-ckpt-huge");
    let (sup, store) = supervisor(dir.path());
    // A manifest length of 4 GiB in the trailer.
    let s = sup.session_with(manual()).unwrap();
    ok(&s, "x <- 1");
    let key = s.checkpoint().unwrap().key;
    s.hibernate();
    wait_state(&s, SessionState::Hibernated);
    let path = store.path_of(&key).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let n = bytes.len();
    bytes[n - 4..].copy_from_slice(&u32::MAX.to_be_bytes());
    std::fs::write(&path, &bytes).unwrap();
    assert_refused(&s, "more than the 16 MiB a manifest may have");
    // A manifest that claims a state of 1 PB behind a frame of a few
    // bytes: refused before anything is allocated for it.
    ok(&s, "x <- 1");
    let key = s.checkpoint().unwrap().key;
    s.hibernate();
    wait_state(&s, SessionState::Hibernated);
    craft(
        &store.path_of(&key).unwrap(),
        |_| {},
        |m| m["state_bytes"] = json!(1u64 << 50),
    );
    assert_refused(&s, "more than its");
}
