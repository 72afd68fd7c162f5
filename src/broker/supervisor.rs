//! The supervisor: serve every ladder through one session at a time, and start over with
//! backoff when the broker goes away — until shutdown, which the session drains.
//!
//! It rebuilds the whole connection on any failure instead of relying on the client's
//! auto-recovery: unacked deliveries return to their queues when the old connection dies, so
//! a rebuild is simple and loses nothing (it may duplicate, which the README documents).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::broker::relay::LadderRuntime;
use crate::broker::session::{self, SessionError};
use crate::broker::state::{DISCONNECTED, State};
use crate::broker::topology::{Names, TopologyError};
use crate::config::Config;
use crate::model::backoff::Backoff;

/// Why the service stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The broker holds objects that contradict the config; reconnecting would not help.
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
            Arc::new(LadderRuntime::new(
                spec.clone(),
                Names::of(&config.namespace, spec),
                config.limits,
                state.metrics.ladder(spec),
                state.telemetry.clone(),
            ))
        })
        .collect();
    *state.ladders.write().unwrap_or_else(std::sync::PoisonError::into_inner) = ladders.clone();
    let mut backoff = Backoff::new(config.amqp.reconnect_min, config.amqp.reconnect_max);
    // the broker to try first: after a lost connection, the next one (another cluster node)
    let mut next_broker = 0;
    // set once a session declared this config's topology: the next sessions look its exchanges
    // up instead, as a declare waits for the metadata store's leader (through a partition)
    let declared = AtomicBool::new(false);
    loop {
        match session::serve(&config, &ladders, &state, &shutdown, (next_broker, &declared)).await {
            Ok(()) => return Ok(()),
            Err(SessionError::Fatal(e)) => {
                health.set_ready(false);
                return Err(e.into());
            }
            Err(SessionError::Retry { error, broker }) => {
                health.set_ready(false);
                health.set_reason(DISCONNECTED, error.clone());
                if error.contains("NOT_FOUND") {
                    // a queue or exchange it declared is gone (the broker's 404 reply text is in
                    // the error): the next session declares again
                    declared.store(false, Ordering::Relaxed);
                }
                state.metrics.reconnects.inc();
                if let Some(broker) = broker {
                    // it was serving: fail over to the next node at once
                    backoff.reset();
                    next_broker = (broker + 1) % config.amqp.urls.len();
                    warn!(url = %config.amqp.urls[broker], error = %error, "broker connection lost; reconnecting");
                    continue;
                }
                let wait = backoff.next_wait();
                warn!(brokers = %config.amqp.brokers(), error = %error, retry_in = ?wait, "cannot reach the broker; retrying");
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = shutdown.cancelled() => return Ok(()),
                }
            }
        }
    }
}
