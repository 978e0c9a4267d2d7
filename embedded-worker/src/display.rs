//! A call's displays (rich results): the MIME bundles the driver reports
//! for tables and HTML values, and those of plot pages, within the call's
//! caps (docs/output-and-plots.md, "Displays").

use crate::console;
use base64::Engine;
use rvisor_protocol::display::{MAX_DISPLAYS, TEXT_PLAIN_BYTES};
use rvisor_protocol::{bounds, Display, Plot, Segment};
use serde_json::{Map, Value};
use std::cell::{Cell, RefCell};

thread_local! {
    static DISPLAYS: RefCell<Vec<Display>> = const { RefCell::new(Vec::new()) };
    /// Displays past [`MAX_DISPLAYS`] in this call, counted.
    static DROPPED: RefCell<u64> = const { RefCell::new(0) };
    /// The call shows visible values as displays (option `values`): their
    /// text is not on the console.
    static VALUES: Cell<bool> = const { Cell::new(false) };
    /// The display of the last visible value shown, by index.
    static LAST_VALUE: Cell<Option<usize>> = const { Cell::new(None) };
    /// A top-level visible value is being shown: a display made now is
    /// its display.
    static SHOWING_VALUE: Cell<bool> = const { Cell::new(false) };
    /// The display id (and whether it is an update) `rvisor_display()`
    /// was given, for the next display the driver reports.
    static PENDING_ID: RefCell<Option<(String, bool)>> = const { RefCell::new(None) };
}

/// Longest display id accepted (the driver checks it too).
pub const MAX_DISPLAY_ID_BYTES: usize = 256;

/// `rvisor_display(x, display_id =, update =)`: the next display the
/// driver reports carries `id` in its `transient` (and is an update of
/// the display of that id when `update`); `None` forgets an id that no
/// display took.
pub fn set_pending_id(id: Option<String>, update: bool) {
    let id = id.filter(|i| !i.is_empty() && i.len() <= MAX_DISPLAY_ID_BYTES);
    PENDING_ID.with(|p| *p.borrow_mut() = id.map(|i| (i, update)));
}

/// Forgets the previous call's displays; `values`: this call shows
/// visible values as displays.
pub fn begin(values: bool) {
    DISPLAYS.with(|d| d.borrow_mut().clear());
    DROPPED.with(|d| *d.borrow_mut() = 0);
    VALUES.with(|v| v.set(values));
    LAST_VALUE.with(|l| l.set(None));
    SHOWING_VALUE.with(|s| s.set(false));
    PENDING_ID.with(|p| *p.borrow_mut() = None);
}

/// A top-level visible value is being shown (`true`), or no longer. With
/// option `values`, the displays made meanwhile are marked
/// `metadata.rvisor.value`: one of them may turn out to be the call's
/// last visible value, which only the end of the call tells (a Jupyter
/// kernel holds such a display back until then, and sends any other at
/// once).
pub fn showing_value(on: bool) {
    SHOWING_VALUE.with(|s| s.set(on));
}

/// How many displays the call has made so far.
pub fn count() -> usize {
    DISPLAYS.with(|d| d.borrow().len())
}

/// A visible value was shown: when that made a display (there are more
/// than `before`), it is the last value so far.
pub fn value_shown(before: usize) {
    let now = count();
    if now > before {
        LAST_VALUE.with(|l| l.set(Some(now - 1)));
    }
}

/// A visible value's display (option `values`): `text` as R printed it
/// (`more`: it printed more than was held), `class` its first class.
pub fn of_value(text: String, more: bool, class: &str) {
    let mut meta = Map::new();
    meta.insert(
        "rvisor".into(),
        serde_json::json!({"kind": "value", "class": class}),
    );
    if more {
        note(
            &mut meta,
            "text/plain",
            "cut at 64 KiB (print less, or write it to a file)",
        );
    }
    from_driver(
        vec!["text/plain".into()],
        vec![text],
        Some(Value::Object(meta).to_string()),
    );
}

/// The call's value displays, and how many were dropped past the count
/// cap; the last visible value's display has `metadata.rvisor.last` true.
pub fn take() -> (Vec<Display>, u64) {
    let mut displays = DISPLAYS.with(|d| std::mem::take(&mut *d.borrow_mut()));
    if let Some(d) = LAST_VALUE
        .with(|l| l.take())
        .and_then(|i| displays.get_mut(i))
    {
        let rv = d
            .metadata
            .entry("rvisor")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(rv) = rv {
            rv.insert("last".into(), Value::Bool(true));
        }
    }
    (
        displays,
        DROPPED.with(|d| std::mem::take(&mut *d.borrow_mut())),
    )
}

