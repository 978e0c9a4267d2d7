//! Where workers come from: a zygote that forks them, a few pre-forked
//! spares so that a new session or a reset is a hand-over, and plain
//! spawning when the zygote is not (yet) there.
//!
//! Three zygotes, each forked from the one before: the *base* zygote (R
//! up, nothing else: it serves within R's start-up time), the *warm* one
//! (the driver, validation, conditions and base graphics warmed up, no
//! package loaded) and the *preloaded* one (the warm one plus the preloads,
//! ggplot2 by default, and their plots warmed up). Code that names a
//! preloaded package gets a worker of the preloaded zygote; other code one
//! of the warm zygote, whose heap is a third of the size: a full `gc()`
//! writes to every R object of the heap a worker was forked with, which
//! makes those pages the worker's own (docs/process-model.md, "Memory").
//!
//! A keeper thread owns the zygote: it starts it (off the request path),
//! restarts it if it dies, and keeps the spares topped up. It lives as long
//! as the pool, which matters: the zygote's parent-death signal fires when
//! the thread that spawned it ends.

use crate::burst::Burst;
use crate::error::Error;
use crate::process::WorkerConfig;
use crate::worker::Worker;
use crate::zygote::Zygote;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How workers are made.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Fork workers from a zygote (default true). Off: every worker is a
    /// fresh process that starts R (~100-300 ms).
    pub zygote: bool,
    /// Pre-forked spares kept ready of each zygote (default 4: a burst of
    /// new sessions is handed spares while the keeper forks more; a spare
    /// costs ~1-2 MB until its session's first collection).
    pub spares: usize,
    /// The most spares a zygote's stage keeps when bursts of new sessions
    /// found none ready (default 16): such a miss raises the number kept
    /// to the asks of its burst so far, for `spares_raised_for` after the
    /// last miss (burst.rs). At or below `spares`: always `spares`.
    pub spares_max: usize,
    /// How long spares raised by a burst's misses are kept after the last
    /// miss (default ten minutes); then the keeper ends those beyond
    /// `spares`.
    pub spares_raised_for: Duration,
    /// Packages the preloaded zygote loads (None: ggplot2 when installed).
    /// Changing them needs a new zygote (a new supervisor). Workers are
    /// forked from a base zygote (R up, nothing loaded) as soon as R has
    /// started; a warm zygote forked from it warms the driver and the plot
    /// devices meanwhile and then takes over (the hand-over: no request
    /// waits for it), and a preloaded zygote forked from the warm one
    /// loads these. A session whose call names one of them (`ggplot2::`,
    /// `library(ggplot2)`) before it has a worker, or any call of it once
    /// one did, and a one-shot run whose code names one, get workers of
    /// the preloaded zygote ([`Pool::names_preload`]); others get workers
    /// without them, which load a package on first use as R does.
    /// `Some(vec![])`: no warm zygote and no plot warm-up at all, for
    /// one-shot commands.
    pub preload: Option<Vec<String>>,
    /// Make the preloaded zygote only once a call names a preload (default
    /// false: as soon as the warm zygote is up). Until it is up, such
    /// calls get workers of the warm zygote, which load the package
    /// themselves as R does. A server whose sessions never use the
    /// preloads then does not hold the preloaded zygote and its spares
    /// (~100 MB; docs/process-model.md, "Memory").
    pub preload_on_first_use: bool,
    /// How long at most the keeper holds back refilling a spare that a
    /// session took while another spare was still ready, waiting for the
    /// session's first call in it to end: on a machine with few cores the
    /// refill's fork competes with that call. An empty pool refills at
    /// once, and so does one whose holds all ended. Default 500 ms
    /// (docs/process-model.md, "The refill after a hand-over"); zero: no
    /// hold, every spare refilled at once.
    pub refill_hold: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            zygote: true,
            spares: 4,
            spares_max: 16,
            spares_raised_for: crate::burst::REMEMBER,
            preload: None,
            preload_on_first_use: false,
            refill_hold: DEFAULT_REFILL_HOLD,
        }
    }
}

/// [`PoolConfig::refill_hold`]'s default.
pub const DEFAULT_REFILL_HOLD: Duration = Duration::from_millis(500);

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
    /// The process id of the zygote that forks workers without preloads
    /// (the warm one once it is up, else the base one), when it runs.
    pub zygote_pid: Option<u32>,
    /// Ready spares without preloads.
    pub spares: usize,
    /// Spares the pool aims to keep without preloads: `PoolConfig::spares`,
    /// raised while bursts of new sessions found none ready (burst.rs).
    pub spares_target: usize,
    /// Packages the preloaded zygote loaded (empty until it is up).
    pub preloaded: Vec<String>,
    /// The preloaded zygote's process id, once it is up.
    #[serde(default)]
    pub preloaded_zygote_pid: Option<u32>,
    /// Ready spares of the preloaded zygote.
    #[serde(default)]
    pub preloaded_spares: usize,
    /// Spares the pool aims to keep of the preloaded zygote once it is up
    /// (as `spares_target`).
    #[serde(default)]
    pub preloaded_spares_target: usize,
    /// The process ids of the ready spares forked with the libraries of
    /// the workers asked for lately (a tenant's library; at most
    /// [`RECENT_LIBRARIES`]).
    #[serde(default)]
    pub library_spare_pids: Vec<u32>,
    /// The preloaded zygote is not made because no call has named a
    /// preload yet ([`PoolConfig::preload_on_first_use`]).
    #[serde(default)]
    pub preload_awaits_first_use: bool,
    /// Spares taken whose refill waits for the first call in them to end
    /// (at most [`PoolConfig::refill_hold`]), while another spare is
    /// ready.
    #[serde(default)]
    pub refills_held: usize,
    /// Whether workers come from the warm zygote (driver and plot warm-up
    /// done). False while only the base zygote serves, and for a pool
    /// without preloads.
    pub warm: bool,
    /// Zygote processes (base and warm) started so far.
    pub zygote_starts: u64,
    /// Where the zygotes' start-up went, milliseconds: `base.r_start`,
    /// `base.warm_up`, `base.seccomp`, `base.total`, then `warm.plots`,
    /// `warm.warm_up`, `warm.total` (from the base zygote's fork of it)
    /// once the warm zygote is up, and `preloaded.preload`,
    /// `preloaded.plots`, `preloaded.warm_up`, `preloaded.total` (from the
    /// warm zygote's fork of it) once the preloaded one is.
    pub startup_ms: std::collections::BTreeMap<String, f64>,
    /// Why the zygote last failed, if it did.
    pub last_error: Option<String>,
}

