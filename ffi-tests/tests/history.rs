//! Session history (server/src/service/history.rs, docs/console.md)
//! against real R: what each call left (code, console, plots, tables,
//! files changed, outcome), resets and restores as entries of their own,
//! the bounds by count and by bytes, paging newest first, tenant
//! isolation, and that the history outlives hibernation and the node
//! (a second node reads it from the shared store).
//!
//! Every wait is on a condition with a deadline; no test asserts a
//! duration.

use rvisor::{Outcome, Supervisor, SupervisorConfig};
use rvisor_ffi_tests::cluster::{call, post_json, Node, NodeOptions, Store};
use rvisor_ffi_tests::{wait_for, TestDir};
use rvisor_server::service::{
    EntryKind, ErrorCode, HistoryLimits, NewSession, Service, ServiceConfig, SessionRun,
};
use rvisor_server::tables::TableConfig;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(120);

fn service(dir: &TestDir, history: HistoryLimits) -> Service {
    let sup = Supervisor::new(SupervisorConfig::default()).expect("supervisor starts");
    Service::new(
        sup,
        ServiceConfig {
            tokens: Some(HashMap::from([
                ("alice-token-0123456789".to_string(), "alice".to_string()),
                ("bob-token-0123456789ab".to_string(), "bob".to_string()),
            ])),
            tables: TableConfig {
                dir: dir.path().join("tables"),
                ..TableConfig::default()
            },
            history,
            ..ServiceConfig::default()
        },
    )
    .expect("the service starts")
}

fn run(svc: &Service, tenant: &str, id: &str, code: &str) -> rvisor::RunResult {
    let req = SessionRun {
        code: code.into(),
        timeout_seconds: None,
        plot_width: None,
        plot_height: None,
        display: None,
    };
    svc.session_run(tenant, id, &req)
        .unwrap_or_else(|e| panic!("{code}: refused: {e}"))
        .wait()
}

#[test]
fn calls_are_kept_with_their_output_plots_tables_and_files_and_other_tenants_see_nothing() {
    let dir = TestDir::new("history-calls");
    let svc = service(&dir, HistoryLimits::default());
    let id = svc
        .create_session("alice", NewSession::default())
        .expect("a session")
        .id;
    assert_eq!(
        run(&svc, "alice", &id, "x <- 41; cat('hello', x + 1, '\\n')").outcome,
        Outcome::Complete
    );
    run(&svc, "alice", &id, "plot(1:10)");
    run(
        &svc,
        "alice",
        &id,
        "data.frame(a = 1:3, b = c('p', 'q', 'r'))",
    );
    run(&svc, "alice", &id, "writeLines('bye', 'out.txt')");
    assert_eq!(
        run(&svc, "alice", &id, "stop('boom')").outcome,
        Outcome::Error
    );
    svc.reset("alice", &id).expect("reset");

    let page = svc.history("alice", &id, None, None).expect("history");
    assert_eq!(page.total, 6);
    assert_eq!(page.next, None);
    let e = &page.entries;
    // Newest first: the reset, the error, the file, the table, the plot,
    // the first call.
    assert_eq!(e[0].kind, EntryKind::Reset);
    assert_eq!(e[0].reason.as_deref(), Some("reset"));
    assert_eq!((e[1].outcome.as_str(), e[1].success), ("error", false));
    assert!(e[1].error.as_ref().unwrap()["message"]
        .as_str()
        .unwrap()
        .contains("boom"));
    assert!(
        e[2].files.iter().any(|f| f["name"] == "out.txt"),
        "{:?}",
        e[2].files
    );
    let table = &e[3].displays[0];
    assert_eq!(table["metadata"]["rvisor"]["kind"], "table");
    assert_eq!(table["data"]["application/json"]["nrow"], 3);
    assert_eq!(e[4].plots.len(), 1);
    assert!(e[4].plots[0]["data_base64"].as_str().unwrap().len() > 100);
    assert_eq!(e[5].console, "hello 42 \n");
    assert_eq!(e[5].code, "x <- 41; cat('hello', x + 1, '\\n')");
    assert!(e[5].duration_ms > 0.0 && !e[5].started_at.is_empty());
    let seqs: Vec<u64> = e.iter().map(|x| x.seq).collect();
    assert_eq!(seqs, vec![6, 5, 4, 3, 2, 1]);

    // The list shows the session with its last call; another tenant's
    // list is empty and its history of the session answers like an
    // unknown session.
    let mine = svc.list_sessions("alice");
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].id, id);
    assert_eq!(mine[0].last_call.as_ref().unwrap()["outcome"], "error");
    assert!(svc.list_sessions("bob").is_empty());
    let theirs = svc.history("bob", &id, None, None).unwrap_err();
    let unknown = svc
        .history("bob", "s-00000000000000000000000000000000", None, None)
        .unwrap_err();
    assert_eq!(theirs.code, ErrorCode::NotFound);
    assert_eq!(theirs.to_json(), unknown.to_json());
    // A page of 0 or of 101 entries says what to ask for.
    let bad = svc.history("alice", &id, Some(0), None).unwrap_err();
    assert_eq!(bad.code, ErrorCode::Invalid);
    assert!(bad.message.contains("1 to 100"), "{}", bad.message);
    // Operators only.
    assert_eq!(
        svc.admin_stats("alice").unwrap_err().code,
        ErrorCode::Forbidden
    );
}

