//! A result's rich outputs as Jupyter display bundles (`display_data`):
//! `RunResult.displays` (MIME bundles made in R: tables, HTML values,
//! plots; docs/output-and-plots.md, "Displays") as they are, or, when the
//! session has displays off, each PNG plot page.

use rvisor::{RunResult, Segment};
use serde_json::{json, Map, Value};

/// One display: shaped exactly like `display_data`'s content.
#[derive(Debug, Clone, PartialEq)]
pub struct Display {
    /// MIME type to value (base64 for images).
    pub data: Map<String, Value>,
    /// MIME type to its metadata (an image's size).
    pub metadata: Map<String, Value>,
    /// `display_id` when the code named one (`rvisor_display(x,
    /// display_id = )`), else empty.
    pub transient: Map<String, Value>,
    /// It replaces the display of its id (`update_display_data`).
    pub update: bool,
}

/// The displays of `r`, in the order R made them: its `displays` when it
/// has any (plots are among them), else each plot page, as `image/png`,
/// in the order of its `plot` segment (a page without one, which should
/// not happen, comes after them).
pub fn displays_of(r: &RunResult) -> Vec<Display> {
    if !r.displays.is_empty() {
        return r.displays.iter().map(Display::of).collect();
    }
    let mut order: Vec<usize> = r
        .segments
        .iter()
        .filter_map(|s| match s {
            Segment::Plot { index } if *index < r.plots.len() => Some(*index),
            _ => None,
        })
        .collect();
    for i in 0..r.plots.len() {
        if !order.contains(&i) {
            order.push(i);
        }
    }
    order
        .into_iter()
        .map(|i| {
            let p = &r.plots[i];
            let mut data = Map::new();
            data.insert(p.mime.clone(), Value::String(p.data_base64.clone()));
            data.insert(
                "text/plain".into(),
                json!(format!("<R plot {}x{}>", p.width, p.height)),
            );
            let mut metadata = Map::new();
            metadata.insert(
                p.mime.clone(),
                json!({"width": p.width, "height": p.height}),
            );
            Display {
                data,
                metadata,
                transient: Map::new(),
                update: false,
            }
        })
        .collect()
}

/// A cell's displays as its events bring them (each `display` event
/// carries its bundle: docs/streaming.md), sent in order with its stream
/// text, each once. The display of a visible value
/// (`metadata.rvisor.value`) is held back until the next output (or the
/// end): only the result says whether it was the cell's last visible
/// value, which goes as `execute_result`, after the displays made at the
/// end (plot pages). Any other display (`rvisor_display()`) goes at once.
#[derive(Debug, Default)]
pub struct Outputs {
    /// Indices into the result's displays already sent (or held).
    sent: std::collections::HashSet<usize>,
    /// A display that may be the cell's result, by index.
    held: Option<(usize, Display)>,
}

impl Outputs {
    /// Output other than a display comes (stream text, a warning): the
    /// display held, if any, goes before it, as `display_data`.
    pub fn release(&mut self) -> Option<Display> {
        self.held.take().map(|(_, d)| d)
    }

    /// Display event `index`, with its bundle when it was streamed with
    /// it: what to send now, in order. A plot page's display (made at the
    /// end of the call) goes at once and keeps a held value held (the
    /// value comes last, as in every kernel); one without its bundle (too
    /// large to stream) is sent from the result at the end.
    pub fn display(&mut self, index: usize, d: Option<&rvisor::Display>) -> Vec<Display> {
        let Some(d) = d.map(Display::of) else {
            return self.release().into_iter().collect();
        };
        self.sent.insert(index);
        if d.kind() == Some("plot") {
            return vec![d];
        }
        let mut now: Vec<Display> = self.release().into_iter().collect();
        if d.is_value() && !d.update {
            self.held = Some((index, d));
        } else {
            now.push(d);
        }
        now
    }

