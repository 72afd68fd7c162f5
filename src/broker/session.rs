//! One session: a connection's life. It connects, declares the topology, reads the cancellation
//! and hold streams, runs every loop of every ladder and their helpers in one task set, and ends
//! through one teardown: drained at shutdown, or at the first failure.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ladder_amqp::Connection;
use tokio::sync::oneshot;
use tokio::task::{JoinError, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::broker::connect::{BlockedWatch, CLOSE_TIMEOUT, close, connect_from};
use crate::broker::declare::{MIGRATED_READ, declare, look_at_drift};
use crate::broker::relay::{self, Drained, Hop, LadderRuntime, RelayError};
use crate::broker::state::{DISCONNECTED, Health, STARTING, State};
use crate::broker::topology::{self, TopologyError};
use crate::config::Config;
use crate::model::names::Namespace;

/// Why a session ended before shutdown.
pub(crate) enum SessionError {
    /// The broker holds objects that contradict the config; reconnecting would not help.
    Fatal(TopologyError),
    /// `broker`: the index of the broker the session served on, if it got that far.
    Retry { error: String, broker: Option<usize> },
}

/// How long a session waits for every ladder's cancellation stream to be read before it gives
/// up and reconnects (the stream holds at most 49 days of cancellations: a few thousand records
/// read in well under a second).
const CANCELS_CATCH_UP: Duration = Duration::from_secs(30);

/// How often the session looks whether the followers caught up.
const CANCELS_POLL: Duration = Duration::from_millis(10);

/// How often a starting session says in its log what it still waits for.
const STEP_LOG_EVERY: Duration = Duration::from_secs(5);

/// Runs one step of a session's start. `/ready` names it (`starting: …`) and the log says every
/// [`STEP_LOG_EVERY`] that it still waits, so a start the broker holds up says on what. The
/// work may name a finer step itself, with [`Health::set_reason`] of [`STARTING`].
async fn step<T>(health: &Health, what: impl Into<String>, work: impl Future<Output = T>) -> T {
    health.set_reason(STARTING, what);
    let started = tokio::time::Instant::now();
    let mut every = tokio::time::interval_at(started + STEP_LOG_EVERY, STEP_LOG_EVERY);
    tokio::pin!(work);
    loop {
        tokio::select! {
            done = &mut work => return done,
            _ = every.tick() => warn!(
                waiting_for = %health.reason_of(STARTING).unwrap_or_default(),
                waited = ?started.elapsed(),
                "not ready: still waiting"
            ),
        }
    }
}

/// What one task of a session is, so that its end is read for what it means.
enum Ended {
    /// A relay loop: drained at shutdown, or failed.
    Relay(Result<Drained, RelayError>),
    /// A stream follower or the watchdog: it ends only when told to, or failing.
    Follower(Result<(), String>),
    /// A releaser, the strays' mover or the drain of a retired due queue: it ends at shutdown
    /// (or, a drain, when its queue is empty); a failure ends the session.
    Helper(Result<(), String>),
}

/// Why a task's end ends the session; `None` for a task that may end.
fn failure(joined: Result<Ended, JoinError>) -> Option<String> {
    match joined {
        Ok(Ended::Relay(Ok(_)) | Ended::Helper(Ok(()))) => None,
        Ok(Ended::Helper(Err(e))) => Some(e),
        Ok(Ended::Relay(Err(e))) => Some(e.to_string()),
        Ok(Ended::Follower(Ok(()))) => Some("a stream follower stopped".to_string()),
        Ok(Ended::Follower(Err(e))) => Some(e),
        Err(panic) => Some(format!("a session task failed: {panic}")),
    }
}

/// A session's connection and the one set of tasks that serve on it.
struct Session<'a> {
    config: &'a Config,
    ladders: &'a [Arc<LadderRuntime>],
    state: &'a Arc<State>,
    connection: Connection,
    /// The index of the broker `connection` is open to.
    broker: usize,
    /// Whether a session declared this config's topology before (see [`Session::declare`]).
    declared: &'a AtomicBool,
    tasks: JoinSet<Ended>,
    /// Relay loops still running: the session has drained when none is left.
    relays: usize,
    /// Stops the followers, the releasers and the watchdog once the relay loops have drained.
    follow_stop: CancellationToken,
}

