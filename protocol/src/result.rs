//! The RunResult: what every surface returns for one call (CONTRACT.md).

use serde::{Deserialize, Serialize};

/// How a call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Outcome {
    /// The code ran to its end.
    Complete,
    /// The code raised an R error; evaluation stopped there, like `source()`.
    Error,
    /// R's parser rejected the code; nothing ran.
    ParseError,
    /// The call was interrupted (SIGINT) and R answered; state is kept.
    Interrupted,
    /// The call ran past its deadline.
    TimedOut,
    /// Output went past `max_output_bytes`; capture stopped, the session lives.
    OutputTruncated,
    /// A visible value renders only as HTML and none could be made (its
    /// dependencies cannot be inlined, or displays are off); the message
    /// says why.
    UnsupportedOutput,
    /// The call was cancelled while running.
    Cancelled,
    /// The session was closed.
    Closed,
    /// The worker process ended during the call (e.g. `quit()`).
    WorkerExited,
    /// The worker process failed (crash, killed by the OS, broken protocol).
    WorkerFailed,
    /// The call was dropped before it started (cancel, reset).
    NotExecuted,
    /// The worker could not be started.
    StartupFailed,
    /// The worker did not become ready within the startup timeout.
    StartupTimedOut,
    /// The request was refused before running (invalid input, full queue).
    Rejected,
}

