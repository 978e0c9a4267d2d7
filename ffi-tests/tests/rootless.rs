//! Rootless confinement (docs/confinement.md, "Rootless"): rvisor run by an
//! ordinary user confines by default, and two sessions of one supervisor
//! stay apart although their workers share the user's host uid.
//!
//! As root, workers have host uids of their own; these tests then check the
//! same attacks against that mode, and skip (saying why) what only exists
//! rootless. CI runs this file both ways (`make test`, `make test-rootless`).

use rvisor::{Outcome, Supervisor, SupervisorConfig};
use rvisor_ffi_tests::confined::{
    assert_denied, assert_nobody_harmed, console, rootless, run, secret, status_field, uid_of,
    worker_pid, ATTEMPT, DEADLINE,
};
use rvisor_ffi_tests::TestDir;
use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;

/// Skips a rootless-only test as root, saying so.
fn rootless_only(test: &str) -> bool {
    if !rootless() {
        eprintln!("skipped {test}: it checks rootless mode, and this test runs as root");
    }
    rootless()
}

/// The default supervisor, as `SupervisorConfig::default()` makes it.
fn supervisor() -> Supervisor {
    Supervisor::new(SupervisorConfig::default()).expect("the supervisor starts confined")
}

fn host_uid(pid: u32) -> u32 {
    uid_of(pid).expect("the process's uid")
}

fn ns(pid: u32, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/ns/{kind}: {e}"))
}

#[test]
fn health_reports_the_mode_and_every_layer() {
    let sup = supervisor();
    let h = sup.health();
    assert_eq!(h.sandbox.mode, "confined");
    let layers = h.sandbox.layers.join("\n");
    let want_mode = if rootless() { "rootless" } else { "root" };
    assert_eq!(h.sandbox.privilege.as_deref(), Some(want_mode), "{layers}");
    for want in [
        "namespaces: ",
        "filesystem: ",
        "credentials: ",
        "landlock: ",
        "seccomp: ",
        "rlimits: ",
        "cgroups",
    ] {
        assert!(layers.contains(want), "no {want:?} in:\n{layers}");
    }
    if rootless() {
        assert!(
            layers.contains("user namespace: one per worker"),
            "{layers}"
        );
        assert!(layers.contains("namespaces: user, mount, pid"), "{layers}");
        assert!(
            layers.contains("cgroups: not used (rootless") || layers.contains("cgroups v1"),
            "{layers}"
        );
    } else {
        assert!(!layers.contains("user namespace"), "{layers}");
    }
    let json = serde_json::to_value(&h.sandbox).unwrap();
    assert_eq!(json["privilege"], want_mode);
}

/// The premise of rootless isolation, as the host sees it: the workers of
/// two sessions have the user's own uid, and each has user, pid and mount
/// namespaces of its own, none of them the supervisor's or the other's.
/// Both are not dumpable: their /proc files belong to root.
#[test]
fn two_sessions_share_the_host_uid_but_no_namespace() {
    if !rootless_only("two_sessions_share_the_host_uid_but_no_namespace") {
        return;
    }
    let sup = supervisor();
    let (a, b) = (sup.session().unwrap(), sup.session().unwrap());
    let (pa, pb) = (worker_pid(&a), worker_pid(&b));
    let me = std::process::id();
    // SAFETY: getuid has no arguments and cannot fail.
    let uid = unsafe { libc::getuid() };
    assert_eq!((host_uid(pa), host_uid(pb)), (uid, uid));
    for kind in ["user", "pid", "mnt", "net", "ipc", "uts", "cgroup"] {
        let (na, nb, nme) = (ns(pa, kind), ns(pb, kind), ns(me, kind));
        assert_ne!(na, nb, "the two workers share their {kind} namespace");
        assert_ne!(na, nme, "a worker shares the supervisor's {kind} namespace");
    }
    let zygote = sup.pool_status().zygote_pid.expect("the zygote runs");
    assert_ne!(
        ns(zygote, "user"),
        ns(me, "user"),
        "the zygote has no user namespace of its own"
    );
    for pid in [pa, pb] {
        assert_eq!(
            status_field(pid, "NSpid").map(|v| v.split_whitespace().last().map(String::from)),
            Some(Some("1".into())),
            "worker {pid} is not pid 1 of its namespace"
        );
        use std::os::unix::fs::MetadataExt;
        let owner = std::fs::metadata(format!("/proc/{pid}/environ"))
            .unwrap()
            .uid();
        assert_eq!(
            owner, 0,
            "worker {pid} is dumpable (its environ belongs to {owner})"
        );
    }
    // Inside, the user's uid is mapped to the worker's, and nothing else.
    let map = console(&a, "cat(readLines('/proc/self/uid_map'), sep = '\\n')");
    let fields: Vec<&str> = map.split_whitespace().collect();
    assert_eq!(fields.len(), 3, "one line of three numbers: {map}");
    assert_eq!(fields[1], uid.to_string(), "{map}");
    assert_eq!(fields[2], "1", "{map}");
    assert_ne!(fields[0], "0", "the worker is root inside: {map}");
}

