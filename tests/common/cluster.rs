//! Helpers for the fault tests (`tests/faults.rs`): the nodes of a RabbitMQ cluster run by
//! `scripts/broker` (kill, stop, start, `rabbitmqctl`), `ladder run` processes against it, and
//! test clients that fail over between the nodes: a paced producer that counts only confirmed
//! publishes, and followers of a queue or a stream that record every arrival.
//!
//! Nodes are numbered from 1 as `scripts/broker` numbers them; the URLs in
//! `LADDER_TEST_CLUSTER_URLS` must be listed in that order (node N is the Nth URL).
#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use ladder_amqp::{BasicProperties, Channel, Confirmation, ConnectOptions, Connection, FieldTable, FieldValue};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{WAIT, now_ms};

/// Comma-separated AMQP URIs of the cluster's nodes, in node order.
pub const CLUSTER_URLS_VAR: &str = "LADDER_TEST_CLUSTER_URLS";

/// How long `scripts/broker start` may take (it waits up to 120 s itself).
const NODE_START_WAIT: Duration = Duration::from_secs(180);

/// How long a graceful `scripts/broker stop` may take (`rabbitmqctl stop`, then TERM, KILL).
const NODE_STOP_WAIT: Duration = Duration::from_secs(120);

/// How long one `rabbitmqctl` call may take.
const CTL_WAIT: Duration = Duration::from_secs(60);

/// How long one connection attempt of a test client may take.
const CLIENT_CONNECT_WAIT: Duration = Duration::from_secs(5);

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The cluster's URLs from [`CLUSTER_URLS_VAR`], `None` when it is unset. Set but empty is an
/// error, not a skip.
pub fn cluster_urls() -> Option<Vec<String>> {
    let value = std::env::var(CLUSTER_URLS_VAR).ok()?;
    let urls: Vec<String> = value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    assert!(!urls.is_empty(), "{CLUSTER_URLS_VAR} is set but names no URL");
    for url in &urls {
        url.parse::<ladder_amqp::AmqpUri>()
            .unwrap_or_else(|e| panic!("{CLUSTER_URLS_VAR}: {url:?} is not an AMQP URI: {e}"));
    }
    Some(urls)
}

/// The node number in a RabbitMQ node name or pid: `ladder-4-3-cluster-2@localhost` → 2,
/// `<ladder-4-3-cluster-2@localhost.1795456424.882.0>` → 2.
pub fn node_number(name: &str) -> Option<usize> {
    let before_at = name.trim_start_matches('<').split('@').next()?;
    before_at.rsplit('-').next()?.parse().ok()
}

/// The loopback port whose listener marks a fault test running on this machine (below the
/// ephemeral range, away from the brokers' ports).
pub const FAULT_LOCK_PORT: u16 = 29_711;

/// Held while a fault test runs, by any process on this machine: fault tests of two processes
/// at once (two `cargo test` runs) would kill each other's nodes and close each other's
/// connections. It is a listening socket, which one process at a time can bind and which the
/// system frees when that process dies, however it dies.
pub struct ExclusiveUse(std::net::TcpListener);

impl ExclusiveUse {
    /// Waits (at most `within`, saying so every 30 s) until no other fault test runs.
    pub fn wait(within: Duration) -> ExclusiveUse {
        let deadline = Instant::now() + within;
        let mut said: Option<Instant> = None;
        loop {
            match std::net::TcpListener::bind(("127.0.0.1", FAULT_LOCK_PORT)) {
                Ok(listener) => return ExclusiveUse(listener),
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                    if said.is_none_or(|at| at.elapsed() >= Duration::from_secs(30)) {
                        eprintln!("waiting for another fault test run (127.0.0.1:{FAULT_LOCK_PORT} is held) to finish");
                        said = Some(Instant::now());
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
                Err(e) => panic!(
                    "cannot take 127.0.0.1:{FAULT_LOCK_PORT}, which marks a running fault test, within {within:?}: {e}"
                ),
            }
        }
    }
}

/// One client connection as the broker lists it.
#[derive(Debug, Clone)]
pub struct BrokerConnection {
    /// For `rabbitmqctl close_connection`.
    pub pid: String,
    /// The node it is connected to.
    pub node: usize,
    /// The `connection_name` client property, if any.
    pub connection_name: Option<String>,
}

/// The cluster run by `scripts/broker PROFILE`; remembers the nodes it stopped or killed and
/// starts them again when dropped, so a failing test never leaves the cluster degraded.
pub struct Cluster {
    pub urls: Vec<String>,
    pub profile: String,
    script: PathBuf,
    down: Mutex<BTreeSet<usize>>,
    /// A cut or a link down may be in force (healed on drop).
    partitioned: Mutex<bool>,
}

/// The `scripts/broker` profile whose nodes run in network namespaces of their own.
pub const PARTITION_PROFILE: &str = "4.3-netns";

impl Cluster {
    /// The cluster of [`CLUSTER_URLS_VAR`] (profile `LADDER_TEST_BROKER_PROFILE`, default
    /// `4.3-cluster`), or `None` when the variable is unset.
    pub fn from_env() -> Option<Cluster> {
        let urls = cluster_urls()?;
        let profile = std::env::var("LADDER_TEST_BROKER_PROFILE").unwrap_or_else(|_| "4.3-cluster".into());
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/broker");
        Some(Cluster {
            urls,
            profile,
            script,
            down: Mutex::new(BTreeSet::new()),
            partitioned: Mutex::new(false),
        })
    }

