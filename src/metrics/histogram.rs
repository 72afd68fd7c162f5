//! A histogram of durations whose `observe` takes no lock: two relaxed atomic adds, one to the
//! bucket the value falls in and one to the sum.
//!
//! prometheus-client's own histogram locks a mutex on every observation and cannot be read
//! back; the relay observes two histograms per retry (hop duration, and lateness on the due
//! hop), and the web page's lateness chart needs the counts per bucket. This one keeps the
//! counts per bucket (not cumulative) so both the exposition and the chart read the same
//! numbers, and encodes itself through prometheus-client's `MetricEncoder` as an ordinary
//! OpenMetrics histogram.
//!
//! Values are kept in whole microseconds (a value is truncated to its microsecond, so it may
//! land in a bucket whose bound it exceeds by less than 1 µs). `_count` is the sum of the
//! buckets, so it always agrees with them; a scrape that races an observation may see its
//! bucket a moment before its sum.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// A lock-free histogram of durations with fixed upper bounds (and `+Inf`). Clones share it.
#[derive(Debug, Clone)]
pub struct DurationHistogram(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// Upper bounds, in microseconds, ascending.
    bounds_us: Box<[u64]>,
    /// Observations per bucket, not cumulative; one more than the bounds (`+Inf`).
    counts: Box<[AtomicU64]>,
    /// The sum of the observations, in microseconds.
    sum_us: AtomicU64,
}

impl DurationHistogram {
    /// `n` upper bounds doubling from `first` (which must be at least 1 µs), then `+Inf`.
    pub fn doubling(first: Duration, n: usize) -> Self {
        let bounds_us: Box<[u64]> = doubling_us(first, n).collect();
        let counts = (0..=n).map(|_| AtomicU64::new(0)).collect();
        DurationHistogram(Arc::new(Inner {
            bounds_us,
            counts,
            sum_us: AtomicU64::new(0),
        }))
    }

    /// Counts one observation of `value`.
    pub fn observe(&self, value: Duration) {
        let us = u64::try_from(value.as_micros()).unwrap_or(u64::MAX);
        // the first bound at or above the value; past the last, the `+Inf` bucket
        let bucket = self.0.bounds_us.partition_point(|&bound| bound < us);
        self.0.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.0.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// The upper bounds that [`DurationHistogram::doubling`] gives, in seconds, without
    /// making a histogram.
    pub fn doubling_bounds(first: Duration, n: usize) -> impl Iterator<Item = f64> {
        doubling_us(first, n).map(seconds)
    }

    /// The upper bounds in seconds, `+Inf` left out.
    pub fn bounds(&self) -> impl Iterator<Item = f64> + '_ {
        self.0.bounds_us.iter().copied().map(seconds)
    }

    /// Observations per bucket so far, not cumulative, `+Inf` last.
    pub fn counts(&self) -> Vec<u64> {
        self.0.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect()
    }

    /// The sum of the observations so far, in seconds.
    pub fn sum_seconds(&self) -> f64 {
        seconds(self.0.sum_us.load(Ordering::Relaxed))
    }
}

/// `n` upper bounds doubling from `first` (at least 1 µs), in microseconds.
fn doubling_us(first: Duration, n: usize) -> impl Iterator<Item = u64> {
    let first_us = u64::try_from(first.as_micros()).unwrap_or(u64::MAX).max(1);
    (0..n).map(move |i| first_us.saturating_mul(1u64.checked_shl(i as u32).unwrap_or(u64::MAX)))
}

fn seconds(us: u64) -> f64 {
    us as f64 / 1e6
}

impl TypedMetric for DurationHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for DurationHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let counts = self.counts();
        let buckets: Vec<(f64, u64)> = self
            .bounds()
            .chain(std::iter::once(f64::INFINITY))
            .zip(counts.iter().copied())
            .collect();
        encoder.encode_histogram::<NoLabelSet>(self.sum_seconds(), counts.iter().sum(), &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::registry::Registry;

    #[test]
    fn buckets_are_upper_bounds_inclusive_and_the_last_is_inf() {
        let h = DurationHistogram::doubling(Duration::from_millis(1), 4);
        assert_eq!(h.bounds().collect::<Vec<_>>(), [0.001, 0.002, 0.004, 0.008]);
        assert!(DurationHistogram::doubling_bounds(Duration::from_millis(1), 4).eq(h.bounds()));
        for ms in [0, 1, 2, 3, 8, 9, 3_600_000] {
            h.observe(Duration::from_millis(ms));
        }
        // 0 and 1 ms ≤ 1 ms; 2 ≤ 2; 3 ≤ 4; 8 ≤ 8; 9 ms and an hour past the last bound
        assert_eq!(h.counts(), [2, 1, 1, 1, 2]);
        assert!((h.sum_seconds() - 3_600.023).abs() < 1e-9, "{}", h.sum_seconds());
        // a clone is the same histogram
        h.clone().observe(Duration::from_micros(1_500));
        assert_eq!(h.counts(), [2, 2, 1, 1, 2]);
    }

    #[test]
    fn encodes_as_a_cumulative_openmetrics_histogram() {
        type Labels = Vec<(String, String)>;
        let family: Family<Labels, DurationHistogram, fn() -> DurationHistogram> =
            Family::new_with_constructor(|| DurationHistogram::doubling(Duration::from_micros(100), 2));
        let mut registry = Registry::default();
        registry.register("t_seconds", "test", family.clone());
        let h = family.get_or_create(&vec![("hop".into(), "due".into())]).clone();
        h.observe(Duration::from_micros(50));
        h.observe(Duration::from_micros(150));
        h.observe(Duration::from_secs(2));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "# TYPE t_seconds histogram",
            "t_seconds_sum{hop=\"due\"} 2.0002",
            "t_seconds_count{hop=\"due\"} 3",
            "t_seconds_bucket{le=\"0.0001\",hop=\"due\"} 1",
            "t_seconds_bucket{le=\"0.0002\",hop=\"due\"} 2",
            "t_seconds_bucket{le=\"+Inf\",hop=\"due\"} 3",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn concurrent_observations_are_all_counted() {
        let h = DurationHistogram::doubling(Duration::from_millis(1), 16);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let h = h.clone();
                s.spawn(move || {
                    for i in 0..10_000u64 {
                        h.observe(Duration::from_micros((i * 7 + t) % 40_000_000));
                    }
                });
            }
        });
        assert_eq!(h.counts().iter().sum::<u64>(), 40_000);
        let expected: u64 = (0..4u64)
            .flat_map(|t| (0..10_000u64).map(move |i| (i * 7 + t) % 40_000_000))
            .sum();
        assert_eq!(h.0.sum_us.load(Ordering::Relaxed), expected);
    }
}
