//! The ladder arithmetic: which tier a retry waits in, and what a tier is called.
//!
//! Pure: no I/O, no clocks. Everything here is decided from a validated [`LadderSpec`]
//! and numbers handed in by the caller, so it is unit-tested without a broker.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use regex::RegexSet;

/// Which kind of queue holds a ladder's tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QueueType {
    /// Replicated, memory-efficient for many waiting messages; supports at-least-once dead-lettering.
    Quorum,
    /// Single-node queue; dead-letters at-most-once.
    Classic,
}

impl QueueType {
    /// How its tiers dead-letter unless a ladder says otherwise: quorum queues at-least-once,
    /// classic ones at-most-once (the only way they can).
    pub fn default_strategy(self) -> DeadLetterStrategy {
        match self {
            QueueType::Quorum => DeadLetterStrategy::AtLeastOnce,
            QueueType::Classic => DeadLetterStrategy::AtMostOnce,
        }
    }

    /// The `x-queue-type` argument value.
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }
}

/// How a tier queue hands expired messages to the due exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
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

/// The bounds that keep the service's memory and the broker's channels finite.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Unacked deliveries per consumer; also bounds the publishes in flight per consumer.
    pub prefetch: u16,
    /// Deliveries the due hop may have in flight to one destination queue; more are put back
    /// into the shortest tier, so one slow destination cannot take the whole prefetch.
    pub max_in_flight_per_destination: u16,
    /// Encoded size above which a message's headers are parked with `header-too-large`.
    pub max_header_bytes: usize,
    /// `retry-reason` is truncated to this many bytes.
    pub max_reason_bytes: usize,
}

/// The shortest delay level: `2^4` ms. A wait shorter than this that is still to come waits
/// a whole level, so an exact delay ends at most this much late (plus one hop), never early.
pub const MIN_LEVEL_MS: u64 = 1 << 4;

/// The longest delay level: `2^31` ms (24 d 20 h 31 m). With every level in between, any delay
/// up to [`MAX_DELAY`] is a sum of distinct levels.
pub const MAX_LEVEL_MS: u64 = 1 << 31;

/// The longest exact delay accepted: 49 days (the levels sum to `2^32 − 16` ms, 49.7 days).
pub const MAX_DELAY: Duration = Duration::from_secs(49 * 24 * 3600);

/// The delay levels, shortest first: every power of two milliseconds from [`MIN_LEVEL_MS`] to
/// [`MAX_LEVEL_MS`] (28 levels).
pub fn delay_levels() -> Vec<Tier> {
    (MIN_LEVEL_MS.trailing_zeros()..=MAX_LEVEL_MS.trailing_zeros())
        .map(|k| {
            let delay = Duration::from_millis(1 << k);
            Tier {
                name: level_name(delay),
                delay,
            }
        })
        .collect()
}

/// A level's name: `level-` and its delay to three significant digits in the largest unit that
/// keeps it at least 1 (`level-1.02s` for 1 024 ms, `level-24.9d`). In a list of queues a level
/// then reads apart from a step (`N.delay.1s`). The exact delay is the queue's `x-message-ttl`.
pub fn level_name(delay: Duration) -> String {
    let ms = delay.as_millis() as f64;
    let (value, unit) = [(86_400_000.0, "d"), (3_600_000.0, "h"), (60_000.0, "m"), (1_000.0, "s")]
        .into_iter()
        .find(|(size, _)| ms >= *size)
        .map_or((ms, "ms"), |(size, unit)| (ms / size, unit));
    let decimals = match value {
        v if v >= 100.0 => 0,
        v if v >= 10.0 => 1,
        _ => 2,
    };
    let text = format!("{value:.decimals$}");
    let text = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.')
    } else {
        &text
    };
    format!("level-{text}{unit}")
}

/// A spread applied to every backoff step: a step `d` waits exactly `d · (1 ± jitter)`, drawn
/// uniformly, so retries of messages that failed together do not come back together.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Jitter {
    /// Thousandths of the step: 100 is 10 %.
    pub permille: u16,
}

