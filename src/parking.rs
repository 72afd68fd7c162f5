//! The parking lot as an operator sees it: list, search, show, replay and discard the records
//! of `N.L.parked`, for the CLI today and the admin HTTP API later.
//!
//! State lives only in the stream. A replay or a discard appends a *resolution record*
//! (`type` = [`RESOLUTION_FORMAT`], JSON body [`Resolution`]) to the same stream, after the
//! entry it resolves; every replica and tool that reads the stream sees the same state, and
//! nothing is ever deleted (retention, not discard, frees space). See ARCHITECTURE.md.
//!
//! Listing and selecting go through a [`LotIndex`]: one compact row per entry, built by reading
//! the stream once (the CLI builds one per command, from the filter's start to the stream's end
//! when the command started; the service keeps one per ladder that follows the stream). The
//! index answers counts and pages by offset; only the page's records are then fetched from the
//! stream, in runs of nearby offsets. Searches the index cannot answer (headers, body) fetch
//! the candidates it narrows to and check them, keeping at most [`MAX_PAGE_WINDOW`] entries.
//! The end is found by reading the last chunk (`x-stream-offset: last`): RabbitMQ 3.10 reports
//! `message_count` 0 for a stream, so a passive declare cannot say where the end is.
//!
//! Pure parts — filters, rate pacing, time bounds, rendering — do no I/O and are unit-tested
//! here; the broker parts bound every await.

use std::collections::{BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::str::FromStr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::envelope::{self, Envelope, EnvelopeError};
use crate::ladder::LadderSpec;
use crate::lot_index::{self, SharedIndex};
use crate::protocol::{self, header, long_string};
use crate::topology::Names;

/// The `type` property and `format` field of a resolution record.
pub const RESOLUTION_FORMAT: &str = "ladder.resolution/v1";

/// The `type` property and `format` field of a marker record: appended by a replay or discard
/// after it took the operator lock, so that reading up to the marker is reading everything that
/// was in the stream before it — every earlier resolution included — without trusting a timing
/// guess about where the stream ends. Readers skip markers.
pub const MARKER_FORMAT: &str = "ladder.marker/v1";

/// A marker record's body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Marker {
    /// Always [`MARKER_FORMAT`].
    pub format: String,
    /// Unique per marker.
    pub id: String,
    /// Who was acting.
    pub by: String,
}

/// Where a read stops.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stop {
    /// At this offset (inclusive).
    At(u64),
    /// At the marker with this id.
    Marker(String),
}

/// Every single broker call (open a channel, declare, publish and its confirm) is bounded by this.
pub const BROKER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long finding the end waits for the last chunk before it takes the stream for empty (and a
/// scan from a time, for the first chunk after it before it takes it that there is none). The
/// broker may have to read the chunk from disk; an empty stream costs this much per request.
pub const SCAN_FIRST_RECORD: Duration = Duration::from_secs(2);

/// Reading the last chunk: a gap this long after a delivery ends it. A chunk is delivered in one
/// burst; a record that comes later was appended after the request started and is not needed.
/// Only read-only commands rely on it (actions read up to a marker instead); 300 ms leaves room
/// for a busy broker's pauses within a burst, at the cost of that much per command.
pub const LAST_CHUNK_GAP: Duration = Duration::from_millis(300);

/// A scan that received nothing for this long before it reached the end offset gives up with
/// [`ParkingError::Timeout`] rather than return a silently short answer. Streams deliver chunk
/// after chunk without pause while credit lasts, so this only fires on a stuck broker.
pub const SCAN_IDLE: Duration = Duration::from_secs(10);

/// Unacked deliveries of a scan (stream consumers need a prefetch; acks give the credit back).
pub const SCAN_PREFETCH: u16 = 1000;

/// A scan acks (with `multiple`) every this many deliveries, well inside [`SCAN_PREFETCH`].
pub const SCAN_ACK_EVERY: u64 = 200;

/// A page may reach at most this deep (`offset + limit`): a newest-first page of a forward scan
/// holds the last `offset + limit` matches, so this bounds a listing's memory.
pub const MAX_PAGE_WINDOW: usize = 10_000;

/// Replay and discard act on at most this many entries per call (oldest first); the entries are
/// held in memory meanwhile. What is left is reported, and the next call (which skips resolved
/// entries) continues.
pub const MAX_ACTION_BATCH: usize = 10_000;

/// Fetching entries by offset: offsets at most this far apart are read in one pass over the
/// stream rather than with a consumer each. Starting a consumer (a channel, a subscription, and
/// the broker reading from the start of the offset's chunk) cost 20–30 ms here, about as long
/// as streaming 1 000–2 000 records (`ladder-bench parking`, BENCHMARKS.md), so reading up to
/// this many records in between is cheaper than starting again.
pub const FETCH_RUN_GAP: u64 = 2048;

/// What can go wrong reading or changing the parking lot.
#[derive(Debug, thiserror::Error)]
pub enum ParkingError {
    /// The broker refused or failed a call.
    #[error("broker: {0}")]
    Broker(#[from] lapin::Error),
    /// A broker call got no answer in time.
    #[error("no answer from the broker within {timeout:?} while {during}")]
    Timeout {
        /// What was being done.
        during: &'static str,
        /// The bound that expired.
        timeout: Duration,
    },
    /// A request that cannot be served as asked.
    #[error("{0}")]
    Invalid(String),
    /// Another replay or discard of this ladder holds the operator lock.
    #[error("another replay or discard of ladder {0} is running; try again when it is done")]
    Busy(String),
    /// No entry at this offset.
    #[error("no parked entry at offset {0}")]
    NotFound(u64),
    /// No ladder of this name in the config.
    #[error("no ladder {0:?}")]
    UnknownLadder(String),
    /// A record could not be decoded.
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
}

async fn bounded<T>(
    during: &'static str,
    call: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, ParkingError> {
    match tokio::time::timeout(BROKER_TIMEOUT, call).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(ParkingError::Timeout {
            during,
            timeout: BROKER_TIMEOUT,
        }),
    }
}

/// Milliseconds since the Unix epoch.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What an operator did to an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Republished (confirmed by the broker) to `to`.
    Replayed,
    /// Marked as handled without republishing.
    Discarded,
}

/// A resolution record: the body of a [`RESOLUTION_FORMAT`] record in the parked stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Resolution {
    /// Always [`RESOLUTION_FORMAT`].
    pub format: String,
    /// The stream offset of the entry it resolves.
    pub resolves: u64,
    /// What was done.
    pub action: Action,
    /// Who asked (`$USER`, `--by`, or the HTTP caller).
    pub by: String,
    /// When, ms since the epoch.
    pub at_ms: u64,
    /// The queue it was replayed to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
}

/// One parked message as read from the stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParkedEntry {
    /// Its offset in the stream: the entry's identity.
    pub offset: u64,
    /// The record.
    pub envelope: Envelope,
    /// How it was resolved, if it was (the newest resolution wins).
    pub resolution: Option<Resolution>,
}

/// Entries parked before `since` may lie in chunks the broker stamped up to this much later
/// (the envelope's time is the service's clock, the chunk's the broker's), so a time-bounded scan
/// starts this much earlier; the filter then drops what is too old.
pub const CLOCK_MARGIN: Duration = Duration::from_secs(60);

/// Where a scan starts. Resolutions always follow their entry, so every scan of one request
/// (resolutions, then entries) may start at the same place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// The first record the stream still holds.
    First,
    /// This offset (the broker starts at the chunk holding it; earlier records are skipped).
    Offset(u64),
    /// The first chunk written at or after this time, ms since the epoch (seconds resolution).
    Time(u64),
}

