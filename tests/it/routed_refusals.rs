//! A repeat failure the broker routed past the intake (`N.L` → `N.L.next` → `N.delay.<tier>`, by
//! the `retry-next` the due hop wrote when it delivered the retry before) that then meets a
//! destination that cannot take it: the due hop, which took the failure in, keeps the intake's
//! guarantees. A full destination (`x-max-length`, `reject-publish`: the broker nacks the
//! publish) defers the retry into a tier again, no attempt counted, until there is room; a
//! destination deleted while the retry waits returns the mandatory publish, and the retry is
//! parked as `no-route` with its attempt and history. In dead-letter mode and in explicit mode.

use std::time::{Duration, Instant};

use crate::common::*;
use ladder::model::names::Hop;
use ladder::model::protocol::parse_history;
use ladder_amqp::{BasicProperties, Delivery, FieldTable, FieldValue};

/// The second step is long enough for the test to act (fill or delete the destination) before a
/// repeat failure routed into it comes due.
const LADDER: &str = r#"
backoff = ["300ms", "1s"]
max_attempts = 3
allow = ["^{ns}-"]
"#;

/// How a consumer fails a message.
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// The destination queue dead-letters into `N.L`; the consumer rejects.
    DeadLetter,
    /// The consumer republishes the message as received to `N.L` (`retry-to` set by the
    /// ladder's delivery), then acks it.
    Explicit,
}

fn received(t: &TestLadder, hop: Hop) -> u64 {
    t.state.ladder(&t.ladder).unwrap().metrics.hop(hop).received.get()
}

