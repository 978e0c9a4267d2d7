//! The [`Supervisor`]: the zygote pool, the registry of workers, sessions
//! handed out and one-shot runs; its configuration ([`SupervisorConfig`]).
//! Sessions themselves are `crate::session`.

use crate::call::{validate_call, CallOptions};
use crate::cancel::CancelToken;
use crate::checkpoint::{CheckpointStore, Manifest};
use crate::error::{ConfineError, Error, ValidateError};
use crate::events::EventSink;
use crate::ids;
use crate::process::WorkerConfig;
use crate::session::{
    close, lock, start_runner, CloseOnDrop, EnvPolicy, PoolSource, Registry, Session,
    SessionOptions, SessionState, Shared,
};
use crate::tools::CallContext;
use crate::worker::Worker;
use rvisor_protocol::timing::mark;
use rvisor_protocol::{Outcome, RunResult};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Configuration of a [`Supervisor`].
#[derive(Debug, Clone, Default)]
pub struct SupervisorConfig {
    /// How workers are started.
    pub worker: WorkerConfig,
    /// Defaults for new sessions.
    pub defaults: SessionOptions,
    /// Zygote and spares.
    pub pool: crate::PoolConfig,
    /// Safety rules for scripts from agents (health reports them).
    pub rules: crate::rules::SafetyRules,
    /// Style checks of validation (`auto`: the fast engine, which the
    /// service layer runs; `lintr` for lintr itself).
    pub style: crate::rules::StyleEngine,
    /// OS confinement of workers (default: every layer; see
    /// docs/confinement.md). The supervisor refuses to start when the host
    /// cannot provide it.
    pub confinement: crate::Confinement,
    /// The node this supervisor runs on, when several serve behind one
    /// router (docs/scale-out.md): session ids then read `{node}.s-{hex}`,
    /// so a router can send a session's calls to its node. `None`: ids
    /// are `s-{hex}`. The caller checks the form (the server's
    /// `cluster::NodeId`); it must not contain `/`.
    pub node_id: Option<String>,
    /// Where sessions keep their checkpoints (none: sessions are not
    /// durable: no checkpoints, no hibernation, a kill starts empty).
    pub checkpoints: Option<Arc<dyn CheckpointStore>>,
}

#[derive(Debug)]
struct SupShared {
    cfg: SupervisorConfig,
    sessions: Mutex<HashMap<String, Weak<CloseOnDrop>>>,
    registry: Arc<Registry>,
    pool: Arc<crate::Pool>,
    shut: AtomicBool,
    started: Instant,
    /// A worker kept for validation: it parses, never evaluates, scripts.
    validator: Mutex<Option<Worker>>,
    /// The confinement in force (from the host probe).
    sandbox: crate::confine::Sandbox,
}

/// Hands out sessions; owns every worker they start. Dropping the last
/// clone shuts every session down.
#[derive(Debug, Clone)]
pub struct Supervisor {
    inner: Arc<SupShared>,
}

