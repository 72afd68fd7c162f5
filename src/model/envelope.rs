//! The parking-lot record: a JSON envelope that carries the whole original message — body,
//! every property, every header with its exact AMQP type — plus why and where it was parked.
//!
//! Why an envelope and not the record's own headers: RabbitMQ 3.10 streams fed over AMQP 0-9-1
//! drop nested tables and arrays and close the connection on a decimal (shared/DESIGN.md).
//! Inside the body, nothing is lost. Pure: no I/O. Format `ladder.parked/v1`, documented in
//! README.md; a field is only ever added, never renamed.

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use ladder_amqp::{BasicProperties, Decimal, Delivery, FieldTable, FieldValue, LongString, ShortString};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::model::protocol::HistoryEntry;

/// The format tag every envelope carries.
pub const FORMAT: &str = "ladder.parked/v1";

/// The `type` of a record holding a parked body too large for its envelope: the body's bytes
/// as they are, `message_id` = the [`BodyRecord::id`] its envelope names. Written just before the
/// envelope, to the same stream.
pub const BODY_FORMAT: &str = "ladder.parked-body/v1";

/// Where a parked body stored apart from its envelope is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BodyRecord {
    /// The `message_id` of the [`BODY_FORMAT`] record holding the body.
    pub id: String,
    /// The body's size.
    pub bytes: u64,
}

/// One parked message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Envelope {
    /// Always [`FORMAT`].
    #[schema(schema_with = format_schema)]
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
    /// Where the service took it from: `intake`, `due` or `quarantine`.
    #[schema(schema_with = hop_schema)]
    pub hop: String,
    /// The message exactly as the service received it.
    pub message: OriginalMessage,
}

fn format_schema() -> utoipa::openapi::Object {
    crate::model::words_schema([FORMAT])
}