/// A zygote forked from another on request (the warm one from the base,
/// the preloaded one from the warm), and the attempts at making it.
#[derive(Debug, Default)]
struct Stage {
    zygote: Option<Arc<Zygote>>,
    /// It is being made (on a thread of its own).
    making: bool,
    /// The latest attempt failed.
    failed: bool,
    /// When to try again after a failure.
    retry_at: Option<std::time::Instant>,
    backoff: Duration,
    /// Ready workers it forked.
    spares: VecDeque<Worker>,
    /// The asks that found no spare ready lately, which raise how many
    /// it keeps.
    burst: Burst,
}

impl Stage {
    fn live(&self) -> Option<Arc<Zygote>> {
        self.zygote.clone().filter(|z| z.is_alive())
    }

    /// Forgets the zygote and its spares (it died, or its parent did), and
    /// allows a new attempt at once; returns them to be dropped outside
    /// the lock.
    fn clear(&mut self) -> (Option<Arc<Zygote>>, VecDeque<Worker>) {
        self.burst.reset();
        self.failed = false;
        self.retry_at = None;
        self.backoff = Duration::from_millis(250);
        (self.zygote.take(), std::mem::take(&mut self.spares))
    }
}

/// Which of the forked zygotes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    Warm,
    Preloaded,
}

#[derive(Debug, Default)]
struct Inner {
    /// The zygote R starts in (a base zygote when a warm one is wanted).
    base: Option<Arc<Zygote>>,
    /// The warm zygote, forked from `base`; forks without preloads go to
    /// it once it is up. Its spares are those of the base zygote until
    /// then.
    warm: Stage,
    /// The preloaded zygote, forked from the warm one; forks with preloads
    /// go to it once it is up.
    preloaded: Stage,
    /// The preloaded zygote loaded none of the packages (none is
    /// installed): it is not kept, and its forks are the warm one's.
    nothing_to_preload: bool,
    /// A call named a preload (with `preload_on_first_use`, the preloaded
    /// zygote is made only then).
    preload_wanted: bool,
    starting: bool,
    starts: u64,
    /// Zygote starts that failed (not forks: those fail when it dies).
    start_failures: u64,
    /// The latest zygote start failed (the keeper retries with backoff).
    last_start_failed: bool,
    last_error: Option<String>,
    /// The libraries-after of the latest workers asked for with them (a
    /// tenant's library, docs/packages.md), most recent first, at most
    /// [`RECENT_LIBRARIES`], each with a spare forked with them (by the
    /// zygote it names) once the keeper made it.
    library_spares: VecDeque<LibrarySpare>,
    /// The refills held back (by [`RefillHold`]s): their ids and
    /// deadlines.
    holds: Vec<(u64, std::time::Instant)>,
    /// The latest ask for a spare: the keeper refills a stage that still
    /// has one only [`crate::burst::QUIET`] after it, when a burst is over.
    last_ask: Option<std::time::Instant>,
    /// Workers being ended that wait for the burst to pass
    /// ([`Pool::after_burst`]), and the memory of their own they hold.
    ending_after_burst: usize,
    ending_bytes: u64,
    next_hold: u64,
    /// When the base zygote was asked to retire ([`settle`]).
    settle_since: Option<std::time::Instant>,
}

/// A worker, with the hold on its refill when it was a spare taken while
/// another was ready.
pub(crate) type Held = (Worker, Option<RefillHold>);

/// Longest a worker being ended waits for a burst of new sessions to pass
/// ([`Pool::after_burst`]).
pub(crate) const ENDING_WAIT: Duration = Duration::from_millis(250);

/// Most workers being ended that wait for a burst to pass at once
/// ([`Pool::after_burst`]): the pool's default `spares_max`.
pub(crate) const ENDING_WAITS: usize = 16;

/// Most memory of their own (resident, less what is shared with a file or
/// the zygote's heap image) the workers waiting for a burst to pass hold
/// together ([`Pool::after_burst`]); a worker with more is ended at once.
pub(crate) const ENDING_BYTES: u64 = 256 << 20;

/// Resident memory of process `pid` less its file-backed and shared pages
/// (`/proc/PID/statm`), bytes: what its end gives back.
fn own_memory_bytes(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let mut f = statm.split_whitespace().skip(1).map(|v| v.parse::<u64>());
    let (resident, shared) = (f.next()?.ok()?, f.next()?.ok()?);
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(resident.saturating_sub(shared) * u64::try_from(page).ok()?)
}

/// Libraries-after that get a spare of their own (a tenant's sessions
/// come one after another: the next one is a hand-over, not a fork).
pub const RECENT_LIBRARIES: usize = 4;

#[derive(Debug)]
struct LibrarySpare {
    libraries: Vec<PathBuf>,
    spare: Option<(Arc<Zygote>, Worker)>,
}

/// A refill the keeper holds back: a spare was taken while another was
/// ready, and its replacement waits until the first call in it has ended
/// (this is dropped then, or with the worker) or the pool's
/// [`PoolConfig::refill_hold`] has passed, so that the fork does not
/// compete with that call for the CPU.
#[derive(Debug)]
pub(crate) struct RefillHold {
    pool: std::sync::Weak<Pool>,
    id: u64,
}

