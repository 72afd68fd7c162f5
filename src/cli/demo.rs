//! `ladder demo`: one failure sent by hand through a ladder, as a consumer would send it, and
//! watched on its way back to the queue it names — the first thing to try after `ladder run`.
//!
//! It never takes someone else's message: it watches the destination only while that queue
//! has no consumer and held nothing when the failure was sent, and hands back (nack, requeue)
//! anything that is not its own.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use ladder::broker::connect as service;
use ladder::clock;
use ladder::config::Config;
use ladder::model::names::Names;
use ladder::model::protocol::{self, header};
use ladder_amqp::{BasicProperties, Channel, Confirmation, Connection, FieldTable, QueueOptions};

use crate::exit;

/// How much longer than the first tier's delay the demo waits for its message to come back:
/// a relay hop takes milliseconds; the rest is room for a busy broker.
const WATCH_SLACK: Duration = Duration::from_secs(30);

/// How long one broker call may take before the demo gives up.
const CALL_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Args)]
pub struct DemoArgs {
    /// The ladder to send it through (needed when the config has more than one).
    #[arg(long)]
    ladder: Option<String>,
    /// The queue the failure is for (`retry-to`); declared (durable, classic) if it does not
    /// exist. It must pass the ladder's allow-list.
    #[arg(long, value_name = "QUEUE", default_value = "orders")]
    to: String,
    /// Send it and exit, without watching for its return.
    #[arg(long)]
    no_wait: bool,
}

/// `ladder demo`: 0 once the message is back (or sent, when it is not watched); 64 an unknown
/// ladder or a destination the ladder may not deliver to; 69 no broker; 1 the ladder's topology
/// is missing or the message did not come back in time.
pub async fn demo(config: &Config, args: DemoArgs) -> ExitCode {
    let spec = match (&args.ladder, config.ladders.as_slice()) {
        (Some(name), ladders) => match ladders.iter().find(|l| &l.name == name) {
            Some(spec) => spec,
            None => return fail(exit::CONFIG, format!("no ladder {name:?} in {}", config.file.display())),
        },
        (None, [only]) => only,
        (None, _) => return fail(exit::CONFIG, "the config has several ladders; choose one with --ladder"),
    };
    let names = Names::of(&config.namespace, spec);
    if let Some(why) = protocol::refuse_destination(spec, &names, &args.to) {
        let allow: Vec<&str> = spec.allow.patterns().iter().map(String::as_str).collect();
        return fail(
            exit::CONFIG,
            format!("{why}; choose a queue with --to that matches allow = {allow:?}"),
        );
    }
    let connection = match service::connect(&config.amqp).await {
        Ok(connection) => connection,
        Err(e) => {
            return fail(
                exit::UNAVAILABLE,
                format!("cannot reach the broker at {}: {e}", config.amqp.brokers()),
            );
        }
    };
    let code = match send_and_watch(&connection, spec.tier_for_attempt(1), &names, &args).await {
        Ok(code) => code,
        Err(why) => fail(exit::FAILED, why),
    };
    let _ = tokio::time::timeout(CALL_TIMEOUT, connection.close(200, "demo done")).await;
    code
}

fn fail(code: u8, why: impl std::fmt::Display) -> ExitCode {
    eprintln!("ladder demo: {why}");
    ExitCode::from(code)
}

/// Bounds a broker call by [`CALL_TIMEOUT`] and says what failed.
async fn call<T>(what: &str, work: impl Future<Output = ladder_amqp::Result<T>>) -> Result<T, String> {
    match tokio::time::timeout(CALL_TIMEOUT, work).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(format!("{what}: {e}")),
        Err(_) => Err(format!("{what}: no answer within {CALL_TIMEOUT:?}")),
    }
}

async fn channel(connection: &Connection) -> Result<Channel, String> {
    call("opening a channel", connection.create_channel()).await
}

