//! The zygote: R initialised once (packages preloaded, JIT and plotting
//! warmed), then forked into ready workers on request.
//!
//! The pool starts a *base* zygote (R up, nothing preloaded: it serves
//! within R's start-up time) and asks it for a *warm* zygote, a forked
//! child that preloads and warms up while the base already serves, then
//! takes over the forking (`ToZygote::Warm`). The base zygote then retires
//! (`ToZygote::Retire`, retired.rs) and the warm one puts its heap in huge
//! pages (`ToZygote::Compact`, huge.rs).
//!
//! The zygote is single-threaded and never evaluates user code: only its own
//! warm-up. It reads `Fork` requests (with the new worker's socket and output
//! pipes attached as SCM_RIGHTS) from its control socket, forks, and reports
//! the child's pid; it reaps its children and reports how they ended. A
//! forked child takes its descriptors, environment and temporary directory
//! from the request and then runs the ordinary worker loop.

use crate::control::{chld_pipe, refuse_fork, serve_control, CHLD_PIPE};
use crate::r::r_string;
use crate::{confine, eval, ffi, interrupt, link, r, serve};
use rvisor_protocol::{
    write_frame, ForkRequest, FromZygote, RunRequest, ToZygote, WarmRequest, ZygoteHello,
    ENV_PRELOAD, ENV_ZYGOTE_BASE, PROTOCOL_VERSION,
};
use std::collections::HashSet;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Instant;

fn run_quiet(r: &r::R, code: &str) -> rvisor_protocol::RunResult {
    eval::run(
        r,
        RunRequest {
            execution_id: "zygote".into(),
            seq: 0,
            code: code.into(),
            plot_width: 200,
            plot_height: 150,
            max_output_bytes: 1 << 20,
            working_dir: None,
            cpu_limit_seconds: None,
            tools: Vec::new(),
            variables: Vec::new(),
            tables: Vec::new(),
            stream: rvisor_protocol::StreamMode::Off,
            display: Default::default(),
            spin_us: 0,
        },
        Vec::new(),
    )
}

fn valid_package_name(p: &str) -> bool {
    let mut c = p.chars();
    matches!(c.next(), Some(ch) if ch.is_ascii_alphabetic())
        && p.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '.')
}

/// Loads `wanted` (`None`: ggplot2 when installed, failures ignored) and,
/// with `plots`, draws one plot per plotting package, so a forked worker's
/// first plot costs what later ones cost. Each step's time goes to
/// `phases`.
fn preload(
    r: &r::R,
    wanted: Option<&[String]>,
    plots: bool,
    phases: &mut Phases,
) -> (Vec<String>, Vec<(String, String)>) {
    let explicit = wanted.is_some();
    let wanted: Vec<String> = match wanted {
        Some(list) => list.to_vec(),
        None => vec!["ggplot2".to_string()],
    };
    let mut loaded = Vec::new();
    let mut failed = Vec::new();
    for pkg in wanted {
        if !valid_package_name(&pkg) {
            failed.push((pkg, "not a valid package name".into()));
            continue;
        }
        // Load the namespace, do not attach it: a forked worker must see the
        // search path a spawned one sees (the pool falls back to spawning
        // while the zygote starts or restarts). Attaching made `ggplot(...)`
        // work without library(ggplot2) in forked workers only, and would
        // let a preloaded package mask functions (dplyr's filter() over
        // stats::filter) in some workers but not others. library() in the
        // worker then only attaches the already loaded namespace.
        let res = run_quiet(
            r,
            &format!("suppressPackageStartupMessages(invisible(loadNamespace('{pkg}')))"),
        );
        if res.outcome == rvisor_protocol::Outcome::Complete {
            loaded.push(pkg);
        } else if explicit {
            let why = res.error.map(|e| e.message).unwrap_or_default();
            failed.push((pkg, why));
        }
    }
    phases.mark("preload");
    if plots {
        // Warm base graphics and every loaded plotting package.
        run_quiet(
            r,
            "plot(1:10, main = 'warm'); lines(1:10); hist(c(1, 2, 2, 3))",
        );
        // grid only when a preloaded package loaded it: otherwise a worker
        // would start with a namespace (and S3 methods: Ops.unit,
        // format.unit) that R started by Rscript does not have.
        run_quiet(
            r,
            "if (isNamespaceLoaded('grid')) { grid::grid.newpage(); grid::grid.text('warm') }",
        );
        if loaded.iter().any(|p| p == "ggplot2") {
            // No geom_smooth: ggplot2 3.4's stat_smooth names `mgcv::gam`,
            // which loads mgcv and with it Matrix, nlme, lattice and
            // splines: 1.2 M more cons cells (~80 MB of heap), which every
            // worker's full gc() would make private (docs/process-model.md,
            // "Memory"). A session's first geom_smooth loads them itself.
            run_quiet(
                r,
                "print(ggplot2::ggplot(data.frame(x = c(1, 2, 3), y = c(3, 1, 2)), \
                 ggplot2::aes(x, y)) + ggplot2::geom_point() + ggplot2::geom_line() + \
                 ggplot2::labs(title = 'warm'))",
            );
        }
        if loaded.iter().any(|p| p == "lattice") {
            run_quiet(r, "print(lattice::xyplot(1:3 ~ 1:3))");
        }
        phases.mark("plots");
    }
    // Forked children must not share RNG state.
    run_quiet(
        r,
        "if (exists('.Random.seed', envir = globalenv())) rm('.Random.seed', envir = globalenv())",
    );
    (loaded, failed)
}