impl Start {
    /// The cheapest start that cannot miss a match: the lowest offset asked for, else the time
    /// bound minus [`CLOCK_MARGIN`], else the first record.
    fn for_filter(filter: &Filter) -> Start {
        if let Some(first) = filter.offsets.as_ref().and_then(|o| o.first()) {
            Start::Offset(*first)
        } else if let Some(since) = filter.since_ms {
            Start::Time(since.saturating_sub(CLOCK_MARGIN.as_millis() as u64))
        } else {
            Start::First
        }
    }

    fn argument(self) -> AMQPValue {
        match self {
            Start::First => AMQPValue::LongString(LongString::from("first")),
            Start::Offset(offset) => AMQPValue::LongLongInt(i64::try_from(offset).unwrap_or(i64::MAX)),
            Start::Time(ms) => AMQPValue::Timestamp(ms / 1000),
        }
    }

    /// Whether a delivered record at `offset` belongs to the scan.
    fn includes(self, offset: u64) -> bool {
        match self {
            Start::Offset(from) => offset >= from,
            Start::First | Start::Time(_) => true,
        }
    }
}

/// Which entries to act on. Every field narrows; the default matches everything.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Filter {
    /// Only these offsets.
    pub offsets: Option<BTreeSet<u64>>,
    /// The ladder that parked it.
    pub ladder: Option<String>,
    /// The queue it was headed for.
    pub destination: Option<String>,
    /// The reason code.
    pub reason: Option<String>,
    /// Parked at or after, ms since the epoch.
    pub since_ms: Option<u64>,
    /// Parked at or before, ms since the epoch.
    pub until_ms: Option<u64>,
    /// The original `message_id`.
    pub message_id: Option<String>,
    /// The original `correlation_id`.
    pub correlation_id: Option<String>,
    /// Original headers that must have these values (text, or an integer's decimal form).
    pub headers: Vec<(String, String)>,
    /// A substring of the original body; bodies that are not UTF-8 never match.
    pub body_contains: Option<String>,
}

impl Filter {
    /// Whether no field narrows (everything matches).
    pub fn is_empty(&self) -> bool {
        *self == Filter::default()
    }

    /// Whether a field narrows that the [`LotIndex`] does not hold (headers, body, ladder), so
    /// the candidates' records must be read and checked with [`Filter::matches`].
    pub fn needs_records(&self) -> bool {
        self.ladder.is_some() || !self.headers.is_empty() || self.body_contains.is_some()
    }

    /// Whether the entry at `offset` matches. Cheap checks first; the body is decoded last.
    pub fn matches(&self, offset: u64, e: &Envelope) -> bool {
        let eq = |want: &Option<String>, have: Option<&str>| want.as_deref().is_none_or(|w| have == Some(w));
        let props = &e.message.properties;
        let prop = |name: &str| props.get(name).and_then(Value::as_str);
        self.offsets.as_ref().is_none_or(|o| o.contains(&offset))
            && eq(&self.ladder, Some(&e.ladder))
            && eq(&self.destination, e.destination.as_deref())
            && eq(&self.reason, Some(&e.reason))
            && self.since_ms.is_none_or(|t| e.parked_at_ms >= t)
            && self.until_ms.is_none_or(|t| e.parked_at_ms <= t)
            && eq(&self.message_id, prop("message_id"))
            && eq(&self.correlation_id, prop("correlation_id"))
            && self.headers.iter().all(|(k, v)| {
                header_text(props.get("headers").and_then(|h| h.get(k.as_str()))).as_deref() == Some(v.as_str())
            })
            && self.body_contains.as_ref().is_none_or(|needle| {
                e.message
                    .body()
                    .ok()
                    .and_then(|b| String::from_utf8(b).ok())
                    .is_some_and(|text| text.contains(needle.as_str()))
            })
    }
}

/// A typed header value (`{"type", "value"}`) as text: strings as they are, integers in
/// decimal, booleans as `true`/`false`; other types have no text form.
pub(crate) fn header_text(typed: Option<&Value>) -> Option<String> {
    let value = typed?.get("value")?;
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) if n.is_i64() || n.is_u64() => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Parses a `--since`/`--until` bound: RFC 3339 (`2026-11-22T01:00:00Z`) or a humantime
/// duration before `now_ms` (`15m`, `2h 30m`). Returns ms since the epoch.
pub fn parse_time_bound(text: &str, now_ms: u64) -> Result<u64, ParkingError> {
    let text = text.trim();
    if let Ok(time) = humantime::parse_rfc3339_weak(text) {
        return time
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .map_err(|_| ParkingError::Invalid(format!("{text:?} is before 1970")));
    }
    match humantime::parse_duration(text) {
        Ok(ago) => Ok(now_ms.saturating_sub(ago.as_millis() as u64)),
        Err(_) => Err(ParkingError::Invalid(format!(
            "{text:?} is neither an RFC 3339 time nor a duration ago such as \"15m\""
        ))),
    }
}

/// Parses a `--header key=value` filter.
pub fn parse_header_filter(text: &str) -> Result<(String, String), ParkingError> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(ParkingError::Invalid(format!("{text:?} is not key=value"))),
    }
}

/// A replay rate: `count` messages per `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    /// Messages …
    pub count: u32,
    /// … per this period.
    pub per: Duration,
}

impl Rate {
    /// The gap between two sends.
    pub fn interval(&self) -> Duration {
        self.per / self.count.max(1)
    }
}

impl FromStr for Rate {
    type Err = ParkingError;

    /// `N/s`, `N/m` or `N/h`, N ≥ 1.
    fn from_str(text: &str) -> Result<Rate, ParkingError> {
        let bad = || ParkingError::Invalid(format!("rate {text:?} is not N/s, N/m or N/h with N >= 1"));
        let (count, unit) = text.trim().split_once('/').ok_or_else(bad)?;
        let count: u32 = count.trim().parse().map_err(|_| bad())?;
        let per = match unit.trim() {
            "s" => Duration::from_secs(1),
            "m" => Duration::from_secs(60),
            "h" => Duration::from_secs(3600),
            _ => return Err(bad()),
        };
        if count == 0 {
            return Err(bad());
        }
        Ok(Rate { count, per })
    }
}

/// Paces sends to a [`Rate`]: a token bucket of one token, so no burst ever exceeds the rate
/// (send `n` happens no earlier than `interval × n` after send 0). Pure: the caller passes the
/// clock and sleeps.
#[derive(Debug, Clone)]
pub struct Pacer {
    interval: Duration,
    next: Option<Instant>,
}

impl Pacer {
    /// A pacer for `rate`.
    pub fn new(rate: Rate) -> Pacer {
        Pacer {
            interval: rate.interval(),
            next: None,
        }
    }

    /// How long to wait, from `now`, before the next send; books that send.
    pub fn delay(&mut self, now: Instant) -> Duration {
        let slot = self.next.map_or(now, |next| next.max(now));
        self.next = Some(slot + self.interval);
        slot - now
    }
}

/// A page of a listing, newest first.
#[derive(Debug, Clone, Serialize)]
pub struct Page {
    /// Entries matching the filter (resolved ones only if asked for).
    pub total: u64,
    /// `entries[0]` is the `offset`-th newest match.
    pub entries: Vec<ParkedEntry>,
}

/// Which page of a listing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRequest {
    /// Newest matches to skip.
    pub offset: usize,
    /// Entries to return.
    pub limit: usize,
}

/// Replay settings.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Another queue than the recorded destination (it must pass the ladder's allow-list).
    pub to: Option<String>,
    /// At most this many replays per period.
    pub rate: Option<Rate>,
    /// Only say what would be replayed.
    pub dry_run: bool,
    /// Who asked, recorded in the resolution and logged.
    pub by: String,
}

/// What happened to one entry of a replay or a discard.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "kebab-case")]
pub enum Status {
    /// Republished, confirmed and resolved.
    Replayed,
    /// Dry run: would be republished.
    WouldReplay,
    /// Resolved as discarded.
    Discarded,
    /// Not done; the entry stays unresolved (unless `resolved` says otherwise).
    Failed {
        /// Why.
        error: String,
    },
}

