//! Traces across retries, recorded with the SDK's in-memory exporter while the service runs
//! against the real broker: one trace per message, the wait as a span, the parking at the end.

use std::collections::HashMap;
use std::time::Duration;

use crate::common::*;
use ladder::broker::state::State;
use ladder::telemetry::Telemetry;
use ladder_amqp::{BasicProperties, FieldTable, FieldValue};
use opentelemetry::Value;
use opentelemetry::trace::{SpanId, SpanKind, Status, TraceId};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};

const THREE_TIERS: &str = "backoff = [\"200ms\", \"500ms\", \"1s\"]\nallow = [\"^{ns}-\"]\n";

fn traced_state() -> (State, InMemorySpanExporter) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let state = State {
        telemetry: Telemetry::new(&provider),
        ..State::default()
    };
    (state, exporter)
}

/// Waits until the exporter holds at least `count` spans of `trace`.
async fn spans_of(exporter: &InMemorySpanExporter, trace: TraceId, count: usize) -> Vec<SpanData> {
    eventually_ok(&format!("{count} spans are in"), WAIT, async || {
        let spans: Vec<SpanData> = exporter
            .get_finished_spans()
            .unwrap()
            .into_iter()
            .filter(|s| s.span_context.trace_id() == trace)
            .collect();
        if spans.len() >= count {
            Ok(spans)
        } else {
            Err(format!("{} spans: {:?}", spans.len(), names(&spans)))
        }
    })
    .await
}

fn names(spans: &[SpanData]) -> Vec<String> {
    spans.iter().map(|s| s.name.to_string()).collect()
}

fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| &kv.value)
}

fn has(span: &SpanData, key: &str, value: impl Into<Value>) -> bool {
    attr(span, key) == Some(&value.into())
}

/// Publishes `traced` with message id `id` into `queue` as a producer in trace `trace` (hex),
/// from its span `span` (hex), would; returns both.
async fn publish_traced(t: &TestLadder, queue: &str, trace: &str, span: &str, id: &str) -> (TraceId, SpanId) {
    let mut headers = FieldTable::default();
    headers.set("traceparent", text(&format!("00-{trace}-{span}-01")));
    t.publish(
        "",
        queue,
        b"traced",
        BasicProperties::default().with_message_id(id).with_headers(headers),
    )
    .await;
    (TraceId::from_hex(trace).unwrap(), SpanId::from_hex(span).unwrap())
}