/// Start-up phases and their durations, for the hello.
struct Phases {
    last: Instant,
    done: Vec<(String, f64)>,
}

impl Phases {
    fn new(from: Instant) -> Self {
        Phases {
            last: from,
            done: Vec::new(),
        }
    }

    /// Records the time since the previous mark as phase `name`.
    fn mark(&mut self, name: &str) {
        let now = Instant::now();
        let ms = (now - self.last).as_secs_f64() * 1000.0;
        self.done
            .push((name.to_string(), (ms * 1000.0).round() / 1000.0));
        self.last = now;
    }
}

/// Serves as a zygote on control socket `fd`. With [`ENV_ZYGOTE_BASE`] in
/// the environment it is a base zygote: it serves as soon as R is up and
/// leaves preloads and plot warm-up to the warm zygote it forks on request.
pub fn run(fd: RawFd) -> Result<(), String> {
    let t0 = Instant::now();
    // SAFETY: the supervisor passed us this descriptor and nothing else owns it.
    let mut ctl = unsafe {
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        UnixStream::from_raw_fd(fd)
    };
    read_hello(&mut ctl)?;
    // One thread per process matters for fork(): keep BLAS single-threaded.
    for var in ["OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"] {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, "1");
        }
    }
    let base = std::env::var_os(ENV_ZYGOTE_BASE).is_some();
    std::env::remove_var(ENV_ZYGOTE_BASE);
    let mut phases = Phases::new(t0);
    let r = serve::start_r().map_err(|e| format!("failed to start R: {e}"))?;
    phases.mark("r_start");
    serve::warm_up(&r);
    phases.mark("warm_up");
    let (preloaded, failed) = if base {
        (Vec::new(), Vec::new())
    } else {
        let wanted: Option<Vec<String>> = std::env::var(ENV_PRELOAD).ok().map(|list| {
            list.split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        });
        warm(&r, wanted.as_deref(), true, &mut phases)
    };
    confine::prepare();
    phases.mark("seccomp");
    if let Ok(f) = std::fs::File::open("/proc/self/ns/pid") {
        OWN_PIDNS.store(f.into_raw_fd(), Ordering::SeqCst);
    }
    ready(&r, ctl, (preloaded, failed), t0, phases, !base)
}

/// Reads the supervisor's hello on a zygote's control socket.
fn read_hello(ctl: &mut UnixStream) -> Result<(), String> {
    match rvisor_protocol::read_frame::<_, ToZygote>(ctl) {
        Ok(ToZygote::Hello { protocol_version }) if protocol_version == PROTOCOL_VERSION => Ok(()),
        Ok(other) => Err(format!("expected a matching hello, got {other:?}")),
        Err(e) => Err(format!("failed to read the hello: {e}")),
    }
}

