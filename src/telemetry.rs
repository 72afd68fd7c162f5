//! OpenTelemetry traces across retries: one trace per message, from its first failure through
//! every wait and redelivery to its parking.
//!
//! Each hop extracts W3C `traceparent`/`tracestate` from the delivery (long string, short
//! string or byte array), records a `process` span (kind consumer) and a `send` span (kind
//! producer) for its publish, and injects the `send` span's context, as long strings, into
//! what it publishes — so the consumer's next attempt, instrumented by any OpenTelemetry
//! RabbitMQ library, continues the same trace. The due hop also records the tier wait as a
//! `wait` span whose start and end come from the ladder's headers, so a trace shows the wait
//! rather than a gap. Spans follow the messaging semantic conventions.
//!
//! Off unless an OTLP exporter is configured through the standard `OTEL_*` variables; off
//! costs one branch per message. This module must not decide anything about a message.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ladder_amqp::{BasicProperties, FieldTable, FieldValue, LongString};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

use crate::model::names::Hop;
use crate::model::names::Names;
use crate::model::protocol::{Decision, RoutedFailure, as_text, as_u64, header};

/// The service's tracer, or nothing when tracing is off.
#[derive(Debug, Clone, Default)]
pub struct Telemetry {
    tracer: Option<SdkTracer>,
}

/// Tracing could not be set up from the environment.
#[derive(Debug, thiserror::Error)]
#[error("cannot set up OpenTelemetry tracing: {0}")]
pub struct TelemetryError(String);

impl Telemetry {
    /// Tracing off.
    pub fn disabled() -> Self {
        Telemetry { tracer: None }
    }

    /// Tracing to `provider` (the binary's OTLP provider, or a test's in-memory one).
    pub fn new(provider: &SdkTracerProvider) -> Self {
        use opentelemetry::trace::TracerProvider as _;
        Telemetry {
            tracer: Some(provider.tracer("ladder")),
        }
    }

    /// Whether spans are recorded.
    pub fn enabled(&self) -> bool {
        self.tracer.is_some()
    }

    /// Starts the spans of one delivery on `hop`: for the due hop, the finished wait span, then
    /// the process span. `None` when tracing is off.
    #[allow(
        clippy::too_many_arguments,
        reason = "one per fact of the delivery its spans record; a struct would be built per delivery only to be taken apart here"
    )]
    pub fn start_hop(
        &self,
        hop: Hop,
        names: &Names,
        ladder: &str,
        props: &BasicProperties,
        body_len: usize,
        now_ms: u64,
        routed: Option<&RoutedFailure>,
    ) -> Option<HopTrace> {
        let tracer = self.tracer.as_ref()?;
        let headers = props.headers_or_empty();
        let headers: &FieldTable = &headers;
        let mut parent = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
        let queue = match hop {
            Hop::Intake => &names.intake_queue,
            Hop::Due => &names.due,
            Hop::Quarantine => &names.quarantine,
        };
        if hop == Hop::Due {
            let wait = match routed {
                // a failure the broker routed: its headers tell of the wait before its last
                // delivery; this one began when it failed
                Some(failure) => Some(Wait {
                    queue: failure.queue.clone().unwrap_or_else(|| names.due.clone()),
                    tier: failure.tier.clone(),
                    entered: now_ms.saturating_sub(failure.waited_ms),
                    due_at: now_ms,
                }),
                None => scheduled_wait(names, headers),
            };
            if let Some(wait) = wait {
                parent = wait_span(tracer, ladder, &wait, &parent, now_ms);
            }
        }
        let mut attributes = vec![
            KeyValue::new("messaging.system", "rabbitmq"),
            KeyValue::new("messaging.operation.name", "process"),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.destination.name", queue.clone()),
            KeyValue::new("messaging.message.body.size", body_len as i64),
            KeyValue::new("ladder.name", ladder.to_string()),
            KeyValue::new("ladder.hop", hop.to_string()),
        ];
        if let Some(id) = &props.message_id {
            attributes.push(KeyValue::new("messaging.message.id", id.to_string()));
        }
        let span = tracer
            .span_builder(format!("process {queue}"))
            .with_kind(SpanKind::Consumer)
            .with_start_time(at(now_ms))
            .with_attributes(attributes)
            .start_with_context(tracer, &parent);
        Some(HopTrace {
            tracer: tracer.clone(),
            process: parent.with_span(span),
        })
    }
}

