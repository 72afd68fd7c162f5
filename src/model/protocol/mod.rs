//! The header protocol: what a failed message must carry, what the ladder sets on it, and the
//! decision for each hop — forward it (to a tier, or to its destination) or park it and why.
//!
//! Pure: it reads properties and a clock value handed in, and returns new properties. It never
//! touches the broker, so every rule here is unit-tested (and can be fuzzed) without one.
//! It must never panic on any input: every value type a client can send ends in a decision.

use std::borrow::Cow;
use std::fmt;

use ladder_amqp::{BasicProperties, FieldTable, FieldValue};
use serde::{Deserialize, Serialize};

use crate::model::ladder::Limits;
use crate::model::ladder::Mode;
use crate::model::ladder::{LadderSpec, MAX_DELAY};
use crate::model::names::{Hop, Names};

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
    /// Set on a probe of the automatic hold: the probe's id, ms since the epoch (ladder). A
    /// message back at the intake with it is that probe failing.
    pub const RETRY_PROBE: &str = "retry-probe";
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
    /// A scheduled delivery's delay in ms, as the retired delayed-message plugin reads it
    /// (publisher; kept on the delivered message).
    pub const X_DELAY: &str = "x-delay";
    /// A scheduled delivery's due time, ms since the epoch (publisher; kept).
    pub const DELAY_UNTIL: &str = "delay-until";
    /// A scheduled delivery to an exchange instead of a queue: the exchange; the routing key is
    /// the one it was published to the ladder with (publisher).
    pub const RETRY_TO_EXCHANGE: &str = "retry-to-exchange";
    /// The routing key a scheduled delivery to an exchange goes out with (ladder, internal).
    pub const RETRY_ROUTING_KEY: &str = "retry-routing-key";
    /// `true` on a scheduled delivery while it waits: not a retry, no attempt (ladder, internal).
    pub const RETRY_SCHEDULED: &str = "retry-scheduled";
    /// Set on a message replayed from the parking lot: `<stream>@<offset>` of its parked record.
    pub const RETRY_REPLAYED_FROM: &str = "retry-replayed-from";
    /// How often the due hop put this attempt back into a tier instead of delivering it (the
    /// destination refused it, or had too many in flight); not an attempt. Cleared by the
    /// intake when the next attempt is scheduled.
    pub const RETRY_DEFERRALS: &str = "retry-deferrals";
    /// Where this message's next failure waits (ladder, on every delivery of a retry): the name
    /// of a tier of its ladder, or `intake`. `N.L` routes a failure carrying it (and the
    /// `retry-ladder` of that ladder) straight into that tier, so a repeat failure skips the
    /// intake; the due hop then does the intake's work for it. It is never on a wait the
    /// service schedules, so a message that comes due with it is a failure. One that comes due
    /// without it is a wait the service scheduled, which only a publisher to the tiers can forge.
    pub const RETRY_NEXT: &str = "retry-next";
    /// The value of [`RETRY_NEXT`] that sends a failure to the intake (its ladder is exhausted,
    /// or its next delay is drawn there).
    pub const NEXT_INTAKE: &str = "intake";
    /// The value of [`RETRY_NEXT`] on a probe of the automatic hold. Its failure goes to the
    /// ladder's `N.L.probes`, which the intake hop serves with nothing queued ahead, so the hold
    /// hears of a failed probe at once, even while the intake has a backlog.
    pub const NEXT_PROBE: &str = "probe";
    /// The attempt history (ladder): a long string of `<attempt>:<tier>:<failed_at_ms>` entries
    /// joined by `,`, oldest first, one appended per retry scheduled, at most
    /// [`super::MAX_HISTORY_ENTRIES`] (the newest). Tier names are compact durations (digits and
    /// `h`, `m`, `s`), so neither separator can occur in one. Informational: read leniently,
    /// never a reason to park; kept across replays (lineage).
    pub const RETRY_HISTORY: &str = "retry-history";

    /// Every header above: decoded without an allocation each
    /// (`ladder_amqp::share_table_keys`, called at start).
    pub const ALL: &[&str] = &[
        RETRY_TO,
        RETRY_REASON,
        RETRY_DELAY,
        RETRY_ATTEMPT,
        RETRY_FIRST_FAILED_AT,
        RETRY_PROBE,
        RETRY_LADDER,
        RETRY_TIER,
        RETRY_DUE_AT,
        RETRY_ORIGINAL_USER_ID,
        X_DEATH,
        X_DELAY,
        DELAY_UNTIL,
        RETRY_TO_EXCHANGE,
        RETRY_ROUTING_KEY,
        RETRY_SCHEDULED,
        RETRY_REPLAYED_FROM,
        RETRY_DEFERRALS,
        RETRY_HISTORY,
        RETRY_NEXT,
    ];
}

