//! Starting embedded R, and the one boundary through which Rust calls R.
//!
//! Everything here must run on the R thread: the process's main thread, which
//! called [`start`]. `main` never spawns threads that touch R, and R's hooks
//! call back on that same thread. [`RThread`] is the proof of that: it is
//! neither `Send` nor `Sync`, and only [`start`] (or code R itself calls,
//! such as a `.Call` entry) makes one.
//!
//! Every sequence of R API calls the worker makes runs inside [`protected`]
//! (or [`toplevel`] for user code): an R error or interrupt raised inside
//! longjmps to an `R_ToplevelExec` context set up here and becomes a Rust
//! `Err` with R's message, instead of unwinding through Rust frames or
//! reaching R's own top level (which ends a non-interactive R with
//! "Execution halted"). Objects allocated inside are protected through the
//! call's [`Scope`], which unprotects them when the call ends (R itself
//! resets the protection stack when it jumps out).
//!
//! The invariant every caller keeps: **a closure passed to [`protected`] or
//! [`toplevel`] holds no value with a destructor across an R API call that
//! can raise**. The closures are `Copy` (they capture only references and
//! plain values), and their bodies build owned Rust values (strings,
//! vectors) only after their last R call, or before they start. A longjmp
//! then skips nothing that needed to run.
//!
//! This is the bottom layer of the worker: it imports only `ffi` (and the
//! protocol's caps), and is the only module that imports `libR-sys`; the
//! R layer above (`values`, `hydrate`, `tools`, `eval`) reaches the raw API
//! through [`sys`], inside closures run by [`protected`], and `interrupt`
//! raises R's interrupt flag through [`set_interrupt_pending`]. What R's hooks do
//! with what they receive (capture, outcome, tool calls) is the business of
//! the modules above, which hand it in as [`Hooks`].

use crate::ffi;
use libR_sys::*;
use std::cell::Cell;
use std::ffi::{CStr, CString};
use std::marker::PhantomData;
use std::os::raw::{c_char, c_int, c_uchar, c_void};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// R's raw API, for the R layer's closures run by [`protected`].
pub(crate) mod sys {
    pub use libR_sys::*;
}

/// Proof that the code holding it runs on the R thread, with R started.
/// Not `Send`, not `Sync`: it cannot leave the thread.
#[derive(Debug, Clone, Copy)]
pub struct RThread {
    _not_send: PhantomData<*mut ()>,
}

impl RThread {
    /// A token for code that R itself called on its thread (a `.Call`
    /// entry, a hook) or that runs after [`start`] on the main thread.
    ///
    /// # Safety
    /// The caller runs on the R thread, after R was initialised.
    pub unsafe fn assume() -> RThread {
        RThread {
            _not_send: PhantomData,
        }
    }
}

/// The protections made during one [`protected`] call. It lives in the
/// frame of [`protected`], outside the `R_ToplevelExec` context, so its
/// `Drop` (which unprotects) is never skipped by a longjmp; after a jump R
/// has already reset its protection stack, and the count is cleared.
pub struct Scope {
    count: Cell<c_int>,
    _not_send: PhantomData<*mut ()>,
}

impl Scope {
    fn new() -> Scope {
        Scope {
            count: Cell::new(0),
            _not_send: PhantomData,
        }
    }

    /// Protects `x` until the protected call ends, and returns it.
    pub fn protect(&self, x: SEXP) -> SEXP {
        // SAFETY: a Scope exists only inside `protected`, on the R thread;
        // the protection is undone by this scope's Drop.
        unsafe { Rf_protect(x) };
        self.count.set(self.count.get() + 1);
        x
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let n = self.count.replace(0);
        if n > 0 {
            // SAFETY: on the R thread; exactly the `n` protections this
            // scope made are on top of R's stack (the closure returned
            // normally: anything it protected and unprotected itself is
            // balanced, and callees leave the stack as they found it).
            unsafe { Rf_unprotect(n) };
        }
    }
}

thread_local! {
    /// While set, R's console output to stderr is dropped: R's default
    /// error handler prints the error of an internal call (binding a
    /// variable) that the caller reports itself, or an error of user code
    /// that the driver has reported already.
    static QUIET_STDERR: Cell<bool> = const { Cell::new(false) };
}

/// Drops (true) or keeps (false) R's console output to stderr.
pub fn quiet_stderr(on: bool) {
    QUIET_STDERR.with(|q| q.set(on));
}

/// What the trampoline runs: the closure, taken once.
struct Job<F> {
    f: Option<F>,
    panicked: bool,
}

unsafe extern "C" fn trampoline<F: FnOnce()>(data: *mut c_void) {
    // SAFETY: `data` is the `Job<F>` that `toplevel` passes, alive for the
    // whole R_ToplevelExec; on the R thread.
    let job = unsafe { &mut *data.cast::<Job<F>>() };
    if let Some(f) = job.f.take() {
        // No panic may cross this extern "C" frame. An R error inside `f`
        // longjmps over this frame and the closure's, which hold nothing
        // with a destructor (the invariant of `toplevel`).
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
            job.panicked = true;
        }
    }
}

