//! How many spares a zygote's stage keeps: the pool's `spares`, raised by
//! the bursts of new workers that found none ready.
//!
//! The keeper forks one spare at a time, a few milliseconds each on a
//! machine with few cores (the fork, the worker's confinement and set-up,
//! its first call), so a burst of new sessions larger than the spares
//! empties the pool, and every session after that waits for a fork while
//! the dying workers of earlier sessions and the refills compete for the
//! same cores (docs/process-model.md, "Spares that follow the bursts").
//! Each ask that finds no spare ready raises the stage's target by one,
//! up to `PoolConfig::spares_max`, so the next burst of that size is
//! handed spares; a host whose sessions come one at a time never misses
//! and keeps the base number. The raise is forgotten after
//! `PoolConfig::spares_raised_for` ([`REMEMBER`] by default) without a
//! miss, and the keeper then ends the spares beyond the base.

use std::time::{Duration, Instant};

/// How long after the latest ask for a spare the keeper waits before it
/// refills a stage that still has one: the forks of a refill during a
/// burst compete with the burst's sessions for the cores, and the spares
/// raised by earlier misses carry the burst meanwhile. An empty stage is
/// refilled at once.
pub(crate) const QUIET: Duration = Duration::from_millis(20);

/// How long a raise of the target lasts after the last miss, by default
/// (`PoolConfig::spares_raised_for`).
pub const REMEMBER: Duration = Duration::from_secs(600);

/// The misses of one stage.
#[derive(Debug)]
pub(crate) struct Burst {
    /// How long a raise lasts after the last miss.
    remember: Duration,
    /// Spares added to the base target, one per miss.
    raised: usize,
    /// The last miss.
    last_miss: Option<Instant>,
}

impl Default for Burst {
    fn default() -> Self {
        Burst::new(REMEMBER)
    }
}

impl Burst {
    pub(crate) fn new(remember: Duration) -> Burst {
        Burst {
            remember,
            raised: 0,
            last_miss: None,
        }
    }

    /// How long a raise lasts after the last miss.
    pub(crate) fn remember(&self) -> Duration {
        self.remember
    }

    /// A worker was asked for and no spare was ready.
    pub(crate) fn miss(&mut self, now: Instant, base: usize, max: usize) {
        if self.expired(now) {
            self.raised = 0;
        }
        self.raised = (self.raised + 1).min(max.saturating_sub(base));
        self.last_miss = Some(now);
    }

    fn expired(&self, now: Instant) -> bool {
        self.last_miss
            .is_none_or(|t| now.saturating_duration_since(t) >= self.remember)
    }

    /// The spares to keep ready now: `base`, plus the misses lately, at
    /// most `max` (never fewer than `base`).
    pub(crate) fn target(&self, now: Instant, base: usize, max: usize) -> usize {
        if self.expired(now) {
            return base;
        }
        (base + self.raised).min(max.max(base))
    }

    /// When a raised target falls back to the base, if it is raised.
    pub(crate) fn falls_back_at(&self) -> Option<Instant> {
        self.last_miss
            .filter(|_| self.raised > 0)
            .map(|t| t + self.remember)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_miss_raises_the_target_up_to_the_most() {
        let t0 = Instant::now();
        let mut b = Burst::default();
        assert_eq!(b.target(t0, 4, 16), 4, "no miss: the base");
        for _ in 0..5 {
            b.miss(t0, 4, 16);
        }
        assert_eq!(b.target(t0, 4, 16), 9);
        for _ in 0..20 {
            b.miss(t0, 4, 16);
        }
        assert_eq!(b.target(t0, 4, 16), 16, "never past the most");
    }

    #[test]
    fn a_raise_is_forgotten_after_a_quiet_while() {
        let t0 = Instant::now();
        let mut b = Burst::default();
        b.miss(t0, 4, 16);
        b.miss(t0 + Duration::from_secs(1), 4, 16);
        assert_eq!(
            b.falls_back_at(),
            Some(t0 + Duration::from_secs(1) + REMEMBER)
        );
        let later = t0 + Duration::from_secs(1) + REMEMBER;
        assert_eq!(b.target(later - Duration::from_millis(1), 4, 16), 6);
        assert_eq!(b.target(later, 4, 16), 4);
        // A miss after the quiet while starts from the base again.
        b.miss(later, 4, 16);
        assert_eq!(b.target(later, 4, 16), 5);
    }

    #[test]
    fn a_most_below_the_base_keeps_the_base() {
        let t0 = Instant::now();
        let mut b = Burst::default();
        b.miss(t0, 4, 2);
        assert_eq!(b.target(t0, 4, 2), 4);
        assert_eq!(b.falls_back_at(), None, "nothing raised");
    }
}