    /// Node numbers, 1-based.
    pub fn nodes(&self) -> std::ops::RangeInclusive<usize> {
        1..=self.urls.len()
    }

    /// The node a broker port belongs to.
    pub fn node_of_port(&self, port: u16) -> Option<usize> {
        self.urls
            .iter()
            .position(|u| u.parse::<ladder_amqp::AmqpUri>().is_ok_and(|u| u.port == port))
            .map(|i| i + 1)
    }

    /// The URLs starting with node `first`, then the others in order (a failover list).
    pub fn urls_from(&self, first: usize) -> Vec<String> {
        let n = self.urls.len();
        (0..n).map(|k| self.urls[(first - 1 + k) % n].clone()).collect()
    }

    /// Runs `scripts/broker ARGS`; its stdout, or a panic naming its stderr.
    async fn broker(&self, args: &[&str], within: Duration) -> String {
        let mut command = tokio::process::Command::new(&self.script);
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let output = tokio::time::timeout(within, command.output())
            .await
            .unwrap_or_else(|_| panic!("scripts/broker {args:?} took longer than {within:?}"))
            .expect("scripts/broker runs");
        assert!(
            output.status.success(),
            "scripts/broker {args:?} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Like [`Cluster::broker`], blocking, for `Drop`; `false` if it failed or timed out.
    fn broker_blocking(&self, args: &[&str], within: Duration) -> bool {
        let Ok(mut child) = Command::new(&self.script)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
        else {
            return false;
        };
        let deadline = Instant::now() + within;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return status.success(),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return false;
                }
            }
        }
    }

    /// SIGKILLs node `n`'s VM.
    pub async fn kill(&self, n: usize) {
        lock(&self.down).insert(n);
        self.broker(&["kill", &self.profile, &n.to_string()], CTL_WAIT).await;
    }

    /// Stops node `n` gracefully.
    pub async fn stop(&self, n: usize) {
        lock(&self.down).insert(n);
        self.broker(&["stop", &self.profile, &n.to_string()], NODE_STOP_WAIT)
            .await;
    }

    /// Starts node `n` and waits until it serves AMQP (returns at once if it runs).
    pub async fn start(&self, n: usize) {
        self.broker(&["start", &self.profile, &n.to_string()], NODE_START_WAIT)
            .await;
        lock(&self.down).remove(&n);
    }

    /// One step of a rolling upgrade of node `n` to `version` (`scripts/broker upgrade`: wait
    /// for quorum plus one, drain, stop, start from that version's root on the same data, wait
    /// until it serves, revive).
    pub async fn upgrade(&self, n: usize, version: &str) {
        lock(&self.down).insert(n);
        self.broker(
            &["upgrade", &self.profile, &n.to_string(), version],
            NODE_STOP_WAIT + NODE_START_WAIT + CTL_WAIT * 2,
        )
        .await;
        lock(&self.down).remove(&n);
    }

    /// Starts every node that is not running, and waits until each serves.
    pub async fn ensure_up(&self) {
        for n in self.nodes() {
            self.start(n).await;
        }
    }

