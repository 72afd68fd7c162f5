//! The header codec: reading and writing the protocol's header values (numbers, names,
//! delays, the history), what a republish strips and carries, and encoded sizes. Pure helpers
//! the hops' decisions share.

use std::time::Duration;

use ladder_amqp::{BasicProperties, FieldTable, FieldValue, LongString, ShortString};

use super::*;

/// The park decision for a delivery whose properties the client could not decode (headers
/// nested beyond what it decodes): they are kept as bytes in the parking lot. `shallow` is the
/// decision on what the shallow headers say, for where the message was headed and its history.
pub fn undecodable(error: &ladder_amqp::types::DecodeError, shallow: Option<Decision<'_>>) -> Park {
    let detail = format!("the properties do not decode ({error}); parked as the bytes received");
    match shallow {
        Some(Decision::Park(park)) => Park {
            reason: ParkReason::InvalidHeader,
            detail: format!("{detail}; {}", park.detail),
            ..park
        },
        Some(Decision::Forward(forward)) => Park::new(ParkReason::InvalidHeader, detail).to(Some(forward.destination)),
        None => Park::new(ParkReason::InvalidHeader, detail),
    }
}

/// Why ladder `spec` (named `names`) may not deliver to `queue`, or `None` if it may: the queue
/// lies in the ladder's namespace or the broker's (`amq.`), or matches none of its `allow`
/// regexes. The one rule for the due hop and for replays from the parking lot.
pub fn refuse_destination(spec: &LadderSpec, names: &Names, queue: &str) -> Option<String> {
    if queue.starts_with(&names.namespace.prefix) || queue.starts_with("amq.") {
        return Some(format!("{queue:?} belongs to the ladder's namespace or the broker"));
    }
    (!spec.allows(queue)).then(|| format!("{queue:?} is not in the allow-list of ladder {}", spec.name))
}

/// Headers the ladder sets for one pass through it; a replay from the parking lot removes them
/// so the message starts a fresh attempt count. `retry-first-failed-at` and `retry-history`
/// stay: they are lineage (after a replay the history's attempts start again at 1, so its
/// entries are told apart by their times).
pub(super) const PER_PASS_HEADERS: [&str; 6] = [
    header::RETRY_ATTEMPT,
    header::RETRY_DUE_AT,
    header::RETRY_TIER,
    header::RETRY_DELAY,
    header::RETRY_LADDER,
    header::RETRY_DEFERRALS,
];

/// Properties to replay a parked message with: the same stripping as every republish, without
/// the per-pass ladder headers (`PER_PASS_HEADERS`) so that the attempt count starts again, and
/// with `extra` headers such as `retry-replayed-from`. The lineage (`retry-first-failed-at`,
/// `retry-history`) stays.
pub fn replay_properties(props: &BasicProperties, extra: &[(&str, FieldValue)]) -> BasicProperties {
    let mut out = republished_headers(&props.headers_or_empty());
    for key in PER_PASS_HEADERS {
        out.remove(key);
    }
    move_user_id(props, &mut out);
    for (key, value) in extra {
        out.set(key, value.clone());
    }
    republished_properties(props, out)
}

/// The park of a publish the broker returned (no queue took `forward`, made from a delivery
/// with `received` properties on `hop`). The record keeps the message as received; the times
/// and attempts are the forward's, so a first failure whose tier is missing still says when it
/// first failed.
pub fn no_route(
    hop: Hop,
    received: &BasicProperties,
    forward: &Forward<'_>,
    reply_code: u16,
    reply_text: &str,
) -> Park {
    let attempts = match hop {
        Hop::Intake => forward.attempt.saturating_sub(1),
        Hop::Due | Hop::Quarantine => forward.attempt,
    };
    Park {
        reason: ParkReason::NoRoute,
        detail: format!(
            "the broker returned the publish to exchange {:?} with routing key {:?}: {reply_code} {reply_text}",
            forward.exchange, forward.routing_key
        ),
        destination: Some(forward.destination.clone()),
        attempts: Some(attempts),
        first_failed_at_ms: first_failed_at_of(&forward.properties).or_else(|| first_failed_at_of(received)),
        // as received, since the envelope stores the received message; but a failure taken in
        // here was counted here, so its history is the counted one, as at the intake
        history: match history_of(&forward.properties) {
            counted if forward.counted == Counted::Here && !counted.is_empty() => counted,
            _ => history_of(received),
        },
        replayed_from: replayed_from_of(received),
    }
}

