//! Many nodes behind nginx (docs/scale-out.md), on one machine: real
//! `rvisor serve --node-id nK` processes on loopback ports, real nginx
//! running deploy/nginx/rvisor.conf as shipped (addresses substituted) and
//! a local S3 server (moto) as the shared store. nginx and moto are
//! installed by scripts/setup.sh; without them these tests fail and say so.

use rvisor_ffi_tests::cluster::{
    call, post_json, Answer, Moto, Nginx, Node, NodeOptions, Store, BUCKET, START,
};
use rvisor_ffi_tests::{wait_for, TestDir};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

const USER: &str = "user-token-0123456789abcdef";
const OPS: &str = "ops-token-0123456789abcdef0";

/// Node `id` on the moto store, with the test's tokens.
fn node(id: &str, moto: &Moto, tokens: &Path) -> Node {
    Node::start(
        id,
        &NodeOptions {
            store: Store::S3(moto),
            tokens: Some(tokens),
            ..NodeOptions::default()
        },
    )
}

/// The node that answered, from nginx's `$upstream_addr` (which lists
/// every node tried: `a : b, c`).
fn answered_by(upstream: &str) -> &str {
    upstream
        .rsplit([',', ' '])
        .find(|p| !p.is_empty() && *p != ":")
        .unwrap_or("")
}

fn node_of(id: &str) -> &str {
    id.split_once(".s-").map(|(n, _)| n).unwrap_or("")
}

/// A new session through nginx: its id.
fn new_session(nginx: &Nginx) -> String {
    let a = post_json(&nginx.url("/v1/sessions"), USER, json!({}));
    assert_eq!(a.status, 201, "{a:?}");
    a.body["id"].as_str().expect("an id").to_string()
}

/// Runs `code` in session `id` through nginx: the printed console and the
/// node that answered.
fn session_run(nginx: &Nginx, id: &str, code: &str) -> (String, String) {
    let a = post_json(
        &nginx.url(&format!("/v1/sessions/{id}/run")),
        USER,
        json!({ "code": code }),
    );
    assert_eq!(a.status, 200, "{id}: {a:?}");
    assert_eq!(a.body["outcome"], "complete", "{id}: {}", a.body);
    (
        a.body["console"].as_str().unwrap_or("").trim().to_string(),
        a.upstream,
    )
}

/// Runs `code` in session `id` through nginx and prints how long the
/// answer took (docs/scale-out.md quotes these); the answer must be 200.
fn timed_call(nginx: &Nginx, id: &str, code: &str, what: &str) -> Answer {
    let t = std::time::Instant::now();
    let r = post_json(
        &nginx.url(&format!("/v1/sessions/{id}/run")),
        USER,
        json!({ "code": code }),
    );
    eprintln!(
        "{what}: {id}'s next call answered in {:.0} ms by {}",
        t.elapsed().as_secs_f64() * 1000.0,
        r.upstream
    );
    assert_eq!(r.status, 200, "{r:?}");
    r
}

fn tokens_file(dir: &TestDir) -> PathBuf {
    let f = dir.path().join("tokens");
    std::fs::write(&f, format!("{USER} alice\n{OPS} ops\n")).unwrap();
    f
}

