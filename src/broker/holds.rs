//! Destination holds on the broker. A hold or a resume is recorded in the ladder's stream
//! `N.L.holds`, by the CLI, the API, the web page or the automatic hold. Followers read the
//! stream into the [`SharedHolds`] every relay loop of the ladder checks. The **releaser**
//! drains the held queues of resumed destinations at their rate and sends the automatic hold's
//! probes.
//!
//! Following reads the whole stream, as a hold lasts until it is resumed; where retention cut
//! it, from the first checkpoint that covers the cut. It is caught up once it read a marker it
//! appended itself, and no relay loop starts before. A hold is recorded only after the
//! destination was checked and its held queue declared; every follower declares the held queue
//! again before it applies the hold, so no due hop routes into a queue that does not exist.
//!
//! The releaser must not deliver faster than the rate asked: every held queue takes one active
//! consumer at a time (`x-single-active-consumer`), so however many replicas drain it, one does,
//! paced by a one-token bucket. What it takes it publishes as it was held (the due hop's
//! delivery properties), mandatory and confirmed, then acks; a returned one is parked as
//! `no-route`, like any delivery. Once a freed destination's held queue stayed empty for the
//! ladder's `held_queue_grace`, the releaser deletes it (the one exception to "Ladder deletes
//! nothing", ARCHITECTURE.md).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use ladder_amqp::{Channel, Confirmation, Connection, Consumer, Delivery, FieldTable, FieldValue, QueueOptions};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::broker::cancels::{CancelError, append, bounded, bounded_on};
use crate::broker::relay::{self, LadderRuntime};
use crate::broker::topology;
use crate::clock::now_ms;
use crate::model::backoff::Backoff;
use crate::model::holds::{
    AUTO, BreakerAction, CHECKPOINT_EVERY_BYTES, CHECKPOINT_FORMAT, Catchup, Checkpoint, Fold, HOLD_FORMAT, HoldAction,
    HoldRecord, HoldState, Holds, ProbeStep, SharedHolds,
};
use crate::model::ladder::LadderSpec;
use crate::model::lot::pace::{Pacer, Ramp, Rate};
use crate::model::names::{Hop, Names};
use crate::model::plan;
use crate::model::protocol::{self, Counted, Forward, ForwardKind};

/// The format of the catch-up marker this module appends.
const FOLLOW_MARKER_FORMAT: &str = "ladder.holds-marker/v1";

/// Records in flight to the follower before it acks.
const PREFETCH: u16 = 500;

/// How often the releaser polls the breaker of an automatic hold (and compares the drains it
/// runs with the holds, which it also does at once when a hold record changed them).
const RELEASER_TICK: Duration = Duration::from_millis(200);

/// Without an automatic hold, the releaser acts on the holds' changes as it is told of them;
/// it also compares every this often, as a net (an idle ladder wakes for nothing else).
const RECONCILE_EVERY: Duration = Duration::from_secs(5);

/// Released messages a drain keeps in flight at once (published, their confirm awaited), so
/// that the pacer's rate, not one confirm round trip per message, sets the pace. Also the
/// drain's prefetch, so it bounds what a drain holds unacked.
const RELEASE_WINDOW: u16 = 512;

/// The shortest wait a drain sleeps for: tokio's timer has millisecond resolution.
const MIN_SLEEP: Duration = Duration::from_millis(1);

/// How long a drain that is stopped waits for the releases it has in flight to be confirmed, so
/// that what the destination took is acked, not released again.
const RELEASE_SETTLE: Duration = Duration::from_secs(5);

/// A drain that received nothing for this long looks whether its held queue is empty (to end a
/// release).
const IDLE_CHECK: Duration = Duration::from_millis(500);

/// How often the prober of an automatic hold looks whether its probe is due.
const PROBE_TICK: Duration = Duration::from_millis(100);

/// How long a hold, a resume or a snapshot may take at most, for an operator's request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a hold or resume was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    /// The ladder may not deliver there.
    #[error("cannot hold {destination:?}: {reason}")]
    NotAllowed {
        /// The destination.
        destination: String,
        /// Why not.
        reason: String,
    },
    /// No such queue.
    #[error("cannot hold {0:?}: no such queue on the broker")]
    Missing(String),
    /// A resume of what is not held.
    #[error("{0:?} is not held")]
    NotHeld(String),
    /// A bad input (rate).
    #[error("{0}")]
    Invalid(String),
    /// Recording failed.
    #[error(transparent)]
    Record(#[from] CancelError),
    /// The broker failed.
    #[error(transparent)]
    Broker(#[from] ladder_amqp::Error),
    /// No such ladder.
    #[error("{0}")]
    UnknownLadder(String),
    /// Declaring the held queue failed.
    #[error("cannot declare the held queue: {0}")]
    Declare(String),
}

impl HoldError {
    /// A caller's mistake (exit 64, HTTP 4xx) rather than the broker's trouble.
    pub fn is_callers(&self) -> bool {
        matches!(
            self,
            HoldError::NotAllowed { .. } | HoldError::Missing(_) | HoldError::NotHeld(_) | HoldError::Invalid(_)
        )
    }
}

/// Checks that ladder `spec` may hold `destination` — allowed, and a queue that exists — and
/// declares its held queue.
async fn prepare(
    connection: &Connection,
    names: &Names,
    spec: &LadderSpec,
    destination: &str,
) -> Result<(), HoldError> {
    if destination.is_empty() || destination.len() > 255 {
        return Err(HoldError::Invalid("a destination queue has 1 to 255 bytes".into()));
    }
    if let Some(reason) = protocol::refuse_destination(spec, names, destination) {
        return Err(HoldError::NotAllowed {
            destination: destination.into(),
            reason,
        });
    }
    let channel = bounded("opening a channel", connection.create_channel()).await?;
    let passive = QueueOptions {
        passive: true,
        ..Default::default()
    };
    match tokio::time::timeout(
        REQUEST_TIMEOUT,
        channel.queue_declare(destination, passive, FieldTable::new()),
    )
    .await
    {
        Err(_) => return Err(HoldError::Declare("the broker did not answer".into())),
        Ok(Err(e)) if e.reply_code() == Some(404) => return Err(HoldError::Missing(destination.into())),
        Ok(Err(e)) => return Err(e.into()),
        Ok(Ok(_)) => {}
    }
    let _ = tokio::time::timeout(REQUEST_TIMEOUT, channel.close(200, "checked")).await;
    declare_held_queue(connection, names, spec, destination).await
}

async fn declare_held_queue(
    connection: &Connection,
    names: &Names,
    spec: &LadderSpec,
    destination: &str,
) -> Result<(), HoldError> {
    let declaration = plan::held_queue(names, spec, destination);
    match tokio::time::timeout(REQUEST_TIMEOUT, topology::apply(connection, &[declaration], &|_| {})).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(HoldError::Declare(e.to_string())),
        Err(_) => Err(HoldError::Declare("the broker did not answer".into())),
    }
}

