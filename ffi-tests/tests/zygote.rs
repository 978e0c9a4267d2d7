//! The zygote and its pool end to end: an embedded R initialised once that
//! forks ready workers (the warm zygote, and the preloaded one for code that
//! names a preloaded package), the pre-forked spares, the restart after the
//! zygote dies, and plain spawning when it is disabled or down. Every test
//! runs real R.
//!
//! Workers forked from the zygote are confined by the OS (the default): the
//! zygote forks each into a new pid namespace, so the worker is the
//! zygote's child and pid 1 of its own pid namespace, and its
//! temporary directory is a private tmpfs that the test reads through
//! `/proc/<pid>/root` (the tests run as root, as confinement requires).
//!
//! No test sleeps and hopes: each waits for a condition by polling it, with a
//! generous deadline after which the test fails as hung. No duration is
//! asserted as a speed claim.

use base64::Engine;
use rvisor::{
    CallContext, CallOptions, EnvPolicy, Outcome, PoolConfig, PoolMode, PoolStatus, RunResult,
    Session, SessionOptions, Supervisor, SupervisorConfig, Tool,
};
use rvisor_ffi_tests::inside;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long anything may take before the test calls it a hang. Generous: a
/// zygote loads ggplot2 and several test processes start R at once.
const DEADLINE: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------
// Helpers

fn supervisor_with(pool: PoolConfig) -> Supervisor {
    supervisor_of(pool, rvisor::WorkerConfig::default())
}

fn supervisor_of(pool: PoolConfig, worker: rvisor::WorkerConfig) -> Supervisor {
    // Spawned workers cannot be confined (only the zygote forks confined
    // ones): a pool without a zygote is the explicit unconfined mode.
    let confinement = if pool.zygote {
        rvisor::Confinement::default()
    } else {
        rvisor::Confinement::unconfined()
    };
    Supervisor::new(SupervisorConfig {
        pool,
        confinement,
        worker,
        ..SupervisorConfig::default()
    })
    .expect("supervisor starts")
}

/// A supervisor with the default pool whose zygote is up and whose spares
/// are ready.
fn ready_supervisor() -> Supervisor {
    ready(supervisor_with(PoolConfig::default()))
}

fn ready(sup: Supervisor) -> Supervisor {
    assert!(
        sup.pool().wait_ready(DEADLINE),
        "the zygote did not come up: {:?}",
        sup.pool_status()
    );
    sup
}

/// Polls until `cond` holds; panics with `what` after [`DEADLINE`].
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `code` in `session` and returns its result, failing on a hang.
fn call(session: &Session, code: &str) -> RunResult {
    session
        .run(code)
        .expect("the call is accepted")
        .wait_timeout(DEADLINE)
        .unwrap_or_else(|| panic!("no result for {code:?} within {DEADLINE:?}"))
}

/// Like [`call`], and the call must complete.
fn call_ok(session: &Session, code: &str) -> RunResult {
    let r = call(session, code);
    assert_complete(&r);
    r
}

fn assert_complete(r: &RunResult) {
    assert_eq!(
        r.outcome,
        Outcome::Complete,
        "call {:?} did not complete: error {:?}, console {:?}",
        r.code,
        r.error,
        r.console
    );
}

/// The lines a call printed with `cat(..., sep = '\n')`.
fn lines(r: &RunResult) -> Vec<String> {
    r.console.lines().map(str::to_string).collect()
}

/// The host pid of the session's worker (started by a call if need be).
/// (R's `Sys.getpid()` is 1 in every confined worker.)
fn worker_pid(session: &Session) -> u32 {
    call_ok(session, "invisible(0)");
    let st = session.status();
    st.pid.unwrap_or_else(|| panic!("no worker pid: {st:?}"))
}

/// Field `name` of /proc/<pid>/<file> (`status`, `smaps_rollup`).
fn proc_field(pid: u32, file: &str, name: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/{file}"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/{file}: {e}"));
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("no {name} line in /proc/{pid}/{file}"))
        .trim()
        .to_string()
}

/// Field `name` of /proc/<pid>/status.
fn proc_status(pid: u32, name: &str) -> String {
    proc_field(pid, "status", name)
}

/// The parent process id of `pid`; panics if it does not run.
fn ppid_of(pid: u32) -> u32 {
    rvisor_ffi_tests::parent_pid(pid).unwrap_or_else(|| panic!("process {pid} does not run"))
}

/// Whether `pid` is pid 1 of its own pid namespace (a confined worker).
fn is_ns_init(pid: u32) -> bool {
    let ns = proc_status(pid, "NSpid");
    let ids: Vec<&str> = ns.split_whitespace().collect();
    ids.len() >= 2 && ids.last() == Some(&"1")
}

/// The zygote's pid; panics if it is not up.
fn zygote_pid(sup: &Supervisor) -> u32 {
    let st = sup.pool_status();
    st.zygote_pid
        .unwrap_or_else(|| panic!("no zygote pid: {st:?}"))
}

/// Asserts that worker `pid` was forked by zygote `z` into confinement:
/// the zygote is its parent, and it is pid 1 of its own pid namespace.
fn assert_forked_by(z: u32, pid: u32) {
    let parent = ppid_of(pid);
    assert_eq!(
        parent, z,
        "worker {pid}'s parent {parent} is not zygote {z}"
    );
    assert!(
        is_ns_init(pid),
        "worker {pid} is not in a pid namespace of its own"
    );
}

/// Asserts that `session`'s worker was forked by the zygote; returns its
/// host pid.
fn assert_forked(sup: &Supervisor, session: &Session) -> u32 {
    let pid = worker_pid(session);
    assert_forked_by(zygote_pid(sup), pid);
    pid
}

/// A tool for one-shot runs (whose worker is gone when the result is
/// back): it checks, while R waits for it, that the calling worker was
/// forked by zygote `z`, and answers "forked".
fn lineage_tool(z: u32) -> Tool {
    Tool::new(
        "lineage",
        "where the worker came from",
        json!({}),
        move |call| {
            // A confined worker's root as the host sees it: /proc/<pid>/root.
            let root = call
                .worker_root
                .as_ref()
                .ok_or("the worker is not confined")?;
            let pid: u32 = root
                .parent()
                .and_then(Path::file_name)
                .and_then(|p| p.to_str())
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("no pid in {}", root.display()))?;
            let parent = ppid_of(pid);
            if parent != z || !is_ns_init(pid) {
                return Err(format!(
                    "worker {pid} (parent {parent}) was not forked by {z}"
                ));
            }
            Ok(json!("forked"))
        },
    )
    .unwrap()
}

fn png_magic(data_base64: &str) {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data_base64)
        .expect("valid base64");
    assert!(bytes.len() > 8, "a PNG has more than 8 bytes");
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
}

fn assert_one_png(r: &RunResult) {
    assert_complete(r);
    assert_eq!(
        r.plots.len(),
        1,
        "call {:?}: plots {}",
        r.code,
        r.plots.len()
    );
    assert_eq!(r.plots[0].mime, "image/png");
    png_magic(&r.plots[0].data_base64);
}

// ---------------------------------------------------------------------------
// 1. Ready zygote

