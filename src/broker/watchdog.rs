//! The session's watchdog: notices a hop that makes no progress while work waits for it, says
//! so in `/ready`, and ends the session so the supervisor moves to the next node.
//!
//! Missed heartbeats catch a node that went silent (`amqp.heartbeat_timeout`). This catches
//! the node that still talks but cannot serve: in a partition, a node cut off from the leaders
//! of the ladder's quorum queues answers heartbeats yet confirms no publish into them and
//! delivers nothing from them. Every `TICK` (500 ms) it looks at each hop's counters
//! ([`crate::model::progress`]: progress is a delivery settled — its publish confirmed, a
//! message a release took from a held queue included — or a publish refused; a delivery
//! received is not, as a node cut off from the rest may still hand out what it holds while it
//! confirms nothing); a hop with nothing in flight that did not move has its queue read (a
//! passive declare on this connection) to see whether messages wait for it. A hop with
//! work waiting and no progress for `amqp.stall_timeout` is stalled; a read the node does not
//! answer within that time is too (it asks the queue's leader). Both end the session: on another
//! node the hop moves again, and what it held goes back to its queue when the connection closes.
//!
//! A node cut off from the rest of its cluster also answers those reads at once, from its own
//! stale state (measured on 4.3: nothing ready, while the majority's new leaders held work for
//! the ladder). So while a hop is quiet the watchdog also publishes a heartbeat, at most every
//! `HEARTBEAT_EVERY`, into the namespace's `N.watchdog` (a quorum queue that keeps one message):
//! only a node that reaches a quorum confirms it. A heartbeat not confirmed within
//! `amqp.stall_timeout` ends the session as well.
//!
//! While the broker blocks publishers (a resource alarm, `connection.blocked`), waiting is
//! expected and the same on every node: the watchdog then judges nothing.

use std::sync::Arc;
use std::time::Duration;

use ladder_amqp::{Channel, Connection};
use tokio_util::sync::CancellationToken;
use tracing::{debug, trace, warn};

use crate::broker::relay::{Hop, LadderRuntime};
use crate::broker::state::Health;
use crate::clock::now_ms;
use crate::model::progress::{Look, Progress};

/// How often the watchdog looks.
const TICK: Duration = Duration::from_millis(500);

/// How often, at most, the watchdog publishes its heartbeat while a hop is quiet: with
/// `amqp.stall_timeout` (3 s by default) for its confirm, a node that cannot reach a quorum is
/// left within about 4 s of the cut even when nothing is in flight. A busy ladder sends none.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

/// A hop whose publishes the broker refused (nacked, or returned) this recently is answered,
/// not cut off: the relay retries a refused publish after up to 30 s, and another node would
/// refuse it too. Stalled then, it is not ready and says so, but the session goes on.
const REFUSED_RECENTLY: Duration = Duration::from_secs(60);

/// Watches until `stop` or `shutdown` (a draining hop takes no more deliveries: no stall);
/// `Err` (the reason) when a hop stalled or the node stopped answering.
pub async fn watch(
    connection: &Connection,
    heartbeat_queue: Option<&str>,
    ladders: &[Arc<LadderRuntime>],
    health: &Health,
    stall_timeout: Duration,
    stop: &CancellationToken,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    let mut dog = Watchdog {
        connection,
        heartbeat_queue,
        ladders,
        health,
        stall_timeout,
        progress: ladders.iter().map(|_| Default::default()).collect(),
        refusals: ladders.iter().map(|_| Default::default()).collect(),
        reported: None,
        channel: None,
        beat_at: None,
    };
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            // the session ends a follower that returns: wait for the end of the drain instead
            () = shutdown.cancelled() => {
                stop.cancelled().await;
                return Ok(());
            }
            _ = ticks.tick() => {}
        }
        if connection.is_blocked() {
            dog.forget();
            continue;
        }
        if !dog.heartbeat_when_quiet().await? {
            continue;
        }
        if let Looked::Refused(refused_stall) = dog.look().await? {
            dog.report(refused_stall);
        }
    }
}

/// What a look found, when no hop stalled.
enum Looked {
    /// An alarm came while the look waited: judged again at the next tick.
    Blocked,
    /// A hop that makes no progress because the broker refuses its publishes, if any.
    Refused(Option<String>),
}

