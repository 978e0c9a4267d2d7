//! A session call in flight ([`PendingCall`]) and the events of a call
//! ([`ServiceEvents`]): both record the metrics and attach the tables the
//! call published when it ends, and cancel it when dropped early.

use super::publish::{take_published, Published};
use super::Service;
use rvisor::{CallEvent, CallHandle, CancelOnDrop, CancelToken, EventKind, Events, RunResult};
use std::time::Instant;

/// A session call in flight: resolve it with [`PendingCall::wait`] or
/// `.await` ([`PendingCall::finish`]); either records the metrics and
/// attaches the tables the call published.
#[derive(Debug)]
pub struct PendingCall {
    pub(super) handle: CallHandle,
    /// Its session (a result of a call that never ran may lack it).
    pub(super) session_id: String,
    pub(super) published: Published,
    pub(super) started: Instant,
    pub(super) service: Service,
    pub(super) cancel: CancelToken,
    pub(super) tenant: String,
    /// Counts the call as in flight (a drain waits for it) until it ends.
    pub(super) in_flight: crate::cluster::InFlight,
    /// The session's files when the call was queued: those it changed go
    /// into the session's history.
    pub(super) files_before: Option<rvisor::files::Snapshot>,
}

impl PendingCall {
    /// The call's execution id.
    pub fn execution_id(&self) -> &str {
        self.handle.execution_id()
    }

    pub(super) fn complete(
        published: &Published,
        service: &Service,
        (tenant, session_id): (&str, &str),
        (started, files_before): (Instant, Option<&rvisor::files::Snapshot>),
        mut r: RunResult,
    ) -> RunResult {
        // A call that never ran (dropped from the queue) says whose it was.
        if r.session.id.is_empty() {
            r.session.id = session_id.to_string();
        }
        r.published = take_published(published, &r.execution_id.clone());
        service.name_package_sources(tenant, &mut r);
        service.inner.metrics.record(tenant, &r, started.elapsed());
        // The files the call changed, as its artifacts (docs/files.md).
        let changed = match (files_before, &r.outcome) {
            (_, rvisor::Outcome::Rejected) | (None, _) => None,
            (Some(before), _) => service.call_changes(session_id, before, &mut r),
        };
        service.record_call(session_id, &r, started.elapsed(), changed.as_deref());
        r
    }

    /// Cancels this call alone (queued: it leaves the queue; running: it
    /// is interrupted); the session and its other calls go on.
    pub fn cancel_token(&self) -> CancelToken {
        self.cancel.clone()
    }

    /// Blocks until the call ends.
    pub fn wait(self) -> RunResult {
        let r = self.handle.wait();
        self.cancel.clear();
        drop(self.in_flight);
        Self::complete(
            &self.published,
            &self.service,
            (&self.tenant, &self.session_id),
            (self.started, self.files_before.as_ref()),
            r,
        )
    }

    /// The call's events as they happen, ending with its result (with the
    /// tables it published; the metrics are recorded then). Dropping the
    /// stream before the result cancels the call (a client that left).
    /// Only a call queued with [`Service::session_run_streaming`] streams
    /// its events; others give their result alone.
    pub fn events(self) -> ServiceEvents {
        let PendingCall {
            handle,
            session_id,
            published,
            started,
            service,
            cancel,
            tenant,
            in_flight,
            files_before,
        } = self;
        ServiceEvents {
            events: handle.events(),
            guard: Some(CancelOnDrop::new(cancel.clone())),
            cancel,
            done: Some(Done {
                published,
                service,
                who: (tenant, session_id),
                started,
                files_before,
            }),
            ahead: None,
            in_flight: Some(in_flight),
            trim: GiveBack(false),
        }
    }

    /// Waits for the call without blocking a thread. If this future is
    /// dropped before the call ends (an HTTP client that closed its
    /// connection), the call is cancelled.
    pub async fn finish(self) -> RunResult {
        let PendingCall {
            handle,
            session_id,
            published,
            started,
            service,
            cancel,
            tenant,
            in_flight,
            files_before,
        } = self;
        let guard = CancelOnDrop::new(cancel.clone());
        let r = handle.await;
        guard.disarm();
        cancel.clear();
        drop(in_flight);
        Self::complete(
            &published,
            &service,
            (&tenant, &session_id),
            (started, files_before.as_ref()),
            r,
        )
    }
}