    /// The call ended with `r`: the displays still to send as
    /// `display_data` (or `update_display_data`), in order, and the
    /// cell's `execute_result`, if it has one (its last visible value).
    pub fn finish(mut self, r: &RunResult) -> (Vec<Display>, Option<Display>) {
        let all = displays_of(r);
        // Without displays (the session has them off) the result's plot
        // pages stand in for them, none streamed.
        let streamed = !r.displays.is_empty();
        let mut now = Vec::new();
        let mut result = None;
        if let Some((i, d)) = self.held.take() {
            match all.get(i) {
                Some(last) if streamed && last.is_last_value() => result = Some(last.clone()),
                _ => now.push(d),
            }
        }
        for (i, d) in all.into_iter().enumerate() {
            if streamed && self.sent.contains(&i) {
                continue;
            }
            if d.is_last_value() && result.is_none() {
                result = Some(d);
            } else {
                now.push(d);
            }
        }
        (now, result)
    }
}

impl Display {
    /// The kernel's display of a result's (or an event's) display.
    pub fn of(d: &rvisor::Display) -> Self {
        Display {
            data: d.data.clone(),
            metadata: d.metadata.clone(),
            transient: d.transient.clone(),
            // A display with an id given again with `update = TRUE`
            // replaces it where it is shown.
            update: d.update && d.display_id().is_some(),
        }
    }

    /// Its `metadata.rvisor.kind` (`table`, `html`, `value`, `plot`).
    fn kind(&self) -> Option<&str> {
        self.metadata.get("rvisor")?.get("kind")?.as_str()
    }

    /// Whether it shows a visible value (`metadata.rvisor.value`), which
    /// may be the cell's result.
    fn is_value(&self) -> bool {
        self.metadata
            .get("rvisor")
            .and_then(|r| r.get("value"))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }

    /// The content of a `display_data` message (and of an
    /// `update_display_data`, which has the same shape).
    pub fn content(&self) -> Value {
        json!({"data": self.data, "metadata": self.metadata, "transient": self.transient})
    }

