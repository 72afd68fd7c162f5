//! Broker plumbing for the benchmark: bounded operations, the registry of everything the bench
//! declared (deleted at the end, also after a failure or Ctrl-C), queue depths, a paced
//! publisher with confirms, and the destination collector that timestamps redeliveries.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use ladder_amqp::{
    BasicProperties, Channel, Confirmation, ConnectOptions, Connection, Delivery, FieldTable, FieldValue, QueueOptions,
};
use tokio::task::JoinHandle;

use crate::now_ms;

/// Upper bound for one broker operation (declare, purge, waiting for a publish confirm).
pub const OP_TIMEOUT: Duration = Duration::from_secs(30);

/// Deleting a queue that holds a million messages takes the broker a while.
const DELETE_TIMEOUT: Duration = Duration::from_secs(180);

/// Every message body is padded to this size: "small messages", like a typical job id payload.
pub const BODY_BYTES: usize = 100;

/// Awaits `fut` for at most `limit`, naming `what` in the error.
pub async fn bounded<T, E: std::fmt::Display>(
    what: &str,
    limit: Duration,
    fut: impl Future<Output = Result<T, E>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(anyhow!("{what}: {e}")),
        Err(_) => Err(anyhow!("{what}: timed out after {limit:?}")),
    }
}

/// Opens a named connection, bounded.
pub async fn connect(url: &str, name: &str) -> Result<Connection> {
    let options = ConnectOptions {
        uri: url.parse().map_err(|e| anyhow!("broker url: {e}"))?,
        connection_name: Some(name.to_string()),
        tls: None,
        dead_after: None,
    };
    bounded("connect to the broker", OP_TIMEOUT, Connection::connect(&options)).await
}

/// A channel in confirm mode.
pub async fn confirm_channel(conn: &Connection) -> Result<Channel> {
    let ch = bounded("open channel", OP_TIMEOUT, conn.create_channel()).await?;
    bounded("confirm.select", OP_TIMEOUT, ch.confirm_select()).await?;
    Ok(ch)
}

/// Names of everything the bench declared or caused to be declared, for the final cleanup.
#[derive(Clone, Default)]
pub struct Registry {
    inner: Arc<Mutex<(Vec<String>, Vec<String>)>>,
}

impl Registry {
    /// Remembers a queue to delete.
    pub fn queue(&self, name: &str) {
        let mut g = self.inner.lock().unwrap();
        if !g.0.iter().any(|q| q == name) {
            g.0.push(name.to_string());
        }
    }

    /// Remembers an exchange to delete.
    pub fn exchange(&self, name: &str) {
        let mut g = self.inner.lock().unwrap();
        if !g.1.iter().any(|e| e == name) {
            g.1.push(name.to_string());
        }
    }

    /// Remembers every queue and exchange of a topology plan.
    pub fn plan(&self, plan: &[ladder::broker::topology::Declaration]) {
        use ladder::broker::topology::Declaration;
        for d in plan {
            match d {
                Declaration::Queue { name, .. } => self.queue(name),
                Declaration::Exchange { name, .. } => self.exchange(name),
                Declaration::Binding { .. } | Declaration::Unbinding { .. } => {}
            }
        }
    }

    /// Every name remembered.
    pub fn snapshot(&self) -> Vec<String> {
        let g = self.inner.lock().unwrap();
        g.0.iter().chain(g.1.iter()).cloned().collect()
    }