/// `kill(-1, SIGKILL)` signals every process its caller may signal: with
/// one host uid for every worker, without the pid namespace it would kill
/// every other session's worker, the zygote and the supervisor. Everyone
/// lives, and so does the attacker.
#[test]
fn attack_kill_every_process_of_the_same_uid() {
    let sup = supervisor();
    assert!(sup.pool().wait_ready(DEADLINE));
    let zygote = sup.pool_status().zygote_pid.expect("the zygote runs");
    let (a, b) = (sup.session().unwrap(), sup.session().unwrap());
    console(&b, "b_state <- 'alive'");
    let b_pid = worker_pid(&b);
    let r = run(
        &a,
        "for (sig in c(15L, 19L, 9L)) cat('kill -1', sig, '=', tools::pskill(-1L, sig), '\\n')\n\
         cat('still here\\n')",
    );
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    assert!(r.console.contains("still here"));
    assert_nobody_harmed(&sup, &a, &b, b_pid, zygote);
}

/// Session A goes for session B's worker, which has the same host uid
/// (rootless): its memory, environment, command line, open files, root and
/// temporary directory through B's host pid, every pid A can see, and B's
/// host paths. B's secret must not reach A, and A sees no process but its
/// own (B keeps a forked child alive meanwhile).
#[test]
fn attack_same_uid_session_reads_another() {
    let sup = supervisor();
    let (a, b) = (sup.session().unwrap(), sup.session().unwrap());
    let b_secret = secret("b");
    let b_dir = console(
        &b,
        &format!(
            "b_secret <- '{b_secret}'; writeLines(b_secret, file.path(tempdir(), 'b.txt'))\n\
             writeLines(b_secret, '/tmp/b.txt')\n\
             job <- parallel::mcparallel({{ Sys.sleep(30); b_secret }})\n\
             cat(tempdir())"
        ),
    );
    let b_dir = b_dir.trim().to_string();
    let b_pid = worker_pid(&b);
    let code = format!(
        r#"{ATTEMPT}
p <- {b_pid}L
for (f in c("mem", "environ", "cmdline", "maps", "status", "fd", "root/tmp/b.txt", "cwd"))
  .attempt(f, if (f %in% c("fd", "cwd")) {{ x <- list.files(sprintf("/proc/%d/%s", p, f)); if (!length(x)) stop("nothing"); x }}
              else readBin(sprintf("/proc/%d/%s", p, f), "raw", 65536))
.attempt("dir_by_path", readLines(file.path('{b_dir}', "b.txt")))
.attempt("host_tmp", readLines("/tmp/b.txt"))
mine <- list.files("/proc", pattern = "^[0-9]+$")
cat("pids:", mine, "\n")
for (q in mine) .attempt(paste0("environ_", q), {{ e <- readBin(sprintf("/proc/%s/environ", q), "raw", 65536); rawToChar(e[e != as.raw(0)]) }})
"#
    );
    let r = run(&a, &code);
    assert_eq!(r.outcome, Outcome::Complete, "{}", r.console);
    let all = format!("{}{:?}{:?}", r.console, r.error, r.result);
    assert!(!all.contains(&b_secret), "B's secret reached A:\n{all}");
    assert_denied(
        &r.console,
        &[
            "mem",
            "environ",
            "cmdline",
            "maps",
            "status",
            "fd",
            "root/tmp/b.txt",
            "cwd",
            "dir_by_path",
            "host_tmp",
        ],
    );
    let pids: HashSet<&str> = r
        .console
        .lines()
        .find_map(|l| l.strip_prefix("pids: "))
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        pids,
        HashSet::from(["1"]),
        "A sees other processes:\n{}",
        r.console
    );
    let rb = run(&b, "cat(b_secret)");
    assert_eq!(rb.console, b_secret);
}

