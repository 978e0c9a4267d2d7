//! A deparser for the calls an error's report names, in Rust: what R's
//! `deparse()` gives for a simple call (`f(x, "a", 1L, n = 2)`), byte for
//! byte, or nothing, and the driver asks R's own deparser.
//!
//! An error's traceback deparses one call per frame. R's deparser sets up
//! its print defaults (reading a dozen options) and its buffers for each,
//! and the driver's R wrapper around it costs a closure call more: for
//! `stop("boom")` that was some 50,000 of a warm error's 237,000
//! instructions. Most frames are calls of named functions on names and
//! short constants; those are written here. Anything else (an operator, a
//! name that needs backticks, a string with a character other than
//! printable ASCII, a number R could print in scientific notation, an
//! attribute, more than [`MAX_LEN`] bytes) is `None`, so nothing here has
//! to follow R's rules beyond the plain case.

use crate::ffi;
use libR_sys::*;
use std::ffi::CStr;
use std::os::raw::c_int;

/// Longest text written here (R's deparser breaks lines past its
/// `width.cutoff`, 500 bytes as the driver asks; this stays clear of it).
const MAX_LEN: usize = 400;

/// Deepest nesting of calls written here.
const MAX_DEPTH: usize = 8;

/// Whether R writes `name` bare in a call: the names of
/// [`rvisor_protocol::names::bare_name`], and `...`.
pub fn syntactic(name: &str) -> bool {
    name == "..." || rvisor_protocol::names::bare_name(name)
}

/// A string constant as R deparses it (double quotes), or `None` for a
/// character other than printable ASCII, tab, newline or carriage return.
pub fn quoted(s: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for &c in s {
        match c {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\t' => out.push_str("\\t"),
            b'\r' => out.push_str("\\r"),
            0x20..=0x7e => out.push(c as char),
            _ => return None,
        }
    }
    out.push('"');
    Some(out)
}

/// A double as R deparses it, for the whole numbers it writes in fixed
/// notation (with `scipen` 0): `None` for the rest.
pub fn whole_number(x: f64) -> Option<String> {
    if !x.is_finite() || x.fract() != 0.0 || x.abs() >= 1e15 {
        return None;
    }
    let digits = format!("{}", x.abs() as u64);
    let significant = digits.trim_end_matches('0').len().max(1);
    // R prints fixed when it is no wider than scientific notation
    // (`1e+05`, `1.5e+07`: mantissa, "e+", two exponent digits).
    let sci = if significant > 1 { significant + 1 } else { 1 } + 4;
    if digits.len() > sci {
        return None;
    }
    Some(if x < 0.0 {
        format!("-{digits}")
    } else {
        digits
    })
}

/// `x`'s text as R's `deparse()` writes it (one line), when it is a call
/// (or a name or scalar constant) of the simple kind; `None` otherwise.
///
/// # Safety
/// On the R thread; `x` is a live R object.
pub unsafe fn simple(x: SEXP) -> Option<String> {
    let mut out = String::new();
    // SAFETY: per the function's contract.
    unsafe { write(x, &mut out, 0)? };
    (out.len() <= MAX_LEN).then_some(out)
}

/// The name of a symbol.
///
/// # Safety
/// On the R thread; `x` is a live symbol.
unsafe fn name_of(x: SEXP) -> Option<&'static str> {
    // SAFETY: per the function's contract: a symbol's name is a CHARSXP
    // that lives as long as the symbol (for ever: symbols are not
    // collected).
    unsafe { CStr::from_ptr(R_CHAR(PRINTNAME(x))).to_str().ok() }
}

/// Whether `x` is a call of the function named `name`.
///
/// # Safety
/// On the R thread; `x` is a live R object.
pub unsafe fn is_call_to(x: SEXP, name: &str) -> bool {
    // SAFETY: per the function's contract.
    unsafe {
        ffi::TYPEOF(x) == SEXPTYPE::LANGSXP as c_int
            && ffi::TYPEOF(CAR(x)) == SEXPTYPE::SYMSXP as c_int
            && name_of(CAR(x)) == Some(name)
    }
}

