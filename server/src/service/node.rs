//! The node's side of the service: readiness, the drain and its hand-off,
//! sessions resumed from the store (at start, and on a miss: taken over
//! under a lease), hand-off requests from other nodes, lease renewal and
//! the TTL sweep (docs/scale-out.md).

use super::publish::Published;
use super::{lock, Entry, ErrorCode, NewSession, Service, ServiceError};
use crate::durable::{SessionRecord, SessionStore, TakeError};
use rvisor::Session;
use serde::Deserialize;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `/readyz`: whether the node takes new work, and why not.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Readiness {
    /// All checks pass.
    pub ready: bool,
    /// This node's id (`rvisor serve --node-id`), if it has one.
    pub node_id: Option<String>,
    /// Workers can be made (the zygote is up).
    pub zygote: bool,
    /// The shared store answered.
    pub store: bool,
    /// The node is draining.
    pub draining: bool,
    /// Why it is not ready (empty when it is).
    pub reasons: Vec<String>,
}

/// `POST /v1/admin/drain`: the drain's state.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct DrainStatus {
    /// This node's id, if it has one.
    pub node_id: Option<String>,
    /// Whether the node is draining.
    pub draining: bool,
    /// Sessions open on this node.
    pub sessions: usize,
    /// Calls running or queued now (session calls and one-shot runs).
    pub calls_in_flight: usize,
}

/// How long one session's release (its last checkpoint) may take at a
/// drain or shutdown.
pub(super) const RELEASE_WITHIN: Duration = Duration::from_secs(30);

/// How often the store is swept for sessions past the TTL (at most; more
/// often for a shorter TTL).
pub(super) const SESSION_SWEEP_EVERY: Duration = Duration::from_secs(600);

impl Service {
    /// Refuses new work while the node drains (retryable: another node
    /// takes it).
    pub(super) fn admit(&self) -> Result<(), ServiceError> {
        if self.inner.drain.is_draining() {
            return Err(ServiceError::new(
                ErrorCode::Draining,
                "this node is draining (shutting down) and takes no new sessions or runs; retry \
                 in a moment: a router sends the request to another node. Existing sessions of \
                 this node still answer until it exits",
            ));
        }
        Ok(())
    }

    /// The drain state: draining, calls in flight.
    pub fn drain_state(&self) -> &crate::cluster::Drain {
        &self.inner.drain
    }

    /// Starts draining (SIGTERM, `POST /v1/admin/drain`): readiness goes
    /// false, new sessions and one-shot runs are refused with `draining`,
    /// existing sessions keep answering. Idempotent. The answer is the
    /// drain's state.
    pub fn start_drain(&self) -> DrainStatus {
        if self.inner.drain.start() {
            tracing::info!(target: "rvisor::cluster", "draining: new sessions and runs are refused");
        }
        self.drain_status()
    }

    /// What a drain has left: sessions open, calls in flight.
    pub fn drain_status(&self) -> DrainStatus {
        DrainStatus {
            node_id: self.inner.sup.config().node_id.clone(),
            draining: self.inner.drain.is_draining(),
            sessions: lock(&self.inner.sessions).len(),
            calls_in_flight: self.inner.drain.in_flight(),
        }
    }

    /// Blocks until the calls in flight have ended or `grace` has passed
    /// (true: none left), then runs the hand-off step. Sessions stay open:
    /// the caller exits, which ends them.
    pub fn finish_drain(&self, grace: Duration) -> bool {
        let idle = self.inner.drain.wait_idle(grace);
        if !idle {
            tracing::warn!(
                target: "rvisor::cluster",
                calls = self.inner.drain.in_flight(),
                "the drain grace ended with calls still running; they end with the process"
            );
        }
        self.hand_off();
        idle
    }

