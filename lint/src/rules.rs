//! The linters, one function each, named and worded as lintr 3.0.2's
//! default linters (the XPath each one mirrors is lintr's; the comments say
//! where the grammar's tree differs from R's parse data).

use crate::tree::{descendants, operator, r_parent, Pos, Source, Tok};
use crate::StyleNote;
use tree_sitter::Node;

/// Where the rules put their notes.
pub(crate) struct Out {
    pub notes: Vec<StyleNote>,
}

impl Out {
    fn push(&mut self, rule: &str, message: impl Into<String>, at: Pos) {
        self.notes.push(StyleNote {
            rule: rule.to_string(),
            message: message.into(),
            line: at.line,
            column: at.col,
        });
    }
}

fn at(line: u32, col: u32) -> Pos {
    Pos { line, col }
}

/// Low-precedence infix operators (lintr's `infix_metadata$low_precedence`)
/// as the grammar names them.
const INFIX: &[&str] = &[
    "+", "-", "~", ">", ">=", "<", "<=", "==", "!=", "&", "|", "&&", "||", "<-", "<<-", ":=", "->",
    "->>", "=", "special", "/", "*",
];

const LEFT_ASSIGN: &[&str] = &["<-", "<<-", "=", ":="];
const RIGHT_ASSIGN: &[&str] = &["->", "->>"];

/// Whether an operator token is used as an infix operator (binary, or the
/// `=` of an argument or a parameter), not a unary one.
fn is_infix_use(t: &Tok) -> bool {
    let Some(n) = t.node else { return false };
    let Some(p) = n.parent() else { return false };
    match p.kind() {
        "binary_operator" => p.child_by_field_name("operator") == Some(n),
        "argument" | "parameter" => t.kind == "=",
        _ => false,
    }
}

fn field<'t>(n: Node<'t>, name: &str) -> Option<Node<'t>> {
    n.child_by_field_name(name)
}

fn is_child_field(parent: Node, name: &str, child: Node) -> bool {
    field(parent, name) == Some(child)
}

/// The name a call's function is spelled with, when it is a symbol
/// (`f(...)`, `pkg::f(...)`): what R's parse data marks
/// `SYMBOL_FUNCTION_CALL`.
fn call_name<'t>(src: &Source<'t>, call: Node) -> Option<&'t str> {
    let f = field(call, "function")?;
    match f.kind() {
        "identifier" => Some(src.text_of(f)),
        "namespace_operator" => field(f, "rhs")
            .filter(|r| r.kind() == "identifier")
            .map(|r| src.text_of(r)),
        _ => None,
    }
}

/// lintr's `assignment_linter()`.
pub(crate) fn assignment(src: &Source, nodes: &[Node], out: &mut Out) {
    for n in nodes.iter().filter(|n| n.kind() == "binary_operator") {
        let Some(op) = field(*n, "operator") else {
            continue;
        };
        let msg = match op.kind() {
            "=" => "Use <-, not =, for assignment.",
            "->" => "Use <-, not ->, for assignment.",
            "->>" => "->> can have hard-to-predict behavior; prefer assigning to a specific environment instead (with assign() or <-).",
            _ => continue,
        };
        out.push("assignment_linter", msg, src.start(op));
    }
}

/// lintr's `infix_spaces_linter()`.
pub(crate) fn infix_spaces(src: &Source, out: &mut Out) {
    for (i, t) in src.toks.iter().enumerate() {
        if !INFIX.contains(&t.kind) || !is_infix_use(t) {
            continue;
        }
        if t.kind == "/" && inside_box_use(src, t) {
            continue;
        }
        let before = src
            .prev(i, false)
            .is_some_and(|p| p.end.line == t.start.line && t.start.col < p.end.col + 2);
        let after = src
            .next(i, false)
            .is_some_and(|n| n.start.line == t.start.line && n.start.col < t.end.col + 2);
        if before || after {
            out.push(
                "infix_spaces_linter",
                "Put spaces around all infix operators.",
                t.start,
            );
        }
    }
}

/// `box::use(a/b)`: lintr exempts its slashes.
fn inside_box_use(src: &Source, t: &Tok) -> bool {
    let mut n = t.node;
    while let Some(x) = n {
        if x.kind() == "call" {
            if let Some(f) = field(x, "function") {
                if f.kind() == "namespace_operator"
                    && field(f, "lhs").is_some_and(|l| src.text_of(l) == "box")
                    && field(f, "rhs").is_some_and(|r| src.text_of(r) == "use")
                {
                    return true;
                }
            }
        }
        n = x.parent();
    }
    false
}