/// The events of a session call ([`PendingCall::events`]).
#[derive(Debug)]
pub struct ServiceEvents {
    events: Events,
    guard: Option<CancelOnDrop>,
    cancel: CancelToken,
    /// What the result gets when it passes: tables, metrics, history.
    done: Option<Done>,
    /// An event read ahead (see [`ServiceEvents::put_back`]).
    ahead: Option<CallEvent>,
    /// A session call counts as in flight (a drain waits for it) until its
    /// result has passed.
    in_flight: Option<crate::cluster::InFlight>,
    /// Declared last, so dropped after `events` has freed what it held.
    trim: GiveBack,
}

/// What a session call's result gets when it passes ([`PendingCall::complete`]).
#[derive(Debug)]
struct Done {
    published: Published,
    service: Service,
    /// (tenant, session id).
    who: (String, String),
    started: Instant,
    files_before: Option<rvisor::files::Snapshot>,
}

/// Gives the heap back to the system when dropped, if armed.
#[derive(Debug)]
struct GiveBack(bool);

impl Drop for GiveBack {
    fn drop(&mut self) {
        if self.0 {
            crate::heap::give_back();
        }
    }
}

impl Drop for ServiceEvents {
    /// A stream that held much (its events for a slow client, a large
    /// result) gives that memory back to the system once it is freed, so
    /// the server does not stay at the peak its slow clients caused.
    fn drop(&mut self) {
        self.trim.0 = self.events.peak_bytes() >= crate::heap::TRIM_AFTER_BYTES;
    }
}

impl ServiceEvents {
    /// The events of a one-shot run fed by [`Service::run_script_streaming`]
    /// with `cancel`: dropping them before the result cancels the run.
    pub fn of_run(events: Events, cancel: CancelToken) -> Self {
        Self {
            events,
            guard: Some(CancelOnDrop::new(cancel.clone())),
            cancel,
            done: None,
            in_flight: None,
            ahead: None,
            trim: GiveBack(false),
        }
    }

    /// Makes `e` (just read) the next event again.
    pub fn put_back(&mut self, e: CallEvent) {
        self.ahead = Some(e);
    }

    /// The call's execution id.
    pub fn execution_id(&self) -> &str {
        self.events.execution_id()
    }

    fn finish(&mut self, mut e: CallEvent) -> CallEvent {
        if let EventKind::Result { result } = &mut e.kind {
            if let Some(g) = self.guard.take() {
                g.disarm();
            }
            self.cancel.clear();
            self.in_flight = None;
            if let Some(d) = self.done.take() {
                let r = std::mem::replace(
                    result.as_mut(),
                    RunResult::empty(String::new(), String::new()),
                );
                let service = d.service;
                let mut r = PendingCall::complete(
                    &d.published,
                    &service,
                    (&d.who.0, &d.who.1),
                    (d.started, d.files_before.as_ref()),
                    r,
                );
                // A streamed answer has its status already: a result this
                // node must not acknowledge (it ran on a copy the node no
                // longer owned) says so in the result itself.
                if let (Some(e), true) = (service.handed_off(&r), r.success) {
                    r.outcome = rvisor::Outcome::Closed;
                    r.success = false;
                    r.prepend_notice(&format!("rvisor: {}", e.message));
                    r.error = Some(rvisor::ErrorInfo::message(e.message));
                }
                **result = r;
            }
        }
        e
    }

    /// Blocks until the next event; `None` after the result.
    pub fn next_blocking(&mut self) -> Option<CallEvent> {
        if let Some(e) = self.ahead.take() {
            return Some(e);
        }
        let e = self.events.next()?;
        Some(self.finish(e))
    }

    /// The next event without blocking a thread; `None` after the result.
    pub async fn next(&mut self) -> Option<CallEvent> {
        if let Some(e) = self.ahead.take() {
            return Some(e);
        }
        let e = self.events.next_event().await?;
        Some(self.finish(e))
    }

    /// The poll form of [`ServiceEvents::next`].
    pub fn poll_next(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<CallEvent>> {
        if let Some(e) = self.ahead.take() {
            return std::task::Poll::Ready(Some(e));
        }
        match self.events.poll_next(cx) {
            std::task::Poll::Ready(Some(e)) => std::task::Poll::Ready(Some(self.finish(e))),
            other => other,
        }
    }
}