impl Supervisor {
    /// A supervisor with this configuration. Removes temporary directories
    /// left behind by supervisors that were killed.
    pub fn new(mut cfg: SupervisorConfig) -> Result<Self, Error> {
        mark("supervisor.new");
        if cfg.worker.worker_bin.is_none() {
            crate::locate_worker()?;
        }
        let mut sandbox = crate::confine::probe(&cfg.confinement, &cfg.worker.temp_root)
            .map_err(Error::Confinement)?;
        sandbox.page_merging = cfg.worker.merge_pages;
        if cfg.confinement.enabled {
            cfg.confinement
                .limits
                .check()
                .map_err(|e| Error::Confinement(e.into()))?;
            for p in &cfg.confinement.read_only {
                crate::confine::check_read_only(p, &cfg.worker.temp_root)
                    .map_err(Error::Confinement)?;
            }
            let cgroups = crate::confine::Cgroups::detect(cfg.confinement.cgroups)
                .map_err(Error::Confinement)?
                .map(Arc::new);
            sandbox.layers.push(crate::confine::cgroup_layer(
                &cfg.confinement.limits,
                cgroups.as_deref(),
            ));
            cfg.worker.cgroups = cgroups;
            cfg.worker.uids = Some(Arc::new(
                crate::confine::Uids::reserve(&cfg.confinement).map_err(Error::Confinement)?,
            ));
            if !cfg.pool.zygote {
                return Err(Error::Confinement(ConfineError::NeedsZygote));
            }
            cfg.worker.confine = Some(cfg.confinement.clone());
            cfg.worker.programs = sandbox.programs.clone().unwrap_or_default();
        } else {
            cfg.worker.confine = None;
            cfg.worker.cgroups = None;
            cfg.worker.uids = None;
            cfg.worker.programs = Vec::new();
        }
        sweep_stale_dirs(&cfg.worker.temp_root);
        mark("supervisor.probed");
        let pool = crate::Pool::new(cfg.worker.clone(), cfg.pool.clone())?;
        mark("supervisor.ready");
        Ok(Self {
            inner: Arc::new(SupShared {
                cfg,
                sessions: Mutex::new(HashMap::new()),
                pool,
                registry: Arc::new(Registry::default()),
                shut: AtomicBool::new(false),
                started: Instant::now(),
                validator: Mutex::new(None),
                sandbox,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SupervisorConfig {
        &self.inner.cfg
    }

    /// The confinement workers get (what health reports).
    pub fn sandbox(&self) -> &crate::confine::Sandbox {
        &self.inner.sandbox
    }

    /// A new session with the supervisor's default options.
    pub fn session(&self) -> Result<Session, Error> {
        self.session_with(self.inner.cfg.defaults.clone())
    }

    /// A new session. Its worker starts with the first call.
    pub fn session_with(&self, opts: SessionOptions) -> Result<Session, Error> {
        if self.inner.shut.load(Ordering::SeqCst) {
            return Err(Error::Invalid("the supervisor is shut down".into()));
        }
        if opts.plot_width == 0
            || opts.plot_width > crate::MAX_PLOT_SIDE
            || opts.plot_height == 0
            || opts.plot_height > crate::MAX_PLOT_SIDE
        {
            return Err(Error::Invalid(format!(
                "plot sizes must be between 1 and {} pixels",
                crate::MAX_PLOT_SIDE
            )));
        }
        if let Some(why) = opts.display.problem() {
            return Err(Error::Invalid(why));
        }
        let mut names = std::collections::HashSet::new();
        for t in &opts.tools {
            if !crate::tools::valid_name(&t.name) {
                return Err(Error::Invalid(format!("tool name {:?} is invalid", t.name)));
            }
            if !names.insert(t.name.clone()) {
                return Err(Error::Invalid(format!(
                    "tool {:?} is registered twice",
                    t.name
                )));
            }
        }
        let id = match &self.inner.cfg.node_id {
            Some(node) => format!("{node}.s-{}", ids::random_hex(8)),
            None => format!("s-{}", ids::random_hex(8)),
        };
        self.open_session(id, opts, None)
    }

    /// A session that goes on from its checkpoint in the store: the same
    /// id, options as it had, and its state restored into the worker of
    /// its first call (`session.restored.reason` is `reason`:
    /// [`RESUMED_RESTART`] after a restart of this server,
    /// [`RESUMED_MOVED`] when another node hands it over). Nothing is read
    /// until that call, so resuming thousands of sessions is cheap; a
    /// checkpoint that is missing or cannot be loaded then gives a fresh
    /// session whose first result says why. Fails without a checkpoint
    /// store, for an id that is not a session id, or one already open.
    pub fn resume_session(
        &self,
        id: &str,
        opts: SessionOptions,
        reason: &str,
    ) -> Result<Session, Error> {
        if self.inner.shut.load(Ordering::SeqCst) {
            return Err(Error::Invalid("the supervisor is shut down".into()));
        }
        if self.inner.cfg.checkpoints.is_none() {
            return Err(Error::Invalid(
                "sessions can only be resumed with a checkpoint store \
                 (SupervisorConfig::checkpoints)"
                    .into(),
            ));
        }
        if !ids::is_session_id(id) {
            return Err(Error::Invalid(format!("{id:?} is not a session id")));
        }
        if self.get(id).is_some() {
            return Err(Error::Invalid(format!("session {id} is already open here")));
        }
        self.open_session(id.to_string(), opts, Some(reason))
    }

    fn open_session(
        &self,
        id: String,
        opts: SessionOptions,
        resume: Option<&str>,
    ) -> Result<Session, Error> {
        let confined = self.inner.cfg.worker.confine.is_some();
        let (working_dir, owns) = match &opts.working_dir {
            Some(d) => {
                if !d.is_dir() {
                    return Err(Error::Invalid(format!(
                        "working_dir {} is not a directory; create it first",
                        d.display()
                    )));
                }
                (
                    Some(std::fs::canonicalize(d).unwrap_or_else(|_| d.clone())),
                    false,
                )
            }
            // A confined worker works in its private tmpfs.
            None if confined => (None, false),
            None => {
                use std::os::unix::fs::DirBuilderExt;
                let d = self
                    .inner
                    .cfg
                    .worker
                    .temp_root
                    .join(format!("rvisor-{}-{id}", std::process::id()));
                std::fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&d)
                    .map_err(|source| Error::Io {
                        what: "create the session's working directory",
                        source,
                    })?;
                (Some(d), true)
            }
        };
        let mut worker_cfg = self.inner.cfg.worker.clone();
        worker_cfg
            .apply_overrides(opts.limits.as_ref(), opts.network)
            .map_err(Error::Settings)?;
        if let (Some(c), Some(d)) = (worker_cfg.confine.as_mut(), &working_dir) {
            // An explicit working directory is visible, read-only, inside.
            crate::confine::check_read_only(d, &worker_cfg.temp_root).map_err(Error::Settings)?;
            crate::confine::check_enterable(d).map_err(Error::Settings)?;
            c.read_only.push(d.clone());
        }
        worker_cfg.startup_timeout = opts.startup_timeout;
        worker_cfg.libpath = opts.libpath.clone();
        worker_cfg.libpath_after = opts.libpath_after.clone();
        match &opts.env {
            EnvPolicy::Inherit => worker_cfg.inherit_env = true,
            EnvPolicy::Names(n) => worker_cfg.env.extend(n.iter().cloned()),
            EnvPolicy::Minimal => {}
        }
        let mut shared = Shared::new(id.clone(), opts, working_dir, owns);
        if let Some(s) = Arc::get_mut(&mut shared) {
            s.store = self.inner.cfg.checkpoints.clone();
        }
        if let Some(reason) = resume {
            let mut i = lock(&shared.inner);
            // Known to exist, not read yet: the first call's worker reads
            // and loads it (see `start_worker`).
            i.checkpoint = Some(Manifest::default());
            i.restore_next = Some(reason.to_string());
            i.state = SessionState::Hibernated;
        }
        let source = PoolSource {
            pool: self.inner.pool.clone(),
            cfg: worker_cfg,
            registry: self.inner.registry.clone(),
            preloads: false,
            refill_hold: None,
        };
        let session = start_runner(shared, source)?;
        let mut sessions = lock(&self.inner.sessions);
        sessions.retain(|_, w| w.strong_count() > 0);
        sessions.insert(id, Arc::downgrade(&session.handle));
        Ok(session)
    }
    /// Looks up a live session by id.
    pub fn get(&self, id: &str) -> Option<Session> {
        lock(&self.inner.sessions)
            .get(id)
            .and_then(Weak::upgrade)
            .map(|handle| Session { handle })
    }

    /// Closes every session and kills every worker.
    pub fn shutdown(&self) {
        mark("supervisor.shutdown");
        self.inner.shut.store(true, Ordering::SeqCst);
        let sessions: Vec<_> = lock(&self.inner.sessions)
            .drain()
            .filter_map(|(_, w)| w.upgrade())
            .collect();
        for s in &sessions {
            close(&s.0);
        }
        self.inner.registry.kill_all();
        self.inner.pool.shutdown();
        mark("supervisor.shut");
    }

    /// A new private directory for the host's own files under the
    /// workers' temporary root, removed when dropped or, if this process
    /// is killed, by the next supervisor that starts on that root.
    pub fn scratch_dir(&self) -> Result<crate::ScratchDir, Error> {
        crate::ScratchDir::new(&self.inner.cfg.worker.temp_root)
    }

    /// Time since the supervisor was created.
    pub fn uptime(&self) -> Duration {
        self.inner.started.elapsed()
    }

    /// Runs `f` on the validation worker, starting (or replacing) it first.
    pub(crate) fn with_validator<T>(
        &self,
        f: impl Fn(&mut Worker) -> Result<T, ValidateError>,
    ) -> Result<T, ValidateError> {
        let mut slot = lock(&self.inner.validator);
        let mut last = String::from("the worker died during validation");
        for _ in 0..2 {
            if slot
                .as_mut()
                .is_none_or(|w| !w.is_alive() || w.link_closed())
            {
                *slot = Some(
                    self.inner
                        .pool
                        .acquire(&self.inner.cfg.worker)
                        .map_err(|e| ValidateError::NoWorker(e.to_string()))?,
                );
            }
            let Some(w) = slot.as_mut() else { continue };
            match f(w) {
                Ok(v) => return Ok(v),
                Err(e) if w.is_alive() && !w.link_closed() => return Err(e),
                // The worker died: once more with a new one.
                Err(e) => {
                    last = e.to_string();
                    *slot = None;
                }
            }
        }
        Err(ValidateError::NoWorker(last))
    }

    /// Where workers come from: zygote mode, spares, preloaded packages.
    pub fn pool_status(&self) -> crate::PoolStatus {
        self.inner.pool.status()
    }

    /// The pool (to wait until the zygote is ready, or find its pid).
    pub fn pool(&self) -> &Arc<crate::Pool> {
        &self.inner.pool
    }

    /// Runs `code` once in a fresh worker (a spare when one is ready) that is
    /// discarded afterwards, so nothing leaks from one run to the next.
    ///
    /// ```
    /// # let sup = rvisor::Supervisor::new(Default::default())?;
    /// let r = sup.run_once("x <- 1; x + 1", &rvisor::CallOptions::default());
    /// assert_eq!(r.console, "[1] 2\n");
    /// assert_eq!(sup.run_once("exists('x')", &Default::default()).console, "[1] FALSE\n");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn run_once(&self, code: &str, opts: &CallOptions) -> RunResult {
        self.run_once_with(ids::execution_id(), code, opts, &CallContext::default())
    }

    /// [`Supervisor::run_once`] with a chosen execution id and tools.
    pub fn run_once_with(
        &self,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
    ) -> RunResult {
        self.run_once_limited(execution_id, code, opts, ctx, None, None)
    }

    /// [`Supervisor::run_once_with`] in a worker with its own confinement
    /// limits and network access (`None`: the supervisor's). The worker is
    /// forked for this run (spares have the supervisor's limits).
    pub fn run_once_limited(
        &self,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
        limits: Option<&crate::Limits>,
        network: Option<bool>,
    ) -> RunResult {
        self.run_once_after(execution_id, code, opts, ctx, limits, network, None)
    }

    /// A one-shot run whose worker first runs `preamble` (seeding, a fixed
    /// time zone: `rvisor batch --seed`); the preamble's own result is not
    /// reported unless it fails, and then nothing else runs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_once_after(
        &self,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
        limits: Option<&crate::Limits>,
        network: Option<bool>,
        preamble: Option<&str>,
    ) -> RunResult {
        self.run_once_events(
            execution_id,
            code,
            opts,
            ctx,
            limits,
            network,
            preamble,
            None,
        )
    }

    /// [`Supervisor::run_once_limited`], handing the call's events to
    /// `events` while it runs (the result is the same as without).
    #[allow(clippy::too_many_arguments)]
    pub fn run_once_streaming(
        &self,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
        limits: Option<&crate::Limits>,
        network: Option<bool>,
        events: &EventSink,
    ) -> RunResult {
        self.run_once_events(
            execution_id,
            code,
            opts,
            ctx,
            limits,
            network,
            None,
            Some(events),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn run_once_events(
        &self,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
        limits: Option<&crate::Limits>,
        network: Option<bool>,
        preamble: Option<&str>,
        events: Option<&EventSink>,
    ) -> RunResult {
        self.run_once_inner(
            execution_id,
            code,
            opts,
            ctx,
            limits,
            network,
            preamble,
            events,
            None,
        )
    }

    /// A one-shot run with `files` around its call: `files.before` puts
    /// inputs in the worker's directory once it is up, `files.after` sees
    /// it (and the result) once the call ended, before the worker goes
    /// (docs/files.md). Unconfined, the call runs in the worker's own
    /// temporary directory, as a confined one does.
    #[allow(clippy::too_many_arguments)]
    pub fn run_once_with_files(
        &self,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
        limits: Option<&crate::Limits>,
        network: Option<bool>,
        events: Option<&EventSink>,
        files: &mut dyn crate::files::RunFiles,
    ) -> RunResult {
        self.run_once_inner(
            execution_id,
            code,
            opts,
            ctx,
            limits,
            network,
            None,
            events,
            Some(files),
        )
    }

    /// [`Supervisor::run_once_after`] with `files` around the call (a
    /// batch job's inputs and artifacts).
    pub(crate) fn run_once_after_with_files(
        &self,
        execution_id: String,
        code: &str,
        (opts, ctx): (&CallOptions, &CallContext),
        preamble: Option<&str>,
        files: &mut dyn crate::files::RunFiles,
    ) -> RunResult {
        self.run_once_inner(
            execution_id,
            code,
            opts,
            ctx,
            None,
            None,
            preamble,
            None,
            Some(files),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn run_once_inner(
        &self,
        execution_id: String,
        code: &str,
        opts: &CallOptions,
        ctx: &CallContext,
        limits: Option<&crate::Limits>,
        network: Option<bool>,
        preamble: Option<&str>,
        events: Option<&EventSink>,
        mut files: Option<&mut dyn crate::files::RunFiles>,
    ) -> RunResult {
        if let Err(e) = validate_call(code, opts) {
            return RunResult::failed(execution_id, code.into(), Outcome::Rejected, e.to_string());
        }
        let cancelled = |id: String| {
            RunResult::failed(
                id,
                code.into(),
                Outcome::Cancelled,
                "cancelled before it started".to_string(),
            )
        };
        if ctx.cancel.as_ref().is_some_and(CancelToken::is_cancelled) {
            return cancelled(execution_id);
        }
        let mut cfg = self.inner.cfg.worker.clone();
        if let Err(e) = cfg.apply_overrides(limits, network) {
            return RunResult::failed(execution_id, code.into(), Outcome::Rejected, e.to_string());
        }
        cfg.libpath_after
            .extend(ctx.libraries_after.iter().cloned());
        mark("run_once.acquire");
        let pool = &self.inner.pool;
        let preloads = pool.names_preload(code) || preamble.is_some_and(|p| pool.names_preload(p));
        let acquired = pool.acquire_holding(&cfg, preloads);
        mark("run_once.acquired");
        // The refill of a spare taken waits for the run to end (or the
        // pool's deadline): `_refill_hold` lives to the end of this call.
        let (mut worker, _refill_hold) = match acquired {
            Ok(held) => held,
            Err(e) => {
                let outcome = match e {
                    Error::StartupTimeout(_) => Outcome::StartupTimedOut,
                    _ => Outcome::StartupFailed,
                };
                return RunResult::failed(execution_id, code.into(), outcome, e.to_string());
            }
        };
        self.inner.registry.insert(&worker);
        // `ctx.cancel` is a state the worker's call loop reads: a cancel
        // that came while the worker started (or during the preamble)
        // means the call is not sent.
        let prepared = match preamble {
            None => Ok(()),
            Some(p) => {
                let pre_ctx = CallContext {
                    cancel: ctx.cancel.clone(),
                    ..CallContext::default()
                };
                let pre = worker.run_call(ids::execution_id(), p, opts, &pre_ctx);
                if pre.success {
                    Ok(())
                } else if pre.outcome == Outcome::Cancelled {
                    Err(cancelled(execution_id.clone()))
                } else {
                    let why = pre.error.map(|e| e.message).unwrap_or_default();
                    Err(RunResult::failed(
                        execution_id.clone(),
                        code.into(),
                        Outcome::StartupFailed,
                        format!("the preamble failed ({}): {why}", pre.outcome),
                    ))
                }
            }
        };
        // Files: the worker's directory, from the host (crate::files).
        let confined = cfg.confine.is_some();
        let dir = crate::files::WorkDir::new(if confined {
            crate::files::Place::Worker {
                pid: worker.pid(),
                dir: worker.temp_dir().to_path_buf(),
                generation: 1,
            }
        } else {
            crate::files::Place::Host(worker.temp_dir().to_path_buf())
        });
        let mut call_opts = std::borrow::Cow::Borrowed(opts);
        let prepared = match (prepared, files.as_mut()) {
            (Ok(()), Some(f)) => {
                if !confined && opts.working_dir.is_none() {
                    call_opts.to_mut().working_dir = Some(worker.temp_dir().to_path_buf());
                }
                f.before(&dir).map_err(|why| {
                    RunResult::failed(
                        execution_id.clone(),
                        code.into(),
                        Outcome::Rejected,
                        format!("the run's input files were refused: {why}; nothing ran"),
                    )
                })
            }
            (p, _) => p,
        };
        mark("run_once.call");
        let mut r = match prepared {
            Ok(()) => worker.run_call_with_events(execution_id, code, &call_opts, ctx, events),
            Err(r) => r,
        };
        if let Some(f) = files.as_mut() {
            f.after(&dir, &mut r);
        }
        mark("run_once.result");
        if let Some(t) = &ctx.cancel {
            t.clear();
        }
        self.inner.registry.remove(&worker);
        r.session.id = format!("run-{}", worker.pid());
        r.session.generation = 1;
        r.session.fresh = true;
        // A one-shot worker is never reused.
        worker.discard();
        r
    }

    /// Kills every worker and exits when the host gets SIGINT or SIGTERM
    /// (for hosts without signal handling of their own; call once). Behind
    /// the `ctrlc` feature: it ends the process, which a library host may
    /// not want.
    #[cfg(feature = "ctrlc")]
    pub fn cleanup_on_signals(&self) -> Result<(), Error> {
        let registry = self.inner.registry.clone();
        let pool = self.inner.pool.clone();
        ctrlc::set_handler(move || {
            registry.kill_all();
            pool.shutdown();
            std::process::exit(130);
        })
        .map_err(|e| Error::Invalid(format!("failed to install the signal handler: {e}")))
    }
}

impl Drop for SupShared {
    fn drop(&mut self) {
        for (_, w) in lock(&self.sessions).drain() {
            if let Some(s) = w.upgrade() {
                close(&s.0);
            }
        }
        self.registry.kill_all();
        self.pool.shutdown();
    }
}

/// Removes, in the background, the directories supervisors that were
/// killed left under `root` (their locks are no longer held:
/// [`crate::tempdir`]); a start does not wait for the deletion.
fn sweep_stale_dirs(root: &Path) {
    let root = root.to_path_buf();
    let _ = std::thread::Builder::new()
        .name("rvisor-sweep".into())
        .spawn(move || crate::tempdir::sweep(&root));
}
