//! The admin HTTP server: `/live`, `/ready`, `/metrics` and `/api/ladders`, the parking-lot API
//! ([`crate::admin::api`]) and the operator web page ([`crate::admin::web`]), and [`run`], which serves them
//! beside the depth poller ([`crate::admin::poller`]) and the parking-lot followers
//! ([`crate::admin::desk`]).
//!
//! Health and metrics only read what the service and the poller share ([`State`], the latest
//! [`Snapshot`]); the parking-lot routes use the [`Desk`]'s own connection. All of it is off the
//! worker path — a slow scrape, a long replay or a stuck client cannot hold up a relay loop,
//! and the relay never waits for it.
//!
//! [`Snapshot`]: crate::admin::snapshot::Snapshot
//! [`Desk`]: crate::admin::desk::Desk

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info, info_span};

pub mod api;
pub mod charts;
pub mod desk;
pub mod guard;
pub mod history;
pub mod holds;
pub mod openapi;
pub mod poller;
pub mod router;
pub mod snapshot;
pub mod state;
pub mod status;
pub mod web;

pub use router::router;
pub use state::AdminState;
pub use status::METRICS_CONTENT_TYPE;

use crate::broker::state::State;
use crate::config::Config;

/// How often [`until_ready`] looks.
const READY_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// Waits until the service has been ready once (its topology declared); false if `shutdown`
/// came first.
async fn until_ready(service: &State, shutdown: &CancellationToken) -> bool {
    while !service.health.is_ready() {
        tokio::select! {
            () = shutdown.cancelled() => return false,
            () = tokio::time::sleep(READY_POLL) => {}
        }
    }
    true
}

/// How often the retired objects' counts are read again.
const DRIFT_REFRESH: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads the retired objects the service found ([`State::drift`]) again every
/// [`DRIFT_REFRESH`], on a connection of its own, so the API and the page show them draining and
/// going; until `shutdown`. A failure is logged at debug and tried again next time.
async fn refresh_drift(config: &Config, service: &State, shutdown: &CancellationToken) {
    let mut connection: Option<ladder_amqp::Connection> = None;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(DRIFT_REFRESH) => {}
        }
        let seen = service
            .drift
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let Some(seen) = seen.filter(|s| !s.survey.retired.is_empty()) else {
            continue;
        };
        if connection.as_ref().is_none_or(|c| !c.is_open()) {
            let name = format!("{} drift", config.amqp.connection_name);
            connection = crate::broker::connect::connect_named(&config.amqp, &name).await.ok();
        }
        let Some(open) = &connection else { continue };
        let version = crate::broker::topology::version_of(open);
        match crate::broker::drift::retired_now(open, config, version, &seen.registry).await {
            Ok(retired) => {
                let mut next = (*seen).clone();
                next.survey.retired = retired;
                next.at_ms = crate::clock::now_ms();
                *service.drift.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(next));
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the retired objects; trying again later");
                connection = None;
            }
        }
    }
    if let Some(c) = connection {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), c.close(200, "stopping")).await;
    }
}

/// Serves [`router`](fn@router) on `listener` until `shutdown`, then lets open requests finish.
pub async fn serve(listener: TcpListener, state: Arc<AdminState>, shutdown: CancellationToken) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// Serves the admin endpoints on `listener` and runs the depth poller, both until `shutdown`.
///
/// The caller cancels `shutdown` after the service drained, so `/metrics` stays readable
/// during the drain. A failing admin server is logged and does not stop the poller or the
/// service: the relay does not depend on it.
pub async fn run(
    listener: TcpListener,
    config: Arc<Config>,
    service: Arc<State>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let (publish, snapshots) = watch::channel(None);
    let state = Arc::new(AdminState::new(config.clone(), service.clone(), snapshots));
    let address = listener.local_addr()?;
    let mut tasks = JoinSet::new();
    let poll = poller::run(
        config.clone(),
        service.clone(),
        publish,
        state.history.clone(),
        shutdown.clone(),
    );
    // the streams exist once the service declared its topology: following earlier would only
    // fail, warn and retry on every fresh start
    let follow = {
        let (desk, service, shutdown) = (state.desk.clone(), service.clone(), shutdown.clone());
        async move {
            if until_ready(&service, &shutdown).await {
                desk.follow(shutdown).await;
            }
        }
    };
    tasks.spawn(
        async move {
            follow.await;
            Ok(())
        }
        .instrument(info_span!("parking-lots")),
    );
    tasks.spawn(
        async move {
            poll.await;
            Ok(())
        }
        .instrument(info_span!("poller")),
    );
    tasks.spawn(
        {
            let (config, service, shutdown) = (config.clone(), service.clone(), shutdown.clone());
            async move {
                refresh_drift(&config, &service, &shutdown).await;
                Ok(())
            }
        }
        .instrument(info_span!("drift")),
    );
    tasks.spawn(serve(listener, state, shutdown.clone()).instrument(info_span!("admin", %address)));
    info!(%address, "admin server listening");
    let mut result = Ok(());
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                error!(error = %e, "admin server failed; the service keeps running without it");
                result = Err(e);
            }
            Err(e) => error!(error = %e, "admin task failed"),
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parking-lot followers start once the service declared the streams, not before (they
    /// would fail and warn on every fresh start), and never after a shutdown.
    #[tokio::test(start_paused = true)]
    async fn the_followers_wait_for_the_topology() {
        let service = Arc::new(State::default());
        let shutdown = CancellationToken::new();
        let waiting = tokio::spawn({
            let (service, shutdown) = (service.clone(), shutdown.clone());
            async move { until_ready(&service, &shutdown).await }
        });
        tokio::time::sleep(READY_POLL * 50).await;
        assert!(!waiting.is_finished(), "started before the service was ready");
        service.health.set_ready(true);
        assert!(waiting.await.unwrap(), "started once ready");

        let never = Arc::new(State::default());
        let stopping = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { until_ready(&never, &shutdown).await }
        });
        shutdown.cancel();
        assert!(!stopping.await.unwrap(), "a shutdown ends the wait, without following");
    }
}