/// The fork loop of a ready zygote (base or warm): fork requests from
/// `ctl`, children reaped as SIGCHLD pokes `pipe`. Returns when the
/// supervisor closes the socket.
fn serve_forks(r: &r::R, ctl: UnixStream, pipe: [RawFd; 2]) -> Result<(), String> {
    // Confined workers (pid 1 of their namespaces: see `fork_confined`).
    let mut confined: HashSet<libc::pid_t> = HashSet::new();
    serve_control(
        ctl,
        pipe,
        &mut confined,
        |ctl, req, fds, confined| match req {
            ToZygote::Fork(req) => fork_worker(r, ctl, req, fds, pipe, confined),
            ToZygote::Warm(req) => fork_warm(r, ctl, req, fds, pipe),
            ToZygote::Retire => {
                // Returns only when the re-execution failed: then this zygote
                // goes on as it was (the supervisor sees no `Retired`).
                let why = crate::retired::retire(ctl.as_raw_fd(), confined);
                eprintln!("rvisor-worker (zygote): could not retire: {why}");
                Ok(())
            }
            ToZygote::Compact => {
                crate::huge::collapse_heap();
                Ok(())
            }
            ToZygote::Hello { .. } => Err("unexpected second hello".into()),
        },
    )
}

/// Forks the warm zygote (see [`ToZygote::Warm`]) and says so.
fn fork_warm(
    r: &r::R,
    ctl: &mut UnixStream,
    req: WarmRequest,
    fds: Vec<OwnedFd>,
    pipe: [RawFd; 2],
) -> Result<(), String> {
    if fds.len() != 1 {
        let message = format!("expected 1 descriptor, got {}", fds.len());
        return refuse_fork(ctl, req.worker_id, message);
    }
    let parent = std::process::id() as libc::pid_t;
    let worker_id = req.worker_id;
    // SAFETY: the zygote is single-threaded (see fork_worker), so the child
    // is a consistent copy; it continues in `become_warm`, which never
    // returns.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        become_warm(r, ctl.as_raw_fd(), req, fds, pipe, parent);
    }
    let error = std::io::Error::last_os_error();
    drop(fds); // the child has its copy
    answer_fork(ctl, worker_id, pid, "fork of the warm zygote failed", error)
}

/// Tells the supervisor how fork request `worker_id` went: `pid` from
/// fork(2), `error` its errno when negative.
fn answer_fork(
    ctl: &mut UnixStream,
    worker_id: u64,
    pid: libc::pid_t,
    what: &str,
    error: std::io::Error,
) -> Result<(), String> {
    let msg = if pid < 0 {
        FromZygote::ForkFailed {
            worker_id,
            message: format!("{what}: {error}"),
        }
    } else {
        FromZygote::Forked {
            worker_id,
            pid: pid as u32,
        }
    };
    write_frame(ctl, &msg).map_err(|e| e.to_string())
}

/// The child side of [`fork_warm`]: leaves the base zygote's descriptors,
/// dies with it, preloads and warms up, then serves forks on its own
/// control socket; never returns.
fn become_warm(
    r: &r::R,
    ctl_fd: RawFd,
    req: WarmRequest,
    fds: Vec<OwnedFd>,
    pipe: [RawFd; 2],
    parent: libc::pid_t,
) -> ! {
    let t0 = Instant::now();
    // SAFETY: in the freshly forked, single-threaded child: plain system
    // calls on descriptors it owns (the base zygote's control socket and
    // self-pipe are closed; its own are made below).
    unsafe {
        CHLD_PIPE.store(-1, Ordering::SeqCst);
        libc::close(ctl_fd);
        libc::close(pipe[0]);
        libc::close(pipe[1]);
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() != parent {
            libc::_exit(71);
        }
    }
    let code = match fds.into_iter().next() {
        Some(sock) => match serve_warm(r, UnixStream::from(sock), &req, t0) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("rvisor-worker (warm zygote): {e}");
                1
            }
        },
        None => 70,
    };
    // SAFETY: flush C stdio, then end the child without running the base
    // zygote's atexit handlers (R's among them).
    unsafe {
        libc::fflush(std::ptr::null_mut());
        libc::_exit(code)
    }
}

