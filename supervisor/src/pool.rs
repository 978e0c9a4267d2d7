//! Where workers come from: a zygote that forks them, a few pre-forked
//! spares so that a new session or a reset is a hand-over, and plain
//! spawning when the zygote is not (yet) there.
//!
//! A keeper thread owns the zygote: it starts it (off the request path),
//! restarts it if it dies, and keeps the spares topped up. It lives as long
//! as the pool, which matters: the zygote's parent-death signal fires when
//! the thread that spawned it ends.

use crate::error::Error;
use crate::process::WorkerConfig;
use crate::worker::Worker;
use crate::zygote::Zygote;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How workers are made.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Fork workers from a zygote (default true). Off: every worker is a
    /// fresh process that starts R (~100-300 ms).
    pub zygote: bool,
    /// Pre-forked spares kept ready (default 2).
    pub spares: usize,
    /// Packages the zygote loads before forking (None: ggplot2 when
    /// installed). Changing them needs a new zygote (a new supervisor).
    /// Workers are forked from a base zygote (R up, nothing loaded) as
    /// soon as R has started; a warm zygote forked from it loads these and
    /// warms the plot devices meanwhile, then takes over (the hand-over:
    /// no request waits for the preloads). `Some(vec![])`: no warm zygote
    /// and no plot warm-up at all, for one-shot commands.
    pub preload: Option<Vec<String>>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            zygote: true,
            spares: 2,
            preload: None,
        }
    }
}

/// Which way new workers are made right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum PoolMode {
    /// Forked from the zygote.
    Zygote,
    /// The zygote is starting; workers are spawned meanwhile.
    Starting,
    /// Spawned as fresh processes (zygote disabled, or down).
    Spawn,
}

/// The pool's state, for health reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PoolStatus {
    /// Which way workers are made now.
    pub mode: PoolMode,
    /// The zygote's process id, when it runs.
    pub zygote_pid: Option<u32>,
    /// Ready spares.
    pub spares: usize,
    /// Spares the pool aims to keep.
    pub spares_target: usize,
    /// Packages the zygote preloaded.
    pub preloaded: Vec<String>,
    /// Whether workers come from the warm zygote (preloads and plot
    /// warm-up done). False while only the base zygote serves, and for a
    /// pool without preloads.
    pub warm: bool,
    /// Zygote processes (base and warm) started so far.
    pub zygote_starts: u64,
    /// Where the zygotes' start-up went, milliseconds: `base.r_start`,
    /// `base.warm_up`, `base.seccomp`, `base.total`, then `warm.preload`,
    /// `warm.plots`, `warm.warm_up`, `warm.total` (from the base zygote's
    /// fork of it) once the warm zygote is up.
    pub startup_ms: std::collections::BTreeMap<String, f64>,
    /// Why the zygote last failed, if it did.
    pub last_error: Option<String>,
}

#[derive(Debug, Default)]
struct Inner {
    /// The zygote R starts in (a base zygote when a warm one is wanted).
    base: Option<Arc<Zygote>>,
    /// The warm zygote, forked from `base`; forks go to it once it is up.
    warm: Option<Arc<Zygote>>,
    /// A warm zygote is being made (on a thread of its own).
    warming: bool,
    /// The latest attempt at a warm zygote failed.
    warm_failed: bool,
    /// When to try for a warm zygote again after a failure.
    warm_retry_at: Option<std::time::Instant>,
    warm_backoff: Duration,
    spares: VecDeque<Worker>,
    starting: bool,
    starts: u64,
    /// Zygote starts that failed (not forks: those fail when it dies).
    start_failures: u64,
    /// The latest zygote start failed (the keeper retries with backoff).
    last_start_failed: bool,
    last_error: Option<String>,
}

/// Makes workers.
#[derive(Debug)]
pub struct Pool {
    base: WorkerConfig,
    cfg: PoolConfig,
    inner: Mutex<Inner>,
    cv: Condvar,
    shut: AtomicBool,
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    /// The zygote that forks now: the warm one when it is up, else the
    /// base one, if alive.
    fn current(&self) -> Option<Arc<Zygote>> {
        self.warm
            .clone()
            .filter(|z| z.is_alive())
            .or_else(|| self.base.clone().filter(|z| z.is_alive()))
    }
}

