//! Raw declarations of R's embedding symbols that `libR-sys` 0.7.1 lacks.
//!
//! All of these are exported by Debian's `libR.so` (R 4.2) and documented in
//! "Writing R Extensions", section 8 (Linking GUIs and other front-ends to
//! R); they are not in R's public API headers that libR-sys binds. Every use
//! must happen on the R thread (the process's main thread), which is the only
//! thread that ever touches R: that is the invariant the SAFETY comments in
//! the rest of the crate refer to as "on the R thread".

#![allow(non_upper_case_globals, non_snake_case)]

use libR_sys::SEXP;
use std::os::raw::{c_char, c_int, c_uchar};

/// `ptr_R_WriteConsoleEx`: `otype` 0 = stdout, 1 = stderr.
pub type WriteConsoleEx = unsafe extern "C" fn(buf: *const c_char, len: c_int, otype: c_int);
/// `ptr_R_WriteConsole` (the legacy hook, must be NULL for Ex to be used).
pub type WriteConsole = unsafe extern "C" fn(buf: *const c_char, len: c_int);
/// `ptr_R_ReadConsole`: returns 0 for EOF.
pub type ReadConsole = unsafe extern "C" fn(
    prompt: *const c_char,
    buf: *mut c_uchar,
    len: c_int,
    add_history: c_int,
) -> c_int;
/// `ptr_R_ProcessEvents` and `ptr_R_FlushConsole`: no arguments.
pub type NoArgs = unsafe extern "C" fn();
/// `ptr_R_CleanUp(SA_TYPE save, int status, int runLast)`.
pub type CleanUp = unsafe extern "C" fn(save: c_int, status: c_int, run_last: c_int);

// SEXP is a pointer to an opaque struct: passing it is FFI-safe in practice.
#[allow(improper_ctypes)]
extern "C" {
    /// 0 stops R from installing its own signal handlers (SIGINT, SIGSEGV...).
    pub static mut R_SignalHandlers: c_int;
    /// R's idea of interactivity (`interactive()`); an `Rboolean`.
    pub static mut R_Interactive: c_int;
    /// Stdio streams R writes to when no console hook is set.
    pub static mut R_Outputfile: *mut libc::FILE;
    /// See [`R_Outputfile`].
    pub static mut R_Consolefile: *mut libc::FILE;
    /// Console output hooks.
    pub static mut ptr_R_WriteConsole: Option<WriteConsole>;
    /// See [`ptr_R_WriteConsole`].
    pub static mut ptr_R_WriteConsoleEx: Option<WriteConsoleEx>;
    /// Console input hook.
    pub static mut ptr_R_ReadConsole: Option<ReadConsole>;
    /// Called by `quit()`.
    pub static mut ptr_R_CleanUp: Option<CleanUp>;
    /// Called whenever R checks for events (`R_CheckUserInterrupt`, and
    /// between the waits of `Sys.sleep()`).
    pub static mut ptr_R_ProcessEvents: Option<NoArgs>;
    /// Called by `flush.console()`.
    pub static mut ptr_R_FlushConsole: Option<NoArgs>;
    /// The longest `Sys.sleep()` waits between event checks, in
    /// microseconds (0: no limit); `R_ext/eventloop.h`.
    pub static mut R_wait_usec: c_int;
    /// R's session temporary directory (what `tempdir()` returns); a
    /// forked worker points it at a directory of its own.
    pub static mut R_TempDir: *mut c_char;
    /// Type of an R object (a function in R 4.2's API; libR-sys lacks it).
    pub fn TYPEOF(x: SEXP) -> c_int;
    /// Whether the value of the last evaluation is visible (an `Rboolean`);
    /// read right after `Rf_eval` of a top-level expression, as R's REPL does.
    pub static mut R_Visible: c_int;
    /// A full garbage collection.
    pub fn R_gc();
    /// The text of the last error R reported ("Error in f() : msg\n").
    pub fn R_curErrorBuf() -> *const c_char;
    /// Sets a symbol's value in the base environment (how R's REPL sets
    /// `.Last.value`).
    pub fn SET_SYMVALUE(x: SEXP, v: SEXP);
    /// Runs the task callbacks (`addTaskCallback`) after a top-level
    /// expression, as R's REPL does; `succeeded` and `visible` are
    /// `Rboolean`s. A callback that returns FALSE is removed.
    pub fn Rf_callToplevelHandlers(expr: SEXP, value: SEXP, succeeded: c_int, visible: c_int);
    /// The top of R's protection stack (`PROTECT`'s count of slots in use,
    /// of `R_PPStackSize`): read and balanced around each call
    /// (`r::protect_depth`, `r::rebalance`).
    pub static R_PPStackTop: c_int;
    /// `class(x)` (`single_string` 0: every class, implicit ones too);
    /// exported by libR, not in libR-sys.
    pub fn R_data_class(obj: SEXP, single_string: c_int) -> SEXP;
}
