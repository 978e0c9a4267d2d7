//! Data pointers become data frames: the worker reads a stored table (an
//! Arrow IPC file) and builds R vectors from its columns directly, with no
//! text parsing in R.

use crate::r::sys::*;
use crate::r::{self, RThread};
use arrow_array::{
    Array, BooleanArray, Date32Array, Float64Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use arrow_schema::{DataType, TimeUnit};
use std::os::raw::c_int;

/// Reads the Arrow IPC file `f`.
fn read(f: std::fs::File) -> Result<(arrow_schema::SchemaRef, Vec<RecordBatch>), String> {
    let r = arrow_ipc::reader::FileReader::try_new(f, None)
        .map_err(|e| format!("cannot read the table: {e}"))?;
    let schema = r.schema();
    let batches = r
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("cannot read the table: {e}"))?;
    Ok((schema, batches))
}

/// Builds a data.frame from the table in file `f` and binds it to `name`
/// in the global environment, inside the protected boundary: memory
/// running out while a column is built is an `Err`, and nothing is bound.
///
/// The batches are read (and owned) here, outside R; the closure that
/// builds the R objects only borrows them, and makes no Rust value with a
/// destructor.
pub fn bind(tok: RThread, name: &str, f: std::fs::File) -> Result<(), String> {
    let (schema, batches) = read(f)?;
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    if rows > i32::MAX as usize {
        return Err(format!(
            "the table has {rows} rows; an R data frame holds at most {}",
            i32::MAX
        ));
    }
    let ncol = schema.fields().len();
    let mut names = Vec::with_capacity(ncol);
    for field in schema.fields() {
        if let Some(why) = r::string_problem(field.name()) {
            return Err(format!("a column name cannot be given to R: {why}"));
        }
        names.push(field.name().as_str());
    }
    let types: Vec<&DataType> = schema.fields().iter().map(|f| f.data_type()).collect();
    let cname = std::ffi::CString::new(name).map_err(|_| "the name holds a NUL byte")?;
    let (cname, names, types, batches) = (cname.as_c_str(), &names[..], &types[..], &batches[..]);
    r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; `df` and `nm` are
        // protected by `scope` while every column is built, and each column
        // is stored in `df` right after it is made, before the next
        // allocation. Everything borrowed is owned by the caller.
        unsafe {
            let df = scope.protect(Rf_allocVector(SEXPTYPE::VECSXP, ncol as R_xlen_t));
            let nm = scope.protect(Rf_allocVector(SEXPTYPE::STRSXP, ncol as R_xlen_t));
            for (j, field) in names.iter().enumerate() {
                SET_STRING_ELT(nm, j as R_xlen_t, r::mk_char(field));
                let col = column(types[j], batches, j, rows)?;
                SET_VECTOR_ELT(df, j as R_xlen_t, col);
            }
            Rf_setAttrib(df, R_NamesSymbol, nm);
            let rn = scope.protect(Rf_allocVector(SEXPTYPE::INTSXP, 2));
            *INTEGER(rn) = R_NaInt;
            *INTEGER(rn).add(1) = -(rows as c_int);
            Rf_setAttrib(df, R_RowNamesSymbol, rn);
            Rf_setAttrib(df, R_ClassSymbol, r::mk_string("data.frame"));
            Rf_defineVar(Rf_install(cname.as_ptr()), df, R_GlobalEnv);
        }
        Ok(())
    })
}

