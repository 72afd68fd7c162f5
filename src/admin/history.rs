//! The overview's memory of the last hour: the depth poller folds each [`Snapshot`] into
//! one-minute [`Point`]s per ladder, which the web page draws ([`crate::admin::charts`]).
//!
//! Bounded: per ladder at most [`MINUTES`] closed points plus the minute in progress (two
//! samples), about 5 KB per ladder, whatever the traffic or the uptime. It holds only what this
//! process counted (like `/api/ladders`' rates): nothing is read back from the broker, and a
//! restart starts an empty hour. Pure: the poller calls [`History::record`]; no I/O, no clock.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::admin::snapshot::Snapshot;
use crate::model::ladder::LadderSpec;

/// Closed one-minute points kept per ladder: the hour the overview draws.
pub const MINUTES: usize = 60;

/// One minute, in ms.
pub const MINUTE_MS: u64 = 60_000;

/// The share of deliveries the lateness chart's quantile leaves above it.
pub const LATENESS_QUANTILE: f64 = 0.99;

pub use crate::admin::snapshot::LatenessCounts;

/// One minute of one ladder.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Point {
    /// Which minute: minutes since the epoch.
    pub minute: u64,
    /// Deliveries taken from the intake queue in the minute.
    pub received: u64,
    /// Retries delivered to their destination in the minute.
    pub delivered: u64,
    /// Messages parked in the minute.
    pub parked: u64,
    /// Waiting in the backoff steps' queues at the minute's last poll (`None`: not read).
    pub waiting_steps: Option<u64>,
    /// Waiting in the delay levels' queues at the minute's last poll.
    pub waiting_levels: Option<u64>,
    /// The estimated 99th percentile of the minute's delivery lateness, in seconds
    /// ([`quantile`]); `None` when nothing was delivered.
    pub lateness_p99: Option<f64>,
}

/// What one poll contributes to a ladder's history.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// When the poll ended, ms since the epoch.
    pub at_ms: u64,
    /// The process's counters (cumulative).
    pub received: u64,
    /// Cumulative deliveries.
    pub delivered: u64,
    /// Cumulative parks.
    pub parked: u64,
    /// Cumulative lateness observations per bucket.
    pub lateness: LatenessCounts,
    /// Ready messages in the backoff steps' queues (`None`: the poll could not read them).
    pub waiting_steps: Option<u64>,
    /// Ready messages in the delay levels' queues.
    pub waiting_levels: Option<u64>,
}

/// The minute in progress: the sample it is measured from and the latest one.
#[derive(Debug, Clone, Copy)]
struct Open {
    minute: u64,
    from: Sample,
    last: Sample,
}

/// One ladder's last hour.
#[derive(Debug, Clone)]
pub struct LadderHistory {
    /// The queue roles (`delay.<tier>`) of the ladder's backoff steps; other tiers are levels.
    step_roles: Vec<String>,
    closed: VecDeque<Point>,
    open: Option<Open>,
    /// Since when the accounting check reports messages unaccounted for (ms since the epoch).
    unaccounted_since_ms: Option<u64>,
}

impl LadderHistory {
    /// An empty history for a ladder whose backoff steps are the tiers named `steps`.
    pub fn new<'a>(steps: impl IntoIterator<Item = &'a str>) -> Self {
        LadderHistory {
            step_roles: steps.into_iter().map(|s| format!("delay.{s}")).collect(),
            closed: VecDeque::with_capacity(MINUTES),
            open: None,
            unaccounted_since_ms: None,
        }
    }

    /// Folds one poll in. A poll in a later minute closes the minute in progress; the counts
    /// between the last poll of a minute and the first of the next go to the next. After a
    /// gap of more than a minute (no polls: the process was busy or stopped polling) the new
    /// minute starts from the new sample, so the gap's traffic is not put in one minute.
    /// Samples older than the minute in progress are ignored.
    pub fn record(&mut self, sample: Sample) {
        let minute = sample.at_ms / MINUTE_MS;
        let Some(open) = &mut self.open else {
            self.open = Some(Open {
                minute,
                from: sample,
                last: sample,
            });
            return;
        };
        if minute < open.minute {
            return;
        }
        if minute == open.minute {
            open.last = sample;
            return;
        }
        let closed = point(open);
        let from = if minute == open.minute + 1 { open.last } else { sample };
        *open = Open {
            minute,
            from,
            last: sample,
        };
        if self.closed.len() == MINUTES {
            self.closed.pop_front();
        }
        self.closed.push_back(closed);
    }

    /// The closed minutes and the one in progress (so far), oldest first, within the
    /// [`MINUTES`] minutes up to and including the one in progress.
    pub fn points(&self) -> Vec<Point> {
        let Some(open) = &self.open else {
            return Vec::new();
        };
        let first = (open.minute + 1).saturating_sub(MINUTES as u64);
        self.closed
            .iter()
            .filter(|p| p.minute >= first)
            .copied()
            .chain(std::iter::once(point(open)))
            .collect()
    }

    /// The minute in progress (minutes since the epoch), if any poll was recorded.
    pub fn current_minute(&self) -> Option<u64> {
        self.open.map(|o| o.minute)
    }

    /// Since when messages have been unaccounted for, if they are now.
    pub fn unaccounted_since_ms(&self) -> Option<u64> {
        self.unaccounted_since_ms
    }

    /// Notes the accounting check's `unaccounted` count at `at_ms`.
    fn note_unaccounted(&mut self, unaccounted: u64, at_ms: u64) {
        self.unaccounted_since_ms = match (unaccounted, self.unaccounted_since_ms) {
            (0, _) => None,
            (_, Some(since)) => Some(since),
            (_, None) => Some(at_ms),
        };
    }
}

