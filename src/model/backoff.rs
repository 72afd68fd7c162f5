//! The one backoff every retry loop uses: exponential with full jitter.
//!
//! Pure: the caller supplies the random draw, so the sequence is unit-tested exactly.

use std::time::Duration;

/// Waits `min · 2ⁿ` capped at `max`, each drawn uniformly from `[ceiling / 2, ceiling]`: half the
/// ceiling is fixed so the wait never collapses to nothing, half is spread so that replicas
/// that lost the same broker at the same instant do not all come back at the same instant.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    ceiling: Duration,
}

impl Backoff {
    /// A backoff from `min` doubling to `max`.
    pub fn new(min: Duration, max: Duration) -> Self {
        let min = min.max(Duration::from_millis(1));
        Backoff {
            min,
            max: max.max(min),
            ceiling: min,
        }
    }

    /// The next wait, with `draw` in `[0, 1)` (`fastrand::f64()` in production).
    pub fn next_with(&mut self, draw: f64) -> Duration {
        let ceiling = self.ceiling;
        self.ceiling = (self.ceiling * 2).min(self.max);
        ceiling.mul_f64(0.5 + 0.5 * draw.clamp(0.0, 1.0))
    }

    /// The next wait, randomly jittered.
    pub fn next_wait(&mut self) -> Duration {
        self.next_with(fastrand::f64())
    }

    /// Starts again from `min` (after a success).
    pub fn reset(&mut self) {
        self.ceiling = self.min;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_jittered_within_the_upper_half_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(250), Duration::from_secs(5));
        let highs: Vec<u128> = (0..7).map(|_| b.next_with(0.999_999).as_millis()).collect();
        assert_eq!(highs, [249, 499, 999, 1999, 3999, 4999, 4999]);
        b.reset();
        let lows: Vec<u128> = (0..3).map(|_| b.next_with(0.0).as_millis()).collect();
        assert_eq!(lows, [125, 250, 500]);
    }

    /// The ceilings of a 100 ms … 1 s backoff, wait by wait.
    const CEILINGS_MS: [u64; 7] = [100, 200, 400, 800, 1000, 1000, 1000];

    /// Sleeps `wait` in paused time and returns how long the clock moved: exactly the wait, but
    /// for the timer wheel's rounding up to the next millisecond.
    async fn slept(wait: Duration) -> Duration {
        let before = tokio::time::Instant::now();
        tokio::time::sleep(wait).await;
        let slept = before.elapsed();
        assert!(
            slept >= wait && slept <= wait + Duration::from_millis(1),
            "{wait:?} slept {slept:?}"
        );
        slept
    }

    /// What a retry loop does with it (the supervisor between two connection attempts): sleep each
    /// wait in turn. With the clock paused, every sleep lies in the upper half of its doubling
    /// ceiling, the sleeps reach the cap and stay there, and a reset starts again from the bottom.
    #[tokio::test(start_paused = true)]
    async fn a_retry_loop_sleeps_within_doubling_bounds_to_the_cap_and_again_after_a_reset() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        for round in 0..50 {
            let mut total = Duration::ZERO;
            for ceiling in CEILINGS_MS.map(Duration::from_millis) {
                let slept = slept(b.next_wait()).await;
                assert!(
                    slept >= ceiling / 2 && slept <= ceiling + Duration::from_millis(1),
                    "round {round}: slept {slept:?}, ceiling {ceiling:?}"
                );
                total += slept;
            }
            let ceilings: Duration = CEILINGS_MS.map(Duration::from_millis).iter().sum();
            assert!(total >= ceilings / 2 && total <= ceilings + Duration::from_millis(7));
            b.reset();
        }
    }

    /// The same loop with fixed draws: the paused clock moves by exactly the expected amounts.
    #[tokio::test(start_paused = true)]
    async fn with_fixed_draws_the_paused_clock_moves_by_exactly_the_schedule() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let started = tokio::time::Instant::now();
        let mut at = vec![];
        for _ in CEILINGS_MS {
            slept(b.next_with(0.5)).await;
            at.push(started.elapsed().as_millis());
        }
        // three quarters of each ceiling, added up
        assert_eq!(at, [75, 225, 525, 1125, 1875, 2625, 3375]);
        b.reset();
        slept(b.next_with(0.0)).await;
        assert_eq!(
            started.elapsed().as_millis(),
            3375 + 50,
            "after a reset, half the minimum"
        );
    }

    /// Replicas that lost the broker at the same instant spread out: the draws differ.
    #[test]
    fn jitter_spreads_the_waits_of_replicas() {
        let firsts: std::collections::BTreeSet<Duration> = (0..100)
            .map(|_| Backoff::new(Duration::from_millis(100), Duration::from_secs(1)).next_wait())
            .collect();
        assert!(firsts.len() > 50, "only {} distinct first waits in 100", firsts.len());
        assert!(
            firsts
                .iter()
                .all(|w| *w >= Duration::from_millis(50) && *w <= Duration::from_millis(100))
        );
    }

    #[test]
    fn degenerate_bounds_still_wait() {
        let mut b = Backoff::new(Duration::ZERO, Duration::ZERO);
        assert!(b.next_with(0.0) > Duration::ZERO);
    }
}
