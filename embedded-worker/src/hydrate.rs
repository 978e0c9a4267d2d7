//! Data pointers become data frames: the worker reads a stored table (an
//! Arrow IPC file) and builds R vectors from its columns directly, with no
//! text parsing in R.

use arrow_array::{
    Array, BooleanArray, Date32Array, Float64Array, Int64Array, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use arrow_schema::{DataType, TimeUnit};
use libR_sys::*;
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
/// in the global environment.
///
/// # Safety
/// On the R thread. `name` has no NUL.
pub unsafe fn bind(name: &str, f: std::fs::File) -> Result<(), String> {
    let (schema, batches) = read(f)?;
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    let ncol = schema.fields().len();
    let cname = std::ffi::CString::new(name).map_err(|_| "bad name".to_string())?;
    // SAFETY: on the R thread; `df` (and `names`) are protected while every
    // column is built, and each column is stored in `df` right after it is
    // made, before the next allocation.
    unsafe {
        let df = Rf_protect(Rf_allocVector(SEXPTYPE::VECSXP, ncol as R_xlen_t));
        let names = Rf_protect(Rf_allocVector(SEXPTYPE::STRSXP, ncol as R_xlen_t));
        for (j, field) in schema.fields().iter().enumerate() {
            SET_STRING_ELT(
                names,
                j as R_xlen_t,
                crate::r::mk_char(&field.name().replace('\0', "")),
            );
            let col = column(field.data_type(), &batches, j, rows)?;
            SET_VECTOR_ELT(df, j as R_xlen_t, col);
        }
        Rf_setAttrib(df, R_NamesSymbol, names);
        let rn = Rf_protect(Rf_allocVector(SEXPTYPE::INTSXP, 2));
        *INTEGER(rn) = R_NaInt;
        *INTEGER(rn).add(1) = -(rows as c_int);
        Rf_setAttrib(df, R_RowNamesSymbol, rn);
        Rf_setAttrib(df, R_ClassSymbol, crate::r::mk_string("data.frame"));
        Rf_defineVar(Rf_install(cname.as_ptr()), df, R_GlobalEnv);
        Rf_unprotect(3);
    }
    Ok(())
}

/// One column over all batches. The result is unprotected.
///
/// # Safety
/// On the R thread.
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
                let $a = b.column(j).as_any().downcast_ref::<$arr>().ok_or("column type mismatch")?;
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
                each!(StringArray, |a, i, at| {
                    let el = if a.is_null(i) {
                        R_NaString
                    } else {
                        crate::r::mk_char(&a.value(i).replace('\0', ""))
                    };
                    SET_STRING_ELT(x, at as R_xlen_t, el);
                });
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
                Rf_setAttrib(x, R_ClassSymbol, crate::r::mk_string("Date"));
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
                SET_STRING_ELT(cls, 0, crate::r::mk_char("POSIXct"));
                SET_STRING_ELT(cls, 1, crate::r::mk_char("POSIXt"));
                Rf_setAttrib(x, R_ClassSymbol, cls);
                let tz = tz.as_deref().unwrap_or("UTC").replace('\0', "");
                Rf_setAttrib(x, Rf_install(c"tzone".as_ptr()), crate::r::mk_string(&tz));
                Rf_unprotect(2);
                x
            }
            other => return Err(format!("unsupported column type {other}")),
        })
    }
}
