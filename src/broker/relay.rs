//! The consume loops of a ladder — intake, due and quarantine — and the parking of what they
//! cannot forward.
//!
//! Each loop owns one channel in confirm mode. It takes up to `prefetch` deliveries, decides
//! each one with [`crate::model::protocol`], publishes the replacement, and acks the delivery
//! only once the broker confirmed that publish (`acks` acks what settles in one turn at once).
//! Many publishes are in flight at once, bounded by the prefetch. A broker error ends the loop
//! and the supervisor reconnects: unacked deliveries go back to their queue, so the worst case
//! is a duplicate, never a loss.
//!
//! No single message or destination may hold a loop up:
//! - the due hop has at most `max_in_flight_per_destination` deliveries in flight to one queue
//!   (`gate`). More for it wait briefly for a slot while it keeps confirming; else they, and what
//!   it refuses, go back into a tier without an attempt counted
//!   ([`crate::model::protocol::HopContext::defer`]). So a full or stalled queue cannot take
//!   the prefetch from the others;
//! - a message whose handling panics (a bug) is parked as `internal-error` instead of taking the
//!   session down again at every redelivery;
//! - a body too large for an envelope is parked apart, as a record of its own
//!   ([`BODY_INLINE_MAX`]).

mod acks;
mod gate;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use ladder_amqp::{BasicProperties, Carried, Channel, Confirmation, Connection, Delivery, FieldTable, ShortString};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::broker::topology::Names;
use crate::clock::{now_ms, unique_id};
use crate::metrics::{InFlight, LadderMetrics};
use crate::model::backoff::Backoff;
use crate::model::cancels::SharedCancellations;
use crate::model::envelope::{BODY_FORMAT, BodyRecord, Envelope, FORMAT, OriginalMessage};
use crate::model::holds::{AutoHoldPolicy, Breaker, SharedHolds};
use crate::model::ladder::LadderSpec;
use crate::model::ladder::Limits;
use crate::model::protocol::{
    self, Arrival, Counted, Decision, DeferReason, Forward, ForwardKind, HopContext, Park, ParkReason, long_string,
};
use crate::telemetry::{HopTrace, Telemetry};

use acks::Acks;
use gate::{BUSY_WAIT, DestinationGate, GatePermit};

/// First pause before publishing again after the broker nacked a publish into a tier or
/// refused a park (the stream is missing). The delivery is held, not requeued: a requeue would
/// come straight back, and counts against a quorum queue's delivery limit.
pub(crate) const RETRY_MIN: Duration = Duration::from_millis(500);

/// The pause doubles up to this; the held delivery occupies one prefetch slot meanwhile.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(30);

/// A body larger than this is parked as a record of its own, before the envelope that names
/// it. In base64 inside the envelope it would pass RabbitMQ's `max_message_size` long before
/// the body itself does, and the index reads every envelope whole.
pub const BODY_INLINE_MAX: usize = 1024 * 1024;

pub use crate::model::names::Hop;

/// Probe failures queued for the hold stream at most: one probe is out per held destination at
/// a time, so more are repeats of the same ones.
const MAX_PENDING_PROBE_FAILURES: usize = 1_000;

/// A ladder with everything its loops need, shared by its loops.
#[derive(Debug)]
pub struct LadderRuntime {
    /// The ladder.
    pub spec: LadderSpec,
    /// Its names.
    pub names: Names,
    /// Bounds.
    pub limits: Limits,
    /// Its metric handles.
    pub metrics: LadderMetrics,
    /// Tracing.
    pub telemetry: Telemetry,
    /// The ladder's cancelled message ids (filled by `broker::cancels::follow`).
    pub cancels: Arc<SharedCancellations>,
    /// The ladder's destination holds (filled by `broker::holds::follow`).
    pub holds: Arc<SharedHolds>,
    /// Told by `broker::holds::follow` when a record changed the holds: the releaser acts on
    /// it at once, and without an automatic hold it waits for nothing else.
    pub holds_changed: tokio::sync::Notify,
    /// Deliveries and failures per destination as this replica sees them: the automatic hold's
    /// breaker (polled by `broker::holds::run_releaser` when `auto_hold` is on) and the busiest
    /// destinations of the web page.
    pub breaker: std::sync::Mutex<Breaker>,
    /// The due hop's deliveries, counted apart from [`breaker`](Self::breaker) (which the
    /// intake counts into) so the two hops, on two threads, take no lock in common per
    /// message; absorbed into it by [`LadderRuntime::merged_breaker`].
    deliveries: std::sync::Mutex<Breaker>,
    /// Probes of the automatic hold this replica's intake saw come back failed, (destination,
    /// probe id), until the releaser records them in the hold stream (within one tick).
    pub probe_failures: std::sync::Mutex<Vec<(String, u64)>>,
}

