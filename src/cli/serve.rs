//! `ladder run` and `ladder apply`: the service, and declaring its topology.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use ladder::admin;
use ladder::broker::declare::{self as declaring, ApplyError};
use ladder::broker::state::State;
use ladder::broker::supervisor as service;
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
    match declaring::apply(config).await {
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
/// `allow_dev_broker`; see [`dev_broker`]). SIGHUP reloads the config and the ladder files
/// ([`reload`]); SIGTERM and SIGINT drain and stop.
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
    // kept as a std listener: each admin server after a reload serves a clone of it, so the
    // port stays bound (connections wait in its backlog) while one stops and the next starts
    let Some(listener) = listen(config.admin.bind) else {
        return ExitCode::from(exit::UNAVAILABLE);
    };
    // a broker that does not answer as the service starts is an error, or a development broker
    // to start; later losses are the supervisor's to ride out
    if let Err(code) = dev_broker::ensure(&config, allow_dev_broker).await {
        return code;
    }
    let (signal_tx, mut signals) = tokio::sync::mpsc::channel(8);
    let signal_task = tokio::spawn(forward_signals(signal_tx));
    info!(config = %config.file.display(), namespace = %config.namespace, ladders = config.ladders.len(), "starting");
    let listener_address = listener.local_addr().unwrap_or(config.admin.bind);
    let mut fingerprint = files_fingerprint(&config);
    let mut config = Arc::new(config);
    let result = loop {
        let shutdown = CancellationToken::new();
        // The admin side stops only after the service drained, so /metrics can watch the drain.
        let admin_stop = CancellationToken::new();
        let admin_listener = match listener.try_clone().and_then(TcpListener::from_std) {
            Ok(l) => l,
            Err(e) => {
                error!(error = %e, "cannot serve the admin listener");
                return ExitCode::from(exit::UNAVAILABLE);
            }
        };
        let mut admin = tokio::spawn(
            admin::run(admin_listener, config.clone(), state.clone(), admin_stop.clone())
                .instrument(info_span!("admin")),
        );
        let welcome = tokio::spawn(welcome(listener_address, config.clone(), state.clone()));
        let mut service = tokio::spawn(service::run(config.clone(), state.clone(), shutdown.clone()));
        let next = serve_until_next(
            &mut service,
            &mut signals,
            &config,
            env,
            &mut fingerprint,
            &shutdown,
            &state,
        )
        .await;
        welcome.abort();
        admin_stop.cancel();
        if tokio::time::timeout(ADMIN_STOP_TIMEOUT, &mut admin).await.is_err() {
            warn!(timeout = ?ADMIN_STOP_TIMEOUT, "the admin server did not stop in time; aborting it");
            admin.abort();
        }
        match next {
            Next::Reload(new) => {
                if new.admin.bind != config.admin.bind {
                    warn!(bind = %config.admin.bind, new = %new.admin.bind, "admin.bind changes on a restart only; the admin server stays where it is");
                }
                config = Arc::new(*new);
            }
            Next::Ended(Ok(result)) => break result,
            Next::Ended(Err(e)) => {
                error!(error = %e, "the service task failed");
                break Ok(());
            }
        }
    };
    signal_task.abort();
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

/// Serves until the service ends, a stop signal drains it, or a reload with a new config
/// drained it.
async fn serve_until_next(
    service: &mut tokio::task::JoinHandle<Result<(), service::ServiceError>>,
    signals: &mut tokio::sync::mpsc::Receiver<Signal>,
    config: &Config,
    env: &HashMap<String, String>,
    fingerprint: &mut u64,
    shutdown: &CancellationToken,
    state: &State,
) -> Next {
    loop {
        tokio::select! {
            ended = &mut *service => return Next::Ended(ended),
            signal = signals.recv() => match signal {
                Some(Signal::Stop(name)) => {
                    info!("{name}: draining");
                    shutdown.cancel();
                    return Next::Ended((&mut *service).await);
                }
                // the signal task ended (it cannot listen): serve until the service ends
                None => return Next::Ended((&mut *service).await),
                Some(Signal::Reload) => match reload(config, env, *fingerprint) {
                    Reloaded::Invalid(e) => {
                        state.metrics.reloaded("invalid");
                        error!(error = %e, "SIGHUP: the new config is invalid; serving on with the running one");
                    }
                    Reloaded::Unchanged => {
                        state.metrics.reloaded("unchanged");
                        info!("SIGHUP: the config and ladder files are unchanged");
                    }
                    Reloaded::New(new, print) => {
                        info!(ladders = new.ladders.len(), "SIGHUP: a new config; draining the running one, then serving the new one");
                        shutdown.cancel();
                        match (&mut *service).await {
                            Ok(Ok(())) => {
                                state.metrics.reloaded("applied");
                                *fingerprint = print;
                                return Next::Reload(new);
                            }
                            other => return Next::Ended(other),
                        }
                    }
                },
            },
        }
    }
}

/// The admin server's listener on `bind`, non-blocking; `None` (logged) when it cannot bind.
fn listen(bind: std::net::SocketAddr) -> Option<std::net::TcpListener> {
    let bound = std::net::TcpListener::bind(bind).and_then(|l| {
        l.set_nonblocking(true)?;
        Ok(l)
    });
    match bound {
        Ok(listener) => Some(listener),
        Err(e) => {
            error!(%bind, error = %e, "cannot listen for the admin server (admin.bind)");
            None
        }
    }
}

/// What ended one config's serving.
enum Next {
    /// The service ended (drained on a signal, or a fault reconnecting cannot fix).
    Ended(Result<Result<(), service::ServiceError>, tokio::task::JoinError>),
    /// It drained for this new config.
    Reload(Box<Config>),
}

/// What a SIGHUP found.
enum Reloaded {
    /// The files load into a valid config that differs: serve it (with its files' fingerprint).
    New(Box<Config>, u64),
    /// The files are as they were.
    Unchanged,
    /// The files do not load; the running config stays.
    Invalid(String),
}

/// Reads the config file `running` came from (with the same environment) and its ladder files
/// again.
fn reload(running: &Config, env: &HashMap<String, String>, fingerprint: u64) -> Reloaded {
    match ladder::config::load(&running.file, env) {
        Err(e) => Reloaded::Invalid(e.to_string()),
        Ok(new) => {
            let print = files_fingerprint(&new);
            if print == fingerprint {
                Reloaded::Unchanged
            } else {
                Reloaded::New(Box::new(new), print)
            }
        }
    }
}

/// A hash of the config file's and every ladder file's bytes: a reload with nothing changed
/// restarts nothing.
fn files_fingerprint(config: &Config) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    std::fs::read(&config.file).unwrap_or_default().hash(&mut hasher);
    let mut files: Vec<_> = std::fs::read_dir(&config.ladders_dir)
        .map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.retain(|path: &std::path::PathBuf| path.extension().is_some_and(|ext| ext == "toml"));
    files.sort();
    for file in files {
        file.hash(&mut hasher);
        std::fs::read(&file).unwrap_or_default().hash(&mut hasher);
    }
    hasher.finish()
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

/// A signal the service acts on.
enum Signal {
    /// SIGTERM or SIGINT: drain and stop.
    Stop(&'static str),
    /// SIGHUP: reload.
    Reload,
}

/// Sends every SIGTERM, SIGINT and SIGHUP to `signals`.
async fn forward_signals(signals: tokio::sync::mpsc::Sender<Signal>) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::hangup()),
    ) else {
        error!("cannot listen for signals; stop the service with SIGKILL");
        return std::future::pending().await;
    };
    loop {
        let signal = tokio::select! {
            _ = term.recv() => Signal::Stop("SIGTERM"),
            _ = int.recv() => Signal::Stop("SIGINT"),
            _ = hup.recv() => Signal::Reload,
        };
        if signals.send(signal).await.is_err() {
            return;
        }
    }
}
