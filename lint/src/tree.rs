//! The parsed script as the rules see it: the tree-sitter tree, its tokens
//! in source order with R-style positions (1-based lines, 1-based character
//! columns, inclusive end column like `getParseData()`'s `col2`), the
//! semicolons the grammar hides, and the file's lines.

use tree_sitter::{Node, Parser, Tree};

/// A position: 1-based line, 1-based character column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Pos {
    pub line: u32,
    pub col: u32,
}

/// One token: a leaf of the tree (strings, numbers, comments and `NA_*`
/// count as one token each), or a semicolon.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tok<'t> {
    /// The node's kind (`identifier`, `(`, `comma`, `<-`, ...), or `;`.
    pub kind: &'static str,
    /// First character.
    pub start: Pos,
    /// Last character (inclusive, like R's `col2`).
    pub end: Pos,
    /// Byte range in the source.
    pub bytes: (usize, usize),
    /// The node (none for a semicolon).
    pub node: Option<Node<'t>>,
}

impl Tok<'_> {
    /// Whether this is a comment.
    pub fn is_comment(&self) -> bool {
        self.kind == "comment"
    }
}

/// A parsed script.
pub(crate) struct Source<'t> {
    pub text: &'t str,
    /// The file's lines as R's `readLines()` gives them (no terminators;
    /// no empty last line for a terminating newline).
    pub lines: Vec<&'t str>,
    /// Byte offset of each line's start.
    line_starts: Vec<usize>,
    /// Whether each line is ASCII (then byte columns are character columns).
    ascii: Vec<bool>,
    pub root: Node<'t>,
    pub toks: Vec<Tok<'t>>,
}

/// Node kinds that are one token although the grammar gives them children.
const ATOMS: &[&str] = &[
    "string",
    "comment",
    "integer",
    "float",
    "complex",
    "na",
    "dots",
    "dot_dot_i",
    "identifier",
    "special",
];

/// Parses `text`; `None` only if tree-sitter gives up (it does not on
/// ordinary input; a timeout or cancellation would).
pub(crate) fn parse(text: &str) -> Option<Tree> {
    let mut parser = Parser::new();
    parser.set_language(&tree_sitter_r::LANGUAGE.into()).ok()?;
    parser.parse(text, None)
}

