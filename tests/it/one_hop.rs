//! One hop per retry, against the real broker: a repeat failure skips the intake (`N.L` routes
//! it by its `retry-next` into its tier), and the due hop does the intake's
//! work for it — the same checks, the same count, the same
//! parking reasons. And the move from the topology before it, in place.

use std::time::{Duration, Instant};

use crate::common::*;
use ladder::model::names::{Hop, Names};
use ladder_amqp::{BasicProperties, FieldTable, FieldValue};

const TWO_TIERS: &str = r#"
backoff = ["300ms", "600ms"]
max_attempts = 3
allow = ["^{ns}-"]
"#;

/// A redelivery may be this much later than its tier on a busy 2-core machine; never earlier.
const TOLERANCE: Duration = Duration::from_millis(1_500);

fn received(t: &TestLadder, hop: Hop) -> u64 {
    t.state.ladder(&t.ladder).unwrap().metrics.hop(hop).received.get()
}

fn entered(t: &TestLadder) -> u64 {
    t.state.ladder(&t.ladder).unwrap().metrics.entered.get()
}

/// Dead-letter mode, every delivery rejected: every retry comes back after exactly its tier, the
/// ladder is climbed and the message parked — and the intake sees only the first failure and
/// the last (to park it): the ones between wait in the tier their `retry-next` names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_failures_climb_the_ladder_without_the_intake() {
    let mut t = TestLadder::start("onehop-dl", TWO_TIERS).await;
    let mut args = FieldTable::default();
    args.set("x-dead-letter-exchange", text(&t.intake()));
    let orders = t.declare_queue("orders", args).await;
    let mut consumer = t.consume(&orders).await;
    let props = BasicProperties::default()
        .with_message_id("m-1")
        .with_delivery_mode(2)
        .with_headers({
            let mut h = FieldTable::default();
            h.set("app", FieldValue::LongInt(7));
            h
        });
    t.publish("", &orders, b"body", props).await;

    let tiers = [300u64, 600, 600];
    let mut failed_at = Instant::now();
    for attempt in 0..=3u64 {
        let d = next(&mut consumer).await;
        let waited = failed_at.elapsed();
        if attempt > 0 {
            let tier = Duration::from_millis(tiers[attempt as usize - 1]);
            assert!(waited >= tier, "retry {attempt} after {waited:?}, before its {tier:?}");
            assert!(
                waited <= tier + TOLERANCE,
                "retry {attempt} after {waited:?} ({tier:?})"
            );
            assert_eq!(int_header(&d, "retry-attempt"), Some(attempt as i64));
            assert_eq!(
                headers_of(&d).get("retry-to"),
                Some(&text(&orders)),
                "read from x-death"
            );
            assert!(headers_of(&d).get("x-death").is_none(), "x-death stripped");
            let next_route = if attempt < 3 { "600ms" } else { "intake" };
            assert_eq!(headers_of(&d).get("retry-next"), Some(&text(next_route)));
        }
        assert_eq!(d.body, b"body");
        assert_eq!(headers_of(&d).get("app"), Some(&FieldValue::LongInt(7)));
        failed_at = Instant::now();
        consumer.reject(&d, false);
    }
    let parked = t.parked(1).await.remove(0);
    assert_eq!(parked.reason, "max-attempts");
    assert_eq!(parked.destination.as_deref(), Some(orders.as_str()));
    // two retries taken in at the due hop; the intake took the first and parked the last
    assert_eq!(received(&t, Hop::Intake), 2);
    assert_eq!(
        received(&t, Hop::Due),
        3,
        "three retries came due, two of them routed failures"
    );
    // each failure enters once, when settled, on every broker (RabbitMQ 4.x marks a message
    // dead-lettered into a quorum queue redelivered, so that flag cannot be what counts)
    assert_eq!(entered(&t), 4, "each failure entered once");
    t.assert_nothing_more("a fifth delivery", &mut consumer, &orders, Via::Ladder)
        .await;
}

/// Explicit mode (republish as received, `retry-to` set): the same one hop. A `retry-delay` in
/// the republish is honoured by the due hop as the intake would: the retry waits its step, then
/// the rest of the longer delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_republished_failure_skips_the_intake_and_keeps_its_retry_delay() {
    // without exact delays a retry-delay is rounded up to a step: 1 s to the 1.5 s one
    let ladder = r#"
