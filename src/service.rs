//! The supervisor: connect, declare the topology, run every ladder's intake and due loops, and
//! start over with backoff when the broker goes away — until shutdown, which it drains.
//!
//! It rebuilds the whole connection on any failure instead of relying on the client's
//! auto-recovery: unacked deliveries return to their queues when the old connection dies, so
//! a rebuild is simple and loses nothing (it may duplicate, which the README documents).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lapin::{Connection, ConnectionProperties};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info, info_span, warn};

use crate::config::{AmqpConfig, Config};
use crate::metrics::Metrics;
use crate::relay::{self, Hop, LadderRuntime};
use crate::telemetry::Telemetry;
use crate::topology::{self, Names, TopologyError};

/// How long one connection attempt may take before it counts as failed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// How long closing a connection may take; a dead peer must not hold up a reconnect.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Shared, cheap-to-read state of the service for health checks.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
}

impl Health {
    /// True once topology is declared and every consumer runs; false while reconnecting.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }
}

/// What the service shares with the admin server and the tests: readiness, metrics, tracing.
#[derive(Debug, Default)]
pub struct State {
    /// Readiness.
    pub health: Health,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// OpenTelemetry tracing (off unless configured).
    pub telemetry: Telemetry,
}

/// Why the service stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The broker holds objects that contradict the config; reconnecting would not help.
    #[error(transparent)]
    Topology(#[from] TopologyError),
}

/// Opens a connection named after the config, bounded by [`CONNECT_TIMEOUT`].
pub async fn connect(amqp: &AmqpConfig) -> lapin::Result<Connection> {
    connect_with_frame_max(amqp, None).await
}

/// Like [`connect`], asking for at most `frame_max` bytes per frame. lapin keeps 32 frames of
/// buffer each way per connection, zeroed up front: at the broker's default 131072 that is 8 MiB
/// of resident memory per connection, which a connection that only exchanges small frames (the
/// depth poller's passive declares) need not pay.
pub async fn connect_with_frame_max(amqp: &AmqpConfig, frame_max: Option<u32>) -> lapin::Result<Connection> {
    let properties = ConnectionProperties::default().with_connection_name(amqp.connection_name.as_str().into());
    // config validated the URI; a failure here would be a bug, reported like an I/O error
    let mut uri: lapin::uri::AMQPUri = amqp.url.expose().parse().map_err(|e: String| {
        lapin::Error::from(lapin::ErrorKind::IOError(Arc::new(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            e,
        ))))
    })?;
    if frame_max.is_some() {
        uri.query.frame_max = frame_max;
    }
    match tokio::time::timeout(CONNECT_TIMEOUT, Connection::connect_uri(uri, properties)).await {
        Ok(result) => result,
        Err(_) => Err(lapin::Error::from(lapin::ErrorKind::IOError(Arc::new(
            std::io::Error::new(std::io::ErrorKind::TimedOut, "connecting to the broker timed out"),
        )))),
    }
}

/// Declares the whole topology of `config` once (what `ladder apply` does).
pub async fn apply(config: &Config) -> Result<(), ApplyError> {
    let connection = connect(&config.amqp).await?;
    let channel = connection.create_channel().await?;
    let result = topology::apply(&channel, &topology::plan(config)).await;
    close(&connection).await;
    Ok(result?)
}

