//! The depth poller: every `admin.poll_interval` it reads the message count of each ladder's
//! queues, exports them as `ladder_queue_messages`, checks the accounting identity
//! ([`crate::model::accounting`]) and publishes a [`Snapshot`] for `/api/ladders`.
//!
//! It owns one connection of its own (named `<amqp.connection_name>-poller`), reused across
//! polls, and reads with passive `queue.declare`, which never creates or changes anything. It
//! must not touch the relay's connection, consume, publish or declare: it is off the worker path,
//! and a slow or unreachable broker only delays its own next poll. Every broker call is bounded
//! by [`BROKER_CALL_TIMEOUT`]. A poll whose connection was lost while it read connects again and
//! reads everything again, up to [`POLL_ATTEMPTS`] times within the poll interval. So one lost
//! connection costs no poll, and the accounting sees one consistent read. A poll that still fails (the broker cannot be reached) is logged (warn
//! once, then debug) and retried at the next tick.
//!
//! What the counts mean (measured on RabbitMQ 3.10.8): for quorum and classic queues,
//! `message_count` is the number of *ready* messages — deliveries the service holds unacked are
//! not in it. For the stream `N.L.parked` it is the stream's length (records within retention),
//! which the broker refreshes only every few seconds, so the parked depth lags.
//!
//! The accounting check is per process. With several replicas each one sees every queue but
//! only its own traffic, so a replica checks only while it is the sole consumer of a ladder's
//! intake and due queues. With several replicas, sum the identity across them in Prometheus.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use ladder_amqp::{Channel, Connection};
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::admin::history::SharedHistory;
pub use crate::admin::snapshot::{AccountingStatus, LadderSnapshot, Rates, Snapshot};
use crate::broker::connect as service;
use crate::broker::state::State;
use crate::clock::now_ms;
use crate::config::{AmqpConfig, Config};
use crate::metrics::LadderMetrics;
use crate::model::accounting::{Counters, Ledger, Observation, Rules, Verdict};
use crate::model::ladder::LadderSpec;
use crate::model::names::Hop;
use crate::model::names::Names;

/// How long one broker call of a poll (connect excepted, which has its own bound in
/// [`service::connect`]) may take. Generous against a loaded broker, yet well below the time
/// an operator would notice stale depths; a call that takes longer drops the connection.
pub const BROKER_CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads one poll makes at most: the first, and the ones after a connection lost while reading
/// (each on a new connection). A broker that drops the poller's connection again at once is
/// not read harder than this; the next tick tries again.
pub const POLL_ATTEMPTS: usize = 3;

/// The pause before reading again after a lost connection.
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// How long closing the poller's connection may take (at shutdown, or to replace a broken one).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// The accounting rules: a quiet poll is exact (no traffic moved while or since it was taken),
/// so no tolerance is needed — a single lost message is reported. What remains is a message
/// briefly in no queue (in transit between a tier and `N.L.due`, or delivered and not yet
/// handled), which never lasts three polls in a row. A shortfall is judged only once it lasted
/// longer than a lost session takes to be noticed ([`accounting_rules`]).
pub fn accounting_rules(amqp: &AmqpConfig) -> Rules {
    Rules {
        tolerance: 0,
        polls: 3,
        settle_ms: shortfall_settle(amqp).as_millis() as u64,
    }
}

/// How long a shortfall must last before the accounting judges it: twice the time in which a
/// session that cannot serve is noticed (missed heartbeats, or the watchdog's stall timeout and
/// its probe's second), 10 s by default. A partition that shows as missing messages before
/// anything noticed it (a cut-off node answers the poller's reads from stale state) is then
/// judged after the lost session, as in doubt.
fn shortfall_settle(amqp: &AmqpConfig) -> Duration {
    let noticed = amqp.heartbeat_timeout.max(amqp.stall_timeout) + Duration::from_secs(2);
    noticed * 2
}

/// The queue roles whose ready messages count as waiting in the ladder: the tiers, `due` and
/// `quarantine` (what it holds is parked by the service).
fn is_waiting_role(role: &str) -> bool {
    role == "due" || role == "quarantine" || role == "held" || role.starts_with("delay.")
}

