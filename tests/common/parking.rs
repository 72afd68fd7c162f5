//! Fixtures of the parking-lot tests (`parking`, `parking_http`, …): a ladder that parks at
//! once, and parked messages of every reason and two destinations, each recognisable by its
//! index (`m-<i>`, tenant `t<i % 4>`, correlation `c-<i % 10>`).

use ladder::model::envelope::Envelope;
use ladder_amqp::{BasicProperties, Delivery, FieldTable, FieldValue};

use super::{TestLadder, text};

/// One 100 ms tier and no retry to spare: `retry-attempt = 1` is parked at once as `max-attempts`.
pub const ONE_TIER: &str = "backoff = [\"100ms\"]\nmax_attempts = 1\nallow = [\"^{ns}-\"]";

/// `retry-first-failed-at` of the messages [`park_mix`] parks for `b`.
pub const B_FIRST_FAILED_AT: i64 = 1_700_000_000_000;

/// How many of each kind [`park_mix`] parks, in this order.
#[derive(Debug, Clone, Copy)]
pub struct Mix {
    /// `max-attempts`, for `a`.
    pub to_a: usize,
    /// `max-attempts`, for `b`, first failed at [`B_FIRST_FAILED_AT`].
    pub to_b: usize,
    /// `invalid-header` (`retry-delay: soon`), for `a`.
    pub invalid: usize,
    /// `no-destination`.
    pub no_destination: usize,
}

impl Mix {
    pub const fn total(&self) -> usize {
        self.to_a + self.to_b + self.invalid + self.no_destination
    }
}

/// Properties of message `i`: id `m-<i>`, correlation `c-<i % 10>`, headers `tenant` =
/// `t<i % 4>` and `seq` = `i` (a long int), then `headers`.
pub fn props(i: usize, headers: Vec<(&str, FieldValue)>) -> BasicProperties {
    let mut table = FieldTable::default();
    table.set("tenant", text(&format!("t{}", i % 4)));
    table.set("seq", FieldValue::LongInt(i as i32));
    for (k, v) in headers {
        table.set(k, v);
    }
    BasicProperties::default()
        .with_message_id(&format!("m-{i}"))
        .with_correlation_id(&format!("c-{}", i % 10))
        .with_content_type("application/json")
        .with_app_id("shop")
        .with_priority(3)
        .with_headers(table)
}

/// Body of message `i`: `{"i": <i>, "kind": "order"}`, or, for every fiftieth, three bytes
/// that are not UTF-8 and so never match a body search.
pub fn body(i: usize) -> Vec<u8> {
    if i % 50 == 49 {
        vec![0xff, 0xfe, i as u8]
    } else {
        format!("{{\"i\": {i}, \"kind\": \"order\"}}").into_bytes()
    }
}

/// Headers that park a message at once, as `max-attempts`, for `to`.
fn exhausted(to: &str) -> Vec<(&'static str, FieldValue)> {
    vec![("retry-to", text(to)), ("retry-attempt", FieldValue::LongLongInt(1))]
}

/// Parks `mix` through the service, messages `0..mix.total()` in the order of [`Mix`]'s fields;
/// returns the envelopes, in stream order.
pub async fn park_mix(t: &TestLadder, mix: Mix, a: &str, b: &str) -> Vec<Envelope> {
    for i in 0..mix.total() {
        let headers = if i < mix.to_a {
            exhausted(a)
        } else if i < mix.to_a + mix.to_b {
            let mut h = exhausted(b);
            h.push(("retry-first-failed-at", FieldValue::LongLongInt(B_FIRST_FAILED_AT)));
            h
        } else if i < mix.to_a + mix.to_b + mix.invalid {
            vec![("retry-to", text(a)), ("retry-delay", text("soon"))]
        } else {
            vec![]
        };
        t.publish(&t.intake(), "", &body(i), props(i, headers)).await;
    }
    t.parked(mix.total()).await
}

/// Parks messages `0..n` through the service, all `max-attempts` for `to`; returns the
/// envelopes, in stream order.
pub async fn park_to(t: &TestLadder, to: &str, n: usize) -> Vec<Envelope> {
    for i in 0..n {
        t.publish(&t.intake(), "", &body(i), props(i, exhausted(to))).await;
    }
    t.parked(n).await
}

/// The message ids of `deliveries`, in order.
pub fn ids<'a>(deliveries: impl IntoIterator<Item = &'a Delivery>) -> Vec<String> {
    deliveries
        .into_iter()
        .map(|d| d.properties.message_id.as_ref().expect("a message id").to_string())
        .collect()
}