/// Holds `destination` in the ladder: checks it, declares its held queue, and records the hold
/// by `by` (confirmed). Every replica then puts its due messages into the held queue.
pub async fn hold(
    connection: &Connection,
    names: &Names,
    spec: &LadderSpec,
    destination: &str,
    by: &str,
    why: &str,
) -> Result<HoldRecord, HoldError> {
    let record = HoldRecord::new(destination, HoldAction::Held, by, why, now_ms());
    record_hold(connection, names, spec, record).await
}

async fn record_hold(
    connection: &Connection,
    names: &Names,
    spec: &LadderSpec,
    record: HoldRecord,
) -> Result<HoldRecord, HoldError> {
    let (destination, by, why) = (&record.destination, &record.by, &record.why);
    prepare(connection, names, spec, destination).await?;
    append(connection, &names.holds, HOLD_FORMAT, &record.to_json()).await?;
    info!(ladder = %spec.name, destination, by, why, "destination hold recorded");
    Ok(record)
}

/// Resumes `destination`: records the resume by `by`; its held queue is then released at `rate`
/// (the ladder's `release_rate` if none), oldest first. The caller checks it is held (the CLI
/// and the API read the state first).
pub async fn resume(
    connection: &Connection,
    names: &Names,
    spec: &LadderSpec,
    destination: &str,
    by: &str,
    rate: Option<Rate>,
) -> Result<HoldRecord, HoldError> {
    let mut record = HoldRecord::new(destination, HoldAction::Resumed, by, "", now_ms());
    record.rate = Some(format_rate(rate.unwrap_or(spec.release_rate)));
    append(connection, &names.holds, HOLD_FORMAT, &record.to_json()).await?;
    info!(ladder = %spec.name, destination, by, rate = record.rate.as_deref().unwrap_or("-"), "destination resume recorded");
    Ok(record)
}

/// `10/s`, `3/m`, `1/h`: the form [`Rate`] parses.
pub fn format_rate(rate: Rate) -> String {
    let unit = match rate.per.as_secs() {
        60 => "m",
        3600 => "h",
        _ => "s",
    };
    format!("{}/{unit}", rate.count)
}

/// The holds of the ladder as the stream says now: read up to a marker appended first.
pub async fn snapshot(connection: &Connection, names: &Names, spec: &LadderSpec) -> Result<Holds, HoldError> {
    let shared = SharedHolds::default();
    let stop = CancellationToken::new();
    let following = follow(connection, names, spec, &shared, None, None, &stop);
    tokio::pin!(following);
    let deadline = tokio::time::sleep(REQUEST_TIMEOUT);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            ended = &mut following => {
                ended?;
                return Err(HoldError::Declare("the hold stream follower stopped".into()));
            }
            () = tokio::time::sleep(Duration::from_millis(5)) => {
                if shared.caught_up() {
                    stop.cancel();
                    let _ = (&mut following).await;
                    return Ok(shared.snapshot());
                }
            }
            () = &mut deadline => return Err(HoldError::Record(CancelError::Timeout(REQUEST_TIMEOUT, "reading the holds"))),
        }
    }
}

