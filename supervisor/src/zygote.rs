//! The supervisor's side of the zygote: start it, ask it to fork workers,
//! learn how its children ended.

use crate::error::Error;
use crate::process::{
    launch, pipe, worker_env, ExitInfo, ExitReports, Proc, TempDir, WorkerConfig,
};
use crate::raw::RawOutput;
use crate::worker::Worker;
use rvisor_protocol::{
    fdpass, read_frame, timing, write_frame, ForkRequest, FromZygote, ToZygote, WarmRequest,
    ZygoteHello, ENV_PRELOAD, ENV_ZYGOTE_BASE, ENV_ZYGOTE_FD, PROTOCOL_VERSION,
};
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What the reader thread learns from the zygote.
#[derive(Debug, Default)]
pub(crate) struct ZygoteState {
    pending: HashMap<u64, Sender<Result<u32, String>>>,
    /// Confined workers' uids by pid, given back when they end.
    uid_of: HashMap<u32, u32>,
    /// Confined workers' cgroups by pid, removed when they end.
    cgroups_of: HashMap<u32, Vec<std::path::PathBuf>>,
    exits: HashMap<u32, ExitInfo>,
    alive: bool,
    /// It said it retired ([`Zygote::retire`]).
    retired: bool,
}

/// Shared between the zygote handle, its reader thread and forked workers.
#[derive(Debug, Default)]
pub(crate) struct ZygoteShared {
    state: Mutex<ZygoteState>,
    cv: Condvar,
    /// The supervisor's worker uids (confined workers only).
    uids: Option<Arc<crate::confine::Uids>>,
}

impl ZygoteShared {
    /// Hands the answer to fork request `worker_id` to its waiter.
    fn answer(&self, worker_id: u64, answer: Result<u32, String>) {
        let tx = self
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pending
            .remove(&worker_id);
        if let Some(tx) = tx {
            let _ = tx.send(answer);
        }
    }

    fn give_back_uid(&self, uid: u32) {
        if let Some(u) = &self.uids {
            u.give_back(uid);
        }
    }
}

impl ExitReports for ZygoteShared {
    fn exit_of(&self, pid: u32, wait: Duration) -> Option<ExitInfo> {
        let end = Instant::now() + wait;
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(e) = s.exits.remove(&pid) {
                return Some(e);
            }
            let now = Instant::now();
            if now >= end || !s.alive {
                return None;
            }
            s = self
                .cv
                .wait_timeout(s, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Whether forked worker `pid` has ended, or is doomed because its
    /// zygote is gone (non-blocking; keeps the news).
    fn peek_exit(&self, pid: u32) -> Option<ExitInfo> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = s.exits.get(&pid) {
            return Some(*e);
        }
        // Without a zygote, its children are dead or dying: each set
        // PR_SET_PDEATHSIG(SIGKILL) towards the zygote, and a zygote whose
        // link broke is killed when the pool drops it. Asking the kernel
        // (kill(pid, 0)) is not enough: the zygote's socket closes before
        // the kernel signals its children, and a killed child exists (dying,
        // then a zombie until init reaps it) for a while after that. A
        // session that trusted it sent its next call to the dead worker and
        // got `worker_failed` instead of a fresh worker; the pool could
        // likewise hand out a dead spare.
        if !s.alive {
            return Some(ExitInfo {
                code: None,
                signal: Some(libc::SIGKILL),
            });
        }
        None
    }
}

/// A running zygote: a base or full one the supervisor started, or a warm
/// one forked by a base zygote ([`Zygote::warm`]).
#[derive(Debug)]
pub struct Zygote {
    ctl: Mutex<UnixStream>,
    shared: Arc<ZygoteShared>,
    hello: ZygoteHello,
    /// The process, when the supervisor started it (a warm zygote is the
    /// base zygote's child: that one reaps it).
    child: Option<Mutex<Child>>,
    next_id: Mutex<u64>,
    /// [`Zygote::retire`] was asked: it forks no more.
    retiring: AtomicBool,
    /// [`Zygote::compact`] was asked.
    compacted: AtomicBool,
    _tmp: Option<TempDir>,
}

impl Zygote {
    /// Starts a zygote and waits until it is ready to fork. `preload`:
    /// packages to load (None: ggplot2 when installed); it also warms the
    /// plot devices before it serves.
    /// `on_exit` runs (on the reader thread) when the zygote goes away.
    pub fn start(
        cfg: &WorkerConfig,
        preload: Option<&[String]>,
        on_exit: impl Fn() + Send + 'static,
    ) -> Result<Zygote, Error> {
        // The preload list travels in the zygote's environment only.
        let extra: Vec<(&str, String)> = preload
            .map(|p| (ENV_PRELOAD, p.join(",")))
            .into_iter()
            .collect();
        Self::launch(cfg, &extra, on_exit)
    }

