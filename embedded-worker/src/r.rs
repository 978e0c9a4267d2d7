//! Starting embedded R and the few primitive ways Rust calls into it.
//!
//! Everything here must run on the R thread: the process's main thread, which
//! called [`start`]. `main` never spawns threads that touch R, and R's hooks
//! call back on that same thread.
//!
//! This is the bottom layer of the worker: it imports only `ffi` (and the
//! protocol's caps). What R's
//! hooks do with what they receive (capture, outcome, tool calls) is the
//! business of the modules above, which hand it in as [`Hooks`].

use crate::ffi;
use libR_sys::*;
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int, c_uchar};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Handles kept alive for the life of the process.
#[derive(Debug, Clone)]
pub struct R {
    /// The driver's private environment (preserved).
    pub driver: SEXP,
    /// The driver's `run` function (reachable from `driver`).
    pub run_fn: SEXP,
    /// "4.2.2".
    pub version: String,
    /// R's session temporary directory.
    pub tempdir: String,
}

const DRIVER_SOURCE: &str = include_str!("driver.R");

/// Where R's hooks and the driver's native routines deliver what they get.
/// Set once by [`start`]; plain function pointers, so the callbacks below
/// can reach them from `extern "C"` frames without knowing their modules.
#[derive(Debug, Clone, Copy)]
pub struct Hooks {
    /// Console output (`stderr` false: standard output), as R wrote it.
    pub console: fn(bytes: &[u8], stderr: bool),
    /// `quit()` was called with this status; R cleans up and the process
    /// exits right after this returns.
    pub quit: fn(status: c_int),
    /// The driver's `.Call(emit, kind, a, b, c)`, arguments as strings.
    pub emit: fn(kind: &str, a: Vec<String>, b: Vec<String>, c: Vec<String>),
    /// Registered as the native routine `rvisor_tool` (2 arguments), which
    /// the driver calls for `tools$name(...)`. Must not unwind.
    pub tool: unsafe extern "C" fn(name: SEXP, args: SEXP) -> SEXP,
}

static HOOKS: OnceLock<Hooks> = OnceLock::new();

/// Console output hook: R calls it for everything it prints.
unsafe extern "C" fn write_console_ex(buf: *const c_char, len: c_int, otype: c_int) {
    if buf.is_null() || len <= 0 {
        return;
    }
    // SAFETY: R passes a buffer of `len` bytes that stays valid for the call.
    let bytes = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len as usize) };
    if let Some(h) = HOOKS.get() {
        (h.console)(bytes, otype != 0);
    }
}

/// Console input hook: a worker has no console, so every read is EOF.
unsafe extern "C" fn read_console(
    _prompt: *const c_char,
    _buf: *mut c_uchar,
    _len: c_int,
    _hist: c_int,
) -> c_int {
    0
}

/// `quit()` hook: report the call's result, then end the process.
unsafe extern "C" fn clean_up(_save: c_int, status: c_int, _run_last: c_int) {
    if let Some(h) = HOOKS.get() {
        (h.quit)(status);
    }
    // SAFETY: on the R thread; removes R's own temporary directory.
    unsafe { R_CleanTempDir() };
    // SAFETY: _exit ends the process at once; nothing after it runs.
    unsafe { libc::_exit(status) };
}

