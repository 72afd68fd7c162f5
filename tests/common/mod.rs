//! Shared helpers for the integration tests: a ladder in a namespace of its own on a real
//! RabbitMQ (`LADDER_TEST_AMQP_URL`, default the machine's broker on 127.0.0.1:5672), the service
//! running against it, and a client to publish, consume and read the parking lot. Everything a
//! test declares is deleted when its `TestLadder` is dropped.
#![allow(dead_code, unreachable_pub)]

pub mod cluster;
mod markers;
pub mod parking;

#[allow(unused_imports)] // not every test binary sends markers
pub use markers::*;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ladder::broker::state::State;
use ladder::broker::supervisor as service;
use ladder::broker::topology::{self, Declaration};
use ladder::config::Config;
use ladder::model::envelope::Envelope;
use ladder_amqp::{
    BasicProperties, Channel, Confirmation, ConnectOptions, Connection, Consumer, Delivery, FieldTable, FieldValue,
    QueueOptions,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The broker the tests run against: `LADDER_TEST_AMQP_URL`, or the machine's (CI's too).
pub fn amqp_url() -> String {
    std::env::var("LADDER_TEST_AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// Upper bound for any single wait in a test.
pub const WAIT: Duration = Duration::from_secs(30);

/// A unique, recognisable namespace: `lt-<hint>-<pid>-<n>-<nanos>`.
pub fn unique_namespace(hint: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos();
    format!(
        "lt-{hint}-{}-{}-{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

pub async fn connect() -> Connection {
    let mut options = ConnectOptions::new(amqp_url().parse().expect("LADDER_TEST_AMQP_URL is an AMQP URI"));
    options.connection_name = Some("ladder-test".into());
    tokio::time::timeout(WAIT, Connection::connect(&options))
        .await
        .expect("connect timed out")
        .expect("the test broker accepts connections")
}

/// An `extra_main` for [`write_config`] that gives the admin server an ephemeral port, for tests
/// that run the binary (`ladder run` binds `admin.bind`, 127.0.0.1:9464 by default).
pub const ADMIN_ANY_PORT: &str = "[admin]\nbind = \"127.0.0.1:0\"";

/// Writes `ladder.toml` and `ladders/<ladder>.toml` into `dir`, with `{ns}` in `ladder_toml`
/// replaced by the namespace, and returns the config path.
///
/// A test ladder has no delay levels unless its TOML says `exact_delays`: the 28 level queues
/// (quorum queues, one Raft group each) per test namespace would make the suite mostly queue
/// declarations on a two-core machine. The tests of exact delays and scheduled deliveries ask
/// for them (`exact_delays = true`).
pub fn write_config(dir: &Path, ns: &str, extra_main: &str, ladder: &str, ladder_toml: &str) -> PathBuf {
    let main = format!(
        "namespace = \"{ns}\"\nshutdown_grace = \"5s\"\nprefetch = 100\n{extra_main}\n[amqp]\nurl = \"{}\"\nreconnect_min = \"100ms\"\nreconnect_max = \"1s\"\n",
        amqp_url()
    );
    std::fs::write(dir.join("ladder.toml"), main).unwrap();
    std::fs::create_dir_all(dir.join("ladders")).unwrap();
    std::fs::write(
        dir.join("ladders").join(format!("{ladder}.toml")),
        with_test_levels(&ladder_toml.replace("{ns}", ns)),
    )
    .unwrap();
    dir.join("ladder.toml")
}

/// `ladder_toml` with `exact_delays = false` first unless it sets `exact_delays` itself (see
/// [`write_config`]).
pub fn with_test_levels(ladder_toml: &str) -> String {
    if ladder_toml.contains("exact_delays") {
        ladder_toml.to_string()
    } else {
        format!("exact_delays = false\n{ladder_toml}")
    }
}

/// A ladder in its own namespace, the service serving it, and a test client.
pub struct TestLadder {
    pub ns: String,
    pub ladder: String,
    pub dir: tempfile::TempDir,
    pub config: Arc<Config>,
    pub state: Arc<State>,
    pub client: Connection,
    pub channel: Channel,
    service: Option<(CancellationToken, JoinHandle<()>)>,
    extra_queues: Vec<String>,
    extra_exchanges: Vec<String>,
}

impl TestLadder {
    /// Starts the service in-process for one ladder named `default` and waits until it is ready.
    /// `ladder_toml` may use `{ns}`; destination queues made with [`TestLadder::queue_name`]
    /// start with `{ns}-`.
    pub async fn start(hint: &str, ladder_toml: &str) -> Self {
        let mut t = Self::configure(hint, ladder_toml).await;
        t.start_service().await;
        t
    }

    /// Like [`TestLadder::start`], with the service sharing `state` (e.g. an in-memory tracer).
    pub async fn start_with_state(hint: &str, ladder_toml: &str, state: State) -> Self {
        let mut t = Self::configure(hint, ladder_toml).await;
        t.state = Arc::new(state);
        t.start_service().await;
        t
    }

    /// Like [`TestLadder::configure`], with `extra_main` added to the service config (before its
    /// `[amqp]` table, so it may open tables of its own, such as `[admin]`).
    pub async fn configure_with(hint: &str, extra_main: &str, ladder_toml: &str) -> Self {
        let mut t = Self::configure(hint, ladder_toml).await;
        let path = write_config(t.dir.path(), &t.ns, extra_main, &t.ladder, ladder_toml);
        t.config = Arc::new(ladder::config::load(&path, &HashMap::new()).expect("test config is valid"));
        t
    }

    /// Writes the config and connects the client, without starting the service.
    pub async fn configure(hint: &str, ladder_toml: &str) -> Self {
        let ns = unique_namespace(hint);
        let dir = tempfile::tempdir().unwrap();
        let path = write_config(dir.path(), &ns, "", "default", ladder_toml);
        let config = ladder::config::load(&path, &HashMap::new()).expect("test config is valid");
        let client = connect().await;
        let channel = client.create_channel().await.unwrap();
        channel.confirm_select().await.unwrap();
        TestLadder {
            ns,
            ladder: "default".into(),
            dir,
            config: Arc::new(config),
            state: Arc::new(State::default()),
            client,
            channel,
            service: None,
            extra_queues: vec![],
            extra_exchanges: vec![],
        }
    }

    pub async fn start_service(&mut self) {
        let token = CancellationToken::new();
        let (config, state, stop) = (self.config.clone(), self.state.clone(), token.clone());
        let handle = tokio::spawn(async move {
            service::run(config, state, stop).await.expect("service runs");
        });
        self.service = Some((token, handle));
        wait_until("service ready", || self.state.health.is_ready()).await;
    }

    /// Ends the service at once, as a crash would: no drain, its deliveries unacked (the broker
    /// requeues them when the connection dies with the task).
    pub fn abort_service(&mut self) {
        if let Some((token, handle)) = self.service.take() {
            handle.abort();
            drop(token);
        }
    }

    /// Stops the service as SIGTERM would and waits for its drain.
    pub async fn stop_service(&mut self) {
        if let Some((token, handle)) = self.service.take() {
            token.cancel();
            tokio::time::timeout(WAIT, handle)
                .await
                .expect("service drains in time")
                .unwrap();
        }
    }

    /// A queue name this ladder's allow-list (`^{ns}-`) accepts; deleted at drop.
    pub fn queue_name(&mut self, name: &str) -> String {
        let q = format!("{}-{name}", self.ns);
        self.extra_queues.push(q.clone());
        q
    }

    /// Declares a durable classic destination queue with optional arguments.
    pub async fn declare_queue(&mut self, name: &str, args: FieldTable) -> String {
        let q = self.queue_name(name);
        self.channel
            .queue_declare(
                &q,
                QueueOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await
            .unwrap();
        q
    }

    /// Deletes `name` (a queue the service declared outside the plan, such as a held queue) at
    /// drop.
    pub fn track_queue(&mut self, name: &str) {
        self.extra_queues.push(name.to_string());
    }

    pub fn track_exchange(&mut self, name: &str) {
        self.extra_exchanges.push(name.to_string());
    }

    /// The intake exchange `N.L`.
    pub fn intake(&self) -> String {
        format!("{}.{}", self.ns, self.ladder)
    }

    pub fn parked_stream(&self) -> String {
        format!("{}.{}.parked", self.ns, self.ladder)
    }

    /// Publishes with confirms and asserts the broker acked (and did not return) it.
    pub async fn publish(&self, exchange: &str, routing_key: &str, body: &[u8], props: BasicProperties) {
        publish(&self.channel, exchange, routing_key, body, props).await;
    }

    /// A consumer on `queue` on a channel of its own, with a bounded prefetch.
    pub async fn consume(&self, queue: &str) -> TestConsumer {
        consume(&self.client, queue).await
    }

    /// Reads the parking lot from the start until `count` envelopes arrived (or panics at `WAIT`).
    pub async fn parked(&self, count: usize) -> Vec<Envelope> {
        read_parked(&self.client, &self.parked_stream(), count).await
    }
}

impl Drop for TestLadder {
    fn drop(&mut self) {
        let (mut queues, mut exchanges) = declared_names(&self.config);
        queues.extend(self.extra_queues.iter().cloned());
        exchanges.extend(self.extra_exchanges.iter().cloned());
        if let Some((token, _)) = self.service.take() {
            token.cancel();
        }
        delete_all_blocking(queues, exchanges);
    }
}

/// Deletes everything the plan of the config at a path declares when dropped, even if the test
/// panicked: made as soon as the config file can be loaded, before anything is declared.
pub struct Cleanup {
    queues: Vec<String>,
    exchanges: Vec<String>,
}

impl Cleanup {
    /// For the config file at `path` (which must load: its secret files written first).
    pub fn for_config(path: &Path) -> Self {
        let config = ladder::config::load(path, &HashMap::new()).expect("test config is valid");
        let (queues, exchanges) = declared_names(&config);
        Cleanup { queues, exchanges }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (queues, exchanges) = (std::mem::take(&mut self.queues), std::mem::take(&mut self.exchanges));
        delete_all_blocking(queues, exchanges);
    }
}

/// The queues and the exchanges `config` declares, for cleanup.
pub fn declared_names(config: &Config) -> (Vec<String>, Vec<String>) {
    let (mut queues, mut exchanges) = (vec![], vec![]);
    for d in topology::plan(config, topology::BrokerVersion::LATEST) {
        match d {
            Declaration::Queue { name, .. } => queues.push(name),
            Declaration::Exchange { name, .. } => exchanges.push(name),
            Declaration::Binding { .. } | Declaration::Unbinding { .. } => {}
        }
    }
    (queues, exchanges)
}

/// [`delete_all`] from a `Drop`: on a runtime of its own, on another thread, because Drop may
/// run while the test's runtime is unwinding.
pub fn delete_all_blocking(queues: Vec<String>, exchanges: Vec<String>) {
    let cleanup = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(delete_all(queues, exchanges));
    });
    let _ = cleanup.join();
}

/// Deletes queues and exchanges, ignoring those already gone.
pub async fn delete_all(queues: Vec<String>, exchanges: Vec<String>) {
    let Ok(options) = amqp_url().parse().map(ConnectOptions::new) else {
        return;
    };
    let Ok(Ok(conn)) = tokio::time::timeout(WAIT, Connection::connect(&options)).await else {
        return;
    };
    delete_on(&conn, queues, exchanges).await;
    let _ = tokio::time::timeout(WAIT, conn.close(200, "cleanup")).await;
}

/// Deletes queues and exchanges on `conn`, ignoring those already gone.
pub async fn delete_on(conn: &Connection, queues: Vec<String>, exchanges: Vec<String>) {
    for q in queues {
        // a failed delete closes the channel, so use one per object
        if let Ok(ch) = conn.create_channel().await {
            let _ = tokio::time::timeout(WAIT, ch.queue_delete(&q)).await;
        }
    }
    for e in exchanges {
        if let Ok(ch) = conn.create_channel().await {
            let _ = tokio::time::timeout(WAIT, ch.exchange_delete(&e)).await;
        }
    }
}

pub async fn publish(channel: &Channel, exchange: &str, routing_key: &str, body: &[u8], props: BasicProperties) {
    let confirm = tokio::time::timeout(WAIT, async {
        channel
            .basic_publish(exchange, routing_key, true, &props, body)
            .unwrap()
            .await
            .unwrap()
    })
    .await
    .expect("publish confirm timed out");
    assert_eq!(
        confirm,
        Confirmation::Ack,
        "publish to {exchange:?}/{routing_key:?} was not routed"
    );
}

/// A consumer and the channel it acks on.
pub struct TestConsumer {
    pub channel: Channel,
    pub consumer: Consumer,
}

impl TestConsumer {
    /// Acks `d`.
    pub fn ack(&self, d: &Delivery) {
        self.channel.basic_ack(d.delivery_tag, false).unwrap();
    }

    /// Rejects `d`, requeueing it or not.
    pub fn reject(&self, d: &Delivery, requeue: bool) {
        self.channel.basic_reject(d.delivery_tag, requeue).unwrap();
    }

    /// Nacks `d`, requeueing it or not.
    pub fn nack(&self, d: &Delivery, requeue: bool) {
        self.channel.basic_nack(d.delivery_tag, false, requeue).unwrap();
    }
}

/// A consumer on `queue` on a channel of its own, with a bounded prefetch.
pub async fn consume(conn: &Connection, queue: &str) -> TestConsumer {
    let channel = conn.create_channel().await.unwrap();
    channel.basic_qos(50).await.unwrap();
    let consumer = channel
        .basic_consume(queue, "", false, FieldTable::default())
        .await
        .unwrap();
    TestConsumer { channel, consumer }
}

/// The next delivery, or `None` after `within`.
pub async fn next_within(consumer: &mut TestConsumer, within: Duration) -> Option<Delivery> {
    match tokio::time::timeout(within, consumer.consumer.next()).await {
        Ok(Some(Ok(d))) => Some(d),
        Ok(Some(Err(e))) => panic!("consumer failed: {e}"),
        Ok(None) => panic!("consumer cancelled"),
        Err(_) => None,
    }
}

/// The next delivery; panics after [`WAIT`].
pub async fn next(consumer: &mut TestConsumer) -> Delivery {
    next_within(consumer, WAIT).await.expect("no delivery within the wait")
}

/// The next `count` deliveries on `consumer`, acked, each with the instant it arrived; panics
/// if they take longer than [`WAIT`] in all.
pub async fn receive_timed(consumer: &mut TestConsumer, count: usize) -> Vec<(Instant, Delivery)> {
    let mut got = Vec::with_capacity(count);
    let received = tokio::time::timeout(WAIT, async {
        while got.len() < count {
            let d = next(consumer).await;
            got.push((Instant::now(), d));
            consumer.ack(&got[got.len() - 1].1);
        }
    })
    .await;
    assert!(
        received.is_ok(),
        "only {} of {count} deliveries arrived within {WAIT:?}",
        got.len()
    );
    got
}

/// The next `count` deliveries on `consumer`, acked; panics if they take longer than [`WAIT`].
pub async fn receive(consumer: &mut TestConsumer, count: usize) -> Vec<Delivery> {
    receive_timed(consumer, count)
        .await
        .into_iter()
        .map(|(_, d)| d)
        .collect()
}

/// Reads `count` envelopes from a parked stream, from its first offset.
pub async fn read_parked(conn: &Connection, stream: &str, count: usize) -> Vec<Envelope> {
    let channel = conn.create_channel().await.unwrap();
    channel.basic_qos(500).await.unwrap();
    let mut args = FieldTable::default();
    args.set("x-stream-offset", FieldValue::string("first"));
    let consumer = channel.basic_consume(stream, "", false, args).await.unwrap();
    let mut consumer = TestConsumer { channel, consumer };
    let mut out = Vec::with_capacity(count);
    let read = tokio::time::timeout(WAIT, async {
        while out.len() < count {
            let d = next(&mut consumer).await;
            consumer.ack(&d);
            // resolutions, markers and bodies stored apart are records of the stream too
            if d.properties.kind.as_ref().and_then(|k| k.to_str()) != Some(ladder::model::envelope::FORMAT) {
                continue;
            }
            out.push(Envelope::from_slice(&d.body).expect("a parked record is an envelope"));
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "only {} of {count} parked messages arrived in {stream}",
        out.len()
    );
    let _ = consumer.channel.close(200, "read").await;
    out
}

/// The first pause between two probes of [`eventually`]; it doubles after every probe up to
/// [`POLL_MAX`]. Short, so that a condition that is nearly true when the wait starts (a service
/// that is almost ready) costs next to nothing.
const POLL_MIN: Duration = Duration::from_millis(10);

/// The longest pause between two probes: a slow condition is seen within this of coming true,
/// without a probe (a passive declare, an HTTP request, a fresh index of a parking lot) every
/// few milliseconds loading the two-core machine that runs the other tests beside it.
const POLL_MAX: Duration = Duration::from_millis(100);

/// Probes until `probe` answers `Ok`, for at most `within` in all: its value, or, when time ran
/// out, the last `Err` it answered (`None` if it answered none in time). A probe still running
/// at the end is cut short: the wait is bounded even if the probe is not.
///
/// The building block of [`eventually`] and [`eventually_ok`], for a caller that words its own
/// failure or does something else when time runs out.
pub async fn poll_until<T, E>(within: Duration, probe: impl AsyncFnMut() -> Result<T, E>) -> Result<T, Option<E>> {
    poll(within, probe, |answer| answer).await
}

/// Probes until `probe` answers `Some`, for at most `within`, and returns what it answered;
/// panics naming `what` (a condition: "the service is ready") when time runs out.
pub async fn eventually<T>(what: &str, within: Duration, probe: impl AsyncFnMut() -> Option<T>) -> T {
    match poll(within, probe, |answer| answer.ok_or(())).await {
        Ok(value) => value,
        Err(_) => panic!("timed out after {within:?} waiting until {what}"),
    }
}

/// Like [`eventually`], for a probe that says what it saw instead (`Err`): the panic shows the
/// last of it, which is what tells a slow condition from a wrong one.
pub async fn eventually_ok<T, E: std::fmt::Display>(
    what: &str,
    within: Duration,
    probe: impl AsyncFnMut() -> Result<T, E>,
) -> T {
    match poll_until(within, probe).await {
        Ok(value) => value,
        Err(Some(last)) => panic!("timed out after {within:?} waiting until {what}; last seen: {last}"),
        Err(None) => panic!("timed out after {within:?} waiting until {what}; the probe never answered"),
    }
}

/// [`eventually`] for a condition that needs no I/O, bounded by [`WAIT`].
///
/// Its own loop rather than `eventually` with an async closure: rustc cannot yet prove the
/// future of a generic `AsyncFnMut` `Send` for every lifetime, so a task that awaits
/// [`eventually`] cannot be `tokio::spawn`ed, and one that awaits this can.
pub async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let mut pacer = Pacer::new(WAIT);
    while !condition() {
        assert!(pacer.pause().await, "timed out after {WAIT:?} waiting until {what}");
    }
}

/// The loop of [`poll_until`]: `verdict` turns what `probe` answered into done (`Ok`) or not yet.
async fn poll<A, T, E>(
    within: Duration,
    mut probe: impl AsyncFnMut() -> A,
    verdict: impl Fn(A) -> Result<T, E>,
) -> Result<T, Option<E>> {
    let mut pacer = Pacer::new(within);
    let mut last = None;
    loop {
        // a zero timeout still polls the probe once: the last probe runs at the deadline
        match tokio::time::timeout(pacer.left(), probe()).await {
            Ok(answer) => match verdict(answer) {
                Ok(value) => return Ok(value),
                Err(seen) => last = Some(seen),
            },
            Err(_) => return Err(last),
        }
        if !pacer.pause().await {
            return Err(last);
        }
    }
}

/// The pauses of a bounded poll: from [`POLL_MIN`], doubling to [`POLL_MAX`], none past the deadline.
struct Pacer {
    deadline: tokio::time::Instant,
    pause: Duration,
}

impl Pacer {
    fn new(within: Duration) -> Self {
        Pacer {
            deadline: tokio::time::Instant::now() + within,
            pause: POLL_MIN,
        }
    }

    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(tokio::time::Instant::now())
    }

    /// Sleeps until the next probe is due; `false`, at once, if the deadline has passed.
    async fn pause(&mut self) -> bool {
        let left = self.left();
        if left.is_zero() {
            return false;
        }
        tokio::time::sleep(self.pause.min(left)).await;
        self.pause = (self.pause * 2).min(POLL_MAX);
        true
    }
}

/// A failure as a consumer publishes it to a ladder's intake: `retry-to` the queue, and
/// `retry-attempt` when given.
pub fn retry_props(to: &str, attempt: Option<i64>) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.set("retry-to", text(to));
    if let Some(attempt) = attempt {
        headers.set("retry-attempt", FieldValue::LongLongInt(attempt));
    }
    BasicProperties::default().with_headers(headers)
}

/// `ladder --config <config>` as the tests run it: the binary cargo built for them, stdin
/// closed, without the caller's `LADDER_*` overrides (a developer's shell must not change what
/// a test runs) or `RUST_MIN_STACK` (the binary sizes its own thread stacks).
pub fn ladder_command(config: &Path) -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ladder"));
    for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("LADDER_")) {
        command.env_remove(key);
    }
    command
        .arg("--config")
        .arg(config)
        .env_remove("RUST_MIN_STACK")
        .stdin(std::process::Stdio::null());
    command
}

