//! How many spares a zygote's stage keeps: the pool's `spares`, raised by
//! the bursts of new workers that found none ready.
//!
//! The keeper forks one spare at a time, a few milliseconds each on a
//! machine with few cores (the fork, the worker's confinement and set-up,
//! its first call), so a burst of new sessions larger than the spares
//! empties the pool, and every session after that waits for a fork while
//! the dying workers of earlier sessions and the refills compete for the
//! same cores (docs/process-model.md, "Spares that follow the bursts").
//! An ask that finds no spare ready raises the stage's target to the
//! number of asks in its burst so far (asks less than [`QUIET`] apart),
//! and by one at least, up to `PoolConfig::spares_max`, so the next burst
//! of that size is handed spares. (By one alone was too slow: in a burst
//! that empties the pool the keeper refills a spare between two asks, so
//! only every other ask missed, and ten sessions back to back needed four
//! bursts before spares served them all.) A host whose sessions come one
//! at a time never misses and keeps the base number. The raise is
//! forgotten after `PoolConfig::spares_raised_for` ([`REMEMBER`] by
//! default) without a miss, and the keeper then ends the spares beyond
//! the base.

use std::time::{Duration, Instant};

/// How long after the latest ask for a spare the keeper waits before it
/// refills a stage that still has one: the forks of a refill during a
/// burst compete with the burst's sessions for the cores, and the spares
/// raised by earlier misses carry the burst meanwhile. An empty stage is
/// refilled at once. Asks less than this apart are one burst.
pub(crate) const QUIET: Duration = Duration::from_millis(20);

/// How long a raise of the target lasts after the last miss, by default
/// (`PoolConfig::spares_raised_for`).
pub const REMEMBER: Duration = Duration::from_secs(600);

/// The asks of one stage, and the misses among them.
#[derive(Debug)]
pub(crate) struct Burst {
    /// How long a raise lasts after the last miss.
    remember: Duration,
    /// Spares added to the base target by misses.
    raised: usize,
    /// The last miss.
    last_miss: Option<Instant>,
    /// Asks in the burst under way (each less than [`QUIET`] after the
    /// one before).
    run: usize,
    /// The latest ask.
    last_ask: Option<Instant>,
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
            run: 0,
            last_ask: None,
        }
    }

    /// Forgets the asks and misses (the stage's zygote was replaced).
    pub(crate) fn reset(&mut self) {
        *self = Burst::new(self.remember);
    }

    /// A worker was asked for; `hit`: a spare was ready.
    pub(crate) fn ask(&mut self, now: Instant, hit: bool, base: usize, max: usize) {
        let close = self
            .last_ask
            .is_some_and(|t| now.saturating_duration_since(t) < QUIET);
        self.run = if close { self.run + 1 } else { 1 };
        self.last_ask = Some(now);
        if hit {
            return;
        }
        if self.expired(now) {
            self.raised = 0;
        }
        let wanted = (self.raised + 1).max(self.run.saturating_sub(base));
        self.raised = wanted.min(max.saturating_sub(base));
        self.last_miss = Some(now);
    }

    fn expired(&self, now: Instant) -> bool {
        self.last_miss
            .is_none_or(|t| now.saturating_duration_since(t) >= self.remember)
    }

    /// The spares to keep ready now: `base`, plus the raise of late
    /// misses, at most `max` (never fewer than `base`).
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

    /// Asks 1 ms apart from `t0`, `hits` saying which found a spare.
    fn burst(b: &mut Burst, t0: Instant, hits: &[bool]) {
        for (i, &hit) in hits.iter().enumerate() {
            b.ask(t0 + Duration::from_millis(i as u64), hit, 4, 16);
        }
    }

    #[test]
    fn a_miss_raises_the_target_to_the_burst_so_far_up_to_the_most() {
        let t0 = Instant::now();
        let mut b = Burst::default();
        burst(&mut b, t0, &[true; 4]);
        assert_eq!(b.target(t0, 4, 16), 4, "no miss: the base");
        // Ten asks, the keeper refilling one spare between two of them
        // once the four are gone: the target is the burst's size.
        let t1 = t0 + Duration::from_secs(1);
        let ten = [
            true, true, true, true, false, true, false, true, false, false,
        ];
        burst(&mut b, t1, &ten);
        assert_eq!(b.target(t1, 4, 16), 10);
        // A lone ask that misses later raises it by one.
        let t2 = t1 + Duration::from_secs(1);
        burst(&mut b, t2, &[false]);
        assert_eq!(b.target(t2, 4, 16), 11);
        let t3 = t2 + Duration::from_secs(1);
        burst(&mut b, t3, &[false; 30]);
        assert_eq!(b.target(t3, 4, 16), 16, "never past the most");
    }

    #[test]
    fn a_raise_is_forgotten_after_a_quiet_while() {
        let t0 = Instant::now();
        let mut b = Burst::default();
        b.ask(t0, false, 4, 16);
        let t1 = t0 + Duration::from_secs(1);
        b.ask(t1, false, 4, 16);
        assert_eq!(b.falls_back_at(), Some(t1 + REMEMBER));
        let later = t1 + REMEMBER;
        assert_eq!(b.target(later - Duration::from_millis(1), 4, 16), 6);
        assert_eq!(b.target(later, 4, 16), 4);
        // A miss after the quiet while starts from the base again.
        b.ask(later, false, 4, 16);
        assert_eq!(b.target(later, 4, 16), 5);
    }

    #[test]
    fn a_most_below_the_base_keeps_the_base() {
        let t0 = Instant::now();
        let mut b = Burst::default();
        b.ask(t0, false, 4, 2);
        assert_eq!(b.target(t0, 4, 2), 4);
        assert_eq!(b.falls_back_at(), None, "nothing raised");
    }
}
