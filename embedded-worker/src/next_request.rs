//! Waiting for the next request by polling for a moment before sleeping.
//!
//! A worker that sleeps in `poll` once it has answered is woken by the
//! kernel when the next request comes: on a virtual machine whose CPU went
//! idle meanwhile, that wake-up is a good part of a short call's time
//! (tens of microseconds, as much as R spends on `1+1`). When the
//! supervisor sees a CPU to spare it asks the worker to poll without
//! sleeping for a while after its answer (`RunRequest::spin_us`): a
//! request that comes within it is read at once. A caller that sends its
//! next call later than that (an agent thinking between calls) costs the
//! worker that while once; the worker then sleeps at once after each
//! answer until the gap between an answer and the next request is short
//! again. Between polls it yields the CPU to any other process that
//! wants it.

use std::time::{Duration, Instant};

/// When the worker last answered, for how long it may poll after an
/// answer, and whether the last gap between an answer and the next
/// request was within that.
#[derive(Debug)]
pub struct NextRequest {
    answered: Option<Instant>,
    window: Duration,
    short_gaps: bool,
}

impl Default for NextRequest {
    fn default() -> Self {
        NextRequest {
            answered: None,
            window: Duration::ZERO,
            // The first answer polls: a host that runs calls back to back
            // gains from the second call on.
            short_gaps: true,
        }
    }
}

impl NextRequest {
    /// A request came: the gap since the last answer is noted.
    pub fn arrived(&mut self, now: Instant) {
        if let Some(at) = self.answered.take() {
            self.short_gaps = now.saturating_duration_since(at) <= self.window;
        }
    }

    /// The worker answered a request that allowed `spin_us` of polling.
    pub fn answered(&mut self, spin_us: u32, now: Instant) {
        self.window = Duration::from_micros(u64::from(spin_us));
        self.answered = Some(now);
    }

    /// How long to poll before sleeping now (zero: sleep at once).
    pub fn poll_for(&self) -> Duration {
        match self.answered {
            Some(_) if self.short_gaps => self.window,
            _ => Duration::ZERO,
        }
    }

    /// Polls `ready` (a non-blocking check for a request), yielding the
    /// CPU between checks, for at most [`NextRequest::poll_for`].
    /// True: a request is there.
    pub fn poll(&self, mut ready: impl FnMut() -> bool) -> bool {
        let window = self.poll_for();
        if window.is_zero() {
            return false;
        }
        let end = Instant::now() + window;
        loop {
            if ready() {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            // SAFETY: sched_yield takes no arguments and cannot fail in a
            // way that matters here.
            unsafe { libc::sched_yield() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polls_after_an_answer_until_a_gap_is_long() {
        let t0 = Instant::now();
        let mut n = NextRequest::default();
        assert_eq!(n.poll_for(), Duration::ZERO, "nothing answered yet");
        n.answered(200, t0);
        assert_eq!(n.poll_for(), Duration::from_micros(200));
        // The next request came within the window: the next answer polls.
        n.arrived(t0 + Duration::from_micros(150));
        n.answered(200, t0 + Duration::from_micros(400));
        assert_eq!(n.poll_for(), Duration::from_micros(200));
        // A caller that thinks between calls: no more polling ...
        n.arrived(t0 + Duration::from_secs(2));
        n.answered(200, t0 + Duration::from_secs(3));
        assert_eq!(n.poll_for(), Duration::ZERO);
        // ... until calls come back to back again.
        n.arrived(t0 + Duration::from_secs(3) + Duration::from_micros(50));
        n.answered(200, t0 + Duration::from_secs(4));
        assert_eq!(n.poll_for(), Duration::from_micros(200));
        // A request that allows none: none.
        n.answered(0, t0 + Duration::from_secs(5));
        assert_eq!(n.poll_for(), Duration::ZERO);
    }

    #[test]
    fn a_request_that_is_there_ends_the_poll_and_none_ends_it_in_time() {
        let mut n = NextRequest::default();
        n.answered(50_000, Instant::now());
        let mut checks = 0;
        assert!(n.poll(|| {
            checks += 1;
            checks == 3
        }));
        assert_eq!(checks, 3);
        n.answered(1_000, Instant::now());
        let t = Instant::now();
        assert!(!n.poll(|| false));
        assert!(t.elapsed() >= Duration::from_micros(1_000));
        n.answered(0, Instant::now());
        assert!(!n.poll(|| panic!("no poll without a window")));
    }
}