#[test]
fn sessions_route_by_node_tables_are_shared_drain_refuses_new_work_and_a_new_node_takes_some() {
    let moto = Moto::start();
    let dir = TestDir::new("rvisor-multinode");
    let tokens = tokens_file(&dir);
    let n1 = node("n1", &moto, &tokens);
    let n2 = node("n2", &moto, &tokens);
    let n3 = node("n3", &moto, &tokens);
    let nodes = [&n1, &n2, &n3];
    let addr_of: BTreeMap<String, String> = nodes
        .iter()
        .map(|n| (n.id.clone(), n.serve.addr.clone()))
        .collect();
    let nginx = Nginx::start(&nodes);

    // 1. Sessions made through nginx spread over the nodes, and each keeps
    // its state across calls, every call answered by the node in its id.
    let mut sessions: Vec<(String, i64)> = Vec::new();
    for k in 0..9 {
        let id = new_session(&nginx);
        let (_, up) = session_run(&nginx, &id, &format!("x <- {k}"));
        assert_eq!(up, addr_of[node_of(&id)], "{id} answered by {up}");
        sessions.push((id, k));
    }
    for (id, k) in &sessions {
        let (out, up) = session_run(&nginx, id, "cat(x * 10)");
        assert_eq!(out, (k * 10).to_string(), "{id}");
        assert_eq!(up, addr_of[node_of(id)]);
    }
    let mut spread: BTreeMap<&str, usize> = BTreeMap::new();
    for (id, _) in &sessions {
        *spread.entry(node_of(id)).or_default() += 1;
    }
    assert_eq!(spread.len(), 3, "least_conn used every node: {spread:?}");

    // 2. A table uploaded through nginx lands on one node and is used by
    // one-shot runs on each of the others (asked directly).
    let up = call(
        "POST",
        &nginx.url("/v1/tables"),
        USER,
        Some(("text/csv", b"v,w\n1,a\n2,b\n39,c\n".to_vec())),
    );
    assert_eq!(up.status, 201, "{up:?}");
    let pointer = up.body["data_pointer"].as_str().unwrap().to_string();
    let stored_on = up.upstream.clone();
    let others: Vec<&&Node> = nodes.iter().filter(|n| n.serve.addr != stored_on).collect();
    assert_eq!(others.len(), 2, "stored on {stored_on}");
    for n in others {
        let r = post_json(
            &n.url("/v1/run"),
            USER,
            json!({"script": "cat(sum(d$v), nrow(d))",
                   "dataframes": [{"data_pointer": pointer, "name": "d"}]}),
        );
        assert_eq!(r.status, 200, "{}: {r:?}", n.id);
        assert_eq!(
            r.body["console"].as_str().unwrap_or("").trim(),
            "42 3",
            "{}",
            n.id
        );
        // Another tenant's view of it: unknown, on every node.
        let o = post_json(
            &n.url("/v1/run"),
            OPS,
            json!({"script": "1", "dataframes": [{"data_pointer": pointer, "name": "d"}]}),
        );
        assert_eq!(o.status, 404, "{o:?}");
        assert_eq!(o.body["error"]["code"], "data_pointer_unresolved", "{o:?}");
    }

    // 3. Drain n2: not ready, new work refused with a retryable 503, its
    // sessions still answer with their state, and nginx sends new
    // sessions elsewhere.
    let forbidden = call("POST", &n2.url("/v1/admin/drain"), USER, None);
    assert_eq!(forbidden.status, 403, "{forbidden:?}");
    let d = call("POST", &n2.url("/v1/admin/drain"), OPS, None);
    assert_eq!(d.status, 200, "{d:?}");
    assert_eq!(d.body["draining"], true);
    let ready = ureq::get(&n2.url("/readyz")).call();
    match ready {
        Err(ureq::Error::Status(503, r)) => {
            let v: Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
            assert_eq!(v["draining"], true, "{v}");
        }
        other => panic!("a draining node is not ready: {other:?}"),
    }
    for (path, body) in [
        ("/v1/sessions", json!({})),
        ("/v1/run", json!({"script": "1"})),
    ] {
        let r = post_json(&n2.url(path), USER, body);
        assert_eq!(r.status, 503, "{path}: {r:?}");
        assert_eq!(r.body["error"]["code"], "draining", "{path}");
        assert!(r.retry_after.is_some(), "{path}: Retry-After");
    }
    for (id, k) in sessions.iter().filter(|(id, _)| node_of(id) == "n2") {
        let (out, up) = session_run(&nginx, id, "cat(x + 1)");
        assert_eq!(out, (k + 1).to_string(), "{id}");
        assert_eq!(up, n2.serve.addr);
    }
    for _ in 0..6 {
        let id = new_session(&nginx);
        assert_ne!(
            node_of(&id),
            "n2",
            "a new session went to the draining node"
        );
        let r = post_json(&nginx.url("/v1/run"), USER, json!({"script": "cat(6 * 7)"}));
        assert_eq!(r.status, 200, "{r:?}");
        assert_ne!(r.upstream, n2.serve.addr);
        call(
            "DELETE",
            &nginx.url(&format!("/v1/sessions/{id}")),
            USER,
            None,
        );
    }

    // 4. A fourth node joins (config and reload): it gets new sessions,
    // and the existing ones stay where they were, with their state.
    let n4 = node("n4", &moto, &tokens);
    nginx.reload(&[&n1, &n2, &n3, &n4]);
    let on_n4 = wait_for("a new session on n4", START, || {
        let id = new_session(&nginx);
        if node_of(&id) == "n4" {
            Some(id)
        } else {
            call(
                "DELETE",
                &nginx.url(&format!("/v1/sessions/{id}")),
                USER,
                None,
            );
            None
        }
    });
    let (_, up) = session_run(&nginx, &on_n4, "x <- 'four'");
    assert_eq!(up, n4.serve.addr);
    for (id, k) in &sessions {
        let (out, up) = session_run(&nginx, id, "cat(x * 10)");
        assert_eq!(out, (k * 10).to_string(), "{id} after the new node");
        assert_eq!(up, addr_of[node_of(id)], "{id} moved");
    }
    drop(n4);
}