    /// Starts a base zygote: it serves as soon as R is up (no preloads, no
    /// plot warm-up); [`Zygote::warm`] then forks a warm one from it.
    pub fn start_base(
        cfg: &WorkerConfig,
        on_exit: impl Fn() + Send + 'static,
    ) -> Result<Zygote, Error> {
        Self::launch(cfg, &[(ENV_ZYGOTE_BASE, "1".to_string())], on_exit)
    }

    fn launch(
        cfg: &WorkerConfig,
        extra: &[(&str, String)],
        on_exit: impl Fn() + Send + 'static,
    ) -> Result<Zygote, Error> {
        let mut extra = extra.to_vec();
        // Start-up timing marks (off unless RVISOR_TIMING names a file).
        if let Some(f) = timing::file() {
            extra.push((timing::ENV_TIMING, f.to_string()));
        }
        timing::mark(timing::ZYGOTE_LAUNCH);
        let (mut child, parent, tmp) = launch(cfg, ENV_ZYGOTE_FD, &extra, Stdio::null())?;
        let stderr = RawOutput::default();
        if let Some(e) = child.stderr.take() {
            stderr.attach(1, e);
        }
        match Self::connect(parent, cfg, None, on_exit) {
            Ok((ctl, shared, hello)) => Ok(Zygote {
                ctl: Mutex::new(ctl),
                shared,
                hello,
                child: Some(Mutex::new(child)),
                next_id: Mutex::new(0),
                retiring: Default::default(),
                compacted: Default::default(),
                _tmp: Some(tmp),
            }),
            Err(why) => {
                let _ = child.kill();
                let _ = child.wait();
                let [_, e] = stderr.take_all(Instant::now() + Duration::from_millis(500));
                Err(Error::Startup(format!(
                    "the zygote did not start ({why}): {}",
                    String::from_utf8_lossy(&e).trim()
                )))
            }
        }
    }

    /// Asks this (base) zygote for a warm zygote: its child, which loads
    /// `preload` (None: ggplot2 when installed) and, with `warm_plots`,
    /// warms the plot devices, then forks workers as this one does. This
    /// zygote keeps serving meanwhile; the call waits (at most the start-up
    /// timeout) until the warm one is ready. The warm zygote dies with this
    /// one; its stderr is this one's.
    pub fn warm(
        &self,
        cfg: &WorkerConfig,
        preload: Option<&[String]>,
        warm_plots: bool,
        on_exit: impl Fn() + Send + 'static,
    ) -> Result<Zygote, Error> {
        let (parent, child_end) = UnixStream::pair().map_err(|source| Error::Io {
            what: "create the warm zygote's socketpair",
            source,
        })?;
        let (worker_id, rx) = self.new_request()?;
        let req = ToZygote::Warm(WarmRequest {
            worker_id,
            preload: preload.map(<[String]>::to_vec),
            warm_plots,
        });
        {
            let ctl = self.ctl.lock().unwrap_or_else(|e| e.into_inner());
            fdpass::send_frame_with_fds(&*ctl, &req, &[child_end.as_raw_fd()]).map_err(|e| {
                self.forget(worker_id, None, &[]);
                Error::Startup(format!("failed to ask the zygote for a warm zygote: {e}"))
            })?;
        }
        drop(child_end);
        let pid = match rx.recv_timeout(cfg.startup_timeout) {
            Ok(Ok(pid)) => pid,
            Ok(Err(message)) => {
                return Err(Error::Startup(format!(
                    "the zygote could not fork a warm zygote: {message}"
                )))
            }
            Err(_) => {
                self.forget(worker_id, None, &[]);
                return Err(Error::StartupTimeout(cfg.startup_timeout));
            }
        };
        match Self::connect(parent, cfg, Some(pid), on_exit) {
            Ok((ctl, shared, hello)) => Ok(Zygote {
                ctl: Mutex::new(ctl),
                shared,
                hello,
                child: None,
                next_id: Mutex::new(0),
                retiring: Default::default(),
                compacted: Default::default(),
                _tmp: None,
            }),
            Err(why) => {
                // SAFETY: kill(2) of the warm zygote this zygote forked for
                // us; its parent has not reaped it unless it already ended
                // (then the signal finds no process or a zombie).
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
                Err(Error::Startup(format!(
                    "the warm zygote did not start ({why}); see the zygote's stderr"
                )))
            }
        }
    }

