//! Unit tests: one or more per rule, each checked against what lintr 3.0.2
//! gives for the same snippet, and a fuzz test (no panic on any input).

use super::*;

/// `(line, column, rule)` of each note for `src`.
fn notes(src: &str) -> Vec<(u32, u32, String)> {
    lint(src)
        .into_iter()
        .map(|n| (n.line, n.column, n.rule))
        .collect()
}

fn has(src: &str, rule: &str, line: u32, col: u32) {
    let got = notes(src);
    assert!(
        got.contains(&(line, col, rule.to_string())),
        "{rule} at {line}:{col} expected in {src:?}, got {got:?}"
    );
}

fn none(src: &str, rule: &str) {
    let got = notes(src);
    assert!(
        !got.iter().any(|n| n.2 == rule),
        "no {rule} expected in {src:?}, got {got:?}"
    );
}

#[test]
fn assignment_linter() {
    has("x = 1\n", "assignment_linter", 1, 3);
    has("1 -> x\n", "assignment_linter", 1, 3);
    has("1 ->> x\n", "assignment_linter", 1, 3);
    none(
        "x <- 1\nf(a = 1)\nf <- function(a = 1) a\nx <<- 2\n",
        "assignment_linter",
    );
    let m = &lint("1 ->> x\n")[0].message;
    assert!(
        m.starts_with("->> can have hard-to-predict behavior"),
        "{m}"
    );
}

#[test]
fn brace_linter() {
    has("f <- function(x)\n{\n  x\n}\n", "brace_linter", 2, 1);
    has("f <- function(x) { x }\n", "brace_linter", 1, 18);
    has("f <- function(x) { x }\n", "brace_linter", 1, 22);
    has("f <- function(x){\n  x\n}\n", "brace_linter", 1, 17);
    has("f <- function(x)\n  x\n", "brace_linter", 1, 6);
    has("if (x) {\n  1\n} else 2\n", "brace_linter", 1, 1);
    has("if (x) 1 else {\n  2\n}\n", "brace_linter", 1, 10);
    has(
        "{\n  if (x) {\n    1\n  }\n  else {\n    2\n  }\n}\n",
        "brace_linter",
        5,
        3,
    );
    none(
        "f <- function(x) {\n  x\n}\nif (x) {\n  1\n} else {\n  2\n}\n",
        "brace_linter",
    );
    none(
        "lapply(x, function(i) {\n  i\n})\ntryCatch({\n  1\n}, error = identity)\n",
        "brace_linter",
    );
    none("for (i in x){\n  i\n}\n", "brace_linter");
}

#[test]
fn commas_linter() {
    has("c(1,2)\n", "commas_linter", 1, 5);
    has("c(1 , 2)\n", "commas_linter", 1, 4);
    has("x[1,]\n", "commas_linter", 1, 5);
    none(
        "c(1, 2)\nx[, 1]\nx[1, , 2]\nalist(a = , b = 1)\n",
        "commas_linter",
    );
}

#[test]
fn commented_code_linter() {
    has("# x <- 1\n", "commented_code_linter", 1, 3);
    has("## print(x)\n", "commented_code_linter", 1, 4);
    has("y <- 1 # y <- 2\n", "commented_code_linter", 1, 10);
    none(
        "# This is prose.\n# TODO: later (maybe)\n#' @param x roxygen\n",
        "commented_code_linter",
    );
}

#[test]
fn equals_na_linter() {
    has("x == NA\n", "equals_na_linter", 1, 3);
    has("NA_integer_ != x\n", "equals_na_linter", 1, 13);
    none("is.na(x)\nx == 'NA'\n", "equals_na_linter");
}

#[test]
fn function_left_parentheses_linter() {
    has("mean (x)\n", "function_left_parentheses_linter", 1, 5);
    has(
        "f <- function (x) x\n",
        "function_left_parentheses_linter",
        1,
        14,
    );
    has(
        "base::mean (x)\n",
        "function_left_parentheses_linter",
        1,
        11,
    );
    none(
        "mean(x)\nf <- function(x) x\n",
        "function_left_parentheses_linter",
    );
}

#[test]
fn infix_spaces_linter() {
    has("x <- 1+2\n", "infix_spaces_linter", 1, 7);
    has("f(a=1)\n", "infix_spaces_linter", 1, 4);
    has("x<-1\n", "infix_spaces_linter", 1, 2);
    has("x %in%y\n", "infix_spaces_linter", 1, 3);
    none(
        "x <- -1\ny <- !x\nz <- x^2\nw <- x:y\nv <- ~x\nu <- f(a = 1)\nbox::use(a/b)\n",
        "infix_spaces_linter",
    );
}