fn hop_schema() -> utoipa::openapi::Object {
    crate::model::words_schema(["intake", "due", "quarantine"])
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct OriginalMessage {
    /// Exchange it was published to (lossy UTF-8 when `exchange_base64` is set).
    pub exchange: String,
    /// The exchange's exact bytes, when they are not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exchange_base64: Option<String>,
    /// Routing key it was published with (lossy UTF-8 when `routing_key_base64` is set).
    pub routing_key: String,
    /// The routing key's exact bytes, when they are not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_key_base64: Option<String>,
    /// Properties; `headers` is a table of typed values (see [`value_to_json`]). Properties the
    /// client could not decode are `{"raw_base64": …, "undecodable": why}`.
    #[schema(value_type = Object)]
    pub properties: Value,
    /// The body, base64; empty when it is stored apart (`body_record`).
    pub body_base64: String,
    /// Set when the body was too large for the envelope and is stored in a record of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_record: Option<BodyRecord>,
}

/// A message's properties as stored: decoded, or the bytes the client could not decode.
#[derive(Debug, Clone, PartialEq)]
pub enum StoredProperties {
    /// Every property, headers with their AMQP types.
    Decoded(Box<BasicProperties>),
    /// The property flags and list exactly as received.
    Raw(Vec<u8>),
}

impl OriginalMessage {
    /// Captures a received message.
    pub fn capture(
        exchange: impl AsRef<[u8]>,
        routing_key: impl AsRef<[u8]>,
        props: &BasicProperties,
        body: &[u8],
    ) -> Self {
        let (exchange, exchange_base64) = text_or_base64(exchange.as_ref());
        let (routing_key, routing_key_base64) = text_or_base64(routing_key.as_ref());
        OriginalMessage {
            exchange,
            exchange_base64,
            routing_key,
            routing_key_base64,
            properties: properties_to_json(props),
            body_base64: B64.encode(body),
            body_record: None,
        }
    }

    /// Captures a delivery as received, properties the client could not decode as bytes.
    pub fn capture_delivery(delivery: &Delivery) -> Self {
        Self::capture_delivery_with(delivery, &delivery.body)
    }

    /// Like [`OriginalMessage::capture_delivery`], with the body stored apart in `record`.
    pub fn capture_delivery_apart(delivery: &Delivery, record: BodyRecord) -> Self {
        OriginalMessage {
            body_record: Some(record),
            ..Self::capture_delivery_with(delivery, &[])
        }
    }

    fn capture_delivery_with(delivery: &Delivery, body: &[u8]) -> Self {
        let mut original = Self::capture(
            delivery.exchange.as_bytes(),
            delivery.routing_key.as_bytes(),
            &delivery.properties,
            body,
        );
        if let Some(raw) = &delivery.undecodable {
            original.properties = json!({
                "raw_base64": B64.encode(&raw.bytes),
                "undecodable": raw.error.to_string(),
            });
        }
        original
    }

    /// The original body; an error when it is stored apart (`body_record`: read it from the
    /// stream with `ParkingLot::body`).
    pub fn body(&self) -> Result<Vec<u8>, EnvelopeError> {
        if let Some(record) = &self.body_record {
            return Err(err(format!(
                "the body ({} bytes) is stored apart, in record {}",
                record.bytes, record.id
            )));
        }
        B64.decode(&self.body_base64)
            .map_err(|e| EnvelopeError(format!("body_base64: {e}")))
    }

    /// The exchange's exact bytes.
    pub fn exchange_bytes(&self) -> Result<Vec<u8>, EnvelopeError> {
        exact_bytes(&self.exchange, self.exchange_base64.as_deref())
    }

    /// The routing key's exact bytes.
    pub fn routing_key_bytes(&self) -> Result<Vec<u8>, EnvelopeError> {
        exact_bytes(&self.routing_key, self.routing_key_base64.as_deref())
    }

    /// The original properties, with every header in its original AMQP type; an error when
    /// they were stored as bytes (see [`OriginalMessage::stored_properties`]).
    pub fn properties(&self) -> Result<BasicProperties, EnvelopeError> {
        match self.stored_properties()? {
            StoredProperties::Decoded(p) => Ok(*p),
            StoredProperties::Raw(_) => Err(err("the properties are stored as bytes (they did not decode)")),
        }
    }

    /// The original properties, decoded or as the bytes they were received as.
    pub fn stored_properties(&self) -> Result<StoredProperties, EnvelopeError> {
        if let Some(raw) = self.properties.get("raw_base64") {
            let text = raw.as_str().ok_or_else(|| err("raw_base64 must be a string"))?;
            return B64
                .decode(text)
                .map(StoredProperties::Raw)
                .map_err(|e| err(format!("raw_base64: {e}")));
        }
        properties_from_json(&self.properties).map(|p| StoredProperties::Decoded(Box::new(p)))
    }
}

/// `bytes` as text, or lossy text and the exact bytes in base64 when they are not UTF-8.
fn text_or_base64(bytes: &[u8]) -> (String, Option<String>) {
    match std::str::from_utf8(bytes) {
        Ok(text) => (text.to_string(), None),
        Err(_) => (String::from_utf8_lossy(bytes).into_owned(), Some(B64.encode(bytes))),
    }
}

fn exact_bytes(text: &str, base64: Option<&str>) -> Result<Vec<u8>, EnvelopeError> {
    match base64 {
        Some(b) => B64.decode(b).map_err(|e| err(format!("base64: {e}"))),
        None => Ok(text.as_bytes().to_vec()),
    }
}

/// A short string as JSON: a string when UTF-8, else `{"base64": …}`.
fn short_to_json(value: &ShortString) -> Value {
    match value.to_str() {
        Some(text) => Value::String(text.to_string()),
        None => json!({ "base64": B64.encode(value.as_bytes()) }),
    }
}

/// The inverse of [`short_to_json`].
fn short_from_json(v: &Value, what: &str) -> Result<ShortString, EnvelopeError> {
    let bytes = match v {
        Value::String(text) => text.as_bytes().to_vec(),
        Value::Object(o) => {
            let text = o
                .get("base64")
                .and_then(Value::as_str)
                .ok_or_else(|| err(format!("{what} must be a string or {{\"base64\": …}}")))?;
            B64.decode(text).map_err(|e| err(format!("{what}: {e}")))?
        }
        _ => return Err(err(format!("{what} must be a string or {{\"base64\": …}}"))),
    };
    ShortString::new(bytes).map_err(|e| err(format!("{what}: {e}")))
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
        "content_type" => &props.content_type,
        "content_encoding" => &props.content_encoding,
        "correlation_id" => &props.correlation_id,
        "reply_to" => &props.reply_to,
        "expiration" => &props.expiration,
        "message_id" => &props.message_id,
        "type" => &props.kind,
        "user_id" => &props.user_id,
        "app_id" => &props.app_id,
        _ => &props.cluster_id,
    }
}