/// Takes the next delivery from `queue` and fails it as an explicit consumer does: republished
/// to the ladder with `retry-to`, then acked.
async fn fail_next(t: &TestLadder, consumer: &mut TestConsumer, queue: &str) {
    let d = next(consumer).await;
    t.publish(
        &t.intake(),
        "",
        &d.body,
        republish_props(&d, &[("retry-to", text(queue))]),
    )
    .await;
    consumer.ack(&d);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_failures_then_parked_is_one_trace_with_the_waits_in_it() {
    let (state, exporter) = traced_state();
    let mut t = TestLadder::start_with_state("trace", THREE_TIERS, state).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;

    // the producer's own span: the whole life of the message must join its trace
    let (trace_id, root) = publish_traced(
        &t,
        &orders,
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "00f067aa0ba902b7",
        "t-1",
    )
    .await;

    for _ in 0..4 {
        fail_next(&t, &mut consumer, &orders).await;
    }
    t.parked(1).await;

    // the first failure: intake process, send to tiers, wait, due process, send to orders; the
    // two repeat failures, routed by the broker straight into their tier: wait, due process (which
    // takes them in), send to orders; the last: intake process and its send to the parking lot
    let spans = spans_of(&exporter, trace_id, 13).await;
    assert_eq!(spans.len(), 13, "{:?}", names(&spans));
    let by_id: HashMap<SpanId, &SpanData> = spans.iter().map(|s| (s.span_context.span_id(), s)).collect();
    let parent = |s: &SpanData| by_id.get(&s.parent_span_id).copied();
    let child_of = |of: &SpanData, name: &str| {
        spans
            .iter()
            .find(|s| s.parent_span_id == of.span_context.span_id() && s.name == name)
    };

    let intake = format!("process {}.default.intake", t.ns);
    let mut intakes: Vec<&SpanData> = spans.iter().filter(|s| s.name == intake).collect();
    intakes.sort_by_key(|s| s.start_time);
    assert_eq!(intakes.len(), 2, "the first failure and the exhausted one");
    assert_eq!(
        intakes[0].parent_span_id, root,
        "the first failure continues the producer's trace"
    );
    for process in &intakes {
        assert_eq!(process.span_kind, SpanKind::Consumer);
        assert!(has(process, "messaging.system", "rabbitmq"));
        assert!(has(process, "messaging.operation.name", "process"));
        assert!(has(process, "messaging.message.id", "t-1"));
        assert!(has(process, "ladder.name", "default"));
        assert!(has(process, "ladder.destination", orders.clone()));
    }
    assert!(has(intakes[0], "ladder.attempt", 1));
    assert!(has(intakes[0], "ladder.tier", "200ms"));

    // each wait: under what sent the message into it — the intake's send to the tiers first,
    // then the due hop's send to orders that the consumer's failure continued
    let tier = format!("{}.delay.200ms", t.ns);
    let mut sent = child_of(intakes[0], &format!("send {tier}")).expect("send to the tier");
    assert!(has(sent, "messaging.rabbitmq.destination.routing_key", tier.clone()));
    for (round, tier) in ["200ms", "500ms", "1s"].into_iter().enumerate() {
        let wait = spans
            .iter()
            .find(|s| s.parent_span_id == sent.span_context.span_id() && s.name.starts_with("wait "))
            .unwrap_or_else(|| panic!("round {round}: a wait span under {}", sent.name));
        assert_eq!(wait.name, format!("wait {}.delay.{tier}", t.ns));
        let waited = wait.end_time.duration_since(wait.start_time).unwrap();
        let delay = humantime::parse_duration(tier).unwrap();
        assert!(
            waited >= delay.saturating_sub(Duration::from_millis(5)) && waited < delay + Duration::from_millis(1_500),
            "{tier}: waited {waited:?}"
        );
        let due = child_of(wait, &format!("process {}.default.due", t.ns)).expect("due process");
        assert!(has(due, "ladder.attempt", round as i64 + 1));
        let deliver = child_of(due, &format!("send {orders}")).expect("send to the destination");
        assert!(has(deliver, "messaging.destination.name", orders.clone()));
        sent = deliver;
    }
    // the exhausted failure continued the last delivery's trace, and was parked
    assert_eq!(
        parent(intakes[1]).map(|s| s.span_context.span_id()),
        Some(sent.span_context.span_id())
    );
    let park = child_of(intakes[1], &format!("send {}", t.parked_stream())).expect("send to the parking lot");
    assert_eq!(park.span_kind, SpanKind::Producer);
    assert!(has(intakes[1], "ladder.parked.reason", "max-attempts"));
    assert!(has(intakes[1], "error.type", "max-attempts"));
    assert!(matches!(intakes[1].status, Status::Error { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_trace_context_starts_a_new_trace() {
    let (state, exporter) = traced_state();
    let mut t = TestLadder::start_with_state("newroot", THREE_TIERS, state).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;
    let mut headers = FieldTable::default();
    headers.set("retry-to", text(&orders));
    t.publish(
        &t.intake(),
        "",
        b"untraced",
        BasicProperties::default().with_headers(headers),
    )
    .await;
    let d = next(&mut consumer).await;

    let traceparent = headers_of(&d).get("traceparent").and_then(|v| match v {
        FieldValue::LongString(s) => Some(String::from_utf8(s.as_bytes().to_vec()).unwrap()),
        _ => None,
    });
    let traceparent = traceparent.expect("the redelivery carries a long-string traceparent");
    let trace_id = TraceId::from_hex(traceparent.split('-').nth(1).unwrap()).unwrap();
    let spans = spans_of(&exporter, trace_id, 5).await;
    let intake = spans
        .iter()
        .find(|s| s.name.starts_with("process") && s.name.ends_with(".intake"))
        .unwrap();
    assert_eq!(intake.parent_span_id, SpanId::INVALID, "a new root");
    assert!(spans.iter().any(|s| s.name.starts_with("wait ")));
}
