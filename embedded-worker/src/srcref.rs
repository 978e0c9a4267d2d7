//! Source references as Rscript makes them: each top-level expression parsed
//! again, just before it runs, when `options("keep.source")` is on then.
//!
//! Rscript (R's read-eval-print loop over a file) parses one top-level
//! expression at a time, reading the `keep.source` option for each
//! (`R_Parse1Buffer`), so `options(keep.source = TRUE)` applies to the
//! expressions after it. A call is parsed whole first instead (a syntax
//! error anywhere runs nothing), without source references; when the option
//! is on before an expression, that expression is parsed again here from
//! its own text, with a srcfile as R's loop makes one.
//!
//! The text of each expression is the part of the code R's loop would have
//! in its buffer when the expression parses: from just after the `;` or
//! newline that ended the one before (blank and comment-only lines are
//! parsed on their own and dropped) to the `;` or newline after its last
//! token, comment included. Line numbers of its srcrefs count from that
//! text's first line, as under Rscript. The boundaries come from the
//! srcrefs of one more parse of the whole code ([`chunks_of`]), done only
//! in a call where the option is on; [`chunks`] turns them into byte
//! ranges, and checks each range (what precedes and follows it), so a range
//! it cannot vouch for leaves that expression as first parsed.

use crate::r::sys::*;
use crate::r::{self, RThread};
use std::borrow::Cow;

/// Where one top-level expression's text lies in the code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// First byte (after the previous `;` or newline).
    pub start: usize,
    /// One past the last byte (the `;` or newline that ends it).
    pub end: usize,
    /// The code ends without a newline here: R's console reader adds one.
    pub newline: bool,
}

impl Chunk {
    /// The text R's loop would parse for this expression.
    pub fn text<'a>(&self, code: &'a str) -> Cow<'a, str> {
        let t = &code[self.start..self.end];
        if self.newline {
            Cow::Owned(format!("{t}\n"))
        } else {
            Cow::Borrowed(t)
        }
    }
}

/// The byte offset in `line` of the character R's parser numbers column
/// `col` (1-based): one column per character, a tab advancing to the next
/// multiple of 8 (`xxgetc` in R's gram.y). None if no character has it.
fn byte_at_col(line: &str, col: i32) -> Option<(usize, char)> {
    let mut c: i32 = 0;
    for (b, ch) in line.char_indices() {
        c += 1;
        if ch == '\t' {
            c = (c + 7) & !7;
        }
        if c == col {
            return Some((b, ch));
        }
        if c > col {
            return None;
        }
    }
    None
}

/// Blanks R's lexer skips between tokens on a line.
fn is_blank(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\x0c')
}

/// The text of each top-level expression of `code`, from the srcrefs of a
/// parse of the whole code (R's eight integers each: first line, byte,
/// last line, byte, first and last column, first and last parsed line).
/// Columns and parsed lines are used: R's byte counts run one too far after
/// a multibyte character in a string, and `#line` directives renumber
/// lines. `None` for an expression whose range does not check out.
pub fn chunks(code: &str, refs: &[[i32; 8]]) -> Vec<Option<Chunk>> {
    let mut starts = vec![0usize];
    starts.extend(code.match_indices('\n').map(|(i, _)| i + 1));
    let line = |n: i32| -> Option<(usize, &str)> {
        let i = usize::try_from(n).ok()?.checked_sub(1)?;
        let from = *starts.get(i)?;
        let to = starts.get(i + 1).map_or(code.len(), |&s| s - 1);
        Some((from, &code[from..to]))
    };
    let bytes = code.as_bytes();
    let one = |r: &[i32; 8]| -> Option<Chunk> {
        let (l0, text0) = line(r[6])?;
        let (l1, text1) = line(r[7])?;
        let first = l0 + byte_at_col(text0, r[4])?.0;
        let (b, ch) = byte_at_col(text1, r[5])?;
        let last = l1 + b + ch.len_utf8();
        if first >= last {
            return None;
        }
        // Back over blanks to the `;` or newline that ended the previous
        // expression (or the start): anything else means the columns were
        // not read right.
        let mut start = first;
        while start > 0 && is_blank(bytes[start - 1]) {
            start -= 1;
        }
        if start > 0 && !matches!(bytes[start - 1], b';' | b'\n') {
            return None;
        }
        // On over blanks to the `;`, the newline, or a comment to its end.
        let mut end = last;
        while end < bytes.len() && is_blank(bytes[end]) {
            end += 1;
        }
        let (end, newline) = match bytes.get(end) {
            None => (end, true),
            Some(b';' | b'\n') => (end + 1, false),
            Some(b'#') => match code[end..].find('\n') {
                Some(nl) => (end + nl + 1, false),
                None => (code.len(), true),
            },
            Some(_) => return None,
        };
        Some(Chunk {
            start,
            end,
            newline,
        })
    };
    refs.iter().map(one).collect()
}