backoff = ["300ms", "600ms", "600ms", "1500ms"]
max_attempts = 4
allow = ["^{ns}-"]
"#;
    let mut t = TestLadder::start("onehop-explicit", ladder).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    t.publish(&t.intake(), "", b"x", retry_props(&orders, None)).await;
    let first = next(&mut consumer).await;
    assert_eq!(int_header(&first, "retry-attempt"), Some(1));
    assert_eq!(
        received(&t, Hop::Intake),
        1,
        "a first publish with retry-to goes to the intake"
    );

    // republished as received: straight into the 600 ms tier
    let failed = Instant::now();
    t.publish(&t.intake(), "", b"x", republish_props(&first, &[])).await;
    consumer.ack(&first);
    let second = next(&mut consumer).await;
    let waited = failed.elapsed();
    assert!(
        waited >= Duration::from_millis(600) && waited <= Duration::from_millis(600) + TOLERANCE,
        "{waited:?}"
    );
    assert_eq!(int_header(&second, "retry-attempt"), Some(2));
    assert_eq!(received(&t, Hop::Intake), 1, "the repeat failure skipped the intake");

    // with a retry-delay: never sooner (not after the 600 ms tier alone), still past the intake
    let failed = Instant::now();
    t.publish(
        &t.intake(),
        "",
        b"x",
        republish_props(&second, &[("retry-delay", FieldValue::LongLongInt(1_000))]),
    )
    .await;
    consumer.ack(&second);
    let third = next(&mut consumer).await;
    let waited = failed.elapsed();
    assert!(waited >= Duration::from_millis(1_000), "{waited:?}");
    assert_eq!(int_header(&third, "retry-attempt"), Some(3));
    assert_eq!(received(&t, Hop::Intake), 1, "a retry-delay needs no intake");
    consumer.ack(&third);
}

/// A publisher that writes the routing headers itself gets every check a first failure gets:
/// a destination outside the allow-list, an exhausted count and an unlisted sender are parked
/// with the intake's reasons, after the wait the forged route chose.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_route_is_checked_like_a_first_failure() {
    let ladder = r#"
backoff = ["300ms", "600ms"]
max_attempts = 3
allow = ["^{ns}-"]
unidentified = "reject"
[senders]
guest = ["^{ns}-"]
"#;
    let mut t = TestLadder::start("onehop-forged", ladder).await;
    let orders = t.queue_name("orders");
    let forged = |to: &str, attempt: i64| {
        let mut h = FieldTable::default();
        h.set("retry-to", text(to));
        h.set("retry-attempt", FieldValue::LongLongInt(attempt));
        h.set("retry-ladder", text("default"));
        h.set("retry-next", text("300ms"));
        BasicProperties::default().with_delivery_mode(2).with_headers(h)
    };
    // the test's connection is the broker's user guest: listed, it passes the sender rule
    t.publish(&t.intake(), "", b"1", forged("payroll", 0).with_user_id("guest"))
        .await;
    t.publish(&t.intake(), "", b"2", forged(&orders, 3).with_user_id("guest"))
        .await;
    // without a user id: unidentified, refused
    t.publish(&t.intake(), "", b"3", forged(&orders, 0)).await;
    let mut parked = t.parked(3).await;
    parked.sort_by_key(|p| p.message.body().unwrap());
    let reasons: Vec<&str> = parked.iter().map(|p| p.reason.as_str()).collect();
    assert_eq!(
        reasons,
        ["destination-not-allowed", "max-attempts", "sender-not-allowed"]
    );
    assert_eq!(received(&t, Hop::Intake), 0, "all three were routed past the intake");
    assert_eq!(received(&t, Hop::Due), 3);
}

