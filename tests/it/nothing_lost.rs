//! Nothing lost, nothing blocked: returned publishes matched to their own message at full
//! prefetch, bytes that are not UTF-8, bodies too large for an envelope, a full destination
//! beside a healthy one, and the delivery limit of the ladder's own queues — each against the
//! real broker, with every message accounted for.

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use crate::common::*;
use ladder_amqp::{BasicProperties, Confirmation, FieldTable, FieldValue, ShortString};

const ONE_TIER: &str = "backoff = [\"200ms\"]\nmax_attempts = 3\nallow = [\"^{ns}-\"]";
const TWO_TIERS: &str = "backoff = [\"200ms\", \"1s\"]\nmax_attempts = 3\nallow = [\"^{ns}-\"]";
const FAST_POLLS: &str = "[admin]\npoll_interval = \"100ms\"";

fn failure(to: &str, id: &str) -> BasicProperties {
    retry_props(to, None).with_message_id(id).with_delivery_mode(2)
}

/// The accounting verdict of the one ladder, from the admin API.
async fn accounting(admin: &TestAdmin) -> serde_json::Value {
    let body = reqwest::get(admin.url("/api/ladders"))
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap();
    body["ladders"][0]["accounting"].clone()
}

/// Regression (issue "Nothing lost, nothing blocked", item 1): with many mandatory publishes in
/// flight on one channel, a return was attributed to whichever confirm completed next — some
/// messages for a missing queue were lost (counted as delivered), some delivered ones parked.
/// Every message must be exactly delivered or parked as `no-route`, never both, never neither,
/// and the accounting identity must balance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_are_matched_to_their_message_at_full_prefetch() {
    let mut t = TestLadder::configure_with("returns", FAST_POLLS, ONE_TIER).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let present = t.declare_queue("present", FieldTable::default()).await;
    let missing = t.queue_name("missing");
    let mut consumer = t.consume(&present).await;
    const RUNS: usize = 3;
    const PER_RUN: usize = 1500;
    let mut parked_so_far = 0;
    for run in 0..RUNS {
        let mut confirms = Vec::with_capacity(PER_RUN);
        let (mut to_present, mut to_missing) = (BTreeSet::new(), BTreeSet::new());
        for i in 0..PER_RUN {
            // irregular runs of each, so one broker ack covers both kinds
            let gone = (i * 7 + run) % 5 < 2;
            let id = format!("r{run}-{i}");
            let target = if gone { &missing } else { &present };
            if gone {
                to_missing.insert(id.clone());
            } else {
                to_present.insert(id.clone());
            }
            let c = t
                .channel
                .basic_publish(t.intake(), "", true, &failure(target, &id), id.as_bytes())
                .unwrap();
            confirms.push(c);
        }
        for c in confirms {
            let c = tokio::time::timeout(WAIT, c).await.unwrap().unwrap();
            assert_eq!(c, Confirmation::Ack);
        }
        // the messages for the existing queue, then anything more up to markers through the
        // ladder (the due hop defers some of this many for one queue, so only once every one
        // arrived do the markers come last)
        let mut delivered: Vec<String> = receive(&mut consumer, to_present.len())
            .await
            .iter()
            .map(|d| message_id(d).to_string())
            .collect();
        let markers = t.mark(&present, Via::Ladder).await;
        let more = until_markers(&mut consumer, &markers).await;
        delivered.extend(more.iter().map(|d| message_id(d).to_string()));
        let delivered_set: BTreeSet<String> = delivered.iter().cloned().collect();
        assert_eq!(
            delivered.len(),
            delivered_set.len(),
            "run {run}: a message was delivered twice"
        );
        let parked = t.parked(parked_so_far + to_missing.len()).await;
        let parked_now = &parked[parked_so_far..];
        parked_so_far = parked.len();
        let parked_ids: BTreeSet<String> = parked_now
            .iter()
            .map(|e| {
                assert_eq!(e.reason, "no-route", "{}", e.detail);
                e.message
                    .properties()
                    .unwrap()
                    .message_id
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(
            parked_ids.len(),
            parked_now.len(),
            "run {run}: a message was parked twice"
        );
        assert_eq!(
            delivered_set, to_present,
            "run {run}: delivered ≠ the messages for the existing queue"
        );
        assert_eq!(
            parked_ids, to_missing,
            "run {run}: parked ≠ the messages for the missing queue"
        );
    }
    // nothing else arrives, and the identity balances with every message placed
    t.assert_nothing_more("a message after the last run", &mut consumer, &present, Via::Ladder)
        .await;
    let a = eventually_ok("the accounting balances", WAIT, async || {
        let a = accounting(&admin).await;
        if a["verdict"] == "balanced" { Ok(a) } else { Err(a) }
    })
    .await;
    assert_eq!(a["unaccounted"], 0, "{a}");
    admin.stop().await;
    t.stop_service().await;
}

fn s(bytes: &[u8]) -> ShortString {
    ShortString::new(bytes).unwrap()
}

/// Regression (item 2): a `message_id`, header name, nested table key or routing key that is
/// not UTF-8 made the AMQP client drop the connection, forever, wedging the ladder and
/// redelivering every other message on the connection. They must flow through byte for byte,
/// be parked intact when they must be parked, and leave other ladders alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_that_are_not_utf8_flow_through_and_park_intact() {
    let mut t = TestLadder::start("bytes", ONE_TIER).await;
    let mut other = TestLadder::start("bytes-other", ONE_TIER).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let other_orders = other.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let mut other_consumer = other.consume(&other_orders).await;

    let odd = |to: &str, id: &[u8]| {
        let mut nested = FieldTable::default();
        nested.insert(s(b"key\xfe\xff"), FieldValue::LongString(vec![0xc3, 0x28].into()));
        let mut headers = FieldTable::default();
        headers.set("retry-to", text(to));
        headers.insert(s(b"name\xff"), FieldValue::FieldTable(nested));
        BasicProperties {
            message_id: Some(s(id)),
            correlation_id: Some(s(b"corr\x80")),
            headers: Some(headers),
            ..Default::default()
        }
    };
    let forbidden = format!("{}x-not-allowed", "elsewhere-");
    let sent = [
        (odd(&orders, b"id\xff\xfe-1"), &b"routing key \xff"[..]),
        (odd(&orders, b"id\xff\xfe-2"), &b""[..]),
        (odd(&forbidden, b"id\xff\xfe-3"), &b"\xc0\xaf"[..]),
    ];
    for (props, routing_key) in &sent {
        let c = t
            .channel
            .basic_publish(t.intake(), routing_key, true, props, b"body \xff")
            .unwrap();
        assert_eq!(tokio::time::timeout(WAIT, c).await.unwrap().unwrap(), Confirmation::Ack);
        // the other ladder keeps flowing meanwhile
        other
            .publish(&other.intake(), "", b"plain", failure(&other_orders, "plain"))
            .await;
    }
    for (props, _) in &sent[..2] {
        let d = next(&mut consumer).await;
        consumer.ack(&d);
        assert_eq!(d.properties.message_id, props.message_id);
        assert_eq!(d.properties.correlation_id, props.correlation_id);
        assert_eq!(d.body, b"body \xff");
        let want = props.headers.as_ref().unwrap();
        let got = d.properties.headers.as_ref().unwrap();
        assert_eq!(
            got.get_bytes(b"name\xff"),
            want.get_bytes(b"name\xff"),
            "nested keys intact"
        );
        assert_eq!(int_header(&d, "retry-attempt"), Some(1));
    }
    for _ in 0..3 {
        let d = next(&mut other_consumer).await;
        other_consumer.ack(&d);
        assert_eq!(
            int_header(&d, "retry-attempt"),
            Some(1),
            "the other ladder delivered each once"
        );
    }
    other
        .assert_nothing_more(
            "a fourth delivery on the other ladder",
            &mut other_consumer,
            &other_orders,
            Via::Ladder,
        )
        .await;

    let parked = t.parked(1).await.remove(0);
    assert_eq!(parked.reason, "destination-not-allowed");
    assert_eq!(parked.message.routing_key_bytes().unwrap(), b"\xc0\xaf");
    let original = parked.message.properties().unwrap();
    assert_eq!(original.message_id, sent[2].0.message_id);
    // RabbitMQ 4.x re-encodes tables sorted by key: compare the entries, not their order
    let sorted = |t: &Option<FieldTable>| {
        let mut entries: Vec<(Vec<u8>, String)> = t
            .iter()
            .flat_map(|t| t.iter())
            .map(|(k, v)| (k.as_bytes().to_vec(), format!("{v:?}")))
            .collect();
        entries.sort();
        entries
    };
    assert_eq!(
        sorted(&original.headers),
        sorted(&sent[2].0.headers),
        "every header byte kept"
    );
    assert_eq!(parked.message.body().unwrap(), b"body \xff");
    assert!(t.state.health.is_ready() && other.state.health.is_ready());
    assert_eq!(t.state.metrics.reconnects.get(), 0, "no connection was lost");
    t.stop_service().await;
    other.stop_service().await;
}

