//! The `ladder` command: parse the command line, set up logging, call the library, and map
//! the outcome to an exit code.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ladder::admin;
use ladder::config::{self, Config};
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
    }
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
