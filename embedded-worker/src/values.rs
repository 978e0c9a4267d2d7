//! JSON to R values, for the values the host hands to R code: a tool's
//! answer and a call's `variables`.
//!
//! Part of the R layer: it builds R objects and depends only on `r`, so the
//! modules that receive JSON (tools, eval) share it without depending on
//! each other.

use crate::r::sys::*;
use std::os::raw::c_int;

/// The longest name R accepts for a symbol, in bytes (R's `MAXIDSIZE`).
pub const MAX_NAME_BYTES: usize = 10_000;

/// `name` if R can bind it as a variable: not empty, at most
/// [`MAX_NAME_BYTES`] (R raises "variable names are limited to 10000
/// bytes"), no NUL. The supervisor checks syntax; this is what R itself
/// would refuse at bind time.
pub fn check_name(name: &str) -> Result<&str, String> {
    let head: String = name.chars().take(40).collect();
    if name.is_empty() {
        Err("name is empty".into())
    } else if name.len() > MAX_NAME_BYTES {
        Err(format!(
            "name {head:?}... is {} bytes long; R limits names to {MAX_NAME_BYTES} bytes",
            name.len()
        ))
    } else if name.contains('\0') {
        Err(format!("name {head:?} contains a NUL byte"))
    } else {
        Ok(name)
    }
}

/// Whether every string in `v` (keys too) can become an R string, and no
/// array is longer than R's vectors allow.
pub fn check_value(v: &serde_json::Value) -> Result<(), String> {
    use serde_json::Value as V;
    match v {
        V::String(s) => match crate::r::string_problem(s) {
            Some(why) => Err(format!("a string cannot be given to R: {why}")),
            None => Ok(()),
        },
        V::Array(items) => items.iter().try_for_each(check_value),
        V::Object(map) => map.iter().try_for_each(|(k, it)| {
            if let Some(why) = crate::r::string_problem(k) {
                return Err(format!("a name cannot be given to R: {why}"));
            }
            check_value(it)
        }),
        _ => Ok(()),
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
/// Allocates no Rust value with a destructor, so an R error (memory
/// running out) may jump out of it.
///
/// # Safety
/// On the R thread, inside `r::protected`; `v` passed [`check_value`].
/// The result is unprotected.
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
            V::String(s) => crate::r::mk_string(s),
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
/// On the R thread, inside `r::protected`; `s` passed `string_problem`.
/// The result is unprotected.
unsafe fn mk_char(s: &str) -> SEXP {
    // SAFETY: per the function's contract.
    unsafe { crate::r::mk_char(s) }
}
