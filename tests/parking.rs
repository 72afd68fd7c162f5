//! The parking lot against the real broker: 200 messages parked through the running service
//! (bad input and exhausted ladders, to two destinations and none), then listed and counted by
//! every filter, shown, replayed at a measured rate with their original body, properties and
//! headers, resolved (a second listing and a second replay skip them), discarded, refused when
//! the target is not allowed or does not exist, and parked again with their lineage after a
//! replayed message fails again. Also the `ladder parked` CLI (`list --json`, `counts`,
//! `replay --dry-run`), and a narrow header search over thousands of records.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::*;
use ladder::envelope::Envelope;
use ladder::lot_index::SharedIndex;
use ladder::parking::{self, Action, Filter, PageRequest, ParkedEntry, ReplayOptions, Status};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, ShortString};

/// One 100 ms tier and no retry to spare: `retry-attempt = 1` is parked at once as `max-attempts`.
const ONE_TIER: &str = "backoff = [\"100ms\"]\nmax_attempts = 1\nallow = [\"^{ns}-\"]";

/// The mix parked by [`park_mix`].
const TO_A: usize = 80;
const TO_B: usize = 60;
const INVALID: usize = 30;
const NO_DESTINATION: usize = 30;
const TOTAL: usize = TO_A + TO_B + INVALID + NO_DESTINATION;

/// A fresh index of what `filter` can match, as the CLI builds one per command.
async fn fresh(lot: &parking::ParkingLot<'_>, filter: &Filter) -> SharedIndex {
    tokio::time::timeout(WAIT, lot.index_for(filter))
        .await
        .expect("indexing timed out")
        .unwrap()
}

fn page(limit: usize) -> PageRequest {
    PageRequest { offset: 0, limit }
}

fn props(i: usize, headers: Vec<(&str, AMQPValue)>) -> BasicProperties {
    let mut table = FieldTable::default();
    table.insert("tenant".into(), text(&format!("t{}", i % 4)));
    table.insert("seq".into(), AMQPValue::LongInt(i as i32));
    for (k, v) in headers {
        table.insert(k.into(), v);
    }
    BasicProperties::default()
        .with_message_id(format!("m-{i}").into())
        .with_correlation_id(format!("c-{}", i % 10).into())
        .with_content_type("application/json".into())
        .with_app_id("shop".into())
        .with_priority(3)
        .with_headers(table)
}

fn body(i: usize) -> Vec<u8> {
    if i % 50 == 49 {
        vec![0xff, 0xfe, i as u8] // binary: never matches a body search
    } else {
        format!("{{\"i\": {i}, \"kind\": \"order\"}}").into_bytes()
    }
}

/// Parks [`TOTAL`] messages through the service: max-attempts to `a` and `b`, invalid-header
/// (`retry-delay: soon`) to `a`, and no-destination; returns the envelopes, in stream order.
async fn park_mix(t: &TestLadder, a: &str, b: &str) -> Vec<Envelope> {
    for i in 0..TOTAL {
        let extra = if i < TO_A {
            vec![("retry-to", text(a)), ("retry-attempt", AMQPValue::LongLongInt(1))]
        } else if i < TO_A + TO_B {
            vec![
                ("retry-to", text(b)),
                ("retry-attempt", AMQPValue::LongLongInt(1)),
                ("retry-first-failed-at", AMQPValue::LongLongInt(1_700_000_000_000)),
            ]
        } else if i < TO_A + TO_B + INVALID {
            vec![("retry-to", text(a)), ("retry-delay", text("soon"))]
        } else {
            vec![]
        };
        t.publish(&t.intake(), "", &body(i), props(i, extra)).await;
    }
    t.parked(TOTAL).await
}

fn count(envelopes: &[Envelope], f: impl Fn(&Envelope) -> bool) -> u64 {
    envelopes.iter().filter(|e| f(e)).count() as u64
}

async fn total(t: &TestLadder, filter: Filter) -> u64 {
    let lot = t.lot();
    lot.list(&fresh(&lot, &filter).await, &filter, page(0), false)
        .await
        .unwrap()
        .total
}

