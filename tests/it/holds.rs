//! Destination holds against the real broker: a held destination gets nothing while another
//! flows on time; a resume releases everything at no more than the rate, oldest first, none
//! lost, none parked, then the destination flows normally again; two replicas agree and a
//! restart keeps the hold; a missing or disallowed destination is refused (CLI 64, API 400/404);
//! the automatic hold trips on a consumer that fails everything and recovers when it heals, and
//! with two replicas probes once at its pace and resumes only after the consumer heals (and
//! when the prober dies, the other replica takes over).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use ladder::broker::state::State;
use ladder::broker::supervisor as service;
use ladder::model::holds::HoldState;
use ladder::model::names::Names;
use ladder_amqp::{BasicProperties, FieldTable};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// A short step, so a retry is due quickly.
const LADDER: &str = "backoff = [\"200ms\"]\nmax_attempts = 1000\nallow = [\"^{ns}-\"]\nrelease_rate = \"10/s\"";

/// Admin server settings with one operator, alice.
const ADMIN: &str =
    "[admin]\nbind = \"127.0.0.1:0\"\npoll_interval = \"100ms\"\n[admin.tokens]\nalice = \"alice-token-0123456789\"";
const ALICE: &str = "alice-token-0123456789";

/// How late a retry of a flowing destination may come (200 ms step, hops, a busy machine).
const LATE: Duration = Duration::from_millis(1_500);

fn failure(to: &str, id: &str) -> BasicProperties {
    retry_props(to, None).with_message_id(id)
}

/// A form's body, URL-encoded.
fn form_body(pairs: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
}

fn names(t: &TestLadder) -> Names {
    Names::new(&t.ns, &t.ladder)
}

/// Declares `orders`, holds it (`why`) and waits until the service holds it back: `orders`, its
/// held queue (tracked, deleted with the test) and the ladder's spec.
async fn hold_orders(t: &mut TestLadder, why: &str) -> (String, String, ladder::model::ladder::LadderSpec) {
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let held_queue = names(t).held_queue(&orders);
    t.track_queue(&held_queue);
    let spec = t.config.ladders[0].clone();
    ladder::broker::holds::hold(&t.client, &names(t), &spec, &orders, "test", why)
        .await
        .unwrap();
    held_in(&t.state, &orders, true).await;
    (orders, held_queue, spec)
}

/// Waits until the service of `state` holds `destination` back (or no longer does).
async fn held_in(state: &State, destination: &str, held: bool) {
    let runtime = state.ladder("default").expect("the service runs the ladder");
    eventually("the hold read by the service", WAIT, async || {
        (runtime.holds.holds_back(destination) == held).then_some(())
    })
    .await;
}

/// `orders` (its held queue tracked), a consumer on it, and `n` failures for it at the intake.
async fn failures_for_orders(t: &mut TestLadder, n: usize) -> (String, TestConsumer) {
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    t.track_queue(&names(t).held_queue(&orders));
    let consumer = t.consume(&orders).await;
    for i in 0..n {
        t.publish(&t.intake(), "", b"o", failure(&orders, &format!("m{i:02}")))
            .await;
    }
    (orders, consumer)
}

/// Acks what arrives, by message id, until `n` different ones did and nothing is `held` (or
/// the wait runs out).
async fn receive_after_healing(
    consumer: &mut TestConsumer,
    n: usize,
    held: impl Fn() -> bool,
) -> HashMap<String, usize> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let deadline = Instant::now() + WAIT * 3;
    while Instant::now() < deadline && (seen.len() < n || held()) {
        if let Some(d) = next_within(consumer, Duration::from_millis(200)).await {
            *seen.entry(message_id(&d).to_string()).or_default() += 1;
            consumer.ack(&d);
        }
    }
    seen
}

