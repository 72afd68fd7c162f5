//! End-to-end retries against the real broker: stepped tiers, both consumer modes, exact
//! redelivery, parking and replay.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::common::*;
use ladder_amqp::{BasicProperties, Decimal, FieldTable, FieldValue};

const THREE_TIERS: &str = r#"
backoff = ["200ms", "500ms", "1s"]
allow = ["^{ns}-"]
"#;

/// A redelivery may be this much later than its tier (intake hop + due hop + a busy 2-core
/// machine running other tests). It is never earlier.
const TOLERANCE: Duration = Duration::from_millis(1_500);

/// Headers of every awkward AMQP type, which must survive the ladder and the parking lot.
fn awkward_headers() -> FieldTable {
    let mut nested = FieldTable::default();
    nested.set("price", FieldValue::Decimal(Decimal { scale: 2, value: 1999 }));
    nested.set("tags", FieldValue::FieldArray(vec![text("a"), FieldValue::LongInt(2)]));
    let mut h = FieldTable::default();
    h.set("nested", FieldValue::FieldTable(nested.clone()));
    h.set(
        "array-of-tables",
        FieldValue::FieldArray(vec![FieldValue::FieldTable(nested), FieldValue::Boolean(false)]),
    );
    h.set(
        "decimal",
        FieldValue::Decimal(Decimal {
            scale: 3,
            value: 123_456,
        }),
    );
    h.set("timestamp", FieldValue::Timestamp(1_700_000_000));
    h.set("bytes", FieldValue::ByteArray(vec![0u8, 1, 254, 255]));
    h.set("double", FieldValue::Double(-0.125));
    h.set("i8", FieldValue::ShortShortInt(-7));
    h.set("void", FieldValue::Void);
    h.set("text", text("ünïcode"));
    h
}

fn original_props() -> BasicProperties {
    BasicProperties::default()
        .with_headers(awkward_headers())
        .with_content_type("application/json")
        .with_content_encoding("identity")
        .with_correlation_id("corr-1")
        .with_message_id("msg-1")
        .with_type("order.created")
        .with_app_id("orders-service")
        .with_timestamp(1_700_000_123)
        .with_priority(3)
        .with_delivery_mode(2)
}