    /// The drain's hand-off step: every session is checkpointed into the
    /// store and its lease released, so that a restart of this node or
    /// another node restores it on its next call. Without a store a
    /// drained node's sessions end with it (their next call answers 404).
    pub(super) fn hand_off(&self) {
        if self.inner.cfg.durable.is_some() {
            self.release_all(RELEASE_WITHIN);
            return;
        }
        let n = lock(&self.inner.sessions).len();
        if n > 0 {
            tracing::warn!(
                target: "rvisor::cluster",
                sessions = n,
                "sessions are not handed off (the server keeps no state: --state-dir or --store): \
                 they end with this node"
            );
        }
    }

    /// Whether this node should get new work (`/readyz`): workers can be
    /// made (the zygote is up, or spawning is allowed), the shared store
    /// answers, and the node is not draining. Cheap: the store's answer is
    /// kept for a second.
    pub fn readiness(&self) -> Readiness {
        let pool = self.inner.sup.pool_status();
        let zygote = match pool.mode {
            rvisor::PoolMode::Zygote => true,
            rvisor::PoolMode::Spawn => !self.inner.sup.config().pool.zygote,
            rvisor::PoolMode::Starting => false,
        };
        let store = {
            let mut c = lock(&self.inner.store_check);
            match &*c {
                Some((at, r)) if at.elapsed() < Duration::from_secs(1) => r.clone(),
                _ => {
                    let r = self
                        .inner
                        .tables
                        .store()
                        .reachable(Duration::from_secs(2))
                        .map_err(|e| e.to_string());
                    *c = Some((Instant::now(), r.clone()));
                    r
                }
            }
        };
        let draining = self.inner.drain.is_draining();
        let mut reasons = Vec::new();
        if !zygote {
            reasons.push(format!(
                "workers cannot be made yet (pool {:?}{})",
                pool.mode,
                pool.last_error
                    .as_deref()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            ));
        }
        if let Err(e) = &store {
            reasons.push(format!("the shared store does not answer: {e}"));
        }
        if draining {
            reasons.push("the node is draining".into());
        }
        Readiness {
            ready: reasons.is_empty(),
            node_id: self.inner.sup.config().node_id.clone(),
            zygote,
            store: store.is_ok(),
            draining,
            reasons,
        }
    }

    /// A session this process does not hold but the store keeps (this
    /// server restarted and lost it to another node earlier, or its node
    /// was drained or lost): taken over (its lease, waiting for a dead
    /// owner's to expire) and resumed from its checkpoint.
    pub(super) fn adopt(
        &self,
        d: &Arc<SessionStore>,
        tenant: &str,
        id: &str,
    ) -> Result<(Session, Published), ServiceError> {
        // One takeover per session at a time (a hand-off of it waits for
        // it, and it for a hand-off); other sessions are not held up.
        let one = self.inner.owner.session(id);
        one.hold(|| self.adopt_locked(d, tenant, id))
    }

    fn adopt_locked(
        &self,
        d: &Arc<SessionStore>,
        tenant: &str,
        id: &str,
    ) -> Result<(Session, Published), ServiceError> {
        if let Some(e) = lock(&self.inner.sessions).get(id) {
            return if e.tenant == tenant {
                Ok((e.session.clone(), e.published.clone()))
            } else {
                Err(ServiceError::not_found("session"))
            };
        }
        let storage = |e: String| {
            ServiceError::new(
                ErrorCode::Storage,
                format!("the session store {} failed ({e}); retry shortly", d.url()),
            )
        };
        let Some(rec) = d
            .get_record(tenant, id)
            .map_err(|e| storage(e.to_string()))?
        else {
            return Err(ServiceError::not_found("session"));
        };
        self.admit()?;
        // Held by a live node: ask it to hand the session over, then wait
        // for its release (or for the lease of a dead one to run out).
        let mut took = d.take(id, Duration::ZERO);
        if matches!(took, Err(TakeError::Held { .. })) {
            if let Err(e) = d.request_handoff(id) {
                return Err(storage(e.to_string()));
            }
            took = d.take(id, d.lease_ttl() + Duration::from_secs(2));
            d.handoff_done(id);
        }
        match took {
            Ok(()) => {}
            Err(TakeError::Held {
                holder,
                expires_unix,
            }) => {
                return Err(ServiceError::new(
                    ErrorCode::Busy,
                    format!(
                        "session {id} is running on node {holder}, which holds it for {} s more; \
                         retry, or send the request to that node",
                        expires_unix.saturating_sub(rvisor::clock::unix_now())
                    ),
                ))
            }
            Err(TakeError::Store(e)) => return Err(storage(e)),
        }
        let reason = match (
            crate::cluster::node_of(id),
            &self.inner.sup.config().node_id,
        ) {
            (Some(n), Some(me)) if n != me => rvisor::RESUMED_MOVED,
            _ => rvisor::RESUMED_RESTART,
        };
        let found = self.resume(tenant, &rec, reason);
        if found.is_err() {
            d.release(id);
        }
        found
    }