/// Regression (item 3): a body too large for an envelope (a 102 MiB body's base64 envelope
/// passes RabbitMQ 3.x's 128 MiB `max_message_size`; on 4.x the limit is 16 MiB) closed the
/// channel at every park and wedged the intake. It is parked as a record of its own, the ladder
/// flows on, and a replay sends the body back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_too_large_for_an_envelope_is_parked_apart_and_replays_whole() {
    let mut t = TestLadder::start("big", ONE_TIER).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let replayed = t.declare_queue("replayed", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    // the largest the broker takes: 102 MiB on 3.x (max 128 MiB), 12 MiB on 4.x (max 16 MiB)
    let size = match t.client.server_version() {
        Some((3, _, _)) => 102 << 20,
        _ => 12 << 20,
    };
    let body: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
    t.publish(&t.intake(), "", &body, failure("elsewhere-not-allowed", "big-1"))
        .await;
    t.publish(&t.intake(), "", b"small", failure(&orders, "after")).await;
    let d = next(&mut consumer).await;
    consumer.ack(&d);
    assert_eq!(message_id(&d), "after", "the ladder flows on behind the big one");

    let parked = t.parked(1).await.remove(0);
    assert_eq!(parked.reason, "destination-not-allowed");
    let record = parked.message.body_record.clone().expect("the body is stored apart");
    assert_eq!(record.bytes, size as u64);
    assert!(parked.message.body_base64.is_empty());

    let lot = t.lot();
    let filter = ladder::model::lot::filter::Filter {
        message_id: Some("big-1".into()),
        ..Default::default()
    };
    let index = lot.index_for(&filter).await.unwrap();
    let selection = lot.select(&index, &filter).await.unwrap();
    assert_eq!(selection.entries.len(), 1);
    let fetched = lot.body(&selection.entries[0]).await.unwrap();
    assert!(fetched == body, "the body read back differs");
    // what an operator sees: `show` reads it back, prints its start, and says where the rest is
    let shown = lot.show(&index, selection.entries[0].offset).await.unwrap();
    assert!(shown.body().unwrap().as_ref() == body.as_slice());
    let text = ladder::model::lot::text::render_entry(lot.stream(), &shown);
    assert!(
        text.contains("stored apart") && text.contains("ladder parked body"),
        "{}",
        &text[..text.len().min(2000)]
    );
    assert!(text.len() < 1 << 20, "show prints a bounded part of a large body");
    let options = ladder::broker::lot::ReplayOptions {
        to: Some(replayed.clone()),
        rate: None,
        dry_run: false,
        by: "test".into(),
        edit: None,
    };
    let outcomes = lot.replay(&index, &selection.entries, &options).await.unwrap();
    assert_eq!(
        outcomes[0].status,
        ladder::broker::lot::Status::Replayed,
        "{outcomes:?}"
    );
    let mut replay_consumer = t.consume(&replayed).await;
    let d = next(&mut replay_consumer).await;
    replay_consumer.ack(&d);
    assert!(d.body == body, "the replayed body differs");
    assert_eq!(t.state.metrics.reconnects.get(), 0, "no channel or connection was lost");
    t.stop_service().await;
}