impl Pool {
    /// A pool making workers like `base`; starts the keeper thread when the
    /// zygote is enabled.
    pub fn new(base: WorkerConfig, cfg: PoolConfig) -> Result<Arc<Pool>, Error> {
        let pool = Arc::new(Pool {
            base,
            cfg,
            inner: Mutex::new(Inner::default()),
            cv: Condvar::new(),
            shut: AtomicBool::new(false),
        });
        if pool.cfg.zygote {
            lock(&pool.inner).starting = true;
            let weak = Arc::downgrade(&pool);
            std::thread::Builder::new()
                .name("rvisor-pool".into())
                .spawn(move || keeper(weak))
                .map_err(|source| Error::Io {
                    what: "start the pool thread",
                    source,
                })?;
        }
        Ok(pool)
    }

    /// Whether this pool makes a warm zygote after the base one.
    fn split(&self) -> bool {
        self.cfg.preload.as_ref().is_none_or(|p| !p.is_empty())
    }

    /// Whether a worker with `cfg` can come from the zygote: R's library
    /// path is fixed when R starts, so it must match the zygote's.
    fn zygote_compatible(&self, cfg: &WorkerConfig) -> bool {
        cfg.libpath == self.base.libpath && cfg.worker_bin == self.base.worker_bin
    }

    /// Whether a spare (forked with the base environment) fits `cfg`.
    fn spare_compatible(&self, cfg: &WorkerConfig) -> bool {
        self.zygote_compatible(cfg)
            && cfg.env == self.base.env
            && cfg.inherit_env == self.base.inherit_env
            && cfg.confine == self.base.confine
    }

    /// A live spare that fits `cfg`, if there is one (the keeper refills).
    fn take_spare(&self, cfg: &WorkerConfig) -> Option<Worker> {
        if !self.spare_compatible(cfg) {
            return None;
        }
        let spare = lock(&self.inner).spares.pop_front();
        self.cv.notify_all();
        let mut w = spare?;
        w.is_alive().then_some(w)
    }

    /// A ready worker for `cfg`: a spare if one fits, else forked from the
    /// zygote, else spawned.
    pub fn acquire(&self, cfg: &WorkerConfig) -> Result<Worker, Error> {
        if cfg.confine.is_some() {
            return self.acquire_confined(cfg);
        }
        if self.cfg.zygote && self.zygote_compatible(cfg) {
            if let Some(w) = self.take_spare(cfg) {
                return Ok(w);
            }
            let zygote = lock(&self.inner).current();
            if let Some(z) = zygote {
                if let Ok(w) = z.fork(cfg) {
                    return Ok(w);
                }
            }
        }
        Worker::spawn(cfg)
    }

    /// A confined worker: only the zygote makes them, so this waits for it
    /// to be up (within the start-up timeout) and reports why it is not.
    fn acquire_confined(&self, cfg: &WorkerConfig) -> Result<Worker, Error> {
        if !self.cfg.zygote || !self.zygote_compatible(cfg) {
            return Err(Error::Startup(
                "confined workers are forked by the zygote, and this worker's settings \
                 (library path or binary) differ from the zygote's"
                    .into(),
            ));
        }
        if let Some(w) = self.take_spare(cfg) {
            return Ok(w);
        }
        let end = std::time::Instant::now() + cfg.startup_timeout;
        // Waits for a live zygote; gives up when a start of one failed
        // after we began waiting (the keeper keeps retrying, with backoff),
        // or at the start-up deadline.
        let failures_before = lock(&self.inner).start_failures;
        loop {
            let mut i = lock(&self.inner);
            let zygote = loop {
                if let Some(z) = i.current() {
                    break z;
                }
                let now = std::time::Instant::now();
                let failed =
                    i.start_failures > failures_before || (!i.starting && i.last_start_failed);
                if failed || now >= end {
                    return Err(Error::Startup(format!(
                        "no zygote to fork a confined worker from: {}",
                        i.last_error
                            .as_deref()
                            .unwrap_or("it did not start in time")
                    )));
                }
                i = self
                    .cv
                    .wait_timeout(i, (end - now).min(Duration::from_millis(500)))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            };
            drop(i);
            match zygote.fork(cfg) {
                // The zygote died under us: wait for its successor.
                Err(_) if !zygote.is_alive() && std::time::Instant::now() < end => {
                    self.cv.notify_all();
                    continue;
                }
                other => return other,
            }
        }
    }

