//! Polling for a moment instead of sleeping, while the host has a CPU to
//! spare.
//!
//! A short call is mostly wake-ups: the session's runner sleeps until the
//! worker answers, the worker sleeps until the next request comes. On a
//! virtual machine whose CPUs go idle in between, each wake-up costs tens
//! of microseconds, as much as R spends on `1+1`. So, while few calls run
//! in this process for the CPUs it may use, the runner polls the worker's
//! socket for up to [`WINDOW`] after it sends a call (when the worker's
//! last call was answered within that), and asks the worker to poll for
//! its next request as long after it answers (`RunRequest::spin_us`; the
//! worker stops doing so while its caller leaves longer gaps). Both yield
//! the CPU between polls. With more calls running than that, nobody polls:
//! the CPUs are better spent on the calls.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// How long a runner polls for an answer, and a worker for its next
/// request, before sleeping. About three times what a worker takes for
/// `1+1` or `stop("boom")` from request to answer.
pub(crate) const WINDOW: Duration = Duration::from_micros(WINDOW_US as u64);

/// [`WINDOW`] in microseconds, as a request carries it.
const WINDOW_US: u32 = 200;

/// Calls being sent or answered in this process.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// The CPUs this process may use (its affinity and cgroup quota).
fn cpus() -> usize {
    static CPUS: OnceLock<usize> = OnceLock::new();
    *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Whether `in_flight` calls, each with a runner and a worker that may
/// poll, leave a CPU for each of those to poll on.
fn spare(in_flight: usize, cpus: usize) -> bool {
    in_flight.saturating_mul(2) <= cpus
}

/// One call in flight, counted while it lives.
#[derive(Debug)]
pub(crate) struct Flight {
    spare: bool,
}

impl Flight {
    /// Counts a call that starts now.
    pub(crate) fn start() -> Flight {
        let n = IN_FLIGHT.fetch_add(1, Ordering::Relaxed) + 1;
        Flight {
            spare: spare(n, cpus()),
        }
    }

    /// Whether the host had a CPU to spare for polling when it started.
    pub(crate) fn spare(&self) -> bool {
        self.spare
    }

    /// How long the worker may poll for its next request after answering
    /// this call (`RunRequest::spin_us`): [`WINDOW`] with a CPU to spare.
    pub(crate) fn spin_us(&self) -> u32 {
        if self.spare {
            WINDOW_US
        } else {
            0
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polls_only_with_two_cpus_per_call_in_flight() {
        assert!(!spare(1, 1), "one CPU: polling would only slow the worker");
        assert!(spare(1, 2));
        assert!(!spare(2, 2));
        assert!(spare(4, 8));
        assert!(!spare(5, 8));
    }
}