/// How a [`toplevel`] run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The closure returned.
    Returned,
    /// R jumped out of it (an error or an interrupt reached the top level).
    Jumped,
    /// It panicked (a bug; the panic was caught at the boundary).
    Panicked,
}

/// Runs `f` in a new top-level R context (`R_ToplevelExec`): at frame 0,
/// with no condition handlers on the stack but the global ones. An R
/// error or interrupt inside ends `f` there.
///
/// `f` must hold no value with a destructor across an R call (it is
/// `Copy`, so it captures none); what it computes goes out through
/// references to places owned by the caller.
pub fn toplevel<F: FnOnce() + Copy>(_tok: RThread, f: F) -> Ended {
    let mut job = Job {
        f: Some(f),
        panicked: false,
    };
    // SAFETY: on the R thread (the token); `job` outlives the call, and the
    // trampoline matches its type. R_ToplevelExec catches every jump out of
    // `f` and restores R's globals (protection stack, handler stack).
    let ok = unsafe { R_ToplevelExec(Some(trampoline::<F>), ptr::addr_of_mut!(job).cast()) };
    match (ok == Rboolean::TRUE, job.panicked) {
        (_, true) => Ended::Panicked,
        (true, false) => Ended::Returned,
        (false, false) => Ended::Jumped,
    }
}

/// The depth of R's protection stack now: what [`rebalance`] restores.
pub fn protect_depth(_tok: RThread) -> c_int {
    // SAFETY: on the R thread (the token), the only one that changes it.
    unsafe { ffi::R_PPStackTop }
}

/// Puts R's protection stack back to `depth` (from [`protect_depth`] when
/// the call began), once the call has ended. Nothing of a call stays
/// protected on the stack after it (what lives on is preserved), so
/// anything left is a leak: one slot a call would run out R's 50,000
/// after as many calls, and every later call would fail ("protection
/// stack overflow"). Debug builds (the tests) stop on it; a release
/// worker says it on stderr and undoes it.
pub fn rebalance(tok: RThread, depth: c_int) {
    let now = protect_depth(tok);
    if now > depth {
        debug_assert!(false, "a call left {} on R's protection stack", now - depth);
        eprintln!(
            "rvisor worker: a call left {} on R's protection stack; undone",
            now - depth
        );
        // SAFETY: on the R thread; the `now - depth` slots above `depth`
        // were pushed during the call, which has ended, and nothing
        // protected by them is used after it.
        unsafe { Rf_unprotect(now - depth) };
    }
}

/// The message of the last R error, without R's "Error in call : " prefix
/// and "Calls:" line.
pub fn last_error_message(_tok: RThread) -> String {
    // SAFETY: on the R thread; R_curErrorBuf returns R's static,
    // NUL-terminated error buffer.
    let raw = unsafe { CStr::from_ptr(ffi::R_curErrorBuf()) }
        .to_string_lossy()
        .into_owned();
    clean_error_text(&raw)
}

fn clean_error_text(raw: &str) -> String {
    let text: Vec<&str> = raw.lines().filter(|l| !l.starts_with("Calls:")).collect();
    let text = text.join("\n");
    let body = if let Some(rest) = text.strip_prefix("Error: ") {
        rest.to_string()
    } else if let Some(rest) = text.strip_prefix("Error in ") {
        // "Error in call : message"; the call may span lines.
        match rest.find(" : ") {
            Some(i) => rest[i + 3..].trim_start_matches('\n').to_string(),
            None => rest.to_string(),
        }
    } else {
        text
    };
    body.trim().to_string()
}

/// Runs a sequence of R API calls, `f`, in a protected context and turns
/// an R error raised inside into `Err` with R's message (R's own printing
/// of it is kept off the console). Objects `f` protects through its
/// [`Scope`] stay protected until `f` returns.
///
/// `f` keeps the invariant of [`toplevel`]: no value with a destructor is
/// alive across an R call inside it (it may return an owned `Err` built
/// after its last R call).
pub fn protected<T, F>(tok: RThread, f: F) -> Result<T, String>
where
    F: FnOnce(&Scope) -> Result<T, String> + Copy,
{
    let scope = Scope::new();
    let mut out: Option<Result<T, String>> = None;
    let was_quiet = QUIET_STDERR.with(|q| q.replace(true));
    let out_ref = &mut out;
    let scope_ref = &scope;
    // The closure handed to R_ToplevelExec only writes its result through a
    // reference once `f` has returned.
    let mut run = Some(move || *out_ref = Some(f(scope_ref)));
    let ended = {
        // `toplevel` needs a Copy closure; this one is called once, through
        // a raw pointer to the Option that owns it (no destructor runs in
        // the R context: the Option is owned here).
        let slot: *mut Option<_> = &mut run;
        toplevel(tok, move || {
            // SAFETY: `slot` points to `run` in this frame, alive for the
            // whole call; taken once.
            if let Some(mut g) = unsafe { (*slot).take() } {
                g()
            }
        })
    };
    QUIET_STDERR.with(|q| q.set(was_quiet));
    match ended {
        Ended::Returned => {
            drop(scope);
            out.unwrap_or_else(|| Err("the R call returned nothing".into()))
        }
        Ended::Jumped => {
            // R reset its protection stack when it jumped out.
            scope.count.set(0);
            Err(last_error_message(tok))
        }
        Ended::Panicked => {
            // No jump: the protections made before the panic are still on
            // R's stack, and the scope's Drop undoes them.
            drop(scope);
            Err("internal error: a panic in the worker's R layer".into())
        }
    }
}