/// The R version read from the installation without starting R (what a
/// Jupyter kernel answers kernel_info with while R starts) is the one the
/// zygote's R reports, and `r_version_now` gives it before the zygote is
/// up as after.
#[test]
fn the_installed_r_version_is_the_one_the_zygote_runs() {
    let installed = rvisor::pool::installed_r_version().expect("read from R_HOME");
    let sup = supervisor_with(PoolConfig::default());
    assert_eq!(
        sup.pool().r_version_now().as_deref(),
        Some(installed.as_str())
    );
    let started = sup
        .pool()
        .r_version(DEADLINE)
        .expect("the zygote says its version");
    assert_eq!(started, installed);
    let session = sup.session().unwrap();
    let r = call_ok(&session, "cat(format(getRversion()))");
    assert_eq!(r.console, installed);
}

#[test]
fn ready_zygote_preloads_ggplot2_keeps_spares_and_forks_session_workers() {
    let sup = ready_supervisor();
    let st: PoolStatus = sup.pool_status();
    assert_eq!(st.mode, PoolMode::Zygote, "{st:?}");
    let z = st.zygote_pid.expect("a zygote pid");
    assert!(Path::new(&format!("/proc/{z}")).exists(), "zygote {z} runs");
    assert!(
        st.preloaded.iter().any(|p| p == "ggplot2"),
        "ggplot2 preloaded: {st:?}"
    );
    let pz = st.preloaded_zygote_pid.expect("a preloaded zygote");
    assert_eq!(
        ppid_of(pz),
        z,
        "the preloaded zygote is the warm one's child"
    );
    assert!(st.startup_ms.contains_key("preloaded.preload"), "{st:?}");
    assert_eq!(st.spares_target, PoolConfig::default().spares);
    assert!(st.zygote_starts >= 3, "base, warm, preloaded: {st:?}");
    assert_eq!(st.last_error, None);
    wait_until("the spares of both zygotes to reach their target", || {
        let st = sup.pool_status();
        st.spares >= st.spares_target && st.preloaded_spares >= st.preloaded_spares_target
    });

    // A session whose first call names ggplot2 is forked by the preloaded
    // zygote: the namespace is loaded (not attached) before library().
    let session = sup.session().expect("session");
    let r = call_ok(
        &session,
        "cat(isNamespaceLoaded('ggplot2'), 'package:ggplot2' %in% search())",
    );
    assert_eq!(r.console, "TRUE FALSE");
    let pid = session.status().pid.expect("a worker");
    assert_forked_by(pz, pid);
    // Without the preload's expensive extras: geom_smooth's mgcv (and its
    // Matrix) are not in the zygote's heap.
    let r = call_ok(
        &session,
        "cat(isNamespaceLoaded('mgcv'), isNamespaceLoaded('Matrix'))",
    );
    assert_eq!(r.console, "FALSE FALSE");
}

/// With `preload_on_first_use` (the command's default) no preloaded
/// zygote is made until a call names a preload: a server whose sessions
/// never use ggplot2 does not hold it. The first session that names it
/// runs at once in a warm worker, which loads ggplot2 itself, and that
/// ask starts the preloaded zygote, whose workers later sessions get.
#[test]
fn the_preloaded_zygote_is_made_when_a_call_first_names_a_preload() {
    let sup = ready(supervisor_with(PoolConfig {
        preload_on_first_use: true,
        ..PoolConfig::default()
    }));
    let st = sup.pool_status();
    let warm = st.zygote_pid.expect("a warm zygote");
    assert_eq!(st.preloaded_zygote_pid, None, "not made yet: {st:?}");
    let plain = sup.session().expect("session");
    call_ok(&plain, "x <- 1");
    assert_eq!(sup.pool_status().preloaded_zygote_pid, None);
    let first = sup.session().expect("session");
    let r = call_ok(
        &first,
        "library(ggplot2); ggplot(mtcars, aes(wt, mpg)) + geom_point()",
    );
    assert_one_png(&r);
    assert_forked_by(warm, first.status().pid.expect("a worker"));
    assert!(sup.pool().wait_ready(DEADLINE), "{:?}", sup.pool_status());
    let pz = sup
        .pool_status()
        .preloaded_zygote_pid
        .expect("made once a call named ggplot2");
    let next = sup.session().expect("session");
    assert_one_png(&call_ok(
        &next,
        "library(ggplot2); ggplot(mtcars, aes(wt, mpg)) + geom_point()",
    ));
    assert_forked_by(pz, next.status().pid.expect("a worker"));
}

/// Sessions that do not name a preloaded package run in workers of the
/// warm zygote, without it (a full gc() there makes a third of the heap
/// private); ggplot2 works there all the same, loaded on first use, with
/// and without library(). A session that named it keeps preloaded workers
/// across resets; one-shot runs are routed by their code.
#[test]
fn sessions_that_do_not_name_ggplot2_run_without_it_and_can_still_use_it() {
    let sup = ready_supervisor();
    let st = sup.pool_status();
    let warm = st.zygote_pid.expect("a warm zygote");
    let pz = st.preloaded_zygote_pid.expect("a preloaded zygote");

    // (The package's name is built at run time where a call must not
    // name it.)
    let plain = sup.session().expect("session");
    let r = call_ok(
        &plain,
        "gg <- paste0('gg', 'plot2'); cat(isNamespaceLoaded(gg))",
    );
    assert_eq!(r.console, "FALSE");
    let pid = plain.status().pid.expect("a worker");
    assert_forked_by(warm, pid);
    let r = call_ok(
        &plain,
        "cat(isNamespaceLoaded('grid'), isNamespaceLoaded('scales'))",
    );
    assert_eq!(
        r.console, "FALSE FALSE",
        "nothing of ggplot2 in the warm zygote"
    );
    // Base graphics are warm there: a plot renders.
    assert_one_png(&call_ok(&plain, "plot(1:10)"));
    // ggplot2:: without library(): loaded by `::`, the plot renders, in the
    // same worker (nothing is moved).
    let r = call_ok(
        &plain,
        "print(ggplot2::ggplot(mtcars, ggplot2::aes(wt, mpg)) + ggplot2::geom_point())",
    );
    assert_one_png(&r);
    assert_eq!(plain.status().pid, Some(pid));
    assert_eq!(plain.status().generation, 1);
    // A later session that uses library() first thing gets it preloaded,
    // and its plots render.
    let lib = sup.session().expect("session");
    let r = call_ok(
        &lib,
        "library(ggplot2); ggplot(mtcars, aes(wt, mpg)) + geom_point()",
    );
    assert_one_png(&r);
    assert_forked_by(pz, lib.status().pid.expect("a worker"));
    // library() in a session without the preload loads and attaches it.
    let late = sup.session().expect("session");
    call_ok(&late, "x <- 1");
    let first = late.status().pid.expect("a worker");
    assert_forked_by(warm, first);
    let r = call_ok(
        &late,
        "library(ggplot2); print(ggplot(mtcars, aes(wt, mpg)) + geom_point()); cat(x)",
    );
    assert_one_png(&r);
    assert!(r.console.ends_with('1'), "{:?}", r.console);
    // From then on its workers are preloaded ones: after a reset too.
    late.reset();
    let r = call_ok(&late, "cat(isNamespaceLoaded(paste0('gg', 'plot2')))");
    assert_eq!(r.console.lines().last(), Some("TRUE"), "{:?}", r.console);
    assert_forked_by(pz, late.status().pid.expect("a worker"));

    // One-shot runs: by their code.
    let opts = CallOptions::default();
    let r = sup.run_once("cat(isNamespaceLoaded(paste0('gg', 'plot2')))", &opts);
    assert_complete(&r);
    assert_eq!(r.console, "FALSE");
    let r = sup.run_once(
        "cat(isNamespaceLoaded('ggplot2')); print(ggplot2::ggplot(mtcars, ggplot2::aes(wt, mpg)) + ggplot2::geom_point())",
        &opts,
    );
    assert_one_png(&r);
    assert!(r.console.starts_with("TRUE"), "{:?}", r.console);
}