/// Runs [`ladder_command`] with `args` and `env` to its end, within [`WAIT`]: what it printed
/// and how it exited.
pub async fn run_ladder(config: &Path, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut command = tokio::process::Command::from(ladder_command(config));
    command.args(args).envs(env.iter().copied()).kill_on_drop(true);
    tokio::time::timeout(WAIT, command.output())
        .await
        .unwrap_or_else(|_| panic!("ladder {args:?} did not exit within {WAIT:?}"))
        .expect("the ladder binary runs")
}

/// A header value as a long string.
pub fn text(s: &str) -> FieldValue {
    FieldValue::string(s)
}

pub fn headers_of(d: &Delivery) -> &FieldTable {
    d.properties.headers.as_ref().expect("headers")
}

/// The ms since epoch of a `retry-*` integer header.
pub fn int_header(d: &Delivery, key: &str) -> Option<i64> {
    match d.properties.headers.as_ref()?.get(key)? {
        FieldValue::LongLongInt(n) => Some(*n),
        other => panic!("{key} is {other:?}"),
    }
}

/// Properties of a message as a consumer republishes it on failure: as received, plus headers.
pub fn republish_props(d: &Delivery, extra: &[(&str, FieldValue)]) -> BasicProperties {
    let mut headers = d.properties.headers.clone().unwrap_or_default();
    for (k, v) in extra {
        headers.set(k, v.clone());
    }
    d.properties.clone().with_headers(headers)
}

