//! The structured result block: JSON printed between marker lines.
//!
//! A script prints `<<<RVISOR_RESULT_START>>>`, JSON, `<<<RVISOR_RESULT_END>>>`
//! on lines of their own (or the JUBE markers). The block is removed from the
//! stdout text and parsed; the last block of a call wins. A block over
//! `bounds::RESULT_JSON_BYTES` is removed too, but not parsed: `result` is
//! null and a warning says why.

use rvisor_protocol::bounds::RESULT_JSON_BYTES;
use rvisor_protocol::Segment;

const MARKERS: [(&str, &str); 2] = [
    ("<<<RVISOR_RESULT_START>>>", "<<<RVISOR_RESULT_END>>>"),
    ("<<<JUBE_RESULT_START>>>", "<<<JUBE_RESULT_END>>>"),
];

/// What was found in a call's output.
#[derive(Debug, Default, PartialEq)]
pub struct Extracted {
    /// The parsed value of the last block, when it is valid (a rejected
    /// last block leaves it `None`, as its warning says, even after a
    /// valid one).
    pub value: Option<serde_json::Value>,
    /// Why a block was rejected (invalid JSON, no end marker, too large).
    pub problems: Vec<String>,
    /// The last block was over `RESULT_JSON_BYTES`.
    pub too_large: bool,
}

/// Removes result blocks from the stdout segments and parses them. A block
/// may span several stdout segments (output interleaved with stderr); text on
/// other streams stays where it is.
pub fn extract(segments: &mut Vec<Segment>) -> Extracted {
    let mut out = Extracted::default();
    // Fast path: nothing to do unless a start marker appears somewhere.
    let any = segments.iter().any(|s| match s {
        Segment::Stdout { text } => MARKERS.iter().any(|(start, _)| text.contains(start)),
        _ => false,
    });
    if !any {
        return out;
    }
    // (marker pair, block text, the block's size when over the cap)
    let mut open: Option<(usize, String, usize)> = None;
    for seg in segments.iter_mut() {
        let Segment::Stdout { text } = seg else {
            continue;
        };
        let mut kept = String::with_capacity(text.len());
        for line in text.split_inclusive('\n') {
            let bare = line.trim_end_matches(['\n', '\r']).trim();
            match &mut open {
                None => {
                    if let Some(i) = MARKERS.iter().position(|(s, _)| bare == *s) {
                        open = Some((i, String::new(), 0));
                    } else {
                        kept.push_str(line);
                    }
                }
                Some((i, block, over)) => {
                    if bare == MARKERS[*i].1 {
                        out.too_large = *over > 0;
                        if *over > 0 {
                            out.value = None;
                            out.value = None;
                            out.problems.push(format!(
                                "the result block is {over} bytes, over the limit of \
                                 {RESULT_JSON_BYTES} bytes; `result` is null (return a summary, \
                                 or publish a table)"
                            ));
                        } else {
                            match serde_json::from_str(block.trim()) {
                                Ok(v) => out.value = Some(v),
                                Err(e) => {
                                    out.value = None;
                                    out.problems.push(format!(
                                        "the result block is not valid JSON ({e}); `result` is null"
                                    ))
                                }
                            }
                        }
                        open = None;
                    } else if *over > 0 {
                        *over += line.len();
                    } else if block.len() + line.len() > RESULT_JSON_BYTES {
                        // Only counted from here on; the text is dropped.
                        *over = block.len() + line.len();
                        *block = String::new();
                    } else {
                        block.push_str(line);
                    }
                }
            }
        }
        *text = kept;
    }
    if let Some((i, block, _)) = open {
        out.value = None;
        out.problems.push(format!(
            "the result block has no end marker {}; `result` is null",
            MARKERS[i].1
        ));
        // Give the text back so nothing printed is lost.
        segments.push(Segment::Stdout {
            text: format!("{}\n{block}", MARKERS[i].0),
        });
    }
    segments.retain(|s| !matches!(s, Segment::Stdout { text } if text.is_empty()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stdout(t: &str) -> Segment {
        Segment::Stdout { text: t.into() }
    }

    #[test]
    fn block_is_parsed_and_removed() {
        let mut segs = vec![stdout(
            "before\n<<<RVISOR_RESULT_START>>>\n{\"a\": [1, 2]}\n<<<RVISOR_RESULT_END>>>\nafter\n",
        )];
        let x = extract(&mut segs);
        assert_eq!(x.value, Some(serde_json::json!({"a": [1, 2]})));
        assert!(x.problems.is_empty());
        assert_eq!(segs, vec![stdout("before\nafter\n")]);
    }

    #[test]
    fn jube_markers_and_split_segments() {
        let mut segs = vec![
            stdout("<<<JUBE_RESULT_START>>>\n[1,"),
            Segment::Stderr {
                text: "note\n".into(),
            },
            stdout("2]\n<<<JUBE_RESULT_END>>>\n"),
        ];
        let x = extract(&mut segs);
        assert_eq!(x.value, Some(serde_json::json!([1, 2])));
        assert_eq!(
            segs,
            vec![Segment::Stderr {
                text: "note\n".into()
            }]
        );
    }

    #[test]
    fn invalid_json_gives_null_and_a_reason() {
        let mut segs = vec![stdout(
            "<<<RVISOR_RESULT_START>>>\n{oops\n<<<RVISOR_RESULT_END>>>\n",
        )];
        let x = extract(&mut segs);
        assert_eq!(x.value, None);
        assert_eq!(x.problems.len(), 1);
        assert!(x.problems[0].contains("not valid JSON"));
    }

    #[test]
    fn unterminated_block_keeps_the_text() {
        let mut segs = vec![stdout("<<<RVISOR_RESULT_START>>>\n{\"a\":1}\n")];
        let x = extract(&mut segs);
        assert_eq!(x.value, None);
        assert!(x.problems[0].contains("no end marker"));
        assert!(matches!(&segs[0], Segment::Stdout { text } if text.contains("{\"a\":1}")));
    }

    #[test]
    fn a_block_over_the_cap_is_dropped_with_a_reason() {
        let big = format!("\"{}\"\n", "a".repeat(RESULT_JSON_BYTES));
        let mut segs = vec![stdout(&format!(
            "<<<RVISOR_RESULT_START>>>\n{big}<<<RVISOR_RESULT_END>>>\nafter\n"
        ))];
        let x = extract(&mut segs);
        assert_eq!(x.value, None);
        assert!(x.too_large);
        assert!(x.problems[0].contains("over the limit"), "{:?}", x.problems);
        assert_eq!(segs, vec![stdout("after\n")]);
    }

    #[test]
    fn markers_inside_a_line_are_plain_text() {
        let mut segs = vec![stdout("say <<<RVISOR_RESULT_START>>> here\n")];
        let x = extract(&mut segs);
        assert_eq!(x, Extracted::default());
        assert_eq!(segs, vec![stdout("say <<<RVISOR_RESULT_START>>> here\n")]);
    }
}
