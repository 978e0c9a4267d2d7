//! Where a session's workers come from and how they end: the pool as a
//! [`WorkerSource`] (every worker in the supervisor's [`Registry`] while it
//! lives, so a host's signal or a shutdown still kills it), and a worker's
//! end on a thread of its own, which waits for a burst of new sessions to
//! pass when its session was closed (`Pool::after_burst`).

use super::lock;
use crate::error::Error;
use crate::process::{ExitInfo, WorkerConfig};
use crate::worker::{Worker, WorkerSource};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Live workers of a supervisor, so they can be killed on host signals.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    workers: Mutex<HashMap<u32, PathBuf>>,
}

impl Registry {
    pub(crate) fn insert(&self, w: &Worker) {
        lock(&self.workers).insert(w.pid(), w.temp_dir().to_path_buf());
    }

    pub(crate) fn remove(&self, w: &Worker) {
        lock(&self.workers).remove(&w.pid());
    }

    /// Removes the worker `pid` with directory `dir`, not another that
    /// got its pid since.
    pub(crate) fn remove_exact(&self, pid: u32, dir: &Path) {
        let mut m = lock(&self.workers);
        if m.get(&pid).is_some_and(|d| d == dir) {
            m.remove(&pid);
        }
    }

    pub(crate) fn kill_all(&self) {
        let workers = std::mem::take(&mut *lock(&self.workers));
        for (pid, tmp) in workers {
            // SAFETY: kill(2) of a process group we created; if it already
            // ended the call fails harmlessly.
            unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
            crate::tempdir::remove_with_lock(&tmp);
        }
    }
}

/// The supervisor's source: the pool, with every worker in the registry
/// while it lives.
#[derive(Debug)]
pub(crate) struct PoolSource {
    pub(crate) pool: Arc<crate::Pool>,
    pub(crate) cfg: WorkerConfig,
    pub(crate) registry: Arc<Registry>,
    /// A call of the session named a preloaded package: its workers come
    /// from the preloaded zygote from then on (the next one after a reset
    /// or hibernation too).
    pub(crate) preloads: bool,
    /// The pool holds back the refill of the spare the current worker was
    /// until its first call has ended (`call_ended` drops this).
    pub(crate) refill_hold: Option<crate::pool::RefillHold>,
}

impl WorkerSource for PoolSource {
    fn start(&mut self) -> Result<Worker, Error> {
        let (w, hold) = self.pool.acquire_holding(&self.cfg, self.preloads)?;
        self.refill_hold = hold;
        self.registry.insert(&w);
        Ok(w)
    }

    fn call_ended(&mut self) {
        self.refill_hold = None;
    }

    fn forget(&mut self, w: &Worker) {
        self.registry.remove(w);
    }

    fn forget_later(&mut self, w: &Worker) -> Box<dyn FnOnce() + Send> {
        let (registry, pid, dir) = (self.registry.clone(), w.pid(), w.temp_dir().to_path_buf());
        Box::new(move || registry.remove_exact(pid, &dir))
    }

    fn before_ending(&mut self, w: &Worker) -> Box<dyn FnOnce() + Send> {
        let (pool, pid) = (self.pool.clone(), w.pid());
        Box::new(move || {
            pool.after_burst(pid);
        })
    }

    fn will_run(&mut self, code: &str) {
        if !self.preloads && self.pool.names_preload(code) {
            self.preloads = true;
        }
    }
}

/// Ends a worker without holding up the session: the shutdown (and, if
/// the worker does not exit, the kill) happens on a thread of its own.
/// It stays known to the source (the supervisor's registry) until it is
/// gone: a process that exits while it ends still kills it and removes its
/// directory (it left /tmp/rvisor-* behind when `session --jsonl` ended
/// right after a reset).
///
/// `closed`: the session is closed, so nothing waits for this worker to
/// end (unlike a reset's or a hibernation's, whose memory and slot the
/// host may be waiting for), and it ends only after a burst of new
/// sessions (`Pool::after_burst`).
pub(super) fn retire(source: &mut impl WorkerSource, w: Worker, closed: bool) {
    let forget = source.forget_later(&w);
    let first = if closed {
        source.before_ending(&w)
    } else {
        Box::new(|| {})
    };
    let retiring = Retiring {
        worker: Some(w),
        forget: Some(forget),
    };
    let spawned = std::thread::Builder::new()
        .name("rvisor-retire".into())
        .spawn(move || {
            let mut r = retiring;
            // Not during a burst of new sessions (Pool::after_burst).
            first();
            if let Some(w) = r.worker.take() {
                w.shutdown(Duration::from_millis(200));
            }
        });
    // Without a thread, the worker was moved into the failed closure and
    // is killed as it is dropped, then forgotten.
    drop(spawned);
}

/// A worker being ended, then forgotten (also when its thread never ran).
struct Retiring {
    worker: Option<Worker>,
    forget: Option<Box<dyn FnOnce() + Send>>,
}

impl Drop for Retiring {
    fn drop(&mut self) {
        drop(self.worker.take());
        if let Some(f) = self.forget.take() {
            f();
        }
    }
}

/// How a worker that died while idle ended, if it did: the link closing
/// is the first sign (the exit status may not be known yet), then its
/// status is awaited briefly so that it names a reason.
pub(super) fn died_idle(w: &mut Worker) -> Option<ExitInfo> {
    w.exit_status()
        .or_else(|| w.link_closed().then(|| w.wait_exit()))
}
