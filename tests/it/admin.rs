//! The admin server and the depth poller against the real broker: `/ready` follows the
//! service, `/metrics` and `/api/ladders` follow real retries, a purged tier is reported by the
//! accounting check, and an unreachable broker only shows as an error in `/api/ladders`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Instant;

use crate::common::*;
use ladder::admin;
use ladder::config::SecretUri;
use ladder_amqp::{BasicProperties, FieldTable};

/// Fast polls, so a test sees depths and the accounting verdict within a second or two.
const FAST_POLLS: &str = "[admin]\npoll_interval = \"100ms\"";

/// A short tier that delivers during the test and a long one that holds messages throughout.
const SHORT_AND_LONG: &str = r#"
backoff = ["200ms", "10m"]
max_attempts = 2
allow = ["^{ns}-"]
"#;

/// One long tier: whatever is scheduled stays there for the whole test.
const LONG_ONLY: &str = r#"
backoff = ["10m"]
allow = ["^{ns}-"]
"#;

/// What these tests read from the admin server.
trait AdminReads {
    async fn get(&self, path: &str) -> Response;
    async fn metrics(&self) -> String;
    async fn ladders(&self) -> serde_json::Value;
    async fn wait_ladders(&self, what: &str, condition: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value;
    async fn wait_metrics(&self, lines: &[&str]) -> String;
}

impl AdminReads for TestAdmin {
    async fn get(&self, path: &str) -> Response {
        http_get(self.addr, path).await
    }

    async fn metrics(&self) -> String {
        let r = self.get("/metrics").await;
        assert_eq!(r.status, 200);
        r.body
    }

    async fn ladders(&self) -> serde_json::Value {
        let r = self.get("/api/ladders").await;
        assert_eq!(r.status, 200, "{}", r.body);
        serde_json::from_str(&r.body).expect("/api/ladders is JSON")
    }

    /// Polls `/api/ladders` until `condition` holds for it; panics after [`WAIT`].
    async fn wait_ladders(&self, what: &str, condition: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        eventually_ok(what, WAIT, async || {
            let v = self.ladders().await;
            if condition(&v) { Ok(v) } else { Err(format!("\n{v:#}")) }
        })
        .await
    }