/// The point of a minute measured from `open.from` to `open.last`.
fn point(open: &Open) -> Point {
    let (from, to) = (&open.from, &open.last);
    let lateness: LatenessCounts = std::array::from_fn(|i| to.lateness[i].saturating_sub(from.lateness[i]));
    Point {
        minute: open.minute,
        received: to.received.saturating_sub(from.received),
        delivered: to.delivered.saturating_sub(from.delivered),
        parked: to.parked.saturating_sub(from.parked),
        waiting_steps: to.waiting_steps,
        waiting_levels: to.waiting_levels,
        lateness_p99: quantile(&lateness, LATENESS_QUANTILE),
    }
}

/// The `q`-quantile of the observations counted per bucket in `counts` (bounds
/// [`crate::metrics::lateness_bounds`], then `+Inf`), as Prometheus' `histogram_quantile`
/// estimates it: linear within the bucket the quantile falls in. The true value lies in the
/// same bucket, so the estimate is off by less than the bucket's width — a factor of two
/// here (between 1 ms and ~33 s); in the `+Inf` bucket it is the highest bound (~33 s), a
/// floor. `None` without observations.
pub fn quantile(counts: &LatenessCounts, q: f64) -> Option<f64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let bounds: Vec<f64> = crate::metrics::lateness_bounds().collect();
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let mut below = 0u64;
    for (i, &n) in counts.iter().enumerate() {
        if n > 0 && (below + n) as f64 >= rank {
            let Some(&upper) = bounds.get(i) else {
                return bounds.last().copied();
            };
            let lower = if i == 0 { 0.0 } else { bounds[i - 1] };
            return Some(lower + (upper - lower) * ((rank - below as f64) / n as f64).clamp(0.0, 1.0));
        }
        below += n;
    }
    bounds.last().copied()
}

/// Every ladder's history, in config order.
#[derive(Debug, Clone, Default)]
pub struct History {
    ladders: Vec<(String, LadderHistory)>,
}

/// The history the poller writes and the web page reads; the lock is held only to copy.
pub type SharedHistory = Arc<Mutex<History>>;

impl History {
    /// An empty history of `ladders`.
    pub fn new(ladders: &[LadderSpec]) -> Self {
        History {
            ladders: ladders
                .iter()
                .map(|spec| {
                    let history = LadderHistory::new(spec.steps.iter().map(|t| t.name.as_str()));
                    (spec.name.clone(), history)
                })
                .collect(),
        }
    }

    /// Folds one poll of every ladder in.
    pub fn record(&mut self, snapshot: &Snapshot) {
        for (name, history) in &mut self.ladders {
            let Some(l) = snapshot.ladder(name) else {
                continue;
            };
            let waiting = |step: bool| {
                l.depths.as_ref().map(|depths| {
                    depths
                        .iter()
                        .filter(|(role, _)| role.starts_with("delay.") && history.step_roles.contains(role) == step)
                        .map(|(_, n)| n.unwrap_or(0))
                        .sum()
                })
            };
            let sample = Sample {
                at_ms: snapshot.at_ms,
                received: l.counters.received_intake,
                delivered: l.counters.delivered,
                parked: l.counters.parked,
                lateness: l.lateness,
                waiting_steps: waiting(true),
                waiting_levels: waiting(false),
            };
            history.record(sample);
            history.note_unaccounted(l.accounting.unaccounted, snapshot.at_ms);
        }
    }