/// A message id as text.
pub fn message_id(d: &Delivery) -> &str {
    d.properties
        .message_id
        .as_ref()
        .and_then(|m| m.to_str())
        .expect("a UTF-8 message id")
}

impl TestLadder {
    /// The parking lot of this test's ladder, read through the library on the test's connection.
    pub fn lot(&self) -> ladder::broker::lot::ParkingLot<'_> {
        ladder::broker::lot::ParkingLot::new(&self.client, &self.config.amqp, &self.ns, &self.config.ladders[0])
    }

    /// The config file the service runs with, for tests that run the binary against it.
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("ladder.toml")
    }
}

/// `(messages ready, consumers)` of `queue` by a passive declare, or `None` if it does not exist.
pub async fn depth(conn: &Connection, queue: &str) -> Option<(u32, u32)> {
    let ch = conn.create_channel().await.ok()?;
    let declared = tokio::time::timeout(WAIT, ch.queue_inspect(queue)).await.ok()?.ok();
    // a failed passive declare already closed the channel
    if declared.is_some() {
        let _ = ch.close(200, "peeked").await;
    }
    declared.map(|q| (q.message_count, q.consumer_count))
}

/// Whether exchange `name` exists (a passive declare on a channel of its own).
pub async fn exchange_exists(conn: &Connection, name: &str) -> bool {
    let ch = conn.create_channel().await.unwrap();
    let found = tokio::time::timeout(WAIT, ch.exchange_inspect(name))
        .await
        .unwrap()
        .is_ok();
    if found {
        let _ = ch.close(200, "peeked").await;
    }
    found
}