/// Follows `names.holds` into `holds` from its first record until `stop`, caught up once it read
/// its own marker. With `metrics` (the service's follower), transitions read after catching up
/// are logged and counted, and checkpoints are appended (see [`Checkpoint`]).
///
/// Retention may have removed the stream's oldest records. A follower whose first record is not
/// at offset 0 keeps what it reads until a checkpoint that covers the cut, then takes the
/// checkpoint's state and applies the kept records after it ([`Catchup`]): the state of a
/// follower that read everything. Every held queue of a restored state is declared before it
/// is applied, as for a `held` record.
pub async fn follow(
    connection: &Connection,
    names: &Names,
    spec: &LadderSpec,
    holds: &SharedHolds,
    metrics: Option<&crate::metrics::HoldMetrics>,
    changed_notify: Option<&tokio::sync::Notify>,
    stop: &CancellationToken,
) -> Result<(), HoldError> {
    let follower = Follower {
        connection,
        names,
        spec,
        holds,
        metrics,
        changed_notify,
        stop,
    };
    holds.set_caught_up(false);
    let mut reading = Reading::new();
    let marker = serde_json::json!({"format": FOLLOW_MARKER_FORMAT, "id": reading.marker_id});
    append(
        connection,
        &names.holds,
        FOLLOW_MARKER_FORMAT,
        marker.to_string().as_bytes(),
    )
    .await?;
    let channel = bounded_on(connection, "opening a channel", connection.create_channel()).await?;
    bounded_on(connection, "setting the prefetch", channel.basic_qos(PREFETCH)).await?;
    let mut args = FieldTable::default();
    args.set("x-stream-offset", FieldValue::string("first"));
    let mut consumer = bounded_on(
        connection,
        "subscribing to the holds",
        channel.basic_consume(&names.holds, "", false, args),
    )
    .await?;
    loop {
        let delivery = tokio::select! {
            () = stop.cancelled() => break,
            next = consumer.next() => match next {
                Some(delivery) => delivery?,
                None => return Err(HoldError::Broker(ladder_amqp::Error::ChannelGone)),
            },
        };
        let Some(offset) = delivery
            .properties
            .headers
            .as_ref()
            .and_then(|h| h.get("x-stream-offset"))
            .and_then(protocol::as_u64)
        else {
            warn!(ladder = %spec.name, "a hold stream delivery without x-stream-offset; skipped");
            channel.basic_ack(delivery.delivery_tag, false)?;
            continue;
        };
        let kind = delivery.properties.kind.as_ref().and_then(|k| k.to_str());
        let (fold, ours) = reading.fold(kind, &delivery.body, offset, spec, names);
        if !follower.apply(fold).await {
            return Ok(());
        }
        if ours && !holds.caught_up() {
            debug!(held = holds.snapshot().held_count(), "holds caught up");
            holds.set_caught_up(true);
        }
        channel.basic_ack(delivery.delivery_tag, false)?;
        if metrics.is_some() && reading.checkpoint_due(holds) {
            let checkpoint = holds.snapshot().checkpoint(offset, now_ms());
            match append(connection, &names.holds, CHECKPOINT_FORMAT, &checkpoint.to_json()).await {
                Ok(()) => debug!(ladder = %spec.name, upto = offset, "hold state checkpointed"),
                // the next record tries again; retention is far off
                Err(e) => warn!(ladder = %spec.name, error = %e, "cannot append a hold checkpoint"),
            }
            // counted again from here; this checkpoint, read back, resets it too
            reading.since_checkpoint = 0;
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), channel.basic_cancel(consumer.tag())).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), channel.close(200, "stopped")).await;
    Ok(())
}

/// A hold follower's reading of its stream: the catch-up, and when to write a checkpoint.
struct Reading {
    catchup: Catchup,
    /// The marker this follower appended: read back, it has caught up.
    marker_id: String,
    /// The state is the fold of the whole stream (not a cut read past without a checkpoint),
    /// so this follower may write checkpoints of it.
    exact: bool,
    /// Bytes read since the latest checkpoint.
    since_checkpoint: u64,
    /// Bytes after which a checkpoint is written: drawn once, as replicas reach it at
    /// different times and the first checkpoint in the stream resets every follower's count.
    threshold: u64,
}

impl Reading {
    fn new() -> Self {
        Reading {
            catchup: Catchup::default(),
            marker_id: crate::clock::unique_id("holds"),
            exact: true,
            since_checkpoint: 0,
            threshold: CHECKPOINT_EVERY_BYTES + fastrand::u64(0..=CHECKPOINT_EVERY_BYTES / 2),
        }
    }

    /// Folds the record at `offset`, of format `kind`; the flag: it is this follower's marker.
    fn fold(&mut self, kind: Option<&str>, body: &[u8], offset: u64, spec: &LadderSpec, names: &Names) -> (Fold, bool) {
        self.since_checkpoint = self.since_checkpoint.saturating_add(body.len() as u64);
        let nothing = Fold::Apply(Vec::new());
        match kind {
            Some(HOLD_FORMAT) => match HoldRecord::from_slice(body) {
                Some(record) => (self.catchup.record(offset, record), false),
                None => {
                    debug!("an unreadable hold record; skipped");
                    self.catchup.other(offset);
                    (nothing, false)
                }
            },
            Some(CHECKPOINT_FORMAT) => {
                self.since_checkpoint = 0;
                match Checkpoint::from_slice(body) {
                    Some(checkpoint) => (self.catchup.checkpoint(offset, &checkpoint, spec.release_rate), false),
                    None => {
                        self.catchup.other(offset);
                        (nothing, false)
                    }
                }
            }
            Some(FOLLOW_MARKER_FORMAT) => {
                self.catchup.other(offset);
                let ours = serde_json::from_slice::<serde_json::Value>(body)
                    .ok()
                    .is_some_and(|v| v["id"] == self.marker_id.as_str());
                if ours && self.catchup.uncovered() {
                    // only a retention below what a checkpoint spans can do this
                    error!(ladder = %spec.name, stream = %names.holds,
                           "the hold stream was cut by its retention and holds no checkpoint that covers the cut; \
                            holds recorded before the cut are lost (hold them again)");
                    self.exact = false;
                    return (Fold::Apply(self.catchup.give_up()), true);
                }
                (nothing, ours)
            }
            _ => {
                self.catchup.other(offset);
                (nothing, false)
            }
        }
    }

    /// Whether to write a checkpoint of `holds` now.
    fn checkpoint_due(&self, holds: &SharedHolds) -> bool {
        self.exact && holds.caught_up() && self.since_checkpoint >= self.threshold
    }
}

/// What a hold follower applies what it reads with.
struct Follower<'a> {
    connection: &'a Connection,
    names: &'a Names,
    spec: &'a LadderSpec,
    holds: &'a SharedHolds,
    metrics: Option<&'a crate::metrics::HoldMetrics>,
    changed_notify: Option<&'a tokio::sync::Notify>,
    stop: &'a CancellationToken,
}

