//! Shared helpers for the integration tests: a ladder in a namespace of its own on the machine's
//! real RabbitMQ, the service running against it, and a client to publish, consume and read the
//! parking lot. Everything a test declares is deleted when its `TestLadder` is dropped.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use ladder::config::Config;
use ladder::envelope::Envelope;
use ladder::service::{self, State};
use ladder::topology::{self, Declaration};
use lapin::message::Delivery;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, Consumer};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The machine's broker (CI's too).
pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

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
    let connection = tokio::time::timeout(WAIT, Connection::connect(AMQP_URL, ConnectionProperties::default()))
        .await
        .expect("connect timed out")
        .expect("the test broker at 127.0.0.1:5672 accepts connections");
    // A test's connection that fails says why on stderr: calls made afterwards only report the
    // state (`InvalidConnectionState(Error)`), which does not tell a broken socket from a missed
    // heartbeat or a protocol error. The task ends with the connection.
    let mut events = connection.events_listener();
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            if let lapin::Event::Error(e) = event {
                eprintln!("test connection error: {e:?}");
            }
        }
    });
    connection
}

/// An `extra_main` for [`write_config`] that gives the admin server an ephemeral port, for tests
/// that run the binary (`ladder run` binds `admin.bind`, 127.0.0.1:9464 by default).
pub const ADMIN_ANY_PORT: &str = "[admin]\nbind = \"127.0.0.1:0\"";

/// Writes `ladder.toml` and `ladders/<ladder>.toml` into `dir`, with `{ns}` in `ladder_toml`
/// replaced by the namespace, and returns the config path.
pub fn write_config(dir: &Path, ns: &str, extra_main: &str, ladder: &str, ladder_toml: &str) -> PathBuf {
    let main = format!(
        "namespace = \"{ns}\"\nshutdown_grace = \"5s\"\nprefetch = 100\n{extra_main}\n[amqp]\nurl = \"{AMQP_URL}\"\nreconnect_min = \"100ms\"\nreconnect_max = \"1s\"\n"
    );
    std::fs::write(dir.join("ladder.toml"), main).unwrap();
    std::fs::create_dir_all(dir.join("ladders")).unwrap();
    std::fs::write(
        dir.join("ladders").join(format!("{ladder}.toml")),
        ladder_toml.replace("{ns}", ns),
    )
    .unwrap();
    dir.join("ladder.toml")
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
        channel.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
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
                q.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
            )
            .await
            .unwrap();
        q
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
    pub async fn consume(&self, queue: &str) -> Consumer {
        let ch = self.client.create_channel().await.unwrap();
        ch.basic_qos(50, BasicQosOptions::default()).await.unwrap();
        ch.basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap()
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

/// The queues and the exchanges `config` declares, for cleanup.
pub fn declared_names(config: &Config) -> (Vec<String>, Vec<String>) {
    let (mut queues, mut exchanges) = (vec![], vec![]);
    for d in topology::plan(config) {
        match d {
            Declaration::Queue { name, .. } => queues.push(name),
            Declaration::Exchange { name, .. } => exchanges.push(name),
            Declaration::Binding { .. } => {}
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
    let Ok(Ok(conn)) = tokio::time::timeout(WAIT, Connection::connect(AMQP_URL, ConnectionProperties::default())).await
    else {
        return;
    };
    for q in queues {
        // a failed delete closes the channel, so use one per object
        if let Ok(ch) = conn.create_channel().await {
            let _ = tokio::time::timeout(WAIT, ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default())).await;
        }
    }
    for e in exchanges {
        if let Ok(ch) = conn.create_channel().await {
            let _ = tokio::time::timeout(
                WAIT,
                ch.exchange_delete(e.as_str().into(), ExchangeDeleteOptions::default()),
            )
            .await;
        }
    }
    let _ = conn.close(200, "cleanup".into()).await;
}

pub async fn publish(channel: &Channel, exchange: &str, routing_key: &str, body: &[u8], props: BasicProperties) {
    let confirm = tokio::time::timeout(WAIT, async {
        channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap()
    })
    .await
    .expect("publish confirm timed out");
    assert_eq!(
        confirm,
        Confirmation::Ack(None),
        "publish to {exchange:?}/{routing_key:?} was not routed"
    );
}

/// The next delivery, or `None` after `within`.
pub async fn next_within(consumer: &mut Consumer, within: Duration) -> Option<Delivery> {
    match tokio::time::timeout(within, consumer.next()).await {
        Ok(Some(Ok(d))) => Some(d),
        Ok(Some(Err(e))) => panic!("consumer failed: {e}"),
        Ok(None) => panic!("consumer cancelled"),
        Err(_) => None,
    }
}

/// The next delivery; panics after [`WAIT`].
pub async fn next(consumer: &mut Consumer) -> Delivery {
    next_within(consumer, WAIT).await.expect("no delivery within the wait")
}

/// Reads `count` envelopes from a parked stream, from its first offset.
pub async fn read_parked(conn: &Connection, stream: &str, count: usize) -> Vec<Envelope> {
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(500, BasicQosOptions::default()).await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-stream-offset".into(),
        AMQPValue::LongString(LongString::from("first")),
    );
    let mut consumer = ch
        .basic_consume(stream.into(), "".into(), BasicConsumeOptions::default(), args)
        .await
        .unwrap();
    let mut out = Vec::with_capacity(count);
    let deadline = Instant::now() + WAIT;
    while out.len() < count {
        let left = deadline.saturating_duration_since(Instant::now());
        let Some(d) = next_within(&mut consumer, left).await else {
            panic!("only {} of {count} parked messages arrived in {stream}", out.len());
        };
        out.push(Envelope::from_slice(&d.data).expect("a parked record is an envelope"));
        d.acker.ack(Default::default()).await.unwrap();
    }
    let _ = ch.close(200, "read".into()).await;
    out
}

/// Polls `condition` every 20 ms; panics after [`WAIT`].
pub async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A header value as a long string.
pub fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes()))
}

pub fn headers_of(d: &Delivery) -> &std::collections::BTreeMap<lapin::types::ShortString, AMQPValue> {
    d.properties.headers().as_ref().expect("headers").inner()
}

/// The ms since epoch of a `retry-*` integer header.
pub fn int_header(d: &Delivery, key: &str) -> Option<i64> {
    match d.properties.headers().as_ref()?.inner().get(key)? {
        AMQPValue::LongLongInt(n) => Some(*n),
        other => panic!("{key} is {other:?}"),
    }
}

/// Properties of a message as a consumer republishes it on failure: as received, plus headers.
pub fn republish_props(d: &Delivery, extra: &[(&str, AMQPValue)]) -> BasicProperties {
    let mut headers = d.properties.headers().clone().unwrap_or_default();
    for (k, v) in extra {
        headers.insert((*k).into(), v.clone());
    }
    d.properties.clone().with_headers(headers)
}

impl TestLadder {
    /// The parking lot of this test's ladder, read through the library on the test's connection.
    pub fn lot(&self) -> ladder::parking::ParkingLot<'_> {
        ladder::parking::ParkingLot::new(&self.client, &self.ns, &self.config.ladders[0])
    }

    /// The config file the service runs with, for tests that run the binary against it.
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("ladder.toml")
    }
}

/// How many messages `queue` holds now (a passive declare on a channel of its own).
pub async fn queue_depth(conn: &Connection, queue: &str) -> u32 {
    let ch = conn.create_channel().await.unwrap();
    let q = tokio::time::timeout(
        WAIT,
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await
    .expect("passive declare timed out")
    .expect("the queue exists");
    let _ = ch.close(200, "depth".into()).await;
    q.message_count()
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