/// lintr's `commas_linter()`.
pub(crate) fn commas(src: &Source, out: &mut Out) {
    for (i, t) in src.toks.iter().enumerate() {
        if t.kind != "comma" {
            continue;
        }
        if let Some(p) = src.prev(i, false) {
            if p.end.line == t.start.line
                && t.start.col != p.end.col + 1
                && p.kind != "comma"
                && !(p.kind == "="
                    && p.node.and_then(|n| n.parent()).map(|x| x.kind()) == Some("argument"))
            {
                out.push(
                    "commas_linter",
                    "Commas should never have a space before.",
                    at(t.start.line, p.end.col + 1),
                );
            }
        }
        if let Some(n) = src.next(i, false) {
            if n.start.line == t.start.line && n.start.col == t.end.col + 1 {
                out.push(
                    "commas_linter",
                    "Commas should always have a space after.",
                    at(t.start.line, t.end.col + 1),
                );
            }
        }
    }
}

/// lintr's `function_left_parentheses_linter()`.
pub(crate) fn function_left_parentheses(src: &Source, nodes: &[Node], out: &mut Out) {
    let msg = "Remove spaces before the left parenthesis in a function call.";
    for n in nodes {
        let (before, open) = match n.kind() {
            "function_definition" => {
                let Some(kw) = field(*n, "name").filter(|k| k.kind() == "function") else {
                    continue;
                };
                (kw, field(*n, "parameters").and_then(|p| field(p, "open")))
            }
            "call" => {
                let Some(f) = field(*n, "function") else {
                    continue;
                };
                if call_name(src, *n).is_none() {
                    continue;
                }
                (f, field(*n, "arguments").and_then(|a| field(a, "open")))
            }
            _ => continue,
        };
        let Some(open) = open else { continue };
        let e = src.end(before);
        if src.start(open).col != e.col + 1 {
            out.push(
                "function_left_parentheses_linter",
                msg,
                at(e.line, e.col + 1),
            );
        }
    }
}

/// lintr's `spaces_inside_linter()`.
pub(crate) fn spaces_inside(src: &Source, out: &mut Out) {
    for (i, t) in src.toks.iter().enumerate() {
        match t.kind {
            "(" | "[" => {
                let Some(n) = src.next(i, false) else {
                    continue;
                };
                if !n.is_comment() && n.start.line == t.start.line && n.start.col != t.end.col + 1 {
                    let msg = if t.kind == "[" {
                        "Do not place spaces after square brackets."
                    } else {
                        "Do not place spaces after parentheses."
                    };
                    out.push("spaces_inside_linter", msg, at(t.start.line, t.end.col + 1));
                }
            }
            ")" | "]" | "]]" => {
                let Some(p) = src.prev(i, false) else {
                    continue;
                };
                if p.kind != "comma" && p.end.line == t.start.line && t.start.col != p.end.col + 1 {
                    let msg = if t.kind == ")" {
                        "Do not place spaces before parentheses."
                    } else {
                        "Do not place spaces before square brackets."
                    };
                    out.push("spaces_inside_linter", msg, at(t.start.line, p.end.col + 1));
                }
            }
            _ => {}
        }
    }
}

/// lintr's `spaces_left_parentheses_linter()`.
pub(crate) fn spaces_left_parentheses(src: &Source, out: &mut Out) {
    for (i, t) in src.toks.iter().enumerate() {
        if t.kind != "(" {
            continue;
        }
        let Some(parent) = t.node.and_then(|n| n.parent()) else {
            continue;
        };
        let Some(p) = src.prev(i, false) else {
            continue;
        };
        let adjacent = p.end.line == t.start.line && p.end.col + 1 == t.start.col;
        if !adjacent {
            continue;
        }
        let bad = match parent.kind() {
            "if_statement" | "while_statement" | "for_statement" => {
                matches!(p.kind, "if" | "while" | "for")
            }
            "parenthesized_expression" => {
                (INFIX.contains(&p.kind) && is_infix_use(p))
                    || matches!(p.kind, "comma" | "{" | "else" | "in" | ";")
            }
            _ => false,
        };
        if bad {
            out.push(
                "spaces_left_parentheses_linter",
                "Place a space before left parenthesis, except in a function call.",
                t.start,
            );
        }
    }
}

