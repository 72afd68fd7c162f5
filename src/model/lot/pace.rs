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