    /// Enters the session of `rec` from the store (its state is restored
    /// by its next call).
    pub(super) fn resume(
        &self,
        tenant: &str,
        rec: &SessionRecord,
        reason: &str,
    ) -> Result<(Session, Published), ServiceError> {
        let req = match &rec.options {
            Some(v) => Some(NewSession::deserialize(v).map_err(|e| {
                ServiceError::new(
                    ErrorCode::Storage,
                    format!(
                        "the stored record of session {} is unreadable ({e})",
                        rec.id
                    ),
                )
            })?),
            None => None,
        };
        let opts = self.session_options(req.as_ref())?;
        let found = self.insert_session(tenant, opts, false, |sup, opts| {
            sup.resume_session(&rec.id, opts, reason)
        })?;
        if let Some(name) = &rec.name {
            lock(&self.inner.names).insert((tenant.to_string(), name.clone()), rec.id.clone());
        }
        tracing::info!(target: "rvisor::sessions", session = %rec.id, reason, "resumed from the store");
        Ok(found)
    }

    /// At start: every session the store keeps for this node (all of them
    /// for a server without a node id), resumed lazily (nothing is read
    /// but the records until a session's next call). A session another
    /// live node holds is left to it.
    pub(super) fn resume_all(&self, d: &Arc<SessionStore>) -> Result<(), crate::blob::BlobError> {
        let me = self.inner.sup.config().node_id.clone();
        let mut resumed = 0;
        for rec in d.records()? {
            let mine = match (&me, crate::cluster::node_of(&rec.id)) {
                (Some(me), Some(n)) => n == me,
                (None, _) => true,
                (Some(_), None) => false,
            };
            if !mine || d.take(&rec.id, Duration::ZERO).is_err() {
                continue;
            }
            match self.resume(&rec.tenant, &rec, rvisor::RESUMED_RESTART) {
                Ok(_) => resumed += 1,
                Err(e) => {
                    d.release(&rec.id);
                    tracing::warn!(target: "rvisor::sessions", session = %rec.id, "not resumed: {e}");
                }
            }
        }
        if resumed > 0 {
            eprintln!(
                "rvisor serve: {resumed} sessions kept in {} go on (restored at their next call)",
                d.url()
            );
        }
        Ok(())
    }

