//! lintr's default linters, statically in Rust on the `tree-sitter-r`
//! grammar: style notes for a 100-line script in about a millisecond,
//! where lintr itself takes one to two seconds.
//!
//! [`lint`] gives [`StyleNote`]s whose `rule` is lintr's linter name
//! (`assignment_linter`, ...), whose `message` is lintr's message text, and
//! whose `line` and `column` are 1-based like lintr's (columns count
//! characters). The reference is lintr 3.0.2's `linters_with_defaults()`;
//! `tests/lintr_agreement.rs` runs both over a corpus and reports per-rule
//! precision and recall.
//!
//! # Covered (lintr 3.0.2 defaults)
//!
//! `assignment_linter`, `brace_linter`, `commas_linter`,
//! `commented_code_linter`, `equals_na_linter`,
//! `function_left_parentheses_linter`, `infix_spaces_linter`,
//! `line_length_linter` (80), `no_tab_linter`, `object_length_linter` (30),
//! `object_name_linter` (snake_case or symbols), `paren_body_linter`,
//! `pipe_continuation_linter`, `semicolon_linter`, `seq_linter`,
//! `single_quotes_linter`, `spaces_inside_linter`,
//! `spaces_left_parentheses_linter`, `T_and_F_symbol_linter`,
//! `trailing_blank_lines_linter`, `trailing_whitespace_linter`,
//! `vector_logic_linter`.
//!
//! # Not covered, and why
//!
//! - `object_usage_linter`: it evaluates each function definition and runs
//!   `codetools::checkUsage` against the attached packages and the global
//!   environment (undefined globals, unused locals, wrong argument names).
//!   Which names exist depends on what is installed and loaded at run time,
//!   so it cannot be answered from the text alone.
//! - `cyclocomp_linter`: the `cyclocomp` package's complexity of the control
//!   flow graph R builds from the expression (limit 15). Not ported; it
//!   fires rarely in scripts (one expression with more than 15 branches).
//! - `commented_code_linter` decides "is this comment parsable R" with the
//!   grammar, not with R's `parse()`; the two disagree on a few odd inputs.
//! - With a syntax error the grammar's tree is unreliable, so only the
//!   line-based rules run (line length, tabs, trailing whitespace and blank
//!   lines); lintr gives up on the expression-level linters too. Syntax
//!   errors themselves are R's parser's to report.
//! - Per-line and per-file `# nolint` comments, `.lintr` settings and
//!   linter arguments other than the defaults are not read.
//!
//! Never panics on any input; no unsafe code.

mod generics;
mod rules;
mod tree;

/// The crate's version, as `style_engine` reports it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// What the validation answer's `style_engine` says for this engine:
/// `rvisor-lint <version>`.
pub fn engine() -> String {
    format!("rvisor-lint {VERSION}")
}

/// One style note, as lintr would give it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StyleNote {
    /// 1-based line.
    pub line: u32,
    /// 1-based column, in characters.
    pub column: u32,
    /// lintr's linter name, e.g. `assignment_linter`.
    pub rule: String,
    /// lintr's message text.
    pub message: String,
}

/// The linter names this crate implements (lintr's names).
pub const RULES: &[&str] = &[
    "assignment_linter",
    "brace_linter",
    "commas_linter",
    "commented_code_linter",
    "equals_na_linter",
    "function_left_parentheses_linter",
    "infix_spaces_linter",
    "line_length_linter",
    "no_tab_linter",
    "object_length_linter",
    "object_name_linter",
    "paren_body_linter",
    "pipe_continuation_linter",
    "semicolon_linter",
    "seq_linter",
    "single_quotes_linter",
    "spaces_inside_linter",
    "spaces_left_parentheses_linter",
    "T_and_F_symbol_linter",
    "trailing_blank_lines_linter",
    "trailing_whitespace_linter",
    "vector_logic_linter",
];

/// Style notes for an R script, sorted by line, column and rule.
pub fn lint(source: &str) -> Vec<StyleNote> {
    let mut out = rules::Out { notes: Vec::new() };
    let Some(parsed) = tree::parse(source) else {
        return out.notes;
    };
    let src = tree::Source::new(source, &parsed);
    let in_string = rules_string_lines(&src);
    rules::line_length(&src, &mut out);
    rules::trailing_whitespace(&src, &mut out);
    rules::trailing_blank_lines(&src, &mut out);
    rules::no_tab(&src, &in_string, &mut out);
    if !src.root.has_error() && src.separated() {
        let nodes = tree::descendants(src.root);
        rules::assignment(&src, &nodes, &mut out);
        rules::brace(&src, &nodes, &mut out);
        rules::commas(&src, &mut out);
        rules::commented_code(&src, &mut out);
        rules::equals_na(&src, &nodes, &mut out);
        rules::function_left_parentheses(&src, &nodes, &mut out);
        rules::infix_spaces(&src, &mut out);
        rules::object_names(&src, &nodes, &mut out);
        rules::paren_body(&src, &nodes, &mut out);
        rules::pipe_continuation(&src, &nodes, &mut out);
        rules::semicolon(&src, &mut out);
        rules::seq(&src, &nodes, &mut out);
        rules::single_quotes(&src, &mut out);
        rules::spaces_inside(&src, &mut out);
        rules::spaces_left_parentheses(&src, &mut out);
        rules::t_and_f(&src, &mut out);
        rules::vector_logic(&src, &nodes, &mut out);
    }
    let mut notes = out.notes;
    notes.sort();
    notes.dedup();
    notes
}

fn rules_string_lines(src: &tree::Source) -> Vec<bool> {
    let mut inside = vec![false; src.lines.len() + 2];
    for t in src.toks.iter().filter(|t| t.kind == "string") {
        for l in t.start.line + 1..=t.end.line {
            if let Some(x) = inside.get_mut(l as usize) {
                *x = true;
            }
        }
    }
    inside
}

#[cfg(test)]
mod tests;