impl Follower<'_> {
    /// Applies `fold`; `false` if `stop` came first.
    async fn apply(&self, fold: Fold) -> bool {
        let records = match fold {
            Fold::Apply(records) => records,
            Fold::Restore(state, records) => {
                for h in state.all().filter(|h| h.holds_back()) {
                    if !declare_until_done(self.connection, self.names, self.spec, &h.destination, self.stop).await {
                        return false;
                    }
                }
                debug!(ladder = %self.spec.name, held = state.held_count(), "hold state restored from a checkpoint");
                self.holds.restore(state);
                if let Some(notify) = self.changed_notify {
                    notify.notify_one();
                }
                records
            }
        };
        self.apply_records(&records).await
    }

    /// Applies hold records in order, each `held` one after its held queue is declared (before any
    /// due hop may route into it); `false` if `stop` came first.
    async fn apply_records(&self, records: &[HoldRecord]) -> bool {
        let Follower {
            connection,
            names,
            spec,
            holds,
            metrics,
            changed_notify,
            stop,
        } = *self;
        for record in records {
            let changed = loop {
                if record.action == HoldAction::Held
                    && !declare_until_done(connection, names, spec, &record.destination, stop).await
                {
                    return false;
                }
                match holds.apply_unless_deleting(record, spec.release_rate) {
                    Some(changed) => break changed,
                    // this process is deleting its held queue: declare it again once it is done
                    None => tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(20)) => {}
                        () = stop.cancelled() => return false,
                    },
                }
            };
            if changed && let Some(notify) = changed_notify {
                notify.notify_one();
            }
            if let Some(metrics) = metrics {
                metrics.held.set(holds.snapshot().held_count() as i64);
                if changed && holds.caught_up() {
                    let kind = match (record.action, record.by == AUTO) {
                        (HoldAction::Held, true) => "auto_held",
                        (HoldAction::Resumed, true) => "auto_resumed",
                        (action, _) => action.code(),
                    };
                    metrics.transition(kind);
                    info!(ladder = %spec.name, destination = %record.destination, transition = kind,
                          by = %record.by, why = %record.why, rate = record.rate.as_deref().unwrap_or("-"), "destination hold changed");
                }
            }
        }
        true
    }
}

/// Declares the held queue of `destination`, trying again with backoff; `false` if `stop` came
/// first.
async fn declare_until_done(
    connection: &Connection,
    names: &Names,
    spec: &LadderSpec,
    destination: &str,
    stop: &CancellationToken,
) -> bool {
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    while let Err(e) = declare_held_queue(connection, names, spec, destination).await {
        warn!(ladder = %spec.name, destination, error = %e, "cannot declare a held queue; trying again");
        tokio::select! {
            () = tokio::time::sleep(backoff.next_wait()) => {}
            () = stop.cancelled() => return false,
        }
    }
    true
}

/// What a drain was started for.
#[derive(Debug, Clone, Copy, PartialEq)]
enum DrainKind {
    /// Release the whole queue at `rate`; `since_ms`: the resume it belongs to.
    Release { rate: Rate, since_ms: u64 },
    /// A free destination: release stragglers (a lagging replica put them in after the release
    /// ended, or a crash left them); when idle for the ladder's `held_queue_grace`, stop and
    /// delete the held queue ([`delete_held_queue`]).
    Stragglers,
    /// An automatic hold: wait on its held queue; as the single active consumer, send its
    /// probes.
    Probe,
}

/// The releaser of one ladder, until `stop`: drains the held queue of every destination that is
/// releasing (and, for a while, of every free one, for stragglers), and runs the automatic
/// hold's breaker.
pub async fn run_releaser(connection: Connection, ladder: Arc<LadderRuntime>, stop: CancellationToken) {
    let mut drains: HashMap<String, (DrainKind, CancellationToken)> = HashMap::new();
    let mut tasks: JoinSet<String> = JoinSet::new();
    // free destinations whose straggler drain ended, by the change it was for
    let mut drained_free: HashMap<String, u64> = HashMap::new();
    let mut tick = tokio::time::interval(match ladder.spec.auto_hold {
        Some(_) => RELEASER_TICK,
        None => RECONCILE_EVERY,
    });
    // this replica, as the prober of an automatic hold
    let me = crate::clock::unique_id("releaser");
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            Some(done) = tasks.join_next() => {
                if let Ok(destination) = done
                    && let Some((kind, _)) = drains.remove(&destination)
                    && kind == DrainKind::Stragglers
                    && let Some(h) = ladder.holds.snapshot().get(&destination)
                {
                    drained_free.insert(destination, h.changed_at_ms);
                }
                continue;
            }
            () = ladder.holds_changed.notified() => {}
            _ = tick.tick() => {}
        }
        let holds = ladder.holds.snapshot();
        if let Some(policy) = ladder.spec.auto_hold {
            auto_hold(&connection, &ladder, &holds, &policy, &me).await;
        }
        // what should run
        let mut wanted: HashMap<String, DrainKind> = HashMap::new();
        for h in holds.all() {
            match h.state {
                // every replica waits on the held queue of an automatic hold; the single active
                // consumer, which holds its oldest message, is the prober
                HoldState::Held if h.probing.is_some() && ladder.spec.auto_hold.is_some() => {
                    wanted.insert(h.destination.clone(), DrainKind::Probe);
                }
                HoldState::Held => {}
                HoldState::Releasing { rate, since_ms } => {
                    wanted.insert(h.destination.clone(), DrainKind::Release { rate, since_ms });
                }
                HoldState::Free => {
                    if drained_free.get(&h.destination) != Some(&h.changed_at_ms) {
                        wanted.insert(h.destination.clone(), DrainKind::Stragglers);
                    }
                }
            }
        }
        // stop what should not run
        drains.retain(|destination, (kind, token)| {
            let keep = wanted.get(destination) == Some(kind);
            if !keep {
                token.cancel();
            }
            keep
        });
        for (destination, kind) in wanted {
            if drains.contains_key(&destination) {
                continue;
            }
            let token = stop.child_token();
            drains.insert(destination.clone(), (kind, token.clone()));
            let span = info_span!("release", ladder = %ladder.spec.name, destination = %destination);
            let (connection, ladder, me) = (connection.clone(), ladder.clone(), me.clone());
            tasks.spawn(
                async move {
                    let ended = match kind {
                        DrainKind::Probe => probe(&connection, &ladder, &destination, &me, &token).await,
                        _ => drain(&connection, &ladder, &destination, kind, &token).await,
                    };
                    if let Err(e) = ended {
                        debug!(error = %e, "a release ended; it starts again");
                        // a pause before it is started again
                        tokio::select! {
                            () = tokio::time::sleep(Duration::from_secs(1)) => {}
                            () = token.cancelled() => {}
                        }
                    }
                    destination
                }
                .instrument(span),
            );
        }
    }
    for (_, (_, token)) in drains {
        token.cancel();
    }
    while tasks.join_next().await.is_some() {}
}