    /// Deletes everything remembered (each on its own channel: a failed delete closes it) and
    /// returns what could not be deleted.
    pub async fn delete_all(&self, url: &str) -> Vec<String> {
        let (queues, exchanges) = std::mem::take(&mut *self.inner.lock().unwrap());
        if queues.is_empty() && exchanges.is_empty() {
            return vec![];
        }
        let conn = match connect(url, "ladder-bench-cleanup").await {
            Ok(c) => c,
            Err(e) => return vec![format!("cannot connect for cleanup: {e}")],
        };
        let mut failed = vec![];
        for q in &queues {
            let result = async {
                let ch = bounded("open channel", OP_TIMEOUT, conn.create_channel()).await?;
                let r = bounded(&format!("delete queue {q}"), DELETE_TIMEOUT, ch.queue_delete(q)).await;
                let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "deleted")).await;
                r
            }
            .await;
            if let Err(e) = result {
                failed.push(e.to_string());
            }
        }
        for x in &exchanges {
            let result = async {
                let ch = bounded("open channel", OP_TIMEOUT, conn.create_channel()).await?;
                let r = bounded(&format!("delete exchange {x}"), OP_TIMEOUT, ch.exchange_delete(x)).await;
                let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "deleted")).await;
                r
            }
            .await;
            if let Err(e) = result {
                failed.push(e.to_string());
            }
        }
        let _ = tokio::time::timeout(OP_TIMEOUT, conn.close(200, "bye")).await;
        failed
    }
}

/// Declares a durable queue (and registers it for deletion).
pub async fn declare_queue(conn: &Connection, registry: &Registry, name: &str, args: FieldTable) -> Result<()> {
    registry.queue(name);
    let ch = bounded("open channel", OP_TIMEOUT, conn.create_channel()).await?;
    let options = QueueOptions {
        durable: true,
        ..Default::default()
    };
    bounded(
        &format!("declare queue {name}"),
        OP_TIMEOUT,
        ch.queue_declare(name, options, args),
    )
    .await?;
    let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "declared")).await;
    Ok(())
}

/// Ready messages and consumers of `queue` (a passive declare).
pub async fn depth(conn: &Connection, queue: &str) -> Result<(u32, u32)> {
    let ch = bounded("open channel", OP_TIMEOUT, conn.create_channel()).await?;
    let q = bounded(&format!("passive declare {queue}"), OP_TIMEOUT, ch.queue_inspect(queue)).await?;
    let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "depth")).await;
    Ok((q.message_count, q.consumer_count))
}

/// Whether an exchange named `name` exists (a passive declare).
pub async fn exchange_exists(conn: &Connection, name: &str) -> bool {
    let Ok(Ok(ch)) = tokio::time::timeout(OP_TIMEOUT, conn.create_channel()).await else {
        return false;
    };
    let found = matches!(
        tokio::time::timeout(OP_TIMEOUT, ch.exchange_inspect(name)).await,
        Ok(Ok(()))
    );
    if found {
        let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "checked")).await;
    }
    found
}

/// Empties `queue`.
pub async fn purge(conn: &Connection, queue: &str) -> Result<u32> {
    let ch = bounded("open channel", OP_TIMEOUT, conn.create_channel()).await?;
    let n = bounded(&format!("purge {queue}"), DELETE_TIMEOUT, ch.queue_purge(queue)).await?;
    let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "purged")).await;
    Ok(n)
}

/// Deletes `queue` now (the registry would do it at the end; a million messages should not wait).
pub async fn delete_queue(conn: &Connection, queue: &str) -> Result<u32> {
    let ch = bounded("open channel", OP_TIMEOUT, conn.create_channel()).await?;
    let n = bounded(&format!("delete queue {queue}"), DELETE_TIMEOUT, ch.queue_delete(queue)).await?;
    let _ = tokio::time::timeout(OP_TIMEOUT, ch.close(200, "deleted")).await;
    Ok(n)
}

