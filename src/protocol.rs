//! The header protocol: what a failed message must carry, what the ladder sets on it, and the
//! decision for each hop — forward it (to a tier, or to its destination) or park it and why.
//!
//! Pure: it reads properties and a clock value handed in, and returns new properties. It never
//! touches the broker, so every rule here is unit-tested (and can be fuzzed) without one.
//! It must never panic on any input: every value type a client can send ends in a decision.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::time::Duration;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use serde::{Deserialize, Serialize};

use crate::config::Limits;
use crate::ladder::LadderSpec;
use crate::topology::Names;

/// Header names of the protocol. No `x-` prefix: that belongs to the broker.
pub mod header {
    /// The queue to redeliver to (consumer sets it; the ladder keeps it).
    pub const RETRY_TO: &str = "retry-to";
    /// Why it failed (consumer, optional; truncated).
    pub const RETRY_REASON: &str = "retry-reason";
    /// Minimum delay wanted: integer ms or a humantime string (consumer, optional; consumed).
    pub const RETRY_DELAY: &str = "retry-delay";
    /// 1 on the first retry (ladder).
    pub const RETRY_ATTEMPT: &str = "retry-attempt";
    /// Ms since the epoch of the first failure (ladder).
    pub const RETRY_FIRST_FAILED_AT: &str = "retry-first-failed-at";
    /// The ladder that scheduled it (ladder).
    pub const RETRY_LADDER: &str = "retry-ladder";
    /// The tier it waited in (ladder).
    pub const RETRY_TIER: &str = "retry-tier";
    /// Ms since the epoch when it is due back (ladder).
    pub const RETRY_DUE_AT: &str = "retry-due-at";
    /// The `user_id` property of the failed message, moved here (ladder).
    pub const RETRY_ORIGINAL_USER_ID: &str = "retry-original-user-id";
    /// The broker's dead-letter history.
    pub const X_DEATH: &str = "x-death";
    /// Set on a message replayed from the parking lot: `<stream>@<offset>` of its parked record.
    pub const RETRY_REPLAYED_FROM: &str = "retry-replayed-from";
    /// The attempt history (ladder): a long string of `<attempt>:<tier>:<failed_at_ms>` entries
    /// joined by `,`, oldest first, one appended per retry scheduled, at most
    /// [`super::MAX_HISTORY_ENTRIES`] (the newest). Tier names are compact durations (digits and
    /// `h`, `m`, `s`), so neither separator can occur in one. Informational: read leniently,
    /// never a reason to park; kept across replays (lineage).
    pub const RETRY_HISTORY: &str = "retry-history";
}

/// Tables nested deeper than this are refused as `invalid-header`; it bounds recursion.
pub const MAX_HEADER_DEPTH: usize = 32;

/// `retry-history` keeps only this many entries, the newest. 16 covers every retry of a
/// typical ladder, and of a replay or two, while bounding the header however often a message
/// fails: an entry is at most 59 bytes with its comma (a 20-digit attempt, a tier name of at
/// most [`MAX_HISTORY_TIER_BYTES`], a 20-digit time; a real one is about 25), so the header stays
/// under 1 KB, a small share of the default 16 KiB `max_header_bytes`.
pub const MAX_HISTORY_ENTRIES: usize = 16;

/// A `retry-history` entry whose tier name is longer than this is dropped as garbage. The
/// longest real tier name is 15 bytes (`1193h2m47s295ms`, the largest TTL RabbitMQ accepts); the
/// bound keeps a forged entry from bloating every later hop and the parked record.
const MAX_HISTORY_TIER_BYTES: usize = 16;

/// `retry-replayed-from` is a stream name (at most 255 bytes), `@` and a `u64` offset (at most
/// 20 digits); a longer value is cut to this before it is copied into a park decision.
const MAX_REPLAYED_FROM_BYTES: usize = 255 + 1 + 20;

/// One retry the ladder scheduled: which attempt, in which tier, and when the failure came in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryEntry {
    /// The retry number (`retry-attempt` as sent).
    pub attempt: u64,
    /// The tier it waited in.
    pub tier: String,
    /// When the intake received the failure, ms since the epoch.
    pub failed_at_ms: u64,
}

/// Why a message went to the parking lot. The codes are a documented, closed set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParkReason {
    /// Its ladder was exhausted.
    MaxAttempts,
    /// Neither `retry-to` nor an `x-death` entry names a queue.
    NoDestination,
    /// The destination is outside the ladder's allow-list (or inside the ladder's namespace).
    DestinationNotAllowed,
    /// The broker returned the publish: the destination (or a tier) queue does not exist.
    NoRoute,
    /// A protocol header has the wrong type or value.
    InvalidHeader,
    /// The headers are larger than `max_header_bytes`.
    HeaderTooLarge,
}

impl ParkReason {
    /// Every reason, for documentation and metrics.
    pub const ALL: [ParkReason; 6] = [
        ParkReason::MaxAttempts,
        ParkReason::NoDestination,
        ParkReason::DestinationNotAllowed,
        ParkReason::NoRoute,
        ParkReason::InvalidHeader,
        ParkReason::HeaderTooLarge,
    ];

