//! The cancellation stream `N.L.cancels`: appending a cancellation (CLI, API, web page) and
//! following the stream into the [`SharedCancellations`] every relay loop of the ladder checks.
//!
//! Following starts at the records written in the last [`MAX_DELAY`] (older ones hold nothing
//! that can still wait). It is caught up once it has read a marker it appended itself: then
//! every cancellation written before it started is in the set, whatever the broker's delivery
//! timing — and only then does the supervisor start the relay loops.

use std::time::Duration;

use ladder_amqp::{BasicProperties, Confirmation, Connection, FieldTable, FieldValue, ShortString};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::clock::now_ms;
use crate::model::cancels::{CANCEL_FORMAT, Cancellation, SharedCancellations};
use crate::model::ladder::MAX_DELAY;
use crate::model::names::Names;

/// Every broker call here is bounded by this.
pub const BROKER_TIMEOUT: Duration = Duration::from_secs(10);

/// The format of the catch-up marker this module appends.
const FOLLOW_MARKER_FORMAT: &str = "ladder.cancels-marker/v1";

/// Records in flight to the follower before it acks (streams need a prefetch).
const PREFETCH: u16 = 500;

/// How often expired cancellations are dropped.
const EXPIRE_EVERY: Duration = Duration::from_secs(60);

/// Why a cancellation or the follower failed.
#[derive(Debug, thiserror::Error)]
pub enum CancelError {
    /// The broker failed or refused.
    #[error(transparent)]
    Broker(#[from] ladder_amqp::Error),
    /// A broker call took longer than [`BROKER_TIMEOUT`].
    #[error("the broker did not answer within {0:?} while {1}")]
    Timeout(Duration, &'static str),
    /// The broker did not take the record (returned: the stream is missing; or nacked).
    #[error("the broker did not take the cancellation record: {0}")]
    NotTaken(String),
    /// The message id cannot be cancelled.
    #[error("{0}")]
    Invalid(String),
}

pub(crate) async fn bounded<T>(
    during: &'static str,
    call: impl Future<Output = ladder_amqp::Result<T>>,
) -> Result<T, CancelError> {
    match tokio::time::timeout(BROKER_TIMEOUT, call).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(CancelError::Timeout(BROKER_TIMEOUT, during)),
    }
}

/// How often [`bounded_on`] looks whether the broker blocks the connection.
const BLOCKED_SLICE: Duration = Duration::from_secs(1);

/// Like [`bounded`], with a clock that stops while the broker blocks `connection` (a memory or
/// disk alarm: it reads nothing from a blocked connection, so no call answers until the alarm
/// clears, and giving up would only reconnect into the same alarm). [`BROKER_TIMEOUT`] counts
/// only the time the connection was not blocked.
pub(crate) async fn bounded_on<T>(
    connection: &Connection,
    during: &'static str,
    call: impl Future<Output = ladder_amqp::Result<T>>,
) -> Result<T, CancelError> {
    let mut call = std::pin::pin!(call);
    let mut unblocked = Duration::ZERO;
    loop {
        match tokio::time::timeout(BLOCKED_SLICE, &mut call).await {
            Ok(result) => return Ok(result?),
            Err(_) if connection.is_blocked() => {}
            Err(_) => {
                unblocked += BLOCKED_SLICE;
                if unblocked >= BROKER_TIMEOUT {
                    return Err(CancelError::Timeout(BROKER_TIMEOUT, during));
                }
            }
        }
    }
}

fn record_properties(format: &str) -> BasicProperties {
    BasicProperties {
        delivery_mode: Some(2),
        content_type: ShortString::try_from("application/json").ok(),
        kind: ShortString::try_from(format).ok(),
        ..BasicProperties::default()
    }
}

/// Appends `record` to the stream `stream` and waits for the broker's confirm.
pub(crate) async fn append(
    connection: &Connection,
    stream: &str,
    format: &str,
    body: &[u8],
) -> Result<(), CancelError> {
    let channel = bounded_on(connection, "opening a channel", connection.create_channel()).await?;
    bounded_on(connection, "selecting confirms", channel.confirm_select()).await?;
    let confirm = channel.basic_publish("", stream, true, &record_properties(format), body)?;
    let confirmation = bounded_on(connection, "waiting for the confirm", confirm).await;
    let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.close(200, "appended")).await;
    match confirmation? {
        Confirmation::Ack => Ok(()),
        Confirmation::Returned(r) => Err(CancelError::NotTaken(format!(
            "{stream} does not exist ({} {})",
            r.reply_code, r.reply_text
        ))),
        Confirmation::Nack | Confirmation::NotRequested => Err(CancelError::NotTaken("nacked".into())),
    }
}

