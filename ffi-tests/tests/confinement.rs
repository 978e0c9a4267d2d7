//! OS confinement end to end: deliberately malicious R code (and native code
//! it loads) run through confined workers of the real supervisor, and
//! ordinary R that must keep working under the same confinement.
//!
//! Attack tests (`attack_*`) each run an attack and assert that it was
//! blocked, that nothing leaked into the result, and that the supervisor and
//! an unrelated sentinel session (with state) are unharmed. The comment on
//! each says which layer stops it. Every attack is bounded in time and size
//! and uses loopback only. Functional tests (`works_*`) show that normal R
//! still works confined.
//!
//! Native attacks build `tests/confinement/probe.c` with gcc at test time
//! into a host directory that the supervisor exposes read-only
//! (`Confinement.read_only`): the "noexec removed" case, where only the
//! kernel layers stand between the code and the host.
//!
//! Each test process gets its own range of worker uids, so that a fork bomb
//! here cannot use up the process limit of another test's workers (RLIMIT_NPROC
//! counts per uid, host-wide).
//!
//! The suite runs as root and as an ordinary user (rootless confinement:
//! `make test-rootless`). Rootless, every worker has the test's host uid and
//! a user namespace of its own, so what a test asks of "the worker's uid"
//! as root it asks of "the worker's user namespace" rootless (`Owner`);
//! the tests that need cgroups say so and skip when the host gives none.
//!
//! No test sleeps and hopes: waits poll a condition with a deadline.

use rvisor::tools::read_worker_file;
use rvisor::{
    CallContext, CallOptions, Confinement, Limits, Outcome, PoolConfig, Programs, RunOptions,
    RunResult, Session, SessionOptions, Supervisor, SupervisorConfig, Tool,
};
use rvisor_ffi_tests::confined::{
    assert_denied, assert_nobody_harmed, console, everything, rootless, run, secret, show, uid_of,
    verdicts, worker_pid, ATTEMPT, DEADLINE,
};
use rvisor_ffi_tests::{wait_for, TestDir};
use serde_json::{json, Value};
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A new host directory of this test, outside the host's /tmp (which a
/// confined worker cannot see), removed when dropped.
fn host_dir(name: &str) -> TestDir {
    TestDir::new_in(
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        &format!("confinement-{name}-{}", std::process::id()),
    )
}

/// The text every successful `id` prints.
const ID_OUTPUT: &str = "uid=";

// ---------------------------------------------------------------------------
// Helpers

/// This test process's own worker uid range (see the module comment). Kept
/// below the default range (2_100_000_000..) that other test files use.
fn uid_base() -> u32 {
    2_000_000_000 + (std::process::id() % 4_000_000) * 16
}

/// The default confinement, with this process's uid range.
fn confinement() -> Confinement {
    Confinement {
        uid_base: uid_base(),
        uid_count: 16,
        ..Confinement::default()
    }
}

fn supervisor_with(confinement: Confinement) -> Supervisor {
    Supervisor::new(SupervisorConfig {
        confinement,
        ..SupervisorConfig::default()
    })
    .expect("the supervisor starts confined")
}

/// A supervisor with the default (full) confinement.
fn supervisor() -> Supervisor {
    supervisor_with(confinement())
}

fn session(sup: &Supervisor) -> Session {
    sup.session().expect("a session is created")
}

/// Runs `code` once in a fresh confined worker (no validation: the library
/// call runs whatever it gets).
fn once(sup: &Supervisor, code: &str) -> RunResult {
    once_with(sup, code, &CallOptions::default(), Vec::new())
}

fn once_with(
    sup: &Supervisor,
    code: &str,
    opts: &CallOptions,
    variables: Vec<(String, Value)>,
) -> RunResult {
    let ctx = CallContext {
        variables,
        ..CallContext::default()
    };
    let r = sup.run_once_with(rvisor::ids::execution_id(), code, opts, &ctx);
    show(code, &r);
    r
}

/// Runs `code` once and asserts it completed; returns the console.
fn once_console(sup: &Supervisor, code: &str) -> String {
    let r = once(sup, code);
    assert_eq!(r.outcome, Outcome::Complete, "{code}:\n{}", r.console);
    r.console
}

/// `s` as an R string literal.
fn r_str(s: &str) -> String {
    let mut out = String::from("'");
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

fn r_path(p: &Path) -> String {
    r_str(p.to_str().expect("test paths are UTF-8"))
}

fn assert_no_leak(r: &RunResult, secret: &str) {
    assert!(
        !everything(r).contains(secret),
        "the secret {secret:?} leaked into the result:\n{}",
        everything(r)
    );
}

fn assert_nothing_executed(r: &RunResult) {
    assert!(
        !everything(r).contains(ID_OUTPUT),
        "a program ran (its output is in the result):\n{}",
        everything(r)
    );
}

/// A session in the same supervisor that holds state and must come through
/// every attack unharmed: same worker, same generation, same variable.
struct Sentinel {
    session: Session,
    value: String,
    pid: u32,
}

impl Sentinel {
    fn new(sup: &Supervisor) -> Self {
        let session = session(sup);
        let value = secret("sentinel");
        console(&session, &format!("sentinel_value <- {}", r_str(&value)));
        let pid = session.status().pid.expect("the sentinel's worker runs");
        Sentinel {
            session,
            value,
            pid,
        }
    }

    fn assert_unharmed(&self) {
        let r = run(&self.session, "cat(sentinel_value)");
        assert_eq!(
            r.outcome,
            Outcome::Complete,
            "the sentinel session was harmed:\n{}",
            r.console
        );
        assert_eq!(r.console, self.value, "the sentinel lost its state");
        assert_eq!(
            r.session.generation, 1,
            "the sentinel's worker was replaced"
        );
        assert_eq!(
            self.session.status().pid,
            Some(self.pid),
            "the sentinel's worker changed"
        );
    }
}

/// What sets a worker's processes apart on the host: its own uid as root;
/// rootless, its own user namespace (the uid is the test's).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Owner {
    Uid(u32),
    UserNs(PathBuf),
}

/// The owner of host process `pid` in this mode.
fn owner_of(pid: u32) -> Option<Owner> {
    if rootless() {
        std::fs::read_link(format!("/proc/{pid}/ns/user"))
            .ok()
            .map(Owner::UserNs)
    } else {
        uid_of(pid).map(Owner::Uid)
    }
}

/// Host processes (zombies included) of `owner`.
fn processes_of(owner: &Owner) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| owner_of(*pid).as_ref() == Some(owner))
        .collect()
}

/// Whether workers of `sup` get cgroups (not rootless here, nor on a host
/// without writable v1 controllers): the tests that need them skip
/// without, saying why.
fn has_cgroups(sup: &Supervisor, test: &str) -> bool {
    let layers = sup.health().sandbox.layers.join("\n");
    if layers.contains("cgroups: not used") {
        eprintln!(
            "skipped {test}: workers get no cgroups here ({})",
            layers
                .lines()
                .find(|l| l.starts_with("cgroups"))
                .unwrap_or_default()
        );
        return false;
    }
    true
}

/// Polls until `cond` holds; panics with `what` after [`DEADLINE`].
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    wait_for(what, DEADLINE, || cond().then_some(()));
}

/// The native attack probe, built with gcc into a host directory that the
/// supervisor exposes read-only.
struct Native {
    dir: TestDir,
    so: PathBuf,
}

fn build_native() -> Native {
    let dir = host_dir("native");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/confinement/probe.c");
    let so = dir.path().join("rvprobe.so");
    let out = Command::new("gcc")
        .args(["-O1", "-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "gcc is needed to build the native attack probe {} ({e}); install it \
                 (apt-get install gcc)",
                src.display()
            )
        });
    assert!(
        out.status.success(),
        "gcc failed to build {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Native { dir, so }
}

/// A supervisor whose workers may read (and load code from) the probe's
/// directory, with `limits`, and run no program (execve denied: a probe
/// that got through would replace the worker).
fn native_supervisor(native: &Native, limits: Limits) -> Supervisor {
    native_supervisor_with(native, limits, Programs::none())
}

fn native_supervisor_with(native: &Native, limits: Limits, programs: Programs) -> Supervisor {
    supervisor_with(Confinement {
        read_only: vec![native.dir.path().to_path_buf()],
        limits,
        programs,
        ..confinement()
    })
}

/// R code that loads the probe.
fn load_native(native: &Native) -> String {
    format!("dyn.load({})\n", r_path(&native.so))
}

/// libc's path on this host.
fn libc_path() -> PathBuf {
    [
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/aarch64-linux-gnu/libc.so.6",
        "/lib/aarch64-linux-gnu/libc.so.6",
        "/usr/lib64/libc.so.6",
        "/lib64/libc.so.6",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
    .expect("libc.so.6 is found")
}

/// errno names for messages.
fn errno_name(e: i64) -> String {
    match e {
        0 => "success".into(),
        -1 => "unknown probe".into(),
        e => format!("{e} ({})", std::io::Error::from_raw_os_error(e as i32)),
    }
}

// ---------------------------------------------------------------------------
// Attacks: what the confinement reports and what the worker is

/// Health says every worker is confined, and by which layers.
#[test]
fn attack_surface_health_reports_every_layer() {
    let sup = supervisor();
    let h = sup.health();
    assert_eq!(h.sandbox.mode, "confined");
    let privilege = if rootless() { "rootless" } else { "root" };
    assert_eq!(h.sandbox.privilege.as_deref(), Some(privilege));
    assert!(!h.sandbox.network, "network is off by default");
    let layers = h.sandbox.layers.join("\n");
    for want in [
        "namespaces",
        "mount",
        "pid",
        "net",
        "landlock",
        "seccomp",
        "rlimits",
        "credentials",
        "filesystem",
    ] {
        assert!(layers.contains(want), "no {want:?} in layers:\n{layers}");
    }
    let limits = h.sandbox.limits.expect("limits are reported");
    assert_eq!(limits, Limits::default());
}

/// The worker is no one: an unprivileged uid of its own, no capabilities,
/// no_new_privs, seccomp filter mode, no supplementary groups; it is pid 1
/// of its own pid namespace and sees only its own processes.
#[test]
fn attack_identity_worker_is_unprivileged() {
    let sup = supervisor();
    let c = once_console(
        &sup,
        r#"
st <- readLines("/proc/self/status")
for (f in c("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp"))
  cat(f, "=", trimws(sub("^[^:]*:", "", st[startsWith(st, paste0(f, ":"))])), "\n")
cat("effective_user =", Sys.info()[["effective_user"]], "\n")
cat("pid =", Sys.getpid(), "\n")
cat("procs =", length(list.files("/proc", pattern = "^[0-9]+$")), "\n")
"#,
    );
    let field = |name: &str| -> String {
        c.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} = ")))
            .unwrap_or_else(|| panic!("no {name} in:\n{c}"))
            .trim()
            .to_string()
    };
    for uid in field("Uid").split_whitespace() {
        let uid: u32 = uid.parse().expect("a uid");
        assert_ne!(uid, 0, "the worker runs as root:\n{c}");
        assert!(
            uid >= uid_base(),
            "the uid {uid} is not from the worker range"
        );
    }
    for gid in field("Gid").split_whitespace() {
        assert_ne!(gid, "0", "the worker runs with gid 0:\n{c}");
    }
    if rootless() {
        // setgroups is denied in a rootless worker's user namespace: the
        // user's groups stay, but none is mapped except its own (shown as
        // the worker's gid), the others are nogroup (65534), and no file
        // in the new root belongs to them.
        let gid = field("Gid");
        let gid = gid.split_whitespace().next().unwrap_or_default();
        for g in field("Groups").split_whitespace() {
            assert!(
                g == gid || g == "65534",
                "a supplementary group {g} is mapped into the worker:\n{c}"
            );
        }
    } else {
        assert_eq!(field("Groups"), "", "supplementary groups remain:\n{c}");
    }
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert_eq!(field(cap), "0000000000000000", "{cap} is not empty:\n{c}");
    }
    assert_eq!(field("NoNewPrivs"), "1", "{c}");
    assert_eq!(field("Seccomp"), "2", "{c}");
    assert_ne!(field("effective_user"), "root", "{c}");
    assert_eq!(
        field("pid"),
        "1",
        "the worker is not pid 1 of its namespace"
    );
    let procs: u32 = field("procs").parse().expect("a count");
    assert!(procs <= 2, "the worker sees {procs} processes:\n{c}");
}

// ---------------------------------------------------------------------------
// Attacks: files

