//! A crash of the real `ladder` process: SIGKILL while hundreds of retries are in flight,
//! then a fresh process on the same config must deliver or park every one of them (at least
//! once: duplicates are allowed, losses are not) and drain cleanly on SIGTERM.

mod common;

use std::collections::{HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::*;
use futures_util::future::try_join_all;
use ladder::envelope::Envelope;
use ladder::topology::Names;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Confirmation, Connection, Consumer};

const LADDER: &str = r#"
backoff = ["200ms", "500ms"]
max_attempts = 2
allow = ["^{ns}-"]
"#;

/// Retries that must reach the destination.
const TO_DELIVER: usize = 400;
/// Retries already at `max_attempts`: they must be parked with `max-attempts`.
const TO_PARK: usize = 200;

/// How long a SIGTERMed service may take to drain and exit (its grace is 5 s).
const DRAIN_WAIT: Duration = Duration::from_secs(20);

/// A running `ladder run` process, its config, and everything the test declared. Dropping it
/// kills the process and deletes every queue and exchange, even when the test failed.
struct Crash {
    dir: tempfile::TempDir,
    config_path: PathBuf,
    names: Names,
    child: Option<Child>,
    runs: usize,
    queues: Vec<String>,
    exchanges: Vec<String>,
}

impl Crash {
    fn configure(hint: &str) -> Self {
        let ns = unique_namespace(hint);
        let dir = tempfile::tempdir().unwrap();
        // an ephemeral admin port: both tests run a service at once, and 9464 may be taken
        let config_path = write_config(dir.path(), &ns, ADMIN_ANY_PORT, "default", LADDER);
        let config = ladder::config::load(&config_path, &HashMap::new()).expect("test config is valid");
        let (queues, exchanges) = declared_names(&config);
        Crash {
            names: Names::new(&ns, "default"),
            dir,
            config_path,
            child: None,
            runs: 0,
            queues,
            exchanges,
        }
    }

    fn ns(&self) -> &str {
        self.names.prefix.trim_end_matches('.')
    }

    fn log_path(&self, run: usize) -> PathBuf {
        self.dir.path().join(format!("run-{run}.log"))
    }

    /// Spawns `ladder --config <file> run`, its stderr going to `run-<n>.log`.
    fn spawn(&mut self) {
        assert!(self.child.is_none(), "a service is already running");
        self.runs += 1;
        let log = std::fs::File::create(self.log_path(self.runs)).unwrap();
        let mut command = Command::new(env!("CARGO_BIN_EXE_ladder"));
        for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("LADDER_")) {
            command.env_remove(key);
        }
        let child = command
            .arg("--config")
            .arg(&self.config_path)
            .arg("run")
            .env("RUST_LOG", "info")
            // the binary must size its own thread stacks (see `deeply_nested_header` below)
            .env_remove("RUST_MIN_STACK")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("the ladder binary starts");
        eprintln!("run {}: pid {}", self.runs, child.id());
        self.child = Some(child);
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("a service runs").id()
    }

    /// Sends SIGKILL and waits until the process is gone.
    async fn kill(&mut self) -> ExitStatus {
        self.child.as_mut().expect("a service runs").kill().unwrap();
        self.wait_exit(Duration::from_secs(5)).await
    }

    /// Sends SIGTERM, as an orchestrator stopping the service would.
    fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill -TERM failed: {status}");
    }

    /// Waits for the running process to exit; panics after `within`.
    async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            let child = self.child.as_mut().expect("a service runs");
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the service (pid {}) did not exit within {within:?}",
                child.id()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The last lines of a run's log, for failure messages.
    fn log_tail(&self, run: usize) -> String {
        let log = std::fs::read_to_string(self.log_path(run)).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Crash {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            for run in 1..=self.runs {
                eprintln!("--- run {run} log (tail) ---\n{}", self.log_tail(run));
            }
        }
        let (queues, exchanges) = (std::mem::take(&mut self.queues), std::mem::take(&mut self.exchanges));
        delete_all_blocking(queues, exchanges);
    }
}

/// `(messages ready, consumers)` of `queue` by a passive declare, or `None` if it does not exist.
async fn depth(conn: &Connection, queue: &str) -> Option<(u32, u32)> {
    let ch = conn.create_channel().await.ok()?;
    let declared = tokio::time::timeout(
        WAIT,
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions::default().passive(),
            FieldTable::default(),
        ),
    )
    .await
    .ok()?
    .ok();
    // a failed passive declare already closed the channel
    if declared.is_some() {
        let _ = ch.close(200, "peeked".into()).await;
    }
    declared.map(|q| (q.message_count(), q.consumer_count()))
}