/// How many messages `queue` holds now (a passive declare on a channel of its own).
pub async fn queue_depth(conn: &Connection, queue: &str) -> u32 {
    let ch = conn.create_channel().await.unwrap();
    let q = tokio::time::timeout(WAIT, ch.queue_inspect(queue))
        .await
        .expect("passive declare timed out")
        .expect("the queue exists");
    let _ = ch.close(200, "depth").await;
    q.message_count
}

/// The admin server (with its poller and parking-lot followers) of a test, on an ephemeral
/// port; stopped when dropped.
pub struct TestAdmin {
    pub addr: std::net::SocketAddr,
    stop: CancellationToken,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl TestAdmin {
    /// Serves the admin endpoints for `config` and `state` on 127.0.0.1:0.
    pub async fn start(config: Arc<Config>, state: Arc<State>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(ladder::admin::run(listener, config, state, stop.clone()));
        TestAdmin {
            addr,
            stop,
            task: Some(task),
        }
    }

    /// `http://<addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Stops the server and the poller and waits for both, as `ladder run` does after a drain.
    pub async fn stop(mut self) {
        self.stop.cancel();
        let task = self.task.take().expect("running");
        let result = tokio::time::timeout(WAIT, task)
            .await
            .expect("the admin server stops on its token")
            .unwrap();
        result.expect("the admin server ran without error");
    }
}

impl Drop for TestAdmin {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
