//! What the service says of itself: `/live`, `/ready`, `/metrics` and `/api/ladders`. Each
//! reads only what the service and the poller share.

use std::sync::Arc;

use axum::Json;
use axum::extract::State as Extract;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;

use crate::admin::state::{AdminState, LaddersView};

/// The content type of `/metrics`: prometheus-client writes the OpenMetrics text format.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// 200 while the process runs.
#[utoipa::path(get, path = "/live", operation_id = "live", responses((status = 200, description = "`ok`", body = String, content_type = "text/plain")))]
pub(crate) async fn live() -> &'static str {
    "ok"
}

/// 200 `ready`, or 503 `not ready: <why>`: `connecting` while no session serves, else every
/// reason that holds a connected service up, by kind (`blocked: low on memory`, `stalled:
/// <ladder>/<hop> no progress for 3s with work waiting`; several are separated by `; `).
#[utoipa::path(
    get,
    path = "/ready",
    operation_id = "ready",
    responses(
        (status = 200, description = "`ready`", body = String, content_type = "text/plain"),
        (status = 503, description = "`not ready: <why>`", body = String, content_type = "text/plain"),
    ),
)]
pub(crate) async fn ready(Extract(state): Extract<Arc<AdminState>>) -> (StatusCode, String) {
    let health = &state.service.health;
    if health.is_ready() {
        (StatusCode::OK, "ready".into())
    } else {
        let why = health.reason().unwrap_or_else(|| "connecting".into());
        (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}"))
    }
}

/// Prometheus metrics in the OpenMetrics text format (docs/src/operations/metrics.md).
#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "metrics",
    responses((status = 200, description = "the metrics", body = String, content_type = "application/openmetrics-text")),
)]
pub(crate) async fn metrics(Extract(state): Extract<Arc<AdminState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        state.service.metrics.encode(),
    )
}

/// Every ladder: config, queue names, latest depths, rates, totals and accounting.
#[utoipa::path(
    get,
    path = "/api/ladders",
    operation_id = "ladders",
    responses((status = 200, description = "the ladders", body = LaddersView)),
)]
pub(crate) async fn ladders(Extract(state): Extract<Arc<AdminState>>) -> Json<LaddersView> {
    let snapshot = state.snapshots.borrow().clone();
    Json(LaddersView::new(&state.config, snapshot.as_deref()).with_drift(&state.service))
}
