//! The `ladder` command: parse the command line, set up logging, call the library, and map
//! the outcome to an exit code.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use ladder::admin;
use ladder::config::{self, Config};
use ladder::parking::{self, ParkingLot};
use ladder::service::{self, ApplyError, State};
use ladder::telemetry::{self, Telemetry};
use ladder::topology;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info, info_span, warn};

/// Invalid config (sysexits EX_USAGE): nothing touched the broker. (clap exits 2 on bad arguments.)
const EXIT_CONFIG: u8 = 64;
/// The broker could not be reached, or `run` cannot listen on `admin.bind` (the port is taken
/// or not ours to use): a resource the service needs is unavailable (EX_UNAVAILABLE). Exiting
/// beats running without health checks an orchestrator would then fail anyway.
const EXIT_UNAVAILABLE: u8 = 69;
/// `ladder parked`: an entry failed, or the request could not be served (no such entry or ladder).
const EXIT_FAILED: u8 = 1;
/// `ladder parked replay|discard`: another one runs on the same ladder (EX_TEMPFAIL).
const EXIT_BUSY: u8 = 75;
/// The broker holds objects that contradict the config (EX_CONFIG).
const EXIT_CONFLICT: u8 = 78;

/// After the service drained, how long the admin server and the poller may take to stop (open
/// HTTP requests finish, the poller closes its connection) before they are aborted.
const ADMIN_STOP_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Parser)]
#[command(
    name = "ladder",
    version,
    about = "Delayed retries with stepped backoff and a parking lot for RabbitMQ"
)]
struct Cli {
    /// The service config file; ladder files are read from its `ladders_dir`.
    #[arg(long, short, global = true, default_value = "ladder.toml")]
    config: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Declare the topology, then serve until SIGTERM/SIGINT.
    Run,
    /// Validate the config and the ladders; exit 64 on the first problem.
    Check,
    /// Print every exchange, queue, binding and argument that would be declared.
    Plan,
    /// Declare the topology and exit.
    Apply,
    /// Inspect, search, replay and discard parked messages.
    Parked(Box<ParkedArgs>),
}

#[derive(clap::Args)]
struct ParkedArgs {
    /// The ladder whose parking lot to use (needed when the config has more than one).
    #[arg(long, global = true)]
    ladder: Option<String>,
    #[command(subcommand)]
    command: ParkedCommand,
}