    /// Starts again, blocking, every node this test stopped or killed (for `Drop`).
    pub fn restore_blocking(&self) {
        if *lock(&self.partitioned) {
            eprintln!("healing the partitions of {} after a failed test", self.profile);
            if self.broker_blocking(&["heal", &self.profile], CTL_WAIT) {
                *lock(&self.partitioned) = false;
            }
        }
        let down: Vec<usize> = lock(&self.down).iter().copied().collect();
        for n in down {
            eprintln!("restarting node {n} of {} after a failed test", self.profile);
            if self.broker_blocking(&["start", &self.profile, &n.to_string()], NODE_START_WAIT) {
                lock(&self.down).remove(&n);
            }
        }
    }

    /// Whether the nodes run in network namespaces of their own (`scripts/broker` profile
    /// `4.3-netns`), so partitions can be made.
    pub fn partitionable(&self) -> bool {
        self.profile == PARTITION_PROFILE
    }

    /// Cuts `a` from `b` (node numbers, or `"host"`: this machine's namespace, where Ladder and
    /// the test run) with blackhole routes; `oneway`: only what `a` sends to `b` is dropped.
    pub async fn cut(&self, a: &str, b: &str, oneway: bool) {
        *lock(&self.partitioned) = true;
        let mut args = vec!["cut", &self.profile, a, b];
        if oneway {
            args.push("--oneway");
        }
        self.broker(&args, CTL_WAIT).await;
    }

    /// Sets node `n`'s link to the bridge down (`false`) or up.
    pub async fn link(&self, n: usize, up: bool) {
        *lock(&self.partitioned) = true;
        let n = n.to_string();
        self.broker(&["link", &self.profile, &n, if up { "up" } else { "down" }], CTL_WAIT)
            .await;
    }

    /// Removes every cut and sets every link up.
    pub async fn heal(&self) {
        self.broker(&["heal", &self.profile], CTL_WAIT).await;
        *lock(&self.partitioned) = false;
    }

    /// `rabbitmqctl -q ARGS` on the first node this test did not take down.
    pub async fn ctl(&self, args: &[&str]) -> String {
        let down = lock(&self.down).clone();
        let node = self.nodes().find(|n| !down.contains(n)).expect("a node is up");
        let mut all = vec!["ctl", &self.profile];
        let node = node.to_string();
        all.push(&node);
        all.push("-q");
        all.extend_from_slice(args);
        self.broker(&all, CTL_WAIT).await
    }

    /// `(queue, leader node)` of every queue whose name starts with `prefix`.
    pub async fn leaders(&self, prefix: &str) -> Vec<(String, usize)> {
        let out = self
            .ctl(&["list_queues", "name", "leader", "--formatter", "json"])
            .await;
        let rows: Vec<serde_json::Value> = serde_json::from_str(out.trim()).expect("list_queues prints JSON");
        let mut leaders: Vec<(String, usize)> = rows
            .iter()
            .filter_map(|row| {
                let name = row["name"].as_str()?;
                let leader = node_number(row["leader"].as_str()?)?;
                name.starts_with(prefix).then(|| (name.to_string(), leader))
            })
            .collect();
        leaders.sort();
        leaders
    }