/// Tables nested deeper than this are refused as `invalid-header`; it bounds recursion.
pub const MAX_HEADER_DEPTH: usize = 32;

/// `retry-history` keeps only this many entries, the newest. 16 covers every retry of a
/// typical ladder and of a replay or two. An entry is at most 59 bytes, so the header stays
/// under 1 KB however often a message fails, a small share of the default `max_header_bytes`.
pub const MAX_HISTORY_ENTRIES: usize = 16;

/// A `retry-history` entry whose tier name is longer than this is dropped as garbage. The
/// longest real tier name is 15 bytes (`1193h2m47s295ms`, the largest TTL RabbitMQ accepts); the
/// bound keeps a forged entry from bloating every later hop and the parked record.
const MAX_HISTORY_TIER_BYTES: usize = 16;

/// `retry-replayed-from` is a stream name (at most 255 bytes), `@` and a `u64` offset (at most
/// 20 digits); a longer value is cut to this before it is copied into a park decision.
const MAX_REPLAYED_FROM_BYTES: usize = 255 + 1 + 20;

/// One retry the ladder scheduled: which attempt, in which tier, and when the failure came in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
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
    /// The broker dead-lettered it out of the ladder's own intake or due queue (a delivery
    /// limit, or a policy's TTL or length limit): the quarantine's catch.
    DeadLettered,
    /// Handling it made the service fail (a bug); it is parked as received.
    InternalError,
    /// The ladder lists its `senders`, and the message's `user_id` may not target its
    /// destination (or it has none, and the `unidentified` policy refuses it).
    SenderNotAllowed,
    /// A scheduled delivery's `x-delay` or `delay-until` is not a time, or beyond 49 days.
    InvalidDelay,
    /// Its message id was cancelled (`ladder scheduled cancel`) before it was due.
    Cancelled,
}

impl ParkReason {
    /// Every reason, for documentation and metrics.
    pub const ALL: [ParkReason; 11] = [
        ParkReason::MaxAttempts,
        ParkReason::NoDestination,
        ParkReason::DestinationNotAllowed,
        ParkReason::NoRoute,
        ParkReason::InvalidHeader,
        ParkReason::HeaderTooLarge,
        ParkReason::DeadLettered,
        ParkReason::InternalError,
        ParkReason::SenderNotAllowed,
        ParkReason::InvalidDelay,
        ParkReason::Cancelled,
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
            ParkReason::DeadLettered => "dead-lettered",
            ParkReason::InternalError => "internal-error",
            ParkReason::SenderNotAllowed => "sender-not-allowed",
            ParkReason::InvalidDelay => "invalid-delay",
            ParkReason::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for ParkReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// Why the due hop put a message back into a tier instead of delivering it. Not a failure of
/// the message: no attempt is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeferReason {
    /// The destination refused the publish (a full queue with `x-overflow: reject-publish`, a
    /// queue without a quorum …). Each refusal of the same attempt waits one tier longer.
    Refused,
    /// The destination already had its bound of deliveries in flight
    /// (`max_in_flight_per_destination`); it waits in the shortest tier.
    Busy,
}

impl DeferReason {
    /// Every reason, for metrics.
    pub const ALL: [DeferReason; 2] = [DeferReason::Refused, DeferReason::Busy];

    /// The metric label.
    pub fn code(self) -> &'static str {
        match self {
            DeferReason::Refused => "refused",
            DeferReason::Busy => "busy",
        }
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

impl Park {
    /// A park with nothing read from the message but `reason` and `detail`.
    pub fn new(reason: ParkReason, detail: impl Into<String>) -> Self {
        Park {
            reason,
            detail: detail.into(),
            destination: None,
            attempts: None,
            first_failed_at_ms: None,
            history: Vec::new(),
            replayed_from: None,
        }
    }

    /// A park of a message with headers `h`: its history and the record it was replayed from
    /// go with it.
    pub fn carrying(reason: ParkReason, detail: impl Into<String>, h: &FieldTable) -> Self {
        Park {
            history: carried_history(h),
            replayed_from: carried_replayed_from(h),
            ..Park::new(reason, detail)
        }
    }

    /// Where the message was headed, if that could be read.
    pub fn to(self, destination: Option<String>) -> Self {
        Park { destination, ..self }
    }