    /// The stable code stored in the parking lot.
    pub fn code(self) -> &'static str {
        match self {
            ParkReason::MaxAttempts => "max-attempts",
            ParkReason::NoDestination => "no-destination",
            ParkReason::DestinationNotAllowed => "destination-not-allowed",
            ParkReason::NoRoute => "no-route",
            ParkReason::InvalidHeader => "invalid-header",
            ParkReason::HeaderTooLarge => "header-too-large",
        }
    }
}

impl fmt::Display for ParkReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// A decision to park, with what is known about the message.
#[derive(Debug, Clone, PartialEq)]
pub struct Park {
    /// The reason code.
    pub reason: ParkReason,
    /// A human-readable explanation.
    pub detail: String,
    /// The destination, if one could be read.
    pub destination: Option<String>,
    /// Retries already made (`retry-attempt` as received), if readable.
    pub attempts: Option<u64>,
    /// `retry-first-failed-at` as received, if readable.
    pub first_failed_at_ms: Option<u64>,
    /// `retry-history` as received: the readable entries, oldest first.
    pub history: Vec<HistoryEntry>,
    /// `retry-replayed-from` as received: the parked record it was replayed from, if any.
    pub replayed_from: Option<String>,
}

/// A decision to republish.
#[derive(Debug, Clone)]
pub struct Forward {
    /// Exchange to publish to (`""` for the default exchange).
    pub exchange: String,
    /// Routing key: the tier name on intake, the destination queue on due.
    pub routing_key: String,
    /// Properties to publish with (persistent; broker headers stripped).
    pub properties: BasicProperties,
    /// Where the message is finally headed.
    pub destination: String,
    /// The retry number (`retry-attempt` as sent).
    pub attempt: u64,
    /// Due hop: how late the message is against `retry-due-at`, in ms (0 if early or unknown).
    pub late_ms: u64,
}

/// What to do with one delivery.
#[derive(Debug, Clone)]
pub enum Decision {
    /// Republish, then ack the delivery once confirmed.
    Forward(Box<Forward>),
    /// Park, then ack the delivery once the park is confirmed.
    Park(Park),
}

/// What one hop needs to decide: the ladder, its names, the bounds.
#[derive(Debug, Clone)]
pub struct HopContext<'a> {
    /// The ladder.
    pub spec: &'a LadderSpec,
    /// Its names.
    pub names: &'a Names,
    /// Bounds.
    pub limits: &'a Limits,
}

