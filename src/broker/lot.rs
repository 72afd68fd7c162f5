//! The parking lot as an operator sees it: list, search, show, replay and discard the records
//! of `N.L.parked`, for the CLI and the admin HTTP API.
//!
//! State lives only in the stream. A replay or a discard appends a *resolution record*
//! (`type` = [`RESOLUTION_FORMAT`], JSON body [`Resolution`]) to the same stream, after the
//! entry it resolves. Every replica and tool that reads the stream sees the same state, and
//! nothing is ever deleted: retention, not discard, frees space.
//!
//! Listing and selecting go through a [`LotIndex`]: one compact row per entry, built by reading
//! the stream once. The CLI builds one per command; the service keeps one per ladder that
//! follows the stream. The index answers counts and pages by offset; only the page's records are then fetched from the
//! stream, in runs of nearby offsets. Searches the index cannot answer (headers, body) fetch
//! the candidates it narrows to and check them, keeping at most [`MAX_PAGE_WINDOW`] entries.
//! The end is found by reading the last chunk (`x-stream-offset: last`): RabbitMQ 3.10 reports
//! `message_count` 0 for a stream, so a passive declare cannot say where the end is.
//!
//! Pure parts — filters, rate pacing, time bounds, rendering — do no I/O and are unit-tested
//! here; the broker parts bound every await.
//!
//! [`LotIndex`]: crate::model::lot::index::LotIndex

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use ladder_amqp::{BasicProperties, Channel, Confirmation, Connection, Consumer, FieldTable, FieldValue, QueueOptions};

use serde::Serialize;

use tokio_util::sync::CancellationToken;

use tracing::{info, warn};

use crate::model::envelope::{self, Envelope, EnvelopeError, StoredProperties};

use crate::model::ladder::LadderSpec;

use crate::model::lot::index::{self as lot_index, SharedIndex};

use crate::model::protocol::{self, header, long_string};

use crate::broker::topology::Names;

use crate::clock::now_ms;
use crate::config::AmqpConfig;
use crate::model::lot::Invalid;
use crate::model::lot::edit::{Edit, EditAudit};
use crate::model::lot::filter::{Entries, Filter};
use crate::model::lot::pace::{Pacer, Rate};
use crate::model::lot::record::{Action, MARKER_FORMAT, Marker, ParkedEntry, RESOLUTION_FORMAT, Resolution};

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

/// How often an action waiting for the follower checks whether it read the marker.
const MARKER_POLL: Duration = Duration::from_millis(20);

/// A body stored apart is looked for this many records before its entry first: it is written
/// just before the envelope, so only the parks of other replicas in between separate them.
pub const BODY_SEARCH_BACK: u64 = 4096;

/// A page may reach at most this deep (`offset + limit`): a newest-first page of a forward scan
/// holds the last `offset + limit` matches, so this bounds a listing's memory.
pub const MAX_PAGE_WINDOW: usize = 10_000;

/// Replay and discard act on at most this many entries per call (oldest first); the entries are
/// held in memory meanwhile. What is left is reported, and the next call (which skips resolved
/// entries) continues.
pub const MAX_ACTION_BATCH: usize = 10_000;

/// Fetching entries by offset: offsets at most this far apart are read in one pass over the
/// stream rather than with a consumer each, as starting a consumer costs about as much as
/// streaming a couple of thousand records.
pub const FETCH_RUN_GAP: u64 = 2048;

