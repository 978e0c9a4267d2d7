//! rvisor-worker: embeds libR and evaluates the calls its supervisor sends.
//!
//! The supervisor starts this binary with one end of a socketpair inherited
//! as a file descriptor (its number in `RVISOR_WORKER_FD`), fds 1 and 2 as
//! pipes it reads, and fd 0 from /dev/null. Frames are those of
//! `rvisor-protocol`. There is no path another process could connect to.

mod caps;
mod confine;
mod console;
mod control;
mod deparse;
mod display;
mod due;
mod eval;
mod ffi;
mod heap_image;
mod huge;
mod hydrate;
mod interrupt;
mod link;
mod markup;
mod next_request;
mod pages;
mod pause;
mod png_save;
mod r;
mod result_block;
mod retired;
mod serve;
mod srcref;
mod state;
mod stream;
mod tools;
mod values;
mod zygote;

use rvisor_protocol::ENV_WORKER_FD;
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::Instant;

/// Stack R runs on. 8 MiB (the usual default) allows ~600 nested R calls;
/// 64 MiB lets deep recursion reach R's own expression limit or its clean
/// "C stack usage is too close to the limit" error. R treats limits above
/// 1e8 bytes as unlimited and stops checking, so "unlimited" is lowered too.
const STACK_BYTES: u64 = 64 * 1024 * 1024;
const ENV_REEXEC: &str = "RVISOR_WORKER_STACK_SET";

/// The main thread's stack size is fixed at exec from RLIMIT_STACK, so a
/// worker started with another limit sets it and executes itself again.
fn ensure_stack() {
    // SAFETY: getrlimit/setrlimit on a struct we own.
    let (cur, max) = unsafe {
        let mut rl: libc::rlimit = std::mem::zeroed();
        libc::getrlimit(libc::RLIMIT_STACK, &mut rl);
        (rl.rlim_cur, rl.rlim_max)
    };
    if cur == STACK_BYTES || std::env::var_os(ENV_REEXEC).is_some() {
        return;
    }
    let want = if max == libc::RLIM_INFINITY {
        STACK_BYTES
    } else {
        max.min(STACK_BYTES)
    };
    if want == cur {
        return;
    }
    // SAFETY: as above; a failure leaves the old limit, which R copes with.
    let ok = unsafe {
        let rl = libc::rlimit {
            rlim_cur: want,
            rlim_max: max,
        };
        libc::setrlimit(libc::RLIMIT_STACK, &rl) == 0
    };
    if !ok {
        return;
    }
    std::env::set_var(ENV_REEXEC, "1");
    let exe = std::env::current_exe();
    if let Ok(exe) = exe {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new(exe);
        // Keep argv[0] as the supervisor chose it (no host path).
        if let Some(arg0) = std::env::args_os().next() {
            cmd.arg0(arg0);
        }
        let err = cmd.args(std::env::args_os().skip(1)).exec();
        eprintln!("rvisor-worker: failed to re-execute with a larger stack: {err}");
    }
}

fn main() -> ExitCode {
    rvisor_protocol::timing::mark(rvisor_protocol::timing::WORKER_MAIN);
    if let Ok(spec) = std::env::var(rvisor_protocol::ENV_ZYGOTE_RETIRED) {
        std::env::remove_var(rvisor_protocol::ENV_ZYGOTE_RETIRED);
        return match retired::serve(&spec) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rvisor-worker (retired zygote): {e}");
                ExitCode::from(1)
            }
        };
    }
    ensure_stack();
    std::env::remove_var(ENV_REEXEC);
    // Read by the dynamic loader already (WorkerConfig::malloc_huge_pages);
    // R code and the programs it runs do not see it. A value the host
    // passed on purpose (another tunable) stays.
    if std::env::var_os(rvisor_protocol::ENV_GLIBC_TUNABLES).as_deref()
        == Some(std::ffi::OsStr::new(
            rvisor_protocol::MALLOC_HUGE_PAGES_TUNABLE,
        ))
    {
        std::env::remove_var(rvisor_protocol::ENV_GLIBC_TUNABLES);
    }
    merge_pages_if_asked();
    if let Some(fd) = std::env::var(rvisor_protocol::ENV_ZYGOTE_FD)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    {
        std::env::remove_var(rvisor_protocol::ENV_ZYGOTE_FD);
        return match zygote::run(fd) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("rvisor-worker (zygote): {e}");
                ExitCode::from(1)
            }
        };
    }
    let Some(fd) = std::env::var(ENV_WORKER_FD)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    else {
        eprintln!(
            "rvisor-worker: {ENV_WORKER_FD} is not set. This program is started by the rvisor \
             supervisor (e.g. `rvisor run script.R`), not by hand."
        );
        return ExitCode::from(2);
    };
    // SAFETY: the supervisor passed us this descriptor and nothing else in
    // the process owns it; FD_CLOEXEC keeps R's child processes from
    // inheriting the link to the supervisor.
    let stream = unsafe {
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        UnixStream::from_raw_fd(fd)
    };
    std::env::remove_var(ENV_WORKER_FD);
    match run_worker(stream) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rvisor-worker: {e}");
            ExitCode::from(1)
        }
    }
}

/// Asks the kernel to merge this process's pages with identical ones of
/// other processes that asked too, when the supervisor says so
/// (`ENV_MERGE_PAGES`): before R starts, so R's whole heap is covered;
/// a zygote's forks inherit it. A kernel without it only costs the
/// saving, so a failure is reported and the process goes on.
fn merge_pages_if_asked() {
    if std::env::var_os(rvisor_protocol::ENV_MERGE_PAGES).is_none() {
        return;
    }
    std::env::remove_var(rvisor_protocol::ENV_MERGE_PAGES);
    // SAFETY: PR_SET_MEMORY_MERGE takes an integer flag and no pointer; it
    // only sets a flag of this process's memory map.
    let rc = unsafe { libc::prctl(libc::PR_SET_MEMORY_MERGE, 1, 0, 0, 0) };
    if rc != 0 {
        eprintln!(
            "rvisor-worker: same-page merging was asked for but not set: {} (it needs Linux \
             6.4 or later with CONFIG_KSM)",
            std::io::Error::last_os_error()
        );
    }
}

/// A worker started by exec: hello, start R, serve calls.
fn run_worker(stream: UnixStream) -> Result<(), String> {
    let t0 = Instant::now();
    link::install(stream);
    if !serve::check_hello()? {
        return Ok(());
    }
    r::use_rtmp_temp_dir();
    let r = serve::start_r().map_err(|e| format!("failed to start R: {e}"))?;
    interrupt::install();
    serve::warm_up(&r);
    if std::env::var_os(WARM_LIKE_ZYGOTE).is_some() {
        // What a worker forked from the warm zygote has (less the
        // preloads): for `rvisor bench --only instructions`, which counts
        // the calls of an exec'd worker under valgrind.
        serve::compile_driver(&r);
        serve::warm_up_conditions(&r);
    }
    serve::serve_calls(&r, t0.elapsed().as_secs_f64() * 1000.0)
}

/// Set (to anything) in an exec'd worker's environment: it compiles the
/// driver and warms its condition handlers as the warm zygote does.
const WARM_LIKE_ZYGOTE: &str = "RVISOR_WORKER_WARM";