/// One tick of the automatic hold on this replica. It records the probe failures its intake
/// saw, polls the breaker (which records new holds), and resumes a destination whose probe came
/// through: the prober does, or anyone once a further probe period went by. A probe due for a whole period that nobody sent means no replica holds a message
/// of the held queue (it is empty): a probe without a message is recorded, so it resumes.
async fn auto_hold(
    connection: &Connection,
    ladder: &LadderRuntime,
    holds: &Holds,
    policy: &crate::model::holds::AutoHoldPolicy,
    me: &str,
) {
    let failed = std::mem::take(
        &mut *ladder
            .probe_failures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    for (destination, probe) in failed {
        // a failure of the probe out now; repeats and older probes are not recorded
        let current = holds
            .get(&destination)
            .and_then(|h| h.probing.as_ref())
            .and_then(|p| p.probe.as_ref())
            .is_some_and(|(at, _)| *at == probe);
        if !current {
            continue;
        }
        info!(ladder = %ladder.spec.name, destination = %destination, probe, "a probe failed; holding on");
        let mut record = HoldRecord::new(&destination, HoldAction::ProbeFailed, me, "", now_ms());
        record.of = Some(probe);
        if let Err(e) = append(connection, &ladder.names.holds, HOLD_FORMAT, &record.to_json()).await {
            // the hold then resumes too early, and trips again if it still fails
            warn!(ladder = %ladder.spec.name, destination = %destination, error = %e, "cannot record a failed probe");
        }
    }
    let actions = ladder.merged_breaker().poll(now_ms(), |d| holds.holds_back(d));
    for BreakerAction::Hold { destination, why } in actions {
        warn!(ladder = %ladder.spec.name, destination = %destination, why = %why, "holding a failing destination automatically");
        let mut record = HoldRecord::new(&destination, HoldAction::Held, AUTO, &why, now_ms());
        record.hold_ms = Some(policy.probe_every.as_millis() as u64);
        if let Err(e) = record_hold(connection, &ladder.names, &ladder.spec, record).await {
            warn!(ladder = %ladder.spec.name, destination = %destination, error = %e, "the automatic hold failed");
        }
    }
    let now = now_ms();
    for h in holds.all() {
        match h.probe_step(now, policy.probe_every) {
            ProbeStep::Resume { prober, overdue } if overdue || prober == me => {
                info!(ladder = %ladder.spec.name, destination = %h.destination, "a probe came through; resuming automatically");
                if let Err(e) = resume(connection, &ladder.names, &ladder.spec, &h.destination, AUTO, None).await {
                    warn!(ladder = %ladder.spec.name, destination = %h.destination, error = %e, "the automatic resume failed");
                }
            }
            ProbeStep::Probe { of, overdue: true }
                if held_messages(connection, &ladder.names.held_queue(&h.destination)).await == Some(0) =>
            {
                debug!(ladder = %ladder.spec.name, destination = %h.destination, "nothing held to probe with");
                let mut record = HoldRecord::new(&h.destination, HoldAction::Probed, me, "nothing held", now);
                record.of = Some(of);
                let _ = append(connection, &ladder.names.holds, HOLD_FORMAT, &record.to_json()).await;
            }
            _ => {}
        }
    }
}

/// A channel in confirm mode consuming the held queue of `destination`, `prefetch` messages at
/// a time, or `None` if the queue does not exist (never held on this broker, or deleted by hand).
async fn consume_held(
    connection: &Connection,
    ladder: &LadderRuntime,
    destination: &str,
    prefetch: u16,
) -> Result<Option<(Channel, Consumer)>, HoldError> {
    let queue = ladder.names.held_queue(destination);
    let channel = bounded("opening a channel", connection.create_channel()).await?;
    bounded("setting the prefetch", channel.basic_qos(prefetch)).await?;
    bounded("selecting confirms", channel.confirm_select()).await?;
    match tokio::time::timeout(
        REQUEST_TIMEOUT,
        channel.basic_consume(&queue, "", false, FieldTable::new()),
    )
    .await
    {
        Ok(Ok(consumer)) => Ok(Some((channel, consumer))),
        Ok(Err(e)) if e.reply_code() == Some(404) => Ok(None),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(HoldError::Declare("the broker did not answer".into())),
    }
}

/// Waits on the held queue of an automatically held `destination` until `stop`. Only the single
/// active consumer receives: it keeps the oldest message (unacked) and, when a probe is due,
/// records it (`probed`, by `me`) and — once the stream shows its record won — releases that
/// message marked `retry-probe: <id>`. If this replica dies, the message goes back to the
/// queue and the next consumer becomes the prober.
async fn probe(
    connection: &Connection,
    ladder: &LadderRuntime,
    destination: &str,
    me: &str,
    stop: &CancellationToken,
) -> Result<(), HoldError> {
    let Some(policy) = ladder.spec.auto_hold else {
        return Ok(());
    };
    let Some((channel, mut consumer)) = consume_held(connection, ladder, destination, 1).await? else {
        return Ok(());
    };
    let result = 'consume: loop {
        let delivery = tokio::select! {
            () = stop.cancelled() => break Ok(()),
            next = consumer.next() => match next {
                Some(Ok(delivery)) => delivery,
                Some(Err(e)) => break Err(e.into()),
                None => break Err(HoldError::Broker(ladder_amqp::Error::ChannelGone)),
            },
        };
        // the prober now: wait for the probe's time, as the stream says
        let mut claimed: Option<u64> = None;
        loop {
            tokio::select! {
                () = stop.cancelled() => {
                    let _ = channel.basic_nack(delivery.delivery_tag, false, true);
                    break 'consume Ok(());
                }
                () = tokio::time::sleep(PROBE_TICK) => {}
            }
            let Some(hold) = ladder.holds.snapshot().get(destination).cloned() else {
                continue;
            };
            let probe_out = hold.probing.as_ref().and_then(|p| p.probe.clone());
            match (claimed, probe_out) {
                (Some(at), Some((out, by))) if out == at && by == me => {
                    let mut properties = delivery.properties.clone();
                    let headers = properties.headers.get_or_insert_with(FieldTable::new);
                    headers.set(protocol::header::RETRY_PROBE, FieldValue::LongLongInt(at as i64));
                    // a failed probe goes to the intake hop at once (which tells the hold), not
                    // into its next tier first, nor behind the intake's backlog: N.L.probes
                    headers.set(
                        protocol::header::RETRY_NEXT,
                        protocol::long_string(protocol::header::NEXT_PROBE),
                    );
                    ladder.metrics.holds.transition("probe");
                    info!(ladder = %ladder.spec.name, destination, probe = at, "releasing one message as a probe");
                    let _in_flight = crate::metrics::InFlight::enter(&ladder.metrics.hop(Hop::Due).in_flight);
                    let delivered = release_one(ladder, &channel, destination, &delivery, &properties).await;
                    match delivered {
                        Ok(delivered) => {
                            settle_release(ladder, &channel, delivery.delivery_tag, delivered)?;
                            continue 'consume;
                        }
                        Err(e) => break 'consume Err(e),
                    }
                }
                // another prober's record won (a consumer that failed over): keep waiting
                (Some(_), Some(_)) => claimed = None,
                (Some(at), None) if now_ms().saturating_sub(at) > REQUEST_TIMEOUT.as_millis() as u64 => claimed = None,
                (Some(_), None) => {}
                (None, _) => match hold.probe_step(now_ms(), policy.probe_every) {
                    ProbeStep::Probe { of, .. } => {
                        let at = now_ms();
                        let mut record = HoldRecord::new(destination, HoldAction::Probed, me, "", at);
                        record.of = Some(of);
                        if let Err(e) = append(connection, &ladder.names.holds, HOLD_FORMAT, &record.to_json()).await {
                            let _ = channel.basic_nack(delivery.delivery_tag, false, true);
                            break 'consume Err(e.into());
                        }
                        claimed = Some(at);
                    }
                    ProbeStep::Wait | ProbeStep::Resume { .. } if hold.state == HoldState::Held => {}
                    // resumed (or released): the release takes over this message
                    _ => {
                        let _ = channel.basic_nack(delivery.delivery_tag, false, true);
                        break 'consume Ok(());
                    }
                },
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), channel.basic_cancel(consumer.tag())).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), channel.close(200, "probed")).await;
    result
}

