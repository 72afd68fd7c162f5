//! When the next message leaves a tier: each tier is a FIFO queue with one TTL, so a message
//! put into it at `t` leaves at `t + ttl`, in the order they went in. [`LeaveTimes`] keeps,
//! for one tier, how many messages leave in each time bucket; the front bucket that has not
//! passed is the next leave time. Buckets are a 1024th of the TTL (at least 1 ms), so a tier
//! holds at most ~1025 buckets however many messages wait: memory stays flat in the number
//! waiting, and the time is exact to a 1024th of the tier (1 ms for a 1 s tier).
//!
//! It knows only what this process put into the tier since it started (other replicas, and
//! messages from before a restart, are not in it): an estimate for operators, never used to
//! decide anything.

use std::collections::VecDeque;

/// Buckets per TTL.
const BUCKETS_PER_TTL: u64 = 1024;

/// The leave times of one tier's messages, in buckets.
#[derive(Debug, Clone)]
pub struct LeaveTimes {
    ttl_ms: u64,
    bucket_ms: u64,
    /// `(bucket end ms, messages)`, oldest first.
    buckets: VecDeque<(u64, u64)>,
}

impl LeaveTimes {
    /// For a tier of `ttl_ms`.
    pub fn new(ttl_ms: u64) -> Self {
        LeaveTimes {
            ttl_ms,
            bucket_ms: (ttl_ms / BUCKETS_PER_TTL).max(1),
            buckets: VecDeque::new(),
        }
    }

    /// A message went into the tier at `now_ms`.
    pub fn entered(&mut self, now_ms: u64) {
        let leave = now_ms.saturating_add(self.ttl_ms);
        let end = leave.div_ceil(self.bucket_ms).saturating_mul(self.bucket_ms);
        match self.buckets.back_mut() {
            Some((last, n)) if *last >= end => *n += 1, // same bucket, or the clock stepped back
            _ => self.buckets.push_back((end, 1)),
        }
    }

    /// Drops what has left by `now_ms`; the next leave time (the end of its bucket) and how many
    /// messages this process put in that have not left yet.
    pub fn next(&mut self, now_ms: u64) -> Option<(u64, u64)> {
        while self.buckets.front().is_some_and(|(end, _)| *end <= now_ms) {
            self.buckets.pop_front();
        }
        let next = self.buckets.front()?.0;
        Some((next, self.buckets.iter().map(|(_, n)| n).sum()))
    }

    /// Buckets held (for the memory bound).
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_leave_time_is_the_oldest_entry_plus_the_ttl() {
        let mut t = LeaveTimes::new(1_000);
        assert_eq!(t.next(0), None);
        t.entered(10_000);
        t.entered(10_000);
        t.entered(10_400);
        assert_eq!(t.next(10_500), Some((11_000, 3)));
        assert_eq!(t.next(11_000), Some((11_400, 1)), "the first two left at 11 000");
        assert_eq!(t.next(11_400), None);
    }

    #[test]
    fn buckets_stay_bounded_however_many_enter() {
        let ttl = 3_600_000; // 1 h: buckets of 3 515 ms
        let mut t = LeaveTimes::new(ttl);
        for i in 0..1_000_000u64 {
            t.entered(i * 7); // 1 000 000 messages over ~2 h
        }
        assert!(t.buckets() <= 2 * BUCKETS_PER_TTL as usize + 2, "{}", t.buckets());
        // at 5 000 000 ms the next to leave went in at 1 400 000 ms
        let (next, waiting) = t.next(5_000_000).unwrap();
        assert!((5_000_000..=5_000_000 + ttl / 1024 + 1).contains(&next), "{next}");
        // the ones that went in after 1 400 000 ms, and the rest of their bucket (≤ 3 515 ms of them)
        assert!((800_000..=800_000 + 3_515 / 7 + 1).contains(&waiting), "{waiting}");
        // within an hour's window at most ~1025 buckets remain once the passed ones are dropped
        t.next(7_000_000);
        assert!(t.buckets() <= BUCKETS_PER_TTL as usize + 1, "{}", t.buckets());
    }

    #[test]
    fn a_clock_stepping_back_counts_into_the_last_bucket() {
        let mut t = LeaveTimes::new(100);
        t.entered(1_000);
        t.entered(900);
        assert_eq!(t.next(0), Some((1_100, 2)));
    }
}
