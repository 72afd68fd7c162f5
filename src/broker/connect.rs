//! Connections to the broker: one named connection to the first node that answers, closed
//! within a bound, and its `connection.blocked` state followed into readiness.

use std::sync::Arc;
use std::time::Duration;

use ladder_amqp::{ConnectOptions, Connection};
use tracing::{debug, info, warn};

use crate::broker::state::{BLOCKED, State};
use crate::config::AmqpConfig;

/// How long one connection attempt may take before it counts as failed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// How long closing a connection may take; a dead peer must not hold up a reconnect.
pub(crate) const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Opens a connection named after the config to the first of its brokers that answers (each
/// attempt bounded by `CONNECT_TIMEOUT`).
pub async fn connect(amqp: &AmqpConfig) -> ladder_amqp::Result<Connection> {
    connect_named(amqp, &amqp.connection_name).await
}

/// Like [`connect`], with another connection name (the poller's and the operator desk's own
/// connections are told apart in the management UI).
pub async fn connect_named(amqp: &AmqpConfig, name: &str) -> ladder_amqp::Result<Connection> {
    connect_from(amqp, name, 0).await.map(|(connection, _)| connection)
}

/// Tries the brokers in turn from index `first`, each once; returns the connection and the
/// index of the broker that answered, or the last error.
pub(crate) async fn connect_from(
    amqp: &AmqpConfig,
    name: &str,
    first: usize,
) -> ladder_amqp::Result<(Connection, usize)> {
    let mut last = None;
    for i in (0..amqp.urls.len()).map(|k| (first + k) % amqp.urls.len()) {
        // config validated the URI; a failure here would be a bug, reported as a bad URI
        let mut uri: ladder_amqp::AmqpUri = amqp.urls[i].expose().parse()?;
        uri.connection_timeout = Some(uri.connection_timeout.unwrap_or(CONNECT_TIMEOUT));
        // a URI's own ?heartbeat= wins (and then two of its intervals, the client's default)
        let dead_after = uri.heartbeat.is_none().then_some(amqp.heartbeat_timeout);
        uri.heartbeat = Some(uri.heartbeat.unwrap_or(amqp.heartbeat.as_secs() as u16));
        let options = ConnectOptions {
            uri,
            connection_name: Some(name.to_string()),
            tls: amqp.tls.clone(),
            dead_after,
        };
        match Connection::connect(&options).await {
            Ok(connection) => return Ok((connection, i)),
            Err(e) => {
                if amqp.urls.len() > 1 {
                    debug!(url = %amqp.urls[i], error = %e, "broker node not reachable; trying the next");
                }
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or(ladder_amqp::Error::ConnectionGone))
}

/// Follows whether the broker blocks `connection` (`connection.blocked`: a memory or disk alarm)
/// into readiness and the metrics, until dropped; dropping it clears both. A blocked connection
/// is alive: the session keeps it (its publishes wait, confirmed once the alarm clears).
pub(crate) struct BlockedWatch {
    task: tokio::task::AbortHandle,
    state: Arc<State>,
}

impl BlockedWatch {
    pub(crate) fn start(connection: &Connection, state: &Arc<State>) -> Self {
        let mut changes = connection.blocked_changes();
        let watched = state.clone();
        let task = tokio::spawn(async move {
            let mut was_blocked = false;
            loop {
                let reason = changes.borrow_and_update().clone();
                match reason {
                    Some(reason) => {
                        if !was_blocked {
                            watched.metrics.broker_blocked_episodes.inc();
                            warn!(reason = %reason, "not ready: the broker blocks publishing (resource alarm); waiting for it to clear");
                        }
                        watched.metrics.broker_blocked.set(1);
                        watched.health.set_reason(BLOCKED, reason);
                        was_blocked = true;
                    }
                    None => {
                        if was_blocked {
                            info!("the broker's resource alarm cleared; publishing again");
                        }
                        watched.metrics.broker_blocked.set(0);
                        watched.health.clear_reason(BLOCKED);
                        was_blocked = false;
                    }
                }
                if changes.changed().await.is_err() {
                    return;
                }
            }
        });
        BlockedWatch {
            task: task.abort_handle(),
            state: state.clone(),
        }
    }
}

impl Drop for BlockedWatch {
    fn drop(&mut self) {
        self.task.abort();
        self.state.metrics.broker_blocked.set(0);
        self.state.health.clear_reason(BLOCKED);
    }
}

/// Closes `connection`, waiting at most [`CLOSE_TIMEOUT`].
pub(crate) async fn close(connection: &Connection) {
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, connection.close(200, "bye")).await;
}