/// Drains the held queue of `destination` as `kind` says, until `stop`.
async fn drain(
    connection: &Connection,
    ladder: &LadderRuntime,
    destination: &str,
    kind: DrainKind,
    stop: &CancellationToken,
) -> Result<(), HoldError> {
    let Some((channel, mut consumer)) = consume_held(connection, ladder, destination, RELEASE_WINDOW).await? else {
        // no held queue (deleted by hand): nothing to release, and the due hops, whose publishes
        // into it come back and wait in a tier, deliver again once the release ended
        if let DrainKind::Release { since_ms, .. } = kind {
            released(connection, ladder, destination, since_ms, "no held queue", stop).await?;
        }
        return Ok(());
    };
    let mut pace = ReleasePace::new(ladder, destination, kind);
    let mut idle_since = Instant::now();
    let mut retire = false;
    // releases in flight, oldest first on the wire: each settles to (its delivery tag, delivered)
    let mut releasing = FuturesUnordered::new();
    let settled = |released: Result<(u64, bool), HoldError>| {
        released.and_then(|(tag, delivered)| settle_release(ladder, &channel, tag, delivered))
    };
    let result = loop {
        // a window full: settle one before taking the next
        if releasing.len() >= usize::from(RELEASE_WINDOW) {
            if let Some(released) = releasing.next().await {
                if let Err(e) = settled(released) {
                    break Err(e);
                }
                idle_since = Instant::now();
            }
            continue;
        }
        let next = tokio::select! {
            () = stop.cancelled() => break Ok(()),
            Some(released) = releasing.next(), if !releasing.is_empty() => {
                if let Err(e) = settled(released) {
                    break Err(e);
                }
                idle_since = Instant::now();
                continue;
            }
            next = tokio::time::timeout(IDLE_CHECK, consumer.next()) => next,
        };
        let delivery = match next {
            Ok(Some(Ok(delivery))) => delivery,
            Ok(Some(Err(e))) => break Err(e.into()),
            Ok(None) => break Err(HoldError::Broker(ladder_amqp::Error::ChannelGone)),
            Err(_) if !releasing.is_empty() => continue,
            Err(_) => match idle(connection, ladder, destination, kind, idle_since, stop).await {
                Idle::Wait => continue,
                Idle::Stop(result) => break result,
                Idle::Retire => {
                    retire = true;
                    break Ok(());
                }
            },
        };
        // paced: the rate holds from the first message on
        let wait = pace.delay(ladder, destination);
        // a timer sleeps at least a millisecond: shorter waits add up in the pacer until one is
        // worth a sleep, so a pace above 1 000/s is kept on average
        if wait >= MIN_SLEEP {
            tokio::select! {
                () = stop.cancelled() => {
                    let _ = channel.basic_nack(delivery.delivery_tag, false, true);
                    break Ok(());
                }
                () = tokio::time::sleep(wait) => {}
            }
        }
        let channel = &channel;
        releasing.push(async move {
            // counted in flight while held here, for the accounting identity
            let _in_flight = crate::metrics::InFlight::enter(&ladder.metrics.hop(Hop::Due).in_flight);
            let delivered = release_one(ladder, channel, destination, &delivery, &delivery.properties).await?;
            Ok::<_, HoldError>((delivery.delivery_tag, delivered))
        });
    };
    // what is in flight is settled before the channel closes (bounded): a release the
    // destination took is acked, not released a second time by the next drain
    let _ = tokio::time::timeout(RELEASE_SETTLE, async {
        while let Some(released) = releasing.next().await {
            let _ = settled(released);
        }
    })
    .await;
    drop(releasing);
    let _ = tokio::time::timeout(Duration::from_secs(5), channel.basic_cancel(consumer.tag())).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), channel.close(200, "released")).await;
    if retire && result.is_ok() {
        return delete_held_queue(connection, ladder, destination).await;
    }
    result
}

