//! Test support for the pure modules, in one place: proptest strategies for AMQP values and
//! properties (bytes that are not UTF-8, duplicate keys, every type, every float bit pattern),
//! for stored envelopes holding any JSON at all, and for parked entries; and envelopes with the
//! odd values operators' views must render (times after the year 9999, control characters, a
//! header nested tens of thousands of levels deep).

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use ladder_amqp::{BasicProperties, Decimal, FieldTable, FieldValue, LongString, ShortString};
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::{Map, Value, json};

use super::{Envelope, FORMAT, OriginalMessage, properties_to_json};
use crate::model::lot::record::{Action, ParkedEntry, RESOLUTION_FORMAT, Resolution};
use crate::model::protocol::HistoryEntry;

/// Text as operators meet it: plain names, any Unicode, control characters and bidirectional
/// overrides, now and then long.
pub(crate) fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z0-9.@-]{0,12}",
        2 => "[\\x00-\\x1f\\x7f-\\u{9f}a-z \\u{202e}\\u{2066}é€😀\\\\\"<>&]{0,16}",
        2 => any::<String>(),
        1 => (1usize..3000).prop_map(|n| "long ".repeat(n)),
    ]
}

/// Bytes for a short string: text, or any bytes up to the 255 a short string holds.
pub(crate) fn short_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => text().prop_map(|t| t.into_bytes().into_iter().take(255).collect()),
        2 => vec(any::<u8>(), 0..=24),
        1 => vec(any::<u8>(), 250..=255),
    ]
}

/// A short string of [`short_bytes`].
pub(crate) fn short_string() -> impl Strategy<Value = ShortString> {
    short_bytes().prop_map(|b| ShortString::new(b).expect("at most 255 bytes"))
}

/// Header names the protocol reads, strips or writes, and one of nobody's.
const PROTOCOL_KEYS: [&str; 19] = [
    "retry-to",
    "retry-attempt",
    "retry-delay",
    "retry-reason",
    "retry-first-failed-at",
    "retry-history",
    "retry-replayed-from",
    "retry-tier",
    "retry-due-at",
    "retry-ladder",
    "retry-original-user-id",
    "x-death",
    "CC",
    "BCC",
    "x-delivery-count",
    "x-acquired-count",
    "x-first-death-queue",
    "x-last-death-reason",
    "tenant",
];

/// A table key: one of a few names (so that keys repeat), or any short string.
pub(crate) fn table_key() -> impl Strategy<Value = ShortString> {
    prop_oneof![
        2 => select(&PROTOCOL_KEYS[..]).prop_map(|k| ShortString::try_from(k).expect("short")),
        1 => select(&["a", "b", "\u{0}", ""][..]).prop_map(|k| ShortString::try_from(k).expect("short")),
        2 => short_string(),
    ]
}

/// A float of any bit pattern (NaNs with any payload and sign, infinities, subnormals, -0).
fn any_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<u64>().prop_map(f64::from_bits),
        select(
            &[
                f64::NAN,
                -f64::NAN,
                f64::INFINITY,
                f64::NEG_INFINITY,
                -0.0,
                f64::MIN_POSITIVE / 2.0
            ][..]
        ),
        any::<f64>(),
    ]
}

fn any_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        any::<u32>().prop_map(f32::from_bits),
        select(&[f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0][..]),
        any::<f32>(),
    ]
}

/// A scalar AMQP value of any type.
pub(crate) fn scalar_value() -> impl Strategy<Value = FieldValue> {
    prop_oneof![
        any::<bool>().prop_map(FieldValue::Boolean),
        any::<i8>().prop_map(FieldValue::ShortShortInt),
        any::<u8>().prop_map(FieldValue::ShortShortUInt),
        any::<i16>().prop_map(FieldValue::ShortInt),
        any::<u16>().prop_map(FieldValue::ShortUInt),
        any::<i32>().prop_map(FieldValue::LongInt),
        any::<u32>().prop_map(FieldValue::LongUInt),
        any::<i64>().prop_map(FieldValue::LongLongInt),
        any_f32().prop_map(FieldValue::Float),
        any_f64().prop_map(FieldValue::Double),
        (any::<u8>(), any::<u32>()).prop_map(|(scale, value)| FieldValue::Decimal(Decimal { scale, value })),
        text().prop_map(|t| FieldValue::LongString(LongString::from(t))),
        vec(any::<u8>(), 0..32).prop_map(|b| FieldValue::LongString(LongString::from(b))),
        any::<u64>().prop_map(FieldValue::Timestamp),
        Just(FieldValue::Void),
        vec(any::<u8>(), 0..32).prop_map(FieldValue::ByteArray),
    ]
}