    /// `(queue, messages, ready, unacked, leader)` of every queue whose name starts with
    /// `prefix`, as text, for failure reports.
    pub async fn queue_states(&self, prefix: &str) -> String {
        let out = self
            .ctl(&[
                "list_queues",
                "name",
                "messages",
                "messages_ready",
                "messages_unacknowledged",
                "consumers",
                "leader",
                "--no-table-headers",
            ])
            .await;
        out.lines()
            .filter(|l| l.starts_with(prefix))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every client connection of the cluster.
    pub async fn connections(&self) -> Vec<BrokerConnection> {
        // the JSON formatter prints pids in a form close_connection does not take; the table
        // formatter prints client properties as Erlang terms: join the two on the name
        let json = self
            .ctl(&["list_connections", "name", "client_properties", "--formatter", "json"])
            .await;
        let rows: Vec<serde_json::Value> = serde_json::from_str(json.trim()).expect("list_connections prints JSON");
        let mut names = HashMap::new();
        for row in rows {
            let Some(name) = row["name"].as_str() else { continue };
            let connection_name = row["client_properties"].as_array().and_then(|props| {
                props.iter().find_map(|p| {
                    (p[0].as_str() == Some("connection_name"))
                        .then(|| p[2].as_str().map(String::from))
                        .flatten()
                })
            });
            names.insert(name.to_string(), connection_name);
        }
        let table = self
            .ctl(&["list_connections", "--no-table-headers", "pid", "name"])
            .await;
        table
            .lines()
            .filter_map(|line| {
                let (pid, name) = line.split_once('\t')?;
                Some(BrokerConnection {
                    pid: pid.trim().to_string(),
                    node: node_number(pid.trim())?,
                    connection_name: names.get(name.trim()).cloned().flatten(),
                })
            })
            .collect()
    }

    /// The connections whose `connection_name` starts with `prefix`.
    pub async fn connections_named(&self, prefix: &str) -> Vec<BrokerConnection> {
        self.connections()
            .await
            .into_iter()
            .filter(|c| c.connection_name.as_deref().is_some_and(|n| n.starts_with(prefix)))
            .collect()
    }

    /// Closes `connections`, all at once (one `rabbitmqctl` each, run together).
    pub async fn close_connections(&self, connections: &[BrokerConnection]) {
        let closing = connections
            .iter()
            .map(|c| self.ctl_owned(vec!["close_connection".into(), c.pid.clone(), "fault test".into()]));
        futures_util::future::join_all(closing).await;
    }

    async fn ctl_owned(&self, args: Vec<String>) -> String {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.ctl(&args).await
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.restore_blocking();
    }
}

/// A connection to the first of `urls` that answers, trying each once; `None` if none did.
pub async fn connect_any(urls: &[String], name: &str) -> Option<(Connection, usize)> {
    for (i, url) in urls.iter().enumerate() {
        let Ok(mut uri) = url.parse::<ladder_amqp::AmqpUri>() else {
            continue;
        };
        uri.connection_timeout = Some(CLIENT_CONNECT_WAIT);
        let mut options = ConnectOptions::new(uri);
        options.connection_name = Some(name.to_string());
        if let Ok(connection) = Connection::connect(&options).await {
            return Some((connection, i));
        }
    }
    None
}

/// Like [`connect_any`], retrying every 200 ms until `stop`; `None` only when stopped.
async fn connect_until(urls: &[String], name: &str, stop: &CancellationToken) -> Option<Connection> {
    loop {
        if stop.is_cancelled() {
            return None;
        }
        if let Some((connection, _)) = connect_any(urls, name).await {
            return Some(connection);
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
            () = stop.cancelled() => return None,
        }
    }
}

/// Deletes the queues and exchanges through the first node that answers, ignoring those
/// already gone. On a runtime and thread of its own: callable from `Drop`.
pub fn delete_on_cluster_blocking(urls: Vec<String>, queues: Vec<String>, exchanges: Vec<String>) {
    let cleanup = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let Some((conn, _)) = connect_any(&urls, "ladder-test-cleanup").await else {
                eprintln!("cleanup: no cluster node answers; left behind: {queues:?} {exchanges:?}");
                return;
            };
            super::delete_on(&conn, queues, exchanges).await;
            let _ = tokio::time::timeout(WAIT, conn.close(200, "cleanup")).await;
        });
    });
    let _ = cleanup.join();
}

/// A `ladder run` process (restartable), its stderr in `<log_dir>/<name>-<run>.log`.
pub struct LadderProcess {
    pub name: String,
    config: PathBuf,
    log_dir: PathBuf,
    rust_log: String,
    pub runs: usize,
    child: Option<Child>,
    http: reqwest::Client,
}

impl LadderProcess {
    /// Spawns `ladder --config <config> run`, without the test's `LADDER_*` variables (the
    /// service reads every one as configuration).
    pub fn spawn(name: &str, config: &Path, log_dir: &Path, rust_log: &str) -> Self {
        let mut p = LadderProcess {
            name: name.to_string(),
            config: config.to_path_buf(),
            log_dir: log_dir.to_path_buf(),
            rust_log: rust_log.to_string(),
            runs: 0,
            child: None,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
        };
        p.respawn();
        p
    }

    /// Starts the process again (after [`LadderProcess::kill`]), logging to a new file.
    pub fn respawn(&mut self) {
        assert!(self.child.is_none(), "{} is running", self.name);
        self.runs += 1;
        let log = std::fs::File::create(self.log_path(self.runs)).unwrap();
        let child = super::ladder_command(&self.config)
            .arg("run")
            .env("RUST_LOG", &self.rust_log)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("the ladder binary starts");
        self.child = Some(child);
    }