impl LadderRuntime {
    /// A ladder's runtime with empty cancellations and holds.
    pub fn new(spec: LadderSpec, names: Names, limits: Limits, metrics: LadderMetrics, telemetry: Telemetry) -> Self {
        let policy = spec.auto_hold.unwrap_or(AutoHoldPolicy {
            window: Duration::from_secs(60),
            min_deliveries: u32::MAX,
            failure_permille: 1000,
            probe_every: Duration::from_secs(10),
        });
        LadderRuntime {
            spec,
            names,
            limits,
            metrics,
            telemetry,
            cancels: Arc::default(),
            holds: Arc::default(),
            holds_changed: tokio::sync::Notify::new(),
            breaker: std::sync::Mutex::new(Breaker::new(policy)),
            deliveries: std::sync::Mutex::new(Breaker::new(policy)),
            probe_failures: std::sync::Mutex::default(),
        }
    }

    fn breaker(&self) -> std::sync::MutexGuard<'_, Breaker> {
        self.breaker.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The breaker with every delivery counted so far: what the automatic hold polls and the
    /// web page lists. (Locks the breaker, then the deliveries: the hops each take one.)
    pub fn merged_breaker(&self) -> std::sync::MutexGuard<'_, Breaker> {
        let mut breaker = self.breaker();
        let mut deliveries = self
            .deliveries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        breaker.absorb(&mut deliveries, now_ms());
        drop(deliveries);
        breaker
    }

    /// The failures of `destination` that came back so far, for a release's ramp.
    pub fn failures_of(&self, destination: &str) -> u64 {
        self.breaker().failures(destination)
    }

    /// A message back at the intake failed at `destination`: counted by the breaker, and if it
    /// is a probe of the automatic hold (`retry-probe`), queued for the hold stream.
    fn failed_at(&self, destination: &str, props: &ladder_amqp::BasicProperties, now: u64) {
        let headers = props.headers.as_ref();
        let lag_ms = protocol::failure_lag_ms(&self.spec, headers);
        let delivered_ms = protocol::delivered_at_ms(headers);
        self.breaker().failed(destination, lag_ms, delivered_ms, now);
        if let Some(probe) = props
            .headers
            .as_ref()
            .and_then(|h| h.get(protocol::header::RETRY_PROBE))
            .and_then(protocol::as_u64)
        {
            let mut pending = self
                .probe_failures
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if pending.len() < MAX_PENDING_PROBE_FAILURES {
                pending.push((destination.to_string(), probe));
            }
        }
    }

    /// Whether the message's id was cancelled.
    pub(crate) fn cancelled(&self, props: &ladder_amqp::BasicProperties) -> bool {
        !self.cancels.is_empty()
            && props
                .message_id
                .as_ref()
                .is_some_and(|id| self.cancels.contains(id.as_bytes(), now_ms()))
    }

    fn context(&self) -> HopContext<'_> {
        HopContext {
            spec: &self.spec,
            names: &self.names,
            limits: &self.limits,
        }
    }

    /// The queue `hop` consumes.
    pub(crate) fn queue(&self, hop: Hop) -> &str {
        match hop {
            Hop::Intake => &self.names.intake_queue,
            Hop::Due => &self.names.due,
            Hop::Quarantine => &self.names.quarantine,
        }
    }
}

/// Why a loop stopped other than by shutdown.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The channel or connection failed.
    #[error("{hop} loop of ladder {ladder}: {source}")]
    Broker {
        /// Which loop.
        hop: Hop,
        /// Which ladder.
        ladder: String,
        /// The client's error.
        #[source]
        source: ladder_amqp::Error,
    },
    /// The broker cancelled the consumer (its queue was deleted).
    #[error("{hop} loop of ladder {ladder}: the broker cancelled the consumer")]
    Cancelled {
        /// Which loop.
        hop: Hop,
        /// Which ladder.
        ladder: String,
    },
}

/// What a loop left behind when it stopped for shutdown.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// Deliveries still unsettled when the grace period ran out; the broker redelivers them.
    pub abandoned: usize,
}

/// A running loop's consumer is subscribed; the supervisor waits for every loop's before it
/// reports ready.
pub type Subscribed = tokio::sync::oneshot::Sender<()>;

