//! The header protocol: what a failed message must carry, what the ladder sets on it, and the
//! decision for each hop — forward it (to a tier, or to its destination) or park it and why.
//!
//! Pure: it reads properties and a clock value handed in, and returns new properties. It never
//! touches the broker, so every rule here is unit-tested (and can be fuzzed) without one.
//! It must never panic on any input: every value type a client can send ends in a decision.

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use ladder_amqp::{BasicProperties, FieldTable, FieldValue, LongString, ShortString};
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
    ];
}

/// Tables nested deeper than this are refused as `invalid-header`; it bounds recursion.
pub const MAX_HEADER_DEPTH: usize = 32;

/// `retry-history` keeps only this many entries, the newest. 16 covers every retry of a
/// typical ladder, and of a replay or two, while bounding the header however often a message
/// fails: an entry is at most 59 bytes with its comma (a 20-digit attempt, a tier name of at
/// most `MAX_HISTORY_TIER_BYTES`, a 20-digit time; a real one is about 25), so the header stays
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

/// A decision to republish.
#[derive(Debug, Clone)]
pub struct Forward<'a> {
    /// Exchange to publish to (`""` for the default exchange); the ladder's own names are
    /// borrowed from its [`HopContext`].
    pub exchange: Cow<'a, str>,
    /// Routing key: the tier name on intake, the destination queue on due.
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
    pub kind: ForwardKind,
}

