//! Bad input against the real broker: every kind of malformed, unroutable or oversized failure
//! message is parked with its reason code and its original body, properties and typed headers,
//! on the intake hop and on the due hop, while good messages published among them keep being
//! redelivered — the service never stops serving and the intake never blocks. Also: a
//! broker-validated `user_id` is moved into a header rather than republished.

use crate::common::*;
use ladder_amqp::{BasicProperties, Decimal, FieldTable, FieldValue, LongString};
use std::collections::{HashMap, HashSet};

const THREE_TIERS: &str = "backoff = [\"200ms\", \"500ms\", \"1s\"]\nallow = [\"^{ns}-\"]";

/// One bad input: what it is, what it carries, and the reason code it must be parked with.
struct Row {
    name: &'static str,
    props: BasicProperties,
    reason: &'static str,
}

fn row(name: &'static str, headers: Vec<(&str, FieldValue)>, reason: &'static str) -> Row {
    let mut table = FieldTable::default();
    for (key, value) in headers {
        table.set(key, value);
    }
    Row {
        name,
        props: BasicProperties::default().with_headers(table),
        reason,
    }
}

/// A table holding a table … `depth` levels down.
fn nested(depth: usize) -> FieldValue {
    let mut value = FieldValue::Boolean(true);
    for _ in 0..depth {
        let mut table = FieldTable::default();
        table.set("n", value);
        value = FieldValue::FieldTable(table);
    }
    value
}

fn table(pairs: Vec<(&str, FieldValue)>) -> FieldValue {
    let mut t = FieldTable::default();
    for (key, value) in pairs {
        t.set(key, value);
    }
    FieldValue::FieldTable(t)
}

/// The table of bad inputs; `orders` is a declared queue the allow-list accepts, so a row
/// that names it fails only on the header the row is about.
fn bad_rows(ns: &str, orders: &str) -> Vec<Row> {
    let to = || ("retry-to", text(orders));
    let decimal = FieldValue::Decimal(Decimal { scale: 1, value: 20 });
    vec![
        Row {
            name: "no headers at all",
            props: BasicProperties::default(),
            reason: "no-destination",
        },
        row(
            "retry-to is an integer",
            vec![("retry-to", FieldValue::LongInt(42))],
            "invalid-header",
        ),
        row(
            "retry-to is a table",
            vec![("retry-to", table(vec![("queue", text(orders))]))],
            "invalid-header",
        ),
        row("retry-to is empty", vec![("retry-to", text(""))], "invalid-header"),
        row(
            "retry-to is not UTF-8",
            vec![(
                "retry-to",
                FieldValue::LongString(LongString::from(vec![0xff, 0xfe, b'q'])),
            )],
            "invalid-header",
        ),
        row(
            "retry-to is 300 characters (allowed prefix, too long for a queue name)",
            vec![("retry-to", text(&format!("{orders}{}", "x".repeat(300 - orders.len()))))],
            "invalid-header",
        ),
        row(
            "retry-to outside the allow-list",
            vec![("retry-to", text("payments"))],
            "destination-not-allowed",
        ),
        row(
            "retry-to inside the ladder's namespace",
            vec![("retry-to", text(&format!("{ns}.default.intake")))],
            "destination-not-allowed",
        ),
        row(
            "retry-to a broker-owned amq. queue",
            vec![("retry-to", text("amq.gen-JzTY20BRgKO-HjmUJj0wLg"))],
            "destination-not-allowed",
        ),
        row(
            "retry-attempt is negative",
            vec![to(), ("retry-attempt", FieldValue::LongInt(-1))],
            "invalid-header",
        ),
        row(
            "retry-attempt is the string \"2\"",
            vec![to(), ("retry-attempt", text("2"))],
            "invalid-header",
        ),
        row(
            "retry-attempt is a decimal",
            vec![to(), ("retry-attempt", decimal)],
            "invalid-header",
        ),
        row(
            "retry-attempt is a fractional double",
            vec![to(), ("retry-attempt", FieldValue::Double(1.5))],
            "invalid-header",
        ),
        row(
            "retry-delay is \"soon\"",
            vec![to(), ("retry-delay", text("soon"))],
            "invalid-header",
        ),
        row(
            "retry-delay is negative",
            vec![to(), ("retry-delay", FieldValue::LongInt(-5))],
            "invalid-header",
        ),
        // beyond the longest delay (49 days): refused where it enters, not after weeks of waiting
        row(
            "retry-delay is a year",
            vec![to(), ("retry-delay", text("1y"))],
            "invalid-header",
        ),
        row(
            "retry-delay is i64::MAX ms",
            vec![to(), ("retry-delay", FieldValue::LongLongInt(i64::MAX))],
            "invalid-header",
        ),
        row(
            "retry-delay is a table",
            vec![to(), ("retry-delay", table(vec![("ms", FieldValue::LongInt(100))]))],
            "invalid-header",
        ),
        row(
            "retry-reason is a timestamp",
            vec![to(), ("retry-reason", FieldValue::Timestamp(1_700_000_000))],
            "invalid-header",
        ),
        row(
            "x-death's newest entry names no queue (an older one does)",
            vec![(
                "x-death",
                FieldValue::FieldArray(vec![
                    table(vec![
                        ("reason", text("rejected")),
                        ("count", FieldValue::LongLongInt(1)),
                    ]),
                    table(vec![("queue", text(orders)), ("reason", text("rejected"))]),
                ]),
            )],
            "no-destination",
        ),
        row("x-death is a string", vec![("x-death", text(orders))], "no-destination"),
        row(
            "headers above max_header_bytes",
            vec![to(), ("blob", FieldValue::ByteArray(vec![7u8; 20_000]))],
            "header-too-large",
        ),
        row(
            "retry-attempt already at max_attempts",
            vec![to(), ("retry-attempt", FieldValue::LongLongInt(3))],
            "max-attempts",
        ),
        row(
            "a header nested deeper than 32 levels",
            vec![to(), ("deep", nested(40))],
            "invalid-header",
        ),
    ]
}

