//! One call: run the driver on the request, then turn what it reported into
//! a RunResult.

use crate::console::{self, Capture};
use crate::r::sys::*;
use crate::r::{self, RThread, R};
use crate::{
    display, ffi, hydrate, interrupt, link, pause, result_block, srcref, stream, tools, values,
};
use rvisor_protocol::bounds::{self, cut};
use rvisor_protocol::{ErrorInfo, Outcome, Plot, RunRequest, RunResult, Segment, Usage};
use std::cell::RefCell;
use std::os::raw::c_int;
use std::time::Instant;

/// What the driver reported during the call, besides console text.
#[derive(Debug, Default)]
struct CallState {
    status: Option<String>,
    error: Option<ErrorInfo>,
    parse_error: bool,
    unsupported: bool,
    plot_files: Vec<String>,
    /// SVG pages made beside the PNG ones (plot format `both`).
    svg_files: Vec<String>,
    /// Warnings past `bounds::MAX_WARNINGS`, counted by the driver.
    warnings_dropped: u64,
    /// Plot pages past `bounds::MAX_PLOTS`, deleted by the driver.
    plots_dropped: u64,
    /// The driver holds warnings of the current expression to flush.
    warning_pending: bool,
    /// The driver's interrupt handler ran.
    interrupted: bool,
    /// Packages loaded from the libraries after R's own: (name, version).
    packages_loaded: Vec<(String, String)>,
}

/// What the `quit()` hook needs to know about the call that is running.
struct Running {
    request: RunRequest,
    r_version: String,
    started: Instant,
    rusage: Rusage,
}

thread_local! {
    static CALL: RefCell<CallState> = RefCell::new(CallState::default());
    static RUNNING: RefCell<Option<Running>> = const { RefCell::new(None) };
}

/// `s` cut to `max` bytes; a cut is recorded as `field`.
fn capped(s: String, max: usize, field: &'static str) -> String {
    match cut(&s, max) {
        (_, false) => s,
        (kept, true) => {
            console::mark(field);
            kept.to_string()
        }
    }
}

/// An error's traceback within its caps (frames and bytes per frame).
fn capped_traceback(mut frames: Vec<String>) -> Vec<String> {
    // The driver adds "... and N more frames" after the frames it keeps.
    if frames.len() > bounds::TRACEBACK_FRAMES + 1 {
        frames.truncate(bounds::TRACEBACK_FRAMES + 1);
        console::mark("error.traceback");
    }
    if frames.len() > bounds::TRACEBACK_FRAMES {
        console::mark("error.traceback");
    }
    frames
        .into_iter()
        .map(|f| capped(f, bounds::TRACEBACK_FRAME_BYTES, "error.traceback"))
        .collect()
}

/// Called by the driver through `.Call(emit, kind, a, b, c)`. The driver
/// has cut texts by characters already; they are cut here to their byte
/// caps (at a character boundary) and the cuts recorded.
pub fn on_emit(kind: &str, a: Vec<String>, b: Vec<String>, c: Vec<String>) {
    let first = |v: &Vec<String>| v.first().cloned();
    // A plot page finished before this report comes before it.
    crate::pages::settle();
    match kind {
        "warning" => console::push(Segment::Warning {
            message: capped(
                first(&a).unwrap_or_default(),
                bounds::WARNING_MESSAGE_BYTES,
                "warnings",
            ),
            call: first(&b).map(|s| capped(s, bounds::CALL_BYTES, "warnings")),
        }),
        "message" => console::push(Segment::Message {
            text: first(&a).unwrap_or_default(),
        }),
        "warnings_dropped" => {
            let n: u64 = first(&a).and_then(|s| s.parse().ok()).unwrap_or(0);
            CALL.with(|s| s.borrow_mut().warnings_dropped = n);
        }
        "packages_loaded" => {
            let pairs = a.into_iter().zip(b).collect();
            CALL.with(|s| s.borrow_mut().packages_loaded = pairs);
        }
        "plots_dropped" => {
            let n: u64 = first(&a).and_then(|s| s.parse().ok()).unwrap_or(0);
            CALL.with(|s| s.borrow_mut().plots_dropped = n);
        }
        // The first error of an expression is the one reported: a second
        // one raised while R handles it (stop() given a condition whose
        // message is not one string: "bad error message") is not.
        "error" if CALL.with(|s| s.borrow().error.is_some()) => r::quiet_stderr(true),
        "error" => {
            let message = capped(
                first(&a).unwrap_or_default(),
                bounds::ERROR_MESSAGE_BYTES,
                "error.message",
            );
            let call = first(&b).map(|s| capped(s, bounds::CALL_BYTES, "error.call"));
            let c = capped_traceback(c);
            // R's default handler prints this error next: it is reported.
            r::quiet_stderr(true);
            console::push(Segment::Error {
                message: message.clone(),
                call: call.clone(),
                traceback: c.clone(),
            });
            CALL.with(|s| {
                s.borrow_mut().error = Some(ErrorInfo {
                    message,
                    call,
                    traceback: c,
                    ..ErrorInfo::default()
                })
            });
        }
        "parse_error" => {
            let message = first(&a).unwrap_or_default();
            let line = first(&b).and_then(|s| s.parse().ok());
            let column = first(&c).and_then(|s| s.parse().ok());
            let headline = message.lines().next().unwrap_or("").to_string();
            let place = match (line, column) {
                (Some(l), Some(c)) => format!(" at line {l}, column {c}"),
                _ => String::new(),
            };
            console::write_text(
                console::Stream::Stderr,
                format!("Error: parse error{place}: {message}\n").as_bytes(),
            );
            CALL.with(|s| {
                let mut s = s.borrow_mut();
                s.parse_error = true;
                s.error = Some(ErrorInfo {
                    message: headline,
                    line,
                    column,
                    ..ErrorInfo::default()
                });
            });
        }
        "unsupported" => {
            let text = first(&a).unwrap_or_default();
            console::write_text(console::Stream::Stderr, format!("{text}\n").as_bytes());
            CALL.with(|s| s.borrow_mut().unsupported = true);
        }
        "notice" => console::write_text(
            console::Stream::Stderr,
            first(&a).unwrap_or_default().as_bytes(),
        ),
        "plots" => CALL.with(|s| s.borrow_mut().plot_files = a),
        "svgs" => CALL.with(|s| s.borrow_mut().svg_files = a),
        "display" => display::from_driver(a, b, first(&c)),
        "display_id" => display::set_pending_id(first(&a), first(&b).as_deref() == Some("update")),
        "warning_pending" => CALL.with(|s| s.borrow_mut().warning_pending = true),
        "interrupted" => {
            // R prints nothing useful for an interrupt ("Error: " for a
            // tool call given up): the outcome says it.
            r::quiet_stderr(true);
            CALL.with(|s| s.borrow_mut().interrupted = true);
        }
        "status" => CALL.with(|s| s.borrow_mut().status = first(&a)),
        "plot_page" => {
            if let Some(i) = first(&a).and_then(|s| s.parse().ok()) {
                stream::plot(i);
            }
            crate::pages::finished(first(&b));
        }
        "progress" => {
            if let Some(value) = first(&a).and_then(|s| s.parse().ok()) {
                let total = first(&b).and_then(|s| s.parse().ok());
                // Cut, not recorded: progress is not part of the result.
                let message =
                    first(&c).map(|m| cut(&m, bounds::WARNING_MESSAGE_BYTES).0.to_string());
                stream::progress(value, total, message);
            }
        }
        _ => {}
    }
}