impl Jitter {
    /// `step` spread by `draw` in `[0, 1)`: `step · (1 + jitter · (2·draw − 1))`, in whole ms.
    pub fn apply(self, step: Duration, draw: f64) -> Duration {
        let spread = f64::from(self.permille) / 1000.0 * (2.0 * draw.clamp(0.0, 1.0) - 1.0);
        let ms = (step.as_millis() as f64 * (1.0 + spread)).round().max(1.0);
        Duration::from_millis(ms as u64)
    }
}

/// Who may send retries to which destinations (the ladder's `senders` and `unidentified`).
///
/// The sender is the message's `user_id` property as the ladder's intake receives it. RabbitMQ
/// refuses a publish whose `user_id` is not the connection's user, so it names who published
/// the message. A header never does, as anyone can write one.
#[derive(Debug, Clone)]
pub struct Senders {
    /// Each sender (a broker user name) and the destination queues it may target.
    pub grants: Vec<(String, RegexSet)>,
    /// What a message from no listed sender may do.
    pub unidentified: Unidentified,
}

/// The policy for a message whose `user_id` is absent or names no listed sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Unidentified {
    /// Parked as `sender-not-allowed`, whatever it targets.
    Reject,
    /// Accepted only in dead-letter mode (headed back to the queue the broker dead-lettered it
    /// from), parked otherwise.
    DeadLetter,
}

impl Unidentified {
    /// The config value.
    pub fn as_str(self) -> &'static str {
        match self {
            Unidentified::Reject => "reject",
            Unidentified::DeadLetter => "dead-letter",
        }
    }
}

/// Where a message's destination comes from, which decides what an unidentified sender may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Whoever published it chose the queue (`retry-to`).
    Explicit,
    /// The newest `x-death` entry names the destination: the broker dead-lettered the message
    /// out of the queue it is headed back to.
    DeadLetter,
}

impl Senders {
    /// Why `user` (the `user_id` property, if any) may not send a message in `mode` to
    /// `destination`, or `None` if it may. A listed sender may target its own grants; any
    /// message (from a listed sender or not) may take the [`Unidentified`] way, so naming
    /// yourself never gives less than not doing so.
    pub fn refuse(&self, ladder: &str, user: Option<&str>, mode: Mode, destination: &str) -> Option<String> {
        let grants = user.and_then(|u| self.grants.iter().find(|(name, _)| name == u));
        if grants.is_some_and(|(_, allowed)| allowed.is_match(destination)) {
            return None;
        }
        if self.unidentified == Unidentified::DeadLetter && mode == Mode::DeadLetter {
            return None;
        }
        let who = match (user, grants) {
            (Some(user), Some(_)) => {
                return Some(format!(
                    "sender {user:?} may not send to {destination:?} (senders.{user} of ladder {ladder})"
                ));
            }
            (Some(user), None) => format!("sender {user:?} is not in senders of ladder {ladder}"),
            (None, _) => "the message has no user_id".to_string(),
        };
        Some(match self.unidentified {
            Unidentified::Reject => format!("{who}; unidentified = \"reject\""),
            Unidentified::DeadLetter => format!(
                "{who}; unidentified = \"dead-letter\" accepts it only dead-lettered out of the queue it returns to"
            ),
        })
    }
}

