//! Events of a call while it runs: console text, conditions, plot pages and
//! progress, in the order they happened, then the final result.
//!
//! The worker sends them in batches ([`crate::FromWorker::Events`]) only
//! when the call asked for them ([`StreamMode`]); the supervisor numbers
//! them (`seq`) and hands them to the call's listener as [`CallEvent`]s.
//! The text of the console events is the text the final result keeps, so
//! their concatenation is the result's `console` (before the structured
//! result block is taken out of it).

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
/// In tail mode: nothing is sent before the call has run this long, then
/// at most this often.
pub const TAIL_INTERVAL_MS: u64 = 250;
/// In tail mode: the most text one batch carries (its end is kept).
pub const TAIL_BYTES: usize = 4096;

/// What happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum EventKind {
    /// Text written to standard output.
    Stdout {
        /// The text.
        text: String,
    },
    /// Text written to standard error.
    Stderr {
        /// The text.
        text: String,
    },
    /// A warning (R reports a top-level expression's warnings when it ends).
    Warning {
        /// The warning's message.
        message: String,
        /// The call that raised it, if any.
        call: Option<String>,
    },
    /// A message (`message()`), ending with its newline.
    Message {
        /// The text.
        text: String,
    },
    /// The error that stopped evaluation.
    Error {
        /// The error's message.
        message: String,
        /// The call that raised it, if any.
        call: Option<String>,
        /// Calls on the stack, innermost first.
        traceback: Vec<String>,
    },
    /// A plot page was finished (the next page started); the image is in
    /// the final result's `plots[index]`.
    Plot {
        /// Index into the final result's `plots`.
        index: usize,
    },
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
}

impl EventKind {
    /// The event for a segment of the capture.
    pub fn from_segment(seg: &Segment) -> Option<Self> {
        Some(match seg {
            Segment::Stdout { text } => EventKind::Stdout { text: text.clone() },
            Segment::Stderr { text } => EventKind::Stderr { text: text.clone() },
            Segment::Warning { message, call } => EventKind::Warning {
                message: message.clone(),
                call: call.clone(),
            },
            Segment::Message { text } => EventKind::Message { text: text.clone() },
            Segment::Error {
                message,
                call,
                traceback,
            } => EventKind::Error {
                message: message.clone(),
                call: call.clone(),
                traceback: traceback.clone(),
            },
            Segment::Plot { index } => EventKind::Plot { index: *index },
        })
    }

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
            EventKind::Progress { .. } => "progress",
            EventKind::Result { .. } => "result",
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
}
