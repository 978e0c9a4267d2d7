//! A bounded randomized test of session ownership, in the style of
//! Jepsen's lease and register tests (docs/scale-out.md, "Chaos test").
//!
//! Three `rvisor serve` nodes on loopback share a store (a directory; or
//! moto's S3 with `RVISOR_CHAOS_STORE=s3`) behind nginx running the shipped
//! config. Clients, one per session, increment a counter in their session
//! (through nginx mostly, sometimes straight to a random node, as a client
//! with a stale route or a router failing over would) and record every
//! answer. A nemesis meanwhile SIGKILLs nodes and starts them again,
//! pauses them (SIGSTOP) for longer than a lease, and drains them
//! (SIGTERM) and starts them again. The checker then reads each session's
//! history and fails on:
//!
//! - an acknowledged increment lost without the result saying the session
//!   was restored or started fresh (a silent rollback, or a stale copy
//!   answering: two nodes serving one session);
//! - a value seen twice, or a value ahead of what the calls could have
//!   made (an increment counted twice);
//! - a session answered by another node without its result saying it
//!   moved there (ownership changing hands without a hand-off or a
//!   takeover);
//! - a session lost (404), or a call answered with a result that is
//!   neither a success nor a retryable refusal.
//!
//! Rollbacks that the results announce (a node killed before its last
//! checkpoint: `session.restored`, or `reset_reason` with a fresh session)
//! are counted and reported, not failed: they are the documented cost of
//! checkpointing after a call rather than in it.
//!
//! `make test` runs a short round; `scripts/chaos.sh SECONDS [SEED]` runs
//! a long one in a release build and prints the counts. Knobs:
//! `RVISOR_CHAOS_SECS` (default 40), `RVISOR_CHAOS_SEED`,
//! `RVISOR_CHAOS_SESSIONS` (4), `RVISOR_CHAOS_STORE` (`dir` or `s3`),
//! `RVISOR_CHAOS_LOGS` (a directory for the nodes' logs).

use rvisor_ffi_tests::cluster::{Moto, Nginx, Node, NodeOptions, Store, START};
use rvisor_ffi_tests::{wait_for, TestDir};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The lease the nodes hold (s): a pause past it lets another node take
/// the node's sessions over.
const LEASE: u32 = 3;
/// Each call increments the session's counter and prints it.
const INCREMENT: &str =
    "if (!exists('counter')) counter <- 0L; counter <- counter + 1L; cat(counter)";

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// xorshift64*: small, seeded, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi - lo + 1))
    }
}

/// What one call's answer was, as the checker needs it.
#[derive(Debug, Clone)]
enum Answer {
    /// 200, outcome complete: the counter's value, the node that ran it,
    /// and what the result said about the session's state.
    Ack {
        value: i64,
        node: String,
        /// `session.restored.reason`, if the state came from a checkpoint.
        restored: Option<String>,
        /// `session.reset_reason`, if set.
        reset: Option<String>,
    },
    /// Refused before anything ran, or ran on a copy whose effects were
    /// dropped: the increment is surely not in the session.
    NotApplied(String),
    /// Unknown whether it applied (a timeout, a node gone mid-call).
    Unknown(String),
    /// Wrong whatever happened (the session is gone, a malformed answer).
    Bad(String),
}

#[derive(Debug, Clone)]
struct Op {
    answer: Answer,
    via: String,
    took_ms: u64,
    /// When it was sent, from the start of the run.
    at_ms: u64,
}

/// The nodes, with the port and id of each (a restart takes the same
/// port, so nginx's routes stay right).
struct Cluster<'a> {
    nodes: Vec<Mutex<Option<Node>>>,
    ids: Vec<String>,
    ports: Vec<u16>,
    opts: NodeOptions<'a>,
}

impl Cluster<'_> {
    fn addr_to_id(&self) -> BTreeMap<String, String> {
        self.ports
            .iter()
            .zip(&self.ids)
            .map(|(p, id)| (format!("127.0.0.1:{p}"), id.clone()))
            .collect()
    }

    fn restart(&self, k: usize) {
        let n = Node::start_on(&self.ids[k], self.ports[k], &self.opts);
        *self.nodes[k].lock().unwrap() = Some(n);
    }
}