/// A validated ladder: its name, backoff steps, limits and allow-list.
#[derive(Debug, Clone)]
pub struct LadderSpec {
    /// The file stem of its config file; part of every name it declares.
    pub name: String,
    /// The delay before retry 1, 2, 3 …; the last step is reused until `max_attempts`.
    pub backoff: Vec<Duration>,
    /// The backoff's distinct steps as tiers, shortest first (a retry without `jitter` or
    /// `retry-delay` waits in exactly one of them).
    pub steps: Vec<Tier>,
    /// Every queue a message can wait in: the steps and, with exact delays, the delay levels;
    /// distinct, shortest first. This is what is declared.
    pub tiers: Vec<Tier>,
    /// Whether the ladder has delay levels: exact `retry-delay`, `jitter`, and scheduled
    /// deliveries (`x-delay`, `delay-until`). Without them a requested delay is rounded up to
    /// the first step at least that long.
    pub exact_delays: bool,
    /// The spread of every backoff step, if any.
    pub jitter: Option<Jitter>,
    /// Retries allowed before a message is parked with `max-attempts`.
    pub max_attempts: u32,
    /// Destination queues this ladder may deliver to.
    pub allow: RegexSet,
    /// Exchanges a scheduled delivery may be published to (none unless configured).
    pub allow_exchanges: RegexSet,
    /// Queue type of the tiers (and of intake and due).
    pub queue_type: QueueType,
    /// Dead-lettering strategy of the tiers.
    pub dead_letter_strategy: DeadLetterStrategy,
    /// Who may send to which destinations; `None`: anyone who can publish to the intake
    /// exchange may target any allowed destination.
    pub senders: Option<Senders>,
    /// How fast a resumed destination's held queue is released when the resume names no rate.
    pub release_rate: crate::model::lot::pace::Rate,
    /// A release doubles its rate this often while no failure comes back
    /// ([`crate::model::lot::pace::Ramp`]); `None`: it keeps its rate.
    pub release_ramp: Option<Duration>,
    /// The automatic hold, if on.
    pub auto_hold: Option<crate::model::holds::AutoHoldPolicy>,
    /// How long a released destination's held queue must stay empty before it is deleted
    /// ([`DEFAULT_HELD_QUEUE_GRACE`]; not configurable, tests shorten it).
    pub held_queue_grace: Duration,
    /// `allow`'s verdicts on the destinations seen, shared by the spec's clones.
    verdicts: Arc<Verdicts>,
}

/// The allow-list's verdicts on the destinations seen, so the regexes run once per destination
/// rather than on every hop of every message. At most [`Verdicts::KEPT`] are kept; past that a
/// new destination is matched each time (a bounded memory, whatever the senders name).
///
/// Read on every hop by both hops' threads, written once per new destination: the map is
/// swapped whole ([`ArcSwap`]), so a read takes no lock. A new verdict copies
/// the map (at most [`Verdicts::KEPT`] entries, once per destination), with
/// [`ArcSwap::rcu`], so two new destinations at once do not replace each other's copy.
#[derive(Debug, Default)]
struct Verdicts {
    seen: ArcSwap<HashMap<Box<str>, bool, foldhash::fast::RandomState>>,
}

impl Verdicts {
    const KEPT: usize = 4096;

    fn allows(&self, allow: &RegexSet, queue: &str) -> bool {
        let seen = self.seen.load();
        if let Some(verdict) = seen.get(queue) {
            return *verdict;
        }
        let full = seen.len() >= Self::KEPT;
        drop(seen);
        let verdict = allow.is_match(queue);
        if !full {
            self.seen.rcu(|seen| {
                if seen.len() >= Self::KEPT || seen.contains_key(queue) {
                    return Arc::clone(seen);
                }
                let mut more = HashMap::clone(seen);
                more.insert(queue.into(), verdict);
                Arc::new(more)
            });
        }
        verdict
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.seen.load().len()
    }
}

/// A released destination's held queue is deleted once it stayed empty this long after the
/// release ended: a replica that read the end of the release later than the one that deletes
/// still routes into it meanwhile, and its stragglers are released, not returned.
pub const DEFAULT_HELD_QUEUE_GRACE: Duration = Duration::from_secs(60);

/// How often a release doubles its rate while no failure comes back, unless configured: a
/// thousand held messages from 10/s take about 30 s.
pub const DEFAULT_RELEASE_RAMP: Duration = Duration::from_secs(5);

/// The release rate of a resume that names none, where a release starts: gentle, so a
/// recovering service is not flooded.
pub const DEFAULT_RELEASE_RATE: crate::model::lot::pace::Rate = crate::model::lot::pace::Rate {
    count: 10,
    per: Duration::from_secs(1),
};