/// How the detail of a delay beyond the longest one ends: the limit, 49 days in ms.
const BEYOND: &str = "beyond the longest delay (4233600000 ms, 49 days)";

/// 50 days in ms: past the limit.
const FIFTY_DAYS_MS: i64 = 50 * 24 * 3600 * 1000;

/// One way a delay beyond the longest enters: the header `header` set to `value` on a message
/// published to the `hop` (`intake`: the ladder's exchange; `due`: its due queue), parked with
/// `reason` and a detail that starts with `starts`.
struct TooFar {
    id: &'static str,
    hop: &'static str,
    header: &'static str,
    value: FieldValue,
    reason: &'static str,
    starts: &'static str,
}

/// A delay beyond the longest one (49 days), wherever it enters, is parked at once with the
/// limit in the detail: a `retry-delay` on intake as `invalid-header`; a scheduled delivery's
/// `x-delay` or `delay-until` on intake, and a `retry-due-at` forged on a message published
/// straight into the ladder's due queue (as anyone with `write` there could), as
/// `invalid-delay`. None waits in the levels first. A ladder with delay levels, which is where
/// a due time is honoured at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delay_beyond_the_longest_is_refused_where_it_enters_naming_the_limit() {
    let mut t = TestLadder::start(
        "toolong",
        "exact_delays = true\nqueue_type = \"classic\"\nbackoff = [\"1s\"]\nallow = [\"^{ns}-\"]",
    )
    .await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let ahead = || FieldValue::LongLongInt(now_ms() as i64 + FIFTY_DAYS_MS);
    let case = |id, hop, header, value, reason, starts| TooFar {
        id,
        hop,
        header,
        value,
        reason,
        starts,
    };
    let cases = [
        case(
            "retry-delay",
            "intake",
            "retry-delay",
            FieldValue::LongLongInt(FIFTY_DAYS_MS),
            "invalid-header",
            "retry-delay is 4320000000 ms, ",
        ),
        case(
            "x-delay",
            "intake",
            "x-delay",
            FieldValue::LongLongInt(FIFTY_DAYS_MS),
            "invalid-delay",
            "x-delay of 4320000000 ms is ",
        ),
        case(
            "delay-until",
            "intake",
            "delay-until",
            ahead(),
            "invalid-delay",
            "delay-until of ",
        ),
        case(
            "forged-due-at",
            "due",
            "retry-due-at",
            ahead(),
            "invalid-delay",
            "retry-due-at is ",
        ),
    ];
    let due_queue = ladder::model::names::Names::new(&t.ns, &t.ladder).due;
    for c in &cases {
        let mut table = FieldTable::default();
        table.set("retry-to", text(&orders));
        table.set(c.header, c.value.clone());
        let props = BasicProperties::default().with_message_id(c.id).with_headers(table);
        match c.hop {
            "intake" => t.publish(&t.intake(), "", c.id.as_bytes(), props).await,
            _ => t.publish("", &due_queue, c.id.as_bytes(), props).await,
        }
    }
    let parked = t.parked(cases.len()).await;
    for c in &cases {
        let id = c.id;
        let e = parked
            .iter()
            .find(|e| e.message.properties().unwrap().message_id.as_ref().unwrap().to_str() == Some(id))
            .unwrap_or_else(|| panic!("{id} was not parked: {parked:?}"));
        assert_eq!(e.reason, c.reason, "{id}: {}", e.detail);
        assert_eq!(e.hop, c.hop, "{id}");
        assert!(e.detail.starts_with(c.starts), "{id}: {}", e.detail);
        assert!(e.detail.ends_with(BEYOND), "{id}: {}", e.detail);
        assert_eq!(e.destination.as_deref(), Some(orders.as_str()), "{id}");
        assert_eq!(e.message.body().unwrap(), id.as_bytes(), "{id}");
    }
    t.assert_nothing_parked_after(cases.len()).await;
    assert!(
        next_within(&mut consumer, std::time::Duration::from_millis(500))
            .await
            .is_none(),
        "a delay beyond the longest was delivered"
    );
}