/// One connection's life: connect, declare, serve, and end on shutdown or on the first failure.
pub(crate) async fn serve(
    config: &Config,
    ladders: &[Arc<LadderRuntime>],
    state: &Arc<State>,
    shutdown: &CancellationToken,
    (first_broker, declared): (usize, &AtomicBool),
) -> Result<(), SessionError> {
    let connecting = connect_from(&config.amqp, &config.amqp.connection_name, first_broker);
    let connecting = step(
        &state.health,
        format!("connecting to {}", config.amqp.brokers()),
        connecting,
    );
    let connected = tokio::select! {
        connected = connecting => connected,
        () = shutdown.cancelled() => return Ok(()),
    };
    let (connection, broker) = connected.map_err(|e| SessionError::Retry {
        error: e.to_string(),
        broker: None,
    })?;
    let _blocked = BlockedWatch::start(&connection, state);
    let version = connection.server_version().map(|(a, b, c)| format!("{a}.{b}.{c}"));
    info!(url = %config.amqp.urls[broker], broker_version = version.as_deref().unwrap_or("unknown"), "connected");
    let mut session = Session {
        config,
        ladders,
        state,
        connection,
        broker,
        declared,
        tasks: JoinSet::new(),
        relays: 0,
        follow_stop: CancellationToken::new(),
    };
    let served = session.run(shutdown).await;
    session.end(served).await
}

/// The cancellation and hold streams whose follower has not read up to its marker yet.
fn streams_behind(ladders: &[Arc<LadderRuntime>]) -> Vec<&str> {
    let cancels = ladders
        .iter()
        .filter(|l| l.spec.exact_delays && !l.cancels.caught_up())
        .map(|l| l.names.cancels.as_str());
    let holds = ladders
        .iter()
        .filter(|l| !l.holds.caught_up())
        .map(|l| l.names.holds.as_str());
    cancels.chain(holds).collect()
}