/// What can go wrong reading or changing the parking lot.
#[derive(Debug, thiserror::Error)]
pub enum ParkingError {
    /// The broker refused or failed a call.
    #[error("broker: {0}")]
    Broker(#[from] ladder_amqp::Error),
    /// A broker call got no answer in time.
    #[error("no answer from the broker within {timeout:?} while {during}")]
    Timeout {
        /// What was being done.
        during: &'static str,
        /// The bound that expired.
        timeout: Duration,
    },
    /// A request that cannot be served as asked (the caller's mistake).
    #[error("{0}")]
    Invalid(String),
    /// The broker refused a write (a nack) or stopped a read it had accepted.
    #[error("{0}")]
    Refused(String),
    /// Something the request needs is not on the broker (the stream, a body record).
    #[error("{0}")]
    Missing(String),
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

/// A hold or resume that failed, classified as the parking lot's errors are (CLI): a caller's
/// mistake (not allowed, no such queue, not held, a bad rate) exits 64.
impl From<crate::broker::holds::HoldError> for ParkingError {
    fn from(e: crate::broker::holds::HoldError) -> Self {
        use crate::broker::holds::HoldError;
        match e {
            e if e.is_callers() => ParkingError::Invalid(e.to_string()),
            HoldError::Record(e) => e.into(),
            HoldError::Broker(e) => ParkingError::Broker(e),
            other => ParkingError::Refused(other.to_string()),
        }
    }
}

/// A cancellation that failed, classified as the parking lot's errors are (CLI, API).
impl From<crate::broker::cancels::CancelError> for ParkingError {
    fn from(e: crate::broker::cancels::CancelError) -> Self {
        use crate::broker::cancels::CancelError;
        match e {
            CancelError::Broker(e) => ParkingError::Broker(e),
            CancelError::Timeout(timeout, during) => ParkingError::Timeout { during, timeout },
            CancelError::NotTaken(why) => ParkingError::Refused(why),
            CancelError::Invalid(why) => ParkingError::Invalid(why),
        }
    }
}

/// What kind of failure an error is: one classification for the CLI's exit codes and the
/// HTTP API's statuses alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The caller asked for something that cannot be done as asked (exit 64, HTTP 400).
    Caller,
    /// The broker is unreachable, slow, or refused (exit 69, HTTP 503).
    Unavailable,
    /// What was asked for does not exist (exit 1, HTTP 404).
    Missing,
    /// Another replay or discard of the ladder runs (exit 75, HTTP 409).
    Conflict,
    /// A record in the stream does not decode (exit 1, HTTP 500).
    Internal,
}

impl ParkingError {
    /// The kind of failure.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ParkingError::Invalid(_) => ErrorKind::Caller,
            ParkingError::Broker(e) if e.reply_code() == Some(404) => ErrorKind::Missing,
            ParkingError::Broker(_) | ParkingError::Timeout { .. } | ParkingError::Refused(_) => ErrorKind::Unavailable,
            ParkingError::Missing(_) | ParkingError::NotFound(_) | ParkingError::UnknownLadder(_) => ErrorKind::Missing,
            ParkingError::Busy(_) => ErrorKind::Conflict,
            ParkingError::Envelope(_) => ErrorKind::Internal,
        }
    }
}

impl From<Invalid> for ParkingError {
    fn from(e: Invalid) -> Self {
        ParkingError::Invalid(e.0)
    }
}

async fn bounded<T>(
    during: &'static str,
    call: impl Future<Output = Result<T, ladder_amqp::Error>>,
) -> Result<T, ParkingError> {
    match tokio::time::timeout(BROKER_TIMEOUT, call).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(ParkingError::Timeout {
            during,
            timeout: BROKER_TIMEOUT,
        }),
    }
}

/// How much earlier than `since` a time-bounded scan starts: an entry's time is the service's
/// clock, its chunk's the broker's. The filter then drops what is too old.
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

    fn argument(self) -> FieldValue {
        match self {
            Start::First => FieldValue::string("first"),
            Start::Offset(offset) => FieldValue::LongLongInt(i64::try_from(offset).unwrap_or(i64::MAX)),
            Start::Time(ms) => FieldValue::Timestamp(ms / 1000),
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
    /// Change the headers or body before replaying (one entry only); the entry keeps the
    /// original, and the resolution records what changed ([`EditAudit`]).
    pub edit: Option<Edit>,
}

/// The queue `edit` sends `entry` to by changing its `retry-to`, if it does.
fn edited_destination(edit: &Edit, entry: &ParkedEntry) -> Option<String> {
    let StoredProperties::Decoded(properties) = entry.envelope.message.stored_properties().ok()? else {
        return None;
    };
    let original = properties.headers.clone().unwrap_or_default();
    let (edited, _, _) = edit.apply(&original, &[]).ok()?;
    crate::model::lot::edit::new_destination(&original, &edited)
}

/// What happened to one entry of a replay or a discard.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
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
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
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
/// It is an exclusive, non-durable queue `N.L.operator-lock` declared on a connection of its
/// own: the broker lets one connection own it and deletes it when that connection dies. The
/// lock owns that connection, so dropping the lock closes it and frees the lock, whether the
/// action ended, failed or was dropped with a client that went away. A crashed holder frees it
/// too.
pub struct OperatorLock {
    connection: Connection,
    channel: Channel,
    queue: String,
}

impl OperatorLock {
    /// Releases the lock now: deletes the queue, which the broker confirms once it is gone, then
    /// closes the connection. Closing alone would free it a moment after the close is confirmed,
    /// and a replay asked for right then could find the lock still taken.
    pub async fn release(self) {
        let _ = tokio::time::timeout(BROKER_TIMEOUT, self.channel.queue_delete(&self.queue)).await;
        let _ = tokio::time::timeout(BROKER_TIMEOUT, self.connection.close(200, "unlocked")).await;
    }
}

/// The parking lot of one ladder, on a connection the caller owns.
pub struct ParkingLot<'a> {
    connection: &'a Connection,
    amqp: &'a AmqpConfig,
    spec: &'a LadderSpec,
    names: Names,
}