/// Any AMQP value: scalars, and arrays and tables of them nested up to 4 levels, at most 48
/// values in all.
pub(crate) fn field_value() -> BoxedStrategy<FieldValue> {
    scalar_value()
        .prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                vec(inner.clone(), 0..6).prop_map(FieldValue::FieldArray),
                vec((table_key(), inner), 0..6)
                    .prop_map(|entries| FieldValue::FieldTable(entries.into_iter().collect())),
            ]
        })
        .boxed()
}

/// A header table: any keys (repeated, not UTF-8), any values.
pub(crate) fn field_table() -> BoxedStrategy<FieldTable> {
    vec((table_key(), field_value()), 0..10)
        .prop_map(|entries| entries.into_iter().collect())
        .boxed()
}

/// A header value as the protocol meets it: anything, or a value it could act on.
fn protocol_value() -> impl Strategy<Value = FieldValue> {
    let queue = select(&["orders", "billing.eu", "ns.default.due", "amq.q", "", "x y", "1s", "10"][..]);
    let death = (
        queue.clone(),
        select(&["rejected", "expired", "maxlen"][..]),
        any::<i64>(),
    )
        .prop_map(|(q, r, n)| {
            let mut t = FieldTable::new();
            t.set("queue", FieldValue::string(q));
            t.set("reason", FieldValue::string(r));
            t.set("count", FieldValue::LongLongInt(n));
            FieldValue::FieldTable(t)
        });
    prop_oneof![
        3 => field_value(),
        2 => queue.prop_map(FieldValue::string),
        1 => select(&["1:1s:5,2:10s:6", "1s", "250ms", "-5", "1:x:2"][..]).prop_map(FieldValue::string),
        2 => (0i64..6).prop_map(FieldValue::LongLongInt),
        1 => any::<i64>().prop_map(FieldValue::LongLongInt),
        1 => vec(death, 0..3).prop_map(FieldValue::FieldArray),
    ]
}

/// A header table biased towards the headers the protocol reads and strips; most lead with a
/// destination the test ladder allows (`orders`, `billing.…`) and a small attempt count, so
/// that the hops forward them as often as they park them.
pub(crate) fn protocol_table() -> BoxedStrategy<FieldTable> {
    let lead = option::weighted(0.8, (select(&["orders", "billing.eu"][..]), option::of(0i64..4)));
    (lead, vec((table_key(), protocol_value()), 0..8))
        .prop_map(|(lead, rest)| {
            let mut entries = Vec::with_capacity(rest.len() + 2);
            if let Some((queue, attempt)) = lead {
                entries.push((
                    ShortString::try_from("retry-to").expect("short"),
                    FieldValue::string(queue),
                ));
                if let Some(n) = attempt {
                    let key = ShortString::try_from("retry-attempt").expect("short");
                    entries.push((key, FieldValue::LongLongInt(n)));
                }
            }
            entries.extend(rest);
            entries.into_iter().collect()
        })
        .boxed()
}

/// Properties with any of the fourteen set, short strings of any bytes, headers from `headers`.
pub(crate) fn properties_with(headers: impl Strategy<Value = FieldTable> + 'static) -> BoxedStrategy<BasicProperties> {
    (
        proptest::array::uniform10(option::weighted(0.3, short_string())),
        option::of(any::<u8>()),
        option::of(any::<u8>()),
        option::of(any::<u64>()),
        option::weighted(0.8, headers),
    )
        .prop_map(|(strings, delivery_mode, priority, timestamp, headers)| {
            let [
                content_type,
                content_encoding,
                correlation_id,
                reply_to,
                expiration,
                message_id,
                kind,
                user_id,
                app_id,
                cluster_id,
            ] = strings;
            BasicProperties {
                content_type,
                content_encoding,
                headers,
                delivery_mode,
                priority,
                correlation_id,
                reply_to,
                expiration,
                message_id,
                timestamp,
                kind,
                user_id,
                app_id,
                cluster_id,
            }
        })
        .boxed()
}

/// Properties of [`properties_with`] any [`field_table`].
pub(crate) fn properties() -> BoxedStrategy<BasicProperties> {
    properties_with(field_table()).boxed()
}