/// Most bytes copied of one string the driver reports through `emit`
/// (set per call from its output cap: R code may raise a condition with a
/// 250 MB message, and the driver's own cut is by characters).
static EMIT_BYTES: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Most strings copied of one argument of `emit` (a traceback has 51 at
/// most, a call's plots 64).
const EMIT_STRINGS: usize = 128;

/// Sets the most bytes copied of one string the driver reports.
pub fn set_emit_limit(bytes: usize) {
    EMIT_BYTES.store(bytes, Ordering::Relaxed);
}

/// `.Call` entry used by the driver to report conditions, plots and status.
unsafe extern "C" fn rvisor_emit(kind: SEXP, a: SEXP, b: SEXP, c: SEXP) -> SEXP {
    let max = EMIT_BYTES.load(Ordering::Relaxed);
    // SAFETY: on the R thread, called by .Call with four live arguments.
    let (kind, a, b, c) = unsafe {
        (
            strings_bounded(kind, 1, 64),
            strings_bounded(a, EMIT_STRINGS, max),
            strings_bounded(b, EMIT_STRINGS, max),
            strings_bounded(c, EMIT_STRINGS, max),
        )
    };
    if let Some(h) = HOOKS.get() {
        (h.emit)(kind.first().map(String::as_str).unwrap_or(""), a, b, c);
    }
    // SAFETY: R_NilValue is a constant of an initialised R.
    unsafe { R_NilValue }
}

/// Copies a character vector (or NULL) into owned strings; NA becomes "NA".
///
/// # Safety
/// On the R thread; `x` is a live R object.
pub unsafe fn strings(x: SEXP) -> Vec<String> {
    // SAFETY: per the function's contract.
    unsafe {
        if ffi::TYPEOF(x) != SEXPTYPE::STRSXP as c_int {
            return Vec::new();
        }
        let n = Rf_xlength(x);
        let mut out = Vec::with_capacity(n as usize);
        for i in 0..n {
            let el = STRING_ELT(x, i);
            if el == R_NaString {
                out.push("NA".to_string());
            } else {
                let p = Rf_translateCharUTF8(el);
                out.push(CStr::from_ptr(p).to_string_lossy().into_owned());
            }
        }
        out
    }
}

/// Copies at most `max_n` strings of a character vector (or NULL), each cut
/// to at most `max_bytes` bytes at a character boundary; NA becomes "NA".
/// Only the kept bytes are decoded.
///
/// # Safety
/// On the R thread; `x` is a live R object.
pub unsafe fn strings_bounded(x: SEXP, max_n: usize, max_bytes: usize) -> Vec<String> {
    // SAFETY: per the function's contract.
    unsafe {
        if ffi::TYPEOF(x) != SEXPTYPE::STRSXP as c_int {
            return Vec::new();
        }
        let n = (Rf_xlength(x).max(0) as usize).min(max_n);
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let el = STRING_ELT(x, i as R_xlen_t);
            if el == R_NaString {
                out.push("NA".to_string());
                continue;
            }
            let bytes = CStr::from_ptr(Rf_translateCharUTF8(el)).to_bytes();
            let upto = bytes.len().min(max_bytes.saturating_add(4));
            let text = String::from_utf8_lossy(&bytes[..upto]);
            let (kept, _) = rvisor_protocol::bounds::cut(&text, max_bytes);
            out.push(kept.to_string());
        }
        out
    }
}

/// A length-one character vector holding `s` (UTF-8). `s` must not contain
/// NUL bytes (R would raise an error, which must not cross Rust frames).
///
/// # Safety
/// On the R thread. The result is unprotected.
pub unsafe fn mk_string(s: &str) -> SEXP {
    debug_assert!(!s.contains('\0'));
    // SAFETY: per the function's contract; the pointer/length pair is valid
    // for the duration of the call and R copies the bytes.
    unsafe {
        Rf_ScalarString(Rf_mkCharLenCE(
            s.as_ptr().cast::<c_char>(),
            s.len() as c_int,
            cetype_t::CE_UTF8,
        ))
    }
}

/// A CHARSXP holding `s` (UTF-8; must not contain NUL).
///
/// # Safety
/// On the R thread. The result is unprotected.
pub unsafe fn mk_char(s: &str) -> SEXP {
    debug_assert!(!s.contains('\0'));
    // SAFETY: pointer/length of a live Rust string; R copies the bytes.
    unsafe {
        Rf_mkCharLenCE(
            s.as_ptr().cast::<c_char>(),
            s.len() as c_int,
            cetype_t::CE_UTF8,
        )
    }
}