/// lintr's `paren_body_linter()`.
pub(crate) fn paren_body(src: &Source, nodes: &[Node], out: &mut Out) {
    for n in nodes {
        let (close, body) = match n.kind() {
            "function_definition" => (
                field(*n, "parameters").and_then(|p| field(p, "close")),
                field(*n, "body"),
            ),
            "if_statement" => (field(*n, "close"), field(*n, "consequence")),
            "while_statement" | "for_statement" => (field(*n, "close"), field(*n, "body")),
            _ => continue,
        };
        let (Some(close), Some(body)) = (close, body) else {
            continue;
        };
        let c = src.end(close);
        let b = src.start(body);
        // for: lintr compares the body's last line with the `(`'s line.
        let same_line = if n.kind() == "for_statement" {
            field(*n, "open").is_some_and(|o| src.start(o).line == src.end(body).line)
        } else {
            b.line == c.line
        };
        if same_line && b.col == c.col + 1 {
            out.push(
                "paren_body_linter",
                "There should be a space between a right parenthesis and a body expression.",
                b,
            );
        }
    }
}

/// lintr's `equals_na_linter()`.
pub(crate) fn equals_na(src: &Source, nodes: &[Node], out: &mut Out) {
    for n in nodes.iter().filter(|n| n.kind() == "binary_operator") {
        let Some(op) = field(*n, "operator").filter(|o| matches!(o.kind(), "==" | "!=")) else {
            continue;
        };
        let na = |f: &str| field(*n, f).is_some_and(|x| x.kind() == "na");
        if na("lhs") || na("rhs") {
            out.push(
                "equals_na_linter",
                "Use is.na for comparisons to NA (not == or !=)",
                src.start(op),
            );
        }
    }
}

const SEQ_BAD: &[&str] = &["length", "n", "nrow", "ncol", "NROW", "NCOL", "dim"];

/// lintr's `seq_linter()`.
pub(crate) fn seq(src: &Source, nodes: &[Node], out: &mut Out) {
    let bad_call = |x: Node| {
        x.kind() == "call"
            && call_name(src, x).is_some_and(|f| {
                SEQ_BAD.contains(&f)
                    && field(x, "function").is_some_and(|f| f.kind() == "identifier")
            })
    };
    // lintr's `get_fun`: the expression's text with the arguments elided.
    let fun = |x: Node| -> String {
        let s = src.tokens_text(x);
        if s == "n()" {
            return s;
        }
        match (s.find('('), s.rfind(')')) {
            (Some(a), Some(b)) if a < b => format!("{}(...){}", &s[..a], &s[b + 1..]),
            _ => s,
        }
    };
    for n in nodes {
        let (e1, e2) = match n.kind() {
            "binary_operator" if operator(*n) == Some(":") => {
                let (Some(l), Some(r)) = (field(*n, "lhs"), field(*n, "rhs")) else {
                    continue;
                };
                // lintr: one operand is `1`, one is (or directly holds) a
                // call of the bad functions, in either order.
                let one = |x: Node| {
                    matches!(x.kind(), "float" | "integer") && matches!(src.text_of(x), "1" | "1L")
                };
                let bad = |x: Node| {
                    bad_call(x)
                        || (x.kind() == "identifier" && src.text_of(x) == ".N")
                        || direct_exprs(x).into_iter().any(bad_call)
                };
                if !((one(l) || one(r)) && (bad(l) || bad(r))) {
                    continue;
                }
                (fun(l), fun(r))
            }
            "call"
                if call_name(src, *n) == Some("seq")
                    && field(*n, "function").is_some_and(|f| f.kind() == "identifier") =>
            {
                let args: Vec<Node> = field(*n, "arguments")
                    .map(|a| {
                        let mut c = a.walk();
                        a.children_by_field_name("argument", &mut c).collect()
                    })
                    .unwrap_or_default();
                if args.len() != 1 {
                    continue;
                }
                let Some(v) = field(args[0], "value") else {
                    continue;
                };
                if !bad_call(v) {
                    continue;
                }
                ("seq".to_string(), fun(v))
            }
            _ => continue,
        };
        let along = e1.contains("length(") || e2.contains("length(");
        let (repl, e3) = if along {
            ("seq_along", "...".to_string())
        } else {
            ("seq_len", e2.clone())
        };
        let msg = if e1.contains("seq") {
            format!("{e1}({e2}) is likely to be wrong in the empty edge case. Use {repl}({e3}) instead.")
        } else {
            format!(
                "{e1}:{e2} is likely to be wrong in the empty edge case. Use {repl}({e3}) instead."
            )
        };
        out.push("seq_linter", msg, src.start(*n));
    }
}