    /// Polls `/metrics` until it has every line of `lines`; panics after [`WAIT`].
    async fn wait_metrics(&self, lines: &[&str]) -> String {
        eventually_ok("/metrics has every line", WAIT, async || {
            let text = self.metrics().await;
            let missing: Vec<_> = lines.iter().filter(|l| !text.lines().any(|line| line == **l)).collect();
            if missing.is_empty() {
                Ok(text)
            } else {
                Err(format!("{missing:?} missing in\n{text}"))
            }
        })
        .await
    }
}

struct Response {
    status: u16,
    content_type: String,
    body: String,
}

/// `GET path` over a plain HTTP/1.1 connection (no client crate needed), bounded by [`WAIT`].
async fn http_get(addr: SocketAddr, path: &str) -> Response {
    let path = path.to_string();
    let get = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut raw = String::new();
        stream.read_to_string(&mut raw).unwrap();
        raw
    });
    let raw = tokio::time::timeout(WAIT, get).await.expect("GET timed out").unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").expect("a complete HTTP response");
    let mut lines = head.lines();
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let header = |name: &str| {
        head.lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
    };
    assert!(header("transfer-encoding").is_none(), "unexpected chunked body");
    Response {
        status,
        content_type: header("content-type").unwrap_or_default(),
        body: body.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_is_503_until_the_service_serves_and_after_it_stopped() {
    let mut t = TestLadder::configure_with("admin-ready", FAST_POLLS, SHORT_AND_LONG).await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let live = admin.get("/live").await;
    assert_eq!((live.status, live.body.as_str()), (200, "ok"));
    assert_eq!(admin.get("/ready").await.status, 503);

    t.start_service().await;
    assert_eq!(admin.get("/ready").await.status, 200);

    t.stop_service().await;
    assert_eq!(admin.get("/ready").await.status, 503);
    assert_eq!(admin.get("/live").await.status, 200);
    admin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_ladders_follow_real_retries() {
    let mut t = TestLadder::configure_with("admin-metrics", FAST_POLLS, SHORT_AND_LONG).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    assert_eq!(admin.get("/ready").await.status, 200);
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;

    // 3 first failures: the 200ms tier, then back to orders
    for i in 0..3 {
        t.publish(
            &t.intake(),
            "",
            format!("short {i}").as_bytes(),
            retry_props(&orders, None),
        )
        .await;
    }
    // 2 second failures: the 10m tier, where they stay
    for i in 0..2 {
        t.publish(
            &t.intake(),
            "",
            format!("long {i}").as_bytes(),
            retry_props(&orders, Some(1)),
        )
        .await;
    }
    // 1 to a queue the ladder may not deliver to: parked at intake
    t.publish(&t.intake(), "", b"stray", retry_props("elsewhere", None))
        .await;
    for _ in 0..3 {
        next(&mut consumer).await;
    }

    let ladder = "ladder=\"default\"";
    let text = admin
        .wait_metrics(&[
            &format!("ladder_received_messages_total{{{ladder},hop=\"intake\"}} 6"),
            &format!("ladder_received_messages_total{{{ladder},hop=\"due\"}} 3"),
            &format!("ladder_scheduled_messages_total{{{ladder},tier=\"200ms\"}} 3"),
            &format!("ladder_scheduled_messages_total{{{ladder},tier=\"10m\"}} 2"),
            &format!("ladder_delivered_messages_total{{{ladder}}} 3"),
            &format!("ladder_parked_messages_total{{{ladder},reason=\"destination-not-allowed\"}} 1"),
            &format!("ladder_queue_messages{{{ladder},queue=\"delay.10m\"}} 2"),
            &format!("ladder_queue_messages{{{ladder},queue=\"delay.200ms\"}} 0"),
            &format!("ladder_queue_messages{{{ladder},queue=\"due\"}} 0"),
            &format!("ladder_unaccounted_messages{{{ladder}}} 0"),
        ])
        .await;
    assert!(
        text.contains("ladder_lateness_seconds_count{ladder=\"default\"} 3"),
        "{text}"
    );
    let r = admin.get("/metrics").await;
    assert_eq!(r.content_type, admin::METRICS_CONTENT_TYPE);

    let v = admin
        .wait_ladders("the poller saw the retries, twice (for rates)", |v| {
            let l = &v["ladders"][0];
            l["depths"]["delay.10m"] == 2 && l["totals"]["delivered"] == 3 && !l["rates"].is_null()
        })
        .await;
    assert!(v["broker_error"].is_null(), "{v:#}");
    assert!(v["polled_at_ms"].as_u64().unwrap() > 0);
    let l = &v["ladders"][0];
    assert_eq!(l["name"], "default");
    assert_eq!(l["exchange"], t.intake().as_str());
    assert_eq!(l["tiers"][1]["name"], "10m");
    assert_eq!(l["tiers"][1]["delay_ms"], 600_000);
    assert_eq!(l["max_attempts"], 2);
    assert_eq!(l["allow"][0], format!("^{}-", t.ns));
    assert_eq!(l["queues"]["delay.10m"], format!("{}.delay.10m", t.ns));
    assert_eq!(l["depths"]["intake"], 0);
    assert_eq!(l["totals"]["received_intake"], 6);
    assert_eq!(l["totals"]["parked"], 1);
    assert!(l["rates"]["window_ms"].as_u64().is_some(), "{l:#}");
    admin
        .wait_ladders("the accounting balances", |v| {
            v["ladders"][0]["accounting"]["verdict"] == "balanced"
        })
        .await;
    admin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_tier_is_reported_as_unaccounted() {
    let mut t = TestLadder::configure_with("admin-lost", FAST_POLLS, LONG_ONLY).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.queue_name("orders");
    for i in 0..3 {
        t.publish(&t.intake(), "", format!("m{i}").as_bytes(), retry_props(&orders, None))
            .await;
    }
    // the check must hold a reference that includes the three waiting messages
    admin
        .wait_ladders("the accounting anchored with 3 waiting", |v| {
            let l = &v["ladders"][0];
            l["depths"]["delay.10m"] == 3 && l["accounting"]["verdict"] == "balanced"
        })
        .await;

    let tier = format!("{}.delay.10m", t.ns);
    let purged = t.channel.queue_purge(&tier).await.unwrap();
    assert_eq!(purged, 3);
    let started = Instant::now();
    admin
        .wait_metrics(&[
            "ladder_unaccounted_messages{ladder=\"default\"} 3",
            "ladder_unaccounted_alarms_total{ladder=\"default\"} 1",
        ])
        .await;
    eprintln!("flagged {:?} after the purge", started.elapsed());
    let v = admin.ladders().await;
    assert_eq!(v["ladders"][0]["accounting"]["verdict"], "unaccounted", "{v:#}");
    assert_eq!(v["ladders"][0]["accounting"]["unaccounted"], 3);
    admin.stop().await;
}

/// Dead-letter mode: first failures the broker dead-letters from a quorum queue into the ladder
/// enter it once each, on every broker (RabbitMQ 4.x flags them `redelivered` on their first
/// delivery), so a message taken out of its tier by hand is reported as lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_taken_from_a_tier_in_dead_letter_mode_is_unaccounted() {
    const FAILURES: usize = 3;
    let mut t = TestLadder::configure_with("admin-lost-dlx", FAST_POLLS, LONG_ONLY).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let mut args = FieldTable::default();
    args.set("x-dead-letter-exchange", text(&t.intake()));
    args.set("x-queue-type", text("quorum"));
    let orders = t.declare_queue("orders", args).await;
    let mut consumer = t.consume(&orders).await;
    for i in 0..FAILURES {
        t.publish("", &orders, format!("m{i}").as_bytes(), BasicProperties::default())
            .await;
        let failed = next(&mut consumer).await;
        consumer.reject(&failed, false);
    }
    admin
        .wait_ladders("the accounting anchored with the failures entered and waiting", |v| {
            let l = &v["ladders"][0];
            l["depths"]["delay.10m"] == FAILURES
                && l["totals"]["entered"] == FAILURES
                && l["accounting"]["verdict"] == "balanced"
        })
        .await;

    let tier = format!("{}.delay.10m", t.ns);
    let mut by_hand = t.consume(&tier).await;
    let taken = next(&mut by_hand).await;
    by_hand.ack(&taken);
    let _ = by_hand.channel.close(200, "took one").await;
    admin
        .wait_metrics(&[
            "ladder_unaccounted_messages{ladder=\"default\"} 1",
            "ladder_unaccounted_alarms_total{ladder=\"default\"} 1",
        ])
        .await;
    let v = admin.ladders().await;
    assert_eq!(v["ladders"][0]["accounting"]["verdict"], "unaccounted", "{v:#}");
    admin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_shows_in_the_listing_and_nothing_else_breaks() {
    let t = TestLadder::configure_with("admin-down", FAST_POLLS, LONG_ONLY).await;
    let mut config = (*t.config).clone();
    // a port nothing listens on: connecting fails at once
    config.amqp.urls = vec![SecretUri::new("amqp://guest:guest@127.0.0.1:1/%2f")];
    let admin = TestAdmin::start(Arc::new(config), t.state.clone()).await;
    let v = admin
        .wait_ladders("a failed poll", |v| !v["broker_error"].is_null())
        .await;
    assert!(v["ladders"][0]["depths"].is_null(), "{v:#}");
    assert_eq!(v["ladders"][0]["name"], "default");
    assert_eq!(admin.get("/live").await.status, 200);
    assert_eq!(admin.get("/ready").await.status, 503);
    assert_eq!(admin.get("/metrics").await.status, 200);
    // it keeps polling, and stops on its token although it cannot connect
    admin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_false_alarm_while_hundreds_of_retries_flow() {
    const RETRIES: usize = 300;
    let mut t = TestLadder::configure_with("admin-busy", FAST_POLLS, SHORT_AND_LONG).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    admin
        .wait_ladders("the accounting anchored", |v| {
            v["ladders"][0]["accounting"]["anchored"] == true
        })
        .await;

    let publisher = {
        let (channel, intake, orders) = (t.channel.clone(), t.intake(), orders.clone());
        tokio::spawn(async move {
            for i in 0..RETRIES {
                let body = format!("m{i}");
                publish(&channel, &intake, "", body.as_bytes(), retry_props(&orders, None)).await;
            }
        })
    };
    let mut verdicts = std::collections::BTreeSet::new();
    for _ in 0..RETRIES {
        let d = next(&mut consumer).await;
        consumer.ack(&d);
        let v = admin.ladders().await;
        verdicts.insert(v["ladders"][0]["accounting"]["verdict"].as_str().unwrap().to_string());
        assert_eq!(v["ladders"][0]["accounting"]["unaccounted"], 0, "{v:#}");
    }
    publisher.await.unwrap();
    // The consumer holds every retry before the service has its confirm, and a quiet poll can
    // fall in a lull of the traffic (the last ones waiting in a tier, balanced then too): wait
    // for a balanced poll that counted every delivery.
    let v = admin
        .wait_ladders("the accounting balances after the traffic", |v| {
            v["ladders"][0]["accounting"]["verdict"] == "balanced" && v["ladders"][0]["totals"]["delivered"] == RETRIES
        })
        .await;
    assert_eq!(v["ladders"][0]["accounting"]["unaccounted"], 0, "{v:#}");
    assert!(
        admin
            .metrics()
            .await
            .contains("ladder_unaccounted_alarms_total{ladder=\"default\"} 0")
    );
    eprintln!("verdicts seen while busy: {verdicts:?}");
    admin.stop().await;
}

/// Repeat failures routed past the intake wait in their tier before the ladder counts them
/// (they enter at the due hop): quiet polls meanwhile find more waiting than counted — a
/// surplus, never a shortfall — and no alarm is raised; once they are delivered the identity
/// balances with every failure counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeat_failures_waiting_uncounted_raise_no_alarm() {
    const MESSAGES: usize = 40;
    let ladder = r#"
backoff = ["200ms", "3s"]
max_attempts = 2
allow = ["^{ns}-"]
"#;
    let mut t = TestLadder::configure_with("admin-routed", FAST_POLLS, ladder).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    admin
        .wait_ladders("the accounting anchored", |v| {
            v["ladders"][0]["accounting"]["anchored"] == true
        })
        .await;
    for i in 0..MESSAGES {
        t.publish(&t.intake(), "", format!("m{i}").as_bytes(), retry_props(&orders, None))
            .await;
    }
    // each first retry fails again, republished as received: routed into the 3 s tier
    for _ in 0..MESSAGES {
        let d = next(&mut consumer).await;
        assert_eq!(int_header(&d, "retry-attempt"), Some(1));
        t.publish(&t.intake(), "", &d.body, republish_props(&d, &[])).await;
        consumer.ack(&d);
    }
    // while they wait uncounted: quiet polls, never a shortfall
    let waiting = admin
        .wait_ladders("quiet polls while the repeat failures wait", |v| {
            v["ladders"][0]["depths"]["delay.3s"] == MESSAGES && v["ladders"][0]["accounting"]["verdict"] == "balanced"
        })
        .await;
    assert_eq!(waiting["ladders"][0]["accounting"]["unaccounted"], 0, "{waiting:#}");
    let mut verdicts = std::collections::BTreeSet::new();
    for _ in 0..MESSAGES {
        let d = next(&mut consumer).await;
        assert_eq!(int_header(&d, "retry-attempt"), Some(2));
        consumer.ack(&d);
        let v = admin.ladders().await;
        verdicts.insert(v["ladders"][0]["accounting"]["verdict"].as_str().unwrap().to_string());
        assert_eq!(v["ladders"][0]["accounting"]["unaccounted"], 0, "{v:#}");
    }
    let v = admin
        .wait_ladders("the accounting balances with every failure counted", |v| {
            v["ladders"][0]["accounting"]["verdict"] == "balanced"
                && v["ladders"][0]["totals"]["delivered"] == 2 * MESSAGES
        })
        .await;
    assert_eq!(v["ladders"][0]["accounting"]["unaccounted"], 0, "{v:#}");
    assert_eq!(
        v["ladders"][0]["totals"]["entered"],
        2 * MESSAGES,
        "each failure entered once: {v:#}"
    );
    assert_eq!(
        v["ladders"][0]["totals"]["received_intake"], MESSAGES,
        "the repeats skipped the intake: {v:#}"
    );
    assert!(
        admin
            .metrics()
            .await
            .contains("ladder_unaccounted_alarms_total{ladder=\"default\"} 0")
    );
    eprintln!("verdicts seen: {verdicts:?}");
    admin.stop().await;
}

/// Ten long tiers: `delay.10m` … `delay.19m`, with the ladder's other queues more than one
/// batch of the poller's parallel reads.
const TEN_LONG: &str = r#"
backoff = ["10m", "11m", "12m", "13m", "14m", "15m", "16m", "17m", "18m", "19m"]
max_attempts = 20
allow = ["^{ns}-"]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn depths_read_in_parallel_stay_with_their_queues_and_a_missing_one_spoils_none() {
    let mut t = TestLadder::configure_with("admin-many", FAST_POLLS, TEN_LONG).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.queue_name("orders");
    // tier i (10+i minutes) gets i + 1 messages: the (i+1)-th attempt waits in it
    for i in 0..10i64 {
        for n in 0..=i {
            let body = format!("tier {i} #{n}");
            let previous = if i == 0 { None } else { Some(i) };
            t.publish(&t.intake(), "", body.as_bytes(), retry_props(&orders, previous))
                .await;
        }
    }
    let tier = |i: usize| format!("delay.{}m", 10 + i);
    let all_there = |v: &serde_json::Value| (0..10).all(|i| v["ladders"][0]["depths"][tier(i)] == i + 1);
    let v = admin.wait_ladders("every tier's depth", all_there).await;
    assert!(v["broker_error"].is_null(), "{v:#}");
    assert_eq!(v["ladders"][0]["depths"]["intake"], 0, "{v:#}");

    // a tier deleted behind the service's back: its count is gone, every other one is right,
    // in this poll and the ones after (a passive declare of a missing queue closes its channel)
    let missing = format!("{}.{}", t.ns, tier(3));
    t.channel.queue_delete(&missing).await.unwrap();
    for _ in 0..3 {
        let v = admin
            .wait_ladders("the deleted tier shows as missing", |v| {
                v["ladders"][0]["depths"][tier(3)].is_null() && v["ladders"][0]["depths"].is_object()
            })
            .await;
        assert!(v["broker_error"].is_null(), "a missing queue is no broker error: {v:#}");
        let depths = &v["ladders"][0]["depths"];
        for i in (0..10).filter(|&i| i != 3) {
            assert_eq!(depths[tier(i)], i + 1, "{}: {v:#}", tier(i));
        }
        assert_eq!(depths["intake"], 0, "{v:#}");
        assert_eq!(depths["due"], 0, "{v:#}");
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    }
    admin.stop().await;
}

/// A TCP hop in front of the broker that passes everything until told to cut the poller's
/// connection (the one whose handshake names `…-poller`): then, at the poller's next write after
/// the one in progress — a batch of passive declares, with the poll under way — it forwards that
/// write and closes both sockets before any answer comes back. The poller sees its connection
/// lost in the middle of a poll, with a real broker on the far side and no management call.
struct Cutter {
    port: u16,
    armed: Arc<std::sync::atomic::AtomicBool>,
    cuts: Arc<std::sync::atomic::AtomicUsize>,
    connections: Arc<std::sync::atomic::AtomicUsize>,
}

impl Cutter {
    async fn start() -> Cutter {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let uri: ladder_amqp::AmqpUri = amqp_url().parse().unwrap();
        let broker = (uri.host.clone(), uri.port);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (armed, cuts, connections) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let (a, c, n) = (armed.clone(), cuts.clone(), connections.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = tokio::net::TcpStream::connect(broker.clone()).await else {
                    continue;
                };
                n.fetch_add(1, Ordering::SeqCst);
                let kill = tokio_util::sync::CancellationToken::new();
                let (mut client_read, mut client_write) = client.into_split();
                let (mut upstream_read, mut upstream_write) = upstream.into_split();
                let (armed, cuts, to_client_kill) = (a.clone(), c.clone(), kill.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        tokio::select! {
                            () = to_client_kill.cancelled() => return,
                            read = upstream_read.read(&mut buf) => match read {
                                Ok(0) | Err(_) => return,
                                Ok(n) => if client_write.write_all(&buf[..n]).await.is_err() { return },
                            },
                        }
                    }
                });
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    let mut seen = Vec::new();
                    let mut poller = false;
                    let mut writes_since_armed = 0;
                    loop {
                        let n = match client_read.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if !poller && seen.len() < 16 * 1024 {
                            seen.extend_from_slice(&buf[..n]);
                            poller = seen.windows(7).any(|w| w == b"-poller");
                        }
                        if upstream_write.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        if poller && armed.load(Ordering::SeqCst) {
                            writes_since_armed += 1;
                            // the write in progress when armed may end a poll; the next starts one
                            if writes_since_armed == 2 {
                                armed.store(false, Ordering::SeqCst);
                                cuts.fetch_add(1, Ordering::SeqCst);
                                break;
                            }
                        }
                    }
                    // both sockets close: this half here, the other half's task on the token
                    kill.cancel();
                });
            }
        });
        Cutter {
            port,
            armed,
            cuts,
            connections,
        }
    }

    /// The broker's URL, through the hop.
    fn url(&self) -> String {
        let url = amqp_url();
        let (scheme_user, rest) = url.rsplit_once('@').expect("a URL with user info");
        let path = rest.find('/').map_or("", |i| &rest[i..]);
        format!("{scheme_user}@127.0.0.1:{}{path}", self.port)
    }

    fn cut_next(&self) {
        self.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn cuts(&self) -> usize {
        self.cuts.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poller_connection_lost_mid_poll_costs_no_poll_and_raises_no_alarm() {
    const CUTS: usize = 5;
    let mut t = TestLadder::configure_with("admin-cut", FAST_POLLS, TEN_LONG).await;
    t.start_service().await;
    let cutter = Cutter::start().await;
    let mut config = (*t.config).clone();
    config.amqp.urls = vec![SecretUri::new(cutter.url())];
    let admin = Arc::new(TestAdmin::start(Arc::new(config), t.state.clone()).await);
    // something to account for: three retries waiting in the first tier throughout
    let orders = t.queue_name("orders");
    for i in 0..3 {
        let body = format!("waiting {i}");
        t.publish(&t.intake(), "", body.as_bytes(), retry_props(&orders, None))
            .await;
    }
    admin
        .wait_ladders("the accounting anchored with three waiting", |v| {
            let l = &v["ladders"][0];
            l["accounting"]["anchored"] == true && l["depths"]["delay.10m"] == 3 && v["broker_error"].is_null()
        })
        .await;

    // every snapshot the admin server publishes from now on, seen every few milliseconds
    let watching = tokio_util::sync::CancellationToken::new();
    let watcher = {
        let (admin, watching) = (admin.clone(), watching.clone());
        tokio::spawn(async move {
            let (mut polls, mut bad) = (std::collections::BTreeSet::new(), Vec::new());
            while !watching.is_cancelled() {
                let v = admin.ladders().await;
                polls.insert(v["polled_at_ms"].as_u64());
                let l = &v["ladders"][0];
                if !v["broker_error"].is_null()
                    || l["depths"].is_null()
                    || l["depths"]["delay.10m"] != 3
                    || l["accounting"]["unaccounted"] != 0
                {
                    bad.push(v);
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            (polls.len(), bad)
        })
    };
    for round in 1..=CUTS {
        let connections = cutter.connections();
        cutter.cut_next();
        eventually("the poller's connection cut mid-poll", WAIT, async || {
            (cutter.cuts() == round && cutter.connections() > connections).then_some(())
        })
        .await;
        // a few polls on the new connection before the next cut
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    }
    watching.cancel();
    let (polls, bad) = tokio::time::timeout(WAIT, watcher).await.unwrap().unwrap();
    assert!(
        bad.is_empty(),
        "{} of the snapshots failed or were off: {:#}",
        bad.len(),
        bad[0]
    );
    assert!(polls > CUTS * 2, "the poller kept polling: {polls} polls seen");
    admin
        .wait_metrics(&["ladder_unaccounted_alarms_total{ladder=\"default\"} 0"])
        .await;
    eprintln!(
        "{CUTS} cuts, {} connections through the hop, {polls} polls seen, none failed",
        cutter.connections()
    );
    Arc::into_inner(admin).expect("the watcher is done").stop().await;
}