#[test]
fn the_warm_zygote_compiles_the_condition_handlers_and_leaves_no_trace_of_its_warm_up() {
    let sup = ready_supervisor();
    assert!(sup.pool_status().warm, "{:?}", sup.pool_status());
    let session = sup.session().expect("session");
    // The warm-up's warnings and errors are not the new session's.
    let r = call_ok(
        &session,
        "cat(exists('last.warning', envir = baseenv()), exists('.Traceback', envir = baseenv()))",
    );
    assert_eq!(r.console, "FALSE FALSE");
    // The driver came compiled with the fork: the warm zygote compiled
    // every function of it, the small ones R's JIT never compiles (it
    // marks a small closure outside the global environment "never JIT":
    // the message and interrupt handlers, begin_call) included, and its
    // condition handlers ran there (before, a session's first two errors
    // each compiled one, 13-16 ms apiece).
    let r = call_ok(
        &session,
        "h <- globalCallingHandlers(); d <- environment(h$error); \
         f <- c(h[c('error', 'warning', 'message', 'interrupt')], \
                list(d$begin_call, d$end_call, d$begin_expr, d$clip)); \
         cat(length(h), vapply(f, function(f) \
           any(grepl('<bytecode', utils::capture.output(print(f)), fixed = TRUE)), NA))",
    );
    // Four handlers: the compiled ones replaced those installed before.
    assert_eq!(r.console, "4 TRUE TRUE TRUE TRUE TRUE TRUE TRUE TRUE");
    let r = call(&session, "stop('first')");
    assert_eq!(r.outcome, rvisor::Outcome::Error);
    let r = call_ok(&session, "warnings()");
    assert_eq!(r.console, "", "the warm-up's warnings shown: {}", r.console);
}

// ---------------------------------------------------------------------------
// 2. Forked workers are independent

#[test]
fn forked_workers_have_their_own_pid_tempdir_and_random_stream() {
    let sup = ready_supervisor();
    let a = sup.session().expect("session a");
    let b = sup.session().expect("session b");
    let pid_a = assert_forked(&sup, &a);
    let pid_b = assert_forked(&sup, &b);
    assert_ne!(pid_a, pid_b);

    let tmp_a = PathBuf::from(call_ok(&a, "cat(tempdir())").console);
    let tmp_b = PathBuf::from(call_ok(&b, "cat(tempdir())").console);
    assert_ne!(tmp_a, tmp_b);
    let root = std::env::temp_dir();
    for (pid, t) in [(pid_a, &tmp_a), (pid_b, &tmp_b)] {
        assert!(inside(pid, t).is_dir(), "{} exists", t.display());
        assert!(
            t.starts_with(&root),
            "{} is under {}",
            t.display(),
            root.display()
        );
    }

    let rng = "cat(format(runif(3), digits = 17), sep = '\\n')";
    let ra = lines(&call_ok(&a, rng));
    let rb = lines(&call_ok(&b, rng));
    assert_eq!(ra.len(), 3);
    assert_eq!(rb.len(), 3);
    assert_ne!(ra, rb, "two forked workers share a random stream");

    // A file in a's temp dir is not in b's.
    let name = "only-in-a.txt";
    let w = call_ok(
        &a,
        &format!("writeLines('a', file.path(tempdir(), '{name}')); cat(file.exists(file.path(tempdir(), '{name}')))"),
    );
    assert_eq!(w.console, "TRUE");
    assert!(inside(pid_a, &tmp_a).join(name).is_file());
    let seen = call_ok(
        &b,
        &format!("cat(file.exists(file.path(tempdir(), '{name}')), length(list.files(tempdir(), pattern = 'only-in-a')))"),
    );
    assert_eq!(seen.console, "FALSE 0");
    assert!(!inside(pid_b, &tmp_b).join(name).exists());
    // Nor can b see a's directory at all.
    let r = call_ok(&b, &format!("cat(dir.exists('{}'))", tmp_a.display()));
    assert_eq!(r.console, "FALSE");
}

// ---------------------------------------------------------------------------
// 3. One-shot isolation

#[test]
fn run_once_leaks_nothing_to_the_next_run() {
    let sup = ready_supervisor();
    let z = zygote_pid(&sup);
    let opts = CallOptions::default();
    // The worker of a one-shot run is gone when its result is back: a tool
    // checks where it came from while it runs.
    let ctx = CallContext {
        tools: std::sync::Arc::new(vec![lineage_tool(z)]),
        ..CallContext::default()
    };
    let once = |code: &str| sup.run_once_with(rvisor::ids::execution_id(), code, &opts, &ctx);
    let first = once(
        "x <- 1; options(foo = 'bar'); library(tools); \
         p <- file.path(tempdir(), 'run1.txt'); writeLines('hi', p); \
         Sys.setenv(FOO = 'set'); \
         cat(tools$lineage(), p, tempdir(), exists('x'), getOption('foo'), \
             'package:tools' %in% search(), file.exists(p), Sys.getenv('FOO'), sep = '\\n')",
    );
    assert_complete(&first);
    assert!(first.session.fresh);
    let l1 = lines(&first);
    assert_eq!(l1.len(), 8, "{l1:?}");
    assert_eq!(
        l1[0], "forked",
        "run 1 ran in a worker forked from the zygote"
    );
    let (path1, tmp1) = (l1[1].clone(), l1[2].clone());
    assert_eq!(&l1[3..], ["TRUE", "bar", "TRUE", "TRUE", "set"]);

    let second = once(&format!(
        "cat(tools$lineage(), exists('x'), is.null(getOption('foo')), \
             'package:tools' %in% search(), file.exists('{path1}'), Sys.getenv('FOO') == '', \
             tempdir(), sep = '\\n')"
    ));
    assert_complete(&second);
    let l2 = lines(&second);
    assert_eq!(l2.len(), 7, "{l2:?}");
    assert_eq!(
        l2[0], "forked",
        "run 2 ran in a worker forked from the zygote"
    );
    assert_eq!(&l2[1..6], ["FALSE", "TRUE", "FALSE", "FALSE", "TRUE"]);
    assert_ne!(l2[6], tmp1, "the second run has a temp dir of its own");
    assert_ne!(first.session.id, second.session.id, "two workers");
    // Run 1's directory (where its private tmpfs was mounted) is gone.
    let dir1 = Path::new(&tmp1).parent().expect("a parent");
    wait_until("run 1's directory to be removed", || !dir1.exists());
}