/// `apply` failed.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The broker could not be reached.
    #[error("cannot reach the broker: {0}")]
    Connect(#[from] lapin::Error),
    /// Declaring failed.
    #[error(transparent)]
    Topology(#[from] TopologyError),
}

/// Serves every ladder of `config` until `shutdown` is cancelled, reconnecting as needed.
///
/// Returns `Ok` after a drained shutdown; `Err` only for faults reconnecting cannot fix.
pub async fn run(config: Arc<Config>, state: Arc<State>, shutdown: CancellationToken) -> Result<(), ServiceError> {
    let health = &state.health;
    let ladders: Vec<Arc<LadderRuntime>> = config
        .ladders
        .iter()
        .map(|spec| {
            Arc::new(LadderRuntime {
                names: Names::new(&config.namespace, &spec.name),
                metrics: state.metrics.ladder(spec),
                telemetry: state.telemetry.clone(),
                spec: spec.clone(),
                limits: config.limits,
            })
        })
        .collect();
    let mut backoff = config.amqp.reconnect_min;
    loop {
        match session(&config, &ladders, health, &shutdown).await {
            Ok(()) => return Ok(()),
            Err(SessionError::Fatal(e)) => {
                health.set_ready(false);
                return Err(e);
            }
            Err(SessionError::Retry { error, was_ready }) => {
                health.set_ready(false);
                if was_ready {
                    backoff = config.amqp.reconnect_min;
                }
                state.metrics.reconnects.inc();
                warn!(url = %config.amqp.url, error = %error, retry_in = ?backoff, "broker connection lost; reconnecting");
            }
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = shutdown.cancelled() => return Ok(()),
        }
        backoff = (backoff * 2).min(config.amqp.reconnect_max);
    }
}

enum SessionError {
    Fatal(ServiceError),
    Retry { error: String, was_ready: bool },
}

impl SessionError {
    fn retry(error: impl ToString) -> Self {
        SessionError::Retry {
            error: error.to_string(),
            was_ready: false,
        }
    }
}

/// One connection's life: connect, declare, serve, and end on shutdown or on the first failure.
async fn session(
    config: &Config,
    ladders: &[Arc<LadderRuntime>],
    health: &Health,
    shutdown: &CancellationToken,
) -> Result<(), SessionError> {
    let connection = tokio::select! {
        connected = connect(&config.amqp) => connected.map_err(SessionError::retry)?,
        () = shutdown.cancelled() => return Ok(()),
    };
    info!(url = %config.amqp.url, "connected");
    let declared = async {
        let channel = connection.create_channel().await.map_err(SessionError::retry)?;
        match topology::apply(&channel, &topology::plan(config)).await {
            Ok(()) => {}
            Err(conflict @ TopologyError::Conflict { .. }) => return Err(SessionError::Fatal(conflict.into())),
            Err(other) => return Err(SessionError::retry(other)),
        }
        let _ = channel.close(200, "declared".into()).await;
        Ok(())
    };
    if let Err(e) = declared.await {
        close(&connection).await;
        return Err(e);
    }

    let connection = Arc::new(connection);
    let mut workers = JoinSet::new();
    for ladder in ladders {
        for hop in [Hop::Intake, Hop::Due] {
            let span = info_span!("relay", ladder = %ladder.spec.name, %hop);
            let (ladder, connection, stop) = (ladder.clone(), connection.clone(), shutdown.clone());
            let grace = config.shutdown_grace;
            workers.spawn(async move { relay::serve(hop, ladder, &connection, stop, grace).await }.instrument(span));
        }
    }
    health.set_ready(true);
    info!(ladders = ladders.len(), "ready");

    let mut abandoned = 0;
    while let Some(joined) = workers.join_next().await {
        let failure = match joined {
            Ok(Ok(drained)) => {
                abandoned += drained.abandoned;
                continue;
            }
            Ok(Err(e)) => e.to_string(),
            Err(panic) => format!("relay task failed: {panic}"),
        };
        // One loop failed: the connection is suspect. Drop every loop (their unacked deliveries
        // return to the queues when the connection closes) and start over.
        health.set_ready(false);
        workers.abort_all();
        while workers.join_next().await.is_some() {}
        close(&connection).await;
        return Err(SessionError::Retry {
            error: failure,
            was_ready: true,
        });
    }
    health.set_ready(false);
    if abandoned > 0 {
        error!(
            abandoned,
            "shutdown grace period ran out; the broker will redeliver the unsettled messages"
        );
    } else {
        info!("drained; every delivery in flight was settled");
    }
    close(&connection).await;
    Ok(())
}

async fn close(connection: &Connection) {
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, connection.close(200, "bye".into())).await;
}