impl Session<'_> {
    fn retry(&self, error: String) -> SessionError {
        SessionError::Retry {
            error,
            broker: Some(self.broker),
        }
    }

    /// Declares, reads the streams, starts every loop and serves until the loops have drained
    /// at shutdown (`Some(abandoned)`) or shutdown came before serving (`None`).
    async fn run(&mut self, shutdown: &CancellationToken) -> Result<Option<usize>, SessionError> {
        let started = std::time::Instant::now();
        self.declare().await?;
        debug!(took = ?started.elapsed(), "topology declared");
        // every ladder's cancellations and holds are read before any loop may deliver what they
        // cancel or hold
        self.follow_streams();
        if !self.catch_up(shutdown).await? {
            return Ok(None);
        }
        debug!(took = ?started.elapsed(), "cancellation and hold streams read");
        self.start_releasers();
        let subscriptions = self.start_relays(shutdown);
        self.start_strays(shutdown);
        self.serve_until_drained(subscriptions, shutdown).await.map(Some)
    }

    /// The one teardown: what still runs stops (aborted after a failure), the connection
    /// closes, and a drained shutdown says whether the grace period sufficed.
    async fn end(mut self, served: Result<Option<usize>, SessionError>) -> Result<(), SessionError> {
        self.state.health.set_ready(false);
        self.state.health.clear_reason(STARTING);
        if !matches!(served, Ok(Some(_))) {
            self.tasks.abort_all();
        }
        self.follow_stop.cancel();
        while self.tasks.join_next().await.is_some() {}
        match served {
            Ok(Some(abandoned)) if abandoned > 0 => error!(
                abandoned,
                "shutdown grace period ran out; the broker will redeliver the unsettled messages"
            ),
            Ok(Some(_)) => info!("drained; every delivery in flight was settled"),
            _ => {}
        }
        close(&self.connection).await;
        served.map(|_| ())
    }

    /// Declares the topology and looks at its drift; a conflict is fatal, anything else is
    /// tried again on a new connection. Once a session of this config declared it, a new one
    /// only looks the exchanges up (a passive declare is answered from the node's own metadata).
    async fn declare(&self) -> Result<(), SessionError> {
        let health = &self.state.health;
        if self.declared.load(Ordering::Relaxed) {
            // passive declares, answered from the node's own copy of the metadata
            let version = topology::version_of(&self.connection);
            let (namespace, ladders) = (&self.config.namespace, &self.config.ladders);
            let exchanges: Vec<_> = crate::model::upgrade::planned(namespace, ladders, version, |_| false)
                .into_iter()
                .filter(|k| k.kind == crate::model::drift::Kind::Exchange)
                .collect();
            let looked = crate::broker::drift::observe(&self.connection, &exchanges);
            match step(health, "looking up the declared exchanges", looked).await {
                Ok(seen) if seen.iter().all(|o| o.exists) => return Ok(()),
                Ok(_) => info!("an exchange of the topology is gone; declaring the topology again"),
                Err(e) => return Err(self.retry(format!("looking up the declared exchanges: {e}"))),
            }
        }
        // what the namespace declared before: as this process last saw it, or read once at its
        // first session (a reconnect must not wait for a stream)
        let seen = self
            .state
            .drift
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map(|seen| seen.registry.clone());
        let known = match seen {
            Some(registry) => Some(registry),
            None => {
                let read = crate::broker::drift::read(&self.connection, &self.config.namespace);
                let topology = Namespace::new(&self.config.namespace).topology;
                let read = step(
                    health,
                    format!("reading {topology}"),
                    tokio::time::timeout(MIGRATED_READ, read),
                );
                read.await.ok().and_then(Result::ok)
            }
        };
        let each = |d: &topology::Declaration| health.set_reason(STARTING, format!("declaring {d}"));
        let declaring = declare(&self.connection, self.config, known.as_ref(), &each);
        match step(health, "declaring the topology", declaring).await {
            Ok(applied) => {
                let recording = look_at_drift(&self.connection, self.config, self.state, applied);
                step(health, "recording the topology", recording).await;
                self.declared.store(true, Ordering::Relaxed);
                Ok(())
            }
            Err(conflict @ TopologyError::Conflict { .. }) => Err(SessionError::Fatal(conflict)),
            Err(other) => Err(self.retry(other.to_string())),
        }
    }

    /// Starts the followers of every ladder's cancellation stream (exact delays only) and
    /// hold stream.
    fn follow_streams(&mut self) {
        for ladder in self.ladders.iter().filter(|l| l.spec.exact_delays) {
            let span = info_span!("cancels", ladder = %ladder.spec.name);
            let (ladder, connection, stop) = (ladder.clone(), self.connection.clone(), self.follow_stop.clone());
            self.tasks.spawn(
                async move {
                    let followed =
                        crate::broker::cancels::follow(&connection, &ladder.names, &ladder.cancels, &stop).await;
                    Ended::Follower(followed.map_err(|e| format!("cannot follow the cancellations: {e}")))
                }
                .instrument(span),
            );
        }
        for ladder in self.ladders {
            let span = info_span!("holds", ladder = %ladder.spec.name);
            let (ladder, connection, stop) = (ladder.clone(), self.connection.clone(), self.follow_stop.clone());
            self.tasks.spawn(
                async move {
                    let followed = crate::broker::holds::follow(
                        &connection,
                        &ladder.names,
                        &ladder.spec,
                        &ladder.holds,
                        Some(&ladder.metrics.holds),
                        Some(&ladder.holds_changed),
                        &stop,
                    )
                    .await;
                    Ended::Follower(followed.map_err(|e| format!("cannot follow the holds: {e}")))
                }
                .instrument(span),
            );
        }
    }

    /// Waits until every follower has read its stream: `Ok(false)` when shutdown comes first.
    async fn catch_up(&mut self, shutdown: &CancellationToken) -> Result<bool, SessionError> {
        let (ladders, connection) = (self.ladders, &self.connection);
        // the followers' markers are publishes: while the broker blocks them (a resource alarm)
        // the catch-up waits for the alarm instead of timing out into a reconnect that would be
        // blocked too
        let health = &self.state.health;
        let caught_up = async {
            let mut deadline = tokio::time::Instant::now() + CANCELS_CATCH_UP;
            loop {
                let behind = streams_behind(ladders);
                if behind.is_empty() {
                    break;
                }
                health.set_reason(STARTING, format!("reading the streams {}", behind.join(", ")));
                if connection.is_blocked() {
                    deadline = tokio::time::Instant::now() + CANCELS_CATCH_UP;
                } else if tokio::time::Instant::now() >= deadline {
                    return Err(format!(
                        "the cancellation and hold streams were not read within {CANCELS_CATCH_UP:?}"
                    ));
                }
                tokio::time::sleep(CANCELS_POLL).await;
            }
            Ok(())
        };
        let reading = tokio::select! {
            done = step(health, "reading the cancellation and hold streams", caught_up) => done,
            Some(joined) = self.tasks.join_next() => Err(failure(joined).unwrap_or_else(|| "a stream follower stopped".to_string())),
            () = shutdown.cancelled() => return Ok(false),
        };
        reading.map(|()| true).map_err(|e| self.retry(e))
    }

    /// The releasers: resumed destinations drain, the automatic hold polls.
    fn start_releasers(&mut self) {
        for ladder in self.ladders {
            let span = info_span!("releaser", ladder = %ladder.spec.name);
            let (ladder, connection, stop) = (ladder.clone(), self.connection.clone(), self.follow_stop.clone());
            self.tasks.spawn(
                async move {
                    crate::broker::holds::run_releaser(connection, ladder, stop).await;
                    Ended::Helper(Ok(()))
                }
                .instrument(span),
            );
        }
    }

    /// Starts one relay loop of `hop` of `ladder`, on `queue` instead of the hop's own queue
    /// when given; the receiver hears once it consumes.
    fn start_relay(
        &mut self,
        hop: Hop,
        queue: Option<String>,
        ladder: &Arc<LadderRuntime>,
        shutdown: &CancellationToken,
    ) -> oneshot::Receiver<()> {
        let (ladder, connection, stop) = (ladder.clone(), self.connection.clone(), shutdown.clone());
        let grace = self.config.shutdown_grace;
        let (subscribed, is_subscribed) = oneshot::channel();
        self.relays += 1;
        // Not in a span: a span is entered and left on every poll of the loop, i.e. for every
        // delivery and confirm; the loop's events name their ladder and hop instead.
        self.tasks.spawn(async move {
            Ended::Relay(
                relay::serve_on(
                    hop,
                    queue.as_deref(),
                    ladder,
                    &connection,
                    stop,
                    grace,
                    Some(subscribed),
                )
                .await,
            )
        });
        is_subscribed
    }

    /// Every ladder's hops and each ladder's probes queue: each queue, and the receiver that
    /// hears once its loop consumes.
    fn start_relays(&mut self, shutdown: &CancellationToken) -> Vec<(String, oneshot::Receiver<()>)> {
        let mut subscriptions = Vec::new();
        let ladders = self.ladders;
        for ladder in ladders {
            for hop in Hop::ALL {
                let queue = ladder.queue(hop).to_string();
                subscriptions.push((queue, self.start_relay(hop, None, ladder, shutdown)));
            }
            // failed probes of the automatic hold, served by the intake hop on their own queue:
            // no backlog of the intake delays what the hold waits to hear
            let probes = ladder.names.probes.clone();
            subscriptions.push((
                probes.clone(),
                self.start_relay(Hop::Intake, Some(probes), ladder, shutdown),
            ));
        }
        subscriptions
    }

    /// The namespace's strays ([`crate::broker::stray`]): `N.stray`, and the due queues of
    /// ladders no ladder file names any more, where what waited in their tiers still comes due
    /// (each until it is empty; then `ladder prune` may remove it).
    fn start_strays(&mut self, shutdown: &CancellationToken) {
        if self.ladders.is_empty() {
            return;
        }
        let (ladders, connection, stop) = (self.ladders.to_vec(), self.connection.clone(), shutdown.clone());
        let stray = Namespace::new(&self.config.namespace).stray;
        self.tasks.spawn(
            async move {
                let moved = crate::broker::stray::serve(&stray, &ladders, &connection, stop).await;
                Ended::Helper(moved.map_err(|e| format!("the strays of {stray}: {e}")))
            }
            .instrument(info_span!("strays")),
        );
        for queue in retired_due_queues(self.state) {
            let span = info_span!("retired", queue = %queue);
            let drain = drain_retired(queue, self.ladders.to_vec(), self.connection.clone(), shutdown.clone());
            self.tasks.spawn(
                async move {
                    drain.await;
                    Ended::Helper(Ok(()))
                }
                .instrument(span),
            );
        }
    }

    /// Serves until every relay loop has drained at shutdown, returning how many deliveries
    /// the grace period abandoned; ready once every loop consumes, watched from then on.
    async fn serve_until_drained(
        &mut self,
        subscriptions: Vec<(String, oneshot::Receiver<()>)>,
        shutdown: &CancellationToken,
    ) -> Result<usize, SessionError> {
        let health = &self.state.health;
        let all_subscribed = async {
            for (queue, subscribed) in subscriptions {
                health.set_reason(STARTING, format!("subscribing to {queue}"));
                if subscribed.await.is_err() {
                    return false;
                }
            }
            true
        };
        let mut ready_pending = Box::pin(step(health, "subscribing", all_subscribed));
        let mut waiting_ready = true;
        let mut abandoned = 0;
        while self.relays > 0 {
            let joined = tokio::select! {
                ready = &mut ready_pending, if waiting_ready => {
                    waiting_ready = false;
                    if ready {
                        self.become_ready(shutdown);
                    }
                    continue;
                }
                Some(joined) = self.tasks.join_next() => joined,
            };
            if let Ok(Ended::Relay(Ok(drained))) = &joined {
                self.relays -= 1;
                abandoned += drained.abandoned;
            } else if let Some(failure) = failure(joined) {
                // the connection is suspect: every loop is dropped (their unacked deliveries
                // return to the queues when the connection closes) and the session starts over
                return Err(self.retry(failure));
            }
        }
        Ok(abandoned)
    }

    /// Every loop consumes: ready, and from now on a hop that stops moving with work waiting
    /// ends the session (the watchdog).
    fn become_ready(&mut self, shutdown: &CancellationToken) {
        let health = &self.state.health;
        health.clear_reason(DISCONNECTED);
        health.clear_reason(STARTING);
        health.set_stalled(None);
        health.set_ready(true);
        info!(ladders = self.ladders.len(), "ready");
        let (ladders, connection, stop, state) = (
            self.ladders.to_vec(),
            self.connection.clone(),
            self.follow_stop.clone(),
            self.state.clone(),
        );
        let (stall_timeout, shutdown) = (self.config.amqp.stall_timeout, shutdown.clone());
        // the namespace's, whatever its ladders; none to watch without a ladder
        let heartbeat = (!ladders.is_empty()).then(|| Namespace::new(&self.config.namespace).watchdog);
        self.tasks.spawn(
            async move {
                let watched = crate::broker::watchdog::watch(
                    &connection,
                    heartbeat.as_deref(),
                    &ladders,
                    &state.health,
                    stall_timeout,
                    &stop,
                    &shutdown,
                )
                .await;
                Ended::Follower(watched)
            }
            .instrument(info_span!("watchdog")),
        );
    }
}