impl<'t> Source<'t> {
    /// Builds the token view of `tree` over `text`.
    pub fn new(text: &'t str, tree: &'t Tree) -> Self {
        let mut line_starts = vec![0];
        for (i, b) in text.bytes().enumerate() {
            if b == b'\n' {
                line_starts.push(i + 1);
            }
        }
        let mut lines: Vec<&str> = text
            .split('\n')
            .map(|l| l.strip_suffix('\r').unwrap_or(l))
            .collect();
        if text.ends_with('\n') || text.is_empty() {
            lines.pop();
        }
        let ascii = line_starts
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let e = line_starts.get(i + 1).copied().unwrap_or(text.len());
                text.as_bytes()[s..e].is_ascii()
            })
            .collect();
        let mut src = Source {
            text,
            lines,
            line_starts,
            ascii,
            root: tree.root_node(),
            toks: Vec::new(),
        };
        let mut toks = Vec::new();
        src.collect(tree.root_node(), &mut toks);
        // Semicolons are hidden by the grammar: find them between tokens.
        let mut with_semis = Vec::with_capacity(toks.len());
        let mut at = 0usize;
        for t in toks {
            src.semicolons(at, t.bytes.0, &mut with_semis);
            at = t.bytes.1;
            with_semis.push(t);
        }
        src.semicolons(at, text.len(), &mut with_semis);
        src.toks = with_semis;
        src
    }

    fn semicolons(&self, from: usize, to: usize, out: &mut Vec<Tok<'t>>) {
        if from >= to {
            return;
        }
        for (i, b) in self.text.as_bytes()[from..to].iter().enumerate() {
            if *b == b';' {
                let p = self.pos_of_byte(from + i);
                out.push(Tok {
                    kind: ";",
                    start: p,
                    end: p,
                    bytes: (from + i, from + i + 1),
                    node: None,
                });
            }
        }
    }

    /// The tokens under `root`, in source order (iterative: deep nesting
    /// must not exhaust the stack).
    fn collect(&self, root: Node<'t>, out: &mut Vec<Tok<'t>>) {
        let mut stack = vec![root];
        while let Some(node) = stack.pop() {
            if node.is_missing() {
                continue;
            }
            if node.child_count() == 0 || ATOMS.contains(&node.kind()) {
                if node.start_byte() == node.end_byte() {
                    continue;
                }
                let start = self.pos_of_byte(node.start_byte());
                let last = self.last_char_start(node.end_byte());
                out.push(Tok {
                    kind: node.kind(),
                    start,
                    end: self.pos_of_byte(last),
                    bytes: (node.start_byte(), node.end_byte()),
                    node: Some(node),
                });
                continue;
            }
            let mut c = node.walk();
            let kids: Vec<Node<'t>> = node.children(&mut c).collect();
            stack.extend(kids.into_iter().rev());
        }
    }

    /// The byte where the character ending at `end` (exclusive) starts.
    fn last_char_start(&self, end: usize) -> usize {
        let mut i = end.saturating_sub(1);
        while i > 0 && !self.text.is_char_boundary(i) {
            i -= 1;
        }
        i
    }

    /// The position of the character at byte `b`.
    pub fn pos_of_byte(&self, b: usize) -> Pos {
        let line = match self.line_starts.binary_search(&b) {
            Ok(i) => i,
            Err(i) => i.saturating_sub(1),
        };
        let start = self.line_starts[line];
        let col = if self.ascii[line] {
            b - start
        } else {
            let mut e = b.min(self.text.len());
            while e > start && !self.text.is_char_boundary(e) {
                e -= 1;
            }
            self.text[start..e].chars().count()
        };
        Pos {
            line: line as u32 + 1,
            col: col as u32 + 1,
        }
    }

    /// A node's first position.
    pub fn start(&self, n: Node) -> Pos {
        self.pos_of_byte(n.start_byte())
    }

    /// A node's last character's position.
    pub fn end(&self, n: Node) -> Pos {
        if n.end_byte() <= n.start_byte() {
            return self.start(n);
        }
        self.pos_of_byte(self.last_char_start(n.end_byte()))
    }

    /// The source text of a node.
    pub fn text_of(&self, n: Node) -> &'t str {
        self.text.get(n.start_byte()..n.end_byte()).unwrap_or("")
    }

    /// The source text of a token.
    pub fn tok_text(&self, t: &Tok) -> &'t str {
        self.text.get(t.bytes.0..t.bytes.1).unwrap_or("")
    }

    /// Index of the first token at or after byte `b`.
    pub fn tok_at(&self, b: usize) -> usize {
        self.toks.partition_point(|t| t.bytes.0 < b)
    }

    /// The node's tokens concatenated without whitespace (what lintr's
    /// XPath `string()` of an `expr` gives).
    pub fn tokens_text(&self, n: Node) -> String {
        let from = self.tok_at(n.start_byte());
        let mut s = String::new();
        for t in &self.toks[from..] {
            if t.bytes.0 >= n.end_byte() {
                break;
            }
            if !t.is_comment() {
                s.push_str(self.tok_text(t));
            }
        }
        s
    }

    /// The previous token before index `i`, optionally skipping comments.
    pub fn prev(&self, i: usize, skip_comments: bool) -> Option<&Tok<'t>> {
        self.toks[..i]
            .iter()
            .rev()
            .find(|t| !(skip_comments && t.is_comment()))
    }

    /// The next token after index `i`, optionally skipping comments.
    pub fn next(&self, i: usize, skip_comments: bool) -> Option<&Tok<'t>> {
        self.toks
            .get(i + 1..)?
            .iter()
            .find(|t| !(skip_comments && t.is_comment()))
    }
}

impl Source<'_> {
    /// Whether every two expressions in a sequence (the script, a `{}`
    /// block) are on different lines or have a `;` between them, as R's
    /// grammar requires and tree-sitter's does not.
    pub fn separated(&self) -> bool {
        for n in descendants(self.root) {
            if !matches!(n.kind(), "program" | "braced_expression") {
                continue;
            }
            let mut c = n.walk();
            let kids: Vec<Node> = n
                .named_children(&mut c)
                .filter(|k| k.kind() != "comment")
                .collect();
            for w in kids.windows(2) {
                let (a, b) = (w[0], w[1]);
                if self.end(a).line != self.start(b).line {
                    continue;
                }
                let gap = self.text.get(a.end_byte()..b.start_byte()).unwrap_or("");
                if !gap.contains(';') {
                    return false;
                }
            }
        }
        true
    }
}

/// Kind of the operator child of a binary or unary operator node.
pub(crate) fn operator(n: Node) -> Option<&'static str> {
    n.child_by_field_name("operator").map(|o| o.kind())
}

/// Whether a node is an expression that lintr sees as `expr` (not a token,
/// comment, or the argument/parameter wrappers the grammar adds).
pub(crate) fn is_wrapper(kind: &str) -> bool {
    matches!(kind, "argument" | "arguments" | "parameter" | "parameters")
}

/// The nearest ancestor that is an `expr` in R's parse data terms (skips the
/// grammar's argument and parameter wrappers).
pub(crate) fn r_parent(n: Node) -> Option<Node> {
    let mut p = n.parent()?;
    while is_wrapper(p.kind()) {
        p = p.parent()?;
    }
    Some(p)
}

/// All descendants of `n` (including `n`), depth first.
pub(crate) fn descendants(n: Node) -> Vec<Node> {
    let mut out = Vec::new();
    let mut stack = vec![n];
    while let Some(x) = stack.pop() {
        out.push(x);
        let mut c = x.walk();
        let kids: Vec<Node> = x.children(&mut c).collect();
        stack.extend(kids.into_iter().rev());
    }
    out
}