/// Consumes `hop` of `ladder` until `shutdown`, then drains in-flight work for up to `grace`.
/// `subscribed` is told once the consumer runs.
pub async fn serve(
    hop: Hop,
    ladder: Arc<LadderRuntime>,
    connection: &Connection,
    shutdown: CancellationToken,
    grace: Duration,
    subscribed: Option<Subscribed>,
) -> Result<Drained, RelayError> {
    serve_on(hop, None, ladder, connection, shutdown, grace, subscribed).await
}

/// [`serve`], consuming `queue` instead of the hop's own queue when given (the intake hop also
/// takes failed probes from `N.L.probes`).
pub async fn serve_on(
    hop: Hop,
    queue: Option<&str>,
    ladder: Arc<LadderRuntime>,
    connection: &Connection,
    shutdown: CancellationToken,
    grace: Duration,
    subscribed: Option<Subscribed>,
) -> Result<Drained, RelayError> {
    let broker = |source| RelayError::Broker {
        hop,
        ladder: ladder.spec.name.clone(),
        source,
    };
    let (channel, mut consumer) = subscribe(hop, queue, &ladder, connection).await.map_err(broker)?;
    if let Some(subscribed) = subscribed {
        let _ = subscribed.send(());
    }

    let limit = usize::from(ladder.limits.max_in_flight_per_destination);
    // deliveries beyond a busy destination's bound may wait for its slots, in what of the
    // prefetch its bound leaves
    let waiting = usize::from(ladder.limits.prefetch).saturating_sub(limit);
    let gate = DestinationGate::new(limit, waiting, BUSY_WAIT);
    // borrowed by every delivery's future rather than counted: the ladder's reference count is
    // shared with loops on other threads, and updating it per delivery costs a cache line
    let (ladder, channel, gate) = (&*ladder, &channel, &gate);
    let mut in_flight: FuturesUnordered<_> = FuturesUnordered::new();
    // A one-shot told by a task of its own when `shutdown` fires. The loop polls it last, and
    // under load also checks it after every delivery with `try_recv`, one atomic load, cheaper
    // than polling a token. The task ends with the loop.
    let (stop, mut stopping) = tokio::sync::oneshot::channel::<()>();
    let _told = tokio_util::task::AbortOnDropHandle::new(tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            shutdown.cancelled().await;
            let _ = stop.send(());
        }
    }));
    // what is received and not acked yet: what settles in one turn is acked in one frame
    let mut acks = Acks::default();
    let ack = |tag, multiple| channel.basic_ack(tag, multiple);
    loop {
        tokio::select! {
            biased;
            Some(settled) = in_flight.next() => {
                let settled: ladder_amqp::Result<u64> = settled;
                acks.settled(settled.map_err(broker)?);
                // the others confirmed by now (the broker confirms in batches) join its ack
                while let Some(Some(settled)) = in_flight.next().now_or_never() {
                    acks.settled(settled.map_err(broker)?);
                }
                acks.flush(ack).map_err(broker)?;
            }
            next = consumer.next() => match next {
                Some(Ok(delivery)) => {
                    acks.received(delivery.delivery_tag);
                    in_flight.push(handle(hop, ladder, channel, gate, Box::new(delivery)));
                    if !matches!(stopping.try_recv(), Err(tokio::sync::oneshot::error::TryRecvError::Empty)) {
                        break;
                    }
                }
                Some(Err(source)) => return Err(broker(source)),
                None => return Err(RelayError::Cancelled { hop, ladder: ladder.spec.name.clone() }),
            },
            _ = &mut stopping => break,
        }
    }

    // Stop taking work, then finish what is in flight within the grace period.
    let _ = channel.basic_cancel(consumer.tag()).await;
    let finish = async {
        acks.flush(ack)?;
        while let Some(settled) = in_flight.next().await {
            acks.settled(settled?);
            acks.flush(ack)?;
        }
        Ok::<(), ladder_amqp::Error>(())
    };
    let drained = match tokio::time::timeout(grace, finish).await {
        Ok(Ok(())) => Drained::default(),
        Ok(Err(source)) => return Err(broker(source)),
        Err(_) => Drained {
            abandoned: in_flight.len(),
        },
    };
    // Closing the channel hands anything unsettled back to the queue.
    let _ = channel.close(200, "shutdown").await;
    Ok(drained)
}

