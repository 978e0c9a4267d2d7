//! The HTML and Markdown of a table and its JSON preview, written in Rust
//! from cells the driver has formatted (`driver_display.R`:
//! `table_markup`, `preview_json`). R formats each shown cell as repr
//! does (`format()` per column part), which decides what a cell says; the
//! escaping and the joining of a few hundred strings, which cost most of
//! a table's display when done with `paste0` and `gsub`, are done here,
//! byte for byte as the R code did them (the tests compare both with
//! repr's output for the same frames).

/// What the driver passes for a table's markup.
pub struct Table<'a> {
    /// The shown cells (ellipses included), column by column.
    pub cells: &'a [String],
    /// Rows of `cells`.
    pub nrow: usize,
    /// Row names as shown, when the table has them.
    pub row_names: Option<&'a [String]>,
    /// Column names as shown, when the table has them.
    pub col_names: Option<&'a [String]>,
    /// Column types (`<dbl>`...), for a data frame.
    pub types: Option<&'a [String]>,
    /// The caption (`A data.frame: 3 × 2`).
    pub caption: &'a str,
    /// Cells of the Markdown header's underline (`---`).
    pub underline: usize,
}

/// `&`, `<` or `>` in `s` (repr escapes these).
fn special(s: &str) -> bool {
    s.bytes().any(|b| matches!(b, b'&' | b'<' | b'>'))
}

/// repr's `html_escape()`: `&`, `<`, `>` as entities; with `spaces`, a
/// text with two spaces in a row is wrapped to keep them.
fn escape_into(out: &mut String, s: &str, spaces: bool) {
    let wrap = spaces && s.contains("  ");
    if wrap {
        out.push_str("<span style=white-space:pre-wrap>");
    }
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            c => out.push(c),
        }
    }
    if wrap {
        out.push_str("</span>");
    }
}

/// What R's `grepl("^\\s*$", s)` says in a UTF-8 locale: only white
/// space (glibc's `iswspace`), or nothing.
fn blank(s: &str) -> bool {
    s.chars().all(|c| {
        matches!(
            c,
            '\t' | '\n'
                | '\u{0B}'
                | '\u{0C}'
                | '\r'
                | ' '
                | '\u{1680}'
                | '\u{2000}'..='\u{2006}'
                | '\u{2008}'..='\u{200A}'
                | '\u{2028}'
                | '\u{2029}'
                | '\u{205F}'
                | '\u{3000}'
        )
    })
}

/// repr's `markdown_escape()` of one text.
fn escape_md_into(out: &mut String, s: &str) {
    if blank(s) {
        out.push_str("<!---->");
    } else {
        escape_into(out, s, false);
    }
}

/// The `<th scope=col>` cells of a header line: the names escaped all
/// together when one of them needs it (repr escapes the vector).
fn header_cells(out: &mut String, names: &[String]) {
    let esc = names.iter().any(|n| special(n));
    for n in names {
        out.push_str("<th scope=col>");
        if esc {
            escape_into(out, n, true);
        } else {
            out.push_str(n);
        }
        out.push_str("</th>");
    }
}