/// What [`parse`] hands to R_ToplevelExec.
struct ParseJob {
    text: SEXP,
    status: ParseStatus,
    exprs: SEXP,
}

unsafe extern "C" fn parse_in_toplevel(data: *mut std::os::raw::c_void) {
    // SAFETY: `data` is the ParseJob that `parse` passes, alive for the call;
    // on the R thread.
    unsafe {
        let job = &mut *data.cast::<ParseJob>();
        job.exprs = R_ParseVector(job.text, -1, &mut job.status, R_NilValue);
    }
}

/// Parses `text` with R's parser (no source references). Returns the
/// expression vector, or R_NilValue when the code does not parse: the
/// driver then asks R's `parse()` for the message, line and column.
///
/// # Safety
/// On the R thread; `text` is a protected character vector. The result is
/// unprotected.
unsafe fn parse(text: SEXP) -> SEXP {
    let mut job = ParseJob {
        text,
        status: ParseStatus::PARSE_NULL,
        exprs: std::ptr::null_mut(),
    };
    // SAFETY: per the function's contract; R_ToplevelExec catches any R
    // error raised while parsing.
    unsafe {
        let ok = R_ToplevelExec(Some(parse_in_toplevel), (&mut job as *mut ParseJob).cast());
        if ok == Rboolean::TRUE && job.status == ParseStatus::PARSE_OK && !job.exprs.is_null() {
            job.exprs
        } else {
            R_NilValue
        }
    }
}

/// CPU time and peak RSS of this process and its children.
#[derive(Debug, Clone, Copy, Default)]
struct Rusage {
    cpu_us: i64,
    peak_rss: u64,
}

fn rusage() -> Rusage {
    let mut total = Rusage::default();
    for who in [libc::RUSAGE_SELF, libc::RUSAGE_CHILDREN] {
        // SAFETY: getrusage fills the zeroed struct we own.
        let ru = unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            libc::getrusage(who, &mut ru);
            ru
        };
        total.cpu_us += ru.ru_utime.tv_sec * 1_000_000
            + ru.ru_utime.tv_usec
            + ru.ru_stime.tv_sec * 1_000_000
            + ru.ru_stime.tv_usec;
        if who == libc::RUSAGE_SELF {
            total.peak_rss = ru.ru_maxrss as u64 * 1024;
        }
    }
    total
}