fn serve_warm(r: &r::R, mut ctl: UnixStream, req: &WarmRequest, t0: Instant) -> Result<(), String> {
    read_hello(&mut ctl)?;
    let mut phases = Phases::new(t0);
    let loaded = warm(r, req.preload.as_deref(), req.warm_plots, &mut phases);
    ready(r, ctl, loaded, t0, phases, true)
}

/// The warm zygote's work: preloads, plots, the driver's warm-up. Not
/// validation's: it runs only in the supervisor's one validation worker,
/// where its first call costs ~6 ms more cold, while its closures and
/// parse data in the zygote's heap cost every session 2.4 MB of private
/// memory after its first full collection (docs/process-model.md).
fn warm(
    r: &r::R,
    wanted: Option<&[String]>,
    plots: bool,
    phases: &mut Phases,
) -> (Vec<String>, Vec<(String, String)>) {
    call_quiet(r, c"jit_off");
    let loaded = preload(r, wanted, plots, phases);
    serve::warm_up(r);
    serve::warm_up_conditions(r);
    compile_driver_apart(r);
    call_quiet(r, c"jit_restore");
    phases.mark("warm_up");
    loaded
}

/// Calls a driver function of no arguments, saying on stderr (the
/// supervisor's log) if it failed.
fn call_quiet(r: &r::R, name: &std::ffi::CStr) {
    // SAFETY: on the R thread, between calls; the driver's environment is
    // preserved for the life of R.
    if let Err(e) = unsafe { r::call_driver(r.driver, name, &[]) } {
        eprintln!(
            "rvisor-worker (zygote): {} failed: {e}",
            name.to_string_lossy()
        );
    }
}

/// Byte-compiles the driver in a child process and adopts the compiled
/// closures it wrote (driver.R's compile_driver_to_file and
/// install_compiled_driver): the compiler's own code, which compiling
/// forces into the heap, stays in the child, so the workers this zygote
/// forks do not inherit it (8 MB of private memory per live session after
/// a full gc(); docs/process-model.md, "Memory"). Compiles here instead if
/// the child fails.
fn compile_driver_apart(r: &r::R) {
    // SAFETY: the zygote is single-threaded (no other thread can hold a
    // lock the child would need); the child runs R code on its only thread
    // and leaves with `_exit`, running none of the parent's atexit
    // handlers or destructors, and it touches none of the parent's sockets.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: on the R thread of the child; the driver's environment
        // is preserved for the life of R.
        let ok = unsafe { r::call_driver(r.driver, c"compile_driver_to_file", &[]) }.is_ok();
        // SAFETY: ends the child without unwinding or atexit handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) }
    }
    let mut done = pid > 0;
    if done {
        let mut status = 0;
        let waited = loop {
            // SAFETY: waits for our own child; `status` is a valid out-pointer.
            let w = unsafe { libc::waitpid(pid, &mut status, 0) };
            if w >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                break w;
            }
        };
        done = waited == pid && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    }
    if done {
        // SAFETY: on the R thread, between calls; the driver's environment
        // is preserved for the life of R.
        match unsafe { r::call_driver(r.driver, c"install_compiled_driver", &[]) } {
            Ok(_) => return,
            Err(e) => {
                eprintln!("rvisor-worker (warm zygote): could not read the compiled driver: {e}")
            }
        }
    } else {
        eprintln!(
            "rvisor-worker (warm zygote): compiling the driver in a child failed; compiling here"
        );
    }
    serve::compile_driver(r);
}