/// The `retry-history` that `props` carry, read as leniently as [`parse_history`] (empty when
/// absent). For park records made outside a hop's decision, such as a returned publish.
pub fn history_of(props: &BasicProperties) -> Vec<HistoryEntry> {
    props.headers.as_ref().map_or_else(Vec::new, carried_history)
}

/// The `retry-first-failed-at` that `props` carry, if readable.
pub fn first_failed_at_of(props: &BasicProperties) -> Option<u64> {
    optional_u64(props.headers.as_ref()?, header::RETRY_FIRST_FAILED_AT)
        .ok()
        .flatten()
}

/// The `retry-replayed-from` that `props` carry, if it is text (cut to a bounded length).
pub fn replayed_from_of(props: &BasicProperties) -> Option<String> {
    props.headers.as_ref().and_then(carried_replayed_from)
}

pub(super) fn carried_history(h: &FieldTable) -> Vec<HistoryEntry> {
    h.get(header::RETRY_HISTORY).map_or_else(Vec::new, parse_history)
}

pub(super) fn carried_replayed_from(h: &FieldTable) -> Option<String> {
    h.get(header::RETRY_REPLAYED_FROM)
        .and_then(as_text)
        .map(|text| truncate(text, MAX_REPLAYED_FROM_BYTES))
}