/// Opens the loop's channel (prefetch, confirms) and consumes `queue`, or the hop's own queue.
async fn subscribe(
    hop: Hop,
    queue: Option<&str>,
    ladder: &LadderRuntime,
    connection: &Connection,
) -> ladder_amqp::Result<(Channel, ladder_amqp::Consumer)> {
    let channel = connection.create_channel().await?;
    channel.basic_qos(ladder.limits.prefetch).await?;
    channel.confirm_select().await?;
    if hop == Hop::Due {
        // The due hop neither reads nor republishes the broker's dead-letter annotations, so it
        // steps over them undecoded: they are a large part of what a due message carries. A
        // ladder that lists senders reads them (the sender rule asks whether a failure was
        // dead-lettered), and so does an older ladder's first wait (`wait.<step>`,
        // `model::upgrade`), whose destination is in `x-death`.
        if ladder.spec.senders.is_none() {
            channel.skip_header_keys_unless_routed(ladder_amqp::DEAD_LETTER_HEADERS, "wait.");
        }
    }
    let queue = queue.unwrap_or(ladder.queue(hop));
    let consumer = channel.basic_consume(queue, "", false, FieldTable::new()).await?;
    info!(ladder = %ladder.spec.name, %hop, queue, "consuming");
    Ok((channel, consumer))
}

/// One delivery, from receipt until it is settled — its replacement confirmed — and may be
/// acked: its delivery tag (the loop acks it, [`Acks`]). A panic while handling it (a bug) parks
/// it as `internal-error` rather than ending the session, which would redeliver it — and panic —
/// again.
///
/// An async block, not an async fn, which would keep its arguments twice in its state. The
/// delivery comes boxed, so that the future allocated for every delivery stays small enough
/// for the allocator's per-thread cache.
#[allow(clippy::manual_async_fn, reason = "an async fn would keep its arguments twice")]
fn handle<'a>(
    hop: Hop,
    ladder: &'a LadderRuntime,
    channel: &'a Channel,
    gate: &'a DestinationGate,
    delivery: Box<Delivery>,
) -> impl Future<Output = ladder_amqp::Result<u64>> + 'a {
    async move {
        let started = Instant::now();
        let metrics = ladder.metrics.hop(hop);
        let _in_flight = InFlight::enter(&metrics.in_flight);
        metrics.received.inc();
        // a failure enters the ladder at the intake, or at the due hop when the broker routed
        // it straight into its wait
        let routed = match hop {
            Hop::Due => ladder
                .context()
                .routed_failure(&delivery.properties, delivery.routing_key.as_bytes()),
            _ => None,
        };
        let enters = hop == Hop::Intake || routed.is_some();
        let handled = AssertUnwindSafe(settle(hop, ladder, channel, gate, &delivery, routed.as_ref()))
            .catch_unwind()
            .await;
        match handled {
            Ok(result) => result?,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                error!(ladder = %ladder.spec.name, %hop, panic = %what, "handling a message failed; parking it as internal-error");
                let detail = format!("the service failed while handling it ({what}); parked as received");
                let park = Park::new(ParkReason::InternalError, detail);
                Box::pin(park_until_confirmed(hop, ladder, channel, &delivery, &park, None)).await?;
            }
        }
        // Counted once settled, not on receipt: RabbitMQ 4.x marks a message dead-lettered out
        // of a quorum queue `redelivered` on its first delivery, so the flag cannot tell a
        // redelivery, and a delivery handed back unsettled must not count.
        if enters {
            ladder.metrics.entered.inc();
        }
        metrics.duration.observe(started.elapsed());
        Ok(delivery.delivery_tag)
    }
}