/// Reading secrets: /etc/shadow, a host file outside every allowed path,
/// and whatever lies in the host's /tmp. Stopped by the new root (none of
/// them exists inside: only read-only binds of what R needs, a private tmpfs
/// at /tmp), with the uid and Landlock behind it.
#[test]
fn attack_read_shadow_host_files_and_host_tmp() {
    let host = host_dir("secret");
    let file_secret = secret("file");
    let host_file = host.path().join("secret.txt");
    std::fs::write(&host_file, &file_secret).unwrap();
    let tmp_secret = secret("tmp");
    let host_tmp_file =
        std::env::temp_dir().join(format!("rvisor-confine-{}", rvisor::ids::random_hex(8)));
    std::fs::write(&host_tmp_file, &tmp_secret).unwrap();
    let _cleanup = RemoveOnDrop(host_tmp_file.clone());

    let sup = supervisor();
    let sentinel = Sentinel::new(&sup);
    let code = format!(
        r#"{ATTEMPT}
.attempt("shadow", readLines("/etc/shadow"))
.attempt("gshadow", readLines("/etc/gshadow"))
.attempt("host_file", readLines({file}))
.attempt("host_file_dir", list.files({dir}))
.attempt("host_tmp_file", readLines({tmpfile}))
.attempt("host_tmp_via_root", readLines(file.path("/proc/1/root", {tmpfile})))
.attempt("proc_1_root_listing", list.files("/proc/1/root/tmp", recursive = TRUE))
cat("tmp listing:", list.files("/tmp", all.files = TRUE, recursive = TRUE), "\n")
cat("root listing:", list.files("/", all.files = TRUE), "\n")
cat("passwd:", readLines("/etc/passwd"), "\n")
"#,
        file = r_path(&host_file),
        dir = r_path(host.path()),
        tmpfile = r_path(&host_tmp_file),
    );
    let r = once(&sup, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_denied(
        &r.console,
        &[
            "shadow",
            "gshadow",
            "host_file",
            "host_tmp_file",
            "host_tmp_via_root",
        ],
    );
    // list.files() of a missing directory is character(0), not an error.
    let v = verdicts(&r.console);
    assert_eq!(v["host_file_dir"], "ALLOWED: ", "{}", r.console);
    assert_no_leak(&r, &file_secret);
    assert_no_leak(&r, &tmp_secret);
    // The paths appear in the error messages; the listings must not show
    // the host's /tmp.
    let tmp_name = host_tmp_file.file_name().unwrap().to_str().unwrap();
    let listing = r
        .console
        .lines()
        .filter(|l| l.starts_with("tmp listing:") || l.starts_with("proc_1_root_listing"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        !listing.contains(tmp_name),
        "the host's /tmp is visible:\n{}",
        r.console
    );
    // The worker's /etc/passwd is its own two-line file, not the host's.
    let host_passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    for line in host_passwd.lines().filter(|l| !l.starts_with("root:")) {
        assert!(
            !r.console.contains(line),
            "the host's /etc/passwd is visible:\n{}",
            r.console
        );
    }
    sentinel.assert_unharmed();
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Fingerprint of a host file: content and modification time (None when
/// missing).
fn fingerprint(p: &Path) -> Option<(Vec<u8>, std::time::SystemTime)> {
    let meta = std::fs::metadata(p).ok()?;
    Some((std::fs::read(p).ok()?, meta.modified().ok()?))
}

/// Writing outside the scratch space: R's own Rprofile.site (would poison
/// every later session), the base package's files, /etc/passwd, a file in
/// the read-only data directory. Every write only opens for append and
/// writes nothing (harmless even if it got through), plus one new file per
/// place; the host files must be unchanged afterwards. Stopped by the
/// read-only binds and the read-only root, Landlock (write only /tmp, the
/// temporary directory and /dev) and the unprivileged uid.
#[test]
fn attack_write_outside_the_scratch_space() {
    let data = host_dir("readonly");
    std::fs::write(data.path().join("data.csv"), "x\n1\n").unwrap();
    let r_home_etc = Path::new("/usr/lib/R/etc");
    let watched: Vec<PathBuf> = vec![
        r_home_etc.join("Rprofile.site"),
        PathBuf::from("/etc/R/Rprofile.site"),
        PathBuf::from("/usr/lib/R/library/base/R/base"),
        PathBuf::from("/usr/lib/R/library/base/DESCRIPTION"),
        PathBuf::from("/etc/passwd"),
        data.path().join("data.csv"),
    ];
    let before: Vec<_> = watched.iter().map(|p| fingerprint(p)).collect();
    let new_files: Vec<PathBuf> = vec![
        PathBuf::from("/usr/lib/R/etc/rvisor-pwned"),
        PathBuf::from("/usr/lib/R/library/base/rvisor-pwned"),
        PathBuf::from("/etc/rvisor-pwned"),
        data.path().join("rvisor-pwned"),
    ];
    for f in &new_files {
        assert!(!f.exists(), "{} exists before the test", f.display());
    }

    let sup = supervisor_with(Confinement {
        read_only: vec![data.path().to_path_buf()],
        ..confinement()
    });
    let sentinel = Sentinel::new(&sup);
    let code = format!(
        r#"{ATTEMPT}
.attempt("rprofile_site", cat("", file = file.path(R.home("etc"), "Rprofile.site"), append = TRUE))
.attempt("rprofile_site_new", file.create(file.path(R.home("etc"), "rvisor-pwned"), showWarnings = TRUE) || stop("not created"))
.attempt("base_R", cat("", file = file.path(R.home("library"), "base", "R", "base"), append = TRUE))
.attempt("base_description", cat("", file = system.file("DESCRIPTION", package = "base"), append = TRUE))
.attempt("base_new", file.create(file.path(R.home("library"), "base", "rvisor-pwned")) || stop("not created"))
.attempt("etc_passwd", cat("", file = "/etc/passwd", append = TRUE))
.attempt("etc_new", file.create("/etc/rvisor-pwned") || stop("not created"))
.attempt("data_csv", cat("", file = {data_csv}, append = TRUE))
.attempt("data_new", file.create({data_new}) || stop("not created"))
.attempt("chmod_base", Sys.chmod(file.path(R.home("library"), "base", "DESCRIPTION"), "777") || stop("not changed"))
.attempt("unlink_base", if (unlink(system.file("DESCRIPTION", package = "base")) != 0 ||
                            file.exists(system.file("DESCRIPTION", package = "base"))) stop("not removed"))
.attempt("rename_etc", file.rename("/etc/passwd", "/etc/passwd.old") || stop("not renamed"))
.attempt("home_rprofile", cat("", file = "/root/.Rprofile", append = TRUE))
.attempt("proc_sysrq", cat("", file = "/proc/sysrq-trigger", append = TRUE))
.attempt("proc_sys_hostname", cat("", file = "/proc/sys/kernel/hostname", append = TRUE))
.attempt("proc_self_oom", cat("", file = "/proc/self/oom_score_adj", append = TRUE))
.attempt("scratch_ok", writeLines("fine", file.path(tempdir(), "ok.txt")))
"#,
        data_csv = r_path(&data.path().join("data.csv")),
        data_new = r_path(&data.path().join("rvisor-pwned")),
    );
    let r = once(&sup, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    let after: Vec<_> = watched.iter().map(|p| fingerprint(p)).collect();
    let created: Vec<_> = new_files.iter().filter(|f| f.exists()).collect();
    for f in &created {
        let _ = std::fs::remove_file(f);
    }
    assert_denied(
        &r.console,
        &[
            "rprofile_site",
            "rprofile_site_new",
            "base_R",
            "base_description",
            "base_new",
            "etc_passwd",
            "etc_new",
            "data_csv",
            "data_new",
            "chmod_base",
            "unlink_base",
            "rename_etc",
            "home_rprofile",
            "proc_sysrq",
            "proc_sys_hostname",
        ],
    );
    assert!(
        verdicts(&r.console)["scratch_ok"].starts_with("ALLOWED"),
        "the scratch space must stay writable:\n{}",
        r.console
    );
    assert!(
        created.is_empty(),
        "files were created on the host: {created:?}"
    );
    for ((p, b), a) in watched.iter().zip(&before).zip(&after) {
        assert_eq!(b, a, "{} changed on the host", p.display());
    }
    sentinel.assert_unharmed();
}

/// A file left in /tmp or the temporary directory by one run (a poisoned
/// .Rprofile, a script for later) is gone for the next session: each worker
/// has its own tmpfs. Stopped by the private scratch space.
#[test]
fn attack_persist_files_for_the_next_session() {
    let sup = supervisor();
    let marker = secret("persist");
    let a = session(&sup);
    let wrote = console(
        &a,
        &format!(
            r#"writeLines({m}, "/tmp/rvisor-persist.R")
writeLines({m}, file.path(tempdir(), "..", ".Rprofile"))
writeLines({m}, file.path(getwd(), ".Rprofile"))
cat(getwd(), "\n")"#,
            m = r_str(&format!("cat('{marker}')")),
        ),
    );
    let b = session(&sup);
    let r = run(
        &b,
        r#"cat("tmp:", list.files("/tmp", all.files = TRUE, recursive = TRUE), "\n")
cat("persist:", file.exists("/tmp/rvisor-persist.R"), "\n")"#,
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(r.console.contains("persist: FALSE"), "{}", r.console);
    assert_no_leak(&r, &marker);
    assert!(!r.console.contains("rvisor-persist"), "{}", r.console);
    // Nor did anything reach the host's /tmp.
    assert!(!Path::new("/tmp/rvisor-persist.R").exists());
    let a_dir = wrote.lines().last().unwrap_or_default().trim().to_string();
    if !a_dir.is_empty() {
        assert!(
            !Path::new(&a_dir).join(".Rprofile").exists(),
            "the worker's .Rprofile reached the host at {a_dir}"
        );
    }
}

// ---------------------------------------------------------------------------
// Attacks: network

/// R reaches for a TCP service on the host's loopback: url(), the libcurl
/// and internal download methods, socketConnection(), make.socket(). Stopped
/// by the network namespace (its loopback is not the host's), Landlock (TCP
/// connect denied) and seccomp (no AF_INET sockets). The listener must never
/// see a connection.
#[test]
fn attack_network_to_a_loopback_listener() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let sup = supervisor();
    let sentinel = Sentinel::new(&sup);
    let code = format!(
        r#"{ATTEMPT}
options(timeout = 5)
u <- "http://127.0.0.1:{port}/secret"
.attempt("url", readLines(url(u)))
.attempt("url_libcurl", readLines(url(u, method = "libcurl")))
.attempt("url_localhost", readLines(url("http://localhost:{port}/")))
.attempt("download_libcurl", download.file(u, tempfile(), method = "libcurl", quiet = TRUE))
.attempt("download_internal", download.file(u, tempfile(), method = "internal", quiet = TRUE))
.attempt("download_default", download.file(u, tempfile(), quiet = TRUE))
.attempt("socket_connection", {{
  con <- socketConnection("127.0.0.1", {port}, blocking = TRUE, timeout = 5)
  writeLines("GET / HTTP/1.0\r\n", con); close(con) }})
.attempt("make_socket", utils::make.socket("127.0.0.1", {port}))
.attempt("server_socket", serverSocket(0L))
"#
    );
    let r = once(&sup, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_denied(
        &r.console,
        &[
            "url",
            "url_libcurl",
            "url_localhost",
            "download_libcurl",
            "download_internal",
            "download_default",
            "socket_connection",
            "make_socket",
            "server_socket",
        ],
    );
    match listener.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        Ok((_, peer)) => panic!("the worker connected to the host's loopback from {peer}"),
        Err(e) => panic!("accept failed: {e}"),
    }
    sentinel.assert_unharmed();
}

// ---------------------------------------------------------------------------
// Attacks: running programs

/// R runs programs every way it can: system(), system2(), pipe(),
/// .Internal(system()), and libc's system() and popen() through dyn.load +
/// .C; prints whether `id`'s output reached its redirect target.
fn run_programs_attack(sup: &Supervisor) -> RunResult {
    let code = format!(
        r#"{ATTEMPT}
mark <- file.path(tempdir(), "pwned")
cmd <- paste("id >", mark)
ran <- function() file.exists(mark) && any(grepl("uid=", readLines(mark, warn = FALSE)))
.attempt("system_intern", system("id", intern = TRUE))
.attempt("system", {{ s <- system(cmd); if (s != 0) stop("status ", s); s }})
.attempt("system2", system2("id", stdout = TRUE))
.attempt("pipe", readLines(pipe("id")))
.attempt("internal_system", .Internal(system("id", TRUE, 0)))
.attempt("shell_via_sh", {{ s <- system2("/bin/sh", c("-c", shQuote(cmd)), stdout = TRUE); if (!ran()) stop("not run"); s }})
.attempt("libc_system_raw", {{
  dyn.load({libc})
  .C("system", c(charToRaw(cmd), as.raw(0)))
  if (!ran()) stop("not run")
}})
.attempt("libc_popen_raw", {{
  .C("popen", c(charToRaw(cmd), as.raw(0)), c(charToRaw("r"), as.raw(0)))
  if (!ran()) stop("not run")
}})
cat("marker exists:", file.exists(mark), "\n")
cat("id ran:", ran(), "\n")
"#,
        libc = r_path(&libc_path()),
    );
    let r = once(sup, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_nothing_executed(&r);
    assert!(r.console.contains("id ran: FALSE"), "{}", r.console);
    r
}

/// Without any program allowed: every way fails, stopped by seccomp
/// (execve denied) and Landlock (nothing executable), before a shell can
/// even make the redirect target.
#[test]
fn attack_run_programs_with_none_allowed() {
    let sup = supervisor_with(Confinement {
        programs: Programs::none(),
        ..confinement()
    });
    let sentinel = Sentinel::new(&sup);
    let r = run_programs_attack(&sup);
    assert_denied(
        &r.console,
        &[
            "system_intern",
            "system",
            "system2",
            "pipe",
            "internal_system",
            "shell_via_sh",
            "libc_system_raw",
            "libc_popen_raw",
        ],
    );
    assert!(r.console.contains("marker exists: FALSE"), "{}", r.console);
    sentinel.assert_unharmed();
}

/// With programs allowed (here `cat`, and so the shell): the shell starts,
/// and `id` still never runs, whichever way it is asked for. Stopped by
/// Landlock (execute only the allowed files) and the noexec program
/// directories.
#[test]
fn attack_run_programs_with_programs_allowed() {
    let sup = supervisor_with(Confinement {
        programs: Programs::only(["cat"]),
        ..confinement()
    });
    let sentinel = Sentinel::new(&sup);
    let r = run_programs_attack(&sup);
    assert_denied(
        &r.console,
        &[
            "system",
            "shell_via_sh",
            "libc_system_raw",
            "libc_popen_raw",
        ],
    );
    sentinel.assert_unharmed();
}

/// The static-check bypasses of SANDBOX-NOTES.md, each run unvalidated in a
/// fresh worker: none may run anything. Stopped by seccomp and Landlock
/// (the OS layer, not a name list, is the boundary).
#[test]
fn attack_static_check_bypasses_run_nothing() {
    let sup = supervisor();
    let sentinel = Sentinel::new(&sup);
    let bypasses = [
        r#"get(paste0("sys", "tem"))("id")"#,
        r#"do.call(paste0("sys", "tem"), list("id"))"#,
        r#"eval(parse(text = rawToChar(charToRaw("system('id')"))))"#,
        r#"eval(parse(text = rawToChar(as.raw(c(0x73, 0x79, 0x73, 0x74, 0x65, 0x6d, 0x28, 0x22, 0x69, 0x64, 0x22, 0x29)))))"#,
        r#"match.fun(chartr("XY", "st", "XyXYem"))("id")"#,
        r#"getExportedValue("base", intToUtf8(c(115, 121, 115, 116, 101, 109)))("id")"#,
        r#"readLines(pipe("id"))"#,
        r#"base::system("id")"#,
        r#"baseenv()$system("id")"#,
        r#"asNamespace("base")[["system"]]("id")"#,
        r#"get("system", envir = baseenv())("id", intern = TRUE)"#,
        r#"(function(f) f("id"))(base::system2)"#,
    ];
    for b in bypasses {
        // Blocked: an error, or the exit status 127 of a shell that could
        // not be started (system() without intern), or no output at all.
        let code = format!(
            r#"r <- tryCatch(withCallingHandlers({b}, warning = function(w) invokeRestart("muffleWarning")),
              error = function(e) structure("DENIED", msg = conditionMessage(e)))
print(r)
cat("BLOCKED:", identical(as.vector(r), "DENIED") || (is.numeric(r) && all(r != 0)) ||
    (is.character(r) && length(r) == 0), "\n")"#
        );
        let r = once(&sup, &code);
        assert_eq!(r.outcome, Outcome::Complete, "{b}: {}", everything(&r));
        assert_nothing_executed(&r);
        assert!(
            r.console.contains("BLOCKED: TRUE"),
            "{b} was not blocked:\n{}",
            r.console
        );
    }
    sentinel.assert_unharmed();
}

// ---------------------------------------------------------------------------
// Attacks: native code

/// A shared object written at run time into tempdir() cannot be loaded:
/// the scratch tmpfs is noexec (mmap with PROT_EXEC fails). R copies a real
/// .so (from R's own library) there, marks it executable, and dyn.loads it.
#[test]
fn attack_load_a_shared_object_written_at_run_time() {
    let sup = supervisor();
    let sentinel = Sentinel::new(&sup);
    let code = format!(
        r#"{ATTEMPT}
src <- system.file("libs", "stats.so", package = "stats")
if (!nzchar(src)) src <- list.files(file.path(R.home("library"), "stats", "libs"), full.names = TRUE)[1]
for (dir in c(tempdir(), "/tmp", getwd())) {{
  f <- file.path(dir, paste0("evil", basename(dir), ".so"))
  stopifnot(file.copy(src, f, overwrite = TRUE))
  Sys.chmod(f, "755")
  .attempt(paste0("dyn_load_", dir), dyn.load(f))
}}
.attempt("dyn_load_dev_shm", {{ stopifnot(file.copy(src, "/dev/shm/evil.so")); dyn.load("/dev/shm/evil.so") }})
"#
    );
    let r = once(&sup, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    let v = verdicts(&r.console);
    let loads: Vec<_> = v
        .iter()
        .filter(|(k, _)| k.starts_with("dyn_load_"))
        .collect();
    assert_eq!(loads.len(), 4, "{}", r.console);
    for (k, verdict) in loads {
        assert!(
            verdict.starts_with("DENIED"),
            "{k}: a shared object written at run time was loaded: {verdict}\n{}",
            r.console
        );
    }
    sentinel.assert_unharmed();
}

/// Native code (the "noexec removed" case: a .so in a read-only directory
/// the host exposed) makes the system calls a breakout needs. Each must
/// fail with EPERM/EACCES (seccomp, capabilities, Landlock) or ENOSYS
/// (clone3, so that glibc falls back to a clone whose flags seccomp reads).
#[test]
fn attack_native_system_calls_are_denied() {
    let native = build_native();
    let sup = native_supervisor(&native, Limits::default());
    let sentinel = Sentinel::new(&sup);
    const EPERM: i64 = libc::EPERM as i64;
    const EACCES: i64 = libc::EACCES as i64;
    const ENOSYS: i64 = libc::ENOSYS as i64;
    let denied = [EPERM, EACCES];
    // (probe, accepted errnos); execve comes last: if it got through, the
    // worker would be gone.
    let probes: Vec<(&str, Vec<i64>)> = vec![
        ("ptrace_attach_child", denied.to_vec()),
        ("ptrace_attach_init", denied.to_vec()),
        ("process_vm_readv_self", denied.to_vec()),
        ("process_vm_writev_self", denied.to_vec()),
        ("socket_inet_tcp", denied.to_vec()),
        ("socket_inet_udp", denied.to_vec()),
        ("socket_inet_raw", denied.to_vec()),
        ("socket_inet6_tcp", denied.to_vec()),
        ("socket_netlink", denied.to_vec()),
        ("socket_packet", denied.to_vec()),
        ("socket_vsock", denied.to_vec()),
        ("socketpair_inet", denied.to_vec()),
        ("mount_tmpfs", denied.to_vec()),
        ("umount_proc", denied.to_vec()),
        ("unshare_user", denied.to_vec()),
        ("unshare_net", denied.to_vec()),
        ("unshare_mount", denied.to_vec()),
        ("clone_newuser", denied.to_vec()),
        ("clone_newns", denied.to_vec()),
        ("clone3_plain", vec![ENOSYS]),
        ("setns_self", denied.to_vec()),
        ("chroot_tmp", denied.to_vec()),
        ("pivot_root", denied.to_vec()),
        ("bpf", denied.to_vec()),
        ("keyctl", denied.to_vec()),
        ("io_uring_setup", denied.to_vec()),
        ("perf_event_open", denied.to_vec()),
        ("userfaultfd", denied.to_vec()),
        ("reboot_bad_magic", denied.to_vec()),
        ("init_module_null", denied.to_vec()),
        // Rootless, uid and gid 0 do not exist in the worker's user
        // namespace: EINVAL.
        ("setuid_root", [EPERM, EACCES, libc::EINVAL as i64].to_vec()),
        ("setgid_root", [EPERM, EACCES, libc::EINVAL as i64].to_vec()),
        ("mknod_block_device", denied.to_vec()),
        ("raise_nproc_limit", denied.to_vec()),
        ("raise_as_limit", denied.to_vec()),
        ("sethostname", denied.to_vec()),
        ("exec_mmap_tmp", denied.to_vec()),
        // Not there at all in the new root; any failure will do.
        ("open_shadow", vec![libc::ENOENT as i64, EACCES]),
        ("fexecve_memfd", denied.to_vec()),
        ("execveat_sh", denied.to_vec()),
        ("execve_sh", denied.to_vec()),
    ];
    let names: Vec<String> = probes.iter().map(|(n, _)| r_str(n)).collect();
    let code = format!(
        r#"{load}
for (p in c({names})) cat(p, "=", .C("rv_probe", p, err = integer(1))$err, "\n")
fds <- .C("rv_fd_kinds", dirs = integer(1), regular = integer(1), other = integer(1))
cat("open directories =", fds$dirs, "\n")
"#,
        load = load_native(&native),
        names = names.join(", "),
    );
    let r = once(&sup, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    assert_nothing_executed(&r);
    let mut failures = Vec::new();
    for (name, ok) in &probes {
        let got = r
            .console
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} = ")))
            .and_then(|v| v.trim().parse::<i64>().ok());
        match got {
            Some(e) if ok.contains(&e) => {}
            Some(e) => failures.push(format!(
                "{name}: got {}, wanted one of {:?}",
                errno_name(e),
                ok.iter().map(|e| errno_name(*e)).collect::<Vec<_>>()
            )),
            None => failures.push(format!("{name}: no report")),
        }
    }
    // No directory descriptor was inherited (one would lead out of the new
    // root with openat(fd, "..")).
    assert!(r.console.contains("open directories = 0 "), "{}", r.console);
    assert!(
        failures.is_empty(),
        "system calls that were not denied:\n{}\nconsole:\n{}",
        failures.join("\n"),
        r.console
    );
    sentinel.assert_unharmed();
}

/// Native code runs `id` through libc's system() and execve(): nothing may
/// run, and the worker stays usable. Stopped by seccomp (execve).
#[test]
fn attack_native_exec_runs_nothing() {
    let native = build_native();
    let sup = native_supervisor(&native, Limits::default());
    let s = session(&sup);
    let r = run(
        &s,
        &format!(
            "{}cat('status =', .C('rv_system', status = integer(1))$status, '\\n')\n\
             cat('execve =', .C('rv_probe', 'execve_sh', err = integer(1))$err, '\\n')",
            load_native(&native)
        ),
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    assert_nothing_executed(&r);
    assert!(!r.console.contains("status = 0 "), "{}", r.console);
    assert!(
        r.console.contains(&format!("execve = {} ", libc::EPERM)),
        "{}",
        r.console
    );
    assert_eq!(console(&s, "cat(1 + 1)"), "2");
}

// ---------------------------------------------------------------------------
// Programs: the operator's allow-list (docs/confinement.md, "Programs")

/// A supervisor whose workers may run exactly `programs` (with the shell
/// and the interpreters they need).
fn programs_supervisor(programs: &[&str]) -> Supervisor {
    supervisor_with(Confinement {
        programs: Programs::only(programs.iter().copied()),
        ..confinement()
    })
}

/// [`confinement`] with a uid range of its own (`slot` 1, 2, ...) and no
/// cgroups, for a test's second and third supervisor: the first may still
/// hold its range for a moment after it is dropped, and the supervisors of
/// one process share its cgroup parent (`rvisor-<pid>`), which the first
/// removes when it goes.
fn confinement_in(slot: u32) -> Confinement {
    Confinement {
        uid_base: 1_600_000_000 + (std::process::id() % 1_000_000) * 64 + slot * 16,
        uid_count: 16,
        cgroups: rvisor::CgroupMode::Off,
        ..Confinement::default()
    }
}

/// The allow-list health reports.
fn allowed_programs(sup: &Supervisor) -> Vec<rvisor::AllowedProgram> {
    sup.health()
        .sandbox
        .programs
        .expect("a confined supervisor lists its programs")
}

/// The first executable `name` on the workers' PATH, as the shell finds it.
fn on_worker_path(name: &str) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    ["/usr/local/bin", "/usr/bin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Health (the library's, as HTTP and MCP give it) lists the allowed
/// programs with the shell and the ELF interpreter they bring, each as the
/// file the worker may execute; with none allowed the list is empty and
/// execve is denied; by default it holds pandoc when pandoc is installed.
#[test]
fn programs_health_lists_the_allow_list() {
    let sup = programs_supervisor(&["id"]);
    let list = allowed_programs(&sup);
    let id = list.iter().find(|p| p.name == "id").expect("id is listed");
    assert_eq!(id.reason, "allowed", "{list:?}");
    let real = |p: &str| std::fs::canonicalize(p).unwrap().display().to_string();
    assert_eq!(id.file, real(&id.path), "{list:?}");
    let sh = list
        .iter()
        .find(|p| p.reason == "shell")
        .expect("the shell");
    assert_eq!((sh.name.as_str(), sh.path.as_str()), ("sh", "/bin/sh"));
    assert_eq!(sh.file, real("/bin/sh"));
    assert!(
        list.iter().any(|p| p.reason == "interpreter"),
        "the ELF interpreter comes along: {list:?}"
    );
    for p in &list {
        assert!(
            Path::new(&p.file).is_absolute() && Path::new(&p.file).is_file(),
            "{p:?}"
        );
    }
    let h = serde_json::to_value(sup.health()).unwrap();
    let first = &h["sandbox"]["programs"][0];
    assert_eq!(first["name"], "id", "{h}");
    for key in ["path", "file", "reason"] {
        assert!(first[key].is_string(), "{key} in {first}");
    }
    let layers = sup.health().sandbox.layers.join("\n");
    assert!(layers.contains("programs: id ("), "{layers}");
    assert!(layers.contains("execve let through"), "{layers}");
    // One supervisor at a time: a test process has one block of uids.
    drop(sup);

    let none = supervisor_with(Confinement {
        programs: Programs::none(),
        ..confinement_in(1)
    });
    assert_eq!(none.health().sandbox.programs, Some(vec![]));
    let layers = none.health().sandbox.layers.join("\n");
    assert!(layers.contains("programs: none (execve denied"), "{layers}");
    assert!(layers.contains("seccomp: execve,"), "{layers}");
    drop(none);

    let default = allowed_programs(&supervisor_with(confinement_in(2)));
    let pandoc = default.iter().find(|p| p.name == "pandoc");
    match on_worker_path("pandoc") {
        Some(_) => assert_eq!(pandoc.map(|p| p.reason.as_str()), Some("default")),
        None => assert!(pandoc.is_none(), "{default:?}"),
    }
}

/// A program that cannot be found is a start-up error that says which and
/// where it was looked for; so is a relative path.
#[test]
fn programs_a_missing_program_is_a_startup_error() {
    for (program, want) in [
        ("rvisor-no-such-program", "no such program on PATH"),
        ("bin/sh", "must be absolute"),
        ("/usr/bin/rvisor-no-such-program", "no such executable file"),
    ] {
        let err = Supervisor::new(SupervisorConfig {
            confinement: Confinement {
                programs: Programs::only([program]),
                ..confinement()
            },
            ..SupervisorConfig::default()
        })
        .expect_err("the supervisor refuses to start");
        let msg = err.to_string();
        assert!(
            msg.contains(program) && msg.contains(want) && msg.contains("--allow-program"),
            "{msg}"
        );
    }
}

/// `GET /v1/health` of a confined `rvisor serve --allow-program id` lists
/// the programs next to the fields it had (`mode`, `privilege`, `layers`);
/// `rvisor health` prints them, `--allow-program none` empties the list,
/// and a missing program keeps the command from starting.
#[test]
fn programs_health_endpoint_and_cli_show_the_list() {
    let srv = rvisor_ffi_tests::ServeBin::start_with(rvisor_ffi_tests::ServeOptions {
        confined: true,
        args: &["--allow-program", "id"],
        ..Default::default()
    });
    let h: Value = ureq::get(&format!("http://{}/v1/health", srv.addr))
        .timeout(DEADLINE)
        .call()
        .expect("health answers")
        .into_json()
        .unwrap();
    let sandbox = &h["sandbox"];
    assert_eq!(sandbox["mode"], "confined", "{h}");
    assert!(sandbox["privilege"].is_string(), "{h}");
    assert!(sandbox["layers"].is_array(), "{h}");
    let programs = sandbox["programs"].as_array().expect("sandbox.programs");
    let names: Vec<&str> = programs.iter().filter_map(|p| p["name"].as_str()).collect();
    assert!(names.contains(&"id") && names.contains(&"sh"), "{h}");
    drop(srv);

    let cli = |args: &[&str]| {
        Command::new(rvisor_ffi_tests::rvisor_bin())
            .args(args)
            .output()
            .expect("rvisor runs")
    };
    let out = cli(&["--allow-program", "id", "health"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("programs workers may run:"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.trim_start().starts_with("id ") && l.contains("allowed")),
        "{text}"
    );
    let out = cli(&["--allow-program", "none", "health", "--json"]);
    let j: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["sandbox"]["programs"], json!([]), "{j}");
    let out = cli(&["--allow-program", "rvisor-no-such-program", "health"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("rvisor-no-such-program") && err.contains("PATH"),
        "{err}"
    );
}

/// An allowed program runs as confined as the worker that starts it: the
/// worker's uid, rlimits, seccomp filter, pid namespace and Landlock
/// domain; it cannot write outside the worker's scratch space, reach the
/// host's loopback, or run a program that is not allowed itself, nor map
/// one through the dynamic loader (`ld.so PROGRAM`).
#[test]
fn programs_an_allowed_program_runs_confined() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let sup = programs_supervisor(&["id", "bash", "touch", "env"]);
    let ld_so = allowed_programs(&sup)
        .into_iter()
        .find(|p| p.reason == "interpreter")
        .expect("an ELF interpreter")
        .path;
    let sentinel = Sentinel::new(&sup);
    let s = session(&sup);
    let pid = worker_pid(&s);
    let code = format!(
        r#"out <- function(cmd) paste(suppressWarnings(system(cmd, intern = TRUE)), collapse = " ")
bash_lines <- function(f) suppressWarnings(system(paste0("bash -c 'while IFS= read -r l; do echo \"$l\"; done < ", f, "'"), intern = TRUE))
cat("uid:", out("id -u"), file.info(tempdir())$uid, "\n")
keys <- c("Max address space", "Max processes", "Max file size", "Max open files", "Max core file size")
mine <- readLines("/proc/self/limits"); theirs <- bash_lines("/proc/self/limits")
pick <- function(x) sort(x[startsWith(x, keys[1]) | startsWith(x, keys[2]) | startsWith(x, keys[3]) | startsWith(x, keys[4]) | startsWith(x, keys[5])])
cat("same limits:", identical(gsub(" +", " ", pick(mine)), gsub(" +", " ", pick(theirs))), length(pick(theirs)), "\n")
st <- bash_lines("/proc/self/status")
cat("status:", gsub("\t", "", st[grepl("^(Seccomp|NoNewPrivs|CapEff):", st)]), "\n")
cat("pids:", out("bash -c 'echo $$ /proc/[0-9]*'"), "\n")
ok <- file.path(tempdir(), "ok")
cat("touch inside:", out(paste("touch", ok, "; echo $?")), file.exists(ok), "\n")
cat("touch outside:", out("for f in /usr/lib/rv-pwned /etc/rv-pwned /rv-pwned /var/rv-pwned; do touch $f 2>/dev/null; echo $?; done"), "\n")
cat("tcp:", out("bash -c 'exec 3<>/dev/tcp/127.0.0.1/{port}' 2>&1; echo $?"), "\n")
cat("exec others:", out("env whoami 2>/dev/null; echo $?; bash -c 'exec /usr/bin/whoami' 2>/dev/null; echo $?; sh -c whoami 2>/dev/null; echo $?"), "\n")
cat("ld.so:", out("{ld_so} /usr/bin/whoami 2>/dev/null; echo $?"), "\n")
"#
    );
    let r = run(&s, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    let line = |label: &str| -> Vec<String> {
        r.console
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{label}: ")))
            .unwrap_or_else(|| panic!("no {label:?} line:\n{}", r.console))
            .split_whitespace()
            .map(str::to_string)
            .collect()
    };
    let uid = line("uid");
    assert_eq!(uid[0], uid[1], "id -u is the worker's uid:\n{}", r.console);
    if !rootless() {
        assert_eq!(
            uid[0],
            uid_of(pid).expect("the worker's uid").to_string(),
            "{}",
            r.console
        );
    }
    assert_eq!(line("same limits"), ["TRUE", "5"], "{}", r.console);
    let status = line("status").join(" ");
    for want in ["Seccomp:2", "NoNewPrivs:1", "CapEff:0000000000000000"] {
        assert!(status.contains(want), "{want} in {status}");
    }
    let pids = line("pids");
    let own: u32 = pids[0].parse().expect("bash's pid");
    assert!(own < 64, "bash is in the worker's pid namespace: {pids:?}");
    assert!(
        pids[1..].contains(&"/proc/1".to_string()) && pids.len() < 20,
        "only the worker's own processes are in view: {pids:?}"
    );
    assert_eq!(line("touch inside"), ["0", "TRUE"], "{}", r.console);
    let outside = line("touch outside");
    assert_eq!(outside.len(), 4, "{}", r.console);
    assert!(outside.iter().all(|s| s != "0"), "{}", r.console);
    for p in [
        "/usr/lib/rv-pwned",
        "/etc/rv-pwned",
        "/rv-pwned",
        "/var/rv-pwned",
    ] {
        assert!(!Path::new(p).exists(), "{p} was written on the host");
    }
    let tcp = line("tcp").join(" ");
    assert!(!tcp.ends_with(" 0") && tcp != "0", "{tcp}");
    assert!(
        tcp.contains("Operation not permitted"),
        "seccomp (inherited) denies the socket: {tcp}"
    );
    assert_eq!(line("exec others"), ["126", "126", "126"], "{}", r.console);
    // The loader's own error status, and nothing the program printed.
    let ld = line("ld.so");
    assert!(ld.len() == 1 && ld[0] != "0", "{}", r.console);
    match listener.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        Ok((_, peer)) => panic!("an allowed program connected to the host's loopback from {peer}"),
        Err(e) => panic!("accept failed: {e}"),
    }
    sentinel.assert_unharmed();
}

/// Native code in a worker that may run programs (execve let through) can
/// still execute nothing else: not a program off the list, not a copy of
/// an allowed one in its scratch space, not a memfd (memfd_create is
/// denied: Landlock would not check its execution); it cannot map a
/// program executable for the dynamic loader, and access(X_OK) says no.
#[test]
fn programs_native_code_cannot_execute_anything_else() {
    let native = build_native();
    let sup = native_supervisor_with(&native, Limits::default(), Programs::only(["cat"]));
    let sentinel = Sentinel::new(&sup);
    const EPERM: i64 = libc::EPERM as i64;
    const EACCES: i64 = libc::EACCES as i64;
    let probes: Vec<(&str, Vec<i64>)> = vec![
        ("execve_id", vec![EACCES]),
        ("execveat_id", vec![EACCES]),
        ("execve_copy_in_tmp", vec![EACCES]),
        ("mmap_exec_program", vec![EPERM, EACCES]),
        ("access_x_program", vec![EACCES]),
        ("fexecve_memfd", vec![EPERM]),
        ("memfd_secret", vec![EPERM]),
    ];
    let names: Vec<String> = probes.iter().map(|(n, _)| r_str(n)).collect();
    let code = format!(
        r#"{load}
for (p in c({names})) cat(p, "=", .C("rv_probe", p, err = integer(1))$err, "\n")
cat("status =", .C("rv_system", status = integer(1))$status, "\n")
"#,
        load = load_native(&native),
        names = names.join(", "),
    );
    let r = once(&sup, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    assert_nothing_executed(&r);
    let mut failures = Vec::new();
    for (name, ok) in &probes {
        let got = r
            .console
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} = ")))
            .and_then(|v| v.trim().parse::<i64>().ok());
        match got {
            Some(e) if ok.contains(&e) => {}
            other => failures.push(format!(
                "{name}: got {:?}, wanted one of {:?}",
                other.map(errno_name),
                ok.iter().map(|e| errno_name(*e)).collect::<Vec<_>>()
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "not refused:\n{}\n{}",
        failures.join("\n"),
        r.console
    );
    // libc's system() starts the (allowed) shell, which cannot run `id`.
    assert!(!r.console.contains("status = 0 "), "{}", r.console);
    sentinel.assert_unharmed();
}

/// A program allowed by its path outside the system paths is bound into
/// the worker's view, alone (its directory's other files stay out), and
/// found by its name: its directory comes first on the worker's PATH.
#[test]
fn programs_one_outside_the_system_paths_is_bound_in_and_found_by_name() {
    // Outside /tmp, which workers see as their own: a checkout under
    // /tmp has its target/ (CARGO_TARGET_TMPDIR) there.
    let dir = TestDir::new_in(
        Path::new("/var/tmp"),
        &format!("rvisor-confinement-elsewhere-{}", std::process::id()),
    );
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let tool = bin.join("rv-id");
    std::fs::copy(on_worker_path("id").expect("id is installed"), &tool).unwrap();
    std::fs::write(bin.join("neighbour.txt"), "not for the worker").unwrap();
    let sup = programs_supervisor(&[tool.to_str().unwrap()]);
    let code = format!(
        r#"cat("which:", Sys.which("rv-id"), "|\n")
cat("runs:", system("rv-id -u", intern = TRUE), file.info(tempdir())$uid, "\n")
cat("neighbour:", file.exists({neighbour}), "\n")
"#,
        neighbour = r_path(&bin.join("neighbour.txt"))
    );
    let r = once(&sup, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    assert!(
        r.console.contains(&format!("which: {} |", tool.display())),
        "{}",
        r.console
    );
    let runs: Vec<&str> = r
        .console
        .lines()
        .find_map(|l| l.strip_prefix("runs: "))
        .expect("a runs line")
        .split_whitespace()
        .collect();
    assert!(runs.len() == 2 && runs[0] == runs[1], "{}", r.console);
    assert!(r.console.contains("neighbour: FALSE"), "{}", r.console);
}

/// A program that is not allowed is refused with a message that says so:
/// rvisor, the program, the allow-list and the flag that allows it, on
/// system(), system(intern = TRUE) and system2(); with no program allowed
/// at all as well (the `which pandoc` of the issue). Never "Cannot
/// allocate memory"; a program that is not installed keeps R's own words.
#[test]
fn programs_a_refused_program_says_why() {
    let code = r#"msg <- function(expr) tryCatch(withCallingHandlers(expr, warning = function(w) {
    cat("call:", deparse(conditionCall(w)), "\n"); invokeRestart("muffleWarning") }),
  error = function(e) paste("ERROR", conditionMessage(e)))
grab <- function(label, expr) {
  m <- character()
  r <- tryCatch(withCallingHandlers(expr, warning = function(w) {
      m <<- c(m, conditionMessage(w)); invokeRestart("muffleWarning") }),
    error = function(e) { m <<- c(m, paste("ERROR", conditionMessage(e))); NULL })
  cat(label, "=>", if (length(m)) m else "(none)", "| value", if (is.numeric(r)) r else length(r), "\n")
}
grab("system", system("whoami"))
grab("intern", system("whoami", intern = TRUE))
grab("system2", system2("whoami", stdout = TRUE))
grab("two", system("whoami; uname", intern = TRUE))
grab("which", system("which pandoc", intern = TRUE))
grab("pipe", readLines(pipe("whoami")))
grab("missing", system("rvisor-no-such-program-x"))
cat("Sys.which:", Sys.which("whoami"), "|\n")
"#;
    let verdict = |console: &str, label: &str| -> String {
        console
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{label} => ")))
            .unwrap_or_else(|| panic!("no {label} line:\n{console}"))
            .to_string()
    };
    // Programs allowed, whoami not among them.
    let sup = programs_supervisor(&["id"]);
    let r = once(&sup, code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    let c = &r.console;
    for label in ["system", "intern", "system2"] {
        let v = verdict(c, label);
        assert!(
            v.starts_with("rvisor: 'whoami' was not run: it is not in this server's allow-list of programs (allowed: id); an operator can allow it with --allow-program whoami"),
            "{label}: {v}"
        );
    }
    assert!(
        verdict(c, "system").trim_end().ends_with("| value 126"),
        "{c}"
    );
    let two = verdict(c, "two");
    assert!(
        two.contains("'whoami' and 'uname' were not run")
            && two.contains("--allow-program whoami --allow-program uname"),
        "{two}"
    );
    assert!(verdict(c, "which").contains("'which' was not run"), "{c}");
    let missing = verdict(c, "missing");
    assert!(
        !missing.contains("rvisor") && missing.contains("value 127"),
        "a program that is not installed is not blamed on the list: {missing}"
    );
    assert!(c.contains("Sys.which:  |"), "{c}");
    assert!(!everything(&r).contains("Cannot allocate memory"), "{c}");
    drop(sup);

    // No program allowed at all: nothing runs, not even the shell.
    let sup = supervisor_with(Confinement {
        programs: Programs::none(),
        ..confinement_in(1)
    });
    let r = once(&sup, code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    let c = &r.console;
    let empty = "this server's allow-list of programs is empty, so R code here may run no programs; an operator can allow it with --allow-program";
    let v = verdict(c, "system");
    assert!(
        v.starts_with("rvisor: 'whoami' was not run: ")
            && v.contains(empty)
            && v.trim_end().ends_with("| value 127"),
        "{v}"
    );
    for label in ["intern", "system2", "which", "pipe"] {
        let v = verdict(c, label);
        assert!(
            v.starts_with("ERROR rvisor: '") && v.contains(empty),
            "{label}: {v}"
        );
    }
    assert!(verdict(c, "which").contains("--allow-program which"), "{c}");
    assert!(!everything(&r).contains("Cannot allocate memory"), "{c}");
}

/// When the shell cannot start at all (here: the worker's process limit
/// is reached), R's "cannot popen ..., probable reason 'Cannot allocate
/// memory'" (glibc's word for any failure to start it) says what it
/// usually means in a confined worker, and is raised by system() as R
/// raises it.
#[test]
fn programs_a_shell_that_cannot_start_says_why() {
    let sup = supervisor_with(Confinement {
        programs: Programs::only(["id"]),
        limits: Limits {
            processes: 6,
            ..Limits::default()
        },
        ..confinement()
    });
    let r = once(
        &sup,
        r#"kids <- lapply(1:12, function(i) tryCatch(parallel::mcparallel(Sys.sleep(60)), error = function(e) NULL))
cat("forked:", sum(!vapply(kids, is.null, NA)), "
")
e <- tryCatch(system("id", intern = TRUE), error = function(e) e)
cat("call:", deparse(conditionCall(e)), "
")
cat("message:", conditionMessage(e), "
")
"#,
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    assert!(
        r.console.contains("call: system(\"id\", intern = TRUE)"),
        "{}",
        r.console
    );
    assert!(
        r.console.contains("cannot popen 'id'")
            && r.console.contains("usually the process limit, --processes"),
        "{}",
        r.console
    );
}

/// Sys.which() finds a program only when it may run (it answers from the
/// allow-list, without a shell, so it works with none allowed), and the
/// shell's `test -x` (access(X_OK)) agrees: the program directories are
/// noexec but for the allowed files.
#[test]
fn programs_sys_which_finds_allowed_programs_only() {
    let code = r#"w <- Sys.which(c("id", "whoami", "sh", "rvisor-no-such-program", NA, "/usr/bin/whoami"))
for (n in seq_along(w)) cat(names(w)[n], "=", w[[n]], "|\n")
cat("id file:", normalizePath(w[["id"]], mustWork = FALSE), "|\n")
v <- tryCatch(suppressWarnings(system(paste("for p in", w[["id"]], "/usr/bin/whoami; do [ -x $p ] && echo $p; done; echo end"), intern = TRUE)), error = function(e) "error")
cat("shell:", v, "\n")
"#;
    let sup = programs_supervisor(&["id"]);
    let r = once(&sup, code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    let c = &r.console;
    let id = on_worker_path("id").expect("id is installed");
    let id_real = std::fs::canonicalize(&id).unwrap();
    assert!(c.contains(&format!("id = {} |", id.display())), "{c}");
    assert!(
        c.contains(&format!("id file: {} |", id_real.display())),
        "{c}"
    );
    for missing in ["whoami", "rvisor-no-such-program", "/usr/bin/whoami"] {
        assert!(c.contains(&format!("{missing} =  |")), "{missing}: {c}");
    }
    assert!(c.contains("NA = NA |"), "{c}");
    assert!(!c.contains("sh =  |"), "the shell may run: {c}");
    assert!(
        c.contains(&format!("shell: {} end", id.display())),
        "the shell finds id only: {c}"
    );

    let sup = supervisor_with(Confinement {
        programs: Programs::none(),
        ..confinement_in(1)
    });
    let r = once(&sup, code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    for name in ["id", "whoami", "sh"] {
        assert!(r.console.contains(&format!("{name} =  |")), "{}", r.console);
    }
}

/// R code that renders `report.Rmd` (a heading, a table and a plot) in the
/// worker's scratch space with `format` and says what the HTML holds.
fn render_report(format: &str) -> String {
    format!(
        r##"stopifnot(requireNamespace("rmarkdown", quietly = TRUE), requireNamespace("knitr", quietly = TRUE))
cat("pandoc available:", rmarkdown::pandoc_available(), "\n")
d <- file.path(tempdir(), "report"); dir.create(d)
writeLines(c("---", "title: Quarterly", "---", "", "# Results", "", "```{{r}}", "summary(cars)", "plot(cars)", "```"), file.path(d, "report.Rmd"))
out <- rmarkdown::render(file.path(d, "report.Rmd"), output_format = {format}, quiet = TRUE)
html <- paste(readLines(out), collapse = "\n")
cat("file:", out == file.path(d, "report.html"), file.exists(out), "\n")
cat("heading:", grepl("Results", html, fixed = TRUE), "\n")
cat("table:", grepl("speed", html, fixed = TRUE), "\n")
cat("plot:", grepl("data:image/png;base64", html, fixed = TRUE), "\n")
"##
    )
}

fn assert_rendered(r: &RunResult) {
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(r));
    for want in [
        "pandoc available: TRUE",
        "file: TRUE TRUE",
        "heading: TRUE",
        "table: TRUE",
        "plot: TRUE",
    ] {
        assert!(r.console.contains(want), "{want}:\n{}", everything(r));
    }
}

/// With the default list (pandoc, when installed) an R Markdown report
/// renders to HTML in a confined worker: knitr runs the chunks, pandoc
/// (through the shell) writes one self-contained file with the plot in it.
#[test]
fn programs_rmarkdown_renders_a_report_with_pandoc() {
    assert!(
        on_worker_path("pandoc").is_some(),
        "pandoc is needed (scripts/setup.sh installs it with r-cran-rmarkdown)"
    );
    let sup = supervisor();
    let r = once(
        &sup,
        &render_report("rmarkdown::html_document(theme = NULL)"),
    );
    assert_rendered(&r);
    // Without pandoc allowed R Markdown says it has none.
    let sup = supervisor_with(Confinement {
        programs: Programs::none(),
        ..confinement_in(1)
    });
    let r = once(
        &sup,
        "cat(rmarkdown::pandoc_available(), nzchar(Sys.which('pandoc')))",
    );
    assert_eq!(r.console, "FALSE FALSE", "{}", everything(&r));
}

/// The default html_document (Bootstrap, jQuery) renders with the default
/// list. Debian's r-cran-jquerylib finds the system jQuery's version with
/// `dpkg -s libjs-jquery | grep | sed | cut` as it renders; in a confined
/// worker the version is read from the directory the package ships
/// (driver_compat.R), so no program is refused, and the answer is the one
/// dpkg gives an unconfined worker. With dpkg and the rest allowed (docs'
/// earlier recipe) it renders too.
#[test]
fn programs_rmarkdown_default_html_document() {
    let sup = supervisor();
    let shells_out = once(
        &sup,
        "cat(requireNamespace('jquerylib', quietly = TRUE) && any(grepl('dpkg', deparse(jquerylib:::expand_version))))",
    );
    let r = once(&sup, &render_report("rmarkdown::html_document()"));
    assert_rendered(&r);
    assert!(
        !everything(&r).contains("not run"),
        "no program was refused: {}",
        everything(&r)
    );
    if shells_out.console != "TRUE" {
        return;
    }
    // The version read from the package's files is dpkg's.
    let version = "cat(jquerylib::jquery_core(3)$version, jquerylib:::expand_version(2) == '')";
    let confined = once(&sup, version);
    assert_eq!(
        confined.outcome,
        Outcome::Complete,
        "{}",
        everything(&confined)
    );
    let free = supervisor_with(Confinement::unconfined());
    let dpkg = once(&free, version);
    assert_eq!(dpkg.outcome, Outcome::Complete, "{}", everything(&dpkg));
    assert!(
        dpkg.console.starts_with("3."),
        "dpkg's answer: {}",
        everything(&dpkg)
    );
    assert_eq!(confined.console, dpkg.console);
    drop(sup);
    let sup = supervisor_with(Confinement {
        programs: Programs::from_flags(["dpkg", "dpkg-query", "grep", "sed", "cut"]),
        read_only: vec![PathBuf::from("/var/lib/dpkg")],
        ..confinement_in(1)
    });
    assert_rendered(&once(&sup, &render_report("rmarkdown::html_document()")));
}

/// Native code connects to an abstract Unix socket the host listens on (the
/// supervisor's own sockets are socketpairs, but a host service may use
/// one). Stopped by the network namespace (abstract names are per network
/// namespace) and Landlock's abstract-socket scoping.
#[test]
fn attack_native_connect_to_a_host_abstract_socket() {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("rvisor-confine-{}", rvisor::ids::random_hex(8));
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr).expect("bind");
    listener.set_nonblocking(true).unwrap();
    let native = build_native();
    let sup = native_supervisor(&native, Limits::default());
    let sentinel = Sentinel::new(&sup);
    let r = once(
        &sup,
        &format!(
            "{}cat('connect =', .C('rv_connect_abstract', {}, err = integer(1))$err, '\\n')",
            load_native(&native),
            r_str(&name)
        ),
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    assert!(
        !r.console.contains("connect = 0 "),
        "the worker connected to the host's abstract socket:\n{}",
        r.console
    );
    match listener.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        Ok(_) => panic!("the worker connected to the host's abstract socket"),
        Err(e) => panic!("accept failed: {e}"),
    }
    sentinel.assert_unharmed();
}

// ---------------------------------------------------------------------------
// Attacks: resources

/// A fork bomb (mcparallel in a loop, capped at 2000 attempts, children that
/// would sleep a minute) hits the process limit quickly; the worker's uid
/// never has more processes than the limit; the sentinel works; and when
/// the session closes no process of that uid is left. Stopped by
/// RLIMIT_NPROC on the worker's own uid and the pid namespace (its children
/// die with it).
#[test]
fn attack_fork_bomb_hits_the_process_limit() {
    let sup = supervisor();
    let sentinel = Sentinel::new(&sup);
    let s = session(&sup);
    let pid = worker_pid(&s);
    let owner = owner_of(pid).expect("the worker's owner");
    if let Owner::Uid(uid) = owner {
        assert!(uid >= uid_base());
    }
    let started = Instant::now();
    let r = run(
        &s,
        r#"n <- 0; why <- "no error"
for (i in 1:2000) {
  ok <- tryCatch({ parallel::mcparallel(Sys.sleep(60)); TRUE },
                 error = function(e) { why <<- conditionMessage(e); FALSE })
  if (!ok) break
  n <- n + 1
}
cat("forked", n, "\n"); cat("error:", why, "\n")"#,
    );
    let took = started.elapsed();
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(
        took < Duration::from_secs(30),
        "the fork bomb took {took:?}"
    );
    let forked: u64 = r
        .console
        .lines()
        .find_map(|l| l.strip_prefix("forked "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("{}", r.console));
    let limit = Limits::default().processes;
    assert!(forked < limit, "forked {forked} processes:\n{}", r.console);
    assert!(
        r.console.contains("unable to fork"),
        "the loop did not end at the process limit:\n{}",
        r.console
    );
    let live = processes_of(&owner).len() as u64;
    assert!(
        live <= limit,
        "the worker ({owner:?}) has {live} processes, over the limit of {limit}"
    );
    sentinel.assert_unharmed();
    assert_eq!(
        console(&s, "cat(1 + 1)"),
        "2",
        "the attacker's session still answers"
    );
    s.close();
    wait_until("the fork bomb's processes to end", || {
        processes_of(&owner).is_empty()
    });
    sentinel.assert_unharmed();
}

/// The same from native code: fork() in a loop (capped at 2000) ends at the
/// process limit with EAGAIN, and nothing of the worker's uid survives the
/// session.
#[test]
fn attack_native_fork_bomb_hits_the_process_limit() {
    let native = build_native();
    let sup = native_supervisor(&native, Limits::default());
    let sentinel = Sentinel::new(&sup);
    let s = session(&sup);
    let owner = owner_of(worker_pid(&s)).expect("the worker's owner");
    let r = run(
        &s,
        &format!(
            "{}r <- .C('rv_forkbomb', 2000L, forked = integer(1), err = integer(1))\n\
             cat('forked =', r$forked, '\\nerr =', r$err, '\\n')",
            load_native(&native)
        ),
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    assert!(
        r.console.contains(&format!("err = {} ", libc::EAGAIN)),
        "fork did not fail with EAGAIN:\n{}",
        r.console
    );
    let live = processes_of(&owner).len() as u64;
    assert!(live <= Limits::default().processes, "{live} processes");
    sentinel.assert_unharmed();
    s.close();
    wait_until("the fork bomb's processes to end", || {
        processes_of(&owner).is_empty()
    });
}

/// Two supervisors on one host (say `rvisor serve` and an `rvisor run`, or
/// two services) with the same configuration: a fork bomb in a worker of
/// one must not stop the other's workers from forking. RLIMIT_NPROC counts
/// per uid host-wide, so this holds only if workers of different
/// supervisors never share a uid; rootless, they all have the user's uid
/// and it counts per user namespace, one per worker.
#[test]
fn attack_fork_bomb_in_one_supervisor_does_not_starve_another() {
    // Two blocks of 1000 uids (each supervisor holds one), in a region of
    // their own so that parallel test processes do not meet here.
    let c = Confinement {
        uid_base: 1_500_000_000 + (std::process::id() % 1000) * 4000,
        uid_count: 2000,
        ..confinement()
    };
    let pool = PoolConfig {
        spares: 0,
        ..PoolConfig::default()
    };
    let mk = || {
        Supervisor::new(SupervisorConfig {
            confinement: c.clone(),
            pool: pool.clone(),
            ..SupervisorConfig::default()
        })
        .expect("the supervisor starts")
    };
    let (sup_a, sup_b) = (mk(), mk());
    let a = session(&sup_a);
    let b = session(&sup_b);
    let (uid_a, uid_b) = (
        owner_of(worker_pid(&a)).unwrap(),
        owner_of(worker_pid(&b)).unwrap(),
    );
    let bomb = console(
        &a,
        r#"n <- 0
for (i in 1:2000) {
  ok <- tryCatch({ parallel::mcparallel(Sys.sleep(60)); TRUE }, error = function(e) FALSE)
  if (!ok) break
  n <- n + 1
}
cat("forked", n, "\n")"#,
    );
    let r = run(
        &b,
        "cat(unlist(parallel::mclapply(1:2, function(i) i * 10L, mc.cores = 2)))",
    );
    a.close();
    assert_eq!(
        (r.outcome, r.console.trim()),
        (Outcome::Complete, "10 20"),
        "a fork bomb in another supervisor's worker ({bomb:?}, {uid_a:?}) stopped this \
         worker ({uid_b:?}) from forking:\n{}",
        everything(&r)
    );
    assert_ne!(
        uid_a, uid_b,
        "workers of two supervisors share {uid_a:?} (and its process limit)"
    );
}

/// 10 GB allocations fail with R's "cannot allocate" error; the worker
/// survives with its state. Stopped by RLIMIT_AS.
#[test]
fn attack_huge_allocations_fail_and_the_worker_survives() {
    let sup = supervisor();
    let sentinel = Sentinel::new(&sup);
    let s = session(&sup);
    console(&s, "kept <- 42");
    for code in [
        "x <- numeric(1.25e9)",
        "y <- raw(1e10)",
        "z <- matrix(0, 5e4, 5e4)",
    ] {
        let started = Instant::now();
        let r = run(&s, code);
        assert_eq!(r.outcome, Outcome::Error, "{code}: {}", everything(&r));
        let msg = r
            .error
            .as_ref()
            .map(|e| e.message.clone())
            .unwrap_or_default();
        assert!(msg.contains("cannot allocate"), "{code}: {msg}");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{code} took long"
        );
    }
    let r = run(&s, "cat(kept, exists('x'), exists('y'))");
    assert_eq!(r.console, "42 FALSE FALSE", "{}", r.console);
    assert_eq!(r.session.generation, 1, "the worker was replaced");
    sentinel.assert_unharmed();
}

/// A stored table whose hydration needs more memory than the worker may
/// have (RLIMIT_AS at the 512 MiB minimum): the call is an error saying
/// why and that nothing ran, and the same worker goes on to hydrate a
/// small table and run code. The file is small (150 M booleans: ~18 MiB
/// of bits in Arrow) but the R logical vector is 4 bytes a row (~572 MiB),
/// more than the whole limit, whatever the worker already maps (a worker
/// of the base zygote maps less than one of the warm zygote, with
/// ggplot2 loaded); R's allocation fails inside the
/// worker's protected boundary (r::protected), not in Rust.
#[test]
fn works_a_table_too_large_for_the_memory_limit_is_an_error_and_the_worker_lives() {
    use arrow_array::{BooleanArray, RecordBatch};
    use arrow_schema::{DataType, Field, Schema};
    let dir = host_dir("hydrate-oom");
    let write = |name: &str, rows: usize, batch: usize| -> PathBuf {
        let path = dir.path().join(name);
        let schema = Arc::new(Schema::new(vec![Field::new(
            "flag",
            DataType::Boolean,
            false,
        )]));
        let f = std::fs::File::create(&path).expect("the table file");
        let mut w = arrow_ipc::writer::FileWriter::try_new(f, &schema).expect("a writer");
        let mut left = rows;
        while left > 0 {
            let n = left.min(batch);
            let col = BooleanArray::from(vec![true; n]);
            let b = RecordBatch::try_new(schema.clone(), vec![Arc::new(col)]).expect("a batch");
            w.write(&b).expect("written");
            left -= n;
        }
        w.finish().expect("finished");
        path
    };
    let big = write("big.arrow", 150_000_000, 5_000_000);
    let small = write("small.arrow", 1000, 1000);
    let size = std::fs::metadata(&big).expect("the file").len();
    assert!(size < 32 << 20, "the big table takes {size} bytes on disk");

    let sup = supervisor_with(Confinement {
        limits: Limits {
            memory_bytes: 512 << 20,
            ..Limits::default()
        },
        ..confinement()
    });
    let mut w = sup
        .pool()
        .acquire(&sup.config().worker)
        .expect("a confined worker");
    let call = |w: &mut rvisor::Worker, id: &str, code: &str, tables: Vec<(String, PathBuf)>| {
        let ctx = CallContext {
            tables,
            ..CallContext::default()
        };
        let r = w.run_call(id.into(), code, &CallOptions::default(), &ctx);
        show(code, &r);
        r
    };
    let code = "cat('ran', nrow(df))";
    let r = call(&mut w, "oom-1", code, vec![("df".into(), big)]);
    assert_eq!(r.outcome, Outcome::Error, "{}", everything(&r));
    let msg = r.error.map(|e| e.message).unwrap_or_default();
    assert!(
        msg.contains("could not be loaded")
            && msg.contains("cannot allocate")
            && msg.contains("nothing ran"),
        "{msg}"
    );
    assert!(
        !r.segments
            .iter()
            .any(|s| matches!(s, rvisor::Segment::Stdout { .. })),
        "the code ran: {}",
        r.console
    );
    // The same worker: nothing was bound, and it hydrates and runs on.
    let r = call(
        &mut w,
        "oom-2",
        "cat(exists('df', envir = globalenv(), inherits = FALSE), '\n')\n\
         cat(nrow(small), sum(small$flag))",
        vec![("small".into(), small)],
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    assert_eq!(r.console, "FALSE \n1000 1000");
    assert!(w.is_alive());
}

/// The memory cap is for the worker, not per process: four forked children
/// of a worker capped at 1 GiB cannot hold 400 MiB each (1.6 GiB in all).
/// With a per-process RLIMIT_AS alone, a worker could hold `processes` x
/// `memory_bytes` (64 x 4 GiB by default), far more than the host has.
/// Stopped by the worker's memory cgroup (memory_bytes + disk_bytes): the
/// kernel kills children past it, so not all four deliver.
#[test]
fn attack_memory_of_forked_children_counts_against_the_cap() {
    let sup = supervisor_with(Confinement {
        limits: Limits {
            memory_bytes: 1 << 30,
            disk_bytes: 64 << 20,
            ..Limits::default()
        },
        ..confinement()
    });
    if !has_cgroups(
        &sup,
        "attack_memory_of_forked_children_counts_against_the_cap",
    ) {
        return;
    }
    let s = session(&sup);
    let r = run(
        &s,
        r#"jobs <- lapply(1:4, function(i) parallel::mcparallel({
  x <- rep(as.double(i), 400 * 2^20 / 8)   # one allocation, every page touched
  Sys.sleep(2)
  sum(x) > 0
}))
res <- parallel::mccollect(jobs, wait = TRUE, timeout = 30)
cat("held:", sum(vapply(res, isTRUE, logical(1))), "\n")"#,
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    assert!(
        !r.console.contains("held: 4"),
        "a worker capped at 1 GiB held 4 x 400 MiB in forked children:\n{}",
        r.console
    );
}

/// Filling the disk: the scratch space is a private tmpfs capped at
/// `disk_bytes` (32 MiB here), and one file at `file_bytes` (16 MiB here).
/// Writes fail past the caps, and nothing lands on the host's disk. Stopped
/// by the tmpfs size and RLIMIT_FSIZE.
#[test]
fn attack_fill_the_disk_past_the_cap() {
    let sup = supervisor_with(Confinement {
        limits: Limits {
            disk_bytes: 32 << 20,
            file_bytes: 16 << 20,
            ..Limits::default()
        },
        ..confinement()
    });
    let sentinel = Sentinel::new(&sup);
    let r = once(
        &sup,
        r#"chunk <- as.raw(rep(1:255, length.out = 2^20))
fail <- function(e) paste("FAILED:", conditionMessage(e))
f <- file.path(tempdir(), "one")
con <- file(f, "wb")
one <- "no failure"
for (i in 1:64) {
  one <- tryCatch({ writeBin(chunk, con); flush(con); "no failure" }, warning = fail, error = fail)
  if (one != "no failure") break
}
close(con)
cat("one file:", file.size(f), "bytes;", one, "\n")
many <- "no failure"
for (i in 1:64) {
  many <- tryCatch({ writeBin(chunk, file.path(tempdir(), paste0("f", i))); "no failure" },
                   warning = fail, error = fail)
  if (many != "no failure") break
}
files <- list.files(c(tempdir(), "/tmp"), full.names = TRUE, recursive = TRUE)
cat("total:", sum(file.size(unique(files)), na.rm = TRUE), "bytes;", many, "\n")"#,
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    let num = |prefix: &str| -> u64 {
        r.console
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {prefix:?} in:\n{}", r.console))
    };
    assert!(
        !r.console.contains("no failure"),
        "writing did not fail at the caps:\n{}",
        r.console
    );
    assert!(num("one file: ") <= 16 << 20, "{}", r.console);
    assert!(num("total: ") <= 32 << 20, "{}", r.console);
    // Nothing of it on the host: this process's worker directories are
    // empty mount points there.
    let mut host_bytes = 0;
    for e in std::fs::read_dir(std::env::temp_dir()).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with(&format!("rvisor-{}-", std::process::id())) {
            host_bytes += dir_size(&e.path());
        }
    }
    assert!(host_bytes < 1 << 20, "{host_bytes} bytes reached the host");
    sentinel.assert_unharmed();
}

fn dir_size(p: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(p) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// The outcome a CPU limit gives: timed out, saying it was the CPU.
fn assert_cpu_limited(r: &RunResult, took: Duration, wall: Duration) {
    assert_eq!(r.outcome, Outcome::TimedOut, "{}", everything(r));
    let e = r.error.as_ref().expect("an error");
    assert!(e.timed_out, "{e:?}");
    assert!(e.message.contains("CPU"), "{}", e.message);
    assert!(
        took < wall / 2,
        "the CPU limit did not stop the call well before its wall timeout ({took:?})"
    );
}

/// A CPU loop in R past the call's CPU limit (2 s) with a long wall timeout
/// (60 s) ends early as timed out. Stopped by RLIMIT_CPU (SIGXCPU).
#[test]
fn attack_cpu_loop_past_the_call_cpu_limit() {
    let sup = supervisor();
    let sentinel = Sentinel::new(&sup);
    let wall = Duration::from_secs(60);
    let opts = CallOptions {
        timeout: Some(wall),
        cpu_limit: Some(Duration::from_secs(2)),
        ..CallOptions::default()
    };
    let started = Instant::now();
    let r = once_with(&sup, "repeat {}", &opts, Vec::new());
    assert_cpu_limited(&r, started.elapsed(), wall);
    sentinel.assert_unharmed();
}

/// The same for a C loop (R never gets control back to check interrupts).
#[test]
fn attack_native_cpu_loop_past_the_call_cpu_limit() {
    let native = build_native();
    let sup = native_supervisor(&native, Limits::default());
    let sentinel = Sentinel::new(&sup);
    let wall = Duration::from_secs(60);
    let opts = CallOptions {
        timeout: Some(wall),
        cpu_limit: Some(Duration::from_secs(2)),
        ..CallOptions::default()
    };
    let started = Instant::now();
    let r = once_with(
        &sup,
        &format!("{}.C('rv_spin')", load_native(&native)),
        &opts,
        Vec::new(),
    );
    assert_cpu_limited(&r, started.elapsed(), wall);
    sentinel.assert_unharmed();
}

/// A CPU limit cannot be escaped by doing the work in forked children:
/// a call limited to 2 s of CPU that keeps two children busy for 2 s each
/// (4 CPU seconds) must be stopped.
#[test]
fn attack_cpu_work_in_children_past_the_call_cpu_limit() {
    let sup = supervisor();
    if !has_cgroups(&sup, "attack_cpu_work_in_children_past_the_call_cpu_limit") {
        return;
    }
    let wall = Duration::from_secs(60);
    let opts = CallOptions {
        timeout: Some(wall),
        cpu_limit: Some(Duration::from_secs(2)),
        ..CallOptions::default()
    };
    let r = once_with(
        &sup,
        r#"burn <- function(i) { t0 <- proc.time()[["user.self"]]; while (proc.time()[["user.self"]] - t0 < 2) {}; i }
parallel::mclapply(1:2, burn, mc.cores = 2)
cat("burned 4 CPU seconds\n")"#,
        &opts,
        Vec::new(),
    );
    assert!(
        !r.console.contains("burned 4 CPU seconds"),
        "a call limited to 2 CPU seconds used 4 in forked children:\n{}",
        everything(&r)
    );
}

/// `Limits.cpu_seconds` bounds a session worker's whole life: a loop past
/// it ends the worker (timed out, saying CPU) well before the wall timeout,
/// and the session goes on with a fresh worker.
#[test]
fn attack_cpu_loop_past_the_worker_lifetime_cpu_limit() {
    let sup = supervisor_with(Confinement {
        limits: Limits {
            cpu_seconds: Some(3),
            ..Limits::default()
        },
        ..confinement()
    });
    let sentinel = Sentinel::new(&sup);
    let s = session(&sup);
    console(&s, "x <- 1");
    let wall = Duration::from_secs(60);
    let started = Instant::now();
    let h = s
        .run_with(
            "repeat {}",
            &RunOptions {
                timeout: Some(wall),
                ..RunOptions::default()
            },
        )
        .expect("accepted");
    let r = h.wait_timeout(wall + DEADLINE).expect("a result");
    assert_cpu_limited(&r, started.elapsed(), wall);
    let next = run(&s, "cat(exists('x'))");
    assert_eq!(next.outcome, Outcome::Complete, "{}", next.console);
    assert!(next.console.ends_with("FALSE"), "{}", next.console);
    assert_eq!(next.session.generation, 2);
    sentinel.assert_unharmed();
}

// ---------------------------------------------------------------------------
// Attacks: other processes

/// R reads the supervisor's environment (a secret set in this process
/// before the supervisor started), its command line and the zygote's, by
/// host pid, and dumps its own environment. Stopped by the pid namespace
/// (host pids do not exist inside), dumpable 0 and the minimal environment.
#[test]
fn attack_read_the_supervisors_environment() {
    let secret_value = secret("env");
    std::env::set_var("RVISOR_CONFINEMENT_TEST_SECRET", &secret_value);
    let sup = supervisor();
    assert!(sup.pool().wait_ready(DEADLINE), "{:?}", sup.pool_status());
    let zygote = sup.pool_status().zygote_pid.expect("the zygote runs");
    let sentinel = Sentinel::new(&sup);
    let me = std::process::id();
    let r = once_with(
        &sup,
        &format!(
            r#"{ATTEMPT}
for (p in c(host_pid, zygote_pid)) {{
  for (f in c("environ", "cmdline", "status", "maps"))
    .attempt(paste0(f, "_", p), readLines(sprintf("/proc/%d/%s", as.integer(p), f), warn = FALSE))
  .attempt(paste0("mem_", p), readBin(sprintf("/proc/%d/mem", as.integer(p)), "raw", 64))
}}
.attempt("own_environ", readLines("/proc/self/environ", warn = FALSE))
.attempt("pid1_environ", readLines("/proc/1/environ", warn = FALSE))
print(Sys.getenv())
"#
        ),
        &CallOptions::default(),
        vec![
            ("host_pid".into(), json!(me)),
            ("zygote_pid".into(), json!(zygote)),
        ],
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_no_leak(&r, &secret_value);
    let mut labels = Vec::new();
    for p in [me, zygote] {
        for f in ["environ", "cmdline", "status", "maps", "mem"] {
            labels.push(format!("{f}_{p}"));
        }
    }
    let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
    assert_denied(&r.console, &labels);
    sentinel.assert_unharmed();
}

/// Session A goes for session B's worker by host pid: its memory, its
/// environment, its root and its temporary directory (by path, directly
/// and through /proc). B's secret must never reach A. Stopped by the pid
/// and mount namespaces, separate uids and dumpable 0.
#[test]
fn attack_read_another_workers_memory_and_files() {
    let sup = supervisor();
    let a = session(&sup);
    let b = session(&sup);
    let b_secret = secret("worker-b");
    let b_dir = console(
        &b,
        &format!(
            "b_secret <- {s}; writeLines(b_secret, file.path(tempdir(), 'b.txt')); \
             writeLines(b_secret, '/tmp/b.txt'); cat(tempdir())",
            s = r_str(&b_secret)
        ),
    );
    let b_dir = b_dir.lines().last().unwrap().trim().to_string();
    let b_pid = worker_pid(&b);
    let code = format!(
        r#"{ATTEMPT}
p <- {b_pid}L
.attempt("mem", readBin(sprintf("/proc/%d/mem", p), "raw", 4096))
.attempt("environ", readLines(sprintf("/proc/%d/environ", p), warn = FALSE))
.attempt("maps", readLines(sprintf("/proc/%d/maps", p)))
.attempt("root_file", readLines(sprintf("/proc/%d/root%s/b.txt", p, {b_dir})))
.attempt("root_tmp", readLines(sprintf("/proc/%d/root/tmp/b.txt", p)))
.attempt("cwd", list.files(sprintf("/proc/%d/cwd", p)))
.attempt("dir_by_path", readLines(file.path({b_dir}, "b.txt")))
.attempt("fd", list.files(sprintf("/proc/%d/fd", p)))
cat("tmp:", list.files("/tmp", recursive = TRUE), "\n")
"#,
        b_dir = r_str(&b_dir),
    );
    let r = run(&a, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert_no_leak(&r, &b_secret);
    assert_denied(
        &r.console,
        &[
            "mem",
            "environ",
            "maps",
            "root_file",
            "root_tmp",
            "dir_by_path",
        ],
    );
    // B still has its state.
    let rb = run(&b, "cat(b_secret)");
    assert_eq!(rb.console, b_secret);
    assert_eq!(rb.session.generation, 1);
}

/// Session A signals session B's worker, the zygote and the supervisor
/// (this test process) with SIGKILL, by host pid. Everyone lives. Stopped by
/// the pid namespace (those pids are not there), separate uids and
/// Landlock's signal scoping.
#[test]
fn attack_signal_other_processes() {
    let sup = supervisor();
    assert!(sup.pool().wait_ready(DEADLINE), "{:?}", sup.pool_status());
    let zygote = sup.pool_status().zygote_pid.expect("the zygote runs");
    let a = session(&sup);
    let b = session(&sup);
    console(&b, "b_state <- 'alive'");
    let b_pid = worker_pid(&b);
    let me = std::process::id();
    let r = run(
        &a,
        &format!(
            r#"for (p in c(b = {b_pid}L, zygote = {zygote}L, supervisor = {me}L))
  for (sig in c(9L, 19L, 15L)) cat("pskill", p, sig, "=", tools::pskill(p, sig), "\n")"#
        ),
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(
        !r.console.contains("= TRUE"),
        "a signal was delivered:\n{}",
        r.console
    );
    assert_nobody_harmed(&sup, &a, &b, b_pid, zygote);
}

/// The host side of tools: R names files for a tool to read (as
/// rvisor_publish does). The handler may only ever read the calling
/// worker's own regular files: not through `..`, a symlink, a symlinked
/// directory, a path outside tempdir(); and a FIFO must not hang the host.
#[test]
fn attack_tool_file_reads_stay_inside_the_worker() {
    let host = host_dir("tool-secret");
    let host_secret = secret("tool");
    let host_file = host.path().join("secret.txt");
    std::fs::write(&host_file, &host_secret).unwrap();
    let (done_tx, done_rx) = mpsc::channel::<(String, Result<usize, String>)>();
    let done_tx = std::sync::Mutex::new(done_tx);
    let tool = Tool::new(
        "slurp",
        "reads a file of the worker",
        json!({}),
        move |call| {
            let path = call.args["path"].as_str().unwrap_or_default().to_string();
            let res = read_worker_file(call, &path);
            let _ = done_tx
                .lock()
                .unwrap()
                .send((path, res.as_ref().map(Vec::len).map_err(Clone::clone)));
            res.map(|bytes| json!(String::from_utf8_lossy(&bytes)))
        },
    )
    .unwrap();
    let sup = supervisor();
    let s = sup
        .session_with(SessionOptions {
            tools: vec![tool],
            timeout: Duration::from_secs(4),
            ..SessionOptions::default()
        })
        .unwrap();
    let code = format!(
        r#"{ATTEMPT}
d <- tempdir()
writeLines("mine", file.path(d, "mine.txt"))
.attempt("own_file", tools$slurp(path = file.path(d, "mine.txt")))
file.symlink({host_file}, file.path(d, "host-link"))
file.symlink("/etc/passwd", file.path(d, "passwd-link"))
file.symlink("/", file.path(d, "rootdir"))
.attempt("symlink_host", tools$slurp(path = file.path(d, "host-link")))
.attempt("symlink_passwd", tools$slurp(path = file.path(d, "passwd-link")))
.attempt("symlink_dir", tools$slurp(path = file.path(d, "rootdir", {host_file_rel})))
.attempt("dotdot", tools$slurp(path = file.path(d, "..", "..", "..", {host_file_rel})))
.attempt("absolute", tools$slurp(path = {host_file}))
.attempt("proc", tools$slurp(path = "/proc/self/environ"))
.attempt("relative", tools$slurp(path = "mine.txt"))
"#,
        host_file = r_path(&host_file),
        host_file_rel = r_str(host_file.to_str().unwrap().trim_start_matches('/')),
    );
    let r = run(&s, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    assert_no_leak(&r, &host_secret);
    assert!(
        verdicts(&r.console)["own_file"].contains("mine"),
        "the tool could not read the worker's own file:\n{}",
        r.console
    );
    assert_denied(
        &r.console,
        &[
            "symlink_host",
            "symlink_passwd",
            "symlink_dir",
            "dotdot",
            "absolute",
            "proc",
            "relative",
        ],
    );
    while done_rx.try_recv().is_ok() {}

    // A FIFO: opening it for reading blocks until a writer comes, which
    // never happens. The handler must not hang (a host thread per call).
    let r = run(
        &s,
        r#"f <- file.path(tempdir(), "fifo")
con <- fifo(f, "w+"); close(con)
cat("is fifo:", file.exists(f), "\n")
tryCatch(tools$slurp(path = f), error = function(e) cat("DENIED:", conditionMessage(e), "\n"))"#,
    );
    let handler = done_rx.recv_timeout(Duration::from_secs(6));
    assert!(
        handler.is_ok(),
        "the tool handler hung opening a FIFO the R code made (a host thread is stuck for \
         good); the call ended {:?}:\n{}",
        r.outcome,
        everything(&r)
    );
    let (_, res) = handler.unwrap();
    assert!(res.is_err(), "a FIFO was read: {res:?}");
}

// ---------------------------------------------------------------------------
// Functional: normal R works confined

/// Installed packages load; models fit.
#[test]
fn works_packages_and_models() {
    let sup = supervisor();
    let c = once_console(
        &sup,
        r#"for (p in c("stats", "utils", "grid", "ggplot2", "lattice", "jsonlite"))
  suppressPackageStartupMessages(library(p, character.only = TRUE))
cat("attached:", all(c("package:ggplot2", "package:lattice", "package:jsonlite") %in% search()), "\n")
fit <- lm(mpg ~ wt + hp, data = mtcars)
cat("lm:", round(coef(fit)[["wt"]], 4), "\n")
g <- glm(am ~ wt, data = mtcars, family = binomial)
cat("glm:", round(coef(g)[["wt"]], 3), "\n")
cat("json:", jsonlite::toJSON(list(a = 1)), "\n")
p <- ggplot(mtcars, aes(wt, mpg)) + geom_point()
cat("ggplot:", class(ggplot_build(p))[1], "\n")"#,
    );
    assert!(c.contains("attached: TRUE"), "{c}");
    assert!(c.contains("lm: -3.8778"), "{c}");
    assert!(c.contains("glm: -4.024"), "{c}");
    assert!(c.contains(r#"json: {"a":[1]}"#), "{c}");
    assert!(c.contains("ggplot: ggplot_built"), "{c}");
}

/// png(), svg() and pdf() write into tempdir(); plots come back as PNG.
#[test]
fn works_graphics_devices_and_captured_plots() {
    let sup = supervisor();
    let r = once(
        &sup,
        r#"d <- tempdir()
png(file.path(d, "a.png")); plot(1:10); invisible(dev.off())
svg(file.path(d, "a.svg")); plot(1:10); invisible(dev.off())
pdf(file.path(d, "a.pdf")); plot(1:10); invisible(dev.off())
for (f in c("a.png", "a.svg", "a.pdf")) cat(f, file.size(file.path(d, f)), "\n")
library(ggplot2)
print(ggplot(mtcars, aes(wt, mpg)) + geom_point())
plot(1:3)"#,
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    for f in ["a.png", "a.svg", "a.pdf"] {
        let size: u64 = r
            .console
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{f} ")))
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("{f}: {}", r.console));
        assert!(size > 0, "{f} is empty");
    }
    assert_eq!(r.plots.len(), 2, "{}", r.console);
    use base64::Engine;
    for p in &r.plots {
        assert_eq!(p.mime, "image/png");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(&p.data_base64)
            .expect("base64");
        assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
        assert!(bytes.len() > 1000);
    }
}

/// tempdir()/tempfile() and the working directory are writable and
/// readable; the session keeps them between calls.
#[test]
fn works_temporary_files() {
    let sup = supervisor();
    let s = session(&sup);
    console(
        &s,
        r#"f <- tempfile(fileext = ".csv")
write.csv(data.frame(x = 1:3, y = c("a", "b", "c")), f, row.names = FALSE)
saveRDS(mtcars, "mtcars.rds")"#,
    );
    let c = console(
        &s,
        r#"cat(nrow(read.csv(f)), identical(readRDS("mtcars.rds"), mtcars), file.exists(tempdir()), "\n")"#,
    );
    assert_eq!(c.trim(), "3 TRUE TRUE");
}

/// Time zones work: conversions, and Sys.timezone() answers instead of
/// failing (it looks for `timedatectl` with Sys.which(), which runs a shell).
#[test]
fn works_time_zones() {
    let sup = supervisor();
    let r = once(
        &sup,
        r#"x <- as.POSIXct("2024-07-01 12:00:00", tz = "UTC")
cat("ny:", format(x, tz = "America/New_York", usetz = TRUE), "\n")
cat("tokyo:", format(as.POSIXct("2024-01-01 00:00", tz = "Asia/Tokyo"), "%Z"), "\n")
cat("tz:", Sys.timezone(), "\n")"#,
    );
    assert!(
        r.console.contains("ny: 2024-07-01 08:00:00 EDT"),
        "{}",
        everything(&r)
    );
    assert!(r.console.contains("tokyo: JST"), "{}", everything(&r));
    assert_eq!(
        r.outcome,
        Outcome::Complete,
        "Sys.timezone() fails confined:\n{}",
        everything(&r)
    );
    assert!(r.console.contains("tz: "), "{}", r.console);
}

/// Forking with mclapply (two cores) gives the right results.
#[test]
fn works_mclapply() {
    let sup = supervisor();
    let c = once_console(
        &sup,
        r#"r <- parallel::mclapply(1:4, function(i) i^2, mc.cores = 2)
cat(unlist(r), "\n")
cat(getOption("mc.cores"), "\n")"#,
    );
    let mut lines = c.lines();
    assert_eq!(lines.next(), Some("1 4 9 16 "), "{c}");
    let cores: u32 = lines.next().unwrap_or_default().trim().parse().unwrap_or(0);
    assert!(cores >= 1, "mc.cores is not set: {c}");
}

/// UTF-8 text, iconv, regular expressions (TRE and PCRE).
#[test]
fn works_text_encodings_and_regex() {
    let sup = supervisor();
    let c = once_console(
        &sup,
        r#"s <- "Grüße, 日本語 façade"
cat(nchar(s), toupper("straße"), "\n")
cat(iconv("façade", "UTF-8", "ASCII//TRANSLIT"), "\n")
cat(iconv(iconv("Grüße", "UTF-8", "latin1"), "latin1", "UTF-8"), "\n")
cat(gsub("(\\w+)@(\\w+)", "\\2 at \\1", "user@example", perl = TRUE), "\n")
cat(regmatches("a1b22c333", gregexpr("\\d+", "a1b22c333", perl = TRUE))[[1]], "\n")
cat(gsub("[[:space:]]+", "_", "a  b\tc"), grepl("^\\p{L}+$", "日本語", perl = TRUE), "\n")
cat(l10n_info()$`UTF-8`, "\n")"#,
    );
    let lines: Vec<&str> = c.lines().collect();
    assert_eq!(lines[0], "17 STRAßE ", "{c}");
    assert_eq!(lines[1], "facade ", "{c}");
    assert_eq!(lines[2], "Grüße ", "{c}");
    assert_eq!(lines[3], "example at user ", "{c}");
    assert_eq!(lines[4], "1 22 333 ", "{c}");
    assert_eq!(lines[5], "a_b_c TRUE ", "{c}");
    assert_eq!(lines[6], "TRUE ", "{c}");
}

/// The environment is sane (HOME set), random numbers are reproducible, and
/// rvisor_result() gives a structured result.
#[test]
fn works_environment_rng_and_structured_results() {
    let sup = supervisor();
    let r = once(
        &sup,
        r#"home <- Sys.getenv("HOME")
cat("home:", home, nzchar(path.expand("~")), "\n")
set.seed(42); cat("sample:", sample(10), "\n")
rvisor_result(list(answer = 42L, name = "confined", xs = c(1.5, 2.5)))"#,
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    let home = r
        .console
        .lines()
        .find_map(|l| l.strip_prefix("home: "))
        .unwrap_or_default();
    assert!(
        home.starts_with('/'),
        "HOME is not an absolute path: {home:?}"
    );
    assert!(home.ends_with("TRUE "), "{home:?}");
    assert!(
        r.console.contains("sample: 1 5 10 8 2 4 6 9 7 3 "),
        "{}",
        r.console
    );
    assert_eq!(
        r.result,
        Some(json!({"answer": 42, "name": "confined", "xs": [1.5, 2.5]}))
    );
}

/// A host data directory exposed with `Confinement.read_only` is readable
/// at its host path (and stays read-only).
#[test]
fn works_reading_a_read_only_data_directory() {
    let data = host_dir("data");
    std::fs::write(data.path().join("data.csv"), "x,y\n1,2\n3,4\n").unwrap();
    let sup = supervisor_with(Confinement {
        read_only: vec![data.path().to_path_buf()],
        ..confinement()
    });
    let c = once_console(
        &sup,
        &format!(
            "d <- read.csv(file.path({}, 'data.csv')); cat(sum(d$x), sum(d$y), '\\n')",
            r_path(data.path())
        ),
    );
    assert_eq!(c.trim(), "4 6");
}

/// The same for a data directory under the host's /tmp (where data often
/// is): the worker's private /tmp must not hide it.
#[test]
fn works_reading_a_read_only_data_directory_under_tmp() {
    let dir = std::env::temp_dir().join(format!(
        "rvisor-confine-data-{}-{}",
        std::process::id(),
        rvisor::ids::random_hex(6)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("data.csv"), "x\n5\n").unwrap();
    struct Rm(PathBuf);
    impl Drop for Rm {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _rm = Rm(dir.clone());
    let sup = supervisor_with(Confinement {
        read_only: vec![dir.clone()],
        ..confinement()
    });
    let r = once(
        &sup,
        &format!(
            "cat(read.csv(file.path({}, 'data.csv'))$x, '\\n')",
            r_path(&dir)
        ),
    );
    assert_eq!(
        (r.outcome, r.console.trim()),
        (Outcome::Complete, "5"),
        "a read_only directory under /tmp is not visible:\n{}",
        everything(&r)
    );
}

/// Tools work from a confined worker (R calls back into the host).
#[test]
fn works_tools() {
    let tool = Tool::new("add", "adds", json!({}), |call| {
        let a = call.args["a"].as_f64().ok_or("a")?;
        let b = call.args["b"].as_f64().ok_or("b")?;
        Ok(json!(a + b))
    })
    .unwrap();
    let sup = supervisor();
    let ctx = CallContext {
        tools: Arc::new(vec![tool]),
        ..CallContext::default()
    };
    let r = sup.run_once_with(
        rvisor::ids::execution_id(),
        "cat(tools$add(a = 2, b = 3))",
        &CallOptions::default(),
        &ctx,
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", everything(&r));
    assert_eq!(r.console, "5");
}

// ---------------------------------------------------------------------------
// Limits per session and per one-shot run

/// A session can have tighter limits than its supervisor: an allocation
/// that the supervisor's limit allows fails in the limited session only.
#[test]
fn limits_per_session_apply_to_that_session_only() {
    let sup = supervisor();
    let roomy = session(&sup);
    let tight = sup
        .session_with(rvisor::SessionOptions {
            limits: Some(Limits {
                memory_bytes: 1 << 30,
                disk_bytes: 8 << 20,
                ..Limits::default()
            }),
            ..rvisor::SessionOptions::default()
        })
        .expect("a limited session");
    let alloc = "x <- raw(1.5e9); length(x)";
    assert_eq!(console(&roomy, alloc), "[1] 1500000000\n");
    let r = run(&tight, alloc);
    assert_eq!(r.outcome, Outcome::Error, "{}", r.console);
    assert!(r.console.contains("cannot allocate"), "{}", r.console);
    // The limited session's disk is 8 MiB; the other's is the default.
    let fill = "f <- file.path(tempdir(), 'big'); \
                r <- tryCatch({ writeBin(raw(20e6), f); 'written' }, \
                              error = function(e) 'failed', warning = function(w) 'failed'); \
                cat(r, file.exists(f) && file.size(f) >= 20e6, '\\n')";
    assert_eq!(console(&roomy, fill), "written TRUE \n");
    assert!(
        console(&tight, fill).contains("FALSE"),
        "20 MB fit in an 8 MiB disk"
    );
    // Both sessions still work.
    assert_eq!(console(&tight, "1 + 1"), "[1] 2\n");
    assert_eq!(console(&roomy, "1 + 1"), "[1] 2\n");
}

/// One-shot runs take limits too; limits R cannot run in are refused with
/// a reason, and so are limits for an unconfined supervisor.
#[test]
fn limits_per_run_and_their_checks() {
    let sup = supervisor();
    let code = "x <- raw(1.5e9); length(x)";
    let run_limited = |limits: &Limits| {
        let r = sup.run_once_limited(
            rvisor::ids::execution_id(),
            code,
            &CallOptions::default(),
            &CallContext::default(),
            Some(limits),
            None,
        );
        show(code, &r);
        r
    };
    let r = run_limited(&Limits {
        memory_bytes: 1 << 30,
        ..Limits::default()
    });
    assert_eq!(r.outcome, Outcome::Error, "{}", r.console);
    assert!(r.console.contains("cannot allocate"), "{}", r.console);
    assert_eq!(
        once_console(&sup, code),
        "[1] 1500000000\n",
        "the default is roomier"
    );
    let r = run_limited(&Limits {
        memory_bytes: 64 << 20,
        ..Limits::default()
    });
    assert_eq!(r.outcome, Outcome::Rejected);
    assert!(r.console.contains("too small"), "{}", r.console);

    let open = Supervisor::new(SupervisorConfig {
        confinement: Confinement::unconfined(),
        pool: PoolConfig {
            spares: 0,
            preload: Some(Vec::new()),
            ..PoolConfig::default()
        },
        ..SupervisorConfig::default()
    })
    .expect("an unconfined supervisor");
    let err = open
        .session_with(rvisor::SessionOptions {
            limits: Some(Limits::default()),
            ..rvisor::SessionOptions::default()
        })
        .expect_err("limits without confinement");
    assert!(err.to_string().contains("unconfined"), "{err}");
}