/// Says hello on `ctl` (ready since `t0`, with what was preloaded), then
/// serves forks until the supervisor closes the socket.
fn ready(
    r: &r::R,
    mut ctl: UnixStream,
    (preloaded, failed): (Vec<String>, Vec<(String, String)>),
    t0: Instant,
    mut phases: Phases,
    warm: bool,
) -> Result<(), String> {
    // The zygotes that serve sessions: collected twice (what the first
    // frees, finalizers included, the second does not find), so that a
    // worker's own full collection leaves most pages as they are here; then
    // their heap into its image (heap_image.rs), which their workers give
    // their copies back to, in huge pages where it can be. Without an image,
    // the anonymous heap in huge pages (huge.rs). The base zygote serves
    // only while the warm one starts, and `rvisor run`'s one fork, where
    // either would cost more than it saves.
    if warm {
        // SAFETY: on the R thread, between evaluations.
        unsafe {
            ffi::R_gc();
            ffi::R_gc();
        }
        match crate::heap_image::take() {
            Ok(_) => phases.mark("heap_image"),
            Err(e) => {
                eprintln!("rvisor-worker (zygote): no heap image, workers keep their copies: {e}");
                crate::huge::collapse_heap();
                phases.mark("huge_pages");
            }
        }
    }
    let pipe = chld_pipe()?;
    let hello = ZygoteHello {
        protocol_version: PROTOCOL_VERSION,
        r_version: r.version.clone(),
        pid: std::process::id(),
        preloaded,
        failed,
        startup_ms: t0.elapsed().as_secs_f64() * 1000.0,
        phases_ms: phases.done,
        warm,
    };
    write_frame(&mut ctl, &FromZygote::Hello(hello)).map_err(|e| e.to_string())?;
    serve_forks(r, ctl, pipe)
}

fn fork_worker(
    r: &r::R,
    ctl: &mut UnixStream,
    req: ForkRequest,
    fds: Vec<OwnedFd>,
    pipe: [RawFd; 2],
    confined: &mut HashSet<libc::pid_t>,
) -> Result<(), String> {
    if fds.len() != 3 {
        let message = format!("expected 3 descriptors, got {}", fds.len());
        return refuse_fork(ctl, req.worker_id, message);
    }
    if let Some(c) = &req.confine {
        guard_programs(r);
        let forked = if c.rootless {
            Ok(fork_rootless(r, ctl.as_raw_fd(), req.clone(), fds, pipe))
        } else {
            fork_confined(r, ctl.as_raw_fd(), req.clone(), fds, pipe)
        };
        let msg = match forked? {
            Ok(pid) => {
                confined.insert(pid);
                FromZygote::Forked {
                    worker_id: req.worker_id,
                    pid: pid as u32,
                }
            }
            Err(message) => FromZygote::ForkFailed {
                worker_id: req.worker_id,
                message,
            },
        };
        return write_frame(ctl, &msg).map_err(|e| e.to_string());
    }
    let zygote_pid = std::process::id() as libc::pid_t;
    // SAFETY: the zygote is single-threaded (it starts no threads and BLAS
    // is held to one), so the child is a consistent copy; it continues in
    // `become_worker`, which never returns.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        become_worker(r, ctl.as_raw_fd(), req, fds, pipe, zygote_pid, None);
    }
    let error = std::io::Error::last_os_error();
    drop(fds); // the child has its copies
    answer_fork(ctl, req.worker_id, pid, "fork failed", error)
}

/// Before the first confined fork: base R's system(), system2(), pipe()
/// and Sys.which() are made to say in words what the worker's allow-list
/// of programs refuses (the driver's `install_program_guard`), once, so
/// that each confined worker only sets its list.
fn guard_programs(r: &r::R) {
    static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !DONE.swap(true, Ordering::SeqCst) {
        // SAFETY: on the R thread (the zygote's only one); evaluates the
        // driver's own function.
        if let Err(e) = unsafe { r::eval_string("install_program_guard()", r.driver) } {
            eprintln!("rvisor-worker (zygote): the programs' messages are R's own: {e}");
        }
    }
}

