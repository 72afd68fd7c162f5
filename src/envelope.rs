//! The parking-lot record: a JSON envelope that carries the whole original message — body,
//! every property, every header with its exact AMQP type — plus why and where it was parked.
//!
//! Why an envelope and not the record's own headers: RabbitMQ 3.10 streams fed over AMQP 0-9-1
//! drop nested tables and arrays and close the connection on a decimal (shared/DESIGN.md).
//! Inside the body, nothing is lost. Pure: no I/O. Format `ladder.parked/v1`, documented in
//! README.md; a field is only ever added, never renamed.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, ByteArray, DecimalValue, FieldArray, FieldTable, LongString, ShortString};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::protocol::HistoryEntry;

/// The format tag every envelope carries.
pub const FORMAT: &str = "ladder.parked/v1";

/// One parked message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Always [`FORMAT`].
    pub format: String,
    /// Reason code (`max-attempts`, `no-route`, …).
    pub reason: String,
    /// Human-readable explanation.
    pub detail: String,
    /// The ladder that parked it.
    pub ladder: String,
    /// The queue it was headed for, if known.
    pub destination: Option<String>,
    /// Retries made before it was parked, if known.
    pub attempts: Option<u64>,
    /// First failure, ms since the epoch, if known.
    pub first_failed_at_ms: Option<u64>,
    /// Each retry scheduled (attempt, tier, failure time), oldest first, from the message's
    /// `retry-history`; absent in records written before it existed, and when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<HistoryEntry>,
    /// The parked record (`<stream>@<offset>`) the message was replayed from, if it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replayed_from: Option<String>,
    /// When it was parked, ms since the epoch.
    pub parked_at_ms: u64,
    /// Where the service took it from: `intake` or `due`.
    pub hop: String,
    /// The message exactly as the service received it.
    pub message: OriginalMessage,
}

impl Envelope {
    /// Decodes a parked record's body, however deeply its headers nest.
    ///
    /// serde_json's default recursion limit (128) would refuse an envelope whose headers nest
    /// deeper than about 60 levels; such a message is still parked, so it must still be readable.
    /// Decoding (and dropping) such a value recurses once per level: call this on a thread with
    /// a large stack (the binary gives its runtime threads [`crate::DEEP_STACK_BYTES`]).
    pub fn from_slice(bytes: &[u8]) -> Result<Envelope, EnvelopeError> {
        let mut json = serde_json::Deserializer::from_slice(bytes);
        json.disable_recursion_limit();
        Envelope::deserialize(serde_stacker::Deserializer::new(&mut json)).map_err(|e| err(e.to_string()))
    }
}

/// A message as received: where it came from, its properties and its body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OriginalMessage {
    /// Exchange it was published to.
    pub exchange: String,
    /// Routing key it was published with.
    pub routing_key: String,
    /// Properties; `headers` is a table of typed values (see [`value_to_json`]).
    pub properties: Value,
    /// The body, base64.
    pub body_base64: String,
}

impl OriginalMessage {
    /// Captures a received message.
    pub fn capture(exchange: &str, routing_key: &str, props: &BasicProperties, body: &[u8]) -> Self {
        OriginalMessage {
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            properties: properties_to_json(props),
            body_base64: B64.encode(body),
        }
    }

    /// The original body.
    pub fn body(&self) -> Result<Vec<u8>, EnvelopeError> {
        B64.decode(&self.body_base64)
            .map_err(|e| EnvelopeError(format!("body_base64: {e}")))
    }

    /// The original properties, with every header in its original AMQP type.
    pub fn properties(&self) -> Result<BasicProperties, EnvelopeError> {
        properties_from_json(&self.properties)
    }
}

/// An envelope that does not decode.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid parked envelope: {0}")]
pub struct EnvelopeError(String);

fn err(message: impl Into<String>) -> EnvelopeError {
    EnvelopeError(message.into())
}

const STRING_PROPERTIES: [&str; 10] = [
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "type",
    "user_id",
    "app_id",
    "cluster_id",
];

fn string_property<'a>(props: &'a BasicProperties, name: &str) -> &'a Option<ShortString> {
    match name {
        "content_type" => props.content_type(),
        "content_encoding" => props.content_encoding(),
        "correlation_id" => props.correlation_id(),
        "reply_to" => props.reply_to(),
        "expiration" => props.expiration(),
        "message_id" => props.message_id(),
        "type" => props.kind(),
        "user_id" => props.user_id(),
        "app_id" => props.app_id(),
        _ => props.cluster_id(),
    }
}