    /// The pool's state.
    pub fn status(&self) -> PoolStatus {
        let i = lock(&self.inner);
        let live = i.current();
        let live = live.as_ref();
        let mut startup_ms = std::collections::BTreeMap::new();
        for (stage, z) in [("base", &i.base), ("warm", &i.warm)] {
            if let Some(z) = z.as_ref().filter(|z| z.is_alive()) {
                for (phase, ms) in &z.hello().phases_ms {
                    *startup_ms.entry(format!("{stage}.{phase}")).or_insert(0.0) += ms;
                }
                startup_ms.insert(format!("{stage}.total"), z.hello().startup_ms);
            }
        }
        PoolStatus {
            mode: match (&live, i.starting) {
                (Some(_), _) => PoolMode::Zygote,
                (None, true) => PoolMode::Starting,
                (None, false) => PoolMode::Spawn,
            },
            zygote_pid: live.map(|z| z.pid()),
            spares: i.spares.len(),
            spares_target: if self.cfg.zygote { self.cfg.spares } else { 0 },
            preloaded: live
                .map(|z| z.hello().preloaded.clone())
                .unwrap_or_default(),
            warm: live.is_some_and(|z| z.is_warm()),
            zygote_starts: i.starts,
            startup_ms,
            last_error: i.last_error.clone(),
        }
    }