/// Forks a confined worker as pid 1 of a new pid namespace: the zygote
/// enters it for its next child only (`unshare(CLONE_NEWPID)`), forks, and
/// goes back to its own (`setns`), so later forks are not affected. The
/// worker makes its other namespaces itself (`become_worker`). The outer
/// `Err` is fatal for the zygote (it could not go back to its own pid
/// namespace); the inner one is a failed fork.
fn fork_confined(
    r: &r::R,
    ctl_fd: RawFd,
    req: ForkRequest,
    fds: Vec<OwnedFd>,
    pipe: [RawFd; 2],
) -> Result<Result<libc::pid_t, String>, String> {
    let own = OWN_PIDNS.load(Ordering::SeqCst);
    if own < 0 {
        return Ok(Err("the zygote has no handle on its pid namespace".into()));
    }
    // SAFETY: unshare affects only the pid namespace of this process's
    // next children; the zygote is single-threaded.
    if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
        return Ok(Err(format!(
            "could not create the worker's pid namespace: {}",
            std::io::Error::last_os_error()
        )));
    }
    let zygote_pid = std::process::id() as libc::pid_t;
    // SAFETY: the zygote is single-threaded (see fork_worker); the child
    // continues in `become_worker`, which never returns.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        become_worker(r, ctl_fd, req, fds, pipe, zygote_pid, None);
    }
    let fork_error = std::io::Error::last_os_error();
    drop(fds); // the child has its copies
               // SAFETY: setns with a namespace descriptor we own, back to our own pid
               // namespace for the children that follow.
    if unsafe { libc::setns(own, libc::CLONE_NEWPID) } != 0 {
        return Err(format!(
            "could not return to the zygote's pid namespace: {}",
            std::io::Error::last_os_error()
        ));
    }
    if pid < 0 {
        return Ok(Err(format!("fork failed: {fork_error}")));
    }
    Ok(Ok(pid))
}

/// Rootless mode: forks a confined worker into a new user namespace and,
/// owned by it, a new pid namespace (the worker is its pid 1), in one
/// `clone(CLONE_NEWUSER | CLONE_NEWPID)`. An unprivileged zygote cannot
/// `setns` back into its own pid namespace (that needs CAP_SYS_ADMIN over
/// the host's), so unshare-fork-setns is for root only; a clone with both
/// flags needs no privilege at all. The child maps the zygote's uid/gid
/// into its user namespace (`confine::map_ids`) before anything else.
fn fork_rootless(
    r: &r::R,
    ctl_fd: RawFd,
    req: ForkRequest,
    fds: Vec<OwnedFd>,
    pipe: [RawFd; 2],
) -> Result<libc::pid_t, String> {
    let zygote_pid = std::process::id() as libc::pid_t;
    // SAFETY: geteuid/getegid take no arguments and cannot fail.
    let outer = unsafe { (libc::geteuid(), libc::getegid()) };
    let flags = (libc::CLONE_NEWUSER | libc::CLONE_NEWPID | libc::SIGCHLD) as libc::c_ulong;
    // SAFETY: clone(2) without CLONE_VM and with a null stack is fork(2)
    // with namespace flags: the child gets a copy of the address space and
    // returns here on its copy of this stack. The zygote is single-threaded
    // (see fork_worker), so no lock is held in the copy; glibc's fork-only
    // work (atfork handlers, of which the zygote registers none that
    // matter with BLAS on one thread, and the cached thread id, which
    // glibc's raise no longer uses) is skipped. The child continues in
    // `become_worker`, which never returns.
    let pid = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
    if pid == 0 {
        become_worker(r, ctl_fd, req, fds, pipe, zygote_pid, Some(outer));
    }
    let fork_error = std::io::Error::last_os_error();
    drop(fds); // the child has its copies
    if pid < 0 {
        return Err(format!(
            "could not fork the worker into a new user and pid namespace: {fork_error}"
        ));
    }
    Ok(pid as libc::pid_t)
}

/// The zygote's own pid namespace (a descriptor), to return to after
/// forking a confined worker into a new one.
static OWN_PIDNS: AtomicI32 = AtomicI32::new(-1);