/// The node that answered, from nginx's `X-Rvisor-Upstream` (the last of
/// the nodes tried) or the address called.
fn answered_by(upstream: &str, called: &str) -> String {
    upstream
        .rsplit([',', ' '])
        .find(|p| !p.is_empty() && *p != ":")
        .unwrap_or(called)
        .to_string()
}

fn classify(res: Result<ureq::Response, ureq::Error>, called: &str) -> Answer {
    let res = match res {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => return Answer::Unknown(format!("transport: {e}")),
    };
    let status = res.status();
    let node = answered_by(res.header("X-Rvisor-Upstream").unwrap_or(""), called);
    let text = res.into_string().unwrap_or_default();
    let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    match status {
        200 => {}
        // nginx: the node went away under the call, or its takeover node
        // could not be reached either.
        502 | 504 => return Answer::Unknown(format!("{status} from the router")),
        404 => return Answer::Bad(format!("the session was lost (404): {text}")),
        429 | 503 => {
            let code = body["error"]["code"].as_str().unwrap_or("");
            let msg = body["error"]["message"].as_str().unwrap_or("");
            let sure = code == "draining"
                || code == "quota"
                || code == "no_worker"
                || msg.contains("Nothing ran")
                || msg.contains("did not run here")
                || msg.contains("are not in the session")
                || msg.contains("before the call ran here")
                || msg.contains("retry shortly")
                || msg.contains("running on node");
            return if sure {
                Answer::NotApplied(format!("{status} {code}: {msg}"))
            } else {
                Answer::Unknown(format!("{status} {code}: {msg}"))
            };
        }
        s => return Answer::Bad(format!("status {s}: {text}")),
    }
    let outcome = body["outcome"].as_str().unwrap_or("");
    match outcome {
        "complete" => {}
        // The worker died mid-call (the node was killed under it): its
        // state went with it.
        "worker_failed" | "worker_exited" | "interrupted" | "cancelled" => {
            return Answer::Unknown(format!("outcome {outcome}"))
        }
        "not_executed" | "closed" => return Answer::NotApplied(format!("outcome {outcome}")),
        o => return Answer::Bad(format!("outcome {o}: {text}")),
    }
    let console = body["console"].as_str().unwrap_or("").trim();
    let Some(value) = console.lines().last().and_then(|l| l.trim().parse().ok()) else {
        return Answer::Bad(format!("no counter in the console: {console:?}"));
    };
    Answer::Ack {
        value,
        node,
        restored: body["session"]["restored"]["reason"]
            .as_str()
            .map(str::to_string),
        reset: body["session"]["reset_reason"].as_str().map(str::to_string),
    }
}

/// What the checker found in one session's history.
#[derive(Debug, Default)]
struct Verdict {
    acks: u64,
    not_applied: u64,
    unknown: u64,
    /// Acknowledged increments rolled back, announced by the result.
    announced_lost: u64,
    announced_rollbacks: u64,
    moves: u64,
    anomalies: Vec<String>,
    /// The announced rollbacks, for the report.
    rollbacks: Vec<String>,
}

/// A fault the nemesis injected: the node, what, and from when to when
/// (ms from the start of the run; a killed node until it is back).
#[derive(Debug, Clone)]
struct Fault {
    node: String,
    kind: &'static str,
    from_ms: u64,
    to_ms: u64,
}