/// Polls until every queue in `queues` is empty, at most `within`; returns whether they were.
pub async fn wait_empty(conn: &Connection, queues: &[String], within: Duration) -> Result<bool> {
    let deadline = Instant::now() + within;
    loop {
        let mut total = 0u64;
        for q in queues {
            total += u64::from(depth(conn, q).await?.0);
        }
        if total == 0 {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A long-string header value.
pub fn text(s: &str) -> FieldValue {
    FieldValue::string(s)
}

/// The body of a benchmark message: who it is and when it was sent, padded to [`BODY_BYTES`].
pub fn body(step: u32, seq: u64, delay_ms: u64) -> Vec<u8> {
    let mut b = format!("B {step} {seq} {} {delay_ms} ", now_ms()).into_bytes();
    b.resize(BODY_BYTES.max(b.len()), b'.');
    b
}

/// One message to publish.
pub struct Msg {
    /// Exchange.
    pub exchange: String,
    /// Routing key.
    pub routing_key: String,
    /// Properties.
    pub properties: BasicProperties,
    /// Body.
    pub body: Vec<u8>,
}

/// What a publishing run achieved.
#[derive(Debug, Clone, Copy, Default)]
pub struct Published {
    /// Confirmed by the broker (routed).
    pub confirmed: u64,
    /// Nacked or returned (unroutable).
    pub refused: u64,
    /// From the first publish to the last one written (not its confirm).
    pub secs: f64,
    /// Whether `stop` ended the run early.
    pub stopped: bool,
}

/// Publishes `count` messages made by `make(seq)`, paced at `rate` per second (`None`: as fast
/// as `window` outstanding confirms allow), until done or `stop()` says so. Waits for every
/// confirm, at most [`OP_TIMEOUT`] after the last publish.
pub async fn publish(
    ch: &Channel,
    rate: Option<f64>,
    count: u64,
    window: usize,
    mut make: impl FnMut(u64) -> Msg,
    mut stop: impl FnMut() -> bool,
) -> Result<Published> {
    let start = Instant::now();
    let mut pending = FuturesUnordered::new();
    let mut out = Published::default();
    let mut sent = 0u64;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let settle = |c: ladder_amqp::Result<Confirmation>, out: &mut Published| -> Result<()> {
        match c.map_err(|e| anyhow!("publish confirm: {e}"))? {
            Confirmation::Ack => out.confirmed += 1,
            _ => out.refused += 1,
        }
        Ok(())
    };
    while sent < count {
        if stop() {
            out.stopped = true;
            break;
        }
        let allowed = match rate {
            Some(r) => ((start.elapsed().as_secs_f64() * r) as u64 + 1).min(count),
            None => count,
        };
        while sent < allowed && pending.len() < window {
            let m = make(sent);
            let confirm = ch
                .basic_publish(&m.exchange, &m.routing_key, true, &m.properties, &m.body)
                .map_err(|e| anyhow!("publish: {e}"))?;
            pending.push(confirm);
            sent += 1;
            if sent.is_multiple_of(256) {
                // keep confirms flowing out of the set without waiting
                while let Some(Some(c)) = pending.next().now_or_never() {
                    settle(c, &mut out)?;
                }
            }
        }
        out.secs = start.elapsed().as_secs_f64();
        if pending.len() >= window {
            match tokio::time::timeout(OP_TIMEOUT, pending.next()).await {
                Ok(Some(c)) => settle(c, &mut out)?,
                Ok(None) => {}
                Err(_) => return Err(anyhow!("no publish confirm within {OP_TIMEOUT:?}")),
            }
        } else if sent < count {
            tokio::select! {
                _ = tick.tick() => {}
                Some(c) = pending.next() => settle(c, &mut out)?,
            }
        }
    }
    let drain = async {
        while let Some(c) = pending.next().await {
            settle(c, &mut out)?;
        }
        Ok::<(), anyhow::Error>(())
    };
    match tokio::time::timeout(OP_TIMEOUT, drain).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(anyhow!(
                "publish confirms still missing {OP_TIMEOUT:?} after the last publish"
            ));
        }
    }
    Ok(out)
}

/// One redelivery seen by a destination consumer.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Sequence number within its step.
    pub seq: u64,
    /// When the load generator published it (ms since the epoch).
    pub sent_ms: u64,
    /// The delay it asked for.
    pub delay_ms: u64,
    /// When the destination consumer received it.
    pub recv_ms: u64,
    /// Its `retry-due-at` header, when it has one.
    pub due_at_ms: Option<u64>,
}

impl Sample {
    /// Lateness against the intended due time: publish time + delay. Includes the intake hop.
    pub fn late_e2e(&self) -> i64 {
        self.recv_ms as i64 - (self.sent_ms + self.delay_ms) as i64
    }

    /// Lateness against the `retry-due-at` header the relay set at the intake hop.
    pub fn late_due(&self) -> Option<i64> {
        self.due_at_ms.map(|d| self.recv_ms as i64 - d as i64)
    }
}