    /// Waits until the zygote is up (or failed), with its preloads (the
    /// warm zygote, or its failure) and the spares, at most `timeout`;
    /// returns whether it is up. For tests and benchmarks that want the
    /// fast path.
    pub fn wait_ready(&self, timeout: Duration) -> bool {
        let end = std::time::Instant::now() + timeout;
        let mut i = lock(&self.inner);
        loop {
            let current = i.current();
            let up = current.is_some();
            let warm_done = !self.split()
                || current.as_ref().is_some_and(|z| z.is_warm())
                || (i.warm_failed && !i.warming);
            let full = i.spares.len() >= self.cfg.spares;
            if (up && full && warm_done) || (!i.starting && !up) {
                return up;
            }
            let now = std::time::Instant::now();
            if now >= end {
                return up;
            }
            i = self
                .cv
                .wait_timeout(i, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Stops the keeper, kills the zygote and the spares.
    pub fn shutdown(&self) {
        self.shut.store(true, Ordering::SeqCst);
        let (base, warm, spares) = {
            let mut i = lock(&self.inner);
            (i.base.take(), i.warm.take(), std::mem::take(&mut i.spares))
        };
        drop(spares);
        for z in [warm, base].into_iter().flatten() {
            z.kill();
        }
        self.cv.notify_all();
    }

    /// The process id of the zygote that forks now (the warm one once it
    /// is up), for tests that kill it.
    pub fn zygote_pid(&self) -> Option<u32> {
        lock(&self.inner).current().map(|z| z.pid())
    }

    /// The process id of the base zygote (the one R started in; the warm
    /// zygote and every worker die with it).
    pub fn base_zygote_pid(&self) -> Option<u32> {
        lock(&self.inner)
            .base
            .as_ref()
            .filter(|z| z.is_alive())
            .map(|z| z.pid())
    }

    /// Wakes the keeper (the zygote died, a spare was taken).
    pub(crate) fn poke(&self) {
        self.cv.notify_all();
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The keeper thread: (re)starts the zygote, asks it for a warm zygote
/// (when the pool preloads), and keeps spares ready.
fn keeper(pool: std::sync::Weak<Pool>) {
    let mut backoff = Duration::from_millis(250);
    loop {
        let Some(p) = pool.upgrade() else { return };
        if p.shut.load(Ordering::SeqCst) {
            return;
        }
        let base = lock(&p.inner).base.clone().filter(|z| z.is_alive());
        if base.is_none() {
            let old = {
                let mut i = lock(&p.inner);
                i.starting = true;
                // Children of a dead zygote are dead too; so is a warm
                // zygote whose base died.
                (i.base.take(), i.warm.take(), std::mem::take(&mut i.spares))
            };
            drop(old);
            p.cv.notify_all();
            let poke = {
                let weak = pool.clone();
                move || {
                    if let Some(p) = weak.upgrade() {
                        p.poke();
                    }
                }
            };
            // A base zygote either way: the warm one (if the pool preloads)
            // is forked from it below.
            let started = Zygote::start_base(&p.base, poke);
            let mut i = lock(&p.inner);
            i.starting = false;
            match started {
                Ok(z) => {
                    i.base = Some(Arc::new(z));
                    i.starts += 1;
                    i.last_error = None;
                    i.last_start_failed = false;
                    i.warm_failed = false;
                    i.warm_retry_at = None;
                    i.warm_backoff = Duration::from_millis(250);
                    backoff = Duration::from_millis(250);
                    drop(i);
                    p.cv.notify_all();
                }
                Err(e) => {
                    i.last_error = Some(e.to_string());
                    i.start_failures += 1;
                    i.last_start_failed = true;
                    drop(i);
                    p.cv.notify_all();
                    let wait = backoff;
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                    let i = lock(&p.inner);
                    let _ = p.cv.wait_timeout(i, wait);
                }
            }
            continue;
        }
        let base = base.expect("checked above");
        if p.split() {
            start_warming(&p, &pool, &base);
        }
        // Top up the spares, one fork at a time, outside the lock.
        let zygote = {
            let i = lock(&p.inner);
            (i.spares.len() < p.cfg.spares)
                .then(|| i.current())
                .flatten()
        };
        if let Some(zygote) = zygote.filter(|_| !p.shut.load(Ordering::SeqCst)) {
            match zygote.fork(&p.base) {
                Ok(w) => {
                    let mut i = lock(&p.inner);
                    // A spare of a base zygote that was replaced by a warm
                    // one meanwhile would lack the preloads: drop it.
                    if i.current().is_some_and(|z| Arc::ptr_eq(&z, &zygote)) {
                        i.spares.push_back(w);
                    } else {
                        drop(i);
                        drop(w);
                    }
                    p.cv.notify_all();
                }
                Err(e) => {
                    lock(&p.inner).last_error = Some(e.to_string());
                    let i = lock(&p.inner);
                    let _ = p.cv.wait_timeout(i, Duration::from_millis(250));
                }
            }
            continue;
        }
        // Sleep until a spare is taken, a zygote comes or goes, a warm-up
        // retry is due, or shutdown. The timeout is a safety net only; the
        // events above notify.
        let i = lock(&p.inner);
        let wait = i
            .warm_retry_at
            .map(|t| t.saturating_duration_since(std::time::Instant::now()))
            .unwrap_or(Duration::from_secs(5))
            .clamp(Duration::from_millis(10), Duration::from_secs(5));
        let _ = p.cv.wait_timeout(i, wait);
    }
}

/// Starts making a warm zygote from `base` on a thread of its own, unless
/// one is up, being made, or a retry after a failure is not due yet. When
/// it is up it takes over the forking and the spares of the base zygote
/// are replaced.
fn start_warming(p: &Arc<Pool>, pool: &std::sync::Weak<Pool>, base: &Arc<Zygote>) {
    let mut i = lock(&p.inner);
    if i.warming || i.warm.as_ref().is_some_and(|z| z.is_alive()) {
        return;
    }
    if i.warm_retry_at
        .is_some_and(|t| std::time::Instant::now() < t)
    {
        return;
    }
    // A warm zygote that died left dead spares behind.
    let dead = i.warm.take().map(|_| std::mem::take(&mut i.spares));
    i.warming = true;
    drop(i);
    drop(dead);
    let (weak, base) = (pool.clone(), base.clone());
    let spawned = std::thread::Builder::new()
        .name("rvisor-warm-zygote".into())
        .spawn(move || {
            let Some(p) = weak.upgrade() else { return };
            let cfg = p.base.clone();
            let preload = p.cfg.preload.clone();
            drop(p);
            let poke = {
                let weak = weak.clone();
                move || {
                    if let Some(p) = weak.upgrade() {
                        p.poke();
                    }
                }
            };
            let made = base.warm(&cfg, preload.as_deref(), true, poke);
            let Some(p) = weak.upgrade() else { return };
            let mut i = lock(&p.inner);
            i.warming = false;
            let same_base = i.base.as_ref().is_some_and(|b| Arc::ptr_eq(b, &base));
            let old_spares = match made {
                Ok(w) if same_base && base.is_alive() => {
                    i.warm = Some(Arc::new(w));
                    i.starts += 1;
                    i.warm_failed = false;
                    i.warm_retry_at = None;
                    i.warm_backoff = Duration::from_millis(250);
                    std::mem::take(&mut i.spares)
                }
                Ok(_) => VecDeque::new(), // its base was replaced: it dies with it
                Err(e) => {
                    i.last_error = Some(format!("warm zygote: {e}"));
                    i.warm_failed = true;
                    let wait = i.warm_backoff.max(Duration::from_millis(250));
                    i.warm_retry_at = Some(std::time::Instant::now() + wait);
                    i.warm_backoff = (wait * 2).min(Duration::from_secs(30));
                    VecDeque::new()
                }
            };
            drop(i);
            drop(old_spares);
            p.cv.notify_all();
        });
    if spawned.is_err() {
        let mut i = lock(&p.inner);
        i.warming = false;
        i.warm_failed = true;
        i.warm_retry_at = Some(std::time::Instant::now() + Duration::from_secs(1));
    }
}