impl Outcome {
    /// The snake_case name used on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Complete => "complete",
            Outcome::Error => "error",
            Outcome::ParseError => "parse_error",
            Outcome::Interrupted => "interrupted",
            Outcome::TimedOut => "timed_out",
            Outcome::OutputTruncated => "output_truncated",
            Outcome::UnsupportedOutput => "unsupported_output",
            Outcome::Cancelled => "cancelled",
            Outcome::Closed => "closed",
            Outcome::WorkerExited => "worker_exited",
            Outcome::WorkerFailed => "worker_failed",
            Outcome::NotExecuted => "not_executed",
            Outcome::StartupFailed => "startup_failed",
            Outcome::StartupTimedOut => "startup_timed_out",
            Outcome::Rejected => "rejected",
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Defines an enum whose first variants are the pieces of a call's output
/// (written once, here), followed by the caller's own variants; with
/// `from Segment`, also its `from_segment`. [`Segment`] and
/// [`crate::EventKind`] are both made by it, so the variants they share
/// cannot drift apart: same names, same fields, hence the same JSON.
/// A variant may have fields only the event has, in brackets after its
/// shared ones (the display event's bundle): they must have a `Default`
/// (`from_segment` fills them with it) and should be skipped when empty,
/// so that an event without them is the segment's JSON exactly.
macro_rules! output_enum {
    // The shared variants, handed to the rule in brackets.
    (@pieces [$($rule:tt)*]) => {
        $crate::result::output_enum! { $($rule)*
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
            /// A warning (`warning()` or from C code).
            Warning {
                /// The warning's message.
                message: String,
                /// The call that raised it, deparsed, if any.
                call: Option<String>,
            },
            /// A message (`message()`), text ends with its newline.
            Message {
                /// The text.
                text: String,
            },
            /// The error that stopped evaluation.
            Error {
                /// The error's message.
                message: String,
                /// The call that raised it, deparsed, if any.
                call: Option<String>,
                /// Calls on the stack, innermost first (as R's `traceback()`).
                traceback: Vec<String>,
            },
            /// A plot page; `index` points into [`RunResult::plots`].
            Plot {
                /// Index into `plots`.
                index: usize,
            },
            /// A rich output (a table, an HTML value, a plot page);
            /// `index` points into [`RunResult::displays`].
            Display {
                /// Index into `displays`.
                index: usize,
            } [
                /// The event only: the display itself (as the final
                /// result's `displays[index]` has it, but without
                /// `metadata.rvisor.last`, known only at the end), when it
                /// was sent with the event; absent when it was too large
                /// to stream (then only the result has it).
                #[serde(default, skip_serializing_if = "Option::is_none")]
                display: Option<Box<$crate::Display>>,
            ],
        }
    };
    // A segment enum: the shared fields only.
    (@enum [$($m:tt)*] $name:ident [$($extra:tt)*] segments
        $($(#[$vm:meta])* $v:ident { $($(#[$fm:meta])* $f:ident: $t:ty,)* }
          $([ $($(#[$em:meta])* $e:ident: $et:ty,)* ])?,)*) => {
        $($m)*
        pub enum $name {
            $($(#[$vm])* $v { $($(#[$fm])* $f: $t,)* },)*
            $($extra)*
        }
    };
    // An event enum: with the fields only events have.
    (@enum [$($m:tt)*] $name:ident [$($extra:tt)*] events
        $($(#[$vm:meta])* $v:ident { $($(#[$fm:meta])* $f:ident: $t:ty,)* }
          $([ $($(#[$em:meta])* $e:ident: $et:ty,)* ])?,)*) => {
        $($m)*
        pub enum $name {
            $($(#[$vm])* $v {
                $($(#[$fm])* $f: $t,)*
                $($($(#[$em])* $e: $et,)*)?
            },)*
            $($extra)*
        }
    };
    (@from $name:ident $seg:ident
        $($(#[$vm:meta])* $v:ident { $($(#[$fm:meta])* $f:ident: $t:ty,)* }
          $([ $($(#[$em:meta])* $e:ident: $et:ty,)* ])?,)*) => {
        impl $name {
            /// The event for a segment of the capture (its event-only
            /// fields empty).
            pub fn from_segment(seg: &$seg) -> Option<Self> {
                Some(match seg {
                    $($seg::$v { $($f,)* } => Self::$v {
                        $($f: $f.clone(),)*
                        $($($e: Default::default(),)*)?
                    },)*
                })
            }
        }
    };
    ($(#[$m:meta])* pub enum $name:ident { $($extra:tt)* }) => {
        $crate::result::output_enum! { @pieces [@enum [$(#[$m])*] $name [$($extra)*] segments] }
    };
    ($(#[$m:meta])* pub enum $name:ident from $seg:ident { $($extra:tt)* }) => {
        $crate::result::output_enum! { @pieces [@enum [$(#[$m])*] $name [$($extra)*] events] }
        $crate::result::output_enum! { @pieces [@from $name $seg] }
    };
}
pub(crate) use output_enum;

output_enum! {
    /// One piece of a call's output, in the order it happened.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
    #[serde(tag = "kind", rename_all = "snake_case")]
    #[non_exhaustive]
    pub enum Segment {}
}

impl Segment {
    /// The text a person sees at the R prompt for this segment, or `None`
    /// when it has no console text (plots).
    pub fn console_text(&self) -> Option<String> {
        match self {
            Segment::Stdout { text } | Segment::Stderr { text } | Segment::Message { text } => {
                Some(text.clone())
            }
            Segment::Warning { message, call } => Some(match call {
                Some(call) => format!("Warning message:\nIn {call} : {message}\n"),
                None => format!("Warning message:\n{message}\n"),
            }),
            Segment::Error { message, call, .. } => Some(match call {
                Some(call) => format!("Error in {call} : {message}\n"),
                None => format!("Error: {message}\n"),
            }),
            Segment::Plot { .. } | Segment::Display { .. } => None,
        }
    }

    /// The warning in the one-line form of `RunResult::warnings`.
    pub fn warning_line(message: &str, call: Option<&str>) -> String {
        match call {
            Some(call) => format!("In {call} : {message}"),
            None => message.to_string(),
        }
    }
}

/// The error of a call that did not complete.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorInfo {
    /// What went wrong, for a person.
    pub message: String,
    /// The R call that raised the error, deparsed.
    pub call: Option<String>,
    /// Calls on the stack, innermost first.
    #[serde(default)]
    pub traceback: Vec<String>,
    /// Parse errors: the line (1-based).
    pub line: Option<u32>,
    /// Parse errors: the column (1-based).
    pub column: Option<u32>,
    /// True when the call ended because it reached its deadline.
    #[serde(default)]
    pub timed_out: bool,
}

impl ErrorInfo {
    /// An error with only a message.
    pub fn message(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            ..Self::default()
        }
    }
}

/// A captured plot page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Plot {
    /// Always `image/png` for now.
    pub mime: String,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// The image, base64 (standard alphabet, padded).
    pub data_base64: String,
}

/// Which session and incarnation of it produced a result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SessionInfo {
    /// Session id.
    pub id: String,
    /// Incremented each time the session's worker is replaced.
    pub generation: u64,
    /// True for the first result after the worker was (re)started.
    pub fresh: bool,
    /// Why the previous worker was replaced, if it was.
    pub reset_reason: Option<String>,
    /// Set on the first result after the session's state was restored from
    /// a checkpoint into a new worker (after hibernation or a kill); null
    /// otherwise.
    #[serde(default)]
    pub restored: Option<Restored>,
}

/// What a restore brought back (see `SessionInfo::restored`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Restored {
    /// Seconds between the checkpoint and the restore.
    pub checkpoint_age_seconds: f64,
    /// When the checkpoint was taken (RFC 3339, UTC).
    pub checkpoint_at: String,
    /// Objects of the global environment that were not saved faithfully and
    /// so are missing (external pointers, connections), by name.
    pub lost: Vec<String>,
    /// Why the session was restored: `hibernated`, or the reset reason of
    /// the worker that ended (`timeout`, `crash`, `killed`, ...).
    pub reason: String,
    /// Calls whose work the restored state does not hold, by execution
    /// id, oldest first: they ran after the checkpoint, and their state
    /// was not saved before the worker or the server ended (a checkpoint
    /// that failed, or the seconds before the next one). At most
    /// [`MAX_LOST_CALLS`], the most recent; `lost_call_count` counts all.
    #[serde(default)]
    pub lost_calls: Vec<String>,
    /// How many calls were lost in all (0: none known).
    #[serde(default)]
    pub lost_call_count: u64,
}

/// Most execution ids [`Restored::lost_calls`] lists.
pub const MAX_LOST_CALLS: usize = 100;

/// Resources the call used.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Usage {
    /// CPU time (user + system) of the worker during the call.
    pub cpu_ms: f64,
    /// Peak resident set size of the worker so far.
    pub peak_rss_bytes: u64,
    /// Bytes of output produced (console text and plots), counted up to the cap.
    pub output_bytes: u64,
}

/// The result of one call, the same on every surface.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunResult {
    /// [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Unique per call.
    pub execution_id: String,
    /// The code as run.
    pub code: String,
    /// How the call ended.
    pub outcome: Outcome,
    /// True for `complete`, and for `output_truncated` when the code succeeded.
    pub success: bool,
    /// Stdout and stderr interleaved in the order written.
    pub console: String,
    /// The same output, typed.
    pub segments: Vec<Segment>,
    /// Warnings in `In call : message` form.
    pub warnings: Vec<String>,
    /// What went wrong, if anything did.
    pub error: Option<ErrorInfo>,
    /// Plot pages, in order.
    pub plots: Vec<Plot>,
    /// The structured result block, parsed.
    pub result: Option<serde_json::Value>,
    /// Evaluation time in the worker.
    pub duration_ms: f64,
    /// R's version, e.g. "4.2.2".
    pub r_version: String,
    /// The session that ran the call.
    pub session: SessionInfo,
    /// Resources used.
    pub usage: Usage,
    /// True when output was cut at `max_output_bytes`.
    pub truncated: bool,
    /// When a script was refused by validation: the findings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<serde_json::Value>,
    /// Tables the code published with `rvisor_publish()` (data pointers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub published: Vec<serde_json::Value>,
    /// Which parts were cut or dropped at a cap (see [`bounds`]), e.g.
    /// `["error.message", "warnings"]`; empty (and absent) when nothing was.
    /// `truncated` is true whenever this is not empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub truncated_fields: Vec<String>,
    /// Rich outputs in order, each a MIME bundle shaped like Jupyter's
    /// `display_data` content (see [`crate::display`]); a `display`
    /// segment marks where each happened. Empty (and absent) when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub displays: Vec<crate::Display>,
    /// Files the call wrote (docs/files.md); absent when none. A one-shot
    /// run's are stored (`uri` `/v1/artifacts/{execution_id}/{name}`); a
    /// session call's are the session's files it made or changed between
    /// being queued and its end, a failed or timed-out call's included,
    /// (`uri` `/v1/sessions/{id}/files/{name}`), at most `max_files` and
    /// `max_call_bytes` of them (a warning says when some were left out).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub artifacts: Vec<crate::artifact::Artifact>,
    /// Packages from libraries after R's own (a tenant's installed
    /// packages, docs/packages.md) loaded when the call ended, for
    /// reproducibility; absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub packages_loaded: Vec<LoadedPackage>,
}

/// A package a call had loaded from a tenant's library.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LoadedPackage {
    /// Package name.
    pub name: String,
    /// Its version, as loaded.
    pub version: String,
    /// The repository it was installed from, when the service knows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repository: Option<String>,
}

/// Caps on what one call sends back, so a result stays small whatever R
/// produces (docs/output-and-plots.md, "Bounds"). The worker applies them
/// (in R where it can, before a huge string is copied, and again in Rust);
/// the supervisor refuses a result frame over [`bounds::result_frame_limit`].
pub mod bounds {
    /// Bytes kept of an error message (R itself cuts its own at 8,170).
    pub const ERROR_MESSAGE_BYTES: usize = 8 * 1024;
    /// Bytes kept of a deparsed call (an error's or a warning's).
    pub const CALL_BYTES: usize = 1024;
    /// Frames kept of a traceback (a line says how many more there were).
    pub const TRACEBACK_FRAMES: usize = 50;
    /// Bytes kept of one traceback frame.
    pub const TRACEBACK_FRAME_BYTES: usize = 1024;
    /// Bytes kept of a warning message.
    pub const WARNING_MESSAGE_BYTES: usize = 8 * 1024;
    /// Warnings kept per call; a notice counts the rest.
    pub const MAX_WARNINGS: usize = 50;
    /// Largest structured result block (JSON text), in bytes; a larger one
    /// gives `result: null` and a warning.
    pub const RESULT_JSON_BYTES: usize = 1024 * 1024;
    /// Plot pages kept per call; later pages are dropped.
    pub const MAX_PLOTS: usize = 64;
    /// Raw output (fds 1 and 2, bypassing R's console) the supervisor
    /// buffers per stream between two frames; it also counts against the
    /// call's output cap.
    pub const RAW_BYTES: usize = 16 * 1024 * 1024;
    /// Fixed part of [`result_frame_limit`]: room for the code, the error,
    /// the warnings and the result block, which have caps of their own.
    pub const FRAME_OVERHEAD_BYTES: u64 = 8 * 1024 * 1024;

    /// Largest result frame accepted for a call with this output cap: four
    /// times the cap (console text appears in `console` and `segments`,
    /// warnings also in `warnings`, plots grow by a third in base64) plus
    /// [`FRAME_OVERHEAD_BYTES`]. The worker shrinks a result that would not
    /// fit (text that JSON escaping blew up); a frame over it means a broken
    /// worker, which the supervisor kills (`worker_failed`).
    pub fn result_frame_limit(max_output_bytes: u64) -> u64 {
        max_output_bytes
            .saturating_mul(4)
            .saturating_add(FRAME_OVERHEAD_BYTES)
    }

    /// The longest prefix of `s` of at most `max` bytes that ends on a
    /// character boundary, and whether anything was cut.
    pub fn cut(s: &str, max: usize) -> (&str, bool) {
        if s.len() <= max {
            return (s, false);
        }
        let mut end = max;
        while end > 0 && !s.is_char_boundary(end) {
            end -= 1;
        }
        (&s[..end], true)
    }
}

/// The RunResult fields CONTRACT.md fixes; every surface must carry them.
pub const RUN_RESULT_FIELDS: [&str; 16] = [
    "schema_version",
    "execution_id",
    "code",
    "outcome",
    "success",
    "console",
    "segments",
    "warnings",
    "error",
    "plots",
    "result",
    "duration_ms",
    "r_version",
    "session",
    "usage",
    "truncated",
];

impl RunResult {
    /// A result for a call that produced nothing (rejected, not executed,
    /// failed to start...), with `message` as its error.
    pub fn failed(execution_id: String, code: String, outcome: Outcome, message: String) -> Self {
        let mut r = Self::empty(execution_id, code);
        r.outcome = outcome;
        r.success = false;
        r.push_segment(Segment::Stderr {
            text: format!("{message}\n"),
        });
        r.error = Some(ErrorInfo::message(message));
        r
    }

    /// A complete, successful result with no output.
    pub fn empty(execution_id: String, code: String) -> Self {
        Self {
            schema_version: crate::SCHEMA_VERSION,
            execution_id,
            code,
            outcome: Outcome::Complete,
            success: true,
            console: String::new(),
            segments: Vec::new(),
            warnings: Vec::new(),
            error: None,
            plots: Vec::new(),
            result: None,
            duration_ms: 0.0,
            r_version: String::new(),
            session: SessionInfo::default(),
            usage: Usage::default(),
            truncated: false,
            validation: None,
            published: Vec::new(),
            truncated_fields: Vec::new(),
            displays: Vec::new(),
            artifacts: Vec::new(),
            packages_loaded: Vec::new(),
        }
    }

    /// Appends a segment and its console text.
    pub fn push_segment(&mut self, seg: Segment) {
        if let Some(text) = seg.console_text() {
            self.console.push_str(&text);
        }
        if let Segment::Warning { message, call } = &seg {
            self.warnings
                .push(Segment::warning_line(message, call.as_deref()));
        }
        self.segments.push(seg);
    }

    /// Records that `field` was cut at a cap (once) and sets `truncated`.
    pub fn mark_truncated(&mut self, field: &str) {
        self.truncated = true;
        if !self.truncated_fields.iter().any(|f| f == field) {
            self.truncated_fields.push(field.to_string());
        }
    }

    /// Puts a line of text (a notice from rvisor, e.g. that the session was
    /// restarted) before all other output.
    pub fn prepend_notice(&mut self, line: &str) {
        let text = format!("{line}\n");
        self.console.insert_str(0, &text);
        self.segments.insert(0, Segment::Stderr { text });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_names_match_serde() {
        for o in [
            Outcome::Complete,
            Outcome::ParseError,
            Outcome::OutputTruncated,
            Outcome::StartupTimedOut,
            Outcome::WorkerExited,
        ] {
            assert_eq!(serde_json::to_value(o).unwrap(), o.as_str());
        }
    }

    #[test]
    fn wire_names_follow_the_contract() {
        let mut r = RunResult::empty("e1".into(), "1+1".into());
        r.push_segment(Segment::Stdout {
            text: "[1] 2\n".into(),
        });
        r.push_segment(Segment::Warning {
            message: "NaNs produced".into(),
            call: Some("log(-1)".into()),
        });
        r.push_segment(Segment::Plot { index: 0 });
        let v = serde_json::to_value(&r).unwrap();
        for key in RUN_RESULT_FIELDS {
            assert!(v.get(key).is_some(), "missing {key}");
        }
        assert_eq!(v["segments"][0]["kind"], "stdout");
        assert_eq!(v["segments"][1]["kind"], "warning");
        assert_eq!(v["segments"][1]["call"], "log(-1)");
        assert_eq!(v["segments"][2]["kind"], "plot");
        assert_eq!(v["warnings"][0], "In log(-1) : NaNs produced");
        assert_eq!(
            r.console,
            "[1] 2\nWarning message:\nIn log(-1) : NaNs produced\n"
        );
        for key in ["id", "generation", "fresh", "reset_reason"] {
            assert!(v["session"].get(key).is_some(), "missing session.{key}");
        }
        for key in ["cpu_ms", "peak_rss_bytes", "output_bytes"] {
            assert!(v["usage"].get(key).is_some(), "missing usage.{key}");
        }
        let back: RunResult = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn truncated_fields_are_additive_and_cut_keeps_characters_whole() {
        let mut r = RunResult::empty("e".into(), "x".into());
        let v = serde_json::to_value(&r).unwrap();
        assert!(v.get("truncated_fields").is_none(), "absent when empty");
        r.mark_truncated("error.message");
        r.mark_truncated("error.message");
        assert!(r.truncated);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["truncated_fields"], serde_json::json!(["error.message"]));
        assert_eq!(bounds::cut("abcé", 4), ("abc", true));
        assert_eq!(bounds::cut("abcé", 5), ("abcé", false));
        assert_eq!(bounds::cut("é", 1), ("", true));
        assert_eq!(
            bounds::result_frame_limit(8 << 20),
            32 * 1024 * 1024 + bounds::FRAME_OVERHEAD_BYTES
        );
    }

    #[test]
    fn notice_goes_first() {
        let mut r = RunResult::empty("e".into(), "x".into());
        r.push_segment(Segment::Stdout { text: "a\n".into() });
        r.prepend_notice("rvisor: started a fresh R session (timeout)");
        assert!(r.console.starts_with("rvisor: started"));
        assert!(matches!(r.segments[0], Segment::Stderr { .. }));
    }
}