#[test]
fn line_length_linter() {
    let long = format!("x <- \"{}\"\n", "a".repeat(80));
    has(&long, "line_length_linter", 1, 81);
    let ok = format!("x <- \"{}\"\n", "é".repeat(73));
    none(&ok, "line_length_linter");
}

#[test]
fn no_tab_linter() {
    has("\tx <- 1\n", "no_tab_linter", 1, 1);
    has("  \tx <- 1\n", "no_tab_linter", 1, 1);
    none("x <- \"a\n\tb\"\nx <- 1\t# tab inside\n", "no_tab_linter");
}

#[test]
fn object_length_linter() {
    has(
        &format!("{} <- 1\n", "a".repeat(31)),
        "object_length_linter",
        1,
        1,
    );
    none(
        &format!("{} <- 1\n", "a".repeat(30)),
        "object_length_linter",
    );
    none(
        &format!("print.{} <- function(x) x\n", "a".repeat(30)),
        "object_length_linter",
    );
}

#[test]
fn object_name_linter() {
    has("camelCase <- 1\n", "object_name_linter", 1, 1);
    has("f <- function(myArg) 1\n", "object_name_linter", 1, 15);
    has("names(myList) <- 1\n", "object_name_linter", 1, 7);
    has("1 -> rightName\n", "object_name_linter", 1, 6);
    none(
        "snake_case <- 1\n.hidden <- 2\nprint.myClass <- function(x) x\n.onLoad <- function(a, b) NULL\n\"%+%\" <- function(a, b) a\ndf$newCol <- 1\nx[myIndex] <- 2\n",
        "object_name_linter",
    );
}

#[test]
fn paren_body_linter() {
    has("f <- function(x)x\n", "paren_body_linter", 1, 17);
    has("if (x)y\n", "paren_body_linter", 1, 7);
    has("for (i in x)y\n", "paren_body_linter", 1, 13);
    none("f <- function(x) x\nif (x) y\n", "paren_body_linter");
}

#[test]
fn pipe_continuation_linter() {
    has("x %>%\n  f() %>% g()\n", "pipe_continuation_linter", 2, 7);
    has("x %>% f() %>%\n  g()\n", "pipe_continuation_linter", 1, 11);
    none(
        "x %>% f() %>% g()\nx %>%\n  f() %>%\n  g()\n",
        "pipe_continuation_linter",
    );
}

#[test]
fn semicolon_linter() {
    has("x <- 1;\n", "semicolon_linter", 1, 7);
    has("x <- 1; y <- 2\n", "semicolon_linter", 1, 7);
    let m: Vec<String> = lint("x <- 1;\ny <- 1; z <- 2\n")
        .into_iter()
        .filter(|n| n.rule == "semicolon_linter")
        .map(|n| n.message)
        .collect();
    assert_eq!(
        m,
        [
            "Trailing semicolons are not needed.",
            "Compound semicolons are discouraged. Replace them by a newline."
        ]
    );
    none("x <- \"a;b\" # c;d\n", "semicolon_linter");
}

#[test]
fn seq_linter() {
    let msg = |s: &str| {
        lint(s)
            .into_iter()
            .find(|n| n.rule == "seq_linter")
            .map(|n| n.message)
            .unwrap_or_default()
    };
    assert_eq!(
        msg("1:length(x)\n"),
        "1:length(...) is likely to be wrong in the empty edge case. Use seq_along(...) instead."
    );
    assert_eq!(
        msg("1:nrow(x)\n"),
        "1:nrow(...) is likely to be wrong in the empty edge case. Use seq_len(nrow(...)) instead."
    );
    assert_eq!(
        msg("seq(length(x))\n"),
        "seq(length(...)) is likely to be wrong in the empty edge case. Use seq_along(...) instead."
    );
    assert_eq!(
        msg("1:n()\n"),
        "1:n() is likely to be wrong in the empty edge case. Use seq_len(n()) instead."
    );
    has("for (i in 1:length(x)) i\n", "seq_linter", 1, 11);
    none("2:length(x)\nseq_len(n)\nseq(1, n)\n", "seq_linter");
}

#[test]
fn single_quotes_linter() {
    has("x <- 'a'\n", "single_quotes_linter", 1, 6);
    none("x <- \"a\"\ny <- 'it\"s'\n", "single_quotes_linter");
}

#[test]
fn spaces_inside_linter() {
    has("f( x)\n", "spaces_inside_linter", 1, 3);
    has("f(x )\n", "spaces_inside_linter", 1, 4);
    has("x[ 1]\n", "spaces_inside_linter", 1, 3);
    has("x[[1 ]]\n", "spaces_inside_linter", 1, 5);
    none(
        "f(x)\nx[1, ]\nf(\n  x\n)\nf( # comment\n  x)\n",
        "spaces_inside_linter",
    );
}