/// One column over all batches. The result is unprotected. Makes no Rust
/// value with a destructor (an R error may jump out of it); a string that
/// R cannot hold is an `Err` made after the last R call.
///
/// # Safety
/// On the R thread, inside `r::protected`.
unsafe fn column(
    t: &DataType,
    batches: &[RecordBatch],
    j: usize,
    rows: usize,
) -> Result<SEXP, String> {
    macro_rules! each {
        ($arr:ty, |$a:ident, $i:ident, $at:ident| $body:block) => {{
            let mut $at = 0usize;
            for b in batches {
                let Some($a) = b.column(j).as_any().downcast_ref::<$arr>() else {
                    return Err("column type mismatch".to_string());
                };
                for $i in 0..$a.len() {
                    $body
                    $at += 1;
                }
            }
        }};
    }
    // SAFETY: on the R thread; each vector is allocated with `rows`
    // elements and written at indices below `rows` (batches add up to it);
    // strings are made while the vector is protected.
    unsafe {
        Ok(match t {
            DataType::Int64 => {
                // R integers are 32-bit with NA = i32::MIN: wider values
                // become doubles.
                let fits = batches.iter().all(|b| {
                    b.column(j)
                        .as_any()
                        .downcast_ref::<Int64Array>()
                        .is_some_and(|a| {
                            a.iter()
                                .flatten()
                                .all(|v| v > i32::MIN as i64 && v <= i32::MAX as i64)
                        })
                });
                if fits {
                    let x = Rf_allocVector(SEXPTYPE::INTSXP, rows as R_xlen_t);
                    let p = INTEGER(x);
                    each!(Int64Array, |a, i, at| {
                        *p.add(at) = if a.is_null(i) {
                            R_NaInt
                        } else {
                            a.value(i) as c_int
                        };
                    });
                    x
                } else {
                    let x = Rf_allocVector(SEXPTYPE::REALSXP, rows as R_xlen_t);
                    let p = REAL(x);
                    each!(Int64Array, |a, i, at| {
                        *p.add(at) = if a.is_null(i) {
                            R_NaReal
                        } else {
                            a.value(i) as f64
                        };
                    });
                    x
                }
            }
            DataType::Float64 => {
                let x = Rf_allocVector(SEXPTYPE::REALSXP, rows as R_xlen_t);
                let p = REAL(x);
                each!(Float64Array, |a, i, at| {
                    *p.add(at) = if a.is_null(i) { R_NaReal } else { a.value(i) };
                });
                x
            }
            DataType::Boolean => {
                let x = Rf_allocVector(SEXPTYPE::LGLSXP, rows as R_xlen_t);
                let p = LOGICAL(x);
                each!(BooleanArray, |a, i, at| {
                    *p.add(at) = if a.is_null(i) {
                        R_NaInt
                    } else {
                        a.value(i) as c_int
                    };
                });
                x
            }
            DataType::Utf8 => {
                let x = Rf_protect(Rf_allocVector(SEXPTYPE::STRSXP, rows as R_xlen_t));
                let mut bad = None;
                each!(StringArray, |a, i, at| {
                    let el = if a.is_null(i) {
                        R_NaString
                    } else if a.value(i).len() > i32::MAX as usize || a.value(i).contains('\0') {
                        bad = Some(at);
                        R_NaString
                    } else {
                        r::mk_char(a.value(i))
                    };
                    SET_STRING_ELT(x, at as R_xlen_t, el);
                });
                if let Some(at) = bad {
                    Rf_unprotect(1);
                    return Err(format!(
                        "row {} of column {} holds a NUL byte or is over 2 GiB, which R \
                         strings cannot hold",
                        at + 1,
                        j + 1
                    ));
                }
                Rf_unprotect(1);
                x
            }
            DataType::Date32 => {
                let x = Rf_protect(Rf_allocVector(SEXPTYPE::REALSXP, rows as R_xlen_t));
                let p = REAL(x);
                each!(Date32Array, |a, i, at| {
                    *p.add(at) = if a.is_null(i) {
                        R_NaReal
                    } else {
                        a.value(i) as f64
                    };
                });
                Rf_setAttrib(x, R_ClassSymbol, r::mk_string("Date"));
                Rf_unprotect(1);
                x
            }
            DataType::Timestamp(TimeUnit::Microsecond, tz) => {
                let x = Rf_protect(Rf_allocVector(SEXPTYPE::REALSXP, rows as R_xlen_t));
                let p = REAL(x);
                each!(TimestampMicrosecondArray, |a, i, at| {
                    *p.add(at) = if a.is_null(i) {
                        R_NaReal
                    } else {
                        a.value(i) as f64 / 1e6
                    };
                });
                let cls = Rf_protect(Rf_allocVector(SEXPTYPE::STRSXP, 2));
                SET_STRING_ELT(cls, 0, r::mk_char("POSIXct"));
                SET_STRING_ELT(cls, 1, r::mk_char("POSIXt"));
                Rf_setAttrib(x, R_ClassSymbol, cls);
                let tz = tz.as_deref().unwrap_or("UTC");
                let tz = if r::string_problem(tz).is_some() {
                    "UTC"
                } else {
                    tz
                };
                Rf_setAttrib(x, Rf_install(c"tzone".as_ptr()), r::mk_string(tz));
                Rf_unprotect(2);
                x
            }
            other => return Err(format!("unsupported column type {other}")),
        })
    }
}