/// Evaluates one request. If the code calls `quit()`, the result is sent
/// from the clean-up hook and the process exits instead of returning.
pub fn run(r: &R, req: RunRequest, files: Vec<std::fs::File>) -> RunResult {
    let started = Instant::now();
    let before = rusage();
    console::begin(req.max_output_bytes);
    stream::begin(req.stream, &req.execution_id);
    // No string the driver reports is copied past what the call may keep.
    r::set_emit_limit(
        usize::try_from(req.max_output_bytes)
            .unwrap_or(usize::MAX)
            .max(bounds::ERROR_MESSAGE_BYTES)
            .saturating_add(4),
    );
    // SAFETY: on the R thread; the driver environment is preserved.
    unsafe { r::set_max_out(r.driver, req.max_output_bytes) };
    CALL.with(|s| *s.borrow_mut() = CallState::default());
    display::begin(req.display.values());
    {
        // Pages are read as they finish, but for PNG and SVG both (a
        // page's SVG is drawn from its record when the call ends).
        let f = req.display.plot_format();
        crate::pages::begin(
            !(f.png() && f.svg()),
            req.display.enabled(),
            req.plot_width,
            req.plot_height,
        );
    }
    pause::at("sent", &req.execution_id, &req.code);
    interrupt::begin_call(req.seq);

    if req.code.contains('\0') {
        let mut res = RunResult::failed(
            req.execution_id.clone(),
            req.code.clone(),
            Outcome::ParseError,
            "the code contains a NUL byte, which R cannot parse; remove it".into(),
        );
        res.r_version = r.version.clone();
        console::take();
        interrupt::end_call();
        return res;
    }

    if req.tables.len() != files.len() {
        let mut res = RunResult::failed(
            req.execution_id.clone(),
            req.code.clone(),
            Outcome::Error,
            format!(
                "{} tables were named but {} arrived; nothing ran",
                req.tables.len(),
                files.len()
            ),
        );
        res.r_version = r.version.clone();
        console::take();
        interrupt::end_call();
        return res;
    }
    // SAFETY: `run` is called on the R thread, after R started.
    let tok = unsafe { RThread::assume() };
    // Everything bound is checked before R sees it, and bound inside the
    // protected boundary: a failure (a name R refuses, memory running out
    // while a table is built) is an error result, and nothing runs.
    pause::at("binding", &req.execution_id, &req.code);
    let bound = bind_inputs(tok, &req, files);
    if let Err(e) = bound {
        // An interrupt that R acted on while binding (a cancel, a
        // deadline) ends the call as interrupted, not as a failed binding.
        let (outcome, why) = if interrupt::seen() {
            (
                Outcome::Interrupted,
                "interrupted while its inputs were bound".to_string(),
            )
        } else {
            (Outcome::Error, e)
        };
        let mut res = RunResult::failed(
            req.execution_id.clone(),
            req.code.clone(),
            outcome,
            format!("{why}; nothing ran"),
        );
        res.r_version = r.version.clone();
        console::take();
        interrupt::end_call();
        return res;
    }
    if let Some(limit) = req.cpu_limit_seconds {
        // The kernel sends SIGXCPU at the soft limit (the process ends) and
        // SIGKILL at the hard one: CPU loops in C code cannot escape it.
        let used = (rusage().cpu_us / 1_000_000) as u64 + 1;
        let mut current = libc::rlimit {
            rlim_cur: libc::RLIM_INFINITY,
            rlim_max: libc::RLIM_INFINITY,
        };
        // SAFETY: getrlimit fills a struct we own.
        unsafe { libc::getrlimit(libc::RLIMIT_CPU, &mut current) };
        // A confined worker cannot raise its hard limit: stay under it.
        let hard = current.rlim_max;
        let rl = libc::rlimit {
            rlim_cur: (used + limit).min(hard.saturating_sub(1)),
            rlim_max: (used + limit + 1).min(hard),
        };
        // SAFETY: setrlimit with a struct we own.
        unsafe { libc::setrlimit(libc::RLIMIT_CPU, &rl) };
    }
    // The working directory is the process's: change it here (a syscall)
    // rather than through R's setwd(). A call without one (a confined
    // worker, which works in its private directory) goes back to where the
    // worker started, so a setwd() lasts no longer than its call.
    let wd = req
        .working_dir
        .clone()
        .filter(|w| !w.is_empty())
        .or_else(|| HOME_DIR.with(|h| h.borrow().clone()));
    if let Some(wd) = wd.as_deref() {
        if let Err(e) = std::env::set_current_dir(wd) {
            // Running somewhere else would read or write the wrong files.
            let mut res = RunResult::failed(
                req.execution_id.clone(),
                req.code.clone(),
                Outcome::Error,
                format!(
                    "could not change to the working directory {wd} ({e}); nothing ran. \
                     A confined worker runs as its own uid: the directory must be readable \
                     and searchable by other users"
                ),
            );
            res.r_version = r.version.clone();
            console::take();
            interrupt::end_call();
            return res;
        }
    }
    RUNNING.with(|x| {
        *x.borrow_mut() = Some(Running {
            request: req.clone(),
            r_version: r.version.clone(),
            started,
            rusage: before,
        })
    });
    tools::begin_call(req.execution_id.clone());
    // Sys.sleep() wakes up to send waiting events when the call streams.
    r::set_event_wait(tok, stream::wait_usec(req.stream));
    let depth = r::protect_depth(tok);
    let escaped = evaluate(tok, r, &req).is_err();
    r::rebalance(tok, depth);
    r::set_event_wait(tok, 0);
    RUNNING.with(|x| x.borrow_mut().take());
    tools::end_call();
    interrupt::end_call();
    r::quiet_stderr(false);
    let call = CALL.with(|s| std::mem::take(&mut *s.borrow_mut()));
    finish(req, &r.version, started, before, call, escaped, None)
}

/// Binds the call's variables and tables in the global environment, each
/// checked first (a name R refuses, a string R cannot hold) and bound
/// inside the protected boundary.
fn bind_inputs(tok: RThread, req: &RunRequest, files: Vec<std::fs::File>) -> Result<(), String> {
    if req.tables.len() != files.len() {
        return Err(format!(
            "{} tables were named but {} arrived",
            req.tables.len(),
            files.len()
        ));
    }
    for (name, value) in &req.variables {
        let name = values::check_name(name).map_err(|e| format!("variable {e}"))?;
        values::check_value(value).map_err(|e| format!("variable {:?}: {e}", name))?;
        let cname = std::ffi::CString::new(name).map_err(|_| "a variable name holds NUL")?;
        let cname = cname.as_c_str();
        r::protected(tok, |scope| {
            // SAFETY: on the R thread inside `protected`; the value is
            // protected by `scope` until it is bound; `cname` is owned by
            // the caller (no destructor in this frame).
            unsafe {
                let v = scope.protect(values::json_to_r(value));
                Rf_defineVar(Rf_install(cname.as_ptr()), v, R_GlobalEnv);
            }
            Ok(())
        })
        .map_err(|e| format!("variable {name:?} could not be bound: {e}"))?;
    }
    for (name, file) in req.tables.iter().zip(files) {
        let name = values::check_name(name).map_err(|e| format!("data frame {e}"))?;
        hydrate::bind(tok, name, file)
            .map_err(|e| format!("the data for {name:?} could not be loaded ({e})"))?;
    }
    Ok(())
}