/// The expressions directly inside `n` in R's parse data (its children,
/// looking through the grammar's argument wrappers).
fn direct_exprs(n: Node) -> Vec<Node> {
    let mut out = Vec::new();
    let mut c = n.walk();
    for k in n.children(&mut c) {
        if k.kind() == "arguments" {
            let mut c2 = k.walk();
            for a in k.children_by_field_name("argument", &mut c2) {
                if let Some(v) = field(a, "value") {
                    out.push(v);
                }
            }
        } else if k.is_named() {
            out.push(k);
        }
    }
    out
}

/// lintr's `T_and_F_symbol_linter()`.
pub(crate) fn t_and_f(src: &Source, out: &mut Out) {
    for t in &src.toks {
        if t.kind != "identifier" {
            continue;
        }
        let name = src.tok_text(t);
        if name != "T" && name != "F" {
            continue;
        }
        let Some(n) = t.node else { continue };
        if !is_plain_symbol(n) {
            continue;
        }
        let long = if name == "T" { "TRUE" } else { "FALSE" };
        let msg = if is_assign_target(n) {
            format!("Don't use {name} as a variable name, as it can break code relying on {name} being {long}.")
        } else {
            format!("Use {long} instead of the symbol {name}.")
        };
        out.push("T_and_F_symbol_linter", msg, at(t.end.line, t.end.col + 1));
    }
}

/// Whether an identifier is a `SYMBOL` in R's parse data: not a called
/// function, an argument or parameter name, a package, or after `$`/`@`.
fn is_plain_symbol(n: Node) -> bool {
    let Some(p) = n.parent() else { return true };
    match p.kind() {
        "call" | "subset" | "subset2" => !(p.kind() == "call" && is_child_field(p, "function", n)),
        "extract_operator" => !is_child_field(p, "rhs", n),
        "namespace_operator" => {
            is_child_field(p, "rhs", n)
                && !p
                    .parent()
                    .is_some_and(|g| g.kind() == "call" && is_child_field(g, "function", p))
        }
        "argument" | "parameter" => !is_child_field(p, "name", n),
        _ => true,
    }
}

/// Whether `n` is directly what an assignment assigns to.
fn is_assign_target(n: Node) -> bool {
    let Some(p) = n.parent() else { return false };
    if p.kind() != "binary_operator" {
        return false;
    }
    match operator(p) {
        Some(op) if LEFT_ASSIGN.contains(&op) => is_child_field(p, "lhs", n),
        Some(op) if RIGHT_ASSIGN.contains(&op) => is_child_field(p, "rhs", n),
        _ => false,
    }
}

/// lintr's `single_quotes_linter()`.
pub(crate) fn single_quotes(src: &Source, out: &mut Out) {
    for t in src.toks.iter().filter(|t| t.kind == "string") {
        let s = src.tok_text(t);
        let body = s.strip_prefix(['r', 'R']).unwrap_or(s);
        if body.len() >= 2 && body.starts_with('\'') && body.ends_with('\'') && !body.contains('"')
        {
            out.push("single_quotes_linter", "Only use double-quotes.", t.start);
        }
    }
}

/// lintr's `semicolon_linter()`.
pub(crate) fn semicolon(src: &Source, out: &mut Out) {
    for (i, t) in src.toks.iter().enumerate() {
        if t.kind != ";" {
            continue;
        }
        let compound = src
            .next(i, false)
            .is_some_and(|n| n.start.line == t.start.line);
        let msg = if compound {
            "Compound semicolons are discouraged. Replace them by a newline."
        } else {
            "Trailing semicolons are not needed."
        };
        out.push("semicolon_linter", msg, t.start);
    }
}

/// lintr's `line_length_linter()` (80 characters).
pub(crate) fn line_length(src: &Source, out: &mut Out) {
    for (i, l) in src.lines.iter().enumerate() {
        if l.len() > 80 && l.chars().count() > 80 {
            out.push(
                "line_length_linter",
                "Lines should not be more than 80 characters.",
                at(i as u32 + 1, 81),
            );
        }
    }
}