#[derive(Default)]
struct Steps {
    samples: HashMap<u32, Vec<Sample>>,
    /// e2e lateness above the capacity threshold, per step (for an early verdict).
    late: HashMap<u32, u64>,
}

/// A consumer on a destination queue, recording every benchmark message per step. It acks as it
/// goes (one `multiple` ack for whatever arrived together), as close to auto-ack as a client that
/// always consumes with acks gets.
pub struct Collector {
    steps: Arc<Mutex<Steps>>,
    task: JoinHandle<()>,
}

/// Lateness above this fails a capacity step (the capacity criterion is p99 < 100 ms).
pub const LATE_MS: i64 = 100;

impl Collector {
    /// Starts consuming `queue` on a channel of `conn`.
    pub async fn start(conn: &Connection, queue: &str) -> Result<Self> {
        let ch = bounded("open channel", OP_TIMEOUT, conn.create_channel()).await?;
        let mut consumer = bounded(
            &format!("consume {queue}"),
            OP_TIMEOUT,
            ch.basic_consume(queue, "", false, FieldTable::new()),
        )
        .await?;
        let steps: Arc<Mutex<Steps>> = Arc::default();
        let sink = steps.clone();
        let task = tokio::spawn(async move {
            let record = |d: &Delivery| {
                let recv_ms = now_ms();
                let Some((step, seq, sent_ms, delay_ms)) = parse_body(&d.body) else {
                    return;
                };
                let due_at_ms = d
                    .properties
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("retry-due-at"))
                    .and_then(int_value);
                let s = Sample {
                    seq,
                    sent_ms,
                    delay_ms,
                    recv_ms,
                    due_at_ms,
                };
                let mut g = sink.lock().unwrap();
                if s.late_e2e() > LATE_MS {
                    *g.late.entry(step).or_default() += 1;
                }
                g.samples.entry(step).or_default().push(s);
            };
            while let Some(Ok(d)) = consumer.next().await {
                record(&d);
                let mut last = d.delivery_tag;
                // whatever else already arrived, then one ack for all of it
                while let Some(Some(Ok(d))) = consumer.next().now_or_never() {
                    record(&d);
                    last = d.delivery_tag;
                }
                if ch.basic_ack(last, true).is_err() {
                    break;
                }
            }
        });
        Ok(Collector { steps, task })
    }

    /// Messages of `step` received so far (duplicates included) and how many were late.
    pub fn progress(&self, step: u32) -> (u64, u64) {
        let g = self.steps.lock().unwrap();
        (
            g.samples.get(&step).map_or(0, |v| v.len() as u64),
            g.late.get(&step).copied().unwrap_or(0),
        )
    }

    /// Takes the samples of `step`, dropping duplicates (at-least-once may redeliver).
    pub fn take(&self, step: u32) -> (Vec<Sample>, u64) {
        let mut g = self.steps.lock().unwrap();
        g.late.remove(&step);
        let mut v = g.samples.remove(&step).unwrap_or_default();
        let raw = v.len();
        v.sort_by_key(|s| (s.seq, s.recv_ms));
        v.dedup_by_key(|s| s.seq);
        let duplicates = (raw - v.len()) as u64;
        (v, duplicates)
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The benchmark body ([`body`]): step, sequence number, send time (ms), delay (ms).
pub fn parse_body(data: &[u8]) -> Option<(u32, u64, u64, u64)> {
    let text = std::str::from_utf8(data).ok()?;
    let mut it = text.split(' ');
    if it.next()? != "B" {
        return None;
    }
    Some((
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
        it.next()?.parse().ok()?,
    ))
}

/// An AMQP integer header as u64.
pub fn int_value(v: &FieldValue) -> Option<u64> {
    match v {
        FieldValue::LongLongInt(n) => u64::try_from(*n).ok(),
        FieldValue::LongInt(n) => u64::try_from(*n).ok(),
        FieldValue::LongUInt(n) => Some(u64::from(*n)),
        FieldValue::Timestamp(n) => Some(*n),
        _ => None,
    }
}