/// The watchdog's view of a session's hops across its ticks.
struct Watchdog<'a> {
    connection: &'a Connection,
    heartbeat_queue: Option<&'a str>,
    ladders: &'a [Arc<LadderRuntime>],
    health: &'a Health,
    stall_timeout: Duration,
    progress: Vec<[Progress; 3]>,
    /// Per hop: the refusals seen, and when they last rose.
    refusals: Vec<[(u64, Option<u64>); 3]>,
    /// The refused stall last reported to readiness.
    reported: Option<String>,
    channel: Option<Channel>,
    beat_at: Option<tokio::time::Instant>,
}

impl Watchdog<'_> {
    /// The broker blocks the connection: what was seen means nothing, and no stall is reported.
    fn forget(&mut self) {
        self.progress.iter_mut().flatten().for_each(Progress::reset);
        if self.reported.take().is_some() {
            self.health.set_stalled(None);
        }
    }

    /// Publishes a heartbeat when any hop is quiet (at most once per `HEARTBEAT_EVERY`): a node
    /// that cannot reach a quorum confirms none. `Ok(false)`: an alarm came while it waited, so
    /// the tick is judged again at the next; `Err`: it did not confirm in time.
    async fn heartbeat_when_quiet(&mut self) -> Result<bool, String> {
        let any_quiet = self.ladders.iter().zip(self.progress.iter()).any(|(ladder, hops)| {
            Hop::ALL.into_iter().zip(hops.iter()).any(|(hop, p)| {
                let metrics = ladder.metrics.hop(hop);
                metrics.in_flight.get() == 0 && p.last_activity() == Some(activity_of(metrics))
            })
        });
        let Some(queue) = self.heartbeat_queue else {
            return Ok(true);
        };
        if !any_quiet || self.beat_at.is_some_and(|at| at.elapsed() < HEARTBEAT_EVERY) {
            return Ok(true);
        }
        self.beat_at = Some(tokio::time::Instant::now());
        match heartbeat(self.connection, &mut self.channel, queue, self.stall_timeout).await {
            Ok(()) => Ok(true),
            // an alarm came while the heartbeat waited: its publish is held, not lost
            Err(_) if self.connection.is_blocked() => Ok(false),
            Err(e) => {
                let reason = format!(
                    "stalled: the node did not confirm a heartbeat into {queue} within {}s: {e}",
                    self.stall_timeout.as_secs_f64()
                );
                warn!("{reason}; moving to another node");
                self.health.set_stalled(Some(reason.clone()));
                Err(reason)
            }
        }
    }

    /// Looks at every hop: `Err` names one that made no progress for the stall timeout with
    /// work waiting (reading its queue only when it did not move and has nothing in flight).
    async fn look(&mut self) -> Result<Looked, String> {
        let limit_ms = self.stall_timeout.as_millis() as u64;
        let mut refused_stall: Option<String> = None;
        for (l, ladder) in self.ladders.iter().enumerate() {
            for (h, hop) in Hop::ALL.into_iter().enumerate() {
                let metrics = ladder.metrics.hop(hop);
                let refused = &mut self.refusals[l][h];
                let refusals_now = metrics.publish_failures.get() + metrics.returned.get();
                if refusals_now != refused.0 {
                    *refused = (refusals_now, Some(now_ms()));
                }
                let refused_recently = refused
                    .1
                    .is_some_and(|at| now_ms().saturating_sub(at) < REFUSED_RECENTLY.as_millis() as u64);
                let activity = activity_of(metrics);
                let in_flight = u64::try_from(metrics.in_flight.get()).unwrap_or(0);
                // a moving hop is fine, and one with publishes in flight has work waiting anyway
                let quiet = in_flight == 0 && self.progress[l][h].last_activity() == Some(activity);
                let ready = if quiet {
                    let queue = queue_of(ladder, hop);
                    match read_ready(self.connection, &mut self.channel, queue, self.stall_timeout).await {
                        Ok(ready) => ready,
                        // a blocked connection is not read by the broker until the alarm clears
                        Err(_) if self.connection.is_blocked() => return Ok(Looked::Blocked),
                        Err(e) => {
                            let reason = format!(
                                "stalled: {}/{hop} the node did not answer a read of {queue} within {}s: {e}",
                                ladder.spec.name,
                                self.stall_timeout.as_secs_f64()
                            );
                            self.health.set_stalled(Some(reason.clone()));
                            return Err(reason);
                        }
                    }
                } else {
                    None
                };
                let look = Look {
                    activity,
                    in_flight,
                    ready,
                };
                let Some(ms) = self.progress[l][h].look(now_ms(), look, limit_ms) else {
                    continue;
                };
                let reason = format!(
                    "stalled: {}/{hop} no progress for {}s with work waiting",
                    ladder.spec.name,
                    ms.div_ceil(1000)
                );
                if refused_recently {
                    // the broker refuses its publishes: honest, but no reason to move
                    refused_stall.get_or_insert(format!("{reason} (the broker refuses its publishes)"));
                    continue;
                }
                if self.connection.is_blocked() {
                    // blocked since the tick began: waiting is expected, judged again after
                    return Ok(Looked::Blocked);
                }
                warn!(ladder = %ladder.spec.name, %hop, in_flight, ready = ?ready, "{reason}; moving to another node");
                self.health.set_stalled(Some(reason.clone()));
                return Err(reason);
            }
        }
        Ok(Looked::Refused(refused_stall))
    }

    /// Reports a stall the broker's refusals explain to readiness, once per change.
    fn report(&mut self, refused_stall: Option<String>) {
        if refused_stall != self.reported {
            if let Some(reason) = &refused_stall {
                warn!("{reason}");
            }
            self.health.set_stalled(refused_stall.clone());
            self.reported = refused_stall;
        }
    }
}