/// Where an action's selection is made from, up to the marker it appended after taking the
/// lock: a fresh index read through the marker (a command), or the index a follower keeps
/// current (the service), once it has read the marker.
pub enum ActIndex<'i> {
    /// Read a fresh one.
    Fresh,
    /// Wait (at most `within`) until `index` holds the marker.
    Followed {
        /// The index the service's follower keeps.
        index: &'i SharedIndex,
        /// How long the follower may take to read the marker.
        within: Duration,
    },
}

impl<'a> ParkingLot<'a> {
    /// The parking lot of `spec` in `namespace`, read on `connection`; `amqp` says how to open
    /// the operator lock's own connection.
    pub fn new(connection: &'a Connection, amqp: &'a AmqpConfig, namespace: &str, spec: &'a LadderSpec) -> Self {
        ParkingLot {
            connection,
            amqp,
            spec,
            names: Names::of(namespace, spec),
        }
    }

    /// The one way to replay or discard: takes the operator lock, appends a marker, brings an
    /// index up to the marker ([`ActIndex`]), selects the unresolved entries matching `filter`
    /// and runs `action` on them. The lock is released before this returns (and when it is
    /// dropped).
    pub async fn act<T>(
        &self,
        filter: &Filter,
        by: &str,
        source: ActIndex<'_>,
        action: impl AsyncFnOnce(&SharedIndex, Selection) -> Result<T, ParkingError>,
    ) -> Result<T, ParkingError> {
        if filter.is_empty() {
            return Err(
                Invalid("give offsets or at least one filter (an empty one would act on everything)".into()).into(),
            );
        }
        let lock = self.lock().await?;
        let acted = async {
            let marker = self.mark(by).await?;
            let fresh;
            let index = match source {
                ActIndex::Fresh => {
                    fresh = self.index_through(filter, &marker).await?;
                    &fresh
                }
                ActIndex::Followed { index, within } => {
                    let reached = async {
                        while !index.read().has_marker(&marker) {
                            tokio::time::sleep(MARKER_POLL).await;
                        }
                    };
                    tokio::time::timeout(within, reached)
                        .await
                        .map_err(|_| ParkingError::Timeout {
                            during: "bringing the parking-lot index up to the stream's end",
                            timeout: within,
                        })?;
                    index
                }
            };
            let selection = self.select(index, filter).await?;
            action(index, selection).await
        }
        .await;
        // free before answering: whoever asks next (the same operator, a job right after this
        // one) finds the lock free
        lock.release().await;
        acted
    }