fn string_property_mut<'a>(props: &'a mut BasicProperties, name: &str) -> &'a mut Option<ShortString> {
    match name {
        "content_type" => &mut props.content_type,
        "content_encoding" => &mut props.content_encoding,
        "correlation_id" => &mut props.correlation_id,
        "reply_to" => &mut props.reply_to,
        "expiration" => &mut props.expiration,
        "message_id" => &mut props.message_id,
        "type" => &mut props.kind,
        "user_id" => &mut props.user_id,
        "app_id" => &mut props.app_id,
        _ => &mut props.cluster_id,
    }
}

/// Properties as a JSON object; absent properties are absent keys.
pub fn properties_to_json(props: &BasicProperties) -> Value {
    let mut out = Map::new();
    for name in STRING_PROPERTIES {
        if let Some(v) = string_property(props, name) {
            out.insert(name.into(), short_to_json(v));
        }
    }
    if let Some(v) = props.delivery_mode {
        out.insert("delivery_mode".into(), json!(v));
    }
    if let Some(v) = props.priority {
        out.insert("priority".into(), json!(v));
    }
    if let Some(v) = props.timestamp {
        out.insert("timestamp".into(), json!(v));
    }
    if let Some(headers) = &props.headers {
        out.insert("headers".into(), table_to_json(headers));
    }
    Value::Object(out)
}

/// The inverse of [`properties_to_json`].
pub fn properties_from_json(value: &Value) -> Result<BasicProperties, EnvelopeError> {
    let object = value.as_object().ok_or_else(|| err("properties must be an object"))?;
    let mut props = BasicProperties::default();
    for (key, v) in object {
        match key.as_str() {
            "delivery_mode" => props.delivery_mode = Some(small_uint(v, key)?),
            "priority" => props.priority = Some(small_uint(v, key)?),
            "timestamp" => props.timestamp = Some(v.as_u64().ok_or_else(|| err("timestamp must be an integer"))?),
            "headers" => props.headers = Some(table_from_json(v)?),
            name if STRING_PROPERTIES.contains(&name) => {
                *string_property_mut(&mut props, name) = Some(short_from_json(v, name)?);
            }
            other => return Err(err(format!("unknown property {other:?}"))),
        }
    }
    Ok(props)
}

fn small_uint(v: &Value, key: &str) -> Result<u8, EnvelopeError> {
    v.as_u64()
        .and_then(|n| u8::try_from(n).ok())
        .ok_or_else(|| err(format!("{key} must be an integer 0..=255")))
}

/// A header table as a JSON object of typed values — or, when a key is not UTF-8 or occurs twice
/// (both legal on the wire), as an array of `[key, value]` pairs in wire order, each key a
/// string or `{"base64": …}`.
pub fn table_to_json(table: &FieldTable) -> Value {
    let mut seen = std::collections::HashSet::with_capacity(table.len());
    let plain = table
        .iter()
        .all(|(k, _)| k.to_str().is_some() && seen.insert(k.as_bytes()));
    if plain {
        Value::Object(table.iter().map(|(k, v)| (k.to_string(), value_to_json(v))).collect())
    } else {
        Value::Array(
            table
                .iter()
                .map(|(k, v)| Value::Array(vec![short_to_json(k), value_to_json(v)]))
                .collect(),
        )
    }
}

/// The inverse of [`table_to_json`].
pub fn table_from_json(value: &Value) -> Result<FieldTable, EnvelopeError> {
    match value {
        Value::Object(object) => {
            let mut entries = Vec::with_capacity(object.len());
            for (k, v) in object {
                let key = ShortString::try_from(k.as_str()).map_err(|e| err(format!("key {k:?}: {e}")))?;
                entries.push((key, value_from_json(v)?));
            }
            Ok(entries.into_iter().collect())
        }
        Value::Array(pairs) => {
            let mut entries = Vec::with_capacity(pairs.len());
            for pair in pairs {
                let [k, v] = pair.as_array().map(Vec::as_slice).unwrap_or_default() else {
                    return Err(err("a table entry must be a [key, value] pair"));
                };
                entries.push((short_from_json(k, "a table key")?, value_from_json(v)?));
            }
            Ok(entries.into_iter().collect())
        }
        _ => Err(err("a table must be an object or an array of [key, value] pairs")),
    }
}