/// What one top-level expression did, written by its `R_ToplevelExec`.
#[derive(Debug, Default, Clone, Copy)]
struct Step {
    visible: bool,
    html: bool,
    /// A table (data frame, matrix) was printed: the value (preserved
    /// until its display is made) and where the console stood before.
    table: Option<(SEXP, (usize, usize))>,
    /// Display option `values`: a visible value that is neither a table
    /// nor HTML (preserved until its display is made).
    value: Option<SEXP>,
    /// `keep.source` is on after it: the next expression is parsed again
    /// with source references.
    keep_source: bool,
}

/// The display options as the driver's `begin_call` takes them: enabled,
/// rows, columns, HTML cap (at most the output cap: the driver's strings
/// are copied up to it), PNG, SVG.
fn display_vector(req: &RunRequest) -> [f64; 6] {
    let d = &req.display;
    let f = d.plot_format();
    [
        f64::from(u8::from(d.enabled())),
        f64::from(d.max_rows()),
        f64::from(d.max_cols()),
        d.html_max_bytes().min(req.max_output_bytes) as f64,
        f64::from(u8::from(f.png())),
        f64::from(u8::from(f.svg())),
    ]
}

/// Classes whose values render only as HTML.
const HTML_CLASSES: [&std::ffi::CStr; 8] = [
    c"htmlwidget",
    c"gt_tbl",
    c"flextable",
    c"shiny.tag",
    c"shiny.tag.list",
    c"html",
    c"datatables",
    c"reactable",
];

