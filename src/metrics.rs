//! Prometheus metrics: one registry for the process, and per-ladder handles made once at start
//! so the relay's hot path only bumps atomics (no label allocation, no map lookup).
//!
//! Names are `ladder_<thing>_<unit>[_total]`; label values are bounded: ladder, hop, tier,
//! reason, queue role — never a message id or a destination queue.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::model::ladder::LadderSpec;
use crate::model::leaving::LeaveTimes;
use crate::model::names::Hop;
use crate::model::protocol::{DeferReason, ParkReason};

mod histogram;
pub use histogram::DurationHistogram;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LadderLabel {
    ladder: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HopLabels {
    ladder: String,
    hop: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    ladder: String,
    tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    ladder: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    ladder: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    ladder: String,
    queue: String,
}

/// How many upper bounds `ladder_lateness_seconds` has (its `+Inf` bucket aside).
pub const LATENESS_BUCKETS: usize = 16;

/// The first upper bound of `ladder_lateness_seconds`; the others double from it.
const LATENESS_FIRST: Duration = Duration::from_millis(1);

/// Lateness buckets: 1 ms to ~33 s, doubling.
fn lateness_histogram() -> DurationHistogram {
    DurationHistogram::doubling(LATENESS_FIRST, LATENESS_BUCKETS)
}

/// The upper bounds of `ladder_lateness_seconds`'s buckets, in seconds.
pub fn lateness_bounds() -> impl Iterator<Item = f64> {
    DurationHistogram::doubling_bounds(LATENESS_FIRST, LATENESS_BUCKETS)
}

/// Hop latency buckets: 100 µs to ~3.3 s, doubling.
fn hop_histogram() -> DurationHistogram {
    DurationHistogram::doubling(Duration::from_micros(100), 16)
}

/// The process's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    received: Family<HopLabels, Counter>,
    scheduled: Family<TierLabels, Counter>,
    delivered: Family<LadderLabel, Counter>,
    entered: Family<LadderLabel, Counter>,
    parked: Family<ReasonLabels, Counter>,
    publish_failures: Family<HopLabels, Counter>,
    returned: Family<HopLabels, Counter>,
    deferred: Family<ReasonLabels, Counter>,
    lateness: Family<LadderLabel, DurationHistogram, fn() -> DurationHistogram>,
    hop_duration: Family<HopLabels, DurationHistogram, fn() -> DurationHistogram>,
    in_flight: Family<HopLabels, Gauge>,
    queue_messages: Family<QueueLabels, Gauge>,
    next_leave: Family<TierLabels, Gauge<f64, AtomicU64>>,
    /// Per (ladder, tier): when what this process put into the tier leaves; shared by every
    /// [`LadderMetrics`] made for the ladder (the relay loops record, the poller reads).
    leaving: Mutex<HashMap<(String, String), SharedLeaveTimes>>,
    unaccounted: Family<LadderLabel, Gauge>,
    unaccounted_alarms: Family<LadderLabel, Counter>,
    in_doubt: Family<LadderLabel, Gauge>,
    hold_transitions: Family<KindLabels, Counter>,
    destinations_held: Family<LadderLabel, Gauge>,
    held_messages: Family<LadderLabel, Counter>,
    released_messages: Family<LadderLabel, Counter>,
    /// Sessions started after a lost connection.
    pub reconnects: Counter,
    /// SIGHUP reloads, by result (`applied`, `unchanged`, `invalid`).
    reloads: Family<ResultLabel, Counter>,
    /// 1 while the broker blocks the service's publishes (`connection.blocked`: a memory or
    /// disk alarm), else 0.
    pub broker_blocked: Gauge,
    /// Times the broker started blocking the service's publishes.
    pub broker_blocked_episodes: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// An empty registry with every family registered.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Metrics {
            received: Family::default(),
            scheduled: Family::default(),
            delivered: Family::default(),
            entered: Family::default(),
            parked: Family::default(),
            publish_failures: Family::default(),
            returned: Family::default(),
            deferred: Family::default(),
            lateness: Family::new_with_constructor(lateness_histogram),
            hop_duration: Family::new_with_constructor(hop_histogram),
            in_flight: Family::default(),
            queue_messages: Family::default(),
            next_leave: Family::default(),
            leaving: Mutex::default(),
            unaccounted: Family::default(),
            unaccounted_alarms: Family::default(),
            in_doubt: Family::default(),
            hold_transitions: Family::default(),
            destinations_held: Family::default(),
            held_messages: Family::default(),
            released_messages: Family::default(),
            reconnects: Counter::default(),
            reloads: Family::default(),
            broker_blocked: Gauge::default(),
            broker_blocked_episodes: Counter::default(),
            registry: Registry::default(),
        };
        m.register_flow(&mut registry);
        m.register_state(&mut registry);
        Metrics { registry, ..m }
    }

    /// Registers what the hops count as messages pass: received, scheduled, delivered, parked, deferred, held and released.
    fn register_flow(&self, registry: &mut Registry) {
        registry.register(
            "ladder_received_messages",
            "Deliveries taken from a ladder's intake or due queue",
            self.received.clone(),
        );
        registry.register(
            "ladder_scheduled_messages",
            "Retries published (and confirmed) into a tier",
            self.scheduled.clone(),
        );
        registry.register(
            "ladder_delivered_messages",
            "Retries published (and confirmed) to their destination queue",
            self.delivered.clone(),
        );
        registry.register(
            "ladder_parked_messages",
            "Messages parked, by reason",
            self.parked.clone(),
        );
        registry.register(
            "ladder_entered_messages",
            "Messages that entered a ladder: intake deliveries it settled, and failures its due hop took in past the intake",
            self.entered.clone(),
        );
        registry.register(
            "ladder_publish_failures",
            "Publishes the broker nacked or parks it refused; the delivery is held and published again",
            self.publish_failures.clone(),
        );
        registry.register(
            "ladder_returned_messages",
            "Mandatory publishes the broker returned as unroutable (then parked as no-route)",
            self.returned.clone(),
        );
        registry.register(
            "ladder_deferred_messages",
            "Due messages put back into a tier instead of delivered, by reason: the destination refused them (refused) or had its bound in flight (busy); no attempt is counted",
            self.deferred.clone(),
        );
        registry.register(
            "ladder_hold_transitions",
            "Destination hold transitions read from the hold stream, by kind: held, resumed, released (a release found the held queue empty), auto_held, auto_resumed, probed (a replica released a probe), probe_failed (a replica's intake saw it fail); and probe (a probe this process released)",
            self.hold_transitions.clone(),
        );
        registry.register(
            "ladder_destinations_held",
            "Destinations held or being released, as this process read the hold stream",
            self.destinations_held.clone(),
        );
        registry.register(
            "ladder_held_messages",
            "Due messages put (and confirmed) into a held destination's queue instead of delivered; no attempt is counted",
            self.held_messages.clone(),
        );
        registry.register(
            "ladder_released_messages",
            "Messages released (and confirmed) from a held queue to their destination, probes included",
            self.released_messages.clone(),
        );
    }

    /// Registers what the hops and the poller measure and the service's own state: timings, queues, the accounting, sessions, reloads and alarms.
    fn register_state(&self, registry: &mut Registry) {
        registry.register(
            "ladder_lateness_seconds",
            "Redelivery time minus the due time (retry-due-at)",
            self.lateness.clone(),
        );
        registry.register(
            "ladder_hop_duration_seconds",
            "From receiving a delivery to acking it (publish and confirm included)",
            self.hop_duration.clone(),
        );
        registry.register(
            "ladder_in_flight_messages",
            "Deliveries received and not yet settled",
            self.in_flight.clone(),
        );
        registry.register(
            "ladder_queue_messages",
            "Messages in a ladder's queues at the latest poll: ready messages; for the parked stream, its length",
            self.queue_messages.clone(),
        );
        registry.register(
            "ladder_tier_next_leave_timestamp_seconds",
            "When the next message this process put into a tier leaves it (tier TTL after it went in, to a 1024th of the TTL), at the latest poll; 0 when none it knows of waits",
            self.next_leave.clone(),
        );
        registry.register(
            "ladder_unaccounted_messages",
            "Messages the accounting identity cannot place (should stay 0)",
            self.unaccounted.clone(),
        );
        registry.register(
            "ladder_unaccounted_alarms",
            "Times the accounting identity found messages it cannot place",
            self.unaccounted_alarms.clone(),
        );
        registry.register(
            "ladder_in_doubt_messages",
            "Messages whose fate the accounting identity does not know yet after a disruption (a partition, a lost session): not counted as lost",
            self.in_doubt.clone(),
        );
        registry.register(
            "ladder_reconnects",
            "Broker sessions started after a lost connection",
            self.reconnects.clone(),
        );
        registry.register(
            "ladder_config_reloads",
            "SIGHUP reloads of the config and ladder files, by result (applied, unchanged, invalid)",
            self.reloads.clone(),
        );
        // at 0 from the start, so an alert on an increase sees the first one
        for result in ["applied", "unchanged", "invalid"] {
            let _ = self.reloads.get_or_create(&ResultLabel { result: result.into() });
        }
        registry.register(
            "ladder_broker_blocked",
            "1 while the broker blocks the service's publishes (a memory or disk alarm: connection.blocked)",
            self.broker_blocked.clone(),
        );
        registry.register(
            "ladder_broker_blocked_episodes",
            "Times the broker started blocking the service's publishes (resource alarms)",
            self.broker_blocked_episodes.clone(),
        );
    }

    /// Counts a SIGHUP reload that ended in `result` (`applied`, `unchanged`, `invalid`).
    pub fn reloaded(&self, result: &str) {
        self.reloads.get_or_create(&ResultLabel { result: result.into() }).inc();
    }

    /// The handles one ladder's loops use.
    pub fn ladder(&self, spec: &LadderSpec) -> LadderMetrics {
        let ladder = spec.name.clone();
        // the accounting series exist from the start, so `increase()` and absence alerts work
        let label = LadderLabel { ladder: ladder.clone() };
        let _ = self.unaccounted.get_or_create(&label);
        let _ = self.unaccounted_alarms.get_or_create(&label);
        let _ = self.in_doubt.get_or_create(&label);
        let hop = |family: &Family<HopLabels, Counter>, hop: Hop| {
            family
                .get_or_create(&HopLabels {
                    ladder: ladder.clone(),
                    hop: hop.to_string(),
                })
                .clone()
        };
        let per_hop = |make: &dyn Fn(Hop) -> HopMetrics| Hop::ALL.map(make);
        // every transition kind's series exists from the start, so `increase()` works
        for kind in HOLD_TRANSITIONS {
            let _ = self.hold_transitions.get_or_create(&KindLabels {
                ladder: ladder.clone(),
                kind: kind.to_string(),
            });
        }
        let holds = HoldMetrics {
            ladder: ladder.clone(),
            transitions: self.hold_transitions.clone(),
            held: self.destinations_held.get_or_create(&label).clone(),
            held_messages: self.held_messages.get_or_create(&label).clone(),
            released_messages: self.released_messages.get_or_create(&label).clone(),
        };
        LadderMetrics {
            holds,
            hops: per_hop(&|h| HopMetrics {
                received: hop(&self.received, h),
                publish_failures: hop(&self.publish_failures, h),
                returned: hop(&self.returned, h),
                duration: self
                    .hop_duration
                    .get_or_create(&HopLabels {
                        ladder: ladder.clone(),
                        hop: h.to_string(),
                    })
                    .clone(),
                in_flight: self
                    .in_flight
                    .get_or_create(&HopLabels {
                        ladder: ladder.clone(),
                        hop: h.to_string(),
                    })
                    .clone(),
                released: Counter::default(),
            }),
            scheduled: spec.tiers.iter().map(|tier| self.tier(&ladder, tier)).collect(),
            entered: self
                .entered
                .get_or_create(&LadderLabel { ladder: ladder.clone() })
                .clone(),
            delivered: self
                .delivered
                .get_or_create(&LadderLabel { ladder: ladder.clone() })
                .clone(),
            lateness: self
                .lateness
                .get_or_create(&LadderLabel { ladder: ladder.clone() })
                .clone(),
            deferred: DeferReason::ALL.map(|reason| {
                let labels = ReasonLabels {
                    ladder: ladder.clone(),
                    reason: reason.code().to_string(),
                };
                self.deferred.get_or_create(&labels).clone()
            }),
            parked: ParkReason::ALL.map(|reason| {
                let labels = ReasonLabels {
                    ladder: ladder.clone(),
                    reason: reason.code().to_string(),
                };
                self.parked.get_or_create(&labels).clone()
            }),
        }
    }

    /// The handles of one tier of `ladder`: its scheduled count, and when its next message
    /// leaves.
    fn tier(&self, ladder: &str, tier: &crate::model::ladder::Tier) -> TierHandles {
        let labels = TierLabels {
            ladder: ladder.to_string(),
            tier: tier.name.clone(),
        };
        let leaving = self
            .leaving
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry((ladder.to_string(), tier.name.clone()))
            .or_insert_with(|| Arc::new(Mutex::new(LeaveTimes::new(tier.ttl_ms()))))
            .clone();
        TierHandles {
            name: tier.name.clone(),
            scheduled: self.scheduled.get_or_create(&labels).clone(),
            next_leave: self.next_leave.get_or_create(&labels).clone(),
            leaving,
        }
    }

    /// Sets the ready-message count of one of `ladder`'s queues (`intake`, `due`, `parked`,
    /// `delay.<tier>`).
    pub fn set_queue_messages(&self, ladder: &str, queue: &str, messages: u64) {
        let labels = QueueLabels {
            ladder: ladder.to_string(),
            queue: queue.to_string(),
        };
        self.queue_messages.get_or_create(&labels).set(messages as i64);
    }

    /// Removes the count of one of `ladder`'s queues: the queue does not exist (any more), and
    /// a stale value would pass for a depth.
    pub fn clear_queue_messages(&self, ladder: &str, queue: &str) {
        let labels = QueueLabels {
            ladder: ladder.to_string(),
            queue: queue.to_string(),
        };
        self.queue_messages.remove(&labels);
    }

    /// Records the result of one accounting check of `ladder`.
    pub fn set_unaccounted(&self, ladder: &str, messages: u64) {
        let labels = LadderLabel {
            ladder: ladder.to_string(),
        };
        self.unaccounted.get_or_create(&labels).set(messages as i64);
        if messages > 0 {
            self.unaccounted_alarms.get_or_create(&labels).inc();
        }
    }

    /// Records how many messages of `ladder` are in doubt (see [`crate::model::accounting`]).
    pub fn set_in_doubt(&self, ladder: &str, messages: u64) {
        let labels = LadderLabel {
            ladder: ladder.to_string(),
        };
        self.in_doubt.get_or_create(&labels).set(messages as i64);
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// One hop's handles.
#[derive(Debug, Clone)]
pub struct HopMetrics {
    /// Deliveries taken.
    pub received: Counter,
    /// Nacked publishes and refused parks.
    pub publish_failures: Counter,
    /// Returned publishes.
    pub returned: Counter,
    /// Receive-to-ack latency.
    pub duration: DurationHistogram,
    /// Deliveries not yet settled.
    pub in_flight: Gauge,
    /// Messages of held queues a release or a probe acked (delivered, or parked): the due
    /// hop's work while it releases, counted in its `in_flight` meanwhile, so the watchdog
    /// sees its progress. Not exported (`ladder_released_messages_total` is).
    pub released: Counter,
}

/// One tier's leave times, shared by the relay loops that record and the poller that reads.
type SharedLeaveTimes = Arc<Mutex<LeaveTimes>>;

/// One tier's handles.
#[derive(Debug, Clone)]
struct TierHandles {
    name: String,
    scheduled: Counter,
    next_leave: Gauge<f64, AtomicU64>,
    leaving: Arc<Mutex<LeaveTimes>>,
}

/// The kinds of `ladder_hold_transitions_total`.
pub const HOLD_TRANSITIONS: [&str; 8] = [
    "held",
    "resumed",
    "released",
    "auto_held",
    "auto_resumed",
    "probed",
    "probe_failed",
    "probe",
];

/// One ladder's destination-hold handles. No destination is a label (unbounded): transitions
/// are counted by kind, and the held ones are a gauge per ladder.
#[derive(Debug, Clone)]
pub struct HoldMetrics {
    ladder: String,
    transitions: Family<KindLabels, Counter>,
    /// Destinations held or releasing.
    pub held: Gauge,
    /// Due messages put into held queues.
    pub held_messages: Counter,
    /// Messages released from held queues.
    pub released_messages: Counter,
}

impl HoldMetrics {
    /// Counts one transition of `kind` (rare: a family lookup is fine).
    pub fn transition(&self, kind: &str) {
        self.transitions
            .get_or_create(&KindLabels {
                ladder: self.ladder.clone(),
                kind: kind.to_string(),
            })
            .inc();
    }
}

/// One ladder's handles, cheap to use from the hot path.
#[derive(Debug, Clone)]
pub struct LadderMetrics {
    /// Destination holds.
    pub holds: HoldMetrics,
    hops: [HopMetrics; Hop::ALL.len()],
    /// Intake deliveries settled, and failures the due hop took in past the intake: the
    /// messages that entered the ladder, for the accounting identity.
    pub entered: Counter,
    scheduled: Vec<TierHandles>,
    /// Retries delivered to their destination.
    pub delivered: Counter,
    /// Due-time lateness of delivered retries (per bucket, readable:
    /// [`LadderMetrics::lateness_counts`]).
    pub lateness: DurationHistogram,
    parked: [Counter; ParkReason::ALL.len()],
    deferred: [Counter; DeferReason::ALL.len()],
}

impl LadderMetrics {
    /// The handles of `hop`.
    pub fn hop(&self, hop: Hop) -> &HopMetrics {
        match hop {
            Hop::Intake => &self.hops[0],
            Hop::Due => &self.hops[1],
            Hop::Quarantine => &self.hops[2],
        }
    }

    /// Counts a message put into `tier` at `now_ms` (a retry, or one hop of a longer wait).
    pub fn scheduled(&self, tier: &str, now_ms: u64) {
        if let Some(t) = self.scheduled.iter().find(|t| t.name == tier) {
            t.scheduled.inc();
            t.leaving.lock().unwrap_or_else(PoisonError::into_inner).entered(now_ms);
        }
    }

    /// Per tier, in the ladder's order: when the next message this process put into it leaves,
    /// and how many it put in that have not left, as of `now_ms`; also sets
    /// `ladder_tier_next_leave_timestamp_seconds` (0 for none).
    pub fn next_leaves(&self, now_ms: u64) -> Vec<(String, Option<(u64, u64)>)> {
        self.scheduled
            .iter()
            .map(|t| {
                let next = t.leaving.lock().unwrap_or_else(PoisonError::into_inner).next(now_ms);
                t.next_leave.set(next.map_or(0.0, |(at, _)| at as f64 / 1000.0));
                (t.name.clone(), next)
            })
            .collect()
    }

    /// Per bucket of `ladder_lateness_seconds` (bounds [`lateness_bounds`], then `+Inf`), the
    /// observations so far in this process, not cumulative.
    pub fn lateness_counts(&self) -> [u64; LATENESS_BUCKETS + 1] {
        let counts = self.lateness.counts();
        std::array::from_fn(|i| counts.get(i).copied().unwrap_or(0))
    }

    /// Counts a delivered retry and its lateness.
    pub fn delivered(&self, late: Duration) {
        self.delivered.inc();
        self.lateness.observe(late);
    }

    /// Counts a parked message.
    pub fn parked(&self, reason: ParkReason) {
        let index = ParkReason::ALL.iter().position(|r| *r == reason).unwrap_or(0);
        self.parked[index].inc();
    }

    /// Counts a due message put back into a tier.
    pub fn deferred(&self, reason: DeferReason) {
        let index = DeferReason::ALL.iter().position(|r| *r == reason).unwrap_or(0);
        self.deferred[index].inc();
    }

    /// Total parked so far, all reasons.
    pub fn parked_total(&self) -> u64 {
        self.parked.iter().map(Counter::get).sum()
    }

    /// Total scheduled so far, all tiers.
    pub fn scheduled_total(&self) -> u64 {
        self.scheduled.iter().map(|t| t.scheduled.get()).sum()
    }
}

/// Keeps a gauge incremented while alive: one per message in flight. It borrows the gauge (the
/// ladder's handles outlive every delivery), so entering costs one atomic add, not also a clone.
#[derive(Debug)]
pub struct InFlight<'a>(&'a Gauge);