    /// The hello exchange on a zygote's control socket (with the start-up
    /// timeout), then the reader thread. `pid`: the process the socket
    /// must belong to, when known (a warm zygote).
    fn connect(
        mut parent: UnixStream,
        cfg: &WorkerConfig,
        pid: Option<u32>,
        on_exit: impl Fn() + Send + 'static,
    ) -> Result<(UnixStream, Arc<ZygoteShared>, ZygoteHello), String> {
        write_frame(
            &mut parent,
            &ToZygote::Hello {
                protocol_version: PROTOCOL_VERSION,
            },
        )
        .map_err(|e| format!("the zygote closed its link at once ({e})"))?;
        let mut reader = parent
            .try_clone()
            .map_err(|e| format!("clone the zygote socket: {e}"))?;
        let _ = reader.set_read_timeout(Some(cfg.startup_timeout));
        let hello = match read_frame::<_, FromZygote>(&mut reader) {
            Ok(FromZygote::Hello(h)) if h.protocol_version == PROTOCOL_VERSION => {
                timing::mark(timing::ZYGOTE_HELLO);
                h
            }
            other => return Err(format!("{other:?}")),
        };
        if pid.is_some_and(|p| p != hello.pid) {
            return Err(format!(
                "the warm zygote says it is pid {}, its parent forked {pid:?}",
                hello.pid
            ));
        }
        let _ = reader.set_read_timeout(None);
        let shared = Arc::new(ZygoteShared {
            uids: cfg.uids.clone(),
            ..ZygoteShared::default()
        });
        shared.state.lock().unwrap_or_else(|e| e.into_inner()).alive = true;
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("rvisor-zygote-link".into())
            .spawn(move || {
                loop {
                    match read_frame::<_, FromZygote>(&mut reader) {
                        Ok(FromZygote::Forked { worker_id, pid }) => sh.answer(worker_id, Ok(pid)),
                        Ok(FromZygote::ForkFailed { worker_id, message }) => {
                            sh.answer(worker_id, Err(message))
                        }
                        Ok(FromZygote::Exited { pid, code, signal }) => {
                            let mut s = sh.state.lock().unwrap_or_else(|e| e.into_inner());
                            s.exits.insert(pid, ExitInfo { code, signal });
                            if let Some(uid) = s.uid_of.remove(&pid) {
                                sh.give_back_uid(uid);
                            }
                            let groups = s.cgroups_of.remove(&pid);
                            // Keep the map small: forget very old news.
                            if s.exits.len() > 4096 {
                                s.exits.clear();
                            }
                            drop(s);
                            sh.cv.notify_all();
                            if let Some(g) = groups {
                                crate::confine::remove(&g);
                            }
                        }
                        Ok(FromZygote::Retired) => {
                            sh.state.lock().unwrap_or_else(|e| e.into_inner()).retired = true;
                            sh.cv.notify_all();
                            on_exit();
                        }
                        Ok(FromZygote::Hello(_)) => {}
                        Err(_) => break,
                    }
                }
                let mut s = sh.state.lock().unwrap_or_else(|e| e.into_inner());
                s.alive = false;
                for (_, tx) in s.pending.drain() {
                    let _ = tx.send(Err("the zygote ended".into()));
                }
                drop(s);
                sh.cv.notify_all();
                on_exit();
            })
            .map_err(|e| format!("start the zygote reader thread: {e}"))?;
        Ok((parent, shared, hello))
    }

    /// A new request id, and the channel its answer (`Forked` or
    /// `ForkFailed`) will come on.
    fn new_request(&self) -> Result<(u64, mpsc::Receiver<Result<u32, String>>), Error> {
        let worker_id = {
            let mut n = self.next_id.lock().unwrap_or_else(|e| e.into_inner());
            *n += 1;
            *n
        };
        let (tx, rx) = mpsc::channel();
        let mut s = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
        if !s.alive {
            return Err(Error::Startup("the zygote is not running".into()));
        }
        s.pending.insert(worker_id, tx);
        Ok((worker_id, rx))
    }