/// The outcome for one entry.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    /// The entry's offset.
    pub offset: u64,
    /// The queue it was (or would be) replayed to; `None` for a discard or no known destination.
    pub to: Option<String>,
    /// What happened.
    #[serde(flatten)]
    pub status: Status,
}

/// What a selection for replay or discard found.
#[derive(Debug, Clone)]
pub struct Selection {
    /// Unresolved matching entries, oldest first, at most [`MAX_ACTION_BATCH`].
    pub entries: Vec<ParkedEntry>,
    /// Matching unresolved entries left out because of [`MAX_ACTION_BATCH`].
    pub left_over: u64,
}

/// Held while a replay or discard selects and acts, so two operators (or replicas) never act on
/// the same entries at once: the second is refused with [`ParkingError::Busy`], and the next one
/// selects after the first recorded its resolutions.
///
/// It is an exclusive, non-durable queue `N.L.operator-lock`: the broker lets one connection
/// own it and deletes it when that connection dies, so a crashed holder never leaves it locked.
/// Requests sharing one connection (a future HTTP handler) must also serialize among themselves.
pub struct OperatorLock {
    channel: Channel,
    queue: String,
}

impl OperatorLock {
    /// Releases the lock (deletes the queue); a failure only delays the release until the
    /// connection closes.
    pub async fn release(self) {
        let _ = tokio::time::timeout(
            BROKER_TIMEOUT,
            self.channel
                .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default()),
        )
        .await;
        let _ = tokio::time::timeout(BROKER_TIMEOUT, self.channel.close(200, "unlocked".into())).await;
    }
}

/// The parking lot of one ladder, on a connection the caller owns.
pub struct ParkingLot<'a> {
    connection: &'a Connection,
    spec: &'a LadderSpec,
    names: Names,
}

impl<'a> ParkingLot<'a> {
    /// The parking lot of `spec` in `namespace`.
    pub fn new(connection: &'a Connection, namespace: &str, spec: &'a LadderSpec) -> Self {
        ParkingLot {
            connection,
            spec,
            names: Names::new(namespace, &spec.name),
        }
    }

