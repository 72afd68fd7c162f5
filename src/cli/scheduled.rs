//! `ladder scheduled`: what a ladder holds for later. `cancel` records a cancellation in the
//! ladder's stream `N.L.cancels` on a connection of its own (no service needed): every replica
//! parks a message with that id as `cancelled` instead of delivering it.

use std::process::ExitCode;

use clap::{Args, Subcommand};
use ladder::broker;
use ladder::broker::lot::ParkingError;
use ladder::config::Config;
use ladder::model::lot::text::printable;
use ladder::model::names::Names;

#[derive(Args)]
pub struct ScheduledArgs {
    /// The ladder (needed when the config has several).
    #[arg(long, global = true)]
    pub ladder: Option<String>,
    #[command(subcommand)]
    pub command: ScheduledCommand,
}

#[derive(Subcommand)]
pub enum ScheduledCommand {
    /// Cancel a scheduled delivery (or a waiting retry) by its message id before it is due: it is
    /// parked as `cancelled` instead of delivered, by every replica.
    Cancel {
        /// The message's `message_id` property.
        message_id: String,
        /// Who asks, for the record and the parked entry (default: $USER).
        #[arg(long)]
        by: Option<String>,
    },
}

pub async fn scheduled(config: &Config, args: ScheduledArgs) -> anyhow::Result<ExitCode> {
    let spec = super::choose_ladder(config, args.ladder.as_deref())?;
    let ScheduledCommand::Cancel { message_id, by } = args.command;
    if !spec.exact_delays {
        return Err(ParkingError::Invalid(format!(
            "ladder {} has exact_delays = false: it schedules nothing to cancel",
            spec.name
        ))
        .into());
    }
    let by = by
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "cli".into());
    let names = Names::of(&config.namespace, spec);
    let connection = broker::connect::connect(&config.amqp)
        .await
        .map_err(ParkingError::from)?;
    let cancelled = broker::cancels::cancel(&connection, &names, &message_id, &format!("cli:{by}")).await;
    let _ = tokio::time::timeout(broker::cancels::BROKER_TIMEOUT, connection.close(200, "done")).await;
    let record = cancelled.map_err(ParkingError::from)?;
    println!(
        "cancelled {} in ladder {}: parked as `cancelled` instead of delivered (recorded in {}, holds until {})",
        printable(&record.message_id),
        spec.name,
        names.cancels,
        humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(record.until_ms)),
    );
    Ok(ExitCode::SUCCESS)
}