/// Regression (item 4): a queue that refuses publishes (`x-max-length 1`, `reject-publish`)
/// held the due hop's whole prefetch in retries, and a retry for a healthy queue waited in
/// `N.L.due` for over 15 s. Refused deliveries go back into a tier (no attempt counted); the
/// healthy queue's retries stay on time; once the full queue drains, everything arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_destination_does_not_hold_up_a_healthy_one() {
    let mut t = TestLadder::start("full", TWO_TIERS).await;
    let mut args = FieldTable::default();
    args.set("x-max-length", FieldValue::LongLongInt(1));
    args.set("x-overflow", text("reject-publish"));
    let full = t.declare_queue("full", args).await;
    let healthy = t.declare_queue("healthy", FieldTable::default()).await;
    t.publish(
        "",
        &full,
        b"filler",
        BasicProperties::default().with_message_id("filler"),
    )
    .await;
    const TO_FULL: usize = 210;
    for i in 0..TO_FULL {
        t.publish(&t.intake(), "", b"f", failure(&full, &format!("full-{i}")))
            .await;
    }
    // while the full queue refuses, retries for the healthy one are on time
    let mut healthy_consumer = t.consume(&healthy).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in 0..20 {
        let sent = Instant::now();
        t.publish(&t.intake(), "", b"h", failure(&healthy, &format!("healthy-{i}")))
            .await;
        let d = next(&mut healthy_consumer).await;
        healthy_consumer.ack(&d);
        let took = sent.elapsed();
        assert!(
            took < Duration::from_millis(200 + 1_500),
            "healthy retry {i} took {took:?} beside a full queue"
        );
    }
    let refused = |m: &str| {
        m.lines()
            .find(|l| l.starts_with("ladder_deferred_messages_total{") && l.contains("reason=\"refused\""))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert!(refused(&t.state.metrics.encode()) > 0, "refusals are counted");
    // drain the full queue: every one of its messages arrives, on its first attempt
    let mut full_consumer = t.consume(&full).await;
    let mut seen = HashSet::new();
    let drained = tokio::time::timeout(WAIT * 2, async {
        while seen.len() < TO_FULL {
            let d = next(&mut full_consumer).await;
            full_consumer.ack(&d);
            let id = message_id(&d).to_string();
            if id != "filler" {
                assert_eq!(
                    int_header(&d, "retry-attempt"),
                    Some(1),
                    "{id}: a refusal is not an attempt"
                );
                seen.insert(id);
            }
        }
    })
    .await;
    assert!(
        drained.is_ok(),
        "only {} of {TO_FULL} arrived at the full queue once it drained",
        seen.len()
    );
    assert_eq!(
        t.lot().index_for(&Default::default()).await.unwrap().read().len(),
        0,
        "nothing parked"
    );
    t.stop_service().await;
}