    /// Takes the ladder's [`OperatorLock`], or fails with [`ParkingError::Busy`] at once.
    pub async fn lock(&self) -> Result<OperatorLock, ParkingError> {
        let channel = bounded("opening a channel", self.connection.create_channel()).await?;
        let queue = format!("{}.operator-lock", self.names.intake_exchange);
        let options = QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..QueueDeclareOptions::default()
        };
        let declare = channel.queue_declare(queue.as_str().into(), options, FieldTable::default());
        match tokio::time::timeout(BROKER_TIMEOUT, declare).await {
            Ok(Ok(_)) => Ok(OperatorLock { channel, queue }),
            // 405 RESOURCE_LOCKED: another connection owns it (the broker closed this channel)
            Ok(Err(e)) if matches!(e.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.get_id() == 405) => {
                Err(ParkingError::Busy(self.spec.name.clone()))
            }
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(ParkingError::Timeout {
                during: "taking the operator lock",
                timeout: BROKER_TIMEOUT,
            }),
        }
    }

    /// The stream's name, `N.L.parked`.
    pub fn stream(&self) -> &str {
        &self.names.parked
    }

    /// A fresh index of the records `filter` can match, from where they may start to the
    /// stream's end now: what a one-off command (the CLI) lists and selects from.
    pub async fn index_for(&self, filter: &Filter) -> Result<SharedIndex, ParkingError> {
        let index = SharedIndex::default();
        let end = self.end().await?;
        self.catch_up(&index, Start::for_filter(filter), end.map(Stop::At))
            .await?;
        Ok(index)
    }

    /// A fresh index of the records `filter` can match, up to and including the marker `id`
    /// (see [`ParkingLot::mark`]): what a replay or discard selects from.
    pub async fn index_through(&self, filter: &Filter, marker: &str) -> Result<SharedIndex, ParkingError> {
        let index = SharedIndex::default();
        let start = Start::for_filter(filter);
        // A read from an offset past the end would wait for records after the marker, never
        // seeing it: such offsets hold nothing to act on yet.
        if let Start::Offset(first) = start
            && self.end().await?.is_none_or(|end| first > end)
        {
            return Ok(index);
        }
        self.catch_up(&index, start, Some(Stop::Marker(marker.to_string())))
            .await?;
        Ok(index)
    }

    /// Appends a marker record (confirmed) and returns its id. Hold the [`OperatorLock`] first:
    /// then every resolution written before the marker is before it in the stream.
    pub async fn mark(&self, by: &str) -> Result<String, ParkingError> {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let id = format!(
            "{}-{nanos}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let marker = Marker {
            format: MARKER_FORMAT.to_string(),
            id: id.clone(),
            by: by.to_string(),
        };
        let body = serde_json::to_vec(&marker).map_err(|e| ParkingError::Invalid(e.to_string()))?;
        let channel = self.confirm_channel().await?;
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_type(MARKER_FORMAT.into());
        let confirmation = publish(&channel, "", &self.names.parked, &body, properties).await;
        let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.close(200, "marked".into())).await;
        match confirmation? {
            Confirmation::Ack(None) => Ok(id),
            Confirmation::Ack(Some(_)) => Err(ParkingError::Invalid(format!(
                "the parking lot {} does not exist",
                self.names.parked
            ))),
            Confirmation::Nack(_) | Confirmation::NotRequested => Err(ParkingError::Invalid(
                "the broker refused the marker record (nack)".into(),
            )),
        }
    }

    /// Applies the records from `from` to `end` to `index`.
    async fn catch_up(&self, index: &SharedIndex, from: Start, end: Option<Stop>) -> Result<(), ParkingError> {
        let stream = self.names.parked.clone();
        self.scan(from, end, |offset, kind, body| match lot_index::decode(kind, body) {
            Ok(record) => index.write().apply(offset, record),
            Err(e) => warn!(%stream, offset, error = %e, "an undecodable record; skipped"),
        })
        .await
    }

    /// Follows the stream into `index` from where it left off (the first record for a new one)
    /// until `stop`, or an error the caller retries after a pause. Each delivery is applied as
    /// it comes, so `index` trails the stream by one round trip.
    pub async fn follow(&self, index: &SharedIndex, stop: &CancellationToken) -> Result<(), ParkingError> {
        let start = match index.read().next_offset() {
            Some(next) => Start::Offset(next),
            None => Start::First,
        };
        self.reading(start.argument(), async |_, consumer| {
            self.follow_on(consumer, start, index, stop).await
        })
        .await
    }

    async fn follow_on(
        &self,
        consumer: &mut lapin::Consumer,
        start: Start,
        index: &SharedIndex,
        stop: &CancellationToken,
    ) -> Result<(), ParkingError> {
        let mut unacked = 0u64;
        loop {
            let delivery = tokio::select! {
                () = stop.cancelled() => return Ok(()),
                delivery = consumer.next() => match delivery {
                    None => return Err(ParkingError::Invalid("the broker cancelled the follower".into())),
                    Some(delivery) => delivery?,
                },
            };
            unacked += 1;
            if unacked >= SCAN_ACK_EVERY {
                bounded("acknowledging", delivery.acker.ack(BasicAckOptions { multiple: true })).await?;
                unacked = 0;
            }
            let Some(offset) = stream_offset(delivery.properties.headers()) else {
                continue;
            };
            if !start.includes(offset) {
                continue;
            }
            let kind = delivery.properties.kind().as_ref().map(|k| k.as_str());
            match lot_index::decode(kind, &delivery.data) {
                Ok(record) => index.write().apply(offset, record),
                Err(e) => {
                    warn!(stream = %self.names.parked, offset, error = %e, "an undecodable record; skipped");
                    index.write().skip(offset);
                }
            }
        }
    }

    /// Entries matching `filter`, newest first, one page of them, and how many match in all.
    /// Resolved entries are left out unless `include_resolved`. The index says which; the page's
    /// records are read from the stream.
    pub async fn list(
        &self,
        index: &SharedIndex,
        filter: &Filter,
        page: PageRequest,
        include_resolved: bool,
    ) -> Result<Page, ParkingError> {
        let window = page.offset.saturating_add(page.limit);
        if !filter.needs_records() {
            let found = index.read().page(filter, include_resolved, page.offset, page.limit);
            let mut entries = self.entries(index, &found.offsets).await?;
            entries.sort_by_key(|e| std::cmp::Reverse(e.offset));
            return Ok(Page {
                total: found.total,
                entries,
            });
        }
        if window > MAX_PAGE_WINDOW {
            return Err(ParkingError::Invalid(format!(
                "offset + limit is {window}; at most {MAX_PAGE_WINDOW} when searching headers or bodies: narrow the filter instead"
            )));
        }
        let candidates = index.read().candidates(filter, include_resolved);
        let mut total = 0u64;
        let mut newest: VecDeque<ParkedEntry> = VecDeque::with_capacity(window.min(1024));
        self.fetch_each(&candidates, |offset, envelope| {
            if filter.matches(offset, &envelope) {
                total += 1;
                if window > 0 {
                    if newest.len() == window {
                        newest.pop_front();
                    }
                    newest.push_back(ParkedEntry {
                        offset,
                        envelope,
                        resolution: None,
                    });
                }
            }
        })
        .await?;
        let mut entries: Vec<ParkedEntry> = newest.into_iter().rev().skip(page.offset).take(page.limit).collect();
        let ix = index.read();
        for entry in &mut entries {
            entry.resolution = ix.resolution(entry.offset).ok().flatten();
        }
        Ok(Page { total, entries })
    }

    /// Entries matching `filter`, in all, per destination and per reason. The index counts
    /// alone unless the filter has header or body conditions; then the candidates are read and
    /// checked, as for [`ParkingLot::list`].
    pub async fn counts(
        &self,
        index: &SharedIndex,
        filter: &Filter,
        include_resolved: bool,
    ) -> Result<lot_index::Counts, ParkingError> {
        if !filter.needs_records() {
            return Ok(index.read().counts(filter, include_resolved));
        }
        let candidates = index.read().candidates(filter, include_resolved);
        let mut tally = lot_index::Tally::default();
        self.fetch_each(&candidates, |offset, envelope| {
            if filter.matches(offset, &envelope) {
                tally.add(envelope.destination.as_deref(), &envelope.reason);
            }
        })
        .await?;
        Ok(tally.finish())
    }

    /// The entry at `offset`, resolved or not.
    pub async fn show(&self, index: &SharedIndex, offset: u64) -> Result<ParkedEntry, ParkingError> {
        if index.read().resolution(offset).is_err() {
            return Err(ParkingError::NotFound(offset));
        }
        self.entries(index, &[offset])
            .await?
            .into_iter()
            .next()
            .ok_or(ParkingError::NotFound(offset))
    }

    /// The records at `offsets` (any order) with their resolutions from `index`, oldest first;
    /// offsets that hold no readable entry are left out.
    pub async fn entries(&self, index: &SharedIndex, offsets: &[u64]) -> Result<Vec<ParkedEntry>, ParkingError> {
        let mut sorted = offsets.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let mut entries = Vec::with_capacity(sorted.len());
        self.fetch_each(&sorted, |offset, envelope| {
            entries.push(ParkedEntry {
                offset,
                envelope,
                resolution: None,
            })
        })
        .await?;
        let ix = index.read();
        for entry in &mut entries {
            entry.resolution = ix.resolution(entry.offset).ok().flatten();
        }
        Ok(entries)
    }

    /// Reads the parked entries at `offsets` (ascending) and hands each to `visit`. Nearby
    /// offsets are read in one run (a consumer from the first to the last of the run); a gap
    /// wider than [`FETCH_RUN_GAP`] starts a new run, so a sparse selection does not read the
    /// whole stream between its entries.
    async fn fetch_each(&self, offsets: &[u64], mut visit: impl FnMut(u64, Envelope)) -> Result<(), ParkingError> {
        let stream = self.names.parked.clone();
        let mut rest = offsets;
        while let Some(&first) = rest.first() {
            let run_len = rest
                .windows(2)
                .position(|w| w[1] - w[0] > FETCH_RUN_GAP)
                .map_or(rest.len(), |i| i + 1);
            let (run, tail) = rest.split_at(run_len);
            let last = run[run.len() - 1];
            let mut wanted = run.iter().peekable();
            self.scan(Start::Offset(first), Some(Stop::At(last)), |offset, kind, body| {
                while wanted.next_if(|w| **w < offset).is_some() {}
                let not_an_entry = matches!(kind, Some(RESOLUTION_FORMAT | MARKER_FORMAT));
                if wanted.next_if(|w| **w == offset).is_none() || not_an_entry {
                    return;
                }
                match Envelope::from_slice(body) {
                    Ok(envelope) => visit(offset, envelope),
                    Err(e) => warn!(%stream, offset, error = %e, "an undecodable record; skipped"),
                }
            })
            .await?;
            rest = tail;
        }
        Ok(())
    }

    /// Unresolved entries matching `filter`, oldest first, for a replay or a discard. Hold the
    /// [`OperatorLock`] from before the selection until the action is done, with `index` caught
    /// up to the stream's end after the lock was taken.
    pub async fn select(&self, index: &SharedIndex, filter: &Filter) -> Result<Selection, ParkingError> {
        let candidates = index.read().candidates(filter, false);
        if !filter.needs_records() {
            let take = candidates.len().min(MAX_ACTION_BATCH);
            let entries = self.entries(index, &candidates[..take]).await?;
            return Ok(Selection {
                entries,
                left_over: (candidates.len() - take) as u64,
            });
        }
        let mut entries = Vec::new();
        let mut left_over = 0u64;
        self.fetch_each(&candidates, |offset, envelope| {
            if filter.matches(offset, &envelope) {
                if entries.len() < MAX_ACTION_BATCH {
                    entries.push(ParkedEntry {
                        offset,
                        envelope,
                        resolution: None,
                    });
                } else {
                    left_over += 1;
                }
            }
        })
        .await?;
        Ok(Selection { entries, left_over })
    }

    /// Replays `entries` in order: each is republished through the default exchange to its
    /// destination (or `options.to`), persistent and mandatory, with a fresh attempt count and
    /// `retry-replayed-from`, at most at `options.rate`; only after the broker confirmed it is
    /// the resolution appended (and applied to `index`). A failure is reported per entry and
    /// leaves it unresolved.
    pub async fn replay(
        &self,
        index: &SharedIndex,
        entries: &[ParkedEntry],
        options: &ReplayOptions,
    ) -> Result<Vec<Outcome>, ParkingError> {
        let channel = if options.dry_run {
            None
        } else {
            Some(self.confirm_channel().await?)
        };
        let mut pacer = options.rate.map(Pacer::new);
        let mut outcomes = Vec::with_capacity(entries.len());
        for entry in entries {
            let target = options.to.clone().or_else(|| entry.envelope.destination.clone());
            let fail = |error: String| Outcome {
                offset: entry.offset,
                to: target.clone(),
                status: Status::Failed { error },
            };
            let Some(queue) = target.clone() else {
                outcomes.push(fail("no destination is recorded; give another queue (--to)".into()));
                continue;
            };
            if let Some(problem) = protocol::refuse_destination(self.spec, &self.names, &queue) {
                outcomes.push(fail(problem));
                continue;
            }
            let (body, properties) = match self.replayed_message(entry, &queue) {
                Ok(message) => message,
                Err(e) => {
                    outcomes.push(fail(e.to_string()));
                    continue;
                }
            };
            let Some(channel) = &channel else {
                outcomes.push(Outcome {
                    offset: entry.offset,
                    to: target,
                    status: Status::WouldReplay,
                });
                continue;
            };
            if let Some(pacer) = pacer.as_mut() {
                tokio::time::sleep(pacer.delay(Instant::now())).await;
            }
            let status = match publish(channel, "", &queue, &body, properties).await? {
                Confirmation::Ack(None) => {
                    let resolution = self.resolution(entry.offset, Action::Replayed, &options.by, Some(&queue));
                    match self.append(channel, &resolution).await {
                        Ok(()) => {
                            index.write().resolve(&resolution);
                            info!(ladder = %self.spec.name, offset = entry.offset, to = %queue, by = %options.by, "replayed a parked message");
                            Status::Replayed
                        }
                        Err(e) => {
                            warn!(ladder = %self.spec.name, offset = entry.offset, to = %queue, by = %options.by, error = %e,
                                  "replayed a parked message but could not record it; a later replay sends it again");
                            Status::Failed {
                                error: format!(
                                    "replayed, but the resolution was not recorded ({e}): it may be sent again"
                                ),
                            }
                        }
                    }
                }
                Confirmation::Ack(Some(returned)) => Status::Failed {
                    error: format!(
                        "the broker returned it: no queue {queue:?} ({} {})",
                        returned.reply_code, returned.reply_text
                    ),
                },
                Confirmation::Nack(_) | Confirmation::NotRequested => Status::Failed {
                    error: "the broker refused the publish (nack)".into(),
                },
            };
            outcomes.push(Outcome {
                offset: entry.offset,
                to: target,
                status,
            });
        }
        if let Some(channel) = channel {
            let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.close(200, "replayed".into())).await;
        }
        Ok(outcomes)
    }

    /// Marks `entries` discarded: one confirmed resolution record each (applied to `index`). The
    /// records stay in the stream until its retention removes them.
    pub async fn discard(
        &self,
        index: &SharedIndex,
        entries: &[ParkedEntry],
        by: &str,
    ) -> Result<Vec<Outcome>, ParkingError> {
        let channel = self.confirm_channel().await?;
        let mut outcomes = Vec::with_capacity(entries.len());
        for entry in entries {
            let resolution = self.resolution(entry.offset, Action::Discarded, by, None);
            let status = match self.append(&channel, &resolution).await {
                Ok(()) => {
                    index.write().resolve(&resolution);
                    info!(ladder = %self.spec.name, offset = entry.offset, by = %by, "discarded a parked message");
                    Status::Discarded
                }
                Err(e) => Status::Failed { error: e.to_string() },
            };
            outcomes.push(Outcome {
                offset: entry.offset,
                to: None,
                status,
            });
        }
        let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.close(200, "discarded".into())).await;
        Ok(outcomes)
    }

    /// The body and properties to replay `entry` to `queue` with.
    fn replayed_message(&self, entry: &ParkedEntry, queue: &str) -> Result<(Vec<u8>, BasicProperties), ParkingError> {
        let message = &entry.envelope.message;
        let original = message.properties()?;
        let mut extra = vec![(
            header::RETRY_REPLAYED_FROM,
            long_string(&format!("{}@{}", self.names.parked, entry.offset)),
        )];
        let had_retry_to = original
            .headers()
            .as_ref()
            .is_some_and(|h| h.inner().contains_key(header::RETRY_TO));
        if had_retry_to {
            extra.push((header::RETRY_TO, long_string(queue)));
        }
        Ok((message.body()?, protocol::replay_properties(&original, &extra)))
    }

    fn resolution(&self, offset: u64, action: Action, by: &str, to: Option<&str>) -> Resolution {
        Resolution {
            format: RESOLUTION_FORMAT.to_string(),
            resolves: offset,
            action,
            by: by.to_string(),
            at_ms: now_ms(),
            to: to.map(str::to_string),
        }
    }

    /// Appends a resolution record and waits for the broker's confirm.
    async fn append(&self, channel: &Channel, resolution: &Resolution) -> Result<(), ParkingError> {
        let body = serde_json::to_vec(resolution).map_err(|e| ParkingError::Invalid(e.to_string()))?;
        let mut headers = FieldTable::default();
        headers.insert("parked-ladder".into(), long_string(&self.spec.name));
        let properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_type(RESOLUTION_FORMAT.into())
            .with_headers(headers);
        match publish(channel, "", &self.names.parked, &body, properties).await? {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(ParkingError::Invalid(format!(
                "the parking lot {} does not exist",
                self.names.parked
            ))),
            Confirmation::Nack(_) | Confirmation::NotRequested => Err(ParkingError::Invalid(
                "the broker refused the resolution record (nack)".into(),
            )),
        }
    }

    async fn confirm_channel(&self) -> Result<Channel, ParkingError> {
        let channel = bounded("opening a channel", self.connection.create_channel()).await?;
        bounded(
            "selecting confirms",
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        Ok(channel)
    }

    /// The offset of the stream's last record now, or `None` if it is empty: the highest offset
    /// of the last chunk (a consumer from `last` starts at the last chunk's first record).
    pub async fn end(&self) -> Result<Option<u64>, ParkingError> {
        let last = AMQPValue::LongString(LongString::from("last"));
        self.reading(last, async |_, consumer| {
            let mut end = None;
            let mut wait = SCAN_FIRST_RECORD;
            while let Ok(Some(delivery)) = tokio::time::timeout(wait, consumer.next()).await {
                let delivery = delivery?;
                wait = LAST_CHUNK_GAP;
                bounded("acknowledging", delivery.acker.ack(BasicAckOptions { multiple: true })).await?;
                end = end.max(stream_offset(delivery.properties.headers()));
            }
            Ok(end)
        })
        .await
    }

    /// Reads the stream from `from` to `end` (inclusive; `None`: the stream is empty), handing
    /// each record to `visit` with its offset and `type` property; decoding is the visitor's (one
    /// bad record must not hide the others).
    async fn scan(
        &self,
        from: Start,
        end: Option<Stop>,
        mut visit: impl FnMut(u64, Option<&str>, &[u8]),
    ) -> Result<(), ParkingError> {
        let Some(end) = end else { return Ok(()) };
        if matches!((from, &end), (Start::Offset(from), Stop::At(end)) if from > *end) {
            return Ok(());
        }
        self.reading(from.argument(), async |channel, consumer| {
            self.scan_on(channel, consumer, from, end, &mut visit).await
        })
        .await
    }

    /// Reads the parking lot on a channel of its own: subscribes from `start`, hands the
    /// consumer to `read`, then cancels it and closes the channel, in that order (see
    /// [`cancel`]), whatever `read` returned.
    async fn reading<T>(
        &self,
        start: AMQPValue,
        read: impl AsyncFnOnce(&Channel, &mut lapin::Consumer) -> Result<T, ParkingError>,
    ) -> Result<T, ParkingError> {
        let channel = bounded("opening a channel", self.connection.create_channel()).await?;
        let result = match self.subscribe(&channel, start).await {
            Ok(mut consumer) => {
                let result = read(&channel, &mut consumer).await;
                cancel(&channel, &consumer).await;
                result
            }
            Err(e) => Err(e),
        };
        let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.close(200, "read".into())).await;
        result
    }

    async fn subscribe(&self, channel: &Channel, start: AMQPValue) -> Result<lapin::Consumer, ParkingError> {
        bounded(
            "setting the prefetch",
            channel.basic_qos(SCAN_PREFETCH, BasicQosOptions::default()),
        )
        .await?;
        let mut args = FieldTable::default();
        args.insert("x-stream-offset".into(), start);
        bounded(
            "subscribing to the parking lot",
            channel.basic_consume(
                self.names.parked.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                args,
            ),
        )
        .await
    }

    async fn scan_on(
        &self,
        channel: &Channel,
        consumer: &mut lapin::Consumer,
        from: Start,
        end: Stop,
        visit: &mut impl FnMut(u64, Option<&str>, &[u8]),
    ) -> Result<(), ParkingError> {
        let mut unacked = 0u64;
        let last_tag;
        let mut received = false;
        loop {
            // From a time after the last chunk the broker delivers nothing until a new chunk
            // comes: then no match was written after that time.
            let quiet_means_done = !received && matches!(from, Start::Time(_));
            let wait = if quiet_means_done { SCAN_FIRST_RECORD } else { SCAN_IDLE };
            let delivery = match tokio::time::timeout(wait, consumer.next()).await {
                Err(_) if quiet_means_done => return Ok(()),
                Err(_) => {
                    return Err(ParkingError::Timeout {
                        during: "reading the parking lot",
                        timeout: SCAN_IDLE,
                    });
                }
                Ok(None) => return Err(ParkingError::Invalid("the broker cancelled the scan".into())),
                Ok(Some(delivery)) => delivery?,
            };
            received = true;
            unacked += 1;
            let tag = delivery.delivery_tag;
            if unacked >= SCAN_ACK_EVERY {
                bounded("acknowledging", delivery.acker.ack(BasicAckOptions { multiple: true })).await?;
                unacked = 0;
            }
            let Some(offset) = stream_offset(delivery.properties.headers()) else {
                warn!(stream = %self.names.parked, "a delivery without x-stream-offset; skipped");
                continue;
            };
            if matches!(end, Stop::At(end) if offset > end) {
                last_tag = tag;
                break;
            }
            let kind = delivery.properties.kind().as_ref().map(|k| k.as_str());
            // A numeric start offset delivers from the chunk that holds it.
            if from.includes(offset) {
                visit(offset, kind, &delivery.data);
            }
            let done = match &end {
                Stop::At(end) => offset == *end,
                Stop::Marker(id) => {
                    kind == Some(MARKER_FORMAT)
                        && serde_json::from_slice::<Marker>(&delivery.data).is_ok_and(|m| m.id == *id)
                }
            };
            if done {
                last_tag = tag;
                break;
            }
        }
        if unacked > 0 {
            let _ = tokio::time::timeout(
                BROKER_TIMEOUT,
                channel.basic_ack(last_tag, BasicAckOptions { multiple: true }),
            )
            .await;
        }
        Ok(())
    }
}