/// The publish that settles one delivery, as it evolves: a refused delivery is deferred, a
/// returned one parked.
enum Step<'a> {
    /// Intake: into a tier.
    Schedule(Box<Forward<'a>>),
    /// Due: to the destination, holding one of its in-flight slots.
    Deliver(Box<Forward<'a>>, GatePermit),
    /// Due: back into a tier — from what the deliver decision would have published when it
    /// took a failure in (its `retry-attempt` and the rest are written there), else as received.
    Defer(DeferReason, Option<Box<Forward<'a>>>),
    /// Due: into the held queue of its destination (held, or releasing), no attempt counted.
    Hold(Box<Forward<'a>>),
    /// Into the parking lot.
    Park(Park),
}

/// Decides, publishes and waits for the broker until the delivery's replacement is confirmed.
async fn settle(
    hop: Hop,
    ladder: &LadderRuntime,
    channel: &Channel,
    gate: &DestinationGate,
    delivery: &Delivery,
    routed: Option<&protocol::RoutedFailure>,
) -> ladder_amqp::Result<()> {
    let now = now_ms();
    let trace = ladder.telemetry.start_hop(
        hop,
        &ladder.names,
        &ladder.spec.name,
        &delivery.properties,
        delivery.body.len(),
        now,
        routed,
    );
    let trace = trace.as_ref();
    let mut step = match decide(hop, ladder, delivery, routed, now, trace) {
        Ok(step) => step,
        Err(forward) => match gate.enter(&forward.destination).await {
            Some(permit) => Step::Deliver(forward, permit),
            None => Step::Defer(DeferReason::Busy, (forward.counted == Counted::Here).then_some(forward)),
        },
    };
    let mut backoff = Backoff::new(RETRY_MIN, RETRY_MAX);
    let mut deferred_due_ms = 0;
    loop {
        let confirmation = publish(hop, ladder, channel, delivery, &step, &mut deferred_due_ms, trace).await?;
        step = match account(
            hop,
            ladder,
            gate,
            delivery,
            step,
            confirmation,
            deferred_due_ms,
            now,
            trace,
        ) {
            Next::Settled => return Ok(()),
            Next::Publish(step) => step,
            Next::Refused(step) => {
                let pause = backoff.next_wait();
                warn!(ladder = %ladder.spec.name, %hop, retry_in = ?pause, "broker refused a publish; holding the delivery and publishing again");
                Box::pin(tokio::time::sleep(pause)).await;
                step
            }
        };
    }
}

/// What the ladder decides for a delivery, as the step that publishes it; `Err`: a delivery
/// that needs a slot of its destination first. Done before the first wait: what a future holds
/// across a wait is kept for as long as the delivery is in flight.
fn decide<'a>(
    hop: Hop,
    ladder: &'a LadderRuntime,
    delivery: &Delivery,
    routed: Option<&protocol::RoutedFailure>,
    now: u64,
    trace: Option<&HopTrace>,
) -> Result<Step<'a>, Box<Forward<'a>>> {
    let props = &delivery.properties;
    let arrival = Arrival {
        now_ms: now,
        routing_key: delivery.routing_key.as_bytes(),
        // only a ladder with a spread draws (a thread-local draw per retry otherwise thrown
        // away): at the intake, and at the due hop for a repeat failure routed there
        draw: if (hop == Hop::Intake || routed.is_some()) && ladder.spec.spread().is_some() {
            fastrand::f64()
        } else {
            0.5
        },
        cancelled: ladder.cancelled(props),
    };
    let decide = |props| match hop {
        Hop::Intake => ladder.context().intake_at(props, &arrival),
        Hop::Due => ladder.context().due_at(props, &arrival),
        Hop::Quarantine => Decision::Park(ladder.context().dead_lettered(props)),
    };
    let decision = match &delivery.undecodable {
        None => decide(props),
        // parked as the bytes received; the shallow headers still say where it was headed
        Some(raw) => Decision::Park(protocol::undecodable(&raw.error, raw.lossy.as_ref().map(decide))),
    };
    if let Some(trace) = trace {
        trace.decided(&decision, props);
    }
    if let Some(destination) = failed_destination(hop, &decision) {
        ladder.failed_at(destination, props, now);
    }
    match decision {
        Decision::Forward(forward) => match forward.kind {
            // a failure of a held destination waits in its held queue, not in a tier as well
            ForwardKind::Wait { .. }
                if hop == Hop::Intake && forward.attempt >= 1 && ladder.holds.holds_back(&forward.destination) =>
            {
                let forward = ladder.context().due_now(forward, now);
                Ok(Step::Hold(forward))
            }
            ForwardKind::Wait { .. } => Ok(Step::Schedule(forward)),
            ForwardKind::Deliver if ladder.holds.holds_back(&forward.destination) => Ok(Step::Hold(forward)),
            ForwardKind::Deliver | ForwardKind::DeliverToExchange => Err(forward),
        },
        Decision::Park(park) => Ok(Step::Park(park)),
    }
}

/// The one place the breaker hears of a failure. A destination failed when a message it was
/// delivered (attempt 2 on) fails again: scheduled at the intake, taken in at the due hop (the
/// broker routed it past the intake), or parked after its last attempt.
fn failed_destination<'d>(hop: Hop, decision: &'d Decision<'_>) -> Option<&'d str> {
    match decision {
        Decision::Forward(forward)
            if forward.attempt >= 2
                && (forward.counted == Counted::Here || hop == Hop::Intake && forward.kind.tier().is_some()) =>
        {
            Some(&forward.destination)
        }
        Decision::Park(park)
            if park.reason == ParkReason::MaxAttempts
                && (hop == Hop::Intake || hop == Hop::Due && park.attempts.is_some()) =>
        {
            park.destination.as_deref()
        }
        _ => None,
    }
}

/// Publishes `step` and waits for the broker's word on it. A deferral's wait is made here, and
/// when it is due goes to `deferred_due_ms`.
async fn publish(
    hop: Hop,
    ladder: &LadderRuntime,
    channel: &Channel,
    delivery: &Delivery,
    step: &Step<'_>,
    deferred_due_ms: &mut u64,
    trace: Option<&HopTrace>,
) -> ladder_amqp::Result<Confirmation> {
    // each publish is bound before its wait: a `?` on the wait's expression would keep its own
    // copy of the wait in the future, beside the wait
    let confirmed = match step {
        Step::Schedule(forward) | Step::Deliver(forward, _) => publish_forward(
            channel,
            trace,
            &forward.exchange,
            &forward.routing_key,
            delivery,
            forward,
        )?,
        Step::Hold(forward) => {
            let queue = ladder.names.held_queue(&forward.destination);
            publish_forward(channel, trace, "", &queue, delivery, forward)?
        }
        Step::Defer(reason, from) => {
            let props = &delivery.properties;
            let forward = match from {
                Some(from) => ladder.context().defer(&from.full_properties(props), *reason, now_ms()),
                None => ladder.context().defer(props, *reason, now_ms()),
            };
            *deferred_due_ms = forward.due_at_ms;
            publish_forward(
                channel,
                trace,
                &forward.exchange,
                &forward.routing_key,
                delivery,
                &forward,
            )?
        }
        // boxed: parking is rare, and its state would make every delivery's future larger
        Step::Park(park) => return Box::pin(park_one(hop, ladder, channel, delivery, park, trace)).await,
    };
    confirmed.await
}

/// What comes after a publish the broker answered.
enum Next<'a> {
    /// Confirmed: the delivery may be acked.
    Settled,
    /// Another publish replaces it at once (a deferral, or a park).
    Publish(Step<'a>),
    /// The broker refused it: published again after a pause.
    Refused(Step<'a>),
}

/// Counts a publish the broker answered with `confirmation`, and says what comes next.
#[allow(
    clippy::too_many_arguments,
    reason = "the delivery's whole context, borrowed from the loop"
)]
fn account<'a>(
    hop: Hop,
    ladder: &LadderRuntime,
    gate: &DestinationGate,
    delivery: &Delivery,
    step: Step<'a>,
    confirmation: Confirmation,
    deferred_due_ms: u64,
    now: u64,
    trace: Option<&HopTrace>,
) -> Next<'a> {
    let metrics = ladder.metrics.hop(hop);
    match (step, confirmation) {
        (step, Confirmation::Ack) => {
            confirmed(hop, ladder, delivery, &step, deferred_due_ms, now, trace);
            Next::Settled
        }
        (Step::Hold(forward), Confirmation::Returned(_)) => {
            // no held queue: deleted after its release ended and this replica has not read the
            // end yet (or deleted by hand). Not parked: it waits in the shortest tier and is
            // decided again, by then on the stream's word. A failure taken in (at the intake, or
            // past it) waits as decided, its attempt counted
            debug!(ladder = %ladder.spec.name, destination = %forward.destination, "the held queue is gone; deferring");
            let taken_in = hop == Hop::Intake || forward.counted == Counted::Here;
            Next::Publish(Step::Defer(DeferReason::Busy, taken_in.then_some(forward)))
        }
        (Step::Schedule(forward) | Step::Deliver(forward, _), Confirmation::Returned(returned)) => {
            metrics.returned.inc();
            let park = protocol::no_route(
                hop,
                &delivery.properties,
                &forward,
                returned.reply_code,
                &returned.reply_text,
            );
            Next::Publish(Step::Park(park))
        }
        (Step::Defer(_, _), Confirmation::Returned(returned)) => {
            metrics.returned.inc();
            let forward = ladder.context().defer(&delivery.properties, DeferReason::Busy, now);
            let park = protocol::no_route(
                hop,
                &delivery.properties,
                &forward,
                returned.reply_code,
                &returned.reply_text,
            );
            Next::Publish(Step::Park(park))
        }
        (Step::Deliver(forward, permit), Confirmation::Nack | Confirmation::NotRequested) => {
            // the destination refused it: back into a tier, not held here
            drop(permit);
            gate.log_refusal(&ladder.spec.name, &forward.destination, || trace_id(trace));
            if let Some(trace) = trace {
                trace.failed("destination-refused");
            }
            Next::Publish(Step::Defer(
                DeferReason::Refused,
                (forward.counted == Counted::Here).then_some(forward),
            ))
        }
        (step, Confirmation::Nack | Confirmation::NotRequested | Confirmation::Returned(_)) => {
            // a tier or the parking lot refused it: the broker is in trouble, hold and retry
            metrics.publish_failures.inc();
            if let Some(trace) = trace {
                trace.failed("publish-refused");
            }
            Next::Refused(step)
        }
    }
}