/// lintr's `trailing_whitespace_linter()`.
pub(crate) fn trailing_whitespace(src: &Source, out: &mut Out) {
    // lintr: a line is exempt when a string starts on or before it and ends
    // after it (start_line <= line < end_line).
    let mut exempt = vec![false; src.lines.len() + 2];
    for t in src.toks.iter().filter(|t| t.kind == "string") {
        for l in t.start.line..t.end.line {
            if let Some(x) = exempt.get_mut(l as usize) {
                *x = true;
            }
        }
    }
    for (i, l) in src.lines.iter().enumerate() {
        let trimmed = l.trim_end_matches([' ', '\t']);
        if trimmed.len() == l.len() {
            continue;
        }
        if exempt[i + 1] {
            continue;
        }
        out.push(
            "trailing_whitespace_linter",
            "Trailing whitespace is superfluous.",
            at(i as u32 + 1, trimmed.chars().count() as u32 + 1),
        );
    }
}

/// lintr's `trailing_blank_lines_linter()`.
pub(crate) fn trailing_blank_lines(src: &Source, out: &mut Out) {
    let mut n = src.lines.len();
    let mut found = Vec::new();
    while n > 0 && src.lines[n - 1].trim().is_empty() {
        found.push(n);
        n -= 1;
    }
    for l in found.into_iter().rev() {
        out.push(
            "trailing_blank_lines_linter",
            "Trailing blank lines are superfluous.",
            at(l as u32, 1),
        );
    }
    if !src.text.is_empty() && !src.text.ends_with('\n') {
        let last = src.lines.last().copied().unwrap_or("");
        out.push(
            "trailing_blank_lines_linter",
            "Missing terminal newline.",
            at(src.lines.len() as u32, last.chars().count() as u32 + 1),
        );
    }
}

/// lintr's `no_tab_linter()`.
pub(crate) fn no_tab(src: &Source, in_string: &[bool], out: &mut Out) {
    for (i, l) in src.lines.iter().enumerate() {
        let lead: &str = &l[..l.len() - l.trim_start().len()];
        if !lead.contains('\t') || in_string.get(i + 1).copied().unwrap_or(false) {
            continue;
        }
        out.push(
            "no_tab_linter",
            "Use spaces to indent, not tabs.",
            at(i as u32 + 1, 1),
        );
    }
}

/// lintr's `commented_code_linter()`.
pub(crate) fn commented_code(src: &Source, out: &mut Out) {
    for t in src.toks.iter().filter(|t| t.is_comment()) {
        let text = src.tok_text(t);
        let rest = text.trim_start_matches('#');
        let code = rest.trim_start();
        if code.is_empty() || !looks_like_code(code) {
            continue;
        }
        let offset = text.len() - code.len();
        let mut candidate = code.trim_end();
        candidate = candidate.strip_suffix(',').unwrap_or(candidate);
        let candidate = candidate
            .trim_start()
            .strip_prefix(',')
            .unwrap_or(candidate);
        if !parsable(candidate) {
            continue;
        }
        let col = t.start.col + text[..offset].chars().count() as u32;
        out.push(
            "commented_code_linter",
            "Commented code should be removed.",
            at(t.start.line, col),
        );
    }
}

/// lintr's code-candidate test: brackets, an operator, `x(...)` or `!x`.
fn looks_like_code(code: &str) -> bool {
    let b = code.as_bytes();
    if code.contains([
        '{', '}', '[', ']', '+', '=', '<', '>', '/', '^', '*', '|', '&',
    ]) || code.contains("%%")
        || code.contains("->")
    {
        return true;
    }
    for i in 0..b.len() {
        if b[i] == b'(' && i > 0 && b[i - 1].is_ascii_graphic() && code[i..].contains(')') {
            return true;
        }
        if b[i] == b'!' && b.get(i + 1).is_some_and(|c| c.is_ascii_alphabetic()) {
            return true;
        }
    }
    false
}

/// Whether `code` parses as R: the grammar finds no error, and no two
/// expressions share a line without a `;` between them (the grammar accepts
/// `a b`; R does not).
fn parsable(code: &str) -> bool {
    let Some(t) = crate::tree::parse(code) else {
        return false;
    };
    if t.root_node().has_error() {
        return false;
    }
    let src = Source::new(code, &t);
    src.separated()
}

