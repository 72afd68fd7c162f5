//! Markers: checks that nothing (else) arrives, which cannot pass on a late wrong delivery.
//!
//! Waiting 500 ms and seeing nothing proves only that a wrong delivery, if there is one, takes
//! longer than 500 ms — which a busy two-core machine, or a tier longer than the window, easily
//! makes it do. A marker is a message the test sends after the action under test, along the path
//! a wrong delivery would take; the check is that nothing but markers arrives before the last
//! marker does. It cannot pass on a late wrong delivery because every hop of the path is first
//! in, first out, so whatever the action set going arrives ahead of the markers, however slow:
//!
//! - [`Via::Queue`]: a queue hands out its messages in the order they were enqueued. A wrong
//!   delivery the action published, and had confirmed, before it returned (a replay, a discard)
//!   is in the queue ahead of a marker published after that, whatever the pace of the consumer.
//! - [`Via::Ladder`]: the way a retry travels. The intake queue is FIFO, and the service publishes
//!   what it takes from a queue in the order it took it (each delivery's first publish goes out
//!   before the service awaits anything for it), so whatever entered the ladder before the
//!   markers leaves the intake ahead of them. A tier's TTL is one per queue, never per message,
//!   so a tier expires its messages into the due queue in the order they entered it, and the due
//!   hop delivers in the order it takes. One marker through each step of the backoff (sent as the
//!   retry that waits there) therefore comes out behind everything that waited in that step: a
//!   wrong retry through any step arrives before the marker of its step.
//!
//! What a marker cannot close: a message the due hop puts back into a tier (its destination is
//! full or has its bound in flight) loses its place, and so does one requeued when a connection
//! is lost; and a message that waits an explicit delay outside the backoff's steps takes a path
//! of its own. Use markers where none of these happens, or only after everything expected has
//! arrived.

use std::sync::atomic::{AtomicU64, Ordering};

use ladder_amqp::{BasicProperties, Channel, Delivery, FieldTable, FieldValue};

use super::{TestConsumer, TestLadder, WAIT, next, publish, retry_props};

/// The way markers travel to the queue they close: the way a wrong delivery would come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// One marker published straight to the queue, confirmed: for a wrong delivery that would
    /// have been published, and confirmed, before the action under test returned.
    Queue,
    /// One marker per step of the ladder's backoff, published to its intake with `retry-to` the
    /// queue and the `retry-attempt` that waits in that step: for a wrong delivery that would
    /// come back through the ladder as a retry.
    Ladder,
}

/// Markers sent, by message id (`marker-…`).
#[derive(Debug, Clone)]
pub struct Markers {
    ids: Vec<String>,
}

impl Markers {
    /// Whether `message_id` is one of these markers.
    pub fn contains(&self, message_id: &str) -> bool {
        self.ids.iter().any(|id| id == message_id)
    }

    pub fn ids(&self) -> &[String] {
        &self.ids
    }
}

/// A marker message id no test uses otherwise.
fn marker_id(tier: &str) -> String {
    static MARKERS: AtomicU64 = AtomicU64::new(0);
    format!(
        "marker-{}-{}-{tier}",
        std::process::id(),
        MARKERS.fetch_add(1, Ordering::Relaxed)
    )
}

/// Sends one marker straight to `queue`, confirmed, on `channel` (in confirm mode).
pub async fn mark_queue(channel: &Channel, queue: &str) -> Markers {
    let id = marker_id("queue");
    let props = BasicProperties::default().with_message_id(&id);
    publish(channel, "", queue, b"marker", props).await;
    Markers { ids: vec![id] }
}

/// Sends one marker to `queue` through each step of a ladder's backoff that a retry reaches —
/// its intake exchange `intake`, its `backoff` and `max_attempts` — confirmed, on `channel` (in
/// confirm mode). Each marker is the retry that waits in its step: the first attempt that does,
/// by `retry-attempt`, not by `retry-delay` (which, with exact delays, waits in delay levels).
pub async fn mark_through_ladder(
    channel: &Channel,
    intake: &str,
    backoff: &[std::time::Duration],
    max_attempts: u32,
    queue: &str,
) -> Markers {
    let mut ids = vec![];
    let mut steps: Vec<std::time::Duration> = vec![];
    for (i, step) in backoff.iter().enumerate().take(max_attempts as usize) {
        if steps.contains(step) {
            continue;
        }
        steps.push(*step);
        let id = marker_id(&format!("{}ms", step.as_millis()));
        // attempt i + 1 waits in backoff[i]: the message carries the attempts before it
        let before = (i > 0).then_some(i as i64);
        let props = retry_props(queue, before).with_message_id(&id);
        publish(channel, intake, "", b"marker", props).await;
        ids.push(id);
    }
    Markers { ids }
}