/// Whether R's loop would keep source references for the next expression
/// it parses: `keep.source` as `R_Parse1Buffer` reads it (`asLogical`, so
/// NA counts as on).
///
/// # Safety
/// On the R thread, inside a top-level context (`r::protected` or
/// `r::toplevel`): a corrupted options list raises an R error.
pub unsafe fn keep_source() -> bool {
    // SAFETY: per the function's contract.
    unsafe { Rf_asLogical(Rf_GetOption1(Rf_install(c"keep.source".as_ptr()))) != 0 }
}

/// The text of each top-level expression of `code` (`text` is `code` as a
/// preserved R string), from one more parse with source references. Empty
/// if that parse fails or does not give `n` expressions (the expressions
/// then keep their first parse).
pub fn chunks_of(tok: RThread, text: SEXP, code: &str, n: usize) -> Vec<Option<Chunk>> {
    let refs = r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; `text` is preserved by
        // the caller, the srcfile and the parse are protected by `scope`.
        // The positions are copied (the one allocation of a Rust value)
        // after the last R call that can raise.
        unsafe {
            let srcfile = scope.protect(R_NewEnv(R_EmptyEnv, 0, 0));
            let mut status = ParseStatus::PARSE_NULL;
            let exprs = scope.protect(R_ParseVector(text, -1, &mut status, srcfile));
            if status != ParseStatus::PARSE_OK {
                return Ok(Vec::new());
            }
            let refs = Rf_getAttrib(exprs, Rf_install(c"srcref".as_ptr()));
            if crate::ffi::TYPEOF(refs) != SEXPTYPE::VECSXP as i32
                || Rf_xlength(refs) != n as R_xlen_t
            {
                return Ok(Vec::new());
            }
            let mut out = Vec::with_capacity(n);
            for i in 0..n {
                let s = VECTOR_ELT(refs, i as R_xlen_t);
                if crate::ffi::TYPEOF(s) != SEXPTYPE::INTSXP as i32 || Rf_xlength(s) < 8 {
                    return Ok(Vec::new());
                }
                let p = INTEGER(s);
                let mut r = [0i32; 8];
                for (k, v) in r.iter_mut().enumerate() {
                    *v = *p.add(k);
                }
                out.push(r);
            }
            Ok(out)
        }
    })
    .unwrap_or_default();
    if refs.len() != n {
        return Vec::new();
    }
    chunks(code, &refs)
}

