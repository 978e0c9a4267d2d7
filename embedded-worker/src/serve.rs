//! The loop every worker runs, exec'd or forked from the zygote: R started
//! with its hooks wired to the capture, the call and the tools; the
//! supervisor's hello; calls until shutdown; and the warm-up that runs the
//! driver before the first real call.
//!
//! Sits above `eval` and `tools` (it connects R's hooks to them) and below
//! `main` and `zygote`, which both use it.

use crate::{console, eval, interrupt, link, pause, r, state, stream, tools};
use rvisor_protocol::{
    timing, FrameError, FromWorker, StateOutcome, ToWorker, WorkerHello, PROTOCOL_VERSION,
};
use std::time::Instant;

/// Starts R with its hooks delivering to this worker's modules: console
/// text to the capture, `quit()` and the driver's reports to the call, and
/// `tools$name()` to the tools.
pub fn start_r() -> Result<r::R, String> {
    timing::mark(timing::WORKER_R_START);
    let r = r::start(r::Hooks {
        console: console_text,
        quit: eval::on_quit,
        emit: eval::on_emit,
        tool: tools::rvisor_tool,
        poll: stream::poll,
        flush: stream::flush_console,
    });
    timing::mark(timing::WORKER_R_STARTED);
    r
}

fn console_text(bytes: &[u8], stderr: bool) {
    let stream = if stderr {
        console::Stream::Stderr
    } else {
        console::Stream::Stdout
    };
    console::write_text(stream, bytes);
}