/// Returns the head of `queue` to it by taking it and closing the channel it came on, `times`
/// times (a lost connection or channel counts toward a quorum queue's delivery limit the same
/// way on RabbitMQ 3.10, 4.0 and 4.3).
async fn return_by_closing(t: &TestLadder, queue: &str, times: usize) {
    for _ in 0..times {
        let mut c = t.consume(queue).await;
        let _held = next(&mut c).await;
        c.channel.close(200, "returning it").await.unwrap();
    }
}

/// A due message, as a tier dead-letters it: addressed to `to`, first retry.
fn due_message(to: &str, id: &str) -> BasicProperties {
    retry_props(to, Some(1)).with_message_id(id).with_delivery_mode(2)
}

/// No broker drops a message the service holds (issue "Nothing lost on the brokers users
/// run"): on 4.x a quorum queue without a dead-letter target dropped it after 20 returns (a
/// lost connection each). `N.L.due` takes 25 returns and the message is still delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_message_returned_25_times_is_still_delivered() {
    let mut t = TestLadder::configure("limit25", ONE_TIER).await;
    t.start_service().await;
    t.stop_service().await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let due = format!("{}.due", t.intake());
    t.publish("", &due, b"held", due_message(&orders, "returned-25")).await;
    return_by_closing(&t, &due, 25).await;
    t.start_service().await;
    let mut consumer = t.consume(&orders).await;
    let d = next(&mut consumer).await;
    consumer.ack(&d);
    assert_eq!(message_id(&d), "returned-25", "25 returns are not a reason to lose it");
    t.stop_service().await;
}

