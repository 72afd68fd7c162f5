//! `ladder prune`, and the drift `ladder check` and `ladder plan` show when a broker answers:
//! what the namespace declared before that the config no longer uses (retired tiers, retired
//! ladders), and what the broker holds with other arguments.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use ladder::broker::connect as supervisor;
use ladder::broker::drift::{self, Pruned, Survey};
use ladder::config::Config;
use ladder::model::drift::PruneStep;
use ladder::model::lot::text::printable;

#[derive(Args)]
pub struct PruneArgs {
    /// Show what would be deleted and what kept, and why; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Wait up to this long (`10m`, `2h`) for retired queues that still hold messages to drain,
    /// then delete them; without it, they are kept and the command exits 75.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub wait: Option<Duration>,
    /// Also delete a retired ladder's parking lot (`N.L.parked`) with every entry in it.
    #[arg(long)]
    pub with_parking_lot: bool,
}

/// How long `check` and `plan` wait for a broker before they leave drift out.
const LOOK_TIMEOUT: Duration = Duration::from_secs(5);

/// How often `prune --wait` looks again.
const WAIT_POLL: Duration = Duration::from_secs(1);

/// Exit code when something retired is kept because it still holds messages or is read
/// (EX_TEMPFAIL: try again once it drained).
const KEPT: u8 = 75;

/// The drift of the namespace as the broker shows it, for `check` and `plan`: `None` when no
/// broker answered within [`LOOK_TIMEOUT`] (said in the text).
pub async fn look(config: &Config) -> Result<Survey, String> {
    let looked = tokio::time::timeout(LOOK_TIMEOUT, async {
        let connection = supervisor::connect(&config.amqp).await.map_err(|e| e.to_string())?;
        let survey = drift::survey(&connection, config).await.map_err(|e| e.to_string());
        let _ = tokio::time::timeout(Duration::from_secs(2), connection.close(200, "looked")).await;
        survey
    })
    .await;
    match looked {
        Ok(result) => result,
        Err(_) => Err(format!("no answer within {}", humantime::format_duration(LOOK_TIMEOUT))),
    }
}

/// The lines that show `survey` (or why there is none).
pub fn describe(config: &Config, survey: &Result<Survey, String>) -> Vec<String> {
    let brokers = config.amqp.brokers();
    let survey = match survey {
        Ok(survey) => survey,
        Err(e) => {
            return vec![format!(
                "broker {brokers}: {e}; retired and differing objects not shown"
            )];
        }
    };
    let mut lines = vec![format!(
        "broker {brokers}: {} retired, {} differing from the config",
        survey.retired.len(),
        survey.differing.len()
    )];
    for r in &survey.retired {
        lines.push(format!("  retired {}", printable(&drift::describe(r))));
    }
    for d in &survey.differing {
        lines.push(format!(
            "  differs {} {}: {}",
            d.kind.as_str(),
            printable(&d.name),
            printable(&d.detail)
        ));
    }
    if !survey.retired.is_empty() {
        lines.push("  `ladder prune --dry-run` shows what `ladder prune` would remove".into());
    }
    lines
}

/// `ladder prune`.
pub async fn prune(config: &Config, args: PruneArgs) -> anyhow::Result<ExitCode> {
    let connection = supervisor::connect(&config.amqp)
        .await
        .map_err(ladder::broker::lot::ParkingError::from)?;
    let result = run(&connection, config, &args).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), connection.close(200, "pruned")).await;
    result
}

async fn run(connection: &ladder_amqp::Connection, config: &Config, args: &PruneArgs) -> anyhow::Result<ExitCode> {
    if args.dry_run {
        let version = ladder::broker::topology::version_of(connection);
        let registry = drift::read(connection, &config.namespace).await?;
        let retired = drift::retired_now(connection, config, version, &registry).await?;
        let steps = ladder::model::drift::prune_plan(&retired, args.with_parking_lot);
        if steps.is_empty() {
            println!("nothing retired in namespace {}", config.namespace);
        }
        for step in &steps {
            match step {
                PruneStep::Delete(r) => println!("would delete {} {}", r.kind.as_str(), printable(&r.name)),
                PruneStep::Keep(r, why) => println!(
                    "would keep   {} {}: {}",
                    r.kind.as_str(),
                    printable(&r.name),
                    printable(why)
                ),
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let deadline = args.wait.map(|wait| Instant::now() + wait);
    let mut deleted = 0;
    loop {
        let outcome = drift::prune(connection, config, args.with_parking_lot).await?;
        let mut waiting = Vec::new();
        let mut parking_lots = 0;
        for pruned in &outcome {
            match pruned {
                Pruned::Deleted(r) => {
                    deleted += 1;
                    println!("deleted {} {}", r.kind.as_str(), printable(&r.name));
                }
                Pruned::Kept(r, why) if r.stream && r.role == "parked" => {
                    parking_lots += 1;
                    println!("kept    {} {}: {}", r.kind.as_str(), printable(&r.name), printable(why));
                }
                Pruned::Kept(r, why) => waiting.push(format!(
                    "{} {}: {}",
                    r.kind.as_str(),
                    printable(&r.name),
                    printable(why)
                )),
            }
        }
        if waiting.is_empty() {
            println!(
                "pruned namespace {}: {deleted} deleted{}",
                config.namespace,
                if parking_lots > 0 {
                    format!(", {parking_lots} parking lot(s) kept")
                } else {
                    String::new()
                }
            );
            return Ok(ExitCode::SUCCESS);
        }
        match deadline {
            Some(deadline) if Instant::now() + WAIT_POLL < deadline => {
                tokio::time::sleep(WAIT_POLL).await;
            }
            _ => {
                for line in &waiting {
                    println!("kept    {line}");
                }
                eprintln!(
                    "ladder: {} retired object(s) kept: they still hold messages or are read{}",
                    waiting.len(),
                    if args.wait.is_some() {
                        " after the wait"
                    } else {
                        " (--wait DURATION waits for them to drain)"
                    }
                );
                return Ok(ExitCode::from(KEPT));
            }
        }
    }
}
