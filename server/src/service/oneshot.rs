//! One-shot runs: a fresh worker, variables and tables bound first,
//! validated before anything runs.

use super::publish::{publish_tool, take_published, Published};
use super::{
    check_bindings, check_timeout, tighter_limits, ErrorCode, RunScript, Service, ServiceError,
    Surface,
};
use rvisor::{CallContext, CallOptions, CancelToken, EventFeed, Outcome, RunResult};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

impl Service {
    /// A one-shot run in a fresh worker, for `tenant`. Blocks until it
    /// ends. A script that fails validation is not run: the answer is a
    /// result with outcome `rejected` and the validation.
    ///
    /// `cancel` stops the run from another thread (the client left): it
    /// then ends as `cancelled`.
    pub fn run_script(
        &self,
        tenant: &str,
        req: RunScript,
        surface: Surface,
        cancel: &CancelToken,
    ) -> Result<RunResult, ServiceError> {
        self.run_script_events(tenant, req, surface, cancel, None)
    }

    /// [`Service::run_script`] streamed: the run's events go to `feed`
    /// while it runs, its result last (also when it was rejected). `Err`
    /// (nothing ran, nothing was fed): the request itself was refused.
    pub fn run_script_streaming(
        &self,
        tenant: &str,
        req: RunScript,
        surface: Surface,
        cancel: &CancelToken,
        feed: &EventFeed,
    ) -> Result<RunResult, ServiceError> {
        let r = self.run_script_events(tenant, req, surface, cancel, Some(feed))?;
        feed.finish(&r);
        Ok(r)
    }

    pub(super) fn run_script_events(
        &self,
        tenant: &str,
        req: RunScript,
        surface: Surface,
        cancel: &CancelToken,
        feed: Option<&EventFeed>,
    ) -> Result<RunResult, ServiceError> {
        let _ = surface;
        self.admit()?;
        let _in_flight = self.inner.drain.enter();
        let sup = &self.inner.sup;
        let rules = self.rules();
        let timeout = check_timeout(req.timeout_seconds, rules)?;
        let limits = tighter_limits(self.server_limits(), req.limits.as_ref())?;
        let display = req.display.unwrap_or_default();
        if let Some(why) = display.problem() {
            return Err(ServiceError::invalid(why));
        }
        let variables: Vec<(String, Value)> = req
            .variables
            .into_iter()
            .map(|v| (v.name, v.value))
            .collect();
        let names: Vec<&str> = req.dataframes.iter().map(|d| d.name.as_str()).collect();
        check_bindings(&variables, &names, rules)?;
        let pointers: Vec<&str> = req
            .dataframes
            .iter()
            .map(|d| d.data_pointer.as_str())
            .collect();
        // All or nothing, and one answer for every failure (unknown,
        // expired, deleted, another tenant's): it does not say which
        // pointer or why.
        let Some(files) = self.inner.tables.resolve(tenant, &pointers) else {
            return Err(ServiceError::new(
                ErrorCode::DataPointerUnresolved,
                "one or more data pointers could not be resolved; nothing ran",
            ));
        };
        let inputs = super::artifacts::decode_inputs(&req.files, self.file_limits())?;
        let tables: Vec<(String, PathBuf)> =
            names.iter().map(|n| n.to_string()).zip(files).collect();
        let started = Instant::now();
        let script = req.script;
        let id = match feed {
            Some(f) => f.execution_id().to_string(),
            None => rvisor::ids::execution_id(),
        };
        // A run checks problems only; style notes are for validation.
        let v = sup.validate_with(&script, rvisor::StyleEngine::None);
        if !v.valid {
            let summary: Vec<String> = v
                .problems
                .iter()
                .map(|p| match (p.line, p.column) {
                    (Some(l), Some(c)) => format!("line {l}, column {c}: {}", p.message),
                    _ => p.message.clone(),
                })
                .collect();
            let mut r = RunResult::failed(
                id,
                script,
                Outcome::Rejected,
                format!(
                    "the script failed validation and was not run: {}",
                    summary.join("; ")
                ),
            );
            r.validation = serde_json::to_value(&v).ok();
            self.inner.metrics.record(tenant, &r, started.elapsed());
            return Ok(r);
        }
        let published: Published = Arc::new(Mutex::new(Vec::new()));
        let publish = publish_tool(
            self.inner.tables.clone(),
            tenant.to_string(),
            published.clone(),
        );
        let opts = CallOptions {
            display,
            ..CallOptions::one_shot(Some(timeout))
        };
        let mut tools = vec![publish];
        tools.extend(self.install_tool(tenant));
        let ctx = CallContext {
            variables,
            tables,
            tools: Arc::new(tools),
            libraries_after: self.tenant_libraries(tenant)?,
            cancel: Some(cancel.clone()),
            ..CallContext::default()
        };
        // Inputs go in first; what the script wrote comes back as
        // artifacts, kept in the shared store (artifacts.rs).
        let mut files = super::artifacts::OneShotFiles {
            inputs,
            limits: *self.file_limits(),
            store: self.inner.tables.store().clone(),
            tenant: tenant.to_string(),
            ttl_secs: self.inner.tables.config().ttl.as_secs(),
            before: Default::default(),
            svc: self.clone(),
        };
        let sink = feed.map(|f| f.sink());
        let mut r = sup.run_once_with_files(
            id,
            &script,
            &opts,
            &ctx,
            limits.as_ref(),
            None,
            sink.as_ref(),
            &mut files,
        );
        r.published = take_published(&published, &r.execution_id.clone());
        self.name_package_sources(tenant, &mut r);
        self.inner.metrics.record(tenant, &r, started.elapsed());
        if matches!(r.outcome, Outcome::StartupFailed | Outcome::StartupTimedOut) {
            return Err(ServiceError::new(
                ErrorCode::NoWorker,
                r.error.map(|e| e.message).unwrap_or_default(),
            ));
        }
        Ok(r)
    }

    pub(super) fn server_limits(&self) -> Option<&rvisor::Limits> {
        self.inner
            .sup
            .config()
            .worker
            .confine
            .as_ref()
            .map(|c| &c.limits)
    }
}