// ---------------------------------------------------------------------------
// 4. Zygote death and restart

#[test]
fn killed_zygote_is_replaced_and_sessions_keep_working() {
    let sup = ready_supervisor();
    let before = sup.pool_status();
    let old = before.zygote_pid.expect("a zygote pid");
    assert!(before.warm, "forks come from the warm zygote: {before:?}");
    let before_base = sup.pool().base_zygote_pid();
    assert!(before_base.is_some_and(|b| b != old), "{before:?}");
    let old_worker_session = sup.session().expect("session");
    let old_worker = assert_forked(&sup, &old_worker_session);
    call_ok(&old_worker_session, "x <- 42");

    // SAFETY: kill(2) of the zygote this test's supervisor started; it has
    // not been reaped (the pool holds its Child), so the pid is still its own.
    let rc = unsafe { libc::kill(old as libc::pid_t, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill the zygote");
    wait_until("the pool to notice that the zygote died", || {
        let st = sup.pool_status();
        st.mode != PoolMode::Zygote || st.zygote_pid != Some(old)
    });

    // Meanwhile a new session works (spawned, or forked from a new zygote).
    let fresh_session = sup.session().expect("session");
    let r = call_ok(&fresh_session, "1 + 1");
    assert_eq!(r.console, "[1] 2\n");

    // The session whose worker died with the zygote gets a fresh worker.
    let r = call(&old_worker_session, "cat(exists('x'))");
    assert_complete(&r);
    assert!(r.session.fresh, "the first result of a new worker is fresh");
    let reason = r.session.reset_reason.clone().unwrap_or_default();
    assert!(
        ["killed", "crash", "exited"].contains(&reason.as_str()),
        "reset_reason {reason:?}"
    );
    let out = r.console.lines().last().unwrap_or_default().to_string();
    let new_worker = old_worker_session.status().pid.expect("a worker pid");
    assert_ne!(new_worker, old_worker);
    assert_eq!(out, "FALSE", "the old worker's state is gone");

    // A warm zygote comes back with a new pid, forked from a new base
    // zygote: the old one had retired (given up R) once the warm one
    // served, so it could not fork another.
    wait_until("a restarted zygote", || {
        let st = sup.pool_status();
        st.mode == PoolMode::Zygote && st.warm && st.zygote_pid.is_some_and(|p| p != old)
    });
    let after_base = sup.pool().base_zygote_pid();
    assert!(
        after_base.is_some_and(|b| Some(b) != before_base),
        "a new base zygote: {after_base:?} (was {before_base:?})"
    );
    // The preloaded zygote, its child, died with it and comes back too,
    // forked from the new warm zygote.
    let sup = ready(sup);
    let st = sup.pool_status();
    assert!(
        st.preloaded.iter().any(|p| p == "ggplot2"),
        "the new zygote preloaded ggplot2: {st:?}"
    );
    assert!(st.zygote_starts >= 5, "{st:?}");
    let pz = st.preloaded_zygote_pid.expect("a preloaded zygote");
    assert_eq!(Some(ppid_of(pz)), st.zygote_pid, "{st:?}");
    // New sessions are forked from the new zygotes again.
    let later = sup.session().expect("session");
    assert_forked(&sup, &later);
    let gg = sup.session().expect("session");
    assert_eq!(
        call_ok(&gg, "cat(isNamespaceLoaded('ggplot2'))").console,
        "TRUE"
    );
    assert_forked_by(pz, gg.status().pid.expect("a worker"));
}

#[test]
fn killed_base_zygote_takes_the_warm_one_and_is_replaced() {
    let sup = ready_supervisor();
    let warm = zygote_pid(&sup);
    let base = sup.pool().base_zygote_pid().expect("a base zygote");
    assert_eq!(
        ppid_of(warm),
        base,
        "the warm zygote is the base zygote's child"
    );
    let session = sup.session().expect("session");
    assert_forked_by(warm, worker_pid(&session));
    call_ok(&session, "x <- 1");

    // SAFETY: kill(2) of the base zygote this test's supervisor started; the
    // pool holds its Child, so it is not reaped and the pid is its own.
    let rc = unsafe { libc::kill(base as libc::pid_t, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill the base zygote");
    // Its child, the warm zygote, dies with it (parent-death signal).
    wait_until("the warm zygote to die with its base", || {
        !Path::new(&format!("/proc/{warm}")).exists() || proc_status(warm, "State").starts_with('Z')
    });
    wait_until("a new base and warm zygote", || {
        let st = sup.pool_status();
        st.warm
            && st.zygote_pid.is_some_and(|p| p != warm)
            && sup.pool().base_zygote_pid().is_some_and(|b| b != base)
    });
    let r = call(&session, "cat(exists('x'))");
    assert_complete(&r);
    assert!(r.session.fresh, "{r:?}");
    assert_eq!(r.console.lines().last(), Some("FALSE"));
    let sup = ready(sup);
    let later = sup.session().expect("session");
    assert_forked(&sup, &later);
}

/// Installs a package into a new library whose load blocks until `gate`
/// exists: a preload that takes as long as the test wants.
fn gated_package(lib: &Path, gate: &Path) {
    let src = lib.join("src/rvgated");
    std::fs::create_dir_all(src.join("R")).expect("package dirs");
    std::fs::write(
        src.join("DESCRIPTION"),
        "Package: rvgated\nVersion: 0.1\nTitle: Gated load\nDescription: Blocks its load.\n\
         License: MIT\nAuthor: rvisor tests\nMaintainer: rvisor tests <t@example.org>\n",
    )
    .expect("DESCRIPTION");
    std::fs::write(src.join("NAMESPACE"), "export(gated)\n").expect("NAMESPACE");
    std::fs::write(
        src.join("R/gated.R"),
        format!(
            "gated <- function() TRUE\n.onLoad <- function(lib, pkg) {{\n  \
             end <- Sys.time() + 600\n  while (!file.exists('{}') && Sys.time() < end) Sys.sleep(0.01)\n}}\n",
            gate.display()
        ),
    )
    .expect("R file");
    let out = std::process::Command::new("R")
        .args(["CMD", "INSTALL", "--no-test-load", "-l"])
        .arg(lib)
        .arg(&src)
        .output()
        .expect("run R CMD INSTALL");
    assert!(
        out.status.success(),
        "R CMD INSTALL failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The hand-over: the base and warm zygotes serve while the preloaded one
/// is still loading its preloads (here: a package whose load waits for a
/// file), code naming the preload too, and once the preloaded one is up,
/// new workers for such code come from it with the preload.
#[test]
fn base_zygote_serves_while_the_warm_one_loads() {
    let dir = rvisor_ffi_tests::TestDir::new_in(Path::new(env!("CARGO_TARGET_TMPDIR")), "gated");
    let lib = dir.path().join("lib");
    std::fs::create_dir_all(&lib).expect("lib dir");
    let gate = dir.path().join("open");
    gated_package(&lib, &gate);
    // Confined workers (other uids) read the library: let them.
    let _ = std::process::Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(dir.path())
        .status();
    let mut cfg = SupervisorConfig {
        pool: PoolConfig {
            preload: Some(vec!["rvgated".into()]),
            ..PoolConfig::default()
        },
        ..SupervisorConfig::default()
    };
    cfg.worker.libpath = vec![lib.clone()];
    cfg.defaults.libpath = vec![lib.clone()];
    let sup = Supervisor::new(cfg).expect("supervisor starts");

    // While the preloaded zygote waits for the gate, sessions, even those
    // naming the preload, are forked by the base or warm zygote and answer.
    let session = sup.session().expect("session");
    let r = call_ok(&session, "cat('rvgated' %in% loadedNamespaces(), 1 + 1)");
    assert_eq!(r.console, "FALSE 2");
    let st = sup.pool_status();
    assert_eq!(st.mode, PoolMode::Zygote, "{st:?}");
    assert!(
        st.preloaded.is_empty() && st.preloaded_zygote_pid.is_none(),
        "the preloaded zygote cannot be up before the gate opens: {st:?}"
    );
    let base = sup.pool().base_zygote_pid().expect("a base zygote");
    let parent = ppid_of(session.status().pid.expect("a worker"));
    assert!(
        parent == base || Some(parent) == sup.pool_status().zygote_pid,
        "forked by the base ({base}) or the warm zygote, not {parent}"
    );
    assert!(st.startup_ms.contains_key("base.r_start"), "{st:?}");
    // A second session while still preloading: forked at once as well.
    let second = sup.session().expect("session");
    assert_eq!(call_ok(&second, "cat(2 + 2)").console, "4");

    std::fs::write(&gate, "").expect("open the gate");
    let sup = ready(sup);
    let st = sup.pool_status();
    assert!(st.warm, "{st:?}");
    assert_eq!(st.preloaded, ["rvgated"], "{st:?}");
    assert!(st.startup_ms.contains_key("preloaded.preload"), "{st:?}");
    let warm = st.zygote_pid.expect("a warm zygote");
    assert_ne!(warm, base);
    assert_eq!(ppid_of(warm), base, "the warm zygote is the base's child");
    let pz = st.preloaded_zygote_pid.expect("a preloaded zygote");
    assert_eq!(
        ppid_of(pz),
        warm,
        "the preloaded zygote is the warm one's child"
    );
    let later = sup.session().expect("session");
    let r = call_ok(&later, "cat('rvgated' %in% loadedNamespaces())");
    assert_eq!(r.console, "TRUE");
    assert_forked_by(pz, later.status().pid.expect("a worker"));
    let other = sup.session().expect("session");
    assert_forked_by(warm, worker_pid(&other));
    // The early sessions keep their workers (and state) from the base.
    assert_eq!(call_ok(&session, "cat(3)").console, "3");
    assert_eq!(session.status().generation, 1);
}

/// One-shot pools (`preload: Some(vec![])`) have no warm zygote at all.
#[test]
fn pool_without_preloads_has_no_warm_zygote() {
    let sup = ready(supervisor_with(PoolConfig {
        preload: Some(Vec::new()),
        spares: 0,
        ..PoolConfig::default()
    }));
    let st = sup.pool_status();
    assert_eq!(st.mode, PoolMode::Zygote);
    assert!(!st.warm, "{st:?}");
    assert_eq!(st.zygote_starts, 1, "{st:?}");
    assert_eq!(st.zygote_pid, sup.pool().base_zygote_pid());
    assert!(
        !st.startup_ms.keys().any(|k| k.starts_with("warm.")),
        "{st:?}"
    );
    let once = sup.run_once("cat(1 + 1)", &CallOptions::default());
    assert_complete(&once);
    assert_eq!(once.console, "2");
}

// ---------------------------------------------------------------------------
// 5. Zygote disabled

#[test]
fn without_zygote_workers_are_spawned() {
    let sup = supervisor_with(PoolConfig {
        zygote: false,
        ..PoolConfig::default()
    });
    assert!(!sup.pool().wait_ready(DEADLINE), "no zygote to wait for");
    let st = sup.pool_status();
    assert_eq!(st.mode, PoolMode::Spawn);
    assert_eq!(st.zygote_pid, None);
    assert_eq!(st.spares, 0);
    assert_eq!(st.spares_target, 0);
    assert!(st.preloaded.is_empty());
    assert_eq!(st.zygote_starts, 0);

    let session = sup.session().expect("session");
    let pid = worker_pid(&session);
    assert_eq!(
        ppid_of(pid),
        std::process::id(),
        "the worker was spawned by this process"
    );
    assert_eq!(call_ok(&session, "x <- 2; x * 21").console, "[1] 42\n");
    let once = sup.run_once("exists('x')", &CallOptions::default());
    assert_complete(&once);
    assert_eq!(once.console, "[1] FALSE\n");
    assert_eq!(sup.pool_status().mode, PoolMode::Spawn);
}

// ---------------------------------------------------------------------------
// 6. Explicit preload list

#[test]
fn explicit_preload_loads_what_exists_and_skips_the_rest() {
    let sup = ready(supervisor_with(PoolConfig {
        preload: Some(vec!["tools".into(), "nonexistentpkg123".into()]),
        ..PoolConfig::default()
    }));
    let st = sup.pool_status();
    assert_eq!(st.mode, PoolMode::Zygote);
    assert_eq!(st.preloaded, ["tools"], "{st:?}");
    assert!(!st.preloaded.iter().any(|p| p == "nonexistentpkg123"));
    assert!(!st.preloaded.iter().any(|p| p == "ggplot2"));

    let session = sup.session().expect("session");
    let r = call_ok(
        &session,
        "cat('tools' %in% loadedNamespaces(), 'nonexistentpkg123' %in% loadedNamespaces())",
    );
    assert_eq!(r.console, "TRUE FALSE");
    let pz = st.preloaded_zygote_pid.expect("a preloaded zygote");
    assert_forked_by(pz, session.status().pid.expect("a worker"));
}

// ---------------------------------------------------------------------------
// 7. Extra environment names

#[test]
fn extra_env_names_reach_forked_workers_only_when_asked_for() {
    let name = format!(
        "RVISOR_ZYGOTE_TEST_{}",
        rvisor::ids::random_hex(6).to_uppercase()
    );
    let value = "forked-and-visible";
    // Before the supervisor (and its zygote) exists; nextest runs each test
    // in its own process, so no other test sees it.
    std::env::set_var(&name, value);
    let sup = ready_supervisor();

    let named = sup
        .session_with(SessionOptions {
            env: EnvPolicy::Names(vec![name.clone()]),
            ..SessionOptions::default()
        })
        .expect("session with env names");
    assert_forked(&sup, &named);
    let r = call_ok(
        &named,
        &format!("cat(Sys.getenv('{name}', unset = '<unset>'))"),
    );
    assert_eq!(r.console, value);

    let plain = sup.session().expect("default session");
    assert_forked(&sup, &plain);
    let r = call_ok(
        &plain,
        &format!("cat(Sys.getenv('{name}', unset = '<unset>'))"),
    );
    assert_eq!(r.console, "<unset>");

    // Nor does the zygote's environment leak the variable to later spares.
    let again = sup.session().expect("default session");
    let r = call_ok(
        &again,
        &format!("cat(Sys.getenv('{name}', unset = '<unset>'))"),
    );
    assert_eq!(r.console, "<unset>");
}

/// A forked worker has what R's start-up put in the environment (from
/// R_HOME/etc/Renviron: PAGER, R_PAPERSIZE, R_UNZIPCMD...), as a worker
/// that started R itself has. And help() prints its page through rvisor's
/// pager (an R function: a confined worker can run no program, and
/// R's pager is a shell script), into the console in order.
#[test]
fn forked_workers_keep_the_environment_r_s_start_up_set() {
    let sup = ready_supervisor();
    let session = sup.session().expect("default session");
    assert_forked(&sup, &session);
    let r = call_ok(
        &session,
        "cat(nzchar(Sys.getenv(c('PAGER', 'R_PAPERSIZE', 'R_UNZIPCMD', 'R_SESSION_TMPDIR'))), '\\n')\n\
         cat(normalizePath(Sys.getenv('R_SESSION_TMPDIR')) == normalizePath(tempdir()), '\\n')\n\
         help('lapply', package = 'base', help_type = 'text')",
    );
    let out = lines(&r);
    assert_eq!(out[0], "TRUE TRUE TRUE TRUE ", "{}", r.console);
    assert_eq!(out[1], "TRUE ", "{}", r.console);
    // rvisor's pager printed the page into the console.
    assert!(
        r.console.contains("R Documentation"),
        "no help page: {}",
        r.console
    );
}

// ---------------------------------------------------------------------------
// 8. Temp dir clean-up

#[test]
fn forked_worker_temp_dir_is_removed_after_close() {
    let sup = ready_supervisor();
    let session = sup.session().expect("session");
    let pid = assert_forked(&sup, &session);
    let r = call_ok(
        &session,
        "writeLines('x', file.path(tempdir(), 'left-behind.txt')); cat(tempdir())",
    );
    let rtmp = PathBuf::from(&r.console);
    // The file is in the worker's private tmpfs (seen through its root).
    assert!(inside(pid, &rtmp).join("left-behind.txt").is_file());
    // R's temp dir lives inside the worker's private directory, which is
    // also a directory on the host (where that tmpfs is mounted).
    let worker_dir = rtmp.parent().expect("a parent").to_path_buf();
    assert!(worker_dir.is_dir());
    assert!(worker_dir.starts_with(std::env::temp_dir()));
    assert_eq!(
        session.status().working_dir,
        worker_dir.display().to_string()
    );

    session.close();
    wait_until("the worker's temp dir to be removed", || {
        !worker_dir.exists()
    });
    drop(session);
}

// ---------------------------------------------------------------------------
// 9. Plots in a forked worker

#[test]
fn forked_worker_draws_base_and_ggplot_plots_and_continues_them() {
    let sup = ready_supervisor();
    let session = sup.session().expect("session");
    assert_forked(&sup, &session);

    assert_one_png(&call(&session, "plot(1:10)"));
    assert_one_png(&call(
        &session,
        "library(ggplot2); ggplot(data.frame(x = 1:3, y = c(2, 1, 3)), aes(x, y)) + geom_point()",
    ));

    let first = call(&session, "plot(1:10, main = 'continued')");
    assert_one_png(&first);
    let more = call(&session, "lines(10:1); points(5, 5)");
    assert_one_png(&more);
    assert!(more.error.is_none(), "{:?}", more.error);
    assert!(more.warnings.is_empty(), "{:?}", more.warnings);
    assert_ne!(
        first.plots[0].data_base64, more.plots[0].data_base64,
        "the continued plot has the added lines"
    );
}

// ---------------------------------------------------------------------------
// 10. Forked and spawned workers look the same to R code

#[test]
fn forked_worker_has_the_search_path_of_a_spawned_one() {
    let search = "cat(search(), sep = '\\n')";
    let spawner = supervisor_with(PoolConfig {
        zygote: false,
        ..PoolConfig::default()
    });
    let spawned = spawner.session().expect("spawned session");
    let spawned_search = lines(&call_ok(&spawned, search));

    let sup = ready_supervisor();
    let forked = sup.session().expect("forked session");
    assert_forked(&sup, &forked);
    let forked_search = lines(&call_ok(&forked, search));
    assert_eq!(forked_search, spawned_search);
    // A worker of the preloaded zygote (the first call names ggplot2):
    // preloading loads namespaces; it attaches nothing the user did not
    // ask for, so code that works in one kind of worker works in the
    // others.
    let preloaded = sup.session().expect("preloaded session");
    let r = call_ok(
        &preloaded,
        "cat('ggplot2' %in% loadedNamespaces(), exists('ggplot'))",
    );
    assert_eq!(r.console, "TRUE FALSE");
    let preloaded_search = lines(&call_ok(&preloaded, search));
    assert_eq!(preloaded_search, spawned_search);
    assert!(!preloaded_search.iter().any(|p| p == "package:ggplot2"));
    let r = call_ok(&preloaded, "library(ggplot2); cat(exists('ggplot'))");
    assert_eq!(r.console, "TRUE");
}

/// Two supervisors in one process (a host application, a test) each have
/// their own cgroups: dropping one does not take away the groups the other
/// makes its confined workers in.
#[test]
fn dropping_one_of_two_supervisors_leaves_the_other_its_cgroups() {
    let pool = || PoolConfig {
        spares: 0,
        preload: Some(Vec::new()),
        ..PoolConfig::default()
    };
    let kept = ready(supervisor_with(pool()));
    let dropped = ready(supervisor_with(pool()));
    let s = dropped.session().expect("session");
    call_ok(&s, "x <- 1");
    drop(s);
    drop(dropped);
    let s = kept.session().expect("session");
    let r = call_ok(&s, "cat(Sys.getpid() > 0)");
    assert_eq!(r.console, "TRUE");
}

#[test]
fn a_tenant_librarys_next_session_takes_a_spare_forked_with_that_library() {
    let sup = ready_supervisor();
    let base = std::env::temp_dir().join(format!("rvisor-libspare-{}", std::process::id()));
    let (a, b) = (base.join("tenant-a"), base.join("tenant-b"));
    for d in [&a, &b] {
        std::fs::create_dir_all(d).unwrap();
    }
    let with = |lib: &Path| {
        sup.session_with(SessionOptions {
            libpath_after: vec![lib.to_path_buf()],
            ..SessionOptions::default()
        })
        .expect("session")
    };
    let last_lib = "lp <- .libPaths(); cat(normalizePath(lp[length(lp)]))";
    // The first session of tenant A's library is forked for it; then the
    // keeper makes a spare with that library.
    let first = with(&a);
    let r = call_ok(&first, last_lib);
    assert_eq!(r.console, a.canonicalize().unwrap().display().to_string());
    wait_until("a spare with A's library", || {
        sup.pool_status().library_spare_pids.len() == 1
    });
    let spare = sup.pool_status().library_spare_pids[0];
    // A's next session is that spare, and has A's library.
    let next = with(&a);
    let r = call_ok(&next, last_lib);
    assert_eq!(r.console, a.canonicalize().unwrap().display().to_string());
    assert_eq!(next.status().pid, Some(spare), "handed over, not forked");
    // B's library is another: not A's spare.
    wait_until("A's spare made again", || {
        sup.pool_status().library_spare_pids.len() == 1
    });
    let a_spare = sup.pool_status().library_spare_pids[0];
    let other = with(&b);
    let r = call_ok(&other, last_lib);
    assert_eq!(r.console, b.canonicalize().unwrap().display().to_string());
    assert_ne!(other.status().pid, Some(a_spare));
    // A session without a tenant library still takes a plain spare.
    let plain = sup.session().expect("session");
    let r = call_ok(
        &plain,
        "cat(length(.libPaths()) == length(unique(c(.Library, .Library.site, .libPaths()))))",
    );
    assert_eq!(r.console, "TRUE");
    let _ = std::fs::remove_dir_all(&base);
}

/// A pool of two spares whose held refills wait `hold` at most, without
/// the preloaded zygote (its spares are not what these tests count).
fn holding_supervisor(hold: Duration) -> Supervisor {
    ready(supervisor_with(PoolConfig {
        spares: 2,
        preload_on_first_use: true,
        refill_hold: hold,
        ..PoolConfig::default()
    }))
}

/// A session's first call starts in a spare taken while another was ready:
/// the keeper holds the refill back until that call has ended (its fork
/// would compete with the call), and refills an empty pool at once.
#[test]
fn a_spare_taken_while_another_is_ready_is_refilled_when_its_first_call_ends() {
    // A deadline no test reaches: only the end of the call releases it.
    let sup = holding_supervisor(Duration::from_secs(3600));
    let st = sup.pool_status();
    assert_eq!((st.spares, st.refills_held), (2, 0), "{st:?}");

    let a = sup.session().expect("session");
    let long = a.run("Sys.sleep(600)").expect("accepted");
    wait_until("A's first call in a spare, its refill held", || {
        let st = sup.pool_status();
        a.status().running.is_some() && st.spares == 1 && st.refills_held == 1
    });

    // B takes the last spare: an empty pool is refilled at once, hold or
    // not (B took no other spare's place, so it holds nothing).
    let b = sup.session().expect("session");
    call_ok(&b, "1+1");
    wait_until("the empty pool refilled despite A's hold", || {
        let st = sup.pool_status();
        st.spares == 1 && st.refills_held == 1
    });
    assert!(long.try_result().is_none(), "A's first call still runs");

    // A's first call ends: the held refill is made.
    cancel_and_wait(&a, long);
    spares_back(&sup, "both spares back once A's first call ended");
    call_ok(&a, "1+1");
}

/// A burst of new sessions larger than the spares: the asks that found
/// none ready raise how many the pool keeps (at most `spares_max`), and
/// the keeper forks up to that, so the next burst of that size is handed
/// spares; once `spares_raised_for` passed without a miss, the pool keeps
/// `spares` again and ends the others.
#[test]
fn a_burst_that_found_no_spare_raises_the_spares_kept_for_a_while() {
    let sup = ready(supervisor_with(PoolConfig {
        spares: 1,
        spares_max: 3,
        spares_raised_for: Duration::from_secs(3),
        preload_on_first_use: true,
        ..PoolConfig::default()
    }));
    let st = sup.pool_status();
    assert_eq!((st.spares, st.spares_target), (1, 1), "{st:?}");

    // Four sessions ask at once. One spare is ready and the keeper forks
    // one at a time (milliseconds each), so the other asks find none and
    // are forked for on the spot.
    let gate = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                let s = sup.session().expect("session");
                gate.wait();
                call_ok(&s, "1+1");
            });
        }
    });
    let st = sup.pool_status();
    assert!(
        (2..=3).contains(&st.spares_target),
        "three asks found no spare: {st:?}"
    );
    // Asked for before a call: the sessions take their workers then.
    wait_until("the raised number of spares ready", || {
        let st = sup.pool_status();
        st.spares_target >= 2 && st.spares == st.spares_target
    });
    let raised = sup.pool_status().spares;

    // A burst of that size now takes spares only: nothing more is raised.
    let sessions: Vec<Session> = (0..raised)
        .map(|_| sup.session().expect("session"))
        .collect();
    for s in &sessions {
        call_ok(s, "1+1");
    }
    assert_eq!(
        sup.pool_status().spares_target,
        raised,
        "{:?}",
        sup.pool_status()
    );
    drop(sessions);

    // Quiet for `spares_raised_for`: back to one spare.
    wait_until("one spare again after the quiet while", || {
        let st = sup.pool_status();
        st.spares_target == 1 && st.spares == 1
    });
}

/// Both spares are ready and no refill is held, within the deadline.
fn spares_back(sup: &Supervisor, what: &str) {
    wait_until(what, || {
        let st = sup.pool_status();
        st.spares == 2 && st.refills_held == 0
    });
}

/// Cancels `s`'s running call `call` and waits for it to end cancelled.
fn cancel_and_wait(s: &rvisor::Session, call: rvisor::CallHandle) {
    s.cancel();
    let r = call
        .wait_timeout(DEADLINE)
        .expect("the cancel ends the call");
    assert_eq!(r.outcome, Outcome::Cancelled, "{r:?}");
}

/// A first call that does not end cannot keep the pool short: the refill
/// comes at the hold's deadline, while the call still runs.
#[test]
fn a_held_refill_is_made_by_its_deadline_when_the_first_call_goes_on() {
    let sup = holding_supervisor(Duration::from_millis(200));
    let a = sup.session().expect("session");
    let long = a.run("Sys.sleep(600)").expect("accepted");
    wait_until("A's first call running", || a.status().running.is_some());
    spares_back(&sup, "both spares back while A's first call runs");
    assert!(long.try_result().is_none(), "A's first call still runs");
    cancel_and_wait(&a, long);
}

/// The worker's memory areas the kernel may merge, and all of them: the
/// `mg` flag of each area's `VmFlags` in /proc/self/smaps, which
/// `prctl(PR_SET_MEMORY_MERGE)` sets on every area, read by R in the
/// worker (a rootless run cannot read a confined worker's /proc from
/// outside).
fn mergeable_areas(session: &Session) -> (usize, usize) {
    let r = call_ok(
        session,
        "f <- grep('^VmFlags:', readLines('/proc/self/smaps'), value = TRUE); \
         cat(sum(grepl(' mg( |$)', f)), length(f), '\\n')",
    );
    let n: Vec<usize> = r
        .console
        .split_whitespace()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|e| panic!("{v:?}: {e} in {:?}", r.console))
        })
        .collect();
    assert_eq!(n.len(), 2, "{:?}", r.console);
    (n[0], n[1])
}