/// Handles kept alive for the life of the process.
#[derive(Debug, Clone)]
pub struct R {
    /// The driver's private environment (preserved).
    pub driver: SEXP,
    /// "4.2.2".
    pub version: String,
    /// R's session temporary directory.
    pub tempdir: String,
}

const DRIVER_SOURCE: &str = include_str!("driver.R");

/// The driver's parts loaded on first use (driver.R, "parts loaded on
/// first use"): validation, checkpoints, displays, input from a front end
/// and the other host-side replacements, which a worker that only runs
/// code (and shows no table or HTML
/// value, loads no distribution-patched package) never needs, so their
/// code is not among the objects a user's `gc()` counts.
const DRIVER_PARTS: [&str; 6] = [
    include_str!("driver_validate.R"),
    include_str!("driver_state.R"),
    include_str!("driver_display.R"),
    include_str!("driver_input.R"),
    include_str!("driver_hosts.R"),
    include_str!("driver_compat.R"),
];

/// The driver's or a part's text without its comment lines (a line that
/// is only a comment): a part's text stays in every worker until first
/// used, and a user's `gc()` counts it (some 1,000 vector cells of
/// comments); the driver's is parsed at every start. A line of a string
/// running over lines that began with `#` would be dropped too: none has
/// one (each parses to the same code either way: `ffi-tests/tests/cli.rs`,
/// `the_driver_parses_to_the_same_code_without_its_comment_lines`).
fn without_comment_lines(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .fold(String::with_capacity(text.len()), |mut out, l| {
            out.push_str(l);
            out.push('\n');
            out
        })
}

/// The names a part assigns at top level: its lines that start, at column
/// 0, with a name and `<-` (a part is only such assignments, indented
/// bodies and comments; the driver's `load_part` refuses one that is not
/// as soon as it is loaded).
fn part_names(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|l| {
            let (name, rest) = l.split_once("<-")?;
            let name = name.trim_end();
            let first = name.chars().next()?;
            let ok = (first.is_ascii_alphabetic() || first == '.')
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '_');
            (ok && !rest.starts_with('-')).then_some(name)
        })
        .collect()
}

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
    /// R checks for events (`R_ProcessEvents`): often during evaluation.
    /// Must be cheap and must not call R.
    pub poll: fn(),
    /// `flush.console()`. Must not call R.
    pub flush: fn(),
}

static HOOKS: OnceLock<Hooks> = OnceLock::new();

/// Console output hook: R calls it for everything it prints.
unsafe extern "C" fn write_console_ex(buf: *const c_char, len: c_int, otype: c_int) {
    if buf.is_null() || len <= 0 {
        return;
    }
    // SAFETY: R passes a buffer of `len` bytes that stays valid for the call.
    let bytes = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len as usize) };
    if otype != 0 && QUIET_STDERR.with(Cell::get) {
        return;
    }
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

/// Event hook: R calls it whenever it checks for interrupts.
unsafe extern "C" fn process_events() {
    if let Some(h) = HOOKS.get() {
        (h.poll)();
    }
}

/// `flush.console()` hook.
unsafe extern "C" fn flush_console() {
    if let Some(h) = HOOKS.get() {
        (h.flush)();
    }
    // SAFETY: fflush(NULL) flushes every C stdio stream (what R's own hook
    // does for its console stream).
    unsafe { libc::fflush(ptr::null_mut()) };
}