#[test]
fn the_oldest_entries_leave_first_by_count_and_by_bytes_and_a_big_one_is_cut() {
    let dir = TestDir::new("history-bounds");
    let svc = service(
        &dir,
        HistoryLimits {
            max_entries: 5,
            max_bytes: 20_000,
            max_entry_bytes: 12_000,
        },
    );
    let id = svc
        .create_session("alice", NewSession::default())
        .expect("a session")
        .id;
    for i in 1..=7 {
        run(&svc, "alice", &id, &format!("cat({i})"));
    }
    let page = svc.history("alice", &id, Some(100), None).unwrap();
    assert_eq!(page.total, 5);
    assert_eq!(page.dropped, 2);
    let codes: Vec<&str> = page.entries.iter().map(|e| e.code.as_str()).collect();
    assert_eq!(codes, ["cat(7)", "cat(6)", "cat(5)", "cat(4)", "cat(3)"]);

    // Paging: two at a time, newest first, each cursor the next page's.
    let p1 = svc.history("alice", &id, Some(2), None).unwrap();
    let before = p1.next.unwrap();
    let p2 = svc.history("alice", &id, Some(2), Some(before)).unwrap();
    let p3 = svc.history("alice", &id, Some(2), p2.next).unwrap();
    let all: Vec<&str> = [&p1, &p2, &p3]
        .iter()
        .flat_map(|p| p.entries.iter().map(|e| e.code.as_str()))
        .collect();
    assert_eq!(all, codes);
    assert_eq!(p3.next, None);

    // By bytes: three calls of ~8 KB each (their text twice: console
    // and segments) are more than the 20 KB; older ones leave though
    // fewer than 5 entries remain.
    for _ in 0..3 {
        run(&svc, "alice", &id, "cat(strrep('a', 4000))");
    }
    let page = svc.history("alice", &id, Some(100), None).unwrap();
    let bytes: usize = page
        .entries
        .iter()
        .map(|e| serde_json::to_vec(e).unwrap().len())
        .sum();
    assert!(bytes <= 20_000, "{bytes}");
    assert!(page.total < 5, "{}", page.total);
    assert!(page.entries[0].truncated.is_none());

    // One entry over 12 KB is cut, and says what it left out.
    run(&svc, "alice", &id, "cat(strrep('b', 50000)); plot(1)");
    let top = &svc.history("alice", &id, Some(1), None).unwrap().entries[0];
    let why = top.truncated.as_deref().expect("cut");
    assert!(why.contains("over the 12000 bytes"), "{why}");
    assert!(why.contains("plots") && why.contains("console"), "{why}");
    assert!(top.plots.is_empty());
    assert!(top.console.starts_with("bbbb") && top.console.len() < 12_000);
    assert!(serde_json::to_vec(top).unwrap().len() <= 12_000);
}

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789ab";

fn get(node: &Node, path: &str, token: &str) -> (u16, Value) {
    let a = call("GET", &node.url(path), token, None);
    (a.status, a.body)
}