/// Parses `code` and evaluates each expression in `env`, returning the last
/// value (unprotected) or the error R reported.
///
/// # Safety
/// On the R thread; `env` is a live environment.
pub unsafe fn eval_string(code: &str, env: SEXP) -> Result<SEXP, String> {
    // SAFETY: per the function's contract; every object allocated here is
    // protected until it is no longer used, and R errors are caught by
    // R_tryEval instead of unwinding through this frame.
    unsafe {
        let text = Rf_protect(mk_string(code));
        let mut status = ParseStatus::PARSE_NULL;
        let exprs = Rf_protect(R_ParseVector(text, -1, &mut status, R_NilValue));
        if status != ParseStatus::PARSE_OK {
            Rf_unprotect(2);
            return Err(format!("failed to parse internal R code ({status:?})"));
        }
        let mut value = R_NilValue;
        for i in 0..Rf_xlength(exprs) {
            let mut err: c_int = 0;
            value = R_tryEval(VECTOR_ELT(exprs, i), env, &mut err);
            if err != 0 {
                Rf_unprotect(2);
                return Err("internal R code raised an error".to_string());
            }
        }
        Rf_unprotect(2);
        Ok(value)
    }
}

/// The driver's `caps` (what a call may report), from the protocol's bounds.
fn driver_caps() -> String {
    use rvisor_protocol::bounds::*;
    format!(
        "caps <- list(message = {ERROR_MESSAGE_BYTES}L, call = {CALL_BYTES}L, \
         frames = {TRACEBACK_FRAMES}L, warning = {WARNING_MESSAGE_BYTES}L, \
         warnings = {MAX_WARNINGS}L, plots = {MAX_PLOTS}L, tool_request = {}L)",
        rvisor_protocol::MAX_TOOL_REQUEST_BYTES
    )
}

/// Sets the driver's `max_out`, the output cap of the call about to run
/// (messages are cut to it in R).
///
/// # Safety
/// On the R thread; `driver` is the driver's environment.
pub unsafe fn set_max_out(driver: SEXP, bytes: u64) {
    // SAFETY: per the function's contract; the new double is protected
    // until it is bound.
    unsafe {
        let v = Rf_protect(Rf_ScalarReal(bytes as f64));
        Rf_defineVar(Rf_install(c"max_out".as_ptr()), v, driver);
        Rf_unprotect(1);
    }
}