/// Counts a confirmed publish: a wait begun, a message held, delivered or deferred.
fn confirmed(
    hop: Hop,
    ladder: &LadderRuntime,
    delivery: &Delivery,
    step: &Step<'_>,
    deferred_due_ms: u64,
    now: u64,
    trace: Option<&HopTrace>,
) {
    match step {
        Step::Schedule(forward) => {
            let tier = forward.kind.tier().unwrap_or_default();
            // the arrival's time: the publish followed it within the decision's microseconds
            ladder.metrics.scheduled(tier, now);
            if hop == Hop::Intake || forward.counted == Counted::Here {
                // a wait begins (the due hop's waits are the next legs of the same one)
                ladder.breaker().scheduled(&forward.destination, forward.due_at_ms, now);
            }
            debug!(ladder = %ladder.spec.name, %hop, destination = %forward.destination, attempt = forward.attempt,
                   tier, trace_id = %trace_id(trace), "scheduled");
        }
        Step::Hold(forward) => {
            ladder.metrics.holds.held_messages.inc();
            debug!(ladder = %ladder.spec.name, %hop, destination = %forward.destination, attempt = forward.attempt,
                   trace_id = %trace_id(trace), "held");
        }
        Step::Deliver(forward, _) => {
            ladder.metrics.delivered(Duration::from_millis(forward.late_ms));
            // a scheduled delivery's failure is a first failure, which the breaker does not count
            if forward.attempt >= 1 {
                let lag_ms = protocol::failure_lag_ms(&ladder.spec, forward.properties.headers.as_ref());
                ladder
                    .deliveries
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .delivered(&forward.destination, lag_ms, now);
            }
            debug!(ladder = %ladder.spec.name, %hop, destination = %forward.destination, attempt = forward.attempt,
                   late_ms = forward.late_ms, trace_id = %trace_id(trace), "delivered");
        }
        Step::Defer(reason, _) => {
            ladder.metrics.deferred(*reason);
            if let Some(destination) = delivery
                .properties
                .headers
                .as_ref()
                .and_then(|h| h.get(protocol::header::RETRY_TO))
                .and_then(protocol::as_text)
            {
                ladder.breaker().scheduled(destination, deferred_due_ms, now_ms());
            }
        }
        Step::Park(_) => {}
    }
}