    /// Takes the ladder's [`OperatorLock`] on a connection of its own, or fails with
    /// [`ParkingError::Busy`] at once.
    pub async fn lock(&self) -> Result<OperatorLock, ParkingError> {
        let name = format!("{}-lock", self.amqp.connection_name);
        let connection = tokio::time::timeout(BROKER_TIMEOUT, crate::broker::connect::connect_named(self.amqp, &name))
            .await
            .map_err(|_| ParkingError::Timeout {
                during: "connecting for the operator lock",
                timeout: BROKER_TIMEOUT,
            })??;
        let channel = bounded("opening a channel", connection.create_channel()).await?;
        let options = QueueOptions {
            exclusive: true,
            auto_delete: true,
            ..QueueOptions::default()
        };
        let declare = channel.queue_declare(&self.names.operator_lock, options, FieldTable::default());
        match tokio::time::timeout(BROKER_TIMEOUT, declare).await {
            Ok(Ok(_)) => Ok(OperatorLock {
                connection,
                channel,
                queue: self.names.operator_lock.clone(),
            }),
            // 405 RESOURCE_LOCKED: another connection owns it (the broker closed this channel)
            Ok(Err(e)) if e.reply_code() == Some(405) => Err(ParkingError::Busy(self.spec.name.clone())),
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
        let id = crate::clock::unique_id("marker");
        let marker = Marker {
            format: MARKER_FORMAT.to_string(),
            id: id.clone(),
            by: by.to_string(),
        };
        let body = serde_json::to_vec(&marker).expect("a marker of strings serializes");
        let channel = self.confirm_channel().await?;
        let properties = record_properties(MARKER_FORMAT, None);
        let confirmation = publish(&channel, "", &self.names.parked, &body, &properties).await;
        let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.close(200, "marked")).await;
        match confirmation? {
            Confirmation::Ack => Ok(id),
            Confirmation::Returned(_) => Err(ParkingError::Missing(format!(
                "the parking lot {} does not exist",
                self.names.parked
            ))),
            Confirmation::Nack | Confirmation::NotRequested => Err(ParkingError::Refused(
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
        self.reading(start.argument(), async |channel, consumer| {
            self.follow_on(channel, consumer, start, index, stop).await
        })
        .await
    }

    async fn follow_on(
        &self,
        channel: &Channel,
        consumer: &mut Consumer,
        start: Start,
        index: &SharedIndex,
        stop: &CancellationToken,
    ) -> Result<(), ParkingError> {
        let mut unacked = 0u64;
        loop {
            let delivery = tokio::select! {
                () = stop.cancelled() => return Ok(()),
                delivery = consumer.next() => match delivery {
                    None => return Err(ParkingError::Refused("the broker cancelled the follower".into())),
                    Some(delivery) => delivery?,
                },
            };
            unacked += 1;
            if unacked >= SCAN_ACK_EVERY {
                channel.basic_ack(delivery.delivery_tag, true)?;
                unacked = 0;
            }
            let Some(offset) = stream_offset(&delivery.properties.headers) else {
                continue;
            };
            if !start.includes(offset) {
                continue;
            }
            let kind = delivery.properties.kind.as_ref().and_then(|k| k.to_str());
            match lot_index::decode(kind, &delivery.body) {
                Ok(record) => index.write().apply(offset, record),
                Err(e) => {
                    warn!(stream = %self.names.parked, offset, error = %e, "an undecodable record; skipped");
                    index.write().skip(offset);
                }
            }
        }
    }

    /// Entries matching `filter`, newest first, one page of them, and how many match in all.
    /// The index says which (resolved ones only when the filter asks); the page's records are
    /// read from the stream.
    pub async fn list(&self, index: &SharedIndex, filter: &Filter, page: PageRequest) -> Result<Page, ParkingError> {
        let window = page.offset.saturating_add(page.limit);
        if !filter.needs_records() {
            let found = index.read().page(filter, page.offset, page.limit);
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
        let candidates = index.read().candidates(filter);
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
                        body_apart: None,
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
    pub async fn counts(&self, index: &SharedIndex, filter: &Filter) -> Result<lot_index::Counts, ParkingError> {
        if !filter.needs_records() {
            return Ok(index.read().counts(filter));
        }
        let candidates = index.read().candidates(filter);
        let mut tally = lot_index::Tally::default();
        self.fetch_each(&candidates, |offset, envelope| {
            if filter.matches(offset, &envelope) {
                tally.add(envelope.destination.as_deref(), &envelope.reason);
            }
        })
        .await?;
        Ok(tally.finish())
    }

    /// The entry at `offset`, resolved or not, with its body read back if it is stored apart.
    pub async fn show(&self, index: &SharedIndex, offset: u64) -> Result<ParkedEntry, ParkingError> {
        if index.read().resolution(offset).is_err() {
            return Err(ParkingError::NotFound(offset));
        }
        let mut entry = self
            .entries(index, &[offset])
            .await?
            .into_iter()
            .next()
            .ok_or(ParkingError::NotFound(offset))?;
        if entry.envelope.message.body_record.is_some() {
            entry.body_apart = Some(self.body(&entry).await?);
        }
        Ok(entry)
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
                body_apart: None,
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
                let not_an_entry = matches!(kind, Some(RESOLUTION_FORMAT | MARKER_FORMAT | envelope::BODY_FORMAT));
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
        let unresolved = filter.clone().with_entries(Entries::Unresolved);
        let filter = &unresolved;
        let candidates = index.read().candidates(filter);
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
                        body_apart: None,
                    });
                } else {
                    left_over += 1;
                }
            }
        })
        .await?;
        Ok(Selection { entries, left_over })
    }

    /// Replays `entries` in order, at most at `options.rate`. Each is republished to its
    /// destination (or `options.to`), persistent and mandatory, with a fresh attempt count and
    /// `retry-replayed-from`. Its resolution is appended only after the broker confirmed it. A
    /// failure is reported per entry and leaves it unresolved.
    pub async fn replay(
        &self,
        index: &SharedIndex,
        entries: &[ParkedEntry],
        options: &ReplayOptions,
    ) -> Result<Vec<Outcome>, ParkingError> {
        self.replay_with(index, entries, options, &mut |_| {}).await
    }

    /// [`ParkingLot::replay`], telling `on_outcome` each entry's outcome as it is known (a
    /// progress report).
    pub async fn replay_with(
        &self,
        index: &SharedIndex,
        entries: &[ParkedEntry],
        options: &ReplayOptions,
        on_outcome: &mut (dyn FnMut(&Outcome) + Send),
    ) -> Result<Vec<Outcome>, ParkingError> {
        let channel = if options.dry_run {
            None
        } else {
            Some(self.confirm_channel().await?)
        };
        let mut pacer = options.rate.map(Pacer::new);
        let mut outcomes = Vec::with_capacity(entries.len());
        if options.edit.is_some() && entries.len() > 1 {
            return Err(ParkingError::Invalid(format!(
                "an edit applies to one entry; {} were selected",
                entries.len()
            )));
        }
        for entry in entries {
            let target = options
                .to
                .clone()
                .or_else(|| options.edit.as_ref().and_then(|edit| edited_destination(edit, entry)))
                .or_else(|| entry.envelope.destination.clone());
            let outcome = |status| Outcome {
                offset: entry.offset,
                to: target.clone(),
                status,
            };
            let fail = |error: String| outcome(Status::Failed { error });
            let Some(queue) = target.clone() else {
                push(
                    &mut outcomes,
                    on_outcome,
                    fail("no destination is recorded; give another queue (--to)".into()),
                );
                continue;
            };
            if let Some(problem) = protocol::refuse_destination(self.spec, &self.names, &queue) {
                push(&mut outcomes, on_outcome, fail(problem));
                continue;
            }
            let (body, properties, edit) = match self.replayed_message(entry, &queue, options.edit.as_ref()).await {
                Ok(message) => message,
                Err(e) => {
                    push(&mut outcomes, on_outcome, fail(e.to_string()));
                    continue;
                }
            };
            let Some(channel) = &channel else {
                push(&mut outcomes, on_outcome, outcome(Status::WouldReplay));
                continue;
            };
            if let Some(pacer) = pacer.as_mut() {
                tokio::time::sleep(pacer.delay(Instant::now())).await;
            }
            let published = match &properties {
                StoredProperties::Decoded(properties) => publish(channel, "", &queue, &body, properties).await?,
                StoredProperties::Raw(raw) => {
                    let confirm = channel.basic_publish_raw(b"", queue.as_bytes(), true, raw, &body)?;
                    bounded("waiting for the publish confirm", confirm).await?
                }
            };
            let status = match published {
                Confirmation::Ack => {
                    self.record_replay(channel, index, entry.offset, &queue, &options.by, edit)
                        .await
                }
                Confirmation::Returned(returned) => Status::Failed {
                    error: format!(
                        "the broker returned it: no queue {queue:?} ({} {})",
                        returned.reply_code, returned.reply_text
                    ),
                },
                Confirmation::Nack | Confirmation::NotRequested => Status::Failed {
                    error: "the broker refused the publish (nack)".into(),
                },
            };
            push(&mut outcomes, on_outcome, outcome(status));
        }
        if let Some(channel) = channel {
            let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.close(200, "replayed")).await;
        }
        Ok(outcomes)
    }

    /// Records the replay of the entry at `offset` to `queue` (confirmed by the broker) in the
    /// stream and in `index`: replayed, or failed when the record was not written.
    async fn record_replay(
        &self,
        channel: &Channel,
        index: &SharedIndex,
        offset: u64,
        queue: &str,
        by: &str,
        edit: Option<EditAudit>,
    ) -> Status {
        let mut resolution = self.resolution(offset, Action::Replayed, by, Some(queue));
        resolution.edit = edit;
        match self.append(channel, &resolution).await {
            Ok(()) => {
                index.write().resolve(&resolution);
                match &resolution.edit {
                    Some(edit) => {
                        info!(ladder = %self.spec.name, offset = offset, to = %queue, by = %by,
                                        edit = %edit.summary(), "replayed a parked message, edited")
                    }
                    None => {
                        info!(ladder = %self.spec.name, offset = offset, to = %queue, by = %by, "replayed a parked message")
                    }
                }
                Status::Replayed
            }
            Err(e) => {
                warn!(ladder = %self.spec.name, offset = offset, to = %queue, by = %by, error = %e,
                      "replayed a parked message but could not record it; a later replay sends it again");
                Status::Failed {
                    error: format!("replayed, but the resolution was not recorded ({e}): it may be sent again"),
                }
            }
        }
    }

    /// Marks `entries` discarded: one confirmed resolution record each (applied to `index`). The
    /// records stay in the stream until its retention removes them.
    pub async fn discard(
        &self,
        index: &SharedIndex,
        entries: &[ParkedEntry],
        by: &str,
    ) -> Result<Vec<Outcome>, ParkingError> {
        self.discard_with(index, entries, by, &mut |_| {}).await
    }

    /// [`ParkingLot::discard`], telling `on_outcome` each entry's outcome as it is known.
    pub async fn discard_with(
        &self,
        index: &SharedIndex,
        entries: &[ParkedEntry],
        by: &str,
        on_outcome: &mut (dyn FnMut(&Outcome) + Send),
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
            push(
                &mut outcomes,
                on_outcome,
                Outcome {
                    offset: entry.offset,
                    to: None,
                    status,
                },
            );
        }
        let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.close(200, "discarded")).await;
        Ok(outcomes)
    }

    /// The body and properties to replay `entry` to `queue` with, `edit` applied (and what it
    /// changed). Properties stored as bytes (they did not decode) are replayed as they are:
    /// there is nothing to rewrite in them, and nothing to edit.
    async fn replayed_message(
        &self,
        entry: &ParkedEntry,
        queue: &str,
        edit: Option<&Edit>,
    ) -> Result<(Vec<u8>, StoredProperties, Option<EditAudit>), ParkingError> {
        let message = &entry.envelope.message;
        let mut original = match message.stored_properties()? {
            StoredProperties::Decoded(original) => *original,
            raw @ StoredProperties::Raw(_) if edit.is_none() => return Ok((self.body(entry).await?, raw, None)),
            StoredProperties::Raw(_) => {
                return Err(ParkingError::Invalid(
                    "this entry's properties did not decode, so they cannot be edited; replay it unedited".into(),
                ));
            }
        };
        let mut body = self.body(entry).await?;
        let mut audit = None;
        if let Some(edit) = edit {
            let headers = original.headers.clone().unwrap_or_default();
            let (headers, edited_body, what) = edit.apply(&headers, &body).map_err(|e| ParkingError::Invalid(e.0))?;
            original.headers = Some(headers);
            body = edited_body;
            audit = Some(what);
        }
        let mut extra = vec![(
            header::RETRY_REPLAYED_FROM,
            long_string(&format!("{}@{}", self.names.parked, entry.offset)),
        )];
        let had_retry_to = original
            .headers
            .as_ref()
            .is_some_and(|h| h.contains_key(header::RETRY_TO));
        if had_retry_to {
            extra.push((header::RETRY_TO, long_string(queue)));
        }
        Ok((
            body,
            StoredProperties::Decoded(Box::new(protocol::replay_properties(&original, &extra))),
            audit,
        ))
    }

    /// The original body of `entry`: from its envelope, or, when it was too large for one, from
    /// the body record written just before it ([`crate::model::envelope::BODY_FORMAT`]). That
    /// record is looked for in the [`BODY_SEARCH_BACK`] records before the entry, then from the
    /// stream's start.
    pub async fn body(&self, entry: &ParkedEntry) -> Result<Vec<u8>, ParkingError> {
        let Some(record) = &entry.envelope.message.body_record else {
            return Ok(entry.envelope.message.body()?);
        };
        let near = Start::Offset(entry.offset.saturating_sub(BODY_SEARCH_BACK));
        for start in [near, Start::First] {
            if let Some(body) = self.find_body(start, entry.offset, &record.id).await? {
                return Ok(body);
            }
        }
        Err(ParkingError::Missing(format!(
            "the body of entry {} (record {}, {} bytes) is no longer in the stream (retention removed it?)",
            entry.offset, record.id, record.bytes
        )))
    }

    /// Reads from `start` up to `before` for the body record `id`.
    async fn find_body(&self, start: Start, before: u64, id: &str) -> Result<Option<Vec<u8>>, ParkingError> {
        self.reading(start.argument(), async |channel, consumer| {
            loop {
                let delivery = match tokio::time::timeout(SCAN_IDLE, consumer.next()).await {
                    Err(_) => {
                        return Err(ParkingError::Timeout {
                            during: "looking for a parked body",
                            timeout: SCAN_IDLE,
                        });
                    }
                    Ok(None) => return Err(ParkingError::Refused("the broker cancelled the read".into())),
                    Ok(Some(delivery)) => delivery?,
                };
                channel.basic_ack(delivery.delivery_tag, false)?;
                let Some(offset) = stream_offset(&delivery.properties.headers) else {
                    continue;
                };
                if offset >= before {
                    return Ok(None);
                }
                let props = &delivery.properties;
                let is_body = props.kind.as_ref().and_then(|k| k.to_str()) == Some(envelope::BODY_FORMAT)
                    && props.message_id.as_ref().and_then(|m| m.to_str()) == Some(id);
                if is_body && start.includes(offset) {
                    return Ok(Some(delivery.body));
                }
            }
        })
        .await
    }

    fn resolution(&self, offset: u64, action: Action, by: &str, to: Option<&str>) -> Resolution {
        Resolution {
            format: RESOLUTION_FORMAT.to_string(),
            resolves: offset,
            action,
            by: by.to_string(),
            at_ms: now_ms(),
            to: to.map(str::to_string),
            edit: None,
        }
    }

    /// Appends a resolution record and waits for the broker's confirm.
    async fn append(&self, channel: &Channel, resolution: &Resolution) -> Result<(), ParkingError> {
        let body = serde_json::to_vec(resolution).expect("a resolution of strings and numbers serializes");
        let mut headers = FieldTable::default();
        headers.set("parked-ladder", long_string(&self.spec.name));
        let properties = record_properties(RESOLUTION_FORMAT, Some(headers));
        match publish(channel, "", &self.names.parked, &body, &properties).await? {
            Confirmation::Ack => Ok(()),
            Confirmation::Returned(_) => Err(ParkingError::Missing(format!(
                "the parking lot {} does not exist",
                self.names.parked
            ))),
            Confirmation::Nack | Confirmation::NotRequested => Err(ParkingError::Refused(
                "the broker refused the resolution record (nack)".into(),
            )),
        }
    }

    async fn confirm_channel(&self) -> Result<Channel, ParkingError> {
        let channel = bounded("opening a channel", self.connection.create_channel()).await?;
        bounded("selecting confirms", channel.confirm_select()).await?;
        Ok(channel)
    }

    /// The offset of the stream's last record now, or `None` if it is empty: the highest offset
    /// of the last chunk (a consumer from `last` starts at the last chunk's first record).
    pub async fn end(&self) -> Result<Option<u64>, ParkingError> {
        let last = FieldValue::string("last");
        self.reading(last, async |channel, consumer| {
            let mut end = None;
            let mut wait = SCAN_FIRST_RECORD;
            while let Ok(Some(delivery)) = tokio::time::timeout(wait, consumer.next()).await {
                let delivery = delivery?;
                wait = LAST_CHUNK_GAP;
                channel.basic_ack(delivery.delivery_tag, true)?;
                end = end.max(stream_offset(&delivery.properties.headers));
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
        start: FieldValue,
        read: impl AsyncFnOnce(&Channel, &mut Consumer) -> Result<T, ParkingError>,
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
        let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.close(200, "read")).await;
        result
    }

    async fn subscribe(&self, channel: &Channel, start: FieldValue) -> Result<Consumer, ParkingError> {
        bounded("setting the prefetch", channel.basic_qos(SCAN_PREFETCH)).await?;
        let mut args = FieldTable::default();
        args.set("x-stream-offset", start);
        bounded(
            "subscribing to the parking lot",
            channel.basic_consume(&self.names.parked, "", false, args),
        )
        .await
    }

    async fn scan_on(
        &self,
        channel: &Channel,
        consumer: &mut Consumer,
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
                Ok(None) => return Err(ParkingError::Refused("the broker cancelled the scan".into())),
                Ok(Some(delivery)) => delivery?,
            };
            received = true;
            unacked += 1;
            let tag = delivery.delivery_tag;
            if unacked >= SCAN_ACK_EVERY {
                channel.basic_ack(tag, true)?;
                unacked = 0;
            }
            let Some(offset) = stream_offset(&delivery.properties.headers) else {
                warn!(stream = %self.names.parked, "a delivery without x-stream-offset; skipped");
                continue;
            };
            if matches!(end, Stop::At(end) if offset > end) {
                last_tag = tag;
                break;
            }
            let kind = delivery.properties.kind.as_ref().and_then(|k| k.to_str());
            // A numeric start offset delivers from the chunk that holds it.
            if from.includes(offset) {
                visit(offset, kind, &delivery.body);
            }
            let done = match &end {
                Stop::At(end) => offset == *end,
                Stop::Marker(id) => {
                    kind == Some(MARKER_FORMAT)
                        && serde_json::from_slice::<Marker>(&delivery.body).is_ok_and(|m| m.id == *id)
                }
            };
            if done {
                last_tag = tag;
                break;
            }
        }
        if unacked > 0 {
            let _ = channel.basic_ack(last_tag, true);
        }
        Ok(())
    }
}

