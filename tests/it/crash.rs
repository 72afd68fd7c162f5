//! A crash of the real `ladder` process: SIGKILL while hundreds of retries are in flight,
//! then a fresh process on the same config must deliver or park every one of them (at least
//! once: duplicates are allowed, losses are not) and drain cleanly on SIGTERM.

use std::collections::{HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use futures_util::future::try_join_all;
use ladder::broker::topology::Names;
use ladder::model::envelope::Envelope;
use ladder_amqp::{BasicProperties, Confirmation, Connection, FieldTable, FieldValue, LongString};

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
    fn configure(hint: &str, ladder: &str) -> Self {
        let ns = unique_namespace(hint);
        let dir = tempfile::tempdir().unwrap();
        // an ephemeral admin port: both tests run a service at once, and 9464 may be taken
        let config_path = write_config(dir.path(), &ns, ADMIN_ANY_PORT, "default", ladder);
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
        self.names.namespace.prefix.trim_end_matches('.')
    }

    fn log_path(&self, run: usize) -> PathBuf {
        self.dir.path().join(format!("run-{run}.log"))
    }

    /// Spawns `ladder --config <file> run`, its stderr going to `run-<n>.log`.
    fn spawn(&mut self) {
        assert!(self.child.is_none(), "a service is already running");
        self.runs += 1;
        let log = std::fs::File::create(self.log_path(self.runs)).unwrap();
        // without RUST_MIN_STACK: the binary must size its own thread stacks (see
        // `deeply_nested_header` below)
        let child = ladder_command(&self.config_path)
            .arg("run")
            .env("RUST_LOG", "info")
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
        let what = format!("the service (pid {}) exits", self.pid());
        let child = self.child.as_mut().expect("a service runs");
        let status = eventually(&what, within, async || child.try_wait().unwrap()).await;
        self.child = None;
        status
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

/// Waits until the service consumes both its intake and its due queue.
async fn wait_serving(conn: &Connection, names: &Names) {
    eventually("the service consumes its intake and due queues", WAIT, async || {
        let intake = depth(conn, &names.intake_queue).await;
        let due = depth(conn, &names.due).await;
        matches!((intake, due), (Some((_, i)), Some((_, d))) if i > 0 && d > 0).then_some(())
    })
    .await
}

/// A failure as a consumer publishes it: `retry-to` `destination`, persistent.
fn failure(id: &str, destination: &str, attempt: Option<i64>) -> BasicProperties {
    retry_props(destination, attempt)
        .with_message_id(id)
        .with_delivery_mode(2)
}

fn message_id(properties: &BasicProperties) -> String {
    properties.message_id.as_ref().expect("a message id").to_string()
}

/// A consumer on its own channel, `args` passed to `basic.consume`.
async fn consumer(conn: &Connection, queue: &str, args: FieldTable) -> TestConsumer {
    let channel = conn.create_channel().await.unwrap();
    channel.basic_qos(200).await.unwrap();
    let consumer = channel.basic_consume(queue, "", false, args).await.unwrap();
    TestConsumer { channel, consumer }
}

/// Consumes `consumer` until `done(seen)` holds, acking everything; returns deliveries seen.
async fn collect(
    consumer: &mut TestConsumer,
    what: &str,
    seen: &mut HashSet<String>,
    mut on_delivery: impl FnMut(&ladder_amqp::Delivery),
    done: impl Fn(&HashSet<String>) -> bool,
) -> usize {
    let mut deliveries = 0;
    let collected = tokio::time::timeout(WAIT * 2, async {
        while !done(seen) {
            let d = next(consumer).await;
            deliveries += 1;
            on_delivery(&d);
            seen.insert(message_id(&d.properties));
            consumer.ack(&d);
        }
    })
    .await;
    assert!(
        collected.is_ok(),
        "{what}: only {} distinct ids arrived in {:?}",
        seen.len(),
        WAIT * 2
    );
    deliveries
}

/// A running service with a confirming client channel and a declared destination queue.
async fn serving(hint: &str) -> (Crash, Connection, ladder_amqp::Channel, String) {
    serving_ladder(hint, LADDER).await
}

/// [`serving`] with the ladder file `ladder`.
async fn serving_ladder(hint: &str, ladder: &str) -> (Crash, Connection, ladder_amqp::Channel, String) {
    let mut t = Crash::configure(hint, ladder);
    let conn = connect().await;
    let orders = format!("{}-orders", t.ns());
    t.queues.push(orders.clone());
    t.spawn();
    wait_serving(&conn, &t.names).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let durable = ladder_amqp::QueueOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(&orders, durable, FieldTable::default()).await.unwrap();
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
            2 => failure(&park[i / 3], &orders, Some(2)),
            _ => failure(&deliver[i / 3 * 2 + i % 3], &orders, None),
        };
        let publish = ch.basic_publish(&names.exchange, "", true, &props, b"order").unwrap();
        confirms.push(publish);
    }
    let confirmed = tokio::time::timeout(WAIT, try_join_all(confirms))
        .await
        .expect("publish confirms timed out")
        .unwrap();
    assert!(
        confirmed.iter().all(|c| *c == Confirmation::Ack),
        "a publish to the intake was not confirmed"
    );
    let published_at = Instant::now();

    // Kill as soon as the first retry reached its destination: the tiers hold the rest.
    // (The destination exists, so polling it on one channel never closes that channel.) Polled
    // every 2 ms, not with `eventually`: every ms of delay lets more retries out of the tiers.
    let deadline = Instant::now() + WAIT;
    loop {
        let peek = ch.queue_inspect(&orders).await.unwrap();
        if peek.message_count > 0 {
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
    stream_args.set("x-stream-offset", FieldValue::LongString(LongString::from("first")));
    let mut parked_consumer = consumer(&conn, &names.parked, stream_args).await;
    let records = collect(
        &mut parked_consumer,
        "parking lot",
        &mut parked,
        |d| {
            let envelope = Envelope::from_slice(&d.body).expect("a parked record is an envelope");
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
    let _ = conn.close(200, "done").await;
}

/// Regression: a header table nested ~1 000 levels deep (7 KB, well under max_header_bytes)
/// overflowed lapin's 2 MiB I/O thread stack and aborted the process — on every restart,
/// since the message was never acked. It must be parked as `invalid-header` instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_deeply_nested_header_is_parked_not_a_crash() {
    let (mut t, conn, ch, orders) = serving("deep").await;
    let names = t.names.clone();

    let mut deep = FieldValue::Boolean(true);
    for _ in 0..3_000 {
        let mut table = FieldTable::default();
        table.set("n", deep);
        deep = FieldValue::FieldTable(table);
    }
    let mut bad = failure("deep", &orders, None);
    let mut headers = bad.headers.clone().unwrap();
    headers.set("deep", deep);
    bad = bad.with_headers(headers);
    publish(&ch, &names.exchange, "", b"deep", bad.clone()).await;
    publish(&ch, &names.exchange, "", b"good", failure("good", &orders, None)).await;

    let mut delivered = consumer(&conn, &orders, FieldTable::default()).await;
    let d = next(&mut delivered).await;
    assert_eq!(message_id(&d.properties), "good");
    let parked = read_parked(&conn, &names.parked, 1).await.remove(0);
    assert_eq!(parked.reason, "invalid-header", "{}", parked.detail);
    assert_eq!(parked.destination.as_deref(), Some(orders.as_str()));
    // nested beyond what the client decodes, the properties are kept as the bytes received
    // (RabbitMQ 4.x re-encodes tables sorted by key, so the bytes are compared as tables)
    let mut sent = bytes::BytesMut::new();
    bad.encode(&mut sent);
    let ladder::model::envelope::StoredProperties::Raw(kept) = parked.message.stored_properties().unwrap() else {
        panic!("the properties were decoded, not kept as bytes")
    };
    let shallow =
        |bytes: &[u8]| ladder_amqp::BasicProperties::decode(&mut ladder_amqp::types::Reader::lossy(bytes)).unwrap();
    assert_eq!(kept.len(), sent.len(), "the parked original lost its nesting");
    assert_eq!(shallow(&kept), shallow(&sent));
    let child = t.child.as_mut().expect("a service runs");
    assert!(
        child.try_wait().unwrap().is_none(),
        "the service died:\n{}",
        t.log_tail(1)
    );
}

/// Repeat failures the broker routes past the intake (`retry-next`) while the service is killed
/// and started again: every message still reaches its last retry, none is lost, none is counted
/// twice (a retry delivered again after the kill carries the same attempt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeat_failures_routed_past_the_intake_survive_a_kill() {
    routed_failures_survive_a_kill("crash-routed", LADDER).await;
}

/// 300 messages in dead-letter mode, each rejected twice, with the service killed (SIGKILL) and
/// started again once a tenth reached their last retry.
async fn routed_failures_survive_a_kill(hint: &str, ladder: &str) {
    const MESSAGES: usize = 300;
    let (mut t, conn, ch, _) = serving_ladder(hint, ladder).await;
    let names = t.names.clone();
    // dead-letter mode: the destination rejects into the ladder's exchange
    let orders = format!("{}-dl-orders", t.ns());
    t.queues.push(orders.clone());
    let mut args = FieldTable::default();
    args.set("x-dead-letter-exchange", text(&names.exchange));
    let durable = ladder_amqp::QueueOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(&orders, durable, args).await.unwrap();
    let ids: Vec<String> = (0..MESSAGES).map(|i| format!("r{i}")).collect();
    let confirms: Vec<_> = ids
        .iter()
        .map(|id| {
            let props = BasicProperties::default()
                .with_message_id(id.as_str())
                .with_delivery_mode(2);
            ch.basic_publish("", &orders, true, &props, b"order").unwrap()
        })
        .collect();
    let confirmed = tokio::time::timeout(WAIT, try_join_all(confirms))
        .await
        .unwrap()
        .unwrap();
    assert!(confirmed.iter().all(|c| *c == Confirmation::Ack));

    // the consumer fails the original and the first retry, and takes the second (the last the
    // ladder allows): attempt 1 comes through the intake, attempt 2 is routed past it
    let mut destination = consumer(&conn, &orders, FieldTable::default()).await;
    let mut done: HashSet<String> = HashSet::new();
    let mut killed = false;
    let deadline = Instant::now() + DRAIN_WAIT * 2;
    while done.len() < MESSAGES {
        assert!(
            Instant::now() < deadline,
            "only {} of {MESSAGES} reached their last retry; missing e.g. {:?}",
            done.len(),
            ids.iter().find(|id| !done.contains(*id))
        );
        let Some(d) = next_within(&mut destination, Duration::from_millis(500)).await else {
            continue;
        };
        let attempt = int_header(&d, "retry-attempt").unwrap_or(0);
        assert!(attempt <= 2, "attempt {attempt}: a retry counted twice");
        if attempt < 2 {
            destination.reject(&d, false);
        } else {
            done.insert(message_id(&d.properties));
            destination.ack(&d);
        }
        if !killed && done.len() >= MESSAGES / 10 {
            // mid-flight: repeat failures wait in the tiers, some are in the due hop's hands
            let status = t.kill().await;
            assert_eq!(status.signal(), Some(9));
            killed = true;
            tokio::time::sleep(Duration::from_millis(500)).await;
            t.spawn();
        }
    }
    assert!(killed, "the kill happened");
    let parked = read_parked(&conn, &names.parked, 0).await;
    assert!(
        parked.is_empty(),
        "nothing parked: {:?}",
        parked.iter().map(|p| &p.reason).collect::<Vec<_>>()
    );
}