/// One wait in a tier, as a span shows it.
struct Wait {
    queue: String,
    tier: String,
    entered: u64,
    due_at: u64,
}

/// A wait the service scheduled: from `retry-due-at` minus the tier's delay (when the message
/// entered the tier) to now.
fn scheduled_wait(names: &Names, h: &FieldTable) -> Option<Wait> {
    let tier = as_text(h.get(header::RETRY_TIER)?)?;
    let due_at = as_u64(h.get(header::RETRY_DUE_AT)?)?;
    let delay = humantime::parse_duration(tier).ok()?;
    Some(Wait {
        queue: names.tier_queue_named(tier),
        tier: tier.to_string(),
        entered: due_at.saturating_sub(delay.as_millis() as u64),
        due_at,
    })
}

/// Records `wait` as a finished span ending now. Returns a context holding it.
fn wait_span(tracer: &SdkTracer, ladder: &str, wait: &Wait, parent: &Context, now_ms: u64) -> Context {
    let Wait {
        queue,
        tier,
        entered,
        due_at,
    } = wait;
    let (entered, due_at) = (*entered, *due_at);
    let mut span = tracer
        .span_builder(format!("wait {queue}"))
        .with_kind(SpanKind::Internal)
        .with_start_time(at(entered))
        .with_attributes([
            KeyValue::new("messaging.system", "rabbitmq"),
            KeyValue::new("messaging.destination.name", queue.clone()),
            KeyValue::new("ladder.name", ladder.to_string()),
            KeyValue::new("ladder.tier", tier.clone()),
            KeyValue::new("ladder.due_at_ms", due_at as i64),
            KeyValue::new("ladder.lateness_ms", now_ms.saturating_sub(due_at) as i64),
        ])
        .start_with_context(tracer, parent);
    span.end_with_timestamp(at(now_ms.max(entered)));
    parent.with_remote_span_context(span.span_context().clone())
}

/// The open process span of one delivery.
#[derive(Debug)]
pub struct HopTrace {
    tracer: SdkTracer,
    process: Context,
}

impl HopTrace {
    /// The trace id, for log lines.
    pub fn trace_id(&self) -> String {
        self.process.span().span_context().trace_id().to_string()
    }

    /// Adds what the hop decided to the process span.
    pub fn decided(&self, decision: &Decision, received: &BasicProperties) {
        let span = self.process.span();
        match decision {
            Decision::Forward(f) => {
                span.set_attribute(KeyValue::new("ladder.attempt", f.attempt as i64));
                span.set_attribute(KeyValue::new("ladder.destination", f.destination.clone()));
                if let Some(FieldValue::LongLongInt(due)) = f.header(received, header::RETRY_DUE_AT) {
                    span.set_attribute(KeyValue::new("ladder.due_at_ms", *due));
                }
                if let Some(tier) = f.header(received, header::RETRY_TIER) {
                    span.set_attribute(KeyValue::new("ladder.tier", as_text(tier).unwrap_or("").to_string()));
                }
            }
            Decision::Park(p) => {
                if let Some(destination) = &p.destination {
                    span.set_attribute(KeyValue::new("ladder.destination", destination.clone()));
                }
            }
        }
    }