fn assert_merges(session: &Session, what: &str) {
    let (mg, all) = mergeable_areas(session);
    assert!(
        all > 0 && mg * 10 >= all * 9,
        "{what}: {mg} of {all} areas mergeable"
    );
}

/// `WorkerConfig::merge_pages` reaches every worker however it is made
/// (forked from the zygotes, confined; spawned without a zygote), and is
/// off by default: a merged page is a side channel between sessions.
#[test]
fn workers_ask_for_page_merging_only_when_the_host_opts_in() {
    let plain = ready_supervisor();
    let s = plain.session().expect("session");
    assert!(!plain.sandbox().page_merging, "health says it is off");
    assert_eq!(mergeable_areas(&s).0, 0, "default: a session's worker");
    drop(s);
    drop(plain);

    let merging = |pool: PoolConfig| {
        supervisor_of(
            pool,
            rvisor::WorkerConfig {
                merge_pages: true,
                ..rvisor::WorkerConfig::default()
            },
        )
    };
    let sup = ready(merging(PoolConfig::default()));
    let s = sup.session().expect("session");
    assert_forked(&sup, &s);
    assert!(sup.sandbox().page_merging, "health says it is on");
    assert_merges(&s, "a confined worker forked by the warm zygote");
    // The state is the session's as ever: merging changes no value.
    assert_eq!(lines(&call_ok(&s, "x <- 1:3; sum(x)")), vec!["[1] 6"]);
    drop(s);
    drop(sup);

    let spawned = merging(PoolConfig {
        zygote: false,
        ..PoolConfig::default()
    });
    let s = spawned.session().expect("session");
    assert_merges(&s, "a worker spawned without a zygote");
}