/// Any JSON: numbers of every range, strings of [`text`], `{"base64": …}` forms, nested.
pub(crate) fn json_value() -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any_f64().prop_map(Value::from),
        text().prop_map(Value::String),
        short_bytes().prop_map(|b| json!({ "base64": B64.encode(b) })),
        Just(json!({ "base64": "not base64!" })),
    ];
    leaf.prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..5).prop_map(Value::Array),
            vec((text(), inner), 0..5).prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
    .boxed()
}

const TYPE_NAMES: [&str; 20] = [
    "boolean",
    "short-short-int",
    "short-short-uint",
    "short-int",
    "short-uint",
    "long-int",
    "long-uint",
    "long-long-int",
    "float",
    "double",
    "decimal",
    "short-string",
    "long-string",
    "field-array",
    "timestamp",
    "field-table",
    "byte-array",
    "void",
    "what",
    "",
];

/// A stored header table in any shape: typed values of the right type or not, the object form,
/// the pair form with any keys, or any JSON at all.
pub(crate) fn stored_headers() -> BoxedStrategy<Value> {
    let type_name = prop_oneof![select(&TYPE_NAMES[..]).prop_map(Value::from), json_value()];
    let typed = prop_oneof![
        3 => (type_name.clone(), json_value()).prop_map(|(t, v)| json!({ "type": t, "value": v })),
        1 => (type_name, json_value()).prop_map(|(t, b)| json!({ "type": t, "base64": b })),
        1 => json_value(),
    ];
    prop_oneof![
        2 => vec((text(), typed.clone()), 0..6).prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        2 => vec((json_value(), typed), 0..6)
            .prop_map(|kv| Value::Array(kv.into_iter().map(|(k, v)| json!([k, v])).collect())),
        1 => json_value(),
    ]
    .boxed()
}

/// Stored properties: captured from real properties, any JSON object (with headers in any
/// shape), any JSON, or bytes that did not decode.
pub(crate) fn stored_properties() -> BoxedStrategy<Value> {
    let key = prop_oneof![
        select(
            &[
                "content_type",
                "message_id",
                "correlation_id",
                "priority",
                "timestamp",
                "headers"
            ][..]
        )
        .prop_map(String::from),
        text(),
    ];
    prop_oneof![
        3 => properties().prop_map(|p| properties_to_json(&p)),
        3 => (vec((key, json_value()), 0..6), option::of(stored_headers())).prop_map(|(kv, headers)| {
            let mut map: Map<String, Value> = kv.into_iter().collect();
            if let Some(headers) = headers {
                map.insert("headers".into(), headers);
            }
            Value::Object(map)
        }),
        1 => json_value(),
        1 => vec(any::<u8>(), 0..16).prop_map(|b| json!({ "raw_base64": B64.encode(b), "undecodable": "too deep" })),
    ]
    .boxed()
}

/// A time in ms since the epoch: recent, any, or at the edges RFC 3339 can show.
pub(crate) fn time_ms() -> impl Strategy<Value = u64> {
    prop_oneof![
        1_600_000_000_000u64..1_900_000_000_000,
        any::<u64>(),
        select(&[0, 253_402_300_799_999, 253_402_300_800_000, u64::MAX][..]),
    ]
}

fn history_entry() -> impl Strategy<Value = HistoryEntry> {
    (any::<u64>(), text(), time_ms()).prop_map(|(attempt, tier, failed_at_ms)| HistoryEntry {
        attempt,
        tier,
        failed_at_ms,
    })
}

/// A stored message: any exchange and routing key bytes, [`stored_properties`], a body in
/// base64 or anything else.
pub(crate) fn stored_message() -> BoxedStrategy<OriginalMessage> {
    let body = prop_oneof![
        vec(any::<u8>(), 0..64).prop_map(|b| B64.encode(b)),
        text().prop_map(|t| B64.encode(t)),
        text(),
    ];
    (short_bytes(), short_bytes(), stored_properties(), body)
        .prop_map(|(exchange, routing_key, properties, body)| OriginalMessage {
            properties,
            body_base64: body,
            ..OriginalMessage::capture(exchange, routing_key, &BasicProperties::default(), b"")
        })
        .boxed()
}