impl HopContext<'_> {
    /// Intake: validate, count the attempt, pick the tier — or park.
    pub fn intake(&self, props: &BasicProperties, now_ms: u64) -> Decision {
        let empty = FieldTable::default();
        let headers = props.headers().as_ref().unwrap_or(&empty);
        let h = headers.inner();
        // Read what can be read before validating, so every park record says where the
        // message was headed (operators search the parking lot by destination).
        let destination = match h.get(header::RETRY_TO) {
            Some(value) => check_queue_name(value),
            None => newest_death_queue(h).ok_or_else(|| {
                format!(
                    "no {} header and no x-death entry naming the queue it failed in",
                    header::RETRY_TO
                )
            }),
        };
        let known_destination = destination.as_ref().ok().cloned();
        let mut history = carried_history(h);

        if let Some((reason, detail)) = self.check_size(headers) {
            return Decision::Park(Park {
                reason,
                detail,
                destination: known_destination,
                attempts: None,
                first_failed_at_ms: None,
                history,
                replayed_from: carried_replayed_from(h),
            });
        }
        let previous = match optional_u64(h, header::RETRY_ATTEMPT) {
            Ok(n) => n.unwrap_or(0),
            Err(problem) => {
                return Decision::Park(Park {
                    reason: ParkReason::InvalidHeader,
                    detail: problem,
                    destination: known_destination,
                    attempts: None,
                    first_failed_at_ms: None,
                    history,
                    replayed_from: carried_replayed_from(h),
                });
            }
        };
        let first_failed_at = optional_u64(h, header::RETRY_FIRST_FAILED_AT).ok().flatten();
        let park = |reason, detail: String, destination: Option<String>| {
            Decision::Park(Park {
                reason,
                detail,
                destination,
                attempts: Some(previous),
                first_failed_at_ms: first_failed_at,
                history: history.clone(),
                replayed_from: carried_replayed_from(h),
            })
        };
        let destination = match destination {
            Ok(queue) => queue,
            Err(problem) if h.contains_key(header::RETRY_TO) => {
                return park(ParkReason::InvalidHeader, problem, None);
            }
            Err(problem) => return park(ParkReason::NoDestination, problem, None),
        };
        if let Some(detail) = self.refuse_destination(&destination) {
            return park(ParkReason::DestinationNotAllowed, detail, Some(destination));
        }
        let min_delay = match h.get(header::RETRY_DELAY).map(parse_delay) {
            None => None,
            Some(Ok(delay)) => Some(delay),
            Some(Err(problem)) => return park(ParkReason::InvalidHeader, problem, Some(destination)),
        };
        let reason = match h.get(header::RETRY_REASON) {
            None => None,
            Some(value) => match as_text(value) {
                Some(text) => Some(truncate(text, self.limits.max_reason_bytes)),
                None => {
                    let problem = format!("{} must be a string, got {}", header::RETRY_REASON, describe(value));
                    return park(ParkReason::InvalidHeader, problem, Some(destination));
                }
            },
        };
        let attempt = previous.saturating_add(1);
        if attempt > u64::from(self.spec.max_attempts) {
            let detail = format!(
                "failed after {previous} retries; ladder {} allows {}",
                self.spec.name, self.spec.max_attempts
            );
            return park(ParkReason::MaxAttempts, detail, Some(destination));
        }

        let tier = self.spec.choose_tier(attempt as u32, min_delay);
        let mut out = republished_headers(h);
        out.remove(header::RETRY_DELAY);
        if let Some(reason) = reason {
            out.insert(header::RETRY_REASON.into(), long_string(&reason));
        }
        if let Some(user) = props.user_id() {
            out.insert(header::RETRY_ORIGINAL_USER_ID.into(), long_string(user.as_str()));
        }
        out.insert(header::RETRY_TO.into(), long_string(&destination));
        out.insert(header::RETRY_ATTEMPT.into(), AMQPValue::LongLongInt(attempt as i64));
        out.insert(
            header::RETRY_FIRST_FAILED_AT.into(),
            AMQPValue::LongLongInt(first_failed_at.unwrap_or(now_ms) as i64),
        );
        out.insert(header::RETRY_LADDER.into(), long_string(&self.spec.name));
        out.insert(header::RETRY_TIER.into(), long_string(&tier.name));
        out.insert(
            header::RETRY_DUE_AT.into(),
            AMQPValue::LongLongInt(now_ms.saturating_add(tier.ttl_ms()) as i64),
        );
        history.push(HistoryEntry {
            attempt,
            tier: tier.name.clone(),
            failed_at_ms: now_ms,
        });
        out.insert(header::RETRY_HISTORY.into(), format_history(&history));
        Decision::Forward(Box::new(Forward {
            exchange: self.names.tiers_exchange.clone(),
            routing_key: tier.name.clone(),
            properties: republished_properties(props, out),
            destination,
            attempt,
            late_ms: 0,
        }))
    }

    /// Due: check the destination again (the allow-list may have changed) and strip what the
    /// tier's dead-lettering added — or park.
    pub fn due(&self, props: &BasicProperties, now_ms: u64) -> Decision {
        let empty = FieldTable::default();
        let headers = props.headers().as_ref().unwrap_or(&empty);
        let h = headers.inner();
        let attempts = optional_u64(h, header::RETRY_ATTEMPT).ok().flatten();
        let first_failed_at = optional_u64(h, header::RETRY_FIRST_FAILED_AT).ok().flatten();
        let park = |reason, detail: String, destination: Option<String>| {
            Decision::Park(Park {
                reason,
                detail,
                destination,
                attempts,
                first_failed_at_ms: first_failed_at,
                history: carried_history(h),
                replayed_from: carried_replayed_from(h),
            })
        };
        let destination = match h.get(header::RETRY_TO).map(check_queue_name) {
            Some(Ok(queue)) => queue,
            Some(Err(problem)) => return park(ParkReason::InvalidHeader, problem, None),
            None => {
                let detail = format!("due message without a {} header", header::RETRY_TO);
                return park(ParkReason::NoDestination, detail, None);
            }
        };
        // Only the intake checks headers, but anyone allowed to publish to the tiers exchange
        // could bypass it.
        if let Some((reason, detail)) = self.check_size(headers) {
            return park(reason, detail, Some(destination));
        }
        if let Some(detail) = self.refuse_destination(&destination) {
            return park(ParkReason::DestinationNotAllowed, detail, Some(destination));
        }
        let due_at = optional_u64(h, header::RETRY_DUE_AT).ok().flatten();
        Decision::Forward(Box::new(Forward {
            exchange: String::new(),
            routing_key: destination.clone(),
            properties: republished_properties(props, republished_headers(h)),
            destination,
            attempt: attempts.unwrap_or(0),
            late_ms: due_at.map_or(0, |due| now_ms.saturating_sub(due)),
        }))
    }

    fn check_size(&self, headers: &FieldTable) -> Option<(ParkReason, String)> {
        match encoded_table_size(headers, 0) {
            Err(TooDeep) => Some((
                ParkReason::InvalidHeader,
                format!("headers nest deeper than {MAX_HEADER_DEPTH} levels"),
            )),
            Ok(size) if size > self.limits.max_header_bytes => Some((
                ParkReason::HeaderTooLarge,
                format!(
                    "headers take {size} bytes, above max_header_bytes = {}",
                    self.limits.max_header_bytes
                ),
            )),
            Ok(_) => None,
        }
    }

    /// Why the ladder may not deliver to `queue`, or `None` if it may.
    fn refuse_destination(&self, queue: &str) -> Option<String> {
        refuse_destination(self.spec, self.names, queue)
    }
}

