//! The ladder arithmetic: which tier a retry waits in, and what a tier is called.
//!
//! Pure: no I/O, no clocks. Everything here is decided from a validated [`LadderSpec`]
//! and numbers handed in by the caller, so it is unit-tested without a broker.

use std::time::Duration;

use regex::RegexSet;

/// Which kind of queue holds a ladder's tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueType {
    /// Replicated, memory-efficient for many waiting messages; supports at-least-once dead-lettering.
    Quorum,
    /// Single-node queue; dead-letters at-most-once.
    Classic,
}

impl QueueType {
    /// The `x-queue-type` argument value.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

/// How a tier queue hands expired messages to the due exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterStrategy {
    /// Quorum only: the tier keeps a message until the due exchange confirmed it. Safer, slower.
    AtLeastOnce,
    /// The broker's default: fast, but a message is dropped if the due exchange is missing.
    AtMostOnce,
}

impl DeadLetterStrategy {
    /// The `x-dead-letter-strategy` argument value.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterStrategy::AtLeastOnce => "at-least-once",
            DeadLetterStrategy::AtMostOnce => "at-most-once",
        }
    }
}

/// One delay step of a ladder, with its compact name (the routing key and queue suffix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tier {
    /// How long a message waits in this tier.
    pub delay: Duration,
    /// Compact humantime name, e.g. `250ms`, `10s`, `1h30m`.
    pub name: String,
}

impl Tier {
    /// A tier for `delay`, named by [`compact_duration`].
    pub fn new(delay: Duration) -> Self {
        Tier {
            name: compact_duration(delay),
            delay,
        }
    }

    /// The TTL in whole milliseconds (validation guarantees it fits).
    pub fn ttl_ms(&self) -> u64 {
        self.delay.as_millis() as u64
    }
}

/// A validated ladder: its name, backoff steps, limits and allow-list.
#[derive(Debug, Clone)]
pub struct LadderSpec {
    /// The file stem of its config file; part of every name it declares.
    pub name: String,
    /// The delay before retry 1, 2, 3 …; the last step is reused until `max_attempts`.
    pub backoff: Vec<Duration>,
    /// Distinct tiers, shortest first.
    pub tiers: Vec<Tier>,
    /// Retries allowed before a message is parked with `max-attempts`.
    pub max_attempts: u32,
    /// Destination queues this ladder may deliver to.
    pub allow: RegexSet,
    /// Queue type of the tiers (and of intake and due).
    pub queue_type: QueueType,
    /// Dead-lettering strategy of the tiers.
    pub dead_letter_strategy: DeadLetterStrategy,
}

impl LadderSpec {
    /// Builds the tier list from `backoff`; callers validate `backoff` first.
    pub fn new(
        name: String,
        backoff: Vec<Duration>,
        max_attempts: u32,
        allow: RegexSet,
        queue_type: QueueType,
        dead_letter_strategy: DeadLetterStrategy,
    ) -> Self {
        let mut delays = backoff.clone();
        delays.sort();
        delays.dedup();
        LadderSpec {
            name,
            tiers: delays.into_iter().map(Tier::new).collect(),
            backoff,
            max_attempts,
            allow,
            queue_type,
            dead_letter_strategy,
        }
    }

    /// The tier for retry number `attempt` (1-based); attempts past the end reuse the last step.
    pub fn tier_for_attempt(&self, attempt: u32) -> &Tier {
        let index = (attempt.max(1) as usize - 1).min(self.backoff.len() - 1);
        self.tier_by_delay(self.backoff[index])
    }

    /// The shortest tier at least `min_delay` long, or the longest tier if none is.
    pub fn tier_for_min_delay(&self, min_delay: Duration) -> &Tier {
        self.tiers
            .iter()
            .find(|tier| tier.delay >= min_delay)
            .unwrap_or_else(|| self.tiers.last().expect("a validated ladder has a tier"))
    }

    /// The tier a retry waits in: the attempt's step, lengthened to honour a requested minimum delay.
    pub fn choose_tier(&self, attempt: u32, min_delay: Option<Duration>) -> &Tier {
        let by_attempt = self.tier_for_attempt(attempt);
        match min_delay {
            Some(wanted) if wanted > by_attempt.delay => self.tier_for_min_delay(wanted),
            _ => by_attempt,
        }
    }