/// lintr's `vector_logic_linter()`.
pub(crate) fn vector_logic(src: &Source, nodes: &[Node], out: &mut Out) {
    for n in nodes.iter().filter(|n| n.kind() == "binary_operator") {
        let Some(op) = field(*n, "operator").filter(|o| matches!(o.kind(), "&" | "|")) else {
            continue;
        };
        let mut in_cond = false;
        let mut excluded = false;
        let mut x = *n;
        while let Some(p) = x.parent() {
            match p.kind() {
                "if_statement" | "while_statement" if is_child_field(p, "condition", x) => {
                    in_cond = true
                }
                "argument" if is_child_field(p, "value", x) => {
                    let call = p.parent().and_then(|a| a.parent());
                    if let Some(c) = call {
                        match c.kind() {
                            "call" => match call_name(src, c) {
                                Some("expect_true" | "expect_false") => in_cond = true,
                                Some(_) => excluded = true,
                                None => {}
                            },
                            "subset" => excluded = true,
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
            x = p;
        }
        if in_cond && !excluded {
            out.push(
                "vector_logic_linter",
                "Conditional expressions require scalar logical operators (&& and ||)",
                src.start(op),
            );
        }
    }
}

/// lintr's `pipe_continuation_linter()`.
pub(crate) fn pipe_continuation(src: &Source, nodes: &[Node], out: &mut Out) {
    let is_pipe = |x: Node| x.kind() == "special" && src.text_of(x) == "%>%";
    for n in nodes.iter().filter(|n| n.kind() == "binary_operator") {
        let Some(op) = field(*n, "operator").filter(|o| is_pipe(*o)) else {
            continue;
        };
        let (Some(l), Some(r)) = (field(*n, "lhs"), field(*n, "rhs")) else {
            continue;
        };
        if src.start(*n).line == src.end(*n).line {
            continue;
        }
        let pipes: Vec<Node> = descendants(l).into_iter().filter(|x| is_pipe(*x)).collect();
        if pipes.is_empty() {
            continue;
        }
        let line = src.start(op).line;
        if src.end(l).line == src.start(r).line || pipes.iter().any(|p| src.start(*p).line == line)
        {
            out.push(
                "pipe_continuation_linter",
                "`%>%` should always have a space before it and a new line after it, unless the full pipeline fits on one line.",
                src.start(op),
            );
        }
    }
}

/// lintr's `brace_linter()`.
pub(crate) fn brace(src: &Source, nodes: &[Node], out: &mut Out) {
    for n in nodes {
        match n.kind() {
            "braced_expression" => brace_block(src, *n, out),
            "if_statement" => brace_if(src, *n, out),
            "function_definition" => {
                let multi = src.start(*n).line != src.end(*n).line;
                let is_fn = field(*n, "name").is_some_and(|k| k.kind() == "function");
                let braced = field(*n, "body").is_some_and(|b| b.kind() == "braced_expression");
                if multi && is_fn && !braced {
                    out.push(
                        "brace_linter",
                        "Any function spanning multiple lines should use curly braces.",
                        src.start(*n),
                    );
                }
            }
            _ => {}
        }
    }
}

fn brace_block(src: &Source, b: Node, out: &mut Out) {
    let (Some(open), Some(close)) = (field(b, "open"), field(b, "close")) else {
        return;
    };
    if close.is_missing() {
        return;
    }
    let oi = src.tok_at(open.start_byte());
    let ci = src.tok_at(close.start_byte());
    let o = src.start(open);
    let c = src.start(close);
    let parent = r_parent(b);
    let inside = |t: &Tok| {
        parent.is_some_and(|p| {
            p.kind() != "program" && t.bytes.0 >= p.start_byte() && t.bytes.1 <= p.end_byte()
        })
    };
    let prev = src.prev(oi, false).filter(|t| inside(t)).copied();
    let prev_code = src.prev(oi, true).filter(|t| inside(t)).copied();
    let statements: Vec<Node> = {
        let mut cur = b.walk();
        b.children_by_field_name("body", &mut cur).collect()
    };
    let outer_block = parent.filter(|p| p.kind() == "braced_expression");

    // Opening brace.
    let nested_same_line = outer_block
        .and_then(|p| field(p, "open"))
        .is_some_and(|po| src.start(po).line == o.line)
        || statements.iter().any(|s| {
            s.kind() == "braced_expression"
                && field(*s, "open").is_some_and(|so| src.start(so).line == o.line)
        });
    let after_open_paren = prev_code.is_some_and(|p| {
        (p.kind == "(" || p.kind == "comma" || (p.kind == "special" && src.tok_text(&p) == "%>%"))
            && o.line > p.end.line
    });
    let next = src.next(oi, false);
    let own_line = prev.is_none_or(|p| p.end.line != o.line);
    let followed = next.is_some_and(|t| !t.is_comment() && t.start.line == o.line);
    if !nested_same_line && !after_open_paren && (own_line || followed) {
        out.push(
            "brace_linter",
            "Opening curly braces should never go on their own line and should always be followed by a new line.",
            o,
        );
    }
    if let Some(p) = src.prev(oi, false) {
        let for_paren = p.kind == ")"
            && p.node
                .and_then(|x| x.parent())
                .is_some_and(|x| x.kind() == "for_statement");
        if matches!(p.kind, ")" | "else" | "repeat")
            && !for_paren
            && inside(p)
            && p.end.line == o.line
            && o.col == p.end.col + 1
        {
            out.push(
                "brace_linter",
                "There should be a space before an opening curly brace.",
                o,
            );
        }
    }

    // Closing brace.
    let next_code = src.next(ci, true);
    // lintr: some enclosing expression is followed, on this line, by `,`,
    // `]` or `)`.
    let mut before_closer = false;
    let mut anc = Some(b);
    while let Some(a) = anc {
        if a.kind() == "program" {
            break;
        }
        if !crate::tree::is_wrapper(a.kind()) {
            let after = src.tok_at(a.end_byte());
            if src.toks.get(after).is_some_and(|t| {
                matches!(t.kind, "comma" | "]" | "]]" | ")") && t.start.line == c.line
            }) {
                before_closer = true;
                break;
            }
        }
        anc = a.parent();
    }
    let nested_close = outer_block
        .and_then(|p| field(p, "close"))
        .is_some_and(|pc| !pc.is_missing() && src.start(pc).line == c.line)
        || statements.iter().any(|s| {
            s.kind() == "braced_expression"
                && field(*s, "close").is_some_and(|sc| src.start(sc).line == c.line)
        });
    let after_something = src.prev(ci, false).is_some_and(|p| p.end.line == c.line);
    let followed_same_line = next_code.is_some_and(|t| {
        inside(t) && t.kind != "else" && t.start.line == c.line && t.bytes.0 >= close.end_byte()
    });
    if !before_closer && !nested_close && (after_something || followed_same_line) {
        out.push(
            "brace_linter",
            "Closing curly-braces should always be on their own line, unless they are followed by an else.",
            c,
        );
    }
}

fn brace_if(src: &Source, n: Node, out: &mut Out) {
    let cons = field(n, "consequence");
    let alt = field(n, "alternative");
    let braced = |x: Option<Node>| x.is_some_and(|x| x.kind() == "braced_expression");
    let mut c = n.walk();
    let else_kw = n.children(&mut c).find(|k| k.kind() == "else");
    if let (Some(e), Some(cons)) = (else_kw, cons) {
        if cons.kind() == "braced_expression" && src.start(e).line != src.end(cons).line {
            out.push(
                "brace_linter",
                "`else` should come on the same line as the previous `}`.",
                src.start(e),
            );
        }
    }
    let Some(e) = else_kw else { return };
    let msg = "Either both or neither branch in `if`/`else` should use curly braces.";
    let alt_ok = braced(alt)
        || alt.is_some_and(|a| a.kind() == "if_statement" && braced(field(a, "consequence")));
    if braced(cons) && !alt_ok {
        if let Some(kw) = n.child(0) {
            out.push("brace_linter", msg, src.start(kw));
        }
    }
    if braced(alt) && !braced(cons) {
        out.push("brace_linter", msg, src.start(e));
    }
}

/// R's functions that start with `.` and are exempt from naming styles
/// (lintr's `special_funs`, after the leading dot is stripped).
const SPECIAL_FUNS: &[&str] = &[
    "onLoad", "onAttach", "onUnload", "onDetach", "Last.lib", "First", "Last",
];

/// The names a script assigns to, and the parameters of its functions
/// (lintr's `object_name_xpath`).
fn assigned_names<'t>(nodes: &[Node<'t>]) -> Vec<Node<'t>> {
    let mut found = Vec::new();
    let mut formals = Vec::new();
    for n in nodes {
        match n.kind() {
            "binary_operator" => {
                let target = match operator(*n) {
                    Some(op) if LEFT_ASSIGN.contains(&op) => field(*n, "lhs"),
                    Some(op) if RIGHT_ASSIGN.contains(&op) => field(*n, "rhs"),
                    _ => None,
                };
                if let Some(t) = target {
                    target_names(t, &mut found);
                }
            }
            "parameter" => formals.extend(field(*n, "name")),
            _ => {}
        }
    }
    found.retain(|n| !inside_subscript(*n));
    found.extend(formals);
    found.sort_by_key(|n| n.start_byte());
    found.dedup_by_key(|n| n.start_byte());
    found
}

/// Whether `n` is inside the brackets of `x[...]` or `x[[...]]`.
fn inside_subscript(n: Node) -> bool {
    let mut x = n;
    while let Some(p) = x.parent() {
        if p.kind() == "arguments"
            && p.parent()
                .is_some_and(|g| matches!(g.kind(), "subset" | "subset2"))
        {
            return true;
        }
        x = p;
    }
    false
}

fn target_names<'t>(root: Node<'t>, found: &mut Vec<Node<'t>>) {
    let mut stack = vec![root];
    while let Some(n) = stack.pop() {
        match n.kind() {
            "identifier" => {
                if is_plain_symbol(n) {
                    found.push(n);
                }
            }
            "string" => {
                if !n
                    .parent()
                    .is_some_and(|p| p.kind() == "extract_operator" && is_child_field(p, "rhs", n))
                {
                    found.push(n);
                }
            }
            "subset" | "subset2" => stack.extend(field(n, "function")),
            _ => {
                let mut c = n.walk();
                stack.extend(n.children(&mut c));
            }
        }
    }
}