/// Sets how long `Sys.sleep()` may wait between two calls of the event
/// hook (microseconds; 0: as long as it sleeps).
pub fn set_event_wait(_tok: RThread, usec: c_int) {
    // SAFETY: R_wait_usec is a plain int R reads on the R thread, which the
    // token proves this is.
    unsafe { ffi::R_wait_usec = usec };
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

/// `.Call` entry of the driver's error handler for what `stop("...")` and
/// R's C code signal: reports the error (as `emit("error", msg, call,
/// frames)` would) when its call and every frame of `calls` are of the
/// kind [`crate::deparse`] writes, and says so (TRUE); NULL otherwise,
/// with nothing reported, and the driver deparses with R's deparser.
unsafe extern "C" fn rvisor_error(msg: SEXP, call: SEXP, calls: SEXP, max_frames: SEXP) -> SEXP {
    // SAFETY: on the R thread, called by .Call with four live arguments.
    unsafe {
        let text = if call == R_NilValue {
            Vec::new()
        } else {
            match crate::deparse::simple(call) {
                Some(t) => vec![t],
                None => return R_NilValue,
            }
        };
        let max = Rf_asInteger(max_frames);
        if max == R_NaInt || max < 0 {
            return R_NilValue;
        }
        let Some(frames) = crate::deparse::frames(calls, max as usize) else {
            return R_NilValue;
        };
        let msg = strings_bounded(msg, EMIT_STRINGS, EMIT_BYTES.load(Ordering::Relaxed));
        if let Some(h) = HOOKS.get() {
            (h.emit)("error", msg, text, frames);
        }
        Rf_ScalarLogical(1)
    }
}

/// Strings of a character vector, NA as `None` (anything else: empty).
///
/// # Safety
/// On the R thread; `x` is a live R object.
unsafe fn strings_na(x: SEXP) -> Vec<Option<String>> {
    // SAFETY: per the function's contract.
    unsafe {
        if ffi::TYPEOF(x) != SEXPTYPE::STRSXP as c_int {
            return Vec::new();
        }
        let n = Rf_xlength(x);
        let mut out = Vec::with_capacity(n.max(0) as usize);
        for i in 0..n {
            let el = STRING_ELT(x, i);
            out.push(if el == R_NaString {
                None
            } else {
                Some(CStr::from_ptr(char_utf8(el)).to_string_lossy().into_owned())
            });
        }
        out
    }
}

/// A character vector of these strings (each passes [`string_problem`]).
///
/// # Safety
/// On the R thread. The result is unprotected.
unsafe fn mk_strings(v: &[String]) -> SEXP {
    // SAFETY: per the function's contract; the vector is protected while
    // its elements are made, and R copies each string's bytes.
    unsafe {
        let out = Rf_protect(Rf_allocVector(SEXPTYPE::STRSXP, v.len() as R_xlen_t));
        for (i, s) in v.iter().enumerate() {
            SET_STRING_ELT(
                out,
                i as R_xlen_t,
                Rf_mkCharLenCE(
                    s.as_ptr().cast::<c_char>(),
                    s.len().min(i32::MAX as usize) as c_int,
                    cetype_t::CE_UTF8,
                ),
            );
        }
        Rf_unprotect(1);
        out
    }
}

/// `.Call` entry of the driver's table displays (`driver_display.R`):
/// `kind` "table" gives `c(html, markdown)` of the cells in `args`,
/// "preview" the JSON preview's text (see [`crate::markup`]). NULL for
/// arguments not as the driver passes them (the driver then lets repr
/// or its own R code do it).
unsafe extern "C" fn rvisor_markup(kind: SEXP, args: SEXP) -> SEXP {
    // SAFETY: on the R thread, called by .Call with two live arguments;
    // the list's elements live as long as the list.
    unsafe {
        let kind = strings(kind);
        if ffi::TYPEOF(args) != SEXPTYPE::VECSXP as c_int {
            return R_NilValue;
        }
        let n = Rf_xlength(args);
        let el = |i: R_xlen_t| {
            if i < n {
                VECTOR_ELT(args, i)
            } else {
                R_NilValue
            }
        };
        let opt = |x: SEXP| (x != R_NilValue).then(|| strings(x));
        let out: Vec<String> = match kind.first().map(String::as_str) {
            Some("table") if n == 7 => {
                let cells = strings(el(0));
                let nrow = Rf_asInteger(el(1));
                if nrow < 0 || (nrow == 0 && !cells.is_empty()) {
                    return R_NilValue;
                }
                let (rn, cn, types) = (opt(el(2)), opt(el(3)), opt(el(4)));
                let caption = strings(el(5)).into_iter().next().unwrap_or_default();
                let underline = Rf_asInteger(el(6)).max(0) as usize;
                if nrow > 0 && cells.len() % nrow as usize != 0 {
                    return R_NilValue;
                }
                let (html, md) = crate::markup::table(&crate::markup::Table {
                    cells: &cells,
                    nrow: nrow as usize,
                    row_names: rn.as_deref(),
                    col_names: cn.as_deref(),
                    types: types.as_deref(),
                    caption: &caption,
                    underline,
                });
                vec![html, md]
            }
            Some("preview") if n == 9 => {
                let first = |x: SEXP| strings(x).into_iter().next().unwrap_or_default();
                let (nrow, ncol) = (first(el(0)), first(el(1)));
                let (names, types, kinds) = (strings(el(2)), strings(el(3)), strings(el(4)));
                let cells = el(5);
                if ffi::TYPEOF(cells) != SEXPTYPE::VECSXP as c_int
                    || Rf_xlength(cells) as usize != kinds.len()
                {
                    return R_NilValue;
                }
                let columns: Vec<crate::markup::Column> = kinds
                    .iter()
                    .enumerate()
                    .map(|(k, kind)| {
                        let v = strings_na(VECTOR_ELT(cells, k as R_xlen_t));
                        if kind == "raw" {
                            crate::markup::Column::Raw(v)
                        } else {
                            crate::markup::Column::Text(v)
                        }
                    })
                    .collect();
                let rows = Rf_asInteger(el(6)).max(0) as usize;
                let rn = (el(7) != R_NilValue).then(|| strings_na(el(7)));
                let truncated = Rf_asLogical(el(8)) == 1;
                vec![crate::markup::preview(&crate::markup::Preview {
                    nrow: &nrow,
                    ncol: &ncol,
                    names: &names,
                    types: &types,
                    columns: &columns,
                    rows,
                    row_names: rn.as_deref(),
                    truncated,
                })]
            }
            _ => return R_NilValue,
        };
        if out.iter().any(|s| string_problem(s).is_some()) {
            return R_NilValue;
        }
        mk_strings(&out)
    }
}

/// The bytes of a CHARSXP in UTF-8. A string marked "bytes" is taken as
/// it is: translating it would raise an R error, which must not cross the
/// Rust frames of a `.Call` entry.
///
/// # Safety
/// On the R thread; `el` is a live CHARSXP.
unsafe fn char_utf8(el: SEXP) -> *const c_char {
    // SAFETY: per the function's contract.
    unsafe {
        if Rf_getCharCE(el) == cetype_t::CE_BYTES {
            R_CHAR(el)
        } else {
            Rf_translateCharUTF8(el)
        }
    }
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
                out.push(CStr::from_ptr(char_utf8(el)).to_string_lossy().into_owned());
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
            let bytes = CStr::from_ptr(char_utf8(el)).to_bytes();
            let upto = bytes.len().min(max_bytes.saturating_add(4));
            let text = String::from_utf8_lossy(&bytes[..upto]);
            let (kept, _) = rvisor_protocol::bounds::cut(&text, max_bytes);
            out.push(kept.to_string());
        }
        out
    }
}

