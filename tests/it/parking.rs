//! The parking lot against the real broker: 200 messages parked through the running service
//! (bad input and exhausted ladders, to two destinations and none), then listed and counted by
//! every filter, shown, replayed at a measured rate with their original body, properties and
//! headers, resolved (a second listing and a second replay skip them), discarded, refused when
//! the target is not allowed or does not exist, and parked again with their lineage after a
//! replayed message fails again. Also the `ladder parked` CLI (`list --json`, `counts`,
//! `replay --dry-run`), and a narrow header search over thousands of records.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::common::parking::{B_FIRST_FAILED_AT, Mix, ONE_TIER, body, ids, park_mix, park_to, props};
use crate::common::*;
use ladder::broker::lot::{self as parking, PageRequest, ReplayOptions, Status};
use ladder::model::envelope::Envelope;
use ladder::model::lot::filter::{Entries, Filter};
use ladder::model::lot::index::SharedIndex;
use ladder::model::lot::record::{Action, ParkedEntry};
use ladder_amqp::{BasicProperties, Confirmation, FieldTable, FieldValue};

/// What the first test parks.
const MIX: Mix = Mix {
    to_a: 80,
    to_b: 60,
    invalid: 30,
    no_destination: 30,
};
const TOTAL: usize = MIX.total();

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

fn count(envelopes: &[Envelope], f: impl Fn(&Envelope) -> bool) -> u64 {
    envelopes.iter().filter(|e| f(e)).count() as u64
}

async fn total(t: &TestLadder, filter: Filter) -> u64 {
    let lot = t.lot();
    lot.list(&fresh(&lot, &filter).await, &filter, page(0))
        .await
        .unwrap()
        .total
}

