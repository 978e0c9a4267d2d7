//! `history_request`: the cells this kernel ran with `store_history`, in
//! memory (a new kernel starts with none), bounded.

use serde_json::{json, Value};
use std::collections::VecDeque;

/// Most cells kept.
const MAX_ENTRIES: usize = 10_000;
/// Most bytes of one cell kept.
const MAX_CELL_BYTES: usize = 64 * 1024;

/// The cells run so far, oldest first.
#[derive(Debug, Default)]
pub struct History {
    cells: VecDeque<(u64, String)>,
}

impl History {
    /// Records cell `n`.
    pub fn push(&mut self, n: u64, code: &str) {
        if self.cells.len() == MAX_ENTRIES {
            self.cells.pop_front();
        }
        let mut end = code.len().min(MAX_CELL_BYTES);
        while !code.is_char_boundary(end) {
            end -= 1;
        }
        self.cells.push_back((n, code[..end].to_string()));
    }

    /// The reply to a `history_request` with `content`.
    pub fn reply(&self, content: &Value) -> Value {
        let n = content["n"].as_u64().unwrap_or(10) as usize;
        let picked: Vec<&(u64, String)> = match content["hist_access_type"].as_str() {
            Some("range") => {
                let start = content["start"].as_u64().unwrap_or(0);
                let stop = content["stop"].as_u64().unwrap_or(u64::MAX);
                self.cells
                    .iter()
                    .filter(|(i, _)| *i >= start && *i < stop)
                    .collect()
            }
            Some("search") => {
                let pattern = content["pattern"].as_str().unwrap_or("*");
                let hits: Vec<_> = self
                    .cells
                    .iter()
                    .filter(|(_, c)| glob(pattern, c))
                    .collect();
                let skip = hits.len().saturating_sub(n);
                hits.into_iter().skip(skip).collect()
            }
            // "tail" and anything else.
            _ => {
                let skip = self.cells.len().saturating_sub(n);
                self.cells.iter().skip(skip).collect()
            }
        };
        let history: Vec<Value> = picked.into_iter().map(|(i, c)| json!([0, i, c])).collect();
        json!({"status": "ok", "history": history})
    }
}

/// Whether `text` matches `pattern`, where `*` is any run and `?` any one
/// character (IPython's history search).
fn glob(pattern: &str, text: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    // Iterative matching with one backtrack point: linear in practice.
    let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_range_and_search() {
        let mut h = History::default();
        for (i, c) in ["x <- 1", "plot(x)", "y <- x + 1"].iter().enumerate() {
            h.push(i as u64 + 1, c);
        }
        let tail = h.reply(&json!({"hist_access_type": "tail", "n": 2}));
        assert_eq!(
            tail["history"],
            json!([[0, 2, "plot(x)"], [0, 3, "y <- x + 1"]])
        );
        let range = h.reply(&json!({"hist_access_type": "range", "start": 1, "stop": 2}));
        assert_eq!(range["history"], json!([[0, 1, "x <- 1"]]));
        let search = h.reply(&json!({"hist_access_type": "search", "pattern": "*<-*", "n": 5}));
        assert_eq!(search["history"].as_array().unwrap().len(), 2);
        assert!(!glob("plot*", "x <- 1"));
    }
}