/// The table's HTML and Markdown, as repr's `repr_html` and
/// `repr_markdown` give them.
pub fn table(t: &Table) -> (String, String) {
    let nrow = t.nrow;
    let ncol = t.cells.len().checked_div(nrow).unwrap_or(0);
    let cell = |i: usize, j: usize| t.cells[j * nrow + i].as_str();
    let bytes: usize = t.cells.iter().map(String::len).sum();
    let rn = t.row_names.filter(|r| r.len() == nrow);

    let mut html = String::with_capacity(bytes * 2 + 256);
    html.push_str("<table class=\"dataframe\">\n<caption>");
    html.push_str(t.caption);
    html.push_str("</caption>\n");
    let corner = if rn.is_some() { "<th></th>" } else { "" };
    if let Some(cn) = t.col_names {
        html.push_str("<thead>\n\t<tr>");
        html.push_str(corner);
        header_cells(&mut html, cn);
        html.push_str("</tr>\n");
        if let Some(types) = t.types {
            html.push_str("\t<tr>");
            html.push_str(corner);
            header_cells(&mut html, types);
            html.push_str("</tr>\n");
        }
        html.push_str("</thead>\n");
    }
    html.push_str("<tbody>\n");
    for i in 0..nrow {
        html.push_str("\t<tr>");
        if let Some(rn) = rn {
            // A row name is escaped alone, when it needs it.
            html.push_str("<th scope=row>");
            if special(&rn[i]) {
                escape_into(&mut html, &rn[i], true);
            } else {
                html.push_str(&rn[i]);
            }
            html.push_str("</th>");
        }
        // A row is escaped whole when one of its cells needs it.
        let esc = (0..ncol).any(|j| special(cell(i, j)));
        for j in 0..ncol {
            html.push_str("<td>");
            if esc {
                escape_into(&mut html, cell(i, j), true);
            } else {
                html.push_str(cell(i, j));
            }
            html.push_str("</td>");
        }
        html.push_str("</tr>\n");
    }
    html.push_str("</tbody>\n</table>\n");

    let mut md = String::with_capacity(bytes + 256);
    md.push('\n');
    md.push_str(t.caption);
    md.push_str("\n\n");
    if let Some(cn) = t.col_names {
        md.push('|');
        if rn.is_some() {
            md.push_str(" <!--/--> |");
        }
        for (k, n) in cn.iter().enumerate() {
            md.push(' ');
            escape_md_into(&mut md, n);
            if let Some(ty) = t.types.and_then(|ts| ts.get(k)) {
                md.push(' ');
                escape_md_into(&mut md, ty);
            }
            md.push_str(" |");
        }
        md.push_str("\n|");
        for k in 0..t.underline {
            if k > 0 {
                md.push('|');
            }
            md.push_str("---");
        }
        md.push_str("|\n");
    }
    for i in 0..nrow {
        md.push('|');
        if let Some(rn) = rn {
            md.push(' ');
            escape_md_into(&mut md, &rn[i]);
            md.push_str(" |");
        }
        for j in 0..ncol {
            md.push(' ');
            escape_md_into(&mut md, cell(i, j));
            md.push_str(" |");
        }
        md.push('\n');
    }
    md.push('\n');
    (html, md)
}

/// The driver's `json_string()`: a JSON string of `s`, with `\\`, `"`,
/// newline, carriage return and tab escaped and any other control
/// character a space.
pub fn json_string_into(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{01}'..='\u{1F}' => out.push(' '),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// One column of a JSON preview: its cells as JSON text (`Raw`: numbers
/// and logicals as R wrote them) or as strings to quote; `None` is null.
pub enum Column {
    /// Cells already JSON (numbers, `true`, `false`).
    Raw(Vec<Option<String>>),
    /// Cells to write as JSON strings.
    Text(Vec<Option<String>>),
}

impl Column {
    fn len(&self) -> usize {
        match self {
            Column::Raw(v) | Column::Text(v) => v.len(),
        }
    }

    fn write(&self, out: &mut String, i: usize) {
        match self {
            Column::Raw(v) => match v.get(i).and_then(Option::as_deref) {
                Some(s) => out.push_str(s),
                None => out.push_str("null"),
            },
            Column::Text(v) => match v.get(i).and_then(Option::as_deref) {
                Some(s) => json_string_into(out, s),
                None => out.push_str("null"),
            },
        }
    }
}

/// What the driver passes for a table's JSON preview.
pub struct Preview<'a> {
    /// The table's rows and columns, as R formats the counts.
    pub nrow: &'a str,
    /// See `nrow`.
    pub ncol: &'a str,
    /// Names and types of the previewed columns.
    pub names: &'a [String],
    /// See `names`.
    pub types: &'a [String],
    /// The previewed columns' first rows.
    pub columns: &'a [Column],
    /// Rows previewed.
    pub rows: usize,
    /// Row names of the previewed rows, unless automatic.
    pub row_names: Option<&'a [Option<String>]>,
    /// Whether rows or columns were left out.
    pub truncated: bool,
}

