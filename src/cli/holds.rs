//! `ladder hold`, `ladder resume` and `ladder holds`: destination holds, recorded in the
//! ladder's stream `N.L.holds` on a connection of their own (no service needed); every replica
//! follows the stream. A destination that is not allowed or does not exist is refused (64).

use std::process::ExitCode;
use std::time::{Duration, UNIX_EPOCH};

use clap::Args;
use ladder::broker;
use ladder::broker::holds::HoldError;
use ladder::broker::lot::ParkingError;
use ladder::config::Config;
use ladder::model::holds::HoldState;
use ladder::model::lot::pace::Rate;
use ladder::model::lot::text::printable;
use ladder::model::names::Names;

#[derive(Args)]
pub struct HoldArgs {
    /// The destination queue to hold.
    pub queue: String,
    /// Why, for the record.
    #[arg(long, default_value = "")]
    pub why: String,
    /// Who asks, for the record (default: $USER).
    #[arg(long)]
    pub by: Option<String>,
    /// The ladder (needed when the config has several).
    #[arg(long)]
    pub ladder: Option<String>,
}

#[derive(Args)]
pub struct ResumeArgs {
    /// The held destination queue.
    pub queue: String,
    /// How fast to release what was held: `N/s`, `N/m` or `N/h` (default: the ladder's
    /// `release_rate`, 10/s unless configured).
    #[arg(long)]
    pub rate: Option<String>,
    /// Who asks, for the record (default: $USER).
    #[arg(long)]
    pub by: Option<String>,
    /// The ladder (needed when the config has several).
    #[arg(long)]
    pub ladder: Option<String>,
}

#[derive(Args)]
pub struct HoldsArgs {
    /// The ladder (needed when the config has several).
    #[arg(long)]
    pub ladder: Option<String>,
}

fn who(by: Option<String>) -> String {
    format!(
        "cli:{}",
        by.or_else(|| std::env::var("USER").ok())
            .unwrap_or_else(|| "cli".into())
    )
}

fn time(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

pub async fn hold(config: &Config, args: HoldArgs) -> anyhow::Result<ExitCode> {
    let spec = super::choose_ladder(config, args.ladder.as_deref())?;
    let names = Names::of(&config.namespace, spec);
    let connection = broker::connect::connect(&config.amqp)
        .await
        .map_err(ParkingError::from)?;
    let held = broker::holds::hold(&connection, &names, spec, &args.queue, &who(args.by), &args.why).await;
    let _ = tokio::time::timeout(broker::cancels::BROKER_TIMEOUT, connection.close(200, "done")).await;
    let record = held.map_err(ParkingError::from)?;
    println!(
        "held {} in ladder {}: its due messages wait in {} until `ladder resume` (recorded in {})",
        printable(&record.destination),
        spec.name,
        names.held_queue(&record.destination),
        names.holds
    );
    Ok(ExitCode::SUCCESS)
}

pub async fn resume(config: &Config, args: ResumeArgs) -> anyhow::Result<ExitCode> {
    let spec = super::choose_ladder(config, args.ladder.as_deref())?;
    let rate = args
        .rate
        .as_deref()
        .map(|r| r.parse::<Rate>().map_err(|e| ParkingError::Invalid(e.0)))
        .transpose()?;
    let names = Names::of(&config.namespace, spec);
    let connection = broker::connect::connect(&config.amqp)
        .await
        .map_err(ParkingError::from)?;
    let resumed = async {
        let holds = broker::holds::snapshot(&connection, &names, spec).await?;
        if !holds.get(&args.queue).is_some_and(|h| h.state == HoldState::Held) {
            return Err(HoldError::NotHeld(args.queue.clone()));
        }
        broker::holds::resume(&connection, &names, spec, &args.queue, &who(args.by), rate).await
    }
    .await;
    let _ = tokio::time::timeout(broker::cancels::BROKER_TIMEOUT, connection.close(200, "done")).await;
    let record = resumed.map_err(ParkingError::from)?;
    println!(
        "resumed {} in ladder {}: what was held is released at {}, oldest first",
        printable(&record.destination),
        spec.name,
        record.rate.as_deref().unwrap_or("-")
    );
    Ok(ExitCode::SUCCESS)
}

pub async fn holds(config: &Config, args: HoldsArgs) -> anyhow::Result<ExitCode> {
    let spec = super::choose_ladder(config, args.ladder.as_deref())?;
    let names = Names::of(&config.namespace, spec);
    let connection = broker::connect::connect(&config.amqp)
        .await
        .map_err(ParkingError::from)?;
    let read = broker::holds::snapshot(&connection, &names, spec).await;
    let _ = tokio::time::timeout(broker::cancels::BROKER_TIMEOUT, connection.close(200, "done")).await;
    let holds = read.map_err(ParkingError::from)?;
    let held: Vec<_> = holds.all().filter(|h| h.holds_back()).collect();
    if held.is_empty() {
        println!("no destination is held in ladder {}", spec.name);
        return Ok(ExitCode::SUCCESS);
    }
    println!("{:<10} {:<32} {:<24} {:<16} why", "state", "destination", "since", "by");
    for h in held {
        let state = match h.state {
            HoldState::Releasing { rate, .. } => format!("releasing {}", broker::holds::format_rate(rate)),
            _ => h.state_code().to_string(),
        };
        println!(
            "{:<10} {:<32} {:<24} {:<16} {}",
            state,
            printable(&h.destination),
            time(h.held_since_ms),
            printable(&h.by),
            printable(&h.why)
        );
    }
    Ok(ExitCode::SUCCESS)
}