/// Past the ladder's delivery limit the broker dead-letters a message out of `N.L.due` into the
/// quarantine, and the service parks it as `dead-lettered` — it is never dropped — while the
/// accounting identity keeps counting it (waiting in the quarantine, then parked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_delivery_limit_a_message_is_parked_not_dropped() {
    let mut t = TestLadder::configure("limit-past", ONE_TIER).await;
    t.start_service().await;
    t.stop_service().await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let due = format!("{}.due", t.intake());
    let quarantine = format!("{}.quarantine", t.intake());
    t.publish("", &due, b"returned too often", due_message(&orders, "past-limit"))
        .await;
    return_by_closing(&t, &due, ladder::broker::topology::DELIVERY_LIMIT as usize + 1).await;
    // dead-lettering happens after the last return, asynchronously
    eventually("it is dead-lettered into the quarantine", WAIT, async || {
        (queue_depth(&t.client, &quarantine).await > 0).then_some(())
    })
    .await;
    assert_eq!(queue_depth(&t.client, &due).await, 0);
    assert_eq!(queue_depth(&t.client, &quarantine).await, 1);
    t.start_service().await;
    let parked = t.parked(1).await.remove(0);
    assert_eq!(parked.reason, "dead-lettered", "{}", parked.detail);
    assert_eq!(parked.hop, "quarantine");
    assert_eq!(parked.destination.as_deref(), Some(orders.as_str()));
    assert!(
        parked.detail.contains("delivery_limit") && parked.detail.contains(&due),
        "{}",
        parked.detail
    );
    assert_eq!(parked.message.body().unwrap(), b"returned too often");
    assert_eq!(queue_depth(&t.client, &quarantine).await, 0);
    t.stop_service().await;
}

/// RabbitMQ 4.3's own delayed retry and Ladder together (README "With RabbitMQ 4.3's delayed
/// retry"): the work queue retries fast by itself (`x-delayed-retry-*`, counted by
/// `basic.reject`), and past its delivery limit dead-letters into the ladder, which waits a
/// long tier and brings the message back for another round of fast retries — until the
/// ladder's attempts run out and it is parked. Runs on RabbitMQ 4.3 or later only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_delayed_retry_on_4_3_hands_over_to_the_ladder() {
    let mut t = TestLadder::start("native", "backoff = [\"1s\"]\nmax_attempts = 2\nallow = [\"^{ns}-\"]").await;
    match t.client.server_version() {
        Some((major, minor, _)) if (major, minor) >= (4, 3) => {}
        version => {
            eprintln!("skipped: RabbitMQ 4.3's delayed retry is not on this broker ({version:?})");
            t.stop_service().await;
            return;
        }
    }
    let mut args = FieldTable::default();
    args.set("x-queue-type", text("quorum"));
    args.set("x-delayed-retry-type", text("failed"));
    args.set("x-delayed-retry-min", FieldValue::LongLongInt(100));
    args.set("x-delayed-retry-max", FieldValue::LongLongInt(300));
    args.set("x-delivery-limit", FieldValue::LongLongInt(2));
    args.set("x-dead-letter-exchange", text(&t.intake()));
    let orders = t.declare_queue("orders", args).await;
    let mut consumer = t.consume(&orders).await;
    t.publish("", &orders, b"work", BasicProperties::default().with_message_id("w-1"))
        .await;
    // 3 rounds (the first delivery and 2 ladder retries), each: 3 deliveries 100 and 200 ms
    // apart (the native retries), rejected; then the ladder's 1 s tier between rounds
    let mut arrivals = vec![];
    for round in 0..3 {
        for _ in 0..3 {
            let d = next(&mut consumer).await;
            arrivals.push((Instant::now(), round, int_header_opt(&d)));
            consumer.reject(&d, true);
        }
    }
    let parked = t.parked(1).await.remove(0);
    assert_eq!(parked.reason, "max-attempts", "{}", parked.detail);
    assert_eq!(
        parked.destination.as_deref(),
        Some(orders.as_str()),
        "the queue it failed in"
    );
    // nothing more: neither from the ladder (a marker through its tier closes it) nor from the
    // queue's own retries, which wait 300 ms at most where the marker's tier waits 1 s
    t.assert_nothing_more("a delivery after the park", &mut consumer, &orders, Via::Ladder)
        .await;
    for w in arrivals.windows(2) {
        let ((a, ra, _), (b, rb, attempt)) = (w[0], w[1]);
        let gap = b.duration_since(a);
        if ra == rb {
            assert!(gap < Duration::from_millis(900), "a native retry took {gap:?}");
        } else {
            assert!(gap >= Duration::from_millis(1000), "a ladder retry came after {gap:?}");
            assert_eq!(attempt, Some(rb as i64), "the ladder counts its own attempts");
        }
    }
    t.stop_service().await;
}

fn int_header_opt(d: &ladder_amqp::Delivery) -> Option<i64> {
    match d.properties.headers.as_ref()?.get("retry-attempt")? {
        FieldValue::LongLongInt(n) => Some(*n),
        _ => None,
    }
}