/// The move from the topology before this one, in place: the intake exchange's old binding to
/// the intake queue is removed (a failure is taken in once, not twice), and retries waiting in
/// the tiers the old way are delivered as they were scheduled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_ladder_moves_to_the_new_way_in_without_loss_or_duplicates() {
    let mut t = TestLadder::configure("onehop-upgrade", TWO_TIERS).await;
    let names = Names::new(&t.ns, &t.ladder);
    // what the previous release declared and bound for the intake
    t.channel
        .exchange_declare(&names.exchange, "fanout", true, FieldTable::default())
        .await
        .unwrap();
    t.track_exchange(&names.exchange);
    let mut intake_args = FieldTable::default();
    intake_args.set("x-queue-type", text("quorum"));
    intake_args.set("x-dead-letter-exchange", text(&names.quarantine));
    intake_args.set("x-delivery-limit", FieldValue::LongLongInt(100));
    t.channel
        .queue_declare(
            &names.intake_queue,
            ladder_amqp::QueueOptions {
                durable: true,
                ..Default::default()
            },
            intake_args,
        )
        .await
        .unwrap();
    t.track_queue(&names.intake_queue);
    t.channel
        .queue_bind(&names.intake_queue, &names.exchange, "", FieldTable::default())
        .await
        .unwrap();
    // a retry the previous release scheduled, waiting in the queue that is about to become
    // its tier: its headers as the old intake wrote them, no retry-next
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut old = FieldTable::default();
    old.set("retry-to", text(&orders));
    old.set("retry-attempt", FieldValue::LongLongInt(1));
    old.set("retry-ladder", text("default"));
    old.set("retry-tier", text("300ms"));
    old.set("retry-due-at", FieldValue::LongLongInt(now_ms() as i64));
    let old_props = BasicProperties::default().with_delivery_mode(2).with_headers(old);
    // an old retry still in the intake, as the old binding put it there
    t.publish(&names.exchange, "", b"old-intake", retry_props(&orders, None))
        .await;

    t.start_service().await;
    // a retry the old due hop would have received: published into N.L.due as the old tiers did
    t.publish(&names.due, "", b"old-due", old_props).await;
    // a new failure, published after the move: taken in once
    t.publish(&names.exchange, "", b"new", retry_props(&orders, None)).await;

    let mut consumer = t.consume(&orders).await;
    let mut bodies: Vec<Vec<u8>> = receive(&mut consumer, 3).await.into_iter().map(|d| d.body).collect();
    bodies.sort();
    assert_eq!(bodies, [b"new".to_vec(), b"old-due".to_vec(), b"old-intake".to_vec()]);
    assert_eq!(
        received(&t, Hop::Intake),
        2,
        "the old intake message and the new failure, once each"
    );
    t.assert_nothing_more("a duplicate", &mut consumer, &orders, Via::Ladder)
        .await;
}

/// What `N.L` routes to no tier goes through its alternate to the intake, each taken in once: a
/// first failure asking for a delay (`retry-delay`), one retried before that carries a
/// `retry-attempt` but no `retry-next` (a delivery of an older release), and one whose
/// `retry-next` names no tier of the ladder (a step taken out since).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_failures_the_intake_must_take_still_go_through_it() {
    let mut t = TestLadder::start("onehop-sort", TWO_TIERS).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let with = |key: &str, value: FieldValue| {
        let mut p = retry_props(&orders, None);
        p.headers.as_mut().unwrap().set(key, value);
        p
    };
    t.publish(
        &t.intake(),
        "",
        b"retry-delay",
        with("retry-delay", FieldValue::LongLongInt(700)),
    )
    .await;
    t.publish(
        &t.intake(),
        "",
        b"retry-attempt",
        with("retry-attempt", FieldValue::LongLongInt(1)),
    )
    .await;
    t.publish(&t.intake(), "", b"retry-next", with("retry-next", text("9s")))
        .await;

    let mut got: Vec<(Vec<u8>, Option<i64>)> = receive(&mut consumer, 3)
        .await
        .into_iter()
        .map(|d| {
            let attempt = int_header(&d, "retry-attempt");
            (d.body, attempt)
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            (b"retry-attempt".to_vec(), Some(2)),
            (b"retry-delay".to_vec(), Some(1)),
            (b"retry-next".to_vec(), Some(1)),
        ]
    );
    assert_eq!(received(&t, Hop::Intake), 3, "each through the intake, once");
    assert_eq!(received(&t, Hop::Due), 3, "each delivered once");
    t.assert_nothing_more("a duplicate", &mut consumer, &orders, Via::Ladder)
        .await;
}