#[test]
fn a_drained_node_lets_its_running_call_finish_and_hands_its_sessions_to_the_others() {
    let moto = Moto::start();
    let dir = TestDir::new("rvisor-multinode");
    let tokens = tokens_file(&dir);
    let n1 = node("n1", &moto, &tokens);
    let mut n2 = node("n2", &moto, &tokens);
    let n3 = node("n3", &moto, &tokens);
    let nginx = Nginx::start(&[&n1, &n2, &n3]);

    // Two sessions on n2, made directly there, with state.
    let mut ids = Vec::new();
    for k in [5, 6] {
        let a = post_json(&n2.url("/v1/sessions"), USER, json!({}));
        assert_eq!(a.status, 201, "{a:?}");
        let id = a.body["id"].as_str().unwrap().to_string();
        assert_eq!(node_of(&id), "n2");
        session_run(&nginx, &id, &format!("x <- {k}; library(splines)"));
        ids.push(id);
    }
    let id = ids[0].clone();

    // A call that is running when SIGTERM comes finishes with its result,
    // and what it did is part of the state handed off.
    let running = {
        let url = nginx.url(&format!("/v1/sessions/{id}/run"));
        std::thread::spawn(move || {
            post_json(
                &url,
                USER,
                json!({"code": "Sys.sleep(1.5); y <- x * 2; cat(y)"}),
            )
        })
    };
    wait_for("the call to run on n2", START, || {
        let s = call("GET", &n2.url(&format!("/v1/sessions/{id}")), USER, None);
        (s.body["state"] == "running").then_some(())
    });
    // SAFETY: kill only sends a signal to the node, our child (not yet
    // reaped, so its pid is still its own).
    let sent = unsafe { libc::kill(n2.serve.child.id() as i32, libc::SIGTERM) };
    assert_eq!(sent, 0);
    let done = running.join().unwrap();
    assert_eq!(done.status, 200, "{done:?}");
    assert_eq!(done.body["console"].as_str().unwrap_or("").trim(), "10");
    let status = wait_for("n2 to exit after its drain", START, || {
        n2.serve.child.try_wait().ok().flatten()
    });
    assert!(status.success(), "n2 exited {status:?}");

    // n2 is gone: nginx sends each session's next call to another node,
    // which takes it over from the store with its state.
    for (k, id) in [5, 6].iter().zip(&ids) {
        let r = timed_call(
            &nginx,
            id,
            "cat(x, 'package:splines' %in% search())",
            "hand-off after a drain",
        );
        assert!(
            r.body["console"]
                .as_str()
                .unwrap_or("")
                .ends_with(&format!("{k} TRUE")),
            "{}",
            r.body
        );
        assert_eq!(
            r.body["session"]["restored"]["reason"], "moved",
            "{}",
            r.body
        );
        assert!(
            r.upstream.contains(&n1.serve.addr) || r.upstream.contains(&n3.serve.addr),
            "{r:?}"
        );
    }
    let (out, _) = session_run(&nginx, &id, "cat(y)");
    assert!(out.ends_with("10"), "{out}");
    // New work still flows, to the nodes that are up.
    let r = post_json(&nginx.url("/v1/run"), USER, json!({"script": "cat(1 + 1)"}));
    assert_eq!(r.status, 200, "{r:?}");
}