/// Waits until the service consumes both its intake and its due queue.
async fn wait_serving(conn: &Connection, names: &Names) {
    let deadline = Instant::now() + WAIT;
    loop {
        let intake = depth(conn, &names.intake_queue).await;
        let due = depth(conn, &names.due).await;
        if matches!((intake, due), (Some((_, i)), Some((_, d))) if i > 0 && d > 0) {
            return;
        }
        assert!(Instant::now() < deadline, "the service did not start consuming");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn retry_props(id: &str, destination: &str, attempt: Option<i64>) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert(
        "retry-to".into(),
        AMQPValue::LongString(LongString::from(destination.as_bytes())),
    );
    if let Some(attempt) = attempt {
        h.insert("retry-attempt".into(), AMQPValue::LongLongInt(attempt));
    }
    BasicProperties::default()
        .with_message_id(id.into())
        .with_delivery_mode(2)
        .with_headers(h)
}

fn message_id(properties: &BasicProperties) -> String {
    properties.message_id().as_ref().expect("a message id").to_string()
}

/// A consumer on its own channel, `args` passed to `basic.consume`.
async fn consumer(conn: &Connection, queue: &str, args: FieldTable) -> Consumer {
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(200, BasicQosOptions::default()).await.unwrap();
    ch.basic_consume(queue.into(), "".into(), BasicConsumeOptions::default(), args)
        .await
        .unwrap()
}

/// Consumes `consumer` until `done(seen)` holds, acking everything; returns deliveries seen.
async fn collect(
    consumer: &mut Consumer,
    what: &str,
    seen: &mut HashSet<String>,
    mut on_delivery: impl FnMut(&lapin::message::Delivery),
    done: impl Fn(&HashSet<String>) -> bool,
) -> usize {
    let deadline = Instant::now() + WAIT * 2;
    let mut deliveries = 0;
    while !done(seen) {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(d) = next_within(consumer, left).await else {
            panic!("{what}: only {} distinct ids arrived in {:?}", seen.len(), WAIT * 2);
        };
        deliveries += 1;
        on_delivery(&d);
        seen.insert(message_id(&d.properties));
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    deliveries
}

/// A running service with a confirming client channel and a declared destination queue.
async fn serving(hint: &str) -> (Crash, Connection, lapin::Channel, String) {
    let mut t = Crash::configure(hint);
    let conn = connect().await;
    let orders = format!("{}-orders", t.ns());
    t.queues.push(orders.clone());
    t.spawn();
    wait_serving(&conn, &t.names).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    ch.queue_declare(
        orders.as_str().into(),
        QueueDeclareOptions::durable(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    (t, conn, ch, orders)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn service_killed_with_hundreds_in_flight_loses_nothing() {
    let (mut t, conn, ch, orders) = serving("crash").await;
    let names = t.names.clone();

    // 600 failures, published back to back with every confirm in flight at once
    let deliver: Vec<String> = (0..TO_DELIVER).map(|i| format!("d{i}")).collect();
    let park: Vec<String> = (0..TO_PARK).map(|i| format!("p{i}")).collect();
    let mut confirms = Vec::with_capacity(TO_DELIVER + TO_PARK);
    for i in 0..TO_DELIVER + TO_PARK {
        let props = match i % 3 {
            2 => retry_props(&park[i / 3], &orders, Some(2)),
            _ => retry_props(&deliver[i / 3 * 2 + i % 3], &orders, None),
        };
        let publish = ch
            .basic_publish(
                names.intake_exchange.as_str().into(),
                "".into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                b"order",
                props,
            )
            .await
            .unwrap();
        confirms.push(publish);
    }
    let confirmed = tokio::time::timeout(WAIT, try_join_all(confirms))
        .await
        .expect("publish confirms timed out")
        .unwrap();
    assert!(
        confirmed.iter().all(|c| *c == Confirmation::Ack(None)),
        "a publish to the intake was not confirmed"
    );
    let published_at = Instant::now();

    // Kill as soon as the first retry reached its destination: the tiers hold the rest.
    // (The destination exists, so polling it on one channel never closes that channel.)
    let deadline = Instant::now() + WAIT;
    loop {
        let peek = ch
            .queue_declare(
                orders.as_str().into(),
                QueueDeclareOptions::default().passive(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        if peek.message_count() > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "no retry reached {orders} before the kill");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let status = t.kill().await;
    assert_eq!(status.signal(), Some(9), "the service was not SIGKILLed: {status}");

    // What the dead service left behind (ready counts; unacked ones return as the broker
    // notices the closed connection, so these are lower bounds).
    let mut left = vec![];
    let tiers = t.queues.iter().filter(|q| q.contains(".delay.")).cloned();
    for queue in [names.intake_queue.clone(), names.due.clone()].into_iter().chain(tiers) {
        left.push((queue.clone(), depth(&conn, &queue).await.map_or(0, |(n, _)| n)));
    }
    let delivered_at_kill = depth(&conn, &orders).await.map_or(0, |(n, _)| n) as usize;
    let waiting: u32 = left.iter().map(|(_, n)| n).sum();
    eprintln!(
        "killed {:?} after the last publish: {delivered_at_kill} of {TO_DELIVER} delivered, \
         {waiting} waiting in the ladder: {left:?}",
        published_at.elapsed()
    );
    assert!(
        delivered_at_kill < TO_DELIVER,
        "every retry was delivered before the kill; the test proves nothing"
    );

    // A new process on the same config finishes the work.
    t.spawn();
    let started = Instant::now();
    let mut delivered = HashSet::new();
    let mut orders_consumer = consumer(&conn, &orders, FieldTable::default()).await;
    let deliveries = collect(
        &mut orders_consumer,
        "destination",
        &mut delivered,
        |d| {
            let id = message_id(&d.properties);
            assert!(id.starts_with('d'), "{id} was delivered but had exhausted its ladder");
        },
        |seen| seen.len() == TO_DELIVER,
    )
    .await;
    eprintln!(
        "{} distinct of {TO_DELIVER} delivered ({deliveries} deliveries in all, duplicates included) within {:?} of the restart",
        delivered.len(),
        started.elapsed()
    );
    assert!(deliver.iter().all(|id| delivered.contains(id)));

    let mut parked = HashSet::new();
    let mut stream_args = FieldTable::default();
    stream_args.insert(
        "x-stream-offset".into(),
        AMQPValue::LongString(LongString::from("first")),
    );
    let mut parked_consumer = consumer(&conn, &names.parked, stream_args).await;
    let records = collect(
        &mut parked_consumer,
        "parking lot",
        &mut parked,
        |d| {
            let envelope = Envelope::from_slice(&d.data).expect("a parked record is an envelope");
            let id = message_id(&d.properties);
            assert!(
                id.starts_with('p'),
                "{id} was parked ({}): {}",
                envelope.reason,
                envelope.detail
            );
            assert_eq!(envelope.reason, "max-attempts", "{id}: {}", envelope.detail);
            assert_eq!(envelope.destination.as_deref(), Some(orders.as_str()));
        },
        |seen| seen.len() == TO_PARK,
    )
    .await;
    eprintln!("{} distinct of {TO_PARK} parked in {records} records", parked.len());
    assert!(park.iter().all(|id| parked.contains(id)));

    // A graceful stop drains and exits 0.
    let stopping = Instant::now();
    t.terminate();
    let status = t.wait_exit(DRAIN_WAIT).await;
    eprintln!("SIGTERM: exited {status} after {:?}", stopping.elapsed());
    assert_eq!(status.code(), Some(0), "log:\n{}", t.log_tail(t.runs));
    let log = std::fs::read_to_string(t.log_path(t.runs)).unwrap();
    assert!(log.contains("SIGTERM: draining") && log.contains("stopped"), "{log}");
    let _ = conn.close(200, "done".into()).await;
}

/// Regression: a header table nested ~1 000 levels deep (7 KB, well under max_header_bytes)
/// overflowed lapin's 2 MiB I/O thread stack and aborted the process — on every restart,
/// since the message was never acked. It must be parked as `invalid-header` instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_deeply_nested_header_is_parked_not_a_crash() {
    let (mut t, conn, ch, orders) = serving("deep").await;
    let names = t.names.clone();

    let mut deep = AMQPValue::Boolean(true);
    for _ in 0..3_000 {
        let mut table = FieldTable::default();
        table.insert("n".into(), deep);
        deep = AMQPValue::FieldTable(table);
    }
    let mut bad = retry_props("deep", &orders, None);
    let mut headers = bad.headers().clone().unwrap();
    headers.insert("deep".into(), deep);
    bad = bad.with_headers(headers);
    publish(&ch, &names.intake_exchange, "", b"deep", bad.clone()).await;
    publish(
        &ch,
        &names.intake_exchange,
        "",
        b"good",
        retry_props("good", &orders, None),
    )
    .await;

    let mut delivered = consumer(&conn, &orders, FieldTable::default()).await;
    let d = next(&mut delivered).await;
    assert_eq!(message_id(&d.properties), "good");
    let parked = read_parked(&conn, &names.parked, 1).await.remove(0);
    assert_eq!(parked.reason, "invalid-header", "{}", parked.detail);
    assert_eq!(parked.destination.as_deref(), Some(orders.as_str()));
    assert_eq!(
        parked.message.properties().unwrap(),
        bad,
        "the parked original lost its nesting"
    );
    let child = t.child.as_mut().expect("a service runs");
    assert!(
        child.try_wait().unwrap().is_none(),
        "the service died:\n{}",
        t.log_tail(1)
    );
}
