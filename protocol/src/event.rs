//! Events of a call while it runs: console text, conditions, plot pages and
//! progress, in the order they happened, then the final result.
//!
//! The worker sends them in batches ([`crate::FromWorker::Events`]) only
//! when the call asked for them ([`StreamMode`]); the supervisor numbers
//! them (`seq`) and hands them to the call's listener as [`CallEvent`]s.
//! The text of the console events is the text the final result keeps, so
//! their concatenation is the result's `console` (before the structured
//! result block is taken out of it), less what a reader that lagged was
//! told it missed ([`EventKind::Lagged`]).

use crate::{RunResult, Segment};
use serde::{Deserialize, Serialize};

/// Which events the worker sends while a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamMode {
    /// None (the call pays nothing).
    #[default]
    Off,
    /// Console text of calls that run for a while, at most every
    /// [`TAIL_INTERVAL_MS`], so `status` can show the last lines printed;
    /// a short call sends nothing.
    Tail,
    /// Everything, with low latency: the first event after a quiet spell
    /// at once, then batches at most every [`FLUSH_INTERVAL_MS`].
    Full,
}

/// The longest a streamed event waits in the worker before it is sent
/// (when R checks for events at least that often).
pub const FLUSH_INTERVAL_MS: u64 = 10;
/// A batch is sent at once when its text reaches this many bytes.
pub const FLUSH_BYTES: usize = 32 * 1024;
/// The largest display (its JSON) a display event carries; a larger one
/// is streamed as `{kind, index}` only, its bundle in the final result.
/// Half the smallest event frame the supervisor accepts, so that a frame
/// with a display and a batch of text always fits.
pub const STREAM_DISPLAY_BYTES: usize = 16 << 20;
/// In tail mode: nothing is sent before the call has run this long, then
/// at most this often.
pub const TAIL_INTERVAL_MS: u64 = 250;
/// In tail mode: the most text one batch carries (its end is kept).
pub const TAIL_BYTES: usize = 4096;

crate::result::output_enum! {
    /// What happened: a piece of the output as the result's segments have
    /// it (a warning comes when R reports it, at the end of its top-level
    /// expression; a plot when its page is finished, at the next page or
    /// the end, its image in the final result's `plots[index]`; a display
    /// when it is made, with its bundle: `{"kind": "display", "index": N,
    /// "display": {data, metadata, ...}}`), progress, or the final result.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(tag = "kind", rename_all = "snake_case")]
    #[non_exhaustive]
    pub enum EventKind from Segment {
        /// Progress reported by `rvisor_progress()` or read from a
        /// `txtProgressBar` (style 3) line.
        Progress {
            /// How far along.
            value: f64,
            /// Out of how much, if known (100 for a text progress bar).
            total: Option<f64>,
            /// What is being done, if said.
            message: Option<String>,
        },
        /// The call's final result: always the last event.
        Result {
            /// The result, exactly as the call's answer without streaming.
            result: Box<RunResult>,
        },
        /// Events this reader did not get: it read more slowly than the
        /// call wrote, and the events waiting for it reached their bound,
        /// so the supervisor dropped the ones in between (a worker never
        /// sends this). The event's `seq` is the last one dropped: events
        /// `first_seq..=seq` were not sent. Everything they held is in the
        /// final result (its console, segments and plots), which is never
        /// dropped.
        Lagged {
            /// The first event dropped.
            first_seq: u64,
            /// How many were dropped (`seq - first_seq + 1`).
            events: u64,
            /// The console text they held (stdout, stderr, messages), in
            /// bytes.
            bytes: u64,
            /// What happened and what to do, for a person.
            message: String,
        },
    }
}

impl EventKind {
    /// The console text of this event (what a person sees), if it has any.
    pub fn console_text(&self) -> Option<&str> {
        match self {
            EventKind::Stdout { text }
            | EventKind::Stderr { text }
            | EventKind::Message { text } => Some(text),
            _ => None,
        }
    }

    /// The name of the kind (`stdout`, `progress`, `result`...).
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::Stdout { .. } => "stdout",
            EventKind::Stderr { .. } => "stderr",
            EventKind::Warning { .. } => "warning",
            EventKind::Message { .. } => "message",
            EventKind::Error { .. } => "error",
            EventKind::Plot { .. } => "plot",
            EventKind::Display { .. } => "display",
            EventKind::Progress { .. } => "progress",
            EventKind::Result { .. } => "result",
            EventKind::Lagged { .. } => "lagged",
        }
    }
}