/// Evaluates the call's code as R's prompt would: the whole code parsed
/// first (a parse error: nothing runs), then each expression in its own
/// `R_ToplevelExec`, at frame 0 in the global environment, under rvisor's
/// global calling handlers; `.Last.value` set; a visible value printed
/// with `PrintValue` (print() or show() dispatched from the global
/// environment). An expression before which `options("keep.source")` is on
/// is parsed again from its own text with source references, as Rscript
/// parses it (`srcref`). The first error or interrupt ends the call, as
/// source() does. `Err`: a driver step itself failed.
fn evaluate(tok: RThread, r: &R, req: &RunRequest) -> Result<(), String> {
    if let Some(why) = r::string_problem(&req.code) {
        return Err(format!("the code cannot be given to R: {why}"));
    }
    for t in &req.tools {
        if let Some(why) = r::string_problem(t) {
            return Err(format!("a tool name cannot be given to R: {why}"));
        }
    }
    let driver = r.driver;
    let code_str = req.code.as_str();
    let tools_list = req.tools.as_slice();
    let (width, height) = (req.plot_width, req.plot_height);
    let rich = req.display.enabled();
    let values = req.display.values();
    let dvec = display_vector(req);
    pause::at("parsing", &req.execution_id, &req.code);
    // The code and its parse stay preserved across the expressions (each
    // R_ToplevelExec resets R's protection stack to where it began).
    let (code, exprs, keep_source) = r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; every object is
        // protected by `scope` from its creation until it is preserved.
        unsafe {
            let code = scope.protect(r::mk_string(code_str));
            let exprs = scope.protect(parse(code));
            let w = scope.protect(Rf_ScalarInteger(width.min(i32::MAX as u32) as c_int));
            let h = scope.protect(Rf_ScalarInteger(height.min(i32::MAX as u32) as c_int));
            let tools = scope.protect(Rf_allocVector(
                SEXPTYPE::STRSXP,
                tools_list.len() as R_xlen_t,
            ));
            for (i, name) in tools_list.iter().enumerate() {
                SET_STRING_ELT(tools, i as R_xlen_t, r::mk_char(name));
            }
            let d = scope.protect(Rf_allocVector(SEXPTYPE::REALSXP, dvec.len() as R_xlen_t));
            for (i, x) in dvec.iter().enumerate() {
                *REAL(d).add(i) = *x;
            }
            r::call_driver(driver, c"begin_call", &[w, h, tools, d])?;
            R_PreserveObject(code);
            R_PreserveObject(exprs);
            Ok((code, exprs, srcref::keep_source()))
        }
    })?;
    // SAFETY: on the R thread; `exprs` is preserved.
    let n = unsafe { Rf_xlength(exprs) };
    let parsed = exprs != unsafe_nil();
    if !parsed {
        // SAFETY: on the R thread; `code` is preserved.
        unsafe { r::call_driver(driver, c"parse_code", &[code]) }?;
    }
    let mut status = "complete";
    // Where each expression's text lies: found once, in a call where
    // keep.source is on before some expression (most calls never need it).
    let mut chunks: Option<Vec<Option<srcref::Chunk>>> = None;
    let mut keep_source = keep_source;
    for i in 0..if parsed { n } else { 0 } {
        // An interrupt R has not acted on yet (one that came before the
        // call began, or while it was bound or parsed, where R does not
        // poll) stops the call before its next expression, as it would
        // at R's prompt: no more of the code runs. Acting on it clears
        // it, as R does, so that the driver's end of the call runs whole.
        if r::interrupt_pending(tok) {
            r::set_interrupt_pending(false);
            CALL.with(|s| s.borrow_mut().interrupted = true);
            status = "interrupted";
            break;
        }
        if keep_source {
            let chunks =
                chunks.get_or_insert_with(|| srcref::chunks_of(tok, code, code_str, n as usize));
            if let Some(Some(c)) = chunks.get(i as usize) {
                srcref::reparse(tok, exprs, i as usize, &c.text(code_str));
            }
        }
        let mut step = Step::default();
        let displays_before = display::count();
        let out: *mut Step = &mut step;
        let ended = r::toplevel(tok, move || {
            // SAFETY: on the R thread, in the expression's own top-level
            // context; `exprs` is preserved and `v` protected until printed
            // (the jump of an error resets the stack; a return does not, so
            // the `protected` count is unprotected at the end); `out` points
            // to `step` in the caller's frame. Nothing here has a destructor.
            unsafe {
                // R_ToplevelExec restores the protection stack only when the
                // code jumps out: 2 left on it per expression overflowed its
                // 50,000 after ~25,000 calls, and every later call failed.
                let mut protected = 2;
                let begin = Rf_protect(Rf_lang1(Rf_findVarInFrame(
                    driver,
                    Rf_install(c"begin_expr".as_ptr()),
                )));
                Rf_eval(begin, driver);
                let v = Rf_protect(Rf_eval(VECTOR_ELT(exprs, i), R_GlobalEnv));
                let visible = ffi::R_Visible != 0;
                r::set_base_value(R_LastvalueSymbol, v);
                (*out).visible = visible;
                if visible {
                    let html = HTML_CLASSES
                        .iter()
                        .any(|c| Rf_inherits(v, c.as_ptr()) == Rboolean::TRUE);
                    if rich && (html || Rf_inherits(v, c"knitr_kable".as_ptr()) == Rboolean::TRUE) {
                        // Its HTML as a display (or, when none can be
                        // made, `unsupported` with the reason).
                        let call = Rf_protect(Rf_lang2(Rf_install(c"show_html".as_ptr()), v));
                        protected += 1;
                        display::showing_value(true);
                        Rf_eval(call, driver);
                        display::showing_value(false);
                    } else if html {
                        (*out).html = true;
                        let call = Rf_protect(Rf_lang2(
                            Rf_findVarInFrame(driver, Rf_install(c"report_html".as_ptr())),
                            v,
                        ));
                        protected += 1;
                        Rf_eval(call, driver);
                    } else {
                        let table = rich
                            && (Rf_isMatrix(v) == Rboolean::TRUE
                                || Rf_inherits(v, c"data.frame".as_ptr()) == Rboolean::TRUE);
                        let before = if table { console::position() } else { (0, 0) };
                        if values {
                            // Its text is its display's, not the console's.
                            console::begin_divert();
                        }
                        Rf_PrintValue(v);
                        if values {
                            console::end_divert();
                        }
                        if table {
                            // Kept past this top-level context for its
                            // display, made once the print has returned.
                            R_PreserveObject(v);
                            (*out).table = Some((v, before));
                        } else if values {
                            R_PreserveObject(v);
                            (*out).value = Some(v);
                        }
                    }
                }
                // Then the task callbacks, as R's REPL runs them (after
                // the value was printed, before the warnings are shown).
                r::run_task_callbacks(VECTOR_ELT(exprs, i), v, visible);
                // What R's loop reads when it parses the next expression:
                // the options as this one (and its callbacks) left them.
                (*out).keep_source = srcref::keep_source();
                Rf_unprotect(protected);
            }
        });
        keep_source = step.keep_source;
        // Also when showing the value jumped.
        display::showing_value(false);
        r::quiet_stderr(false);
        if let Some((text, _)) = console::abandon_divert() {
            // The print jumped (an error in a print method): what it wrote
            // goes to the console, as at R's prompt.
            console::write_text(console::Stream::Stdout, text.as_bytes());
        }
        let held = console::take_held();
        if let Some((v, before)) = step.table {
            if ended == r::Ended::Returned {
                display::showing_value(true);
                show_table(tok, driver, v, before, held.as_ref().map(|h| h.0.as_str()));
                display::showing_value(false);
            }
            // SAFETY: on the R thread; `v` was preserved in the expression.
            unsafe { R_ReleaseObject(v) };
        } else if let Some(v) = step.value {
            if ended == r::Ended::Returned {
                let (text, more) = held.unwrap_or_default();
                let class = first_class(tok, v);
                display::showing_value(true);
                display::of_value(text, more, &class);
                display::showing_value(false);
            }
            // SAFETY: on the R thread; `v` was preserved in the expression.
            unsafe { R_ReleaseObject(v) };
        }
        if values && step.visible && ended == r::Ended::Returned {
            display::value_shown(displays_before);
        }
        if CALL.with(|s| std::mem::take(&mut s.borrow_mut().warning_pending)) {
            // The expression's warnings are reported, and R's record of
            // them becomes `last.warning` (what warnings() shows), as at
            // the prompt: an expression that warned replaces it, one that
            // did not leaves it.
            let _ = r::protected(tok, |scope| {
                // SAFETY: on the R thread inside `protected`; the driver's
                // environment is preserved and the record protected by
                // `scope` until it is bound.
                unsafe {
                    let lw = scope.protect(r::call_driver(driver, c"flush_warnings", &[])?);
                    if lw != R_NilValue {
                        r::set_base_value(Rf_install(c"last.warning".as_ptr()), lw);
                    }
                }
                Ok(())
            });
        }
        if step.html || CALL.with(|s| s.borrow().unsupported) {
            status = "unsupported";
        }
        match ended {
            r::Ended::Returned => {}
            r::Ended::Jumped | r::Ended::Panicked => {
                let interrupted = CALL.with(|s| s.borrow().interrupted) || interrupt::seen();
                if interrupted {
                    status = "interrupted";
                } else {
                    status = "error";
                    if CALL.with(|s| s.borrow().error.is_none()) {
                        // No handler could run (the stack was exhausted):
                        // R printed the error itself; report it from R's
                        // error buffer.
                        let msg = if ended == r::Ended::Panicked {
                            "internal error in the worker".to_string()
                        } else {
                            r::last_error_message(tok)
                        };
                        CALL.with(|s| {
                            s.borrow_mut().error = Some(ErrorInfo::message(capped(
                                msg,
                                bounds::ERROR_MESSAGE_BYTES,
                                "error.message",
                            )))
                        });
                    }
                }
                break;
            }
        }
    }
    // SAFETY: on the R thread; the driver's environment is preserved, and
    // `code` and `exprs` were preserved above and are released here.
    let ended = unsafe { r::call_driver(driver, c"end_call", &[]) };
    // SAFETY: as above.
    unsafe {
        R_ReleaseObject(exprs);
        R_ReleaseObject(code);
    }
    if parsed {
        CALL.with(|s| s.borrow_mut().status = Some(status.to_string()));
    }
    ended.map(|_| ())
}