/// What a replayed message must carry: the original headers without the per-pass ladder headers,
/// plus `retry-replayed-from`.
fn expected_headers(stream: &str, entry: &ParkedEntry) -> BTreeMap<ShortString, AMQPValue> {
    let mut h = parking::original_headers(&entry.envelope).unwrap().inner().clone();
    for gone in [
        "retry-attempt",
        "retry-due-at",
        "retry-tier",
        "retry-delay",
        "retry-ladder",
    ] {
        h.remove(gone);
    }
    h.insert(
        "retry-replayed-from".into(),
        text(&format!("{stream}@{}", entry.offset)),
    );
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parking_lot_lists_searches_replays_at_a_rate_and_discards() {
    let mut t = TestLadder::start("park", ONE_TIER).await;
    let a = t.declare_queue("a", FieldTable::default()).await;
    let b = t.declare_queue("b", FieldTable::default()).await;
    let missing = t.queue_name("missing"); // allowed, never declared
    let parked = park_mix(&t, &a, &b).await;
    let stream = t.parked_stream();
    let lot = t.lot();

    // list: newest first, paged, counted
    let first = lot
        .list(
            &fresh(&lot, &Filter::default()).await,
            &Filter::default(),
            page(10),
            false,
        )
        .await
        .unwrap();
    assert_eq!(first.total, TOTAL as u64);
    assert_eq!(first.entries.len(), 10);
    assert!(
        first.entries.windows(2).all(|w| w[0].offset > w[1].offset),
        "newest first"
    );
    assert_eq!(
        first.entries[0].envelope,
        parked[TOTAL - 1],
        "the newest entry comes first"
    );
    let second = lot
        .list(
            &fresh(&lot, &Filter::default()).await,
            &Filter::default(),
            PageRequest { offset: 10, limit: 10 },
            false,
        )
        .await
        .unwrap();
    assert!(
        second.entries[0].offset < first.entries[9].offset,
        "page 2 follows page 1"
    );
    assert_eq!(second.entries[9].envelope, parked[TOTAL - 20]);

    // count by each filter kind
    let f = Filter::default;
    assert_eq!(
        total(
            &t,
            Filter {
                destination: Some(a.clone()),
                ..f()
            }
        )
        .await,
        (TO_A + INVALID) as u64
    );
    assert_eq!(
        total(
            &t,
            Filter {
                destination: Some(b.clone()),
                ..f()
            }
        )
        .await,
        TO_B as u64
    );
    assert_eq!(
        total(
            &t,
            Filter {
                reason: Some("max-attempts".into()),
                ..f()
            }
        )
        .await,
        (TO_A + TO_B) as u64
    );
    assert_eq!(
        total(
            &t,
            Filter {
                reason: Some("invalid-header".into()),
                ..f()
            }
        )
        .await,
        INVALID as u64
    );
    assert_eq!(
        total(
            &t,
            Filter {
                reason: Some("no-destination".into()),
                ..f()
            }
        )
        .await,
        NO_DESTINATION as u64
    );
    assert_eq!(
        total(
            &t,
            Filter {
                ladder: Some("default".into()),
                ..f()
            }
        )
        .await,
        TOTAL as u64
    );
    assert_eq!(
        total(
            &t,
            Filter {
                message_id: Some("m-7".into()),
                ..f()
            }
        )
        .await,
        1
    );
    assert_eq!(
        total(
            &t,
            Filter {
                correlation_id: Some("c-3".into()),
                ..f()
            }
        )
        .await,
        (TOTAL / 10) as u64
    );
    let tenant_t1 = Filter {
        headers: vec![("tenant".into(), "t1".into())],
        ..f()
    };
    assert_eq!(total(&t, tenant_t1).await, (TOTAL / 4) as u64);
    let seq_and_tenant = Filter {
        headers: vec![("tenant".into(), "t1".into()), ("seq".into(), "5".into())],
        ..f()
    };
    assert_eq!(total(&t, seq_and_tenant).await, 1);
    assert_eq!(
        total(
            &t,
            Filter {
                body_contains: Some("\"i\": 17,".into()),
                ..f()
            }
        )
        .await,
        1
    );
    let binary = count(&parked, |e| e.message.body().unwrap()[0] == 0xff);
    assert_eq!(binary, 4);
    assert_eq!(
        total(
            &t,
            Filter {
                body_contains: Some("order".into()),
                ..f()
            }
        )
        .await,
        TOTAL as u64 - binary,
        "binary bodies never match a body search"
    );
    let middle = parked[TOTAL / 2].parked_at_ms;
    let since = Filter {
        since_ms: Some(middle),
        ..f()
    };
    assert_eq!(total(&t, since).await, count(&parked, |e| e.parked_at_ms >= middle));
    let future = Filter {
        since_ms: Some(now_ms() + 3_600_000),
        ..f()
    };
    assert_eq!(total(&t, future).await, 0, "nothing parked after the last chunk");
    let until = Filter {
        until_ms: Some(middle),
        ..f()
    };
    assert_eq!(total(&t, until).await, count(&parked, |e| e.parked_at_ms <= middle));
    let combined = Filter {
        destination: Some(a.clone()),
        reason: Some("invalid-header".into()),
        headers: vec![("tenant".into(), "t0".into())],
        ..f()
    };
    let expected = count(&parked, |e| {
        e.reason == "invalid-header" && parking::original_headers(e).unwrap().inner().get("tenant") == Some(&text("t0"))
    });
    assert_eq!(total(&t, combined).await, expected);

    // show one
    let one = lot
        .show(&fresh(&lot, &Filter::default()).await, first.entries[3].offset)
        .await
        .unwrap();
    assert_eq!(one, first.entries[3]);
    let shown = parking::render_entry(&stream, &one);
    assert!(shown.contains(&format!("{stream}@{}", one.offset)), "{shown}");
    assert!(matches!(
        lot.show(&fresh(&lot, &Filter::default()).await, 1_000_000).await,
        Err(parking::ParkingError::NotFound(1_000_000))
    ));

    // replay everything headed for b at 50/s: every message arrives as it was, at the rate
    let rate: parking::Rate = "50/s".parse().unwrap();
    let to_b = Filter {
        destination: Some(b.clone()),
        ..f()
    };
    let selection = lot.select(&fresh(&lot, &to_b).await, &to_b).await.unwrap();
    assert_eq!((selection.entries.len(), selection.left_over), (TO_B, 0));
    let options = ReplayOptions {
        to: None,
        rate: Some(rate),
        dry_run: false,
        by: "test".into(),
    };
    let mut consumer = t.consume(&b).await;
    let receive = tokio::spawn(async move {
        let mut got = Vec::new();
        while got.len() < TO_B {
            let d = next(&mut consumer).await;
            got.push((Instant::now(), d.properties.clone(), d.data.clone()));
            d.acker.ack(Default::default()).await.unwrap();
        }
        (got, consumer)
    });
    let outcomes = lot
        .replay(&SharedIndex::default(), &selection.entries, &options)
        .await
        .unwrap();
    assert!(outcomes.iter().all(|o| o.status == Status::Replayed), "{outcomes:?}");
    let (got, mut consumer) = tokio::time::timeout(WAIT, receive).await.unwrap().unwrap();
    let by_id: BTreeMap<String, &ParkedEntry> = selection
        .entries
        .iter()
        .map(|e| {
            (
                e.envelope.message.properties["message_id"]
                    .as_str()
                    .unwrap()
                    .to_string(),
                e,
            )
        })
        .collect();
    for (_, properties, data) in &got {
        let id = properties.message_id().as_ref().unwrap().to_string();
        let entry = by_id[&id];
        let original = entry.envelope.message.properties().unwrap();
        assert_eq!(data, &entry.envelope.message.body().unwrap(), "{id}: body");
        assert_eq!(properties.correlation_id(), original.correlation_id(), "{id}");
        assert_eq!(properties.content_type(), original.content_type(), "{id}");
        assert_eq!(properties.app_id(), original.app_id(), "{id}");
        assert_eq!(properties.priority(), original.priority(), "{id}");
        assert_eq!(properties.delivery_mode(), &Some(2), "{id}: persistent");
        let headers = properties.headers().as_ref().unwrap().inner();
        assert_eq!(headers, &expected_headers(&stream, entry), "{id}: headers");
        assert_eq!(
            headers.get("retry-first-failed-at"),
            Some(&AMQPValue::LongLongInt(1_700_000_000_000))
        );
    }
    let ids: BTreeSet<&String> = by_id.keys().collect();
    assert_eq!(ids.len(), got.len(), "each entry arrived once");
    // measured, not assumed: no window of `count` consecutive arrivals is shorter than the period
    let arrivals: Vec<Instant> = got.iter().map(|(at, _, _)| *at).collect();
    let n = rate.count as usize;
    let tolerance = Duration::from_millis(60);
    for w in arrivals.windows(n + 1) {
        let span = w[n] - w[0];
        assert!(span + tolerance >= rate.per, "{} arrivals within {span:?}", n + 1);
    }
    let elapsed = (arrivals[TO_B - 1] - arrivals[0]).as_secs_f64();
    let observed = (TO_B - 1) as f64 / elapsed;
    assert!(observed <= 50.0 * 1.05, "observed {observed:.1}/s");
    eprintln!("replayed {TO_B} at {observed:.1}/s");

    // resolved: hidden from a listing, shown with --all, never sent twice
    assert_eq!(total(&t, to_b.clone()).await, 0);
    let all = lot
        .list(&fresh(&lot, &to_b).await, &to_b, page(100), true)
        .await
        .unwrap();
    assert_eq!(all.total, TO_B as u64);
    for entry in &all.entries {
        let r = entry.resolution.as_ref().expect("resolved");
        assert_eq!(
            (r.action, r.by.as_str(), r.to.as_deref()),
            (Action::Replayed, "test", Some(b.as_str()))
        );
        assert_eq!(r.resolves, entry.offset);
    }
    let again = lot.select(&fresh(&lot, &to_b).await, &to_b).await.unwrap();
    assert!(again.entries.is_empty());
    assert!(
        lot.replay(&SharedIndex::default(), &again.entries, &options)
            .await
            .unwrap()
            .is_empty()
    );
    let by_offset = Filter {
        offsets: Some(selection.entries.iter().map(|e| e.offset).collect()),
        ..f()
    };
    assert!(
        lot.select(&fresh(&lot, &by_offset).await, &by_offset)
            .await
            .unwrap()
            .entries
            .is_empty()
    );
    assert!(
        next_within(&mut consumer, Duration::from_millis(500)).await.is_none(),
        "a resolved entry was resent"
    );
    assert_eq!(total(&t, Filter::default()).await, (TOTAL - TO_B) as u64);

    // refused targets leave the entry unresolved
    let m0 = Filter {
        message_id: Some("m-0".into()),
        ..f()
    };
    let victim = lot.select(&fresh(&lot, &m0).await, &m0).await.unwrap().entries;
    assert_eq!(victim.len(), 1);
    for (to, error) in [
        (missing.as_str(), "no queue"),
        ("payments", "allow-list"),
        (stream.as_str(), "namespace"),
    ] {
        let options = ReplayOptions {
            to: Some(to.to_string()),
            ..options.clone()
        };
        let outcomes = lot.replay(&SharedIndex::default(), &victim, &options).await.unwrap();
        match &outcomes[0].status {
            Status::Failed { error: e } => assert!(e.contains(error), "{to}: {e}"),
            other => panic!("{to}: {other:?}"),
        }
    }
    assert_eq!(
        total(
            &t,
            Filter {
                message_id: Some("m-0".into()),
                ..f()
            }
        )
        .await,
        1
    );

    // dry run: says what, sends nothing, resolves nothing
    let to_a_max = Filter {
        destination: Some(a.clone()),
        reason: Some("max-attempts".into()),
        ..f()
    };
    let dry = lot.select(&fresh(&lot, &to_a_max).await, &to_a_max).await.unwrap();
    let dry_options = ReplayOptions {
        dry_run: true,
        ..options.clone()
    };
    let outcomes = lot
        .replay(&SharedIndex::default(), &dry.entries, &dry_options)
        .await
        .unwrap();
    assert_eq!(outcomes.len(), TO_A);
    assert!(
        outcomes
            .iter()
            .all(|o| o.status == Status::WouldReplay && o.to.as_deref() == Some(a.as_str()))
    );
    assert_eq!(queue_depth(&t.client, &a).await, 0);
    assert_eq!(total(&t, to_a_max.clone()).await, TO_A as u64);

    // one replay or discard at a time per ladder, across connections; released on demand or
    // when the holder's connection dies
    let lock = lot.lock().await.unwrap();
    let other = connect().await;
    let spec = &t.config.ladders[0];
    let elsewhere = parking::ParkingLot::new(&other, &t.ns, spec);
    assert!(matches!(elsewhere.lock().await, Err(parking::ParkingError::Busy(_))));
    lock.release().await;
    let held = elsewhere.lock().await.unwrap();
    assert!(matches!(lot.lock().await, Err(parking::ParkingError::Busy(_))));
    drop(held);
    let _ = other.close(200, "gone".into()).await;
    // the broker deletes a dead connection's exclusive queue shortly after the close
    let deadline = Instant::now() + WAIT;
    loop {
        match lot.lock().await {
            Ok(lock) => break lock.release().await,
            Err(parking::ParkingError::Busy(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("a dead holder's lock is free: {e}"),
        }
    }

    // discard hides them; --all shows them discarded
    let no_destination = Filter {
        reason: Some("no-destination".into()),
        ..f()
    };
    let doomed = lot
        .select(&fresh(&lot, &no_destination).await, &no_destination)
        .await
        .unwrap();
    let outcomes = lot
        .discard(&SharedIndex::default(), &doomed.entries, "test")
        .await
        .unwrap();
    assert!(outcomes.iter().all(|o| o.status == Status::Discarded));
    assert_eq!(total(&t, no_destination.clone()).await, 0);
    let discarded = lot
        .list(&fresh(&lot, &no_destination).await, &no_destination, page(5), true)
        .await
        .unwrap();
    assert_eq!(discarded.total, NO_DESTINATION as u64);
    assert!(
        discarded
            .entries
            .iter()
            .all(|e| e.resolution.as_ref().map(|r| r.action) == Some(Action::Discarded))
    );
    assert_eq!(
        total(&t, Filter::default()).await,
        (TOTAL - TO_B - NO_DESTINATION) as u64
    );

    t.stop_service().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_message_that_fails_again_climbs_the_ladder_and_is_parked_with_its_lineage() {
    let mut t = TestLadder::start("park-again", ONE_TIER).await;
    let a = t.declare_queue("a", FieldTable::default()).await;
    let headers = vec![
        ("retry-to", text(&a)),
        ("retry-attempt", AMQPValue::LongLongInt(1)),
        ("retry-first-failed-at", AMQPValue::LongLongInt(1_700_000_000_000)),
    ];
    t.publish(&t.intake(), "", &body(1), props(1, headers)).await;
    t.parked(1).await;
    let stream = t.parked_stream();
    let lot = t.lot();
    let entries = lot
        .select(&fresh(&lot, &Filter::default()).await, &Filter::default())
        .await
        .unwrap()
        .entries;
    let origin = format!("{stream}@{}", entries[0].offset);
    let options = ReplayOptions {
        to: None,
        rate: None,
        dry_run: false,
        by: "test".into(),
    };
    assert_eq!(
        lot.replay(&SharedIndex::default(), &entries, &options).await.unwrap()[0].status,
        Status::Replayed
    );

    // the consumer fails twice: the first failure is retry 1 (fresh count), the second parks it
    let mut consumer = t.consume(&a).await;
    for attempt in [None, Some(1)] {
        let d = next(&mut consumer).await;
        assert_eq!(int_header(&d, "retry-attempt"), attempt);
        assert_eq!(headers_of(&d).get("retry-replayed-from"), Some(&text(&origin)));
        t.publish(&t.intake(), "", &d.data, republish_props(&d, &[])).await;
        d.acker.ack(Default::default()).await.unwrap();
    }
    let deadline = Instant::now() + WAIT;
    let again = loop {
        let page = lot
            .list(
                &fresh(&lot, &Filter::default()).await,
                &Filter::default(),
                page(10),
                false,
            )
            .await
            .unwrap();
        if let Some(entry) = page.entries.into_iter().next() {
            break entry;
        }
        assert!(Instant::now() < deadline, "not parked again");
    };
    assert!(again.offset > entries[0].offset);
    assert_eq!(again.envelope.reason, "max-attempts");
    assert_eq!(again.envelope.attempts, Some(1));
    assert_eq!(
        again.envelope.first_failed_at_ms,
        Some(1_700_000_000_000),
        "lineage: first failure kept"
    );
    let h = parking::original_headers(&again.envelope).unwrap();
    assert_eq!(
        h.inner().get("retry-replayed-from"),
        Some(&text(&origin)),
        "lineage: replayed from"
    );
    // the first entry stays resolved; the second is the only open one
    let open = lot
        .list(
            &fresh(&lot, &Filter::default()).await,
            &Filter::default(),
            page(10),
            true,
        )
        .await
        .unwrap();
    assert_eq!(open.total, 2);
    assert!(open.entries[1].resolution.is_some() && open.entries[0].resolution.is_none());
    t.stop_service().await;
}

async fn cli(config: &std::path::Path, args: &[&str]) -> std::process::Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_ladder"));
    command
        .arg("--config")
        .arg(config)
        .args(args)
        .env("RUST_LOG", "warn")
        .env("USER", "cli-test")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    tokio::time::timeout(WAIT, command.output())
        .await
        .expect("the command finishes in time")
        .expect("the binary runs")
}

fn json_of(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_lists_as_json_and_dry_runs_a_replay() {
    let mut t = TestLadder::start("park-cli", ONE_TIER).await;
    let a = t.declare_queue("a", FieldTable::default()).await;
    for i in 0..12 {
        let headers = vec![("retry-to", text(&a)), ("retry-attempt", AMQPValue::LongLongInt(1))];
        t.publish(&t.intake(), "", &body(i), props(i, headers)).await;
    }
    t.parked(12).await;
    let config = t.config_path();

    let list = json_of(
        &cli(
            &config,
            &["parked", "list", "--json", "--limit", "5", "--header", "tenant=t1"],
        )
        .await,
    );
    assert_eq!(list["total"], 3);
    let entries = list["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 3);
    assert_eq!(entries[0]["envelope"]["message"]["properties"]["message_id"], "m-9");
    assert_eq!(entries[0]["envelope"]["destination"], a.as_str());

    let table = cli(&config, &["parked", "list", "--destination", &a]).await;
    let text_out = String::from_utf8_lossy(&table.stdout);
    assert!(
        text_out.starts_with("OFFSET") && text_out.contains("12 of 12 unresolved entries"),
        "{text_out}"
    );

    let counts = json_of(&cli(&config, &["parked", "counts", "--json"]).await);
    assert_eq!(counts["total"], 12);
    assert_eq!(counts["by_reason"], serde_json::json!([["max-attempts", 12]]));
    assert_eq!(counts["by_destination"], serde_json::json!([[a.as_str(), 12]]));
    // a header condition is checked on the records
    let t1 = json_of(&cli(&config, &["parked", "counts", "--json", "--header", "tenant=t1"]).await);
    assert_eq!(t1["total"], 3);
    assert_eq!(t1["by_reason"], serde_json::json!([["max-attempts", 3]]));
    let table = cli(&config, &["parked", "counts"]).await;
    let text_out = String::from_utf8_lossy(&table.stdout);
    assert!(
        text_out.starts_with("REASON")
            && text_out.contains("max-attempts")
            && text_out.contains("12 unresolved entries"),
        "{text_out}"
    );

    let offset = entries[0]["offset"].as_u64().unwrap().to_string();
    let shown = cli(&config, &["parked", "show", &offset]).await;
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains("body (") && shown.contains("\"kind\": \"order\""),
        "{shown}"
    );

    let dry = json_of(
        &cli(
            &config,
            &[
                "parked",
                "replay",
                "--dry-run",
                "--json",
                "--rate",
                "50/s",
                "--reason",
                "max-attempts",
            ],
        )
        .await,
    );
    let outcomes = dry["outcomes"].as_array().unwrap();
    assert_eq!(outcomes.len(), 12);
    assert!(
        outcomes
            .iter()
            .all(|o| o["status"] == "would-replay" && o["to"] == a.as_str()),
        "{dry}"
    );
    assert_eq!(queue_depth(&t.client, &a).await, 0, "a dry run sends nothing");

    // without a terminal, discard needs --yes
    let refused = cli(&config, &["parked", "discard", &offset]).await;
    assert_eq!(
        refused.status.code(),
        Some(64),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let discarded = json_of(&cli(&config, &["parked", "discard", "--yes", "--json", &offset]).await);
    assert_eq!(discarded["outcomes"][0]["status"], "discarded");
    let list = json_of(&cli(&config, &["parked", "list", "--json"]).await);
    assert_eq!(list["total"], 11);
    let all = json_of(&cli(&config, &["parked", "list", "--json", "--all"]).await);
    assert_eq!(all["total"], 12);
    let shown = json_of(&cli(&config, &["parked", "show", "--json", &offset]).await);
    assert_eq!(shown["resolution"]["action"], "discarded");
    assert_eq!(shown["resolution"]["by"], "cli-test", "who asked is recorded");
    t.stop_service().await;
}

/// Message ids that arrive on `queue` (acked) until it has been quiet for `quiet`.
async fn arrived_ids(consumer: &mut lapin::Consumer, quiet: Duration) -> Vec<String> {
    let mut ids = vec![];
    let deadline = Instant::now() + WAIT;
    while let Some(d) = next_within(consumer, quiet).await {
        ids.push(d.properties.message_id().as_ref().unwrap().to_string());
        d.ack(lapin::options::BasicAckOptions::default()).await.unwrap();
        assert!(Instant::now() < deadline, "the queue never went quiet");
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_killed_midway_loses_nothing_and_the_next_run_finishes_it() {
    const N: usize = 40;
    let mut t = TestLadder::start("park-kill", ONE_TIER).await;
    let a = t.declare_queue("a", FieldTable::default()).await;
    for i in 0..N {
        let headers = vec![("retry-to", text(&a)), ("retry-attempt", AMQPValue::LongLongInt(1))];
        t.publish(&t.intake(), "", &body(i), props(i, headers)).await;
    }
    t.parked(N).await;
    let config = t.config_path();
    let mut consumer = t.consume(&a).await;

    // SIGKILL a paced replay partway through
    let mut replay = tokio::process::Command::new(env!("CARGO_BIN_EXE_ladder"))
        .arg("--config")
        .arg(&config)
        .args([
            "parked",
            "replay",
            "--destination",
            &a,
            "--rate",
            "20/s",
            "--by",
            "doomed",
        ])
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let started = Instant::now();
    let first = arrived_until(&mut consumer, N / 2).await;
    replay.start_kill().unwrap();
    let status = tokio::time::timeout(WAIT, replay.wait()).await.unwrap().unwrap();
    assert!(!status.success(), "killed after {:?}", started.elapsed());
    let mut arrived = first;
    arrived.extend(arrived_ids(&mut consumer, Duration::from_millis(500)).await);
    let lot = t.lot();
    let resolved = lot
        .list(
            &fresh(&lot, &Filter::default()).await,
            &Filter::default(),
            page(N),
            true,
        )
        .await
        .unwrap();
    let resolved_ids: Vec<String> = resolved
        .entries
        .iter()
        .filter(|e| e.resolution.is_some())
        .map(|e| {
            e.envelope.message.properties["message_id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    eprintln!(
        "killed after {} arrivals ({} resolved)",
        arrived.len(),
        resolved_ids.len()
    );
    assert!(arrived.len() < N, "the kill came before the end");
    assert!(
        resolved_ids.iter().all(|id| arrived.contains(id)),
        "an entry is resolved only after its message was confirmed (and so arrived)"
    );
    assert!(
        arrived.len() - resolved_ids.len() <= 1,
        "at most the one in flight was sent without its resolution"
    );

    // the next run replays what is unresolved: every message arrived, at most one twice
    let out = cli(&config, &["parked", "replay", "--destination", &a, "--by", "again"]).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    arrived.extend(arrived_ids(&mut consumer, Duration::from_millis(500)).await);
    let unique: BTreeSet<&String> = arrived.iter().collect();
    assert_eq!(unique.len(), N, "nothing lost");
    assert!(
        arrived.len() <= N + 1,
        "{} deliveries: duplicates only from the kill",
        arrived.len()
    );
    assert_eq!(total(&t, Filter::default()).await, 0);
    t.stop_service().await;
}

/// Waits (bounded) until `count` messages arrived; returns their ids (acked).
async fn arrived_until(consumer: &mut lapin::Consumer, count: usize) -> Vec<String> {
    let mut ids = vec![];
    while ids.len() < count {
        let d = next(consumer).await;
        ids.push(d.properties.message_id().as_ref().unwrap().to_string());
        d.ack(lapin::options::BasicAckOptions::default()).await.unwrap();
    }
    ids
}

/// Parks `n` records straight into the lot's stream, in the service's record format (reason
/// `max-attempts`, header `tenant` = `tenant(i)`, message id `m-<i>`), confirming in batches:
/// thousands in about a second, which parking through the service would not allow.
async fn park_records(t: &TestLadder, n: usize, destination: &str, tenant: impl Fn(usize) -> &'static str) {
    use lapin::Confirmation;
    use lapin::options::BasicPublishOptions;

    let stream = t.parked_stream();
    let indices: Vec<usize> = (0..n).collect();
    for batch in indices.chunks(500) {
        let mut confirms = Vec::with_capacity(batch.len());
        for &i in batch {
            let mut headers = FieldTable::default();
            headers.insert("tenant".into(), text(tenant(i)));
            let original = BasicProperties::default()
                .with_message_id(format!("m-{i}").into())
                .with_headers(headers);
            let envelope = Envelope {
                format: ladder::envelope::FORMAT.into(),
                reason: "max-attempts".into(),
                detail: String::new(),
                ladder: t.ladder.clone(),
                destination: Some(destination.to_string()),
                attempts: Some(1),
                first_failed_at_ms: None,
                history: vec![],
                replayed_from: None,
                parked_at_ms: now_ms(),
                hop: "due".into(),
                message: ladder::envelope::OriginalMessage::capture("", destination, &original, b"{}"),
            };
            let record = BasicProperties::default()
                .with_delivery_mode(2)
                .with_type(ladder::envelope::FORMAT.into());
            let body = serde_json::to_vec(&envelope).unwrap();
            let options = BasicPublishOptions {
                mandatory: true,
                immediate: false,
            };
            let publish = t
                .channel
                .basic_publish("".into(), stream.as_str().into(), options, &body, record);
            confirms.push(tokio::time::timeout(WAIT, publish).await.unwrap().unwrap());
        }
        for confirm in confirms {
            let confirmation = tokio::time::timeout(WAIT, confirm).await.unwrap().unwrap();
            assert_eq!(confirmation, Confirmation::Ack(None));
        }
    }
}

/// A header search whose matches lie thousands of records apart reads them in separate runs
/// (`parking::FETCH_RUN_GAP`), after the index's header digest has ruled out the rest: the
/// path a narrow search of a large lot takes, which a lot of a few hundred never reaches.
#[tokio::test(flavor = "multi_thread")]
async fn a_narrow_header_search_reads_matches_far_apart_and_misses_none() {
    const N: usize = 7000;
    const RARE: [usize; 3] = [5, 3500, 6990];
    let mut t = TestLadder::start("park-sparse", ONE_TIER).await;
    let a = t.queue_name("a");
    park_records(&t, N, &a, |i| if RARE.contains(&i) { "rare" } else { "common" }).await;
    let lot = t.lot();
    assert!(
        RARE.windows(2).all(|w| (w[1] - w[0]) as u64 > parking::FETCH_RUN_GAP),
        "the matches must lie further apart than one run"
    );

    let rare = Filter {
        headers: vec![("tenant".into(), "rare".into())],
        ..Filter::default()
    };
    let index = fresh(&lot, &rare).await;
    assert_eq!(index.read().len(), N);
    let candidates = index.read().candidates(&rare, false);
    assert!(
        candidates.len() < N / 10,
        "the digest leaves {} of {N} to read",
        candidates.len()
    );
    let found = lot.list(&index, &rare, page(10), false).await.unwrap();
    assert_eq!(found.total, RARE.len() as u64);
    let ids: Vec<&str> = found
        .entries
        .iter()
        .map(|e| e.envelope.message.properties["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["m-6990", "m-3500", "m-5"], "newest first");
    let counts = lot.counts(&index, &rare, false).await.unwrap();
    assert_eq!(counts.total, RARE.len() as u64);
    assert_eq!(counts.by_destination, vec![(a.clone(), RARE.len() as u64)]);

    // a value nearly every entry holds: the digest lets (almost) all through, one long run reads
    // them, and the exact check keeps the rest
    let common = Filter {
        headers: vec![("tenant".into(), "common".into())],
        ..Filter::default()
    };
    assert_eq!(
        lot.counts(&index, &common, false).await.unwrap().total,
        (N - RARE.len()) as u64
    );
}