/// lintr's `strip_names()`.
fn strip_name(s: &str) -> &str {
    let s = s.trim_start_matches(['.', '"', '\'', '`', '%', '$', '@']);
    s.trim_end_matches(['"', '\'', '`', '<', '-', '%', '$', '@'])
}

/// Top-level `name <- function(...) ... UseMethod(...)`: S3 generics the
/// script declares (lintr's `declared_s3_generics()`).
fn declared_generics<'t>(src: &Source<'t>) -> Vec<&'t str> {
    let mut out = Vec::new();
    let mut c = src.root.walk();
    for n in src.root.children(&mut c) {
        if n.kind() != "binary_operator" || !matches!(operator(n), Some("<-" | "<<-" | "=" | ":="))
        {
            continue;
        }
        let (Some(l), Some(r)) = (field(n, "lhs"), field(n, "rhs")) else {
            continue;
        };
        if l.kind() != "identifier" || r.kind() != "function_definition" {
            continue;
        }
        let uses = descendants(n)
            .into_iter()
            .any(|x| x.kind() == "call" && call_name(src, x) == Some("UseMethod"));
        if uses {
            out.push(src.text_of(l));
        }
    }
    out
}

fn snake_case(s: &str) -> bool {
    let s = s.strip_prefix('.').unwrap_or(s);
    let lower_digit = |c: char| c.is_lowercase() || c.is_ascii_digit();
    let mut chars = s.chars();
    match chars.next() {
        Some(c) if lower_digit(c) => {}
        _ => return false,
    }
    chars.all(|c| lower_digit(c) || c == '_')
}