/// Field `name` of /proc/<pid>/smaps_rollup, in kB.
fn rollup_kb(pid: u32, name: &str) -> u64 {
    let v = proc_field(pid, "smaps_rollup", name);
    v.trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{name} of {pid} is not a size: {v:?}"))
}

/// Memory /proc/<pid>/smaps_rollup says is mapped in huge pages, in kB:
/// anonymous (huge.rs) or of the heap image's file on its tmpfs
/// (heap_image.rs).
fn huge_kb(pid: u32) -> u64 {
    rollup_kb(pid, "AnonHugePages") + rollup_kb(pid, "ShmemPmdMapped")
}

/// Memory /proc/<pid>/smaps says the process maps in mappings whose name
/// contains `name` and shares with another process (the zygote), in kB.
fn shared_kb(pid: u32, name: &str) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .unwrap_or_else(|e| panic!("smaps of {pid}: {e}"));
    let mut inside = false;
    let mut kb = 0;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: "start-end perms offset dev inode [name]".
            inside = line.contains(name);
        } else if inside && (first == "Shared_Clean:" || first == "Shared_Dirty:") {
            kb += fields
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    kb
}

/// Once the warm zygote serves, the base zygote retires: it gives up R and
/// its heap (a few MB of anonymous memory left of ~40), and it still reaps
/// the workers it forked before, which keep working meanwhile.
#[test]
fn the_base_zygote_retires_once_the_warm_one_serves_and_still_reaps_its_workers() {
    let sup = supervisor_with(PoolConfig::default());
    // A session whose first call comes before the warm zygote is up (R's
    // start, then ~1 s of warm-up): the base zygote forks its worker.
    let early = sup.session().expect("session");
    let worker = worker_pid(&early);
    let base = sup.pool().base_zygote_pid().expect("a base zygote");
    assert_eq!(
        ppid_of(worker),
        base,
        "the early worker is the base zygote's"
    );
    call_ok(&early, "x <- 41");
    let sup = ready(sup);
    wait_until("the base zygote to retire", || {
        rollup_kb(base, "Anonymous") < 8 * 1024
    });
    assert_eq!(sup.pool().base_zygote_pid(), Some(base), "the same process");
    // Its early worker still works, and forks now come from the warm zygote.
    assert_eq!(lines(&call_ok(&early, "x + 1")), vec!["[1] 42"]);
    let later = sup.session().expect("session");
    assert_forked(&sup, &later);
    assert_ne!(zygote_pid(&sup), base);
    // The early worker's end is reaped by the retired zygote (a process
    // nobody reaps stays as a zombie in /proc).
    early.close();
    wait_until("the early worker to be reaped", || {
        !Path::new(&format!("/proc/{worker}")).exists()
    });
}