/// The child side of a fork: set up, then serve calls; never returns.
/// `outer_ids`: rootless mode, the zygote's uid and gid to map into the
/// child's new user namespace.
fn become_worker(
    r: &r::R,
    ctl_fd: RawFd,
    req: ForkRequest,
    fds: Vec<OwnedFd>,
    pipe: [RawFd; 2],
    parent_pid: libc::pid_t,
    outer_ids: Option<(u32, u32)>,
) -> ! {
    let mut fds = fds.into_iter();
    let (Some(sock), Some(out), Some(err)) = (fds.next(), fds.next(), fds.next()) else {
        // SAFETY: _exit ends the child at once.
        unsafe { libc::_exit(70) }
    };
    // SAFETY: in the freshly forked, single-threaded child: plain system
    // calls on descriptors it owns (the zygote's control socket and
    // self-pipe are closed, the output pipes become fds 1 and 2).
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGCHLD, &act, std::ptr::null_mut());
        CHLD_PIPE.store(-1, Ordering::SeqCst);
        libc::close(ctl_fd);
        libc::close(pipe[0]);
        libc::close(pipe[1]);
        // The handle on the zygote's pid namespace is not a worker's business.
        let own = OWN_PIDNS.swap(-1, Ordering::SeqCst);
        if own >= 0 {
            libc::close(own);
        }
        libc::dup2(out.as_raw_fd(), 1);
        libc::dup2(err.as_raw_fd(), 2);
        libc::setpgid(0, 0);
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        // A confined worker's parent (the zygote) is outside its pid
        // namespace: getppid() says 0 there.
        let parent = if req.confine.is_some() { 0 } else { parent_pid };
        if libc::getppid() != parent {
            libc::_exit(71);
        }
    }
    drop(out);
    drop(err);

    // The worker's own environment and temporary directory. R's own
    // directories stay: R.home() reads them (the zygote set them when it
    // started R); so does what R's start-up set (PAGER, R_PAPERSIZE,
    // R_UNZIPCMD...), as a worker that started R itself has it. The
    // request's variables come after, and win.
    let r_dirs: Vec<(&str, std::ffi::OsString)> =
        ["R_HOME", "R_SHARE_DIR", "R_INCLUDE_DIR", "R_DOC_DIR"]
            .into_iter()
            .filter_map(|k| std::env::var_os(k).map(|v| (k, v)))
            .collect();
    // SAFETY: single-threaded child; clearenv/setenv do not race.
    unsafe { libc::clearenv() };
    for (k, v) in r_dirs {
        std::env::set_var(k, v);
    }
    for (k, v) in r::startup_env() {
        std::env::set_var(k, v);
    }
    for (k, v) in &req.env {
        if !k.is_empty() && !k.contains('=') && !k.contains('\0') && !v.contains('\0') {
            std::env::set_var(k, v);
        }
    }
    std::env::set_var("TMPDIR", &req.temp_dir);
    if req.confine.is_some() {
        // A home that exists inside, programs only where they live (and
        // where the allowed ones do), and the time zone named:
        // Sys.timezone() would otherwise shell out to timedatectl.
        std::env::set_var("HOME", &req.temp_dir);
        std::env::set_var("PATH", worker_path(req.confine.as_ref()));
        if std::env::var_os("TZ").is_none() {
            if let Some(tz) = host_time_zone() {
                std::env::set_var("TZ", tz);
            }
        }
    }
    // Its pagemap, for giving its copies of the zygote's pages back
    // (heap_image.rs), while it may still open it.
    crate::heap_image::open_pagemap();
    if let Some(c) = &req.confine {
        let mapped = match outer_ids {
            Some((uid, gid)) => confine::map_ids(c, uid, gid),
            None if c.rootless => Err("a rootless worker was forked without its ids".into()),
            None => Ok(()),
        };
        if let Err(e) = mapped.and_then(|()| confine::apply(c, &req.temp_dir)) {
            eprintln!("rvisor-worker: confinement failed, the worker does not start: {e}");
            // SAFETY: end the child at once.
            unsafe { libc::_exit(72) }
        }
        // detectCores() shells out, which confinement forbids; the
        // programs the worker may run, and what R says of the others.
        let r_vec = |v: Vec<&str>| {
            let items: Vec<String> = v.into_iter().map(r_string).collect();
            format!("c({})", items.join(", "))
        };
        let files = r_vec(c.programs.iter().map(|p| p.file.as_str()).collect());
        let listed = r_vec(
            c.programs
                .iter()
                .filter(|p| p.reason == "default" || p.reason == "allowed")
                .map(|p| p.name.as_str())
                .collect(),
        );
        // SAFETY: on the R thread; evaluates the driver's own functions
        // with literal arguments.
        let _ = unsafe {
            r::eval_string(
                &format!(
                    "options(mc.cores = {}L); set_programs(as.character({files}), as.character({listed}))",
                    c.cores.max(1)
                ),
                r.driver,
            )
        };
        let _ = std::env::set_current_dir(&req.temp_dir);
    }
    let rtmp = format!("{}/Rtmp", req.temp_dir);
    let _ = std::fs::create_dir_all(&rtmp);
    if let Ok(c) = CString::new(rtmp.clone()) {
        // SAFETY: on the R thread (the only thread); R reads R_TempDir as a
        // C string that must live for the process: the CString is leaked.
        unsafe { ffi::R_TempDir = c.into_raw() };
    }
    // As R sets it at start-up: where its session temporary directory is.
    std::env::set_var("R_SESSION_TMPDIR", &rtmp);
    let plot_dir = format!("{rtmp}/rvisor-plots");
    // SAFETY: on the R thread; the driver environment is preserved.
    let _ = unsafe { r::eval_string(&format!("reinit({})", r_string(&plot_dir)), r.driver) };
    let r = r::R {
        tempdir: rtmp,
        ..r.clone()
    };

    interrupt::install();
    // One call of its own before the hello: its first call no longer pays
    // for the pages a call writes (copies of the zygote's), which a spare
    // now pays before it is handed to a session.
    serve::warm_up_fork(&r);
    // SAFETY: `sock` is an owned descriptor; ownership moves to the stream.
    let stream = unsafe { UnixStream::from_raw_fd(sock.into_raw_fd()) };
    link::install(stream);
    let code = match serve::check_hello() {
        Ok(true) => match serve::serve_calls(&r, 0.0) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("rvisor-worker: {e}");
                1
            }
        },
        Ok(false) => 0,
        Err(e) => {
            eprintln!("rvisor-worker: {e}");
            1
        }
    };
    // SAFETY: flush C stdio, then end the child without running the
    // zygote's atexit handlers.
    unsafe {
        libc::fflush(std::ptr::null_mut());
        libc::_exit(code)
    }
}

