//! Regression tests for defects found while redesigning (issue 12), one per defect that needs a
//! broker or the binary; the others are unit tests beside the code (`filter`, `api`, `config`,
//! `protocol`, `admin`).

use std::time::Duration;

use ladder_amqp::{BasicProperties, FieldTable, FieldValue};

use crate::common::*;

const ONE_TIER: &str = "backoff = [\"100ms\"]\nmax_attempts = 1\nallow = [\"^{ns}-\"]";

/// Runs the ladder binary against `config` with `args`, without inherited `LADDER_*` variables.
async fn ladder(config: &std::path::Path, args: &[&str]) -> std::process::Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_ladder"));
    command.arg("--config").arg(config).args(args).kill_on_drop(true);
    for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("LADDER_")) {
        command.env_remove(key);
    }
    command.env("LADDER_AMQP__URL", amqp_url());
    tokio::time::timeout(WAIT, command.output())
        .await
        .unwrap_or_else(|_| panic!("ladder {args:?} did not exit within {WAIT:?}"))
        .expect("the ladder binary runs")
}

/// A replay or discard with neither offsets nor a filter would act on everything: it exits 64
/// (a caller's mistake, as the README says), not 1, and touches nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_action_without_a_filter_exits_64_and_touches_nothing() {
    let mut t = TestLadder::configure("regress-empty", ONE_TIER).await;
    let a = t.declare_queue("a", FieldTable::default()).await;
    t.start_service().await;
    let extra = vec![("retry-to", text(&a)), ("retry-attempt", FieldValue::LongLongInt(1))];
    let mut props = BasicProperties::default().with_message_id("m-1");
    let mut headers = FieldTable::default();
    for (k, v) in extra {
        headers.set(k, v);
    }
    props.headers = Some(headers);
    t.publish(&t.intake(), "", b"kept", props).await;
    t.parked(1).await;
    let config = t.config_path();
    for args in [&["parked", "replay"][..], &["parked", "discard", "--yes"][..]] {
        let out = ladder(&config, args).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(stderr.contains("filter"), "{args:?} says why: {stderr}");
    }
    let out = ladder(&config, &["parked", "list", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let page: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(page["total"], 1, "still unresolved: {page}");
    assert_eq!(queue_depth(&t.client, &a).await, 0, "nothing was replayed");
    // and the lock was never taken: an action with a filter runs at once
    let out = ladder(&config, &["parked", "discard", "--yes", "--reason", "max-attempts"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    tokio::time::sleep(Duration::ZERO).await;
}

/// A new session of the same process looks its exchanges up instead of declaring the topology
/// again (a declare waits for the metadata store's leader, through a partition). When something
/// it declared is gone (the intake queue, deleted by hand), the session that fails on it leaves
/// the next one to declare everything again: the queue is back, the service ready, and a
/// failure sent afterwards is redelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_deleted_by_hand_is_declared_again_by_the_next_session() {
    let mut t = TestLadder::start("redeclare", ONE_TIER).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let intake_queue = format!("{}.intake", t.intake());
    let reconnects = t.state.metrics.reconnects.get();
    t.channel.queue_delete(&intake_queue).await.unwrap();
    eventually(
        "two sessions lost: the one consuming it, then one that found it gone",
        WAIT,
        async || (t.state.metrics.reconnects.get() >= reconnects + 2).then_some(()),
    )
    .await;
    eventually("ready again", WAIT, async || t.state.health.is_ready().then_some(())).await;
    assert!(
        depth(&t.client, &intake_queue).await.is_some(),
        "the intake queue was declared again"
    );
    let props = retry_props(&orders, None).with_message_id("after");
    t.publish(&t.intake(), "", b"x", props).await;
    let d = next_within(&mut consumer, WAIT)
        .await
        .expect("redelivered after the new declare");
    assert_eq!(message_id(&d), "after");
}