/// Parses `chunk` (one top-level expression's text) as R's loop does with
/// `keep.source` on: source references into a srcfile of class
/// `srcfilecopy` with filename `""` and the text as `lines`, no parse data
/// (`R_Parse1Buffer` keeps none). The expression replaces element `i` of
/// the preserved expression vector `exprs`. Leaves it as it was if the text
/// does not parse to exactly one expression.
pub fn reparse(tok: RThread, exprs: SEXP, i: usize, chunk: &str) {
    if r::string_problem(chunk).is_some() {
        return;
    }
    let _ = r::protected(tok, |scope| {
        // SAFETY: on the R thread inside `protected`; `exprs` is preserved
        // by the caller and `i` is within it; every object made here is
        // protected by `scope` until it is stored in `exprs` (which keeps
        // it reachable) or dropped.
        unsafe {
            let text = scope.protect(r::mk_string(chunk));
            let srcfile = scope.protect(R_NewEnv(R_EmptyEnv, 0, 0));
            Rf_defineVar(
                Rf_install(c"filename".as_ptr()),
                scope.protect(Rf_mkString(c"".as_ptr())),
                srcfile,
            );
            Rf_defineVar(Rf_install(c"lines".as_ptr()), text, srcfile);
            let class = scope.protect(Rf_allocVector(SEXPTYPE::STRSXP, 2));
            SET_STRING_ELT(class, 0, Rf_mkChar(c"srcfilecopy".as_ptr()));
            SET_STRING_ELT(class, 1, Rf_mkChar(c"srcfile".as_ptr()));
            Rf_setAttrib(srcfile, R_ClassSymbol, class);
            let mut status = ParseStatus::PARSE_NULL;
            let parsed = scope.protect(R_ParseVector(text, -1, &mut status, srcfile));
            // R_Parse keeps parse data when `keep.parse.data` is on; R's
            // loop keeps none.
            R_removeVarFromFrame(Rf_install(c"parseData".as_ptr()), srcfile);
            if status == ParseStatus::PARSE_OK && Rf_xlength(parsed) == 1 {
                SET_VECTOR_ELT(exprs, i as R_xlen_t, VECTOR_ELT(parsed, 0));
            }
        }
        Ok(())
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chunks' texts, for positions written as R gives them
    /// (first line, first column, last line, last column).
    fn texts(code: &str, pos: &[(i32, i32, i32, i32)]) -> Vec<Option<String>> {
        let refs: Vec<[i32; 8]> = pos
            .iter()
            .map(|&(l0, c0, l1, c1)| [l0, 0, l1, 0, c0, c1, l0, l1])
            .collect();
        chunks(code, &refs)
            .into_iter()
            .map(|c| c.map(|c| c.text(code).into_owned()))
            .collect()
    }

    #[test]
    fn expressions_on_one_line_split_after_each_semicolon() {
        // R's loop reads up to each `;` and parses what it has.
        assert_eq!(
            texts(
                "a <- 1; f <- function(x) x ;g()\n",
                &[(1, 1, 1, 6), (1, 9, 1, 26), (1, 29, 1, 31)]
            ),
            vec![
                Some("a <- 1;".into()),
                Some(" f <- function(x) x ;".into()),
                Some("g()\n".into())
            ]
        );
    }

    #[test]
    fn a_multi_line_expression_keeps_its_lines_and_trailing_comment() {
        let code = "# head\n\nf <- function(x) {\n  x + 1 # one\n} # end\ny\n";
        assert_eq!(
            texts(code, &[(3, 1, 5, 1), (6, 1, 6, 1)]),
            vec![
                Some("f <- function(x) {\n  x + 1 # one\n} # end\n".into()),
                Some("y\n".into())
            ]
        );
    }

    #[test]
    fn the_last_line_gets_the_newline_r_s_reader_adds() {
        assert_eq!(texts("x", &[(1, 1, 1, 1)]), vec![Some("x\n".into())]);
        assert_eq!(
            texts("x # c", &[(1, 1, 1, 1)]),
            vec![Some("x # c\n".into())]
        );
    }

    #[test]
    fn columns_count_characters_and_tabs_as_r_does() {
        // "é" is one column and two bytes; a tab goes to column 8.
        let code = "s <- \"é\"; t <- 1\n\tu <- 2\n";
        assert_eq!(
            texts(code, &[(1, 1, 1, 8), (1, 11, 1, 16), (2, 9, 2, 14)]),
            vec![
                Some("s <- \"é\";".into()),
                Some(" t <- 1\n".into()),
                Some("\tu <- 2\n".into())
            ]
        );
    }

    #[test]
    fn a_range_that_does_not_check_out_is_refused() {
        // Starting inside a name, ending inside a name, past the line.
        assert_eq!(
            texts(
                "ab <- 1\n",
                &[(1, 2, 1, 7), (1, 1, 1, 1), (1, 1, 1, 40), (3, 1, 3, 1)]
            ),
            vec![None, None, None, None]
        );
    }
}
