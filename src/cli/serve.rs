//! `ladder run` and `ladder apply`: the service, and declaring its topology.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use ladder::admin;
use ladder::broker::supervisor::{self as service, ApplyError, State};
use ladder::config::Config;
use ladder::telemetry::{self, Telemetry};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info, info_span, warn};

use crate::cli::{DEFAULT_CONFIG, dev_broker, probe};
use crate::exit;

/// After the service drained, how long the admin server and the poller may take to stop (open
/// HTTP requests finish, the poller closes its connection) before they are aborted.
const ADMIN_STOP_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn apply(config: &Config) -> ExitCode {
    match service::apply(config).await {
        Ok(()) => {
            info!("topology declared");
            ExitCode::SUCCESS
        }
        Err(ApplyError::Connect(e)) => {
            error!(brokers = %config.amqp.brokers(), error = %e, "cannot reach the broker");
            ExitCode::from(exit::UNAVAILABLE)
        }
        Err(ApplyError::Topology(e)) => {
            error!(error = %e, "cannot declare the topology");
            ExitCode::from(exit::CONFLICT)
        }
    }
}

/// `ladder run`: the service, after a broker answered (or the development broker started, with
/// `allow_dev_broker`; see [`dev_broker`]).
pub async fn run(config: Config, env: &HashMap<String, String>, allow_dev_broker: bool) -> ExitCode {
    let provider = match telemetry::provider_from_env(env) {
        Ok(provider) => provider,
        Err(e) => {
            eprintln!("ladder: {e}");
            return ExitCode::from(exit::CONFIG);
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
            return ExitCode::from(exit::UNAVAILABLE);
        }
    };
    // a broker that does not answer as the service starts is an error, or a development broker
    // to start; later losses are the supervisor's to ride out
    if let Err(code) = dev_broker::ensure(&config, allow_dev_broker).await {
        return code;
    }
    let shutdown = CancellationToken::new();
    let signals = tokio::spawn(wait_for_signal(shutdown.clone()));
    info!(config = %config.file.display(), namespace = %config.namespace, ladders = config.ladders.len(), "starting");
    let listener_address = listener.local_addr().unwrap_or(config.admin.bind);
    let config = Arc::new(config);
    // The admin side stops only after the service drained, so /metrics can watch the drain.
    let admin_stop = CancellationToken::new();
    let mut admin = tokio::spawn(
        admin::run(listener, config.clone(), state.clone(), admin_stop.clone()).instrument(info_span!("admin")),
    );
    let welcome = tokio::spawn(welcome(listener_address, config.clone(), state.clone()));
    let result = service::run(config, state, shutdown).await;
    welcome.abort();
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
            ExitCode::from(exit::CONFLICT)
        }
    }
}

/// How often [`welcome`] looks whether the service is ready.
const WELCOME_POLL: Duration = Duration::from_millis(100);

/// Once the service is first ready: where the admin page is, and how to send a first failure
/// by hand (`ladder demo`, spelt as this binary was started).
async fn welcome(admin: SocketAddr, config: Arc<Config>, state: Arc<State>) {
    while !state.health.is_ready() {
        tokio::time::sleep(WELCOME_POLL).await;
    }
    let mut demo = match std::env::current_exe() {
        Ok(exe) if exe.to_string_lossy().contains("/target/release/") => "cargo run --release -- demo".to_string(),
        Ok(exe) if exe.to_string_lossy().contains("/target/debug/") => "cargo run -- demo".to_string(),
        _ => "ladder demo".to_string(),
    };
    if config.file != Path::new(DEFAULT_CONFIG) {
        demo = format!("{demo} --config {}", config.file.display());
    }
    info!(
        "admin page: http://{}/ (health /ready, metrics /metrics); send a first failure by hand: {demo}",
        probe::reachable(admin)
    );
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
