//! The supervisor: connect, declare the topology, run every ladder's intake and due loops, and
//! start over with backoff when the broker goes away — until shutdown, which it drains.
//!
//! It rebuilds the whole connection on any failure instead of relying on the client's
//! auto-recovery: unacked deliveries return to their queues when the old connection dies, so
//! a rebuild is simple and loses nothing (it may duplicate, which the README documents).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ladder_amqp::{ConnectOptions, Connection};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::broker::relay::{self, Hop, LadderRuntime};
use crate::broker::topology::{self, Names, TopologyError};
use crate::config::{AmqpConfig, Config};
use crate::metrics::Metrics;
use crate::model::backoff::Backoff;
use crate::model::upgrade;
use crate::telemetry::Telemetry;

/// How long one connection attempt may take before it counts as failed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// How long closing a connection may take; a dead peer must not hold up a reconnect.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Shared, cheap-to-read state of the service for health checks.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
    /// Why a serving session is not ready, by kind (`blocked`, …): each kind is set and cleared
    /// by its own watcher; `/ready` reports them all.
    reasons: std::sync::Mutex<std::collections::BTreeMap<&'static str, String>>,
}

impl Health {
    /// True once topology is declared and every consumer runs, and nothing holds the service
    /// up (no [`Health::reasons`]); false while reconnecting.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed) && self.lock_reasons().is_empty()
    }

    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// Why the service is not ready though connected, as `kind: detail` (e.g. `blocked: low on
    /// memory`), sorted by kind; empty when nothing holds it up.
    pub fn reasons(&self) -> Vec<String> {
        self.lock_reasons()
            .iter()
            .map(|(kind, detail)| format!("{kind}: {detail}"))
            .collect()
    }

    /// Marks the service not ready because of `kind` (replacing that kind's detail).
    pub fn set_reason(&self, kind: &'static str, detail: impl Into<String>) {
        self.lock_reasons().insert(kind, detail.into());
    }

    /// `kind` no longer holds the service up.
    pub fn clear_reason(&self, kind: &'static str) {
        self.lock_reasons().remove(kind);
    }

    /// Why the service is not ready: every reason that holds it up (`kind: detail`, joined by
    /// `; `), or `connecting` while no session serves; `None` when ready.
    pub fn reason(&self) -> Option<String> {
        let reasons = self.reasons();
        if !reasons.is_empty() {
            return Some(reasons.join("; "));
        }
        (!self.ready.load(Ordering::Relaxed)).then(|| "connecting".to_string())
    }

    /// Marks a hop stalled (`Some(reason)`, `stalled: …`) or clears it: the [`STALLED`] reason,
    /// set by the session's watchdog ([`crate::broker::watchdog`]).
    pub(crate) fn set_stalled(&self, reason: Option<String>) {
        match reason {
            Some(reason) => {
                let detail = reason.strip_prefix("stalled: ").unwrap_or(&reason).to_string();
                self.set_reason(STALLED, detail);
            }
            None => self.clear_reason(STALLED),
        }
    }

    fn lock_reasons(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<&'static str, String>> {
        self.reasons.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The readiness reason while a hop makes no progress with work waiting (the watchdog's).
pub const STALLED: &str = "stalled";

/// The readiness reason while the broker blocks the service's publishes (a resource alarm).
pub const BLOCKED: &str = "blocked";

/// The readiness reason after a session failed, until one is ready again: why (the broker
/// refused or did not answer, e.g. one out of file descriptors, or the connection was lost).
pub const DISCONNECTED: &str = "disconnected";

/// Follows whether the broker blocks `connection` (`connection.blocked`: a memory or disk alarm)
/// into readiness and the metrics, until dropped; dropping it clears both. A blocked connection
/// is alive: the session keeps it (its publishes wait, confirmed once the alarm clears).
struct BlockedWatch {
    task: tokio::task::AbortHandle,
    state: Arc<State>,
}

impl BlockedWatch {
    fn start(connection: &Connection, state: &Arc<State>) -> Self {
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

/// What the service shares with the admin server and the tests: readiness, metrics, tracing.
#[derive(Debug, Default)]
pub struct State {
    /// Readiness.
    pub health: Health,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// OpenTelemetry tracing (off unless configured).
    pub telemetry: Telemetry,
    /// Every ladder's runtime once `run` made them: the admin side reads their holds and
    /// breakers (never the other way round).
    pub ladders: std::sync::RwLock<Vec<Arc<LadderRuntime>>>,
    /// The namespace's drift as last seen: written by the service after it declared its
    /// topology, its counts refreshed by the admin side (`None` before the first look).
    pub drift: std::sync::RwLock<Option<Arc<DriftSeen>>>,
}

/// The namespace's drift ([`crate::broker::drift`]) at one moment.
#[derive(Debug, Clone)]
pub struct DriftSeen {
    /// What the topology stream said.
    pub registry: crate::model::drift::Registry,
    /// What is retired and what differs.
    pub survey: crate::broker::drift::Survey,
    /// When (Unix ms).
    pub at_ms: u64,
}

impl State {
    /// The runtime of ladder `name`, once the service runs.
    pub fn ladder(&self, name: &str) -> Option<Arc<LadderRuntime>> {
        self.ladders
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .find(|l| l.spec.name == name)
            .cloned()
    }
}

/// Why the service stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The broker holds objects that contradict the config; reconnecting would not help.
    #[error(transparent)]
    Topology(#[from] TopologyError),
}

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
async fn connect_from(amqp: &AmqpConfig, name: &str, first: usize) -> ladder_amqp::Result<(Connection, usize)> {
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

/// Declares the whole topology of `config` once (what `ladder apply` does), records it in the
/// namespace's topology stream, and logs its drift.
///
/// A declaration the broker fails for a passing reason (a 541 such as a quorum queue's
/// `cluster_not_formed` on a loaded node, or the connection lost mid-way) is tried again on a
/// new connection, for at most [`APPLY_RETRY_FOR`]: declaring is idempotent. A conflict, a
/// refused login or an unreachable broker fail at once.
pub async fn apply(config: &Config) -> Result<(), ApplyError> {
    let deadline = tokio::time::Instant::now() + APPLY_RETRY_FOR;
    let mut pause = Duration::from_millis(500);
    loop {
        let connection = connect(&config.amqp).await?;
        // how each ladder was declared before is read from the topology stream (see `declare`)
        let known = tokio::time::timeout(
            MIGRATED_READ,
            crate::broker::drift::read(&connection, &config.namespace),
        )
        .await
        .ok()
        .and_then(Result::ok);
        let result = declare(&connection, config, known.as_ref()).await;
        if let Ok(applied) = &result {
            look_at_drift(&connection, config, &State::default(), applied.clone()).await;
        }
        close(&connection).await;
        match result {
            Err(TopologyError::Broker { declaration, source })
                if passing(&source) && tokio::time::Instant::now() + pause < deadline =>
            {
                warn!(%declaration, error = %source, retry_in = ?pause, "declaring failed for a passing reason; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(4));
            }
            result => return result.map(|_| ()).map_err(ApplyError::from),
        }
    }
}

/// How long `apply` keeps trying a declaration the broker failed for a passing reason.
pub const APPLY_RETRY_FOR: Duration = Duration::from_secs(30);

/// True for a declaring error that a new attempt may not meet: the broker's 541
/// INTERNAL_ERROR (a quorum queue whose Raft cluster did not form in time) or a connection lost
/// on the way. Refusals (403, 406, 530 …) are not passing.
fn passing(error: &ladder_amqp::Error) -> bool {
    match error {
        ladder_amqp::Error::ConnectionClosed(reason) | ladder_amqp::Error::ChannelClosed(reason) => reason.code == 541,
        ladder_amqp::Error::Io(_) | ladder_amqp::Error::ConnectionGone | ladder_amqp::Error::HeartbeatTimeout(_) => {
            true
        }
        _ => false,
    }
}

/// How long recording the topology and reading the retired objects may take after declaring.
const DRIFT_TIMEOUT: Duration = Duration::from_secs(20);

/// After declaring: records the plan in the namespace's topology stream, reads what is retired
/// (and what `applied` found: queues kept in an older shape, ladders of a release before the
/// stream), logs it and keeps it in `state`. A failure
/// here is logged and does not stop the service: the relay does not depend on it.
async fn look_at_drift(connection: &Connection, config: &Config, state: &State, applied: Applied) {
    let version = topology::version_of(connection);
    let Applied { older, unrecorded } = applied;
    let looked = tokio::time::timeout(DRIFT_TIMEOUT, async {
        let registry = crate::broker::drift::record(connection, config, version, &unrecorded).await?;
        let retired = crate::broker::drift::retired_now(connection, config, version, &registry).await?;
        Ok::<_, crate::broker::drift::DriftError>((registry, retired))
    })
    .await;
    let (registry, retired) = match looked {
        Ok(Ok(seen)) => seen,
        Ok(Err(e)) => {
            warn!(error = %e, "cannot record the topology or read what is retired; drift is not shown");
            return;
        }
        Err(_) => {
            warn!(timeout = ?DRIFT_TIMEOUT, "recording the topology took too long; drift is not shown");
            return;
        }
    };
    for r in &retired {
        warn!(
            object = %r.name,
            ladder = %r.ladder,
            role = %r.role,
            messages = r.messages,
            last_due_by = %r.last_due_by_ms.map(crate::model::lot::text::format_time).unwrap_or_default(),
            "retired: {}",
            r.note
        );
    }
    if !retired.is_empty() {
        info!(
            retired = retired.len(),
            "objects the config no longer uses; `ladder check` lists them, `ladder prune` removes the empty ones"
        );
    }
    let differing = older
        .iter()
        .map(|o| crate::broker::drift::Difference {
            name: o.name.clone(),
            kind: crate::model::drift::Kind::Queue,
            detail: format!(
                "declared by an older Ladder, without {}; kept (a policy can add it)",
                o.missing.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
            ),
        })
        .collect();
    *state.drift.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(DriftSeen {
        registry,
        survey: crate::broker::drift::Survey { retired, differing },
        at_ms: crate::clock::now_ms(),
    }));
}

/// Declares the topology of `config` for the broker `connection` is open to, and warns about
/// queues kept in an older shape (see [`topology::OlderQueue`]), which it returns with the
/// ladders a release before the topology stream declared.
///
/// A ladder an earlier release declared keeps the forwarding layer of its fanout `N.L` and is
/// moved off its ways in of before (`upgrade`); a new ladder declares today's layout only.
async fn declare(
    connection: &Connection,
    config: &Config,
    known: Option<&crate::model::drift::Registry>,
) -> Result<Applied, TopologyError> {
    let version = topology::version_of(connection);
    let mut plan = crate::model::plan::plan_shared(&config.namespace, &config.ladders, version);
    let mut unrecorded = Vec::new();
    for spec in &config.ladders {
        let names = Names::of(&config.namespace, spec);
        // asked only of a ladder the stream does not know; a failure to ask ends the session
        let entry = async || crate::broker::drift::is_fanout(connection, &names.exchange).await;
        let before = upgrade::Before::of(known, &names, spec, entry)
            .await
            .map_err(|e| TopologyError::Broker {
                declaration: format!("the exchange {} as it is", names.exchange),
                source: match e {
                    crate::broker::cancels::CancelError::Broker(source) => source,
                    other => ladder_amqp::Error::Protocol(other.to_string()),
                },
            })?;
        if before.moves() {
            info!(ladder = %spec.name, layout = upgrade::LAYOUT, "moving a ladder declared by an earlier release to today's layout, behind N.L.next");
        }
        if before == upgrade::Before::Unrecorded {
            unrecorded.push(spec.name.clone());
        }
        plan.extend(upgrade::plan_ladder(&names, spec, version, before));
    }
    let older_queues = topology::apply(connection, &plan).await?;
    for older in &older_queues {
        let missing: Vec<&str> = older.missing.iter().map(|(k, _)| *k).collect();
        warn!(
            queue = %older.name,
            missing = %missing.join(", "),
            fix = %older.policy_command(),
            "a queue declared by an older Ladder (or on an older RabbitMQ) is kept as it is; RabbitMQ cannot add \
             arguments to an existing queue, so give it what it lacks with a policy"
        );
    }
    Ok(Applied {
        older: older_queues,
        unrecorded,
    })
}

/// What [`declare`] found that the drift record needs.
#[derive(Clone)]
struct Applied {
    /// Queues kept in an older shape.
    older: Vec<topology::OlderQueue>,
    /// Ladders a release before the topology stream declared: their own tiers of before are
    /// looked for and recorded, so they show as retired until pruned.
    unrecorded: Vec<String>,
}

/// How long a starting session may read the topology stream to learn which ladders it declared
/// before; past it every unbind is made.
const MIGRATED_READ: Duration = Duration::from_secs(5);

/// `apply` failed.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The broker could not be reached.
    #[error("cannot reach the broker: {0}")]
    Connect(#[from] ladder_amqp::Error),
    /// Declaring failed.
    #[error(transparent)]
    Topology(#[from] TopologyError),
}

/// How long a session waits for every ladder's cancellation stream to be read before it gives
/// up and reconnects (the stream holds at most 49 days of cancellations: a few thousand records
/// read in well under a second).
const CANCELS_CATCH_UP: Duration = Duration::from_secs(30);

/// How often the session looks whether the followers caught up.
const CANCELS_POLL: Duration = Duration::from_millis(10);

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
    loop {
        match session(&config, &ladders, &state, &shutdown, next_broker).await {
            Ok(()) => return Ok(()),
            Err(SessionError::Fatal(e)) => {
                health.set_ready(false);
                return Err(e);
            }
            Err(SessionError::Retry { error, broker }) => {
                health.set_ready(false);
                health.set_reason(DISCONNECTED, error.clone());
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

enum SessionError {
    Fatal(ServiceError),
    /// `broker`: the index of the broker the session served on, if it got that far.
    Retry {
        error: String,
        broker: Option<usize>,
    },
}

impl SessionError {
    fn retry(error: impl ToString) -> Self {
        SessionError::Retry {
            error: error.to_string(),
            broker: None,
        }
    }
}

/// One connection's life: connect, declare, serve, and end on shutdown or on the first failure.
async fn session(
    config: &Config,
    ladders: &[Arc<LadderRuntime>],
    state: &Arc<State>,
    shutdown: &CancellationToken,
    first_broker: usize,
) -> Result<(), SessionError> {
    let health = &state.health;
    let (connection, broker) = tokio::select! {
        connected = connect_from(&config.amqp, &config.amqp.connection_name, first_broker) => connected.map_err(SessionError::retry)?,
        () = shutdown.cancelled() => return Ok(()),
    };
    let _blocked = BlockedWatch::start(&connection, state);
    let version = connection.server_version().map(|(a, b, c)| format!("{a}.{b}.{c}"));
    info!(url = %config.amqp.urls[broker], broker_version = version.as_deref().unwrap_or("unknown"), "connected");
    let retry = |error: String| SessionError::Retry {
        error,
        broker: Some(broker),
    };
    let session_started = std::time::Instant::now();
    // what the namespace declared before: as this process last saw it, or read once at its first
    // session (a reconnect must not wait for a stream)
    let seen = state
        .drift
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_ref()
        .map(|seen| seen.registry.clone());
    let known = match seen {
        Some(registry) => Some(registry),
        None => tokio::time::timeout(
            MIGRATED_READ,
            crate::broker::drift::read(&connection, &config.namespace),
        )
        .await
        .ok()
        .and_then(Result::ok),
    };
    let declared = match declare(&connection, config, known.as_ref()).await {
        Ok(applied) => {
            look_at_drift(&connection, config, state, applied).await;
            Ok(())
        }
        Err(conflict @ TopologyError::Conflict { .. }) => Err(SessionError::Fatal(conflict.into())),
        Err(other) => Err(retry(other.to_string())),
    };
    if let Err(e) = declared {
        close(&connection).await;
        return Err(e);
    }
    debug!(took = ?session_started.elapsed(), "topology declared");

    // every ladder's cancellations and holds are read before any loop may deliver what they
    // cancel or hold
    let mut followers: JoinSet<Result<(), String>> = JoinSet::new();
    let follow_stop = CancellationToken::new();
    for ladder in ladders.iter().filter(|l| l.spec.exact_delays) {
        let span = info_span!("cancels", ladder = %ladder.spec.name);
        let (ladder, connection, stop) = (ladder.clone(), connection.clone(), follow_stop.clone());
        followers.spawn(
            async move {
                crate::broker::cancels::follow(&connection, &ladder.names, &ladder.cancels, &stop)
                    .await
                    .map_err(|e| format!("cannot follow the cancellations: {e}"))
            }
            .instrument(span),
        );
    }
    for ladder in ladders {
        let span = info_span!("holds", ladder = %ladder.spec.name);
        let (ladder, connection, stop) = (ladder.clone(), connection.clone(), follow_stop.clone());
        followers.spawn(
            async move {
                crate::broker::holds::follow(
                    &connection,
                    &ladder.names,
                    &ladder.spec,
                    &ladder.holds,
                    Some(&ladder.metrics.holds),
                    Some(&ladder.holds_changed),
                    &stop,
                )
                .await
                .map_err(|e| format!("cannot follow the holds: {e}"))
            }
            .instrument(span),
        );
    }
    // the followers' markers are publishes: while the broker blocks them (a resource alarm) the
    // catch-up waits for the alarm instead of timing out into a reconnect that would be blocked too
    let caught_up = async {
        let mut deadline = tokio::time::Instant::now() + CANCELS_CATCH_UP;
        while !ladders
            .iter()
            .filter(|l| l.spec.exact_delays)
            .all(|l| l.cancels.caught_up())
            || !ladders.iter().all(|l| l.holds.caught_up())
        {
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
        done = caught_up => done,
        Some(joined) = followers.join_next() => Err(match joined {
            Ok(Ok(())) => "a stream follower stopped".to_string(),
            Ok(Err(e)) => e,
            Err(panic) => format!("stream follower failed: {panic}"),
        }),
        () = shutdown.cancelled() => {
            followers.abort_all();
            close(&connection).await;
            return Ok(());
        }
    };
    if let Err(e) = reading {
        followers.abort_all();
        close(&connection).await;
        return Err(retry(e));
    }
    debug!(took = ?session_started.elapsed(), "cancellation and hold streams read");

    // the releasers: resumed destinations drain, the automatic hold polls
    let mut releasers = JoinSet::new();
    for ladder in ladders {
        let span = info_span!("releaser", ladder = %ladder.spec.name);
        let (ladder, connection, stop) = (ladder.clone(), connection.clone(), follow_stop.clone());
        releasers.spawn(crate::broker::holds::run_releaser(connection, ladder, stop).instrument(span));
    }

    let mut workers = JoinSet::new();
    let mut subscriptions = Vec::new();
    for ladder in ladders {
        for hop in Hop::ALL {
            // Not in a span: a span is entered and left on every poll of the loop, i.e. for
            // every delivery and confirm; the loop's events name their ladder and hop instead.
            let (ladder, connection, stop) = (ladder.clone(), connection.clone(), shutdown.clone());
            let grace = config.shutdown_grace;
            let (subscribed, is_subscribed) = tokio::sync::oneshot::channel();
            subscriptions.push(is_subscribed);
            workers.spawn(async move { relay::serve(hop, ladder, &connection, stop, grace, Some(subscribed)).await });
        }
    }
    // failed probes of the automatic hold, each ladder's intake hop on its own N.L.probes: no
    // backlog of the intake delays what the hold waits to hear
    for ladder in ladders {
        let (ladder, connection, stop) = (ladder.clone(), connection.clone(), shutdown.clone());
        let grace = config.shutdown_grace;
        let (subscribed, is_subscribed) = tokio::sync::oneshot::channel();
        subscriptions.push(is_subscribed);
        workers.spawn(async move {
            let probes = ladder.names.probes.clone();
            relay::serve_on(
                Hop::Intake,
                Some(&probes),
                ladder,
                &connection,
                stop,
                grace,
                Some(subscribed),
            )
            .await
        });
    }
    // what a shared tier dead-lettered for no ladder served here: the first ladder's due hop
    // checks it as its own (and parks what has no destination or is not allowed)
    if let Some(first) = ladders.first() {
        let (ladder, connection, stop) = (first.clone(), connection.clone(), shutdown.clone());
        let grace = config.shutdown_grace;
        let (subscribed, is_subscribed) = tokio::sync::oneshot::channel();
        subscriptions.push(is_subscribed);
        workers.spawn(async move {
            let stray = ladder.names.stray.clone();
            relay::serve_on(
                Hop::Due,
                Some(&stray),
                ladder,
                &connection,
                stop,
                grace,
                Some(subscribed),
            )
            .await
        });
    }
    // the due queues of ladders no ladder file names any more: what waited in their tiers still
    // comes due there (N.due routes it by its retry-ladder), and is drained by the first ladder's
    // due hop as N.stray is, until each is empty (then `ladder prune` may remove it)
    let mut drainers = JoinSet::new();
    if let Some(first) = ladders.first() {
        for queue in retired_due_queues(state) {
            let span = info_span!("retired", queue = %queue);
            let (ladder, connection, stop) = (first.clone(), connection.clone(), shutdown.clone());
            let grace = config.shutdown_grace;
            drainers.spawn(drain_retired(queue, ladder, connection, stop, grace).instrument(span));
        }
    }
    // ready once every consumer runs; a loop that fails first ends the session below
    let all_subscribed = async {
        for s in subscriptions {
            if s.await.is_err() {
                return false;
            }
        }
        true
    };
    let mut ready_pending = Box::pin(all_subscribed);
    let mut waiting_ready = true;
    let mut abandoned = 0;
    loop {
        let joined = tokio::select! {
            ready = &mut ready_pending, if waiting_ready => {
                waiting_ready = false;
                if ready {
                    health.clear_reason(DISCONNECTED);
                    health.set_stalled(None);
                    health.set_ready(true);
                    info!(ladders = ladders.len(), "ready");
                    // from now on a hop that stops moving with work waiting ends the session
                    let (ladders, connection, stop, state) =
                        (ladders.to_vec(), connection.clone(), follow_stop.clone(), state.clone());
                    let (stall_timeout, shutdown) = (config.amqp.stall_timeout, shutdown.clone());
                    // the namespace's, whatever its ladders; none to watch without a ladder
                    let heartbeat = (!ladders.is_empty()).then(|| Names::new(&config.namespace, "").watchdog);
                    followers.spawn(
                        async move {
                            crate::broker::watchdog::watch(&connection, heartbeat.as_deref(), &ladders, &state.health, stall_timeout, &stop, &shutdown)
                                .await
                        }
                        .instrument(info_span!("watchdog")),
                    );
                }
                continue;
            }
            joined = workers.join_next() => joined,
            Some(follower) = followers.join_next() => {
                let failure = match follower {
                    Ok(Ok(())) => "a stream follower stopped".to_string(),
                    Ok(Err(e)) => e,
                    Err(panic) => format!("stream follower failed: {panic}"),
                };
                health.set_ready(false);
                workers.abort_all();
                releasers.abort_all();
                while workers.join_next().await.is_some() {}
                close(&connection).await;
                return Err(retry(failure));
            }
        };
        let Some(joined) = joined else { break };
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
        follow_stop.cancel();
        followers.abort_all();
        releasers.abort_all();
        close(&connection).await;
        return Err(retry(failure));
    }
    follow_stop.cancel();
    while followers.join_next().await.is_some() {}
    while releasers.join_next().await.is_some() {}
    while drainers.join_next().await.is_some() {}
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

/// Drains the due queue of a retired ladder through `ladder`'s due hop (its checks, as for
/// `N.stray`) whenever it holds messages, and lets go of it once it is empty, so that a
/// consumer does not keep `ladder prune` from deleting it. Ends when the queue is gone or at
/// shutdown; a failure of its own is logged, never the session's.
async fn drain_retired(
    queue: String,
    ladder: Arc<LadderRuntime>,
    connection: Connection,
    shutdown: CancellationToken,
    grace: Duration,
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
                let serve = crate::broker::relay::serve_on(
                    Hop::Due,
                    Some(&queue),
                    ladder.clone(),
                    &connection,
                    stop.clone(),
                    grace,
                    None,
                );
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

async fn close(connection: &Connection) {
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, connection.close(200, "bye")).await;
}