    /// Whether this ladder may deliver to `queue`.
    pub fn allows(&self, queue: &str) -> bool {
        self.allow.is_match(queue)
    }

    fn tier_by_delay(&self, delay: Duration) -> &Tier {
        self.tiers
            .iter()
            .find(|tier| tier.delay == delay)
            .expect("every backoff step has a tier")
    }
}

/// Formats a duration as compact humantime without spaces: `250ms`, `10s`, `1m`, `1h30m`, `48h`.
///
/// Hours are the largest unit so that names stay readable and unambiguous (`humantime`'s own
/// formatter would say `2days 1h` and insert spaces, which do not belong in a queue name).
pub fn compact_duration(duration: Duration) -> String {
    let total_ms = duration.as_millis();
    if total_ms == 0 {
        return "0ms".to_string();
    }
    let parts = [
        (total_ms / 3_600_000, "h"),
        (total_ms / 60_000 % 60, "m"),
        (total_ms / 1_000 % 60, "s"),
        (total_ms % 1_000, "ms"),
    ];
    parts
        .iter()
        .filter(|(value, _)| *value > 0)
        .map(|(value, unit)| format!("{value}{unit}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ladder(steps: &[u64], max_attempts: u32) -> LadderSpec {
        LadderSpec::new(
            "t".into(),
            steps.iter().map(|ms| Duration::from_millis(*ms)).collect(),
            max_attempts,
            RegexSet::new(["^orders$"]).unwrap(),
            QueueType::Quorum,
            DeadLetterStrategy::AtLeastOnce,
        )
    }

    #[test]
    fn compact_names() {
        let cases = [
            (250, "250ms"),
            (1_000, "1s"),
            (10_000, "10s"),
            (60_000, "1m"),
            (5_400_000, "1h30m"),
            (1_500, "1s500ms"),
            (172_800_000, "48h"),
            (3_661_001, "1h1m1s1ms"),
        ];
        for (ms, name) in cases {
            assert_eq!(compact_duration(Duration::from_millis(ms)), name, "{ms} ms");
        }
    }

    #[test]
    fn compact_names_parse_back_with_humantime() {
        for ms in [1, 999, 1_000, 61_001, 5_400_000, 90_061_001] {
            let name = compact_duration(Duration::from_millis(ms));
            assert_eq!(humantime::parse_duration(&name).unwrap().as_millis() as u64, ms);
        }
    }

    #[test]
    fn tiers_are_distinct_and_sorted() {
        let l = ladder(&[10_000, 1_000, 10_000, 60_000], 4);
        let names: Vec<_> = l.tiers.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["1s", "10s", "1m"]);
    }

    #[test]
    fn attempt_picks_its_step_and_reuses_the_last() {
        let l = ladder(&[1_000, 10_000, 60_000], 10);
        assert_eq!(l.tier_for_attempt(1).name, "1s");
        assert_eq!(l.tier_for_attempt(2).name, "10s");
        assert_eq!(l.tier_for_attempt(3).name, "1m");
        assert_eq!(l.tier_for_attempt(9).name, "1m");
        // attempt 0 cannot be produced by intake, but must not panic
        assert_eq!(l.tier_for_attempt(0).name, "1s");
    }

    #[test]
    fn min_delay_picks_first_tier_long_enough_or_the_longest() {
        let l = ladder(&[1_000, 10_000, 60_000], 3);
        assert_eq!(l.tier_for_min_delay(Duration::from_millis(1)).name, "1s");
        assert_eq!(l.tier_for_min_delay(Duration::from_secs(1)).name, "1s");
        assert_eq!(l.tier_for_min_delay(Duration::from_millis(1_001)).name, "10s");
        assert_eq!(l.tier_for_min_delay(Duration::from_secs(3_600)).name, "1m");
    }

    #[test]
    fn choose_tier_never_shortens_the_backoff() {
        let l = ladder(&[1_000, 10_000, 60_000], 3);
        assert_eq!(l.choose_tier(2, Some(Duration::from_millis(5))).name, "10s");
        assert_eq!(l.choose_tier(1, Some(Duration::from_secs(30))).name, "1m");
        assert_eq!(l.choose_tier(1, None).name, "1s");
    }
}