/// An envelope holding anything a record can: any text, any numbers for times and attempts,
/// [`stored_message`].
pub(crate) fn envelope() -> BoxedStrategy<Envelope> {
    (
        (text(), text(), text(), option::of(text()), text()),
        (
            option::of(any::<u64>()),
            option::of(time_ms()),
            time_ms(),
            vec(history_entry(), 0..4),
            option::of(text()),
        ),
        stored_message(),
    )
        .prop_map(
            |(
                (reason, detail, ladder, destination, hop),
                (attempts, first_failed_at_ms, parked_at_ms, history, replayed_from),
                message,
            )| {
                Envelope {
                    format: FORMAT.into(),
                    reason,
                    detail,
                    ladder,
                    destination,
                    attempts,
                    first_failed_at_ms,
                    history,
                    replayed_from,
                    parked_at_ms,
                    hop,
                    message,
                }
            },
        )
        .boxed()
}

/// A resolution of any entry, by anyone, at any time.
pub(crate) fn resolution() -> impl Strategy<Value = Resolution> {
    (any::<u64>(), any::<bool>(), text(), time_ms(), option::of(text())).prop_map(
        |(resolves, replayed, by, at_ms, to)| Resolution {
            format: RESOLUTION_FORMAT.into(),
            resolves,
            action: if replayed { Action::Replayed } else { Action::Discarded },
            by,
            at_ms,
            to,
            edit: None,
        },
    )
}

/// A parked entry of [`envelope`], resolved or not.
pub(crate) fn parked_entry() -> BoxedStrategy<ParkedEntry> {
    (any::<u64>(), envelope(), option::of(resolution()))
        .prop_map(|(offset, envelope, resolution)| ParkedEntry {
            offset,
            envelope,
            resolution,
            body_apart: None,
        })
        .boxed()
}

/// Times a record may carry that RFC 3339 cannot show: the year 10000 and beyond, `u64::MAX`.
pub(crate) const OUT_OF_RANGE_TIMES: [u64; 3] = [253_402_300_800_000, 300_000_000_000_000, u64::MAX];

/// A plain envelope for the tests to change: `max-attempts` to `orders`, parked at `parked_at_ms`.
pub(crate) fn plain_envelope(parked_at_ms: u64, props: &BasicProperties, body: &[u8]) -> Envelope {
    Envelope {
        format: FORMAT.into(),
        reason: "max-attempts".into(),
        detail: "d".into(),
        ladder: "default".into(),
        destination: Some("orders".into()),
        attempts: Some(3),
        first_failed_at_ms: Some(1),
        history: Vec::new(),
        replayed_from: None,
        parked_at_ms,
        hop: "intake".into(),
        message: OriginalMessage::capture("ns.default", "", props, body),
    }
}

/// An entry whose every time (first failure, history, parked, resolved) is `ms`.
pub(crate) fn entry_at(ms: u64) -> ParkedEntry {
    let mut e = plain_envelope(ms, &BasicProperties::default(), b"x");
    e.first_failed_at_ms = Some(ms);
    e.history = vec![HistoryEntry {
        attempt: 1,
        tier: "1s".into(),
        failed_at_ms: ms,
    }];
    ParkedEntry {
        offset: 4,
        body_apart: None,
        envelope: e,
        resolution: Some(Resolution {
            format: RESOLUTION_FORMAT.into(),
            resolves: 4,
            action: Action::Replayed,
            by: "ops".into(),
            at_ms: ms,
            to: Some("orders".into()),
            edit: None,
        }),
    }
}

/// A string longer than any line of a terminal or a page.
pub(crate) const LONG: usize = 100_000;