fn symbols_only(s: &str) -> bool {
    s.chars().all(|c| !c.is_alphanumeric())
}

/// lintr's `object_name_linter()` (snake_case or symbols) and
/// `object_length_linter()` (30 characters).
pub(crate) fn object_names(src: &Source, nodes: &[Node], out: &mut Out) {
    let names = assigned_names(nodes);
    if names.is_empty() {
        return;
    }
    let declared = declared_generics(src);
    let generics: Vec<&str> = declared
        .iter()
        .copied()
        .chain(crate::generics::BASE_S3_GENERICS.iter().copied())
        .map(strip_name)
        .filter(|g| !g.is_empty())
        .collect();
    let generic_prefix = |name: &str| -> Option<usize> {
        generics.iter().find_map(|g| {
            name.strip_prefix(g)
                .filter(|rest| rest.starts_with('.'))
                .map(|_| g.len() + 1)
        })
    };
    for n in names {
        let name = strip_name(src.text_of(n));
        let pos = src.start(n);
        let conforming = name.is_empty()
            || snake_case(name)
            || symbols_only(name)
            || generic_prefix(name).is_some_and(|p| p < name.len())
            || SPECIAL_FUNS.contains(&name);
        if !conforming {
            out.push(
                "object_name_linter",
                "Variable and function name style should be snake_case or symbols.",
                pos,
            );
        }
        let stripped = match generic_prefix(name) {
            Some(p) => &name[p..],
            None => name,
        };
        if stripped.chars().count() > 30 {
            out.push(
                "object_length_linter",
                "Variable and function names should not be longer than 30 characters.",
                pos,
            );
        }
    }
}