/// What a replayed message must carry: the original headers without the per-pass ladder headers,
/// plus `retry-replayed-from`.
fn expected_headers(stream: &str, entry: &ParkedEntry) -> FieldTable {
    let mut h = ladder::model::lot::record::original_headers(&entry.envelope).unwrap();
    for gone in [
        "retry-attempt",
        "retry-due-at",
        "retry-tier",
        "retry-delay",
        "retry-ladder",
    ] {
        h.remove(gone);
    }
    h.set("retry-replayed-from", text(&format!("{stream}@{}", entry.offset)));
    h
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parking_lot_lists_searches_replays_at_a_rate_and_discards() {
    let mut t = TestLadder::start("park", ONE_TIER).await;
    let a = t.declare_queue("a", FieldTable::default()).await;
    let b = t.declare_queue("b", FieldTable::default()).await;
    let missing = t.queue_name("missing"); // allowed, never declared
    let parked = park_mix(&t, MIX, &a, &b).await;
    let stream = t.parked_stream();
    let lot = t.lot();

    // list: newest first, paged, counted
    let first = lot
        .list(&fresh(&lot, &Filter::default()).await, &Filter::default(), page(10))
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
    let by_kind = [
        (
            Filter {
                destination: Some(a.clone()),
                ..f()
            },
            MIX.to_a + MIX.invalid,
        ),
        (
            Filter {
                destination: Some(b.clone()),
                ..f()
            },
            MIX.to_b,
        ),
        (
            Filter {
                reason: Some("max-attempts".into()),
                ..f()
            },
            MIX.to_a + MIX.to_b,
        ),
        (
            Filter {
                reason: Some("invalid-header".into()),
                ..f()
            },
            MIX.invalid,
        ),
        (
            Filter {
                reason: Some("no-destination".into()),
                ..f()
            },
            MIX.no_destination,
        ),
        (
            Filter {
                ladder: Some("default".into()),
                ..f()
            },
            TOTAL,
        ),
        (
            Filter {
                message_id: Some("m-7".into()),
                ..f()
            },
            1,
        ),
        (
            Filter {
                correlation_id: Some("c-3".into()),
                ..f()
            },
            TOTAL / 10,
        ),
        (
            Filter {
                headers: vec![("tenant".into(), "t1".into())],
                ..f()
            },
            TOTAL / 4,
        ),
        (
            Filter {
                headers: vec![("tenant".into(), "t1".into()), ("seq".into(), "5".into())],
                ..f()
            },
            1,
        ),
        (
            Filter {
                body_contains: Some("\"i\": 17,".into()),
                ..f()
            },
            1,
        ),
    ];
    for (filter, expected) in by_kind {
        assert_eq!(total(&t, filter.clone()).await, expected as u64, "{filter:?}");
    }
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
        e.reason == "invalid-header"
            && ladder::model::lot::record::original_headers(e).unwrap().get("tenant") == Some(&text("t0"))
    });
    assert_eq!(total(&t, combined).await, expected);

    // show one
    let one = lot
        .show(&fresh(&lot, &Filter::default()).await, first.entries[3].offset)
        .await
        .unwrap();
    assert_eq!(one, first.entries[3]);
    let shown = ladder::model::lot::text::render_entry(&stream, &one);
    assert!(shown.contains(&format!("{stream}@{}", one.offset)), "{shown}");
    assert!(matches!(
        lot.show(&fresh(&lot, &Filter::default()).await, 1_000_000).await,
        Err(parking::ParkingError::NotFound(1_000_000))
    ));

    // replay everything headed for b at 50/s: every message arrives as it was, at the rate
    let rate: ladder::model::lot::pace::Rate = "50/s".parse().unwrap();
    let to_b = Filter {
        destination: Some(b.clone()),
        ..f()
    };
    let selection = lot.select(&fresh(&lot, &to_b).await, &to_b).await.unwrap();
    assert_eq!((selection.entries.len(), selection.left_over), (MIX.to_b, 0));
    let options = ReplayOptions {
        to: None,
        rate: Some(rate),
        dry_run: false,
        by: "test".into(),
        edit: None,
    };
    let mut consumer = t.consume(&b).await;
    let receive = tokio::spawn(async move { (receive_timed(&mut consumer, MIX.to_b).await, consumer) });
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
    for (_, d) in &got {
        let (properties, data) = (&d.properties, &d.body);
        let id = properties.message_id.as_ref().unwrap().to_string();
        let entry = by_id[&id];
        let original = entry.envelope.message.properties().unwrap();
        assert_eq!(data, &entry.envelope.message.body().unwrap(), "{id}: body");
        assert_eq!(properties.correlation_id, original.correlation_id, "{id}");
        assert_eq!(properties.content_type, original.content_type, "{id}");
        assert_eq!(properties.app_id, original.app_id, "{id}");
        assert_eq!(properties.priority, original.priority, "{id}");
        assert_eq!(properties.delivery_mode, Some(2), "{id}: persistent");
        let headers = properties.headers.as_ref().unwrap();
        assert_eq!(headers, &expected_headers(&stream, entry), "{id}: headers");
        assert_eq!(
            headers.get("retry-first-failed-at"),
            Some(&FieldValue::LongLongInt(B_FIRST_FAILED_AT))
        );
    }
    let ids: BTreeSet<&String> = by_id.keys().collect();
    assert_eq!(ids.len(), got.len(), "each entry arrived once");
    // measured, not assumed: no window of `count` consecutive arrivals is shorter than the period
    let arrivals: Vec<Instant> = got.iter().map(|(at, _)| *at).collect();
    let n = rate.count as usize;
    let tolerance = Duration::from_millis(60);
    for w in arrivals.windows(n + 1) {
        let span = w[n] - w[0];
        assert!(span + tolerance >= rate.per, "{} arrivals within {span:?}", n + 1);
    }
    let elapsed = (arrivals[MIX.to_b - 1] - arrivals[0]).as_secs_f64();
    let observed = (MIX.to_b - 1) as f64 / elapsed;
    assert!(observed <= 50.0 * 1.05, "observed {observed:.1}/s");
    eprintln!("replayed {} at {observed:.1}/s", MIX.to_b);

    // resolved: hidden from a listing, shown with --all, never sent twice
    assert_eq!(total(&t, to_b.clone()).await, 0);
    let all = lot
        .list(
            &fresh(&lot, &to_b).await,
            &to_b.clone().with_entries(Entries::All),
            page(100),
        )
        .await
        .unwrap();
    assert_eq!(all.total, MIX.to_b as u64);
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
    t.assert_nothing_more("a resolved entry was resent", &mut consumer, &b, Via::Queue)
        .await;
    assert_eq!(total(&t, Filter::default()).await, (TOTAL - MIX.to_b) as u64);

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
    assert_eq!(outcomes.len(), MIX.to_a);
    assert!(
        outcomes
            .iter()
            .all(|o| o.status == Status::WouldReplay && o.to.as_deref() == Some(a.as_str()))
    );
    assert_eq!(queue_depth(&t.client, &a).await, 0);
    assert_eq!(total(&t, to_a_max.clone()).await, MIX.to_a as u64);

    // one replay or discard at a time per ladder, across connections; released on demand, or
    // when the holder drops its lock (a failed action, a client that went away)
    let lock = lot.lock().await.unwrap();
    let other = connect().await;
    let spec = &t.config.ladders[0];
    let elsewhere = parking::ParkingLot::new(&other, &t.config.amqp, &t.ns, spec);
    assert!(matches!(elsewhere.lock().await, Err(parking::ParkingError::Busy(_))));
    lock.release().await;
    let held = elsewhere.lock().await.unwrap();
    assert!(matches!(lot.lock().await, Err(parking::ParkingError::Busy(_))));
    drop(held);
    // the broker deletes the exclusive queue once it sees the dropped lock's connection go
    eventually_ok("a dropped lock is free", WAIT, async || match lot.lock().await {
        Ok(lock) => {
            lock.release().await;
            Ok(())
        }
        Err(busy @ parking::ParkingError::Busy(_)) => Err(busy),
        Err(e) => panic!("a dropped lock is free: {e}"),
    })
    .await;
    let _ = other.close(200, "gone").await;
    // an action without a filter would act on everything: refused before it takes the lock
    let refused = lot
        .act(
            &Filter::default(),
            "test",
            parking::ActIndex::Fresh,
            async |_, _| Ok(()),
        )
        .await;
    assert!(matches!(refused, Err(parking::ParkingError::Invalid(_))), "{refused:?}");

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
        .list(
            &fresh(&lot, &no_destination).await,
            &no_destination.clone().with_entries(Entries::All),
            page(5),
        )
        .await
        .unwrap();
    assert_eq!(discarded.total, MIX.no_destination as u64);
    assert!(
        discarded
            .entries
            .iter()
            .all(|e| e.resolution.as_ref().map(|r| r.action) == Some(Action::Discarded))
    );
    assert_eq!(
        total(&t, Filter::default()).await,
        (TOTAL - MIX.to_b - MIX.no_destination) as u64
    );

    t.stop_service().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_message_that_fails_again_climbs_the_ladder_and_is_parked_with_its_lineage() {
    let mut t = TestLadder::start("park-again", ONE_TIER).await;
    let a = t.declare_queue("a", FieldTable::default()).await;
    let headers = vec![
        ("retry-to", text(&a)),
        ("retry-attempt", FieldValue::LongLongInt(1)),
        ("retry-first-failed-at", FieldValue::LongLongInt(B_FIRST_FAILED_AT)),
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
        edit: None,
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
        t.publish(&t.intake(), "", &d.body, republish_props(&d, &[])).await;
        consumer.ack(&d);
    }
    let again = eventually("the replayed message is parked again", WAIT, async || {
        let page = lot
            .list(&fresh(&lot, &Filter::default()).await, &Filter::default(), page(10))
            .await
            .unwrap();
        page.entries.into_iter().next()
    })
    .await;
    assert!(again.offset > entries[0].offset);
    assert_eq!(again.envelope.reason, "max-attempts");
    assert_eq!(again.envelope.attempts, Some(1));
    assert_eq!(
        again.envelope.first_failed_at_ms,
        Some(B_FIRST_FAILED_AT as u64),
        "lineage: first failure kept"
    );
    let h = ladder::model::lot::record::original_headers(&again.envelope).unwrap();
    assert_eq!(
        h.get("retry-replayed-from"),
        Some(&text(&origin)),
        "lineage: replayed from"
    );
    // the first entry stays resolved; the second is the only open one
    let open = lot
        .list(
            &fresh(&lot, &Filter::default()).await,
            &Filter::default().with_entries(Entries::All),
            page(10),
        )
        .await
        .unwrap();
    assert_eq!(open.total, 2);
    assert!(open.entries[1].resolution.is_some() && open.entries[0].resolution.is_none());
    t.stop_service().await;
}