/// Reads the supervisor's hello. `Ok(false)`: the supervisor went away.
pub fn check_hello() -> Result<bool, String> {
    match link::recv() {
        Ok(ToWorker::Hello { protocol_version }) if protocol_version == PROTOCOL_VERSION => {
            Ok(true)
        }
        Ok(ToWorker::Hello { protocol_version }) => {
            let message = format!(
                "protocol mismatch: the supervisor speaks version {protocol_version}, this \
                 worker {PROTOCOL_VERSION}; install matching rvisor and rvisor-worker binaries"
            );
            let _ = link::send(&FromWorker::Fatal {
                message: message.clone(),
            });
            Err(message)
        }
        Ok(other) => Err(format!("expected hello, got {other:?}")),
        Err(FrameError::Closed) => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

/// The environment variable naming libraries that go after R's own on
/// `.libPaths()` (a tenant's packages, docs/packages.md): R reads
/// `R_LIBS` only when it starts, which for a forked worker was in the
/// zygote, and `R_LIBS` would put them before the site library.
const LIBS_AFTER: &str = "RVISOR_LIBS_AFTER";

fn add_libraries_after(r: &r::R) {
    let Some(v) = std::env::var_os(LIBS_AFTER) else {
        return;
    };
    let dirs: Vec<String> = std::env::split_paths(&v)
        .filter_map(|p| p.to_str().map(r::r_string))
        .collect();
    std::env::remove_var(LIBS_AFTER);
    if dirs.is_empty() {
        return;
    }
    // The driver reports the packages loaded from them with each result.
    let code = format!(
        "local({{ d <- c({}); .libPaths(c(.libPaths(), d)); state$libs_after <- normalizePath(d, mustWork = FALSE) }})",
        dirs.join(", ")
    );
    // SAFETY: on the R thread, R started, before the first call; the
    // driver environment is preserved; the code is base R's with literal
    // strings (quoted by r_string).
    let _ = unsafe { r::eval_string(&code, r.driver) };
}

/// Says hello with R ready, then evaluates calls until the supervisor
/// closes the link or says shutdown. Used by exec'd and forked workers.
/// How long a worker waits idle after calls before it gives its copies
/// of the zygote's pages back.
const GIVE_BACK_IDLE_MS: i32 = rvisor_protocol::GIVE_BACK_IDLE_MS as i32;

pub fn serve_calls(r: &r::R, startup_ms: f64) -> Result<(), String> {
    add_libraries_after(r);
    let hello = WorkerHello {
        protocol_version: PROTOCOL_VERSION,
        r_version: r.version.clone(),
        pid: std::process::id(),
        r_tempdir: r.tempdir.clone(),
        startup_ms,
    };
    link::send(&FromWorker::Hello(hello)).map_err(|e| e.to_string())?;
    // Calls without a working directory of their own (confined workers)
    // start each in the directory the worker was set up in.
    eval::set_home_dir(
        std::env::current_dir()
            .ok()
            .map(|d| d.display().to_string()),
    );
    // What options and environment variables are at the start: a
    // checkpoint saves only what the session changed.
    // SAFETY: on the R thread, R started; the driver is preserved.
    let _ = unsafe { r::call_driver(r.driver, c"mark_start", &[]) };
    // Whether calls ran since the worker last gave its copies of the
    // zygote's pages back (heap_image.rs): it does once idle for
    // `GIVE_BACK_IDLE_MS`, and stops as soon as a request comes.
    let mut ran = false;
    let mut gc_seconds_then = 0.0;
    // Whether to poll for the next request a moment before sleeping
    // (next_request.rs).
    let mut next = crate::next_request::NextRequest::default();
    loop {
        let came = next.poll(|| link::readable(0));
        if std::mem::take(&mut ran) && !came && !link::readable(GIVE_BACK_IDLE_MS) {
            let gc_seconds = gc_seconds(r);
            let collected = gc_seconds > gc_seconds_then;
            if !crate::heap_image::give_back(|| link::readable(0), collected).stopped {
                gc_seconds_then = gc_seconds;
            }
        }
        ran = true;
        let frame = link::recv_with_fds();
        next.arrived(Instant::now());
        match frame {
            Ok((ToWorker::Run(req), fds)) => {
                let spin_us = req.spin_us;
                answer_call(r, req, fds)?;
                next.answered(spin_us, Instant::now());
            }
            Ok((
                ToWorker::Validate {
                    script,
                    forbidden,
                    max_nesting_depth,
                    style,
                },
                _,
            )) => {
                let json = eval::validate(r, &script, &forbidden, max_nesting_depth, &style);
                // R code ran (its select wrapper may have taken the SIGINT
                // handler over): the handler is whole again before the
                // answer, after which the next call and its interrupt come.
                interrupt::install();
                link::send(&FromWorker::Validation { json }).map_err(|e| e.to_string())?;
            }
            Ok((
                ToWorker::Checkpoint {
                    working_dir,
                    max_file_bytes,
                    max_bytes,
                },
                fds,
            )) => {
                let outcome = match fds.into_iter().next() {
                    Some(fd) => {
                        state::checkpoint(r, fd.into(), working_dir, max_file_bytes, max_bytes)
                    }
                    None => Err("no file to write the checkpoint into was passed".into()),
                };
                interrupt::install();
                let msg = FromWorker::Checkpointed {
                    outcome: state_outcome(outcome),
                };
                link::send(&msg).map_err(|e| e.to_string())?;
            }
            Ok((ToWorker::Restore { working_dir }, fds)) => {
                let outcome = match fds.into_iter().next() {
                    Some(fd) => state::restore(r, fd.into(), working_dir),
                    None => Err("no checkpoint file was passed".into()),
                };
                interrupt::install();
                let msg = FromWorker::Restored {
                    outcome: state_outcome(outcome),
                };
                link::send(&msg).map_err(|e| e.to_string())?;
            }
            // An answer to a tool call that was given up (interrupted).
            Ok((ToWorker::ToolResult { .. }, _)) => {}
            Ok((ToWorker::Shutdown, _)) | Err(FrameError::Closed) => return Ok(()),
            Ok((ToWorker::Hello { .. }, _)) => return Err("unexpected second hello".into()),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The seconds R has spent collecting garbage (`gc.time()`), or 0.
fn gc_seconds(_r: &r::R) -> f64 {
    // SAFETY: on the R thread, between calls: evaluates base's own
    // function in the base environment (a binding R code cannot change)
    // and reads the double it returns at once.
    unsafe {
        match r::eval_string("gc.time()[[1L]]", crate::r::sys::R_BaseEnv) {
            Ok(v) => crate::r::sys::Rf_asReal(v),
            Err(_) => 0.0,
        }
    }
}

/// One call, from the request to its result sent: everything a call costs
/// the worker. Not inlined, and named once: the instruction-count guard
/// (`rvisor bench --only instructions`, scripts/perf-guard.sh) counts what
/// runs inside this function (callgrind's `--toggle-collect`), so that R's
/// start-up is not in the figure.
#[inline(never)]
pub fn answer_call(
    r: &r::R,
    req: rvisor_protocol::RunRequest,
    fds: Vec<std::os::fd::OwnedFd>,
) -> Result<(), String> {
    let files = fds.into_iter().map(std::fs::File::from).collect();
    let cap = req.max_output_bytes;
    let res = eval::run(r, req, files);
    pause::at("result", &res.execution_id, &res.code);
    let payload = eval::result_frame(res, cap)?;
    stream::end();
    link::flush_stdio();
    link::send_payload(&payload).map_err(|e| e.to_string())
}

fn state_outcome(r: Result<String, String>) -> StateOutcome {
    match r {
        Ok(json) => StateOutcome::Done(json),
        Err(why) => StateOutcome::Failed(why),
    }
}

/// Runs the driver a few times so R's JIT has compiled it before the first
/// real call (a new closure's second call otherwise costs ~100 ms).
pub fn warm_up(r: &r::R) {
    timing::mark(timing::WORKER_WARM_UP);
    warm_up_with(r, &["invisible(NULL)", "1", "invisible(NULL)"]);
    timing::mark(timing::WORKER_WARMED_UP);
}

/// Byte-compiles the driver's R functions (R's JIT leaves them to the AST
/// interpreter; driver.R's compile_driver). For the warm zygote: a few
/// hundred milliseconds off the request path, shared by every fork.
pub fn compile_driver(r: &r::R) {
    // SAFETY: on the R thread, between calls; the driver's environment is
    // preserved for the life of R.
    if let Err(e) = unsafe { r::call_driver(r.driver, c"compile_driver", &[]) } {
        // The zygote's stderr goes to the supervisor's log.
        eprintln!("rvisor-worker (warm zygote): could not compile the driver: {e}");
    }
}

/// Runs a warning, a message and an error twice each through the driver
/// (R's JIT compiles a closure on its second call), so that a forked
/// worker's first errors do not pay for compiling the driver's condition
/// handlers: some 13-16 ms for each of the first two errors of a session
/// otherwise (callgrind: 70 M instructions a call for an error's first
/// three calls, 0.9 M once warm). For the warm zygote: off the request
/// path, and shared by every worker it forks.
pub fn warm_up_conditions(r: &r::R) {
    warm_up_with(
        r,
        &[
            "warning('warm'); message('warm')",
            "warning('warm'); message('warm')",
            "stop('warm')",
            "stop('warm')",
        ],
    );
    // What the warm-up left that a new worker must not see: the last
    // warnings (what warnings() shows) and the last error's traceback.
    // The base environment's bindings are the symbols' values, which R
    // code cannot remove: they are unbound as R's C code binds them.
    for name in [c"last.warning", c".Traceback"] {
        // SAFETY: on the R thread, between calls; `Rf_install` returns a
        // symbol R keeps for good, and R_UnboundValue is R's own marker of
        // an unbound symbol (set_base_value only stores the pointer).
        unsafe {
            use crate::r::sys::{R_UnboundValue, Rf_install};
            r::set_base_value(Rf_install(name.as_ptr()), R_UnboundValue);
        }
    }
}

/// A forked worker's own call, before its hello (zygote.rs): a value
/// printed, as most calls do; then `.Last.value` is NULL again, as in a
/// new R session.
pub fn warm_up_fork(r: &r::R) {
    warm_up_with(r, &["1"]);
    // SAFETY: on the R thread, between calls; R_NilValue and the symbol
    // are R's own constants.
    unsafe {
        use crate::r::sys::{R_LastvalueSymbol, R_NilValue};
        r::set_base_value(R_LastvalueSymbol, R_NilValue);
    }
}

/// Runs `codes` through the driver, discarding the results.
fn warm_up_with(r: &r::R, codes: &[&str]) {
    for code in codes {
        let req = rvisor_protocol::RunRequest {
            execution_id: "warm-up".into(),
            seq: 0,
            code: (*code).into(),
            plot_width: 100,
            plot_height: 100,
            max_output_bytes: 1 << 20,
            working_dir: None,
            cpu_limit_seconds: None,
            tools: Vec::new(),
            variables: Vec::new(),
            tables: Vec::new(),
            stream: rvisor_protocol::StreamMode::Off,
            display: Default::default(),
            spin_us: 0,
        };
        let _ = eval::run(r, req, Vec::new());
    }
}