#[derive(Subcommand)]
enum ParkedCommand {
    /// List parked messages, newest first (unresolved only, unless --all).
    List {
        #[command(flatten)]
        filter: FilterArgs,
        /// Entries to print.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Newest matches to skip (paging).
        #[arg(long, default_value_t = 0)]
        offset: usize,
        /// Include replayed and discarded entries, with their resolution.
        #[arg(long)]
        all: bool,
        /// Print JSON (`{"total", "entries"}`) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Count parked messages matching the filters, in all, per reason and per destination.
    Counts {
        #[command(flatten)]
        filter: FilterArgs,
        /// Count replayed and discarded entries too.
        #[arg(long)]
        all: bool,
        /// Print JSON (`{"total", "by_destination", "by_reason"}`) instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Print one entry in full: body, properties, headers, reason, attempts and times.
    Show {
        /// The entry's stream offset (first column of `list`).
        offset: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Republish entries (by offset, or all unresolved ones matching the filters) to their queue.
    Replay {
        /// Stream offsets of the entries.
        offsets: Vec<u64>,
        #[command(flatten)]
        filter: FilterArgs,
        /// Replay to this queue instead (it must pass the ladder's allow-list).
        #[arg(long)]
        to: Option<String>,
        /// At most this many per second or minute: `50/s`, `100/m`.
        #[arg(long)]
        rate: Option<String>,
        /// Only print what would be replayed.
        #[arg(long)]
        dry_run: bool,
        /// Who asks, for the record and the log (default: $USER).
        #[arg(long)]
        by: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Mark entries (by offset, or all unresolved ones matching the filters) as discarded.
    Discard {
        /// Stream offsets of the entries.
        offsets: Vec<u64>,
        #[command(flatten)]
        filter: FilterArgs,
        /// Do not ask for confirmation (required when stdin is not a terminal).
        #[arg(long)]
        yes: bool,
        /// Who asks, for the record and the log (default: $USER).
        #[arg(long)]
        by: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
struct FilterArgs {
    /// The queue it was headed for.
    #[arg(long)]
    destination: Option<String>,
    /// The reason code (`max-attempts`, `no-route`, ...).
    #[arg(long)]
    reason: Option<String>,
    /// Parked at or after: a duration ago (`2h`) or an RFC 3339 time.
    #[arg(long)]
    since: Option<String>,
    /// Parked at or before: a duration ago (`10m`) or an RFC 3339 time.
    #[arg(long)]
    until: Option<String>,
    /// The original message id.
    #[arg(long)]
    message_id: Option<String>,
    /// The original correlation id.
    #[arg(long)]
    correlation_id: Option<String>,
    /// An original header's text value, `key=value` (repeatable; all must match).
    #[arg(long = "header", value_name = "KEY=VALUE")]
    headers: Vec<String>,
    /// A substring of the (text) body.
    #[arg(long)]
    body_contains: Option<String>,
}

impl FilterArgs {
    fn build(self, offsets: &[u64]) -> Result<parking::Filter, parking::ParkingError> {
        let now = ladder::relay::now_ms();
        Ok(parking::Filter {
            offsets: (!offsets.is_empty()).then(|| offsets.iter().copied().collect()),
            ladder: None,
            destination: self.destination,
            reason: self.reason,
            since_ms: self.since.map(|t| parking::parse_time_bound(&t, now)).transpose()?,
            until_ms: self.until.map(|t| parking::parse_time_bound(&t, now)).transpose()?,
            message_id: self.message_id,
            correlation_id: self.correlation_id,
            headers: self
                .headers
                .iter()
                .map(|h| parking::parse_header_filter(h))
                .collect::<Result<_, _>>()?,
            body_contains: self.body_contains,
        })
    }
}

fn main() -> ExitCode {
    // lapin's I/O thread takes the default stack size, which std reads from RUST_MIN_STACK when
    // it spawns its first thread; a deeply nested header must not overflow that thread.
    if std::env::var_os("RUST_MIN_STACK").is_none() {
        // SAFETY: nothing has spawned a thread yet, so nothing reads the environment concurrently.
        unsafe { std::env::set_var("RUST_MIN_STACK", ladder::DEEP_STACK_BYTES.to_string()) };
    }
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        // lapin logs its own view of every connection failure; ours already carries the error
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,lapin=off".into()),
        )
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();

    let env: HashMap<String, String> = std::env::vars().collect();
    let config = match config::load(&cli.config, &env) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("ladder: invalid config: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    match cli.command {
        Command::Check => {
            println!("{}: ok ({} ladders)", config.file.display(), config.ladders.len());
            for ladder in &config.ladders {
                let tiers: Vec<_> = ladder.tiers.iter().map(|t| t.name.as_str()).collect();
                println!(
                    "  {}: tiers [{}], max_attempts {}, {} {}",
                    ladder.name,
                    tiers.join(", "),
                    ladder.max_attempts,
                    ladder.queue_type.as_str(),
                    ladder.dead_letter_strategy.as_str()
                );
            }
            ExitCode::SUCCESS
        }
        Command::Plan => {
            for declaration in topology::plan(&config) {
                println!("{declaration}");
            }
            ExitCode::SUCCESS
        }
        Command::Apply => runtime().block_on(apply(&config)),
        Command::Run => runtime().block_on(run(config, &env)),
        Command::Parked(args) => match runtime().block_on(parked(&config, *args, &env)) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("ladder: {e:#}");
                ExitCode::from(match e.downcast_ref::<parking::ParkingError>() {
                    Some(parking::ParkingError::Broker(_) | parking::ParkingError::Timeout { .. }) => EXIT_UNAVAILABLE,
                    Some(parking::ParkingError::Invalid(_)) => EXIT_CONFIG,
                    Some(parking::ParkingError::Busy(_)) => EXIT_BUSY,
                    _ => EXIT_FAILED,
                })
            }
        },
    }
}

/// `ladder parked …`: resolve the ladder, connect, call the library, print.
async fn parked(config: &Config, args: ParkedArgs, env: &HashMap<String, String>) -> anyhow::Result<ExitCode> {
    let spec = match (&args.ladder, config.ladders.as_slice()) {
        (Some(name), ladders) => ladders
            .iter()
            .find(|l| &l.name == name)
            .with_context(|| format!("no ladder {name:?} in {}", config.file.display()))?,
        (None, [only]) => only,
        (None, _) => anyhow::bail!("the config has several ladders; choose one with --ladder"),
    };
    let connection = service::connect(&config.amqp)
        .await
        .map_err(parking::ParkingError::from)
        .with_context(|| format!("cannot reach the broker at {}", config.amqp.url))?;
    let lot = ParkingLot::new(&connection, &config.namespace, spec);
    let by = |by: Option<String>| {
        by.or_else(|| env.get("USER").cloned())
            .unwrap_or_else(|| "unknown".into())
    };
    let code = match args.command {
        ParkedCommand::List {
            filter,
            limit,
            offset,
            all,
            json,
        } => {
            let filter = filter.build(&[])?;
            let index = lot.index_for(&filter).await?;
            let page = lot
                .list(&index, &filter, parking::PageRequest { offset, limit }, all)
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&page)?);
            } else {
                print!("{}", parking::render_table(&page.entries));
                println!(
                    "{} of {} {} in {}",
                    page.entries.len(),
                    page.total,
                    if all { "entries" } else { "unresolved entries" },
                    lot.stream()
                );
            }
            ExitCode::SUCCESS
        }
        ParkedCommand::Counts { filter, all, json } => {
            let filter = filter.build(&[])?;
            let index = lot.index_for(&filter).await?;
            let counts = lot.counts(&index, &filter, all).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&counts)?);
            } else {
                print!("{}", parking::render_counts(&counts));
                println!(
                    "{} {} in {}",
                    counts.total,
                    if all { "entries" } else { "unresolved entries" },
                    lot.stream()
                );
            }
            ExitCode::SUCCESS
        }
        ParkedCommand::Show { offset, json } => {
            let filter = parking::Filter {
                offsets: Some([offset].into()),
                ..parking::Filter::default()
            };
            let entry = lot.show(&lot.index_for(&filter).await?, offset).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&entry)?);
            } else {
                print!("{}", parking::render_entry(lot.stream(), &entry));
            }
            ExitCode::SUCCESS
        }
        ParkedCommand::Replay {
            offsets,
            filter,
            to,
            rate,
            dry_run,
            by: who,
            json,
        } => {
            let filter = filter.build(&offsets)?;
            anyhow::ensure!(!filter.is_empty(), "give offsets or at least one filter");
            let options = parking::ReplayOptions {
                to,
                rate: rate.map(|r| r.parse()).transpose()?,
                dry_run,
                by: by(who),
            };
            let lock = lot.lock().await?;
            let marker = lot.mark(&options.by).await?;
            let index = lot.index_through(&filter, &marker).await?;
            let selection = lot.select(&index, &filter).await?;
            info!(ladder = %spec.name, by = %options.by, entries = selection.entries.len(), dry_run, "replay requested");
            let outcomes = lot.replay(&index, &selection.entries, &options).await?;
            lock.release().await;
            report(&outcomes, selection.left_over, json)?
        }
        ParkedCommand::Discard {
            offsets,
            filter,
            yes,
            by: who,
            json,
        } => {
            let filter = filter.build(&offsets)?;
            anyhow::ensure!(!filter.is_empty(), "give offsets or at least one filter");
            let who = by(who);
            let lock = lot.lock().await?;
            let marker = lot.mark(&who).await?;
            let index = lot.index_through(&filter, &marker).await?;
            let selection = lot.select(&index, &filter).await?;
            if !yes && !selection.entries.is_empty() {
                if !std::io::stdin().is_terminal() {
                    eprintln!(
                        "ladder: refusing to discard {} entries without --yes (stdin is not a terminal)",
                        selection.entries.len()
                    );
                    lock.release().await;
                    return Ok(ExitCode::from(EXIT_CONFIG));
                }
                print!("{}", parking::render_table(&selection.entries));
                print!("discard these {} entries? [y/N] ", selection.entries.len());
                std::io::Write::flush(&mut std::io::stdout())?;
                let mut answer = String::new();
                std::io::stdin().read_line(&mut answer)?;
                if !matches!(answer.trim(), "y" | "Y" | "yes") {
                    println!("nothing discarded");
                    lock.release().await;
                    return Ok(ExitCode::SUCCESS);
                }
            }
            info!(ladder = %spec.name, by = %who, entries = selection.entries.len(), "discard requested");
            let outcomes = lot.discard(&index, &selection.entries, &who).await?;
            lock.release().await;
            report(&outcomes, selection.left_over, json)?
        }
    };
    let _ = tokio::time::timeout(parking::BROKER_TIMEOUT, connection.close(200, "done".into())).await;
    Ok(code)
}