impl Drop for RefillHold {
    fn drop(&mut self) {
        if let Some(p) = self.pool.upgrade() {
            lock(&p.inner).holds.retain(|(id, _)| *id != self.id);
            p.cv.notify_all();
        }
    }
}

/// Makes workers.
#[derive(Debug)]
pub struct Pool {
    /// Itself, for the [`RefillHold`]s it hands out.
    me: std::sync::Weak<Pool>,
    base: WorkerConfig,
    cfg: PoolConfig,
    inner: Mutex<Inner>,
    cv: Condvar,
    shut: AtomicBool,
    /// The keeper thread while it runs: [`Pool::shutdown`] waits for it,
    /// so a spare it was forking is dropped (its directory removed) before
    /// the process exits, rather than left in the temporary directory.
    keeper: Arc<(Mutex<Option<std::thread::ThreadId>>, Condvar)>,
}

/// A lock of any of the pool's mutexes, a poisoned one taken as it is.
fn lock_any<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn lock(m: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    /// When the current burst of asks for spares is over: [`crate::burst::QUIET`]
    /// after the latest ask (`None`: nothing was asked).
    fn quiet_at(&self) -> Option<std::time::Instant> {
        self.last_ask.map(|t| t + crate::burst::QUIET)
    }

    /// Whether no spare was asked for in the last [`crate::burst::QUIET`]
    /// before `now`: the keeper refills, and closed sessions' workers end.
    fn quiet(&self, now: std::time::Instant) -> bool {
        self.quiet_at().is_none_or(|t| now >= t)
    }

    /// The zygote that forks workers without preloads now: the warm one
    /// when it is up, else the base one, if alive and not retired.
    fn current(&self) -> Option<Arc<Zygote>> {
        self.warm.live().or_else(|| {
            self.base
                .clone()
                .filter(|z| z.is_alive() && !z.is_retiring())
        })
    }

    /// The base zygote, unless it is dead, or retired while no warm zygote
    /// is up or being made (then a new one has to be started).
    fn usable_base(&self) -> Option<Arc<Zygote>> {
        let warm_gone = !self.warm.making && self.warm.live().is_none();
        self.base
            .clone()
            .filter(|z| z.is_alive() && !(z.is_retiring() && warm_gone))
    }

    /// Whether a refill is held back now ([`RefillHold`]); forgets the
    /// holds whose deadline passed.
    fn holding(&mut self, now: std::time::Instant) -> bool {
        self.holds.retain(|(_, end)| *end > now);
        !self.holds.is_empty()
    }

    fn stage(&mut self, which: Which) -> &mut Stage {
        match which {
            Which::Warm => &mut self.warm,
            Which::Preloaded => &mut self.preloaded,
        }
    }
}

impl Pool {
    /// A pool making workers like `base`; starts the keeper thread when the
    /// zygote is enabled.
    pub fn new(base: WorkerConfig, cfg: PoolConfig) -> Result<Arc<Pool>, Error> {
        let mut inner = Inner::default();
        inner.warm.burst = Burst::new(cfg.spares_raised_for);
        inner.preloaded.burst = Burst::new(cfg.spares_raised_for);
        let pool = Arc::new_cyclic(|me| Pool {
            me: me.clone(),
            base,
            cfg,
            inner: Mutex::new(inner),
            cv: Condvar::new(),
            shut: AtomicBool::new(false),
            keeper: Arc::new((Mutex::new(None), Condvar::new())),
        });
        if pool.cfg.zygote {
            lock(&pool.inner).starting = true;
            let weak = Arc::downgrade(&pool);
            let alive = pool.keeper.clone();
            let mut running = lock_any(&alive.0);
            let spawned = std::thread::Builder::new()
                .name("rvisor-pool".into())
                .spawn({
                    let alive = alive.clone();
                    move || {
                        let _gone = KeeperGone(alive);
                        keeper(weak)
                    }
                })
                .map_err(|source| Error::Io {
                    what: "start the pool thread",
                    source,
                })?;
            *running = Some(spawned.thread().id());
        }
        Ok(pool)
    }

    /// Whether this pool makes a warm zygote after the base one (and a
    /// preloaded one after that).
    fn split(&self) -> bool {
        self.cfg.preload.as_ref().is_none_or(|p| !p.is_empty())
    }

    /// Whether `code` names a package the preloaded zygote loads (as a
    /// whole word: `ggplot2::ggplot`, `library(ggplot2)`,
    /// `requireNamespace("ggplot2")`), so that it should run in a worker
    /// of that zygote. Code that reaches the package without naming it
    /// (another package that imports it) loads it in its worker, as R
    /// does.
    pub fn names_preload(&self, code: &str) -> bool {
        self.split()
            && self
                .cfg
                .preload
                .as_deref()
                .unwrap_or(&[])
                .iter()
                .map(String::as_str)
                .chain(self.cfg.preload.is_none().then_some(DEFAULT_PRELOAD))
                .any(|p| names_package(code, p))
    }

    /// Whether a worker with `cfg` can come from the zygote: R's library
    /// path is fixed when R starts, so it must match the zygote's.
    fn zygote_compatible(&self, cfg: &WorkerConfig) -> bool {
        cfg.libpath == self.base.libpath && cfg.worker_bin == self.base.worker_bin
    }

    /// Whether a spare (forked with the base environment) fits `cfg`.
    fn spare_compatible(&self, cfg: &WorkerConfig) -> bool {
        self.library_spare_compatible(cfg) && cfg.libpath_after == self.base.libpath_after
    }

    /// Whether a spare forked with the base environment and `cfg`'s
    /// libraries-after fits `cfg`.
    fn library_spare_compatible(&self, cfg: &WorkerConfig) -> bool {
        self.zygote_compatible(cfg)
            && cfg.env == self.base.env
            && cfg.inherit_env == self.base.inherit_env
            && cfg.confine == self.base.confine
    }