impl LadderSpec {
    /// Builds the tier list from `backoff`, with exact delays on, no jitter and no exchange
    /// allowed; callers validate `backoff` first.
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
        let steps: Vec<Tier> = delays.into_iter().map(Tier::new).collect();
        let mut spec = LadderSpec {
            name,
            tiers: steps.clone(),
            steps,
            exact_delays: false,
            jitter: None,
            backoff,
            max_attempts,
            allow,
            allow_exchanges: RegexSet::empty(),
            queue_type,
            dead_letter_strategy,
            senders: None,
            release_rate: DEFAULT_RELEASE_RATE,
            release_ramp: Some(DEFAULT_RELEASE_RAMP),
            auto_hold: None,
            held_queue_grace: DEFAULT_HELD_QUEUE_GRACE,
            verdicts: Arc::default(),
        };
        spec.set_exact_delays(true);
        spec
    }

    /// The same ladder, restricted to `senders`.
    pub fn with_senders(self, senders: Senders) -> Self {
        LadderSpec {
            senders: Some(senders),
            ..self
        }
    }

    /// Turns the delay levels on or off.
    pub fn set_exact_delays(&mut self, on: bool) {
        self.exact_delays = on;
        let mut tiers = self.steps.clone();
        if on {
            tiers.extend(delay_levels());
        }
        tiers.sort_by_key(|t| t.delay);
        tiers.dedup_by_key(|t| t.delay);
        self.tiers = tiers;
    }

    /// The step for retry number `attempt` (1-based); attempts past the end reuse the last step.
    pub fn tier_for_attempt(&self, attempt: u32) -> &Tier {
        let index = (attempt.max(1) as usize - 1).min(self.backoff.len() - 1);
        self.step_by_delay(self.backoff[index])
    }

    /// The shortest step at least `min_delay` long, or the longest step if none is.
    pub fn tier_for_min_delay(&self, min_delay: Duration) -> &Tier {
        self.steps
            .iter()
            .find(|tier| tier.delay >= min_delay)
            .unwrap_or_else(|| self.steps.last().expect("a validated ladder has a step"))
    }

    /// The spread a retry's delay takes: `jitter`, which applies only with exact delays. Without
    /// one, [`LadderSpec::retry_delay`] does not read its draw (and the intake draws none).
    pub fn spread(&self) -> Option<Jitter> {
        self.jitter.filter(|_| self.exact_delays)
    }

    /// How long retry number `attempt` waits: its step (spread by `jitter` with `draw`),
    /// lengthened to a requested minimum delay. Without exact delays, rounded up to a step.
    pub fn retry_delay(&self, attempt: u32, min_delay: Option<Duration>, draw: f64) -> Duration {
        let step = self.tier_for_attempt(attempt).delay;
        if !self.exact_delays {
            return match min_delay {
                Some(wanted) if wanted > step => self.tier_for_min_delay(wanted).delay,
                _ => step,
            };
        }
        let spread = self.spread().map_or(step, |j| j.apply(step, draw));
        min_delay.map_or(spread, |wanted| wanted.max(spread))
    }

    /// Where the next failure of a message delivered as retry `attempt` waits when the broker
    /// routes it (the `retry-next` header the due hop writes): the tier of retry `attempt + 1`.
    /// `None` — through the intake — when that retry would exhaust the ladder (the intake parks
    /// it at once) or its delay is spread by `jitter` (the intake draws it).
    pub fn next_route(&self, attempt: u64) -> Option<&Tier> {
        let next = attempt.checked_add(1)?;
        if next > u64::from(self.max_attempts) || self.spread().is_some() {
            return None;
        }
        Some(self.tier_for_attempt(u32::try_from(next).unwrap_or(u32::MAX)))
    }

    /// The tier to wait in next when `remaining` is still to wait: the longest tier no longer
    /// than it (so a message is never early), or the shortest when every tier is longer. With
    /// the delay levels every wait at least halves what remains, so a delay `d` takes at most
    /// `log2(d / 16 ms) + 1` tiers (28 for 49 days), and a backoff step exactly one.
    pub fn next_wait(&self, remaining: Duration) -> &Tier {
        // the tiers are sorted by delay: a binary search reads a handful of them where a walk
        // from the longest read up to thirty (one cache line each) on every retry
        let no_longer = self.tiers.partition_point(|t| t.delay <= remaining);
        &self.tiers[no_longer.saturating_sub(1)]
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
        self.verdicts.allows(&self.allow, queue)
    }

    fn step_by_delay(&self, delay: Duration) -> &Tier {
        self.steps
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

    #[test]
    fn the_allow_lists_verdicts_are_kept_for_a_bounded_number_of_destinations() {
        let spec = ladder(&[1000], 3);
        let copy = spec.clone();
        for _ in 0..2 {
            assert!(spec.allows("orders") && copy.allows("orders"));
            assert!(!spec.allows("orders2") && !copy.allows("billing"));
        }
        for i in 0..Verdicts::KEPT + 100 {
            assert!(!spec.allows(&format!("q{i}")));
        }
        assert_eq!(spec.verdicts.len(), Verdicts::KEPT, "bounded");
        // past the bound, a destination is still matched: the verdicts stay right
        assert!(spec.allows("orders") && !spec.allows("orders3") && !spec.allows("q999999"));
    }

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

    fn senders(unidentified: Unidentified) -> Senders {
        Senders {
            grants: vec![
                ("billing-svc".into(), RegexSet::new(["^billing\\."]).unwrap()),
                ("orders-svc".into(), RegexSet::new(["^orders$"]).unwrap()),
            ],
            unidentified,
        }
    }

    #[test]
    fn a_listed_sender_may_target_its_grants_only() {
        let s = senders(Unidentified::Reject);
        assert_eq!(
            s.refuse("l", Some("billing-svc"), Mode::Explicit, "billing.invoices"),
            None
        );
        assert_eq!(s.refuse("l", Some("orders-svc"), Mode::Explicit, "orders"), None);
        let no = s.refuse("l", Some("billing-svc"), Mode::Explicit, "orders").unwrap();
        assert!(no.contains("\"billing-svc\" may not send to \"orders\""), "{no}");
        // a grant is for explicit and dead-letter mode alike
        assert_eq!(s.refuse("l", Some("orders-svc"), Mode::DeadLetter, "orders"), None);
        assert!(
            s.refuse("l", Some("orders-svc"), Mode::DeadLetter, "billing.x")
                .is_some()
        );
    }

    #[test]
    fn unidentified_messages_follow_the_policy() {
        let reject = senders(Unidentified::Reject);
        for mode in [Mode::Explicit, Mode::DeadLetter] {
            let no = reject.refuse("l", None, mode, "orders").unwrap();
            assert!(no.contains("no user_id") && no.contains("reject"), "{no}");
            let no = reject.refuse("l", Some("mallory"), mode, "orders").unwrap();
            assert!(no.contains("\"mallory\" is not in senders of ladder l"), "{no}");
        }
        let dead_letter = senders(Unidentified::DeadLetter);
        assert_eq!(dead_letter.refuse("l", None, Mode::DeadLetter, "orders"), None);
        assert_eq!(
            dead_letter.refuse("l", Some("mallory"), Mode::DeadLetter, "billing.x"),
            None
        );
        // a listed sender outside its grants still has what an unidentified one has
        assert_eq!(
            dead_letter.refuse("l", Some("orders-svc"), Mode::DeadLetter, "billing.x"),
            None
        );
        let no = dead_letter.refuse("l", None, Mode::Explicit, "orders").unwrap();
        assert!(no.contains("only dead-lettered"), "{no}");
        assert!(
            dead_letter
                .refuse("l", Some("mallory"), Mode::Explicit, "orders")
                .is_some()
        );
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
        let mut l = ladder(&[10_000, 1_000, 10_000, 60_000], 4);
        let names: Vec<_> = l.steps.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["1s", "10s", "1m"]);
        l.set_exact_delays(false);
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

    #[test]
    fn the_levels_are_the_powers_of_two_from_16ms_to_24_days() {
        let levels = delay_levels();
        assert_eq!(levels.len(), 28);
        let names: Vec<&str> = levels.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "level-16ms",
                "level-32ms",
                "level-64ms",
                "level-128ms",
                "level-256ms",
                "level-512ms",
                "level-1.02s",
                "level-2.05s",
                "level-4.1s",
                "level-8.19s",
                "level-16.4s",
                "level-32.8s",
                "level-1.09m",
                "level-2.18m",
                "level-4.37m",
                "level-8.74m",
                "level-17.5m",
                "level-35m",
                "level-1.17h",
                "level-2.33h",
                "level-4.66h",
                "level-9.32h",
                "level-18.6h",
                "level-1.55d",
                "level-3.11d",
                "level-6.21d",
                "level-12.4d",
                "level-24.9d",
            ]
        );
        assert_eq!(levels[27].ttl_ms(), 1 << 31);
        assert!(levels.iter().map(|l| l.ttl_ms()).sum::<u64>() >= MAX_DELAY.as_millis() as u64);
        let l = ladder(&[1_000, 10_000], 3);
        assert_eq!(l.tiers.len(), 30, "the steps and the levels");
        assert_eq!(l.steps.len(), 2);
        let mut off = l.clone();
        off.set_exact_delays(false);
        assert_eq!(off.tiers, off.steps);
    }

    /// Following `next_wait` from any delay: never early, at most one short level late, in at
    /// most log2(d / 16 ms) + 1 tiers; a backoff step is one tier.
    #[test]
    fn waits_compose_any_delay_exactly_in_few_tiers() {
        let l = ladder(&[1_000, 10_000, 60_000, 600_000], 4);
        let mut delays: Vec<u64> = vec![
            1,
            15,
            16,
            17,
            75_000,
            86_400_000,
            30 * 86_400_000,
            MAX_DELAY.as_millis() as u64,
        ];
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            delays.push(x % MAX_DELAY.as_millis() as u64 + 1);
        }
        let mut worst = 0;
        for d in delays {
            let (mut waited, mut hops) = (0u64, 0u32);
            while waited < d {
                waited += l.next_wait(Duration::from_millis(d - waited)).ttl_ms();
                hops += 1;
            }
            let bound = 64 - (d / MIN_LEVEL_MS).max(1).leading_zeros() + 1;
            assert!(hops <= bound, "{d} ms took {hops} tiers, bound {bound}");
            assert!(waited - d < MIN_LEVEL_MS, "{d} ms waited {waited}");
            worst = worst.max(hops);
        }
        assert!(worst <= 29, "{worst}");
        // the binary search picks what a walk from the longest tier down picks
        for remaining in [
            0,
            1,
            15,
            16,
            17,
            999,
            1_000,
            1_001,
            75_000,
            MAX_DELAY.as_millis() as u64 * 2,
        ] {
            let remaining = Duration::from_millis(remaining);
            let walked = l
                .tiers
                .iter()
                .rev()
                .find(|t| t.delay <= remaining)
                .unwrap_or(&l.tiers[0]);
            assert_eq!(l.next_wait(remaining), walked, "{remaining:?}");
        }
        for step in [1_000, 10_000, 60_000, 600_000] {
            assert_eq!(
                l.next_wait(Duration::from_millis(step)).ttl_ms(),
                step,
                "a step is one tier"
            );
        }
    }

    #[test]
    fn without_a_spread_the_draw_is_not_read() {
        let mut l = ladder(&[10_000], 3);
        l.jitter = Some(Jitter { permille: 100 });
        assert!(l.spread().is_some());
        for (jitter, exact) in [(None, true), (Some(Jitter { permille: 100 }), false)] {
            l.jitter = jitter;
            l.set_exact_delays(exact);
            assert!(l.spread().is_none());
            assert_eq!(l.retry_delay(1, None, 0.0), l.retry_delay(1, None, 0.999_999));
        }
    }

    #[test]
    fn jitter_spreads_a_step_both_ways_and_retry_delay_is_exact() {
        let mut l = ladder(&[10_000], 3);
        l.jitter = Some(Jitter { permille: 100 });
        assert_eq!(l.retry_delay(1, None, 0.0).as_millis(), 9_000);
        assert_eq!(l.retry_delay(1, None, 0.5).as_millis(), 10_000);
        assert_eq!(l.retry_delay(1, None, 0.999_999).as_millis(), 11_000);
        l.jitter = None;
        assert_eq!(
            l.retry_delay(1, Some(Duration::from_secs(75)), 0.3).as_secs(),
            75,
            "exact, not the next step"
        );
        assert_eq!(
            l.retry_delay(1, Some(Duration::from_secs(1)), 0.3).as_secs(),
            10,
            "never shorter than the step"
        );
        l.set_exact_delays(false);
        assert_eq!(
            l.retry_delay(1, Some(Duration::from_secs(75)), 0.3).as_secs(),
            10,
            "rounded to the longest step"
        );
    }
}
