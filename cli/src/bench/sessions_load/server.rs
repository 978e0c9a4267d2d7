//! The `rvisor serve` the driver starts and restarts ([`Server`]), the
//! run's temporary directory, and what is read of the host: free disk,
//! the state directory's size, the workers' PSS from /proc.

use super::Config;
use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `rvisor serve` started by the driver.
pub(super) struct Server {
    pub(super) child: Child,
    pub(super) addr: String,
    pub(super) dir: PathBuf,
    /// The last lines of its standard error (for error messages).
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
}

impl Server {
    /// Starts `rvisor serve` on `listen` with the state in `dir/state` and
    /// waits until `/readyz` answers 200.
    pub(super) fn start(cfg: &Config, dir: &Path, listen: &str) -> Result<Server, String> {
        let mut cmd = Command::new(&cfg.rvisor);
        if cfg.unconfined {
            cmd.arg("--unconfined");
        }
        // Room above the sessions for one retried creation per client.
        let n = (cfg.sessions + cfg.clients).to_string();
        cmd.args(["serve", "--no-auth", "--listen", listen, "--node-id", "n1"])
            .args(["--max-sessions", &n, "--max-sessions-per-tenant", &n])
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["--drain-grace-secs", "60", "--style", "builtin"]);
        if let Some(l) = cfg.live {
            cmd.args(["--max-live-sessions", &l.to_string()]);
        }
        if let Some(b) = cfg.memory_budget_mb {
            cmd.args(["--memory-budget-mb", &b.to_string()]);
        }
        if let Some(h) = cfg.hibernate_after_secs {
            cmd.args(["--hibernate-after-secs", &h.to_string()]);
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", cfg.rvisor.display()))?;
        let stderr = child.stderr.take().ok_or("no stderr")?;
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let tail = tail.clone();
            // RVISOR_LOAD_SERVER_LOG=FILE keeps the server's whole log.
            let mut log = std::env::var_os("RVISOR_LOAD_SERVER_LOG").and_then(|p| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .ok()
            });
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if let Some(f) = log.as_mut() {
                        use std::io::Write;
                        let _ = writeln!(f, "{line}");
                    }
                    if let Some(a) = line.split("listening on http://").nth(1) {
                        let _ = tx.send(a.trim().to_string());
                    }
                    if let Ok(mut t) = tail.lock() {
                        if t.len() == 30 {
                            t.pop_front();
                        }
                        t.push_back(line);
                    }
                }
            });
        }
        let mut server = Server {
            child,
            addr: String::new(),
            dir: dir.to_path_buf(),
            stderr_tail: tail,
        };
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(a) => server.addr = a,
            Err(_) => {
                let _ = server.terminate(Duration::from_secs(10));
                return Err(server.why_not_started(cfg));
            }
        }
        let end = Instant::now() + Duration::from_secs(180);
        let url = format!("http://{}/readyz", server.addr);
        loop {
            if ureq::get(&url)
                .timeout(Duration::from_secs(5))
                .call()
                .is_ok()
            {
                return Ok(server);
            }
            if Instant::now() > end {
                let _ = server.terminate(Duration::from_secs(10));
                return Err(format!(
                    "rvisor serve did not become ready within 180 s: {}",
                    server.tail()
                ));
            }
            if let Ok(Some(st)) = server.child.try_wait() {
                return Err(format!(
                    "rvisor serve exited ({st}) before it was ready: {}",
                    server.tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn tail(&self) -> String {
        self.stderr_tail
            .lock()
            .map(|t| t.iter().cloned().collect::<Vec<_>>().join("\n"))
            .unwrap_or_default()
    }

    /// Why the server did not listen, naming a missing feature when its
    /// flag was refused.
    fn why_not_started(&self, cfg: &Config) -> String {
        // The reader thread may still be copying the last lines.
        let end = Instant::now() + Duration::from_secs(2);
        while Instant::now() < end && self.tail().is_empty() {
            std::thread::sleep(Duration::from_millis(20));
        }
        let tail = self.tail();
        for (flag, feature, instead) in [
            (
                "--max-live-sessions",
                "admission control (a host-wide cap of live sessions, issue 15)",
                "--live 0 runs without a live cap",
            ),
            (
                "--memory-budget-mb",
                "admission control (the live workers' memory budget, issue 15)",
                "--memory-budget-mb 0 runs without a budget",
            ),
        ] {
            if tail.contains(flag) && tail.contains("unexpected argument") {
                return format!(
                    "this rvisor serve ({}) has no {flag}: it lacks {feature}, which the \
                     sessions-load targets need; build a binary that has it ({instead}, \
                     and measures less)",
                    cfg.rvisor.display()
                );
            }
        }
        format!("rvisor serve did not start listening: {tail}")
    }

    /// SIGTERM, then waits for the exit (SIGKILL after `grace`); the exit
    /// status, or why it had to be killed.
    pub(super) fn terminate(&mut self, grace: Duration) -> Result<String, String> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Ok(format!("already exited: {st}"));
        }
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: `pid` is our own child, not yet reaped (try_wait saw it
        // running), so the id cannot name another process.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let end = Instant::now() + grace;
        loop {
            match self.child.try_wait() {
                Ok(Some(st)) => return Ok(st.to_string()),
                Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(10)),
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return Err(format!(
                        "rvisor serve did not exit within {:.0} s of SIGTERM (killed): {}",
                        grace.as_secs_f64(),
                        self.tail()
                    ));
                }
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The run's temporary directory, removed when dropped.
pub(super) struct WorkDir(pub(super) PathBuf);

impl WorkDir {
    pub(super) fn new(parent: &Path) -> Result<WorkDir, String> {
        let d = parent.join(format!(
            "rvisor-sessions-load-{}-{}",
            std::process::id(),
            rvisor::ids::random_hex(4)
        ));
        std::fs::create_dir_all(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
        Ok(WorkDir(d))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Free bytes for an unprivileged writer on the file system of `dir`.
pub(super) fn free_bytes(dir: &Path) -> Result<u64, String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| format!("{} has a NUL byte", dir.display()))?;
    // SAFETY: statvfs is plain old data; an all-zero value is valid.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path that lives across the call and
    // `st` is a valid, writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(format!(
            "cannot read the free space of {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Bytes of the files under `dir`.
pub(super) fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Summed PSS (bytes) of the `rvisor-worker` processes under `root`, their
/// number, and how many of them could not be read.
pub(super) fn workers_pss(root: u32) -> (u64, usize, usize) {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut comm: HashMap<u32, String> = HashMap::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return (0, 0, 0);
    };
    for e in rd.filter_map(Result::ok) {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        let ppid = stat[close + 1..]
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(pp) = ppid {
            children.entry(pp).or_default().push(pid);
        }
        comm.insert(pid, name);
    }
    let (mut total, mut n, mut unreadable) = (0u64, 0usize, 0usize);
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        if let Some(c) = children.get(&p) {
            stack.extend(c);
        }
        if p == root || comm.get(&p).map(String::as_str) != Some("rvisor-worker") {
            continue;
        }
        n += 1;
        let pss = std::fs::read_to_string(format!("/proc/{p}/smaps_rollup"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Pss:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            });
        match pss {
            Some(kb) => total += kb * 1024,
            None => unreadable += 1,
        }
    }
    (total, n, unreadable)
}