/// At least once: what a dead replica had taken but not yet acked comes again, but no message
/// more than twice; and nothing was parked.
async fn at_least_once_and_nothing_parked(t: &TestLadder, seen: &HashMap<String, usize>) {
    assert!(seen.values().all(|k| *k <= 2), "none more than twice: {seen:?}");
    eprintln!("twice: {}", seen.values().filter(|k| **k == 2).count());
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hold_delivers_nothing_while_others_flow_and_resume_releases_all_at_the_rate_oldest_first() {
    let mut t = TestLadder::configure_with("hold", ADMIN, LADDER).await;
    t.start_service().await;
    // the depth poller, whose accounting must count held messages as waiting
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let billing = t.declare_queue("billing", FieldTable::default()).await;
    t.track_queue(&names(&t).held_queue(&orders));
    let spec = t.config.ladders[0].clone();
    ladder::broker::holds::hold(&t.client, &names(&t), &spec, &orders, "test", "orders is down")
        .await
        .unwrap();
    held_in(&t.state, &orders, true).await;

    let mut orders_in = t.consume(&orders).await;
    let mut billing_in = t.consume(&billing).await;
    let n = 20;
    for i in 0..n {
        t.publish(&t.intake(), "", b"o", failure(&orders, &format!("o{i:02}")))
            .await;
        // so that their due times are in this order
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // billing keeps flowing on time
    for i in 0..5 {
        let sent = Instant::now();
        t.publish(&t.intake(), "", b"b", failure(&billing, &format!("b{i}")))
            .await;
        let d = next(&mut billing_in).await;
        assert_eq!(message_id(&d), format!("b{i}"));
        assert!(
            sent.elapsed() < Duration::from_millis(200) + LATE,
            "billing late: {:?}",
            sent.elapsed()
        );
        billing_in.ack(&d);
    }
    assert!(
        next_within(&mut orders_in, Duration::from_secs(2)).await.is_none(),
        "nothing to a held destination"
    );
    let held_queue = names(&t).held_queue(&orders);
    eventually("all held", WAIT, async || {
        (queue_depth(&t.client, &held_queue).await == n).then_some(())
    })
    .await;
    // held at the intake, without a wait in a tier first: nothing of orders was scheduled
    // (only billing's five)
    let scheduled: u64 = t
        .state
        .metrics
        .encode()
        .lines()
        .filter(|l| l.starts_with("ladder_scheduled_messages_total{ladder=\"default\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    assert_eq!(scheduled, 5, "only billing's failures waited in a tier");
    eventually("the poller counts them as waiting", WAIT, async || {
        t.state
            .metrics
            .encode()
            .contains("ladder_queue_messages{ladder=\"default\",queue=\"held\"} 20")
            .then_some(())
    })
    .await;

    // resume: released at 10/s, oldest first, each once, with its one attempt (acked as received)
    let resumed_at = Instant::now();
    ladder::broker::holds::resume(&t.client, &names(&t), &spec, &orders, "test", None)
        .await
        .unwrap();
    let got = receive_timed(&mut orders_in, n as usize).await;
    let ids: Vec<String> = got.iter().map(|(_, d)| message_id(d).to_string()).collect();
    let expected: Vec<String> = (0..n).map(|i| format!("o{i:02}")).collect();
    assert_eq!(ids, expected, "oldest first, none lost, none twice");
    for (_, d) in &got {
        assert_eq!(int_header(d, "retry-attempt"), Some(1), "holding counted no attempt");
    }
    // the rate from the resume to the last arrival: the releases are sent exactly on the pacer's
    // slots, so a first arrival that is late (the broker's jitter) would make first-to-last
    // look faster than the rate (measured 11.2/s once, with the last on time)
    let span = got.last().unwrap().0 - got.first().unwrap().0;
    let since_resume = got.last().unwrap().0 - resumed_at;
    let rate = (n - 1) as f64 / since_resume.as_secs_f64();
    eprintln!("released {n} in {since_resume:?} after the resume ({span:?} first to last): {rate:.2}/s at 10/s");
    assert!(rate <= 10.5, "released at {rate:.2}/s, above 10/s");
    assert!(rate >= 5.0, "released at {rate:.2}/s, far below 10/s");

    // the release ends when the held queue is empty; then orders flows normally again
    let runtime = t.state.ladder("default").unwrap();
    eventually("the release ended", WAIT, async || {
        (runtime.holds.snapshot().get(&orders).map(|h| h.state) == Some(HoldState::Free)).then_some(())
    })
    .await;
    let sent = Instant::now();
    t.publish(&t.intake(), "", b"o", failure(&orders, "after")).await;
    let d = next(&mut orders_in).await;
    assert_eq!(message_id(&d), "after");
    assert!(
        sent.elapsed() < Duration::from_millis(200) + LATE,
        "{:?}",
        sent.elapsed()
    );
    orders_in.ack(&d);
    assert!(
        next_within(&mut orders_in, Duration::from_millis(500)).await.is_none(),
        "none twice"
    );
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
    let metrics = t.state.metrics.encode();
    for line in [
        "ladder_hold_transitions_total{ladder=\"default\",kind=\"held\"} 1",
        "ladder_hold_transitions_total{ladder=\"default\",kind=\"resumed\"} 1",
        "ladder_hold_transitions_total{ladder=\"default\",kind=\"released\"} 1",
        "ladder_held_messages_total{ladder=\"default\"} 20",
        "ladder_released_messages_total{ladder=\"default\"} 20",
        "ladder_destinations_held{ladder=\"default\"} 0",
        "ladder_unaccounted_alarms_total{ladder=\"default\"} 0",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    admin.stop().await;
}

/// A release from 10/s that doubles every second while nothing fails, with the automatic hold on.
const RAMPED: &str = "backoff = [\"200ms\"]\nmax_attempts = 100000\nallow = [\"^{ns}-\"]\n\
release_rate = \"10/s\"\nrelease_ramp = \"1s\"\n[auto_hold]\nenabled = true\nwindow = \"5s\"\nmin_deliveries = 10";

/// A destination that came back at a limited capacity: its consumer takes 40 a second and sends
/// back as failed what comes faster. The release ramps up from 10/s while nothing fails and
/// backs off when failures come back, so the backlog drains faster than at its start rate,
/// without the automatic hold tripping again; every message arrives, none is parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ramped_release_drains_a_destination_of_limited_capacity_without_tripping_it() {
    const CAPACITY: f64 = 40.0;
    let mut t = TestLadder::start("holdramp", RAMPED).await;
    let (orders, held_queue, spec) = hold_orders(&mut t, "orders is down").await;
    let mut consumer = t.consume(&orders).await;
    let n = 300;
    for i in 0..n {
        t.publish(&t.intake(), "", b"o", failure(&orders, &format!("m{i:03}")))
            .await;
    }
    eventually("all held", WAIT * 2, async || {
        (queue_depth(&t.client, &held_queue).await == n).then_some(())
    })
    .await;
    let resumed = Instant::now();
    ladder::broker::holds::resume(&t.client, &names(&t), &spec, &orders, "test", None)
        .await
        .unwrap();
    // a token bucket of CAPACITY a second, a burst of 10
    let (mut tokens, mut refilled) = (10.0f64, Instant::now());
    let mut seen: HashSet<String> = HashSet::new();
    let mut sent_back = 0;
    let deadline = resumed + WAIT * 6;
    while seen.len() < n as usize && Instant::now() < deadline {
        let Some(d) = next_within(&mut consumer, Duration::from_millis(200)).await else {
            continue;
        };
        tokens = (tokens + refilled.elapsed().as_secs_f64() * CAPACITY).min(10.0);
        refilled = Instant::now();
        if tokens >= 1.0 {
            tokens -= 1.0;
            seen.insert(message_id(&d).to_string());
        } else {
            t.publish(&t.intake(), "", &d.body, republish_props(&d, &[])).await;
            sent_back += 1;
        }
        consumer.ack(&d);
    }
    let drained = resumed.elapsed();
    eprintln!(
        "drained {} in {drained:?}, {sent_back} sent back over capacity",
        seen.len()
    );
    assert_eq!(seen.len(), n as usize, "every message arrived");
    let fixed = Duration::from_secs_f64(f64::from(n) / 10.0);
    assert!(
        drained < fixed * 3 / 4,
        "ramped: {drained:?} against {fixed:?} at the start rate"
    );
    assert!(sent_back > 0, "the ramp reached the capacity");
    let metrics = t.state.metrics.encode();
    assert!(
        !metrics.contains("kind=\"auto_held\"} 1"),
        "the automatic hold did not trip:\n{metrics}"
    );
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
}

/// Regression (ladder-bench outage, 2026-12-06): a release keeps publishes in flight on the due
/// hop, and the watchdog took them, with no settled delivery of the hop's own, for a stall. It
/// ended the session every 3-4 s of a release at 1 000/s, and every reconnect released again
/// what was out: 127 duplicates in 150 000. A release longer than `amqp.stall_timeout` (here
/// 3 000 messages at 2 000/s against 500 ms) is progress: no reconnect, each message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_longer_than_the_stall_timeout_is_progress_and_delivers_each_once() {
    let ladder = "backoff = [\"200ms\"]\nmax_attempts = 1000\nallow = [\"^{ns}-\"]\nrelease_rate = \"2000/s\"";
    let mut t = TestLadder::configure_with("hold-long", "", ladder).await;
    let mut config = (*t.config).clone();
    config.amqp.stall_timeout = Duration::from_millis(500);
    t.config = Arc::new(config);
    t.start_service().await;
    let (orders, held_queue, spec) = hold_orders(&mut t, "orders is down").await;
    let n = 3000;
    for i in 0..n {
        t.publish(&t.intake(), "", b"o", failure(&orders, &format!("o{i}")))
            .await;
    }
    eventually("all held", WAIT, async || {
        (queue_depth(&t.client, &held_queue).await == n).then_some(())
    })
    .await;
    let reconnects = t.state.metrics.reconnects.get();

    let mut orders_in = t.consume(&orders).await;
    ladder::broker::holds::resume(&t.client, &names(&t), &spec, &orders, "test", None)
        .await
        .unwrap();
    let got = receive_timed(&mut orders_in, n as usize).await;
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (_, d) in &got {
        *seen.entry(message_id(d).to_string()).or_default() += 1;
    }
    // anything released twice comes after the n-th delivery
    while let Some(d) = next_within(&mut orders_in, Duration::from_secs(2)).await {
        *seen.entry(message_id(&d).to_string()).or_default() += 1;
        orders_in.ack(&d);
    }
    let twice: Vec<&String> = seen.iter().filter(|(_, c)| **c > 1).map(|(id, _)| id).collect();
    assert_eq!(seen.len(), n as usize, "every message released");
    assert!(
        twice.is_empty(),
        "{} delivered more than once, e.g. {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
    assert_eq!(
        t.state.metrics.reconnects.get(),
        reconnects,
        "the session ended during the release (the watchdog took it for a stall)"
    );
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
}

/// A second service for the same config (another replica), stopped when dropped.
struct Replica(CancellationToken, tokio::task::JoinHandle<()>, Arc<State>);

impl Replica {
    async fn start(t: &TestLadder) -> Self {
        let (stop, state) = (CancellationToken::new(), Arc::new(State::default()));
        let (config, s, token) = (t.config.clone(), state.clone(), stop.clone());
        let task = tokio::spawn(async move { service::run(config, s, token).await.expect("replica runs") });
        wait_until("replica ready", || state.health.is_ready()).await;
        Replica(stop, task, state)
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.0.cancel();
        self.1.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_agree_on_a_hold_made_through_one_api_and_a_restart_keeps_it() {
    let mut t = TestLadder::configure_with("hold2", ADMIN, LADDER).await;
    t.start_service().await;
    let replica = Replica::start(&t).await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    t.track_queue(&names(&t).held_queue(&orders));
    let http = reqwest::Client::builder().timeout(WAIT).build().unwrap();
    let holds = admin.url(&format!("/api/ladders/{}/holds", t.ladder));

    let refused = http
        .post(&holds)
        .json(&json!({"destination": orders}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 401, "a hold needs a token");
    let answer = http
        .post(&holds)
        .bearer_auth(ALICE)
        .json(&json!({"destination": orders, "why": "maintenance"}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status().as_u16(), 200);
    let answer: Value = answer.json().await.unwrap();
    assert_eq!(
        (answer["by"].as_str(), answer["action"].as_str()),
        (Some("alice"), Some("held"))
    );
    // the other replica holds it too
    held_in(&replica.2, &orders, true).await;
    held_in(&t.state, &orders, true).await;
    let mut orders_in = t.consume(&orders).await;
    for i in 0..10 {
        t.publish(&t.intake(), "", b"o", failure(&orders, &format!("a{i}")))
            .await;
    }
    assert!(
        next_within(&mut orders_in, Duration::from_secs(2)).await.is_none(),
        "neither replica delivers"
    );

    // both restart: the hold is read back from the stream
    drop(replica);
    t.stop_service().await;
    t.start_service().await;
    let replica = Replica::start(&t).await;
    held_in(&t.state, &orders, true).await;
    held_in(&replica.2, &orders, true).await;
    for i in 0..10 {
        t.publish(&t.intake(), "", b"o", failure(&orders, &format!("b{i}")))
            .await;
    }
    assert!(
        next_within(&mut orders_in, Duration::from_secs(2)).await.is_none(),
        "still held after restart"
    );
    let listed: Value = http.get(&holds).send().await.unwrap().json().await.unwrap();
    let held = &listed["holds"][0];
    assert_eq!(held["destination"], orders.as_str());
    assert_eq!(
        (held["state"].as_str(), held["by"].as_str(), held["why"].as_str()),
        (Some("held"), Some("alice"), Some("maintenance"))
    );
    assert_eq!(listed["recent"][0]["action"], "held", "{listed}");
    eventually("20 in the held queue", WAIT, async || {
        let listed: Value = http.get(&holds).send().await.ok()?.json().await.ok()?;
        (listed["holds"][0]["messages"] == 20).then_some(())
    })
    .await;
    // the web page lists it
    let page = http
        .get(admin.url("/ladders/default/destinations"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains(&orders) && page.contains("maintenance") && page.contains("alice"),
        "{page}"
    );
    // with the parked counts of every replica, and a hold button for each busy one not held
    assert!(page.contains("Most parked destinations"), "{page}");
    if page.contains("id=\"busiest\"") {
        assert!(page.contains("Parked, unresolved"), "{page}");
    }

    // resume through the API, fast: every one delivered once, none parked
    let resume = admin.url(&format!("/api/ladders/{}/holds/resume", t.ladder));
    let answer = http
        .post(&resume)
        .bearer_auth(ALICE)
        .json(&json!({"destination": orders, "rate": "50/s"}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status().as_u16(), 200);
    let got = receive(&mut orders_in, 20).await;
    let ids: HashSet<String> = got.iter().map(|d| message_id(d).to_string()).collect();
    assert_eq!(ids.len(), 20, "none lost, none twice");
    assert!(
        next_within(&mut orders_in, Duration::from_secs(1)).await.is_none(),
        "none twice"
    );
    held_in(&replica.2, &orders, false).await;
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
    admin.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holding_a_missing_or_disallowed_destination_is_refused() {
    let mut t = TestLadder::configure_with("holdno", ADMIN, LADDER).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    t.track_queue(&names(&t).held_queue(&orders));
    let missing = t.queue_name("missing");
    let config = t.config_path();

    // CLI: 64 with a clear reason
    let out = run_ladder(&config, &["hold", &missing, "--why", "x"], &[]).await;
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no such queue"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run_ladder(&config, &["hold", "elsewhere"], &[]).await;
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("allow-list"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run_ladder(&config, &["resume", &orders], &[]).await;
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not held"));

    // API: 404 and 400, 409 for a resume of what is not held
    let http = reqwest::Client::builder().timeout(WAIT).build().unwrap();
    let holds = admin.url(&format!("/api/ladders/{}/holds", t.ladder));
    let post = async |url: &str, body: Value| {
        let r = http.post(url).bearer_auth(ALICE).json(&body).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.unwrap())
    };
    let (status, body) = post(&holds, json!({"destination": missing})).await;
    assert_eq!(status, 404, "{body}");
    assert!(body["error"].as_str().unwrap().contains("no such queue"), "{body}");
    let (status, body) = post(&holds, json!({"destination": "elsewhere"})).await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("allow-list"), "{body}");
    let (status, body) = post(&holds, json!({"destination": format!("{}.default.due", t.ns)})).await;
    assert_eq!(status, 400, "the ladder's own queues: {body}");
    let resume = admin.url(&format!("/api/ladders/{}/holds/resume", t.ladder));
    let (status, body) = post(&resume, json!({"destination": orders})).await;
    assert_eq!(status, 409, "{body}");

    // an allowed, existing one is held by the CLI and listed; a bad rate is refused
    let out = run_ladder(&config, &["hold", &orders, "--why", "deploying", "--by", "carol"], &[]).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = run_ladder(&config, &["holds"], &[]).await;
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        listed.contains(&orders) && listed.contains("cli:carol") && listed.contains("deploying"),
        "{listed}"
    );
    let (status, _) = post(&resume, json!({"destination": orders, "rate": "fast"})).await;
    assert_eq!(status, 400);
    let out = run_ladder(&config, &["resume", &orders, "--rate", "fast"], &[]).await;
    assert_eq!(out.status.code(), Some(64));
    let out = run_ladder(&config, &["resume", &orders, "--rate", "20/s"], &[]).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("20/s"));
    held_in(&t.state, &orders, false).await;

    // the web page's forms: a token is needed; a hold and a resume each say what they did
    let form = admin.url("/ladders/default/destinations/hold");
    let refused = http
        .post(&form)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form_body(&[("destination", orders.as_str())]))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 403);
    let page = http
        .post(&form)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form_body(&[("destination", missing.as_str()), ("token", ALICE)]))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status().as_u16(), 404);
    assert!(page.text().await.unwrap().contains("no such queue"));
    eventually("the release ended", WAIT, async || {
        let runtime = t.state.ladder("default")?;
        (runtime.holds.snapshot().get(&orders)?.state == HoldState::Free).then_some(())
    })
    .await;
    let page = http
        .post(&form)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form_body(&[
            ("destination", orders.as_str()),
            ("why", "from the page"),
            ("token", ALICE),
        ]))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status().as_u16(), 200);
    assert!(page.text().await.unwrap().contains("Held"));
    held_in(&t.state, &orders, true).await;
    let listing = http
        .get(admin.url("/ladders/default/destinations"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        listing.contains("from the page") && listing.contains("Resume"),
        "{listing}"
    );
    let page = http
        .post(admin.url("/ladders/default/destinations/resume"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(form_body(&[
            ("destination", orders.as_str()),
            ("rate", "5/s"),
            ("token", ALICE),
        ]))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status().as_u16(), 200);
    assert!(page.text().await.unwrap().contains("5/s"));
    held_in(&t.state, &orders, false).await;
    admin.stop().await;
}

/// Automatic hold with a short window, so the test runs in seconds.
const AUTO: &str = "backoff = [\"100ms\"]\nmax_attempts = 100000\nallow = [\"^{ns}-\"]\nrelease_rate = \"50/s\"\n\
[auto_hold]\nenabled = true\nwindow = \"2s\"\nmin_deliveries = 10\nfailure_ratio = \"90%\"\nprobe_every = \"1s\"";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_hold_trips_on_a_failing_consumer_and_recovers_when_it_heals() {
    let mut t = TestLadder::start("holdauto", AUTO).await;
    let n = 20;
    let (orders, mut consumer) = failures_for_orders(&mut t, n).await;
    // a consumer that fails everything: each delivery goes back to the ladder as received
    let runtime = t.state.ladder("default").unwrap();
    let tripped = Instant::now();
    let mut failed = 0;
    while !runtime.holds.holds_back(&orders) {
        assert!(
            tripped.elapsed() < WAIT,
            "the automatic hold did not trip after {failed} failures"
        );
        if let Some(d) = next_within(&mut consumer, Duration::from_millis(100)).await {
            let props = republish_props(&d, &[]);
            t.publish(&t.intake(), "", &d.body, props).await;
            consumer.ack(&d);
            failed += 1;
        }
    }
    let hold = runtime.holds.snapshot().get(&orders).cloned().unwrap();
    assert_eq!(hold.by, "auto");
    assert!(hold.why.contains("deliveries failed"), "{}", hold.why);
    eprintln!(
        "tripped after {failed} failures in {:?}: {}",
        tripped.elapsed(),
        hold.why
    );

    // the consumer heals: whatever still comes (in flight when it tripped, the probe, the
    // release) is acked; every message arrives, none is parked
    let mut seen: HashMap<String, usize> = HashMap::new();
    let healed = Instant::now();
    let deadline = healed + WAIT * 2;
    while seen.len() < n && Instant::now() < deadline {
        if let Some(d) = next_within(&mut consumer, Duration::from_millis(500)).await {
            *seen.entry(message_id(&d).to_string()).or_default() += 1;
            consumer.ack(&d);
        }
    }
    assert_eq!(seen.len(), n, "every message delivered after healing: {seen:?}");
    eventually("resumed automatically", WAIT, async || {
        (!runtime.holds.holds_back(&orders)).then_some(())
    })
    .await;
    eprintln!("recovered {:?} after healing", healed.elapsed());
    let metrics = t.state.metrics.encode();
    for line in [
        "ladder_hold_transitions_total{ladder=\"default\",kind=\"auto_held\"} 1",
        "ladder_hold_transitions_total{ladder=\"default\",kind=\"auto_resumed\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
    let probes: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ladder_hold_transitions_total{ladder=\"default\",kind=\"probe\"} "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(probes >= 1, "a probe went out before the resume:\n{metrics}");
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
}

/// The automatic hold's defaults (90 % of at least 50 deliveries in 1 m, a probe every 4 s), and
/// steps short enough for a test.
const DEFAULTS: &str = "backoff = [\"200ms\", \"1s\", \"3s\"]\nmax_attempts = 100000\n\
allow = [\"^{ns}-\"]\nrelease_rate = \"100/s\"\n[auto_hold]\nenabled = true";

/// How a test's consumer fails a message.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fails {
    /// It rejects, and the queue dead-letters into the ladder: the broker routes each repeat
    /// failure into its next tier, and the ladder sees it only when it comes due.
    DeadLetter,
    /// It publishes the failure to the ladder (with `retry-to`), then acks.
    Explicit,
}

/// Fails `d`, a delivery from `orders`, the way `mode` says.
async fn fail(t: &TestLadder, consumer: &TestConsumer, d: &ladder_amqp::Delivery, orders: &str, mode: Fails) {
    match mode {
        Fails::DeadLetter => consumer.reject(d, false),
        Fails::Explicit => {
            let props = republish_props(d, &[("retry-to", text(orders))]);
            t.publish(&t.intake(), "", &d.body, props).await;
            consumer.ack(d);
        }
    }
}

/// A consumer that fails everything trips the default hold within its window, in either mode;
/// once it heals, the destination resumes within 10 s, every message arrives and none is parked.
async fn a_total_outage_trips_the_defaults_and_the_healed_destination_resumes_within_10s(mode: Fails) {
    let mut t = TestLadder::start(&format!("hold{mode:?}"), DEFAULTS).await;
    let mut args = FieldTable::default();
    if mode == Fails::DeadLetter {
        args.set("x-dead-letter-exchange", text(&t.intake()));
    }
    let orders = t.declare_queue("orders", args).await;
    t.track_queue(&names(&t).held_queue(&orders));
    let mut consumer = t.consume(&orders).await;
    let n = 100;
    for i in 0..n {
        let props = BasicProperties::default()
            .with_message_id(&format!("m{i:03}"))
            .with_delivery_mode(2);
        t.publish("", &orders, b"o", props).await;
    }
    let runtime = t.state.ladder("default").unwrap();
    let outage = Instant::now();
    let mut failed = 0;
    while !runtime.holds.holds_back(&orders) {
        assert!(
            outage.elapsed() < Duration::from_secs(60),
            "no hold within the window, after {failed} failures"
        );
        if let Some(d) = next_within(&mut consumer, Duration::from_millis(100)).await {
            fail(&t, &consumer, &d, &orders, mode).await;
            failed += 1;
        }
    }
    let hold = runtime.holds.snapshot().get(&orders).cloned().unwrap();
    assert_eq!(hold.by, "auto");
    eprintln!(
        "{mode:?}: tripped after {failed} failures in {:?}: {}",
        outage.elapsed(),
        hold.why
    );
    // still failing for a while: the probes fail and it stays held
    let failing_until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < failing_until {
        if let Some(d) = next_within(&mut consumer, Duration::from_millis(100)).await {
            fail(&t, &consumer, &d, &orders, mode).await;
        }
    }
    assert!(runtime.holds.holds_back(&orders), "held while the probes fail");
    let healed = Instant::now();
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut resumed = None;
    let deadline = healed + WAIT * 3;
    while Instant::now() < deadline && (seen.len() < n || resumed.is_none()) {
        if let Some(d) = next_within(&mut consumer, Duration::from_millis(100)).await {
            *seen.entry(message_id(&d).to_string()).or_default() += 1;
            consumer.ack(&d);
        }
        if resumed.is_none() && !runtime.holds.holds_back(&orders) {
            resumed = Some(healed.elapsed());
        }
    }
    eprintln!("{mode:?}: resumed {resumed:?} after healing");
    let resumed = resumed.expect("resumed after healing");
    assert!(resumed <= Duration::from_secs(10), "resumed {resumed:?} after healing");
    assert_eq!(seen.len(), n, "every message delivered after healing");
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_total_outage_in_dead_letter_mode_trips_the_defaults_and_the_healed_destination_resumes_within_10s() {
    a_total_outage_trips_the_defaults_and_the_healed_destination_resumes_within_10s(Fails::DeadLetter).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_total_outage_in_explicit_mode_trips_the_defaults_and_the_healed_destination_resumes_within_10s() {
    a_total_outage_trips_the_defaults_and_the_healed_destination_resumes_within_10s(Fails::Explicit).await;
}

/// A destination that fails 30 % of its deliveries at random (a partial failure) is never held
/// by the default breaker (90 % of at least 50 in 1 m), though it judged enough deliveries to
/// trip: every message arrives, none is parked. A total outage trips it (the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_failing_30_percent_of_its_deliveries_is_never_held_by_the_defaults() {
    let mut t = TestLadder::start("hold30", DEFAULTS).await;
    let mut args = FieldTable::default();
    args.set("x-dead-letter-exchange", text(&t.intake()));
    let orders = t.declare_queue("orders", args).await;
    t.track_queue(&names(&t).held_queue(&orders));
    let mut consumer = t.consume(&orders).await;
    let n = 400;
    for i in 0..n {
        let props = BasicProperties::default()
            .with_message_id(&format!("m{i:03}"))
            .with_delivery_mode(2);
        t.publish("", &orders, b"o", props).await;
    }
    let runtime = t.state.ladder("default").unwrap();
    // xorshift: the same 30 % every run
    let mut seed: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut fails = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % 100 < 30
    };
    let (mut done, mut deliveries, mut failed) = (HashSet::new(), 0u64, 0u64);
    let (mut most_judged, mut worst_ratio) = (0u64, 0.0f64);
    let deadline = Instant::now() + WAIT * 3;
    while done.len() < n {
        assert!(Instant::now() < deadline, "{} of {n} done in time", done.len());
        assert!(
            !runtime.holds.holds_back(&orders),
            "held after {deliveries} deliveries, {failed} failed"
        );
        if let Some(busy) = runtime
            .breaker
            .lock()
            .unwrap()
            .busiest(now_ms(), 10)
            .into_iter()
            .find(|b| b.destination == orders)
        {
            most_judged = most_judged.max(busy.delivered);
            if busy.delivered >= 50 {
                worst_ratio = worst_ratio.max(busy.failed as f64 / busy.delivered as f64);
            }
        }
        let Some(d) = next_within(&mut consumer, Duration::from_millis(100)).await else {
            continue;
        };
        deliveries += 1;
        if fails() {
            failed += 1;
            consumer.reject(&d, false);
        } else {
            done.insert(message_id(&d).to_string());
            consumer.ack(&d);
        }
    }
    eprintln!(
        "{deliveries} deliveries, {failed} failed; the breaker judged up to {most_judged} retries in its window, \
         at most {:.0} % failed",
        worst_ratio * 100.0
    );
    assert!(
        most_judged >= 50,
        "the breaker judged {most_judged} retries at most: too few to trip at all"
    );
    assert!(!runtime.holds.holds_back(&orders), "never held");
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
}

/// The `probe` transitions (probes this process released) in a metrics text.
fn probes_released(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("ladder_hold_transitions_total{ladder=\"default\",kind=\"probe\"} "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// Two replicas share the half-open state: each probe goes out once (from the held queue's
/// single active consumer), a probe's failure is seen whichever replica's intake takes it, so
/// neither resumes while the consumer still fails; once it heals, both resume and every message
/// arrives exactly once after the healing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_probe_once_at_the_pace_and_resume_only_after_the_consumer_heals() {
    let mut t = TestLadder::start("holdauto2", AUTO).await;
    let replica = Replica::start(&t).await;
    let n = 30;
    let (orders, mut consumer) = failures_for_orders(&mut t, n).await;
    let here = t.state.ladder("default").unwrap();
    let there = replica.2.ladder("default").unwrap();
    let held_anywhere = || here.holds.holds_back(&orders) || there.holds.holds_back(&orders);
    let held_everywhere = || here.holds.holds_back(&orders) && there.holds.holds_back(&orders);
    // the consumer fails everything (probes too) for FAILING after the trip
    const FAILING: Duration = Duration::from_secs(9);
    let started = Instant::now();
    let mut tripped: Option<Instant> = None;
    // probe id -> when it arrived, how often
    let mut probes: HashMap<u64, (Instant, usize)> = HashMap::new();
    let mut resumed_while_failing = false;
    while tripped.is_none_or(|at| at.elapsed() < FAILING) {
        assert!(started.elapsed() < WAIT * 2, "the automatic hold did not trip");
        if tripped.is_none() && held_everywhere() {
            tripped = Some(Instant::now());
        }
        // let a failed probe's record reach the stream before judging
        if let Some(at) = tripped
            && at.elapsed() > Duration::from_millis(500)
            && !held_anywhere()
        {
            resumed_while_failing = true;
        }
        if let Some(d) = next_within(&mut consumer, Duration::from_millis(50)).await {
            if let Some(id) = headers_of(&d)
                .get("retry-probe")
                .and_then(ladder::model::protocol::as_u64)
            {
                probes.entry(id).or_insert((Instant::now(), 0)).1 += 1;
            }
            let props = republish_props(&d, &[]);
            t.publish(&t.intake(), "", &d.body, props).await;
            consumer.ack(&d);
        }
    }
    let tripped = tripped.unwrap();
    let mut at: Vec<(u64, Instant, usize)> = probes.iter().map(|(id, (when, k))| (*id, *when, *k)).collect();
    at.sort_by_key(|p| p.1);
    let gaps: Vec<Duration> = at.windows(2).map(|w| w[1].1 - w[0].1).collect();
    eprintln!(
        "probes while failing: {} at {:?} after the trip; gaps {gaps:?}",
        at.len(),
        at.iter().map(|p| p.1 - tripped).collect::<Vec<_>>()
    );
    assert!(!resumed_while_failing, "resumed while the consumer still failed");
    assert!(at.iter().all(|p| p.2 == 1), "each probe delivered once: {at:?}");
    // one probe a second after the trip and after each failed one: some 7 in the 9 s. Doubled
    // probes (one per replica) would come in pairs, milliseconds apart
    assert!(
        (3..=9).contains(&at.len()),
        "probes at the configured pace, not one per replica: {at:?}"
    );
    assert!(
        gaps.iter().all(|g| *g >= Duration::from_millis(900)),
        "probes paced by probe_every: {gaps:?}"
    );
    let released = probes_released(&t.state.metrics.encode()) + probes_released(&replica.2.metrics.encode());
    assert_eq!(released, at.len() as u64, "each probe released by one replica");
    // every probe failed, whichever intake took it back, and both replicas read it (the last
    // may have gone out just before the consumer healed)
    for (who, state) in [("here", &t.state), ("there", &replica.2)] {
        let failed = || {
            state
                .metrics
                .encode()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("ladder_hold_transitions_total{ladder=\"default\",kind=\"probe_failed\"} ")
                })
                .and_then(|n| n.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        let what = format!("{who} read every probe's failure");
        eventually_ok(&what, Duration::from_secs(5), async || match failed() {
            n if n == at.len() as u64 => Ok(()),
            n => Err(format!("{n} of {}", at.len())),
        })
        .await;
    }

    // healed: every message arrives exactly once from now on, none is parked
    let healed = Instant::now();
    let seen = receive_after_healing(&mut consumer, n, held_anywhere).await;
    eprintln!("recovered {:?} after healing", healed.elapsed());
    assert_eq!(seen.len(), n, "every message delivered after healing: {seen:?}");
    assert!(!held_anywhere(), "both replicas resumed");
    assert!(
        next_within(&mut consumer, Duration::from_secs(1)).await.is_none(),
        "nothing more"
    );
    at_least_once_and_nothing_parked(&t, &seen).await;
    drop(replica);
}

/// The prober dies after its first probe failed: the broker hands the held message to the other
/// replica's consumer, which probes next and resumes once the consumer heals; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_prober_dies_the_other_replica_probes_and_resumes() {
    let mut t = TestLadder::start("holdauto3", AUTO).await;
    let mut replica = Some(Replica::start(&t).await);
    let n = 20;
    let (orders, mut consumer) = failures_for_orders(&mut t, n).await;
    // fail everything until the first probe came and failed too
    let started = Instant::now();
    loop {
        assert!(started.elapsed() < WAIT * 2, "no probe went out");
        if let Some(d) = next_within(&mut consumer, Duration::from_millis(50)).await {
            let probe = headers_of(&d).get("retry-probe").is_some();
            let props = republish_props(&d, &[]);
            t.publish(&t.intake(), "", &d.body, props).await;
            consumer.ack(&d);
            if probe {
                break;
            }
        }
    }
    // its failure recorded, the prober dies
    tokio::time::sleep(Duration::from_millis(600)).await;
    let survivor = if probes_released(&t.state.metrics.encode()) > 0 {
        eprintln!("the prober was the first service: stopped");
        t.stop_service().await;
        replica.as_ref().unwrap().2.clone()
    } else {
        eprintln!("the prober was the second service: aborted");
        drop(replica.take());
        t.state.clone()
    };
    let runtime = survivor.ladder("default").unwrap();
    assert!(runtime.holds.holds_back(&orders), "still held after the failed probe");
    // healed: the survivor probes, resumes, and every message arrives once
    let healed = Instant::now();
    let seen = receive_after_healing(&mut consumer, n, || runtime.holds.holds_back(&orders)).await;
    eprintln!("the survivor recovered {:?} after healing", healed.elapsed());
    assert_eq!(seen.len(), n, "every message delivered after healing: {seen:?}");
    assert!(!runtime.holds.holds_back(&orders), "resumed");
    assert!(
        probes_released(&survivor.metrics.encode()) >= 1,
        "the survivor sent the next probe"
    );
    at_least_once_and_nothing_parked(&t, &seen).await;
    drop(replica);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_cancelled_while_held_is_parked_on_release_not_delivered() {
    let ladder = "exact_delays = true\nbackoff = [\"200ms\"]\nallow = [\"^{ns}-\"]\nrelease_rate = \"50/s\"";
    let mut t = TestLadder::start("holdcancel", ladder).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    t.track_queue(&names(&t).held_queue(&orders));
    let spec = t.config.ladders[0].clone();
    ladder::broker::holds::hold(&t.client, &names(&t), &spec, &orders, "test", "")
        .await
        .unwrap();
    held_in(&t.state, &orders, true).await;
    let mut orders_in = t.consume(&orders).await;
    for id in ["keep", "stop"] {
        t.publish(&t.intake(), "", id.as_bytes(), failure(&orders, id)).await;
    }
    let held_queue = names(&t).held_queue(&orders);
    eventually("both held", WAIT, async || {
        (queue_depth(&t.client, &held_queue).await == 2).then_some(())
    })
    .await;
    ladder::broker::cancels::cancel(&t.client, &names(&t), "stop", "test")
        .await
        .unwrap();
    ladder::broker::holds::resume(&t.client, &names(&t), &spec, &orders, "test", None)
        .await
        .unwrap();
    let d = next(&mut orders_in).await;
    assert_eq!(message_id(&d), "keep");
    orders_in.ack(&d);
    let parked = t.parked(1).await;
    assert_eq!(parked[0].reason, "cancelled", "{}", parked[0].detail);
    assert_eq!(parked[0].message.properties["message_id"], "stop");
    assert!(parked[0].detail.contains("held queue"), "{}", parked[0].detail);
    assert!(
        next_within(&mut orders_in, Duration::from_secs(1)).await.is_none(),
        "the cancelled one is not delivered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_destinations_page_counts_the_messages_waiting_for_each_destination() {
    // one long step: the retries wait in one shared tier queue, for two destinations
    let ladder = "backoff = [\"8s\"]\nmax_attempts = 5\nallow = [\"^{ns}-\"]";
    let mut t = TestLadder::configure_with("waiting", ADMIN, ladder).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let billing = t.declare_queue("billing", FieldTable::default()).await;
    let mut orders_in = t.consume(&orders).await;
    let mut billing_in = t.consume(&billing).await;
    for i in 0..7 {
        t.publish(&t.intake(), "", b"o", failure(&orders, &format!("o{i}")))
            .await;
    }
    for i in 0..3 {
        t.publish(&t.intake(), "", b"b", failure(&billing, &format!("b{i}")))
            .await;
    }
    let http = reqwest::Client::new();
    let holds = admin.url(&format!("/api/ladders/{}/holds", t.ladder));
    let waiting_of = |listed: &Value, destination: &str| {
        listed["busiest"]
            .as_array()?
            .iter()
            .find(|b| b["destination"] == destination)?["waiting"]
            .as_u64()
    };
    // all ten waiting in the one tier: 7 for orders, 3 for billing
    eventually("7 and 3 waiting", Duration::from_secs(6), async || {
        let listed: Value = http.get(&holds).send().await.ok()?.json().await.ok()?;
        (waiting_of(&listed, &orders) == Some(7) && waiting_of(&listed, &billing) == Some(3)).then_some(())
    })
    .await;
    let page = http
        .get(admin.url("/ladders/default/destinations"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let row = |destination: &str| {
        let start = page
            .find(&format!("<tr data-destination=\"{destination}\">"))
            .unwrap_or_else(|| panic!("a row for {destination}: {page}"));
        page[start..start + page[start..].find("</tr>").unwrap()].to_string()
    };
    assert!(
        page.contains("<th title=\"put into a tier by this replica, not due yet\">Waiting</th>"),
        "{page}"
    );
    assert!(
        row(&orders).contains("<td class=\"waiting\">7</td>"),
        "{}",
        row(&orders)
    );
    assert!(
        row(&billing).contains("<td class=\"waiting\">3</td>"),
        "{}",
        row(&billing)
    );

    // once due they are delivered, and no longer waiting
    let got = receive(&mut orders_in, 7).await;
    assert_eq!(got.len(), 7);
    let got = receive(&mut billing_in, 3).await;
    assert_eq!(got.len(), 3);
    eventually("none waiting, all delivered", WAIT, async || {
        let listed: Value = http.get(&holds).send().await.ok()?.json().await.ok()?;
        let busy = listed["busiest"].as_array()?;
        let of = |d: &str| busy.iter().find(|b| b["destination"] == d).cloned();
        let (o, b) = (of(&orders)?, of(&billing)?);
        (o["waiting"] == 0 && b["waiting"] == 0 && o["delivered"] == 7 && b["delivered"] == 3).then_some(())
    })
    .await;
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
    admin.stop().await;
}

/// The offset of the first record of `stream` still there, and of its first hold record of
/// `destination` (if retention left one).
async fn first_offsets(t: &TestLadder, stream: &str, destination: &str) -> (u64, Option<u64>) {
    let channel = t.client.create_channel().await.unwrap();
    channel.basic_qos(100).await.unwrap();
    let mut args = FieldTable::default();
    args.set("x-stream-offset", ladder_amqp::FieldValue::string("first"));
    let mut consumer = channel.basic_consume(stream, "", false, args).await.unwrap();
    let offset_of = |d: &ladder_amqp::Delivery| {
        d.properties
            .headers
            .as_ref()
            .and_then(|h| h.get("x-stream-offset"))
            .and_then(ladder::model::protocol::as_u64)
            .expect("a stream offset")
    };
    let first = tokio::time::timeout(WAIT, consumer.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let (first_offset, mut hold) = (offset_of(&first), None);
    let mut delivery = Some(first);
    // the records up to a quiet moment: the stream's tail
    while let Some(d) = delivery {
        let record = ladder::model::holds::HoldRecord::from_slice(&d.body);
        if hold.is_none() && record.is_some_and(|r| r.destination == destination) {
            hold = Some(offset_of(&d));
        }
        channel.basic_ack(d.delivery_tag, false).unwrap();
        delivery = match tokio::time::timeout(Duration::from_millis(500), consumer.next()).await {
            Ok(Some(Ok(d))) => Some(d),
            _ => None,
        };
    }
    let _ = channel.close(200, "read").await;
    (first_offset, hold)
}

/// Retention removes the hold stream's oldest segments (past `HOLDS_MAX_BYTES`): a hold recorded
/// before the cut still holds on a replica that starts after it, because the followers'
/// checkpoints carry it, and it resumes as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_older_than_the_hold_streams_retention_still_holds_on_a_new_replica() {
    let mut t = TestLadder::configure_with("hold-retention", "", LADDER).await;
    t.start_service().await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    t.track_queue(&names(&t).held_queue(&orders));
    let spec = t.config.ladders[0].clone();
    ladder::broker::holds::hold(&t.client, &names(&t), &spec, &orders, "test", "before the cut")
        .await
        .unwrap();
    held_in(&t.state, &orders, true).await;
    let stream = names(&t).holds;
    let (_, hold) = first_offsets(&t, &stream, &orders).await;
    let hold = hold.expect("the hold record");

    // more than the retention, in records the followers skip (a MiB each), so the segment that
    // holds the hold record is removed
    let filler = vec![b'x'; 1024 * 1024];
    let mib = ladder::model::plan::HOLDS_MAX_BYTES as usize / filler.len();
    for _ in 0..mib + 4 {
        let props = BasicProperties::default().with_type("lt.filler").with_delivery_mode(2);
        t.publish("", &stream, &filler, props).await;
    }
    let (first, again) = first_offsets(&t, &stream, &orders).await;
    assert!(
        first > hold,
        "retention cut the stream past the hold record ({first} > {hold})"
    );
    assert_eq!(again, None, "no hold record of orders is left");

    // a replica that starts now reads the stream from its cut, and holds
    let replica = Replica::start(&t).await;
    held_in(&replica.2, &orders, true).await;
    let holds = ladder::broker::holds::snapshot(&t.client, &names(&t), &spec)
        .await
        .unwrap();
    let h = holds.get(&orders).expect("the hold is known");
    assert_eq!((h.state, h.why.as_str()), (HoldState::Held, "before the cut"));
    // and what comes due for orders waits, on either replica
    let mut orders_in = t.consume(&orders).await;
    for i in 0..6 {
        t.publish(&t.intake(), "", b"o", failure(&orders, &format!("r{i}")))
            .await;
    }
    assert!(
        next_within(&mut orders_in, Duration::from_secs(2)).await.is_none(),
        "held after the cut"
    );
    ladder::broker::holds::resume(&t.client, &names(&t), &spec, &orders, "test", None)
        .await
        .unwrap();
    let got = receive(&mut orders_in, 6).await;
    let ids: HashSet<String> = got.iter().map(|d| message_id(d).to_string()).collect();
    assert_eq!(ids.len(), 6, "all released once");
    held_in(&replica.2, &orders, false).await;
    held_in(&t.state, &orders, false).await;
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
}

/// Whether `queue` exists (a passive declare on a channel of its own).
async fn exists(t: &TestLadder, queue: &str) -> bool {
    let channel = t.client.create_channel().await.unwrap();
    let found = tokio::time::timeout(WAIT, channel.queue_inspect(queue))
        .await
        .expect("the broker answers");
    match found {
        Ok(_) => {
            let _ = channel.close(200, "inspected").await;
            true
        }
        Err(e) if e.reply_code() == Some(404) => false,
        Err(e) => panic!("inspecting {queue}: {e}"),
    }
}

/// The grace after which a released held queue is deleted, short for the tests.
const GRACE: Duration = Duration::from_millis(1_500);

/// Holds `orders`, lets failures for it come due all along (before the hold, while held, during
/// the release, around the deletion of the held queue and after it), resumes, and checks that the
/// held queue is deleted once empty for the grace, that the destination is forgotten, that every
/// message arrived exactly once and none was parked; then holds it again (a new held queue) and
/// releases that too.
async fn held_queue_deleted_after_release(kind: &str, queue_type: &str, replicas: usize) {
    let ladder = format!("{LADDER}\nqueue_type = \"{queue_type}\"");
    let mut t = TestLadder::configure_with(kind, "", &ladder).await;
    let mut config = (*t.config).clone();
    config.ladders[0].held_queue_grace = GRACE;
    t.config = Arc::new(config);
    t.start_service().await;
    let mut others = Vec::new();
    for _ in 1..replicas {
        others.push(Replica::start(&t).await);
    }
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let held_queue = names(&t).held_queue(&orders);
    t.track_queue(&held_queue);
    let spec = t.config.ladders[0].clone();
    let mut orders_in = t.consume(&orders).await;

    // failures for orders, ten 40 ms apart then a second's pause, from now until told to stop
    let sending = CancellationToken::new();
    let sender = {
        let (channel, intake, orders, sending) = (t.channel.clone(), t.intake(), orders.clone(), sending.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !sending.is_cancelled() {
                publish(&channel, &intake, "", b"o", failure(&orders, &format!("s{n:04}"))).await;
                n += 1;
                // bursts with a pause: a release ends only once its held queue is idle (500 ms)
                let pause = if n % 10 == 0 { 1_000 } else { 40 };
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            n
        })
    };
    let mut seen: HashMap<String, usize> = HashMap::new();
    let take = async |consumer: &mut TestConsumer, within: Duration, seen: &mut HashMap<String, usize>| {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if let Some(d) = next_within(consumer, Duration::from_millis(50)).await {
                *seen.entry(message_id(&d).to_string()).or_default() += 1;
                consumer.ack(&d);
            }
        }
    };
    for round in 0..2 {
        take(&mut orders_in, Duration::from_millis(400), &mut seen).await;
        ladder::broker::holds::hold(&t.client, &names(&t), &spec, &orders, "test", "deleted after")
            .await
            .unwrap();
        held_in(&t.state, &orders, true).await;
        for r in &others {
            held_in(&r.2, &orders, true).await;
        }
        take(&mut orders_in, Duration::from_millis(800), &mut seen).await;
        ladder::broker::holds::resume(
            &t.client,
            &names(&t),
            &spec,
            &orders,
            "test",
            Some("100/s".parse().unwrap()),
        )
        .await
        .unwrap();
        held_in(&t.state, &orders, false).await;
        // the held queue goes once it stayed empty for the grace, on every replica's word
        let until = Instant::now() + WAIT;
        while exists(&t, &held_queue).await {
            assert!(Instant::now() < until, "round {round}: the held queue was not deleted");
            take(&mut orders_in, Duration::from_millis(100), &mut seen).await;
        }
        eventually("every replica forgets the destination", WAIT, async || {
            let gone = |state: &State| {
                let runtime = state.ladder("default").unwrap();
                runtime.holds.snapshot().get(&orders).is_none()
            };
            (gone(&t.state) && others.iter().all(|r| gone(&r.2))).then_some(())
        })
        .await;
        take(&mut orders_in, Duration::from_millis(400), &mut seen).await;
    }
    sending.cancel();
    let sent = tokio::time::timeout(WAIT, sender).await.unwrap().unwrap();
    let until = Instant::now() + WAIT;
    while seen.len() < sent && Instant::now() < until {
        take(&mut orders_in, Duration::from_millis(200), &mut seen).await;
    }
    take(&mut orders_in, Duration::from_millis(300), &mut seen).await;
    assert_eq!(seen.len(), sent, "every one of {sent} delivered");
    assert!(seen.values().all(|k| *k == 1), "none twice: {seen:?}");
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
    assert!(!exists(&t, &held_queue).await);
    eprintln!("{kind}: {sent} delivered once, the held queue deleted twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_quorum_held_queue_is_deleted_after_its_grace_and_nothing_is_lost() {
    held_queue_deleted_after_release("held-del-q", "quorum", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_classic_held_queue_is_deleted_with_two_replicas_and_nothing_is_lost() {
    held_queue_deleted_after_release("held-del-c", "classic", 2).await;
}

/// A replica that routes into a held queue already deleted (it had not read the end of the
/// release yet; here: the queue deleted by hand while held) gets its publish back: the message
/// is not parked but waits in a tier, and is delivered once the release ended. Here the
/// failures reach the intake while held, so the intake's publish comes back first: each waits
/// as the intake decided it, its attempt counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_message_whose_held_queue_is_gone_waits_and_is_delivered_after_the_release() {
    let mut t = TestLadder::configure_with("held-gone", "", LADDER).await;
    t.start_service().await;
    let (orders, held_queue, spec) = hold_orders(&mut t, "gone").await;
    t.channel.queue_delete(&held_queue).await.unwrap();
    let mut orders_in = t.consume(&orders).await;
    for i in 0..8 {
        t.publish(&t.intake(), "", b"o", failure(&orders, &format!("g{i}")))
            .await;
    }
    assert!(
        next_within(&mut orders_in, Duration::from_secs(2)).await.is_none(),
        "still held"
    );
    ladder::broker::holds::resume(&t.client, &names(&t), &spec, &orders, "test", None)
        .await
        .unwrap();
    let got = receive(&mut orders_in, 8).await;
    let ids: HashSet<String> = got.iter().map(|d| message_id(d).to_string()).collect();
    assert_eq!(ids.len(), 8, "all delivered once");
    for d in &got {
        assert_eq!(int_header(d, "retry-attempt"), Some(1), "its attempt counted once");
    }
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");
}
