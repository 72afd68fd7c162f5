//! The two consume loops of a ladder — intake and due — and the parking of what they cannot
//! forward.
//!
//! Each loop owns one channel in confirm mode: it takes up to `prefetch` deliveries, decides
//! each one with [`crate::protocol`], publishes the replacement and acks the delivery only once
//! the broker confirmed that publish. Many publishes are in flight at once (the prefetch bounds
//! them); nothing waits for one confirm before sending the next. A broker error ends the loop,
//! and the supervisor reconnects: unacked deliveries go back to their queue, so the worst case
//! is a duplicate, never a loss.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use lapin::message::Delivery;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::config::Limits;
use crate::envelope::{Envelope, FORMAT, OriginalMessage};
use crate::ladder::LadderSpec;
use crate::metrics::{InFlight, LadderMetrics};
use crate::protocol::{self, Decision, Forward, HopContext, Park, ParkReason, long_string};
use crate::telemetry::{HopTrace, Telemetry};
use crate::topology::Names;

/// First pause before publishing again after the broker nacked a publish or refused a park
/// (the stream is missing). The delivery is held, not requeued: a requeue would come straight
/// back, and on RabbitMQ 4.x each one counts against a quorum queue's delivery limit (20 by
/// default), after which the broker drops the message.
const RETRY_MIN: Duration = Duration::from_millis(500);

/// The pause doubles up to this; the held delivery occupies one prefetch slot meanwhile.
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Which queue a loop consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hop {
    /// `N.L.intake`: failures coming in.
    Intake,
    /// `N.L.due`: messages whose wait is over.
    Due,
}

impl fmt::Display for Hop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hop::Intake => "intake",
            Hop::Due => "due",
        })
    }
}

/// A ladder with everything its loops need, shared by both loops.
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
}