/// Same-uid processes may ptrace and read each other's memory unless
/// something stands between them. From inside A: no namespace of B's can
/// be entered (setns and unshare are denied, so a second user namespace
/// cannot be made to get capabilities back), and A cannot create a new
/// user namespace by unshare or by forking into one.
#[test]
fn attack_new_user_namespace_from_a_worker() {
    let sup = supervisor();
    let s = sup.session().unwrap();
    let c = console(
        &s,
        r#"
pid <- parallel::mcparallel(Sys.getpid())
res <- parallel::mccollect(pid)
cat("child_pid =", unlist(res), "\n")
cat("uid_map =", readLines("/proc/self/uid_map"), "\n")
.w <- tryCatch({ writeLines("0 0 1", "/proc/self/uid_map"); "ALLOWED" }, error = function(e) "DENIED", warning = function(w) "DENIED")
cat("rewrite_uid_map =", .w, "\n")
"#,
    );
    assert!(c.contains("rewrite_uid_map = DENIED"), "{c}");
    // forked children stay in the worker's pid namespace (pid 2, 3, ...).
    let child: u32 = c
        .lines()
        .find_map(|l| l.strip_prefix("child_pid = "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{c}"));
    assert!(
        child < 100,
        "a forked child has pid {child}: not in the worker's namespace"
    );
}

/// The same default everywhere: the `rvisor` command run by this user
/// confines (pid 1, new root, seccomp) without any flag, and its health
/// says the mode.
#[test]
fn the_command_line_confines_by_default() {
    let dir = TestDir::new("rvisor-rootless");
    let script = dir.path().join("one.R");
    std::fs::write(
        &script,
        "st <- readLines('/proc/self/status')\n\
         cat(Sys.getpid(), grep('^Seccomp:', st, value = TRUE), file.exists('/home'), '\\n')\n",
    )
    .unwrap();
    let out = Command::new(rvisor_ffi_tests::rvisor_bin())
        .arg("run")
        .arg(&script)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fields: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(fields, ["1", "Seccomp:", "2", "FALSE"], "{text}");
    let out = Command::new(rvisor_ffi_tests::rvisor_bin())
        .args(["health", "--json"])
        .output()
        .unwrap();
    let h: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    let want = if rootless() { "rootless" } else { "root" };
    assert_eq!(h["sandbox"]["privilege"], want, "{h}");
}

/// A rootless worker's limits hold without cgroups: RLIMIT_NPROC counts the
/// processes of the worker's own user namespace, so a fork bomb stops at
/// the limit and a second session of the same supervisor (same host uid)
/// still forks.
#[test]
fn fork_bomb_in_one_session_leaves_the_other_forking() {
    let sup = supervisor();
    let (a, b) = (sup.session().unwrap(), sup.session().unwrap());
    let bomb = console(
        &a,
        r#"n <- 0
for (i in 1:2000) {
  ok <- tryCatch({ parallel::mcparallel(Sys.sleep(30)); TRUE }, error = function(e) FALSE)
  if (!ok) break
  n <- n + 1
}
cat(n)"#,
    );
    let n: u64 = bomb.trim().parse().unwrap_or_else(|_| panic!("{bomb}"));
    assert!(n < rvisor::Limits::default().processes, "forked {n}");
    let r = run(
        &b,
        "cat(unlist(parallel::mclapply(1:2, function(i) i * 10L, mc.cores = 2)))",
    );
    assert_eq!(
        (r.outcome, r.console.trim()),
        (Outcome::Complete, "10 20"),
        "a fork bomb in session A ({n} children) stopped session B from forking"
    );
}
