//! The namespace's strays: what a shared tier dead-lettered for no ladder the namespace serves
//! (`N.stray`), and what comes due in the due queue of a retired ladder. Each message is moved
//! to the ladder it belongs to by its own headers, through `N.due` with its `retry-ladder` set
//! to that ladder, whose due hop then decides it with its own checks.

use std::sync::Arc;

use ladder_amqp::{Channel, Confirmation, Connection, Delivery, FieldTable};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::broker::connect::CLOSE_TIMEOUT;
use crate::broker::relay::{LadderRuntime, RETRY_MAX, RETRY_MIN};
use crate::model::backoff::Backoff;
use crate::model::protocol::{self, header};

/// Strays moved at once: they are rare, and one at a time keeps their order.
const PREFETCH: u16 = 16;

/// The ladder a stray with `headers` belongs to: the one its `retry-ladder` names, else the
/// first whose allow-list admits its `retry-to`, else the first (whose due hop parks it as not
/// allowed); `None` without ladders.
pub fn owner<'l>(ladders: &'l [Arc<LadderRuntime>], headers: Option<&FieldTable>) -> Option<&'l Arc<LadderRuntime>> {
    let text = |key: &str| headers.and_then(|h| h.get(key)).and_then(protocol::as_text);
    let named = text(header::RETRY_LADDER).and_then(|name| ladders.iter().find(|l| l.spec.name == name));
    let admitting = || {
        let to = text(header::RETRY_TO)?;
        ladders.iter().find(|l| l.spec.allows(to))
    };
    named.or_else(admitting).or_else(|| ladders.first())
}

/// Moves every message of `queue` to the ladder it belongs to ([`owner`]) until `stop`; acks
/// each once the broker confirmed its move.
pub async fn serve(
    queue: &str,
    ladders: &[Arc<LadderRuntime>],
    connection: &Connection,
    stop: CancellationToken,
) -> ladder_amqp::Result<()> {
    let channel = connection.create_channel().await?;
    channel.basic_qos(PREFETCH).await?;
    channel.confirm_select().await?;
    let mut consumer = channel.basic_consume(queue, "", false, FieldTable::new()).await?;
    info!(queue, "consuming strays");
    loop {
        let delivery = tokio::select! {
            () = stop.cancelled() => break,
            next = consumer.next() => match next {
                Some(delivery) => delivery?,
                None => return Err(ladder_amqp::Error::ChannelGone),
            },
        };
        let Some(ladder) = owner(ladders, delivery.properties.headers.as_ref()) else {
            break;
        };
        if !move_one(&channel, ladder, &delivery, &stop).await? {
            break;
        }
        channel.basic_ack(delivery.delivery_tag, false)?;
    }
    // what is unacked goes back to the queue when the channel closes
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, channel.close(200, "stopped")).await;
    Ok(())
}

/// Publishes `delivery` to `ladder`'s due queue until the broker confirms it: `false` if `stop`
/// came first. Through `N.due`, which routes by `retry-ladder`, so that its routing key (an
/// older ladder's first wait, `wait.<step>`) stays; properties that did not decode go straight
/// to the due queue, which parks them.
async fn move_one(
    channel: &Channel,
    ladder: &LadderRuntime,
    delivery: &Delivery,
    stop: &CancellationToken,
) -> ladder_amqp::Result<bool> {
    let mut backoff = Backoff::new(RETRY_MIN, RETRY_MAX);
    loop {
        let confirm = match &delivery.undecodable {
            None => {
                let mut properties = delivery.properties.clone();
                let mut headers = properties.headers.take().unwrap_or_default();
                headers.set(header::RETRY_LADDER, protocol::long_string(&ladder.spec.name));
                let properties = properties.with_headers(headers);
                let due = &ladder.names.namespace.due;
                channel.basic_publish(due, delivery.routing_key.as_bytes(), true, &properties, &delivery.body)?
            }
            Some(raw) => {
                channel.basic_publish_raw(b"", ladder.names.due.as_bytes(), true, &raw.bytes, &delivery.body)?
            }
        };
        match confirm.await? {
            Confirmation::Ack | Confirmation::NotRequested => return Ok(true),
            refused => {
                let pause = backoff.next_wait();
                warn!(ladder = %ladder.spec.name, ?refused, retry_in = ?pause, "the broker refused a stray's move; moving it again");
                tokio::select! {
                    () = stop.cancelled() => return Ok(false),
                    () = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
}