/// Why `s` cannot become an R string, if it cannot: R strings hold no NUL
/// byte and at most 2^31 - 1 bytes (R raises an error for either).
pub fn string_problem(s: &str) -> Option<String> {
    if s.contains('\0') {
        Some("it contains a NUL byte, which R strings cannot hold".into())
    } else if s.len() > i32::MAX as usize {
        Some(format!(
            "it is {} bytes long; R strings hold at most {} bytes",
            s.len(),
            i32::MAX
        ))
    } else {
        None
    }
}

/// A length-one character vector holding `s` (UTF-8). `s` passes
/// [`string_problem`] (R would raise an error otherwise).
///
/// # Safety
/// On the R thread, inside [`protected`]. The result is unprotected.
pub unsafe fn mk_string(s: &str) -> SEXP {
    debug_assert!(string_problem(s).is_none());
    // SAFETY: per the function's contract; the pointer/length pair is valid
    // for the duration of the call and R copies the bytes.
    unsafe {
        Rf_ScalarString(Rf_mkCharLenCE(
            s.as_ptr().cast::<c_char>(),
            s.len().min(i32::MAX as usize) as c_int,
            cetype_t::CE_UTF8,
        ))
    }
}

/// A CHARSXP holding `s` (UTF-8; passes [`string_problem`]).
///
/// # Safety
/// On the R thread, inside [`protected`]. The result is unprotected.
pub unsafe fn mk_char(s: &str) -> SEXP {
    debug_assert!(string_problem(s).is_none());
    // SAFETY: pointer/length of a live Rust string; R copies the bytes.
    unsafe {
        Rf_mkCharLenCE(
            s.as_ptr().cast::<c_char>(),
            s.len().min(i32::MAX as usize) as c_int,
            cetype_t::CE_UTF8,
        )
    }
}

/// Raises (true) or clears (false) R's pending-interrupt flag
/// (`R_interrupts_pending`), which R polls in loops, `Sys.sleep` and long
/// internals, then signals an `interrupt` condition.
///
/// Async-signal-safe, and the one R global touched from outside the R
/// thread's normal flow: the SIGINT handler calls it (`interrupt`), on
/// whichever thread the signal lands (the worker has one). Needs no
/// [`RThread`]: it is one volatile store to an `int`, which R reads with
/// no lock, and it allocates nothing and cannot raise an R error.
pub fn set_interrupt_pending(on: bool) {
    // SAFETY: R_interrupts_pending is a plain C `int` in libR (always
    // present once the worker is linked); a volatile aligned store is
    // atomic with respect to a signal handler and to R's own reads.
    unsafe {
        std::ptr::write_volatile(
            std::ptr::addr_of_mut!(R_interrupts_pending),
            c_int::from(on),
        )
    };
}

/// Whether R's pending-interrupt flag is raised: an interrupt reached the
/// worker and R has not acted on it yet (it clears the flag when it does).
pub fn interrupt_pending(_tok: RThread) -> bool {
    // SAFETY: R_interrupts_pending is a plain C `int` in libR; a volatile
    // aligned read on the R thread (the handler's store is atomic).
    unsafe { std::ptr::read_volatile(std::ptr::addr_of!(R_interrupts_pending)) != 0 }
}