/// An entry with odd values everywhere: ids that are not UTF-8 or hold control characters and
/// bidirectional overrides, keys that are not UTF-8 and repeat, non-finite floats, the extremes
/// of every integer, a [`LONG`] string, properties beyond their AMQP ranges, `{"base64": …}`
/// forms that do and do not decode, a body with an escape sequence.
pub(crate) fn odd_entry() -> ParkedEntry {
    let key = |k: &[u8]| ShortString::new(k).expect("short");
    // a key that is not UTF-8 and one that repeats: the table is stored as [key, value] pairs
    let table: FieldTable = [
        (key(b"k\xfe\x00"), FieldValue::Double(f64::NAN)),
        (key(b"k"), FieldValue::Float(f32::INFINITY)),
        (key(b"k"), FieldValue::Double(f64::NEG_INFINITY)),
        (
            key("\u{1b}]0;title\u{7}".as_bytes()),
            FieldValue::LongString("a\nb\u{1b}[31m\u{9b}".into()),
        ),
        (key(b"max"), FieldValue::LongLongInt(i64::MIN)),
        (key(b"long"), FieldValue::LongString("x".repeat(LONG).into())),
        (key(b"bin"), FieldValue::LongString(vec![0xff, 0, 0x1b].into())),
    ]
    .into_iter()
    .collect();
    let props = BasicProperties {
        message_id: Some(ShortString::new(&b"id-\xff\x1b[2J"[..]).unwrap()),
        correlation_id: Some(ShortString::try_from("c\u{7}\u{202e}1").unwrap()),
        headers: Some(table),
        ..BasicProperties::default()
    };
    let mut e = plain_envelope(0, &props, b"\x1b[2Jbody");
    e.reason = "max-attempts\u{1b}[2J".into();
    e.destination = Some("or\nders".into());
    e.detail = "line one\nline two\r\u{0}\u{9b}".into();
    e.ladder = "l\u{1b}".into();
    e.hop = "du\u{7}e".into();
    e.attempts = Some(u64::MAX);
    e.replayed_from = Some("s@1\u{1b}".into());
    e.history = vec![HistoryEntry {
        attempt: u64::MAX,
        tier: "t\u{1b}".into(),
        failed_at_ms: 0,
    }];
    let stored = e.message.properties.as_object_mut().expect("an object");
    stored.insert("priority".into(), json!(1e300));
    stored.insert("timestamp".into(), json!(u64::MAX));
    stored.insert("delivery_mode".into(), json!(-12_345_678_901_234_i64));
    stored.insert("\u{1b}[2Jkey".into(), json!({"base64": "G1sySg=="}));
    stored.insert("app_id".into(), json!({"base64": "not base64!"}));
    ParkedEntry {
        offset: u64::MAX,
        body_apart: None,
        envelope: e,
        resolution: Some(Resolution {
            format: RESOLUTION_FORMAT.into(),
            resolves: u64::MAX,
            action: Action::Discarded,
            by: "o\u{1b}ps".into(),
            at_ms: 0,
            to: None,
            edit: None,
        }),
    }
}

/// How deep [`deep_record`] nests its header: as deep as records written by versions that read
/// any nesting hold (more than a 128 KiB frame allows), far beyond what a 8 MiB stack renders.
pub(crate) const DEEP_LEVELS: usize = 24_000;

/// The JSON text of a `ladder.parked/v1` record (to `destination`, message id `deep`, parked
/// now-ish) whose header `deep` is a field array nested `levels` deep around a long string.
/// Built as text: a value this deep cannot even be built or dropped on a small stack.
pub(crate) fn deep_record(levels: usize, destination: &str) -> Vec<u8> {
    let mut header = String::with_capacity(levels * 40 + 64);
    for _ in 0..levels {
        header.push_str(r#"{"type":"field-array","value":["#);
    }
    header.push_str(r#"{"type":"long-string","value":"bottom"}"#);
    for _ in 0..levels {
        header.push_str("]}");
    }
    format!(
        r#"{{"format":"{FORMAT}","reason":"invalid-header","detail":"deep","ladder":"default","destination":{},"attempts":null,"first_failed_at_ms":null,"parked_at_ms":1763766071103,"hop":"intake","message":{{"exchange":"x","routing_key":"","properties":{{"message_id":"deep","headers":{{"deep":{header},"tenant":{{"type":"long-string","value":"acme"}}}}}},"body_base64":"{}"}}}}"#,
        Value::from(destination),
        B64.encode("deep body"),
    )
    .into_bytes()
}

/// A parked envelope for tests: `reason`, ladder `default`, 3 attempts, parked at
/// `parked_at_ms`, holding `props` and `body`.
pub(crate) fn parked_envelope(
    reason: &str,
    destination: Option<&str>,
    parked_at_ms: u64,
    props: BasicProperties,
    body: &[u8],
) -> Envelope {
    Envelope {
        format: FORMAT.into(),
        reason: reason.into(),
        detail: "d".into(),
        ladder: "default".into(),
        destination: destination.map(str::to_string),
        attempts: Some(3),
        first_failed_at_ms: Some(1),
        history: Vec::new(),
        replayed_from: None,
        parked_at_ms,
        hop: "intake".into(),
        message: crate::model::envelope::OriginalMessage::capture("ns.default", "", &props, body),
    }
}

/// A header table of `pairs`.
pub(crate) fn header_table(pairs: &[(&str, FieldValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.set(k, v.clone());
    }
    t
}