/// Why ladder `spec` (named `names`) may not deliver to `queue`, or `None` if it may: the queue
/// lies in the ladder's namespace or the broker's (`amq.`), or matches none of its `allow`
/// regexes. The one rule for the due hop and for replays from the parking lot.
pub fn refuse_destination(spec: &LadderSpec, names: &Names, queue: &str) -> Option<String> {
    if queue.starts_with(&names.prefix) || queue.starts_with("amq.") {
        return Some(format!("{queue:?} belongs to the ladder's namespace or the broker"));
    }
    (!spec.allows(queue)).then(|| format!("{queue:?} is not in the allow-list of ladder {}", spec.name))
}

/// Headers the ladder sets for one pass through it; a replay from the parking lot removes them
/// so the message starts a fresh attempt count. `retry-first-failed-at` and `retry-history`
/// stay: they are lineage (after a replay the history's attempts start again at 1, so its
/// entries are told apart by their times).
const PER_PASS_HEADERS: [&str; 5] = [
    header::RETRY_ATTEMPT,
    header::RETRY_DUE_AT,
    header::RETRY_TIER,
    header::RETRY_DELAY,
    header::RETRY_LADDER,
];

/// Properties to replay a parked message with: the same stripping as every republish (broker
/// headers, `expiration`, `user_id` moved to `retry-original-user-id`, persistent), minus the
/// per-pass ladder headers ([`PER_PASS_HEADERS`]) so the attempt count starts again (lineage:
/// `retry-first-failed-at` and `retry-history` stay), plus `extra` headers (the caller's
/// lineage, e.g. `retry-replayed-from`).
pub fn replay_properties(props: &BasicProperties, extra: &[(&str, AMQPValue)]) -> BasicProperties {
    let empty = FieldTable::default();
    let headers = props.headers().as_ref().unwrap_or(&empty);
    let mut out = republished_headers(headers.inner());
    for key in PER_PASS_HEADERS {
        out.remove(key);
    }
    if let Some(user) = props.user_id() {
        out.insert(header::RETRY_ORIGINAL_USER_ID.into(), long_string(user.as_str()));
    }
    for (key, value) in extra {
        out.insert((*key).into(), value.clone());
    }
    republished_properties(props, out)
}

/// The `retry-history` that `props` carry, read as leniently as [`parse_history`] (empty when
/// absent). For park records made outside a hop's decision, such as a returned publish.
pub fn history_of(props: &BasicProperties) -> Vec<HistoryEntry> {
    props
        .headers()
        .as_ref()
        .map_or_else(Vec::new, |h| carried_history(h.inner()))
}

/// The `retry-replayed-from` that `props` carry, if it is text (cut to a bounded length).
pub fn replayed_from_of(props: &BasicProperties) -> Option<String> {
    props.headers().as_ref().and_then(|h| carried_replayed_from(h.inner()))
}

fn carried_history(h: &BTreeMap<ShortString, AMQPValue>) -> Vec<HistoryEntry> {
    h.get(header::RETRY_HISTORY).map_or_else(Vec::new, parse_history)
}

fn carried_replayed_from(h: &BTreeMap<ShortString, AMQPValue>) -> Option<String> {
    h.get(header::RETRY_REPLAYED_FROM)
        .and_then(as_text)
        .map(|text| truncate(text, MAX_REPLAYED_FROM_BYTES))
}

/// Reads a `retry-history` value: its newest [`MAX_HISTORY_ENTRIES`] readable entries, oldest
/// first. Lenient, because the history only informs operators: a value that is not text gives
/// no entries, and an entry that does not parse is skipped while the others are kept.
pub fn parse_history(value: &AMQPValue) -> Vec<HistoryEntry> {
    let Some(text) = as_text(value) else {
        return Vec::new();
    };
    // From the end, so the newest entries are kept and a long forged value is not read whole.
    let mut entries: Vec<HistoryEntry> = text
        .rsplit(',')
        .filter_map(parse_history_entry)
        .take(MAX_HISTORY_ENTRIES)
        .collect();
    entries.reverse();
    entries
}

fn parse_history_entry(entry: &str) -> Option<HistoryEntry> {
    let mut parts = entry.trim().split(':');
    let (attempt, tier, failed_at) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some()
        || tier.is_empty()
        || tier.len() > MAX_HISTORY_TIER_BYTES
        || !tier.bytes().all(|b| b.is_ascii_alphanumeric())
    {
        return None;
    }
    Some(HistoryEntry {
        attempt: attempt.parse().ok()?,
        tier: tier.to_string(),
        failed_at_ms: failed_at.parse().ok()?,
    })
}

/// The `retry-history` value for `entries` (oldest first): a long string of the newest
/// [`MAX_HISTORY_ENTRIES`], `<attempt>:<tier>:<failed_at_ms>` joined by `,`.
pub fn format_history(entries: &[HistoryEntry]) -> AMQPValue {
    let newest = &entries[entries.len().saturating_sub(MAX_HISTORY_ENTRIES)..];
    let mut text = String::with_capacity(newest.len() * 32);
    for (i, e) in newest.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        let _ = write!(text, "{}:{}:{}", e.attempt, e.tier, e.failed_at_ms);
    }
    long_string(&text)
}