/// Runs R's task callbacks (`addTaskCallback()`, `taskCallbackManager()`)
/// for top-level expression `expr` that succeeded with `value`, as R's
/// REPL (and Rscript) does after each expression has been printed.
///
/// # Safety
/// On the R thread, inside a top-level context (a callback's error jumps
/// to it); `expr` and `value` are protected.
pub unsafe fn run_task_callbacks(expr: SEXP, value: SEXP, visible: bool) {
    // SAFETY: per the function's contract.
    unsafe { ffi::Rf_callToplevelHandlers(expr, value, 1, c_int::from(visible)) }
}

/// Binds `sym` to `v` in the base environment, as R's own REPL sets
/// `.Last.value` and `last.warning`: R code cannot add a binding there
/// (the base environment's frame is locked: "cannot add binding of
/// 'last.warning' to the base environment"), so R's C code sets the
/// symbol's value directly, which is what this does.
///
/// # Safety
/// On the R thread; `sym` is a symbol and `v` a live object (the base
/// environment keeps it reachable from then on).
pub unsafe fn set_base_value(sym: SEXP, v: SEXP) {
    // SAFETY: per the function's contract; SET_SYMVALUE only stores the
    // pointer (with R's write barrier) and cannot raise an error.
    unsafe { ffi::SET_SYMVALUE(sym, v) }
}

/// Parses `code` and evaluates each expression in `env` inside
/// [`protected`], returning the last value (unprotected) or R's error.
///
/// # Safety
/// On the R thread; `env` is a live environment.
pub unsafe fn eval_string(code: &str, env: SEXP) -> Result<SEXP, String> {
    if let Some(why) = string_problem(code) {
        return Err(format!("cannot evaluate internal R code: {why}"));
    }
    // SAFETY: per the function's contract.
    let tok = unsafe { RThread::assume() };
    protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; `text` and `exprs`
        // are protected by `scope`; nothing here has a destructor (the
        // error string is made after the last R call).
        unsafe {
            let text = scope.protect(mk_string(code));
            let mut status = ParseStatus::PARSE_NULL;
            let exprs = scope.protect(R_ParseVector(text, -1, &mut status, R_NilValue));
            if status != ParseStatus::PARSE_OK {
                return Err(format!("failed to parse internal R code ({status:?})"));
            }
            let mut value = R_NilValue;
            for i in 0..Rf_xlength(exprs) {
                value = Rf_eval(VECTOR_ELT(exprs, i), env);
            }
            Ok(value)
        }
    })
}

/// Calls the driver's function `name` (a C string) with `args`, in `env`,
/// inside [`protected`]. The result is unprotected.
///
/// # Safety
/// On the R thread; `driver` is the driver's environment and `args` are
/// live objects, protected by the caller.
pub unsafe fn call_driver(driver: SEXP, name: &CStr, args: &[SEXP]) -> Result<SEXP, String> {
    // SAFETY: per the function's contract.
    let tok = unsafe { RThread::assume() };
    protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; the call is protected
        // by `scope` while it is built and evaluated.
        unsafe {
            let fun = Rf_findVarInFrame(driver, Rf_install(name.as_ptr()));
            let mut call = R_NilValue;
            for a in args.iter().rev() {
                call = scope.protect(Rf_lcons(*a, call));
            }
            let call = scope.protect(Rf_lcons(fun, call));
            Ok(Rf_eval(call, driver))
        }
    })
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
    // SAFETY: per the function's contract.
    let tok = unsafe { RThread::assume() };
    let _ = protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; the double is
        // protected by `scope` until it is bound.
        unsafe {
            let v = scope.protect(Rf_ScalarReal(bytes as f64));
            Rf_defineVar(Rf_install(c"max_out".as_ptr()), v, driver);
        }
        Ok(())
    });
}

/// The environment variables R's start-up set in this process (from
/// `R_HOME/etc/Renviron` and the worker's own defaults: `PAGER`,
/// `R_PAPERSIZE`, `R_UNZIPCMD`, `TAR`, `EDITOR`, `R_LIBS_SITE`...), with
/// their values.
static STARTUP_ENV: OnceLock<Vec<(std::ffi::OsString, std::ffi::OsString)>> = OnceLock::new();

/// What R's start-up added to (or changed in) the environment: a worker
/// forked from the zygote, whose environment is replaced by its own, sets
/// these again, so that it has what a worker that started R itself has
/// (without `PAGER`, `help()` and `file.show()` print nothing). Empty
/// before [`start`]. `R_SESSION_TMPDIR` (the zygote's own temporary
/// directory) is left out.
pub fn startup_env() -> &'static [(std::ffi::OsString, std::ffi::OsString)] {
    STARTUP_ENV.get().map(Vec::as_slice).unwrap_or(&[])
}