/// The service's counters of one ladder, read from its metric handles.
pub fn counters(metrics: &LadderMetrics) -> Counters {
    let (intake, due) = (metrics.hop(Hop::Intake), metrics.hop(Hop::Due));
    let gauge = |g: &prometheus_client::metrics::gauge::Gauge| u64::try_from(g.get()).unwrap_or(0);
    let quarantine = metrics.hop(Hop::Quarantine);
    Counters {
        entered: metrics.entered.get(),
        received_intake: intake.received.get(),
        refused_intake: intake.publish_failures.get(),
        received_due: due.received.get(),
        refused_due: due.publish_failures.get(),
        scheduled: metrics.scheduled_total(),
        delivered: metrics.delivered.get(),
        parked: metrics.parked_total(),
        in_flight_intake: gauge(&intake.in_flight),
        in_flight_due: gauge(&due.in_flight),
        in_flight_quarantine: gauge(&quarantine.in_flight),
    }
}

/// A ladder as the poller tracks it.
struct Tracked {
    spec: LadderSpec,
    queues: Vec<(String, String)>,
    metrics: LadderMetrics,
    ledger: Ledger,
    /// The `ladder_unaccounted_messages` value last exported.
    reported: u64,
    /// Whether other consumers shared the intake or due queue at the latest poll.
    shared: bool,
    /// The `ladder_in_doubt_messages` value last exported.
    reported_in_doubt: u64,
    /// Since the latest observation: a poll could not read the broker (a partition?).
    unread: bool,
    /// The service's session count (`ladder_reconnects_total`) at the latest observation.
    session: u64,
}

/// What one poll read from the broker for one ladder.
struct Read {
    depths: Vec<(String, Option<u64>)>,
    /// Consumers of the intake and due queues (`None` if either is missing).
    consumers: Option<(u32, u32)>,
}

/// Polls until `shutdown`, publishing each [`Snapshot`] on `publish` and folding it into
/// `history`.
pub async fn run(
    config: Arc<Config>,
    state: Arc<State>,
    publish: watch::Sender<Option<Arc<Snapshot>>>,
    history: SharedHistory,
    shutdown: CancellationToken,
) {
    let mut ladders: Vec<Tracked> = config
        .ladders
        .iter()
        .map(|spec| Tracked {
            queues: Names::of(&config.namespace, spec).queues(spec),
            metrics: state.metrics.ladder(spec),
            spec: spec.clone(),
            ledger: Ledger::default(),
            reported: 0,
            shared: false,
            reported_in_doubt: 0,
            unread: false,
            session: 0,
        })
        .collect();
    let amqp = AmqpConfig {
        connection_name: format!("{}-poller", config.amqp.connection_name),
        ..config.amqp.clone()
    };
    let mut broker = Broker::default();
    let mut previous: Option<Arc<Snapshot>> = None;
    let mut ticks = tokio::time::interval(config.admin.poll_interval);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            _ = ticks.tick() => {}
        }
        let snapshot = tokio::select! {
            () = shutdown.cancelled() => break,
            snapshot = poll(&amqp, &mut broker, &state, &mut ladders, previous.as_deref(), config.admin.poll_interval) => Arc::new(snapshot),
        };
        previous = Some(snapshot.clone());
        history.lock().unwrap_or_else(PoisonError::into_inner).record(&snapshot);
        publish.send_replace(Some(snapshot));
    }
    broker.reset().await;
    debug!("depth poller stopped");
}