/// Makes the display of a table the expression printed: the driver's
/// `show_table` with the text the print wrote (its `text/plain`). An
/// interrupt or error inside it ends only the display (the driver catches
/// errors; `protected` the rest).
fn show_table(tok: RThread, driver: SEXP, v: SEXP, before: (usize, usize), held: Option<&str>) {
    // One byte more than a display keeps, so a cut is seen and noted.
    let text = match held {
        Some(t) => t.to_string(),
        None => console::stdout_since(before, rvisor_protocol::display::TEXT_PLAIN_BYTES + 1),
    };
    let text = text.as_str();
    let _ = r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; `v` is preserved by
        // the caller, the text protected by `scope` until the call ran.
        unsafe {
            let t = scope.protect(r::mk_string(text));
            r::call_driver(driver, c"show_table", &[v, t])?;
        }
        Ok(())
    });
}

/// The first class of `v` as `class(v)[[1]]` gives it (implicit classes
/// too: `numeric`, `function`, `matrix`); empty if R cannot say.
fn first_class(tok: RThread, v: SEXP) -> String {
    r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; `v` is preserved by
        // the caller, the class vector protected by `scope` while read.
        unsafe {
            let cls = scope.protect(ffi::R_data_class(v, 0));
            Ok(r::strings(cls).into_iter().next().unwrap_or_default())
        }
    })
    .unwrap_or_default()
}

/// R's NULL.
fn unsafe_nil() -> SEXP {
    // SAFETY: R_NilValue is a constant of an initialised R.
    unsafe { R_NilValue }
}

