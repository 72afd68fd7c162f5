//! Scheduled deliveries against the real broker: `x-delay` and `delay-until` on a ladder's intake
//! deliver once, to the queue or exchange named, after exactly that delay (never early); times
//! in the past deliver at once; absurd ones, unroutable and disallowed targets are parked with
//! their reason; a cancellation made through the CLI or the API reaches every replica before
//! the message is due; a service killed with deliveries scheduled loses none and delivers none
//! early.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use ladder::broker::state::State;
use ladder::broker::supervisor as service;
use ladder_amqp::{BasicProperties, FieldTable, FieldValue};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// A ladder with delay levels that may deliver to this test's queues and exchanges.
const SCHEDULING: &str = r#"
exact_delays = true
backoff = ["1s"]
allow = ["^{ns}-"]
allow_exchanges = ["^{ns}-"]
"#;

/// A scheduled delivery may be this much later than asked (intake hop, level hops, due hop on a
/// busy 2-core machine running other tests). It is never earlier.
const LATE: Duration = Duration::from_millis(1_500);

/// Admin server settings with one operator, alice.
const ADMIN: &str =
    "[admin]\nbind = \"127.0.0.1:0\"\npoll_interval = \"100ms\"\n[admin.tokens]\nalice = \"alice-token-0123456789\"";
const ALICE: &str = "alice-token-0123456789";

fn scheduled(id: &str, headers: &[(&str, FieldValue)]) -> BasicProperties {
    let mut h = FieldTable::default();
    for (key, value) in headers {
        h.set(key, value.clone());
    }
    BasicProperties::default().with_message_id(id).with_headers(h)
}