    /// Starts the send span of a publish and returns `properties` carrying its context.
    pub fn send(
        &self,
        exchange: &str,
        routing_key: &str,
        mut properties: BasicProperties,
    ) -> (SendTrace, BasicProperties) {
        let destination = if exchange.is_empty() { routing_key } else { exchange };
        let span = self
            .tracer
            .span_builder(format!("send {destination}"))
            .with_kind(SpanKind::Producer)
            .with_attributes([
                KeyValue::new("messaging.system", "rabbitmq"),
                KeyValue::new("messaging.operation.name", "send"),
                KeyValue::new("messaging.operation.type", "send"),
                KeyValue::new("messaging.destination.name", destination.to_string()),
                KeyValue::new("messaging.rabbitmq.destination.routing_key", routing_key.to_string()),
            ])
            .start_with_context(&self.tracer, &self.process);
        let cx = self.process.with_span(span);
        let headers = properties.headers.get_or_insert_with(FieldTable::new);
        TraceContextPropagator::new().inject_context(&cx, &mut HeaderInjector(headers));
        (SendTrace(cx), properties)
    }

    /// Marks the message parked: `error.type` and the reason on the process span.
    pub fn parked(&self, reason: &str) {
        let span = self.process.span();
        span.set_attribute(KeyValue::new("ladder.parked.reason", reason.to_string()));
        span.set_attribute(KeyValue::new("error.type", reason.to_string()));
        span.set_status(Status::error(format!("parked: {reason}")));
    }

    /// Marks a failure that sends the delivery back to its queue.
    pub fn failed(&self, error_type: &str) {
        let span = self.process.span();
        span.set_attribute(KeyValue::new("error.type", error_type.to_string()));
        span.set_status(Status::error(error_type.to_string()));
    }
}

impl Drop for HopTrace {
    fn drop(&mut self) {
        self.process.span().end();
    }
}

/// The open send span of one publish; ends when dropped or finished.
#[derive(Debug)]
pub struct SendTrace(Context);

impl SendTrace {
    /// Ends the span, with `error.type` if the broker did not take the message as sent.
    pub fn finish(self, error_type: Option<&str>) {
        if let Some(error) = error_type {
            let span = self.0.span();
            span.set_attribute(KeyValue::new("error.type", error.to_string()));
            span.set_status(Status::error(error.to_string()));
        }
    }
}

impl Drop for SendTrace {
    fn drop(&mut self) {
        self.0.span().end();
    }
}

/// Sets up tracing from the standard environment: on when `OTEL_TRACES_EXPORTER=otlp` or an
/// `OTEL_EXPORTER_OTLP_ENDPOINT`/`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, off when
/// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. The exporter reads the protocol
/// (`grpc` or `http/protobuf`), endpoint, headers and timeout from `OTEL_EXPORTER_OTLP_*`; the
/// sampler comes from `OTEL_TRACES_SAMPLER`. Call inside the tokio runtime.
pub fn provider_from_env(
    env: &std::collections::HashMap<String, String>,
) -> Result<Option<SdkTracerProvider>, TelemetryError> {
    let var = |k: &str| env.get(k).map(|v| v.trim().to_ascii_lowercase());
    if var("OTEL_SDK_DISABLED").as_deref() == Some("true") || var("OTEL_TRACES_EXPORTER").as_deref() == Some("none") {
        return Ok(None);
    }
    let wanted = var("OTEL_TRACES_EXPORTER").as_deref() == Some("otlp")
        || env.contains_key("OTEL_EXPORTER_OTLP_ENDPOINT")
        || env.contains_key("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    if !wanted {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .build()
        .map_err(|e| TelemetryError(e.to_string()))?;
    let processor = opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
        exporter,
        opentelemetry_sdk::runtime::Tokio,
    )
    .build();
    let mut resource = opentelemetry_sdk::Resource::builder();
    if !env.contains_key("OTEL_SERVICE_NAME") {
        resource = resource.with_service_name("ladder");
    }
    Ok(Some(
        SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource.build())
            .build(),
    ))
}

fn at(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

struct HeaderExtractor<'a>(&'a FieldTable);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(as_text)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().filter_map(|(k, _)| k.to_str()).collect()
    }
}

struct HeaderInjector<'a>(&'a mut FieldTable);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // long strings: RabbitMQ rejects short strings in tables, and other clients read these
        self.0.set(key, FieldValue::LongString(LongString::from(value)));
    }
}