/// Appends `x`'s text to `out`; `None` when it is not of the simple kind.
///
/// # Safety
/// On the R thread; `x` is a live R object.
unsafe fn write(x: SEXP, out: &mut String, depth: usize) -> Option<()> {
    // SAFETY: per the function's contract; every object read is reached
    // from `x`, which the caller keeps alive.
    unsafe {
        if out.len() > MAX_LEN || depth > MAX_DEPTH {
            return None;
        }
        let t = ffi::TYPEOF(x);
        if t == SEXPTYPE::NILSXP as c_int {
            out.push_str("NULL");
            return Some(());
        }
        if t == SEXPTYPE::SYMSXP as c_int {
            let name = name_of(x)?;
            if x == R_MissingArg || !syntactic(name) {
                return None;
            }
            out.push_str(name);
            return Some(());
        }
        if ATTRIB(x) != R_NilValue {
            return None;
        }
        if t == SEXPTYPE::LANGSXP as c_int {
            let head = CAR(x);
            if ffi::TYPEOF(head) != SEXPTYPE::SYMSXP as c_int {
                return None;
            }
            write(head, out, depth + 1)?;
            out.push('(');
            let mut arg = CDR(x);
            let mut first = true;
            while arg != R_NilValue {
                if ffi::TYPEOF(arg) != SEXPTYPE::LISTSXP as c_int {
                    return None;
                }
                if !first {
                    out.push_str(", ");
                }
                first = false;
                let tag = TAG(arg);
                if tag != R_NilValue {
                    let name = name_of(tag)?;
                    if !syntactic(name) {
                        return None;
                    }
                    out.push_str(name);
                    out.push_str(" = ");
                }
                write(CAR(arg), out, depth + 1)?;
                arg = CDR(arg);
            }
            out.push(')');
            return Some(());
        }
        if Rf_xlength(x) != 1 {
            return None;
        }
        if t == SEXPTYPE::STRSXP as c_int {
            let el = STRING_ELT(x, 0);
            if el == R_NaString {
                out.push_str("NA_character_");
            } else {
                out.push_str(&quoted(CStr::from_ptr(R_CHAR(el)).to_bytes())?);
            }
        } else if t == SEXPTYPE::LGLSXP as c_int {
            out.push_str(match *LOGICAL(x) {
                0 => "FALSE",
                v if v == R_NaInt => "NA",
                _ => "TRUE",
            });
        } else if t == SEXPTYPE::INTSXP as c_int {
            let v = *INTEGER(x);
            if v == R_NaInt {
                out.push_str("NA_integer_");
            } else {
                out.push_str(&format!("{v}L"));
            }
        } else if t == SEXPTYPE::REALSXP as c_int {
            let v = *REAL(x);
            if R_IsNA(v) != 0 {
                out.push_str("NA_real_");
            } else if !scipen_is_zero() {
                return None;
            } else {
                out.push_str(&whole_number(v)?);
            }
        } else {
            return None;
        }
        Some(())
    }
}

/// Whether `getOption("scipen")` is 0 or unset (R's deparser weighs fixed
/// against scientific notation with it).
///
/// # Safety
/// On the R thread.
unsafe fn scipen_is_zero() -> bool {
    // SAFETY: per the function's contract; the option's value is read, not kept.
    unsafe {
        let v = Rf_GetOption1(Rf_install(c"scipen".as_ptr()));
        v == R_NilValue || Rf_asInteger(v) == 0
    }
}

/// The traceback of an error as the driver's `error_frames()` writes it,
/// innermost frame first, from `calls` (`sys.calls()` in the driver's
/// error handler: its own frame, and R's `.handleSimpleError` under it,
/// are not the user's): at most `max_frames`, then a line that counts the
/// rest. `None` when a frame is not of the simple kind.
///
/// # Safety
/// On the R thread; `calls` is a live pairlist.
pub unsafe fn frames(calls: SEXP, max_frames: usize) -> Option<Vec<String>> {
    // SAFETY: per the function's contract; the calls are reached from `calls`.
    unsafe {
        let mut all = Vec::new();
        let mut c = calls;
        while c != R_NilValue {
            if ffi::TYPEOF(c) != SEXPTYPE::LISTSXP as c_int || all.len() > 10_000 {
                return None;
            }
            all.push(CAR(c));
            c = CDR(c);
        }
        let mut n = all.len().saturating_sub(1);
        if n >= 1 && is_call_to(all[n - 1], ".handleSimpleError") {
            n -= 1;
        }
        let k = n.min(max_frames);
        let mut out = Vec::with_capacity(k + 1);
        for j in 1..=k {
            out.push(simple(all[n - j])?);
        }
        if n > k {
            out.push(format!("... and {} more frames", n - k));
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_r_writes_bare() {
        for ok in ["f", "stop", ".f", "f.g_h2", "...", "x1", "T", "..a"] {
            assert!(syntactic(ok), "{ok}");
        }
        for no in [
            "", "1f", "_f", ".1f", "..1", "my var", "if", "function", "TRUE", "NA_real_", "+", "[",
            "é",
        ] {
            assert!(!syntactic(no), "{no}");
        }
    }

    #[test]
    fn strings_are_escaped_as_r_does_or_left_to_r() {
        assert_eq!(quoted(b"boom").as_deref(), Some("\"boom\""));
        assert_eq!(
            quoted(b"a\"b\\c\nd\te").as_deref(),
            Some("\"a\\\"b\\\\c\\nd\\te\"")
        );
        assert_eq!(quoted("é".as_bytes()), None);
        assert_eq!(quoted(b"\x07"), None);
    }

    #[test]
    fn whole_numbers_in_fixed_notation_only() {
        assert_eq!(whole_number(1.0).as_deref(), Some("1"));
        assert_eq!(whole_number(-3.0).as_deref(), Some("-3"));
        assert_eq!(whole_number(0.0).as_deref(), Some("0"));
        assert_eq!(whole_number(99999.0).as_deref(), Some("99999"));
        assert_eq!(whole_number(1200.0).as_deref(), Some("1200"));
        assert_eq!(whole_number(1e5), None); // R: 1e+05
                                             // 7 wide either way ("1.5e+06"): R takes fixed.
        assert_eq!(whole_number(1_500_000.0).as_deref(), Some("1500000"));
        assert_eq!(whole_number(0.5), None);
        assert_eq!(whole_number(f64::INFINITY), None);
    }
}
