//! Resource alarms and a broker out of file descriptors (issue 39), on a node of their own: the
//! `4.3-alarms` profile of scripts/broker (127.0.0.1:5741). These tests raise alarms and starve
//! the broker of descriptors, which blocks or refuses every client of that node, so they never
//! run against a shared broker: each skips unless `LADDER_TEST_BROKER_PROFILE` is `4.3-alarms`
//! (what `eval "$(scripts/broker env 4.3-alarms)"` exports), and `scripts/test` runs them alone,
//! in its disruptive phase. A guard puts the node back (limits, alarms) even when a test fails.

mod common;

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use ladder_amqp::{BasicProperties, ConnectOptions, Connection, FieldTable};

/// The scripts/broker profile these tests may disturb, and nothing else.
const PROFILE: &str = "4.3-alarms";

/// The repository (scripts/broker).
const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// How long an alarm is held: longer than two heartbeat intervals (10 s each by default), so a
/// connection that the client or the broker closed for missed heartbeats would show.
const MEMORY_ALARM: Duration = Duration::from_secs(25);

/// The disk alarm is held for less: the heartbeats were shown by the memory alarm.
const DISK_ALARM: Duration = Duration::from_secs(8);

/// How many failures the tests send before the alarm, and while it is raised.
const BEFORE: usize = 300;
const DURING: usize = 100;

/// The node these tests may disturb, or `None` (the test then says it skipped).
fn alarms_node() -> Option<()> {
    let profile = std::env::var("LADDER_TEST_BROKER_PROFILE").unwrap_or_default();
    if profile != PROFILE {
        eprintln!(
            "skipped: LADDER_TEST_BROKER_PROFILE is {profile:?}, not {PROFILE:?}; these tests raise alarms and \
             run only against their own node (scripts/broker up {PROFILE}; eval \"$(scripts/broker env {PROFILE})\")"
        );
        return None;
    }
    assert!(
        !amqp_url().contains(":5672/"),
        "the alarm tests must not run against the machine's broker: {}",
        amqp_url()
    );
    Some(())
}

/// `rabbitmqctl ARGS` on the alarms node, bounded; its output on success, a panic otherwise.
fn ctl(args: &[&str]) -> String {
    let out = bounded(
        Command::new(format!("{REPO}/scripts/broker"))
            .args(["ctl", PROFILE, "1"])
            .args(args),
    );
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `command` to its end within two minutes (killed after).
fn bounded(command: &mut Command) -> std::process::Output {
    try_bounded(command).unwrap_or_else(|| panic!("{command:?} did not finish within 120 s"))
}

/// [`bounded`] for a `Drop`: `None` (never a panic) when it does not finish or does not run.
fn try_bounded(command: &mut Command) -> Option<std::process::Output> {
    let child = command
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .ok()?;
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(120)) {
        Ok(out) => out.ok(),
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            None
        }
    }
}

/// The alarms the node has now (`rabbit_alarm:get_alarms()`), as Erlang text.
fn alarms() -> String {
    ctl(&["-q", "eval", "rabbit_alarm:get_alarms()."]).trim().to_string()
}

/// A resource alarm raised on the node; cleared on drop, whatever happened.
struct Alarm {
    clear: &'static [&'static str],
}

impl Alarm {
    fn memory() -> Self {
        let alarm = Alarm {
            clear: &["set_vm_memory_high_watermark", "0.6"],
        };
        ctl(&["set_vm_memory_high_watermark", "0.0000001"]);
        alarm
    }

    fn disk() -> Self {
        let alarm = Alarm {
            clear: &["set_disk_free_limit", "50000000"],
        };
        ctl(&["set_disk_free_limit", "100000GB"]);
        alarm
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        let cleared = try_bounded(
            Command::new(format!("{REPO}/scripts/broker"))
                .args(["ctl", PROFILE, "1"])
                .args(self.clear),
        );
        if !cleared.is_some_and(|out| out.status.success()) {
            eprintln!("could not clear the alarm: rabbitmqctl {:?} failed", self.clear);
            if !std::thread::panicking() {
                panic!("could not clear the alarm: rabbitmqctl {:?} failed", self.clear);
            }
        }
    }
}

/// Every delivery to a destination queue, by message id, counted by a consumer on a
/// connection of its own that never publishes (so the broker never blocks it).
struct Arrivals {
    seen: Arc<Mutex<HashMap<String, usize>>>,
    task: tokio::task::JoinHandle<()>,
    _connection: Connection,
}