/// Checks one session's history (the client is sequential: its calls are
/// in order and never overlap). A rollback is allowed only when the
/// result announces it and the node that made the lost increments was
/// killed or paused in between (its state since its last checkpoint went
/// with it); a drain or a hand-off must lose nothing.
fn check(
    session: &str,
    ops: &[Op],
    addr_to_id: &BTreeMap<String, String>,
    faults: &[Fault],
) -> Verdict {
    let mut v = Verdict::default();
    let mut last_at: u64 = 0;
    let mut last: i64 = 0;
    let mut slack: i64 = 0;
    let mut owner: Option<String> = None;
    for (i, op) in ops.iter().enumerate() {
        match &op.answer {
            Answer::Ack {
                value,
                node,
                restored,
                reset,
            } => {
                v.acks += 1;
                let node = addr_to_id.get(node).cloned().unwrap_or(node.clone());
                let announced = restored.is_some() || reset.is_some();
                let fresh = reset.is_some() && restored.is_none();
                let x = *value;
                if fresh {
                    if x != 1 {
                        v.anomalies.push(format!(
                            "{session} op {i}: a fresh session answered {x}, not 1"
                        ));
                    }
                } else if x > last + 1 + slack {
                    v.anomalies.push(format!(
                        "{session} op {i}: {x} after {last} with {slack} unknown calls between: \
                         an increment counted twice"
                    ));
                } else if x < last + 1 && !announced {
                    v.anomalies.push(format!(
                        "{session} op {i}: {x} after {last} on {node}, and the result says \
                         nothing of a restore: acknowledged increments lost silently (a stale \
                         copy answering?)"
                    ));
                }
                if announced && x < last + 1 {
                    let lost_with = owner.as_ref().and_then(|o| {
                        faults.iter().find(|f| {
                            &f.node == o
                                && f.kind != "drain"
                                && f.from_ms <= op.at_ms + op.took_ms
                                && f.to_ms >= last_at
                        })
                    });
                    if lost_with.is_none() {
                        v.anomalies.push(format!(
                            "{session} op {i}: {x} after {last} on {node} ({restored:?}, \
                             {reset:?}): acknowledged increments lost although their node {:?} \
                             was neither killed nor paused since (a hand-off or drain lost them)",
                            owner
                        ));
                    }
                    v.announced_rollbacks += 1;
                    v.announced_lost += (last + 1 - x) as u64;
                    v.rollbacks.push(format!(
                        "{session} op {i}: {x} after {last} on {node} ({restored:?}, {reset:?}, \
                         via {}, at {} ms)",
                        op.via, op.at_ms
                    ));
                }
                if let Some(o) = &owner {
                    if *o != node {
                        v.moves += 1;
                        // A move is announced by the result: the state
                        // came from a checkpoint (`restored`), or the
                        // session had none yet and started fresh.
                        if !announced {
                            v.anomalies.push(format!(
                                "{session} op {i}: answered by {node} after {o}, and the \
                                 result says nothing of a move ({:?} via {}): two nodes served \
                                 the session; the calls before: {:?}",
                                op.answer,
                                op.via,
                                &ops[i.saturating_sub(3)..i]
                            ));
                        }
                    }
                }
                owner = Some(node);
                last = x;
                last_at = op.at_ms;
                slack = 0;
            }
            Answer::NotApplied(_) => v.not_applied += 1,
            Answer::Unknown(_) => {
                v.unknown += 1;
                slack += 1;
            }
            Answer::Bad(why) => v
                .anomalies
                .push(format!("{session} op {i} via {}: {why}", op.via)),
        }
    }
    v
}

fn new_session(nginx: &Nginx) -> String {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(30))
        .build();
    wait_for("a new session", START, || {
        let r = agent
            .post(&nginx.url("/v1/sessions"))
            .send_json(json!({}))
            .ok()?;
        let v: Value = r.into_json().ok()?;
        v["id"].as_str().map(str::to_string)
    })
}