/// A worker started directly (not forked from the zygote) gets the same
/// `tempdir()` as a forked one (zygote.rs): `Rtmp` in its own directory
/// (`TMPDIR`), so that listings of its files leave it out
/// (`rvisor::files::R_TEMP_DIR`). R would make a `RtmpXXXXXX` of its own;
/// it keeps one set before [`start`]. The zygote keeps R's. Call before
/// [`start`], on the main thread.
pub fn use_rtmp_temp_dir() {
    let Some(tmp) = std::env::var_os("TMPDIR") else {
        return;
    };
    let rtmp = std::path::Path::new(&tmp).join("Rtmp");
    if std::fs::create_dir_all(&rtmp).is_err() {
        return;
    }
    if let Ok(c) = CString::new(rtmp.as_os_str().as_encoded_bytes()) {
        // SAFETY: on the main thread before R starts (its start-up keeps
        // a temporary directory already set); R keeps the pointer for the
        // process, so the CString is leaked.
        unsafe { ffi::R_TempDir = c.into_raw() };
    }
}

/// The JIT level R sets at start-up from `R_ENABLE_JIT` (C's `atoi` of
/// it; 3 when unset).
fn jit_level(var: Option<&std::ffi::OsStr>) -> i32 {
    let Some(v) = var else { return 3 };
    let v = v.to_string_lossy();
    let t = v.trim_start();
    let (sign, digits) = match t.as_bytes().first() {
        Some(b'-') => (-1i64, &t[1..]),
        Some(b'+') => (1, &t[1..]),
        _ => (1, t),
    };
    let n = digits
        .bytes()
        .take_while(u8::is_ascii_digit)
        .fold(0i64, |n, d| {
            (n * 10 + i64::from(d - b'0')).min(i64::from(i32::MAX))
        });
    (sign * n) as i32
}

/// R's default packages, as its start-up would have loaded them, and its
/// JIT at the level it would have set (start.R says why).
///
/// # Safety
/// On the R thread, R initialised by `setup_Rmainloop`.
unsafe fn load_default_packages(
    default_packages: Option<&std::ffi::OsStr>,
    enable_jit: Option<&std::ffi::OsStr>,
) -> Result<(), String> {
    let dp = default_packages.map_or(String::new(), |v| v.to_string_lossy().into_owned());
    let level = jit_level(enable_jit);
    if let Some(why) = string_problem(&dp) {
        return Err(format!("R_DEFAULT_PACKAGES cannot be given to R: {why}"));
    }
    let code = format!("({})({}, {level}L)", include_str!("start.R"), r_string(&dp));
    // SAFETY: per the function's contract.
    unsafe { eval_string(&code, R_BaseEnv) }
        .map(|_| ())
        .map_err(|e| format!("failed to load R's default packages: {e}"))
}

