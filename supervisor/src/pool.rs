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
    /// Times the zygote was (re)started.
    pub zygote_starts: u64,
    /// Why the zygote last failed, if it did.
    pub last_error: Option<String>,
}

#[derive(Debug, Default)]
struct Inner {
    zygote: Option<Arc<Zygote>>,
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
            let zygote = lock(&self.inner).zygote.clone();
            if let Some(z) = zygote.filter(|z| z.is_alive()) {
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
                if let Some(z) = i.zygote.clone().filter(|z| z.is_alive()) {
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
        let live = i.zygote.as_ref().filter(|z| z.is_alive());
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
            zygote_starts: i.starts,
            last_error: i.last_error.clone(),
        }
    }

    /// Waits until the zygote is up (or failed), at most `timeout`; returns
    /// whether it is up. For tests and benchmarks that want the fast path.
    pub fn wait_ready(&self, timeout: Duration) -> bool {
        let end = std::time::Instant::now() + timeout;
        let mut i = lock(&self.inner);
        loop {
            let up = i.zygote.as_ref().is_some_and(|z| z.is_alive());
            let full = i.spares.len() >= self.cfg.spares;
            if (up && full) || (!i.starting && !up) {
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
        let (z, spares) = {
            let mut i = lock(&self.inner);
            (i.zygote.take(), std::mem::take(&mut i.spares))
        };
        drop(spares);
        if let Some(z) = z {
            z.kill();
        }
        self.cv.notify_all();
    }

    /// The process id of the zygote, for tests that kill it.
    pub fn zygote_pid(&self) -> Option<u32> {
        lock(&self.inner).zygote.as_ref().map(|z| z.pid())
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

/// The keeper thread: (re)starts the zygote and keeps spares ready.
fn keeper(pool: std::sync::Weak<Pool>) {
    let mut backoff = Duration::from_millis(250);
    loop {
        let Some(p) = pool.upgrade() else { return };
        if p.shut.load(Ordering::SeqCst) {
            return;
        }
        let zygote = lock(&p.inner).zygote.clone().filter(|z| z.is_alive());
        let zygote = match zygote {
            Some(z) => z,
            None => {
                {
                    let mut i = lock(&p.inner);
                    i.starting = true;
                    i.zygote = None;
                    i.spares.clear(); // children of a dead zygote are dead too
                }
                p.cv.notify_all();
                let started = Zygote::start(&p.base, p.cfg.preload.as_deref(), {
                    let weak = pool.clone();
                    move || {
                        if let Some(p) = weak.upgrade() {
                            p.poke();
                        }
                    }
                });
                let mut i = lock(&p.inner);
                i.starting = false;
                match started {
                    Ok(z) => {
                        let z = Arc::new(z);
                        i.zygote = Some(z.clone());
                        i.starts += 1;
                        i.last_error = None;
                        i.last_start_failed = false;
                        backoff = Duration::from_millis(250);
                        drop(i);
                        p.cv.notify_all();
                        z
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
                        continue;
                    }
                }
            }
        };
        // Top up the spares, one fork at a time, outside the lock.
        let need = {
            let i = lock(&p.inner);
            i.spares.len() < p.cfg.spares
        };
        if need && !p.shut.load(Ordering::SeqCst) {
            match zygote.fork(&p.base) {
                Ok(w) => {
                    lock(&p.inner).spares.push_back(w);
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
        // Sleep until a spare is taken, the zygote dies, or shutdown. The
        // timeout is a safety net only; the events above notify.
        let i = lock(&p.inner);
        let _ = p.cv.wait_timeout(i, Duration::from_secs(5));
    }
}
