//! The in-process retry (`ladder-bench hold`): what a consumer does without a retry system — it
//! keeps each failed delivery in memory and sleeps before trying again.
//!
//! `unacked`: the delivery stays unacked while it waits (prefetch unlimited, so it can hold many);
//! a crash hands every held message back to the queue at once, so its delay is lost.
//! `acked`: the delivery is acked and the message kept in memory; a crash loses it.
//! Prints the number of messages it holds, one line every 100 ms, for the parent to read.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Result;
use ladder_amqp::FieldTable;

use crate::broker::{OP_TIMEOUT, bounded, connect};

/// What the hold subcommand is told.
#[derive(Debug, Clone, clap::Args)]
pub struct HoldArgs {
    /// Broker.
    #[arg(long)]
    pub url: String,
    /// The consumer's queue.
    #[arg(long)]
    pub queue: String,
    /// `unacked` or `acked`.
    #[arg(long)]
    pub mode: String,
    /// How long each message waits before its retry.
    #[arg(long, default_value_t = 3_600_000)]
    pub hold_ms: u64,
}

/// Consumes and holds until killed or the parent goes away.
pub async fn run(args: HoldArgs) -> Result<()> {
    let ack_first = match args.mode.as_str() {
        "acked" => true,
        "unacked" => false,
        other => anyhow::bail!("mode {other:?} is not acked or unacked"),
    };
    let conn = connect(&args.url, "ladder-bench-hold").await?;
    let ch = bounded("open channel", OP_TIMEOUT, conn.create_channel()).await?;
    // 0 = unlimited: the in-process retry holds everything it has been given
    bounded("basic.qos", OP_TIMEOUT, ch.basic_qos(0)).await?;
    let mut consumer = bounded(
        "basic.consume",
        OP_TIMEOUT,
        ch.basic_consume(&args.queue, "", false, FieldTable::new()),
    )
    .await?;
    let held = Arc::new(AtomicU64::new(0));
    let report = held.clone();
    tokio::spawn(async move {
        loop {
            println!("{}", report.load(Ordering::Relaxed));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let hold = Duration::from_millis(args.hold_ms);
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery?;
        if ack_first {
            ch.basic_ack(delivery.delivery_tag, false)?;
        }
        held.fetch_add(1, Ordering::Relaxed);
        let held = held.clone();
        let ch = ch.clone();
        // the usual shape: one task per failed message, sleeping until its retry
        tokio::spawn(async move {
            tokio::time::sleep(hold).await;
            let _retry = &delivery.body; // the retry would process the body here
            if !ack_first {
                let _ = ch.basic_ack(delivery.delivery_tag, false);
            }
            held.fetch_sub(1, Ordering::Relaxed);
        });
    }
    Ok(())
}