    pub fn log_path(&self, run: usize) -> PathBuf {
        self.log_dir.join(format!("{}-{run}.log", self.name))
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The admin address the current run logged (`admin server listening address=…`).
    pub fn admin(&self) -> Option<SocketAddr> {
        self.child.as_ref()?;
        let log = std::fs::read_to_string(self.log_path(self.runs)).ok()?;
        let line = log.lines().find(|l| l.contains("admin server listening"))?;
        let address = line.split("address=").nth(1)?.split_whitespace().next()?;
        address.parse().ok()
    }

    /// `GET /ready`: `Some(true)` on 200, `Some(false)` on another status, `None` unreachable.
    pub async fn ready(&self) -> Option<bool> {
        let addr = self.admin()?;
        let response = self.http.get(format!("http://{addr}/ready")).send().await.ok()?;
        Some(response.status() == reqwest::StatusCode::OK)
    }

    /// Waits until `/ready` answers 200; panics after `within`.
    pub async fn wait_ready(&mut self, within: Duration) {
        let ready = super::poll_until(within, async || {
            if self.ready().await == Some(true) {
                return Ok(());
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("{} exited ({status}):\n{}", self.name, self.log_tail(30));
            }
            Err(())
        })
        .await;
        assert!(
            ready.is_ok(),
            "{} was not ready within {within:?}:\n{}",
            self.name,
            self.log_tail(30)
        );
    }

    /// The sum of every sample of metric `name` (all label sets), from `/metrics`.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        let addr = self.admin()?;
        let text = self
            .http
            .get(format!("http://{addr}/metrics"))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        let mut sum = None;
        for line in text.lines() {
            let Some(rest) = line.strip_prefix(name) else { continue };
            if !(rest.starts_with(' ') || rest.starts_with('{')) {
                continue;
            }
            let value: f64 = rest.rsplit(' ').next()?.parse().ok()?;
            *sum.get_or_insert(0.0) += value;
        }
        sum
    }