impl LadderRuntime {
    fn context(&self) -> HopContext<'_> {
        HopContext {
            spec: &self.spec,
            names: &self.names,
            limits: &self.limits,
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
        source: lapin::Error,
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

/// Consumes `hop` of `ladder` until `shutdown`, then drains in-flight work for up to `grace`.
pub async fn serve(
    hop: Hop,
    ladder: Arc<LadderRuntime>,
    connection: &Connection,
    shutdown: CancellationToken,
    grace: Duration,
) -> Result<Drained, RelayError> {
    let broker = |source| RelayError::Broker {
        hop,
        ladder: ladder.spec.name.clone(),
        source,
    };
    let channel = connection.create_channel().await.map_err(broker)?;
    channel
        .basic_qos(ladder.limits.prefetch, BasicQosOptions::default())
        .await
        .map_err(broker)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(broker)?;
    let queue = match hop {
        Hop::Intake => ladder.names.intake_queue.as_str(),
        Hop::Due => ladder.names.due.as_str(),
    };
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(broker)?;
    info!(queue, "consuming");

    let mut in_flight: FuturesUnordered<_> = FuturesUnordered::new();
    loop {
        tokio::select! {
            biased;
            Some(settled) = in_flight.next() => { let settled: lapin::Result<()> = settled; settled.map_err(broker)? }
            () = shutdown.cancelled() => break,
            next = consumer.next() => match next {
                Some(Ok(delivery)) => in_flight.push(handle(hop, ladder.clone(), channel.clone(), delivery)),
                Some(Err(source)) => return Err(broker(source)),
                None => return Err(RelayError::Cancelled { hop, ladder: ladder.spec.name.clone() }),
            },
        }
    }

    // Stop taking work, then finish what is in flight within the grace period.
    let _ = channel
        .basic_cancel(consumer.tag(), BasicCancelOptions::default())
        .await;
    let finish = async {
        while let Some(settled) = in_flight.next().await {
            settled?;
        }
        Ok::<(), lapin::Error>(())
    };
    let drained = match tokio::time::timeout(grace, finish).await {
        Ok(Ok(())) => Drained::default(),
        Ok(Err(source)) => return Err(broker(source)),
        Err(_) => Drained {
            abandoned: in_flight.len(),
        },
    };
    // Closing the channel hands anything unsettled back to the queue.
    let _ = channel.close(200, "shutdown".into()).await;
    Ok(drained)
}

/// Whether a delivery's replacement is safely with the broker.
enum Settle {
    Ack,
    Retry,
}

async fn handle(hop: Hop, ladder: Arc<LadderRuntime>, channel: Channel, delivery: Delivery) -> lapin::Result<()> {
    let started = Instant::now();
    let metrics = ladder.metrics.hop(hop);
    let _in_flight = InFlight::enter(&metrics.in_flight);
    metrics.received.inc();
    let now = now_ms();
    let props = &delivery.properties;
    let trace = ladder
        .telemetry
        .start_hop(hop, &ladder.names, &ladder.spec.name, props, delivery.data.len(), now);
    let decision = match hop {
        Hop::Intake => ladder.context().intake(props, now),
        Hop::Due => ladder.context().due(props, now),
    };
    if let Some(trace) = &trace {
        trace.decided(&decision);
    }
    let trace = trace.as_ref();
    let mut pause = RETRY_MIN;
    loop {
        let settle = match &decision {
            Decision::Forward(forward) => forward_one(hop, &ladder, &channel, &delivery, forward, trace).await?,
            Decision::Park(park) => park_one(hop, &ladder, &channel, &delivery, park, trace).await?,
        };
        match settle {
            Settle::Ack => break,
            Settle::Retry => {
                metrics.publish_failures.inc();
                if let Some(trace) = trace {
                    trace.failed("publish-refused");
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(RETRY_MAX);
            }
        }
    }
    delivery.acker.ack(Default::default()).await?;
    metrics.duration.observe(started.elapsed().as_secs_f64());
    Ok(())
}

async fn forward_one(
    hop: Hop,
    ladder: &LadderRuntime,
    channel: &Channel,
    delivery: &Delivery,
    forward: &Forward,
    trace: Option<&HopTrace>,
) -> lapin::Result<Settle> {
    let confirmation = publish_confirmed(
        channel,
        trace,
        &forward.exchange,
        &forward.routing_key,
        &delivery.data,
        forward.properties.clone(),
    )
    .await?;
    match confirmation {
        Confirmation::Ack(None) => {
            match hop {
                Hop::Intake => ladder.metrics.scheduled(&forward.routing_key),
                Hop::Due => ladder.metrics.delivered(Duration::from_millis(forward.late_ms)),
            }
            debug!(ladder = %ladder.spec.name, %hop, destination = %forward.destination, attempt = forward.attempt,
                   routing_key = %forward.routing_key, late_ms = forward.late_ms, trace_id = %trace_id(trace), "forwarded");
            Ok(Settle::Ack)
        }
        Confirmation::Ack(Some(returned)) => {
            ladder.metrics.hop(hop).returned.inc();
            let detail = format!(
                "the broker returned the publish to exchange {:?} with routing key {:?}: {} {}",
                forward.exchange, forward.routing_key, returned.reply_code, returned.reply_text
            );
            let attempts = match hop {
                Hop::Intake => forward.attempt.saturating_sub(1),
                Hop::Due => forward.attempt,
            };
            let park = Park {
                reason: ParkReason::NoRoute,
                detail,
                destination: Some(forward.destination.clone()),
                attempts: Some(attempts),
                first_failed_at_ms: None,
                // as received: the envelope stores the received message, not the forward
                history: protocol::history_of(&delivery.properties),
                replayed_from: protocol::replayed_from_of(&delivery.properties),
            };
            park_one(hop, ladder, channel, delivery, &park, trace).await
        }
        Confirmation::Nack(_) | Confirmation::NotRequested => {
            warn!(ladder = %ladder.spec.name, %hop, "broker refused a publish; holding the delivery and publishing again");
            Ok(Settle::Retry)
        }
    }
}

async fn park_one(
    hop: Hop,
    ladder: &LadderRuntime,
    channel: &Channel,
    delivery: &Delivery,
    park: &Park,
    trace: Option<&HopTrace>,
) -> lapin::Result<Settle> {
    let reason = park.reason;
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
        message: OriginalMessage::capture(
            delivery.exchange.as_str(),
            delivery.routing_key.as_str(),
            &delivery.properties,
            &delivery.data,
        ),
    };
    let body = serde_json::to_vec(&envelope).expect("an envelope of JSON values always serializes");
    let mut headers = FieldTable::default();
    // Plain strings only: streams on 3.10 keep these, and they let tools filter without decoding.
    headers.insert("parked-reason".into(), long_string(&envelope.reason));
    headers.insert("parked-ladder".into(), long_string(&envelope.ladder));
    if let Some(destination) = &envelope.destination {
        headers.insert("parked-destination".into(), long_string(destination));
    }
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_type(FORMAT.into())
        .with_headers(headers);
    if let Some(id) = delivery.properties.message_id() {
        properties = properties.with_message_id(id.clone());
    }
    let confirmation = publish_confirmed(channel, trace, "", &ladder.names.parked, &body, properties).await?;
    if let Confirmation::Ack(None) = confirmation {
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
        return Ok(Settle::Ack);
    }
    error!(
        ladder = %envelope.ladder,
        parked = %ladder.names.parked,
        reason = %envelope.reason,
        "the parking lot refused a message; holding it and parking again"
    );
    Ok(Settle::Retry)
}

/// Publishes persistent and mandatory, waits for the broker's confirm, and traces the send.
async fn publish_confirmed(
    channel: &Channel,
    trace: Option<&HopTrace>,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> lapin::Result<Confirmation> {
    let (send, properties) = match trace {
        Some(trace) => {
            let (send, properties) = trace.send(exchange, routing_key, properties);
            (Some(send), properties)
        }
        None => (None, properties),
    };
    let options = BasicPublishOptions {
        mandatory: true,
        immediate: false,
    };
    let confirmation = channel
        .basic_publish(exchange.into(), routing_key.into(), options, body, properties)
        .await?
        .await?;
    if let Some(send) = send {
        send.finish(match &confirmation {
            Confirmation::Ack(None) => None,
            Confirmation::Ack(Some(_)) => Some("no-route"),
            Confirmation::Nack(_) | Confirmation::NotRequested => Some("nacked"),
        });
    }
    Ok(confirmation)
}

fn trace_id(trace: Option<&HopTrace>) -> String {
    trace.map_or_else(|| "-".to_string(), HopTrace::trace_id)
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