    /// The node's two maintenance threads, which end with the service:
    /// one renews this node's leases and does nothing else (dropping the
    /// sessions another node took), so that no call, checkpoint or
    /// hand-off can delay a renewal; the other answers hand-off requests
    /// (each release on a thread of its own: it waits for the session's
    /// running call) and deletes sessions past the TTL.
    pub(super) fn start_maintenance(&self, d: Arc<SessionStore>) {
        let every = d.renew_every();
        let ttl = self.inner.cfg.session_ttl;
        let leases = d.clone();
        self.every("rvisor-leases", every, move |svc| {
            for id in leases.renew() {
                tracing::warn!(target: "rvisor::sessions", session = %id,
                    "another node took this session over (our lease lapsed): dropping our copy");
                svc.lose(&id);
            }
        });
        // The first sweep ran at start (Service::new).
        let mut last_sweep = Some(Instant::now());
        self.every("rvisor-durable", every, move |svc| {
            svc.answer_handoffs(&d);
            let sweep_every = ttl.map_or(SESSION_SWEEP_EVERY, |t| t.min(SESSION_SWEEP_EVERY));
            let sweep_due = last_sweep.is_none_or(|t| t.elapsed() >= sweep_every);
            if let (Some(ttl), true) = (ttl, sweep_due) {
                last_sweep = Some(Instant::now());
                svc.sweep_expired(&d, ttl);
            }
        });
    }

