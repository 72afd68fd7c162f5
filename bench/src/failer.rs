//! A consumer that fails messages the way an application does, and times their retries.
//!
//! The same consumer drives every retry mechanism the benchmark compares, so they differ only
//! in how a failure is handed back ([`Fail`]): RabbitMQ 4.3's native delayed retry
//! (`basic.reject` with requeue), Ladder's dead-letter mode (`basic.reject` without requeue,
//! the queue dead-letters into the ladder) and Ladder's explicit mode (republish to the intake
//! with `retry-to`, ack once confirmed).
//!
//! Each message of a step fails its first `failures` deliveries, counted by the consumer itself
//! (a broker's `x-delivery-count` and Ladder's `retry-attempt` mean different things), or every
//! delivery while an outage is on ([`Failer::set_failing`]). Every delivery that follows a
//! failure is a retry, timed against the failure: lateness = receive time − (failure time +
//! the message's delay). Successful deliveries are recorded as [`Sample`]s, duplicates kept.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Result;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use ladder_amqp::{Channel, Confirmation, Connection, FieldTable};
use tokio::task::JoinHandle;

use crate::broker::{self, LATE_MS, OP_TIMEOUT, Sample, text};
use crate::now_ms;

/// How a [`Failer`] fails a message.
#[derive(Clone)]
pub enum Fail {
    /// `basic.reject` with requeue: the queue's own delayed retry brings it back.
    Reject,
    /// `basic.reject` without requeue: the queue dead-letters it (into a ladder's intake).
    DeadLetter,
    /// Republish to the ladder's intake exchange with `retry-to` (as a consumer does), ack once
    /// confirmed.
    Ladder {
        /// The ladder's intake exchange `N.L`.
        intake: String,
        /// A channel in confirm mode.
        publish: Channel,
    },
}

/// What the consumer saw of one step.
#[derive(Default)]
struct StepSeen {
    /// Per message: failed deliveries so far, and when the last one failed (ms).
    fails: HashMap<u64, (u32, u64)>,
    /// Every successful delivery, duplicates included.
    successes: Vec<Sample>,
    /// Messages delivered successfully at least once.
    done: HashSet<u64>,
    /// Successful deliveries more than [`LATE_MS`] late against publish + delay.
    late: u64,
    /// Per retry (a delivery after a failure): receive − (failure + delay), ms.
    retry_late: Vec<i64>,
    /// Deliveries failed.
    failed: u64,
}

/// One step's record, taken out of the consumer.
#[derive(Debug, Default, Clone)]
pub struct Seen {
    /// The first successful delivery of each message, by sequence number.
    pub samples: Vec<Sample>,
    /// Successful deliveries beyond the first of a message.
    pub duplicates: u64,
    /// Lateness of every retry, ms.
    pub retry_late: Vec<i64>,
    /// Deliveries the consumer failed.
    pub failed: u64,
}