#[test]
fn sessions_keep_one_owner_and_every_acknowledged_increment_under_kills_pauses_and_drains() {
    let secs: u64 = env_or("RVISOR_CHAOS_SECS", 40);
    let seed: u64 = env_or("RVISOR_CHAOS_SEED", 20261201);
    let sessions: usize = env_or("RVISOR_CHAOS_SESSIONS", 4);
    let use_s3 = std::env::var("RVISOR_CHAOS_STORE").as_deref() == Ok("s3");
    let logs = std::env::var("RVISOR_CHAOS_LOGS")
        .ok()
        .map(std::path::PathBuf::from);
    if let Some(d) = &logs {
        std::fs::create_dir_all(d).expect("the logs directory");
    }
    eprintln!(
        "chaos: {secs} s, seed {seed}, {sessions} sessions, store {}",
        if use_s3 { "s3" } else { "dir" }
    );

    let dir = TestDir::new("rvisor-chaos-store");
    let moto = use_s3.then(Moto::start);
    let store = match &moto {
        Some(m) => Store::S3(m),
        None => Store::Dir(dir.path()),
    };
    let opts = NodeOptions {
        store,
        lease_secs: LEASE,
        logs: logs.as_deref(),
        ..NodeOptions::default()
    };
    let first: Vec<Node> = (1..=3)
        .map(|k| Node::start(&format!("n{k}"), &opts))
        .collect();
    let nginx = Nginx::start(&first.iter().collect::<Vec<_>>());
    let cluster = Cluster {
        ids: first.iter().map(|n| n.id.clone()).collect(),
        ports: first.iter().map(|n| n.port).collect(),
        nodes: first.into_iter().map(|n| Mutex::new(Some(n))).collect(),
        opts,
    };
    let addr_to_id = cluster.addr_to_id();
    let addrs: Vec<String> = addr_to_id.keys().cloned().collect();

    let ids: Vec<String> = (0..sessions).map(|_| new_session(&nginx)).collect();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let stop = AtomicBool::new(false);
    let faults: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());
    let fault_log: Mutex<Vec<Fault>> = Mutex::new(Vec::new());
    let total_ops = AtomicU64::new(0);
    let histories: Vec<Arc<Mutex<Vec<Op>>>> = ids
        .iter()
        .map(|_| Arc::new(Mutex::new(Vec::new())))
        .collect();

    std::thread::scope(|sc| {
        // The clients: one per session, sequential.
        for (k, id) in ids.iter().enumerate() {
            let (history, stop, total_ops, addrs, nginx_url) = (
                histories[k].clone(),
                &stop,
                &total_ops,
                &addrs,
                nginx.url(""),
            );
            let started = &started;
            sc.spawn(move || {
                let mut rng = Rng(seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(k as u64 + 1)));
                let agent = ureq::AgentBuilder::new()
                    .timeout(Duration::from_secs(20))
                    .build();
                while !stop.load(Ordering::Relaxed) {
                    // Idle now and then past the 2 s after which a session
                    // checkpoints, so that kills find checkpoints.
                    let think = if rng.below(6) == 0 {
                        rng.ms(2200, 3500)
                    } else {
                        rng.ms(0, 300)
                    };
                    std::thread::sleep(think);
                    let (base, via) = if rng.below(5) == 0 {
                        let a = &addrs[rng.below(addrs.len() as u64) as usize];
                        (format!("http://{a}"), a.clone())
                    } else {
                        (nginx_url.clone(), "nginx".to_string())
                    };
                    let t = Instant::now();
                    let res = agent
                        .post(&format!("{base}/v1/sessions/{id}/run"))
                        .send_json(json!({ "code": INCREMENT }));
                    let answer = classify(res, via.as_str());
                    total_ops.fetch_add(1, Ordering::Relaxed);
                    history.lock().unwrap().push(Op {
                        answer,
                        via,
                        took_ms: t.elapsed().as_millis() as u64,
                        at_ms: t.duration_since(*started).as_millis() as u64,
                    });
                }
            });
        }

        // The nemesis: one fault at a time, on a random node.
        let mut rng = Rng(seed);
        while Instant::now() + Duration::from_secs(6) < deadline {
            std::thread::sleep(rng.ms(800, 2500));
            let k = rng.below(3) as usize;
            let kind = ["kill", "pause", "drain"][rng.below(3) as usize];
            let pid = match cluster.nodes[k].lock().unwrap().as_ref() {
                Some(n) => n.pid(),
                None => continue,
            };
            let from_ms = started.elapsed().as_millis() as u64;
            eprintln!(
                "chaos: {kind} {} (pid {pid}) at {from_ms} ms",
                cluster.ids[k]
            );
            match kind {
                "kill" => {
                    let n = cluster.nodes[k].lock().unwrap().take();
                    drop(n); // SIGKILL, reaped
                    std::thread::sleep(rng.ms(300, 2500));
                    cluster.restart(k);
                }
                "pause" => {
                    let g = cluster.nodes[k].lock().unwrap();
                    let n = g.as_ref().expect("the node");
                    n.signal(libc::SIGSTOP);
                    std::thread::sleep(Duration::from_secs(LEASE.into()) + rng.ms(500, 2500));
                    n.signal(libc::SIGCONT);
                }
                _ => {
                    let mut n = cluster.nodes[k].lock().unwrap().take().expect("the node");
                    n.signal(libc::SIGTERM);
                    wait_for("a drained node to exit", START, || {
                        n.serve.child.try_wait().ok().flatten()
                    });
                    cluster.restart(k);
                }
            }
            *faults.lock().unwrap().entry(kind).or_default() += 1;
            fault_log.lock().unwrap().push(Fault {
                node: cluster.ids[k].clone(),
                kind,
                from_ms,
                to_ms: started.elapsed().as_millis() as u64,
            });
        }
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        stop.store(true, Ordering::Relaxed);
    });

    // A last call in each session once the cluster is calm: every session
    // still answers, with a value the checker accepts.
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(30))
        .build();
    for (k, id) in ids.iter().enumerate() {
        let op = wait_for(&format!("{id} to answer after the chaos"), START, || {
            let t = Instant::now();
            let res = agent
                .post(&nginx.url(&format!("/v1/sessions/{id}/run")))
                .send_json(json!({ "code": INCREMENT }));
            let answer = classify(res, "nginx");
            let op = Op {
                answer,
                via: "nginx (final)".into(),
                took_ms: t.elapsed().as_millis() as u64,
                at_ms: t.duration_since(started).as_millis() as u64,
            };
            let done = matches!(op.answer, Answer::Ack { .. } | Answer::Bad(_));
            histories[k].lock().unwrap().push(op.clone());
            done.then_some(op)
        });
        assert!(matches!(op.answer, Answer::Ack { .. }), "{id}: {op:?}");
    }

    let fault_log = fault_log.into_inner().unwrap();
    let mut total = Verdict::default();
    let mut slowest = 0;
    for (k, id) in ids.iter().enumerate() {
        let h = histories[k].lock().unwrap();
        slowest = slowest.max(h.iter().map(|o| o.took_ms).max().unwrap_or(0));
        let v = check(id, &h, &addr_to_id, &fault_log);
        total.acks += v.acks;
        total.not_applied += v.not_applied;
        total.unknown += v.unknown;
        total.announced_lost += v.announced_lost;
        total.announced_rollbacks += v.announced_rollbacks;
        total.moves += v.moves;
        total.anomalies.extend(v.anomalies);
        total.rollbacks.extend(v.rollbacks);
    }
    let faults = faults.into_inner().unwrap();
    eprintln!(
        "chaos: {} operations ({} acknowledged, {} refused before running, {} unknown), \
         {} moves between nodes, faults {:?}, announced rollbacks {} ({} acknowledged \
         increments), slowest answer {} ms, anomalies {}",
        total_ops.load(Ordering::Relaxed) + ids.len() as u64,
        total.acks,
        total.not_applied,
        total.unknown,
        total.moves,
        faults,
        total.announced_rollbacks,
        total.announced_lost,
        slowest,
        total.anomalies.len()
    );
    for (k, id) in ids.iter().enumerate() {
        let h = histories[k].lock().unwrap();
        let not_run: Vec<&str> = h
            .iter()
            .filter_map(|o| match &o.answer {
                Answer::NotApplied(why) | Answer::Unknown(why) => Some(why.as_str()),
                _ => None,
            })
            .collect();
        if !not_run.is_empty() {
            eprintln!("chaos: {id}: calls that did not succeed: {not_run:?}");
        }
    }
    for r in &total.rollbacks {
        eprintln!("chaos: rollback {r}");
    }
    for a in &total.anomalies {
        eprintln!("chaos: ANOMALY {a}");
    }
    assert!(
        total.anomalies.is_empty(),
        "{} anomalies (above)",
        total.anomalies.len()
    );
    assert!(faults.values().sum::<u64>() > 0, "no fault was injected");
    assert!(
        total.acks > ids.len() as u64,
        "too few calls succeeded to tell"
    );
}