/// The preview's JSON text (`{"nrow", "ncol", "columns", "rows",
/// "row_names", "truncated"}`).
pub fn preview(p: &Preview) -> String {
    let mut out = String::with_capacity(64 + p.rows * p.columns.len() * 12);
    out.push_str("{\"nrow\":");
    out.push_str(p.nrow);
    out.push_str(",\"ncol\":");
    out.push_str(p.ncol);
    out.push_str(",\"columns\":[");
    for (k, (n, t)) in p.names.iter().zip(p.types).enumerate() {
        if k > 0 {
            out.push(',');
        }
        out.push_str("{\"name\":");
        json_string_into(&mut out, n);
        out.push_str(",\"type\":");
        json_string_into(&mut out, t);
        out.push('}');
    }
    out.push_str("],\"rows\":[");
    let rows = p
        .columns
        .iter()
        .map(Column::len)
        .min()
        .unwrap_or(p.rows)
        .min(p.rows);
    for i in 0..rows {
        if i > 0 {
            out.push(',');
        }
        out.push('[');
        for (k, c) in p.columns.iter().enumerate() {
            if k > 0 {
                out.push(',');
            }
            c.write(&mut out, i);
        }
        out.push(']');
    }
    out.push_str("],\"row_names\":");
    match p.row_names {
        None => out.push_str("null"),
        Some(rn) => {
            out.push('[');
            for (i, r) in rn.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                match r {
                    Some(s) => json_string_into(&mut out, s),
                    None => out.push_str("null"),
                }
            }
            out.push(']');
        }
    }
    out.push_str(",\"truncated\":");
    out.push_str(if p.truncated { "true" } else { "false" });
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn a_small_frame_as_repr_writes_it() {
        let cells = s(&["1", "2", "a", "b&c"]);
        let cn = s(&["x", "y"]);
        let types = s(&["<int>", "<chr>"]);
        let (html, md) = table(&Table {
            cells: &cells,
            nrow: 2,
            row_names: None,
            col_names: Some(&cn),
            types: Some(&types),
            caption: "A data.frame: 2 × 2",
            underline: 2,
        });
        assert_eq!(
            html,
            "<table class=\"dataframe\">\n<caption>A data.frame: 2 × 2</caption>\n<thead>\n\
             \t<tr><th scope=col>x</th><th scope=col>y</th></tr>\n\
             \t<tr><th scope=col>&lt;int&gt;</th><th scope=col>&lt;chr&gt;</th></tr>\n\
             </thead>\n<tbody>\n\t<tr><td>1</td><td>a</td></tr>\n\
             \t<tr><td>2</td><td>b&amp;c</td></tr>\n</tbody>\n</table>\n"
        );
        assert_eq!(
            md,
            "\nA data.frame: 2 × 2\n\n| x &lt;int&gt; | y &lt;chr&gt; |\n|---|---|\n\
             | 1 | a |\n| 2 | b&amp;c |\n\n"
        );
    }

    #[test]
    fn row_names_blank_cells_and_double_spaces() {
        let cells = s(&["a  b", " ", "<x>  y", ""]);
        let rn = s(&["r  1", "r<2>"]);
        let cn = s(&["v", "w"]);
        let (html, md) = table(&Table {
            cells: &cells,
            nrow: 2,
            row_names: Some(&rn),
            col_names: Some(&cn),
            types: None,
            caption: "c",
            underline: 3,
        });
        // Row 1 has a special character: all its cells are escaped, and
        // double spaces kept; its row name has none and is left as is.
        assert!(html.contains(
            "\t<tr><th scope=row>r  1</th><td><span style=white-space:pre-wrap>a  b</span></td>\
             <td><span style=white-space:pre-wrap>&lt;x&gt;  y</span></td></tr>"
        ), "{html}");
        assert!(
            html.contains("<th scope=row>r&lt;2&gt;</th><td> </td><td></td>"),
            "{html}"
        );
        assert!(md.contains("| <!--/--> | v | w |\n|---|---|---|\n"), "{md}");
        assert!(md.contains("| r  1 | a  b | &lt;x&gt;  y |\n"), "{md}");
        assert!(md.contains("| r&lt;2&gt; | <!----> | <!----> |\n"), "{md}");
    }

    #[test]
    fn the_preview_is_json() {
        let cols = [
            Column::Raw(vec![Some("1.5".into()), None]),
            Column::Text(vec![Some("a\"b\n\u{1}".into()), None]),
        ];
        let names = s(&["x", "y"]);
        let types = s(&["numeric", "character"]);
        let rn = [Some("r1".to_string()), None];
        let j = preview(&Preview {
            nrow: "2",
            ncol: "2",
            names: &names,
            types: &types,
            columns: &cols,
            rows: 2,
            row_names: Some(&rn),
            truncated: false,
        });
        assert_eq!(
            j,
            "{\"nrow\":2,\"ncol\":2,\"columns\":[{\"name\":\"x\",\"type\":\"numeric\"},\
             {\"name\":\"y\",\"type\":\"character\"}],\"rows\":[[1.5,\"a\\\"b\\n \"],[null,null]],\
             \"row_names\":[\"r1\",null],\"truncated\":false}"
        );
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        assert_eq!(v["rows"][0][1], "a\"b\n ");
        // No columns: one empty array per row.
        let j = preview(&Preview {
            nrow: "3",
            ncol: "0",
            names: &[],
            types: &[],
            columns: &[],
            rows: 3,
            row_names: None,
            truncated: false,
        });
        assert!(j.contains("\"rows\":[[],[],[]]"), "{j}");
    }
}
