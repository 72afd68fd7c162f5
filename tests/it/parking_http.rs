//! The parking lot over the admin server's JSON API, against the real broker: a few hundred
//! parked messages of different reasons and destinations searched every way, a filter replayed
//! at a rate (arrival and rate checked), a discard, the same state seen by a restarted service,
//! tokens required and named in the record, and two replicas asked to replay the same filter at
//! the same time replaying each entry once.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::common::parking::{Mix, ONE_TIER, ids, park_mix, park_to};
use crate::common::*;
use ladder_amqp::FieldTable;
use serde_json::{Value, json};

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789abc";

/// Admin on an ephemeral port, fast polls, two operators.
const ADMIN: &str = "[admin]\nbind = \"127.0.0.1:0\"\npoll_interval = \"100ms\"\n[admin.tokens]\nalice = \"alice-token-0123456789\"\nbob = \"bob-token-0123456789abc\"";

/// What the first test parks.
const MIX: Mix = Mix {
    to_a: 150,
    to_b: 100,
    invalid: 30,
    no_destination: 20,
};
const TOTAL: usize = MIX.total();

struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    fn new(admin: &TestAdmin, ladder: &str) -> Self {
        Api {
            http: reqwest::Client::builder().timeout(WAIT * 2).build().unwrap(),
            base: admin.url(&format!("/api/ladders/{ladder}/parked")),
        }
    }

    async fn get(&self, query: &[(&str, &str)]) -> (u16, Value) {
        let r = self
            .http
            .get(&self.base)
            .query(query)
            .send()
            .await
            .expect("GET answered");
        (r.status().as_u16(), r.json().await.expect("a JSON answer"))
    }

    async fn counts(&self, query: &[(&str, &str)]) -> (u16, Value) {
        let r = self
            .http
            .get(format!("{}/counts", self.base))
            .query(query)
            .send()
            .await
            .expect("GET answered");
        (r.status().as_u16(), r.json().await.expect("a JSON answer"))
    }

    async fn total(&self, query: &[(&str, &str)]) -> u64 {
        let (status, v) = self.get(query).await;
        assert_eq!(status, 200, "{v}");
        v["total"].as_u64().unwrap()
    }

    /// Waits until the index has caught up with the stream and holds `n` entries in all.
    async fn wait_indexed(&self, n: u64) {
        let what = format!("the index caught up at {n} entries");
        eventually_ok(&what, WAIT, async || {
            let (_, v) = self.get(&[("limit", "0"), ("resolved", "include")]).await;
            if v["caught_up"] == true && v["total"].as_u64() == Some(n) {
                Ok(())
            } else {
                Err(v)
            }
        })
        .await
    }

    /// Waits until `query` counts `n` (another replica's resolutions arrive through the stream).
    async fn wait_total(&self, query: &[(&str, &str)], n: u64) {
        let what = format!("{query:?} counts {n}");
        eventually_ok(&what, WAIT, async || match self.total(query).await {
            total if total == n => Ok(()),
            total => Err(total),
        })
        .await
    }

    async fn post(&self, action: &str, token: Option<&str>, body: Value) -> (u16, Value) {
        let mut request = self.http.post(format!("{}/{action}", self.base)).json(&body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let r = request.send().await.expect("POST answered");
        (r.status().as_u16(), r.json().await.expect("a JSON answer"))
    }
}