/// Records an outcome and reports it.
fn push(outcomes: &mut Vec<Outcome>, on_outcome: &mut (dyn FnMut(&Outcome) + Send), outcome: Outcome) {
    on_outcome(&outcome);
    outcomes.push(outcome);
}

/// Cancels `consumer` and waits for the broker's answer, before its channel is closed, so the
/// stream stops delivering while the channel closes.
async fn cancel(channel: &Channel, consumer: &Consumer) {
    let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.basic_cancel(consumer.tag())).await;
}

fn stream_offset(headers: &Option<FieldTable>) -> Option<u64> {
    protocol::as_u64(headers.as_ref()?.get("x-stream-offset")?)
}

/// The properties of a record Ladder writes to the parking lot itself (markers, resolutions).
fn record_properties(format: &str, headers: Option<FieldTable>) -> BasicProperties {
    let short = |text: &str| ladder_amqp::ShortString::try_from(text).ok();
    BasicProperties {
        delivery_mode: Some(2),
        content_type: short("application/json"),
        kind: short(format),
        headers,
        ..Default::default()
    }
}

/// Publishes mandatory and waits for the confirm, each step bounded.
async fn publish(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: &BasicProperties,
) -> Result<Confirmation, ParkingError> {
    let confirm = channel.basic_publish(exchange, routing_key, true, properties, body)?;
    bounded("waiting for the publish confirm", confirm).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn scans_start_as_late_as_the_filter_allows() {
        let f = Filter::default;
        assert_eq!(Start::for_filter(&f()), Start::First);
        let since = Filter {
            since_ms: Some(100_000),
            ..f()
        };
        assert_eq!(Start::for_filter(&since), Start::Time(40_000));
        assert_eq!(Start::Time(40_999).argument(), FieldValue::Timestamp(40));
        let both = Filter {
            offsets: Some(BTreeSet::from([9, 4])),
            ..since
        };
        assert_eq!(Start::for_filter(&both), Start::Offset(4));
        assert!(!Start::Offset(4).includes(3) && Start::Offset(4).includes(4));
    }
}