/// What arrives on `consumer` before the last of `markers` does, in order, markers left out;
/// everything is acked. Panics if the markers take longer than [`WAIT`] (markers through a
/// ladder take its longest tier: not for ladders with tiers of minutes).
pub async fn until_markers(consumer: &mut TestConsumer, markers: &Markers) -> Vec<Delivery> {
    let mut missing: Vec<&str> = markers.ids.iter().map(String::as_str).collect();
    let mut before = vec![];
    let arrived = tokio::time::timeout(WAIT, async {
        while !missing.is_empty() {
            let d = next(consumer).await;
            consumer.ack(&d);
            let id = d.properties.message_id.as_ref().and_then(|id| id.to_str());
            match id.and_then(|id| missing.iter().position(|m| *m == id)) {
                Some(i) => {
                    missing.swap_remove(i);
                }
                // a marker twice (a redelivery) is not what the test is about
                None if id.is_some_and(|id| markers.contains(id)) => {}
                None => before.push(d),
            }
        }
    })
    .await;
    assert!(
        arrived.is_ok(),
        "markers {missing:?} did not arrive within {WAIT:?} ({} other deliveries did)",
        before.len()
    );
    before
}

/// Panics, naming `what` must not arrive, if anything but `markers` arrives on `consumer`
/// before the last of them does.
pub async fn assert_nothing_before(what: &str, consumer: &mut TestConsumer, markers: &Markers) {
    let before = until_markers(consumer, markers).await;
    if let Some(d) = before.first() {
        panic!(
            "{what}: {} deliveries arrived before the markers, the first: {:?} {:?}",
            before.len(),
            d.properties,
            String::from_utf8_lossy(&d.body)
        );
    }
}

impl TestLadder {
    /// Sends markers to `queue` the way `via` says, on the test's confirming channel.
    pub async fn mark(&self, queue: &str, via: Via) -> Markers {
        match via {
            Via::Queue => mark_queue(&self.channel, queue).await,
            Via::Ladder => {
                let spec = &self.config.ladders[0];
                mark_through_ladder(&self.channel, &self.intake(), &spec.backoff, spec.max_attempts, queue).await
            }
        }
    }

    /// Sends markers to `queue` the way `via` says and panics if anything but them arrives on
    /// `consumer` (which consumes `queue`) before they do: "nothing more arrives", which no
    /// late wrong delivery passes (see the [module](self) doc). `what` names what must not.
    pub async fn assert_nothing_more(&self, what: &str, consumer: &mut TestConsumer, queue: &str, via: Via) {
        let markers = self.mark(queue, via).await;
        assert_nothing_before(what, consumer, &markers).await;
    }

    /// Everything in `queue` up to a marker published to it now, acked, the marker left out: all
    /// that was published to `queue`, and confirmed, before this call, however late. For a queue
    /// nothing else consumes.
    pub async fn drain_queue(&self, queue: &str) -> Vec<Delivery> {
        let mut consumer = self.consume(queue).await;
        let markers = self.mark(queue, Via::Queue).await;
        let before = until_markers(&mut consumer, &markers).await;
        let _ = consumer.channel.close(200, "drained").await;
        before
    }

    /// Panics if the parking lot gets a record after its first `count` (a fresh stream starts
    /// at offset 0) other than the markers this sends through every step to a queue that does not
    /// exist, which the due hop parks as `no-route`. A wrong park from the intake hop is
    /// published before the markers leave the intake, one from the due hop before the marker
    /// of its tier is delivered (and returned, and parked); see the [module](self) doc.
    pub async fn assert_nothing_parked_after(&self, count: usize) {
        let nowhere = format!("{}-marker-never-declared", self.ns);
        let markers = self.mark(&nowhere, Via::Ladder).await;
        let channel = self.client.create_channel().await.unwrap();
        channel.basic_qos(10).await.unwrap();
        let mut args = FieldTable::default();
        args.set("x-stream-offset", FieldValue::LongLongInt(count as i64));
        let consumer = channel
            .basic_consume(&self.parked_stream(), "", false, args)
            .await
            .unwrap();
        let mut consumer = TestConsumer { channel, consumer };
        let extra = until_markers(&mut consumer, &markers).await;
        if let Some(d) = extra.first() {
            let record = String::from_utf8_lossy(&d.body);
            panic!("{} extra records were parked, the first: {record}", extra.len());
        }
        let _ = consumer.channel.close(200, "checked").await;
    }
}