async fn send_and_watch(
    connection: &Connection,
    tier: &ladder::model::ladder::Tier,
    names: &Names,
    args: &DemoArgs,
) -> Result<ExitCode, String> {
    let to = args.to.as_str();
    // a passive declare that fails closes its channel: one channel per question
    if call("", channel(connection).await?.exchange_inspect(&names.exchange))
        .await
        .is_err()
    {
        return Err(format!(
            "exchange {} does not exist: start the service first (ladder run), or declare it (ladder apply)",
            names.exchange
        ));
    }
    let before = destination(connection, to).await?;

    let id = format!("demo-{}", clock::now_ms());
    let mut headers = FieldTable::new();
    headers.set(header::RETRY_TO, protocol::long_string(to));
    headers.set(
        header::RETRY_REASON,
        protocol::long_string("sent by hand with `ladder demo`"),
    );
    let properties = BasicProperties::default()
        .with_message_id(&id)
        .with_content_type("text/plain")
        .with_delivery_mode(2)
        .with_headers(headers);
    let ch = channel(connection).await?;
    call("confirm mode", ch.confirm_select()).await?;
    let confirm = ch
        .basic_publish(
            &names.exchange,
            "",
            true,
            &properties,
            b"a first failure, sent by `ladder demo`",
        )
        .map_err(|e| format!("publishing: {e}"))?;
    match call("publishing", confirm).await? {
        Confirmation::Ack | Confirmation::NotRequested => {}
        Confirmation::Nack => return Err(format!("the broker refused the publish to {}", names.exchange)),
        Confirmation::Returned(_) => {
            return Err(format!(
                "{} routed it to no queue: is {} declared and bound? (ladder apply)",
                names.exchange, names.intake_queue
            ));
        }
    }
    let sent = Instant::now();
    println!(
        "sent {id} to exchange {} (the ladder's intake), with retry-to: {to}",
        names.exchange
    );
    println!(
        "  the ladder takes it from {}, counts attempt 1 and holds it {} in {}",
        names.intake_queue,
        tier.name,
        names.tier_queue(tier)
    );
    println!(
        "  then it publishes it to queue {to}, the queue that failed (or parks it in {}: ladder parked list)",
        names.parked
    );

    if args.no_wait {
        return Ok(ExitCode::SUCCESS);
    }
    if before.consumer_count > 0 {
        println!(
            "queue {to} has {} consumer(s): they get {id} back in about {}",
            before.consumer_count, tier.name
        );
        return Ok(ExitCode::SUCCESS);
    }
    if before.message_count > 0 {
        println!(
            "queue {to} holds {} other message(s), so {id} is not watched: it arrives behind them in about {}",
            before.message_count, tier.name
        );
        return Ok(ExitCode::SUCCESS);
    }
    watch(connection, to, &id, sent, tier.delay + WATCH_SLACK).await
}

/// Queue `to` as it is, declared (durable, classic) when it does not exist.
async fn destination(connection: &Connection, to: &str) -> Result<ladder_amqp::QueueInfo, String> {
    let ch = channel(connection).await?;
    match ch.queue_inspect(to).await {
        Ok(info) => Ok(info),
        Err(e) if e.reply_code() == Some(404) => {
            let ch = channel(connection).await?;
            let options = QueueOptions {
                durable: true,
                ..QueueOptions::default()
            };
            let info = call(
                &format!("declaring queue {to}"),
                ch.queue_declare(to, options, FieldTable::new()),
            )
            .await?;
            println!("declared queue {to} (durable, classic): it did not exist");
            Ok(info)
        }
        Err(e) => Err(format!("reading queue {to}: {e}")),
    }
}

/// Waits for message `id` on `queue` (until `within` after `sent`) and takes it; a message that
/// is not ours goes back to the queue, and the watch ends.
async fn watch(
    connection: &Connection,
    queue: &str,
    id: &str,
    sent: Instant,
    within: Duration,
) -> Result<ExitCode, String> {
    let ch = channel(connection).await?;
    call("basic.qos", ch.basic_qos(1)).await?;
    let mut consumer = call(
        &format!("consuming from {queue}"),
        ch.basic_consume(queue, "", false, FieldTable::new()),
    )
    .await?;
    println!("waiting for it on queue {queue} (at most {within:?}) ...");
    let delivery = match tokio::time::timeout(within.saturating_sub(sent.elapsed()), consumer.next()).await {
        Ok(Some(Ok(delivery))) => delivery,
        Ok(Some(Err(e))) => return Err(format!("consuming from {queue}: {e}")),
        Ok(None) => return Err(format!("the consumer on {queue} was cancelled (queue deleted?)")),
        Err(_) => {
            return Err(format!(
                "{id} did not arrive in {queue} within {within:?}: is `ladder run` serving this config? Was it \
                 parked? (ladder parked list)"
            ));
        }
    };
    let props = &delivery.properties;
    if props.message_id.as_ref().map(ToString::to_string).as_deref() != Some(id) {
        let _ = ch.basic_nack(delivery.delivery_tag, false, true);
        println!("another message arrived on {queue} first and went back to it; {id} is not watched further");
        return Ok(ExitCode::SUCCESS);
    }
    ch.basic_ack(delivery.delivery_tag, false)
        .map_err(|e| format!("acking {id}: {e}"))?;
    let headers = props.headers_or_empty();
    let show = |key: &str| {
        headers
            .get(key)
            .map(|v| {
                protocol::as_text(v).map_or_else(
                    || protocol::as_u64(v).map_or("?".into(), |n| n.to_string()),
                    str::to_string,
                )
            })
            .unwrap_or_else(|| "-".into())
    };
    println!(
        "back in {queue} after {:.2} s: retry-attempt {}, retry-tier {}, retry-ladder {} (taken off the queue: done)",
        sent.elapsed().as_secs_f64(),
        show(header::RETRY_ATTEMPT),
        show(header::RETRY_TIER),
        show(header::RETRY_LADDER)
    );
    Ok(ExitCode::SUCCESS)
}