    /// The history of ladder `name`.
    pub fn ladder(&self, name: &str) -> Option<&LadderHistory> {
        self.ladders.iter().find(|(n, _)| n == name).map(|(_, h)| h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::LATENESS_BUCKETS;

    fn sample(at_ms: u64, received: u64) -> Sample {
        Sample {
            at_ms,
            received,
            delivered: received / 2,
            parked: 0,
            lateness: [0; LATENESS_BUCKETS + 1],
            waiting_steps: Some(received),
            waiting_levels: None,
        }
    }

    #[test]
    fn an_empty_history_has_no_points() {
        assert!(LadderHistory::new(["1s"]).points().is_empty());
    }

    #[test]
    fn polls_fold_into_minutes_counting_from_the_previous_minutes_last_poll() {
        let mut h = LadderHistory::new(["1s"]);
        let t0 = 1_000 * MINUTE_MS;
        h.record(sample(t0 + 1_000, 10));
        h.record(sample(t0 + 30_000, 25));
        h.record(sample(t0 + MINUTE_MS + 5_000, 40));
        let points = h.points();
        assert_eq!(points.len(), 2);
        assert_eq!(
            (points[0].minute, points[0].received, points[0].delivered),
            (1_000, 15, 7)
        );
        assert_eq!(points[0].waiting_steps, Some(25), "the minute's last depth");
        // the minute in progress counts from the last poll of the one before
        assert_eq!((points[1].minute, points[1].received), (1_001, 15));
        // a sample from the past changes nothing
        h.record(sample(t0, 99));
        assert_eq!(h.points(), points);
    }

    #[test]
    fn a_gap_without_polls_does_not_pile_its_traffic_into_one_minute() {
        let mut h = LadderHistory::new(["1s"]);
        h.record(sample(0, 0));
        h.record(sample(10 * MINUTE_MS, 500));
        h.record(sample(10 * MINUTE_MS + 1, 510));
        let points = h.points();
        assert_eq!(
            points.iter().map(|p| (p.minute, p.received)).collect::<Vec<_>>(),
            [(0, 0), (10, 10)]
        );
    }

    #[test]
    fn the_history_is_bounded_to_an_hour() {
        let mut h = LadderHistory::new(["1s"]);
        for minute in 0..500u64 {
            for second in [0, 20, 40] {
                h.record(sample(minute * MINUTE_MS + second * 1_000, minute * 3));
            }
        }
        assert_eq!(h.closed.len(), MINUTES);
        let points = h.points();
        assert_eq!(points.len(), MINUTES, "59 closed minutes and the one in progress");
        assert_eq!(points.first().unwrap().minute, 500 - MINUTES as u64);
        assert_eq!(points.last().unwrap().minute, 499);
        assert!(points.windows(2).all(|w| w[0].minute + 1 == w[1].minute));
    }

    #[test]
    fn p99_falls_in_the_bucket_that_holds_it() {
        let none = [0; LATENESS_BUCKETS + 1];
        assert_eq!(quantile(&none, 0.99), None);
        // 100 deliveries: 98 within 1 ms, 2 between 8 and 16 ms — the 99th is in (8, 16] ms
        let mut counts = none;
        counts[0] = 98;
        counts[4] = 2;
        let p99 = quantile(&counts, 0.99).unwrap();
        assert!((0.008..=0.016).contains(&p99), "{p99}");
        assert!((p99 - 0.012).abs() < 1e-9, "linear within the bucket: {p99}");
        // all in +Inf: the highest bound, a floor
        let mut over = none;
        over[LATENESS_BUCKETS] = 5;
        assert!((quantile(&over, 0.99).unwrap() - 0.001 * 2f64.powi(15)).abs() < 1e-9);
    }

    #[test]
    fn lateness_per_minute_comes_from_the_bucket_deltas() {
        let mut h = LadderHistory::new(["1s"]);
        let mut s = sample(0, 0);
        s.lateness[10] = 1_000; // an old slow minute
        h.record(s);
        s.at_ms = MINUTE_MS;
        h.record(s);
        s.at_ms = MINUTE_MS + 1;
        s.lateness[0] += 100; // this minute: 100 fast deliveries
        h.record(s);
        let points = h.points();
        assert_eq!(points[0].lateness_p99, None, "nothing delivered in the first minute");
        assert!(points[1].lateness_p99.unwrap() <= 0.001, "{:?}", points[1]);
    }

    #[test]
    fn waiting_is_split_into_steps_and_levels() {
        use crate::admin::snapshot::{AccountingStatus, LadderSnapshot};
        use crate::model::accounting::Counters;
        let mut history = History {
            ladders: vec![("orders".into(), LadderHistory::new(["1s", "10s"]))],
        };
        let snapshot = Snapshot {
            at: std::time::Instant::now(),
            at_ms: 5 * MINUTE_MS,
            broker_error: None,
            ladders: vec![LadderSnapshot {
                name: "orders".into(),
                depths: Some(vec![
                    ("intake".into(), Some(100)),
                    ("delay.1s".into(), Some(3)),
                    ("delay.10s".into(), Some(4)),
                    ("delay.16ms".into(), Some(5)),
                    ("delay.1h".into(), None),
                ]),
                counters: Counters::default(),
                rates: None,
                accounting: AccountingStatus {
                    verdict: "unaccounted",
                    anchored: true,
                    missing: Some(2),
                    unaccounted: 2,
                    in_doubt: 0,
                },
                next_leaves: Vec::new(),
                lateness: [0; LATENESS_BUCKETS + 1],
            }],
        };
        history.record(&snapshot);
        let h = history.ladder("orders").unwrap();
        let p = h.points()[0];
        assert_eq!((p.waiting_steps, p.waiting_levels), (Some(7), Some(5)));
        assert_eq!(h.unaccounted_since_ms(), Some(5 * MINUTE_MS));
    }
}