/// The entries of a table as stored ([`table_to_json`]): a display key (lossy UTF-8) and the
/// typed value, in order, for either form. Anything else gives none.
pub fn table_entries(table: &Value) -> Vec<(String, &Value)> {
    match table {
        Value::Object(map) => map.iter().map(|(k, v)| (k.clone(), v)).collect(),
        Value::Array(pairs) => pairs
            .iter()
            .filter_map(|pair| match pair.as_array().map(Vec::as_slice) {
                Some([k, v]) => Some((short_text(k)?, v)),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The first value under `key` in a stored table, in either form.
pub fn table_get<'a>(table: &'a Value, key: &str) -> Option<&'a Value> {
    match table {
        Value::Object(map) => map.get(key),
        Value::Array(pairs) => pairs.iter().find_map(|pair| match pair.as_array().map(Vec::as_slice) {
            Some([Value::String(k), v]) if k == key => Some(v),
            _ => None,
        }),
        _ => None,
    }
}

/// A stored short string (a string, or `{"base64": …}`) as text, lossy for bytes that are not
/// UTF-8.
pub fn short_text(v: &Value) -> Option<String> {
    match v {
        Value::String(text) => Some(text.clone()),
        Value::Object(o) => {
            let bytes = B64.decode(o.get("base64")?.as_str()?).ok()?;
            Some(String::from_utf8_lossy(&bytes).into_owned())
        }
        _ => None,
    }
}

/// One AMQP value as `{"type": <name>, "value": <json>}`; the names are AMQP 0-9-1's (kebab case).
///
/// Long strings that are not UTF-8 and byte arrays use `"base64"` instead of `"value"`; floats
/// that are not finite are the strings `"NaN"`, `"inf"`, `"-inf"` (a NaN other than the one
/// `f32::NAN` or `f64::NAN` is — another sign or payload — also has its `"bits"`, an integer);
/// a decimal is `{"scale": u8, "value": u32}`.
pub fn value_to_json(value: &FieldValue) -> Value {
    // not `json!`: it would serialize `v` again at every level, quadratic in the nesting depth
    let typed = |t: &str, v: Value| {
        let mut map = Map::with_capacity(2);
        map.insert("type".into(), Value::String(t.into()));
        map.insert("value".into(), v);
        Value::Object(map)
    };
    match value {
        FieldValue::Boolean(b) => typed("boolean", json!(b)),
        FieldValue::ShortShortInt(n) => typed("short-short-int", json!(n)),
        FieldValue::ShortShortUInt(n) => typed("short-short-uint", json!(n)),
        FieldValue::ShortInt(n) => typed("short-int", json!(n)),
        FieldValue::ShortUInt(n) => typed("short-uint", json!(n)),
        FieldValue::LongInt(n) => typed("long-int", json!(n)),
        FieldValue::LongUInt(n) => typed("long-uint", json!(n)),
        FieldValue::LongLongInt(n) => typed("long-long-int", json!(n)),
        FieldValue::Float(f) => with_nan_bits(
            typed("float", float_to_json(f64::from(*f))),
            (f.is_nan() && f.to_bits() != f32::NAN.to_bits()).then(|| u64::from(f.to_bits())),
        ),
        FieldValue::Double(f) => with_nan_bits(
            typed("double", float_to_json(*f)),
            (f.is_nan() && f.to_bits() != f64::NAN.to_bits()).then(|| f.to_bits()),
        ),
        FieldValue::Decimal(d) => typed("decimal", json!({ "scale": d.scale, "value": d.value })),
        FieldValue::LongString(s) => match s.to_str() {
            Some(text) => typed("long-string", json!(text)),
            None => json!({ "type": "long-string", "base64": B64.encode(s.as_bytes()) }),
        },
        FieldValue::FieldArray(a) => typed("field-array", Value::Array(a.iter().map(value_to_json).collect())),
        FieldValue::Timestamp(t) => typed("timestamp", json!(t)),
        FieldValue::FieldTable(t) => typed("field-table", table_to_json(t)),
        FieldValue::ByteArray(b) => json!({ "type": "byte-array", "base64": B64.encode(b) }),
        FieldValue::Void => json!({ "type": "void" }),
    }
}

/// `typed` with `"bits"` when a NaN's bits are not the usual ones (x86 computes 0/0 as a NaN with
/// the sign bit set; a payload may carry anything): `"NaN"` alone would replay another value.
fn with_nan_bits(mut typed: Value, bits: Option<u64>) -> Value {
    if let (Some(bits), Value::Object(map)) = (bits, &mut typed) {
        map.insert("bits".into(), json!(bits));
    }
    typed
}

/// The `"bits"` of a stored NaN ([`with_nan_bits`]), if any, checked to be a NaN's.
fn nan_bits<T>(v: &Value, from_bits: impl Fn(u64) -> Option<T>) -> Result<Option<T>, EnvelopeError> {
    v.get("bits")
        .map(|bits| {
            bits.as_u64()
                .and_then(from_bits)
                .ok_or_else(|| err("bits must be the bits of a NaN"))
        })
        .transpose()
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
pub fn value_from_json(v: &Value) -> Result<FieldValue, EnvelopeError> {
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
        "boolean" => FieldValue::Boolean(value()?.as_bool().ok_or_else(|| err("boolean must be true or false"))?),
        "short-short-int" => FieldValue::ShortShortInt(int(i8::MIN.into(), i8::MAX.into())? as i8),
        "short-short-uint" => FieldValue::ShortShortUInt(int(0, u8::MAX.into())? as u8),
        "short-int" => FieldValue::ShortInt(int(i16::MIN.into(), i16::MAX.into())? as i16),
        "short-uint" => FieldValue::ShortUInt(int(0, u16::MAX.into())? as u16),
        "long-int" => FieldValue::LongInt(int(i32::MIN.into(), i32::MAX.into())? as i32),
        "long-uint" => FieldValue::LongUInt(int(0, u32::MAX.into())? as u32),
        "long-long-int" => FieldValue::LongLongInt(int(i64::MIN, i64::MAX)?),
        "float" => FieldValue::Float(match float_from_json(value()?)? {
            nan if nan.is_nan() => {
                let bits = |b: u64| u32::try_from(b).ok().map(f32::from_bits).filter(|f| f.is_nan());
                nan_bits(v, bits)?.unwrap_or(f32::NAN)
            }
            f => f as f32,
        }),
        "double" => FieldValue::Double(match float_from_json(value()?)? {
            nan if nan.is_nan() => nan_bits(v, |b| Some(f64::from_bits(b)).filter(|f| f.is_nan()))?.unwrap_or(f64::NAN),
            f => f,
        }),
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
                (Some(scale), Some(value)) => FieldValue::Decimal(Decimal { scale, value }),
                _ => return Err(err("decimal needs scale (u8) and value (u32)")),
            }
        }
        // written by versions that stored lapin's short strings; RabbitMQ's tables have no
        // short-string type, so it comes back as the long string a replay can publish
        "short-string" => {
            let text = value()?.as_str().ok_or_else(|| err("short-string must be a string"))?;
            if text.len() > 255 {
                return Err(err("short-string longer than 255 bytes"));
            }
            FieldValue::LongString(LongString::from(text))
        }
        "long-string" => match v.get("value") {
            Some(Value::String(text)) => FieldValue::LongString(LongString::from(text.as_bytes())),
            _ => FieldValue::LongString(LongString::from(bytes()?)),
        },
        "field-array" => {
            let items = value()?.as_array().ok_or_else(|| err("field-array must be an array"))?;
            let items = items.iter().map(value_from_json).collect::<Result<Vec<_>, _>>()?;
            FieldValue::FieldArray(items)
        }
        "timestamp" => FieldValue::Timestamp(
            value()?
                .as_u64()
                .ok_or_else(|| err("timestamp must be an unsigned integer"))?,
        ),
        "field-table" => FieldValue::FieldTable(table_from_json(value()?)?),
        "byte-array" => FieldValue::ByteArray(bytes()?),
        "void" => FieldValue::Void,
        other => return Err(err(format!("unknown value type {other:?}"))),
    })
}

