//! What the benchmark records: per-step measurements and the summaries built from them.
//! Plain data, serialized to `results.json` next to the generated report.

use serde::{Deserialize, Serialize};

/// Percentiles of a lateness sample, in ms.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Pcts {
    /// Sample size.
    pub n: usize,
    /// Median.
    pub p50: i64,
    /// 99th percentile (nearest rank).
    pub p99: i64,
    /// Maximum.
    pub max: i64,
}

/// Nearest-rank percentiles of `v`.
pub fn pcts(mut v: Vec<i64>) -> Pcts {
    if v.is_empty() {
        return Pcts::default();
    }
    v.sort_unstable();
    let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Pcts {
        n: v.len(),
        p50: rank(0.50),
        p99: rank(0.99),
        max: *v.last().unwrap(),
    }
}

/// One load step: a target (ladder or relay) at one offered rate for a few seconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Step {
    /// `capacity` (a search step) or `fixed` (a fixed-rate lateness measurement).
    pub phase: String,
    /// `ladder` or `relay`.
    pub target: String,
    /// `quorum-alo`, `quorum-amo`, `classic`.
    pub cfg: String,
    /// Retries per second asked for.
    pub offered: f64,
    /// Retries per second the publisher achieved.
    pub achieved: f64,
    /// Publishing time.
    pub secs: f64,
    /// Published and confirmed.
    pub sent: u64,
    /// Redelivered to the destination (duplicates removed).
    pub delivered: u64,
    /// Redelivered more than once.
    pub duplicates: u64,
    /// Sent but never redelivered within the wait.
    pub lost: u64,
    /// Publishes the broker nacked or returned.
    pub refused: u64,
    /// Stopped as soon as more than 1% were over 100 ms late (a certain miss).
    pub stopped_early: bool,
    /// Lateness against publish time + delay (includes the intake hop).
    pub e2e: Pcts,
    /// Lateness against the `retry-due-at` header.
    pub due: Pcts,
    /// CPU seconds of the relay process (ladder or minimal relay) during the step.
    pub cpu_s: f64,
    /// Its CPU seconds per 10 000 retries.
    pub cpu_per_10k: f64,
    /// The part of `cpu_per_10k` spent in the kernel (system calls), seconds per 10 000.
    #[serde(default)]
    pub sys_per_10k: f64,
    /// The broker's CPU seconds per 10 000 retries.
    pub broker_cpu_per_10k: f64,
    /// The relay process's resident set at the end of the step, kB.
    pub rss_kb: u64,
    /// Before the step, seconds waited for the broker to go quiet (`scenarios::QUIET_BROKER`).
    #[serde(default)]
    pub broker_settle_s: f64,
    /// The share of the machine's CPU time the hypervisor stole during the step, % (a virtual
    /// machine's neighbours: at tens of percent, a step measures them more than the services).
    #[serde(default)]
    pub steal_pct: f64,
    /// p99 e2e < 100 ms, nothing lost or refused, offered rate achieved.
    pub pass: bool,
}

/// The result of one capacity search.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Capacity {
    /// Configuration.
    pub cfg: String,
    /// Highest passing rate of the ladder (0 if none passed).
    pub ladder: f64,
    /// Lowest failing rate of the ladder (`None`: it never failed up to the search's ceiling).
    pub ladder_fail: Option<f64>,
    /// Highest passing rate of the minimal relay.
    pub relay: f64,
    /// Lowest failing rate of the minimal relay.
    pub relay_fail: Option<f64>,
}

impl Capacity {
    /// The rate at which CPU per retry is compared: 80 % of the *lower* of the two capacities,
    /// so that both processes keep up. Above a process's capacity it takes more deliveries per
    /// wake-up and so spends less CPU per retry; a rate only one of them sustains would favour
    /// the one that falls behind. `None` when neither passed a step.
    pub fn cpu_rate(&self) -> Option<f64> {
        let lower = [self.ladder, self.relay]
            .into_iter()
            .filter(|&c| c > 0.0)
            .fold(f64::INFINITY, f64::min);
        lower.is_finite().then(|| crate::round50(lower * 0.8))
    }
}