fn ms(value: u64) -> FieldValue {
    FieldValue::LongLongInt(value as i64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_delay_delivers_once_after_exactly_that_delay() {
    let mut t = TestLadder::start("xdelay", SCHEDULING).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let mut sent = HashMap::new();
    // 300 ms, 1.7 s and 2.5 s, published longest first: none waits behind a longer one
    for (id, delay) in [("late", 2_500u64), ("middle", 1_700), ("soon", 300)] {
        let props = scheduled(id, &[("retry-to", text(&orders)), ("x-delay", ms(delay))]);
        sent.insert(id.to_string(), (Instant::now(), delay));
        t.publish(&t.intake(), "", id.as_bytes(), props).await;
    }
    let mut order = Vec::new();
    for _ in 0..3 {
        let d = next(&mut consumer).await;
        let id = message_id(&d).to_string();
        let (at, delay) = sent[&id];
        let waited = at.elapsed();
        assert!(waited >= Duration::from_millis(delay), "{id}: {waited:?} < {delay} ms");
        assert!(waited < Duration::from_millis(delay) + LATE, "{id}: {waited:?}");
        let h = headers_of(&d);
        assert!(
            h.get("retry-attempt").is_none(),
            "a scheduled delivery is no retry: {h:?}"
        );
        assert!(
            h.get("x-delay").is_none() && h.get("retry-scheduled").is_none(),
            "{h:?}"
        );
        assert_eq!(d.body, id.as_bytes());
        consumer.ack(&d);
        order.push(id);
    }
    assert_eq!(order, ["soon", "middle", "late"]);
    assert!(
        next_within(&mut consumer, Duration::from_secs(2)).await.is_none(),
        "delivered once"
    );
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_time_in_the_past_delivers_at_once_and_an_absurd_one_is_parked() {
    let mut t = TestLadder::start("dpast", SCHEDULING).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let sent = Instant::now();
    let past = scheduled(
        "past",
        &[("retry-to", text(&orders)), ("delay-until", ms(now_ms() - 60_000))],
    );
    t.publish(&t.intake(), "", b"past", past).await;
    let d = next(&mut consumer).await;
    assert_eq!(message_id(&d), "past");
    assert!(sent.elapsed() < LATE, "{:?}", sent.elapsed());
    consumer.ack(&d);

    let absurd = [
        ("words", "x-delay", text("soon")),
        ("seconds", "delay-until", ms(now_ms() / 1000 + 30)),
        ("too-far", "x-delay", ms(60 * 24 * 3600 * 1000)),
        ("next-year", "delay-until", ms(now_ms() + 365 * 24 * 3600 * 1000)),
    ];
    for (id, key, value) in &absurd {
        t.publish(
            &t.intake(),
            "",
            b"?",
            scheduled(id, &[("retry-to", text(&orders)), (key, value.clone())]),
        )
        .await;
    }
    let parked = t.parked(absurd.len()).await;
    for (envelope, (id, key, _)) in parked.iter().zip(&absurd) {
        assert_eq!(envelope.message.properties["message_id"].as_str(), Some(*id));
        assert_eq!(envelope.reason, "invalid-delay", "{id}: {}", envelope.detail);
        assert!(envelope.detail.contains(key), "{id}: {}", envelope.detail);
        assert_eq!(envelope.destination.as_deref(), Some(orders.as_str()));
    }
    assert!(
        next_within(&mut consumer, Duration::from_secs(1)).await.is_none(),
        "none delivered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_target_gets_the_routing_key_and_unroutable_or_disallowed_are_parked() {
    let mut t = TestLadder::start("dexch", SCHEDULING).await;
    let events = format!("{}-events", t.ns);
    t.track_exchange(&events);
    t.channel
        .exchange_declare(&events, "topic", true, FieldTable::default())
        .await
        .unwrap();
    let created = t.declare_queue("created", FieldTable::default()).await;
    t.channel
        .queue_bind(&created, &events, "order.created", FieldTable::default())
        .await
        .unwrap();
    let mut consumer = t.consume(&created).await;

    let to_events = |id: &str| scheduled(id, &[("retry-to-exchange", text(&events)), ("x-delay", ms(400))]);
    let sent = Instant::now();
    t.publish(&t.intake(), "order.created", b"e1", to_events("routed"))
        .await;
    let d = next(&mut consumer).await;
    assert_eq!(message_id(&d), "routed");
    assert_eq!(
        d.routing_key.to_str().unwrap(),
        "order.created",
        "the key it was published with"
    );
    assert!(sent.elapsed() >= Duration::from_millis(400), "{:?}", sent.elapsed());
    consumer.ack(&d);

    // a key nothing is bound to: returned, parked
    t.publish(&t.intake(), "order.deleted", b"e2", to_events("unroutable"))
        .await;
    // an exchange outside allow_exchanges
    let other = scheduled(
        "elsewhere",
        &[("retry-to-exchange", text("amq.topic")), ("x-delay", ms(100))],
    );
    t.publish(&t.intake(), "order.created", b"e3", other).await;
    let parked = t.parked(2).await;
    let reason_of = |id: &str| {
        parked
            .iter()
            .find(|e| e.message.properties["message_id"].as_str() == Some(id))
            .map(|e| e.reason.clone())
            .unwrap_or_else(|| panic!("{id} parked: {parked:?}"))
    };
    assert_eq!(reason_of("unroutable"), "no-route");
    assert_eq!(reason_of("elsewhere"), "destination-not-allowed");
    assert!(next_within(&mut consumer, Duration::from_secs(1)).await.is_none());
}

/// A second service for the same config (another replica), stopped when dropped.
struct Replica(CancellationToken, tokio::task::JoinHandle<()>);

impl Replica {
    async fn start(t: &TestLadder) -> Self {
        let (stop, state) = (CancellationToken::new(), Arc::new(State::default()));
        let (config, s, token) = (t.config.clone(), state.clone(), stop.clone());
        let task = tokio::spawn(async move { service::run(config, s, token).await.expect("replica runs") });
        wait_until("replica ready", || state.health.is_ready()).await;
        Replica(stop, task)
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.0.cancel();
        self.1.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_from_the_cli_or_the_api_reaches_every_replica_before_it_is_due() {
    let mut t = TestLadder::configure_with("dcancel", ADMIN, SCHEDULING).await;
    t.start_service().await;
    let _replica = Replica::start(&t).await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    for id in ["keep", "by-cli", "by-api"] {
        let props = scheduled(id, &[("retry-to", text(&orders)), ("x-delay", ms(4_000))]);
        t.publish(&t.intake(), "", id.as_bytes(), props).await;
    }
    // the page and the API say when the next of them leaves its level (this replica's share)
    let due_by = now_ms() + 4_000;
    let http = reqwest::Client::builder().timeout(WAIT).build().unwrap();
    let ladders = admin.url("/api/ladders");
    let (next_out, waiting) = eventually("a next leave time in /api/ladders", WAIT, async || {
        let v: Value = http.get(&ladders).send().await.ok()?.json().await.ok()?;
        let tiers = v["ladders"][0]["tiers"].as_array()?.clone();
        let next = tiers.iter().filter_map(|t| t["next_leave_at_ms"].as_u64()).min()?;
        let waiting: u64 = tiers.iter().filter_map(|t| t["put_in_waiting"].as_u64()).sum();
        Some((next, waiting))
    })
    .await;
    assert!(
        next_out <= due_by && next_out + 4_100 >= due_by,
        "next leave {next_out}, due by {due_by}"
    );
    assert!(
        (1..=3).contains(&waiting),
        "{waiting} (the service or the replica took them)"
    );
    let out = run_ladder(
        &t.config_path(),
        &["scheduled", "cancel", "by-cli", "--by", "carol"],
        &[],
    )
    .await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("cancelled by-cli"));

    let url = admin.url(&format!("/api/ladders/{}/scheduled/cancel", t.ladder));
    let refused = http
        .post(&url)
        .json(&json!({"message_id": "by-api"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 401, "a cancel needs a token");
    let answer = http
        .post(&url)
        .bearer_auth(ALICE)
        .json(&json!({"message_id": "by-api"}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status().as_u16(), 200);
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(answer["message_id"], "by-api");
    assert_eq!(answer["by"], "alice");

    let d = next(&mut consumer).await;
    assert_eq!(message_id(&d), "keep");
    consumer.ack(&d);
    let parked = t.parked(2).await;
    let mut cancelled: Vec<_> = parked
        .iter()
        .map(|e| {
            assert_eq!(e.reason, "cancelled", "{}", e.detail);
            e.message.properties["message_id"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    cancelled.sort();
    assert_eq!(cancelled, ["by-api", "by-cli"]);
    assert!(
        next_within(&mut consumer, Duration::from_secs(2)).await.is_none(),
        "neither delivered"
    );
    admin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_racing_the_due_time_has_exactly_one_outcome() {
    let mut t = TestLadder::start("drace", SCHEDULING).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let names = ladder::model::names::Names::new(&t.ns, &t.ladder);
    let n = 40u64;
    for i in 0..n {
        // due 1.0 s … 1.39 s from now; cancelled at about 1.2 s: some before, some after
        let props = scheduled(
            &format!("r{i}"),
            &[("retry-to", text(&orders)), ("x-delay", ms(1_000 + 10 * i))],
        );
        t.publish(&t.intake(), "", b"r", props).await;
    }
    tokio::time::sleep(Duration::from_millis(1_150)).await;
    for i in 0..n {
        ladder::broker::cancels::cancel(&t.client, &names, &format!("r{i}"), "race")
            .await
            .unwrap();
    }
    let mut outcomes: HashMap<String, Vec<&str>> = HashMap::new();
    let deadline = Instant::now() + WAIT;
    let mut delivered = 0;
    while Instant::now() < deadline {
        match next_within(&mut consumer, Duration::from_secs(3)).await {
            Some(d) => {
                outcomes
                    .entry(message_id(&d).to_string())
                    .or_default()
                    .push("delivered");
                consumer.ack(&d);
                delivered += 1;
            }
            None => break,
        }
    }
    let parked = t.parked(n as usize - delivered).await;
    for e in &parked {
        assert_eq!(e.reason, "cancelled");
        outcomes
            .entry(
                e.message.properties["message_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
            .or_default()
            .push("cancelled");
    }
    assert_eq!(outcomes.len() as u64, n, "every message has an outcome: {outcomes:?}");
    assert!(
        outcomes.values().all(|o| o.len() == 1),
        "exactly one each: {outcomes:?}"
    );
    // nothing else parked: the stream's last record is the last of these
    tokio::time::sleep(Duration::from_millis(500)).await;
    let last = t.lot().end().await.unwrap();
    assert_eq!(last, parked.len().checked_sub(1).map(|l| l as u64), "no more parked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_service_loses_no_scheduled_delivery_and_delivers_none_early() {
    let mut t = TestLadder::start("dkill", SCHEDULING).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let n = 200u64;
    let mut due = HashMap::new();
    for i in 0..n {
        let delay = 500 + (i * 17) % 2_500;
        let props = scheduled(&format!("k{i}"), &[("retry-to", text(&orders)), ("x-delay", ms(delay))]);
        due.insert(format!("k{i}"), now_ms() + delay);
        t.publish(&t.intake(), "", b"k", props).await;
    }
    // the service dies at once (no drain) while they wait, and comes back a moment later
    t.abort_service();
    tokio::time::sleep(Duration::from_millis(700)).await;
    t.start_service().await;
    let mut consumer = t.consume(&orders).await;
    let mut seen = HashMap::new();
    while seen.len() < n as usize {
        let d = next(&mut consumer).await;
        let id = message_id(&d).to_string();
        let early = due[&id].saturating_sub(now_ms());
        assert!(early <= 5, "{id} delivered {early} ms early");
        *seen.entry(id).or_insert(0) += 1;
        consumer.ack(&d);
    }
    assert_eq!(seen.len() as u64, n, "none lost");
    assert_eq!(t.lot().end().await.unwrap(), None, "none parked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ladder_without_levels_parks_a_scheduled_delivery_and_refuses_a_cancel() {
    let mut t = TestLadder::start("dnolevels", "backoff = [\"1s\"]\nallow = [\"^{ns}-\"]").await;
    assert!(!t.config.ladders[0].exact_delays);
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    t.publish(
        &t.intake(),
        "",
        b"x",
        scheduled("x", &[("retry-to", text(&orders)), ("x-delay", ms(100))]),
    )
    .await;
    let parked = t.parked(1).await;
    assert_eq!(parked[0].reason, "invalid-delay");
    assert!(
        parked[0].detail.contains("exact_delays = false"),
        "{}",
        parked[0].detail
    );
    let out = run_ladder(&t.config_path(), &["scheduled", "cancel", "x"], &[]).await;
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("exact_delays = false"));
}