/// A drain's pace: its rate, and for a release the ramp up from it while the destination takes
/// what it gets.
struct ReleasePace {
    pacer: Pacer,
    ramp: Option<Ramp>,
}

impl ReleasePace {
    fn new(ladder: &LadderRuntime, destination: &str, kind: DrainKind) -> Self {
        match kind {
            DrainKind::Release { rate, .. } => ReleasePace {
                pacer: Pacer::new(rate),
                ramp: ladder
                    .spec
                    .release_ramp
                    .map(|every| Ramp::new(rate, every, now_ms(), ladder.failures_of(destination))),
            },
            DrainKind::Stragglers | DrainKind::Probe => ReleasePace {
                pacer: Pacer::new(ladder.spec.release_rate),
                ramp: None,
            },
        }
    }

    /// How long to wait before the next release; books it.
    fn delay(&mut self, ladder: &LadderRuntime, destination: &str) -> Duration {
        if let Some(ramp) = &mut self.ramp {
            let failures = ladder.failures_of(destination);
            self.pacer.set_interval(ramp.interval(now_ms(), failures));
        }
        self.pacer.delay(Instant::now())
    }
}

/// What a drain does after its held queue gave it nothing for a while.
enum Idle {
    /// Waits on.
    Wait,
    /// Stops, with this result.
    Stop(Result<(), HoldError>),
    /// Stops and deletes the held queue: a free destination's, idle for its grace.
    Retire,
}

/// A drain of `kind` found its held queue idle since `idle_since`: a release that finds it
/// empty has ended ([`released`]).
async fn idle(
    connection: &Connection,
    ladder: &LadderRuntime,
    destination: &str,
    kind: DrainKind,
    idle_since: Instant,
    stop: &CancellationToken,
) -> Idle {
    match kind {
        DrainKind::Release { since_ms, .. } => {
            if held_messages(connection, &ladder.names.held_queue(destination)).await == Some(0)
                && let Err(e) = released(connection, ladder, destination, since_ms, "", stop).await
            {
                return Idle::Stop(Err(e));
            }
            if stop.is_cancelled() {
                Idle::Stop(Ok(()))
            } else {
                Idle::Wait
            }
        }
        DrainKind::Stragglers if idle_since.elapsed() >= ladder.spec.held_queue_grace => Idle::Retire,
        DrainKind::Stragglers | DrainKind::Probe => Idle::Wait,
    }
}

/// Records that the release of `destination` (which began at `since_ms`) ended, then waits
/// for the follower to turn it free and stop this drain (or for 2 s).
async fn released(
    connection: &Connection,
    ladder: &LadderRuntime,
    destination: &str,
    since_ms: u64,
    why: &str,
    stop: &CancellationToken,
) -> Result<(), HoldError> {
    let mut record = HoldRecord::new(destination, HoldAction::Released, "release", why, now_ms());
    record.of = Some(since_ms);
    append(connection, &ladder.names.holds, HOLD_FORMAT, &record.to_json()).await?;
    tokio::select! {
        () = stop.cancelled() => {}
        () = tokio::time::sleep(Duration::from_secs(2)) => {}
    }
    Ok(())
}

/// Acks a released delivery (delivered, or parked) and counts it: as the due hop's progress
/// for the watchdog, and as released if delivered.
fn settle_release(ladder: &LadderRuntime, channel: &Channel, tag: u64, delivered: bool) -> Result<(), HoldError> {
    channel.basic_ack(tag, false)?;
    ladder.metrics.hop(Hop::Due).released.inc();
    if delivered {
        ladder.metrics.holds.released_messages.inc();
    }
    Ok(())
}

/// Deletes the held queue of a `destination` that is free and whose queue stayed empty for the
/// ladder's `held_queue_grace` since its release ended, then records `deleted` (every replica
/// forgets the destination). Only an empty queue without consumers is deleted, and nothing of
/// this process routes into it meanwhile ([`SharedHolds::begin_delete`]). A classic queue is
/// deleted `if-empty`, which the broker decides atomically. A quorum queue refuses `if-empty`,
/// so it is deleted only while this replica is the only consumer of `N.L.due`, when no other
/// replica can route into it; otherwise it is kept.
async fn delete_held_queue(
    connection: &Connection,
    ladder: &LadderRuntime,
    destination: &str,
) -> Result<(), HoldError> {
    let free_since = ladder
        .holds
        .snapshot()
        .get(destination)
        .filter(|h| h.state == HoldState::Free)
        .map(|h| h.changed_at_ms);
    let Some(free_since) = free_since else {
        return Ok(());
    };
    if !ladder.holds.caught_up() || !ladder.holds.begin_delete(destination, free_since) {
        return Ok(());
    }
    let deleted = delete_if_unused(connection, ladder, destination).await;
    ladder.holds.end_delete(destination);
    if !deleted? {
        return Ok(());
    }
    info!(ladder = %ladder.spec.name, destination, "deleted the held queue of a released destination");
    let mut record = HoldRecord::new(destination, HoldAction::Deleted, "release", "", now_ms());
    record.of = Some(free_since);
    append(connection, &ladder.names.holds, HOLD_FORMAT, &record.to_json()).await?;
    Ok(())
}