/// What a [`Forward`] carries over as received: every header but the broker's
/// ([`is_stripped`]) and those the forward writes anew (`except`), and — when the received
/// properties are already what a republish writes (persistent, no `expiration`, no
/// `user_id`: a retry the ladder published itself, or most failures) — the other properties
/// too.
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
    /// over from `received` before the forward's own — or none, and the fields' own headers.
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
pub enum ForwardKind {
    /// Into a tier (or straight to the due queue) to wait; not a delivery.
    Wait,
    /// Out to the destination queue or exchange.
    Deliver,
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
    /// Intake at `now_ms` (see [`HopContext::intake_at`]), a forward's headers all in its
    /// properties ([`Decision::materialized`]).
    pub fn intake(&self, props: &BasicProperties, now_ms: u64) -> Decision<'a> {
        self.intake_at(props, &Arrival::at(now_ms)).materialized(props)
    }

    /// Due at `now_ms` (see [`HopContext::due_at`]), a forward's headers all in its properties
    /// ([`Decision::materialized`]).
    pub fn due(&self, props: &BasicProperties, now_ms: u64) -> Decision<'a> {
        self.due_at(props, &Arrival::at(now_ms)).materialized(props)
    }

    /// Intake: a scheduled delivery (`x-delay`, `delay-until`) waits its exact delay; a failure
    /// is validated, its attempt counted, and it waits its retry's delay — or it is parked.
    pub fn intake_at(&self, props: &BasicProperties, arrival: &Arrival<'_>) -> Decision<'a> {
        let now_ms = arrival.now_ms;
        let headers = props.headers_or_empty();
        let h: &FieldTable = &headers;
        if h.contains_key(header::X_DELAY) || h.contains_key(header::DELAY_UNTIL) {
            return self.schedule(props, h, arrival);
        }
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
        // what a park record needs is read only when parking (this runs on every retry)
        let known_destination = || destination.as_ref().ok().cloned();

        if let Some((reason, detail)) = self.check_size(h) {
            return Decision::Park(Park {
                reason,
                detail,
                destination: known_destination(),
                attempts: None,
                first_failed_at_ms: None,
                history: carried_history(h),
                replayed_from: carried_replayed_from(h),
            });
        }
        let previous = match optional_u64(h, header::RETRY_ATTEMPT) {
            Ok(n) => n.unwrap_or(0),
            Err(problem) => {
                return Decision::Park(Park {
                    reason: ParkReason::InvalidHeader,
                    detail: problem,
                    destination: known_destination(),
                    attempts: None,
                    first_failed_at_ms: None,
                    history: carried_history(h),
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
                history: carried_history(h),
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
        if let Some(detail) = self.refuse_sender(props, h, &destination) {
            return park(ParkReason::SenderNotAllowed, detail, Some(destination));
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

        if arrival.cancelled {
            return park(ParkReason::Cancelled, cancelled_detail(props), Some(destination));
        }
        let delay = self.spec.retry_delay(attempt as u32, min_delay, arrival.draw);
        let tier = self.spec.next_wait(delay);
        // what the intake writes; the rest is carried over as received (`Carry`)
        let mut out = FieldTable::with_capacity(INTAKE_WRITES.len() + 1);
        if let Some(reason) = reason {
            out.push(ShortString::from_static(header::RETRY_REASON), long_string(&reason));
        }
        // a user id to move replaces a `retry-original-user-id` received (rare)
        let except = if props.user_id.is_some() {
            INTAKE_WRITES_WITH_USER
        } else {
            INTAKE_WRITES
        };
        move_user_id(props, &mut out);
        out.push(ShortString::from_static(header::RETRY_TO), long_string(&destination));
        out.push(
            ShortString::from_static(header::RETRY_ATTEMPT),
            FieldValue::LongLongInt(attempt as i64),
        );
        out.push(
            ShortString::from_static(header::RETRY_FIRST_FAILED_AT),
            FieldValue::LongLongInt(first_failed_at.unwrap_or(now_ms) as i64),
        );
        out.push(
            ShortString::from_static(header::RETRY_LADDER),
            long_string(&self.spec.name),
        );
        out.push(ShortString::from_static(header::RETRY_TIER), long_string(&tier.name));
        let due_at_ms = now_ms.saturating_add(delay.as_millis() as u64);
        out.push(
            ShortString::from_static(header::RETRY_DUE_AT),
            FieldValue::LongLongInt(due_at_ms as i64),
        );
        // the tier's own name when the delay is the tier's (no jitter, no retry-delay)
        let step = if delay == tier.delay {
            std::borrow::Cow::Borrowed(tier.name.as_str())
        } else {
            std::borrow::Cow::Owned(crate::model::ladder::compact_duration(delay))
        };
        out.push(
            ShortString::from_static(header::RETRY_HISTORY),
            appended_history(h.get(header::RETRY_HISTORY), attempt, &step, now_ms),
        );
        let (properties, carry) = carrying(props, Some(out), except);
        Decision::Forward(Box::new(Forward {
            exchange: Cow::Borrowed(self.names.tiers_exchange.as_str()),
            routing_key: Cow::Borrowed(tier.name.as_str()),
            properties,
            carry: Some(carry),
            destination,
            attempt,
            late_ms: 0,
            due_at_ms,
            kind: ForwardKind::Wait,
        }))
    }

    /// Intake of a scheduled delivery: where to (a queue, or an exchange with the routing key
    /// it came with), and when; then the first wait. No attempt is counted.
    fn schedule(&self, props: &BasicProperties, h: &FieldTable, arrival: &Arrival<'_>) -> Decision<'a> {
        let now_ms = arrival.now_ms;
        let target = match (h.get(header::RETRY_TO), h.get(header::RETRY_TO_EXCHANGE)) {
            (Some(_), Some(_)) => Err((
                ParkReason::InvalidHeader,
                format!(
                    "{} and {} name two targets; give one",
                    header::RETRY_TO,
                    header::RETRY_TO_EXCHANGE
                ),
            )),
            (Some(queue), None) => check_queue_name(queue)
                .map(Target::Queue)
                .map_err(|p| (ParkReason::InvalidHeader, p)),
            (None, Some(exchange)) => check_exchange_name(exchange)
                .map(Target::Exchange)
                .map_err(|p| (ParkReason::InvalidHeader, p)),
            (None, None) => Err((
                ParkReason::NoDestination,
                format!(
                    "a scheduled delivery needs {} (a queue) or {} (an exchange)",
                    header::RETRY_TO,
                    header::RETRY_TO_EXCHANGE
                ),
            )),
        };
        let park = |reason, detail: String, destination: Option<String>| {
            Decision::Park(Park {
                reason,
                detail,
                destination,
                attempts: None,
                first_failed_at_ms: None,
                history: Vec::new(),
                replayed_from: carried_replayed_from(h),
            })
        };
        let target = match target {
            Ok(target) => target,
            Err((reason, detail)) => return park(reason, detail, None),
        };
        let queue = target.queue().map(str::to_string);
        if let Some((reason, detail)) = self.check_size(h) {
            return park(reason, detail, queue);
        }
        if let Some(detail) = self.refuse_target(&target) {
            return park(ParkReason::DestinationNotAllowed, detail, queue);
        }
        if !self.spec.exact_delays {
            let detail = format!(
                "ladder {} has exact_delays = false: it schedules no deliveries",
                self.spec.name
            );
            return park(ParkReason::InvalidDelay, detail, queue);
        }
        let due_at = match scheduled_due_at(h, now_ms) {
            Ok(due_at) => due_at,
            Err(detail) => return park(ParkReason::InvalidDelay, detail, queue),
        };
        if arrival.cancelled {
            return park(ParkReason::Cancelled, cancelled_detail(props), queue);
        }
        let mut out = republished_headers(h);
        // the request is answered by `retry-due-at`: a delivered message that fails later and
        // comes back as received is a retry, not another scheduled delivery
        out.remove(header::X_DELAY);
        out.remove(header::DELAY_UNTIL);
        move_user_id(props, &mut out);
        out.set(header::RETRY_SCHEDULED, FieldValue::Boolean(true));
        out.set(header::RETRY_LADDER, long_string(&self.spec.name));
        out.set(header::RETRY_DUE_AT, FieldValue::LongLongInt(due_at as i64));
        if let Target::Exchange(_) = target {
            out.set(
                header::RETRY_ROUTING_KEY,
                FieldValue::LongString(LongString::from(arrival.routing_key)),
            );
        }
        let remaining = due_at.saturating_sub(now_ms);
        let (exchange, routing_key) = if remaining == 0 {
            // due already: through the due queue, which delivers it at once
            (Cow::Borrowed(self.names.due.as_str()), Cow::Borrowed(""))
        } else {
            let tier = self.spec.next_wait(Duration::from_millis(remaining));
            out.set(header::RETRY_TIER, long_string(&tier.name));
            (
                Cow::Borrowed(self.names.tiers_exchange.as_str()),
                Cow::Borrowed(tier.name.as_str()),
            )
        };
        Decision::Forward(Box::new(Forward {
            exchange,
            routing_key,
            properties: republished_properties(props, out),
            carry: None,
            destination: target.into_key(),
            attempt: 0,
            late_ms: 0,
            due_at_ms: due_at,
            kind: ForwardKind::Wait,
        }))
    }

    /// Why the ladder may not deliver to `target`, or `None` if it may.
    fn refuse_target(&self, target: &Target) -> Option<String> {
        match target {
            Target::Queue(queue) => self.refuse_destination(queue),
            Target::Exchange(exchange) if exchange.is_empty() || exchange.starts_with("amq.") => Some(format!(
                "exchange {exchange:?} is the broker's; name a queue with retry-to instead"
            )),
            Target::Exchange(exchange) if exchange.starts_with(&self.names.prefix) => Some(format!(
                "exchange {exchange:?} lies in Ladder's namespace {:?}",
                self.names.prefix
            )),
            Target::Exchange(exchange) if !self.spec.allow_exchanges.is_match(exchange) => Some(format!(
                "exchange {exchange:?} is not in ladder {}'s allow_exchanges",
                self.spec.name
            )),
            Target::Exchange(_) => None,
        }
    }

    /// Due: a message whose due time is still ahead waits again, in the longest tier that does
    /// not overshoot; one that is due is checked again (the allow-list may have changed),
    /// stripped of what the tier's dead-lettering added, and delivered — or parked.
    pub fn due_at(&self, props: &BasicProperties, arrival: &Arrival<'_>) -> Decision<'a> {
        let now_ms = arrival.now_ms;
        let headers = props.headers_or_empty();
        let h: &FieldTable = &headers;
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
        let scheduled = matches!(h.get(header::RETRY_SCHEDULED), Some(FieldValue::Boolean(true)));
        let target = match (h.get(header::RETRY_TO), h.get(header::RETRY_TO_EXCHANGE)) {
            (Some(queue), _) => check_queue_name(queue).map(Target::Queue),
            (None, Some(exchange)) if scheduled => check_exchange_name(exchange).map(Target::Exchange),
            _ => {
                let detail = format!("due message without a {} header", header::RETRY_TO);
                return park(ParkReason::NoDestination, detail, None);
            }
        };
        let target = match target {
            Ok(target) => target,
            Err(problem) => return park(ParkReason::InvalidHeader, problem, None),
        };
        let queue = || target.queue().map(str::to_string); // for a park record only
        // Only the intake checks headers, but anyone allowed to publish to the tiers exchange
        // could bypass it.
        if let Some((reason, detail)) = self.check_size(h) {
            return park(reason, detail, queue());
        }
        if let Some(detail) = self.refuse_target(&target) {
            return park(ParkReason::DestinationNotAllowed, detail, queue());
        }
        if arrival.cancelled {
            return park(ParkReason::Cancelled, cancelled_detail(props), queue());
        }
        let due_at = optional_u64(h, header::RETRY_DUE_AT).ok().flatten();
        if let Some(due) = due_at
            && due > now_ms
            && self.spec.exact_delays
        {
            let remaining = Duration::from_millis(due - now_ms);
            if remaining > MAX_DELAY {
                let detail = format!(
                    "{} is {} ms ahead, beyond the longest delay",
                    header::RETRY_DUE_AT,
                    due - now_ms
                );
                return park(ParkReason::InvalidDelay, detail, queue());
            }
            let tier = self.spec.next_wait(remaining);
            let mut out = FieldTable::with_capacity(1);
            out.push(ShortString::from_static(header::RETRY_TIER), long_string(&tier.name));
            let (properties, carry) = carrying(props, Some(out), &[header::RETRY_TIER]);
            return Decision::Forward(Box::new(Forward {
                exchange: Cow::Borrowed(self.names.tiers_exchange.as_str()),
                routing_key: Cow::Borrowed(tier.name.as_str()),
                properties,
                carry: Some(carry),
                destination: target.into_key(),
                attempt: attempts.unwrap_or(0),
                late_ms: 0,
                due_at_ms: due,
                kind: ForwardKind::Wait,
            }));
        }
        let (exchange, routing_key) = match &target {
            Target::Queue(queue) => (Cow::Borrowed(""), Cow::Owned(queue.clone())),
            Target::Exchange(exchange) => {
                let key = h
                    .get(header::RETRY_ROUTING_KEY)
                    .and_then(as_text)
                    .unwrap_or_default()
                    .to_string();
                (Cow::Owned(exchange.clone()), Cow::Owned(key))
            }
        };
        // delivered as received; a scheduled delivery as it was published: the ladder's
        // bookkeeping leaves with the wait
        let except = if scheduled { SCHEDULED_BOOKKEEPING } else { &[] };
        let (properties, carry) = carrying(props, None, except);
        Decision::Forward(Box::new(Forward {
            exchange,
            routing_key,
            properties,
            carry: Some(carry),
            destination: target.into_key(),
            attempt: attempts.unwrap_or(0),
            late_ms: due_at.map_or(0, |due| now_ms.saturating_sub(due)),
            due_at_ms: 0,
            kind: ForwardKind::Deliver,
        }))
    }

    /// Due: the message cannot be delivered now (`reason`), so it waits in a tier again without
    /// an attempt being counted: the shortest tier when the destination is busy, and one tier
    /// longer for each refusal of the same attempt (`retry-deferrals`) when it refuses.
    pub fn defer(&self, props: &BasicProperties, reason: DeferReason, now_ms: u64) -> Forward<'a> {
        let headers = props.headers_or_empty();
        let h: &FieldTable = &headers;
        let deferrals = optional_u64(h, header::RETRY_DEFERRALS)
            .ok()
            .flatten()
            .unwrap_or(0)
            .saturating_add(1);
        let tiers = &self.spec.steps;
        let tier = match reason {
            DeferReason::Busy => &tiers[0],
            DeferReason::Refused => &tiers[(deferrals as usize - 1).min(tiers.len() - 1)],
        };
        let mut out = republished_headers(h);
        out.set(header::RETRY_DEFERRALS, FieldValue::LongLongInt(deferrals as i64));
        out.set(header::RETRY_TIER, long_string(&tier.name));
        let due_at_ms = now_ms.saturating_add(tier.ttl_ms());
        out.set(header::RETRY_DUE_AT, FieldValue::LongLongInt(due_at_ms as i64));
        Forward {
            exchange: Cow::Borrowed(self.names.tiers_exchange.as_str()),
            routing_key: Cow::Borrowed(tier.name.as_str()),
            properties: republished_properties(props, out),
            carry: None,
            destination: h
                .get(header::RETRY_TO)
                .and_then(as_text)
                .unwrap_or_default()
                .to_string(),
            attempt: optional_u64(h, header::RETRY_ATTEMPT).ok().flatten().unwrap_or(0),
            late_ms: 0,
            due_at_ms,
            kind: ForwardKind::Wait,
        }
    }

    /// Quarantine: the broker dead-lettered the message out of the ladder's intake or due queue
    /// (its `x-death` says why). It is parked as received, with what its headers tell.
    pub fn dead_lettered(&self, props: &BasicProperties) -> Park {
        let headers = props.headers_or_empty();
        let h: &FieldTable = &headers;
        let deaths: &[FieldValue] = match h.get(header::X_DEATH) {
            Some(FieldValue::FieldArray(deaths)) => deaths,
            _ => &[],
        };
        let field = |entry: &FieldValue, key: &str| match entry {
            FieldValue::FieldTable(t) => t.get(key).and_then(as_text).map(str::to_string),
            _ => None,
        };
        let newest = deaths.first();
        let queue = newest.and_then(|d| field(d, "queue")).unwrap_or_else(|| "?".into());
        let why = newest
            .and_then(|d| field(d, "reason"))
            .unwrap_or_else(|| "no x-death reason".into());
        let count = match newest {
            Some(FieldValue::FieldTable(t)) => t.get("count").and_then(as_u64),
            _ => None,
        };
        let detail = match count {
            Some(n) => format!("the broker dead-lettered it out of {queue}: {why} ({n} times)"),
            None => format!("the broker dead-lettered it out of {queue}: {why}"),
        };
        // retry-to, or the consumer's queue it was dead-lettered from before it reached the ladder
        let destination = match h.get(header::RETRY_TO).map(check_queue_name) {
            Some(Ok(queue)) => Some(queue),
            _ => deaths
                .iter()
                .filter_map(|d| field(d, "queue"))
                .find(|q| !q.is_empty() && !q.starts_with(&self.names.prefix)),
        };
        Park {
            reason: ParkReason::DeadLettered,
            detail,
            destination,
            attempts: optional_u64(h, header::RETRY_ATTEMPT).ok().flatten(),
            first_failed_at_ms: optional_u64(h, header::RETRY_FIRST_FAILED_AT).ok().flatten(),
            history: carried_history(h),
            replayed_from: carried_replayed_from(h),
        }
    }

    fn check_size(&self, headers: &FieldTable) -> Option<(ParkReason, String)> {
        // what is republished: the broker's annotations (x-death, nested and growing with
        // every dead-lettering) are stripped, so they are neither counted nor walked
        let republished = encoded_entries_size(headers.iter().filter(|(k, _)| !is_stripped(k.as_bytes())), 0);
        match republished {
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

    /// Why the message's sender may not target `destination`, or `None` if it may (or the
    /// ladder lists no senders). Intake only: the sender is the `user_id` property, which the
    /// broker checked against the publishing connection; on later hops it is Ladder's own
    /// publish, and `retry-original-user-id` is a header anyone can write.
    fn refuse_sender(&self, props: &BasicProperties, h: &FieldTable, destination: &str) -> Option<String> {
        let senders = self.spec.senders.as_ref()?;
        // Dead-lettered out of the very queue it is headed back to. Not "no retry-to": from
        // the second pass on, the message carries the retry-to the ladder set on the first.
        let mode = if newest_death_queue(h).as_deref() == Some(destination) {
            Mode::DeadLetter
        } else {
            Mode::Explicit
        };
        // a user name that is not UTF-8 cannot be one the config lists
        let user = props.user_id.as_ref().map(|u| u.to_string_lossy());
        senders.refuse(&self.spec.name, user.as_deref(), mode, destination)
    }
}

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
        Some(Decision::Forward(forward)) => Park {
            reason: ParkReason::InvalidHeader,
            detail,
            destination: Some(forward.destination),
            attempts: None,
            first_failed_at_ms: None,
            history: Vec::new(),
            replayed_from: None,
        },
        None => Park {
            reason: ParkReason::InvalidHeader,
            detail,
            destination: None,
            attempts: None,
            first_failed_at_ms: None,
            history: Vec::new(),
            replayed_from: None,
        },
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
const PER_PASS_HEADERS: [&str; 6] = [
    header::RETRY_ATTEMPT,
    header::RETRY_DUE_AT,
    header::RETRY_TIER,
    header::RETRY_DELAY,
    header::RETRY_LADDER,
    header::RETRY_DEFERRALS,
];

/// Properties to replay a parked message with: the same stripping as every republish (broker
/// headers, `expiration`, `user_id` moved to `retry-original-user-id`, persistent), minus the
/// per-pass ladder headers (`PER_PASS_HEADERS`) so the attempt count starts again (lineage:
/// `retry-first-failed-at` and `retry-history` stay), plus `extra` headers (the caller's
/// lineage, e.g. `retry-replayed-from`).
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
        // as received: the envelope stores the received message, not the forward
        history: history_of(received),
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

fn carried_history(h: &FieldTable) -> Vec<HistoryEntry> {
    h.get(header::RETRY_HISTORY).map_or_else(Vec::new, parse_history)
}

fn carried_replayed_from(h: &FieldTable) -> Option<String> {
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
fn push_history_entry(text: &mut String, attempt: u64, tier: &str, failed_at_ms: u64) {
    push_decimal(text, attempt);
    text.push(':');
    text.push_str(tier);
    text.push(':');
    push_decimal(text, failed_at_ms);
}

/// Appends `n` in decimal: what `write!` would, without the formatting machinery (this runs on
/// every retry the intake schedules).
fn push_decimal(text: &mut String, n: u64) {
    text.push_str(itoa::Buffer::new().format(n));
}

/// A `retry-to` value as a queue name, or what is wrong with it.
fn check_queue_name(value: &FieldValue) -> Result<String, String> {
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
const INTAKE_WRITES: &[&str] = match INTAKE_WRITES_WITH_USER.split_last() {
    Some((_, writes)) => writes,
    None => &[],
};

/// [`INTAKE_WRITES`], then `retry-original-user-id`, which the intake writes when the delivery
/// has a `user_id` to move.
const INTAKE_WRITES_WITH_USER: &[&str] = &[
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
    header::RETRY_ORIGINAL_USER_ID,
];

/// The ladder's bookkeeping of a scheduled delivery, which the due hop removes: the message is
/// delivered as it was published.
const SCHEDULED_BOOKKEEPING: &[&str] = &[
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
fn appended_history(previous: Option<&FieldValue>, attempt: u64, step: &str, failed_at_ms: u64) -> FieldValue {
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
/// [`parse_history`] reads back to the same text (no spaces, no leading zeros, no overflow).
fn is_written_history(text: &str) -> bool {
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
fn republished_headers(headers: &FieldTable) -> FieldTable {
    headers
        .iter()
        .filter(|(k, _)| !is_stripped(k.as_bytes()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// A `user_id` that is not the publishing connection's would make the broker close the
/// channel: it moves into `retry-original-user-id`, byte for byte.
fn move_user_id(props: &BasicProperties, out: &mut FieldTable) {
    if let Some(user) = &props.user_id {
        out.set(
            header::RETRY_ORIGINAL_USER_ID,
            FieldValue::LongString(LongString::from(user.as_bytes())),
        );
    }
}

/// Copies `props` without `expiration` and `user_id` (a `user_id` that is not ours would make the
/// broker close the channel), persistent, with `headers`.
fn republished_properties(props: &BasicProperties, headers: FieldTable) -> BasicProperties {
    BasicProperties {
        headers: Some(headers),
        ..republished_properties_without_headers(props)
    }
}

/// Whether `props`, less the broker's headers, are already what a republish writes
/// ([`republished_properties`]): persistent, without `expiration` and `user_id`.
fn is_republished_as_received(props: &BasicProperties) -> bool {
    props.delivery_mode == Some(2) && props.expiration.is_none() && props.user_id.is_none()
}

/// The properties and the carry of a forward made from `props` that writes the headers `own`
/// (those `except` names): its headers, and a copy of the other received properties only when
/// they are not republished as received.
fn carrying(
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

fn republished_properties_without_headers(props: &BasicProperties) -> BasicProperties {
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
fn as_i64(value: &FieldValue) -> Option<i64> {
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

fn optional_u64(h: &FieldTable, key: &str) -> Result<Option<u64>, String> {
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
enum Target {
    Queue(String),
    Exchange(String),
}

impl Target {
    fn queue(&self) -> Option<&str> {
        match self {
            Target::Queue(queue) => Some(queue),
            Target::Exchange(_) => None,
        }
    }

    /// The key its in-flight bound and its logs use: the queue's name, or `exchange:<name>`.
    fn into_key(self) -> String {
        match self {
            Target::Queue(queue) => queue,
            Target::Exchange(exchange) => format!("exchange:{exchange}"),
        }
    }
}

/// A `retry-to-exchange` value: a text exchange name of at most 255 bytes.
fn check_exchange_name(value: &FieldValue) -> Result<String, String> {
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
const EARLIEST_DELAY_UNTIL_MS: u64 = 100_000_000_000;

/// When a scheduled delivery is due, ms since the epoch: `now + x-delay` or `delay-until`; a
/// time in the past is now. Not a number, both given, beyond [`MAX_DELAY`], or an epoch time
/// that looks like seconds is an error.
fn scheduled_due_at(h: &FieldTable, now_ms: u64) -> Result<u64, String> {
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
                return Err(format!("{} of {until} is more than 49 days ahead", header::DELAY_UNTIL));
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
    Park {
        reason: ParkReason::Cancelled,
        detail: format!("{} (it waited in a held queue)", cancelled_detail(props)),
        destination: Some(destination.to_string()),
        attempts: optional_u64(&h, header::RETRY_ATTEMPT).ok().flatten(),
        first_failed_at_ms: first_failed_at_of(props),
        history: history_of(props),
        replayed_from: replayed_from_of(props),
    }
}

fn cancelled_detail(props: &BasicProperties) -> String {
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
fn newest_death_queue(h: &FieldTable) -> Option<String> {
    let FieldValue::FieldArray(deaths) = h.get(header::X_DEATH)? else {
        return None;
    };
    let FieldValue::FieldTable(newest) = deaths.first()? else {
        return None;
    };
    as_text(newest.get("queue")?)
        .filter(|q| !q.is_empty())
        .map(str::to_string)
}

/// A short description of a value for error details, bounded in length.
fn describe(value: &FieldValue) -> String {
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
fn encoded_entries_size<'a>(
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

fn encoded_value_size(value: &FieldValue, depth: usize) -> Result<usize, TooDeep> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ladder::{DeadLetterStrategy, QueueType};
    use ladder_amqp::{Decimal, ShortString};

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
        assert_eq!(out.exchange, "ns.default.tiers");
        assert_eq!(out.routing_key, "200ms");
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
        assert_eq!(out.routing_key, "500ms");
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
            assert_eq!(out.routing_key, "256ms", "{value:?}");
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
        assert_eq!(out.routing_key, "34m57s152ms");
        // without exact delays: the first step at least that long, as before
        let mut off = fixture();
        off.spec.set_exact_delays(false);
        let input = props(&[
            ("retry-to", long_string("orders")),
            ("retry-delay", FieldValue::LongInt(400)),
        ]);
        assert_eq!(forward(off.ctx().intake(&input, NOW)).routing_key, "500ms");
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
        assert_eq!(first.kind, ForwardKind::Wait);
        let mut at = NOW + 256 + 3;
        let mut props_now = first.properties;
        let mut hops = vec![first.routing_key];
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
            assert_eq!(out.exchange, "ns.default.tiers");
            assert_eq!(
                header(&out.properties, "retry-attempt"),
                Some(&FieldValue::LongLongInt(1)),
                "no attempt"
            );
            let tier = f.spec.tiers.iter().find(|t| t.name == out.routing_key).unwrap();
            at += tier.ttl_ms() + 3;
            hops.push(out.routing_key);
            props_now = out.properties;
            assert!(hops.len() < 10, "{hops:?}");
        }
        assert_eq!(
            hops,
            ["256ms", "128ms", "16ms"],
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
        assert_eq!((out.kind, out.attempt), (ForwardKind::Wait, 0));
        assert_eq!(out.routing_key, "4s96ms");
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
            (&*out.exchange, &*out.routing_key),
            ("ns.default.due", ""),
            "straight to the due queue"
        );
        let negative = scheduled(&[
            ("retry-to", long_string("orders")),
            ("x-delay", FieldValue::LongInt(-5)),
        ]);
        assert_eq!(forward(f.ctx().intake(&negative, NOW)).exchange, "ns.default.due");
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
            (ForwardKind::Deliver, "events", "order.created")
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
            assert_eq!(out.exchange, "ns.default.tiers");
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
            let tier = f.spec.tiers.iter().find(|t| t.name == out.routing_key).unwrap();
            assert_eq!(
                header(&out.properties, "retry-due-at"),
                Some(&FieldValue::LongLongInt((NOW + tier.ttl_ms()) as i64))
            );
            tiers.push(out.routing_key.clone());
            props = out.properties;
        }
        assert_eq!(tiers, ["200ms", "500ms", "1s", "1s"]);
        // busy: always the shortest tier
        let out = f.ctx().defer(&props, DeferReason::Busy, NOW);
        assert_eq!(out.routing_key, "200ms");
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
            park.detail.contains("312 NO_ROUTE") && park.detail.contains("ns.default.tiers"),
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
}