fn assert_user_headers_kept(received: &BasicProperties) {
    let got = received.headers.as_ref().expect("headers");
    for (k, v) in awkward_headers().iter() {
        assert_eq!(got.get_bytes(k.as_bytes()), Some(v), "header {k} changed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_failing_consumer_climbs_every_tier_then_is_parked_and_replays_exactly() {
    let mut t = TestLadder::start("climb", THREE_TIERS).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let body = b"{\"order\": 42, \"binary\": \"\xff\"}".to_vec();
    t.publish("", &orders, &body, original_props()).await;

    let tiers = [200u64, 500, 1000];
    let mut failed_at = None;
    for attempt in 0..=3u64 {
        let d = next(&mut consumer).await;
        let arrived = Instant::now();
        if let Some(failed_at) = failed_at {
            let waited = arrived.duration_since(failed_at);
            let tier = Duration::from_millis(tiers[attempt as usize - 1]);
            eprintln!("attempt {attempt}: tier {tier:?}, waited {waited:?}");
            assert!(
                waited >= tier,
                "attempt {attempt} came back after {waited:?}, before its {tier:?} tier"
            );
            assert!(
                waited <= tier + TOLERANCE,
                "attempt {attempt} came back {waited:?} after failing (tier {tier:?})"
            );
            assert_eq!(int_header(&d, "retry-attempt"), Some(attempt as i64));
            assert_eq!(
                headers_of(&d).get("retry-tier"),
                Some(&text(&ladder::model::ladder::compact_duration(tier)))
            );
            assert!(headers_of(&d).get("x-death").is_none(), "x-death must be stripped");
        }
        assert_eq!(d.body, body);
        assert_user_headers_kept(&d.properties);
        assert_eq!(d.properties.message_id.as_ref().unwrap().to_str().unwrap(), "msg-1");
        // fail: republish as received, naming the queue, then ack
        let props = republish_props(
            &d,
            &[
                ("retry-to", text(&orders)),
                ("retry-reason", text(&format!("boom {attempt}"))),
            ],
        );
        failed_at = Some(Instant::now());
        t.publish(&t.intake(), "", &d.body, props).await;
        consumer.ack(&d);
    }
    t.assert_nothing_more("a fifth delivery", &mut consumer, &orders, Via::Ladder)
        .await;

    let parked = t.parked(1).await.remove(0);
    assert_eq!(parked.reason, "max-attempts");
    assert_eq!(parked.destination.as_deref(), Some(orders.as_str()));
    assert_eq!(parked.attempts, Some(3));
    assert_eq!(parked.hop, "intake");
    assert!(parked.first_failed_at_ms.is_some());
    let original_body = parked.message.body().unwrap();
    let original = parked.message.properties().unwrap();
    assert_eq!(original_body, body);
    assert_user_headers_kept(&original);
    let h = original.headers.as_ref().unwrap();
    assert_eq!(h.get("retry-reason"), Some(&text("boom 3")));
    assert_eq!(h.get("retry-attempt"), Some(&FieldValue::LongLongInt(3)));

    // replay: the envelope republishes the message it parked exactly
    let replay = t.declare_queue("replay", FieldTable::default()).await;
    let mut replayed = t.consume(&replay).await;
    t.publish("", &replay, &original_body, original.clone()).await;
    let d = next(&mut replayed).await;
    assert_eq!(d.body, body);
    assert_eq!(
        d.properties, original,
        "replayed properties differ from the parked original"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_mode_needs_no_client_code() {
    let mut t = TestLadder::start("dlx", THREE_TIERS).await;
    let mut args = FieldTable::default();
    args.set("x-dead-letter-exchange", text(&t.intake()));
    args.set("x-queue-type", text("quorum"));
    let orders = t.declare_queue("orders", args).await;
    let mut consumer = t.consume(&orders).await;
    t.publish("", &orders, b"zero code", original_props()).await;

    let first = next(&mut consumer).await;
    let rejected_at = Instant::now();
    consumer.reject(&first, false);

    let second = next(&mut consumer).await;
    let waited = rejected_at.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited <= Duration::from_millis(200) + TOLERANCE,
        "{waited:?}"
    );
    assert_eq!(second.body, b"zero code");
    assert_eq!(int_header(&second, "retry-attempt"), Some(1));
    assert_eq!(headers_of(&second).get("retry-to"), Some(&text(&orders)));
    assert!(
        headers_of(&second)
            .iter()
            .all(|(k, _)| !k.as_bytes().starts_with(b"x-")),
        "{:?}",
        headers_of(&second)
    );
    assert_user_headers_kept(&second.properties);

    // the second rejection carries the ladder's own headers back: attempt 2 waits in 500ms
    let rejected_at = Instant::now();
    consumer.reject(&second, false);
    let third = next(&mut consumer).await;
    assert!(rejected_at.elapsed() >= Duration::from_millis(500));
    assert_eq!(int_header(&third, "retry-attempt"), Some(2));
    consumer.ack(&third);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivery_goes_only_to_the_queue_that_failed() {
    let mut t = TestLadder::start("exact", THREE_TIERS).await;
    let fanout = format!("{}-events", t.ns);
    t.channel
        .exchange_declare(&fanout, "fanout", false, FieldTable::default())
        .await
        .unwrap();
    t.track_exchange(&fanout);
    let failing = t.declare_queue("failing", FieldTable::default()).await;
    let healthy = t.declare_queue("healthy", FieldTable::default()).await;
    for q in [&failing, &healthy] {
        t.channel
            .queue_bind(q, &fanout, "", FieldTable::default())
            .await
            .unwrap();
    }
    let mut failing_consumer = t.consume(&failing).await;
    let mut healthy_consumer = t.consume(&healthy).await;
    t.publish(&fanout, "", b"event", BasicProperties::default()).await;

    let d = next(&mut healthy_consumer).await;
    healthy_consumer.ack(&d);
    let d = next(&mut failing_consumer).await;
    t.publish(
        &t.intake(),
        "",
        &d.body,
        republish_props(&d, &[("retry-to", text(&failing))]),
    )
    .await;
    failing_consumer.ack(&d);

    let again = next(&mut failing_consumer).await;
    assert_eq!(int_header(&again, "retry-attempt"), Some(1));
    failing_consumer.ack(&again);
    t.assert_nothing_more(
        "the retry, to the healthy queue bound to the same exchange",
        &mut healthy_consumer,
        &healthy,
        Via::Ladder,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_delay_is_waited_exactly() {
    let mut t = TestLadder::start("delay", &format!("exact_delays = true\n{THREE_TIERS}")).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let failed_at = Instant::now();
    let props = BasicProperties::default().with_headers({
        let mut h = FieldTable::default();
        h.set("retry-to", text(&orders));
        h.set("retry-delay", text("600ms"));
        h
    });
    t.publish(&t.intake(), "", b"later", props).await;
    let d = next(&mut consumer).await;
    let waited = failed_at.elapsed();
    // 600 ms through the 512, 64, 16 and 16 ms levels (8 ms late by design), not the 1 s step
    assert!(waited >= Duration::from_millis(600), "{waited:?}");
    assert!(waited < Duration::from_millis(600) + TOLERANCE, "{waited:?}");
    let due_at = int_header(&d, "retry-due-at").expect("retry-due-at");
    let first = int_header(&d, "retry-first-failed-at").expect("retry-first-failed-at");
    assert_eq!(due_at - first, 600, "due exactly 600 ms after the failure");
    assert!(headers_of(&d).get("retry-delay").is_none(), "retry-delay is consumed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_destination_is_parked_as_no_route() {
    let mut t = TestLadder::start("noroute", THREE_TIERS).await;
    let missing = t.queue_name("does-not-exist");
    let props = BasicProperties::default().with_message_id("lost-1").with_headers({
        let mut h = FieldTable::default();
        h.set("retry-to", text(&missing));
        h
    });
    t.publish(&t.intake(), "", b"nowhere", props).await;
    let parked = t.parked(1).await.remove(0);
    assert_eq!(parked.reason, "no-route");
    assert_eq!(parked.hop, "due");
    assert_eq!(parked.destination.as_deref(), Some(missing.as_str()));
    assert_eq!(parked.message.body().unwrap(), b"nowhere");
    assert_eq!(parked.attempts, Some(1));
    let attempts: Vec<u64> = parked.history.iter().map(|e| e.attempt).collect();
    assert_eq!(attempts, [1], "a returned publish keeps the history it carried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_mid_flight_drains_and_loses_nothing() {
    let mut t = TestLadder::start("drain", THREE_TIERS).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let n = 300;
    for i in 0..n {
        let props = BasicProperties::default()
            .with_message_id(&format!("m{i}"))
            .with_headers({
                let mut h = FieldTable::default();
                h.set("retry-to", text(&orders));
                h
            });
        t.publish(&t.intake(), "", b"x", props).await;
    }
    // stop while the service is busy with them, then start again
    t.stop_service().await;
    t.start_service().await;
    let mut consumer = t.consume(&orders).await;
    let mut seen = HashSet::new();
    while seen.len() < n {
        let d = next(&mut consumer).await;
        seen.insert(d.properties.message_id.as_ref().unwrap().to_string());
        consumer.ack(&d);
    }
    assert_eq!(seen.len(), n);
}

/// Fails every delivery of one message on `queue` by republishing it to the intake, as a
/// consumer does, `failures` times, and checks what each retry carried in `retry-history`.
async fn fail_every_delivery(t: &TestLadder, consumer: &mut TestConsumer, queue: &str, failures: usize) {
    for failure in 0..failures {
        let d = next(consumer).await;
        if failure > 0 {
            let history = headers_of(&d)
                .get("retry-history")
                .expect("a retry carries its history");
            assert!(matches!(history, FieldValue::LongString(_)), "{history:?}");
        }
        let props = republish_props(&d, &[("retry-to", text(queue))]);
        t.publish(&t.intake(), "", &d.body, props).await;
        consumer.ack(&d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_records_carry_the_attempt_history_and_replay_lineage() {
    let mut t = TestLadder::start("history", THREE_TIERS).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let started = now_ms();
    t.publish("", &orders, b"history", BasicProperties::default()).await;

    // three failures are scheduled as retries 1..3; the fourth exhausts the ladder
    fail_every_delivery(&t, &mut consumer, &orders, 4).await;
    let first = t.parked(1).await.remove(0);
    assert_eq!((first.reason.as_str(), first.attempts), ("max-attempts", Some(3)));
    assert_eq!(first.replayed_from, None);
    let tiers: Vec<String> = t.config.ladders[0].steps.iter().map(|tier| tier.name.clone()).collect();
    assert_eq!(tiers, ["200ms", "500ms", "1s"]);
    let attempts: Vec<u64> = first.history.iter().map(|e| e.attempt).collect();
    assert_eq!(attempts, [1, 2, 3], "{:?}", first.history);
    let history_tiers: Vec<&str> = first.history.iter().map(|e| e.tier.as_str()).collect();
    assert_eq!(history_tiers, tiers);
    let times: Vec<u64> = first.history.iter().map(|e| e.failed_at_ms).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    assert!(times[0] >= started && times[2] <= first.parked_at_ms, "{times:?}");
    assert_eq!(first.first_failed_at_ms, Some(times[0]));

    // replay it as `ladder parked replay` would (the stream's first record is offset 0), and
    // fail it to the end of the ladder again
    let origin = format!("{}@0", t.parked_stream());
    let replayed = ladder::model::protocol::replay_properties(
        &first.message.properties().unwrap(),
        &[("retry-replayed-from", text(&origin))],
    );
    t.publish("", &orders, &first.message.body().unwrap(), replayed).await;
    fail_every_delivery(&t, &mut consumer, &orders, 4).await;
    let again = t.parked(2).await.remove(1);
    assert_eq!((again.reason.as_str(), again.attempts), ("max-attempts", Some(3)));
    assert_eq!(again.replayed_from.as_deref(), Some(origin.as_str()));
    // lineage: the first pass's entries, then the second pass's, counted from 1 again
    let attempts: Vec<u64> = again.history.iter().map(|e| e.attempt).collect();
    assert_eq!(attempts, [1, 2, 3, 1, 2, 3], "{:?}", again.history);
    assert_eq!(again.history[..3], first.history[..]);
    let times: Vec<u64> = again.history.iter().map(|e| e.failed_at_ms).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    assert!(times[3] >= first.parked_at_ms, "{times:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jitter_spreads_retries_that_failed_together_and_waits_each_exactly() {
    let ladder = "exact_delays = true\njitter = \"50%\"\nbackoff = [\"2s\"]\nallow = [\"^{ns}-\"]";
    let mut t = TestLadder::start("jitter", ladder).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let n = 30;
    let failed_at = Instant::now();
    for i in 0..n {
        let props = retry_props(&orders, None).with_message_id(&format!("j{i}"));
        t.publish(&t.intake(), "", b"j", props).await;
    }
    let got = receive_timed(&mut consumer, n).await;
    let mut waits = Vec::new();
    for (at, d) in &got {
        // each waits its own draw of 2 s ± 50 %, exactly: due − first failure is the draw
        let due = int_header(d, "retry-due-at").expect("retry-due-at");
        let first = int_header(d, "retry-first-failed-at").expect("retry-first-failed-at");
        let drawn = (due - first) as u64;
        assert!((1_000..=3_000).contains(&drawn), "{drawn} ms is outside 2 s ± 50 %");
        let waited = at.duration_since(failed_at);
        assert!(
            waited + Duration::from_millis(50) >= Duration::from_millis(drawn),
            "{waited:?} < {drawn} ms"
        );
        waits.push(drawn);
    }
    waits.sort();
    // 30 uniform draws over 2 s: spread over far more than a few ms
    assert!(
        waits[n - 1] - waits[0] > 800,
        "retries that failed together came back together: {waits:?}"
    );
    assert!(
        next_within(&mut consumer, Duration::from_secs(1)).await.is_none(),
        "each once"
    );
}