/// Whether this kernel collapses anonymous memory into huge pages on
/// request (MADV_COLLAPSE, Linux 6.1), tried on a mapping of our own.
fn kernel_collapses() -> bool {
    const LEN: usize = 4 << 20;
    // SAFETY: a fresh private anonymous mapping of our own, touched, advised
    // and unmapped here; nothing else refers to it.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return false;
        }
        let start = (p as usize + (2 << 20) - 1) & !((2 << 20) - 1);
        std::ptr::write_volatile(start as *mut u8, 1);
        let ok = libc::madvise(start as *mut libc::c_void, 2 << 20, 25) == 0;
        libc::munmap(p, LEN);
        ok
    }
}

/// The warm zygote's heap is in huge pages (its image's, heap_image.rs;
/// without one, anonymous ones, huge.rs), which its forks share until they
/// write: a session's worker still shares some of them after its calls,
/// and its state is its own as ever.
#[test]
fn the_warm_zygotes_heap_is_in_huge_pages_that_workers_share() {
    if !kernel_collapses() {
        eprintln!("skipped: this kernel does not collapse memory into huge pages (MADV_COLLAPSE)");
        return;
    }
    let sup = ready_supervisor();
    let z = zygote_pid(&sup);
    // A zygote that may not mount a tmpfs (rootless) keeps its image in a
    // memfd, in small pages (which a fork does not copy either: the
    // zygote maps them in a view no fork inherits).
    let maps = std::fs::read_to_string(format!("/proc/{z}/maps")).expect("the zygote's maps");
    if maps.contains("/memfd:rvisor-heap-image") {
        eprintln!("skipped: the zygote's heap image is a memfd, in small pages (no tmpfs mount)");
        return;
    }
    // The bulk comes once the base zygote has retired (a few ms after the
    // warm one is up, longer on a loaded machine).
    wait_until("the warm zygote's heap in huge pages", || {
        huge_kb(z) >= 8 * 1024
    });
    let s = sup.session().expect("session");
    let pid = assert_forked(&sup, &s);
    assert_eq!(lines(&call_ok(&s, "v <- 1:10; sum(v)")), vec!["[1] 55"]);
    // Its writes split the zygote's huge mappings into small ones in the
    // worker (a copy-on-write fault maps 4 kB), so what it shares is read
    // in its mappings of the image (or of the heap, without one), not as
    // huge mappings of its own.
    let heap = if std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .expect("the worker's maps")
        .contains("/rvisor-heap-image")
    {
        "/rvisor-heap-image"
    } else {
        "[heap]"
    };
    let shared = shared_kb(pid, heap);
    assert!(
        shared >= 2048,
        "the session's worker {pid} shares {shared} kB of the zygote's heap ({heap})"
    );
    // A full collection writes over the whole heap: the worker's own copies.
    let r = call_ok(&s, "invisible(gc()); x <- rnorm(10); length(x)");
    assert_eq!(lines(&r), vec!["[1] 10"]);
}
