//! Tools from R: `tools$name(...)` sends a request to the supervisor and
//! turns the JSON answer into an R value.

use crate::{eval, link};
use libR_sys::*;
use rvisor_protocol::{FromWorker, ToolOutcome, MAX_TOOL_REQUEST_BYTES};
use std::os::raw::c_int;

/// `.Call("rvisor_tool", name, args_json)`: returns `list(ok, value)`, where
/// `value` is the result or, when `ok` is FALSE, the error message (the R
/// side raises it: Rust must not raise R errors across its own frames).
///
/// # Safety
/// Called by R's `.Call` on the R thread with two live arguments.
pub unsafe extern "C" fn rvisor_tool(name: SEXP, args: SEXP) -> SEXP {
    // SAFETY: per the function's contract.
    let (name, args) = unsafe { (crate::r::strings(name), crate::r::strings(args)) };
    let name = name.into_iter().next().unwrap_or_default();
    let args = args.into_iter().next().unwrap_or_default();
    let outcome = call(&name, &args);
    // SAFETY: on the R thread; converts owned Rust data into new R objects.
    unsafe { to_answer(outcome) }
}

fn call(name: &str, args: &str) -> ToolOutcome {
    if args.len() > MAX_TOOL_REQUEST_BYTES {
        return ToolOutcome::Error(format!(
            "the request to tool '{name}' is {} bytes, over the limit of {} bytes; pass a data \
             pointer or a file name instead of the data",
            args.len(),
            MAX_TOOL_REQUEST_BYTES
        ));
    }
    let args: serde_json::Value = match serde_json::from_str(args) {
        Ok(v) => v,
        Err(e) => return ToolOutcome::Error(format!("failed to encode the tool arguments: {e}")),
    };
    let Some(execution_id) = eval::current_execution_id() else {
        return ToolOutcome::Error("tools can only be called during a call".into());
    };
    let call_id = eval::next_tool_call_id();
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

/// # Safety
/// On the R thread.
unsafe fn to_answer(outcome: ToolOutcome) -> SEXP {
    // SAFETY: on the R thread; `out` is protected while its elements are
    // built, and each element is stored right after it is made.
    unsafe {
        let out = Rf_protect(Rf_allocVector(SEXPTYPE::VECSXP, 2));
        match outcome {
            ToolOutcome::Value(v) => {
                SET_VECTOR_ELT(out, 0, Rf_ScalarLogical(1));
                SET_VECTOR_ELT(out, 1, json_to_r(&v));
            }
            // Interrupted while waiting (timeout, cancel): NA tells the
            // driver to end the call as an interrupt, not as an R error.
            ToolOutcome::Error(msg) if crate::interrupt::seen() => {
                SET_VECTOR_ELT(out, 0, Rf_ScalarLogical(R_NaInt));
                SET_VECTOR_ELT(out, 1, crate::r::mk_string(&msg.replace('\0', "")));
            }
            ToolOutcome::Error(msg) => {
                SET_VECTOR_ELT(out, 0, Rf_ScalarLogical(0));
                SET_VECTOR_ELT(out, 1, crate::r::mk_string(&msg.replace('\0', "")));
            }
        }
        Rf_unprotect(1);
        out
    }
}

#[derive(PartialEq, Clone, Copy)]
enum Kind {
    Bool,
    Int,
    Num,
    Str,
}

fn scalar_kind(v: &serde_json::Value) -> Option<Option<Kind>> {
    use serde_json::Value as V;
    match v {
        V::Null => Some(None),
        V::Bool(_) => Some(Some(Kind::Bool)),
        V::Number(n) => Some(Some(match n.as_i64() {
            Some(i) if i > i32::MIN as i64 && i <= i32::MAX as i64 => Kind::Int,
            _ => Kind::Num,
        })),
        V::String(_) => Some(Some(Kind::Str)),
        _ => None,
    }
}

/// The kind of an array that can become an atomic vector: all scalars of
/// one kind (integers widen to doubles), nulls allowed as NA.
fn atomic_kind(items: &[serde_json::Value]) -> Option<Kind> {
    let mut kind: Option<Kind> = None;
    for it in items {
        match scalar_kind(it)? {
            None => {}
            Some(k) => {
                kind = Some(match (kind, k) {
                    (None, k) => k,
                    (Some(a), b) if a == b => a,
                    (Some(Kind::Int), Kind::Num) | (Some(Kind::Num), Kind::Int) => Kind::Num,
                    _ => return None,
                });
            }
        }
    }
    kind
}

/// JSON to R, as jsonlite's `fromJSON(simplifyVector = TRUE)` would for
/// scalars and arrays of scalars: objects become named lists.
///
/// # Safety
/// On the R thread. The result is unprotected.
pub unsafe fn json_to_r(v: &serde_json::Value) -> SEXP {
    use serde_json::Value as V;
    // SAFETY: on the R thread; every allocation happens while the objects
    // being filled are protected.
    unsafe {
        match v {
            V::Null => R_NilValue,
            V::Bool(b) => Rf_ScalarLogical(*b as c_int),
            V::Number(n) => match scalar_kind(v) {
                Some(Some(Kind::Int)) => Rf_ScalarInteger(n.as_i64().unwrap_or(0) as c_int),
                _ => Rf_ScalarReal(n.as_f64().unwrap_or(f64::NAN)),
            },
            V::String(s) => crate::r::mk_string(&s.replace('\0', "")),
            V::Array(items) if !items.is_empty() && atomic_kind(items).is_some() => {
                let kind = atomic_kind(items).unwrap_or(Kind::Str);
                let n = items.len() as R_xlen_t;
                match kind {
                    Kind::Bool => {
                        let x = Rf_protect(Rf_allocVector(SEXPTYPE::LGLSXP, n));
                        for (i, it) in items.iter().enumerate() {
                            *LOGICAL(x).add(i) = it.as_bool().map_or(R_NaInt, |b| b as c_int);
                        }
                        Rf_unprotect(1);
                        x
                    }
                    Kind::Int => {
                        let x = Rf_protect(Rf_allocVector(SEXPTYPE::INTSXP, n));
                        for (i, it) in items.iter().enumerate() {
                            *INTEGER(x).add(i) = it.as_i64().map_or(R_NaInt, |v| v as c_int);
                        }
                        Rf_unprotect(1);
                        x
                    }
                    Kind::Num => {
                        let x = Rf_protect(Rf_allocVector(SEXPTYPE::REALSXP, n));
                        for (i, it) in items.iter().enumerate() {
                            *REAL(x).add(i) = it.as_f64().unwrap_or(R_NaReal);
                        }
                        Rf_unprotect(1);
                        x
                    }
                    Kind::Str => {
                        let x = Rf_protect(Rf_allocVector(SEXPTYPE::STRSXP, n));
                        for (i, it) in items.iter().enumerate() {
                            let el = match it.as_str() {
                                Some(s) => mk_char(s),
                                None => R_NaString,
                            };
                            SET_STRING_ELT(x, i as R_xlen_t, el);
                        }
                        Rf_unprotect(1);
                        x
                    }
                }
            }
            V::Array(items) => {
                let x = Rf_protect(Rf_allocVector(SEXPTYPE::VECSXP, items.len() as R_xlen_t));
                for (i, it) in items.iter().enumerate() {
                    SET_VECTOR_ELT(x, i as R_xlen_t, json_to_r(it));
                }
                Rf_unprotect(1);
                x
            }
            V::Object(map) => {
                let n = map.len() as R_xlen_t;
                let x = Rf_protect(Rf_allocVector(SEXPTYPE::VECSXP, n));
                let names = Rf_protect(Rf_allocVector(SEXPTYPE::STRSXP, n));
                for (i, (k, it)) in map.iter().enumerate() {
                    SET_STRING_ELT(names, i as R_xlen_t, mk_char(k));
                    SET_VECTOR_ELT(x, i as R_xlen_t, json_to_r(it));
                }
                Rf_setAttrib(x, R_NamesSymbol, names);
                Rf_unprotect(2);
                x
            }
        }
    }
}

/// # Safety
/// On the R thread; result unprotected.
unsafe fn mk_char(s: &str) -> SEXP {
    // SAFETY: per the function's contract; NULs removed as mk_char requires.
    unsafe { crate::r::mk_char(&s.replace('\0', "")) }
}