#[test]
fn a_killed_nodes_sessions_go_on_elsewhere_from_their_last_checkpoint() {
    let moto = Moto::start();
    let dir = TestDir::new("rvisor-multinode");
    let tokens = tokens_file(&dir);
    let n1 = node("n1", &moto, &tokens);
    let n2 = node("n2", &moto, &tokens);
    let mut n3 = node("n3", &moto, &tokens);
    let nginx = Nginx::start(&[&n1, &n2, &n3]);

    let a = post_json(&n3.url("/v1/sessions"), USER, json!({}));
    assert_eq!(a.status, 201, "{a:?}");
    let id = a.body["id"].as_str().unwrap().to_string();
    session_run(&nginx, &id, "x <- 41; f <- function() x + 1");
    let cp = call(
        "POST",
        &n3.url(&format!("/v1/sessions/{id}/checkpoint")),
        USER,
        None,
    );
    assert_eq!(cp.status, 200, "{cp:?}");
    assert_eq!(cp.body["written"], true, "{cp:?}");

    // SIGKILL: no drain, no hand-off; the lease stops being renewed.
    n3.serve.child.kill().unwrap();
    n3.serve.child.wait().unwrap();
    let r = timed_call(
        &nginx,
        &id,
        "cat(f())",
        "take-over after SIGKILL (leases of 3 s)",
    );
    assert!(
        r.body["console"].as_str().unwrap_or("").ends_with("42"),
        "{}",
        r.body
    );
    let restored = &r.body["session"]["restored"];
    assert_eq!(restored["reason"], "moved", "{}", r.body);
    assert!(restored["checkpoint_at"].is_string(), "{}", r.body);
    let new_home = answered_by(&r.upstream).to_string();
    assert!(
        new_home == n1.serve.addr || new_home == n2.serve.addr,
        "{r:?}"
    );
    // The new owner keeps it: the next calls stay there, state intact.
    let (out, up) = session_run(&nginx, &id, "x <- x + 1; cat(f())");
    assert!(out.ends_with("43"), "{out}");
    assert_eq!(answered_by(&up), new_home);
    // n3 comes back (same id, new address): calls go to it again, and it
    // asks the takeover node for the session through the store.
    let n3 = node("n3", &moto, &tokens);
    nginx.reload(&[&n1, &n2, &n3]);
    // (nginx's reload takes effect when its old workers have finished.)
    let back = wait_for("n3 to answer its session again", START, || {
        let (out, up) = session_run(&nginx, &id, "cat(f())");
        assert!(out.ends_with("43"), "{out}");
        (answered_by(&up) == n3.serve.addr).then_some(out)
    });
    assert!(back.contains("restored the state"), "{back}");
    // Closing it deletes it from the store: no node finds it again.
    let del = call(
        "DELETE",
        &nginx.url(&format!("/v1/sessions/{id}")),
        USER,
        None,
    );
    assert_eq!(del.status, 204, "{del:?}");
    for n in [&n1, &n2, &n3] {
        let g = call("GET", &n.url(&format!("/v1/sessions/{id}")), USER, None);
        assert_eq!(g.status, 404, "{}: {g:?}", n.id);
    }
}

#[test]
fn leases_are_exclusive_on_the_s3_store() {
    use rvisor_server::blob::{BlobStore, LeaseError, StoreUrl};
    let moto = Moto::start();
    for (k, v) in moto.env() {
        std::env::set_var(k, v);
    }
    // A bucket that does not exist is a store that does not answer.
    let missing = BlobStore::open(&StoreUrl::S3 {
        bucket: "no-such-bucket".into(),
        prefix: String::new(),
    })
    .expect("opening contacts nothing");
    let e = missing.reachable(Duration::from_secs(10)).unwrap_err();
    assert!(e.to_string().contains("NoSuchBucket"), "{e}");
    let url = StoreUrl::S3 {
        bucket: BUCKET.into(),
        prefix: "leases".into(),
    };
    let a = BlobStore::open(&url).expect("the S3 store");
    let b = BlobStore::open(&url).expect("the S3 store");
    let ttl = Duration::from_secs(60);
    let mut mine = a
        .acquire_lease("session/s1", "n1", ttl)
        .expect("a new lease");
    match b.acquire_lease("session/s1", "n2", ttl) {
        Err(LeaseError::Held { holder, .. }) => assert_eq!(holder, "n1"),
        other => panic!("a live lease was taken: {other:?}"),
    }
    a.renew_lease(&mut mine, ttl)
        .expect("renewed by its holder");
    a.release_lease(mine).expect("released");
    let theirs = b
        .acquire_lease("session/s1", "n2", ttl)
        .expect("free after release");
    assert_eq!(theirs.record().holder, "n2");
    // Conditional writes are the store's own: a stale e-tag is refused.
    let t1 = a.put("k", b"1".to_vec()).unwrap().expect("an e-tag");
    a.put("k", b"2".to_vec()).unwrap();
    assert!(a.put_if_match("k", b"3".to_vec(), &t1).is_err());
    assert!(a.put_if_absent("k", b"4".to_vec()).is_err());
    assert_eq!(b.get("k").unwrap().unwrap().bytes, b"2");
}