/// Starts R with `hooks` receiving what it reports. Must be called once, on
/// the main thread, before anything else touches R.
pub fn start(hooks: Hooks) -> Result<R, String> {
    // Only the first call's hooks count; there is no second start.
    let _ = HOOKS.set(hooks);
    let env_before: std::collections::HashMap<std::ffi::OsString, std::ffi::OsString> =
        std::env::vars_os().collect();
    if std::env::var_os("R_HOME").is_none() {
        std::env::set_var("R_HOME", env!("RVISOR_BUILD_R_HOME"));
    }
    // What the `R` front-end script exports and embedded R lacks:
    // R.home("doc"), R.home("share") and R.home("include") need them.
    for (var, baked) in [
        ("R_SHARE_DIR", env!("RVISOR_BUILD_R_SHARE_DIR")),
        ("R_INCLUDE_DIR", env!("RVISOR_BUILD_R_INCLUDE_DIR")),
        ("R_DOC_DIR", env!("RVISOR_BUILD_R_DOC_DIR")),
    ] {
        if std::env::var_os(var).is_none() && !baked.is_empty() {
            std::env::set_var(var, baked);
        }
    }
    if std::env::var_os("LC_ALL").is_none() && std::env::var_os("LANG").is_none() {
        // Without a UTF-8 locale R prints non-ASCII text as <U+00E9>.
        std::env::set_var("LANG", "C.UTF-8");
    }
    // The default packages are loaded after R's start-up, with the JIT off
    // until they are (start.R); both variables are put back right after.
    let default_packages = std::env::var_os("R_DEFAULT_PACKAGES");
    let enable_jit = std::env::var_os("R_ENABLE_JIT");
    std::env::set_var("R_DEFAULT_PACKAGES", "NULL");
    std::env::set_var("R_ENABLE_JIT", "0");
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
        ffi::ptr_R_ProcessEvents = Some(process_events);
        ffi::ptr_R_FlushConsole = Some(flush_console);
        setup_Rmainloop();
    }
    for (var, was) in [
        ("R_DEFAULT_PACKAGES", &default_packages),
        ("R_ENABLE_JIT", &enable_jit),
    ] {
        match was {
            Some(v) => std::env::set_var(var, v),
            None => std::env::remove_var(var),
        }
    }
    // SAFETY: R is initialised; on the R thread.
    unsafe { load_default_packages(default_packages.as_deref(), enable_jit.as_deref()) }?;
    let added: Vec<_> = std::env::vars_os()
        .filter(|(k, v)| k != "R_SESSION_TMPDIR" && env_before.get(k) != Some(v))
        .collect();
    let _ = STARTUP_ENV.set(added);

    // SAFETY: R is initialised; on the R thread. The method table is
    // 'static and terminated by a null entry, as R_registerRoutines requires.
    unsafe {
        static mut CALL_METHODS: [R_CallMethodDef; 5] = [
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
                name: c"rvisor_markup".as_ptr(),
                fun: None,
                numArgs: 2,
            },
            R_CallMethodDef {
                name: c"rvisor_error".as_ptr(),
                fun: None,
                numArgs: 4,
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
        let markup: unsafe extern "C" fn(SEXP, SEXP) -> SEXP = rvisor_markup;
        CALL_METHODS[2].fun = Some(std::mem::transmute::<
            unsafe extern "C" fn(SEXP, SEXP) -> SEXP,
            unsafe extern "C" fn() -> *mut std::os::raw::c_void,
        >(markup));
        let error: unsafe extern "C" fn(SEXP, SEXP, SEXP, SEXP) -> SEXP = rvisor_error;
        CALL_METHODS[3].fun = Some(std::mem::transmute::<
            unsafe extern "C" fn(SEXP, SEXP, SEXP, SEXP) -> SEXP,
            unsafe extern "C" fn() -> *mut std::os::raw::c_void,
        >(error));
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
        let sym = eval_string("getNativeSymbolInfo('rvisor_markup')", R_BaseEnv)?;
        Rf_defineVar(Rf_install(c"markup_sym".as_ptr()), sym, driver);
        let sym = eval_string("getNativeSymbolInfo('rvisor_error')", R_BaseEnv)?;
        Rf_defineVar(Rf_install(c"error_sym".as_ptr()), sym, driver);
        // Without its comment lines: a quarter of its lines, and of R's
        // parse of it at every start (~0.6 of 2.2 ms).
        eval_string(&without_comment_lines(DRIVER_SOURCE), driver)
            .map_err(|e| format!("failed to load the driver: {e}"))?;
        // One call for all parts: R's JIT compiles a closure on its second
        // call, and a worker's first compile forces most of the compiler's
        // lazily loaded functions (some 56,000 cons cells, which every
        // user's gc() would count).
        let tok = RThread::assume();
        protected(tok, |scope| {
            let mut args = Vec::with_capacity(2 * DRIVER_PARTS.len());
            for text in DRIVER_PARTS {
                args.push(scope.protect(mk_string(&without_comment_lines(text))));
                let names = part_names(text);
                let v = scope.protect(Rf_allocVector(SEXPTYPE::STRSXP, names.len() as R_xlen_t));
                for (i, n) in names.iter().enumerate() {
                    SET_STRING_ELT(v, i as R_xlen_t, mk_char(n));
                }
                args.push(v);
            }
            call_driver(driver, c"on_demand", &args).map(|_| ())
        })
        .map_err(|e| format!("failed to bind the driver's parts: {e}"))?;
        eval_string(&driver_caps(), driver)
            .map_err(|e| format!("failed to set the driver's caps: {e}"))?;
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
        if let Some(why) = string_problem(&plot_dir) {
            return Err(format!("the plot directory cannot be used: {why}"));
        }
        let tok = RThread::assume();
        protected(tok, |scope| {
            let dir = scope.protect(mk_string(&plot_dir));
            call_driver(driver, c"init", &[dir]).map(|_| ())
        })
        .map_err(|e| format!("failed to initialise the driver: {e}"))?;
        Ok(R {
            driver,
            version,
            tempdir,
        })
    }
}

/// `s` as an R string literal.
pub fn r_string(s: &str) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parts_names_are_its_top_level_assignments() {
        let text = "## a comment\nfirst <- function(x) {\n  inner <- x\n  inner\n}\n\
                    .dotted_2 <- 1\nx[1] <- 2\nnot_this <<- 3\n# gone <- 4\n";
        assert_eq!(part_names(text), vec!["first", ".dotted_2"]);
        // Every part the driver loads on demand declares what it assigns.
        let all: Vec<&str> = DRIVER_PARTS.iter().flat_map(|p| part_names(p)).collect();
        for p in DRIVER_PARTS {
            assert!(!part_names(p).is_empty());
        }
        for known in [
            "validate",
            "checkpoint_state",
            "restore_state",
            "show_table",
            "install_input",
        ] {
            assert!(all.contains(&known), "{known} in {all:?}");
        }
    }

    #[test]
    fn the_jit_level_is_what_r_reads_from_r_enable_jit() {
        use std::ffi::OsStr;
        assert_eq!(jit_level(None), 3);
        for (v, want) in [
            ("0", 0),
            ("2", 2),
            (" 1", 1),
            ("3x", 3),
            ("x", 0),
            ("", 0),
            ("-1", -1),
        ] {
            assert_eq!(jit_level(Some(OsStr::new(v))), want, "{v:?}");
        }
    }
}