/// `PATH` in a confined worker: the directories of the allowed programs
/// that live elsewhere, then the system's program directories, so that a
/// program allowed by name is found by that name inside, as the
/// supervisor found it on its own `PATH` (a pandoc in `~/.local/bin` over
/// the system's).
fn worker_path(c: Option<&rvisor_protocol::Confine>) -> String {
    let system = ["/usr/local/bin", "/usr/bin", "/bin"];
    let mut dirs: Vec<&str> = Vec::new();
    for p in c.map(|c| c.programs.as_slice()).unwrap_or_default() {
        if p.reason != "default" && p.reason != "allowed" {
            continue;
        }
        let Some(dir) = std::path::Path::new(&p.path)
            .parent()
            .and_then(|d| d.to_str())
        else {
            continue;
        };
        if !dir.is_empty() && !dir.contains(':') && !system.contains(&dir) && !dirs.contains(&dir) {
            dirs.push(dir);
        }
    }
    dirs.extend(system);
    dirs.join(":")
}

/// The host's time zone name (`/etc/timezone`, else the target of the
/// `/etc/localtime` link), if it has one.
fn host_time_zone() -> Option<String> {
    if let Ok(s) = std::fs::read_to_string("/etc/timezone") {
        let s = s.trim();
        if !s.is_empty() && !s.contains('\0') {
            return Some(s.to_string());
        }
    }
    let link = std::fs::read_link("/etc/localtime").ok()?;
    let s = link.to_str()?;
    let name = s.split("zoneinfo/").nth(1)?;
    (!name.is_empty()).then(|| name.to_string())
}