#[test]
fn spaces_left_parentheses_linter() {
    has("if(x) 1\n", "spaces_left_parentheses_linter", 1, 3);
    has("for(i in x) 1\n", "spaces_left_parentheses_linter", 1, 4);
    has("x <- y -(1)\n", "spaces_left_parentheses_linter", 1, 9);
    has("c(1,(2))\n", "spaces_left_parentheses_linter", 1, 5);
    none(
        "f(x)\nx <- -(1)\nif (x) 1\n",
        "spaces_left_parentheses_linter",
    );
}

#[test]
fn t_and_f_symbol_linter() {
    has("x <- T\n", "T_and_F_symbol_linter", 1, 7);
    has("T <- 1\n", "T_and_F_symbol_linter", 1, 2);
    none(
        "x <- TRUE\ny$T\nf(T = 1)\nfunction(T) 1\nT()\n",
        "T_and_F_symbol_linter",
    );
}

#[test]
fn trailing_blank_lines_linter() {
    has("x <- 1\n\n", "trailing_blank_lines_linter", 2, 1);
    has("x <- 1", "trailing_blank_lines_linter", 1, 7);
    none("x <- 1\n", "trailing_blank_lines_linter");
}

#[test]
fn trailing_whitespace_linter() {
    has("x <- 1  \n", "trailing_whitespace_linter", 1, 7);
    has("x <- 1\n  \ny\n", "trailing_whitespace_linter", 2, 1);
    none("x <- \"a  \nb\"\n", "trailing_whitespace_linter");
}

#[test]
fn vector_logic_linter() {
    has("if (a & b) 1\n", "vector_logic_linter", 1, 7);
    has("while (a | b) 1\n", "vector_logic_linter", 1, 10);
    has("expect_true(a & b)\n", "vector_logic_linter", 1, 15);
    none(
        "if (a && b) 1\nif (any(a & b)) 1\nif (x[a & b]) 1\nx <- a & b\nif (x) a & b\n",
        "vector_logic_linter",
    );
}

#[test]
fn the_issue_script() {
    // 50 lines of `x1 <- mean(rnorm(11)); y1 = x1 * 2`: a compound
    // semicolon and an `=` assignment on each.
    let script: String = (1..=50)
        .map(|i| format!("x{i} <- mean(rnorm({})); y{i} = x{i} * 2\n", i + 10))
        .collect();
    let n = lint(&script);
    assert_eq!(
        n.iter().filter(|n| n.rule == "semicolon_linter").count(),
        50
    );
    assert_eq!(
        n.iter().filter(|n| n.rule == "assignment_linter").count(),
        50
    );
}

#[test]
fn columns_count_characters() {
    has("s <- \"é\"; x = 1\n", "assignment_linter", 1, 13);
}

#[test]
fn syntax_errors_keep_line_rules_only() {
    let n = notes("x = (1  \n");
    assert_eq!(n, [(1, 7, "trailing_whitespace_linter".to_string())]);
}

/// A tiny deterministic generator (no dependency): xorshift.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn never_panics() {
    let pieces = [
        "x",
        "<-",
        "=",
        "->",
        "->>",
        "(",
        ")",
        "{",
        "}",
        "[",
        "[[",
        "]",
        "]]",
        ",",
        ";",
        "\n",
        " ",
        "\t",
        "'",
        "\"",
        "#",
        "%>%",
        "%%",
        "&",
        "|",
        "if",
        "else",
        "function",
        "\\",
        "for",
        "in",
        "while",
        "repeat",
        "1",
        "1L",
        "NA",
        "T",
        "F",
        ":",
        "::",
        "$",
        "@",
        "~",
        "-",
        "!",
        "é",
        "\u{1F600}",
        "\r",
        "r\"(",
        ")\"",
        "`",
        "...",
        "..1",
        "seq",
        "length",
        "\0",
    ];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for _ in 0..3000 {
        let len = (rng.next() % 40) as usize;
        let s: String = (0..len)
            .map(|_| pieces[(rng.next() % pieces.len() as u64) as usize])
            .collect();
        let _ = lint(&s);
    }
    for _ in 0..2000 {
        let len = (rng.next() % 64) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let _ = lint(&String::from_utf8_lossy(&bytes));
    }
    let _ = lint("");
    let _ = lint("\n\n\n");
    // Deep nesting (the largest script the service accepts is 256 KiB).
    let _ = lint(&"(".repeat(200_000));
    let _ = lint(&format!("{}1{}", "(".repeat(100_000), ")".repeat(100_000)));
    let _ = lint(&format!("{}1{}", "{".repeat(50_000), "}".repeat(50_000)));
    let _ = lint(&"-".repeat(200_000));
}