#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod tests {
    use super::*;

    fn s(text: &str) -> Option<ShortString> {
        Some(ShortString::try_from(text).unwrap())
    }

    /// Every AMQP type, nested, with edge values.
    pub(crate) fn every_type() -> FieldTable {
        let mut inner = FieldTable::default();
        inner.set(
            "deep",
            FieldValue::FieldArray(vec![
                FieldValue::Decimal(Decimal { scale: 2, value: 12345 }),
                FieldValue::Void,
            ]),
        );
        let mut t = FieldTable::default();
        let entries = [
            ("bool", FieldValue::Boolean(true)),
            ("i8", FieldValue::ShortShortInt(-128)),
            ("u8", FieldValue::ShortShortUInt(255)),
            ("i16", FieldValue::ShortInt(-32768)),
            ("u16", FieldValue::ShortUInt(65535)),
            ("i32", FieldValue::LongInt(i32::MIN)),
            ("u32", FieldValue::LongUInt(u32::MAX)),
            ("i64", FieldValue::LongLongInt(i64::MIN)),
            ("f32", FieldValue::Float(0.1)),
            ("f64", FieldValue::Double(-1.0e300)),
            ("inf", FieldValue::Double(f64::NEG_INFINITY)),
            (
                "decimal",
                FieldValue::Decimal(Decimal {
                    scale: 3,
                    value: 4_000_000_000,
                }),
            ),
            ("long", FieldValue::LongString("päck".into())),
            ("binary-long", FieldValue::LongString(vec![0u8, 0xff, 0x80].into())),
            ("\u{0}key", FieldValue::LongString("a key with a NUL".into())),
            (
                "array",
                FieldValue::FieldArray(vec![FieldValue::LongInt(1), FieldValue::FieldTable(inner.clone())]),
            ),
            ("timestamp", FieldValue::Timestamp(1_700_000_000)),
            ("table", FieldValue::FieldTable(inner)),
            ("bytes", FieldValue::ByteArray(vec![1u8, 2, 3, 0])),
            ("void", FieldValue::Void),
        ];
        for (k, v) in entries {
            t.set(k, v);
        }
        t
    }

    #[test]
    fn every_value_type_round_trips_exactly() {
        let props = BasicProperties {
            headers: Some(every_type()),
            content_type: s("application/json"),
            delivery_mode: Some(2),
            priority: Some(7),
            timestamp: Some(123),
            expiration: s("1000"),
            user_id: s("guest"),
            kind: s("order.created"),
            message_id: s("id-1"),
            ..Default::default()
        };
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
            let mut value = FieldValue::LongString("bottom".into());
            for _ in 0..5_000 {
                let mut t = FieldTable::default();
                t.set("n", value);
                value = FieldValue::FieldTable(t);
            }
            let mut headers = FieldTable::default();
            headers.set("deep", value);
            let props = BasicProperties {
                headers: Some(headers),
                ..Default::default()
            };
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
        let props = BasicProperties {
            message_id: s("m-1"),
            ..Default::default()
        };
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
    fn bytes_that_are_not_utf8_round_trip_exactly() {
        let mut nested = FieldTable::new();
        nested.insert(ShortString::new(&b"k\xfe"[..]).unwrap(), FieldValue::LongInt(1));
        let mut headers = FieldTable::new();
        headers.insert(
            ShortString::new(&b"name\xff"[..]).unwrap(),
            FieldValue::FieldTable(nested),
        );
        headers.set("dup", FieldValue::LongInt(1));
        let props = BasicProperties {
            message_id: Some(ShortString::new(&b"\xff\xfe"[..]).unwrap()),
            correlation_id: s("plain"),
            headers: Some(headers),
            ..Default::default()
        };
        let original = OriginalMessage::capture(&b"ex\xff"[..], &b"rk\xfe"[..], &props, b"body");
        let json = serde_json::to_value(&original).unwrap();
        assert_eq!(json["properties"]["message_id"], json!({"base64": "//4="}));
        assert!(json["properties"]["headers"].is_array(), "{json}");
        let back: OriginalMessage = serde_json::from_value(json).unwrap();
        assert_eq!(back.properties().unwrap(), props);
        assert_eq!(back.exchange_bytes().unwrap(), b"ex\xff");
        assert_eq!(back.routing_key_bytes().unwrap(), b"rk\xfe");
        assert_eq!(back.exchange, "ex\u{fffd}");

        // a key that occurs twice on the wire is kept twice, in order
        let twice: FieldTable = [
            (ShortString::try_from("a").unwrap(), FieldValue::LongInt(1)),
            (ShortString::try_from("a").unwrap(), FieldValue::LongInt(2)),
        ]
        .into_iter()
        .collect();
        assert_eq!(table_from_json(&table_to_json(&twice)).unwrap(), twice);
    }

    #[test]
    fn properties_that_did_not_decode_are_kept_as_bytes() {
        let delivery = Delivery {
            delivery_tag: 1,
            redelivered: false,
            exchange: ShortString::try_from("x").unwrap(),
            routing_key: ShortString::default(),
            properties: BasicProperties::default(),
            undecodable: Some(Box::new(ladder_amqp::Undecodable {
                bytes: vec![0x20, 0, 1, 2, 3],
                error: ladder_amqp::types::DecodeError::TooDeep,
                lossy: None,
            })),
            body: b"b".to_vec(),
        };
        let original = OriginalMessage::capture_delivery(&delivery);
        let back: OriginalMessage = serde_json::from_str(&serde_json::to_string(&original).unwrap()).unwrap();
        assert_eq!(
            back.stored_properties().unwrap(),
            StoredProperties::Raw(vec![0x20, 0, 1, 2, 3])
        );
        assert!(back.properties().is_err());
        assert_eq!(
            back.properties["undecodable"],
            json!(ladder_amqp::types::DecodeError::TooDeep.to_string())
        );
    }

    #[test]
    fn nan_survives_as_nan() {
        let v = value_from_json(&value_to_json(&FieldValue::Float(f32::NAN))).unwrap();
        assert!(matches!(v, FieldValue::Float(f) if f.is_nan()));
    }

    /// Found by `any_message_round_trips_through_the_envelope_text`: a NaN with the sign bit
    /// set (what x86 computes for 0/0) or a payload came back as the plain NaN, and a double
    /// like this one came back one ULP off (serde_json's default float parser).
    #[test]
    fn every_float_bit_pattern_survives() {
        let doubles = [
            0xfff8_0000_0000_0000,
            0x7ff0_0000_0000_0001,
            0xc206_c944_c376_592c,
            0x8000_0000_0000_0000,
        ];
        for bits in doubles {
            let text = value_to_json(&FieldValue::Double(f64::from_bits(bits))).to_string();
            let back = value_from_json(&serde_json::from_str(&text).unwrap()).unwrap();
            assert!(
                matches!(back, FieldValue::Double(f) if f.to_bits() == bits),
                "{bits:#x}: {text} {back:?}"
            );
        }
        for bits in [0xffc0_0000, 0x7f80_0001, 0x7fc0_0000, 0x0000_0001] {
            let text = value_to_json(&FieldValue::Float(f32::from_bits(bits))).to_string();
            let back = value_from_json(&serde_json::from_str(&text).unwrap()).unwrap();
            assert!(
                matches!(back, FieldValue::Float(f) if f.to_bits() == bits),
                "{bits:#x}: {text} {back:?}"
            );
        }
        // the usual NaN is stored as before, without bits; bits that are not a NaN's are refused
        assert_eq!(
            value_to_json(&FieldValue::Double(f64::NAN)),
            json!({"type": "double", "value": "NaN"})
        );
        assert!(value_from_json(&json!({"type": "double", "value": "NaN", "bits": 0})).is_err());
        assert!(value_from_json(&json!({"type": "float", "value": "NaN", "bits": u64::MAX})).is_err());
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
            json!({"type": "field-table", "value": [["k"]]}),
            json!({"type": "field-table", "value": 5}),
        ] {
            assert!(value_from_json(&bad).is_err(), "{bad}");
        }
    }

    /// Properties as their wire encoding: equal encodings are equal properties, floats compared
    /// by their bits (a NaN equals itself, -0 differs from 0).
    fn wire(props: &BasicProperties) -> Vec<u8> {
        let mut out = bytes::BytesMut::new();
        props.encode(&mut out);
        out.to_vec()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: 384,
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Whatever a message carries — short strings of any bytes, keys that repeat or are not
        /// UTF-8, every value type, floats of every bit pattern — comes back exactly from the
        /// stored envelope's JSON text.
        #[test]
        fn any_message_round_trips_through_the_envelope_text(
            props in testing::properties(),
            exchange in testing::short_bytes(),
            routing_key in testing::short_bytes(),
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
        ) {
            let original = OriginalMessage::capture(&exchange, &routing_key, &props, &body);
            let text = serde_json::to_string(&original).unwrap();
            let back: OriginalMessage = serde_json::from_str(&text).unwrap();
            let decoded = back.properties().unwrap();
            proptest::prop_assert_eq!(wire(&decoded), wire(&props), "{:?}", decoded);
            proptest::prop_assert_eq!(back.body().unwrap(), body);
            proptest::prop_assert_eq!(back.exchange_bytes().unwrap(), exchange);
            proptest::prop_assert_eq!(back.routing_key_bytes().unwrap(), routing_key);
        }
    }
}
