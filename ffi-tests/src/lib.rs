//! Helpers shared by the tests against real R.

pub mod cluster;
pub mod confined;
pub mod durable;

use rvisor::{CallOptions, RunResult, Worker, WorkerConfig};
use std::path::{Path, PathBuf};

/// Starts a worker (the binary built next to the test executable). A
/// spawned worker is not confined (only the zygote forks confined ones):
/// these tests are about the worker itself; supervisors confine theirs.
pub fn worker() -> Worker {
    Worker::spawn(&WorkerConfig::default()).expect("worker starts")
}

/// Runs `code` with default options.
pub fn run(w: &mut Worker, code: &str) -> RunResult {
    w.run(code, &CallOptions::default())
}

/// The `rvisor` binary next to the test executable (`target/debug/rvisor`).
pub fn rvisor_bin() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("the test executable");
    let bin = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("target/debug")
        .join("rvisor");
    assert!(
        bin.is_file(),
        "{} is missing: run `cargo build --workspace` first",
        bin.display()
    );
    bin
}

/// The RunResult fields CONTRACT.md fixes (defined once, in the protocol).
pub use rvisor::RUN_RESULT_FIELDS;

/// `path` as the worker with host pid `pid` sees it, from the host: through
/// its root, `/proc/<pid>/root`. A confined worker's temporary directory is
/// a private tmpfs that only this reaches (the tests run as root, as
/// confinement requires).
pub fn inside(pid: u32, path: &Path) -> PathBuf {
    Path::new(&format!("/proc/{pid}/root")).join(path.strip_prefix("/").unwrap_or(path))
}

/// The parent of process `pid` (from /proc/<pid>/status), if it runs.
pub fn parent_pid(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))?
        .trim()
        .parse()
        .ok()
}

/// Polls `f` every 20 ms until it gives a value; fails the test as hung
/// after `deadline`.
pub fn wait_for<T>(
    what: &str,
    deadline: std::time::Duration,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let end = std::time::Instant::now() + deadline;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            std::time::Instant::now() < end,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A new directory of a test, removed when dropped.
#[derive(Debug)]
pub struct TestDir(PathBuf);

impl TestDir {
    /// `parent/<name>-<random>`.
    pub fn new_in(parent: &Path, name: &str) -> Self {
        let d = parent.join(format!("{name}-{}", rvisor::ids::random_hex(6)));
        std::fs::create_dir_all(&d).expect("create a test directory");
        TestDir(d)
    }

    /// A new directory in the host's temporary directory.
    pub fn new(name: &str) -> Self {
        Self::new_in(&std::env::temp_dir(), name)
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The real `rvisor serve` binary, unconfined unless asked (confinement is
/// not the subject of most tests that use it), on a free loopback port with
/// a data directory and a temporary directory of its own; killed when
/// dropped (its zygote's and workers' directories go with the temporary
/// one: a killed server cannot remove them, and each test left them in
/// /tmp).
#[derive(Debug)]
pub struct ServeBin {
    /// The server process.
    pub child: std::process::Child,
    /// `IP:PORT` it listens on (from its "listening on" line).
    pub addr: String,
    _dir: TestDir,
    _tmp: TestDir,
}

/// How [`ServeBin::start_with`] starts the server.
#[derive(Debug, Default)]
pub struct ServeOptions<'a> {
    /// `--tokens FILE`; `None`: `--no-auth`.
    pub tokens: Option<&'a Path>,
    /// `--listen IP:PORT`; `None`: a free loopback port.
    pub listen: Option<&'a str>,
    /// More flags, after the ones every test server gets.
    pub args: &'a [&'a str],
    /// Environment variables the server gets on top of the test's.
    pub env: Vec<(&'static str, String)>,
    /// Where to append what the server writes on stderr (its log); by
    /// default it is read and dropped.
    pub log: Option<PathBuf>,
    /// Confine the workers (the default in production); `false`: start it
    /// `--unconfined`.
    pub confined: bool,
}

impl ServeBin {
    /// Starts `rvisor --unconfined serve --no-auth` with `extra` flags and
    /// waits until it listens.
    pub fn start(extra: &[&str]) -> Self {
        Self::start_with(ServeOptions {
            args: extra,
            ..ServeOptions::default()
        })
    }

    /// Starts `rvisor serve` (`--unconfined` unless `opts.confined`) as
    /// `opts` say and waits until it listens.
    pub fn start_with(opts: ServeOptions<'_>) -> Self {
        use std::io::{BufRead, Read};
        let dir = TestDir::new("rvisor-serve-bin");
        // Confined workers (their own uids) reach their directories below it.
        let tmp = TestDir::new("rvisor-serve-tmp");
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755));
        }
        let mut cmd = std::process::Command::new(rvisor_bin());
        cmd.env("TMPDIR", tmp.path());
        if !opts.confined {
            cmd.arg("--unconfined");
        }
        cmd.args(["serve", "--listen", opts.listen.unwrap_or("127.0.0.1:0")]);
        match opts.tokens {
            Some(t) => cmd.arg("--tokens").arg(t),
            None => cmd.arg("--no-auth"),
        };
        let mut child = cmd
            .arg("--data-dir")
            .arg(dir.path())
            .args(opts.args)
            .envs(opts.env)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("rvisor serve starts");
        let mut err = std::io::BufReader::new(child.stderr.take().expect("stderr"));
        let mut addr = None;
        let mut line = String::new();
        while addr.is_none() {
            line.clear();
            if err.read_line(&mut line).unwrap_or(0) == 0 {
                panic!("rvisor serve {:?} ended before it listened", opts.args);
            }
            addr = line
                .split("listening on http://")
                .nth(1)
                .map(|a| a.trim().to_string());
        }
        // Keep draining stderr so the server never blocks on it.
        let log = opts.log.and_then(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .ok()
        });
        std::thread::spawn(move || match log {
            Some(mut f) => {
                let _ = std::io::copy(&mut err, &mut f);
            }
            None => {
                let mut sink = String::new();
                let _ = err.read_to_string(&mut sink);
            }
        });
        ServeBin {
            child,
            addr: addr.unwrap_or_default(),
            _dir: dir,
            _tmp: tmp,
        }
    }

    /// The server's peak resident memory so far (VmHWM), bytes.
    pub fn peak_rss(&self) -> u64 {
        self.status_bytes("VmHWM:")
    }

    /// The server's resident memory now (VmRSS), bytes.
    pub fn rss(&self) -> u64 {
        self.status_bytes("VmRSS:")
    }

    /// A `kB` field of the server's /proc/PID/status, in bytes (0 if it
    /// cannot be read).
    fn status_bytes(&self, field: &str) -> u64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or(0)
    }
}

impl Drop for ServeBin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