/// See [`delete_held_queue`]: whether the queue was deleted.
async fn delete_if_unused(
    connection: &Connection,
    ladder: &LadderRuntime,
    destination: &str,
) -> Result<bool, HoldError> {
    let queue = ladder.names.held_queue(destination);
    let channel = bounded("opening a channel", connection.create_channel()).await?;
    let inspect = |queue: String| {
        let channel = channel.clone();
        async move { tokio::time::timeout(REQUEST_TIMEOUT, channel.queue_inspect(&queue)).await }
    };
    let deleted = 'delete: {
        let held = match inspect(queue.clone()).await {
            Ok(Ok(info)) => info,
            // gone already (another replica deleted it and records it)
            Ok(Err(e)) if e.reply_code() == Some(404) => break 'delete Ok(false),
            Ok(Err(e)) => break 'delete Err(e.into()),
            Err(_) => break 'delete Err(HoldError::Declare("the broker did not answer".into())),
        };
        if held.message_count > 0 || held.consumer_count > 0 {
            // stragglers, or another replica's drain still running: it deletes it after its grace
            break 'delete Ok(false);
        }
        let gone = match ladder.spec.queue_type {
            crate::model::ladder::QueueType::Classic => {
                tokio::time::timeout(REQUEST_TIMEOUT, channel.queue_delete_if_empty(&queue)).await
            }
            crate::model::ladder::QueueType::Quorum => {
                let due = match inspect(ladder.names.due.clone()).await {
                    Ok(Ok(info)) => info.consumer_count,
                    _ => break 'delete Ok(false),
                };
                if due != 1 {
                    debug!(ladder = %ladder.spec.name, destination, due_consumers = due,
                           "a quorum held queue is kept while other replicas run (quorum queues refuse if-empty)");
                    break 'delete Ok(false);
                }
                tokio::time::timeout(REQUEST_TIMEOUT, channel.queue_delete(&queue)).await
            }
        };
        match gone {
            Ok(Ok(0)) => Ok(true),
            Ok(Ok(lost)) => {
                // only a publisher outside Ladder can have put them there
                error!(ladder = %ladder.spec.name, destination, lost, "a held queue deleted as empty held messages");
                Ok(true)
            }
            // 406: not empty after all (classic)
            Ok(Err(e)) if e.reply_code() == Some(406) => Ok(false),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(HoldError::Declare("the broker did not answer".into())),
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(5), channel.close(200, "retired")).await;
    deleted
}

/// Ready messages in `queue`, if the broker says.
pub async fn depth(connection: &Connection, queue: &str) -> Option<u32> {
    held_messages(connection, queue).await
}

async fn held_messages(connection: &Connection, queue: &str) -> Option<u32> {
    let channel = tokio::time::timeout(REQUEST_TIMEOUT, connection.create_channel())
        .await
        .ok()?
        .ok()?;
    let passive = QueueOptions {
        passive: true,
        ..Default::default()
    };
    let info = tokio::time::timeout(
        REQUEST_TIMEOUT,
        channel.queue_declare(queue, passive, FieldTable::new()),
    )
    .await
    .ok()?
    .ok();
    let _ = tokio::time::timeout(Duration::from_secs(5), channel.close(200, "counted")).await;
    info.map(|i| i.message_count)
}

/// Publishes one held message to `destination` (mandatory, confirmed) until the broker takes
/// it: a refusal (a full destination) is tried again with backoff, a return parks it, and so
/// does a cancellation of its message id. Whether it was delivered.
async fn release_one(
    ladder: &LadderRuntime,
    channel: &ladder_amqp::Channel,
    destination: &str,
    delivery: &Delivery,
    properties: &ladder_amqp::BasicProperties,
) -> Result<bool, HoldError> {
    if ladder.cancelled(&delivery.properties) {
        let park = protocol::cancelled_while_held(&delivery.properties, destination);
        relay::park_until_confirmed(Hop::Due, ladder, channel, delivery, &park, None).await?;
        return Ok(false);
    }
    let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));
    loop {
        let confirm = channel.basic_publish("", destination, true, properties, &delivery.body)?;
        match confirm.await? {
            Confirmation::Ack => {
                ladder.metrics.delivered(Duration::ZERO);
                let lag_ms = protocol::failure_lag_ms(&ladder.spec, delivery.properties.headers.as_ref());
                ladder
                    .breaker
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .delivered(destination, lag_ms, now_ms());
                return Ok(true);
            }
            Confirmation::Returned(returned) => {
                let forward = Forward {
                    exchange: "".into(),
                    routing_key: destination.into(),
                    properties: delivery.properties.clone(),
                    carry: None,
                    destination: destination.into(),
                    attempt: 0,
                    late_ms: 0,
                    due_at_ms: 0,
                    kind: ForwardKind::Deliver,
                    counted: Counted::Before,
                };
                let park = protocol::no_route(
                    Hop::Due,
                    &delivery.properties,
                    &forward,
                    returned.reply_code,
                    &returned.reply_text,
                );
                relay::park_until_confirmed(Hop::Due, ladder, channel, delivery, &park, None).await?;
                return Ok(false);
            }
            Confirmation::Nack | Confirmation::NotRequested => {
                // refused: the broker answered (the watchdog's refused, not stalled)
                ladder.metrics.hop(Hop::Due).publish_failures.inc();
                let pause = backoff.next_wait();
                warn!(ladder = %ladder.spec.name, destination, retry_in = ?pause, "the destination refused a released message; holding it and trying again");
                tokio::time::sleep(pause).await;
            }
        }
    }
}