/// One event of a call, as every surface shows it:
/// `{"execution_id", "seq", "kind", ...}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallEvent {
    /// The call's execution id.
    pub execution_id: String,
    /// 1, 2, 3... within the call.
    pub seq: u64,
    /// What happened.
    #[serde(flatten)]
    pub kind: EventKind,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_display_event_carries_its_bundle_and_its_segment_does_not() {
        let mut d = crate::Display::default();
        d.data
            .insert("text/html".into(), serde_json::json!("<table></table>"));
        let e = CallEvent {
            execution_id: "x".into(),
            seq: 2,
            kind: EventKind::Display {
                index: 0,
                display: Some(Box::new(d.clone())),
            },
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"execution_id": "x", "seq": 2, "kind": "display", "index": 0,
                               "display": {"data": {"text/html": "<table></table>"},
                                           "metadata": {}}})
        );
        let back: CallEvent = serde_json::from_value(v).unwrap();
        assert_eq!(back, e);
        // The segment, and an event made from it, stay {kind, index}; an
        // old event without the field still reads.
        let seg = Segment::Display { index: 0 };
        assert_eq!(
            serde_json::to_value(&seg).unwrap(),
            serde_json::json!({"kind": "display", "index": 0})
        );
        let from = EventKind::from_segment(&seg).unwrap();
        assert_eq!(
            from,
            EventKind::Display {
                index: 0,
                display: None
            }
        );
        assert_eq!(
            serde_json::to_value(&from).unwrap(),
            serde_json::json!({"kind": "display", "index": 0})
        );
        let old: EventKind =
            serde_json::from_value(serde_json::json!({"kind": "display", "index": 4})).unwrap();
        assert_eq!(
            old,
            EventKind::Display {
                index: 4,
                display: None
            }
        );
        assert!(d.size_bytes() >= "text/html<table></table>".len());
    }

    #[test]
    fn wire_shape() {
        let e = CallEvent {
            execution_id: "x".into(),
            seq: 3,
            kind: EventKind::Progress {
                value: 2.0,
                total: Some(10.0),
                message: None,
            },
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"execution_id": "x", "seq": 3, "kind": "progress",
                               "value": 2.0, "total": 10.0, "message": null})
        );
        let back: CallEvent = serde_json::from_value(v).unwrap();
        assert_eq!(back, e);
        let s = serde_json::to_string(&CallEvent {
            execution_id: "x".into(),
            seq: 1,
            kind: EventKind::Stdout { text: "a\n".into() },
        })
        .unwrap();
        assert_eq!(
            s,
            r#"{"execution_id":"x","seq":1,"kind":"stdout","text":"a\n"}"#
        );
    }

    /// Every kind's JSON, fixed: the shared variants read as a result's
    /// segments do, field for field (`kind` first, then the fields).
    #[test]
    fn every_kind_keeps_its_wire_form() {
        let seg = |s: Segment| EventKind::from_segment(&s).expect("every segment is an event");
        let cases: Vec<(EventKind, &str)> = vec![
            (
                EventKind::Stdout { text: "a\n".into() },
                r#"{"kind":"stdout","text":"a\n"}"#,
            ),
            (
                EventKind::Stderr { text: "b".into() },
                r#"{"kind":"stderr","text":"b"}"#,
            ),
            (
                EventKind::Warning {
                    message: "w".into(),
                    call: Some("f()".into()),
                },
                r#"{"kind":"warning","message":"w","call":"f()"}"#,
            ),
            (
                EventKind::Message { text: "m\n".into() },
                r#"{"kind":"message","text":"m\n"}"#,
            ),
            (
                EventKind::Error {
                    message: "e".into(),
                    call: None,
                    traceback: vec!["g()".into(), "f()".into()],
                },
                r#"{"kind":"error","message":"e","call":null,"traceback":["g()","f()"]}"#,
            ),
            (EventKind::Plot { index: 2 }, r#"{"kind":"plot","index":2}"#),
            (
                EventKind::Progress {
                    value: 1.5,
                    total: None,
                    message: Some("step".into()),
                },
                r#"{"kind":"progress","value":1.5,"total":null,"message":"step"}"#,
            ),
            (
                EventKind::Lagged {
                    first_seq: 5,
                    events: 3,
                    bytes: 96,
                    message: "m".into(),
                },
                r#"{"kind":"lagged","first_seq":5,"events":3,"bytes":96,"message":"m"}"#,
            ),
        ];
        for (kind, json) in &cases {
            assert_eq!(
                serde_json::to_string(kind).unwrap(),
                *json,
                "{}",
                kind.name()
            );
            let back: EventKind = serde_json::from_str(json).unwrap();
            assert_eq!(&back, kind);
            let as_event = serde_json::to_value(CallEvent {
                execution_id: "x".into(),
                seq: 1,
                kind: kind.clone(),
            })
            .unwrap();
            assert_eq!(as_event["kind"], kind.name());
            if let Ok(s) = serde_json::from_str::<Segment>(json) {
                assert_eq!(serde_json::to_string(&s).unwrap(), *json);
                assert_eq!(&seg(s), kind);
            } else {
                assert!(
                    ["progress", "lagged"].contains(&kind.name()),
                    "only progress, lagged and result are events alone"
                );
            }
        }
        let result = serde_json::to_value(EventKind::Result {
            result: Box::new(RunResult::empty("x".into(), "1".into())),
        })
        .unwrap();
        assert_eq!(result["kind"], "result");
        assert_eq!(
            result["result"],
            serde_json::to_value(RunResult::empty("x".into(), "1".into())).unwrap()
        );
    }
}
