//! A compact in-memory index of one parking lot, built by reading its stream once. It keeps one
//! small row per parked entry (offset, time, destination, reason, hashed ids, resolution), so
//! listing, counting and filtering by the indexed fields never reread the stream.
//!
//! It is a cache, never the state: the stream (entries plus resolution records) is the truth,
//! and any index can be rebuilt from it. The CLI builds one per command; the running service
//! keeps one per ladder that follows the stream ([`crate::admin::desk`]), so every replica serves
//! the same view a few milliseconds behind the stream.
//!
//! What it cannot answer exactly — header `key=value` and body substring searches — the caller
//! checks on the records it fetches ([`Filter::needs_records`]). For headers it narrows those
//! records first: each row keeps a small Bloom filter of its message's top-level headers (see
//! [`header_bits`]), so a search for a rare value fetches the few entries that may hold it, not
//! the whole lot. Pure: no I/O.

use std::collections::{HashMap, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::model::lot::Invalid;
use crate::model::lot::edit::EditAudit;
use crate::model::lot::filter::Filter;
use crate::model::lot::record::{Action, MARKER_FORMAT, Marker, RESOLUTION_FORMAT, Resolution};

/// The index keeps at most this many entries and drops the oldest beyond it (they stay in the
/// stream, reachable by offset). A row takes 64 bytes, so the cap bounds an index near 650 MB;
/// the stream's own retention normally removes entries long before.
pub const MAX_INDEXED_ENTRIES: usize = 10_000_000;

/// What the index needs of a parked record. It is read with exactly the strictness of
/// [`Envelope::from_slice`](crate::model::envelope::Envelope::from_slice), so the index takes a
/// record for an entry exactly when fetching it can show it (a property test holds the two
/// together). The body, the properties and the headers are only checked, and of the headers
/// only a digest is kept.
#[derive(Deserialize)]
#[allow(dead_code)] // fields of type `Text` and the like only check the record
struct Summary {
    format: Text,
    reason: String,
    detail: Text,
    ladder: Text,
    destination: Option<String>,
    attempts: Option<u64>,
    first_failed_at_ms: Option<u64>,
    #[serde(default)]
    history: Vec<crate::model::protocol::HistoryEntry>,
    #[serde(default)]
    replayed_from: Option<Text>,
    parked_at_ms: u64,
    hop: Text,
    message: SummaryMessage,
}

/// [`crate::model::envelope::OriginalMessage`], checked.
#[derive(Deserialize)]
#[allow(dead_code)]
struct SummaryMessage {
    exchange: Text,
    #[serde(default)]
    exchange_base64: Option<Text>,
    routing_key: Text,
    #[serde(default)]
    routing_key_base64: Option<Text>,
    properties: SummaryProperties,
    body_base64: Text,
    #[serde(default)]
    body_record: Option<crate::model::envelope::BodyRecord>,
}

/// A JSON string, checked as a `String` would be (escapes decoded, UTF-8), kept nowhere.
struct Text;

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Checked;
        impl<'de> Visitor<'de> for Checked {
            type Value = Text;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Text, E> {
                Ok(Text)
            }
        }
        deserializer.deserialize_string(Checked)
    }
}

/// Any JSON, checked as a `serde_json::Value` would be (strings decoded, numbers in range),
/// kept nowhere. Nested values recurse, on the stack `serde_stacker` grows.
struct AnyJson;

impl<'de> Deserialize<'de> for AnyJson {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(Checked(|| AnyJson))
    }
}

/// A visitor that checks any JSON and answers `make()`; a type that reads more of some JSON
/// types overrides those.
struct Checked<F>(F);