    /// What the zygote said when it became ready.
    pub fn hello(&self) -> &ZygoteHello {
        &self.hello
    }

    /// The zygote's process id.
    pub fn pid(&self) -> u32 {
        self.hello.pid
    }

    /// Whether the zygote still runs.
    pub fn is_alive(&self) -> bool {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .alive
    }

    /// Asks this base zygote to retire (once): its warm zygote serves, and
    /// it gives up R and its heap, reaping and reporting its children
    /// still (`ToZygote::Retire`). It forks nothing from now on.
    pub fn retire(&self) {
        self.send_once(&self.retiring, &ToZygote::Retire);
    }

    /// Sends `msg` unless `sent` says it was; no answer is read (a zygote
    /// whose link broke is seen dead by the reader thread).
    fn send_once(&self, sent: &AtomicBool, msg: &ToZygote) {
        if !sent.swap(true, Ordering::SeqCst) {
            let ctl = self.ctl.lock().unwrap_or_else(|e| e.into_inner());
            let _ = write_frame(&mut &*ctl, msg);
        }
    }

    /// Whether [`Zygote::retire`] was asked (it forks no more).
    pub fn is_retiring(&self) -> bool {
        self.retiring.load(Ordering::SeqCst)
    }

    /// Whether it said it retired.
    pub fn is_retired(&self) -> bool {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retired
    }

    /// Asks this warm zygote (once) to put its heap in huge pages where its
    /// pages are its own (`ToZygote::Compact`): after its base retired,
    /// before it forks most of its workers.
    pub fn compact(&self) {
        self.send_once(&self.compacted, &ToZygote::Compact);
    }

    /// Whether this is a warm zygote (preloads done) rather than a base one.
    pub fn is_warm(&self) -> bool {
        self.hello.warm
    }

    /// Waits for the zygote process to end (returns at once if it has). A
    /// warm zygote: until its link closes.
    pub fn wait(&self) {
        match &self.child {
            Some(c) => {
                let _ = c.lock().unwrap_or_else(|e| e.into_inner()).wait();
            }
            None => {
                let mut s = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
                while s.alive {
                    s = self.shared.cv.wait(s).unwrap_or_else(|e| e.into_inner());
                }
            }
        }
    }

    /// Kills the zygote as [`Zygote::kill`] does, but leaves the waiting
    /// for its end (the kernel tearing down its memory: ~5 ms here) to a
    /// thread, so a supervisor shutting down does not wait for it (a
    /// process that exits then leaves the reaping to init).
    pub fn kill_in_background(self: Arc<Self>) {
        if !self.send_kill() {
            return;
        }
        let reaper = std::thread::Builder::new()
            .name("rvisor-reap".into())
            .spawn({
                let z = self.clone();
                move || z.wait()
            });
        if reaper.is_err() {
            self.wait();
        }
    }

    /// Kills the zygote (its workers die with it: parent-death signal).
    pub fn kill(&self) {
        if self.send_kill() {
            self.wait();
        }
    }

    /// Sends the zygote SIGKILL; true when it is this process's child,
    /// to be reaped ([`Zygote::wait`]). Its directory (R's tempdir() in
    /// it) goes now, not when the last handle drops (a killed zygote
    /// writes nothing more): threads still holding one when the process
    /// exits (`rvisor run`, `session --jsonl`) left a /tmp/rvisor-*
    /// directory behind each time.
    fn send_kill(&self) -> bool {
        match &self.child {
            Some(c) => {
                let _ = c.lock().unwrap_or_else(|e| e.into_inner()).kill();
                if let Some(t) = &self._tmp {
                    t.remove_now();
                }
                true
            }
            None if self.is_alive() => {
                // SAFETY: kill(2) of the warm zygote, a child of the base
                // zygote that is not reaped while its link is open (the
                // link closes when it ends; then at worst a zombie, or no
                // process, gets the signal).
                unsafe { libc::kill(self.hello.pid as libc::pid_t, libc::SIGKILL) };
                false
            }
            None => false,
        }
    }