/// A `retry-to` value as a queue name, or what is wrong with it.
fn check_queue_name(value: &AMQPValue) -> Result<String, String> {
    match as_text(value) {
        Some("") => Err(format!("{} is empty", header::RETRY_TO)),
        Some(name) if name.len() > 255 => Err(format!(
            "{} is {} bytes long; queue names have at most 255",
            header::RETRY_TO,
            name.len()
        )),
        Some(name) => Ok(name.to_string()),
        None => Err(format!(
            "{} must be a queue name string, got {}",
            header::RETRY_TO,
            describe(value)
        )),
    }
}

/// Headers the broker owns or that route copies elsewhere; removed before every republish.
fn is_stripped(key: &str) -> bool {
    matches!(key, "x-death" | "CC" | "BCC" | "x-delivery-count")
        || key.starts_with("x-first-death-")
        || key.starts_with("x-last-death-")
}

fn republished_headers(headers: &BTreeMap<ShortString, AMQPValue>) -> BTreeMap<ShortString, AMQPValue> {
    headers
        .iter()
        .filter(|(k, _)| !is_stripped(k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Copies `props` without `expiration` and `user_id` (a `user_id` that is not ours would make the
/// broker close the channel), persistent, with `headers`.
fn republished_properties(props: &BasicProperties, headers: BTreeMap<ShortString, AMQPValue>) -> BasicProperties {
    let mut out = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(FieldTable::from(headers));
    if let Some(v) = props.content_type() {
        out = out.with_content_type(v.clone());
    }
    if let Some(v) = props.content_encoding() {
        out = out.with_content_encoding(v.clone());
    }
    if let Some(v) = props.priority() {
        out = out.with_priority(*v);
    }
    if let Some(v) = props.correlation_id() {
        out = out.with_correlation_id(v.clone());
    }
    if let Some(v) = props.reply_to() {
        out = out.with_reply_to(v.clone());
    }
    if let Some(v) = props.message_id() {
        out = out.with_message_id(v.clone());
    }
    if let Some(v) = props.timestamp() {
        out = out.with_timestamp(*v);
    }
    if let Some(v) = props.kind() {
        out = out.with_type(v.clone());
    }
    if let Some(v) = props.app_id() {
        out = out.with_app_id(v.clone());
    }
    if let Some(v) = props.cluster_id() {
        out = out.with_cluster_id(v.clone());
    }
    out
}

/// A header value as a long string (RabbitMQ rejects short strings in tables).
pub fn long_string(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes()))
}

/// Text from a long string, short string or UTF-8 byte array.
pub fn as_text(value: &AMQPValue) -> Option<&str> {
    match value {
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str()),
        AMQPValue::ByteArray(b) => std::str::from_utf8(b.as_slice()).ok(),
        _ => None,
    }
}

/// A non-negative integer of any AMQP integer width (or an integral float, as JavaScript sends).
pub fn as_u64(value: &AMQPValue) -> Option<u64> {
    let signed = |n: i64| u64::try_from(n).ok();
    match value {
        AMQPValue::ShortShortInt(n) => signed(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::ShortInt(n) => signed(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongInt(n) => signed(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(u64::from(*n)),
        AMQPValue::LongLongInt(n) => signed(*n),
        AMQPValue::Double(f) if f.fract() == 0.0 && *f >= 0.0 && *f < 9.0e15 => Some(*f as u64),
        AMQPValue::Float(f) if f.fract() == 0.0 && *f >= 0.0 && *f < 1.6e7 => Some(*f as u64),
        _ => None,
    }
}

fn optional_u64(h: &BTreeMap<ShortString, AMQPValue>, key: &str) -> Result<Option<u64>, String> {
    match h.get(key) {
        None => Ok(None),
        Some(value) => as_u64(value)
            .map(Some)
            .ok_or_else(|| format!("{key} must be a non-negative integer, got {}", describe(value))),
    }
}

/// `retry-delay`: integer milliseconds, or a string of digits (ms) or humantime (`30s`).
pub fn parse_delay(value: &AMQPValue) -> Result<Duration, String> {
    if let Some(ms) = as_u64(value) {
        return Ok(Duration::from_millis(ms));
    }
    let bad = || {
        format!(
            "{} must be integer milliseconds or a duration like \"30s\", got {}",
            header::RETRY_DELAY,
            describe(value)
        )
    };
    let text = as_text(value).ok_or_else(bad)?.trim();
    if let Ok(ms) = text.parse::<u64>() {
        return Ok(Duration::from_millis(ms));
    }
    humantime::parse_duration(text).map_err(|_| bad())
}

/// The queue named by the newest `x-death` entry (RabbitMQ keeps the newest first).
fn newest_death_queue(h: &BTreeMap<ShortString, AMQPValue>) -> Option<String> {
    let AMQPValue::FieldArray(deaths) = h.get(header::X_DEATH)? else {
        return None;
    };
    let AMQPValue::FieldTable(newest) = deaths.as_slice().first()? else {
        return None;
    };
    as_text(newest.inner().get("queue")?)
        .filter(|q| !q.is_empty())
        .map(str::to_string)
}

/// A short description of a value for error details, bounded in length.
fn describe(value: &AMQPValue) -> String {
    let type_name = format!("{:?}", value.get_type());
    match value {
        AMQPValue::LongString(_) | AMQPValue::ShortString(_) | AMQPValue::ByteArray(_) => match as_text(value) {
            Some(text) => format!("{type_name} {:?}", truncate(text, 64)),
            None => format!("{type_name} (not UTF-8)"),
        },
        AMQPValue::FieldTable(_) | AMQPValue::FieldArray(_) | AMQPValue::Void => type_name,
        other => format!(
            "{type_name} {}",
            format!("{other:?}").chars().take(64).collect::<String>()
        ),
    }
}

/// `text` cut to at most `max` bytes on a character boundary.
pub fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// Headers nest deeper than [`MAX_HEADER_DEPTH`].
#[derive(Debug, PartialEq, Eq)]
pub struct TooDeep;

/// The size of `table` in the AMQP 0-9-1 wire encoding, as RabbitMQ counts it against frame_max.
pub fn encoded_table_size(table: &FieldTable, depth: usize) -> Result<usize, TooDeep> {
    if depth > MAX_HEADER_DEPTH {
        return Err(TooDeep);
    }
    let mut size = 4;
    for (key, value) in table {
        size += 1 + key.as_str().len() + 1 + encoded_value_size(value, depth)?;
    }
    Ok(size)
}

fn encoded_value_size(value: &AMQPValue, depth: usize) -> Result<usize, TooDeep> {
    Ok(match value {
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.len(),
        AMQPValue::ByteArray(b) => 4 + b.len(),
        AMQPValue::Void => 0,
        AMQPValue::FieldTable(t) => encoded_table_size(t, depth + 1)?,
        AMQPValue::FieldArray(a) => {
            if depth + 1 > MAX_HEADER_DEPTH {
                return Err(TooDeep);
            }
            let mut size = 4;
            for v in a.as_slice() {
                size += 1 + encoded_value_size(v, depth + 1)?;
            }
            size
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ladder::{DeadLetterStrategy, QueueType};
    use lapin::types::{ByteArray, DecimalValue, FieldArray};

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

    fn props(headers: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert((*k).into(), v.clone());
        }
        BasicProperties::default().with_headers(table)
    }

    fn forward(d: Decision) -> Forward {
        match d {
            Decision::Forward(f) => *f,
            Decision::Park(p) => panic!("parked: {p:?}"),
        }
    }

    fn parked(d: Decision) -> Park {
        match d {
            Decision::Park(p) => p,
            Decision::Forward(f) => panic!("forwarded to {}", f.routing_key),
        }
    }

    fn header<'a>(p: &'a BasicProperties, key: &str) -> Option<&'a AMQPValue> {
        p.headers().as_ref()?.inner().get(key)
    }

    fn death(queue: &str) -> AMQPValue {
        let mut entry = FieldTable::default();
        entry.insert("queue".into(), long_string(queue));
        entry.insert("reason".into(), long_string("rejected"));
        entry.insert("count".into(), AMQPValue::LongLongInt(1));
        AMQPValue::FieldTable(entry)
    }

    #[test]
    fn first_failure_is_scheduled_in_the_first_tier() {
        let f = fixture();
        let input = props(&[("retry-to", long_string("orders")), ("app", AMQPValue::LongInt(7))])
            .with_expiration("5000".into())
            .with_user_id("guest".into())
            .with_message_id("m1".into());
        let out = forward(f.ctx().intake(&input, NOW));
        assert_eq!(out.exchange, "ns.default.tiers");
        assert_eq!(out.routing_key, "200ms");
        assert_eq!(out.attempt, 1);
        let p = &out.properties;
        assert_eq!(header(p, "retry-attempt"), Some(&AMQPValue::LongLongInt(1)));
        assert_eq!(
            header(p, "retry-first-failed-at"),
            Some(&AMQPValue::LongLongInt(NOW as i64))
        );
        assert_eq!(
            header(p, "retry-due-at"),
            Some(&AMQPValue::LongLongInt(NOW as i64 + 200))
        );
        assert_eq!(header(p, "retry-tier"), Some(&long_string("200ms")));
        assert_eq!(header(p, "retry-ladder"), Some(&long_string("default")));
        assert_eq!(header(p, "retry-to"), Some(&long_string("orders")));
        assert_eq!(header(p, "retry-original-user-id"), Some(&long_string("guest")));
        assert_eq!(header(p, "app"), Some(&AMQPValue::LongInt(7)));
        assert_eq!(p.expiration(), &None);
        assert_eq!(p.user_id(), &None);
        assert_eq!(p.delivery_mode(), &Some(2));
        assert_eq!(p.message_id().as_ref().map(|s| s.as_str()), Some("m1"));
    }

    #[test]
    fn attempts_climb_the_ladder_and_keep_first_failure_time() {
        let f = fixture();
        let input = props(&[
            ("retry-to", long_string("orders")),
            ("retry-attempt", AMQPValue::LongLongInt(1)),
            ("retry-first-failed-at", AMQPValue::LongLongInt(42)),
        ]);
        let out = forward(f.ctx().intake(&input, NOW));
        assert_eq!(out.routing_key, "500ms");
        assert_eq!(
            header(&out.properties, "retry-attempt"),
            Some(&AMQPValue::LongLongInt(2))
        );
        assert_eq!(
            header(&out.properties, "retry-first-failed-at"),
            Some(&AMQPValue::LongLongInt(42))
        );
    }

    #[test]
    fn exhausted_ladder_parks_with_max_attempts() {
        let f = fixture();
        let input = props(&[
            ("retry-to", long_string("orders")),
            ("retry-attempt", AMQPValue::ShortShortUInt(3)),
        ]);
        let p = parked(f.ctx().intake(&input, NOW));
        assert_eq!(p.reason, ParkReason::MaxAttempts);
        assert_eq!(p.destination.as_deref(), Some("orders"));
        assert_eq!(p.attempts, Some(3));
    }

    #[test]
    fn dead_letter_mode_uses_the_newest_death_and_strips_broker_headers() {
        let f = fixture();
        let deaths = AMQPValue::FieldArray(FieldArray::from(vec![death("billing.eu"), death("orders")]));
        let input = props(&[
            ("x-death", deaths),
            ("x-first-death-queue", long_string("orders")),
            ("x-last-death-reason", long_string("rejected")),
            ("CC", AMQPValue::FieldArray(FieldArray::default())),
            ("BCC", AMQPValue::FieldArray(FieldArray::default())),
        ]);
        let out = forward(f.ctx().intake(&input, NOW));
        assert_eq!(out.destination, "billing.eu");
        let keys: Vec<_> = out
            .properties
            .headers()
            .as_ref()
            .unwrap()
            .inner()
            .keys()
            .map(|k| k.to_string())
            .collect();
        assert!(
            keys.iter().all(|k| !k.starts_with("x-") && k != "CC" && k != "BCC"),
            "{keys:?}"
        );
    }

    #[test]
    fn explicit_retry_to_wins_over_x_death() {
        let f = fixture();
        let deaths = AMQPValue::FieldArray(FieldArray::from(vec![death("billing.eu")]));
        let input = props(&[("x-death", deaths), ("retry-to", long_string("orders"))]);
        assert_eq!(forward(f.ctx().intake(&input, NOW)).destination, "orders");
    }

    #[test]
    fn retry_delay_lengthens_the_wait_and_is_consumed() {
        let f = fixture();
        for value in [
            AMQPValue::LongInt(400),
            long_string("400ms"),
            long_string("400"),
            AMQPValue::Double(400.0),
        ] {
            let input = props(&[("retry-to", long_string("orders")), ("retry-delay", value.clone())]);
            let out = forward(f.ctx().intake(&input, NOW));
            assert_eq!(out.routing_key, "500ms", "{value:?}");
            assert_eq!(header(&out.properties, "retry-delay"), None);
        }
        let input = props(&[("retry-to", long_string("orders")), ("retry-delay", long_string("1h"))]);
        assert_eq!(forward(f.ctx().intake(&input, NOW)).routing_key, "1s");
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
            let mut v = AMQPValue::Boolean(true);
            for _ in 0..depth {
                let mut t = FieldTable::default();
                t.insert("n".into(), v);
                v = AMQPValue::FieldTable(t);
            }
            v
        };
        type Case<'a> = (&'a str, Vec<(&'a str, AMQPValue)>, ParkReason);
        let cases: Vec<Case> = vec![
            ("no headers at all", vec![], ParkReason::NoDestination),
            (
                "retry-to is an integer",
                vec![("retry-to", AMQPValue::LongInt(5))],
                ParkReason::InvalidHeader,
            ),
            (
                "retry-to is a table",
                vec![("retry-to", AMQPValue::FieldTable(FieldTable::default()))],
                ParkReason::InvalidHeader,
            ),
            (
                "retry-to is empty",
                vec![("retry-to", long_string(""))],
                ParkReason::InvalidHeader,
            ),
            (
                "retry-to not UTF-8",
                vec![("retry-to", AMQPValue::LongString(vec![0xff, 0xfe].into()))],
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
                vec![to(), ("retry-attempt", AMQPValue::LongInt(-1))],
                ParkReason::InvalidHeader,
            ),
            (
                "string attempt",
                vec![to(), ("retry-attempt", long_string("2"))],
                ParkReason::InvalidHeader,
            ),
            (
                "fractional attempt",
                vec![to(), ("retry-attempt", AMQPValue::Double(1.5))],
                ParkReason::InvalidHeader,
            ),
            (
                "decimal attempt",
                vec![
                    to(),
                    (
                        "retry-attempt",
                        AMQPValue::DecimalValue(DecimalValue { scale: 1, value: 10 }),
                    ),
                ],
                ParkReason::InvalidHeader,
            ),
            (
                "void attempt",
                vec![to(), ("retry-attempt", AMQPValue::Void)],
                ParkReason::InvalidHeader,
            ),
            (
                "bad delay",
                vec![to(), ("retry-delay", long_string("soon"))],
                ParkReason::InvalidHeader,
            ),
            (
                "negative delay",
                vec![to(), ("retry-delay", AMQPValue::LongInt(-5))],
                ParkReason::InvalidHeader,
            ),
            (
                "array delay",
                vec![to(), ("retry-delay", AMQPValue::FieldArray(FieldArray::default()))],
                ParkReason::InvalidHeader,
            ),
            (
                "timestamp reason",
                vec![to(), ("retry-reason", AMQPValue::Timestamp(5))],
                ParkReason::InvalidHeader,
            ),
            (
                "x-death without queue",
                vec![(
                    "x-death",
                    AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Boolean(true)])),
                )],
                ParkReason::NoDestination,
            ),
            (
                "huge header",
                vec![to(), ("blob", AMQPValue::ByteArray(ByteArray::from(vec![0u8; 5000])))],
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
    fn due_delivers_to_the_destination_and_strips_tier_deaths() {
        let f = fixture();
        let deaths = AMQPValue::FieldArray(FieldArray::from(vec![death("ns.default.delay.200ms")]));
        let input = props(&[
            ("retry-to", long_string("orders")),
            ("retry-attempt", AMQPValue::LongLongInt(2)),
            ("retry-due-at", AMQPValue::LongLongInt(NOW as i64 - 30)),
            ("x-death", deaths),
        ]);
        let out = forward(f.ctx().due(&input, NOW));
        assert_eq!((out.exchange.as_str(), out.routing_key.as_str()), ("", "orders"));
        assert_eq!(out.late_ms, 30);
        assert_eq!(out.attempt, 2);
        assert_eq!(header(&out.properties, "x-death"), None);
        assert_eq!(
            header(&out.properties, "retry-attempt"),
            Some(&AMQPValue::LongLongInt(2))
        );
    }

    #[test]
    fn parks_say_where_the_message_was_headed_when_readable() {
        let f = fixture();
        let cases = [
            props(&[("retry-to", long_string("orders")), ("retry-attempt", long_string("x"))]),
            props(&[
                ("retry-to", long_string("orders")),
                ("blob", AMQPValue::ByteArray(vec![0u8; 5000].into())),
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
            ("blob", AMQPValue::ByteArray(vec![0u8; 5000].into())),
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
            assert!(matches!(value, AMQPValue::LongString(_)), "{value:?}");
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
        let AMQPValue::LongString(text) = header(&input, "retry-history").unwrap() else {
            panic!("not a long string")
        };
        assert!(text.len() < 1024, "{} bytes", text.len());

        let many: Vec<HistoryEntry> = (1..=40).map(|n| entry(n, "1h1m1s1ms", NOW + n)).collect();
        assert_eq!(parse_history(&format_history(&many)), many[40 - MAX_HISTORY_ENTRIES..]);

        // the worst a header can carry on, forged or not, still fits the documented bound
        let longest_tier = crate::ladder::compact_duration(Duration::from_millis(u64::from(u32::MAX)));
        assert_eq!(longest_tier.len(), 15);
        let tier = "9".repeat(MAX_HISTORY_TIER_BYTES);
        let worst: Vec<HistoryEntry> = (0..40).map(|_| entry(u64::MAX, &tier, u64::MAX)).collect();
        let AMQPValue::LongString(text) = format_history(&parse_history(&format_history(&worst))) else {
            panic!("not a long string")
        };
        assert!(text.len() < 1024, "{} bytes", text.len());
        assert_eq!(parse_history(&AMQPValue::LongString(text)).len(), MAX_HISTORY_ENTRIES);
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
            parse_history(&AMQPValue::ShortString("1:1s:5".into())),
            [entry(1, "1s", 5)]
        );
        let long_tier = format!("1:{}s:5", "1".repeat(MAX_HISTORY_TIER_BYTES));
        for garbage in [
            AMQPValue::LongInt(5),
            AMQPValue::LongString(vec![0xff, b':', 0xfe].into()),
            AMQPValue::FieldTable(FieldTable::default()),
            AMQPValue::FieldArray(FieldArray::from(vec![long_string("1:1s:5")])),
            AMQPValue::Void,
            long_string(""),
            long_string(&long_tier),
        ] {
            assert_eq!(parse_history(&garbage), [], "{garbage:?}");
        }

        // garbage in the header: the message is forwarded, with the readable entries kept
        let f = fixture();
        let input = props(&[
            ("retry-to", long_string("orders")),
            ("retry-attempt", AMQPValue::LongLongInt(1)),
            ("retry-history", long_string("1:200ms:5,junk")),
        ]);
        let out = forward(f.ctx().intake(&input, NOW));
        assert_eq!(
            history_header(&out.properties),
            [entry(1, "200ms", 5), entry(2, "500ms", NOW)]
        );
        let input = props(&[
            ("retry-to", long_string("orders")),
            ("retry-history", AMQPValue::Boolean(true)),
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
        let with = |extra: &[(&str, AMQPValue)]| {
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
                .intake(&with(&[to("orders"), ("retry-attempt", AMQPValue::LongInt(3))]), NOW),
            f.ctx().intake(
                &with(&[to("orders"), ("blob", AMQPValue::ByteArray(vec![0u8; 5000].into()))]),
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
            ("retry-attempt", AMQPValue::LongLongInt(3)),
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
    fn encoded_size_matches_the_wire_format() {
        let mut t = FieldTable::default();
        t.insert("a".into(), long_string("xyz")); // 1+1 key, 1 type, 4+3
        t.insert(
            "b".into(),
            AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Boolean(true)])),
        ); // 2, 1, 4+(1+1)
        assert_eq!(encoded_table_size(&t, 0), Ok(4 + (2 + 1 + 7) + (2 + 1 + 6)));
    }
}