/// `ladder_deferred_messages_total` for the reason `refused`.
fn refused(t: &TestLadder) -> u64 {
    t.state
        .metrics
        .encode()
        .lines()
        .find(|l| l.starts_with("ladder_deferred_messages_total{") && l.contains("reason=\"refused\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0)
}

/// `(attempt, tier)` of each `retry-history` entry of `headers`.
fn history_of(headers: Option<&FieldTable>) -> Vec<(u64, String)> {
    headers
        .and_then(|h| h.get("retry-history"))
        .map(parse_history)
        .unwrap_or_default()
        .into_iter()
        .map(|e| (e.attempt, e.tier))
        .collect()
}

fn steps(entries: &[(u64, &str)]) -> Vec<(u64, String)> {
    entries.iter().map(|(a, t)| (*a, t.to_string())).collect()
}

/// The ladder, its destination `orders` (dead-lettering into `N.L` in dead-letter mode) and a
/// consumer on it; the message `id` failed once (through the intake) and its first retry,
/// delivered by the ladder with `retry-next`, in the consumer's hands.
async fn first_retry(hint: &str, mode: Mode, orders_args: FieldTable) -> (TestLadder, String, TestConsumer, Delivery) {
    let mut t = TestLadder::start(hint, LADDER).await;
    let mut args = orders_args;
    if let Mode::DeadLetter = mode {
        args.set("x-dead-letter-exchange", text(&t.intake()));
    }
    let orders = t.declare_queue("orders", args).await;
    let mut consumer = t.consume(&orders).await;
    let body = b"routed".as_slice();
    match mode {
        Mode::DeadLetter => {
            let props = BasicProperties::default().with_message_id("m-1").with_delivery_mode(2);
            t.publish("", &orders, body, props).await;
            let d = next(&mut consumer).await;
            consumer.reject(&d, false);
        }
        Mode::Explicit => {
            let props = retry_props(&orders, None).with_message_id("m-1").with_delivery_mode(2);
            t.publish(&t.intake(), "", body, props).await;
        }
    }
    let d = next(&mut consumer).await;
    assert_eq!(message_id(&d), "m-1");
    assert_eq!(int_header(&d, "retry-attempt"), Some(1));
    assert_eq!(
        headers_of(&d).get("retry-next"),
        Some(&text("1s")),
        "the first retry says where its next failure waits"
    );
    assert_eq!(received(&t, Hop::Intake), 1, "the first failure took the intake");
    (t, orders, consumer, d)
}

/// Fails `d` as `mode` does: its next failure, routed by its `retry-next` past the intake.
async fn fail(t: &TestLadder, consumer: &TestConsumer, d: &Delivery, mode: Mode) {
    match mode {
        Mode::DeadLetter => consumer.reject(d, false),
        Mode::Explicit => {
            t.publish(&t.intake(), "", &d.body, republish_props(d, &[])).await;
            consumer.ack(d);
        }
    }
}

/// A routed repeat failure whose destination is full: each refused delivery waits in a tier
/// again (`retry-deferrals` counts them, the attempt does not move), and once there is room it
/// is delivered, once, as the second retry; the intake saw only the first failure.
async fn a_routed_failure_to_a_full_destination_waits_for_room(mode: Mode) {
    let mut full = FieldTable::default();
    full.set("x-max-length", FieldValue::LongLongInt(1));
    full.set("x-overflow", text("reject-publish"));
    let (t, orders, consumer, d) = first_retry(&format!("routed-full-{mode:?}"), mode, full).await;
    // the consumer stops taking from the queue, so one filler makes it full
    consumer.channel.basic_cancel(consumer.consumer.tag()).await.unwrap();
    t.publish(
        "",
        &orders,
        b"filler",
        BasicProperties::default().with_message_id("filler"),
    )
    .await;
    fail(&t, &consumer, &d, mode).await;

    // refused twice: it came due, was refused and waited in a tier, came due again, was refused
    let refusals = eventually("the full destination refuses the retry twice", WAIT, async || {
        (refused(&t) >= 2).then(|| refused(&t))
    })
    .await;
    assert_eq!(
        received(&t, Hop::Intake),
        1,
        "the repeat failure and its deferrals skipped the intake"
    );

    // room: the filler is taken, and the retry follows
    let mut consumer = t.consume(&orders).await;
    let filler = next(&mut consumer).await;
    assert_eq!(message_id(&filler), "filler");
    consumer.ack(&filler);
    let retry = next(&mut consumer).await;
    consumer.ack(&retry);
    assert_eq!(message_id(&retry), "m-1");
    assert_eq!(retry.body, b"routed");
    assert_eq!(
        int_header(&retry, "retry-attempt"),
        Some(2),
        "a deferral is not an attempt"
    );
    let deferrals = int_header(&retry, "retry-deferrals").expect("retry-deferrals");
    let refusals_now = refused(&t);
    assert!(
        deferrals >= 2 && deferrals as u64 == refusals_now,
        "retry-deferrals {deferrals}, refusals counted {refusals_now} (at least {refusals} seen before room was made)"
    );
    assert_eq!(
        history_of(retry.properties.headers.as_ref()),
        steps(&[(1, "300ms"), (2, "1s")]),
        "one entry per failure, none per deferral"
    );
    assert_eq!(
        headers_of(&retry).get("retry-next"),
        Some(&text("1s")),
        "the delivery says where a third failure waits"
    );
    assert!(headers_of(&retry).get("x-death").is_none(), "x-death stripped");
    // the due hop: the first retry, the routed failure, and each deferral coming due again
    assert_eq!(received(&t, Hop::Due), 2 + refusals_now);
    assert_eq!(received(&t, Hop::Intake), 1, "the intake saw the first failure only");
    assert_eq!(
        t.lot().index_for(&Default::default()).await.unwrap().read().len(),
        0,
        "nothing parked"
    );
    t.assert_nothing_more("a second delivery of the retry", &mut consumer, &orders, Via::Ladder)
        .await;
}

/// A routed repeat failure whose destination was deleted while it waited: the due hop's
/// mandatory publish is returned and the retry is parked as `no-route`, with the attempt the
/// due hop counted for it and both failures in its history.
async fn a_routed_failure_to_a_deleted_destination_is_parked_as_no_route(mode: Mode) {
    let (t, orders, consumer, d) = first_retry(&format!("routed-gone-{mode:?}"), mode, FieldTable::default()).await;
    let failed = Instant::now();
    fail(&t, &consumer, &d, mode).await;
    let _ = consumer.channel.close(200, "done").await;
    t.channel.queue_delete(&orders).await.unwrap();
    assert!(
        failed.elapsed() < Duration::from_millis(800),
        "the destination was deleted {:?} after the failure: not before its 1 s wait was over",
        failed.elapsed()
    );
    assert_eq!(depth(&t.client, &orders).await, None, "{orders} is deleted");

    let parked = t.parked(1).await.remove(0);
    let waited = failed.elapsed();
    assert_eq!(parked.reason, "no-route", "{}", parked.detail);
    assert_eq!(parked.hop, "due");
    assert_eq!(parked.destination.as_deref(), Some(orders.as_str()));
    assert_eq!(parked.message.body().unwrap(), b"routed");
    assert_eq!(
        parked.attempts,
        Some(2),
        "the routed failure was counted before the publish"
    );
    let history: Vec<(u64, String)> = parked.history.iter().map(|e| (e.attempt, e.tier.clone())).collect();
    // both failures: the second, which the due hop counted (attempts 2), is in the history as
    // it would be in the intake's park of the same return
    let both = steps(&[(1, "300ms"), (2, "1s")]);
    assert_eq!(history, both);
    assert!(
        waited >= Duration::from_secs(1),
        "parked after {waited:?}, before its wait"
    );
    assert_eq!(
        received(&t, Hop::Intake),
        1,
        "the repeat failure was routed past the intake"
    );
    assert_eq!(
        received(&t, Hop::Due),
        2,
        "the due hop took the first retry and the routed failure"
    );
    assert_eq!(
        depth(&t.client, &orders).await,
        None,
        "the publish did not declare it again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_repeat_failure_to_a_full_destination_waits_for_room() {
    a_routed_failure_to_a_full_destination_waits_for_room(Mode::DeadLetter).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_republished_repeat_failure_to_a_full_destination_waits_for_room() {
    a_routed_failure_to_a_full_destination_waits_for_room(Mode::Explicit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_repeat_failure_to_a_deleted_destination_is_parked_as_no_route() {
    a_routed_failure_to_a_deleted_destination_is_parked_as_no_route(Mode::DeadLetter).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_republished_repeat_failure_to_a_deleted_destination_is_parked_as_no_route() {
    a_routed_failure_to_a_deleted_destination_is_parked_as_no_route(Mode::Explicit).await;
}
