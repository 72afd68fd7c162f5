use super::*;
use crate::model::ladder::{DeadLetterStrategy, QueueType};
use ladder_amqp::LongString;
use ladder_amqp::{Decimal, ShortString};
use std::time::Duration;

fn s(text: &str) -> Option<ShortString> {
    Some(ShortString::try_from(text).unwrap())
}

const NOW: u64 = 1_700_000_000_000;

struct Fixture {
    spec: LadderSpec,
    names: Names,
    limits: Limits,
}

fn fixture() -> Fixture {
    Fixture {
        spec: LadderSpec::new(
            "default".into(),
            vec![
                Duration::from_millis(200),
                Duration::from_millis(500),
                Duration::from_secs(1),
            ],
            3,
            regex::RegexSet::new(["^orders$", "^billing\\."]).unwrap(),
            QueueType::Quorum,
            DeadLetterStrategy::AtLeastOnce,
        ),
        names: Names::new("ns", "default"),
        limits: Limits {
            prefetch: 10,
            max_in_flight_per_destination: 3,
            max_header_bytes: 4096,
            max_reason_bytes: 32,
        },
    }
}

impl Fixture {
    fn ctx(&self) -> HopContext<'_> {
        HopContext {
            spec: &self.spec,
            names: &self.names,
            limits: &self.limits,
        }
    }
}

fn props(headers: &[(&str, FieldValue)]) -> BasicProperties {
    let mut table = FieldTable::default();
    for (k, v) in headers {
        table.set(k, v.clone());
    }
    BasicProperties {
        headers: Some(table),
        ..Default::default()
    }
}

fn forward(d: Decision<'_>) -> Forward<'_> {
    match d {
        Decision::Forward(f) => *f,
        Decision::Park(p) => panic!("parked: {p:?}"),
    }
}

fn parked(d: Decision<'_>) -> Park {
    match d {
        Decision::Park(p) => p,
        Decision::Forward(f) => panic!("forwarded to {}", f.routing_key),
    }
}

fn header<'a>(p: &'a BasicProperties, key: &str) -> Option<&'a FieldValue> {
    p.headers.as_ref()?.get(key)
}

#[test]
fn the_annotations_the_due_hop_skips_are_ones_every_hop_strips() {
    for key in ladder_amqp::DEAD_LETTER_HEADERS {
        assert!(is_stripped(key.as_bytes()), "{key}");
    }
    assert!(!ladder_amqp::DEAD_LETTER_HEADERS.iter().any(|k| k.starts_with("retry-")));
}

fn death(queue: &str) -> FieldValue {
    let mut entry = FieldTable::default();
    entry.set("queue", long_string(queue));
    entry.set("reason", long_string("rejected"));
    entry.set("count", FieldValue::LongLongInt(1));
    FieldValue::FieldTable(entry)
}

#[test]
fn first_failure_is_scheduled_in_the_first_tier() {
    let f = fixture();
    let input = BasicProperties {
        expiration: s("5000"),
        user_id: s("guest"),
        message_id: s("m1"),
        ..props(&[("retry-to", long_string("orders")), ("app", FieldValue::LongInt(7))])
    };
    let out = forward(f.ctx().intake(&input, NOW));
    assert_eq!(out.exchange, "");
    assert_eq!(out.kind.tier().unwrap(), "200ms");
    assert_eq!(out.attempt, 1);
    let p = &out.properties;
    assert_eq!(header(p, "retry-attempt"), Some(&FieldValue::LongLongInt(1)));
    assert_eq!(
        header(p, "retry-first-failed-at"),
        Some(&FieldValue::LongLongInt(NOW as i64))
    );
    assert_eq!(
        header(p, "retry-due-at"),
        Some(&FieldValue::LongLongInt(NOW as i64 + 200))
    );
    assert_eq!(header(p, "retry-tier"), Some(&long_string("200ms")));
    assert_eq!(header(p, "retry-ladder"), Some(&long_string("default")));
    assert_eq!(header(p, "retry-to"), Some(&long_string("orders")));
    assert_eq!(header(p, "retry-original-user-id"), Some(&long_string("guest")));
    assert_eq!(header(p, "app"), Some(&FieldValue::LongInt(7)));
    assert_eq!(p.expiration, None);
    assert_eq!(p.user_id, None);
    assert_eq!(p.delivery_mode, Some(2));
    assert_eq!(p.message_id, s("m1"));
}

#[test]
fn attempts_climb_the_ladder_and_keep_first_failure_time() {
    let f = fixture();
    let input = props(&[
        ("retry-to", long_string("orders")),
        ("retry-attempt", FieldValue::LongLongInt(1)),
        ("retry-first-failed-at", FieldValue::LongLongInt(42)),
    ]);
    let out = forward(f.ctx().intake(&input, NOW));
    assert_eq!(out.kind.tier().unwrap(), "500ms");
    assert_eq!(
        header(&out.properties, "retry-attempt"),
        Some(&FieldValue::LongLongInt(2))
    );
    assert_eq!(
        header(&out.properties, "retry-first-failed-at"),
        Some(&FieldValue::LongLongInt(42))
    );
}

#[test]
fn exhausted_ladder_parks_with_max_attempts() {
    let f = fixture();
    let input = props(&[
        ("retry-to", long_string("orders")),
        ("retry-attempt", FieldValue::ShortShortUInt(3)),
    ]);
    let p = parked(f.ctx().intake(&input, NOW));
    assert_eq!(p.reason, ParkReason::MaxAttempts);
    assert_eq!(p.destination.as_deref(), Some("orders"));
    assert_eq!(p.attempts, Some(3));
}

#[test]
fn dead_letter_mode_uses_the_newest_death_and_strips_broker_headers() {
    let f = fixture();
    let deaths = FieldValue::FieldArray(vec![death("billing.eu"), death("orders")]);
    let input = props(&[
        ("x-death", deaths),
        ("x-first-death-queue", long_string("orders")),
        ("x-last-death-reason", long_string("rejected")),
        ("CC", FieldValue::FieldArray(Vec::new())),
        ("BCC", FieldValue::FieldArray(Vec::new())),
    ]);
    let out = forward(f.ctx().intake(&input, NOW));
    assert_eq!(out.destination, "billing.eu");
    let keys: Vec<_> = out
        .properties
        .headers
        .as_ref()
        .unwrap()
        .iter()
        .map(|(k, _)| k.to_string())
        .collect();
    assert!(
        keys.iter().all(|k| !k.starts_with("x-") && k != "CC" && k != "BCC"),
        "{keys:?}"
    );
}

#[test]
fn explicit_retry_to_wins_over_x_death() {
    let f = fixture();
    let deaths = FieldValue::FieldArray(vec![death("billing.eu")]);
    let input = props(&[("x-death", deaths), ("retry-to", long_string("orders"))]);
    assert_eq!(forward(f.ctx().intake(&input, NOW)).destination, "orders");
}

#[test]
fn retry_delay_lengthens_the_wait_exactly_and_is_consumed() {
    let f = fixture();
    for value in [
        FieldValue::LongInt(400),
        long_string("400ms"),
        long_string("400"),
        FieldValue::Double(400.0),
    ] {
        let input = props(&[("retry-to", long_string("orders")), ("retry-delay", value.clone())]);
        let out = forward(f.ctx().intake(&input, NOW));
        // 400 ms exactly: the 256 ms level first, the rest on the way back
        assert_eq!(out.kind.tier().unwrap(), "level-256ms", "{value:?}");
        assert_eq!(
            header(&out.properties, "retry-due-at"),
            Some(&FieldValue::LongLongInt(NOW as i64 + 400))
        );
        assert_eq!(header(&out.properties, "retry-delay"), None);
    }
    let input = props(&[("retry-to", long_string("orders")), ("retry-delay", long_string("1h"))]);
    let out = forward(f.ctx().intake(&input, NOW));
    assert_eq!(
        header(&out.properties, "retry-due-at"),
        Some(&FieldValue::LongLongInt(NOW as i64 + 3_600_000))
    );
    assert_eq!(out.kind.tier().unwrap(), "level-35m");
    // without exact delays: the first step at least that long, as before
    let mut off = fixture();
    off.spec.set_exact_delays(false);
    let input = props(&[
        ("retry-to", long_string("orders")),
        ("retry-delay", FieldValue::LongInt(400)),
    ]);
    assert_eq!(forward(off.ctx().intake(&input, NOW)).kind.tier(), Some("500ms"));
}