/// Parks `delivery`, publishing again with backoff until the broker confirms.
pub(crate) async fn park_until_confirmed(
    hop: Hop,
    ladder: &LadderRuntime,
    channel: &Channel,
    delivery: &Delivery,
    park: &Park,
    trace: Option<&HopTrace>,
) -> ladder_amqp::Result<()> {
    let mut backoff = Backoff::new(RETRY_MIN, RETRY_MAX);
    loop {
        if let Confirmation::Ack = park_one(hop, ladder, channel, delivery, park, trace).await? {
            return Ok(());
        }
        ladder.metrics.hop(hop).publish_failures.inc();
        tokio::time::sleep(backoff.next_wait()).await;
    }
}

/// Publishes the parked record of `delivery` (and, for a large body, the body's own record
/// first); `Ack` once the broker confirmed all of it.
async fn park_one(
    hop: Hop,
    ladder: &LadderRuntime,
    channel: &Channel,
    delivery: &Delivery,
    park: &Park,
    trace: Option<&HopTrace>,
) -> ladder_amqp::Result<Confirmation> {
    let reason = park.reason;
    let message = if delivery.body.len() > BODY_INLINE_MAX {
        let record = BodyRecord {
            id: unique_id(&ladder.spec.name),
            bytes: delivery.body.len() as u64,
        };
        let mut headers = FieldTable::default();
        headers.set("parked-ladder", long_string(&ladder.spec.name));
        headers.set("parked-body-of", long_string(&record.id));
        let properties = BasicProperties {
            delivery_mode: Some(2),
            content_type: Some(short("application/octet-stream")),
            kind: Some(short(BODY_FORMAT)),
            message_id: ShortString::try_from(record.id.as_str()).ok(),
            headers: Some(headers),
            ..Default::default()
        };
        let stored = publish_confirmed(
            channel,
            trace,
            "",
            &ladder.names.parked,
            &delivery.body,
            &properties,
            None,
        )?
        .await?;
        if stored != Confirmation::Ack {
            error!(ladder = %ladder.spec.name, parked = %ladder.names.parked, "the parking lot refused a body record; holding the message and parking again");
            return Ok(stored);
        }
        OriginalMessage::capture_delivery_apart(delivery, record)
    } else {
        OriginalMessage::capture_delivery(delivery)
    };
    let envelope = Envelope {
        format: FORMAT.to_string(),
        reason: reason.code().to_string(),
        detail: park.detail.clone(),
        ladder: ladder.spec.name.clone(),
        destination: park.destination.clone(),
        attempts: park.attempts,
        first_failed_at_ms: park.first_failed_at_ms,
        history: park.history.clone(),
        replayed_from: park.replayed_from.clone(),
        parked_at_ms: now_ms(),
        hop: hop.to_string(),
        message,
    };
    let body = serde_json::to_vec(&envelope).expect("an envelope of JSON values always serializes");
    let mut headers = FieldTable::default();
    // Plain strings only: streams on 3.10 keep these, and they let tools filter without decoding.
    headers.set("parked-reason", long_string(&envelope.reason));
    headers.set("parked-ladder", long_string(&envelope.ladder));
    if let Some(destination) = &envelope.destination {
        headers.set("parked-destination", long_string(destination));
    }
    let properties = BasicProperties {
        delivery_mode: Some(2),
        content_type: Some(short("application/json")),
        kind: Some(short(FORMAT)),
        headers: Some(headers),
        message_id: delivery.properties.message_id.clone(),
        ..Default::default()
    };
    let confirmation = publish_confirmed(channel, trace, "", &ladder.names.parked, &body, &properties, None)?.await?;
    if let Confirmation::Ack = confirmation {
        ladder.metrics.parked(reason);
        if let Some(trace) = trace {
            trace.parked(reason.code());
        }
        warn!(
            ladder = %envelope.ladder,
            %hop,
            reason = %envelope.reason,
            destination = envelope.destination.as_deref().unwrap_or("-"),
            attempts = envelope.attempts.unwrap_or(0),
            detail = %envelope.detail,
            trace_id = %trace_id(trace),
            "parked message"
        );
    } else {
        error!(
            ladder = %envelope.ladder,
            %hop,
            parked = %ladder.names.parked,
            reason = %envelope.reason,
            "the parking lot refused a message; holding it and parking again"
        );
    }
    Ok(confirmation)
}