/// What the broker answered a hop so far: deliveries settled (their publishes confirmed) and
/// publishes refused or returned. Deliveries received are no progress by themselves: a node cut
/// off from the rest may hand out what its old leader still holds while it confirms nothing.
fn activity_of(metrics: &crate::metrics::HopMetrics) -> u64 {
    let settled: u64 = metrics.duration.counts().iter().sum();
    // a release from a held queue is the due hop's work too (it counts in its in_flight)
    settled + metrics.released.get() + metrics.publish_failures.get() + metrics.returned.get()
}

fn queue_of(ladder: &LadderRuntime, hop: Hop) -> &str {
    match hop {
        Hop::Intake => &ladder.names.intake_queue,
        Hop::Due => &ladder.names.due,
        Hop::Quarantine => &ladder.names.quarantine,
    }
}

/// The watchdog's channel, in confirm mode: opened on first use, again after a 404 closed it.
async fn open<'c>(connection: &Connection, channel: &'c mut Option<Channel>) -> Result<&'c Channel, String> {
    if !channel.as_ref().is_some_and(Channel::is_open) {
        let ch = connection.create_channel().await.map_err(|e| e.to_string())?;
        ch.confirm_select().await.map_err(|e| e.to_string())?;
        *channel = Some(ch);
    }
    channel.as_ref().ok_or_else(|| "no channel".to_string())
}

/// Publishes one heartbeat into `queue` and waits for the broker's answer: `Ok` for any answer
/// (confirmed, refused or returned: the node spoke for its cluster), `Err` if none came in time.
async fn heartbeat(
    connection: &Connection,
    channel: &mut Option<Channel>,
    queue: &str,
    within: Duration,
) -> Result<(), String> {
    let send = async {
        let ch = open(connection, channel).await?;
        let properties = ladder_amqp::BasicProperties {
            delivery_mode: Some(2),
            ..Default::default()
        };
        let confirm = ch
            .basic_publish("", queue, true, &properties, b"")
            .map_err(|e| e.to_string())?;
        confirm.await.map(|_| ()).map_err(|e| e.to_string())
    };
    tokio::time::timeout(within, send)
        .await
        .unwrap_or_else(|_| Err("no answer".to_string()))
}

/// Ready messages in `queue`, read on the watchdog's channel: `Ok(None)` if the queue is
/// missing, `Err` if the node did not answer in time.
async fn read_ready(
    connection: &Connection,
    channel: &mut Option<Channel>,
    queue: &str,
    within: Duration,
) -> Result<Option<u64>, String> {
    let read = async {
        let ch = open(connection, channel).await?;
        match ch.queue_inspect(queue).await {
            Ok(info) => {
                trace!(
                    queue,
                    ready = info.message_count,
                    consumers = info.consumer_count,
                    "watchdog read"
                );
                Ok(Some(u64::from(info.message_count)))
            }
            Err(e) if e.reply_code() == Some(404) => {
                debug!(queue, "watchdog: queue not found");
                Ok(None)
            }
            Err(e) => Err(e.to_string()),
        }
    };
    tokio::time::timeout(within, read)
        .await
        .unwrap_or_else(|_| Err("no answer".to_string()))
}