/// Starts R with `hooks` receiving what it reports. Must be called once, on
/// the main thread, before anything else touches R.
pub fn start(hooks: Hooks) -> Result<R, String> {
    // Only the first call's hooks count; there is no second start.
    let _ = HOOKS.set(hooks);
    if std::env::var_os("R_HOME").is_none() {
        std::env::set_var("R_HOME", env!("RVISOR_BUILD_R_HOME"));
    }
    if std::env::var_os("LC_ALL").is_none() && std::env::var_os("LANG").is_none() {
        // Without a UTF-8 locale R prints non-ASCII text as <U+00E9>.
        std::env::set_var("LANG", "C.UTF-8");
    }
    let args: Vec<CString> = ["R", "--vanilla", "--quiet", "--no-echo", "--no-save"]
        .iter()
        .map(|a| CString::new(*a).expect("static argument"))
        .collect();
    // R keeps argv pointers (commandArgs()), so they live for the process.
    let args: &'static [CString] = Box::leak(args.into_boxed_slice());
    let mut argv: Vec<*mut c_char> = args.iter().map(|a| a.as_ptr() as *mut c_char).collect();
    let argv: &'static mut [*mut c_char] = Box::leak(argv.split_off(0).into_boxed_slice());

    // SAFETY: first and only initialisation of R, on the main thread; the
    // hooks are `extern "C"` functions that never unwind (a panic in them
    // aborts) and only touch this thread's capture.
    unsafe {
        ffi::R_SignalHandlers = 0;
        Rf_initialize_R(argv.len() as c_int, argv.as_mut_ptr());
        ffi::R_Interactive = 0;
        ffi::R_Outputfile = ptr::null_mut();
        ffi::R_Consolefile = ptr::null_mut();
        ffi::ptr_R_WriteConsole = None;
        ffi::ptr_R_WriteConsoleEx = Some(write_console_ex);
        ffi::ptr_R_ReadConsole = Some(read_console);
        ffi::ptr_R_CleanUp = Some(clean_up);
        setup_Rmainloop();
    }

    // SAFETY: R is initialised; on the R thread. The method table is
    // 'static and terminated by a null entry, as R_registerRoutines requires.
    unsafe {
        static mut CALL_METHODS: [R_CallMethodDef; 3] = [
            R_CallMethodDef {
                name: c"rvisor_emit".as_ptr(),
                fun: None,
                numArgs: 4,
            },
            R_CallMethodDef {
                name: c"rvisor_tool".as_ptr(),
                fun: None,
                numArgs: 2,
            },
            R_CallMethodDef {
                name: ptr::null(),
                fun: None,
                numArgs: 0,
            },
        ];
        let emit: unsafe extern "C" fn(SEXP, SEXP, SEXP, SEXP) -> SEXP = rvisor_emit;
        // DL_FUNC is R's generic function pointer; .Call casts it back using
        // numArgs, which matches the real signature above.
        CALL_METHODS[0].fun = Some(std::mem::transmute::<
            unsafe extern "C" fn(SEXP, SEXP, SEXP, SEXP) -> SEXP,
            unsafe extern "C" fn() -> *mut std::os::raw::c_void,
        >(emit));
        let tool: unsafe extern "C" fn(SEXP, SEXP) -> SEXP = hooks.tool;
        CALL_METHODS[1].fun = Some(std::mem::transmute::<
            unsafe extern "C" fn(SEXP, SEXP) -> SEXP,
            unsafe extern "C" fn() -> *mut std::os::raw::c_void,
        >(tool));
        let info = R_getEmbeddingDllInfo();
        R_registerRoutines(
            info,
            ptr::null(),
            ptr::addr_of!(CALL_METHODS).cast::<R_CallMethodDef>(),
            ptr::null(),
            ptr::null(),
        );
        R_useDynamicSymbols(info, Rboolean::FALSE);
    }

    // SAFETY: on the R thread; objects are protected (or preserved) while used.
    unsafe {
        let driver = eval_string("new.env(parent = baseenv())", R_GlobalEnv)?;
        R_PreserveObject(driver);
        let sym = eval_string("getNativeSymbolInfo('rvisor_emit')", R_BaseEnv)?;
        Rf_defineVar(Rf_install(c"emit".as_ptr()), sym, driver);
        let sym = eval_string("getNativeSymbolInfo('rvisor_tool')", R_BaseEnv)?;
        Rf_defineVar(Rf_install(c"tool_sym".as_ptr()), sym, driver);
        eval_string(DRIVER_SOURCE, driver)
            .map_err(|e| format!("failed to load the driver: {e}"))?;
        eval_string(&driver_caps(), driver)
            .map_err(|e| format!("failed to set the driver's caps: {e}"))?;
        let run_fn = Rf_findVarInFrame(driver, Rf_install(c"run".as_ptr()));
        let version = strings(eval_string(
            "paste(R.version$major, R.version$minor, sep = '.')",
            R_BaseEnv,
        )?)
        .pop()
        .unwrap_or_default();
        let tempdir = strings(eval_string("tempdir()", R_BaseEnv)?)
            .pop()
            .unwrap_or_default();
        let plot_dir = format!("{tempdir}/rvisor-plots");
        let dir = Rf_protect(mk_string(&plot_dir));
        let init = Rf_protect(Rf_lang2(
            Rf_findVarInFrame(driver, Rf_install(c"init".as_ptr())),
            dir,
        ));
        let mut err = 0;
        R_tryEval(init, driver, &mut err);
        Rf_unprotect(2);
        if err != 0 {
            return Err("failed to initialise the driver".into());
        }
        Ok(R {
            driver,
            run_fn,
            version,
            tempdir,
        })
    }
}