/// Prints the outcomes of a replay or discard; exit 1 ([`EXIT_FAILED`]) if any entry failed.
fn report(outcomes: &[parking::Outcome], left_over: u64, json: bool) -> anyhow::Result<ExitCode> {
    let failed = outcomes
        .iter()
        .filter(|o| matches!(o.status, parking::Status::Failed { .. }))
        .count();
    if json {
        let out = serde_json::json!({ "outcomes": outcomes, "failed": failed, "left_over": left_over });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        for o in outcomes {
            let to = o.to.as_deref().unwrap_or("-");
            match &o.status {
                parking::Status::Replayed => println!("{}\treplayed to {to}", o.offset),
                parking::Status::WouldReplay => println!("{}\twould replay to {to}", o.offset),
                parking::Status::Discarded => println!("{}\tdiscarded", o.offset),
                parking::Status::Failed { error } => println!("{}\tfailed: {error}", o.offset),
            }
        }
        println!("{} entries, {failed} failed", outcomes.len());
        if left_over > 0 {
            println!("{left_over} more match; run again to continue");
        }
    }
    Ok(if failed > 0 {
        ExitCode::from(EXIT_FAILED)
    } else {
        ExitCode::SUCCESS
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(ladder::DEEP_STACK_BYTES)
        .build()
        .expect("the tokio runtime starts")
}

async fn apply(config: &Config) -> ExitCode {
    match service::apply(config).await {
        Ok(()) => {
            info!(declarations = topology::plan(config).len(), "topology declared");
            ExitCode::SUCCESS
        }
        Err(ApplyError::Connect(e)) => {
            error!(url = %config.amqp.url, error = %e, "cannot reach the broker");
            ExitCode::from(EXIT_UNAVAILABLE)
        }
        Err(ApplyError::Topology(e)) => {
            error!(error = %e, "cannot declare the topology");
            ExitCode::from(EXIT_CONFLICT)
        }
    }
}

async fn run(config: Config, env: &HashMap<String, String>) -> ExitCode {
    let provider = match telemetry::provider_from_env(env) {
        Ok(provider) => provider,
        Err(e) => {
            eprintln!("ladder: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let state = Arc::new(State {
        telemetry: provider.as_ref().map_or_else(Telemetry::disabled, Telemetry::new),
        ..State::default()
    });
    info!(tracing = state.telemetry.enabled(), "telemetry");
    let listener = match TcpListener::bind(config.admin.bind).await {
        Ok(listener) => listener,
        Err(e) => {
            error!(bind = %config.admin.bind, error = %e, "cannot listen for the admin server (admin.bind)");
            return ExitCode::from(EXIT_UNAVAILABLE);
        }
    };
    let shutdown = CancellationToken::new();
    let signals = tokio::spawn(wait_for_signal(shutdown.clone()));
    info!(config = %config.file.display(), namespace = %config.namespace, ladders = config.ladders.len(), "starting");
    let config = Arc::new(config);
    // The admin side stops only after the service drained, so /metrics can watch the drain.
    let admin_stop = CancellationToken::new();
    let mut admin = tokio::spawn(
        admin::run(listener, config.clone(), state.clone(), admin_stop.clone()).instrument(info_span!("admin")),
    );
    let result = service::run(config, state, shutdown).await;
    signals.abort();
    admin_stop.cancel();
    if tokio::time::timeout(ADMIN_STOP_TIMEOUT, &mut admin).await.is_err() {
        warn!(timeout = ?ADMIN_STOP_TIMEOUT, "the admin server did not stop in time; aborting it");
        admin.abort();
    }
    if let Some(provider) = provider {
        // flush what the batch processor still holds
        if let Err(e) = provider.shutdown() {
            error!(error = %e, "cannot flush traces");
        }
    }
    match result {
        Ok(()) => {
            info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            error!(error = %e, "stopped");
            ExitCode::from(EXIT_CONFLICT)
        }
    }
}

/// Cancels `shutdown` on the first SIGTERM or SIGINT.
async fn wait_for_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        error!("cannot listen for signals; stop the service with SIGKILL");
        return;
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: draining"),
        _ = int.recv() => info!("SIGINT: draining"),
    }
    shutdown.cancel();
}