/// A retry's exact wait is composed on the way back: the due hop sends what is not yet due
/// into the longest tier that does not overshoot, and delivers what is due.
#[test]
fn the_due_hop_waits_again_until_due_then_delivers() {
    let f = fixture();
    let input = props(&[
        ("retry-to", long_string("orders")),
        ("retry-delay", FieldValue::LongInt(400)),
    ]);
    let first = forward(f.ctx().intake(&input, NOW));
    assert_eq!(first.kind.tier(), Some("level-256ms"));
    let mut at = NOW + 256 + 3;
    let mut props_now = first.properties;
    let mut hops = vec![first.kind.tier().unwrap()];
    loop {
        let out = forward(f.ctx().due(&props_now, at));
        if out.kind == ForwardKind::Deliver {
            assert_eq!((&*out.exchange, &*out.routing_key), ("", "orders"));
            assert!(at >= NOW + 400, "never early");
            assert!(
                at < NOW + 400 + 16 + 3 * hops.len() as u64,
                "late by less than a level plus the hops"
            );
            assert_eq!(out.late_ms, at - (NOW + 400));
            assert_eq!(out.attempt, 1);
            break;
        }
        assert_eq!(out.exchange, "");
        assert_eq!(
            header(&out.properties, "retry-attempt"),
            Some(&FieldValue::LongLongInt(1)),
            "no attempt"
        );
        let tier = f
            .spec
            .tiers
            .iter()
            .find(|t| t.name == out.kind.tier().unwrap())
            .unwrap();
        at += tier.ttl_ms() + 3;
        hops.push(out.kind.tier().unwrap());
        props_now = out.properties;
        assert!(hops.len() < 10, "{hops:?}");
    }
    assert_eq!(
        hops,
        ["level-256ms", "level-128ms", "level-16ms"],
        "400 = 256 + 128 + 16 (with 3 ms per hop)"
    );
}

#[test]
fn a_forward_writes_the_received_properties_without_copying_those_that_need_no_change() {
    let f = fixture();
    let ctx = f.ctx();
    // as the ladder publishes a retry: persistent, no expiration, no user id
    let received = BasicProperties {
        content_type: s("text/plain"),
        message_id: s("m-1"),
        delivery_mode: Some(2),
        ..props(&[
            ("retry-to", long_string("orders")),
            ("x-delivery-count", FieldValue::LongInt(3)),
        ])
    };
    for decision in [
        ctx.intake_at(&received, &Arrival::at(NOW)),
        ctx.due_at(&received, &Arrival::at(NOW)),
    ] {
        let out = forward(decision);
        assert!(out.carry.is_some_and(|c| c.as_received));
        assert_eq!(out.properties.content_type, None, "the fields are not copied");
        let full = out.full_properties(&received);
        assert_eq!(
            (&full.content_type, &full.message_id),
            (&received.content_type, &received.message_id)
        );
        assert_eq!(full.delivery_mode, Some(2));
        assert_eq!(header(&full, "x-delivery-count"), None);
        assert_eq!(header(&full, "retry-to"), Some(&long_string("orders")));
    }
    // a TTL, a user id or a transient mode of its own is not republished: a copy without them
    let other = BasicProperties {
        expiration: s("60000"),
        user_id: s("svc"),
        delivery_mode: Some(1),
        ..received.clone()
    };
    for decision in [
        ctx.intake_at(&other, &Arrival::at(NOW)),
        ctx.due_at(&other, &Arrival::at(NOW)),
    ] {
        let out = forward(decision);
        assert!(out.carry.is_some_and(|c| !c.as_received));
        let full = out.full_properties(&other);
        assert_eq!(
            (&full.expiration, &full.user_id, full.delivery_mode),
            (&None, &None, Some(2))
        );
        assert_eq!(
            (&full.content_type, &full.message_id),
            (&other.content_type, &other.message_id)
        );
    }
}

#[test]
fn jitter_spreads_the_retry_exactly() {
    let mut f = fixture();
    f.spec.jitter = Some(crate::model::ladder::Jitter { permille: 100 });
    let input = props(&[("retry-to", long_string("orders"))]);
    let due = |draw: f64| {
        let arrival = Arrival {
            draw,
            ..Arrival::at(NOW)
        };
        let out = forward(f.ctx().intake_at(&input, &arrival).materialized(&input));
        header(&out.properties, "retry-due-at").and_then(as_u64).unwrap() - NOW
    };
    assert_eq!(due(0.0), 180, "200 ms - 10 %");
    assert_eq!(due(0.5), 200);
    assert_eq!(due(0.999_999), 220);
}

fn scheduled(headers: &[(&str, FieldValue)]) -> BasicProperties {
    BasicProperties {
        message_id: s("sched-1"),
        ..props(headers)
    }
}

#[test]
fn x_delay_schedules_one_delivery_without_an_attempt() {
    let f = fixture();
    let input = scheduled(&[
        ("retry-to", long_string("orders")),
        ("x-delay", FieldValue::LongInt(5_000)),
    ]);
    let out = forward(f.ctx().intake(&input, NOW));
    assert_eq!((out.kind.tier().is_some(), out.attempt), (true, 0));
    assert_eq!(out.kind.tier().unwrap(), "level-4.1s");
    let p = &out.properties;
    assert_eq!(
        header(p, "retry-due-at"),
        Some(&FieldValue::LongLongInt(NOW as i64 + 5_000))
    );
    assert_eq!(header(p, "retry-scheduled"), Some(&FieldValue::Boolean(true)));
    assert_eq!(header(p, "retry-attempt"), None, "not a failure");
    assert_eq!(header(p, "x-delay"), None, "answered: a later failure is a retry");
    // due: delivered once, as published (the request and the ladder's bookkeeping gone)
    let out = forward(f.ctx().due(&out.properties, NOW + 5_001));
    assert_eq!(out.kind, ForwardKind::Deliver);
    assert_eq!(out.routing_key, "orders");
    let p = &out.properties;
    assert_eq!(header(p, "x-delay"), None);
    for gone in ["retry-scheduled", "retry-due-at", "retry-tier", "retry-ladder"] {
        assert_eq!(header(p, gone), None, "{gone}");
    }
    assert_eq!(p.message_id, s("sched-1"));
}