    /// SIGKILLs the process and reaps it.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let _ = child.kill();
        child.wait().ok()
    }

    /// SIGTERM, then waits up to `within` for the drain; SIGKILL if it takes longer.
    pub async fn terminate(&mut self, within: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        match super::poll_until(within, async || child.try_wait().ok().flatten().ok_or(())).await {
            Ok(status) => {
                self.child = None;
                Some(status)
            }
            Err(_) => {
                eprintln!("{} did not drain within {within:?}; killing it", self.name);
                self.kill()
            }
        }
    }

    /// The last `n` lines of the current run's log.
    pub fn log_tail(&self, n: usize) -> String {
        let log = std::fs::read_to_string(self.log_path(self.runs)).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for LadderProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What a [`Producer`] got confirmed, and what it could not.
#[derive(Debug, Default)]
pub struct ProducerReport {
    /// Sequence number → when the broker confirmed it (ms since the epoch).
    pub confirmed: HashMap<u64, u64>,
    /// Publishes sent.
    pub published: u64,
    /// Nacked by the broker.
    pub nacked: u64,
    /// Returned as unroutable.
    pub returned: u64,
    /// No answer: the channel died, or no confirm within the wait.
    pub unknown: u64,
    /// Connections opened after the first.
    pub reconnects: u64,
}

/// Publishes at a steady rate with publisher confirms, persistent and mandatory, reconnecting
/// to another node when its connection dies; counts a message only once the broker acked it.
pub struct Producer {
    stop: CancellationToken,
    task: JoinHandle<ProducerReport>,
    /// Confirmed so far (for progress checks while it runs).
    pub confirmed: Arc<AtomicU64>,
}

/// Builds the properties of message `seq` (from 1).
pub type PropsFor = Arc<dyn Fn(u64) -> BasicProperties + Send + Sync>;

impl Producer {
    /// Starts publishing to `exchange` (routing key `""`) every `1/rate` s, connecting to the
    /// first of `urls` that answers.
    pub fn start(urls: Vec<String>, exchange: String, rate: f64, props_for: PropsFor) -> Producer {
        let stop = CancellationToken::new();
        let confirmed = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(produce(
            urls,
            exchange,
            rate,
            props_for,
            stop.clone(),
            confirmed.clone(),
        ));
        Producer { stop, task, confirmed }
    }

    /// Stops publishing and waits for the confirms still outstanding.
    pub async fn finish(self) -> ProducerReport {
        self.stop.cancel();
        tokio::time::timeout(WAIT * 2, self.task)
            .await
            .expect("the producer finishes")
            .expect("the producer task did not panic")
    }
}

type Pending = BoxFuture<'static, (u64, Option<ladder_amqp::Result<Confirmation>>)>;

async fn produce(
    urls: Vec<String>,
    exchange: String,
    rate: f64,
    props_for: PropsFor,
    stop: CancellationToken,
    confirmed_count: Arc<AtomicU64>,
) -> ProducerReport {
    let mut report = ProducerReport::default();
    let mut pending: FuturesUnordered<Pending> = FuturesUnordered::new();
    let record =
        |report: &mut ProducerReport, (seq, answer): (u64, Option<ladder_amqp::Result<Confirmation>>)| match answer {
            Some(Ok(Confirmation::Ack)) => {
                report.confirmed.insert(seq, now_ms());
                confirmed_count.fetch_add(1, Ordering::Relaxed);
            }
            Some(Ok(Confirmation::Nack)) => report.nacked += 1,
            Some(Ok(Confirmation::Returned(_))) => report.returned += 1,
            _ => report.unknown += 1,
        };
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut seq = 0;
    let mut connections = 0u64;
    // the current connection and channel live until the last confirm is in: dropping either
    // fails them all
    let mut current: Option<(Connection, Channel)> = None;
    'connect: while !stop.is_cancelled() {
        let connecting = connect_until(&urls, "ladder-test-producer", &stop);
        tokio::pin!(connecting);
        // keep settling the old channel's confirms while connecting
        let connection = loop {
            tokio::select! {
                Some(done) = pending.next() => record(&mut report, done),
                connection = &mut connecting => break connection,
            }
        };
        let Some(connection) = connection else { break };
        connections += 1;
        let channel = match open_confirming(&connection).await {
            Some(channel) => channel,
            None => continue 'connect,
        };
        current = Some((connection.clone(), channel.clone()));
        loop {
            tokio::select! {
                biased;
                Some(done) = pending.next() => record(&mut report, done),
                () = stop.cancelled() => break 'connect,
                _ = ticker.tick() => {
                    if !channel.is_open() {
                        continue 'connect;
                    }
                    seq += 1;
                    let props = props_for(seq);
                    report.published += 1;
                    match channel.basic_publish(exchange.as_str(), "", true, &props, b"fault-test") {
                        Ok(confirm) => pending.push(Box::pin(async move {
                            (seq, tokio::time::timeout(WAIT, confirm).await.ok())
                        })),
                        Err(_) => {
                            report.unknown += 1;
                            continue 'connect;
                        }
                    }
                }
            }
        }
    }
    let drain = async {
        while let Some(done) = pending.next().await {
            record(&mut report, done);
        }
    };
    // every pending confirm is bounded by WAIT already
    drain.await;
    if let Some((connection, _)) = current {
        let _ = tokio::time::timeout(Duration::from_secs(2), connection.close(200, "done")).await;
    }
    report.reconnects = connections.saturating_sub(1);
    report
}

async fn open_confirming(connection: &Connection) -> Option<Channel> {
    let channel = tokio::time::timeout(WAIT, connection.create_channel())
        .await
        .ok()?
        .ok()?;
    tokio::time::timeout(WAIT, channel.confirm_select()).await.ok()?.ok()?;
    Some(channel)
}

/// One message as a [`Follower`] received it.
#[derive(Debug, Clone)]
pub struct Arrival {
    /// Its `message_id`.
    pub id: String,
    /// When it arrived, ms since the epoch.
    pub at_ms: u64,
    /// Its `retry-due-at` header.
    pub due_at_ms: Option<i64>,
    /// The broker delivered it before (to this test client, which lost its connection).
    pub redelivered: bool,
    /// For a parked record: the parking reason.
    pub reason: Option<String>,
}

/// Consumes a queue (or reads a stream from its first offset) on whichever node answers,
/// reconnecting when its connection dies, acking each message once recorded.
pub struct Follower {
    stop: CancellationToken,
    task: JoinHandle<()>,
    pub arrivals: Arc<Mutex<Vec<Arrival>>>,
    pub reconnects: Arc<AtomicU64>,
}

