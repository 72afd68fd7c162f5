//! The tier queues are the namespace's, against the real broker: two ladders share one tier
//! queue, and what expires in it comes due in its own ladder only (`N.due` routes by
//! `retry-ladder`); the accounting checks both ladders together; what belongs to no ladder the
//! namespace serves goes to `N.stray`, and on to the ladder its headers say it belongs to —
//! nothing is dropped and no check is skipped.

use std::collections::HashMap;
use std::sync::Arc;

use crate::common::*;
use ladder_amqp::{BasicProperties, FieldTable, FieldValue};

/// Two ladders with the same step: they share `N.delay.300ms`.
fn ladder(dest: &str) -> String {
    format!("backoff = [\"300ms\"]\nmax_attempts = 3\nallow = [\"^{{ns}}-{dest}$\"]\n")
}

/// Reads `/api/ladders` until `condition` holds (or panics at [`WAIT`]).
async fn wait_ladders(
    admin: &TestAdmin,
    what: &str,
    condition: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    eventually_ok(what, WAIT, async || {
        let url = admin.url("/api/ladders");
        let body = tokio::time::timeout(WAIT, async { reqwest::get(&url).await?.text().await })
            .await
            .map_err(|_| "the admin server did not answer".to_string())?
            .map_err(|e| e.to_string())?;
        let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        if condition(&v) { Ok(v) } else { Err(format!("\n{v:#}")) }
    })
    .await
}

/// Ladders `a` and `b` of one namespace, each failing 100 messages twice in dead-letter mode:
/// every retry waits in the one shared tier queue and comes back to its own destination, each
/// message's last retry exactly once; no per-ladder tier exists; the namespace-wide accounting
/// check balances with every delivery counted, and never reports a loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ladders_share_a_tier_and_each_retry_comes_back_to_its_own_queue() {
    const EACH: usize = 100;
    let mut t = TestLadder::configure_with("shared", "[admin]\npoll_interval = \"100ms\"", &ladder("a")).await;
    // a second ladder in the same directory (files are read sorted: `b` comes first)
    let path = write_config(
        t.dir.path(),
        &t.ns,
        "[admin]\npoll_interval = \"100ms\"",
        "b",
        &ladder("b"),
    );
    t.config = Arc::new(ladder::config::load(&path, &HashMap::new()).expect("two ladders load"));
    assert_eq!(t.config.ladders.len(), 2);
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;

    let shared = format!("{}.delay.300ms", t.ns);
    assert!(depth(&t.client, &shared).await.is_some(), "the shared tier exists");
    for own in ["default", "b"] {
        let queue = format!("{}.{own}.delay.300ms", t.ns);
        assert_eq!(depth(&t.client, &queue).await, None, "{queue} is not declared");
    }

    let mut queues = Vec::new();
    for (name, ladder) in [("a", "default"), ("b", "b")] {
        let mut args = FieldTable::default();
        args.set("x-dead-letter-exchange", text(&format!("{}.{ladder}", t.ns)));
        queues.push(t.declare_queue(name, args).await);
    }
    for (i, queue) in queues.iter().enumerate() {
        for n in 0..EACH {
            let props = BasicProperties::default()
                .with_message_id(format!("{i}-{n}").as_str())
                .with_delivery_mode(2);
            t.publish("", queue, b"x", props).await;
        }
    }
    let mut consumers = [t.consume(&queues[0]).await, t.consume(&queues[1]).await];
    let mut done: [HashMap<String, usize>; 2] = [HashMap::new(), HashMap::new()];
    let deadline = tokio::time::Instant::now() + WAIT * 2;
    while done.iter().map(HashMap::len).sum::<usize>() < 2 * EACH {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {:?} done",
            done.each_ref().map(HashMap::len)
        );
        for (i, consumer) in consumers.iter_mut().enumerate() {
            let Some(d) = next_within(consumer, std::time::Duration::from_millis(50)).await else {
                continue;
            };
            let id = message_id(&d).to_string();
            assert!(id.starts_with(&format!("{i}-")), "{id} came back to queue {i}");
            let attempt = int_header(&d, "retry-attempt").unwrap_or(0);
            if attempt < 2 {
                consumer.reject(&d, false);
            } else {
                assert_eq!(attempt, 2, "{id}");
                *done[i].entry(id).or_default() += 1;
                consumer.ack(&d);
            }
        }
    }
    for (i, seen) in done.iter().enumerate() {
        let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            twice.is_empty(),
            "queue {i}: delivered twice on its last retry: {twice:?}"
        );
    }
    // nothing more arrives, and the shared tier is empty
    for consumer in &mut consumers {
        assert!(
            next_within(consumer, std::time::Duration::from_millis(800))
                .await
                .is_none()
        );
    }
    // both ladders are checked together: balanced, every delivery counted, no loss
    let v = wait_ladders(&admin, "both ladders balance with every delivery counted", |v| {
        let l = v["ladders"].as_array().unwrap();
        let delivered: u64 = l.iter().map(|l| l["totals"]["delivered"].as_u64().unwrap_or(0)).sum();
        delivered == 4 * EACH as u64 && l.iter().all(|l| l["accounting"]["verdict"] == "balanced")
    })
    .await;
    for (l, other) in v["ladders"].as_array().unwrap().iter().zip(["default", "b"]) {
        assert_eq!(l["accounting"]["unaccounted"], 0, "{v:#}");
        assert_eq!(l["queues"]["delay.300ms"], shared.as_str(), "{v:#}");
        // the page and the API say whose messages the count also holds
        assert_eq!(l["tiers"][0]["shared_with"], serde_json::json!([other]), "{v:#}");
    }
    admin.stop().await;
}