/// Reads a `retry-history` value: its newest [`MAX_HISTORY_ENTRIES`] readable entries, oldest
/// first. Lenient, because the history only informs operators: a value that is not text gives
/// no entries, and an entry that does not parse is skipped while the others are kept.
pub fn parse_history(value: &FieldValue) -> Vec<HistoryEntry> {
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

pub(super) fn parse_history_entry(entry: &str) -> Option<HistoryEntry> {
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
pub fn format_history(entries: &[HistoryEntry]) -> FieldValue {
    let newest = &entries[entries.len().saturating_sub(MAX_HISTORY_ENTRIES)..];
    let mut text = String::with_capacity(newest.len() * 32);
    for (i, e) in newest.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        push_history_entry(&mut text, e.attempt, &e.tier, e.failed_at_ms);
    }
    FieldValue::LongString(LongString::from(text))
}

/// Appends one `retry-history` entry, `<attempt>:<tier>:<failed_at_ms>`.
pub(super) fn push_history_entry(text: &mut String, attempt: u64, tier: &str, failed_at_ms: u64) {
    push_decimal(text, attempt);
    text.push(':');
    text.push_str(tier);
    text.push(':');
    push_decimal(text, failed_at_ms);
}

/// Appends `n` in decimal: what `write!` would, without the formatting machinery (this runs on
/// every retry the intake schedules).
pub(super) fn push_decimal(text: &mut String, n: u64) {
    text.push_str(itoa::Buffer::new().format(n));
}

/// A `retry-to` value as a queue name, or what is wrong with it.
pub(super) fn check_queue_name(value: &FieldValue) -> Result<String, String> {
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
/// `x-delivery-count` and `x-acquired-count` are quorum-queue counters (4.x sends both, and
/// they ride along through dead-lettering into the next queue, where a delivery limit would
/// count them); the `x-death` family is the dead-letter history.
pub fn is_stripped(key: &[u8]) -> bool {
    matches!(
        key,
        b"x-death" | b"CC" | b"BCC" | b"x-delivery-count" | b"x-acquired-count"
    ) || key.starts_with(b"x-first-death-")
        || key.starts_with(b"x-last-death-")
}

/// What the intake writes into a retry's headers (and `retry-delay` and `retry-deferrals`,
/// which it drops; `retry-reason` is written whenever it was received): none of them is
/// carried over as received.
pub(super) const INTAKE_WRITES: &[&str] = match INTAKE_WRITES_WITH_USER.split_last() {
    Some((_, writes)) => writes,
    None => &[],
};

/// [`INTAKE_WRITES`], then `retry-original-user-id`, which the intake writes when the delivery
/// has a `user_id` to move.
pub(super) const INTAKE_WRITES_WITH_USER: &[&str] = &[
    header::RETRY_DELAY,
    header::RETRY_DEFERRALS,
    header::RETRY_REASON,
    header::RETRY_TO,
    header::RETRY_ATTEMPT,
    header::RETRY_FIRST_FAILED_AT,
    header::RETRY_LADDER,
    header::RETRY_TIER,
    header::RETRY_DUE_AT,
    header::RETRY_HISTORY,
    header::RETRY_NEXT,
    header::RETRY_ORIGINAL_USER_ID,
];

/// The ladder's bookkeeping of a scheduled delivery, which the due hop removes: the message is
/// delivered as it was published.
pub(super) const SCHEDULED_BOOKKEEPING: &[&str] = &[
    header::RETRY_SCHEDULED,
    header::RETRY_TIER,
    header::RETRY_DUE_AT,
    header::RETRY_LADDER,
    header::RETRY_ROUTING_KEY,
];

/// The `retry-history` after a failure at `failed_at_ms`: `previous` with `attempt:step:failed_at_ms`
/// appended, the same as [`format_history`] of [`parse_history`] plus the entry. A previous
/// value in the form Ladder writes (the common case) is appended to as text; anything else is
/// read entry by entry and written anew.
pub(super) fn appended_history(
    previous: Option<&FieldValue>,
    attempt: u64,
    step: &str,
    failed_at_ms: u64,
) -> FieldValue {
    let as_written = match previous.map(as_text) {
        None => Some(""),
        Some(Some(text)) if is_written_history(text) => Some(text),
        _ => None,
    };
    match as_written {
        Some(text) => {
            let mut out = String::with_capacity(text.len() + 1 + 44 + step.len());
            out.push_str(text);
            if !text.is_empty() {
                out.push(',');
            }
            push_history_entry(&mut out, attempt, step, failed_at_ms);
            FieldValue::LongString(LongString::from(out))
        }
        None => {
            let mut history = previous.map_or_else(Vec::new, parse_history);
            history.push(HistoryEntry {
                attempt,
                tier: step.to_string(),
                failed_at_ms,
            });
            format_history(&history)
        }
    }
}

/// Whether `text` is a history exactly as [`format_history`] writes it, with room for one more
/// entry: at least one and fewer than [`MAX_HISTORY_ENTRIES`] entries, each of which
/// [`parse_history`] reads back to the same text.
pub(super) fn is_written_history(text: &str) -> bool {
    let canonical_number = |n: &str| {
        !n.is_empty()
            && n.bytes().all(|b| b.is_ascii_digit())
            && (n == "0" || !n.starts_with('0'))
            && n.parse::<u64>().is_ok()
    };
    let mut entries = 0;
    for entry in text.split(',') {
        entries += 1;
        if entries >= MAX_HISTORY_ENTRIES {
            return false;
        }
        let mut parts = entry.split(':');
        let (Some(attempt), Some(tier), Some(failed_at), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return false;
        };
        if !canonical_number(attempt)
            || !canonical_number(failed_at)
            || tier.is_empty()
            || tier.len() > MAX_HISTORY_TIER_BYTES
            || !tier.bytes().all(|b| b.is_ascii_alphanumeric())
        {
            return false;
        }
    }
    true
}

/// The headers republished as a copy (every one but the broker's), for what writes a table
/// of its own (a scheduled delivery, a deferral, a replay); a retry's forward carries them
/// over instead ([`Carry`]).
pub(super) fn republished_headers(headers: &FieldTable) -> FieldTable {
    headers
        .iter()
        .filter(|(k, _)| !is_stripped(k.as_bytes()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// A `user_id` that is not the publishing connection's would make the broker close the
/// channel: it moves into `retry-original-user-id`, byte for byte.
pub(super) fn move_user_id(props: &BasicProperties, out: &mut FieldTable) {
    if let Some(user) = &props.user_id {
        out.set(
            header::RETRY_ORIGINAL_USER_ID,
            FieldValue::LongString(LongString::from(user.as_bytes())),
        );
    }
}

/// Copies `props` without `expiration` and `user_id` (a `user_id` that is not ours would make the
/// broker close the channel), persistent, with `headers`.
pub(super) fn republished_properties(props: &BasicProperties, headers: FieldTable) -> BasicProperties {
    BasicProperties {
        headers: Some(headers),
        ..republished_properties_without_headers(props)
    }
}

/// Whether `props`, less the broker's headers, are already what a republish writes
/// ([`republished_properties`]): persistent, without `expiration` and `user_id`.
pub(super) fn is_republished_as_received(props: &BasicProperties) -> bool {
    props.delivery_mode == Some(2) && props.expiration.is_none() && props.user_id.is_none()
}

/// The properties and the carry of a forward made from `props` that writes the headers `own`
/// (those `except` names): its headers, and a copy of the other received properties only when
/// they are not republished as received.
pub(super) fn carrying(
    props: &BasicProperties,
    own: Option<FieldTable>,
    except: &'static [&'static str],
) -> (BasicProperties, Carry) {
    let as_received = is_republished_as_received(props);
    let fields = if as_received {
        BasicProperties::default()
    } else {
        republished_properties_without_headers(props)
    };
    (
        BasicProperties { headers: own, ..fields },
        Carry { except, as_received },
    )
}

pub(super) fn republished_properties_without_headers(props: &BasicProperties) -> BasicProperties {
    BasicProperties {
        delivery_mode: Some(2),
        expiration: None,
        user_id: None,
        ..props.clone_without_headers()
    }
}

/// A header value as a long string (RabbitMQ rejects short strings in tables).
pub fn long_string(text: &str) -> FieldValue {
    FieldValue::LongString(LongString::from(text))
}

/// Text from a long string, short string or UTF-8 byte array.
pub fn as_text(value: &FieldValue) -> Option<&str> {
    match value {
        FieldValue::LongString(s) => s.to_str(),
        FieldValue::ByteArray(b) => std::str::from_utf8(b).ok(),
        _ => None,
    }
}

/// A non-negative integer of any AMQP integer width (or an integral float, as JavaScript sends).
pub fn as_u64(value: &FieldValue) -> Option<u64> {
    let signed = |n: i64| u64::try_from(n).ok();
    match value {
        FieldValue::ShortShortInt(n) => signed(i64::from(*n)),
        FieldValue::ShortShortUInt(n) => Some(u64::from(*n)),
        FieldValue::ShortInt(n) => signed(i64::from(*n)),
        FieldValue::ShortUInt(n) => Some(u64::from(*n)),
        FieldValue::LongInt(n) => signed(i64::from(*n)),
        FieldValue::LongUInt(n) => Some(u64::from(*n)),
        FieldValue::LongLongInt(n) => signed(*n),
        FieldValue::Double(f) if f.fract() == 0.0 && *f >= 0.0 && *f < 9.0e15 => Some(*f as u64),
        FieldValue::Float(f) if f.fract() == 0.0 && *f >= 0.0 && *f < 1.6e7 => Some(*f as u64),
        _ => None,
    }
}

/// A signed integer of any AMQP integer width (or an integral float): negative values too.
pub(super) fn as_i64(value: &FieldValue) -> Option<i64> {
    match value {
        FieldValue::ShortShortInt(n) => Some(i64::from(*n)),
        FieldValue::ShortInt(n) => Some(i64::from(*n)),
        FieldValue::LongInt(n) => Some(i64::from(*n)),
        FieldValue::LongLongInt(n) => Some(*n),
        FieldValue::Double(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Some(*f as i64),
        FieldValue::Float(f) if f.fract() == 0.0 && f.abs() < 1.6e7 => Some(*f as i64),
        _ => as_u64(value).and_then(|n| i64::try_from(n).ok()),
    }
}

pub(super) fn optional_u64(h: &FieldTable, key: &str) -> Result<Option<u64>, String> {
    match h.get(key) {
        None => Ok(None),
        Some(value) => as_u64(value)
            .map(Some)
            .ok_or_else(|| format!("{key} must be a non-negative integer, got {}", describe(value))),
    }
}

/// `retry-delay`: integer milliseconds, or a string of digits (ms) or humantime (`30s`).
pub fn parse_delay(value: &FieldValue) -> Result<Duration, String> {
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

/// Where a delivery goes: a queue (through the default exchange), or an exchange with a
/// routing key (scheduled deliveries only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Target {
    Queue(String),
    Exchange(String),
}

impl Target {
    pub(super) fn queue(&self) -> Option<&str> {
        match self {
            Target::Queue(queue) => Some(queue),
            Target::Exchange(_) => None,
        }
    }

    /// The key its in-flight bound and its logs use: the queue's name, or `exchange:<name>`.
    pub(super) fn into_key(self) -> String {
        match self {
            Target::Queue(queue) => queue,
            Target::Exchange(exchange) => format!("exchange:{exchange}"),
        }
    }
}

/// A `retry-to-exchange` value: a text exchange name of at most 255 bytes.
pub(super) fn check_exchange_name(value: &FieldValue) -> Result<String, String> {
    match as_text(value) {
        Some(name) if name.len() <= 255 => Ok(name.to_string()),
        Some(name) => Err(format!(
            "{} is {} bytes, above 255",
            header::RETRY_TO_EXCHANGE,
            name.len()
        )),
        None => Err(format!(
            "{} must be a string, got {}",
            header::RETRY_TO_EXCHANGE,
            describe(value)
        )),
    }
}

/// Epoch times below this (1973-03-03) are taken for seconds given as milliseconds.
pub(super) const EARLIEST_DELAY_UNTIL_MS: u64 = 100_000_000_000;

/// When a scheduled delivery is due, ms since the epoch: `now + x-delay` or `delay-until`; a
/// time in the past is now. Not a number, both given, beyond [`MAX_DELAY`], or an epoch time
/// that looks like seconds is an error.
pub(super) fn scheduled_due_at(h: &FieldTable, now_ms: u64) -> Result<u64, String> {
    let max_ms = MAX_DELAY.as_millis() as u64;
    let as_int = |key: &str, value: &FieldValue| -> Result<i128, String> {
        let text = as_text(value).map(str::trim);
        as_i64(value)
            .map(i128::from)
            .or_else(|| as_u64(value).map(i128::from))
            .or_else(|| text.and_then(|t| t.parse::<i128>().ok()))
            .ok_or_else(|| format!("{key} must be integer milliseconds, got {}", describe(value)))
    };
    match (h.get(header::X_DELAY), h.get(header::DELAY_UNTIL)) {
        (Some(_), Some(_)) => Err(format!(
            "{} and {} both given; give one",
            header::X_DELAY,
            header::DELAY_UNTIL
        )),
        (Some(value), None) => {
            let delay = as_int(header::X_DELAY, value)?;
            if delay > i128::from(max_ms) {
                return Err(format!(
                    "{} of {delay} ms is beyond the longest delay ({max_ms} ms, 49 days)",
                    header::X_DELAY
                ));
            }
            // a negative delay is in the past: due now
            Ok(now_ms.saturating_add(delay.max(0) as u64))
        }
        (None, Some(value)) => {
            let until = as_int(header::DELAY_UNTIL, value)?;
            if until < i128::from(EARLIEST_DELAY_UNTIL_MS) {
                return Err(format!(
                    "{} of {until} is before 1973 as milliseconds since the epoch (seconds given?)",
                    header::DELAY_UNTIL
                ));
            }
            if until > i128::from(now_ms.saturating_add(max_ms)) {
                return Err(format!(
                    "{} of {until} is {} ms ahead, beyond the longest delay ({max_ms} ms, 49 days)",
                    header::DELAY_UNTIL,
                    until - i128::from(now_ms)
                ));
            }
            Ok((until as u64).max(now_ms))
        }
        (None, None) => Err("no delay given".into()),
    }
}

/// The park of a message cancelled while it waited in a held destination's queue (released
/// after the cancellation): parked as `cancelled`, never delivered.
pub fn cancelled_while_held(props: &BasicProperties, destination: &str) -> Park {
    let h = props.headers_or_empty();
    let detail = format!("{} (it waited in a held queue)", cancelled_detail(props));
    Park::carrying(ParkReason::Cancelled, detail, &h)
        .to(Some(destination.to_string()))
        .after(
            optional_u64(&h, header::RETRY_ATTEMPT).ok().flatten(),
            first_failed_at_of(props),
        )
}

pub(super) fn cancelled_detail(props: &BasicProperties) -> String {
    let id = props
        .message_id
        .as_ref()
        .map(|id| String::from_utf8_lossy(id.as_bytes()).into_owned());
    format!(
        "message id {:?} was cancelled before it was due",
        id.unwrap_or_default()
    )
}

/// The queue named by the newest `x-death` entry (RabbitMQ keeps the newest first).
pub(super) fn newest_death_queue(h: &FieldTable) -> Option<String> {
    death_queue(h, 0)
}

/// The queue of the `x-death` entry after the newest `skip`, as [`newest_death_queue`].
pub(super) fn death_queue(h: &FieldTable, skip: usize) -> Option<String> {
    let FieldValue::FieldArray(deaths) = h.get(header::X_DEATH)? else {
        return None;
    };
    let FieldValue::FieldTable(newest) = deaths.get(skip)? else {
        return None;
    };
    as_text(newest.get("queue")?)
        .filter(|q| !q.is_empty())
        .map(str::to_string)
}

/// A short description of a value for error details, bounded in length.
pub(super) fn describe(value: &FieldValue) -> String {
    let type_name = type_name(value);
    match value {
        FieldValue::LongString(_) | FieldValue::ByteArray(_) => match as_text(value) {
            Some(text) => format!("{type_name} {:?}", truncate(text, 64)),
            None => format!("{type_name} (not UTF-8)"),
        },
        FieldValue::FieldTable(_) | FieldValue::FieldArray(_) | FieldValue::Void => type_name.to_string(),
        other => format!(
            "{type_name} {}",
            format!("{other:?}").chars().take(64).collect::<String>()
        ),
    }
}

/// The AMQP 0-9-1 name of a value's type, kebab case (as the parked envelope writes it).
pub fn type_name(value: &FieldValue) -> &'static str {
    match value {
        FieldValue::Boolean(_) => "boolean",
        FieldValue::ShortShortInt(_) => "short-short-int",
        FieldValue::ShortShortUInt(_) => "short-short-uint",
        FieldValue::ShortInt(_) => "short-int",
        FieldValue::ShortUInt(_) => "short-uint",
        FieldValue::LongInt(_) => "long-int",
        FieldValue::LongUInt(_) => "long-uint",
        FieldValue::LongLongInt(_) => "long-long-int",
        FieldValue::Float(_) => "float",
        FieldValue::Double(_) => "double",
        FieldValue::Decimal(_) => "decimal",
        FieldValue::LongString(_) => "long-string",
        FieldValue::FieldArray(_) => "field-array",
        FieldValue::Timestamp(_) => "timestamp",
        FieldValue::FieldTable(_) => "field-table",
        FieldValue::Void => "void",
        FieldValue::ByteArray(_) => "byte-array",
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
    encoded_entries_size(table.iter(), depth)
}

/// The size of a table of these `entries` at `depth`, as [`encoded_table_size`] counts it.
pub(super) fn encoded_entries_size<'a>(
    entries: impl Iterator<Item = (&'a ShortString, &'a FieldValue)>,
    depth: usize,
) -> Result<usize, TooDeep> {
    if depth > MAX_HEADER_DEPTH {
        return Err(TooDeep);
    }
    let mut size = 4;
    for (key, value) in entries {
        size += 1 + key.len() + 1 + encoded_value_size(value, depth)?;
    }
    Ok(size)
}

pub(super) fn encoded_value_size(value: &FieldValue, depth: usize) -> Result<usize, TooDeep> {
    Ok(match value {
        FieldValue::Boolean(_) | FieldValue::ShortShortInt(_) | FieldValue::ShortShortUInt(_) => 1,
        FieldValue::ShortInt(_) | FieldValue::ShortUInt(_) => 2,
        FieldValue::LongInt(_) | FieldValue::LongUInt(_) | FieldValue::Float(_) => 4,
        FieldValue::LongLongInt(_) | FieldValue::Double(_) | FieldValue::Timestamp(_) => 8,
        FieldValue::Decimal(_) => 5,
        FieldValue::LongString(s) => 4 + s.len(),
        FieldValue::ByteArray(b) => 4 + b.len(),
        FieldValue::Void => 0,
        FieldValue::FieldTable(t) => encoded_table_size(t, depth + 1)?,
        FieldValue::FieldArray(a) => {
            if depth + 1 > MAX_HEADER_DEPTH {
                return Err(TooDeep);
            }
            let mut size = 4;
            for v in a {
                size += 1 + encoded_value_size(v, depth + 1)?;
            }
            size
        }
    })
}