impl<'a> InFlight<'a> {
    /// Increments `gauge` until dropped.
    pub fn enter(gauge: &'a Gauge) -> Self {
        gauge.inc();
        InFlight(gauge)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ladder::{DeadLetterStrategy, QueueType};

    #[test]
    fn names_units_and_bounded_labels() {
        let metrics = Metrics::new();
        let spec = LadderSpec::new(
            "orders".into(),
            vec![Duration::from_secs(1), Duration::from_secs(10)],
            3,
            regex::RegexSet::new(["x"]).unwrap(),
            QueueType::Quorum,
            DeadLetterStrategy::AtLeastOnce,
        );
        let l = metrics.ladder(&spec);
        l.hop(Hop::Intake).received.inc();
        l.scheduled("10s", 1_000);
        l.delivered(Duration::from_millis(12));
        l.parked(ParkReason::NoRoute);
        l.deferred(DeferReason::Refused);
        metrics.set_queue_messages("orders", "delay.10s", 7);
        let text = metrics.encode();
        for line in [
            "ladder_received_messages_total{ladder=\"orders\",hop=\"intake\"} 1",
            "ladder_scheduled_messages_total{ladder=\"orders\",tier=\"10s\"} 1",
            "ladder_scheduled_messages_total{ladder=\"orders\",tier=\"1s\"} 0",
            "ladder_delivered_messages_total{ladder=\"orders\"} 1",
            "ladder_parked_messages_total{ladder=\"orders\",reason=\"no-route\"} 1",
            "ladder_parked_messages_total{ladder=\"orders\",reason=\"max-attempts\"} 0",
            "ladder_deferred_messages_total{ladder=\"orders\",reason=\"refused\"} 1",
            "ladder_deferred_messages_total{ladder=\"orders\",reason=\"busy\"} 0",
            "ladder_lateness_seconds_count{ladder=\"orders\"} 1",
            "ladder_queue_messages{ladder=\"orders\",queue=\"delay.10s\"} 7",
            "ladder_unaccounted_messages{ladder=\"orders\"} 0",
            "ladder_unaccounted_alarms_total{ladder=\"orders\"} 0",
            "ladder_in_doubt_messages{ladder=\"orders\"} 0",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert_eq!(l.parked_total(), 1);
        assert_eq!(l.scheduled_total(), 1);
        // the lateness buckets are readable through any handle of the ladder: 12 ms is in
        // the bucket up to 16 ms (1, 2, 4, 8, 16)
        let again = metrics.ladder(&spec);
        again.delivered(Duration::from_secs(3600));
        let mut expected = [0; LATENESS_BUCKETS + 1];
        expected[4] = 1;
        expected[LATENESS_BUCKETS] = 1;
        assert_eq!(l.lateness_counts(), expected);
        metrics.clear_queue_messages("orders", "delay.10s");
        assert!(!metrics.encode().contains("queue=\"delay.10s\""));
    }

    #[test]
    fn in_flight_guard_counts_up_and_down() {
        let gauge = Gauge::default();
        let a = InFlight::enter(&gauge);
        let b = InFlight::enter(&gauge);
        assert_eq!(gauge.get(), 2);
        drop(a);
        drop(b);
        assert_eq!(gauge.get(), 0);
    }
}