/// Properties of a good failure: it names an allowed, declared queue.
fn good_props(id: &str, orders: &str) -> BasicProperties {
    retry_props(orders, None).with_message_id(id)
}

fn header<'a>(props: &'a BasicProperties, key: &str) -> Option<&'a FieldValue> {
    props.headers.as_ref()?.get(key)
}

/// Polls the ready count of `queue` (passively declared) until it is 0; panics after [`WAIT`].
async fn wait_until_empty(t: &TestLadder, queue: &str) {
    eventually_ok(&format!("{queue} is empty"), WAIT, async || {
        // a failed passive declare closes the channel: one per poll
        let ch = t.client.create_channel().await.unwrap();
        let declared = ch.queue_inspect(queue).await.unwrap();
        let _ = ch.close(200, "polled").await;
        assert_eq!(declared.consumer_count, 1, "the service no longer consumes {queue}");
        match declared.message_count {
            0 => Ok(()),
            n => Err(format!("{n} messages")),
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_is_parked_with_its_reason_and_the_service_keeps_serving() {
    let mut t = TestLadder::start("bad", THREE_TIERS).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let rows = bad_rows(&t.ns, &orders);
    assert!(rows.len() >= 14);

    // publish every bad row, with a good message after every fifth one and at the end
    let mut sent: HashMap<String, (&Row, Vec<u8>, BasicProperties)> = HashMap::new();
    let mut good = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let id = format!("bad-{i}");
        let body = format!("bad body {i}: {}", r.name).into_bytes();
        let props = r.props.clone().with_message_id(id.as_str());
        t.publish(&t.intake(), "", &body, props.clone()).await;
        sent.insert(id, (r, body, props));
        if i % 5 == 4 || i == rows.len() - 1 {
            let id = format!("good-{}", good.len());
            t.publish(&t.intake(), "", id.as_bytes(), good_props(&id, &orders))
                .await;
            good.push(id);
        }
    }

    let envelopes = t.parked(rows.len()).await;
    let mut seen = HashSet::new();
    for envelope in &envelopes {
        let original = envelope.message.properties().expect("the envelope decodes");
        let id = original.message_id.as_ref().expect("message_id kept").to_string();
        assert!(seen.insert(id.clone()), "{id} was parked twice");
        let Some((r, body, props)) = sent.get(&id) else {
            panic!("parked a message that was not bad: {envelope:?}");
        };
        let name = r.name;
        assert_eq!(envelope.reason, r.reason, "{name}: {}", envelope.detail);
        assert!(!envelope.detail.is_empty(), "{name}: empty detail");
        assert_eq!(envelope.hop, "intake", "{name}");
        assert_eq!(envelope.ladder, "default", "{name}");
        assert_eq!(envelope.message.exchange, t.intake(), "{name}");
        assert_eq!(&envelope.message.body().unwrap(), body, "{name}: body changed");
        assert_eq!(&original, props, "{name}: properties or headers changed");
    }
    assert_eq!(seen.len(), rows.len());
    t.assert_nothing_parked_after(rows.len()).await;

    // a few rows in detail: exact AMQP types survive, destinations and counts are reported
    let by_name = |name: &str| {
        let (id, _) = sent.iter().find(|(_, (r, _, _))| r.name == name).unwrap();
        let envelope = envelopes
            .iter()
            .find(|e| {
                e.message
                    .properties()
                    .unwrap()
                    .message_id
                    .as_ref()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    == id
            })
            .unwrap();
        (envelope, envelope.message.properties().unwrap())
    };
    let (_, p) = by_name("retry-attempt is a decimal");
    assert_eq!(
        header(&p, "retry-attempt"),
        Some(&FieldValue::Decimal(Decimal { scale: 1, value: 20 }))
    );
    let (_, p) = by_name("retry-to is not UTF-8");
    assert_eq!(
        header(&p, "retry-to"),
        Some(&FieldValue::LongString(LongString::from(vec![0xff, 0xfe, b'q'])))
    );
    let (_, p) = by_name("x-death's newest entry names no queue (an older one does)");
    assert!(
        matches!(header(&p, "x-death"), Some(FieldValue::FieldArray(a)) if a.as_slice().len() == 2),
        "{:?}",
        header(&p, "x-death")
    );
    let (_, p) = by_name("a header nested deeper than 32 levels");
    assert_eq!(header(&p, "deep"), Some(&nested(40)));
    let (e, _) = by_name("retry-to outside the allow-list");
    assert_eq!(e.destination.as_deref(), Some("payments"));
    let (e, _) = by_name("retry-to inside the ladder's namespace");
    assert!(e.detail.contains("namespace"), "{}", e.detail);
    let (e, _) = by_name("retry-attempt already at max_attempts");
    assert_eq!(e.destination.as_deref(), Some(orders.as_str()));
    assert_eq!(e.attempts, Some(3));
    let (e, _) = by_name("headers above max_header_bytes");
    assert!(e.detail.contains("max_header_bytes"), "{}", e.detail);
    // a delay beyond the longest is refused at once, and the detail names the limit
    for name in ["retry-delay is a year", "retry-delay is i64::MAX ms"] {
        let (e, _) = by_name(name);
        assert!(
            e.detail.starts_with("retry-delay is ") && e.detail.ends_with(BEYOND),
            "{name}: {}",
            e.detail
        );
        assert_eq!(e.destination.as_deref(), Some(orders.as_str()), "{name}");
    }

    // the good messages went through, and nothing bad followed them
    let mut delivered = HashSet::new();
    while delivered.len() < good.len() {
        let d = next(&mut consumer).await;
        let id = d.properties.message_id.as_ref().unwrap().to_string();
        assert_eq!(d.body, id.as_bytes(), "{id}");
        assert_eq!(int_header(&d, "retry-attempt"), Some(1), "{id}");
        assert!(delivered.insert(id.clone()), "{id} delivered twice");
        consumer.ack(&d);
    }
    assert_eq!(delivered, good.iter().cloned().collect::<HashSet<_>>());
    t.assert_nothing_more(
        &format!("a bad message delivered to {orders}"),
        &mut consumer,
        &orders,
        Via::Ladder,
    )
    .await;

    let ns = t.ns.clone();
    wait_until_empty(&t, &format!("{ns}.default.intake")).await;
    wait_until_empty(&t, &format!("{ns}.default.due")).await;
    assert!(t.state.health.is_ready(), "the service is no longer ready");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_on_the_due_hop_is_parked() {
    let t = TestLadder::start("baddue", THREE_TIERS).await;
    let mut headers = FieldTable::default();
    headers.set("app", FieldValue::LongInt(7));
    let props = BasicProperties::default()
        .with_message_id("bypass-1")
        .with_headers(headers);
    let tier = format!("{}.delay.200ms", t.ns);
    t.publish("", &tier, b"bypassed intake", props).await;

    let parked = t.parked(1).await.remove(0);
    assert_eq!(parked.reason, "no-destination", "{}", parked.detail);
    assert_eq!(parked.hop, "due");
    assert!(!parked.detail.is_empty());
    assert_eq!(parked.destination, None);
    assert_eq!(parked.message.body().unwrap(), b"bypassed intake");
    let original = parked.message.properties().unwrap();
    assert_eq!(original.message_id.as_ref().unwrap().to_str().unwrap(), "bypass-1");
    assert_eq!(header(&original, "app"), Some(&FieldValue::LongInt(7)));
    t.assert_nothing_parked_after(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_id_is_moved_into_a_header() {
    let mut t = TestLadder::start("userid", THREE_TIERS).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let props = good_props("who-1", &orders).with_user_id("guest");
    t.publish(&t.intake(), "", b"from guest", props).await;

    let d = next(&mut consumer).await;
    assert_eq!(d.body, b"from guest");
    assert_eq!(d.properties.message_id.as_ref().unwrap().to_str().unwrap(), "who-1");
    assert_eq!(d.properties.user_id, None, "user_id must not be republished");
    assert_eq!(headers_of(&d).get("retry-original-user-id"), Some(&text("guest")));
    assert_eq!(int_header(&d, "retry-attempt"), Some(1));
    consumer.ack(&d);
}

/// Deletes the ladder's parking lot and publishes a message without a destination, which must
/// be parked: waits until its park is refused (a publish failure on the intake). The message
/// is then held unacked in the intake.
async fn hold_one_for_a_missing_lot(t: &TestLadder) {
    t.channel.queue_delete(&t.parked_stream()).await.unwrap();
    t.publish(
        &t.intake(),
        "",
        b"held",
        BasicProperties::default().with_message_id("held-1"),
    )
    .await;
    let failures = || {
        t.state.metrics.encode().lines().any(|l| {
            l.starts_with("ladder_publish_failures_total{") && l.contains("hop=\"intake\"") && !l.ends_with(" 0")
        })
    };
    wait_until("the park is refused", failures).await;
}

/// Declares the parking lot again and asserts the held message is parked there.
async fn restore_the_lot_and_find_it_parked(t: &TestLadder) {
    let mut args = FieldTable::default();
    args.set("x-queue-type", text("stream"));
    let ch = t.client.create_channel().await.unwrap();
    ch.queue_declare(
        &t.parked_stream(),
        ladder_amqp::QueueOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    let parked = t.parked(1).await.remove(0);
    assert_eq!(parked.reason, "no-destination");
    assert_eq!(parked.message.body().unwrap(), b"held");
}

/// The parking lot itself can go missing (deleted by hand). A message that must be parked is
/// then held — not requeued (which on RabbitMQ 4.x counts toward the delivery limit) and not
/// dropped — and parked as soon as the stream is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_parking_lot_holds_the_message_until_it_is_back() {
    let t = TestLadder::start("noparking", THREE_TIERS).await;
    // the refused park shows as a publish failure; the message is still unacked in intake
    hold_one_for_a_missing_lot(&t).await;
    restore_the_lot_and_find_it_parked(&t).await;
}

/// A delivery held unacked (its park refused: the parking lot is missing) must not hold up the
/// acks of the deliveries after it: the hop acks what settles in one turn in one multiple ack,
/// and a multiple ack cannot pass an unsettled delivery. The deliveries behind it are acked on
/// their own, so more than a prefetch (100) of them pass while it is held — each arrives once,
/// none stays unacked in the intake — and the held one is parked once the lot is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_delivery_does_not_hold_up_the_acks_behind_it() {
    let mut t = TestLadder::start("heldhead", THREE_TIERS).await;
    let healthy = t.declare_queue("healthy", FieldTable::default()).await;
    hold_one_for_a_missing_lot(&t).await;
    const BEHIND: usize = 250;
    let mut consumer = t.consume(&healthy).await;
    for i in 0..BEHIND {
        let props = retry_props(&healthy, None).with_message_id(&format!("behind-{i}"));
        t.publish(&t.intake(), "", b"b", props).await;
    }
    let mut seen = HashSet::new();
    for d in receive(&mut consumer, BEHIND).await {
        assert!(seen.insert(message_id(&d).to_string()), "{} twice", message_id(&d));
    }
    assert_eq!(seen.len(), BEHIND);
    // nothing is left ready in the intake: what passed the held one was taken and acked
    let names = ladder::model::names::Names::new(&t.ns, &t.ladder);
    assert_eq!(queue_depth(&t.client, &names.intake_queue).await, 0);
    assert!(
        next_within(&mut consumer, std::time::Duration::from_millis(300))
            .await
            .is_none(),
        "no duplicate behind the held delivery"
    );
    restore_the_lot_and_find_it_parked(&t).await;
}
