//! Who owns a session, as this node sees it (docs/scale-out.md,
//! "Ownership by leases"): one lock per session for taking it over or
//! handing it off (so takeovers of different sessions never wait for each
//! other), the hand-offs in progress, the call gate that confirms the
//! node's lease right before and after every call, and the results that
//! must not be acknowledged because the session was lost meanwhile.

use super::{lock, Service, ServiceState};
use crate::durable::{OwnershipError, SessionStore};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// How long a lost session or an unkept result is remembered, so that
/// the answers of calls that were in flight then say to retry.
const REMEMBER: Duration = Duration::from_secs(600);
/// At most this many of each are remembered (oldest dropped first).
const REMEMBER_MAX: usize = 100_000;
/// A call starts only while this node's lease surely runs this much
/// longer (its renewal thread keeps it running while the call does).
pub(super) const CALL_MARGIN: Duration = Duration::from_secs(1);

/// Ids with when they were noted and why, pruned by age and count.
#[derive(Debug, Default)]
struct Recent(HashMap<String, (Instant, String)>);

impl Recent {
    fn note(&mut self, id: &str, why: &str) {
        let now = Instant::now();
        if self.0.len() >= REMEMBER_MAX {
            self.0
                .retain(|_, (at, _)| now.duration_since(*at) < REMEMBER);
            if self.0.len() >= REMEMBER_MAX {
                let oldest = self
                    .0
                    .iter()
                    .min_by_key(|(_, (at, _))| *at)
                    .map(|(k, _)| k.clone());
                if let Some(oldest) = oldest {
                    self.0.remove(&oldest);
                }
            }
        }
        self.0.insert(id.to_string(), (now, why.to_string()));
    }

    fn get(&self, id: &str) -> Option<String> {
        self.0
            .get(id)
            .filter(|(at, _)| at.elapsed() < REMEMBER)
            .map(|(_, why)| why.clone())
    }
}

/// This node's bookkeeping of session ownership (in `ServiceState`).
#[derive(Debug, Default)]
pub(super) struct Ownership {
    /// Session id -> held while the session is taken over or handed off.
    locks: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Sessions being released on another node's request.
    handing_off: Mutex<HashSet<String>>,
    /// Sessions this node lost or handed off: calls of theirs that did
    /// not run here are retryable (they run where the session is now).
    moved: Mutex<Recent>,
    /// Calls whose results must not be acknowledged: they ran on a copy
    /// this node no longer owns, or were refused before they ran.
    not_kept: Mutex<Recent>,
}

/// The per-session lock, held while the session is taken over or handed
/// off; [`SessionLock::drop`] forgets it when nobody else waits on it.
pub(super) struct SessionLock<'a> {
    owner: &'a Ownership,
    id: String,
    lock: Arc<Mutex<()>>,
}

impl SessionLock<'_> {
    /// Runs `f` with the lock held.
    pub(super) fn hold<T>(&self, f: impl FnOnce() -> T) -> T {
        let _held = lock(&self.lock);
        f()
    }
}

impl Drop for SessionLock<'_> {
    fn drop(&mut self) {
        let mut locks = lock(&self.owner.locks);
        // Ours and the map's: nobody else holds or waits for it.
        if Arc::strong_count(&self.lock) <= 2 {
            locks.remove(&self.id);
        }
    }
}

impl Ownership {
    /// The lock of session `id`.
    pub(super) fn session(&self, id: &str) -> SessionLock<'_> {
        let lock = lock(&self.locks).entry(id.to_string()).or_default().clone();
        SessionLock {
            owner: self,
            id: id.to_string(),
            lock,
        }
    }

    /// Marks a hand-off of `id` as started; false if one already is.
    pub(super) fn start_handoff(&self, id: &str) -> bool {
        lock(&self.handing_off).insert(id.to_string())
    }

    /// The hand-off of `id` is over.
    pub(super) fn end_handoff(&self, id: &str) {
        lock(&self.handing_off).remove(id);
    }

    /// Session `id` went to another node (lost, or handed off), `why`.
    pub(super) fn moved(&self, id: &str, why: &str) {
        lock(&self.moved).note(id, why);
    }

    /// Why session `id` went to another node, if it did lately.
    pub(super) fn has_moved(&self, id: &str) -> Option<String> {
        lock(&self.moved).get(id)
    }

    /// The result of call `execution_id` must not be acknowledged, `why`.
    pub(super) fn not_kept(&self, execution_id: &str, why: &str) {
        lock(&self.not_kept).note(execution_id, why);
    }

    /// Why the result of `execution_id` must not be acknowledged, if so.
    pub(super) fn is_not_kept(&self, execution_id: &str) -> Option<String> {
        lock(&self.not_kept).get(execution_id)
    }
}

/// The call gate of a session on a node with leases: a call runs only
/// while the node holds the session's lease, and its result is
/// acknowledged only if the node held it throughout.
#[derive(Debug)]
pub(super) struct LeaseGate {
    pub(super) store: Arc<SessionStore>,
    pub(super) service: Weak<ServiceState>,
}

impl LeaseGate {
    fn service(&self) -> Option<Service> {
        self.service.upgrade().map(|inner| Service { inner })
    }
}

impl rvisor::CallGate for LeaseGate {
    fn before_call(&self, session: &str, execution_id: &str) -> Result<(), String> {
        match self.store.confirm(session, CALL_MARGIN) {
            Ok(()) => Ok(()),
            Err(OwnershipError::Lost) => {
                let why = "this node no longer holds the session: another node took it over \
                           while this node was paused or cut off from the store. Nothing ran; \
                           retry the call (it runs where the session is now)";
                if let Some(svc) = self.service() {
                    svc.inner.owner.not_kept(execution_id, why);
                    svc.lose(session);
                }
                Err(why.into())
            }
            Err(OwnershipError::Unconfirmed(e)) => {
                let why = format!(
                    "this node could not confirm that it still holds the session: the session \
                     store does not answer ({e}). Nothing ran; retry shortly"
                );
                if let Some(svc) = self.service() {
                    svc.inner.owner.not_kept(execution_id, &why);
                }
                Err(why)
            }
        }
    }

    fn after_call(&self, session: &str, execution_id: &str) {
        match self.store.confirm(session, Duration::ZERO) {
            Ok(()) => {}
            Err(OwnershipError::Lost) => {
                tracing::warn!(target: "rvisor::sessions", session, execution_id,
                    "the lease lapsed and another node took the session during this call: its \
                     result is not acknowledged");
                if let Some(svc) = self.service() {
                    svc.inner.owner.not_kept(
                        execution_id,
                        "another node took the session over while this call ran here (this node \
                         was paused or cut off from the store past its lease): the call's effects \
                         are not in the session. Retry the call (it runs where the session is now)",
                    );
                    svc.lose(session);
                }
            }
            // The lease lapsed by this node's clock and the store does not
            // answer: another node may have taken the session, or not.
            // The call's effects are in this node's copy, which stays (it
            // is dropped if the renewal finds the lease taken), so the
            // answer is indeterminate, and says so.
            Err(OwnershipError::Unconfirmed(e)) => {
                tracing::warn!(target: "rvisor::sessions", session, execution_id,
                    "could not confirm the lease after the call ({e})");
                if let Some(svc) = self.service() {
                    svc.inner.owner.not_kept(
                        execution_id,
                        &format!(
                            "the call ran, but this node could not confirm that it still held the \
                             session when it ended (its lease lapsed and the session store does not \
                             answer: {e}), so its effects may or may not be kept: check the \
                             session's state before retrying"
                        ),
                    );
                }
            }
        }
    }
}
