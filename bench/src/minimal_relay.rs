//! The minimal relay (`ladder-bench relay`): the same two hops as the ladder over the same
//! topology, with nothing else — the physical limit of this design on this broker.
//!
//! intake: consume `N.L.intake` → publish through the default exchange into the namespace's
//! shared tier queue `N.delay.<tier>` → confirm → ack. The tier dead-letters into `N.due`, a
//! headers exchange that routes by `retry-ladder` to `N.L.due`.
//! due: consume `N.L.due` → publish to the default exchange with `retry-to` as routing key →
//! confirm → ack.
//!
//! The relay writes the same protocol headers the ladder writes on each hop
//! (`model::protocol::intake` and `due`), so both publish the same header bytes and the
//! comparison measures the ladder's work, not its headers: at the intake `retry-to`,
//! `retry-attempt`, `retry-first-failed-at`, `retry-ladder` (which `N.due` routes by),
//! `retry-tier`, `retry-due-at` and `retry-history`; at the due hop `retry-next`, the broker's
//! dead-letter annotations (`x-death` and its family) removed. No validation, no telemetry, no
//! parking, no ladder arithmetic (the attempt is counted, the tier is the one it is given).
//! Same prefetch, same persistent mandatory publishes and the same many-in-flight structure as
//! the ladder, and the same shared table keys (`ladder_amqp::share_table_keys`), so the
//! difference measured is the ladder's own work.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use ladder_amqp::{Channel, Confirmation, Connection, Delivery, FieldTable, FieldValue};

use ladder::model::protocol::{header, is_stripped};

use crate::broker::{OP_TIMEOUT, bounded, confirm_channel, connect};
use crate::now_ms;

/// What the relay subcommand is told.
#[derive(Debug, Clone, clap::Args)]
pub struct RelayArgs {
    /// Broker.
    #[arg(long)]
    pub url: String,
    /// `N.L.intake`.
    #[arg(long)]
    pub intake_queue: String,
    /// `N.L.due`.
    #[arg(long)]
    pub due_queue: String,
    /// `L`, written as `retry-ladder`: `N.due` routes what expires in the shared tier by it.
    #[arg(long)]
    pub ladder: String,
    /// The tier queue (`N.delay.1s`), published to through the default exchange.
    #[arg(long)]
    pub tier_queue: String,
    /// The tier's name (`1s`), written as `retry-tier`.
    #[arg(long)]
    pub tier: String,
    /// The tier's TTL, for `retry-due-at`.
    #[arg(long)]
    pub ttl_ms: u64,
    /// Unacked deliveries per consumer (the ladder's default).
    #[arg(long, default_value_t = 200)]
    pub prefetch: u16,
}

#[derive(Clone, Copy)]
enum Hop {
    Intake,
    Due,
}

/// Runs both hops until the connection fails or the parent goes away.
///
/// Each hop is a task of its own on the multi-threaded runtime, as in the ladder's supervisor,
/// so both pay the same thread hand-offs.
pub async fn run(args: RelayArgs) -> Result<()> {
    // the client's cheapest path for the headers it reads and writes, as the ladder takes it
    // for its own (the same list; and RabbitMQ's x-death keys)
    ladder_amqp::share_table_keys(header::ALL);
    let conn = connect(&args.url, "ladder-bench-relay").await?;
    let args = Arc::new(args);
    let intake = tokio::spawn(hop_loop(conn.clone(), args.clone(), Hop::Intake));
    let due = tokio::spawn(hop_loop(conn, args, Hop::Due));
    let (a, b) = tokio::try_join!(intake, due)?;
    a.and(b)
}

async fn hop_loop(conn: Connection, args: Arc<RelayArgs>, hop: Hop) -> Result<()> {
    let args = &*args;
    let ch = confirm_channel(&conn).await?;
    bounded("basic.qos", OP_TIMEOUT, ch.basic_qos(args.prefetch)).await?;
    let queue = match hop {
        Hop::Intake => &args.intake_queue,
        Hop::Due => &args.due_queue,
    };
    let mut consumer = bounded(
        "basic.consume",
        OP_TIMEOUT,
        ch.basic_consume(queue, "", false, FieldTable::new()),
    )
    .await?;
    let mut in_flight = FuturesUnordered::new();
    loop {
        tokio::select! {
            biased;
            Some(done) = in_flight.next() => { let done: ladder_amqp::Result<()> = done; done? }
            next = consumer.next() => match next {
                Some(Ok(d)) => in_flight.push(relay_one(hop, args, ch.clone(), d)),
                Some(Err(e)) => return Err(e.into()),
                None => return Ok(()),
            },
        }
    }
}

/// What the ladder's intake writes on a failure it takes in (`model::protocol::intake`), its
/// values taken as they come: no checks. `failed_at`: when it failed (now at the intake; a first
/// wait's TTL ago at the due hop).
fn take_in(args: &RelayArgs, headers: &mut FieldTable, failed_at: u64) {
    let number = |h: &FieldTable, key| match h.get(key) {
        Some(FieldValue::LongLongInt(n)) => Some(*n),
        _ => None,
    };
    let attempt = number(headers, header::RETRY_ATTEMPT).unwrap_or(0) + 1;
    let first_failed_at = number(headers, header::RETRY_FIRST_FAILED_AT).unwrap_or(failed_at as i64);
    let entry = format!("{attempt}:{}:{failed_at}", args.tier);
    let history = match headers.get(header::RETRY_HISTORY) {
        Some(FieldValue::LongString(s)) => format!("{},{entry}", String::from_utf8_lossy(s.as_bytes())),
        _ => entry,
    };
    headers.set(header::RETRY_ATTEMPT, FieldValue::LongLongInt(attempt));
    headers.set(header::RETRY_FIRST_FAILED_AT, FieldValue::LongLongInt(first_failed_at));
    headers.set(header::RETRY_LADDER, FieldValue::string(&args.ladder));
    headers.set(header::RETRY_TIER, FieldValue::string(&args.tier));
    headers.set(
        header::RETRY_DUE_AT,
        FieldValue::LongLongInt((failed_at + args.ttl_ms) as i64),
    );
    headers.set(header::RETRY_HISTORY, FieldValue::string(&history));
}

async fn relay_one(hop: Hop, args: &RelayArgs, ch: Channel, d: Delivery) -> ladder_amqp::Result<()> {
    let mut headers = d.properties.headers.clone().unwrap_or_default();
    let (exchange, routing_key) = match hop {
        Hop::Intake => {
            take_in(args, &mut headers, now_ms());
            ("", args.tier_queue.clone())
        }
        Hop::Due => {
            let to = match headers.get(header::RETRY_TO) {
                Some(FieldValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                _ => String::new(),
            };
            // as the ladder's due hop delivers it: without what dead-lettering added, with
            // where its next failure waits (the one tier: the ladder's answer for a one-step
            // backoff)
            headers.retain(|key, _| !is_stripped(key.as_bytes()));
            headers.set(header::RETRY_NEXT, FieldValue::string(&args.tier));
            ("", to)
        }
    };
    let properties = d.properties.clone().with_headers(headers);
    let confirm = ch
        .basic_publish(exchange, &routing_key, true, &properties, &d.body)?
        .await?;
    if !matches!(confirm, Confirmation::Ack | Confirmation::Returned(_)) {
        // not expected in the benchmark; hand it back like the ladder would retry it
        tokio::time::sleep(Duration::from_millis(500)).await;
        return ch.basic_nack(d.delivery_tag, false, true);
    }
    ch.basic_ack(d.delivery_tag, false)
}
