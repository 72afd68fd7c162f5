//! When the next message leaves a tier. Each tier is a FIFO queue with one TTL, so a message put
//! into it at `t` leaves at `t + ttl`, in order. [`LeaveTimes`] keeps, for one tier, how many
//! messages leave in each time bucket; the front bucket that has not passed is the next leave
//! time. Buckets are a 1024th of the TTL, so memory stays flat however many messages wait.
//!
//! [`DueCounts`] counts, for one destination, the messages in any tier whose due time has not
//! come. The broker cannot say this, as tiers are shared by every destination; the due times
//! can, in buckets a 32nd of each message's delay wide, at most [`MAX_DUE_BUCKETS`] of them.
//!
//! Both know only what this process put into the tiers since it started (other replicas, and
//! messages from before a restart, are not in them): estimates for operators, never used to
//! decide anything.

use std::collections::{BTreeMap, VecDeque};

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

/// Due-time buckets one destination keeps, at most (a few KiB).
pub const MAX_DUE_BUCKETS: usize = 128;

/// A bucket is at most this fraction of the delay wide.
const BUCKETS_PER_DELAY: u64 = 32;

/// How many messages for one destination are waiting: put into a tier, not yet due.
#[derive(Debug, Clone, Default)]
pub struct DueCounts {
    /// `(bucket end ms, messages)`: a message due at `t` counts until its bucket's end.
    buckets: BTreeMap<u64, u64>,
    total: u64,
}

impl DueCounts {
    /// A message due at `due_ms` was put into a tier at `now_ms`.
    pub fn entered(&mut self, due_ms: u64, now_ms: u64) {
        // a power of two no wider than a 32nd of the delay: bucket ends of one width are its
        // multiples, so messages due close together share a bucket
        let width = (due_ms.saturating_sub(now_ms) / BUCKETS_PER_DELAY).max(1);
        let width = 1u64 << (63 - width.leading_zeros());
        let end = due_ms.div_ceil(width).saturating_mul(width);
        // the common case: due with the message before it (one delay, a steady flow)
        if let Some(mut last) = self.buckets.last_entry()
            && *last.key() == end
        {
            *last.get_mut() += 1;
            self.total += 1;
            return;
        }
        if self.buckets.len() >= MAX_DUE_BUCKETS && !self.buckets.contains_key(&end) {
            self.leave(now_ms);
        }
        if self.buckets.len() >= MAX_DUE_BUCKETS && !self.buckets.contains_key(&end) {
            // full: into the next later bucket, or the last one moved out to this end — a
            // message counts too long, never too short
            let later = self.buckets.range_mut(end..).next().map(|(_, n)| n);
            match later {
                Some(n) => *n += 1,
                None => {
                    let (_, n) = self.buckets.pop_last().expect("full, so not empty");
                    self.buckets.insert(end, n + 1);
                }
            }
        } else {
            *self.buckets.entry(end).or_insert(0) += 1;
        }
        self.total += 1;
    }

    /// Messages not due by `now_ms`.
    pub fn waiting(&mut self, now_ms: u64) -> u64 {
        self.leave(now_ms);
        self.total
    }

    /// Whether any message is not due by `now_ms`.
    pub fn any_after(&self, now_ms: u64) -> bool {
        self.buckets.last_key_value().is_some_and(|(end, _)| *end > now_ms)
    }

    /// Buckets held (for the memory bound).
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    fn leave(&mut self, now_ms: u64) {
        while let Some(entry) = self.buckets.first_entry() {
            if *entry.key() > now_ms {
                break;
            }
            self.total -= entry.remove();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_waits_until_its_messages_are_due() {
        let mut d = DueCounts::default();
        assert_eq!(d.waiting(0), 0);
        d.entered(11_000, 10_000); // 1 s delay: buckets of 16 ms
        d.entered(11_005, 10_005);
        d.entered(70_000, 10_000); // 1 min delay: buckets of 1 024 ms
        assert_eq!(d.waiting(10_500), 3);
        assert_eq!(
            d.waiting(11_007),
            3,
            "due at 11 000 and 11 005: their bucket ends at 11 008"
        );
        assert_eq!(d.waiting(11_008), 1);
        assert_eq!(d.waiting(70_655), 1, "its bucket ends at 70 656");
        assert_eq!(d.waiting(70_656), 0);
        assert_eq!(d.buckets(), 0);
    }

    #[test]
    fn a_message_counts_at_most_a_32nd_of_its_delay_too_long() {
        for delay in [1u64, 31, 32, 1_000, 60_000, 3_600_000, 596 * 3_600_000] {
            let mut d = DueCounts::default();
            let now = 1_700_000_000_000;
            d.entered(now + delay, now);
            assert_eq!(d.waiting(now + delay - 1), 1, "delay {delay}: counted until due");
            assert_eq!(
                d.waiting(now + delay + delay / 32 + 1),
                0,
                "delay {delay}: gone soon after"
            );
        }
    }

    #[test]
    fn buckets_stay_bounded_and_nothing_leaves_early() {
        let mut d = DueCounts::default();
        let now = 1_000_000u64;
        // 100 000 messages with delays spread over 1 ms .. ~28 h
        let mut x = 7u64;
        let mut dues = Vec::new();
        for _ in 0..100_000 {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let due = now + 1 + (x >> 33) % 100_000_000;
            d.entered(due, now);
            dues.push(due);
            assert!(d.buckets() <= MAX_DUE_BUCKETS);
        }
        dues.sort_unstable();
        for at in [now, now + 1_000, now + 1_000_000, now + 50_000_000, now + 99_999_999] {
            let truly = dues.iter().filter(|&&due| due > at).count() as u64;
            let counted = d.waiting(at);
            assert!(
                counted >= truly,
                "at {at}: {counted} < {truly}: counted as left too early"
            );
        }
        assert_eq!(d.waiting(now + 300_000_000), 0);
    }

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