#[test]
fn delay_until_in_the_past_goes_out_at_once_and_absurd_delays_park() {
    let f = fixture();
    let input = scheduled(&[
        ("retry-to", long_string("orders")),
        ("delay-until", FieldValue::LongLongInt(NOW as i64 - 60_000)),
    ]);
    let out = forward(f.ctx().intake(&input, NOW));
    assert_eq!(
        (&*out.exchange, &*out.routing_key, out.kind.tier()),
        ("", "ns.default.due", Some("")),
        "straight to the due queue"
    );
    let negative = scheduled(&[
        ("retry-to", long_string("orders")),
        ("x-delay", FieldValue::LongInt(-5)),
    ]);
    assert_eq!(forward(f.ctx().intake(&negative, NOW)).routing_key, "ns.default.due");
    for (key, value, why) in [
        ("x-delay", long_string("soon"), "integer"),
        ("x-delay", FieldValue::LongLongInt(50 * 86_400_000), "longest"),
        ("delay-until", FieldValue::LongLongInt(1_764_000_000), "seconds"),
        (
            "delay-until",
            FieldValue::LongLongInt(NOW as i64 + 50 * 86_400_000),
            "49 days",
        ),
        ("x-delay", FieldValue::Boolean(true), "integer"),
    ] {
        let input = scheduled(&[("retry-to", long_string("orders")), (key, value.clone())]);
        let park = parked(f.ctx().intake(&input, NOW));
        assert_eq!(park.reason, ParkReason::InvalidDelay, "{key} {value:?}");
        assert!(park.detail.contains(why), "{}", park.detail);
        assert_eq!(park.destination.as_deref(), Some("orders"));
    }
    let both = scheduled(&[
        ("retry-to", long_string("orders")),
        ("x-delay", FieldValue::LongInt(1)),
        ("delay-until", FieldValue::LongLongInt(NOW as i64)),
    ]);
    assert_eq!(parked(f.ctx().intake(&both, NOW)).reason, ParkReason::InvalidDelay);
    let nowhere = scheduled(&[("x-delay", FieldValue::LongInt(1))]);
    assert_eq!(parked(f.ctx().intake(&nowhere, NOW)).reason, ParkReason::NoDestination);
    let outside = scheduled(&[
        ("retry-to", long_string("payroll")),
        ("x-delay", FieldValue::LongInt(1)),
    ]);
    assert_eq!(
        parked(f.ctx().intake(&outside, NOW)).reason,
        ParkReason::DestinationNotAllowed
    );
}

#[test]
fn a_scheduled_delivery_to_an_exchange_keeps_its_routing_key_and_needs_allowing() {
    let mut f = fixture();
    let input = scheduled(&[
        ("retry-to-exchange", long_string("events")),
        ("x-delay", FieldValue::LongInt(100)),
    ]);
    let arrival = Arrival {
        routing_key: b"order.created",
        ..Arrival::at(NOW)
    };
    let park = parked(f.ctx().intake_at(&input, &arrival));
    assert_eq!(park.reason, ParkReason::DestinationNotAllowed);
    assert!(park.detail.contains("allow_exchanges"), "{}", park.detail);
    f.spec.allow_exchanges = regex::RegexSet::new(["^events$"]).unwrap();
    let out = forward(f.ctx().intake_at(&input, &arrival).materialized(&input));
    assert_eq!(out.destination, "exchange:events");
    let out = forward(f.ctx().due(&out.properties, NOW + 100));
    assert_eq!(
        (out.kind, &*out.exchange, &*out.routing_key),
        (ForwardKind::DeliverToExchange, "events", "order.created")
    );
    assert_eq!(header(&out.properties, "retry-routing-key"), None);
    for reserved in ["", "amq.topic", "ns.default.tiers"] {
        f.spec.allow_exchanges = regex::RegexSet::new([".*"]).unwrap();
        let input = scheduled(&[
            ("retry-to-exchange", long_string(reserved)),
            ("x-delay", FieldValue::LongInt(1)),
        ]);
        assert_eq!(
            parked(f.ctx().intake(&input, NOW)).reason,
            ParkReason::DestinationNotAllowed,
            "{reserved:?}"
        );
    }
}

#[test]
fn a_cancelled_id_is_parked_wherever_it_is_met() {
    let f = fixture();
    let cancelled = Arrival {
        cancelled: true,
        ..Arrival::at(NOW)
    };
    let input = scheduled(&[
        ("retry-to", long_string("orders")),
        ("x-delay", FieldValue::LongInt(5_000)),
    ]);
    let park = parked(f.ctx().intake_at(&input, &cancelled));
    assert_eq!(park.reason, ParkReason::Cancelled);
    assert!(park.detail.contains("sched-1"), "{}", park.detail);
    let waiting = forward(f.ctx().intake(&input, NOW)).properties;
    assert_eq!(
        parked(f.ctx().due_at(&waiting, &cancelled)).reason,
        ParkReason::Cancelled,
        "mid-wait"
    );
    let due = Arrival {
        now_ms: NOW + 6_000,
        ..cancelled
    };
    assert_eq!(
        parked(f.ctx().due_at(&waiting, &due)).reason,
        ParkReason::Cancelled,
        "when due"
    );
    let failure = scheduled(&[("retry-to", long_string("orders"))]);
    assert_eq!(
        parked(f.ctx().intake_at(&failure, &cancelled)).reason,
        ParkReason::Cancelled,
        "a retry too"
    );
}

#[test]
fn reason_is_truncated_on_a_char_boundary() {
    let f = fixture();
    let long = "é".repeat(40);
    let input = props(&[
        ("retry-to", long_string("orders")),
        ("retry-reason", long_string(&long)),
    ]);
    let out = forward(f.ctx().intake(&input, NOW));
    assert_eq!(
        header(&out.properties, "retry-reason"),
        Some(&long_string(&"é".repeat(16)))
    );
}