impl Arrivals {
    async fn start(queue: &str) -> Self {
        let connection = connect().await;
        let mut consumer = consume(&connection, queue).await;
        let seen = Arc::new(Mutex::new(HashMap::new()));
        let sink = seen.clone();
        let task = tokio::spawn(async move {
            while let Some(Ok(d)) = consumer.consumer.next().await {
                let id = message_id(&d).to_string();
                *sink.lock().unwrap().entry(id).or_insert(0) += 1;
                consumer.ack(&d);
            }
        });
        Arrivals {
            seen,
            task,
            _connection: connection,
        }
    }

    fn distinct(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    fn deliveries(&self) -> usize {
        self.seen.lock().unwrap().values().sum()
    }

    /// Waits (at most `within`) until every id in `ids` arrived; panics with the missing ones.
    async fn wait_for(&self, ids: &[String], within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let missing: Vec<String> = {
                let seen = self.seen.lock().unwrap();
                ids.iter().filter(|id| !seen.contains_key(*id)).cloned().collect()
            };
            if missing.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {} messages did not arrive within {within:?} (lost?), e.g. {:?}",
                missing.len(),
                ids.len(),
                &missing[..missing.len().min(5)]
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Arrivals {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn failure(id: &str, destination: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.set("retry-to", text(destination));
    BasicProperties::default()
        .with_message_id(id)
        .with_delivery_mode(2)
        .with_headers(headers)
}

/// Publishes `ids` as failures into the ladder on a channel of `connection`, in a task: the
/// publishes wait while the broker blocks the connection; the task ends once all are confirmed.
fn publish_in_background(
    connection: &Connection,
    exchange: String,
    destination: String,
    ids: Vec<String>,
) -> tokio::task::JoinHandle<()> {
    let connection = connection.clone();
    tokio::spawn(async move {
        let channel = connection.create_channel().await.unwrap();
        channel.confirm_select().await.unwrap();
        let mut confirms = Vec::with_capacity(ids.len());
        for id in &ids {
            confirms.push(
                channel
                    .basic_publish(&exchange, "", true, &failure(id, &destination), b"during")
                    .unwrap(),
            );
        }
        for confirm in confirms {
            assert_eq!(confirm.await.unwrap(), ladder_amqp::Confirmation::Ack);
        }
    })
}

/// One alarm while Ladder moves retries: nothing lost, no duplicate, not ready with the broker's
/// reason while blocked (the connection kept, no reconnect), ready again by itself after.
async fn alarm_under_traffic(kind: &str, raise: fn() -> Alarm, hold: Duration, reason: &str) {
    // a 5 s tier: what is sent before the alarm is still waiting when the alarm comes, and comes
    // due while it holds (the broker blocks a connection when it publishes during an alarm)
    let mut t = TestLadder::start(
        &format!("alarm-{kind}"),
        "backoff = [\"5s\", \"2s\"]\nallow = [\"^{ns}-\"]\n",
    )
    .await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let arrivals = Arrivals::start(&orders).await;
    assert_eq!(alarms(), "[]", "the node has an alarm before the test raised one");

    // before: failures on their way through the intake and the 5 s tier when the alarm comes
    let before: Vec<String> = (0..BEFORE).map(|i| format!("b{i}")).collect();
    for id in &before {
        t.publish(&t.intake(), "", b"before", failure(id, &orders)).await;
    }
    let delivered_before = arrivals.distinct();

    let raised_at = Instant::now();
    let alarm = raise();
    let blocked_reason = format!("blocked: {reason}");
    eventually_ok("the service says the broker blocks it", WAIT, async || {
        let reasons = t.state.health.reasons();
        if reasons.iter().any(|r| r == &blocked_reason) {
            Ok(())
        } else {
            Err(format!(
                "reasons {reasons:?}, ready {}, {} delivered, broker alarms {}",
                t.state.health.is_ready(),
                arrivals.deliveries(),
                alarms()
            ))
        }
    })
    .await;
    let noticed = raised_at.elapsed();
    // during: failures published while blocked wait in the publisher's connection
    let publisher = connect().await;
    let during: Vec<String> = (0..DURING).map(|i| format!("d{i}")).collect();
    let publishing = publish_in_background(&publisher, t.intake(), orders.clone(), during.clone());

    let held_until = Instant::now() + hold;
    let mut moved_while_blocked = 0;
    let mut last = arrivals.deliveries();
    while Instant::now() < held_until {
        assert!(!t.state.health.is_ready(), "ready while the broker blocks it");
        assert_eq!(t.state.health.reasons(), vec![blocked_reason.clone()]);
        assert_eq!(t.state.metrics.broker_blocked.get(), 1);
        assert_eq!(
            t.state.metrics.reconnects.get(),
            0,
            "the service reconnected while blocked"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = arrivals.deliveries();
        moved_while_blocked += now - last;
        last = now;
    }
    let metrics = t.state.metrics.encode();
    assert!(metrics.contains("ladder_broker_blocked 1"), "{metrics}");
    assert!(metrics.contains("ladder_broker_blocked_episodes_total 1"), "{metrics}");

    let cleared_at = Instant::now();
    drop(alarm);
    wait_until("the service is ready again once the alarm cleared", || {
        t.state.health.is_ready()
    })
    .await;
    let resumed = cleared_at.elapsed();
    assert!(t.state.health.reasons().is_empty(), "{:?}", t.state.health.reasons());
    assert_eq!(t.state.metrics.broker_blocked.get(), 0);

    tokio::time::timeout(WAIT, publishing)
        .await
        .expect("the publishes made while blocked are confirmed after the alarm")
        .unwrap();
    let all: Vec<String> = before.iter().chain(&during).cloned().collect();
    arrivals.wait_for(&all, WAIT).await;
    // anything that would come twice comes within a tier's wait of the last delivery
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (distinct, deliveries) = (arrivals.distinct(), arrivals.deliveries());
    assert_eq!(distinct, all.len(), "a message arrived that was never sent");
    assert_eq!(t.state.metrics.reconnects.get(), 0, "the service reconnected");
    assert!(
        t.state
            .metrics
            .encode()
            .contains("ladder_broker_blocked_episodes_total 1")
    );
    eprintln!(
        "ALARM kind={kind} messages={} lost=0 duplicates={} blocked_noticed_ms={} held_ms={} \
         delivered_before_alarm={delivered_before} moved_while_blocked={moved_while_blocked} ready_again_ms={} reconnects=0",
        all.len(),
        deliveries - distinct,
        noticed.as_millis(),
        hold.as_millis(),
        resumed.as_millis()
    );
    assert_eq!(deliveries, distinct, "duplicates without a reconnect");
    t.client = connect().await; // the helpers' cleanup opens its own; keep ours fresh
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disruptive_memory_alarm_blocks_then_resumes_losing_nothing() {
    if alarms_node().is_none() {
        return;
    }
    alarm_under_traffic("memory", Alarm::memory, MEMORY_ALARM, "low on memory").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disruptive_disk_alarm_blocks_then_resumes_losing_nothing() {
    if alarms_node().is_none() {
        return;
    }
    alarm_under_traffic("disk", Alarm::disk, DISK_ALARM, "low on disk").await;
}

// --- a broker out of file descriptors -----------------------------------------------------

/// The node's Erlang VM (its pid, for its file-descriptor limit).
fn beam_pid() -> u32 {
    ctl(&["-q", "eval", "os:getpid()."])
        .trim()
        .trim_matches('"')
        .parse()
        .expect("a pid")
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn nofile(pid: u32) -> String {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let fields: Vec<&str> = line.split_whitespace().collect();
    format!("{}:{}", fields[3], fields[4])
}

/// The node's file-descriptor limit (soft) lowered with prlimit; put back on drop. The kernel
/// refuses a new descriptor whose number is not below the limit, so a limit of 3 refuses every
/// new one (0-2 are taken) — a socket, a file, the CLI's distribution link — while every
/// descriptor already open keeps working, and one closed frees a number the broker cannot use
/// again: a broker out of descriptors, at once and reversibly.
struct FdLimit {
    pid: u32,
    before: String,
}

impl FdLimit {
    fn lower(pid: u32, soft: usize) -> Self {
        let before = nofile(pid);
        let hard = before.split(':').nth(1).unwrap().to_string();
        let limit = FdLimit { pid, before };
        let status = Command::new("prlimit")
            .args(["--pid", &pid.to_string(), &format!("--nofile={soft}:{hard}")])
            .status()
            .unwrap();
        assert!(status.success(), "prlimit failed");
        limit
    }
}

impl Drop for FdLimit {
    fn drop(&mut self) {
        let status = Command::new("prlimit")
            .args(["--pid", &self.pid.to_string(), &format!("--nofile={}", self.before)])
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!("could not put the node's file-descriptor limit back to {}", self.before);
        }
    }
}

/// Restarts the alarms node when dropped. A node that ran out of descriptors is not itself
/// afterwards: RabbitMQ 4.3.6's memory monitor crashed on `emfile` reading `/proc` and was not
/// restarted (`set_vm_memory_high_watermark` then fails with `noproc`), so the node is restarted
/// before the next test.
struct RestartNode;

impl Drop for RestartNode {
    fn drop(&mut self) {
        for step in ["stop", "start"] {
            match try_bounded(Command::new(format!("{REPO}/scripts/broker")).args([step, PROFILE, "1"])) {
                Some(out) if out.status.success() => {}
                Some(out) => eprintln!(
                    "scripts/broker {step} {PROFILE} 1 failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ),
                None => eprintln!("scripts/broker {step} {PROFILE} 1 did not finish within 120 s"),
            }
        }
    }
}

/// A connection attempt that gives up after `ms`.
async fn try_connect(ms: u64) -> ladder_amqp::Result<Connection> {
    let mut uri: ladder_amqp::AmqpUri = amqp_url().parse().unwrap();
    uri.connection_timeout = Some(Duration::from_millis(ms));
    Connection::connect(&ConnectOptions::new(uri)).await
}

/// Issue 39: a broker out of file descriptors accepts no new connection (measured on 3.10 with
/// ~400 quorum queues on `ulimit -n 1024`). Here the node's limit is lowered below every
/// descriptor it has (see [`FdLimit`]): it refuses every new connection. A Ladder already
/// connected keeps working (retries keep arriving, it stays ready); a second replica started
/// meanwhile cannot connect, keeps retrying with backoff without crashing, and `/ready` says why;
/// once the broker has descriptors again it connects by itself. Nothing is lost.
///
/// The destination is a quorum queue: with no descriptor to spare, retries to a classic queue
/// declared just before were not delivered (measured: 100 confirmed into the ladder, none
/// delivered within 30 s; a classic queue opens files of its own as it fills), while quorum
/// queues write to the node's already open log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disruptive_broker_out_of_file_descriptors_refuses_then_recovers() {
    if alarms_node().is_none() {
        return;
    }
    let _restart = RestartNode; // dropped last, after the cleanup of the namespace
    let mut t = TestLadder::start("fds", "backoff = [\"1s\", \"2s\"]\nallow = [\"^{ns}-\"]\n").await;
    let mut quorum = FieldTable::default();
    quorum.set("x-queue-type", text("quorum"));
    let orders = t.declare_queue("orders", quorum).await;
    let arrivals = Arrivals::start(&orders).await;
    // the test's publisher, opened while the broker still accepts connections
    let publisher = connect().await;
    // the second replica's config: the same ladder, connection attempts cut at 3 s
    let env: HashMap<String, String> = [(
        "LADDER_AMQP__URL".to_string(),
        format!("{}?connection_timeout=3000", amqp_url()),
    )]
    .into();
    let second_config = Arc::new(ladder::config::load(&t.config_path(), &env).expect("test config is valid"));

    let pid = beam_pid();
    let open = open_fds(pid);
    let limit = FdLimit::lower(pid, 3);
    let limited_at = Instant::now();
    eprintln!("node pid {pid}: {open} descriptors open, limit lowered to 3");
    let refused = try_connect(3000)
        .await
        .expect_err("a new connection was accepted")
        .to_string();
    eprintln!("the broker refused a new connection: {refused}");

    // a second replica starts now: no connection, retries with backoff, says why
    let second = Arc::new(ladder::broker::state::State::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let replica = tokio::spawn(ladder::broker::supervisor::run(
        second_config,
        second.clone(),
        stop.clone(),
    ));
    let _stop_replica = stop.clone().drop_guard();

    // the connected one keeps working
    let first: Vec<String> = (0..100).map(|i| format!("f{i}")).collect();
    let sending = publish_in_background(&publisher, t.intake(), orders.clone(), first.clone());
    tokio::time::timeout(WAIT, sending)
        .await
        .expect("publishes confirmed")
        .unwrap();
    arrivals.wait_for(&first, WAIT).await;
    assert!(t.state.health.is_ready(), "{:?}", t.state.health.reasons());
    assert_eq!(t.state.metrics.reconnects.get(), 0);
    // more, waiting in the tiers while the limit stays
    let later: Vec<String> = (0..100).map(|i| format!("s{i}")).collect();
    let sending = publish_in_background(&publisher, t.intake(), orders.clone(), later.clone());
    tokio::time::timeout(WAIT, sending)
        .await
        .expect("publishes confirmed")
        .unwrap();

    let why = eventually_ok("the second replica says why it is not ready", WAIT, async || {
        let reasons = second.health.reasons();
        match reasons.iter().find(|r| r.starts_with("disconnected: ")) {
            Some(r) if second.metrics.reconnects.get() >= 2 => Ok(r.clone()),
            _ => Err(format!("{reasons:?}, {} attempts", second.metrics.reconnects.get())),
        }
    })
    .await;
    assert!(why.contains("took longer than"), "{why}");
    assert!(!second.health.is_ready());
    assert!(!replica.is_finished(), "the second replica stopped");
    let attempts = second.metrics.reconnects.get();
    let refused_for = limited_at.elapsed();

    let freed_at = Instant::now();
    drop(limit);
    wait_until(
        "the second replica connects once the broker has descriptors again",
        || second.health.is_ready(),
    )
    .await;
    let recovered = freed_at.elapsed();
    assert!(t.state.health.is_ready());
    let all: Vec<String> = first.iter().chain(&later).cloned().collect();
    arrivals.wait_for(&all, WAIT).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (distinct, deliveries) = (arrivals.distinct(), arrivals.deliveries());
    assert_eq!(distinct, all.len(), "a message arrived that was never sent");
    eprintln!(
        "FDS messages={} lost=0 duplicates={} refused_for_ms={} second_replica_attempts={attempts} reason={why:?} \
         second_ready_after_freed_ms={} first_reconnects={}",
        all.len(),
        deliveries - distinct,
        refused_for.as_millis(),
        recovered.as_millis(),
        t.state.metrics.reconnects.get()
    );
    assert_eq!(deliveries, distinct, "duplicates without a reconnect");
    assert_eq!(t.state.metrics.reconnects.get(), 0);
    eprintln!(
        "the node's memory monitor after the starvation: {}",
        ctl(&["-q", "eval", "whereis(vm_memory_monitor)."]).trim()
    );
    stop.cancel();
    tokio::time::timeout(WAIT, replica)
        .await
        .expect("the second replica drains")
        .unwrap()
        .expect("the second replica ran without a fatal error");
}

/// Longer than the 30 s the session gives the streams' catch-up before it reconnects: a service
/// that timed out into a reconnect during the alarm would show.
const STARTED_BLOCKED: Duration = Duration::from_secs(35);

/// Issue 39: a service that starts while an alarm is in effect declares its topology (declares
/// are not blocked), then waits for the alarm — its streams' markers are publishes — without
/// timing out into reconnects, not ready with the broker's reason; once the alarm clears it
/// serves, and nothing sent meanwhile is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disruptive_a_service_started_during_an_alarm_waits_then_serves() {
    if alarms_node().is_none() {
        return;
    }
    let mut t = TestLadder::configure("alarm-start", "backoff = [\"1s\"]\nallow = [\"^{ns}-\"]\n").await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let arrivals = Arrivals::start(&orders).await;
    assert_eq!(alarms(), "[]", "the node has an alarm before the test raised one");
    let alarm = Alarm::memory();
    let started = Instant::now();
    let stop = tokio_util::sync::CancellationToken::new();
    let service = tokio::spawn(ladder::broker::supervisor::run(
        t.config.clone(),
        t.state.clone(),
        stop.clone(),
    ));
    let _stop = stop.clone().drop_guard();
    eventually_ok("the starting service says the broker blocks it", WAIT, async || {
        let reasons = t.state.health.reasons();
        if reasons.iter().any(|r| r == "blocked: low on memory") {
            Ok(())
        } else {
            Err(format!("{reasons:?}"))
        }
    })
    .await;
    while started.elapsed() < STARTED_BLOCKED {
        assert!(!t.state.health.is_ready(), "ready while blocked");
        assert_eq!(t.state.metrics.reconnects.get(), 0, "reconnected while blocked");
        assert!(!service.is_finished(), "the service stopped");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // the topology was declared: the intake takes failures (the publisher waits for the alarm)
    let publisher = connect().await;
    let ids: Vec<String> = (0..50).map(|i| format!("m{i}")).collect();
    let publishing = publish_in_background(&publisher, t.intake(), orders.clone(), ids.clone());

    let cleared_at = Instant::now();
    drop(alarm);
    wait_until("the service is ready once the alarm cleared", || {
        t.state.health.is_ready()
    })
    .await;
    let ready_after = cleared_at.elapsed();
    tokio::time::timeout(WAIT, publishing)
        .await
        .expect("confirmed after the alarm")
        .unwrap();
    arrivals.wait_for(&ids, WAIT).await;
    assert_eq!(t.state.metrics.reconnects.get(), 0);
    eprintln!(
        "ALARM kind=memory-at-start messages={} lost=0 duplicates={} blocked_ms={} ready_after_clear_ms={} reconnects=0",
        ids.len(),
        arrivals.deliveries() - arrivals.distinct(),
        cleared_at.duration_since(started).as_millis(),
        ready_after.as_millis()
    );
    stop.cancel();
    tokio::time::timeout(WAIT, service)
        .await
        .expect("the service drains")
        .unwrap()
        .expect("the service ran without a fatal error");
}