/// `ladder --config <config> <args…>`, as user `cli-test`.
async fn cli(config: &std::path::Path, args: &[&str]) -> std::process::Output {
    run_ladder(config, args, &[("RUST_LOG", "warn"), ("USER", "cli-test")]).await
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
    park_to(&t, &a, 12).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_killed_midway_loses_nothing_and_the_next_run_finishes_it() {
    const N: usize = 40;
    let mut t = TestLadder::start("park-kill", ONE_TIER).await;
    let a = t.declare_queue("a", FieldTable::default()).await;
    park_to(&t, &a, N).await;
    let config = t.config_path();
    let mut consumer = t.consume(&a).await;

    // SIGKILL a paced replay partway through
    let mut replay = tokio::process::Command::from(ladder_command(&config))
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
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let started = Instant::now();
    let mut arrived = ids(&receive(&mut consumer, N / 2).await);
    replay.start_kill().unwrap();
    let status = tokio::time::timeout(WAIT, replay.wait()).await.unwrap().unwrap();
    assert!(!status.success(), "killed after {:?}", started.elapsed());
    // and what else it sent: the broker routes what a connection sent before it noticed the
    // connection close, so a marker published after the process is gone queues behind it
    let markers = t.mark(&a, Via::Queue).await;
    arrived.extend(ids(&until_markers(&mut consumer, &markers).await));
    let lot = t.lot();
    let resolved = lot
        .list(
            &fresh(&lot, &Filter::default()).await,
            &Filter::default().with_entries(Entries::All),
            page(N),
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
    let markers = t.mark(&a, Via::Queue).await;
    arrived.extend(ids(&until_markers(&mut consumer, &markers).await));
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

/// Parks `n` records straight into the lot's stream, in the service's record format (reason
/// `max-attempts`, header `tenant` = `tenant(i)`, message id `m-<i>`), confirming in batches:
/// thousands in about a second, which parking through the service would not allow.
async fn park_records(t: &TestLadder, n: usize, destination: &str, tenant: impl Fn(usize) -> &'static str) {
    let stream = t.parked_stream();
    let indices: Vec<usize> = (0..n).collect();
    for batch in indices.chunks(500) {
        let mut confirms = Vec::with_capacity(batch.len());
        for &i in batch {
            let mut headers = FieldTable::default();
            headers.set("tenant", text(tenant(i)));
            let original = BasicProperties::default()
                .with_message_id(&format!("m-{i}"))
                .with_headers(headers);
            let envelope = Envelope {
                format: ladder::model::envelope::FORMAT.into(),
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
                message: ladder::model::envelope::OriginalMessage::capture("", destination, &original, b"{}"),
            };
            let record = BasicProperties::default()
                .with_delivery_mode(2)
                .with_type(ladder::model::envelope::FORMAT);
            let body = serde_json::to_vec(&envelope).unwrap();
            confirms.push(t.channel.basic_publish("", &stream, true, &record, &body).unwrap());
        }
        for confirm in confirms {
            let confirmation = tokio::time::timeout(WAIT, confirm).await.unwrap().unwrap();
            assert_eq!(confirmation, Confirmation::Ack);
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
    let candidates = index.read().candidates(&rare);
    assert!(
        candidates.len() < N / 10,
        "the digest leaves {} of {N} to read",
        candidates.len()
    );
    let found = lot.list(&index, &rare, page(10)).await.unwrap();
    assert_eq!(found.total, RARE.len() as u64);
    let ids: Vec<&str> = found
        .entries
        .iter()
        .map(|e| e.envelope.message.properties["message_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["m-6990", "m-3500", "m-5"], "newest first");
    let counts = lot.counts(&index, &rare).await.unwrap();
    assert_eq!(counts.total, RARE.len() as u64);
    assert_eq!(counts.by_destination, vec![(a.clone(), RARE.len() as u64)]);

    // a value nearly every entry holds: the digest lets (almost) all through, one long run reads
    // them, and the exact check keeps the rest
    let common = Filter {
        headers: vec![("tenant".into(), "common".into())],
        ..Filter::default()
    };
    assert_eq!(
        lot.counts(&index, &common).await.unwrap().total,
        (N - RARE.len()) as u64
    );
}