    /// The spare of `cfg`'s libraries-after, if the keeper has one ready
    /// (of the zygote that forks now); either way they become the most
    /// recent, so the keeper makes (or remakes) their spare.
    fn take_library_spare(&self, cfg: &WorkerConfig) -> Option<Held> {
        if !self.cfg.zygote
            || cfg.libpath_after.is_empty()
            || cfg.libpath_after == self.base.libpath_after
            || !self.library_spare_compatible(cfg)
        {
            return None;
        }
        let (taken, dropped) = {
            let mut i = lock(&self.inner);
            let current = i.current();
            let at = i
                .library_spares
                .iter()
                .position(|l| l.libraries == cfg.libpath_after);
            let mut entry = match at.and_then(|at| i.library_spares.remove(at)) {
                Some(e) => e,
                None => LibrarySpare {
                    libraries: cfg.libpath_after.clone(),
                    spare: None,
                },
            };
            let taken = entry.spare.take().and_then(|(z, w)| {
                current
                    .as_ref()
                    .is_some_and(|c| Arc::ptr_eq(c, &z))
                    .then_some(w)
            });
            i.library_spares.push_front(entry);
            let dropped: Vec<LibrarySpare> = if i.library_spares.len() > RECENT_LIBRARIES {
                i.library_spares.drain(RECENT_LIBRARIES..).collect()
            } else {
                Vec::new()
            };
            (taken, dropped)
        };
        drop(dropped);
        self.cv.notify_all();
        let mut w = taken?;
        w.is_alive().then_some((w, None))
    }

    /// How many spares `stage` keeps now: the pool's `spares`, raised by
    /// the misses of late bursts (burst.rs).
    fn target(&self, stage: &Stage, now: std::time::Instant) -> usize {
        stage
            .burst
            .target(now, self.cfg.spares, self.cfg.spares_max)
    }

    /// A live spare that fits `cfg`, if there is one (the keeper refills):
    /// with `preloads`, one of the preloaded zygote (none while it is not
    /// up), else one without preloads. When another spare of its kind is
    /// still ready, the refill is held back until the hold is dropped (at
    /// the end of the first call in the spare) or its deadline passes.
    fn take_spare(&self, cfg: &WorkerConfig, preloads: bool) -> Option<Held> {
        if !self.spare_compatible(cfg) {
            return None;
        }
        let (spare, hold) = {
            let mut i = lock(&self.inner);
            let now = std::time::Instant::now();
            i.last_ask = Some(now);
            // Asks while the stage's zygote serves count: one that finds
            // no spare ready raises how many are kept (burst.rs).
            let serves = if preloads {
                i.preloaded.live().is_some()
            } else {
                i.current().is_some()
            };
            let stage = if preloads {
                &mut i.preloaded
            } else {
                &mut i.warm
            };
            let spare = stage.spares.pop_front();
            let others = !stage.spares.is_empty();
            if serves && self.cfg.spares > 0 {
                let hit = spare.is_some();
                stage
                    .burst
                    .ask(now, hit, self.cfg.spares, self.cfg.spares_max);
            }
            let hold = (spare.is_some() && others && !self.cfg.refill_hold.is_zero()).then(|| {
                let id = i.next_hold;
                i.next_hold += 1;
                i.holds
                    .push((id, std::time::Instant::now() + self.cfg.refill_hold));
                RefillHold {
                    pool: self.me.clone(),
                    id,
                }
            });
            (spare, hold)
        };
        self.cv.notify_all();
        let mut w = spare?;
        w.is_alive().then_some((w, hold))
    }