    /// Forks a ready worker with `cfg`'s environment and waits for its hello.
    pub fn fork(&self, cfg: &WorkerConfig) -> Result<Worker, Error> {
        timing::mark(timing::FORK_REQUEST);
        let t0 = Instant::now();
        let tmp = TempDir::new(&cfg.temp_root)?;
        let (parent, child_end) = UnixStream::pair().map_err(|source| Error::Io {
            what: "create the worker socketpair",
            source,
        })?;
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        let mut env: Vec<(String, String)> = Vec::new();
        for (k, v) in worker_env(cfg) {
            if let (Some(k), Some(v)) = (k.to_str(), v.to_str()) {
                env.push((k.to_string(), v.to_string()));
            }
        }
        let (worker_id, rx) = self.new_request()?;
        let (confine, uid, groups) = match &cfg.confine {
            Some(c) => {
                let Some(uids) = self.shared.uids.clone() else {
                    self.forget(worker_id, None, &[]);
                    return Err(Error::Startup(
                        "no worker uids were reserved for confined workers".into(),
                    ));
                };
                let Some(uid) = uids.take() else {
                    self.forget(worker_id, None, &[]);
                    return Err(Error::Startup(format!(
                        "all {} worker uids of this supervisor are in use: end sessions or raise Confinement.uid_count",
                        uids.count()
                    )));
                };
                let groups = match &cfg.cgroups {
                    Some(cg) => {
                        match cg.create(&format!("w-{}-{worker_id}", self.pid()), &c.limits) {
                            Ok(g) => g,
                            Err(e) => {
                                self.forget(worker_id, Some(uid), &[]);
                                return Err(Error::Startup(format!(
                                    "cannot make the worker's cgroups: {e}"
                                )));
                            }
                        }
                    }
                    None => Vec::new(),
                };
                (
                    Some(crate::confine::request(
                        c,
                        uid,
                        &[cfg.libpath.as_slice(), cfg.libpath_after.as_slice()].concat(),
                        &groups,
                        &cfg.programs,
                    )),
                    Some(uid),
                    groups,
                )
            }
            None => (None, None, Vec::new()),
        };
        let req = ToZygote::Fork(ForkRequest {
            worker_id,
            temp_dir: tmp.path().display().to_string(),
            env,
            confine,
        });
        {
            let ctl = self.ctl.lock().unwrap_or_else(|e| e.into_inner());
            fdpass::send_frame_with_fds(
                &*ctl,
                &req,
                &[child_end.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()],
            )
            .map_err(|e| {
                self.forget(worker_id, uid, &groups);
                Error::Startup(format!("failed to ask the zygote to fork: {e}"))
            })?;
        }
        drop((child_end, out_w, err_w));
        let pid = match rx.recv_timeout(cfg.startup_timeout) {
            Ok(Ok(pid)) => pid,
            Ok(Err(message)) => {
                self.forget(worker_id, uid, &groups);
                return Err(Error::Startup(format!(
                    "the zygote could not fork: {message}"
                )));
            }
            Err(_) => {
                self.forget(worker_id, uid, &groups);
                return Err(Error::StartupTimeout(cfg.startup_timeout));
            }
        };
        let cpu_usage = crate::confine::cpu_usage_file(&groups);
        if let Some(uid) = uid {
            let mut s = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            if s.exits.contains_key(&pid) {
                drop(s);
                self.shared.give_back_uid(uid);
                crate::confine::remove(&groups);
            } else {
                s.uid_of.insert(pid, uid);
                s.cgroups_of.insert(pid, groups);
            }
        }
        let proc = Proc::Forked {
            pid,
            reports: self.shared.clone(),
            reaped: None,
        };
        let remaining = cfg.startup_timeout.saturating_sub(t0.elapsed());
        timing::mark(timing::FORK_FORKED);
        let mut w = Worker::connect(proc, parent, [out_r, err_r], tmp, remaining, t0)?;
        timing::mark(timing::FORK_READY);
        w.confined = cfg.confine.is_some();
        w.cpu_usage = cpu_usage;
        Ok(w)
    }
}

impl Zygote {
    /// Drops fork request `worker_id`, gives its uid back and removes its
    /// cgroups.
    fn forget(&self, worker_id: u64, uid: Option<u32>, groups: &[std::path::PathBuf]) {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pending
            .remove(&worker_id);
        if let Some(uid) = uid {
            self.shared.give_back_uid(uid);
        }
        crate::confine::remove(groups);
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        self.kill();
    }
}
