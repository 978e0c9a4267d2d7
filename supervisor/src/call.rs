//! One call's settings, the checks made before it is sent, and the notes
//! the supervisor adds to a result when it stopped the call itself
//! (timeout, cancel, CPU limit).

use crate::error::CallError;
use rvisor_protocol::{
    DisplayOptions, ErrorInfo, Outcome, RunResult, Segment, DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_PLOT_HEIGHT, DEFAULT_PLOT_WIDTH, MAX_PLOT_SIDE,
};
use std::path::PathBuf;
use std::time::Duration;

/// Largest accepted code, in bytes.
pub const MAX_CODE_BYTES: usize = 256 * 1024;

/// Per-call settings.
#[derive(Debug, Clone)]
pub struct CallOptions {
    /// Deadline of the call; `None` for no limit.
    pub timeout: Option<Duration>,
    /// How long R gets to answer an interrupt before the worker is killed.
    pub grace: Duration,
    /// Plot size in pixels.
    pub plot_width: u32,
    /// Plot size in pixels.
    pub plot_height: u32,
    /// Cap on console text plus plot bytes.
    pub max_output_bytes: u64,
    /// Directory to run in.
    pub working_dir: Option<PathBuf>,
    /// CPU time the call may use (enforced by the kernel, RLIMIT_CPU). Only
    /// for workers used once: the limit cannot be raised again.
    pub cpu_limit: Option<Duration>,
    /// Which rich results the call makes (tables, HTML values, plot
    /// formats; docs/output-and-plots.md, "Displays").
    pub display: DisplayOptions,
}

impl Default for CallOptions {
    fn default() -> Self {
        Self {
            timeout: Some(Duration::from_secs(30)),
            grace: Duration::from_secs(2),
            plot_width: DEFAULT_PLOT_WIDTH,
            plot_height: DEFAULT_PLOT_HEIGHT,
            max_output_bytes: DEFAULT_MAX_OUTPUT_BYTES,
            working_dir: None,
            cpu_limit: None,
            display: DisplayOptions::default(),
        }
    }
}

impl CallOptions {
    /// The options of a one-shot run with `timeout` (`None`: no limit):
    /// the rule every one-shot surface shares (the service's runs, `rvisor
    /// batch`), that a run may use no more CPU time than its wall-clock
    /// timeout.
    pub fn one_shot(timeout: Option<Duration>) -> Self {
        Self {
            timeout,
            cpu_limit: timeout,
            ..Self::default()
        }
    }
}

/// Checks a call before it is sent: non-empty code within
/// [`MAX_CODE_BYTES`], plot sides within 1..=[`MAX_PLOT_SIDE`], a non-zero
/// output cap, display limits in range. The message says what to change.
pub fn validate_call(code: &str, opts: &CallOptions) -> Result<(), CallError> {
    if code.trim().is_empty() {
        return Err(CallError::Empty);
    }
    if code.len() > MAX_CODE_BYTES {
        return Err(CallError::TooLarge {
            bytes: code.len(),
            limit: MAX_CODE_BYTES,
        });
    }
    for (name, value) in [
        ("plot_width", opts.plot_width),
        ("plot_height", opts.plot_height),
    ] {
        if value == 0 || value > MAX_PLOT_SIDE {
            return Err(CallError::PlotSize {
                name,
                value,
                max: MAX_PLOT_SIDE,
            });
        }
    }
    if opts.max_output_bytes == 0 {
        return Err(CallError::NoOutput);
    }
    if let Some(why) = opts.display.problem() {
        return Err(CallError::Display(why));
    }
    Ok(())
}

/// The code as R reads it from a file: Windows line endings (CR LF)
/// become LF, as R's file reader makes them for `Rscript FILE` and
/// `source()`. R's parser itself takes a CR for a stray character
/// ("unexpected input"), so code written on Windows, or sent by a client
/// that ends lines with CR LF, would fail before anything ran. A CR alone
/// (not before LF) is left as it is, as R leaves it.
///
/// ```
/// assert_eq!(rvisor::unix_newlines("x <- 1\r\ny <- 2\r\n"), "x <- 1\ny <- 2\n");
/// assert_eq!(rvisor::unix_newlines("cat('a\rb')"), "cat('a\rb')");
/// ```
pub fn unix_newlines(code: &str) -> std::borrow::Cow<'_, str> {
    if code.contains("\r\n") {
        std::borrow::Cow::Owned(code.replace("\r\n", "\n"))
    } else {
        std::borrow::Cow::Borrowed(code)
    }
}