#[test]
fn bad_inputs_park_with_their_reason() {
    let f = fixture();
    let to = || ("retry-to", long_string("orders"));
    let nested = |depth: usize| {
        let mut v = FieldValue::Boolean(true);
        for _ in 0..depth {
            let mut t = FieldTable::default();
            t.set("n", v);
            v = FieldValue::FieldTable(t);
        }
        v
    };
    type Case<'a> = (&'a str, Vec<(&'a str, FieldValue)>, ParkReason);
    let cases: Vec<Case> = vec![
        ("no headers at all", vec![], ParkReason::NoDestination),
        (
            "retry-to is an integer",
            vec![("retry-to", FieldValue::LongInt(5))],
            ParkReason::InvalidHeader,
        ),
        (
            "retry-to is a table",
            vec![("retry-to", FieldValue::FieldTable(FieldTable::default()))],
            ParkReason::InvalidHeader,
        ),
        (
            "retry-to is empty",
            vec![("retry-to", long_string(""))],
            ParkReason::InvalidHeader,
        ),
        (
            "retry-to not UTF-8",
            vec![("retry-to", FieldValue::LongString(vec![0xffu8, 0xfe].into()))],
            ParkReason::InvalidHeader,
        ),
        (
            "retry-to too long",
            vec![("retry-to", long_string(&"q".repeat(256)))],
            ParkReason::InvalidHeader,
        ),
        (
            "not allowed",
            vec![("retry-to", long_string("payments"))],
            ParkReason::DestinationNotAllowed,
        ),
        (
            "own namespace",
            vec![("retry-to", long_string("ns.default.intake"))],
            ParkReason::DestinationNotAllowed,
        ),
        (
            "broker queue",
            vec![("retry-to", long_string("amq.gen-x"))],
            ParkReason::DestinationNotAllowed,
        ),
        (
            "negative attempt",
            vec![to(), ("retry-attempt", FieldValue::LongInt(-1))],
            ParkReason::InvalidHeader,
        ),
        (
            "string attempt",
            vec![to(), ("retry-attempt", long_string("2"))],
            ParkReason::InvalidHeader,
        ),
        (
            "fractional attempt",
            vec![to(), ("retry-attempt", FieldValue::Double(1.5))],
            ParkReason::InvalidHeader,
        ),
        (
            "decimal attempt",
            vec![
                to(),
                ("retry-attempt", FieldValue::Decimal(Decimal { scale: 1, value: 10 })),
            ],
            ParkReason::InvalidHeader,
        ),
        (
            "void attempt",
            vec![to(), ("retry-attempt", FieldValue::Void)],
            ParkReason::InvalidHeader,
        ),
        (
            "bad delay",
            vec![to(), ("retry-delay", long_string("soon"))],
            ParkReason::InvalidHeader,
        ),
        (
            "negative delay",
            vec![to(), ("retry-delay", FieldValue::LongInt(-5))],
            ParkReason::InvalidHeader,
        ),
        (
            "array delay",
            vec![to(), ("retry-delay", FieldValue::FieldArray(Vec::new()))],
            ParkReason::InvalidHeader,
        ),
        (
            "timestamp reason",
            vec![to(), ("retry-reason", FieldValue::Timestamp(5))],
            ParkReason::InvalidHeader,
        ),
        (
            "x-death without queue",
            vec![("x-death", FieldValue::FieldArray(vec![FieldValue::Boolean(true)]))],
            ParkReason::NoDestination,
        ),
        (
            "huge header",
            vec![to(), ("blob", FieldValue::ByteArray(vec![0u8; 5000]))],
            ParkReason::HeaderTooLarge,
        ),
        (
            "deep nesting",
            vec![to(), ("deep", nested(MAX_HEADER_DEPTH + 2))],
            ParkReason::InvalidHeader,
        ),
    ];
    for (name, headers, reason) in cases {
        let p = parked(f.ctx().intake(&props(&headers), NOW));
        assert_eq!(p.reason, reason, "{name}: {}", p.detail);
        assert!(!p.detail.is_empty(), "{name}");
    }
}

#[test]
fn listed_senders_reach_their_grants_and_the_rest_is_parked_as_sender_not_allowed() {
    use crate::model::ladder::{Senders, Unidentified};
    let f = fixture();
    let senders = |unidentified| Senders {
        grants: vec![
            ("orders-svc".into(), regex::RegexSet::new(["^orders$"]).unwrap()),
            ("billing-svc".into(), regex::RegexSet::new(["^billing\\."]).unwrap()),
        ],
        unidentified,
    };
    let spec = f.spec.clone().with_senders(senders(Unidentified::Reject));
    let ctx = HopContext { spec: &spec, ..f.ctx() };
    let from = |user: Option<&str>, headers: &[(&str, FieldValue)]| BasicProperties {
        user_id: user.and_then(s),
        ..props(headers)
    };
    let to = |queue: &str| (header::RETRY_TO, long_string(queue));
    // the user_id is who sent it; it still moves into retry-original-user-id
    let f1 = forward(ctx.intake(&from(Some("orders-svc"), &[to("orders")]), NOW));
    assert_eq!(f1.destination, "orders");
    assert!(f1.properties.user_id.is_none());
    assert_eq!(
        header(&f1.properties, header::RETRY_ORIGINAL_USER_ID).and_then(as_text),
        Some("orders-svc")
    );
    forward(ctx.intake(&from(Some("billing-svc"), &[to("billing.invoices")]), NOW));
    // another team's queue, an unknown user, no user at all
    for (user, queue, expected) in [
        (
            Some("billing-svc"),
            "orders",
            "\"billing-svc\" may not send to \"orders\"",
        ),
        (
            Some("mallory"),
            "orders",
            "\"mallory\" is not in senders of ladder default",
        ),
        (None, "orders", "no user_id"),
    ] {
        let p = parked(ctx.intake(&from(user, &[to(queue)]), NOW));
        assert_eq!(p.reason, ParkReason::SenderNotAllowed);
        assert_eq!(p.destination.as_deref(), Some(queue));
        assert!(p.detail.contains(expected), "{}", p.detail);
    }
    // a header naming a listed sender proves nothing: anyone can write it
    let forged = from(
        None,
        &[
            to("orders"),
            (header::RETRY_ORIGINAL_USER_ID, long_string("orders-svc")),
        ],
    );
    assert_eq!(parked(ctx.intake(&forged, NOW)).reason, ParkReason::SenderNotAllowed);
    // dead-letter mode (the newest x-death names the destination): refused under "reject",
    // accepted under "dead-letter" — on the first pass (no retry-to) and on later ones
    // (with the retry-to the ladder set)
    let deaths = |queue: &str| (header::X_DEATH, FieldValue::FieldArray(vec![death(queue)]));
    let dead_lettered = from(None, &[deaths("orders")]);
    let again = from(None, &[deaths("orders"), to("orders")]);
    let elsewhere = from(None, &[deaths("orders"), to("billing.x")]);
    for p in [&dead_lettered, &again, &elsewhere] {
        assert_eq!(parked(ctx.intake(p, NOW)).reason, ParkReason::SenderNotAllowed);
    }
    let spec = f.spec.clone().with_senders(senders(Unidentified::DeadLetter));
    let ctx = HopContext { spec: &spec, ..f.ctx() };
    assert_eq!(forward(ctx.intake(&dead_lettered, NOW)).destination, "orders");
    assert_eq!(forward(ctx.intake(&again, NOW)).destination, "orders");
    // dead-lettered from orders, but sent on to another queue: explicit, and unidentified
    assert_eq!(parked(ctx.intake(&elsewhere, NOW)).reason, ParkReason::SenderNotAllowed);
    let p = parked(ctx.intake(&from(None, &[to("orders")]), NOW));
    assert!(p.detail.contains("only dead-lettered"), "{}", p.detail);
    // the allow-list still comes first, and a ladder without senders checks none
    let p = parked(ctx.intake(&from(Some("orders-svc"), &[to("elsewhere")]), NOW));
    assert_eq!(p.reason, ParkReason::DestinationNotAllowed);
    forward(f.ctx().intake(&from(Some("mallory"), &[to("orders")]), NOW));
}

#[test]
fn due_delivers_to_the_destination_and_strips_tier_deaths() {
    let f = fixture();
    let deaths = FieldValue::FieldArray(vec![death("ns.default.delay.200ms")]);
    let input = props(&[
        ("retry-to", long_string("orders")),
        ("retry-attempt", FieldValue::LongLongInt(2)),
        ("retry-due-at", FieldValue::LongLongInt(NOW as i64 - 30)),
        ("x-death", deaths),
    ]);
    let out = forward(f.ctx().due(&input, NOW));
    assert_eq!((&*out.exchange, &*out.routing_key), ("", "orders"));
    assert_eq!(out.late_ms, 30);
    assert_eq!(out.attempt, 2);
    assert_eq!(header(&out.properties, "x-death"), None);
    assert_eq!(
        header(&out.properties, "retry-attempt"),
        Some(&FieldValue::LongLongInt(2))
    );
}

#[test]
fn parks_say_where_the_message_was_headed_when_readable() {
    let f = fixture();
    let cases = [
        props(&[("retry-to", long_string("orders")), ("retry-attempt", long_string("x"))]),
        props(&[
            ("retry-to", long_string("orders")),
            ("blob", FieldValue::ByteArray(vec![0u8; 5000])),
        ]),
        props(&[
            ("retry-to", long_string("orders")),
            ("retry-delay", long_string("soon")),
        ]),
    ];
    for input in cases {
        assert_eq!(
            parked(f.ctx().intake(&input, NOW)).destination.as_deref(),
            Some("orders")
        );
    }
}

#[test]
fn due_checks_header_size_too() {
    let f = fixture();
    let input = props(&[
        ("retry-to", long_string("orders")),
        ("blob", FieldValue::ByteArray(vec![0u8; 5000])),
    ]);
    assert_eq!(parked(f.ctx().due(&input, NOW)).reason, ParkReason::HeaderTooLarge);
}

#[test]
fn due_parks_what_it_cannot_deliver() {
    let f = fixture();
    assert_eq!(parked(f.ctx().due(&props(&[]), NOW)).reason, ParkReason::NoDestination);
    let p = parked(f.ctx().due(&props(&[("retry-to", long_string("payments"))]), NOW));
    assert_eq!(p.reason, ParkReason::DestinationNotAllowed);
}

fn entry(attempt: u64, tier: &str, failed_at_ms: u64) -> HistoryEntry {
    HistoryEntry {
        attempt,
        tier: tier.into(),
        failed_at_ms,
    }
}

fn history_header(p: &BasicProperties) -> Vec<HistoryEntry> {
    parse_history(header(p, "retry-history").expect("retry-history set"))
}

#[test]
fn every_scheduled_retry_appends_one_history_entry() {
    let f = fixture();
    let mut input = props(&[("retry-to", long_string("orders"))]);
    for (i, now) in [NOW, NOW + 1_012, NOW + 3_000].into_iter().enumerate() {
        let out = forward(f.ctx().intake(&input, now));
        input = out.properties;
        let value = header(&input, "retry-history").unwrap();
        assert!(matches!(value, FieldValue::LongString(_)), "{value:?}");
        assert_eq!(history_header(&input).len(), i + 1);
    }
    assert_eq!(
        header(&input, "retry-history"),
        Some(&long_string(
            "1:200ms:1700000000000,2:500ms:1700000001012,3:1s:1700000003000"
        ))
    );
    // the fourth failure exhausts the ladder: the park carries the three entries
    let p = parked(f.ctx().intake(&input, NOW + 5_000));
    assert_eq!(p.reason, ParkReason::MaxAttempts);
    assert_eq!(
        p.history,
        [
            entry(1, "200ms", NOW),
            entry(2, "500ms", NOW + 1_012),
            entry(3, "1s", NOW + 3_000)
        ]
    );
    assert_eq!(p.replayed_from, None);
}

#[test]
fn history_keeps_only_the_newest_entries() {
    let mut f = fixture();
    f.spec.max_attempts = 100;
    let mut input = props(&[("retry-to", long_string("orders"))]);
    for n in 0..MAX_HISTORY_ENTRIES as u64 + 5 {
        input = forward(f.ctx().intake(&input, NOW + n)).properties;
    }
    let history = history_header(&input);
    assert_eq!(history.len(), MAX_HISTORY_ENTRIES);
    let attempts: Vec<u64> = history.iter().map(|e| e.attempt).collect();
    assert_eq!(attempts, (6..=21).collect::<Vec<_>>());
    assert_eq!(history.last(), Some(&entry(21, "1s", NOW + 20)));
    let FieldValue::LongString(text) = header(&input, "retry-history").unwrap() else {
        panic!("not a long string")
    };
    assert!(text.len() < 1024, "{} bytes", text.len());

    let many: Vec<HistoryEntry> = (1..=40).map(|n| entry(n, "1h1m1s1ms", NOW + n)).collect();
    assert_eq!(parse_history(&format_history(&many)), many[40 - MAX_HISTORY_ENTRIES..]);
    let edges = [entry(0, "1s", 10), entry(u64::MAX, "2m", 1_763_929_200_000)];
    assert_eq!(
        format_history(&edges),
        long_string("0:1s:10,18446744073709551615:2m:1763929200000")
    );

    // the worst a header can carry on, forged or not, still fits the documented bound
    let longest_tier = crate::model::ladder::compact_duration(Duration::from_millis(u64::from(u32::MAX)));
    assert_eq!(longest_tier.len(), 15);
    let tier = "9".repeat(MAX_HISTORY_TIER_BYTES);
    let worst: Vec<HistoryEntry> = (0..40).map(|_| entry(u64::MAX, &tier, u64::MAX)).collect();
    let FieldValue::LongString(text) = format_history(&parse_history(&format_history(&worst))) else {
        panic!("not a long string")
    };
    assert!(text.len() < 1024, "{} bytes", text.len());
    assert_eq!(parse_history(&FieldValue::LongString(text)).len(), MAX_HISTORY_ENTRIES);
}

#[test]
fn history_is_read_leniently_and_never_parks() {
    let text = "x,1:1s:5, 2:10s:6 ,3:10s,4:1s:7:8,:1s:9,5::9,6:1 s:9,7:1s:abc,8:-1s:9,\
                9:1s:-9,10:1s:10,,11:1,s:11";
    assert_eq!(
        parse_history(&long_string(text)),
        [entry(1, "1s", 5), entry(2, "10s", 6), entry(10, "1s", 10)]
    );
    assert_eq!(
        parse_history(&FieldValue::ByteArray(b"1:1s:5".to_vec())),
        [entry(1, "1s", 5)]
    );
    let long_tier = format!("1:{}s:5", "1".repeat(MAX_HISTORY_TIER_BYTES));
    for garbage in [
        FieldValue::LongInt(5),
        FieldValue::LongString(vec![0xffu8, b':', 0xfe].into()),
        FieldValue::FieldTable(FieldTable::default()),
        FieldValue::FieldArray(vec![long_string("1:1s:5")]),
        FieldValue::Void,
        long_string(""),
        long_string(&long_tier),
    ] {
        assert_eq!(parse_history(&garbage), [], "{garbage:?}");
    }

    // garbage in the header: the message is forwarded, with the readable entries kept
    let f = fixture();
    let input = props(&[
        ("retry-to", long_string("orders")),
        ("retry-attempt", FieldValue::LongLongInt(1)),
        ("retry-history", long_string("1:200ms:5,junk")),
    ]);
    let out = forward(f.ctx().intake(&input, NOW));
    assert_eq!(
        history_header(&out.properties),
        [entry(1, "200ms", 5), entry(2, "500ms", NOW)]
    );
    let input = props(&[
        ("retry-to", long_string("orders")),
        ("retry-history", FieldValue::Boolean(true)),
    ]);
    let out = forward(f.ctx().intake(&input, NOW));
    assert_eq!(history_header(&out.properties), [entry(1, "200ms", NOW)]);
}

#[test]
fn parks_carry_the_history_and_lineage_as_received() {
    let f = fixture();
    let lineage = [
        ("retry-history", long_string("1:200ms:5,2:500ms:6")),
        ("retry-replayed-from", long_string("ns.default.parked@42")),
    ];
    let with = |extra: &[(&str, FieldValue)]| {
        let mut headers = lineage.to_vec();
        headers.extend_from_slice(extra);
        props(&headers)
    };
    let to = |queue: &str| ("retry-to", long_string(queue));
    let decisions = [
        f.ctx().intake(&with(&[to("payments")]), NOW),
        f.ctx().intake(&with(&[]), NOW),
        f.ctx()
            .intake(&with(&[to("orders"), ("retry-attempt", long_string("x"))]), NOW),
        f.ctx()
            .intake(&with(&[to("orders"), ("retry-attempt", FieldValue::LongInt(3))]), NOW),
        f.ctx().intake(
            &with(&[to("orders"), ("blob", FieldValue::ByteArray(vec![0u8; 5000]))]),
            NOW,
        ),
        f.ctx().due(&with(&[]), NOW),
        f.ctx().due(&with(&[to("payments")]), NOW),
    ];
    for decision in decisions {
        let p = parked(decision);
        assert_eq!(p.history, [entry(1, "200ms", 5), entry(2, "500ms", 6)], "{}", p.detail);
        assert_eq!(p.replayed_from.as_deref(), Some("ns.default.parked@42"), "{}", p.detail);
    }
    let long = props(&[("retry-replayed-from", long_string(&"s".repeat(5000)))]);
    assert_eq!(replayed_from_of(&long).map(|s| s.len()), Some(MAX_REPLAYED_FROM_BYTES));
    assert_eq!(history_of(&BasicProperties::default()), []);
}

#[test]
fn replay_keeps_the_history_and_a_replayed_message_starts_again_at_attempt_one() {
    let f = fixture();
    let parked_props = props(&[
        ("retry-to", long_string("orders")),
        ("retry-attempt", FieldValue::LongLongInt(3)),
        ("retry-tier", long_string("1s")),
        ("retry-history", long_string("1:200ms:5,2:500ms:6,3:1s:7")),
    ]);
    let replayed = replay_properties(&parked_props, &[(header::RETRY_REPLAYED_FROM, long_string("s@1"))]);
    assert_eq!(
        header(&replayed, "retry-history"),
        Some(&long_string("1:200ms:5,2:500ms:6,3:1s:7"))
    );
    assert_eq!(header(&replayed, "retry-attempt"), None);
    let out = forward(f.ctx().intake(&replayed, NOW));
    assert_eq!(
        history_header(&out.properties),
        [
            entry(1, "200ms", 5),
            entry(2, "500ms", 6),
            entry(3, "1s", 7),
            entry(1, "200ms", NOW)
        ]
    );
}

#[test]
fn a_deferred_message_waits_again_without_an_attempt_and_longer_for_each_refusal() {
    let f = fixture();
    let mut props = props(&[
        ("retry-to", long_string("orders")),
        ("retry-attempt", FieldValue::LongLongInt(2)),
        ("retry-tier", long_string("500ms")),
        ("x-death", FieldValue::FieldArray(vec![death("ns.default.delay.500ms")])),
    ]);
    let mut tiers = vec![];
    for n in 1..=4 {
        let out = f.ctx().defer(&props, DeferReason::Refused, NOW);
        assert_eq!(out.exchange, "");
        assert_eq!((out.attempt, out.destination.as_str()), (2, "orders"));
        assert_eq!(
            header(&out.properties, "retry-attempt"),
            Some(&FieldValue::LongLongInt(2))
        );
        assert_eq!(
            header(&out.properties, "retry-deferrals"),
            Some(&FieldValue::LongLongInt(n))
        );
        assert_eq!(header(&out.properties, "x-death"), None);
        let tier = f
            .spec
            .tiers
            .iter()
            .find(|t| t.name == out.kind.tier().unwrap())
            .unwrap();
        assert_eq!(
            header(&out.properties, "retry-due-at"),
            Some(&FieldValue::LongLongInt((NOW + tier.ttl_ms()) as i64))
        );
        tiers.push(out.kind.tier().unwrap().to_string());
        props = out.properties;
    }
    assert_eq!(tiers, ["200ms", "500ms", "1s", "1s"]);
    // busy: always the shortest tier
    let out = f.ctx().defer(&props, DeferReason::Busy, NOW);
    assert_eq!(out.kind.tier().unwrap(), "200ms");
    // the next failure is a new attempt: the deferrals start again
    let next = forward(f.ctx().intake(&props, NOW));
    assert_eq!(header(&next.properties, "retry-deferrals"), None);
    assert_eq!(
        header(&next.properties, "retry-attempt"),
        Some(&FieldValue::LongLongInt(3))
    );
}

#[test]
fn encoded_size_matches_the_wire_format() {
    let mut t = FieldTable::default();
    t.set("a", long_string("xyz")); // 1+1 key, 1 type, 4+3
    t.set("b", FieldValue::FieldArray(vec![FieldValue::Boolean(true)])); // 2, 1, 4+(1+1)
    assert_eq!(encoded_table_size(&t, 0), Ok(4 + (2 + 1 + 7) + (2 + 1 + 6)));
}

mod history {
    use proptest::prelude::*;

    use super::*;

    fn entry() -> impl Strategy<Value = String> {
        // canonical entries, and the odd ones a sender may write (spaces, zeros, junk)
        prop_oneof![
            (0u64..100, "[0-9]{1,3}(ms|s|m|h)", 0u64..u64::MAX).prop_map(|(a, t, f)| format!("{a}:{t}:{f}")),
            "[ 0-9a-z:]{0,12}",
            Just("01:1s:5".to_string()),
            Just(" 1:1s:5".to_string()),
            Just("1:1s:99999999999999999999".to_string()),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1024, failure_persistence: None, ..ProptestConfig::default() })]

        /// Appending as text gives exactly what reading the history and writing it anew gives.
        #[test]
        fn appending_is_reading_and_writing_anew(
            entries in proptest::collection::vec(entry(), 0..20),
            as_text_value in any::<bool>(),
            attempt in 0u64..1000,
            failed_at in any::<u64>(),
        ) {
            let text = entries.join(",");
            let previous = if as_text_value {
                Some(FieldValue::LongString(LongString::from(text.as_str())))
            } else if entries.is_empty() {
                None
            } else {
                Some(FieldValue::LongLongInt(7))
            };
            let mut expected = previous.as_ref().map_or_else(Vec::new, parse_history);
            expected.push(HistoryEntry { attempt, tier: "10s".into(), failed_at_ms: failed_at });
            prop_assert_eq!(
                appended_history(previous.as_ref(), attempt, "10s", failed_at),
                format_history(&expected)
            );
        }
    }
}

