//! The supervisor's side of the zygote: start it, ask it to fork workers,
//! learn how its children ended.

use crate::error::Error;
use crate::process::{
    launch, pipe, worker_env, ExitInfo, ExitReports, Proc, TempDir, WorkerConfig,
};
use crate::raw::RawOutput;
use crate::worker::Worker;
use rvisor_protocol::{
    fdpass, read_frame, write_frame, ForkRequest, FromZygote, ToZygote, ZygoteHello, ENV_PRELOAD,
    ENV_ZYGOTE_FD, PROTOCOL_VERSION,
};
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::process::{Child, Stdio};
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

/// A running zygote.
#[derive(Debug)]
pub struct Zygote {
    ctl: Mutex<UnixStream>,
    shared: Arc<ZygoteShared>,
    hello: ZygoteHello,
    child: Mutex<Child>,
    next_id: Mutex<u64>,
    _tmp: TempDir,
}

impl Zygote {
    /// Starts a zygote and waits until it is ready to fork. `preload`:
    /// packages to load (None: ggplot2 when installed).
    /// `on_exit` runs (on the reader thread) when the zygote goes away.
    pub fn start(
        cfg: &WorkerConfig,
        preload: Option<&[String]>,
        on_exit: impl Fn() + Send + 'static,
    ) -> Result<Zygote, Error> {
        // The preload list travels in the zygote's environment only.
        let mut extra: Vec<(&str, String)> = preload
            .map(|p| (ENV_PRELOAD, p.join(",")))
            .into_iter()
            .collect();
        // Start-up timing marks (off unless RVISOR_TIMING names a file).
        if let Some(f) = rvisor_protocol::timing::file() {
            extra.push((rvisor_protocol::timing::ENV_TIMING, f.to_string()));
        }
        rvisor_protocol::timing::mark("zygote.launch");
        let (mut child, mut parent, tmp) = launch(cfg, ENV_ZYGOTE_FD, &extra, Stdio::null())?;
        let stderr = RawOutput::default();
        if let Some(e) = child.stderr.take() {
            stderr.attach(1, e);
        }
        write_frame(
            &mut parent,
            &ToZygote::Hello {
                protocol_version: PROTOCOL_VERSION,
            },
        )
        .map_err(|e| Error::Startup(format!("the zygote closed its link at once ({e})")))?;
        let mut reader = parent.try_clone().map_err(|source| Error::Io {
            what: "clone the zygote socket",
            source,
        })?;
        let hello = match read_frame::<_, FromZygote>(&mut reader) {
            Ok(FromZygote::Hello(h)) if h.protocol_version == PROTOCOL_VERSION => {
                rvisor_protocol::timing::mark("zygote.hello");
                h
            }
            other => {
                let _ = child.kill();
                let _ = child.wait();
                let [_, e] = stderr.take_all(Instant::now() + Duration::from_millis(500));
                return Err(Error::Startup(format!(
                    "the zygote did not start ({other:?}): {}",
                    String::from_utf8_lossy(&e).trim()
                )));
            }
        };
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
            .map_err(|source| Error::Io {
                what: "start the zygote reader thread",
                source,
            })?;
        Ok(Zygote {
            ctl: Mutex::new(parent),
            shared,
            hello,
            child: Mutex::new(child),
            next_id: Mutex::new(0),
            _tmp: tmp,
        })
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

    /// Waits for the zygote process to end (returns at once if it has).
    pub fn wait(&self) {
        let _ = self.child.lock().unwrap_or_else(|e| e.into_inner()).wait();
    }

    /// Kills the zygote (its workers die with it: parent-death signal).
    pub fn kill(&self) {
        let mut c = self.child.lock().unwrap_or_else(|e| e.into_inner());
        let _ = c.kill();
        let _ = c.wait();
    }

    /// Forks a ready worker with `cfg`'s environment and waits for its hello.
    pub fn fork(&self, cfg: &WorkerConfig) -> Result<Worker, Error> {
        rvisor_protocol::timing::mark("fork.request");
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
        let worker_id = {
            let mut n = self.next_id.lock().unwrap_or_else(|e| e.into_inner());
            *n += 1;
            *n
        };
        let (tx, rx) = mpsc::channel();
        {
            let mut s = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            if !s.alive {
                return Err(Error::Startup("the zygote is not running".into()));
            }
            s.pending.insert(worker_id, tx);
        }
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
                    Some(crate::confine::request(c, uid, &cfg.libpath, &groups)),
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
        rvisor_protocol::timing::mark("fork.forked");
        let mut w = Worker::connect(proc, parent, [out_r, err_r], tmp, remaining, t0)?;
        rvisor_protocol::timing::mark("fork.ready");
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