impl Follower {
    /// Follows `queue`; a `stream` is read from its first offset, and after a reconnect from
    /// the offset after the last one received.
    pub fn start(urls: Vec<String>, queue: String, stream: bool) -> Follower {
        let stop = CancellationToken::new();
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let reconnects = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(follow(
            urls,
            queue,
            stream,
            stop.clone(),
            arrivals.clone(),
            reconnects.clone(),
        ));
        Follower {
            stop,
            task,
            arrivals,
            reconnects,
        }
    }

    /// A copy of what arrived so far.
    pub fn snapshot(&self) -> Vec<Arrival> {
        lock(&self.arrivals).clone()
    }

    pub async fn finish(self) -> Vec<Arrival> {
        self.stop.cancel();
        let _ = tokio::time::timeout(WAIT, self.task).await;
        lock(&self.arrivals).clone()
    }
}

async fn follow(
    urls: Vec<String>,
    queue: String,
    stream: bool,
    stop: CancellationToken,
    arrivals: Arc<Mutex<Vec<Arrival>>>,
    reconnects: Arc<AtomicU64>,
) {
    // the next stream offset to read
    let mut next_offset: Option<i64> = None;
    let mut connections = 0u64;
    while !stop.is_cancelled() {
        let Some(connection) = connect_until(&urls, "ladder-test-follower", &stop).await else {
            return;
        };
        connections += 1;
        if connections > 1 {
            reconnects.fetch_add(1, Ordering::Relaxed);
        }
        let subscribed = async {
            let channel = connection.create_channel().await.ok()?;
            channel.basic_qos(if stream { 500 } else { 200 }).await.ok()?;
            let mut args = FieldTable::default();
            if stream {
                let offset = next_offset.map_or(FieldValue::string("first"), FieldValue::LongLongInt);
                args.set("x-stream-offset", offset);
            }
            let consumer = channel.basic_consume(queue.as_str(), "", false, args).await.ok()?;
            Some((channel, consumer))
        };
        let Some((channel, mut consumer)) = tokio::time::timeout(WAIT, subscribed).await.ok().flatten() else {
            let _ = tokio::time::timeout(Duration::from_secs(2), connection.close(200, "retry")).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        loop {
            let delivery = tokio::select! {
                () = stop.cancelled() => break,
                next = consumer.next() => match next {
                    Some(Ok(d)) => d,
                    _ => break,
                },
            };
            let at_ms = now_ms();
            let headers = delivery.properties.headers.as_ref();
            let header_int = |key: &str| match headers.and_then(|h| h.get(key)) {
                Some(FieldValue::LongLongInt(n)) => Some(*n),
                Some(FieldValue::LongInt(n)) => Some(i64::from(*n)),
                _ => None,
            };
            let mut keep = true;
            if stream && let Some(offset) = header_int("x-stream-offset") {
                keep = next_offset.is_none_or(|next| offset >= next);
                next_offset = Some(next_offset.map_or(offset + 1, |next| next.max(offset + 1)));
            }
            // resolutions, markers and bodies stored apart are records of a parking lot too
            if stream
                && delivery.properties.kind.as_ref().and_then(|k| k.to_str()) != Some(ladder::model::envelope::FORMAT)
            {
                keep = false;
            }
            if keep {
                let id = delivery
                    .properties
                    .message_id
                    .as_ref()
                    .map(|m| m.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let reason = stream.then(|| {
                    ladder::model::envelope::Envelope::from_slice(&delivery.body)
                        .map(|e| e.reason)
                        .unwrap_or_else(|_| "not-an-envelope".into())
                });
                lock(&arrivals).push(Arrival {
                    id,
                    at_ms,
                    due_at_ms: header_int("retry-due-at"),
                    redelivered: delivery.redelivered,
                    reason,
                });
            }
            if channel.basic_ack(delivery.delivery_tag, false).is_err() {
                break;
            }
        }
        if stop.is_cancelled() {
            let _ = channel.basic_cancel(consumer.tag()).await;
            let _ = tokio::time::timeout(Duration::from_secs(2), connection.close(200, "done")).await;
            return;
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), connection.close(200, "retry")).await;
    }
}