    /// The message type it goes as: `update_display_data` for an update
    /// of a display id, else `display_data`.
    pub fn msg_type(&self) -> &'static str {
        if self.update {
            "update_display_data"
        } else {
            "display_data"
        }
    }

    /// Whether this is the display of the call's last visible value
    /// (`metadata.rvisor.last`), which a cell sends as `execute_result`.
    pub fn is_last_value(&self) -> bool {
        self.metadata
            .get("rvisor")
            .and_then(|r| r.get("last"))
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }

    /// The content of an `execute_result` of cell `execution_count`.
    pub fn result_content(&self, execution_count: u64) -> Value {
        json!({"data": self.data, "metadata": self.metadata, "execution_count": execution_count})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_results_displays_are_sent_as_they_are() {
        let mut r = RunResult::empty("e".into(), "df".into());
        r.plots.push(rvisor::Plot {
            mime: "image/png".into(),
            width: 10,
            height: 10,
            data_base64: "png".into(),
        });
        let mut data = Map::new();
        data.insert("text/html".into(), json!("<table></table>"));
        r.displays.push(rvisor::Display {
            data,
            ..rvisor::Display::default()
        });
        let d = displays_of(&r);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].data["text/html"], "<table></table>");
    }

    #[test]
    fn the_last_value_is_the_cells_result() {
        let mut d = Display {
            data: Map::new(),
            metadata: Map::new(),
            transient: Map::new(),
            update: false,
        };
        assert!(!d.is_last_value());
        d.metadata
            .insert("rvisor".into(), json!({"kind": "value", "last": true}));
        assert!(d.is_last_value());
        let c = d.result_content(3);
        assert_eq!(c["execution_count"], 3);
        assert_eq!(c["metadata"]["rvisor"]["kind"], "value");
    }

    #[test]
    fn a_display_id_goes_in_transient_and_an_update_as_update_display_data() {
        let mut r = RunResult::empty("e".into(), "rvisor_display(1, display_id = 'p')".into());
        for update in [false, true] {
            let mut d = rvisor::Display::default();
            d.data.insert("text/plain".into(), json!("[1] 1"));
            d.transient.insert("display_id".into(), json!("p"));
            d.update = update;
            r.displays.push(d);
        }
        // An update without an id is an ordinary display.
        r.displays.push(rvisor::Display {
            update: true,
            ..rvisor::Display::default()
        });
        let d = displays_of(&r);
        assert_eq!(d[0].msg_type(), "display_data");
        assert_eq!(d[0].content()["transient"]["display_id"], "p");
        assert_eq!(d[1].msg_type(), "update_display_data");
        assert_eq!(d[1].content()["transient"]["display_id"], "p");
        assert_eq!(d[2].msg_type(), "display_data");
        assert_eq!(d[2].content()["transient"], json!({}));
    }

    /// A display of `kind`; `value` kinds are a visible value's.
    fn shown(kind: &str, text: &str) -> rvisor::Display {
        let mut d = rvisor::Display::default();
        d.data.insert("text/plain".into(), json!(text));
        let (kind, value) = match kind.strip_suffix(" value") {
            Some(k) => (k, true),
            None => (kind, kind == "value"),
        };
        let mut rv = json!({"kind": kind});
        if value {
            rv["value"] = json!(true);
        }
        d.metadata.insert("rvisor".into(), rv);
        d
    }

    fn texts(d: &[Display]) -> Vec<&str> {
        d.iter()
            .map(|d| d.data["text/plain"].as_str().unwrap())
            .collect()
    }

    #[test]
    fn streamed_displays_go_in_order_and_the_last_value_is_the_result() {
        // cat("a"); df; cat("b"); rvisor_display(x); 1 + 1; plot(1)
        let mut r = RunResult::empty("e".into(), "".into());
        r.displays = vec![
            shown("table value", "df"),
            shown("text", "x"),
            shown("value", "[1] 2"),
            shown("plot", "p"),
        ];
        r.displays[2].metadata.insert(
            "rvisor".into(),
            json!({"kind": "value", "value": true, "last": true}),
        );
        let mut o = Outputs::default();
        assert!(o.release().is_none());
        assert!(
            o.display(0, Some(&shown("table value", "df"))).is_empty(),
            "held"
        );
        assert_eq!(texts(&o.release().into_iter().collect::<Vec<_>>()), ["df"]);
        // Not a value's: at once.
        assert_eq!(texts(&o.display(1, Some(&shown("text", "x")))), ["x"]);
        assert!(o.display(2, Some(&shown("value", "[1] 2"))).is_empty());
        // A plot page's display goes at once; the value stays held.
        assert_eq!(texts(&o.display(3, Some(&shown("plot", "p")))), ["p"]);
        let (now, result) = o.finish(&r);
        assert!(now.is_empty(), "nothing is sent twice: {now:?}");
        let result = result.unwrap();
        assert_eq!(result.data["text/plain"], "[1] 2");
        assert!(result.is_last_value());
    }

    #[test]
    fn a_held_display_that_is_not_the_last_value_and_unstreamed_ones_come_at_the_end() {
        let mut r = RunResult::empty("e".into(), "".into());
        r.displays = vec![shown("table value", "df"), shown("html", "big")];
        let mut o = Outputs::default();
        assert!(o.display(0, Some(&shown("table value", "df"))).is_empty());
        // Too large to stream: the held one goes, this one comes from the
        // result.
        assert_eq!(texts(&o.display(1, None)), ["df"]);
        let (now, result) = o.finish(&r);
        assert_eq!(texts(&now), ["big"]);
        assert!(result.is_none());
        // Held to the end, not the last value: display_data.
        let mut o = Outputs::default();
        assert!(o.display(0, Some(&shown("table value", "df"))).is_empty());
        let (now, result) = o.finish(&r);
        assert_eq!(texts(&now), ["df", "big"]);
        assert!(result.is_none());
    }

    #[test]
    fn plots_follow_their_segments() {
        let mut r = RunResult::empty("e".into(), "plot(1); plot(2)".into());
        for w in [100, 200] {
            r.plots.push(rvisor::Plot {
                mime: "image/png".into(),
                width: w,
                height: 50,
                data_base64: format!("png{w}"),
            });
        }
        r.segments = vec![Segment::Plot { index: 1 }, Segment::Plot { index: 0 }];
        let d = displays_of(&r);
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].data["image/png"], "png200");
        assert_eq!(d[1].metadata["image/png"]["width"], 100);
    }
}