/// What expires in a shared tier for no ladder the namespace serves — a message without
/// `retry-ladder`, or naming a ladder that is gone — is routed to `N.stray` (never dropped) and
/// moved to the ladder its headers say it belongs to: the one whose allow-list admits its
/// `retry-to`, whichever ladder file sorts first; what no ladder admits is parked with the
/// reason by the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_belongs_to_no_ladder_goes_to_the_ladder_that_admits_it() {
    let mut t = TestLadder::configure_with("stray", "", &ladder("a")).await;
    // a second ladder that sorts first and admits only `b`
    let path = write_config(t.dir.path(), &t.ns, "", "b", &ladder("b"));
    t.config = Arc::new(ladder::config::load(&path, &HashMap::new()).expect("two ladders load"));
    assert_eq!(t.config.ladders[0].name, "b");
    t.start_service().await;
    let allowed = t.declare_queue("a", FieldTable::default()).await;
    let nowhere = t.declare_queue("c", FieldTable::default()).await;
    let mut consumer = t.consume(&allowed).await;
    let shared = format!("{}.delay.300ms", t.ns);
    let stray = |id: &str, ladder: Option<&str>, to: &str| {
        let mut h = FieldTable::default();
        h.set("retry-to", text(to));
        if let Some(ladder) = ladder {
            h.set("retry-ladder", text(ladder));
        }
        h.set("retry-attempt", FieldValue::LongLongInt(1));
        BasicProperties::default()
            .with_message_id(id)
            .with_delivery_mode(2)
            .with_headers(h)
    };
    // straight into the shared tier, as only a user with write on it could
    t.publish("", &shared, b"gone", stray("gone-1", Some("retired"), &allowed))
        .await;
    t.publish("", &shared, b"none", stray("none-1", None, &allowed)).await;
    t.publish("", &shared, b"other", stray("other-1", Some("retired"), &nowhere))
        .await;

    let mut seen = Vec::new();
    for _ in 0..2 {
        let d = next(&mut consumer).await;
        seen.push(message_id(&d).to_string());
        consumer.ack(&d);
    }
    seen.sort();
    assert_eq!(seen, ["gone-1", "none-1"], "delivered by the ladder that admits them");
    let first = format!("{}.b.parked", t.ns);
    let parked = read_parked(&t.client, &first, 1).await.remove(0);
    assert_eq!(parked.reason, "destination-not-allowed", "{}", parked.detail);
    assert_eq!(parked.hop, "due");
    assert_eq!(parked.destination.as_deref(), Some(nowhere.as_str()));
    t.assert_nothing_parked_after(0).await;
    assert_eq!(
        depth(&t.client, &format!("{}.stray", t.ns)).await,
        Some((0, 1)),
        "N.stray is consumed"
    );
}
