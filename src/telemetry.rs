//! OpenTelemetry tracing across retries (filled in by the telemetry work).

/// The service's tracer; off unless configured.
#[derive(Debug, Clone, Default)]
pub struct Telemetry {}