/// One poll of every ladder: the counters before, every queue read, the counters after. A read
/// that lost its connection is made again, whole, on a new one, while `within` allows.
async fn poll(
    amqp: &AmqpConfig,
    broker: &mut Broker,
    state: &State,
    ladders: &mut [Tracked],
    previous: Option<&Snapshot>,
    within: Duration,
) -> Snapshot {
    let (before, ready, session, reads) = read_counted(amqp, broker, state, ladders, within).await;
    let (reads, broker_error) = match reads {
        Ok(reads) => (reads, None),
        Err(e) => (Vec::new(), Some(e.text)),
    };
    let readable = broker_error.is_none();
    broker.report(broker_error.as_deref());
    let at = Instant::now();
    let at_ms = now_ms();
    let session_after = state.metrics.reconnects.get();

    let afters: Vec<Counters> = ladders.iter().map(|l| counters(&l.metrics)).collect();
    let reads_if = |i: usize| if readable { reads.get(i) } else { None };
    let mut observed: Vec<Option<Observation>> = Vec::with_capacity(ladders.len());
    // the ladders of a namespace share their tier queues, whose depth cannot be split by ladder:
    // with more than one, each ladder's ledger checks them all together, every queue counted once
    let mut waiting_in: BTreeMap<String, u64> = BTreeMap::new();
    for (i, ladder) in ladders.iter_mut().enumerate() {
        let counted = Counted {
            before: before[i],
            after: afters[i],
            ready,
            session,
            session_after,
        };
        observed.push(reads_if(i).map(|read| observe(state, ladder, read, counted, &mut waiting_in)));
    }
    let together = (ladders.len() > 1)
        .then(|| observed.iter().copied().collect::<Option<Vec<Observation>>>())
        .flatten()
        .map(|all| Observation::together(&all, waiting_in.values().sum()));

    let mut entries = Vec::with_capacity(ladders.len());
    for (i, ladder) in ladders.iter_mut().enumerate() {
        let after = afters[i];
        let read = reads_if(i);
        if let Some(observation) = together.as_ref().or(observed[i].as_ref()) {
            let verdict = ladder.ledger.observe(observation, accounting_rules(amqp));
            report(ladder, verdict, state);
        }
        if !readable {
            ladder.unread = true;
        }
        let rates = previous
            .and_then(|p| p.ladder(&ladder.spec.name).map(|l| (p.at, l.counters)))
            .and_then(|(then, counters)| Rates::between(&counters, &after, at.saturating_duration_since(then)));
        entries.push(LadderSnapshot {
            name: ladder.spec.name.clone(),
            next_leaves: ladder.metrics.next_leaves(at_ms),
            lateness: ladder.metrics.lateness_counts(),
            depths: read.map(|r| r.depths.clone()),
            counters: after,
            rates,
            accounting: AccountingStatus {
                verdict: ladder.ledger.last().map_or("unchecked", |v| v.name()),
                anchored: ladder.ledger.anchored(),
                missing: ladder
                    .ledger
                    .missing()
                    .map(|m| m.clamp(i64::MIN.into(), i64::MAX.into()) as i64),
                unaccounted: ladder.ledger.unaccounted(),
                in_doubt: ladder.ledger.in_doubt(),
            },
        });
    }
    Snapshot {
        at,
        at_ms,
        broker_error: if readable { None } else { broker.last_error.clone() },
        ladders: entries,
    }
}