fn with_string_property(props: BasicProperties, name: &str, value: ShortString) -> BasicProperties {
    match name {
        "content_type" => props.with_content_type(value),
        "content_encoding" => props.with_content_encoding(value),
        "correlation_id" => props.with_correlation_id(value),
        "reply_to" => props.with_reply_to(value),
        "expiration" => props.with_expiration(value),
        "message_id" => props.with_message_id(value),
        "type" => props.with_type(value),
        "user_id" => props.with_user_id(value),
        "app_id" => props.with_app_id(value),
        _ => props.with_cluster_id(value),
    }
}

/// Properties as a JSON object; absent properties are absent keys.
pub fn properties_to_json(props: &BasicProperties) -> Value {
    let mut out = Map::new();
    for name in STRING_PROPERTIES {
        if let Some(v) = string_property(props, name) {
            out.insert(name.into(), Value::String(v.to_string()));
        }
    }
    if let Some(v) = props.delivery_mode() {
        out.insert("delivery_mode".into(), json!(v));
    }
    if let Some(v) = props.priority() {
        out.insert("priority".into(), json!(v));
    }
    if let Some(v) = props.timestamp() {
        out.insert("timestamp".into(), json!(v));
    }
    if let Some(headers) = props.headers() {
        out.insert("headers".into(), table_to_json(headers));
    }
    Value::Object(out)
}

/// The inverse of [`properties_to_json`].
pub fn properties_from_json(value: &Value) -> Result<BasicProperties, EnvelopeError> {
    let object = value.as_object().ok_or_else(|| err("properties must be an object"))?;
    let mut props = BasicProperties::default();
    for (key, v) in object {
        props = match key.as_str() {
            "delivery_mode" => props.with_delivery_mode(small_uint(v, key)?),
            "priority" => props.with_priority(small_uint(v, key)?),
            "timestamp" => props.with_timestamp(v.as_u64().ok_or_else(|| err("timestamp must be an integer"))?),
            "headers" => props.with_headers(table_from_json(v)?),
            name if STRING_PROPERTIES.contains(&name) => {
                let text = v.as_str().ok_or_else(|| err(format!("{name} must be a string")))?;
                let short = ShortString::try_new(text).map_err(|e| err(format!("{name}: {e}")))?;
                with_string_property(props, name, short)
            }
            other => return Err(err(format!("unknown property {other:?}"))),
        };
    }
    Ok(props)
}

fn small_uint(v: &Value, key: &str) -> Result<u8, EnvelopeError> {
    v.as_u64()
        .and_then(|n| u8::try_from(n).ok())
        .ok_or_else(|| err(format!("{key} must be an integer 0..=255")))
}

/// A header table as a JSON object of typed values.
pub fn table_to_json(table: &FieldTable) -> Value {
    Value::Object(
        table
            .into_iter()
            .map(|(k, v)| (k.to_string(), value_to_json(v)))
            .collect(),
    )
}

/// The inverse of [`table_to_json`].
pub fn table_from_json(value: &Value) -> Result<FieldTable, EnvelopeError> {
    let object = value.as_object().ok_or_else(|| err("a table must be an object"))?;
    let mut table = FieldTable::default();
    for (k, v) in object {
        let key = ShortString::try_new(k.as_str()).map_err(|e| err(format!("key {k:?}: {e}")))?;
        table.insert(key, value_from_json(v)?);
    }
    Ok(table)
}