/// A ladder served with [`ADMIN`] whose lot holds `n` entries for its queue `a`: the ladder and `a`.
async fn parked_for_a(hint: &str, n: usize) -> (TestLadder, String) {
    let mut t = TestLadder::configure_with(hint, ADMIN, ONE_TIER).await;
    let a = t.declare_queue("a", FieldTable::default()).await;
    t.start_service().await;
    park_to(&t, &a, n).await;
    (t, a)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_api_searches_replays_at_a_rate_discards_and_a_restart_sees_the_same() {
    let mut t = TestLadder::configure_with("http-lot", ADMIN, ONE_TIER).await;
    let a = t.declare_queue("a", FieldTable::default()).await;
    let b = t.declare_queue("b", FieldTable::default()).await;
    t.start_service().await;
    let before = now_ms();
    park_mix(&t, MIX, &a, &b).await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let api = Api::new(&admin, &t.ladder);
    api.wait_indexed(TOTAL as u64).await;

    // search each way
    assert_eq!(api.total(&[]).await, TOTAL as u64);
    assert_eq!(api.total(&[("destination", &a)]).await, (MIX.to_a + MIX.invalid) as u64);
    assert_eq!(api.total(&[("destination", &b)]).await, MIX.to_b as u64);
    assert_eq!(
        api.total(&[("reason", "max-attempts")]).await,
        (MIX.to_a + MIX.to_b) as u64
    );
    assert_eq!(api.total(&[("reason", "invalid-header")]).await, MIX.invalid as u64);
    assert_eq!(
        api.total(&[("reason", "no-destination")]).await,
        MIX.no_destination as u64
    );
    assert_eq!(api.total(&[("message_id", "m-7")]).await, 1);
    assert_eq!(api.total(&[("correlation_id", "c-3")]).await, (TOTAL / 10) as u64);
    assert_eq!(api.total(&[("header", "tenant=t1")]).await, (TOTAL / 4) as u64);
    assert_eq!(api.total(&[("body", "\"i\": 12,")]).await, 1);
    assert_eq!(api.total(&[("header", "tenant=t1"), ("destination", &b)]).await, 25);
    assert_eq!(api.total(&[("since", "1h")]).await, TOTAL as u64);
    let until = humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(before - 1000));
    assert_eq!(api.total(&[("until", &until.to_string())]).await, 0);

    // counted per reason and per destination, from the index or (headers) the records
    let (status, c) = api.counts(&[]).await;
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["total"], TOTAL);
    assert_eq!(
        c["by_reason"],
        json!([
            ["max-attempts", MIX.to_a + MIX.to_b],
            ["invalid-header", MIX.invalid],
            ["no-destination", MIX.no_destination]
        ])
    );
    assert_eq!(
        c["by_destination"],
        json!([[a, MIX.to_a + MIX.invalid], [b, MIX.to_b], ["-", MIX.no_destination]])
    );
    assert_eq!(c["caught_up"], true);
    let tenant_1 = |from: usize, to: usize| (from..to).filter(|i| i % 4 == 1).count();
    let (_, c) = api.counts(&[("header", "tenant=t1"), ("reason", "max-attempts")]).await;
    assert_eq!(c["total"], tenant_1(0, MIX.to_a + MIX.to_b));
    assert_eq!(
        c["by_destination"],
        json!([[a, tenant_1(0, MIX.to_a)], [b, tenant_1(MIX.to_a, MIX.to_a + MIX.to_b)]])
    );

    // newest first, paged; one entry in full
    let (_, first) = api.get(&[("limit", "10")]).await;
    let entries = first["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 10);
    assert_eq!(
        entries[0]["envelope"]["message"]["properties"]["message_id"],
        format!("m-{}", TOTAL - 1)
    );
    let (_, last) = api.get(&[("limit", "50"), ("offset", &(TOTAL - 10).to_string())]).await;
    assert_eq!(last["entries"].as_array().unwrap().len(), 10);
    assert_eq!(
        last["entries"][9]["envelope"]["message"]["properties"]["message_id"],
        "m-0"
    );
    let offset = entries[3]["offset"].as_u64().unwrap();
    let one: Value = api
        .http
        .get(format!("{}/{offset}", api.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(one["offset"], offset);
    assert_eq!(one["envelope"]["reason"], "no-destination");
    let missing = api.http.get(format!("{}/999999", api.base)).send().await.unwrap();
    assert_eq!(missing.status().as_u16(), 404);
    let (status, _) = api.get(&[("limit", "100000")]).await;
    assert_eq!(status, 400, "pages are bounded");

    // replay and discard need a configured token
    let to_b = json!({"destination": b, "reason": "max-attempts"});
    let (status, v) = api.post("replay", None, to_b.clone()).await;
    assert_eq!(status, 401, "{v}");
    let (status, v) = api.post("replay", Some("not-a-token-at-all-1234"), to_b.clone()).await;
    assert_eq!(status, 403, "{v}");
    assert_eq!(queue_depth(&t.client, &b).await, 0, "a refused request replays nothing");
    let (status, v) = api.post("replay", Some(ALICE), json!({})).await;
    assert_eq!(status, 400, "an empty filter is refused: {v}");

    // a dry run says what would be replayed
    let mut dry = to_b.clone();
    dry["dry_run"] = json!(true);
    let (status, v) = api.post("replay", Some(ALICE), dry).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["outcomes"].as_array().unwrap().len(), MIX.to_b);
    assert!(
        v["outcomes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|o| o["status"] == "would-replay")
    );
    assert_eq!(queue_depth(&t.client, &b).await, 0);

    // replay a filter at 50/s: every message arrives, no faster than the rate
    let mut paced = to_b.clone();
    paced["rate"] = json!("50/s");
    let mut consumer = t.consume(&b).await;
    let started = Instant::now();
    let replay = async {
        let answer = api.post("replay", Some(ALICE), paced).await;
        (answer, started.elapsed())
    };
    // consume while it replays, to see the arrival rate; then anything more, up to a marker
    // (the request answers once its last publish is confirmed)
    let (((status, v), took), arrivals) = tokio::join!(replay, receive_timed(&mut consumer, MIX.to_b));
    let times: Vec<Instant> = arrivals.iter().map(|(at, _)| *at).collect();
    let mut arrived = ids(arrivals.iter().map(|(_, d)| d));
    let markers = t.mark(&b, Via::Queue).await;
    arrived.extend(ids(&until_markers(&mut consumer, &markers).await));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["left_over"], 0);
    assert!(
        v["outcomes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|o| o["status"] == "replayed"),
        "{v}"
    );
    let unique: HashSet<_> = arrived.iter().collect();
    assert_eq!(
        (arrived.len(), unique.len()),
        (MIX.to_b, MIX.to_b),
        "each replayed once"
    );
    let spread = times[MIX.to_b - 1] - times[0];
    let rate = (MIX.to_b - 1) as f64 / spread.as_secs_f64();
    eprintln!(
        "replayed {} at 50/s: request took {took:?}, arrivals spread {spread:?} ({rate:.1}/s)",
        MIX.to_b
    );
    assert!(took >= Duration::from_millis(99 * 20), "the pacer holds 50/s: {took:?}");
    assert!(rate <= 55.0, "arrivals no faster than the rate: {rate:.1}/s");
    assert_eq!(
        api.total(&[("destination", &b)]).await,
        0,
        "replayed entries are resolved"
    );
    let (_, resolved) = api
        .get(&[("destination", &b), ("resolved", "include"), ("limit", "1")])
        .await;
    assert_eq!(resolved["total"], MIX.to_b as u64);
    let r = &resolved["entries"][0]["resolution"];
    assert_eq!(
        (r["action"].as_str(), r["by"].as_str(), r["to"].as_str()),
        (Some("replayed"), Some("alice"), Some(b.as_str()))
    );

    // discard by filter, as bob
    let (status, v) = api
        .post("discard", Some(BOB), json!({"reason": "no-destination"}))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["outcomes"].as_array().unwrap().len(), MIX.no_destination);
    assert_eq!(api.total(&[("reason", "no-destination")]).await, 0);
    let open = (TOTAL - MIX.to_b - MIX.no_destination) as u64;
    assert_eq!(api.total(&[]).await, open);

    // a restarted service (a fresh index read from the stream) serves the same state
    admin.stop().await;
    t.stop_service().await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let api = Api::new(&admin, &t.ladder);
    api.wait_indexed(TOTAL as u64).await;
    assert_eq!(api.total(&[]).await, open);
    assert_eq!(api.total(&[("destination", &b)]).await, 0);
    assert_eq!(api.total(&[("reason", "no-destination")]).await, 0);
    let (_, v) = api
        .get(&[("reason", "no-destination"), ("resolved", "include"), ("limit", "1")])
        .await;
    assert_eq!(v["entries"][0]["resolution"]["action"], "discarded");
    assert_eq!(v["entries"][0]["resolution"]["by"], "bob");
    assert_eq!(api.total(&[("header", "tenant=t2"), ("destination", &a)]).await, 45);
    admin.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_asked_at_once_replay_each_entry_once() {
    const N: usize = 120;
    let (t, a) = parked_for_a("http-twice", N).await;
    // two replicas: each its own admin server, connection and index
    let one = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let two = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let (api1, api2) = (Api::new(&one, &t.ladder), Api::new(&two, &t.ladder));
    api1.wait_indexed(N as u64).await;
    api2.wait_indexed(N as u64).await;

    let body = json!({"destination": a, "rate": "200/s"});
    let ((s1, v1), (s2, v2), (s3, v3)) = tokio::join!(
        api1.post("replay", Some(ALICE), body.clone()),
        api2.post("replay", Some(BOB), body.clone()),
        // a second request to the same replica at the same time
        api1.post("replay", Some(BOB), body.clone()),
    );
    let replayed = |status: u16, v: &Value| -> usize {
        match status {
            200 => v["outcomes"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|o| o["status"] == "replayed")
                .count(),
            409 => 0,
            other => panic!("unexpected {other}: {v}"),
        }
    };
    let counts = [replayed(s1, &v1), replayed(s2, &v2), replayed(s3, &v3)];
    eprintln!("statuses {s1}/{s2}/{s3}, replayed {counts:?}");
    assert_eq!(
        counts.iter().sum::<usize>(),
        N,
        "every entry replayed by exactly one request"
    );
    assert!(
        [s1, s3].contains(&409),
        "two requests to one replica at once: one is refused as busy ({s1}, {s3})"
    );
    // every request answered after its last publish was confirmed: all of them queue ahead of
    // a marker published now
    let arrived = ids(&t.drain_queue(&a).await);
    let unique: HashSet<_> = arrived.iter().collect();
    assert_eq!((arrived.len(), unique.len()), (N, N), "each message arrived once");
    // both replicas see every entry resolved, whichever of them replayed it
    api1.wait_total(&[], 0).await;
    api2.wait_total(&[], 0).await;
    one.stop().await;
    two.stop().await;
}

/// A replay longer than the caller waits answers 202 with its job; the job runs on to its end,
/// holds the ladder meanwhile (a second action is refused as busy), and its page and the API
/// show every outcome once it ends.
#[tokio::test(flavor = "multi_thread")]
async fn a_long_replay_runs_on_as_a_job_the_caller_follows() {
    const N: usize = 12;
    let (t, a) = parked_for_a("http-job", N).await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let api = Api::new(&admin, &t.ladder);
    api.wait_indexed(N as u64).await;

    // 12 at 6/s take about two seconds; the caller waits for none of it
    let (status, started) = api
        .post(
            "replay",
            Some(ALICE),
            json!({"destination": a, "rate": "6/s", "wait": "0s"}),
        )
        .await;
    assert_eq!(status, 202, "{started}");
    assert_eq!(started["done"], false, "{started}");
    assert_eq!(started["by"], "alice");
    let link = started["status"].as_str().expect("a status link").to_string();
    let (busy, refusal) = api.post("discard", Some(BOB), json!({"destination": a})).await;
    assert_eq!(busy, 409, "a second action while the job runs: {refusal}");

    let http = reqwest::Client::builder().timeout(WAIT).build().unwrap();
    let done = eventually_ok("the job ended", WAIT, async || {
        let view: Value = http.get(admin.url(&link)).send().await.unwrap().json().await.unwrap();
        if view["done"] == true { Ok(view) } else { Err(view) }
    })
    .await;
    let outcomes = done["outcomes"].as_array().unwrap();
    assert_eq!(outcomes.len(), N, "{done}");
    assert!(outcomes.iter().all(|o| o["status"] == "replayed"), "{done}");
    assert_eq!(done["error"], Value::Null);
    let listed: Value = http
        .get(admin.url(&format!("/api/ladders/{}/parked/jobs", t.ladder)))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed[0]["id"], started["id"], "the newest job first: {listed}");
    // the operator's page of the same job
    let page = http
        .get(admin.url(&format!("/ladders/{}/jobs/{}", t.ladder, started["id"])))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status().as_u16(), 200);
    let html = page.text().await.unwrap();
    assert!(html.contains(&format!("{N} replayed.")), "{html}");
    assert!(
        !html.contains("http-equiv=\"refresh\""),
        "an ended job's page stops refreshing"
    );
    let missing = http
        .get(admin.url(&format!("/api/ladders/{}/parked/jobs/999999", t.ladder)))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status().as_u16(), 404);

    // the job ended after its last publish was confirmed
    let arrived = ids(&t.drain_queue(&a).await);
    assert_eq!(arrived.iter().collect::<HashSet<_>>().len(), N, "each replayed once");
    assert_eq!(arrived.len(), N);
    api.wait_total(&[], 0).await;
    admin.stop().await;
}