/// Cancels `consumer` and waits for the broker's answer, before its channel is closed. Dropping
/// a lapin `Consumer` sends its cancel from a background task; when that task runs after a
/// `channel.close` began, lapin 4.12 fails the whole connection ("invalid channel state:
/// Closing (basic.cancel)") — seen here as a CLI exiting with `invalid connection state` in
/// about one test run in 25. Cancelled first, the consumer leaves its drop nothing to send.
async fn cancel(channel: &Channel, consumer: &lapin::Consumer) {
    let _ = tokio::time::timeout(
        BROKER_TIMEOUT,
        channel.basic_cancel(consumer.tag(), BasicCancelOptions::default()),
    )
    .await;
}

fn stream_offset(headers: &Option<FieldTable>) -> Option<u64> {
    protocol::as_u64(headers.as_ref()?.inner().get("x-stream-offset")?)
}

/// Publishes mandatory and waits for the confirm, each step bounded.
async fn publish(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<Confirmation, ParkingError> {
    let options = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    let confirm = bounded(
        "publishing",
        channel.basic_publish(exchange.into(), routing_key.into(), options, body, properties),
    )
    .await?;
    bounded("waiting for the publish confirm", confirm).await
}

/// `ms` since the epoch as RFC 3339, to the second (UTC).
pub fn format_time(ms: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// A human table of `entries`: offset, parked at, ladder, reason, destination, attempts,
/// message id, and the resolution when any entry has one.
pub fn render_table(entries: &[ParkedEntry]) -> String {
    let with_resolution = entries.iter().any(|e| e.resolution.is_some());
    let mut rows = vec![vec![
        "OFFSET".to_string(),
        "PARKED AT".into(),
        "LADDER".into(),
        "REASON".into(),
        "DESTINATION".into(),
        "ATTEMPTS".into(),
        "MESSAGE ID".into(),
    ]];
    if with_resolution {
        rows[0].push("RESOLUTION".into());
    }
    for entry in entries {
        let e = &entry.envelope;
        let mut row = vec![
            entry.offset.to_string(),
            format_time(e.parked_at_ms),
            e.ladder.clone(),
            e.reason.clone(),
            e.destination.clone().unwrap_or_else(|| "-".into()),
            e.attempts.map_or_else(|| "-".into(), |a| a.to_string()),
            e.message
                .properties
                .get("message_id")
                .and_then(Value::as_str)
                .unwrap_or("-")
                .to_string(),
        ];
        if with_resolution {
            row.push(
                entry
                    .resolution
                    .as_ref()
                    .map_or_else(|| "-".into(), describe_resolution),
            );
        }
        rows.push(row);
    }
    let columns = rows[0].len();
    let widths: Vec<usize> = (0..columns)
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    out
}

fn describe_resolution(r: &Resolution) -> String {
    let action = match r.action {
        Action::Replayed => format!("replayed to {}", r.to.as_deref().unwrap_or("?")),
        Action::Discarded => "discarded".to_string(),
    };
    format!("{action} by {} at {}", r.by, format_time(r.at_ms))
}

/// One entry in full: reason and detail, attempts and times, the attempt history and lineage,
/// properties, headers (with their AMQP types) and the body — as text when it is UTF-8,
/// otherwise as hex.
pub fn render_entry(stream: &str, entry: &ParkedEntry) -> String {
    let e = &entry.envelope;
    let mut out = String::new();
    let _ = writeln!(out, "entry        {stream}@{}", entry.offset);
    let _ = writeln!(out, "ladder       {}", e.ladder);
    let _ = writeln!(out, "reason       {}", e.reason);
    let _ = writeln!(out, "detail       {}", e.detail);
    let _ = writeln!(out, "destination  {}", e.destination.as_deref().unwrap_or("-"));
    let _ = writeln!(
        out,
        "attempts     {}",
        e.attempts.map_or_else(|| "-".into(), |a| a.to_string())
    );
    if let Some(first) = e.first_failed_at_ms {
        let _ = writeln!(out, "first failed {}", format_time(first));
    }
    if let Some(from) = &e.replayed_from {
        let _ = writeln!(out, "replayed from {from}");
    }
    if !e.history.is_empty() {
        let _ = writeln!(out, "history");
        let attempt_width = e.history.iter().map(|h| h.attempt.to_string().len()).max().unwrap_or(0);
        let tier_width = e.history.iter().map(|h| h.tier.chars().count()).max().unwrap_or(0);
        for h in &e.history {
            let _ = writeln!(
                out,
                "  attempt {:<attempt_width$}  tier {:<tier_width$}  failed at {}",
                h.attempt,
                h.tier,
                format_time(h.failed_at_ms)
            );
        }
    }
    let _ = writeln!(out, "parked at    {} (hop {})", format_time(e.parked_at_ms), e.hop);
    let _ = writeln!(
        out,
        "resolution   {}",
        entry
            .resolution
            .as_ref()
            .map_or_else(|| "unresolved".into(), describe_resolution)
    );
    let _ = writeln!(
        out,
        "received on  exchange {:?}, routing key {:?}",
        e.message.exchange, e.message.routing_key
    );
    let _ = writeln!(out, "properties");
    if let Some(props) = e.message.properties.as_object() {
        for (key, value) in props.iter().filter(|(k, _)| k.as_str() != "headers") {
            let _ = writeln!(out, "  {key} = {value}");
        }
    }
    let _ = writeln!(out, "headers");
    if let Some(headers) = e.message.properties.get("headers").and_then(Value::as_object) {
        for (key, typed) in headers {
            let kind = typed.get("type").and_then(Value::as_str).unwrap_or("?");
            let value = typed
                .get("value")
                .or_else(|| typed.get("base64"))
                .cloned()
                .unwrap_or(Value::Null);
            let _ = writeln!(out, "  {key} ({kind}) = {value}");
        }
    }
    match e.message.body() {
        Ok(body) => match body_text(&body) {
            Some(text) => {
                let _ = writeln!(out, "body ({} bytes, text)\n{text}", body.len());
            }
            None => {
                let _ = writeln!(out, "body ({} bytes, hex)\n{}", body.len(), hex_dump(&body));
            }
        },
        Err(e) => {
            let _ = writeln!(out, "body: {e}");
        }
    }
    out
}

/// Counts as two tables, per reason and per destination, largest first.
pub fn render_counts(counts: &lot_index::Counts) -> String {
    let mut out = String::new();
    for (title, rows) in [("REASON", &counts.by_reason), ("DESTINATION", &counts.by_destination)] {
        let width = rows
            .iter()
            .map(|(name, _)| name.len())
            .max()
            .unwrap_or(0)
            .max(title.len());
        let _ = writeln!(out, "{title:<width$}  {:>9}", "COUNT");
        for (name, n) in rows {
            let _ = writeln!(out, "{name:<width$}  {n:>9}");
        }
        out.push('\n');
    }
    out
}

/// A body as text, if it is text: UTF-8 without control characters other than tab, newline and
/// carriage return (a NUL or an escape sequence would garble a terminal or hide in a page).
pub fn body_text(bytes: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(bytes).ok()?;
    let printable = text.chars().all(|c| !c.is_control() || matches!(c, '\t' | '\n' | '\r'));
    printable.then_some(text)
}

/// `bytes` as hex, 16 a line, each line led by its offset.
pub fn hex_dump(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 3);
    for (i, chunk) in bytes.chunks(16).enumerate() {
        let _ = write!(out, "{:08x} ", i * 16);
        for b in chunk {
            let _ = write!(out, " {b:02x}");
        }
        out.push('\n');
    }
    out
}

/// The original headers of an envelope as an AMQP table (for tests and tools comparing a
/// replayed message with its record).
pub fn original_headers(e: &Envelope) -> Result<FieldTable, EnvelopeError> {
    match e.message.properties.get("headers") {
        Some(headers) => envelope::table_from_json(headers),
        None => Ok(FieldTable::default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{FORMAT, OriginalMessage};
    use crate::protocol::HistoryEntry;

    fn envelope(
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
            message: OriginalMessage::capture("ns.default", "", &props, body),
        }
    }

    fn headers(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert((*k).into(), v.clone());
        }
        t
    }

    #[test]
    fn empty_filter_matches_everything() {
        let e = envelope("no-route", None, 5, BasicProperties::default(), b"");
        assert!(Filter::default().is_empty());
        assert!(Filter::default().matches(0, &e));
    }

    #[test]
    fn filters_by_each_field() {
        let props = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_correlation_id("c-1".into())
            .with_headers(headers(&[
                ("tenant", long_string("acme")),
                ("n", AMQPValue::LongInt(7)),
                ("t", AMQPValue::FieldTable(FieldTable::default())),
            ]));
        let e = envelope("max-attempts", Some("orders"), 1_000, props, b"{\"order\": 42}");
        let yes = |f: Filter| assert!(f.matches(10, &e), "{f:?} should match");
        let no = |f: Filter| assert!(!f.matches(10, &e), "{f:?} should not match");
        let f = Filter::default;
        yes(Filter {
            offsets: Some(BTreeSet::from([10])),
            ..f()
        });
        no(Filter {
            offsets: Some(BTreeSet::from([11])),
            ..f()
        });
        yes(Filter {
            ladder: Some("default".into()),
            ..f()
        });
        no(Filter {
            ladder: Some("other".into()),
            ..f()
        });
        yes(Filter {
            destination: Some("orders".into()),
            ..f()
        });
        no(Filter {
            destination: Some("orders2".into()),
            ..f()
        });
        yes(Filter {
            reason: Some("max-attempts".into()),
            ..f()
        });
        no(Filter {
            reason: Some("no-route".into()),
            ..f()
        });
        yes(Filter {
            since_ms: Some(1_000),
            until_ms: Some(1_000),
            ..f()
        });
        no(Filter {
            since_ms: Some(1_001),
            ..f()
        });
        no(Filter {
            until_ms: Some(999),
            ..f()
        });
        yes(Filter {
            message_id: Some("m-1".into()),
            ..f()
        });
        no(Filter {
            message_id: Some("m-2".into()),
            ..f()
        });
        yes(Filter {
            correlation_id: Some("c-1".into()),
            ..f()
        });
        no(Filter {
            correlation_id: Some("m-1".into()),
            ..f()
        });
        yes(Filter {
            headers: vec![("tenant".into(), "acme".into()), ("n".into(), "7".into())],
            ..f()
        });
        no(Filter {
            headers: vec![("tenant".into(), "acme".into()), ("n".into(), "8".into())],
            ..f()
        });
        no(Filter {
            headers: vec![("missing".into(), "".into())],
            ..f()
        });
        no(Filter {
            headers: vec![("t".into(), "{}".into())],
            ..f()
        });
        yes(Filter {
            body_contains: Some("\"order\": 4".into()),
            ..f()
        });
        no(Filter {
            body_contains: Some("invoice".into()),
            ..f()
        });
    }

    #[test]
    fn body_filter_skips_binary_bodies_and_unknown_destinations() {
        let e = envelope(
            "no-destination",
            None,
            1,
            BasicProperties::default(),
            &[0xff, 0xfe, b'a'],
        );
        let f = Filter {
            body_contains: Some("a".into()),
            ..Filter::default()
        };
        assert!(!f.matches(0, &e));
        let f = Filter {
            destination: Some("orders".into()),
            ..Filter::default()
        };
        assert!(!f.matches(0, &e));
    }

    #[test]
    fn scans_start_as_late_as_the_filter_allows() {
        let f = Filter::default;
        assert_eq!(Start::for_filter(&f()), Start::First);
        let since = Filter {
            since_ms: Some(100_000),
            ..f()
        };
        assert_eq!(Start::for_filter(&since), Start::Time(40_000));
        assert_eq!(Start::Time(40_999).argument(), AMQPValue::Timestamp(40));
        let both = Filter {
            offsets: Some(BTreeSet::from([9, 4])),
            ..since
        };
        assert_eq!(Start::for_filter(&both), Start::Offset(4));
        assert!(!Start::Offset(4).includes(3) && Start::Offset(4).includes(4));
    }

    #[test]
    fn rates_parse() {
        assert_eq!(
            "50/s".parse::<Rate>().unwrap(),
            Rate {
                count: 50,
                per: Duration::from_secs(1)
            }
        );
        assert_eq!("50/s".parse::<Rate>().unwrap().interval(), Duration::from_millis(20));
        assert_eq!(" 30/m ".parse::<Rate>().unwrap().interval(), Duration::from_secs(2));
        assert_eq!("2/h".parse::<Rate>().unwrap().interval(), Duration::from_secs(1800));
        for bad in ["", "50", "0/s", "-1/s", "5/d", "x/s", "5/"] {
            assert!(bad.parse::<Rate>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn pacer_never_exceeds_the_rate() {
        let mut pacer = Pacer::new("10/s".parse().unwrap());
        let t0 = Instant::now();
        assert_eq!(pacer.delay(t0), Duration::ZERO);
        // asked again at once: wait for the next slot
        assert_eq!(pacer.delay(t0), Duration::from_millis(100));
        // the caller slept until its slot and asks again: one more interval
        assert_eq!(pacer.delay(t0 + Duration::from_millis(100)), Duration::from_millis(100));
        // after a long pause no burst is saved up: one send now, the next an interval later
        let later = t0 + Duration::from_secs(10);
        assert_eq!(pacer.delay(later), Duration::ZERO);
        assert_eq!(pacer.delay(later), Duration::from_millis(100));
    }

    #[test]
    fn time_bounds_parse() {
        let now = 10_000_000;
        assert_eq!(parse_time_bound("15m", now).unwrap(), now - 15 * 60 * 1000);
        assert_eq!(parse_time_bound("1h 30m", now).unwrap(), now - 90 * 60 * 1000);
        assert_eq!(parse_time_bound("1970-01-01T00:00:10Z", now).unwrap(), 10_000);
        assert!(parse_time_bound("yesterday", now).is_err());
        assert_eq!(parse_time_bound("1000h", 5).unwrap(), 0);
    }

    #[test]
    fn header_filters_parse() {
        assert_eq!(
            parse_header_filter("tenant=a=b").unwrap(),
            ("tenant".to_string(), "a=b".to_string())
        );
        assert_eq!(parse_header_filter("k=").unwrap(), ("k".to_string(), String::new()));
        assert!(parse_header_filter("=v").is_err());
        assert!(parse_header_filter("kv").is_err());
    }

    #[test]
    fn resolution_record_format_is_stable() {
        let r = Resolution {
            format: RESOLUTION_FORMAT.into(),
            resolves: 7,
            action: Action::Replayed,
            by: "ops".into(),
            at_ms: 9,
            to: Some("orders".into()),
        };
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"format": "ladder.resolution/v1", "resolves": 7, "action": "replayed",
                               "by": "ops", "at_ms": 9, "to": "orders"})
        );
        let lot_index::Indexed::Resolution(back) =
            lot_index::decode(Some(RESOLUTION_FORMAT), json.to_string().as_bytes()).unwrap()
        else {
            panic!("not a resolution")
        };
        assert_eq!(back, r);
    }

    #[test]
    fn replay_properties_start_a_fresh_count_and_keep_lineage() {
        let props = BasicProperties::default()
            .with_message_id("m".into())
            .with_user_id("alice".into())
            .with_expiration("1000".into())
            .with_headers(headers(&[
                ("retry-attempt", AMQPValue::LongLongInt(3)),
                ("retry-tier", long_string("1s")),
                ("retry-due-at", AMQPValue::LongLongInt(5)),
                ("retry-ladder", long_string("default")),
                ("retry-first-failed-at", AMQPValue::LongLongInt(1)),
                ("retry-to", long_string("orders")),
                ("x-death", AMQPValue::FieldArray(Default::default())),
                ("tenant", long_string("acme")),
            ]));
        let out = protocol::replay_properties(&props, &[(header::RETRY_REPLAYED_FROM, long_string("s@1"))]);
        let h = out.headers().as_ref().unwrap().inner();
        for gone in ["retry-attempt", "retry-tier", "retry-due-at", "retry-ladder", "x-death"] {
            assert!(!h.contains_key(gone), "{gone} kept");
        }
        for kept in ["retry-first-failed-at", "retry-to", "tenant", "retry-replayed-from"] {
            assert!(h.contains_key(kept), "{kept} dropped");
        }
        assert_eq!(h.get("retry-original-user-id"), Some(&long_string("alice")));
        assert!(out.user_id().is_none() && out.expiration().is_none());
        assert_eq!(out.delivery_mode(), &Some(2));
        assert_eq!(out.message_id().as_ref().map(|m| m.as_str()), Some("m"));
    }

    #[test]
    fn table_shows_resolution_only_when_there_is_one() {
        let props = BasicProperties::default().with_message_id("m-1".into());
        let mut entry = ParkedEntry {
            offset: 12,
            envelope: envelope("no-route", Some("orders"), 0, props, b"x"),
            resolution: None,
        };
        let table = render_table(std::slice::from_ref(&entry));
        assert!(table.starts_with("OFFSET"), "{table}");
        let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(
            row,
            [
                "12",
                "1970-01-01T00:00:00Z",
                "default",
                "no-route",
                "orders",
                "3",
                "m-1"
            ]
        );
        assert!(!table.contains("RESOLUTION"));
        entry.resolution = Some(Resolution {
            format: RESOLUTION_FORMAT.into(),
            resolves: 12,
            action: Action::Discarded,
            by: "ops".into(),
            at_ms: 0,
            to: None,
        });
        assert!(render_table(&[entry]).contains("discarded by ops"));
    }

    #[test]
    fn counts_render_as_two_aligned_tables() {
        let counts = lot_index::Counts {
            total: 5,
            by_destination: vec![("orders".into(), 4), ("-".into(), 1)],
            by_reason: vec![("max-attempts".into(), 5)],
        };
        assert_eq!(
            render_counts(&counts),
            "REASON            COUNT\nmax-attempts          5\n\n\
             DESTINATION      COUNT\norders               4\n-                    1\n\n"
        );
    }

    #[test]
    fn show_prints_text_or_hex_bodies() {
        let props = BasicProperties::default().with_headers(headers(&[("n", AMQPValue::LongInt(7))]));
        let mut entry = ParkedEntry {
            offset: 3,
            envelope: envelope("no-route", Some("orders"), 0, props.clone(), b"hello"),
            resolution: None,
        };
        let text = render_entry("s", &entry);
        assert!(
            text.contains("entry        s@3") && text.contains("body (5 bytes, text)\nhello"),
            "{text}"
        );
        assert!(text.contains("n (long-int) = 7"), "{text}");
        entry.envelope = envelope("no-route", Some("orders"), 0, props.clone(), &[0, 1, 0xff]);
        assert!(render_entry("s", &entry).contains("body (3 bytes, hex)\n00000000  00 01 ff"));
        // valid UTF-8 with control characters is not shown as text either
        entry.envelope = envelope("no-route", Some("orders"), 0, props, b"\x00\x1b[2Jbin");
        assert!(
            render_entry("s", &entry).contains("body (8 bytes, hex)\n00000000  00 1b 5b 32 4a 62 69 6e"),
            "{}",
            render_entry("s", &entry)
        );
        assert_eq!(body_text(b"line\r\n\ttabbed \xc3\xbc"), Some("line\r\n\ttabbed \u{fc}"));
    }

    #[test]
    fn show_prints_the_history_and_where_it_was_replayed_from() {
        let mut entry = ParkedEntry {
            offset: 9,
            envelope: envelope("max-attempts", Some("orders"), 0, BasicProperties::default(), b""),
            resolution: None,
        };
        let plain = render_entry("s", &entry);
        assert!(
            !plain.contains("history") && !plain.contains("replayed from"),
            "{plain}"
        );
        entry.envelope.history = vec![
            HistoryEntry {
                attempt: 1,
                tier: "1s".into(),
                failed_at_ms: 1_000,
            },
            HistoryEntry {
                attempt: 2,
                tier: "10s".into(),
                failed_at_ms: 2_500,
            },
        ];
        entry.envelope.replayed_from = Some("s@3".into());
        let text = render_entry("s", &entry);
        assert!(
            text.contains(
                "replayed from s@3\nhistory\n\
                 \x20 attempt 1  tier 1s   failed at 1970-01-01T00:00:01Z\n\
                 \x20 attempt 2  tier 10s  failed at 1970-01-01T00:00:02Z\nparked at"
            ),
            "{text}"
        );
    }
}
