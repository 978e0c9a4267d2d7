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
        return r
            .displays
            .iter()
            .map(|d| Display {
                data: d.data.clone(),
                metadata: d.metadata.clone(),
                transient: d.transient.clone(),
                update: d.update && d.display_id().is_some(),
            })
            .collect();
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

impl Display {
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