    /// Runs `round` on a thread named `name` every `every` until the
    /// service stops.
    pub(super) fn every(
        &self,
        name: &str,
        every: Duration,
        mut round: impl FnMut(&Service) + Send + 'static,
    ) {
        let weak = Arc::downgrade(&self.inner);
        let stop = self.inner.stop.clone();
        let spawned = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || loop {
                {
                    let (m, cv) = &*stop;
                    let g = lock(m);
                    let (g, _) = cv
                        .wait_timeout_while(g, every, |stopped| !*stopped)
                        .unwrap_or_else(|e| e.into_inner());
                    if *g {
                        return;
                    }
                }
                let Some(inner) = weak.upgrade() else { return };
                round(&Service { inner });
            });
        if let Err(e) = spawned {
            tracing::error!(target: "rvisor::sessions", "no {name} thread: {e}");
        }
    }

    /// This node lost session `id` to another (its lease was taken): the
    /// local copy is dropped without writing, and calls of it that did not
    /// run here are answered as retryable.
    pub(super) fn lose(&self, id: &str) {
        self.inner.owner.moved(
            id,
            "another node took this session over while this node was paused or cut off from \
             the store; the call did not run here: retry it (it runs where the session is now)",
        );
        if let Some(e) = self.forget(id) {
            e.session.abandon();
        }
    }

    /// Releases the sessions other nodes asked for, each on a thread of
    /// its own (after its running call; see `durable`'s module docs).
    pub(super) fn answer_handoffs(&self, d: &Arc<SessionStore>) {
        let asked = match d.handoff_requests() {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(target: "rvisor::sessions", "could not read hand-off requests: {e}");
                return;
            }
        };
        for id in asked {
            if !self.inner.owner.start_handoff(&id) {
                continue; // being released already
            }
            let (svc, d, id2) = (self.clone(), d.clone(), id.clone());
            let spawned = std::thread::Builder::new()
                .name("rvisor-handoff".into())
                .spawn(move || {
                    svc.hand_over(&d, &id2);
                    svc.inner.owner.end_handoff(&id2);
                });
            if let Err(e) = spawned {
                self.inner.owner.end_handoff(&id);
                tracing::warn!(target: "rvisor::sessions", session = %id, "no hand-off thread: {e}");
            }
        }
    }

    /// Releases session `id` to the node that asked for it: its running
    /// call finishes, the state is checkpointed, the lease given up. The
    /// session's lock is held throughout, so that a call arriving here
    /// meanwhile takes the session back only once this is done.
    fn hand_over(&self, d: &SessionStore, id: &str) {
        let one = self.inner.owner.session(id);
        one.hold(|| {
            // The state first, while the session still runs here. A
            // release whose checkpoint the store refuses retires the worker
            // all the same, and the lease went with it: the asking node
            // resumed the older checkpoint and the calls acknowledged here
            // since were lost (a renewal held up on a loaded machine leaves
            // the lease short of the second a write needs, and the write is
            // refused as fenced while the lease is still ours). While it is
            // ours, the hand-off waits for a later round (the asking node
            // answers busy meanwhile, and its client retries).
            let here = lock(&self.inner.sessions)
                .get(id)
                .map(|e| e.session.clone());
            if let Some(s) = here {
                if let Err(rvisor::CheckpointError::Store(why) | rvisor::CheckpointError::Fenced(why)) =
                    s.checkpoint()
                {
                    if d.confirm(id, Duration::ZERO).is_ok() {
                        tracing::warn!(target: "rvisor::sessions", session = %id,
                            "hand-off put off: the session's state could not be stored ({why}); \
                             it stays here, and the hand-off is tried again");
                        return;
                    }
                }
            }
            if let Some(e) = self.forget(id) {
                self.inner.owner.moved(
                    id,
                    "this session was handed off to another node (it asked for it) before the \
                     call ran here: retry it (it runs where the session is now)",
                );
                if let Err(why) = e.session.release(RELEASE_WITHIN) {
                    tracing::warn!(target: "rvisor::sessions", session = %id,
                        "handed off without a new checkpoint ({why})");
                }
                tracing::info!(target: "rvisor::sessions", session = %id, "handed off to another node on request");
            }
            d.release(id);
        });
    }

    /// Deletes sessions unused for `ttl` that no node runs.
    pub(super) fn sweep_expired(&self, d: &SessionStore, ttl: Duration) {
        let expired = match d.expired(ttl) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(target: "rvisor::sessions", "the TTL sweep could not list the store: {e}");
                return;
            }
        };
        for (tenant_hex, id) in expired {
            if let Some(e) = self.forget(&id) {
                // Ours but unused that long (hibernated): closed for good.
                e.session.close();
            }
            d.delete_expired(&tenant_hex, &id);
            tracing::info!(target: "rvisor::sessions", session = %id, "deleted: unused past the session TTL");
        }
    }

    /// Ends every session in this process but keeps each in the store
    /// (checkpointed if it changed, its lease released), so that a restart
    /// or another node goes on with it. Without a store: closes them.
    pub fn release_all(&self, within: Duration) {
        let Some(d) = self.inner.cfg.durable.clone() else {
            self.close_all();
            return;
        };
        // The node is stopping: nothing new starts, and calls that find
        // their session gone are told to retry (they go on elsewhere).
        self.inner.drain.start();
        let _one = lock(&self.inner.releasing);
        let all: Vec<(String, Entry)> = lock(&self.inner.sessions).drain().collect();
        lock(&self.inner.names).clear();
        if all.is_empty() {
            return;
        }
        let started = Instant::now();
        let n = all.len();
        let queue = Mutex::new(all);
        let written = std::sync::atomic::AtomicUsize::new(0);
        let failed = std::sync::atomic::AtomicUsize::new(0);
        // A few at a time: each checkpoint is one worker's work.
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| loop {
                    let Some((id, e)) = lock(&queue).pop() else {
                        return;
                    };
                    match e.session.release(within) {
                        Ok(Some(_)) => {
                            written.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(None) => {}
                        Err(why) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(target: "rvisor::sessions", session = %id,
                                "not checkpointed at release ({why}); its last checkpoint stays");
                        }
                    }
                    d.release(&id);
                });
            }
        });
        eprintln!(
            "rvisor serve: {n} sessions kept in {} ({} checkpointed now, {} kept their last \
             checkpoint) in {:.2} s",
            d.url(),
            written.load(Ordering::Relaxed),
            failed.load(Ordering::Relaxed),
            started.elapsed().as_secs_f64()
        );
    }

    /// Starts draining this node, for an operator (`POST /v1/admin/drain`).
    pub fn drain_for(&self, tenant: &str) -> Result<DrainStatus, ServiceError> {
        if !self.is_operator(tenant) {
            return Err(ServiceError::new(
                ErrorCode::Forbidden,
                "draining a node is for operators: use an operator's token \
                 (rvisor serve --operator TENANT)",
            ));
        }
        Ok(self.start_drain())
    }
}