mod properties {
    use proptest::prelude::*;

    use super::*;
    use crate::model::envelope::testing;

    /// What no republish may carry: a header the broker owns or that routes copies
    /// ([`is_stripped`]), `expiration` (tier queues set the delay) or `user_id` (the broker
    /// would close the channel).
    fn clean(props: &BasicProperties) -> Result<(), TestCaseError> {
        prop_assert!(props.expiration.is_none(), "expiration {:?}", props.expiration);
        prop_assert!(props.user_id.is_none(), "user_id {:?}", props.user_id);
        for (key, _) in props.headers.iter().flat_map(FieldTable::iter) {
            prop_assert!(!is_stripped(key.as_bytes()), "{:?} kept", key);
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

        /// Any properties — headers of every type nested up to 4 levels, the protocol's own
        /// headers with any values, short strings of any bytes — get a decision on both hops
        /// without a panic; every forward, and every replay, carries nothing stripped.
        #[test]
        fn any_delivery_gets_a_decision_and_a_forward_carries_nothing_stripped(
            props in testing::properties_with(testing::protocol_table()),
            now_ms in prop_oneof![Just(NOW), any::<u64>()],
        ) {
            let f = fixture();
            let ctx = f.ctx();
            // what a forward writes itself is never also carried over: no header twice
            for decision in [ctx.intake_at(&props, &Arrival::at(now_ms)), ctx.due_at(&props, &Arrival::at(now_ms))] {
                if let Decision::Forward(forward) = decision
                    && let Some(carry) = forward.carry
                {
                    for (key, _) in forward.properties.headers.iter().flat_map(FieldTable::iter) {
                        prop_assert!(!carry.keeps(key.as_bytes()), "{key:?} written and carried");
                    }
                }
            }
            if let Decision::Forward(tiered) = ctx.intake(&props, now_ms) {
                clean(&tiered.properties)?;
                // the tier's dead-lettering brings it back to the due hop
                if let Decision::Forward(delivered) = ctx.due(&tiered.properties, now_ms) {
                    clean(&delivered.properties)?;
                }
            }
            if let Decision::Forward(delivered) = ctx.due(&props, now_ms) {
                clean(&delivered.properties)?;
            }
            clean(&replay_properties(&props, &[(header::RETRY_REPLAYED_FROM, long_string("s@1"))]))?;
        }
    }
}

#[test]
fn a_returned_first_failure_is_parked_with_when_it_first_failed() {
    let f = fixture();
    let received = props(&[("retry-to", long_string("orders"))]);
    let out = forward(f.ctx().intake(&received, NOW));
    let park = no_route(Hop::Intake, &received, &out, 312, "NO_ROUTE");
    assert_eq!(park.reason, ParkReason::NoRoute);
    assert_eq!(
        park.first_failed_at_ms,
        Some(NOW),
        "the forward's, not the missing header"
    );
    assert_eq!(park.attempts, Some(0), "no retry was made");
    assert_eq!(park.destination.as_deref(), Some("orders"));
    assert!(
        park.detail.contains("312 NO_ROUTE") && park.detail.contains("ns.delay.200ms"),
        "{}",
        park.detail
    );
    // a later one keeps the first failure it carried
    let later = props(&[
        ("retry-to", long_string("orders")),
        ("retry-attempt", FieldValue::LongLongInt(1)),
        ("retry-first-failed-at", FieldValue::LongLongInt((NOW - 5_000) as i64)),
    ]);
    let out = forward(f.ctx().intake(&later, NOW));
    let park = no_route(Hop::Intake, &later, &out, 312, "NO_ROUTE");
    assert_eq!((park.first_failed_at_ms, park.attempts), (Some(NOW - 5_000), Some(1)));
}

/// An `x-death` entry the broker writes when a message expires from `queue`.
fn expired(queue: &str) -> FieldValue {
    let mut entry = FieldTable::default();
    entry.set("queue", long_string(queue));
    entry.set("reason", long_string("expired"));
    entry.set("count", FieldValue::LongLongInt(1));
    FieldValue::FieldTable(entry)
}

/// `delivered` as it comes back to the due hop after its consumer rejected it and the broker
/// routed it by its `retry-next` into `tier`, whose TTL then expired.
fn rejected_into(delivered: &BasicProperties, tier: &str) -> BasicProperties {
    let mut back = delivered.clone();
    let headers = back.headers.get_or_insert_with(FieldTable::default);
    headers.set("x-death", FieldValue::FieldArray(vec![expired(tier), death("orders")]));
    back
}

#[test]
fn a_repeat_failure_routed_past_the_intake_is_taken_in_at_the_due_hop() {
    let f = fixture();
    let input = props(&[("retry-to", long_string("orders"))]);
    let first = forward(f.ctx().intake(&input, NOW));
    let delivered = forward(f.ctx().due(&first.properties, NOW + 200));
    assert_eq!((delivered.kind, delivered.attempt), (ForwardKind::Deliver, 1));
    // where its next failure waits: the second step
    assert_eq!(header(&delivered.properties, "retry-next"), Some(&long_string("500ms")));

    // the consumer rejects it at NOW + 210; the broker routes it into the 500 ms tier
    let back = rejected_into(&delivered.properties, "ns.default.delay.500ms");
    assert_eq!(
        f.ctx().routed_failure(&back, b"").map(|r| (r.waited_ms, r.skip)),
        Some((500, 1))
    );
    let out = forward(f.ctx().due(&back, NOW + 710 + 2));
    assert_eq!(out.counted, Counted::Here, "taken in here");
    assert_eq!(
        (out.kind, &*out.exchange, &*out.routing_key),
        (ForwardKind::Deliver, "", "orders")
    );
    assert_eq!(out.attempt, 2);
    assert_eq!(out.late_ms, 0, "the wait it had is its delay");
    let p = &out.properties;
    assert_eq!(header(p, "retry-attempt"), Some(&FieldValue::LongLongInt(2)));
    assert_eq!(header(p, "retry-next"), Some(&long_string("1s")));
    assert_eq!(
        header(p, "retry-first-failed-at"),
        Some(&FieldValue::LongLongInt(NOW as i64))
    );
    assert!(header(p, "x-death").is_none(), "the broker's annotations are stripped");
    let history = parse_history(header(p, "retry-history").unwrap());
    assert_eq!(
        history.iter().map(|e| (e.attempt, e.tier.as_str())).collect::<Vec<_>>(),
        [(1, "200ms"), (2, "500ms")]
    );
    assert_eq!(
        history[1].failed_at_ms,
        NOW + 212,
        "failed a tier's TTL before it came due"
    );

    // the last retry: the next failure goes to the intake, which parks it at once
    let back = rejected_into(p, "ns.default.delay.1s");
    let third = forward(f.ctx().due(&back, NOW + 2_000));
    assert_eq!(third.attempt, 3);
    assert_eq!(header(&third.properties, "retry-next"), Some(&long_string("intake")));
    let exhausted = parked(f.ctx().intake(&third.properties, NOW + 2_100));
    assert_eq!(exhausted.reason, ParkReason::MaxAttempts);
}

#[test]
fn a_forged_route_gets_every_check_a_first_failure_gets() {
    let f = fixture();
    let forged = |extra: &[(&str, FieldValue)]| {
        let mut headers = vec![
            ("retry-next", long_string("200ms")),
            ("retry-ladder", long_string("default")),
            (
                "x-death",
                FieldValue::FieldArray(vec![expired("ns.default.delay.200ms")]),
            ),
        ];
        headers.extend(extra.iter().cloned());
        props(&headers)
    };
    // a destination outside the allow-list
    let p = parked(f.ctx().due(&forged(&[("retry-to", long_string("payroll"))]), NOW));
    assert_eq!(p.reason, ParkReason::DestinationNotAllowed);
    // an attempt count past the ladder
    let p = parked(f.ctx().due(
        &forged(&[
            ("retry-to", long_string("orders")),
            ("retry-attempt", FieldValue::LongLongInt(3)),
        ]),
        NOW,
    ));
    assert_eq!(p.reason, ParkReason::MaxAttempts);
    // a header of the wrong type
    let p = parked(f.ctx().due(
        &forged(&[("retry-to", long_string("orders")), ("retry-attempt", long_string("x"))]),
        NOW,
    ));
    assert_eq!(p.reason, ParkReason::InvalidHeader);
    // no destination at all
    assert_eq!(parked(f.ctx().due(&forged(&[]), NOW)).reason, ParkReason::NoDestination);
    // a sender the ladder does not list
    let mut listed = fixture();
    listed.spec = listed.spec.clone().with_senders(crate::model::ladder::Senders {
        grants: vec![("orders-svc".into(), regex::RegexSet::new(["^orders$"]).unwrap())],
        unidentified: crate::model::ladder::Unidentified::Reject,
    });
    let from_stranger = BasicProperties {
        user_id: s("stranger"),
        ..forged(&[("retry-to", long_string("orders"))])
    };
    assert_eq!(
        parked(listed.ctx().due(&from_stranger, NOW)).reason,
        ParkReason::SenderNotAllowed
    );
    // routed into a tier shorter than its retry's delay: it waits for the rest, never early
    let short = forward(f.ctx().due(
        &forged(&[
            ("retry-to", long_string("orders")),
            ("retry-attempt", FieldValue::LongLongInt(1)),
        ]),
        NOW,
    ));
    assert_eq!((short.kind.tier(), short.due_at_ms), (Some("level-256ms"), NOW + 300));
    assert_eq!(short.counted, Counted::Here);
    assert!(
        header(&short.full_properties(&forged(&[])), "retry-next").is_none(),
        "a wait the service schedules never carries retry-next"
    );
}

#[test]
fn a_wait_the_service_schedules_never_carries_retry_next() {
    let f = fixture();
    let input = props(&[("retry-to", long_string("orders")), ("retry-next", long_string("1s"))]);
    let out = f.ctx().intake(&input, NOW);
    assert!(header(&forward(out).properties, "retry-next").is_none());
    let deferred = f.ctx().defer(&input, DeferReason::Busy, NOW);
    assert!(header(&deferred.properties, "retry-next").is_none());
    // what is not a routed failure: a wait the service scheduled, coming out of its tier
    let leg = BasicProperties {
        headers: Some({
            let mut h = input.headers.clone().unwrap();
            h.remove("retry-next");
            h.set("x-death", FieldValue::FieldArray(vec![expired("ns.default.delay.1s")]));
            h
        }),
        ..Default::default()
    };
    assert_eq!(f.ctx().routed_failure(&leg, b""), None);
}

#[test]
fn a_retry_delay_beyond_the_longest_delay_is_refused_at_once() {
    let f = fixture();
    for value in [long_string("1y"), FieldValue::LongLongInt(i64::MAX)] {
        let p = parked(f.ctx().intake(
            &props(&[("retry-to", long_string("orders")), ("retry-delay", value)]),
            NOW,
        ));
        assert_eq!(p.reason, ParkReason::InvalidHeader);
        assert!(
            p.detail.contains("beyond the longest delay (4233600000 ms"),
            "{}",
            p.detail
        );
    }
}

#[test]
fn a_routed_failure_asking_a_longer_delay_waits_the_rest_never_less() {
    // without delay levels: the intake would wait the first step at least the requested delay
    // (1 s); the due hop, after the 200 ms tier, waits one step at least the rest (800 ms → 1 s)
    let mut f = fixture();
    f.spec.set_exact_delays(false);
    let back = props(&[
        ("retry-to", long_string("orders")),
        ("retry-attempt", FieldValue::LongLongInt(0)),
        ("retry-ladder", long_string("default")),
        ("retry-next", long_string("200ms")),
        ("retry-delay", FieldValue::LongInt(700)),
    ]);
    let out = forward(f.ctx().due(&back, NOW));
    assert_eq!(out.kind.tier(), Some("1s"));
    assert_eq!(
        out.due_at_ms,
        NOW - 200 + 1_000,
        "the intake's delay, counted from the failure"
    );
    // with levels: exactly the rest, composed
    let f = fixture();
    let out = forward(f.ctx().due(&back, NOW));
    assert_eq!((out.kind.tier().is_some(), out.due_at_ms), (true, NOW - 200 + 700));
    assert_eq!(
        out.kind.tier().unwrap(),
        "500ms",
        "the longest tier within the 500 ms left (a step)"
    );
}

#[test]
fn a_routed_failure_that_asks_for_a_scheduled_delivery_gets_the_intakes_schedule() {
    let f = fixture();
    let back = props(&[
        ("retry-to", long_string("orders")),
        ("retry-attempt", FieldValue::LongLongInt(1)),
        ("retry-ladder", long_string("default")),
        ("retry-next", long_string("500ms")),
        ("x-delay", FieldValue::LongInt(2_000)),
    ]);
    let out = forward(f.ctx().due(&back, NOW));
    assert_eq!(
        (out.kind.tier().is_some(), out.attempt),
        (true, 0),
        "no attempt: a scheduled delivery"
    );
    assert_eq!(
        out.due_at_ms,
        NOW - 500 + 2_000,
        "counted from when it was published back"
    );
    assert_eq!(out.exchange, "");
    assert_eq!(
        header(&out.properties, "retry-scheduled"),
        Some(&FieldValue::Boolean(true))
    );
}

#[test]
fn a_scheduled_wait_drops_retry_next_and_comes_due_as_a_delivery() {
    let f = fixture();
    // a delivered retry (it carries where its next failure waits) published back with a delay
    let back = props(&[
        ("retry-to", long_string("orders")),
        ("retry-attempt", FieldValue::LongLongInt(1)),
        ("retry-ladder", long_string("default")),
        ("retry-next", long_string("500ms")),
        ("x-delay", FieldValue::LongInt(2_000)),
    ]);
    let wait = forward(f.ctx().intake(&back, NOW));
    assert_eq!(
        (wait.kind.tier().is_some(), wait.attempt),
        (true, 0),
        "a scheduled delivery"
    );
    assert_eq!(
        header(&wait.properties, "retry-next"),
        None,
        "the wait is no routed failure"
    );
    // the same at the due hop, for one routed there: its schedule carries no retry-next either
    let routed = forward(f.ctx().due(&back, NOW));
    assert_eq!(header(&routed.properties, "retry-next"), None);
    // so when the wait is over it is delivered as scheduled, not taken in as a failure again
    let due = forward(f.ctx().due(&wait.properties, wait.due_at_ms));
    assert_eq!(due.kind, ForwardKind::Deliver);
    assert_eq!(due.routing_key, "orders");
    assert_eq!(
        header(&due.properties, "retry-scheduled"),
        None,
        "delivered as it was published"
    );
}

#[test]
fn a_first_failure_that_waited_its_first_step_past_the_intake_is_taken_in_and_delivered() {
    let f = fixture();
    // an older ladder's first failure, as its N.L.wait.200ms dead-letters it into N.L.due
    let input = props(&[
        ("retry-to", long_string("orders")),
        ("retry-reason", long_string("timeout")),
    ]);
    let arrival = Arrival {
        routing_key: b"wait.200ms",
        ..Arrival::at(NOW + 205)
    };
    let routed = f
        .ctx()
        .routed_failure(&input, arrival.routing_key)
        .expect("a first failure");
    assert_eq!(
        (
            routed.waited_ms,
            routed.skip,
            routed.queue.as_deref(),
            routed.tier.as_str()
        ),
        (200, 0, Some("ns.default.wait.200ms"), "200ms")
    );
    let out = forward(f.ctx().due_at(&input, &arrival).materialized(&input));
    assert_eq!(out.counted, Counted::Here, "taken in here, as the intake would have");
    assert_eq!(
        (out.kind, &*out.exchange, &*out.routing_key, out.attempt),
        (ForwardKind::Deliver, "", "orders", 1)
    );
    let p = &out.properties;
    assert_eq!(header(p, "retry-attempt"), Some(&FieldValue::LongLongInt(1)));
    assert_eq!(header(p, "retry-next"), Some(&long_string("500ms")));
    assert_eq!(header(p, "retry-reason"), Some(&long_string("timeout")));
    assert_eq!(
        header(p, "retry-first-failed-at"),
        Some(&FieldValue::LongLongInt((NOW + 5) as i64)),
        "it failed its first step's TTL before it came due"
    );
    let history = parse_history(header(p, "retry-history").unwrap());
    assert_eq!(
        history.iter().map(|e| (e.attempt, e.tier.as_str())).collect::<Vec<_>>(),
        [(1, "200ms")]
    );

    // the same checks as at the intake: a destination outside the allow-list is parked
    let refused = props(&[("retry-to", long_string("payments"))]);
    let park = parked(f.ctx().due_at(&refused, &arrival));
    assert_eq!(park.reason, ParkReason::DestinationNotAllowed);
    // no destination at all
    let park = parked(f.ctx().due_at(&props(&[]), &arrival));
    assert_eq!(park.reason, ParkReason::NoDestination);

    // a wait the service scheduled comes due with a tier's name as its key: not a failure
    let scheduled = forward(f.ctx().intake(&input, NOW));
    let leg = Arrival {
        routing_key: b"200ms",
        ..Arrival::at(NOW + 205)
    };
    assert_eq!(f.ctx().routed_failure(&scheduled.properties, leg.routing_key), None);
    // and a repeat failure's retry-next decides over a key that looks like a first wait's
    let delivered = forward(f.ctx().due(&scheduled.properties, NOW + 205));
    let back = rejected_into(&delivered.properties, "ns.delay.500ms");
    let routed = f.ctx().routed_failure(&back, b"wait.200ms").unwrap();
    assert_eq!((routed.tier.as_str(), routed.waited_ms), ("500ms", 500));
}

#[test]
fn a_dead_lettered_first_wait_skips_its_own_death_entry() {
    let f = fixture();
    // forged into the wait with an x-death: the wait's own
    // entry is skipped, so the destination is the queue it failed in
    let mut input = props(&[]);
    input.headers.as_mut().unwrap().set(
        "x-death",
        FieldValue::FieldArray(vec![expired("ns.default.wait.200ms"), death("orders")]),
    );
    let routed = f.ctx().routed_failure(&input, b"wait.200ms").unwrap();
    assert_eq!(routed.skip, 1);
    let arrival = Arrival {
        routing_key: b"wait.200ms",
        ..Arrival::at(NOW + 200)
    };
    let out = forward(f.ctx().due_at(&input, &arrival));
    assert_eq!((&*out.routing_key, out.attempt), ("orders", 1));
}