/// A display the driver reported: `mimes[i]` holds `values[i]`
/// (`application/json` as JSON text), `meta` is JSON text. Counted against
/// the output cap; when the whole bundle does not fit, only its text/plain
/// is kept (and `displays` marked cut); past [`MAX_DISPLAYS`] it is
/// counted, not kept. Its segment goes where it happened.
pub fn from_driver(mimes: Vec<String>, values: Vec<String>, meta: Option<String>) {
    if DISPLAYS.with(|d| d.borrow().len()) >= MAX_DISPLAYS {
        DROPPED.with(|d| *d.borrow_mut() += 1);
        console::mark("displays");
        return;
    }
    let mut metadata = meta
        .and_then(|m| serde_json::from_str::<Map<String, Value>>(&m).ok())
        .unwrap_or_default();
    let mut data = Map::new();
    for (mime, value) in mimes.into_iter().zip(values) {
        let v = if mime == "text/plain" {
            let (kept, cut) = bounds::cut(&value, TEXT_PLAIN_BYTES);
            if cut {
                let why = if VALUES.with(Cell::get) {
                    "cut at 64 KiB (print less, or write it to a file)"
                } else {
                    "cut at 64 KiB (the console has the text)"
                };
                note(&mut metadata, &mime, why);
            }
            Value::String(kept.to_string())
        } else if mime.ends_with("json") {
            match serde_json::from_str(&value) {
                Ok(v) => v,
                Err(e) => {
                    note(
                        &mut metadata,
                        &mime,
                        &format!("left out: invalid JSON ({e})"),
                    );
                    continue;
                }
            }
        } else {
            Value::String(value)
        };
        data.insert(mime, v);
    }
    let size: u64 = data.values().map(value_bytes).sum();
    if !console::admit_display(size) {
        let plain = data.remove("text/plain");
        for mime in data.keys() {
            note(
                &mut metadata,
                mime,
                "left out: over the call's output cap (max_output_bytes)",
            );
        }
        data.clear();
        match plain {
            Some(p) if console::admit_display(value_bytes(&p)) => {
                data.insert("text/plain".into(), p);
            }
            _ => return,
        }
    }
    let mut d = Display {
        data,
        metadata,
        ..Display::default()
    };
    if let Some((id, update)) = PENDING_ID.with(|p| p.borrow_mut().take()) {
        d.transient.insert("display_id".into(), Value::String(id));
        d.update = update;
    }
    push(d);
}

/// A display streamed and placed where it is made, never marked as a
/// value's: a plot page's made while the call runs (pages.rs; a page can
/// finish while a value prints), and through [`push`] the driver's.
pub fn push_page(d: Display) {
    let index = count();
    // Streamed with its bundle as it is made (when the call streams).
    crate::stream::display(index, &d);
    DISPLAYS.with(|v| v.borrow_mut().push(d));
    console::push(Segment::Display { index });
}

/// A display the driver reported: marked as a value's while one is shown.
fn push(mut d: Display) {
    if VALUES.with(Cell::get) && SHOWING_VALUE.with(Cell::get) {
        let rv = d
            .metadata
            .entry("rvisor")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(rv) = rv {
            rv.insert("value".into(), Value::Bool(true));
        }
    }
    push_page(d);
}

fn value_bytes(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.len() as u64,
        other => other.to_string().len() as u64,
    }
}

/// Records in `metadata.rvisor.truncated` that `mime` was cut or left out.
pub fn note(metadata: &mut Map<String, Value>, mime: &str, why: &str) {
    let rv = metadata
        .entry("rvisor")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Value::Object(rv) = rv {
        let t = rv
            .entry("truncated")
            .or_insert_with(|| Value::Object(Map::new()));
        if let Value::Object(t) = t {
            t.insert(mime.to_string(), Value::String(why.to_string()));
        }
    }
}

/// The display of plot page `page`: its image (PNG base64, or SVG text) and
/// the SVG made beside a PNG (`svg`), with each type's size in metadata.
pub fn of_plot(page: usize, plot: &Plot, svg: Option<String>) -> Display {
    let mut data = Map::new();
    let mut metadata = Map::new();
    let size = serde_json::json!({"width": plot.width, "height": plot.height});
    if plot.mime == "image/svg+xml" {
        let text = base64::engine::general_purpose::STANDARD
            .decode(&plot.data_base64)
            .ok()
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default();
        data.insert("image/svg+xml".into(), Value::String(text));
        metadata.insert("image/svg+xml".into(), size.clone());
    } else {
        data.insert("image/png".into(), Value::String(plot.data_base64.clone()));
        metadata.insert("image/png".into(), size.clone());
    }
    if let Some(svg) = svg {
        data.insert("image/svg+xml".into(), Value::String(svg));
        metadata.insert("image/svg+xml".into(), size);
    }
    data.insert(
        "text/plain".into(),
        Value::String(format!(
            "[plot {}: {}x{} pixels]",
            page + 1,
            plot.width,
            plot.height
        )),
    );
    metadata.insert(
        "rvisor".into(),
        serde_json::json!({"kind": "plot", "plot": page}),
    );
    Display {
        data,
        metadata,
        ..Display::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_over_the_cap_keeps_its_text_and_says_why() {
        console::begin(100);
        begin(false);
        from_driver(
            vec![
                "text/plain".into(),
                "text/html".into(),
                "application/json".into(),
            ],
            vec![
                "  x\n1 1\n".into(),
                "<table>".repeat(50),
                r#"{"nrow":1}"#.into(),
            ],
            Some(r#"{"rvisor":{"kind":"table"}}"#.into()),
        );
        from_driver(
            vec!["text/plain".into(), "application/json".into()],
            vec!["y".into(), "{not json".into()],
            None,
        );
        let (d, dropped) = take();
        let c = console::take();
        assert_eq!(dropped, 0);
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].data.len(), 1, "{:?}", d[0]);
        assert_eq!(d[0].data["text/plain"], "  x\n1 1\n");
        let t = &d[0].metadata["rvisor"]["truncated"];
        assert!(t["text/html"].as_str().unwrap().contains("output cap"));
        assert!(t["application/json"].is_string());
        assert!(d[1].metadata["rvisor"]["truncated"]["application/json"]
            .as_str()
            .unwrap()
            .contains("invalid JSON"));
        assert_eq!(
            c.segments,
            vec![Segment::Display { index: 0 }, Segment::Display { index: 1 }]
        );
        assert!(c.fields.contains(&"displays"));
    }
}