    /// The retries it had already (`retry-attempt` as received) and when it first failed.
    pub fn after(self, attempts: Option<u64>, first_failed_at_ms: Option<u64>) -> Self {
        Park {
            attempts,
            first_failed_at_ms,
            ..self
        }
    }
}

/// A decision to republish.
#[derive(Debug, Clone)]
pub struct Forward<'a> {
    /// Exchange to publish to (`""` for the default exchange, by which every wait and every
    /// delivery to a queue goes).
    pub exchange: Cow<'a, str>,
    /// Routing key: the tier queue on a wait, the destination queue on a delivery.
    pub routing_key: Cow<'a, str>,
    /// Properties to publish with (persistent, no `expiration` or `user_id`, broker headers
    /// stripped). With [`carry`](Self::carry), its headers are only those the forward writes
    /// — what it carries over from the received ones comes before them — and when the carry
    /// is [`as_received`](Carry::as_received) it holds nothing else
    /// ([`Forward::full_properties`] makes the whole).
    pub properties: BasicProperties,
    /// What is republished as received, written from the delivery's own properties at
    /// publish time instead of copied into the forward (a retry's headers are the largest part
    /// of its properties, and most of them pass through).
    pub carry: Option<Carry>,
    /// Where the message is finally headed.
    pub destination: String,
    /// The retry number (`retry-attempt` as sent).
    pub attempt: u64,
    /// Due hop: how late the message is against `retry-due-at`, in ms (0 if early or unknown).
    pub late_ms: u64,
    /// A wait: when the message is due (`retry-due-at` as sent), ms since the epoch; 0 for a
    /// delivery.
    pub due_at_ms: u64,
    /// Into a tier to wait, or out to its destination.
    pub kind: ForwardKind<'a>,
    /// Where its failure was counted: before this hop, or here.
    pub counted: Counted,
}

/// Where the failure a [`Forward`] republishes was counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// Before this hop, at the intake: what was received is what a deferral starts from.
    Before,
    /// Here, at the due hop: a failure the broker routed past the intake by its `retry-next`,
    /// taken in as the intake would have. It entered the ladder at this hop, and a deferral
    /// starts from what this forward publishes, not from what was received.
    Here,
}

/// What a [`Forward`] carries over as received: every header but the broker's
/// ([`is_stripped`]) and those the forward writes anew (`except`). When the received properties
/// are already what a republish writes (persistent, no `expiration`, no `user_id`), the other
/// properties are carried too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Carry {
    except: &'static [&'static str],
    /// The properties other than the headers are the received ones, unchanged.
    pub as_received: bool,
}

impl Carry {
    /// Whether a received header named `key` is republished.
    pub fn keeps(&self, key: &[u8]) -> bool {
        !is_stripped(key) && !self.except.iter().any(|e| e.as_bytes() == key)
    }
}

impl Forward<'_> {
    /// The properties the forward publishes, headers and all, made from `received` (the
    /// delivery's properties): what it carries over, then its own headers. A copy, for
    /// tracing and tests; the relay writes them without making it
    /// ([`Forward::publishing`]).
    pub fn full_properties(&self, received: &BasicProperties) -> BasicProperties {
        self.publishing(received, |fields, carried| match carried {
            Some(carried) => fields.with_carried(&carried),
            None => fields.clone(),
        })
    }

    /// Calls `publish` with what the relay publishes for this forward of a delivery with
    /// `received` properties: the properties whose fields are written, and the headers carried
    /// over from `received` before the forward's own (or none, and the fields' own headers).
    pub fn publishing<R>(
        &self,
        received: &BasicProperties,
        publish: impl FnOnce(&BasicProperties, Option<ladder_amqp::Carried<'_>>) -> R,
    ) -> R {
        let Some(carry) = self.carry else {
            return publish(&self.properties, None);
        };
        let keep = |key: &[u8]| carry.keeps(key);
        let empty = FieldTable::new();
        let carried = ladder_amqp::Carried {
            table: received.headers.as_ref().unwrap_or(&empty),
            keep: &keep,
            then: self.properties.headers.as_ref(),
        };
        let fields = if carry.as_received { received } else { &self.properties };
        publish(fields, Some(carried))
    }

    /// The header `key` the forward publishes: its own, or one it carries over from `received`.
    pub fn header<'a>(&'a self, received: &'a BasicProperties, key: &str) -> Option<&'a FieldValue> {
        let own = self.properties.headers.as_ref().and_then(|h| h.get(key));
        let carried = || {
            self.carry
                .filter(|carry| carry.keeps(key.as_bytes()))
                .and_then(|_| received.headers.as_ref()?.get(key))
        };
        own.or_else(carried)
    }
}

/// Where a [`Forward`] goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardKind<'a> {
    /// Into the tier named `tier` (or, `tier` empty, straight to the due queue) to wait; not a
    /// delivery.
    Wait {
        /// The tier's name, the `tier` label of the metrics.
        tier: &'a str,
    },
    /// Out to the destination queue (or, when it is held, to its held queue).
    Deliver,
    /// Out to an exchange, the target of a scheduled delivery: never held.
    DeliverToExchange,
}