    /// Waits, for worker `pid` about to be ended (its session closed),
    /// until no spare was asked for in the last [`crate::burst::QUIET`]:
    /// at most [`ENDING_WAIT`], and only while fewer than
    /// [`ENDING_WAITS`] workers, holding at most [`ENDING_BYTES`] of
    /// memory of their own together, wait so (others are ended at once).
    /// A worker's end tears down its memory, ~2 ms of a core; in a burst
    /// of new sessions on a machine with few cores that took a core from
    /// the sessions starting, and a session handed a ready spare waited
    /// for it (docs/process-model.md, "Spares that follow the bursts").
    /// The worker is idle meanwhile (its session's calls have ended), and
    /// stays known to the supervisor, which kills it if the process ends
    /// first. Returns whether it waited.
    pub(crate) fn after_burst(&self, pid: u32) -> bool {
        let end = std::time::Instant::now() + ENDING_WAIT;
        let mut i = lock(&self.inner);
        if i.quiet(std::time::Instant::now()) || i.ending_after_burst >= ENDING_WAITS {
            return false;
        }
        drop(i);
        // Unknown (the process is gone, or /proc is not readable): at once.
        let bytes = own_memory_bytes(pid).unwrap_or(u64::MAX);
        i = lock(&self.inner);
        if bytes > ENDING_BYTES.saturating_sub(i.ending_bytes) {
            return false;
        }
        i.ending_after_burst += 1;
        i.ending_bytes += bytes;
        loop {
            let now = std::time::Instant::now();
            if i.quiet(now) || now >= end || self.shut.load(Ordering::SeqCst) {
                break;
            }
            let quiet_at = i.quiet_at().unwrap_or(now).min(end);
            i = self
                .cv
                .wait_timeout(i, quiet_at.saturating_duration_since(now))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        i.ending_after_burst -= 1;
        i.ending_bytes -= bytes;
        true
    }

    /// A ready worker for `cfg` without preloads: a spare if one fits,
    /// else forked from the zygote, else spawned.
    pub fn acquire(&self, cfg: &WorkerConfig) -> Result<Worker, Error> {
        self.acquire_with(cfg, false)
    }

    /// A ready worker for `cfg`, with `preloads` one of the preloaded
    /// zygote when it is up (a spare, else a fork); otherwise, or when it
    /// is not, as [`Pool::acquire`] makes them.
    pub fn acquire_with(&self, cfg: &WorkerConfig, preloads: bool) -> Result<Worker, Error> {
        self.acquire_holding(cfg, preloads).map(|(w, _)| w)
    }

    /// As [`Pool::acquire_with`], with the hold on the spare's refill when
    /// the worker is a spare taken while another was ready: the caller
    /// drops it when the first call in the worker has ended.
    pub(crate) fn acquire_holding(
        &self,
        cfg: &WorkerConfig,
        preloads: bool,
    ) -> Result<Held, Error> {
        if cfg.confine.is_some() {
            return self.acquire_confined(cfg, preloads);
        }
        if self.cfg.zygote && self.zygote_compatible(cfg) {
            if preloads {
                if let Some(w) = self.preloaded_worker(cfg) {
                    return Ok(w);
                }
            }
            if let Some(w) = self
                .take_spare(cfg, false)
                .or_else(|| self.take_library_spare(cfg))
            {
                return Ok(w);
            }
            let zygote = lock(&self.inner).current();
            if let Some(z) = zygote {
                if let Ok(w) = z.fork(cfg) {
                    return Ok((w, None));
                }
            }
        }
        Worker::spawn(cfg).map(|w| (w, None))
    }

    /// A worker of the preloaded zygote (a spare, else a fork), if it is up.
    /// The first such ask is what starts it, with `preload_on_first_use`.
    fn preloaded_worker(&self, cfg: &WorkerConfig) -> Option<Held> {
        if self.cfg.preload_on_first_use {
            let mut i = lock(&self.inner);
            if !i.preload_wanted {
                i.preload_wanted = true;
                drop(i);
                self.cv.notify_all();
            }
        }
        if let Some(w) = self.take_spare(cfg, true) {
            return Some(w);
        }
        let zygote = lock(&self.inner).preloaded.live()?;
        zygote.fork(cfg).ok().map(|w| (w, None))
    }

    /// A confined worker: only the zygote makes them, so this waits for it
    /// to be up (within the start-up timeout) and reports why it is not.
    fn acquire_confined(&self, cfg: &WorkerConfig, preloads: bool) -> Result<Held, Error> {
        if !self.cfg.zygote || !self.zygote_compatible(cfg) {
            return Err(Error::Startup(
                "confined workers are forked by the zygote, and this worker's settings \
                 (library path or binary) differ from the zygote's"
                    .into(),
            ));
        }
        if preloads {
            if let Some(w) = self.preloaded_worker(cfg) {
                return Ok(w);
            }
        }
        if let Some(w) = self
            .take_spare(cfg, false)
            .or_else(|| self.take_library_spare(cfg))
        {
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
                // The zygote died under us, or it was the base zygote and
                // retired meanwhile (its warm zygote serves now): ask the
                // one that forks now.
                Err(_)
                    if (!zygote.is_alive() || zygote.is_retiring())
                        && std::time::Instant::now() < end =>
                {
                    self.cv.notify_all();
                    continue;
                }
                other => return other.map(|w| (w, None)),
            }
        }
    }

    /// The pool's state.
    pub fn status(&self) -> PoolStatus {
        let i = lock(&self.inner);
        let live = i.current();
        let live = live.as_ref();
        let mut startup_ms = std::collections::BTreeMap::new();
        let preloaded = i.preloaded.live();
        for (stage, z) in [
            ("base", &i.base),
            ("warm", &i.warm.zygote),
            ("preloaded", &preloaded),
        ] {
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
            spares: i.warm.spares.len(),
            spares_target: if self.cfg.zygote {
                self.target(&i.warm, std::time::Instant::now())
            } else {
                0
            },
            preloaded: preloaded
                .as_ref()
                .map(|z| z.hello().preloaded.clone())
                .unwrap_or_default(),
            preloaded_zygote_pid: preloaded.as_ref().map(|z| z.pid()),
            preloaded_spares: i.preloaded.spares.len(),
            preloaded_spares_target: if self.cfg.zygote {
                self.target(&i.preloaded, std::time::Instant::now())
            } else {
                0
            },
            library_spare_pids: i
                .library_spares
                .iter()
                .filter_map(|l| l.spare.as_ref().map(|(_, w)| w.pid()))
                .collect(),
            preload_awaits_first_use: self.split()
                && self.cfg.preload_on_first_use
                && !i.preload_wanted,
            refills_held: {
                let now = std::time::Instant::now();
                i.holds.iter().filter(|(_, end)| *end > now).count()
            },
            warm: live.is_some_and(|z| z.is_warm()),
            zygote_starts: i.starts,
            startup_ms,
            last_error: i.last_error.clone(),
        }
    }