/// One AMQP value as `{"type": <name>, "value": <json>}`; the names are AMQP 0-9-1's (kebab case).
///
/// Long strings that are not UTF-8 and byte arrays use `"base64"` instead of `"value"`; floats
/// that are not finite are the strings `"NaN"`, `"inf"`, `"-inf"`; a decimal is
/// `{"scale": u8, "value": u32}`.
pub fn value_to_json(value: &AMQPValue) -> Value {
    // not `json!`: it would serialize `v` again at every level, quadratic in the nesting depth
    let typed = |t: &str, v: Value| {
        let mut map = Map::with_capacity(2);
        map.insert("type".into(), Value::String(t.into()));
        map.insert("value".into(), v);
        Value::Object(map)
    };
    match value {
        AMQPValue::Boolean(b) => typed("boolean", json!(b)),
        AMQPValue::ShortShortInt(n) => typed("short-short-int", json!(n)),
        AMQPValue::ShortShortUInt(n) => typed("short-short-uint", json!(n)),
        AMQPValue::ShortInt(n) => typed("short-int", json!(n)),
        AMQPValue::ShortUInt(n) => typed("short-uint", json!(n)),
        AMQPValue::LongInt(n) => typed("long-int", json!(n)),
        AMQPValue::LongUInt(n) => typed("long-uint", json!(n)),
        AMQPValue::LongLongInt(n) => typed("long-long-int", json!(n)),
        AMQPValue::Float(f) => typed("float", float_to_json(f64::from(*f))),
        AMQPValue::Double(f) => typed("double", float_to_json(*f)),
        AMQPValue::DecimalValue(d) => typed("decimal", json!({ "scale": d.scale, "value": d.value })),
        AMQPValue::ShortString(s) => typed("short-string", json!(s.as_str())),
        AMQPValue::LongString(s) => match std::str::from_utf8(s.as_bytes()) {
            Ok(text) => typed("long-string", json!(text)),
            Err(_) => json!({ "type": "long-string", "base64": B64.encode(s.as_bytes()) }),
        },
        AMQPValue::FieldArray(a) => typed(
            "field-array",
            Value::Array(a.as_slice().iter().map(value_to_json).collect()),
        ),
        AMQPValue::Timestamp(t) => typed("timestamp", json!(t)),
        AMQPValue::FieldTable(t) => typed("field-table", table_to_json(t)),
        AMQPValue::ByteArray(b) => json!({ "type": "byte-array", "base64": B64.encode(b.as_slice()) }),
        AMQPValue::Void => json!({ "type": "void" }),
    }
}

fn float_to_json(f: f64) -> Value {
    if f.is_nan() {
        json!("NaN")
    } else if f.is_infinite() {
        json!(if f > 0.0 { "inf" } else { "-inf" })
    } else {
        json!(f)
    }
}

fn float_from_json(v: &Value) -> Result<f64, EnvelopeError> {
    match v {
        Value::String(s) if s == "NaN" => Ok(f64::NAN),
        Value::String(s) if s == "inf" => Ok(f64::INFINITY),
        Value::String(s) if s == "-inf" => Ok(f64::NEG_INFINITY),
        other => other
            .as_f64()
            .ok_or_else(|| err("a float must be a number, \"NaN\", \"inf\" or \"-inf\"")),
    }
}