/// Records that `message_id` is cancelled in the ladder named by `names`, by `by`: every
/// replica parks a message with that id as `cancelled` when it next handles it (at the latest
/// when it is due), instead of delivering it. Returns the record once the broker confirmed it.
pub async fn cancel(
    connection: &Connection,
    names: &Names,
    message_id: &str,
    by: &str,
) -> Result<Cancellation, CancelError> {
    let record = Cancellation::new(message_id, by, now_ms()).map_err(CancelError::Invalid)?;
    append(connection, &names.cancels, CANCEL_FORMAT, &record.to_json()).await?;
    info!(stream = %names.cancels, message_id, by, "cancellation recorded");
    Ok(record)
}

/// Follows `names.cancels` into `set` until `stop`: from the records of the last [`MAX_DELAY`],
/// marking `set` caught up once it read its own marker. Returns on `stop`, or with the error
/// that ended it.
pub async fn follow(
    connection: &Connection,
    names: &Names,
    set: &SharedCancellations,
    stop: &CancellationToken,
) -> Result<(), CancelError> {
    set.set_caught_up(false);
    let marker_id = crate::clock::unique_id("cancels");
    let marker = serde_json::json!({"format": FOLLOW_MARKER_FORMAT, "id": marker_id});
    append(
        connection,
        &names.cancels,
        FOLLOW_MARKER_FORMAT,
        marker.to_string().as_bytes(),
    )
    .await?;

    let channel = bounded_on(connection, "opening a channel", connection.create_channel()).await?;
    bounded_on(connection, "setting the prefetch", channel.basic_qos(PREFETCH)).await?;
    let since = now_ms().saturating_sub(MAX_DELAY.as_millis() as u64);
    let mut args = FieldTable::default();
    args.set("x-stream-offset", FieldValue::Timestamp(since / 1000));
    let mut consumer = bounded_on(
        connection,
        "subscribing to the cancellations",
        channel.basic_consume(&names.cancels, "", false, args),
    )
    .await?;
    let mut expire = tokio::time::interval(EXPIRE_EVERY);
    loop {
        let delivery = tokio::select! {
            () = stop.cancelled() => break,
            _ = expire.tick() => {
                set.expire(now_ms());
                continue;
            }
            next = consumer.next() => match next {
                Some(delivery) => delivery?,
                None => return Err(CancelError::Broker(ladder_amqp::Error::ChannelGone)),
            },
        };
        let kind = delivery.properties.kind.as_ref().and_then(|k| k.to_str());
        match kind {
            Some(CANCEL_FORMAT) => match Cancellation::from_slice(&delivery.body) {
                Some(c) => {
                    debug!(message_id = %c.message_id, by = %c.by, "cancellation read");
                    set.add(&c);
                }
                None => debug!("an unreadable cancellation record; skipped"),
            },
            Some(FOLLOW_MARKER_FORMAT) => {
                let ours = serde_json::from_slice::<serde_json::Value>(&delivery.body)
                    .ok()
                    .is_some_and(|v| v["id"] == marker_id.as_str());
                if ours && !set.caught_up() {
                    debug!(cancellations = set.len(), "cancellations caught up");
                    set.set_caught_up(true);
                }
            }
            _ => {}
        }
        channel.basic_ack(delivery.delivery_tag, false)?;
    }
    let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.basic_cancel(consumer.tag())).await;
    let _ = tokio::time::timeout(BROKER_TIMEOUT, channel.close(200, "stopped")).await;
    Ok(())
}
