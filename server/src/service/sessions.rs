//! Sessions of the service: made, found (by id or name, for their tenant
//! only), called, cancelled, reset, checkpointed, closed; admission on
//! every call.

use super::error::session_error;
use super::publish::{publish_tool, Published};
use super::{
    check_timeout, lock, tighter_limits, Entry, ErrorCode, NewSession, PendingCall, Service,
    ServiceError, SessionRun,
};
use crate::durable::SessionRecord;
use rvisor::{
    CancelToken, RunOptions, RunResult, Session, SessionOptions, SessionStatus, Supervisor,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

impl Service {
    /// A new session of `tenant`.
    pub fn create_session(
        &self,
        tenant: &str,
        req: NewSession,
    ) -> Result<SessionStatus, ServiceError> {
        let s = self.open(tenant, Some(req), None)?;
        Ok(s.status())
    }

    /// The options of a session made with `req` (`None`: the server's
    /// defaults, as for named sessions).
    pub(super) fn session_options(
        &self,
        req: Option<&NewSession>,
    ) -> Result<SessionOptions, ServiceError> {
        let defaults = self.inner.sup.config().defaults.clone();
        let Some(req) = req else {
            return Ok(defaults);
        };
        let mut opts = SessionOptions {
            timeout: check_timeout(req.timeout_seconds, self.rules())?,
            ..defaults
        };
        if let Some(w) = req.plot_width {
            opts.plot_width = w;
        }
        if let Some(h) = req.plot_height {
            opts.plot_height = h;
        }
        if let Some(d) = &req.display {
            if let Some(why) = d.problem() {
                return Err(ServiceError::invalid(why));
            }
            opts.display = opts.display.over(d);
        }
        opts.limits = tighter_limits(self.server_limits(), req.limits.as_ref())?;
        Ok(opts)
    }

    /// A new session of `tenant`, made with `req` and named `name`; kept
    /// durable (record, lease) when the service has a store.
    pub(super) fn open(
        &self,
        tenant: &str,
        req: Option<NewSession>,
        name: Option<&str>,
    ) -> Result<Session, ServiceError> {
        self.admit()?;
        let opts = self.session_options(req.as_ref())?;
        let (s, _) = self.insert_session(tenant, opts, true, |sup, opts| sup.session_with(opts))?;
        if let Some(d) = &self.inner.cfg.durable {
            let rec = SessionRecord {
                id: s.id().to_string(),
                tenant: tenant.to_string(),
                name: name.map(str::to_string),
                created_unix: rvisor::clock::unix_now(),
                options: req.map(|r| serde_json::to_value(r).unwrap_or_default()),
            };
            let kept = d
                .take(s.id(), Duration::ZERO)
                .map_err(|e| format!("{e:?}"))
                .and_then(|()| d.put_record(&rec).map_err(|e| e.to_string()));
            if let Err(e) = kept {
                lock(&self.inner.sessions).remove(s.id());
                s.close();
                d.delete_session(tenant, s.id());
                return Err(ServiceError::new(
                    ErrorCode::Storage,
                    format!(
                        "the session could not be recorded in the store {} ({e}); \
                         nothing was kept, retry when the store answers",
                        d.url()
                    ),
                ));
            }
        }
        Ok(s)
    }

    /// Makes a session with `make` and enters it in the map of `tenant`,
    /// within the session caps when it is `new` (a session resumed from
    /// the store exists already: lowering a cap must not make it
    /// unreachable).
    pub(super) fn insert_session(
        &self,
        tenant: &str,
        mut opts: SessionOptions,
        new: bool,
        make: impl FnOnce(&Supervisor, SessionOptions) -> Result<Session, rvisor::Error>,
    ) -> Result<(Session, Published), ServiceError> {
        let published: Published = Arc::new(Mutex::new(Vec::new()));
        // A tenant's packages (packages.rs): its library after R's own,
        // and install.packages() through the host.
        opts.libpath_after.extend(self.tenant_libraries(tenant)?);
        opts.tools.extend(self.install_tool(tenant));
        opts.tools.push(publish_tool(
            self.inner.tables.clone(),
            tenant.to_string(),
            published.clone(),
        ));
        if let Some(d) = &self.inner.cfg.durable {
            // The store keys checkpoints by tenant (a bare supervisor
            // store, as `session --jsonl` has, by session id).
            opts.checkpoint_prefix = crate::durable::checkpoint_prefix(tenant);
            if d.uses_leases() {
                // Every call runs only under this node's lease.
                opts.call_gate = Some(Arc::new(super::ownership::LeaseGate {
                    store: d.clone(),
                    service: Arc::downgrade(&self.inner),
                }));
            }
        }
        // Admission: counted and inserted under one lock, so racing
        // creations cannot pass the caps together.
        let mut sessions = lock(&self.inner.sessions);
        let cfg = &self.inner.cfg;
        let mine = sessions.values().filter(|e| e.tenant == tenant).count();
        if new && mine >= cfg.max_sessions_per_tenant {
            return Err(ServiceError::new(
                ErrorCode::Quota,
                format!(
                    "you have {mine} sessions open, the most allowed; close one \
                     (DELETE /v1/sessions/{{id}}) before opening another"
                ),
            ));
        }
        if new && sessions.len() >= cfg.max_sessions {
            return Err(ServiceError::new(
                ErrorCode::Quota,
                format!(
                    "the server holds {} sessions, the most it admits; retry later",
                    sessions.len()
                ),
            ));
        }
        let s = make(&self.inner.sup, opts).map_err(session_error)?;
        let history = self.open_history(tenant, s.id());
        sessions.insert(
            s.id().to_string(),
            Entry {
                tenant: tenant.to_string(),
                session: s.clone(),
                published: published.clone(),
                history,
            },
        );
        Ok((s, published))
    }

    pub(super) fn find(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<(Session, Published), ServiceError> {
        match lock(&self.inner.sessions).get(id) {
            Some(e) if e.tenant == tenant => return Ok((e.session.clone(), e.published.clone())),
            // Another tenant's session answers exactly like an unknown one.
            Some(_) => return Err(ServiceError::not_found("session")),
            None => {}
        }
        match &self.inner.cfg.durable {
            Some(d) => self.adopt(d, tenant, id),
            None => Err(ServiceError::not_found("session")),
        }
    }

    /// The session `id` of `tenant`.
    pub fn session(&self, tenant: &str, id: &str) -> Result<Session, ServiceError> {
        Ok(self.find(tenant, id)?.0)
    }

    /// The session named `name` of `tenant` (for surfaces that address
    /// sessions by name: nng, `session --jsonl`, MCP); made with the
    /// server's defaults on first use when `create`. `Ok(None)`: no such
    /// name and `create` was false.
    pub fn named_session(
        &self,
        tenant: &str,
        name: &str,
        create: bool,
    ) -> Result<Option<String>, ServiceError> {
        let mut names = lock(&self.inner.names);
        let key = (tenant.to_string(), name.to_string());
        if let Some(id) = names.get(&key) {
            // Closed by id meanwhile? Then the name is free again.
            if self.find(tenant, id).is_ok() {
                return Ok(Some(id.clone()));
            }
            names.remove(&key);
        }
        if !create {
            return Ok(None);
        }
        let s = self.open(tenant, None, Some(name))?;
        let id = s.id().to_string();
        names.insert(key, id.clone());
        Ok(Some(id))
    }

    /// Queues a call in session `id` of `tenant`.
    pub fn session_run(
        &self,
        tenant: &str,
        id: &str,
        req: &SessionRun,
    ) -> Result<PendingCall, ServiceError> {
        self.queue_session_run(tenant, id, req, false)
    }

    /// [`Service::session_run`] for a caller that follows the call as it
    /// runs ([`PendingCall::events`]).
    pub fn session_run_streaming(
        &self,
        tenant: &str,
        id: &str,
        req: &SessionRun,
    ) -> Result<PendingCall, ServiceError> {
        self.queue_session_run(tenant, id, req, true)
    }

    pub(super) fn queue_session_run(
        &self,
        tenant: &str,
        id: &str,
        req: &SessionRun,
        stream: bool,
    ) -> Result<PendingCall, ServiceError> {
        let (s, published) = self.find(tenant, id)?;
        // The files now, so the history can say which the call changed.
        let files_before = self.session_snapshot(tenant, id).ok().flatten();
        // Counted from here: a drain waits for calls already accepted.
        let in_flight = self.inner.drain.enter();
        let timeout = match req.timeout_seconds {
            None => None,
            t => Some(check_timeout(t, self.rules())?),
        };
        let started = Instant::now();
        let over = RunOptions {
            timeout,
            plot_width: req.plot_width,
            plot_height: req.plot_height,
            display: req.display.unwrap_or_default(),
            stream_limits: self.stream_limits(tenant),
        };
        // Admission: a session without a worker gets one only within the
        // live caps and the memory budget (idle sessions hibernate to make
        // room); a tenant's calls are capped. Checked and queued at once.
        let queued = self
            .inner
            .admission
            .admit(
                || self.sessions_view(),
                tenant,
                id,
                || {
                    if stream {
                        s.run_streaming_with(&req.code, &over)
                    } else {
                        s.run_with(&req.code, &over)
                    }
                },
            )
            .map_err(ServiceError::refused)?;
        let handle = queued.map_err(|e| match e {
            // Released under the caller by a drain or shutdown: it goes on
            // after a restart or on another node, so the call is retryable.
            rvisor::Rejection::Closed if self.inner.drain.is_draining() => ServiceError::new(
                ErrorCode::Draining,
                "this node is stopping and has handed the session off; retry in a moment \
                 (a router sends the call to the node that has it now)",
            ),
            // Handed off to another node (it asked for it), or lost to
            // one, between the lookup above and the call's queueing: the
            // session goes on there, so the call is retryable, not a 404
            // (the chaos test saw "session not found" for a live session).
            rvisor::Rejection::Closed => self
                .moved_away(id)
                // A session closed under the caller is gone for it.
                .unwrap_or_else(|| ServiceError::not_found("session")),
            other => other.into(),
        })?;
        let cancel = CancelToken::new();
        {
            let id = handle.execution_id().to_string();
            cancel.on_cancel(move || {
                s.cancel_call(&id);
            });
        }
        Ok(PendingCall {
            handle,
            session_id: id.to_string(),
            published,
            started,
            service: self.clone(),
            cancel,
            tenant: tenant.to_string(),
            in_flight,
            files_before,
        })
    }

    /// Follows session `id`'s calls from the next one on, whoever queues
    /// them ([`rvisor::Session::watch`], bounded as the tenant's streams):
    /// the web console's live view of an agent's calls.
    pub fn watch(&self, tenant: &str, id: &str) -> Result<rvisor::Watch, ServiceError> {
        let s = self.session(tenant, id)?;
        s.watch(self.stream_limits(tenant)).map_err(|e| match e {
            rvisor::Rejection::Invalid(m) => ServiceError::new(ErrorCode::Busy, m),
            other => other.into(),
        })
    }

    /// The status of session `id`.
    pub fn session_status(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        Ok(self.session(tenant, id)?.status())
    }

    /// Cancels the running call and drops the queue of session `id`.
    pub fn cancel(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        let s = self.session(tenant, id)?;
        s.cancel();
        Ok(s.status())
    }

    /// Starts session `id` over with a fresh worker.
    pub fn reset(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        let s = self.session(tenant, id)?;
        // The fresh worker is put in place before the next call runs.
        s.reset();
        self.record_event(id, super::EntryKind::Reset, "reset");
        Ok(s.status())
    }

    /// Whether this server keeps checkpoints (`--state-dir` or a store):
    /// without them it offers no checkpoint, hibernate or restore (its
    /// OpenAPI document lists none of the three).
    pub fn keeps_checkpoints(&self) -> bool {
        self.inner.sup.config().checkpoints.is_some()
    }

    /// `not_found` for the checkpoint operations of a server that keeps no
    /// checkpoints: it does not offer them, as a route it does not have.
    fn checkpoints_offered(&self, op: &str) -> Result<(), ServiceError> {
        if self.keeps_checkpoints() {
            return Ok(());
        }
        Err(ServiceError::new(
            ErrorCode::NotFound,
            format!(
                "this server keeps no checkpoints, so it has no {op}: start it with \
                 --state-dir DIR to checkpoint, hibernate and restore sessions"
            ),
        ))
    }

    /// Checkpoints session `id` now (after its running call) and says what
    /// the checkpoint holds; `written: false` when nothing ran since the
    /// last one. Blocks until it is done. `conflict` when no call has run
    /// in it yet (nothing to keep), `not_found` when the server keeps no
    /// checkpoints (no `--state-dir`), `too_large` over the cap on one
    /// checkpoint, `quota` over the tenant's quota of checkpoint bytes,
    /// `busy` when another node took the session over, `storage` when the
    /// store failed, `internal` when the worker did.
    pub fn checkpoint(
        &self,
        tenant: &str,
        id: &str,
    ) -> Result<rvisor::checkpoint::CheckpointInfo, ServiceError> {
        self.checkpoints_offered("checkpoint")?;
        let s = self.session(tenant, id)?;
        s.checkpoint().map_err(|e| match e {
            rvisor::CheckpointError::NothingYet => ServiceError::conflict(format!(
                "session {id} has nothing to checkpoint yet: no call has run in it; run one first"
            )),
            e => ServiceError::from(e),
        })
    }

    /// Rolls session `id` back to its last checkpoint (the next worker
    /// loads it); `conflict` when it has none yet, `not_found` when the
    /// server keeps no checkpoints.
    pub fn restore(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        self.checkpoints_offered("restore")?;
        let s = self.session(tenant, id)?;
        s.restore().map_err(|e| match e {
            rvisor::RestoreError::NoCheckpoint => ServiceError::conflict(format!(
                "session {id} has no checkpoint to restore yet: checkpoint it first \
                 (POST .../checkpoint, or let it go idle)"
            )),
            e => ServiceError::new(ErrorCode::Closed, e.to_string()),
        })?;
        self.record_event(id, super::EntryKind::Restore, "restore");
        Ok(s.status())
    }

    /// Hibernates session `id` once it is idle (checkpoint, worker
    /// released); the next call restores it. `not_found` when the server
    /// keeps no checkpoints.
    pub fn hibernate(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        self.checkpoints_offered("hibernate")?;
        let s = self.session(tenant, id)?;
        s.hibernate();
        Ok(s.status())
    }

    /// 503 `busy`, retryable, when session `id` went to another node lately
    /// (handed off or lost): a call of it that did not run here runs there.
    fn moved_away(&self, id: &str) -> Option<ServiceError> {
        self.inner.owner.has_moved(id).map(retry_busy)
    }

    /// The retryable error to answer instead of a call's result `r`, when
    /// the session is elsewhere now: the call never ran because its
    /// session was handed off (this node drains: 503 `draining`; another
    /// node asked for it, or took it over: 503 `busy`), or it ran on a
    /// copy this node no longer owned, so its effects are not in the
    /// session (503 `busy`). The client (or a router) retries where the
    /// session is now. `None` for every other result.
    pub fn handed_off(&self, r: &RunResult) -> Option<ServiceError> {
        if let Some(why) = self.inner.owner.is_not_kept(&r.execution_id) {
            return Some(retry_busy(why));
        }
        let not_run = matches!(
            r.outcome,
            rvisor::Outcome::Closed | rvisor::Outcome::NotExecuted
        );
        if let Some(e) = not_run.then(|| self.moved_away(&r.session.id)).flatten() {
            return Some(e);
        }
        (r.outcome == rvisor::Outcome::Closed && self.inner.drain.is_draining()).then(|| {
            let why = r
                .error
                .as_ref()
                .map_or_else(|| r.console.trim().to_string(), |e| e.message.clone());
            ServiceError::new(ErrorCode::Draining, why)
        })
    }

    /// Takes session `id` out of the service's maps (the caller ends it),
    /// with any name that still means it (a racing `named_session` may
    /// already have made a new one under the name, which stays reachable).
    pub(super) fn forget(&self, id: &str) -> Option<Entry> {
        let e = lock(&self.inner.sessions).remove(id);
        lock(&self.inner.names).retain(|_, v| v != id);
        self.release_file_bytes(id);
        e
    }

    /// Closes session `id`; its running and queued calls end as `closed`.
    /// The answer is the closed session's status.
    pub fn close(&self, tenant: &str, id: &str) -> Result<SessionStatus, ServiceError> {
        let s = self.session(tenant, id)?;
        self.forget(id);
        self.forget_file_bytes(id);
        s.close();
        if let Some(d) = &self.inner.cfg.durable {
            d.delete_session(tenant, id);
        }
        Ok(s.status())
    }

    /// Closes every session for good (their checkpoints are deleted; at
    /// the end of a surface that keeps nothing: see
    /// [`Service::release_all`]).
    pub fn close_all(&self) {
        let all: Vec<Entry> = lock(&self.inner.sessions).drain().map(|(_, e)| e).collect();
        lock(&self.inner.names).clear();
        for e in all {
            e.session.close();
        }
    }
}

/// 503 `busy`, to retry in a second (where the session is now).
fn retry_busy(why: String) -> ServiceError {
    let mut e = ServiceError::new(ErrorCode::Busy, why);
    e.retry_after_seconds = Some(1);
    e
}