/// How often a retired ladder's due queue is looked at for messages to drain.
const RETIRED_LOOK: Duration = Duration::from_secs(2);

/// The due queues (`N.L.due`) of the retired ladders the latest drift survey found.
fn retired_due_queues(state: &State) -> Vec<String> {
    let seen = state
        .drift
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    seen.map(|seen| {
        seen.survey
            .retired
            .iter()
            .filter(|r| r.ladder_retired && r.kind == crate::model::drift::Kind::Queue && r.role == "due")
            .map(|r| r.name.clone())
            .collect()
    })
    .unwrap_or_default()
}

/// Moves what comes due in the due queue of a retired ladder to the ladders served here, as
/// strays are ([`crate::broker::stray`]), whenever it holds messages, and lets go of it once it
/// is empty, so that a consumer does not keep `ladder prune` from deleting it. Ends when the
/// queue is gone or at shutdown; a failure of its own is logged, never the session's.
async fn drain_retired(
    queue: String,
    ladders: Vec<Arc<LadderRuntime>>,
    connection: Connection,
    shutdown: CancellationToken,
) {
    let depth = async |queue: &str| -> Option<u32> {
        let channel = tokio::time::timeout(CLOSE_TIMEOUT, connection.create_channel())
            .await
            .ok()?
            .ok()?;
        let info = tokio::time::timeout(CLOSE_TIMEOUT, channel.queue_inspect(queue))
            .await
            .ok()?;
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, channel.close(200, "looked")).await;
        info.ok().map(|i| i.message_count)
    };
    loop {
        match depth(&queue).await {
            // gone (pruned), or the connection is: the next session looks again
            None => return,
            Some(0) => {}
            Some(waiting) => {
                info!(queue, waiting, "draining the due queue of a retired ladder");
                let stop = shutdown.child_token();
                let serve = crate::broker::stray::serve(&queue, &ladders, &connection, stop.clone());
                let watch = async {
                    // two looks in a row that find it empty: let go
                    let mut empty = 0;
                    while empty < 2 {
                        tokio::time::sleep(RETIRED_LOOK).await;
                        empty = if depth(&queue).await == Some(0) { empty + 1 } else { 0 };
                    }
                    stop.cancel();
                    std::future::pending::<()>().await
                };
                tokio::select! {
                    served = serve => if let Err(e) = served {
                        warn!(queue, error = %e, "draining a retired ladder's due queue stopped");
                        return;
                    },
                    () = watch => {}
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(RETIRED_LOOK) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_step_is_named_on_ready_while_it_waits_and_a_finer_step_replaces_it() {
        let health = Health::default();
        let (done, waited) = oneshot::channel::<()>();
        let work = async {
            health.set_reason(STARTING, "subscribing to ns.orders.intake");
            waited.await
        };
        let waiting = step(&health, "subscribing", work);
        tokio::pin!(waiting);
        assert!(
            tokio::time::timeout(Duration::from_millis(20), &mut waiting)
                .await
                .is_err()
        );
        assert_eq!(
            health.reason().as_deref(),
            Some("starting: subscribing to ns.orders.intake")
        );
        assert!(!health.is_ready());
        done.send(()).unwrap();
        assert!(waiting.await.is_ok());
    }
}