impl<'de, T, F: FnOnce() -> T> Visitor<'de> for Checked<F> {
    type Value = T;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<T, E> {
        Ok(self.0())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<T, E> {
        Ok(self.0())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<T, E> {
        Ok(self.0())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<T, E> {
        Ok(self.0())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<T, E> {
        Ok(self.0())
    }
    fn visit_unit<E: de::Error>(self) -> Result<T, E> {
        Ok(self.0())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<T, A::Error> {
        while seq.next_element::<AnyJson>()?.is_some() {}
        Ok(self.0())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<T, A::Error> {
        while map.next_key::<Text>()?.is_some() {
            map.next_value::<AnyJson>()?;
        }
        Ok(self.0())
    }
}

/// The stored properties (any JSON, as the envelope's `Value`). From an object it keeps the
/// message and correlation ids as lossy text, as the exact check reads them, and the headers'
/// digest. A key given twice counts once, the last time, as in a `Value`.
#[derive(Default)]
struct SummaryProperties {
    message_id: Option<String>,
    correlation_id: Option<String>,
    headers: HeaderDigest,
}

impl<'de> Deserialize<'de> for SummaryProperties {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Properties;
        impl<'de> Visitor<'de> for Properties {
            type Value = SummaryProperties;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SummaryProperties, A::Error> {
                let mut p = SummaryProperties::default();
                while let Some(key) = map.next_key::<String>()? {
                    let text = |v: serde_json::Value| crate::model::envelope::short_text(&v);
                    match key.as_str() {
                        "message_id" => p.message_id = text(map.next_value()?),
                        "correlation_id" => p.correlation_id = text(map.next_value()?),
                        "headers" => p.headers = map.next_value()?,
                        _ => {
                            map.next_value::<AnyJson>()?;
                        }
                    }
                }
                Ok(p)
            }
            // anything else is kept as it is and has nothing to index
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<SummaryProperties, E> {
                Ok(SummaryProperties::default())
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<SummaryProperties, E> {
                Ok(SummaryProperties::default())
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<SummaryProperties, E> {
                Ok(SummaryProperties::default())
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<SummaryProperties, E> {
                Ok(SummaryProperties::default())
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<SummaryProperties, E> {
                Ok(SummaryProperties::default())
            }
            fn visit_unit<E: de::Error>(self) -> Result<SummaryProperties, E> {
                Ok(SummaryProperties::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<SummaryProperties, A::Error> {
                Checked(SummaryProperties::default).visit_seq(seq)
            }
        }
        deserializer.deserialize_any(Properties)
    }
}

/// The Bloom filter of a message's headers: for each top-level header with a text form (the
/// form `--header key=value` compares: strings as they are, integers in decimal, booleans),
/// the bits [`header_bits`] gives its key and text. Headers in any other shape (any JSON is
/// kept) have none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct HeaderDigest(u128);

impl<'de> Deserialize<'de> for HeaderDigest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Headers;
        impl<'de> Visitor<'de> for Headers {
            type Value = HeaderDigest;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a table of typed header values")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<HeaderDigest, A::Error> {
                let mut digest = 0;
                while let Some(key) = map.next_key::<String>()? {
                    if let Some(text) = map.next_value::<TypedHeader>()?.0 {
                        digest |= header_bits(&key, &text);
                    }
                }
                Ok(HeaderDigest(digest))
            }
            // the pair form, for tables with keys that are not UTF-8 or occur twice
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<HeaderDigest, A::Error> {
                let mut digest = 0;
                while let Some(pair) = seq.next_element::<HeaderPair>()? {
                    if let (Some(key), Some(text)) = (pair.0, pair.1) {
                        digest |= header_bits(&key, &text);
                    }
                }
                Ok(HeaderDigest(digest))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<HeaderDigest, E> {
                Ok(HeaderDigest(0))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<HeaderDigest, E> {
                Ok(HeaderDigest(0))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<HeaderDigest, E> {
                Ok(HeaderDigest(0))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<HeaderDigest, E> {
                Ok(HeaderDigest(0))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<HeaderDigest, E> {
                Ok(HeaderDigest(0))
            }
            fn visit_unit<E: de::Error>(self) -> Result<HeaderDigest, E> {
                Ok(HeaderDigest(0))
            }
        }
        deserializer.deserialize_any(Headers)
    }
}

/// One `[key, typed value]` pair of a table in the pair form: the key as text (`None` for one
/// that is not UTF-8, which `--header` cannot name) and the value's text form. Any other JSON
/// in its place has neither.
struct HeaderPair(Option<String>, Option<String>);

impl<'de> Deserialize<'de> for HeaderPair {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Pair;
        impl<'de> Visitor<'de> for Pair {
            type Value = HeaderPair;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a [key, value] pair")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<HeaderPair, A::Error> {
                let key = seq.next_element::<serde_json::Value>()?;
                let value = seq.next_element::<TypedHeader>()?;
                while seq.next_element::<AnyJson>()?.is_some() {}
                let key = match key {
                    Some(serde_json::Value::String(k)) => Some(k),
                    _ => None,
                };
                Ok(HeaderPair(key, value.and_then(|v| v.0)))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<HeaderPair, A::Error> {
                Checked(|| HeaderPair(None, None)).visit_map(map)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<HeaderPair, E> {
                Ok(HeaderPair(None, None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<HeaderPair, E> {
                Ok(HeaderPair(None, None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<HeaderPair, E> {
                Ok(HeaderPair(None, None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<HeaderPair, E> {
                Ok(HeaderPair(None, None))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<HeaderPair, E> {
                Ok(HeaderPair(None, None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<HeaderPair, E> {
                Ok(HeaderPair(None, None))
            }
        }
        deserializer.deserialize_any(Pair)
    }
}

/// A header as the envelope stores it, `{"type": …, "value": …}`: the text form of its value
/// (of the last `"value"`, as a `Value` keeps it). Any other JSON has none.
struct TypedHeader(Option<String>);

impl<'de> Deserialize<'de> for TypedHeader {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Typed;
        impl<'de> Visitor<'de> for Typed {
            type Value = TypedHeader;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a typed header value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TypedHeader, A::Error> {
                let mut text = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key == "value" {
                        text = map.next_value::<HeaderText>()?.0;
                    } else {
                        map.next_value::<AnyJson>()?;
                    }
                }
                Ok(TypedHeader(text))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<TypedHeader, A::Error> {
                Checked(|| TypedHeader(None)).visit_seq(seq)
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<TypedHeader, E> {
                Ok(TypedHeader(None))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<TypedHeader, E> {
                Ok(TypedHeader(None))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<TypedHeader, E> {
                Ok(TypedHeader(None))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<TypedHeader, E> {
                Ok(TypedHeader(None))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<TypedHeader, E> {
                Ok(TypedHeader(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<TypedHeader, E> {
                Ok(TypedHeader(None))
            }
        }
        deserializer.deserialize_any(Typed)
    }
}

/// A header value's text form, if it has one; anything nested is checked without being built.
/// Must agree with `parking::header_text`, which checks the records (a unit test pins it).
#[derive(Default)]
struct HeaderText(Option<String>);

impl<'de> Deserialize<'de> for HeaderText {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Text;
        impl<'de> Visitor<'de> for Text {
            type Value = HeaderText;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HeaderText, E> {
                Ok(HeaderText(Some(v.to_string())))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<HeaderText, E> {
                Ok(HeaderText(Some(v.to_string())))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<HeaderText, E> {
                Ok(HeaderText(Some(v.to_string())))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<HeaderText, E> {
                Ok(HeaderText(Some(v.to_string())))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<HeaderText, E> {
                Ok(HeaderText(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<HeaderText, E> {
                Ok(HeaderText(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<HeaderText, A::Error> {
                Checked(HeaderText::default).visit_seq(seq)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<HeaderText, A::Error> {
                Checked(HeaderText::default).visit_map(map)
            }
        }
        deserializer.deserialize_any(Text)
    }
}

/// The digest bits of one header `key` with text form `text`: three of 128, from one hash. With
/// the dozen headers a parked message typically carries, about 1 row in 100 that lacks a pair
/// still passes; the exact check reads and rejects those. So the digest only decides how much
/// is read, never what matches.
pub fn header_bits(key: &str, text: &str) -> u128 {
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    text.hash(&mut h);
    let h = h.finish();
    (0..3).fold(0u128, |bits, i| bits | 1u128 << ((h >> (i * 7)) & 127))
}

/// One indexed record, decoded from a stream delivery's `type` property and body.
#[derive(Debug, Clone, PartialEq)]
pub enum Indexed {
    /// A parked entry.
    Entry(EntrySummary),
    /// A resolution of an earlier entry.
    Resolution(Resolution),
    /// A marker ([`crate::broker::lot::ParkingLot::mark`]), by id.
    Marker(String),
    /// A parked body stored apart from its envelope ([`crate::model::envelope::BODY_FORMAT`]); read
    /// only when its entry's body is wanted.
    Body,
}

/// The indexed fields of a parked entry.
#[derive(Debug, Clone, PartialEq)]
pub struct EntrySummary {
    /// Reason code.
    pub reason: String,
    /// Destination queue, if known.
    pub destination: Option<String>,
    /// When it was parked, ms since the epoch.
    pub parked_at_ms: u64,
    /// The original `message_id`.
    pub message_id: Option<String>,
    /// The original `correlation_id`.
    pub correlation_id: Option<String>,
    /// The [`header_bits`] of every original header with a text form, or-ed together.
    pub header_digest: u128,
}

/// Decodes what the index needs of one record. A record of neither kind is an error the caller
/// logs and skips.
pub fn decode(kind: Option<&str>, body: &[u8]) -> Result<Indexed, Invalid> {
    if kind == Some(RESOLUTION_FORMAT) {
        let resolution: Resolution =
            serde_json::from_slice(body).map_err(|e| Invalid(format!("invalid resolution: {e}")))?;
        return Ok(Indexed::Resolution(resolution));
    }
    if kind == Some(crate::model::envelope::BODY_FORMAT) {
        return Ok(Indexed::Body);
    }
    if kind == Some(MARKER_FORMAT) {
        let marker: Marker = serde_json::from_slice(body).map_err(|e| Invalid(format!("invalid marker: {e}")))?;
        return Ok(Indexed::Marker(marker.id));
    }
    let mut json = serde_json::Deserializer::from_slice(body);
    json.disable_recursion_limit();
    let summary = Summary::deserialize(serde_stacker::Deserializer::new(&mut json))
        .map_err(|e| Invalid(format!("invalid parked envelope: {e}")))?;
    Ok(Indexed::Entry(EntrySummary {
        reason: summary.reason,
        destination: summary.destination,
        parked_at_ms: summary.parked_at_ms,
        message_id: summary.message.properties.message_id,
        correlation_id: summary.message.properties.correlation_id,
        header_digest: summary.message.properties.headers.0,
    }))
}

/// "No value" in an interned column.
const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Row {
    offset: u64,
    parked_at_ms: u64,
    message_id: u64,
    correlation_id: u64,
    /// [`EntrySummary::header_digest`].
    headers: u128,
    destination: u32,
    reason: u32,
    resolved: bool,
}

#[derive(Debug, Clone, Copy)]
struct CompactResolution {
    action: Action,
    by: u32,
    to: u32,
    at_ms: u64,
}

/// Strings seen in a column, stored once.
#[derive(Debug, Default)]
struct Interner {
    ids: HashMap<String, u32>,
    names: Vec<String>,
}

impl Interner {
    fn intern(&mut self, name: Option<&str>) -> u32 {
        let Some(name) = name else { return NONE };
        if let Some(id) = self.ids.get(name) {
            return *id;
        }
        let id = self.names.len() as u32;
        self.names.push(name.to_string());
        self.ids.insert(name.to_string(), id);
        id
    }

    /// `Some(NONE)` for "must be absent" is not needed: filters only ask for present values.
    fn lookup(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    fn name(&self, id: u32) -> Option<&str> {
        self.names.get(id as usize).map(String::as_str)
    }
}

fn hash(text: Option<&str>) -> u64 {
    let Some(text) = text else { return 0 };
    let mut h = DefaultHasher::new();
    text.hash(&mut h);
    // 0 means "absent"
    h.finish().max(1)
}

/// Entries counted in all, per destination (`-` for none) and per reason; each group largest
/// first, then by name. Serialized as `{"total", "by_destination": [[name, n], ..],
/// "by_reason": [..]}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Counts {
    /// Every entry counted.
    pub total: u64,
    /// Count per destination.
    pub by_destination: Vec<(String, u64)>,
    /// Count per reason.
    pub by_reason: Vec<(String, u64)>,
}

/// Builds [`Counts`] one entry at a time, for entries checked outside the index (header and
/// body searches).
#[derive(Debug, Default)]
pub struct Tally {
    total: u64,
    by_destination: HashMap<String, u64>,
    by_reason: HashMap<String, u64>,
}

impl Tally {
    /// Counts one entry.
    pub fn add(&mut self, destination: Option<&str>, reason: &str) {
        self.total += 1;
        *self
            .by_destination
            .entry(destination.unwrap_or("-").to_string())
            .or_default() += 1;
        *self.by_reason.entry(reason.to_string()).or_default() += 1;
    }

    /// The counts, each group largest first.
    pub fn finish(self) -> Counts {
        Counts {
            total: self.total,
            by_destination: largest_first(self.by_destination),
            by_reason: largest_first(self.by_reason),
        }
    }
}

fn largest_first(counts: impl IntoIterator<Item = (String, u64)>) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = counts.into_iter().collect();
    out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

/// A [`LotIndex`] shared between the task that follows the stream and the requests that read
/// it. Locks are held only for in-memory work, never across an await.
#[derive(Debug, Clone, Default)]
pub struct SharedIndex(Arc<RwLock<LotIndex>>);

impl SharedIndex {
    /// Reads the index. A writer that panicked left it consistent (each apply is one row), so a
    /// poisoned lock is still used.
    pub fn read(&self) -> RwLockReadGuard<'_, LotIndex> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Changes the index.
    pub fn write(&self) -> RwLockWriteGuard<'_, LotIndex> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A page of offsets, newest first, and how many entries matched in all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffsetPage {
    /// Matching entries.
    pub total: u64,
    /// The page's offsets, newest first.
    pub offsets: Vec<u64>,
}

/// The index of one parking lot.
#[derive(Debug, Default)]
pub struct LotIndex {
    rows: VecDeque<Row>,
    /// Rows dropped from the front by [`MAX_INDEXED_ENTRIES`].
    dropped: u64,
    destinations: Interner,
    reasons: Interner,
    people: Interner,
    resolutions: HashMap<u64, CompactResolution>,
    /// The edit audits of replays that edited first, by the offset they resolve: an operator
    /// edits one entry at a time by hand, so these stay few (and leave with their rows).
    edits: HashMap<u64, Box<EditAudit>>,
    /// The offset after the last record applied.
    next: Option<u64>,
    /// The newest [`MARKERS_KEPT`] marker ids applied.
    markers: VecDeque<String>,
}

/// Marker ids an index remembers: an action waits for its own marker within seconds of writing
/// it, and actions on one ladder run one at a time, so a few suffice.
const MARKERS_KEPT: usize = 64;

impl LotIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Where reading must continue: the offset after the last record applied, or `None` before
    /// the first.
    pub fn next_offset(&self) -> Option<u64> {
        self.next
    }

    /// Indexed entries (resolved or not).
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether no entry is indexed.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Entries dropped because of [`MAX_INDEXED_ENTRIES`].
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Applies the record at `offset`. Records are applied in stream order; applying one again
    /// (a follower that resumed a little early) changes nothing.
    pub fn apply(&mut self, offset: u64, record: Indexed) {
        if self.next.is_some_and(|next| offset < next) {
            // Already applied, except a resolution that was applied locally first (see
            // `resolve`), which is idempotent anyway.
            if let Indexed::Resolution(r) = record {
                self.resolve(&r);
            }
            return;
        }
        self.next = Some(offset + 1);
        match record {
            Indexed::Entry(e) => {
                if self.rows.len() >= MAX_INDEXED_ENTRIES
                    && let Some(old) = self.rows.pop_front()
                {
                    self.resolutions.remove(&old.offset);
                    self.edits.remove(&old.offset);
                    self.dropped += 1;
                }
                self.rows.push_back(Row {
                    offset,
                    parked_at_ms: e.parked_at_ms,
                    message_id: hash(e.message_id.as_deref()),
                    correlation_id: hash(e.correlation_id.as_deref()),
                    headers: e.header_digest,
                    destination: self.destinations.intern(e.destination.as_deref()),
                    reason: self.reasons.intern(Some(&e.reason)),
                    resolved: false,
                });
            }
            Indexed::Resolution(r) => self.resolve(&r),
            Indexed::Marker(id) => {
                if self.markers.len() == MARKERS_KEPT {
                    self.markers.pop_front();
                }
                self.markers.push_back(id);
            }
            Indexed::Body => {}
        }
    }

    /// Whether the marker `id` has been applied (so has everything before it).
    pub fn has_marker(&self, id: &str) -> bool {
        self.markers.iter().any(|m| m == id)
    }

    /// Moves past a record that could not be decoded.
    pub fn skip(&mut self, offset: u64) {
        if self.next.is_none_or(|next| offset >= next) {
            self.next = Some(offset + 1);
        }
    }

    /// Records a resolution (the newest wins). The service calls this as soon as its own
    /// resolution is confirmed, before the follower reads it back from the stream.
    pub fn resolve(&mut self, r: &Resolution) {
        let Ok(i) = self.rows.binary_search_by_key(&r.resolves, |row| row.offset) else {
            return;
        };
        self.rows[i].resolved = true;
        let compact = CompactResolution {
            action: r.action,
            by: self.people.intern(Some(&r.by)),
            to: self.destinations.intern(r.to.as_deref()),
            at_ms: r.at_ms,
        };
        let newest = self.resolutions.get(&r.resolves).is_none_or(|old| old.at_ms <= r.at_ms);
        if newest {
            self.resolutions.insert(r.resolves, compact);
            match &r.edit {
                Some(edit) => self.edits.insert(r.resolves, Box::new(edit.clone())),
                None => self.edits.remove(&r.resolves),
            };
        }
    }

    /// How the entry at `offset` was resolved; `Err(())` if no entry is indexed there.
    #[allow(clippy::result_unit_err)]
    pub fn resolution(&self, offset: u64) -> Result<Option<Resolution>, ()> {
        self.rows
            .binary_search_by_key(&offset, |row| row.offset)
            .map_err(|_| ())?;
        Ok(self.resolutions.get(&offset).map(|c| Resolution {
            format: RESOLUTION_FORMAT.to_string(),
            resolves: offset,
            action: c.action,
            by: self.people.name(c.by).unwrap_or("?").to_string(),
            at_ms: c.at_ms,
            to: self.destinations.name(c.to).map(str::to_string),
            edit: self.edits.get(&offset).map(|e| (**e).clone()),
        }))
    }

    /// A predicate over rows for the indexed part of `filter`; `None` if nothing can match (a
    /// destination or reason the index has never seen).
    fn predicate<'a>(&'a self, filter: &'a Filter) -> Option<impl Fn(&Row) -> bool + 'a> {
        let include_resolved = filter.entries == super::filter::Entries::All;
        let lookup = |interner: &Interner, want: &Option<String>| match want {
            None => Some(None),
            Some(name) => interner.lookup(name).map(Some),
        };
        let destination = lookup(&self.destinations, &filter.destination)?;
        let reason = lookup(&self.reasons, &filter.reason)?;
        let message_id = filter.message_id.as_deref().map(|m| hash(Some(m)));
        let correlation_id = filter.correlation_id.as_deref().map(|c| hash(Some(c)));
        let offsets = filter.offsets.as_ref();
        let (since, until) = (filter.since_ms, filter.until_ms);
        // rows that may hold every wanted header (the records are checked exactly afterwards)
        let headers = filter.headers.iter().fold(0u128, |m, (k, v)| m | header_bits(k, v));
        Some(move |row: &Row| {
            (include_resolved || !row.resolved)
                && destination.is_none_or(|d| row.destination == d)
                && reason.is_none_or(|r| row.reason == r)
                && since.is_none_or(|t| row.parked_at_ms >= t)
                && until.is_none_or(|t| row.parked_at_ms <= t)
                && message_id.is_none_or(|m| row.message_id == m)
                && correlation_id.is_none_or(|c| row.correlation_id == c)
                && offsets.is_none_or(|o| o.contains(&row.offset))
                && row.headers & headers == headers
        })
    }

    /// Entries matching the indexed part of `filter` (all of it unless
    /// [`Filter::needs_records`]; for headers, rows that may match): the total, and the offsets
    /// of `limit` of them after skipping the `skip` newest.
    pub fn page(&self, filter: &Filter, skip: usize, limit: usize) -> OffsetPage {
        let Some(matches) = self.predicate(filter) else {
            return OffsetPage {
                total: 0,
                offsets: vec![],
            };
        };
        let mut total = 0u64;
        let mut offsets = Vec::with_capacity(limit.min(1024));
        for row in self.rows.iter().rev().filter(|row| matches(row)) {
            if total >= skip as u64 && offsets.len() < limit {
                offsets.push(row.offset);
            }
            total += 1;
        }
        OffsetPage { total, offsets }
    }

    /// Every offset matching the indexed part of `filter`, oldest first (candidates for a
    /// replay, a discard or a search the index cannot finish).
    pub fn candidates(&self, filter: &Filter) -> Vec<u64> {
        match self.predicate(filter) {
            Some(matches) => self.rows.iter().filter(|r| matches(r)).map(|r| r.offset).collect(),
            None => vec![],
        }
    }

    /// Entries matching the indexed part of `filter` (all of it unless
    /// [`Filter::needs_records`]), counted in all, per destination and per reason.
    pub fn counts(&self, filter: &Filter) -> Counts {
        let Some(matches) = self.predicate(filter) else {
            return Counts::default();
        };
        let mut total = 0;
        let mut by_destination: HashMap<u32, u64> = HashMap::new();
        let mut by_reason: HashMap<u32, u64> = HashMap::new();
        for row in self.rows.iter().filter(|r| matches(r)) {
            total += 1;
            *by_destination.entry(row.destination).or_default() += 1;
            *by_reason.entry(row.reason).or_default() += 1;
        }
        let named = |interner: &Interner, counts: HashMap<u32, u64>| {
            largest_first(
                counts
                    .into_iter()
                    .map(|(id, n)| (interner.name(id).unwrap_or("-").to_string(), n)),
            )
        };
        Counts {
            total,
            by_destination: named(&self.destinations, by_destination),
            by_reason: named(&self.reasons, by_reason),
        }
    }

    /// Unresolved entries in all, per destination and per reason, for an overview.
    pub fn unresolved_counts(&self) -> Counts {
        self.counts(&Filter::default())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn entry(reason: &str, destination: Option<&str>, at: u64, message_id: Option<&str>) -> Indexed {
        Indexed::Entry(EntrySummary {
            reason: reason.into(),
            destination: destination.map(str::to_string),
            parked_at_ms: at,
            message_id: message_id.map(str::to_string),
            correlation_id: None,
            header_digest: 0,
        })
    }

    fn resolution(offset: u64, action: Action, at_ms: u64) -> Indexed {
        Indexed::Resolution(Resolution {
            format: RESOLUTION_FORMAT.into(),
            resolves: offset,
            action,
            by: "ops".into(),
            at_ms,
            to: (action == Action::Replayed).then(|| "orders".to_string()),
            edit: None,
        })
    }

    /// offsets 0..6: entries at 0,1,2,4,5 and a resolution of 1 at offset 3.
    fn index() -> LotIndex {
        let mut ix = LotIndex::new();
        ix.apply(0, entry("max-attempts", Some("orders"), 1_000, Some("m0")));
        ix.apply(1, entry("no-route", Some("billing"), 2_000, Some("m1")));
        ix.apply(2, entry("max-attempts", Some("orders"), 3_000, Some("m2")));
        ix.apply(3, resolution(1, Action::Replayed, 3_500));
        ix.apply(4, entry("invalid-header", None, 4_000, None));
        ix.apply(5, entry("max-attempts", Some("billing"), 5_000, Some("m5")));
        ix
    }

    #[test]
    fn pages_are_newest_first_and_skip_resolved_unless_asked() {
        let ix = index();
        let all = Filter::default();
        assert_eq!(
            ix.page(&all, 0, 10),
            OffsetPage {
                total: 4,
                offsets: vec![5, 4, 2, 0]
            }
        );
        assert_eq!(
            ix.page(
                &all.clone().with_entries(crate::model::lot::filter::Entries::All),
                0,
                10
            )
            .offsets,
            vec![5, 4, 2, 1, 0]
        );
        assert_eq!(
            ix.page(&all, 1, 2),
            OffsetPage {
                total: 4,
                offsets: vec![4, 2]
            }
        );
        assert_eq!(ix.page(&all, 10, 2).offsets, Vec::<u64>::new());
        assert_eq!(ix.next_offset(), Some(6));
    }

    #[test]
    fn indexed_fields_filter() {
        let ix = index();
        let count = |f: Filter| ix.page(&f, 0, 100).total;
        let f = |edit: fn(&mut Filter)| {
            let mut f = Filter::default();
            edit(&mut f);
            f
        };
        assert_eq!(count(f(|f| f.destination = Some("orders".into()))), 2);
        assert_eq!(count(f(|f| f.destination = Some("nowhere".into()))), 0);
        assert_eq!(count(f(|f| f.reason = Some("max-attempts".into()))), 3);
        assert_eq!(count(f(|f| f.reason = Some("no-route".into()))), 0, "resolved");
        assert_eq!(count(f(|f| f.message_id = Some("m2".into()))), 1);
        assert_eq!(count(f(|f| f.message_id = Some("m9".into()))), 0);
        assert_eq!(count(f(|f| f.since_ms = Some(3_000))), 3);
        assert_eq!(count(f(|f| f.until_ms = Some(3_000))), 2);
        assert_eq!(count(f(|f| f.offsets = Some(BTreeSet::from([0, 1, 5])))), 2);
        assert_eq!(ix.candidates(&f(|f| f.destination = Some("billing".into()))), vec![5]);
    }

    #[test]
    fn the_newest_resolution_wins_and_reapplying_changes_nothing() {
        let mut ix = index();
        assert_eq!(ix.resolution(1).unwrap().unwrap().action, Action::Replayed);
        ix.apply(6, resolution(1, Action::Discarded, 9_000));
        assert_eq!(ix.resolution(1).unwrap().unwrap().action, Action::Discarded);
        // a follower resuming early re-applies records it has seen
        ix.apply(2, entry("max-attempts", Some("orders"), 3_000, Some("m2")));
        ix.apply(3, resolution(1, Action::Replayed, 3_500));
        assert_eq!(ix.len(), 5);
        assert_eq!(ix.resolution(1).unwrap().unwrap().action, Action::Discarded);
        assert_eq!(ix.resolution(0).unwrap(), None);
        assert!(
            ix.resolution(3).is_err(),
            "offset 3 is a resolution record, not an entry"
        );
    }

    #[test]
    fn a_local_resolution_counts_before_the_stream_returns_it() {
        let mut ix = index();
        let Indexed::Resolution(r) = resolution(2, Action::Discarded, 6_000) else {
            unreachable!()
        };
        ix.resolve(&r);
        assert_eq!(ix.page(&Filter::default(), 0, 10).offsets, vec![5, 4, 0]);
        ix.apply(7, Indexed::Resolution(r));
        assert_eq!(ix.page(&Filter::default(), 0, 10).total, 3);
    }

    #[test]
    fn markers_are_remembered_and_take_an_offset_but_no_row() {
        let mut ix = index();
        let body = br#"{"format":"ladder.marker/v1","id":"m-1","by":"ops"}"#;
        let marker = decode(Some(MARKER_FORMAT), body).unwrap();
        assert_eq!(marker, Indexed::Marker("m-1".into()));
        assert!(!ix.has_marker("m-1"));
        ix.apply(6, marker);
        assert!(ix.has_marker("m-1") && !ix.has_marker("m-2"));
        assert_eq!((ix.len(), ix.next_offset()), (5, Some(7)));
        for i in 0..MARKERS_KEPT {
            ix.apply(7 + i as u64, Indexed::Marker(format!("x{i}")));
        }
        assert!(!ix.has_marker("m-1"), "only the newest are kept");
    }

    #[test]
    fn counts_group_by_destination_and_reason_largest_first() {
        let counts = index().unresolved_counts();
        assert_eq!(counts.total, 4);
        assert_eq!(
            counts.by_destination,
            vec![("orders".into(), 2), ("-".into(), 1), ("billing".into(), 1)]
        );
        assert_eq!(
            counts.by_reason,
            vec![("max-attempts".into(), 3), ("invalid-header".into(), 1)]
        );
        let billing = Filter {
            destination: Some("billing".into()),
            ..Filter::default()
        };
        let with_resolved = index().counts(&billing.clone().with_entries(crate::model::lot::filter::Entries::All));
        assert_eq!(with_resolved.total, 2);
        assert_eq!(
            with_resolved.by_reason,
            vec![("max-attempts".into(), 1), ("no-route".into(), 1)]
        );
        let nowhere = Filter {
            reason: Some("never-seen".into()),
            ..Filter::default()
        };
        assert_eq!(
            index().counts(&nowhere.clone().with_entries(crate::model::lot::filter::Entries::All)),
            Counts::default()
        );
        // the tally for checked records orders the same way
        let mut tally = Tally::default();
        for (d, r) in [(Some("b"), "x"), (None, "y"), (Some("a"), "x"), (Some("b"), "x")] {
            tally.add(d, r);
        }
        let t = tally.finish();
        assert_eq!(t.total, 4);
        assert_eq!(
            t.by_destination,
            vec![("b".into(), 2), ("-".into(), 1), ("a".into(), 1)]
        );
        assert_eq!(t.by_reason, vec![("x".into(), 3), ("y".into(), 1)]);
    }

    #[test]
    fn decodes_summaries_without_building_headers() {
        let body = br#"{"format":"ladder.parked/v1","reason":"no-route","detail":"d","ladder":"l",
            "destination":"orders","attempts":2,"first_failed_at_ms":1,"parked_at_ms":7,"hop":"due",
            "message":{"exchange":"","routing_key":"q","properties":{"message_id":"m","headers":
            {"deep":{"type":"table","value":{"a":{"type":"table","value":{}}}}}},"body_base64":""}}"#;
        match decode(None, body).unwrap() {
            Indexed::Entry(e) => {
                assert_eq!(e.reason, "no-route");
                assert_eq!(e.destination.as_deref(), Some("orders"));
                assert_eq!(e.parked_at_ms, 7);
                assert_eq!(e.message_id.as_deref(), Some("m"));
                assert_eq!(e.correlation_id, None);
            }
            other => panic!("{other:?}"),
        }
        let r = br#"{"format":"ladder.resolution/v1","resolves":3,"action":"discarded","by":"x","at_ms":1}"#;
        assert!(matches!(
            decode(Some(RESOLUTION_FORMAT), r).unwrap(),
            Indexed::Resolution(_)
        ));
        assert!(decode(None, b"{}").is_err());
    }

    /// The digest must hold every pair the exact check (`parking::header_text`) would accept,
    /// whatever the header's AMQP type: a missing pair would hide a match.
    #[test]
    fn the_header_digest_holds_every_pair_the_exact_check_accepts() {
        use ladder_amqp::{BasicProperties, Decimal, FieldTable, FieldValue as AMQPValue, LongString, ShortString};

        let mut headers = FieldTable::default();
        let mut nested = FieldTable::default();
        nested.set("inner", AMQPValue::LongString(LongString::from("x")));
        let values = [
            ("text", AMQPValue::LongString(LongString::from("acme \"quoted\" ü"))),
            ("negative", AMQPValue::LongLongInt(-42)),
            ("small", AMQPValue::ShortShortUInt(7)),
            ("big", AMQPValue::LongUInt(4_000_000_000)),
            ("flag", AMQPValue::Boolean(true)),
            ("when", AMQPValue::Timestamp(1_763_766_012)),
            ("ratio", AMQPValue::Double(2.0)),
            ("nan", AMQPValue::Float(f32::NAN)),
            ("price", AMQPValue::Decimal(Decimal { scale: 2, value: 1999 })),
            ("bytes", AMQPValue::ByteArray(vec![1u8, 2, 3])),
            ("binary", AMQPValue::LongString(LongString::from(vec![0xff_u8, 0xfe]))),
            ("list", AMQPValue::FieldArray(vec![AMQPValue::LongLongInt(1)])),
            ("table", AMQPValue::FieldTable(nested)),
            ("void", AMQPValue::Void),
        ];
        for (k, v) in values {
            headers.set(k, v);
        }
        let props = BasicProperties {
            headers: Some(headers),
            ..Default::default()
        };
        let envelope = crate::model::envelope::Envelope {
            format: crate::model::envelope::FORMAT.into(),
            reason: "max-attempts".into(),
            detail: String::new(),
            ladder: "l".into(),
            destination: Some("orders".into()),
            attempts: Some(1),
            first_failed_at_ms: None,
            history: vec![],
            replayed_from: None,
            parked_at_ms: 1,
            hop: "due".into(),
            message: crate::model::envelope::OriginalMessage::capture("", "orders", &props, b"{}"),
        };
        let body = serde_json::to_vec(&envelope).unwrap();
        let Indexed::Entry(summary) = decode(None, &body).unwrap() else {
            panic!("not an entry")
        };
        let json = &envelope.message.properties["headers"];
        let mut with_text = vec![];
        for (key, typed) in json.as_object().unwrap() {
            if let Some(text) = crate::model::lot::filter::header_text(Some(typed)) {
                let bits = header_bits(key, &text);
                assert_eq!(
                    summary.header_digest & bits,
                    bits,
                    "{key}={text} is missing from the digest"
                );
                with_text.push(key.as_str());
            }
        }
        with_text.sort_unstable();
        // the pairs the exact check can match: not the float, decimal, bytes, list, table, void
        assert_eq!(with_text, ["big", "flag", "nan", "negative", "small", "text", "when"]);

        // the same with a key that is not UTF-8, which stores the table as [key, value] pairs
        let mut odd = props.clone();
        if let Some(h) = odd.headers.as_mut() {
            h.insert(ShortString::new(&b"k\xff"[..]).unwrap(), AMQPValue::LongInt(1));
        }
        let envelope = crate::model::envelope::Envelope {
            message: crate::model::envelope::OriginalMessage::capture("", "orders", &odd, b"{}"),
            ..envelope
        };
        let json = &envelope.message.properties["headers"];
        assert!(json.is_array());
        let Indexed::Entry(summary) = decode(None, &serde_json::to_vec(&envelope).unwrap()).unwrap() else {
            panic!("not an entry")
        };
        let mut with_text = 0;
        // a key that is not UTF-8 cannot be named by `--header`, so it needs no bits
        for (key, typed) in crate::model::envelope::table_entries(json)
            .into_iter()
            .filter(|(k, _)| !k.contains('\u{fffd}'))
        {
            if let Some(text) = crate::model::lot::filter::header_text(Some(typed)) {
                let bits = header_bits(&key, &text);
                assert_eq!(
                    summary.header_digest & bits,
                    bits,
                    "{key}={text} is missing from the digest"
                );
                with_text += 1;
            }
        }
        assert_eq!(with_text, 7);
        // an envelope without headers, or with `null`, has an empty digest
        let bare = br#"{"format":"ladder.parked/v1","reason":"r","detail":"","ladder":"l","destination":null,
            "attempts":null,"first_failed_at_ms":null,"parked_at_ms":1,"hop":"due","message":{"exchange":"",
            "routing_key":"q","properties":{"headers":null},"body_base64":""}}"#;
        let Indexed::Entry(summary) = decode(None, bare).unwrap() else {
            panic!("not an entry")
        };
        assert_eq!(summary.header_digest, 0);
    }

    #[test]
    fn a_header_filter_narrows_the_candidates_without_losing_one() {
        let mut ix = LotIndex::new();
        for i in 0..10_000u64 {
            let tenant = format!("t{}", i % 100);
            let digest = header_bits("tenant", &tenant) | header_bits("retry-attempt", &(i % 8).to_string());
            ix.apply(
                i,
                Indexed::Entry(EntrySummary {
                    reason: "max-attempts".into(),
                    destination: Some("orders".into()),
                    parked_at_ms: i,
                    message_id: None,
                    correlation_id: None,
                    header_digest: digest,
                }),
            );
        }
        let f = Filter {
            headers: vec![("tenant".into(), "t7".into())],
            ..Filter::default()
        };
        let candidates = ix.candidates(&f);
        let exact: Vec<u64> = (0..10_000).filter(|i| i % 100 == 7).collect();
        assert!(
            exact.iter().all(|o| candidates.binary_search(o).is_ok()),
            "a true match was filtered out"
        );
        // 100 true matches; rows with two pairs (6 of 128 bits) let almost nothing else through
        assert!(candidates.len() < 200, "{} candidates", candidates.len());
        let none = Filter {
            headers: vec![("tenant".into(), "nobody".into())],
            ..Filter::default()
        };
        assert!(ix.candidates(&none).len() < 100);
    }

    #[test]
    fn a_million_rows_stay_compact_and_fast() {
        let mut ix = LotIndex::new();
        for i in 0..1_000_000u64 {
            let destination = format!("queue-{}", i % 50);
            let id = format!("m{i}");
            ix.apply(i, entry("max-attempts", Some(&destination), i, Some(&id)));
        }
        assert_eq!(std::mem::size_of::<Row>(), 64);
        let f = Filter {
            destination: Some("queue-7".into()),
            ..Filter::default()
        };
        let page = ix.page(&f, 0, 50);
        assert_eq!(page.total, 20_000);
        assert_eq!(page.offsets[0], 999_957);
        let by_id = Filter {
            message_id: Some("m123456".into()),
            ..Filter::default()
        };
        assert_eq!(ix.page(&by_id, 0, 50).offsets, vec![123_456]);
    }

    mod properties {
        use proptest::collection::vec;
        use proptest::prelude::*;
        use proptest::sample::{Index, select};
        use serde_json::Value;

        use super::*;
        use crate::model::envelope::{self, BODY_FORMAT, Envelope, FORMAT, testing};
        use crate::model::lot::filter::header_text;

        /// Field names at each level of a stored envelope: top, `message`, `message.properties`.
        const FIELDS: [&[&str]; 3] = [
            &[
                "format",
                "reason",
                "detail",
                "ladder",
                "destination",
                "attempts",
                "first_failed_at_ms",
                "history",
                "replayed_from",
                "parked_at_ms",
                "hop",
                "message",
                "extra",
            ],
            &[
                "exchange",
                "exchange_base64",
                "routing_key",
                "routing_key_base64",
                "properties",
                "body_base64",
                "body_record",
            ],
            &["message_id", "correlation_id", "headers", "priority", "raw_base64"],
        ];

        /// A change to a stored envelope: at a level, a field removed (`None`) or set to any JSON.
        type Edit = (usize, Index, Option<Value>);

        /// A byte-level change: overwrite, insert or remove a byte, or cut the text there.
        type ByteEdit = (u8, Index, u8);

        fn edit_json(value: &mut Value, (level, field, to): Edit) {
            let target = match level {
                0 => Some(value),
                1 => value.get_mut("message"),
                _ => value.get_mut("message").and_then(|m| m.get_mut("properties")),
            };
            let Some(Value::Object(map)) = target else { return };
            let key = *field.get(FIELDS[level]);
            match to {
                Some(v) => {
                    map.insert(key.into(), v);
                }
                None => {
                    map.shift_remove(key);
                }
            }
        }

        fn edit_bytes(bytes: &mut Vec<u8>, (how, at, byte): ByteEdit) {
            if bytes.is_empty() {
                return;
            }
            let i = at.index(bytes.len());
            match how % 4 {
                0 => bytes[i] = byte,
                1 => bytes.insert(i, byte),
                2 => {
                    bytes.remove(i);
                }
                _ => bytes.truncate(i),
            }
        }

        /// A stored envelope's body, perhaps changed by [`Edit`]s and [`ByteEdit`]s.
        fn record() -> impl Strategy<Value = Vec<u8>> {
            let edit = (0usize..3, any::<Index>(), proptest::option::of(testing::json_value()));
            let byte_edit = (any::<u8>(), any::<Index>(), any::<u8>());
            (testing::envelope(), vec(edit, 0..3), vec(byte_edit, 0..3)).prop_map(|(e, edits, byte_edits)| {
                let mut value = serde_json::to_value(&e).unwrap();
                for edit in edits {
                    edit_json(&mut value, edit);
                }
                let mut bytes = serde_json::to_vec(&value).unwrap();
                for edit in byte_edits {
                    edit_bytes(&mut bytes, edit);
                }
                bytes
            })
        }

        /// `type` properties a record may have.
        fn kind() -> impl Strategy<Value = Option<&'static str>> {
            proptest::option::of(select(
                &[FORMAT, RESOLUTION_FORMAT, MARKER_FORMAT, BODY_FORMAT, "other/v1", ""][..],
            ))
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

            /// No record, whatever its type and bytes, makes decoding panic.
            #[test]
            fn decoding_never_panics(kind in kind(), bytes in vec(any::<u8>(), 0..512)) {
                let _ = decode(kind, &bytes);
            }

            /// The index takes a record for an entry exactly when reading it back as an envelope
            /// succeeds (otherwise it counts entries nobody can show, or hides ones that can be),
            /// and what it keeps of it agrees with the envelope: the fields it filters on, and a
            /// header digest holding every header a `--header` filter could match.
            #[test]
            fn the_index_and_the_envelope_agree_on_every_record(bytes in record(), kind in kind()) {
                let indexed = decode(kind, &bytes);
                if matches!(kind, Some(RESOLUTION_FORMAT | MARKER_FORMAT | BODY_FORMAT)) {
                    // never read as an entry, by the index or by fetching
                    prop_assert!(!matches!(indexed, Ok(Indexed::Entry(_))));
                    return Ok(());
                }
                let read = Envelope::from_slice(&bytes);
                prop_assert_eq!(
                    matches!(indexed, Ok(Indexed::Entry(_))),
                    read.is_ok(),
                    "index: {:?}\nenvelope: {:?}\nrecord: {}",
                    indexed.as_ref().err(),
                    read.as_ref().err(),
                    String::from_utf8_lossy(&bytes)
                );
                let (Ok(Indexed::Entry(summary)), Ok(e)) = (indexed, read) else { return Ok(()) };
                prop_assert_eq!(&summary.reason, &e.reason);
                prop_assert_eq!(&summary.destination, &e.destination);
                prop_assert_eq!(summary.parked_at_ms, e.parked_at_ms);
                let props = &e.message.properties;
                let text = |name: &str| props.get(name).and_then(envelope::short_text);
                prop_assert_eq!(&summary.message_id, &text("message_id"));
                prop_assert_eq!(&summary.correlation_id, &text("correlation_id"));
                if let Some(headers) = props.get("headers") {
                    for (key, _) in envelope::table_entries(headers) {
                        let wanted = header_text(envelope::table_get(headers, &key));
                        if let Some(wanted) = wanted {
                            let bits = header_bits(&key, &wanted);
                            prop_assert_eq!(summary.header_digest & bits, bits, "{}={}", key, wanted);
                        }
                    }
                }
            }
        }
    }
}