/// Reads every ladder's queues, again on a new connection after one was lost while `within`
/// allows; with the counters before, whether the service was ready, and its session count.
async fn read_counted(
    amqp: &AmqpConfig,
    broker: &mut Broker,
    state: &State,
    ladders: &[Tracked],
    within: Duration,
) -> (Vec<Counters>, bool, u64, Result<Vec<Read>, ReadError>) {
    let started = Instant::now();
    let mut attempt = 1;
    loop {
        // taken again with every read, so the accounting compares one read with its own counters
        let before: Vec<Counters> = ladders.iter().map(|l| counters(&l.metrics)).collect();
        let ready = state.health.is_ready();
        let session = state.metrics.reconnects.get();
        let reads = read_all(amqp, broker, state, ladders).await;
        match reads {
            Err(e) if e.lost && attempt < POLL_ATTEMPTS && started.elapsed() + RETRY_PAUSE < within => {
                debug!(error = %e.text, attempt, "depth poller lost its connection while reading; reading again");
                attempt += 1;
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            reads => return (before, ready, session, reads),
        }
    }
}

/// The counters one ladder's read was taken between, and whether a session served
/// throughout.
#[derive(Clone, Copy)]
struct Counted {
    before: Counters,
    after: Counters,
    /// The service was ready before the read.
    ready: bool,
    /// The session count before the read, and after it.
    session: u64,
    session_after: u64,
}

/// What one ladder's read tells its ledger; its depths go to the metrics, and its waiting
/// queues into `waiting_in` (a shared tier by its queue, counted once).
fn observe(
    state: &State,
    ladder: &mut Tracked,
    read: &Read,
    counted: Counted,
    waiting_in: &mut BTreeMap<String, u64>,
) -> Observation {
    for (role, messages) in &read.depths {
        match messages {
            Some(messages) => state.metrics.set_queue_messages(&ladder.spec.name, role, *messages),
            None => state.metrics.clear_queue_messages(&ladder.spec.name, role),
        }
        if is_waiting_role(role) {
            // a tier by its queue (shared), anything else as this ladder's own
            let queue = ladder.queues.iter().find(|(r, _)| r == role).map(|(_, q)| q.clone());
            let key = match queue {
                Some(queue) if role.starts_with("delay.") => queue,
                _ => format!("{}\u{0}{role}", ladder.spec.name),
            };
            waiting_in.insert(key, messages.unwrap_or(0));
        }
    }
    let waiting = read
        .depths
        .iter()
        .filter(|(role, _)| is_waiting_role(role))
        .map(|(_, messages)| messages.unwrap_or(0))
        .sum();
    let complete = read.depths.iter().all(|(_, messages)| messages.is_some());
    let shared = read.consumers.is_some_and(|(intake, due)| intake > 1 || due > 1);
    let checkable = counted.ready
        && state.health.is_ready()
        && complete
        && counted.session == counted.session_after
        && read.consumers == Some((1, 1));
    let observation = Observation {
        before: counted.before,
        after: counted.after,
        waiting,
        checkable,
        shared,
        // what went unconfirmed or unacked then may turn up late, or counted twice
        disrupted: ladder.unread || !checkable || ladder.session != counted.session_after,
        at_ms: crate::clock::now_ms(),
    };
    ladder.unread = false;
    ladder.session = counted.session_after;
    if shared != ladder.shared {
        ladder.shared = shared;
        if shared {
            info!(
                ladder = %ladder.spec.name,
                "other consumers share the intake or due queue (replicas?); the accounting check \
                 is per process, so it is off while they do"
            );
        }
    }
    observation
}

/// Every ladder's queues, and the held queues this process knows of (summed into one role `held`:
/// a destination is no label).
async fn read_all(
    amqp: &AmqpConfig,
    broker: &mut Broker,
    state: &State,
    ladders: &[Tracked],
) -> Result<Vec<Read>, ReadError> {
    let ready = state.health.is_ready();
    let mut reads = Vec::with_capacity(ladders.len());
    for ladder in ladders {
        let mut queues = ladder.queues.clone();
        if let Some(runtime) = state.ladder(&ladder.spec.name) {
            let holds = runtime.holds.snapshot();
            queues.extend(
                holds
                    .all()
                    .map(|h| ("held".to_string(), runtime.names.held_queue(&h.destination))),
            );
        }
        let mut read = broker.read(amqp, &queues, ready).await?;
        let held: Vec<Option<u64>> = read
            .depths
            .iter()
            .filter(|(r, _)| r == "held")
            .map(|(_, m)| *m)
            .collect();
        if !held.is_empty() {
            read.depths.retain(|(r, _)| r != "held");
            let sum = held.iter().copied().sum::<Option<u64>>();
            read.depths.push(("held".to_string(), sum));
        }
        reads.push(read);
    }
    Ok(reads)
}

/// Why a read of the broker failed.
#[derive(Debug)]
struct ReadError {
    text: String,
    /// The connection was open and was lost (closed, broken, or a call went unanswered): a new
    /// one may read at once. Not when connecting itself failed.
    lost: bool,
}

impl ReadError {
    fn lost(text: String) -> Self {
        ReadError { text, lost: true }
    }
}

/// Exports a verdict and logs what changed.
fn report(ladder: &mut Tracked, verdict: Verdict, state: &State) {
    let name = ladder.spec.name.as_str();
    let unaccounted = ladder.ledger.unaccounted();
    match verdict {
        Verdict::Unaccounted { missing } if missing != ladder.reported => {
            error!(
                ladder = name,
                unaccounted = missing,
                "messages the ladder cannot account for"
            );
        }
        Verdict::InDoubt { missing } if missing != ladder.reported_in_doubt => {
            warn!(
                ladder = name,
                in_doubt = missing,
                "messages missing after a disruption (a partition, a lost connection); in doubt, not lost: unacked \
                 deliveries and unconfirmed publishes of the lost session may still come back"
            );
        }
        Verdict::Rebased { surplus } => {
            info!(
                ladder = name,
                surplus,
                "found more messages than counted (duplicates, or published straight into a tier); taking them as the new reference"
            );
        }
        Verdict::Balanced | Verdict::Anchored if ladder.reported > 0 => {
            info!(ladder = name, "the ladder's messages are accounted for again");
        }
        Verdict::Unchecked if ladder.reported > 0 => {
            info!(
                ladder = name,
                "accounting check restarts (reconnect, or other consumers); clearing its alarm"
            );
        }
        _ => {}
    }
    let in_doubt = ladder.ledger.in_doubt();
    if in_doubt != ladder.reported_in_doubt {
        state.metrics.set_in_doubt(name, in_doubt);
        ladder.reported_in_doubt = in_doubt;
    }
    if unaccounted != ladder.reported {
        state.metrics.set_unaccounted(name, unaccounted);
        ladder.reported = unaccounted;
    }
}

/// Passive declares a poll has in flight at once, each on a channel of its own (the client
/// makes one call at a time per channel). Eight at once go out in one write and come back in
/// about one read, where one at a time took a round trip per queue.
const PARALLEL_READS: usize = 8;

/// The poller's own connection and channels, kept across polls.
#[derive(Default)]
struct Broker {
    connection: Option<Connection>,
    /// Up to [`PARALLEL_READS`]; `None` where one was closed (a passive declare of a missing
    /// queue closes its channel) or not opened yet.
    channels: Vec<Option<Channel>>,
    /// The error of the latest failed poll; `None` while polls succeed.
    last_error: Option<String>,
    /// Queues found missing, so each is logged once until it reappears.
    missing: HashSet<String>,
}

impl Broker {
    /// Reads the message count of every queue in `queues` (`(role, name)`), up to
    /// [`PARALLEL_READS`] at once. A missing queue is worth a warning only once the service
    /// declared its topology (`declared`).
    async fn read(
        &mut self,
        amqp: &AmqpConfig,
        queues: &[(String, String)],
        declared: bool,
    ) -> Result<Read, ReadError> {
        let mut depths = Vec::with_capacity(queues.len());
        let (mut intake_consumers, mut due_consumers) = (None, None);
        for batch in queues.chunks(PARALLEL_READS) {
            let counts = self.declare_passive(amqp, batch).await?;
            for ((role, queue), count) in batch.iter().zip(counts) {
                let count = match count {
                    Some((messages, consumers)) => {
                        if self.missing.remove(queue) {
                            info!(queue = %queue, "queue exists again");
                        }
                        match role.as_str() {
                            "intake" => intake_consumers = Some(consumers),
                            "due" => due_consumers = Some(consumers),
                            _ => {}
                        }
                        Some(u64::from(messages))
                    }
                    // a held queue is deleted once its release ended: no loss, nothing to say
                    None if role == "held" => Some(0),
                    None => {
                        if !declared {
                            debug!(queue = %queue, "queue not found (not declared yet)");
                        } else if self.missing.insert(queue.clone()) {
                            warn!(queue = %queue, "queue not found although the topology was declared; was it deleted?");
                        }
                        None
                    }
                };
                depths.push((role.clone(), count));
            }
        }
        Ok(Read {
            depths,
            consumers: intake_consumers.zip(due_consumers),
        })
    }

    /// `(messages, consumers)` of each queue of `batch` (at most [`PARALLEL_READS`]), read at
    /// once, each on a channel of its own; `None` for a queue that does not exist. `Err` if the
    /// broker cannot be read (the connection is then dropped, to be rebuilt next time).
    async fn declare_passive(
        &mut self,
        amqp: &AmqpConfig,
        batch: &[(String, String)],
    ) -> Result<Vec<Option<(u32, u32)>>, ReadError> {
        let mut channels = Vec::with_capacity(batch.len());
        for slot in 0..batch.len() {
            channels.push(self.channel(amqp, slot).await?);
        }
        let declared = futures_util::future::join_all(
            batch
                .iter()
                .zip(&channels)
                .map(|((_, queue), channel)| tokio::time::timeout(BROKER_CALL_TIMEOUT, channel.queue_inspect(queue))),
        )
        .await;
        let mut counts = Vec::with_capacity(batch.len());
        for (slot, ((_, queue), declared)) in batch.iter().zip(declared).enumerate() {
            match declared {
                Ok(Ok(q)) => counts.push(Some((q.message_count, q.consumer_count))),
                // a failed passive declare closes its channel: a new one is opened for the next
                Ok(Err(e)) if not_found(&e) => {
                    self.channels[slot] = None;
                    counts.push(None);
                }
                Ok(Err(e)) => {
                    self.reset().await;
                    return Err(ReadError::lost(format!("reading {queue}: {e}")));
                }
                Err(_) => {
                    self.reset().await;
                    return Err(ReadError::lost(format!(
                        "reading {queue}: no answer within {BROKER_CALL_TIMEOUT:?}"
                    )));
                }
            }
        }
        Ok(counts)
    }

    /// The open channel of `slot`, connecting and opening one first if needed.
    async fn channel(&mut self, amqp: &AmqpConfig, slot: usize) -> Result<Channel, ReadError> {
        if self.channels.len() <= slot {
            self.channels.resize(slot + 1, None);
        }
        if let Some(channel) = &self.channels[slot]
            && channel.is_open()
        {
            return Ok(channel.clone());
        }
        self.channels[slot] = None;
        if !self.connection.as_ref().is_some_and(Connection::is_open) {
            self.reset().await;
            self.channels.resize(slot + 1, None);
            let connection = service::connect(amqp).await.map_err(|e| ReadError {
                text: format!("cannot reach the broker: {e}"),
                lost: false,
            })?;
            self.connection = Some(connection);
        }
        let Some(connection) = &self.connection else {
            return Err(ReadError::lost("no connection".into()));
        };
        let channel = match tokio::time::timeout(BROKER_CALL_TIMEOUT, connection.create_channel()).await {
            Ok(Ok(channel)) => channel,
            Ok(Err(e)) => {
                self.reset().await;
                return Err(ReadError::lost(format!("opening a channel: {e}")));
            }
            Err(_) => {
                self.reset().await;
                return Err(ReadError::lost(format!(
                    "opening a channel: no answer within {BROKER_CALL_TIMEOUT:?}"
                )));
            }
        };
        self.channels[slot] = Some(channel.clone());
        Ok(channel)
    }

    /// Closes the connection (bounded: a dead or stuck broker must not hold up the poller) so the
    /// next call connects afresh.
    async fn reset(&mut self) {
        self.channels.clear();
        if let Some(connection) = self.connection.take() {
            let _ = tokio::time::timeout(CLOSE_TIMEOUT, connection.close(200, "resetting")).await;
        }
    }

    /// Logs a poll's outcome: a failure once at warn (then debug), and the recovery at info.
    fn report(&mut self, error: Option<&str>) {
        match (error, self.last_error.is_some()) {
            (Some(e), false) => warn!(error = %e, "depth poller cannot read the broker; retrying every poll"),
            (Some(e), true) => debug!(error = %e, "depth poller still cannot read the broker"),
            (None, true) => info!("depth poller reads the broker again"),
            (None, false) => {}
        }
        self.last_error = error.map(str::to_string);
    }
}

/// Whether `error` is the broker's 404 NOT_FOUND for a passive declare.
fn not_found(error: &ladder_amqp::Error) -> bool {
    error.reply_code() == Some(404)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_per_second_over_the_window() {
        let from = Counters {
            received_intake: 10,
            scheduled: 8,
            delivered: 1,
            parked: 2,
            ..Counters::default()
        };
        let to = Counters {
            received_intake: 30,
            scheduled: 18,
            delivered: 6,
            parked: 2,
            ..Counters::default()
        };
        let r = Rates::between(&from, &to, Duration::from_secs(5)).unwrap();
        assert_eq!((r.received, r.scheduled, r.delivered, r.parked), (4.0, 2.0, 1.0, 0.0));
        assert_eq!(r.window_ms, 5000);
        assert!(Rates::between(&from, &to, Duration::ZERO).is_none());
    }

    #[test]
    fn only_tiers_and_due_count_as_waiting() {
        assert!(is_waiting_role("due") && is_waiting_role("delay.10s") && is_waiting_role("quarantine"));
        assert!(!is_waiting_role("wait.10s"), "first failures not seen yet");
        assert!(!is_waiting_role("intake") && !is_waiting_role("parked"));
    }
}
