//! Tools from R: `tools$name(...)` sends a request to the supervisor and
//! turns the JSON answer into an R value.
//!
//! `eval` opens the tools for a call ([`begin_call`]) and closes them
//! ([`end_call`]), as it does for interrupts; this module does not need to
//! know anything else about the call.

use crate::r::sys::*;
use crate::r::{self, RThread};
use crate::{interrupt, link, values};
use rvisor_protocol::{FromWorker, ToolOutcome, MAX_TOOL_REQUEST_BYTES};
use std::cell::{Cell, RefCell};

thread_local! {
    // Only the R thread: eval sets it, R's `.Call` reads it.
    /// The execution id of the call tools may be called for, if any.
    static CALL: RefCell<Option<String>> = const { RefCell::new(None) };
    /// The last tool call id handed out; ids are unique within this worker.
    static TOOL_CALLS: Cell<u64> = const { Cell::new(0) };
}

/// Tools may be called from now on, for call `execution_id`.
pub fn begin_call(execution_id: String) {
    CALL.with(|c| *c.borrow_mut() = Some(execution_id));
}

/// The call has ended (or the process is ending): tools are refused.
pub fn end_call() {
    CALL.with(|c| c.borrow_mut().take());
}

fn current_execution_id() -> Option<String> {
    CALL.with(|c| c.borrow().clone())
}

fn next_tool_call_id() -> u64 {
    TOOL_CALLS.with(|c| {
        c.set(c.get() + 1);
        c.get()
    })
}

/// `.Call("rvisor_tool", name, args_json)`: returns `list(ok, value)`, where
/// `value` is the result or, when `ok` is FALSE, the error message (the R
/// side raises it: Rust must not raise R errors across its own frames).
///
/// # Safety
/// Called by R's `.Call` on the R thread with two live arguments.
pub unsafe extern "C" fn rvisor_tool(name: SEXP, args: SEXP) -> SEXP {
    // SAFETY: per the function's contract.
    // Only one byte more than the limit is copied of the arguments: enough
    // to refuse them.
    let (name, args) = unsafe {
        (
            r::strings_bounded(name, 1, 1024),
            r::strings_bounded(args, 1, MAX_TOOL_REQUEST_BYTES + 1),
        )
    };
    let name = name.into_iter().next().unwrap_or_default();
    let args = args.into_iter().next().unwrap_or_default();
    let outcome = call(&name, &args);
    // SAFETY: R called this `.Call` entry on its thread.
    let tok = unsafe { RThread::assume() };
    to_answer(tok, outcome)
}

fn call(name: &str, args: &str) -> ToolOutcome {
    if args.len() > MAX_TOOL_REQUEST_BYTES {
        // The driver refuses these before they get here, with the size.
        return ToolOutcome::Error(format!(
            "the request to tool '{name}' is over the limit of {MAX_TOOL_REQUEST_BYTES} bytes; \
             pass a data pointer or a file name instead of the data",
        ));
    }
    let args: serde_json::Value = match serde_json::from_str(args) {
        Ok(v) => v,
        Err(e) => return ToolOutcome::Error(format!("failed to encode the tool arguments: {e}")),
    };
    let Some(execution_id) = current_execution_id() else {
        return ToolOutcome::Error("tools can only be called during a call".into());
    };
    let call_id = next_tool_call_id();
    let msg = FromWorker::ToolCall {
        execution_id,
        call_id,
        name: name.to_string(),
        args,
    };
    if let Err(e) = link::send(&msg) {
        return ToolOutcome::Error(format!("failed to send the tool call: {e}"));
    }
    link::wait_tool_result(call_id)
}

/// The answer as `list(ok, value)`, built inside the protected boundary:
/// a value R cannot hold (or memory running out) becomes an error answer,
/// and if even that cannot be built, NULL (the driver raises an error).
fn to_answer(tok: RThread, outcome: ToolOutcome) -> SEXP {
    let outcome = match outcome {
        ToolOutcome::Value(v) => match values::check_value(&v) {
            Ok(()) => ToolOutcome::Value(v),
            Err(e) => ToolOutcome::Error(format!("the tool's answer cannot be given to R: {e}")),
        },
        ToolOutcome::Error(msg) => ToolOutcome::Error(msg.replace('\0', "")),
    };
    let interrupted = interrupt::seen();
    let outcome = &outcome;
    let built = r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; `out` is protected by
        // `scope` while its elements are built, and each element is stored
        // right after it is made. `outcome` is owned by the caller.
        unsafe {
            let out = scope.protect(Rf_allocVector(SEXPTYPE::VECSXP, 2));
            match outcome {
                ToolOutcome::Value(v) => {
                    SET_VECTOR_ELT(out, 0, Rf_ScalarLogical(1));
                    SET_VECTOR_ELT(out, 1, values::json_to_r(v));
                }
                // Interrupted while waiting (timeout, cancel): NA tells the
                // driver to end the call as an interrupt, not as an R error.
                ToolOutcome::Error(msg) => {
                    let ok = if interrupted { R_NaInt } else { 0 };
                    SET_VECTOR_ELT(out, 0, Rf_ScalarLogical(ok));
                    SET_VECTOR_ELT(out, 1, r::mk_string(msg));
                }
            }
            Ok(out)
        }
    });
    match built {
        Ok(out) => out,
        Err(e) => to_answer_error(tok, &e),
    }
}

/// `list(FALSE, message)`, or NULL if even that cannot be built.
fn to_answer_error(tok: RThread, why: &str) -> SEXP {
    let msg = format!("the tool's answer could not be built in R: {why}").replace('\0', "");
    let msg = msg.as_str();
    // SAFETY: R_NilValue is a constant of an initialised R.
    let nil = unsafe { R_NilValue };
    r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; `out` is protected by
        // `scope`; `msg` is owned by the caller.
        unsafe {
            let out = scope.protect(Rf_allocVector(SEXPTYPE::VECSXP, 2));
            SET_VECTOR_ELT(out, 0, Rf_ScalarLogical(0));
            SET_VECTOR_ELT(out, 1, r::mk_string(msg));
            Ok(out)
        }
    })
    .unwrap_or(nil)
}