    /// Waits until the zygote is up (or failed), with its warm and
    /// preloaded zygotes (or their failures) and the spares of each, at
    /// most `timeout`; returns whether it is up. For tests and benchmarks
    /// that want the fast path.
    pub fn wait_ready(&self, timeout: Duration) -> bool {
        let end = std::time::Instant::now() + timeout;
        let mut i = lock(&self.inner);
        loop {
            let current = i.current();
            let up = current.is_some();
            let warm_done = !self.split()
                || current.as_ref().is_some_and(|z| z.is_warm())
                || (i.warm.failed && !i.warm.making);
            let preloaded = i.preloaded.live();
            let preloaded_done = !self.split()
                || i.nothing_to_preload
                || (self.cfg.preload_on_first_use && !i.preload_wanted)
                || preloaded.is_some()
                || (i.preloaded.failed && !i.preloaded.making)
                || (warm_done && i.warm.live().is_none());
            let full = i.warm.spares.len() >= self.cfg.spares
                && (preloaded.is_none() || i.preloaded.spares.len() >= self.cfg.spares);
            if (up && full && warm_done && preloaded_done) || (!i.starting && !up) {
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
        let (base, warm, preloaded, library_spares) = {
            let mut i = lock(&self.inner);
            (
                i.base.take(),
                i.warm.clear(),
                i.preloaded.clear(),
                std::mem::take(&mut i.library_spares),
            )
        };
        drop(library_spares);
        let (warm, warm_spares) = warm;
        let (preloaded, preloaded_spares) = preloaded;
        drop(warm_spares);
        drop(preloaded_spares);
        for z in [preloaded, warm, base].into_iter().flatten() {
            z.kill_in_background();
        }
        self.cv.notify_all();
        // The keeper sees the stop at its next step (a fork of a killed
        // zygote fails at once); bounded, and never on the keeper itself
        // (the pool can be dropped there).
        let (m, cv) = &*self.keeper;
        let end = std::time::Instant::now() + KEEPER_STOP_WAIT;
        let mut k = lock_any(m);
        while let Some(id) = *k {
            let now = std::time::Instant::now();
            if id == std::thread::current().id() || now >= end {
                break;
            }
            k = cv
                .wait_timeout(k, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The process id of the zygote that forks workers without preloads
    /// now (the warm one once it is up), for tests that kill it.
    pub fn zygote_pid(&self) -> Option<u32> {
        lock(&self.inner).current().map(|z| z.pid())
    }

    /// The R version workers run, without waiting: the zygote's when it
    /// is up, else the installation's ([`installed_r_version`]), so a
    /// front end that asks while R starts (a Jupyter kernel's
    /// `kernel_info`) need not wait for it; None when neither is known.
    pub fn r_version_now(&self) -> Option<String> {
        self.r_version(Duration::ZERO).or_else(installed_r_version)
    }

    /// The R version the zygote runs: at once when it is up, after at
    /// most `timeout` while it starts; None without one.
    pub fn r_version(&self, timeout: Duration) -> Option<String> {
        let end = std::time::Instant::now() + timeout;
        let mut i = lock(&self.inner);
        loop {
            if let Some(z) = i.current() {
                return Some(z.hello().r_version.clone());
            }
            let now = std::time::Instant::now();
            if !self.cfg.zygote || !i.starting || now >= end {
                return None;
            }
            i = self
                .cv
                .wait_timeout(i, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The process id of the preloaded zygote, once it is up.
    pub fn preloaded_zygote_pid(&self) -> Option<u32> {
        lock(&self.inner).preloaded.live().map(|z| z.pid())
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

/// The package the preloaded zygote loads when the pool names none.
pub const DEFAULT_PRELOAD: &str = "ggplot2";

/// Whether `code` contains `pkg` as a whole word: not inside a longer name
/// (R names are letters, digits, `.` and `_`).
fn names_package(code: &str, pkg: &str) -> bool {
    if pkg.is_empty() {
        return false;
    }
    let word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '.' || c == '_');
    code.match_indices(pkg).any(|(at, _)| {
        !word(code[..at].chars().next_back()) && !word(code[at + pkg.len()..].chars().next())
    })
}

/// How long [`Pool::shutdown`] waits for the keeper thread to end.
const KEEPER_STOP_WAIT: Duration = Duration::from_secs(2);

/// Says, when the keeper thread ends however it does, that it has.
struct KeeperGone(Arc<(Mutex<Option<std::thread::ThreadId>>, Condvar)>);

impl Drop for KeeperGone {
    fn drop(&mut self) {
        *lock_any(&self.0 .0) = None;
        self.0 .1.notify_all();
    }
}

/// The keeper thread: (re)starts the zygote, asks it for a warm zygote and
/// that one for a preloaded zygote (when the pool preloads), and keeps
/// spares of each ready.
fn keeper(pool: std::sync::Weak<Pool>) {
    let mut backoff = Duration::from_millis(250);
    loop {
        let Some(p) = pool.upgrade() else { return };
        if p.shut.load(Ordering::SeqCst) {
            return;
        }
        let base = lock(&p.inner).usable_base();
        if base.is_none() {
            let old = {
                let mut i = lock(&p.inner);
                i.starting = true;
                // Children of a dead zygote are dead too; so are the warm
                // and preloaded zygotes whose base died.
                (i.base.take(), i.warm.clear(), i.preloaded.clear())
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
                    i.nothing_to_preload = false;
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
            start_making(&p, &pool, &base, Which::Warm);
            let warm = {
                let i = lock(&p.inner);
                i.warm
                    .live()
                    .filter(|_| !i.nothing_to_preload)
                    .filter(|_| i.preload_wanted || !p.cfg.preload_on_first_use)
            };
            if settle(&p, &base) {
                // Forks from the warm zygote wait (a little) until its base
                // retired and its heap is compact: a page it still shared
                // would stay out of its huge pages.
                let i = lock(&p.inner);
                let _ = p.cv.wait_timeout(i, Duration::from_millis(20));
                continue;
            }
            if let Some(warm) = warm {
                start_making(&p, &pool, &warm, Which::Preloaded);
            }
        }
        // A stage whose raised target fell back ends its spares beyond
        // it, one per turn (the youngest: the oldest are handed over first).
        let surplus = {
            let mut i = lock(&p.inner);
            let now = std::time::Instant::now();
            let (warm, preloaded) = (p.target(&i.warm, now), p.target(&i.preloaded, now));
            if i.warm.spares.len() > warm {
                i.warm.spares.pop_back()
            } else if i.preloaded.spares.len() > preloaded {
                i.preloaded.spares.pop_back()
            } else {
                None
            }
        };
        if surplus.is_some() {
            drop(surplus);
            continue;
        }
        // Top up the spares, one fork at a time, outside the lock: those
        // without preloads first (most sessions), then the preloaded ones.
        // While a session's first call runs in a spare it took (a
        // `RefillHold`), or less than `burst::QUIET` after the latest ask,
        // a kind that still has a spare ready waits: on a machine with few
        // cores the fork would compete with those sessions.
        let zygote = {
            let mut i = lock(&p.inner);
            let now = std::time::Instant::now();
            let holding = i.holding(now);
            let quiet = i.quiet(now);
            let wants = |s: &Stage| {
                s.spares.len() < p.target(s, now) && (s.spares.is_empty() || (!holding && quiet))
            };
            if wants(&i.warm) {
                i.current().map(|z| (z, Which::Warm))
            } else if wants(&i.preloaded) {
                i.preloaded.live().map(|z| (z, Which::Preloaded))
            } else {
                None
            }
        };
        // Then a spare for each of the recent libraries-after that lacks
        // one (or whose spare's zygote was replaced).
        if zygote.is_none() && !p.shut.load(Ordering::SeqCst) {
            let wanted = {
                let i = lock(&p.inner);
                i.current().and_then(|z| {
                    i.library_spares
                        .iter()
                        .find(|l| !l.spare.as_ref().is_some_and(|(sz, _)| Arc::ptr_eq(sz, &z)))
                        .map(|l| (z.clone(), l.libraries.clone()))
                })
            };
            if let Some((z, libraries)) = wanted {
                let cfg = WorkerConfig {
                    libpath_after: libraries.clone(),
                    ..p.base.clone()
                };
                match z.fork(&cfg) {
                    Ok(w) => {
                        let mut i = lock(&p.inner);
                        let still = i.current().is_some_and(|c| Arc::ptr_eq(&c, &z));
                        let old = match i
                            .library_spares
                            .iter_mut()
                            .find(|l| l.libraries == libraries)
                        {
                            Some(l) if still => l.spare.replace((z, w)),
                            _ => Some((z, w)),
                        };
                        drop(i);
                        drop(old);
                        p.cv.notify_all();
                    }
                    Err(e) => {
                        // Not tried again for these libraries until they
                        // are asked for again (a removed directory would
                        // fail every time).
                        let mut i = lock(&p.inner);
                        i.last_error = Some(e.to_string());
                        i.library_spares.retain(|l| l.libraries != libraries);
                    }
                }
                continue;
            }
        }
        if let Some((zygote, which)) = zygote.filter(|_| !p.shut.load(Ordering::SeqCst)) {
            match zygote.fork(&p.base) {
                Ok(w) => {
                    let mut i = lock(&p.inner);
                    // A spare of a zygote that was replaced meanwhile (the
                    // base one by the warm one, which has the warm-up)
                    // is dropped.
                    let still = match which {
                        Which::Warm => i.current(),
                        Which::Preloaded => i.preloaded.live(),
                    };
                    if still.is_some_and(|z| Arc::ptr_eq(&z, &zygote)) {
                        i.stage(which).spares.push_back(w);
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
        // Sleep until a spare is taken, a zygote comes or goes, a retry
        // is due, or shutdown. The timeout is a safety net only; the
        // events above notify.
        let i = lock(&p.inner);
        let wait = [
            i.warm.retry_at,
            i.preloaded.retry_at,
            i.warm.burst.falls_back_at(),
            i.preloaded.burst.falls_back_at(),
            i.quiet_at(),
        ]
        .into_iter()
        .flatten()
        .chain(i.holds.iter().map(|&(_, end)| end))
        .min()
        .map(|t| t.saturating_duration_since(std::time::Instant::now()))
        .unwrap_or(Duration::from_secs(5))
        .clamp(Duration::from_millis(10), Duration::from_secs(5));
        let _ = p.cv.wait_timeout(i, wait);
    }
}

/// Once the warm zygote is up: asks the base zygote to retire (it gives up
/// R and its heap, which the warm zygote shared: embedded-worker's
/// retired.rs), then, once it has, the warm zygote to put its heap in huge
/// pages (huge.rs). True while that is under way, for at most
/// [`SETTLE_LIMIT`] after the warm zygote came up.
fn settle(p: &Pool, base: &Arc<Zygote>) -> bool {
    let mut i = lock(&p.inner);
    let Some(warm) = i.warm.live() else {
        return false;
    };
    if !base.is_retiring() {
        base.retire();
        i.settle_since = Some(std::time::Instant::now());
    }
    if base.is_retired() || !base.is_alive() {
        warm.compact();
        return false;
    }
    i.settle_since.is_some_and(|t| t.elapsed() < SETTLE_LIMIT)
}

/// How long forks from a new warm zygote wait for its base to retire.
const SETTLE_LIMIT: Duration = Duration::from_secs(2);

/// The version of the R installation workers start R from, read from its
/// base package's `DESCRIPTION` without starting R: `R_HOME` as a worker
/// resolves it (this process's `R_HOME`, which workers inherit, else the
/// build's R). None when the file cannot be read or has no version.
pub fn installed_r_version() -> Option<String> {
    let home = std::env::var_os("R_HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("RVISOR_BUILD_R_HOME")));
    let text = std::fs::read_to_string(home.join("library/base/DESCRIPTION")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Version:"))
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Starts making the `which` zygote from `parent` on a thread of its own,
/// unless it is up, being made, or a retry after a failure is not due yet.
/// When it is up it takes over its forks: the warm zygote those of the
/// base one (whose spares are replaced), the preloaded one those of code
/// that names a preload.
fn start_making(p: &Arc<Pool>, pool: &std::sync::Weak<Pool>, parent: &Arc<Zygote>, which: Which) {
    let mut i = lock(&p.inner);
    let stage = i.stage(which);
    if stage.making || stage.live().is_some() {
        return;
    }
    if stage
        .retry_at
        .is_some_and(|t| std::time::Instant::now() < t)
    {
        return;
    }
    // A zygote that died left dead spares behind; so did its preloaded
    // child, which died with it. (Before the first warm zygote, the warm
    // spares are the base zygote's: they stay until it is up.)
    let had = stage.zygote.take().is_some();
    let mut dead = Vec::new();
    if had {
        dead.push(std::mem::take(&mut stage.spares));
    }
    stage.making = true;
    if which == Which::Warm && had {
        let (z, spares) = i.preloaded.clear();
        drop(z);
        dead.push(spares);
    }
    drop(i);
    drop(dead);
    let (weak, parent) = (pool.clone(), parent.clone());
    let name = match which {
        Which::Warm => "rvisor-warm-zygote",
        Which::Preloaded => "rvisor-preloaded-zygote",
    };
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let Some(p) = weak.upgrade() else { return };
            let cfg = p.base.clone();
            // The warm zygote loads no package; the preloaded one the
            // pool's list (None: ggplot2 when installed).
            let preload = match which {
                Which::Warm => Some(Vec::new()),
                Which::Preloaded => p.cfg.preload.clone(),
            };
            drop(p);
            let poke = {
                let weak = weak.clone();
                move || {
                    if let Some(p) = weak.upgrade() {
                        p.poke();
                    }
                }
            };
            let made = parent.warm(&cfg, preload.as_deref(), true, poke);
            let Some(p) = weak.upgrade() else { return };
            let mut i = lock(&p.inner);
            let same_parent = match which {
                Which::Warm => i.base.as_ref().is_some_and(|b| Arc::ptr_eq(b, &parent)),
                Which::Preloaded => i.warm.live().is_some_and(|w| Arc::ptr_eq(&w, &parent)),
            };
            let mut old_spares = VecDeque::new();
            let mut unused = None;
            match made {
                Ok(z) if same_parent && parent.is_alive() => {
                    if which == Which::Preloaded && z.hello().preloaded.is_empty() {
                        // None of the packages is installed: nothing to
                        // fork from it that the warm zygote has not.
                        i.nothing_to_preload = true;
                        unused = Some(z);
                    } else {
                        if which == Which::Warm {
                            old_spares = std::mem::take(&mut i.warm.spares);
                        }
                        i.stage(which).zygote = Some(Arc::new(z));
                    }
                    i.starts += 1;
                    let stage = i.stage(which);
                    stage.failed = false;
                    stage.retry_at = None;
                    stage.backoff = Duration::from_millis(250);
                }
                Ok(_) => {} // its parent was replaced: it dies with it
                Err(e) => {
                    let label = match which {
                        Which::Warm => "warm zygote",
                        Which::Preloaded => "preloaded zygote",
                    };
                    i.last_error = Some(format!("{label}: {e}"));
                    let stage = i.stage(which);
                    stage.failed = true;
                    let wait = stage.backoff.max(Duration::from_millis(250));
                    stage.retry_at = Some(std::time::Instant::now() + wait);
                    stage.backoff = (wait * 2).min(Duration::from_secs(30));
                }
            }
            i.stage(which).making = false;
            drop(i);
            drop(old_spares);
            if let Some(z) = unused {
                z.kill();
            }
            p.cv.notify_all();
        });
    if spawned.is_err() {
        let mut i = lock(&p.inner);
        let stage = i.stage(which);
        stage.making = false;
        stage.failed = true;
        stage.retry_at = Some(std::time::Instant::now() + Duration::from_secs(1));
    }
}

#[cfg(test)]
mod tests {
    use super::{lock, names_package, Pool, PoolConfig, ENDING_BYTES, ENDING_WAIT, ENDING_WAITS};
    use std::time::{Duration, Instant};

    /// A pool without a zygote, whose latest ask for a spare was at `ask`.
    fn pool_asked_at(ask: Option<Instant>) -> std::sync::Arc<Pool> {
        let cfg = PoolConfig {
            zygote: false,
            ..PoolConfig::default()
        };
        let pool = Pool::new(crate::WorkerConfig::default(), cfg).unwrap();
        lock(&pool.inner).last_ask = ask;
        pool
    }

    #[test]
    fn a_worker_being_ended_waits_for_a_burst_of_asks_at_most_its_bound() {
        // Asks that go on (the latest one still ahead): the wait ends at
        // its bound, and the next worker may wait again.
        let pool = pool_asked_at(Some(Instant::now() + Duration::from_secs(3600)));
        let me = std::process::id();
        let t = Instant::now();
        assert!(pool.after_burst(me));
        assert!(t.elapsed() >= ENDING_WAIT);
        assert_eq!(lock(&pool.inner).ending_after_burst, 0);
        assert_eq!(lock(&pool.inner).ending_bytes, 0);
        // A burst that is over by the time it looks (the latest ask
        // longer ago than QUIET), or no ask at all: no wait.
        let over = Instant::now() - crate::burst::QUIET - Duration::from_millis(1);
        assert!(!pool_asked_at(Some(over)).after_burst(me));
        assert!(!pool_asked_at(None).after_burst(me));
    }

    #[test]
    fn a_worker_being_ended_does_not_wait_past_the_bounds_of_count_and_memory() {
        let pool = pool_asked_at(Some(Instant::now() + Duration::from_secs(3600)));
        let me = std::process::id();
        // As many waiting as allowed: the next one ends at once.
        lock(&pool.inner).ending_after_burst = ENDING_WAITS;
        assert!(!pool.after_burst(me));
        // The waiting ones hold all the memory allowed: at once too.
        lock(&pool.inner).ending_after_burst = 0;
        lock(&pool.inner).ending_bytes = ENDING_BYTES;
        assert!(!pool.after_burst(me));
        // A process whose memory cannot be read (gone): at once.
        lock(&pool.inner).ending_bytes = 0;
        assert!(!pool.after_burst(u32::MAX));
        // What a waiting worker counts: its own memory, read from /proc.
        assert!(super::own_memory_bytes(me).is_some_and(|b| b > 0));
    }

    #[test]
    fn a_package_is_named_as_a_whole_word() {
        for code in [
            "library(ggplot2)",
            "library('ggplot2'); ggplot(mtcars)",
            "p <- ggplot2::ggplot(mtcars)",
            "requireNamespace(\"ggplot2\")",
            "x <- 1\nsuppressMessages(require(ggplot2))",
            "ggplot2",
        ] {
            assert!(names_package(code, "ggplot2"), "{code}");
        }
        for code in [
            "1 + 1",
            "ggplot(mtcars)",
            "library(ggplot2movies)",
            "my.ggplot2 <- 1",
            "x_ggplot2",
            "ggplot2_theme()",
            "ggplot",
        ] {
            assert!(!names_package(code, "ggplot2"), "{code}");
        }
        assert!(!names_package("anything", ""));
    }
}