/// Publishes `forward` of `delivery` to `exchange` with `routing_key` (the forward's own, or a
/// held queue), its headers written from the delivery's as it carries them over
/// ([`Forward::carry`]), not copied first; see [`publish_confirmed`].
fn publish_forward(
    channel: &Channel,
    trace: Option<&HopTrace>,
    exchange: &str,
    routing_key: &str,
    delivery: &Delivery,
    forward: &Forward<'_>,
) -> ladder_amqp::Result<impl Future<Output = ladder_amqp::Result<Confirmation>> + use<>> {
    forward.publishing(&delivery.properties, |properties, carried| {
        publish_confirmed(
            channel,
            trace,
            exchange,
            routing_key,
            &delivery.body,
            properties,
            carried,
        )
    })
}

/// Publishes persistent and mandatory, and returns the wait for the broker's confirm, which
/// traces the send. The frames are written before it returns, so the wait borrows nothing:
/// the caller may drop what it published from first.
fn publish_confirmed(
    channel: &Channel,
    trace: Option<&HopTrace>,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: &BasicProperties,
    carried: Option<Carried<'_>>,
) -> ladder_amqp::Result<impl Future<Output = ladder_amqp::Result<Confirmation>> + use<>> {
    let (send, confirm) = match trace {
        None => (
            None,
            channel.basic_publish_carrying(exchange, routing_key, true, properties, carried, body)?,
        ),
        Some(trace) => {
            // the send span's context goes into the headers published: a copy, only when tracing
            let properties = match carried {
                Some(carried) => properties.with_carried(&carried),
                None => properties.clone(),
            };
            let (send, traced) = trace.send(exchange, routing_key, properties);
            (
                Some(send),
                channel.basic_publish(exchange, routing_key, true, &traced, body)?,
            )
        }
    };
    Ok(async move {
        let confirmation = confirm.await?;
        if let Some(send) = send {
            send.finish(match &confirmation {
                Confirmation::Ack => None,
                Confirmation::Returned(_) => Some("no-route"),
                Confirmation::Nack | Confirmation::NotRequested => Some("nacked"),
            });
        }
        Ok(confirmation)
    })
}

/// A short string of a name this crate controls (a content type, a format tag).
fn short(text: &str) -> ShortString {
    ShortString::try_from(text).expect("a constant of at most 255 bytes")
}

fn trace_id(trace: Option<&HopTrace>) -> String {
    trace.map_or_else(|| "-".to_string(), HopTrace::trace_id)
}