/// The inverse of [`value_to_json`].
pub fn value_from_json(v: &Value) -> Result<AMQPValue, EnvelopeError> {
    let type_name = v
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| err("a value needs a \"type\""))?;
    let value = || {
        v.get("value")
            .ok_or_else(|| err(format!("{type_name} needs a \"value\"")))
    };
    let int = |lo: i64, hi: i64| -> Result<i64, EnvelopeError> {
        value()?
            .as_i64()
            .filter(|n| (lo..=hi).contains(n))
            .ok_or_else(|| err(format!("{type_name} out of range")))
    };
    let bytes = || -> Result<Vec<u8>, EnvelopeError> {
        let text = v
            .get("base64")
            .and_then(Value::as_str)
            .ok_or_else(|| err("missing base64"))?;
        B64.decode(text).map_err(|e| err(format!("{type_name}: {e}")))
    };
    Ok(match type_name {
        "boolean" => AMQPValue::Boolean(value()?.as_bool().ok_or_else(|| err("boolean must be true or false"))?),
        "short-short-int" => AMQPValue::ShortShortInt(int(i8::MIN.into(), i8::MAX.into())? as i8),
        "short-short-uint" => AMQPValue::ShortShortUInt(int(0, u8::MAX.into())? as u8),
        "short-int" => AMQPValue::ShortInt(int(i16::MIN.into(), i16::MAX.into())? as i16),
        "short-uint" => AMQPValue::ShortUInt(int(0, u16::MAX.into())? as u16),
        "long-int" => AMQPValue::LongInt(int(i32::MIN.into(), i32::MAX.into())? as i32),
        "long-uint" => AMQPValue::LongUInt(int(0, u32::MAX.into())? as u32),
        "long-long-int" => AMQPValue::LongLongInt(int(i64::MIN, i64::MAX)?),
        "float" => AMQPValue::Float(float_from_json(value()?)? as f32),
        "double" => AMQPValue::Double(float_from_json(value()?)?),
        "decimal" => {
            let d = value()?;
            let scale = d
                .get("scale")
                .and_then(Value::as_u64)
                .and_then(|n| u8::try_from(n).ok());
            let number = d
                .get("value")
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok());
            match (scale, number) {
                (Some(scale), Some(value)) => AMQPValue::DecimalValue(DecimalValue { scale, value }),
                _ => return Err(err("decimal needs scale (u8) and value (u32)")),
            }
        }
        "short-string" => {
            let text = value()?.as_str().ok_or_else(|| err("short-string must be a string"))?;
            AMQPValue::ShortString(ShortString::try_new(text).map_err(|e| err(e.to_string()))?)
        }
        "long-string" => match v.get("value") {
            Some(Value::String(text)) => AMQPValue::LongString(LongString::from(text.as_bytes())),
            _ => AMQPValue::LongString(LongString::from(bytes()?)),
        },
        "field-array" => {
            let items = value()?.as_array().ok_or_else(|| err("field-array must be an array"))?;
            let items = items.iter().map(value_from_json).collect::<Result<Vec<_>, _>>()?;
            AMQPValue::FieldArray(FieldArray::from(items))
        }
        "timestamp" => AMQPValue::Timestamp(
            value()?
                .as_u64()
                .ok_or_else(|| err("timestamp must be an unsigned integer"))?,
        ),
        "field-table" => AMQPValue::FieldTable(table_from_json(value()?)?),
        "byte-array" => AMQPValue::ByteArray(ByteArray::from(bytes()?)),
        "void" => AMQPValue::Void,
        other => return Err(err(format!("unknown value type {other:?}"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every AMQP type, nested, with edge values.
    pub(crate) fn every_type() -> FieldTable {
        let mut inner = FieldTable::default();
        inner.insert(
            "deep".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![
                AMQPValue::DecimalValue(DecimalValue { scale: 2, value: 12345 }),
                AMQPValue::Void,
            ])),
        );
        let mut t = FieldTable::default();
        let entries = [
            ("bool", AMQPValue::Boolean(true)),
            ("i8", AMQPValue::ShortShortInt(-128)),
            ("u8", AMQPValue::ShortShortUInt(255)),
            ("i16", AMQPValue::ShortInt(-32768)),
            ("u16", AMQPValue::ShortUInt(65535)),
            ("i32", AMQPValue::LongInt(i32::MIN)),
            ("u32", AMQPValue::LongUInt(u32::MAX)),
            ("i64", AMQPValue::LongLongInt(i64::MIN)),
            ("f32", AMQPValue::Float(0.1)),
            ("f64", AMQPValue::Double(-1.0e300)),
            ("inf", AMQPValue::Double(f64::NEG_INFINITY)),
            (
                "decimal",
                AMQPValue::DecimalValue(DecimalValue {
                    scale: 3,
                    value: 4_000_000_000,
                }),
            ),
            ("short", AMQPValue::ShortString("short".into())),
            ("long", AMQPValue::LongString("päck".into())),
            ("binary-long", AMQPValue::LongString(vec![0u8, 0xff, 0x80].into())),
            (
                "array",
                AMQPValue::FieldArray(FieldArray::from(vec![
                    AMQPValue::LongInt(1),
                    AMQPValue::FieldTable(inner.clone()),
                ])),
            ),
            ("timestamp", AMQPValue::Timestamp(1_700_000_000)),
            ("table", AMQPValue::FieldTable(inner)),
            ("bytes", AMQPValue::ByteArray(vec![1u8, 2, 3, 0].into())),
            ("void", AMQPValue::Void),
        ];
        for (k, v) in entries {
            t.insert(k.into(), v);
        }
        t
    }

    #[test]
    fn every_value_type_round_trips_exactly() {
        let props = BasicProperties::default()
            .with_headers(every_type())
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_priority(7)
            .with_timestamp(123)
            .with_expiration("1000".into())
            .with_user_id("guest".into())
            .with_type("order.created".into())
            .with_message_id("id-1".into());
        let body = b"\x00\x01 binary body \xff";
        let original = OriginalMessage::capture("ex", "rk", &props, body);
        let text = serde_json::to_string(&original).unwrap();
        let back: OriginalMessage = serde_json::from_str(&text).unwrap();
        assert_eq!(back.properties().unwrap(), props);
        assert_eq!(back.body().unwrap(), body);
    }

    #[test]
    fn deeply_nested_headers_round_trip_through_the_envelope() {
        let run = || {
            let mut value = AMQPValue::LongString("bottom".into());
            for _ in 0..5_000 {
                let mut t = FieldTable::default();
                t.insert("n".into(), value);
                value = AMQPValue::FieldTable(t);
            }
            let mut headers = FieldTable::default();
            headers.insert("deep".into(), value);
            let props = BasicProperties::default().with_headers(headers);
            let envelope = Envelope {
                format: FORMAT.into(),
                reason: "invalid-header".into(),
                detail: "deep".into(),
                ladder: "l".into(),
                destination: None,
                attempts: None,
                first_failed_at_ms: None,
                history: Vec::new(),
                replayed_from: None,
                parked_at_ms: 1,
                hop: "intake".into(),
                message: OriginalMessage::capture("x", "", &props, b"body"),
            };
            let bytes = serde_json::to_vec(&envelope).unwrap();
            let back = Envelope::from_slice(&bytes).unwrap();
            assert_eq!(back.message.properties().unwrap(), props);
        };
        std::thread::Builder::new()
            .stack_size(crate::DEEP_STACK_BYTES)
            .spawn(run)
            .unwrap()
            .join()
            .unwrap();
    }

    fn parked_with_history() -> Envelope {
        let props = BasicProperties::default().with_message_id("m-1".into());
        Envelope {
            format: FORMAT.into(),
            reason: "max-attempts".into(),
            detail: "failed after 2 retries; ladder default allows 2".into(),
            ladder: "default".into(),
            destination: Some("orders".into()),
            attempts: Some(2),
            first_failed_at_ms: Some(1_000),
            history: vec![
                HistoryEntry {
                    attempt: 1,
                    tier: "1s".into(),
                    failed_at_ms: 1_000,
                },
                HistoryEntry {
                    attempt: 2,
                    tier: "10s".into(),
                    failed_at_ms: 2_012,
                },
            ],
            replayed_from: Some("ladder.default.parked@7".into()),
            parked_at_ms: 12_345,
            hop: "intake".into(),
            message: OriginalMessage::capture("ladder.default", "", &props, b"{}"),
        }
    }

    #[test]
    fn history_and_lineage_round_trip() {
        let envelope = parked_with_history();
        let json = serde_json::to_value(&envelope).unwrap();
        assert_eq!(
            json["history"],
            json!([
                {"attempt": 1, "tier": "1s", "failed_at_ms": 1_000},
                {"attempt": 2, "tier": "10s", "failed_at_ms": 2_012},
            ])
        );
        assert_eq!(json["replayed_from"], json!("ladder.default.parked@7"));
        let back = Envelope::from_slice(json.to_string().as_bytes()).unwrap();
        assert_eq!(back, envelope);
    }

    #[test]
    fn empty_history_and_lineage_are_left_out() {
        let envelope = Envelope {
            history: Vec::new(),
            replayed_from: None,
            ..parked_with_history()
        };
        let json = serde_json::to_value(&envelope).unwrap();
        assert!(
            json.get("history").is_none() && json.get("replayed_from").is_none(),
            "{json}"
        );
        assert_eq!(Envelope::from_slice(json.to_string().as_bytes()).unwrap(), envelope);
    }

    #[test]
    fn records_from_before_the_history_still_decode() {
        // a ladder.parked/v1 record as written before `history` and `replayed_from` existed
        let old = r#"{
            "format": "ladder.parked/v1",
            "reason": "max-attempts",
            "detail": "failed after 3 retries; ladder default allows 3",
            "ladder": "default",
            "destination": "orders",
            "attempts": 3,
            "first_failed_at_ms": 1763766000000,
            "parked_at_ms": 1763766012345,
            "hop": "intake",
            "message": {
                "exchange": "ladder.default",
                "routing_key": "",
                "properties": {
                    "message_id": "m-1",
                    "headers": {"retry-attempt": {"type": "long-long-int", "value": 3}}
                },
                "body_base64": "eyJvcmRlciI6IDQyfQ=="
            }
        }"#;
        let e = Envelope::from_slice(old.as_bytes()).unwrap();
        assert_eq!((e.attempts, e.destination.as_deref()), (Some(3), Some("orders")));
        assert!(e.history.is_empty());
        assert_eq!(e.replayed_from, None);
        assert_eq!(e.message.body().unwrap(), br#"{"order": 42}"#);
    }

    #[test]
    fn nan_survives_as_nan() {
        let v = value_from_json(&value_to_json(&AMQPValue::Float(f32::NAN))).unwrap();
        assert!(matches!(v, AMQPValue::Float(f) if f.is_nan()));
    }

    #[test]
    fn malformed_values_are_errors_not_panics() {
        for bad in [
            json!({}),
            json!({"type": "long-int", "value": 1u64 << 40}),
            json!({"type": "short-short-uint", "value": -1}),
            json!({"type": "decimal", "value": {"scale": 1}}),
            json!({"type": "byte-array", "base64": "!!"}),
            json!({"type": "what"}),
            json!({"type": "short-string", "value": "x".repeat(300)}),
        ] {
            assert!(value_from_json(&bad).is_err(), "{bad}");
        }
    }
}
