//! Rates for paced replays (`50/s`, `10/m`) and the pacer that spaces publishes evenly.

use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::model::lot::Invalid;

/// A replay rate: `count` messages per `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    /// Messages …
    pub count: u32,
    /// … per this period.
    pub per: Duration,
}

impl Rate {
    /// The gap between two sends.
    pub fn interval(&self) -> Duration {
        self.per / self.count.max(1)
    }
}

impl FromStr for Rate {
    type Err = Invalid;

    /// `N/s`, `N/m` or `N/h`, N ≥ 1.
    fn from_str(text: &str) -> Result<Rate, Invalid> {
        let bad = || Invalid(format!("rate {text:?} is not N/s, N/m or N/h with N >= 1"));
        let (count, unit) = text.trim().split_once('/').ok_or_else(bad)?;
        let count: u32 = whole_number(count.trim()).ok_or_else(bad)?;
        let per = match unit.trim() {
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            _ => return Err(bad()),
        };
        if count == 0 {
            return Err(bad());
        }
        Ok(Rate { count, per })
    }
}

/// Paces sends to a [`Rate`]: a token bucket of one token, so no burst ever exceeds the rate
/// (send `n` happens no earlier than `interval × n` after send 0). Pure: the caller passes the
/// clock and sleeps.
#[derive(Debug, Clone)]
pub struct Pacer {
    interval: Duration,
    next: Option<Instant>,
}

impl Pacer {
    /// A pacer for `rate`.
    pub fn new(rate: Rate) -> Pacer {
        Pacer {
            interval: rate.interval(),
            next: None,
        }
    }

    /// How long to wait, from `now`, before the next send; books that send.
    pub fn delay(&mut self, now: Instant) -> Duration {
        let slot = self.next.map_or(now, |next| next.max(now));
        self.next = Some(slot + self.interval);
        slot - now
    }

    /// Sends at `interval` from the next one on.
    pub fn set_interval(&mut self, interval: Duration) {
        self.interval = interval;
    }
}

/// The fastest a release ramps to: beyond it the in-flight window, not the pace, bounds it.
pub const MAX_RAMPED_PER_SECOND: u32 = 100_000;

/// A release's pace as it ramps: it starts at its rate and doubles every `every` while no
/// failure of the destination came back in that time; after a period with failures it halves,
/// never below the start. So a destination that recovered at a limited capacity is fed about
/// what it takes. Pure: the caller passes the clock and the destination's failures so far.
#[derive(Debug, Clone)]
pub struct Ramp {
    start: Duration,
    fastest: Duration,
    interval: Duration,
    every_ms: u64,
    step_at_ms: u64,
    /// The destination's failures when this period began.
    failures: u64,
}

impl Ramp {
    /// A ramp from `start`, stepping every `every`, at `now_ms` with `failures` counted so far.
    pub fn new(start: Rate, every: Duration, now_ms: u64, failures: u64) -> Ramp {
        let start = start.interval();
        Ramp {
            start,
            fastest: (Duration::from_secs(1) / MAX_RAMPED_PER_SECOND).min(start),
            interval: start,
            every_ms: every.as_millis().max(1) as u64,
            step_at_ms: now_ms,
            failures,
        }
    }

    /// The interval between sends at `now_ms`, with `failures` counted so far (a count that
    /// went down, as when the counter was evicted, reads as no failure).
    pub fn interval(&mut self, now_ms: u64, failures: u64) -> Duration {
        if now_ms >= self.step_at_ms.saturating_add(self.every_ms) {
            self.interval = if failures > self.failures {
                (self.interval * 2).min(self.start)
            } else {
                (self.interval / 2).max(self.fastest)
            };
            self.step_at_ms = now_ms;
            self.failures = failures;
        }
        self.interval
    }
}

/// A whole number as the admin API's description writes one (an OpenAPI `integer`, a rate's
/// count): digits only. Rust's parsers also take a leading `+`, which the description does not.
pub fn whole_number<T: std::str::FromStr>(text: &str) -> Option<T> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ramp_doubles_while_nothing_fails_and_halves_after_failures_never_below_its_start() {
        let start: Rate = "10/s".parse().unwrap();
        let mut ramp = Ramp::new(start, Duration::from_secs(5), 0, 7);
        let ms = |d: Duration| d.as_millis();
        assert_eq!(ms(ramp.interval(4_999, 7)), 100, "the start rate until a period passed");
        assert_eq!(ms(ramp.interval(5_000, 7)), 50);
        assert_eq!(ms(ramp.interval(10_000, 7)), 25);
        // failures came back during the next period: halved
        assert_eq!(ms(ramp.interval(12_000, 9)), 25);
        assert_eq!(ms(ramp.interval(15_000, 9)), 50);
        assert_eq!(ms(ramp.interval(20_000, 12)), 100);
        assert_eq!(ms(ramp.interval(25_000, 20)), 100, "never below the start");
        // a counter that went down (evicted) is no failure
        assert_eq!(ms(ramp.interval(30_000, 0)), 50);
        for at in 1..100 {
            ramp.interval(30_000 + at * 5_000, 0);
        }
        assert_eq!(
            ramp.interval(1_000_000, 0),
            Duration::from_secs(1) / MAX_RAMPED_PER_SECOND
        );
    }

    #[test]
    fn rates_parse() {
        assert_eq!(
            "50/s".parse::<Rate>().unwrap(),
            Rate {
                count: 50,
                per: Duration::from_secs(1)
            }
        );
        assert_eq!("50/s".parse::<Rate>().unwrap().interval(), Duration::from_millis(20));
        assert_eq!(" 30/m ".parse::<Rate>().unwrap().interval(), Duration::from_secs(2));
        assert_eq!("2/h".parse::<Rate>().unwrap().interval(), Duration::from_secs(1800));
        for bad in ["", "50", "0/s", "-1/s", "+5/s", "5/d", "x/s", "5/"] {
            assert!(bad.parse::<Rate>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn pacer_never_exceeds_the_rate() {
        let mut pacer = Pacer::new("10/s".parse().unwrap());
        let t0 = Instant::now();
        assert_eq!(pacer.delay(t0), Duration::ZERO);
        // asked again at once: wait for the next slot
        assert_eq!(pacer.delay(t0), Duration::from_millis(100));
        // the caller slept until its slot and asks again: one more interval
        assert_eq!(pacer.delay(t0 + Duration::from_millis(100)), Duration::from_millis(100));
        // after a long pause no burst is saved up: one send now, the next an interval later
        let later = t0 + Duration::from_secs(10);
        assert_eq!(pacer.delay(later), Duration::ZERO);
        assert_eq!(pacer.delay(later), Duration::from_millis(100));
    }
}