impl<'a> ForwardKind<'a> {
    /// The tier of a wait; `None` for a delivery.
    pub fn tier(self) -> Option<&'a str> {
        match self {
            ForwardKind::Wait { tier } => Some(tier),
            ForwardKind::Deliver | ForwardKind::DeliverToExchange => None,
        }
    }
}

/// What the service knows of one delivery besides its properties: when it arrived, the routing
/// key it came with, a random draw in `[0, 1)` for `jitter`, and whether its message id was
/// cancelled. The model reads no clock and draws no random number itself.
#[derive(Debug, Clone, Copy)]
pub struct Arrival<'a> {
    /// Now, ms since the epoch.
    pub now_ms: u64,
    /// The routing key of the delivery.
    pub routing_key: &'a [u8],
    /// Uniform in `[0, 1)`.
    pub draw: f64,
    /// Its message id is in the ladder's cancellations.
    pub cancelled: bool,
}

impl Arrival<'static> {
    /// An arrival at `now_ms` with an empty routing key, the middle draw, not cancelled.
    pub fn at(now_ms: u64) -> Self {
        Arrival {
            now_ms,
            routing_key: b"",
            draw: 0.5,
            cancelled: false,
        }
    }
}

/// A failure the broker routed straight into a wait (see [`HopContext::routed_failure`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedFailure {
    /// The queue it waited in (`N.delay.<retry-next>`, shared by the namespace's ladders; or,
    /// a first failure of an older ladder, its `N.L.wait.<tier>`, [`crate::model::upgrade`]).
    pub queue: Option<String>,
    /// How long it waited before it came due: the TTL of that tier (0 when `retry-next` names
    /// none).
    pub waited_ms: u64,
    /// How many of its newest `x-death` entries are that wait's (0 or 1): skipped when its
    /// destination and sender are read from the rest, as the intake reads them.
    pub skip: usize,
    /// The tier it waited (its `retry-next`, or the first step it waited in `N.L.wait.<tier>`).
    pub tier: String,
}

/// What to do with one delivery.
#[derive(Debug, Clone)]
pub enum Decision<'a> {
    /// Republish, then ack the delivery once confirmed.
    Forward(Box<Forward<'a>>),
    /// Park, then ack the delivery once the park is confirmed.
    Park(Park),
}

impl<'a> Decision<'a> {
    /// The decision with a forward's headers all in its properties, none carried over
    /// ([`Forward::full_properties`]): what was decided on `received`, as tests and tools read it.
    pub fn materialized(self, received: &BasicProperties) -> Decision<'a> {
        match self {
            Decision::Forward(mut forward) => {
                forward.properties = forward.full_properties(received);
                forward.carry = None;
                Decision::Forward(forward)
            }
            park @ Decision::Park(_) => park,
        }
    }
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

impl<'a> HopContext<'a> {
    /// Where a wait in `tier` is published: the default exchange, the tier queue's name, and
    /// the kind that names the tier.
    fn wait_in(&self, tier: &'a crate::model::ladder::Tier) -> (Cow<'a, str>, Cow<'a, str>, ForwardKind<'a>) {
        (
            Cow::Borrowed(""),
            Cow::Owned(self.names.tier_queue(tier)),
            ForwardKind::Wait { tier: &tier.name },
        )
    }
}

mod codec;
mod due;
mod intake;

pub use codec::*;

/// How long after its delivery a failure of a message comes back to the ladder, by the route
/// its `retry-next` names: that tier's TTL, or 0 when it names the intake or the probes (or is
/// absent). The breaker counts a delivery, and its failure, at this verdict time.
pub fn failure_lag_ms(spec: &LadderSpec, headers: Option<&FieldTable>) -> u64 {
    headers
        .and_then(|h| h.get(header::RETRY_NEXT))
        .and_then(as_text)
        .map_or(0, |name| tier_ms(spec, name))
}

/// How long the tier named `name` holds a message: the ladder's own tier's TTL, or what the
/// name says (a tier taken out of the ladder since; 0 for a name that is no delay).
fn tier_ms(spec: &LadderSpec, name: &str) -> u64 {
    match spec.tiers.iter().find(|t| t.name == name) {
        Some(tier) => tier.ttl_ms(),
        None => parse_delay(&long_string(name)).map_or(0, |d| d.as_millis() as u64),
    }
}

/// When a message that came back failed was delivered: the `retry-due-at` it was delivered
/// with (a delivery leaves when due), or 0 when it has none.
pub fn delivered_at_ms(headers: Option<&FieldTable>) -> u64 {
    headers
        .and_then(|h| optional_u64(h, header::RETRY_DUE_AT).ok().flatten())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests;
