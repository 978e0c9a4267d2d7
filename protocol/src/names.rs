//! R's rule for a name written bare (without backquotes), in one place for
//! the supervisor (variable names a run is given, `rvisor::ops`) and the
//! worker (the calls an error's report writes, its `deparse` module).

/// R's reserved words, which are never a bare name.
pub const RESERVED_WORDS: &[&str] = &[
    "if",
    "else",
    "repeat",
    "while",
    "function",
    "for",
    "next",
    "break",
    "TRUE",
    "FALSE",
    "NULL",
    "Inf",
    "NaN",
    "NA",
    "NA_integer_",
    "NA_real_",
    "NA_character_",
    "NA_complex_",
    "in",
];

/// Whether R writes `name` bare: a syntactic name in ASCII (R's own test
/// takes the locale's letters too), not a reserved word, and none of the
/// dot-dot forms (`...`, `..1`), which name arguments rather than values.
pub fn bare_name(name: &str) -> bool {
    let b = name.as_bytes();
    let ok_start = match b.first() {
        Some(c) if c.is_ascii_alphabetic() => true,
        Some(b'.') => !matches!(b.get(1), Some(c) if c.is_ascii_digit()),
        _ => false,
    };
    ok_start
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || *c == b'.' || *c == b'_')
        && !RESERVED_WORDS.contains(&name)
        && !(name.starts_with("..") && name[2..].chars().all(|c| c.is_ascii_digit()))
        && name != "..."
}

#[cfg(test)]
mod tests {
    use super::bare_name;

    #[test]
    fn bare_names_are_syntactic_ascii_and_not_reserved() {
        for ok in [
            "x", "x1", "my.var", "my_var", ".hidden", ".", "a.b_c", "..a", "T",
        ] {
            assert!(bare_name(ok), "{ok}");
        }
        for bad in [
            "", "1x", "_x", ".1x", "if", "TRUE", "NA_real_", "a-b", "a b", "...", "..1", "é", "+",
        ] {
            assert!(!bare_name(bad), "{bad}");
        }
    }
}