/// A consumer that fails messages and records their retries, per step (the body's step id).
pub struct Failer {
    seen: Arc<Mutex<HashMap<u32, StepSeen>>>,
    failing: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Failer {
    /// Consumes `queue` on a channel of `conn` (prefetch 2 000); each message fails its first
    /// `failures` deliveries, handed back as `fail` says.
    pub async fn start(conn: &Connection, queue: &str, fail: Fail, failures: u32) -> Result<Self> {
        let ch = broker::bounded("open channel", OP_TIMEOUT, conn.create_channel()).await?;
        broker::bounded("qos", OP_TIMEOUT, ch.basic_qos(2000)).await?;
        let mut consumer = broker::bounded(
            &format!("consume {queue}"),
            OP_TIMEOUT,
            ch.basic_consume(queue, "", false, FieldTable::new()),
        )
        .await?;
        let seen: Arc<Mutex<HashMap<u32, StepSeen>>> = Arc::default();
        let failing = Arc::new(AtomicBool::new(false));
        let (sink, outage) = (seen.clone(), failing.clone());
        let queue = queue.to_string();
        let task = tokio::spawn(async move {
            let mut confirms = FuturesUnordered::new();
            loop {
                let d = tokio::select! {
                    d = consumer.next() => match d {
                        Some(Ok(d)) => d,
                        _ => break,
                    },
                    Some((tag, c)) = confirms.next(), if !confirms.is_empty() => {
                        let c: ladder_amqp::Result<Confirmation> = c;
                        let ok = matches!(c, Ok(Confirmation::Ack));
                        // a refused republish goes back to the queue, as a failed consumer's would
                        let _ = if ok { ch.basic_ack(tag, false) } else { ch.basic_reject(tag, true) };
                        continue;
                    }
                };
                let recv_ms = now_ms();
                let Some((step, seq, sent_ms, delay_ms)) = broker::parse_body(&d.body) else {
                    let _ = ch.basic_ack(d.delivery_tag, false);
                    continue;
                };
                let fail_it = {
                    let mut g = sink.lock().unwrap();
                    let s = g.entry(step).or_default();
                    let (failed_before, last_fail) = s.fails.get(&seq).copied().unwrap_or((0, 0));
                    if failed_before > 0 {
                        s.retry_late.push(recv_ms as i64 - (last_fail + delay_ms) as i64);
                    }
                    let fail_it = outage.load(Ordering::Relaxed) || failed_before < failures;
                    if fail_it {
                        s.fails.insert(seq, (failed_before + 1, now_ms()));
                        s.failed += 1;
                    } else {
                        let sample = Sample {
                            seq,
                            sent_ms,
                            delay_ms,
                            recv_ms,
                            due_at_ms: None,
                        };
                        if sample.late_e2e() > LATE_MS {
                            s.late += 1;
                        }
                        s.successes.push(sample);
                        s.done.insert(seq);
                    }
                    fail_it
                };
                if !fail_it {
                    let _ = ch.basic_ack(d.delivery_tag, false);
                    continue;
                }
                match &fail {
                    Fail::Reject => {
                        let _ = ch.basic_reject(d.delivery_tag, true);
                    }
                    Fail::DeadLetter => {
                        let _ = ch.basic_reject(d.delivery_tag, false);
                    }
                    Fail::Ladder { intake, publish } => {
                        let mut h = d.properties.headers.clone().unwrap_or_default();
                        h.set("retry-to", text(&queue));
                        let props = d.properties.clone().with_headers(h);
                        match publish.basic_publish(intake, "", true, &props, &d.body) {
                            Ok(c) => confirms.push(async move { (d.delivery_tag, c.await) }),
                            Err(_) => break,
                        }
                    }
                }
            }
        });
        Ok(Failer { seen, failing, task })
    }

    /// While on, every delivery fails (an outage of the consumer's dependency).
    pub fn set_failing(&self, on: bool) {
        self.failing.store(on, Ordering::Relaxed);
    }

    /// Messages of `step` delivered successfully so far (each counted once), and how many
    /// successful deliveries were more than [`LATE_MS`] late against publish + delay.
    pub fn progress(&self, step: u32) -> (u64, u64) {
        let g = self.seen.lock().unwrap();
        g.get(&step).map_or((0, 0), |s| (s.done.len() as u64, s.late))
    }

    /// Deliveries of `step` failed so far.
    pub fn failed(&self, step: u32) -> u64 {
        self.seen.lock().unwrap().get(&step).map_or(0, |s| s.failed)
    }

    /// Takes what was seen of `step`.
    pub fn take(&self, step: u32) -> Seen {
        let s = self.seen.lock().unwrap().remove(&step).unwrap_or_default();
        let mut samples = s.successes;
        let raw = samples.len();
        samples.sort_by_key(|s| (s.seq, s.recv_ms));
        samples.dedup_by_key(|s| s.seq);
        Seen {
            duplicates: (raw - samples.len()) as u64,
            samples,
            retry_late: s.retry_late,
            failed: s.failed,
        }
    }
}

impl Drop for Failer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