/// Lateness of one stream in the short/long mix.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MixStream {
    /// `ladder` or `per-message TTL`.
    pub name: String,
    /// Short retries: lateness against publish time + delay.
    pub short: Pcts,
    /// Long retries.
    pub long: Pcts,
    /// Short retries more than 100 ms late.
    pub short_late_100: usize,
    /// Sent, delivered.
    pub sent: u64,
    /// Delivered (duplicates removed).
    pub delivered: u64,
    /// All short-retry lateness values (ms), for the plot.
    #[serde(default)]
    pub short_values: Vec<i64>,
}

/// The short/long mix: ladder vs per-message TTL.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Mix {
    /// Rate of each stream.
    pub rate: f64,
    /// Publishing time.
    pub secs: f64,
    /// Short delay, ms.
    pub short_ms: u64,
    /// Long delay, ms.
    pub long_ms: u64,
    /// One long retry in this many.
    pub long_every: u64,
    /// The two streams.
    pub streams: Vec<MixStream>,
}

/// The in-process retry.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct InProcess {
    /// RSS with nothing held, kB.
    pub rss_idle_kb: u64,
    /// (messages held, RSS kB), unacked mode.
    pub rss_held: Vec<(u64, u64)>,
    /// Unacked mode: messages held at the crash.
    pub crash_unacked_held: u64,
    /// How many were back in the queue, ready, after the crash.
    pub crash_unacked_back: u64,
    /// How long after the SIGKILL they were all back (ms).
    pub crash_unacked_back_ms: u64,
    /// Acked mode: messages held at the crash.
    pub crash_acked_held: u64,
    /// Acked mode: RSS with them held, kB.
    pub crash_acked_rss_kb: u64,
    /// Acked mode: messages in the queue after the crash.
    pub crash_acked_back: u64,
}

/// A million retries waiting in a long tier.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Million {
    /// Retries published.
    pub count: u64,
    /// Seconds from the first publish until all were in the tier.
    pub secs: f64,
    /// Ladder RSS before, kB.
    pub ladder_rss_before_kb: u64,
    /// Ladder RSS with all of them waiting, kB.
    pub ladder_rss_after_kb: u64,
    /// Highest ladder RSS seen while it moved them, kB.
    pub ladder_rss_peak_kb: u64,
    /// Ladder CPU seconds per 10 000 intake hops while it moved them.
    pub ladder_cpu_per_10k: f64,
    /// Broker RSS before, with them waiting, after deleting them, kB.
    pub broker_rss_kb: (u64, u64, u64),
    /// Skipped, and why.
    pub skipped: Option<String>,
}

#[cfg(test)]
mod capacity_tests {
    use super::Capacity;

    fn cap(ladder: f64, relay: f64) -> Capacity {
        Capacity {
            cfg: "quorum-amo".into(),
            ladder,
            relay,
            ..Capacity::default()
        }
    }

    #[test]
    fn cpu_is_compared_at_eighty_percent_of_the_lower_capacity() {
        assert_eq!(cap(8000.0, 6000.0).cpu_rate(), Some(4800.0));
        assert_eq!(cap(4000.0, 6000.0).cpu_rate(), Some(3200.0));
        assert_eq!(cap(4000.0, 4000.0).cpu_rate(), Some(3200.0));
    }

    #[test]
    fn a_process_that_passed_no_step_does_not_set_the_rate() {
        assert_eq!(cap(4000.0, 0.0).cpu_rate(), Some(3200.0));
        assert_eq!(cap(0.0, 6000.0).cpu_rate(), Some(4800.0));
        assert_eq!(cap(0.0, 0.0).cpu_rate(), None);
    }
}