#[test]
fn the_history_outlives_hibernation_and_its_node() {
    let dir = TestDir::new("history-store");
    let store = dir.path().join("store");
    std::fs::create_dir_all(&store).unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(
        &tokens,
        format!("{ALICE} alice\n{BOB} bob\nops-token-0123456789ab ops\n"),
    )
    .unwrap();
    let opts = NodeOptions {
        store: Store::Dir(&store),
        tokens: Some(&tokens),
        ..NodeOptions::default()
    };
    let n1 = Node::start("n1", &opts);
    let s = post_json(&n1.url("/v1/sessions"), ALICE, json!({}));
    assert_eq!(s.status, 201, "{:?}", s.body);
    let id = s.body["id"].as_str().unwrap().to_string();
    let run = |node: &Node, code: &str| {
        let r = post_json(
            &node.url(&format!("/v1/sessions/{id}/run")),
            ALICE,
            json!({ "code": code }),
        );
        assert_eq!(r.status, 200, "{:?}", r.body);
        r.body
    };
    run(&n1, "v <- 'kept'; cat(v)");
    let h = post_json(
        &n1.url(&format!("/v1/sessions/{id}/hibernate")),
        ALICE,
        json!({}),
    );
    assert_eq!(h.status, 200, "{:?}", h.body);
    wait_for("the session to hibernate", DEADLINE, || {
        let (_, st) = get(&n1, &format!("/v1/sessions/{id}"), ALICE);
        (st["state"] == "hibernated").then_some(())
    });
    // The history went into the store with the checkpoint.
    let kept = walk(&store);
    assert!(kept.iter().any(|p| p.ends_with("/checkpoint")), "{kept:?}");
    assert!(
        kept.iter().any(|p| p.ends_with("/history.json")),
        "{kept:?}"
    );
    let woke = run(&n1, "cat(v)");
    assert_eq!(woke["session"]["restored"]["reason"], "hibernated");

    let (status, page) = get(&n1, &format!("/v1/sessions/{id}/history"), ALICE);
    assert_eq!(status, 200, "{page}");
    let kinds: Vec<&str> = page["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["call", "restore", "call"]);
    assert_eq!(page["entries"][1]["reason"], "hibernated");

    // Over HTTP: the list, bad queries as 400s in the JSON error shape,
    // another tenant's session like an unknown one.
    let (_, list) = get(&n1, "/v1/sessions", ALICE);
    assert_eq!(list["sessions"][0]["id"], id.as_str());
    let (_, none) = get(&n1, "/v1/sessions", BOB);
    assert_eq!(none["sessions"], json!([]));
    for q in ["limit=abc", "before=x", "limit=1&limit=2"] {
        let (status, body) = get(&n1, &format!("/v1/sessions/{id}/history?{q}"), ALICE);
        assert_eq!(status, 400, "{q}: {body}");
        assert_eq!(body["error"]["code"], "bad_request", "{q}");
    }
    let (theirs, tb) = get(&n1, &format!("/v1/sessions/{id}/history"), BOB);
    let (unknown, ub) = get(
        &n1,
        "/v1/sessions/s-00000000000000000000000000000000/history",
        BOB,
    );
    assert_eq!((theirs, &tb), (404, &ub));
    assert_eq!(unknown, 404);
    let (forbidden, _) = get(&n1, "/v1/admin/stats", ALICE);
    assert_eq!(forbidden, 403);
    let (ok, stats) = get(&n1, "/v1/admin/stats", "ops-token-0123456789ab");
    assert_eq!(ok, 200, "{stats}");
    let calls: u64 = stats["minutes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["calls"].as_u64().unwrap())
        .sum();
    assert!(calls >= 2, "{stats}");

    // The node stops (SIGTERM: it drains and hands its sessions off);
    // another node on the same store has the whole history, and adds to it.
    n1.signal(libc::SIGTERM);
    let mut n1 = n1;
    wait_for("n1 to exit", DEADLINE, || {
        n1.serve.child.try_wait().ok().flatten().map(|_| ())
    });
    let n2 = Node::start("n2", &opts);
    let (status, page) = get(&n2, &format!("/v1/sessions/{id}/history"), ALICE);
    assert_eq!(status, 200, "{page}");
    assert_eq!(page["total"], 3, "{page}");
    assert_eq!(page["entries"][2]["console"], "kept");
    run(&n2, "cat(v, 'on n2')");
    let (_, page) = get(&n2, &format!("/v1/sessions/{id}/history?limit=2"), ALICE);
    let e = page["entries"].as_array().unwrap();
    assert!(
        e[0]["console"].as_str().unwrap().ends_with("kept on n2"),
        "{page}"
    );
    // Numbering goes on from n1's (a restore entry may come first).
    assert!(e[0]["seq"].as_u64().unwrap() >= 4, "{page}");
    assert!(page["next"].is_u64(), "{page}");
    // A closed session's history goes with it.
    assert_eq!(
        call(
            "DELETE",
            &n2.url(&format!("/v1/sessions/{id}")),
            ALICE,
            None
        )
        .status,
        204
    );
    let left: Vec<_> = walk(&store)
        .into_iter()
        .filter(|p| p.ends_with("history.json"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

fn walk(d: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(d) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p.display().to_string());
            }
        }
    }
    out
}

#[test]
fn session_jsonl_answers_history_pages() {
    use std::io::{BufRead, BufReader, Write};
    let mut child = std::process::Command::new(rvisor_ffi_tests::rvisor_bin())
        .args(["--unconfined", "session", "--jsonl"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("rvisor session --jsonl starts");
    let mut input = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut ask = |v: Value| -> Value {
        writeln!(input, "{v}").unwrap();
        input.flush().unwrap();
        let line = lines.next().expect("an answer").unwrap();
        serde_json::from_str(&line).unwrap()
    };
    for i in 1..=3 {
        let r = ask(json!({"id": i, "op": "run", "code": format!("cat({i})")}));
        assert_eq!(r["result"]["outcome"], "complete", "{r}");
    }
    let h = ask(json!({"id": 9, "op": "history", "limit": 2}));
    let codes: Vec<&str> = h["history"]["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["code"].as_str().unwrap())
        .collect();
    assert_eq!(codes, ["cat(3)", "cat(2)"], "{h}");
    assert_eq!(h["history"]["next"], 2);
    let older = ask(json!({"id": 10, "op": "history", "before": 2}));
    assert_eq!(older["history"]["entries"][0]["console"], "1", "{older}");
    let bad = ask(json!({"id": 11, "op": "history", "limit": 0}));
    assert_eq!(bad["error"]["code"], "invalid", "{bad}");
    drop(input);
    let _ = child.wait();
}

#[test]
fn a_watcher_sees_every_call_of_the_session_in_full_whoever_runs_it() {
    use rvisor::EventKind;
    let dir = TestDir::new("history-watch");
    let svc = service(&dir, HistoryLimits::default());
    let id = svc
        .create_session("alice", NewSession::default())
        .expect("a session")
        .id;
    let e = svc.watch("bob", &id).expect_err("not bob's");
    assert_eq!(e.code, ErrorCode::NotFound, "{e}");
    let watch = svc.watch("alice", &id).expect("a watch");
    // Queued without streaming, and printing more than status's tail
    // keeps (20 lines): the watcher still gets all of it.
    let code = "for (i in 1:60) cat('line', i, '\\n'); Sys.sleep(0.3); message('to stderr'); cat('end\\n')";
    let r = run(&svc, "alice", &id, code);
    assert_eq!(r.outcome, Outcome::Complete, "{r:?}");
    let seen = watch.recv_timeout(DEADLINE).expect("the call is seen");
    assert_eq!(
        (seen.execution_id.as_str(), seen.code.as_str()),
        (r.execution_id.as_str(), code)
    );
    let mut text = String::new();
    let mut result = None;
    for e in seen.events {
        match e.kind {
            EventKind::Result { result: got } => result = Some(got),
            kind => text.push_str(kind.console_text().unwrap_or("")),
        }
    }
    assert_eq!(text, r.console, "every line, in order");
    assert_eq!(text.lines().count(), 62, "{text}");
    let result = result.expect("the result ends the call's events");
    assert_eq!(
        (result.execution_id, result.outcome),
        (r.execution_id.clone(), Outcome::Complete)
    );

    // At most MAX_WATCHERS at once (busy past that); a dropped one frees
    // its place.
    let more: Vec<_> = (1..rvisor::MAX_WATCHERS)
        .map(|_| svc.watch("alice", &id).expect("room"))
        .collect();
    let e = svc.watch("alice", &id).expect_err("full");
    assert_eq!(e.code, ErrorCode::Busy, "{e}");
    drop(more);
    let last = svc.watch("alice", &id).expect("room again");
    // The next call is seen by both; closing the session ends the watch.
    let r = run(&svc, "alice", &id, "cat('again\\n')");
    for w in [&watch, &last] {
        let seen = w.recv_timeout(DEADLINE).expect("seen");
        assert_eq!(seen.execution_id, r.execution_id);
    }
    svc.close("alice", &id).expect("closed");
    assert!(matches!(
        last.recv_timeout(DEADLINE),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
    ));
}