/// Why the supervisor interrupted a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    Timeout,
    Cancel,
}

/// Says in `res` that the supervisor stopped the call, and why; `killed`:
/// R did not answer the interrupt, so the worker was killed.
pub(crate) fn mark_stopped(
    res: &mut RunResult,
    why: Stop,
    timeout: Option<Duration>,
    killed: bool,
) {
    match why {
        Stop::Timeout => mark_timed_out(res, timeout, killed),
        Stop::Cancel => mark_cancelled(res, killed),
    }
}

fn mark_timed_out(res: &mut RunResult, timeout: Option<Duration>, killed: bool) {
    let secs = timeout.map(|t| t.as_secs_f64()).unwrap_or(0.0);
    let message = if killed {
        format!(
            "the call exceeded its timeout of {secs} s and R did not answer the interrupt, so \
             the worker was killed; the session's state is lost"
        )
    } else {
        format!(
            "the call exceeded its timeout of {secs} s and was interrupted; the session's \
             variables are kept"
        )
    };
    res.push_segment(Segment::Stderr {
        text: format!("rvisor: {message}\n"),
    });
    res.outcome = Outcome::TimedOut;
    res.success = false;
    let mut err = res.error.take().unwrap_or_default();
    err.message = message;
    err.timed_out = true;
    res.error = Some(err);
}

fn mark_cancelled(res: &mut RunResult, killed: bool) {
    let message = if killed {
        "the call was cancelled; R did not answer the interrupt, so the worker was killed and \
         the session's state is lost"
    } else {
        "the call was cancelled; the session's variables are kept"
    };
    res.push_segment(Segment::Stderr {
        text: format!("rvisor: {message}\n"),
    });
    res.outcome = Outcome::Cancelled;
    res.success = false;
    let mut err = res.error.take().unwrap_or_default();
    err.message = message.to_string();
    res.error = Some(err);
}

/// The result of a call stopped at its CPU time limit: the raw output it
/// wrote, then the notice.
pub(crate) fn cpu_limit_result(
    execution_id: String,
    code: &str,
    r_version: &str,
    [out, err]: [Vec<u8>; 2],
) -> RunResult {
    let mut res = RunResult::empty(execution_id, code.into());
    res.r_version = r_version.to_string();
    push_raw(&mut res, out, err);
    let message =
        "the call used up its CPU time limit (counting the processes it started) and was stopped";
    res.push_segment(Segment::Stderr {
        text: format!("rvisor: {message}\n"),
    });
    res.outcome = Outcome::TimedOut;
    res.success = false;
    res.error = Some(ErrorInfo {
        timed_out: true,
        ..ErrorInfo::message(message)
    });
    res
}

/// Appends raw output (the worker's fds 1 and 2) to a result.
pub(crate) fn push_raw(res: &mut RunResult, out: Vec<u8>, err: Vec<u8>) {
    if !out.is_empty() {
        res.push_segment(Segment::Stdout {
            text: String::from_utf8_lossy(&out).into_owned(),
        });
    }
    if !err.is_empty() {
        res.push_segment(Segment::Stderr {
            text: String::from_utf8_lossy(&err).into_owned(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_checked_before_they_are_sent() {
        let ok = CallOptions::default();
        assert_eq!(validate_call("1", &ok), Ok(()));
        assert_eq!(validate_call("  \n", &ok), Err(CallError::Empty));
        let big = "x".repeat(MAX_CODE_BYTES + 1);
        assert!(matches!(
            validate_call(&big, &ok),
            Err(CallError::TooLarge { .. })
        ));
        let wide = CallOptions {
            plot_width: 0,
            ..CallOptions::default()
        };
        let e = validate_call("1", &wide).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("plot_width is 0; it must be between 1 and {MAX_PLOT_SIDE} pixels")
        );
        let mute = CallOptions {
            max_output_bytes: 0,
            ..CallOptions::default()
        };
        assert_eq!(validate_call("1", &mute), Err(CallError::NoOutput));
    }
}
