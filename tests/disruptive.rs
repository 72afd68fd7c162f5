//! Tests that restart the machine's broker. They disturb every other connection, so
//! `scripts/test` runs this binary alone, after the others (`--skip disruptive_` keeps the
//! main run away from them), and each test waits until the broker accepts connections again.

mod common;

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use lapin::BasicProperties;
use lapin::options::{BasicAckOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;

/// Starts the broker's app again on drop, so a failing test never leaves it stopped.
struct BrokerGuard;

impl BrokerGuard {
    fn stop_app() -> Self {
        rabbitmqctl(&["stop_app"]);
        BrokerGuard
    }
}

impl Drop for BrokerGuard {
    fn drop(&mut self) {
        rabbitmqctl(&["start_app"]);
        rabbitmqctl(&["await_startup", "--timeout", "120"]);
    }
}

fn rabbitmqctl(args: &[&str]) {
    let status = Command::new("rabbitmqctl")
        .args(args)
        .status()
        .expect("rabbitmqctl runs");
    assert!(status.success(), "rabbitmqctl {args:?} failed: {status}");
}

fn retry_props(id: &str, destination: &str) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert("retry-to".into(), text(destination));
    BasicProperties::default()
        .with_message_id(id.into())
        .with_delivery_mode(2)
        .with_headers(h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disruptive_broker_restart_under_traffic_loses_nothing() {
    let mut t = TestLadder::start("restart", "backoff = [\"1s\", \"2s\"]\nallow = [\"^{ns}-\"]\n").await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;

    // Before: 300 retries on their way through intake and the 1s tier.
    let before = 300;
    for i in 0..before {
        t.publish(&t.intake(), "", b"before", retry_props(&format!("b{i}"), &orders))
            .await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    let stopped_at = Instant::now();
    let guard = BrokerGuard::stop_app();
    wait_until("the service notices the broker is gone", || !t.state.health.is_ready()).await;
    drop(guard); // start_app, and wait until the broker is up
    eprintln!("broker was down for {:?}", stopped_at.elapsed());
    wait_until("the service reconnects by itself", || t.state.health.is_ready()).await;

    // After: the service serves new failures too.
    let client = connect().await;
    let channel = client.create_channel().await.unwrap();
    channel.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let after = 100;
    for i in 0..after {
        publish(
            &channel,
            &t.intake(),
            "",
            b"after",
            retry_props(&format!("a{i}"), &orders),
        )
        .await;
    }

    let consumer_channel = client.create_channel().await.unwrap();
    consumer_channel.basic_qos(100, Default::default()).await.unwrap();
    let mut consumer = consumer_channel
        .basic_consume(
            orders.as_str().into(),
            "".into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut seen = HashSet::new();
    let mut deliveries = 0;
    while seen.len() < before + after {
        let d = next(&mut consumer).await;
        deliveries += 1;
        seen.insert(d.properties.message_id().as_ref().unwrap().to_string());
        d.acker.ack(BasicAckOptions::default()).await.unwrap();
    }
    eprintln!("{} distinct messages delivered in {deliveries} deliveries", seen.len());
    // the old client connection died with the broker; the helpers' cleanup opens its own
    t.client = client;
}