thread_local! {
    /// Where the worker started: a call without a working directory goes
    /// back there (set by `serve` before the first call).
    static HOME_DIR: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Records the directory calls without a working directory run in.
pub fn set_home_dir(dir: Option<String>) {
    HOME_DIR.with(|h| *h.borrow_mut() = dir);
}

/// The directory calls without a working directory run in.
pub fn home_dir() -> Option<String> {
    HOME_DIR.with(|h| h.borrow().clone())
}

/// Called from R's clean-up hook when the code calls `quit()`: reports the
/// call as `worker_exited` (with the output so far) before the process ends.
pub fn on_quit(status: c_int) {
    tools::end_call();
    let Some(running) = RUNNING.with(|x| x.borrow_mut().take()) else {
        return;
    };
    let call = CALL.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let res = finish(
        running.request.clone(),
        &running.r_version,
        running.started,
        running.rusage,
        call,
        false,
        Some(status),
    );
    stream::end();
    link::flush_stdio();
    if let Ok(payload) = result_frame(res, running.request.max_output_bytes) {
        let _ = link::send_payload(&payload);
    }
}

fn finish(
    req: RunRequest,
    r_version: &str,
    started: Instant,
    before: Rusage,
    mut call: CallState,
    escaped: bool,
    quit_status: Option<c_int>,
) -> RunResult {
    // The pages read as they finished (pages.rs: their segments and
    // displays are in place already), then those the call's end found,
    // up to the cap of pages.
    let early = crate::pages::take();
    let room = bounds::MAX_PLOTS.saturating_sub(early.len());
    let (plots, over) = collect_plots(&call.plot_files, req.plot_width, req.plot_height, room);
    call.plots_dropped += over;
    stream::plots_kept(early.len() + plots.len());
    // SVG pages made beside PNG ones: read only for pages kept, within the cap.
    let mut svgs = read_svgs(&call.svg_files, plots.len());
    let (mut displays, displays_dropped) = display::take();
    let rich = req.display.enabled();
    let Capture {
        mut segments,
        bytes,
        truncated,
        fields,
        ..
    } = console::take();
    let block = result_block::extract(&mut segments);

    let mut res = RunResult::empty(req.execution_id, req.code);
    res.r_version = r_version.to_string();
    for seg in segments {
        res.push_segment(seg);
    }
    for problem in block.problems {
        res.push_segment(Segment::Warning {
            message: format!("rvisor: {problem}"),
            call: None,
        });
    }
    res.result = block.value;
    let first_late = early.len();
    res.plots = early;
    for (k, plot) in plots.into_iter().enumerate() {
        let i = first_late + k;
        res.segments.push(Segment::Plot { index: i });
        if rich {
            // The page as a display too (its image repeated, so a client
            // of displays alone has every output; counted once in the cap).
            // With `both`, a page has an SVG slot: empty when its SVG
            // did not fit under the output cap.
            let wanted = k < svgs.len();
            let svg = svgs.get_mut(k).and_then(Option::take);
            let left_out = wanted && svg.is_none();
            let mut d = display::of_plot(i, &plot, svg);
            if left_out {
                display::note(
                    &mut d.metadata,
                    "image/svg+xml",
                    "left out: over the call's output cap (max_output_bytes)",
                );
            }
            // Streamed now, at the end of the call, before the result: a
            // page is read from its file only then.
            stream::display(displays.len(), &d);
            displays.push(d);
            res.segments.push(Segment::Display {
                index: displays.len() - 1,
            });
        }
        res.plots.push(plot);
    }
    res.displays = displays;
    res.packages_loaded = std::mem::take(&mut call.packages_loaded)
        .into_iter()
        .map(|(name, version)| rvisor_protocol::LoadedPackage {
            name,
            version,
            repository: None,
        })
        .collect();
    if displays_dropped > 0 {
        res.push_segment(Segment::Stderr {
            text: format!(
                "rvisor: {displays_dropped} more displays were not kept (at most {} per call)\n",
                rvisor_protocol::display::MAX_DISPLAYS
            ),
        });
    }
    for field in fields {
        res.mark_truncated(field);
    }
    if block.too_large {
        res.mark_truncated("result");
    }
    if call.warnings_dropped > 0 {
        res.push_segment(Segment::Stderr {
            text: format!(
                "rvisor: {} more warnings were not kept (at most {} per call)\n",
                call.warnings_dropped,
                bounds::MAX_WARNINGS
            ),
        });
        res.mark_truncated("warnings");
    }
    if call.plots_dropped > 0 {
        res.push_segment(Segment::Stderr {
            text: format!(
                "rvisor: {} more plot pages were not kept (at most {} per call)\n",
                call.plots_dropped,
                bounds::MAX_PLOTS
            ),
        });
        res.mark_truncated("plots");
    }

    let interrupted = interrupt::seen();
    let outcome = if let Some(status) = quit_status {
        let msg = format!(
            "quit() was called (status {status}): the R session ended. The next call \
             starts a fresh R session without the previous variables."
        );
        res.push_segment(Segment::Stderr {
            text: format!("{msg}\n"),
        });
        call.error = Some(ErrorInfo::message(msg));
        Outcome::WorkerExited
    } else if call.parse_error {
        Outcome::ParseError
    } else {
        match call.status.as_deref() {
            Some("complete") => Outcome::Complete,
            Some("unsupported") => Outcome::UnsupportedOutput,
            Some("error") => {
                if call.error.is_none() {
                    call.error = Some(ErrorInfo::message(
                        "an R error occurred but its details could not be captured",
                    ));
                }
                Outcome::Error
            }
            Some("interrupted") => Outcome::Interrupted,
            _ if interrupted => Outcome::Interrupted,
            _ => {
                // The driver itself failed (should not happen): say so.
                if call.error.is_none() {
                    call.error = Some(ErrorInfo::message(if escaped {
                        "the evaluation ended abnormally (an error escaped rvisor's driver)"
                    } else {
                        "the evaluation ended without reporting a status"
                    }));
                }
                Outcome::Error
            }
        }
    };
    if outcome == Outcome::Interrupted && call.error.is_none() {
        call.error = Some(ErrorInfo::message("the evaluation was interrupted"));
    }
    if outcome == Outcome::UnsupportedOutput && call.error.is_none() {
        call.error = Some(ErrorInfo::message(
            "a value renders only as HTML, which rvisor cannot show; print the data instead",
        ));
    }
    res.truncated |= truncated;
    let truncated = res.truncated;
    let code_ok = outcome == Outcome::Complete;
    res.outcome = if truncated && code_ok {
        Outcome::OutputTruncated
    } else {
        outcome
    };
    res.success = code_ok;
    res.error = call.error;
    let after = rusage();
    res.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
    res.usage = Usage {
        cpu_ms: (after.cpu_us - before.cpu_us) as f64 / 1000.0,
        peak_rss_bytes: after.peak_rss,
        // Console text and plot bytes, as counted against the cap.
        output_bytes: bytes,
    };
    res
}

/// Serialises a call's result for its frame, within the frame limit the
/// supervisor enforces for this output cap (`bounds::result_frame_limit`).
/// Text that fits the output cap can still outgrow the frame when JSON
/// escaping blows it up (control characters take 6 bytes): then the text
/// of the console is kept only in part, halving until the frame fits.
pub fn result_frame(res: RunResult, max_output_bytes: u64) -> Result<Vec<u8>, String> {
    let limit = bounds::result_frame_limit(max_output_bytes);
    let encode = |r: RunResult| -> Result<(Vec<u8>, RunResult), String> {
        let msg = rvisor_protocol::FromWorker::Result(Box::new(r));
        let payload = serde_json::to_vec(&msg).map_err(|e| e.to_string())?;
        let rvisor_protocol::FromWorker::Result(r) = msg else {
            unreachable!("built above")
        };
        Ok((payload, *r))
    };
    let (payload, mut res) = encode(res)?;
    if payload.len() as u64 <= limit {
        return Ok(payload);
    }
    let original = std::mem::take(&mut res.segments);
    let text: usize = original.iter().map(text_len).sum();
    let mut keep = text / 2;
    loop {
        shrink_text(&mut res, &original, keep);
        let (payload, back) = encode(res)?;
        if payload.len() as u64 <= limit {
            return Ok(payload);
        }
        res = back;
        if keep == 0 {
            // Only the bounded parts are left: drop plots and the block too.
            res.plots.clear();
            res.displays.clear();
            res.segments
                .retain(|s| !matches!(s, Segment::Plot { .. } | Segment::Display { .. }));
            res.mark_truncated("displays");
            res.result = None;
            res.mark_truncated("plots");
            res.mark_truncated("result");
            let (payload, _) = encode(res)?;
            return Ok(payload);
        }
        keep /= 2;
    }
}

fn text_len(s: &Segment) -> usize {
    match s {
        Segment::Stdout { text } | Segment::Stderr { text } | Segment::Message { text } => {
            text.len()
        }
        _ => 0,
    }
}

/// Rebuilds `res`'s console, segments and warnings from `original`,
/// keeping `keep` bytes of plain text in all (cut at a character boundary).
fn shrink_text(res: &mut RunResult, original: &[Segment], keep: usize) {
    res.console.clear();
    res.segments.clear();
    res.warnings.clear();
    let mut left = keep;
    for seg in original {
        let seg = match seg {
            Segment::Stdout { text } | Segment::Stderr { text } | Segment::Message { text } => {
                let (kept, _) = cut(text, left);
                left -= kept.len();
                if kept.is_empty() {
                    continue;
                }
                let text = kept.to_string();
                match seg {
                    Segment::Stdout { .. } => Segment::Stdout { text },
                    Segment::Stderr { .. } => Segment::Stderr { text },
                    _ => Segment::Message { text },
                }
            }
            other => other.clone(),
        };
        if let Segment::Plot { .. } = seg {
            res.segments.push(seg);
        } else {
            res.push_segment(seg);
        }
    }
    res.mark_truncated("console");
    if res.outcome == Outcome::Complete {
        res.outcome = Outcome::OutputTruncated;
    }
}

/// Reads the SVG pages made beside the first `kept` PNG pages (each
/// counted against the output cap; one that does not fit is `None`) and
/// deletes them all.
fn read_svgs(files: &[String], kept: usize) -> Vec<Option<String>> {
    let mut out = Vec::new();
    for (i, f) in files.iter().enumerate() {
        let size = std::fs::metadata(f).map(|m| m.len()).unwrap_or(0);
        let svg = if i < kept && size > 0 && console::admit_bytes(size) {
            std::fs::read_to_string(f).ok()
        } else {
            None
        };
        let _ = std::fs::remove_file(f);
        out.push(svg);
    }
    out
}

/// Reads the plot files (PNG, or SVG when only SVG was asked for) the
/// driver reported, deletes them, and keeps those that fit under the
/// output cap, at most `room` pages; with how many more there were
/// (deleted unread). Files read already as their pages finished
/// (pages.rs) are gone and skipped.
fn collect_plots(files: &[String], width: u32, height: u32, room: usize) -> (Vec<Plot>, u64) {
    let mut out = Vec::new();
    let mut over = 0;
    for f in files {
        if out.len() >= room {
            if std::fs::remove_file(f).is_ok() {
                over += 1;
            }
            continue;
        }
        // The size decides before the file is read: a page that does not
        // fit under the cap is never loaded.
        if let Some(p) = crate::pages::read_page(f, width, height) {
            out.push(p);
        }
    }
    (out, over)
}

/// Runs the driver's `validate()` on `script` (which is passed as data and
/// never evaluated) and returns its JSON findings.
pub fn validate(r: &R, script: &str, forbidden: &[String], max_depth: u32, style: &str) -> String {
    if script.contains('\0') {
        return r#"{"problems":[{"kind":"syntax","message":"the script contains a NUL byte","line":null,"column":null}],"warnings":[],"style":[]}"#.to_string();
    }
    console::begin(1 << 20);
    let forbidden: Vec<&str> = forbidden
        .iter()
        .map(String::as_str)
        .filter(|n| r::string_problem(n).is_none())
        .collect();
    let style = if r::string_problem(style).is_none() {
        style
    } else {
        "none"
    };
    let (forbidden, driver) = (&forbidden[..], r.driver);
    // SAFETY: validate is called on the R thread, after R started.
    let tok = unsafe { RThread::assume() };
    let out = r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; every argument is
        // protected by `scope` from its creation until the call has run.
        unsafe {
            let script = scope.protect(r::mk_string(script));
            let names = scope.protect(Rf_allocVector(
                SEXPTYPE::STRSXP,
                forbidden.len() as R_xlen_t,
            ));
            for (i, n) in forbidden.iter().enumerate() {
                SET_STRING_ELT(names, i as R_xlen_t, r::mk_char(n));
            }
            let depth = scope.protect(Rf_ScalarInteger(max_depth.min(i32::MAX as u32) as c_int));
            let style = scope.protect(r::mk_string(style));
            let value = scope.protect(r::call_driver(
                driver,
                c"validate",
                &[script, names, depth, style],
            )?);
            Ok(r::strings(value).pop())
        }
    })
    .ok()
    .flatten();
    let captured = console::take();
    out.unwrap_or_else(|| {
        let why: String = captured
            .segments
            .iter()
            .filter_map(|s| s.console_text())
            .collect::<String>();
        serde_json::json!({
            "problems": [{"kind": "syntax", "message": format!("validation failed: {}", why.trim()), "line": null, "column": null}],
            "warnings": [], "style": []
        })
        .to_string()
    })
}
