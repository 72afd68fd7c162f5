//! The admin HTTP server: `/live`, `/ready`, `/metrics` and `/api/ladders`, the parking-lot API
//! ([`crate::api`]) and the operator web page ([`crate::web`]), and [`run`], which serves them
//! beside the depth poller ([`crate::poller`]) and the parking-lot followers
//! ([`crate::operator`]).
//!
//! Health and metrics only read what the service and the poller share ([`State`], the latest
//! [`Snapshot`]); the parking-lot routes use the [`Desk`]'s own connection. All of it is off the
//! worker path — a slow scrape, a long replay or a stuck client cannot hold up a relay loop,
//! and the relay never waits for it.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::State as Extract;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info, info_span};

use crate::accounting::Counters;
use crate::config::Config;
use crate::operator::Desk;
use crate::poller::{self, AccountingStatus, Rates, Snapshot};
use crate::service::State;
use crate::topology::Names;
use crate::{api, web};

/// The content type of `/metrics`: prometheus-client writes the OpenMetrics text format.
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// What the admin endpoints read.
#[derive(Debug)]
pub struct AdminState {
    /// Readiness and metrics, shared with the service.
    pub service: Arc<State>,
    /// The configuration the service runs with.
    pub config: Arc<Config>,
    /// The poller's latest snapshot; `None` until its first poll.
    pub snapshots: watch::Receiver<Option<Arc<Snapshot>>>,
    /// The parking lots.
    pub desk: Arc<Desk>,
}

impl AdminState {
    /// The state for `config` and `service`, reading snapshots from `snapshots`.
    pub fn new(config: Arc<Config>, service: Arc<State>, snapshots: watch::Receiver<Option<Arc<Snapshot>>>) -> Self {
        AdminState {
            service,
            desk: Arc::new(Desk::new(config.clone())),
            config,
            snapshots,
        }
    }
}

/// The admin routes.
pub fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/live", get(live))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/api/ladders", get(ladders))
        .route("/api/ladders/{ladder}/parked", get(api::list))
        .route("/api/ladders/{ladder}/parked/replay", post(api::replay))
        .route("/api/ladders/{ladder}/parked/discard", post(api::discard))
        .route("/api/ladders/{ladder}/parked/counts", get(api::counts))
        .route("/api/ladders/{ladder}/parked/{offset}", get(api::show))
        .route("/", get(web::overview))
        .route("/ladders/{ladder}/parked", get(web::list))
        .route("/ladders/{ladder}/parked/{offset}", get(web::entry))
        .route(
            "/ladders/{ladder}/parked/{offset}/{action}",
            get(web::confirm_one).post(web::act_on_one),
        )
        .route(
            "/ladders/{ladder}/matching/{action}",
            get(web::confirm_matching).post(web::act_on_matching),
        )
        .with_state(state)
}

/// Serves [`router`] on `listener` until `shutdown`, then lets open requests finish.
pub async fn serve(listener: TcpListener, state: Arc<AdminState>, shutdown: CancellationToken) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// Serves the admin endpoints on `listener` and runs the depth poller, both until `shutdown`.
///
/// The caller cancels `shutdown` after the service drained, so `/metrics` stays readable
/// during the drain. A failing admin server is logged and does not stop the poller or the
/// service: the relay does not depend on it.
pub async fn run(
    listener: TcpListener,
    config: Arc<Config>,
    service: Arc<State>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let (publish, snapshots) = watch::channel(None);
    let state = Arc::new(AdminState::new(config.clone(), service.clone(), snapshots));
    let address = listener.local_addr()?;
    let mut tasks = JoinSet::new();
    let poll = poller::run(config, service, publish, shutdown.clone());
    let follow = state.desk.clone().follow(shutdown.clone());
    tasks.spawn(
        async move {
            follow.await;
            Ok(())
        }
        .instrument(info_span!("parking-lots")),
    );
    tasks.spawn(
        async move {
            poll.await;
            Ok(())
        }
        .instrument(info_span!("poller")),
    );
    tasks.spawn(serve(listener, state, shutdown.clone()).instrument(info_span!("admin", %address)));
    info!(%address, "admin server listening");
    let mut result = Ok(());
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                error!(error = %e, "admin server failed; the service keeps running without it");
                result = Err(e);
            }
            Err(e) => error!(error = %e, "admin task failed"),
        }
    }
    result
}

async fn live() -> &'static str {
    "ok"
}

async fn ready(Extract(state): Extract<Arc<AdminState>>) -> (StatusCode, &'static str) {
    if state.service.health.is_ready() {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
    }
}

async fn metrics(Extract(state): Extract<Arc<AdminState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
        state.service.metrics.encode(),
    )
}

async fn ladders(Extract(state): Extract<Arc<AdminState>>) -> Json<LaddersView> {
    let snapshot = state.snapshots.borrow().clone();
    Json(LaddersView::new(&state.config, snapshot.as_deref()))
}

/// `/api/ladders` (and the web page's overview).
#[derive(Debug, Serialize)]
pub(crate) struct LaddersView {
    pub(crate) namespace: String,
    pub(crate) poll_interval_ms: u64,
    /// When the latest poll ended (ms since the epoch); `null` before the first.
    pub(crate) polled_at_ms: Option<u64>,
    /// Why the latest poll could not read the broker.
    pub(crate) broker_error: Option<String>,
    pub(crate) ladders: Vec<LadderView>,
}

#[derive(Debug, Serialize)]
pub(crate) struct LadderView {
    pub(crate) name: String,
    pub(crate) exchange: String,
    pub(crate) tiers: Vec<TierView>,
    pub(crate) max_attempts: u32,
    pub(crate) allow: Vec<String>,
    pub(crate) queue_type: &'static str,
    pub(crate) dead_letter_strategy: &'static str,
    /// Queue name per role (`intake`, `due`, `parked`, `delay.<tier>`).
    pub(crate) queues: BTreeMap<String, String>,
    /// Message count per role from the latest poll (`null` for a missing queue); `null` before
    /// the first poll or when it could not read the broker.
    pub(crate) depths: Option<BTreeMap<String, Option<u64>>>,
    /// Per-second rates between the two latest polls.
    pub(crate) rates: Option<Rates>,
    /// This process's counters at the latest poll.
    pub(crate) totals: Option<Counters>,
    pub(crate) accounting: Option<AccountingStatus>,
}

#[derive(Debug, Serialize)]
pub(crate) struct TierView {
    pub(crate) name: String,
    pub(crate) delay_ms: u64,
    pub(crate) queue: String,
}

impl LaddersView {
    pub(crate) fn new(config: &Config, snapshot: Option<&Snapshot>) -> Self {
        let ladders = config
            .ladders
            .iter()
            .map(|spec| {
                let names = Names::new(&config.namespace, &spec.name);
                let polled = snapshot.and_then(|s| s.ladder(&spec.name));
                LadderView {
                    name: spec.name.clone(),
                    exchange: names.intake_exchange.clone(),
                    tiers: spec
                        .tiers
                        .iter()
                        .map(|tier| TierView {
                            name: tier.name.clone(),
                            delay_ms: tier.ttl_ms(),
                            queue: names.tier_queue(tier),
                        })
                        .collect(),
                    max_attempts: spec.max_attempts,
                    allow: spec.allow.patterns().to_vec(),
                    queue_type: spec.queue_type.as_str(),
                    dead_letter_strategy: spec.dead_letter_strategy.as_str(),
                    queues: names.queues(spec).into_iter().collect(),
                    depths: polled
                        .and_then(|l| l.depths.as_ref())
                        .map(|d| d.iter().cloned().collect()),
                    rates: polled.and_then(|l| l.rates),
                    totals: polled.map(|l| l.counters),
                    accounting: polled.map(|l| l.accounting),
                }
            })
            .collect();
        LaddersView {
            namespace: config.namespace.clone(),
            poll_interval_ms: config.admin.poll_interval.as_millis() as u64,
            polled_at_ms: snapshot.map(|s| s.at_ms),
            broker_error: snapshot.and_then(|s| s.broker_error.clone()),
            ladders,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Instant;

    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;
    use crate::poller::LadderSnapshot;

    struct Fixture {
        _dir: tempfile::TempDir,
        state: Arc<AdminState>,
        publish: watch::Sender<Option<Arc<Snapshot>>>,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ladder.toml"), "namespace = \"ns\"\n").unwrap();
        std::fs::create_dir(dir.path().join("ladders")).unwrap();
        std::fs::write(
            dir.path().join("ladders/orders.toml"),
            "backoff = [\"1s\", \"10s\"]\nmax_attempts = 4\nallow = [\"^orders$\", \"^billing\\\\.\"]\n",
        )
        .unwrap();
        let config = crate::config::load(&dir.path().join("ladder.toml"), &HashMap::new()).unwrap();
        let (publish, snapshots) = watch::channel(None);
        let state = Arc::new(AdminState::new(Arc::new(config), Arc::new(State::default()), snapshots));
        Fixture {
            _dir: dir,
            state,
            publish,
        }
    }

    async fn get(state: &Arc<AdminState>, uri: &str) -> (StatusCode, Option<String>, String) {
        let response = router(state.clone())
            .oneshot(Request::builder().uri(uri).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_string());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, content_type, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn live_is_always_ok() {
        let f = fixture();
        assert_eq!(get(&f.state, "/live").await.0, StatusCode::OK);
        assert_eq!(get(&f.state, "/live").await.2, "ok");
    }

    #[tokio::test]
    async fn ready_flips_from_503_to_200_and_back() {
        let f = fixture();
        assert_eq!(get(&f.state, "/ready").await.0, StatusCode::SERVICE_UNAVAILABLE);
        f.state.service.health.set_ready(true);
        assert_eq!(get(&f.state, "/ready").await.0, StatusCode::OK);
        f.state.service.health.set_ready(false);
        assert_eq!(get(&f.state, "/ready").await.0, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[tokio::test]
    async fn metrics_are_openmetrics_text() {
        let f = fixture();
        let spec = &f.state.config.ladders[0];
        let ladder = f.state.service.metrics.ladder(spec);
        ladder.scheduled("10s");
        f.state.service.metrics.set_queue_messages("orders", "delay.10s", 1);
        let (status, content_type, body) = get(&f.state, "/metrics").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type.as_deref(), Some(METRICS_CONTENT_TYPE));
        assert!(
            body.contains("ladder_scheduled_messages_total{ladder=\"orders\",tier=\"10s\"} 1"),
            "{body}"
        );
        assert!(body.contains("ladder_queue_messages{ladder=\"orders\",queue=\"delay.10s\"} 1"));
        assert!(body.ends_with("# EOF\n"), "{body}");
    }

    #[tokio::test]
    async fn ladders_lists_the_config_before_the_first_poll() {
        let f = fixture();
        let (status, content_type, body) = get(&f.state, "/api/ladders").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type.as_deref(), Some("application/json"));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["namespace"], "ns");
        assert_eq!(v["poll_interval_ms"], 5000);
        assert!(v["polled_at_ms"].is_null());
        let l = &v["ladders"][0];
        assert_eq!(l["name"], "orders");
        assert_eq!(l["exchange"], "ns.orders");
        assert_eq!(
            l["tiers"],
            serde_json::json!([
                {"name": "1s", "delay_ms": 1000, "queue": "ns.orders.delay.1s"},
                {"name": "10s", "delay_ms": 10000, "queue": "ns.orders.delay.10s"},
            ])
        );
        assert_eq!(l["max_attempts"], 4);
        assert_eq!(l["allow"], serde_json::json!(["^orders$", "^billing\\."]));
        assert_eq!(l["queue_type"], "quorum");
        assert_eq!(l["dead_letter_strategy"], "at-least-once");
        assert_eq!(l["queues"]["intake"], "ns.orders.intake");
        assert_eq!(l["queues"]["delay.10s"], "ns.orders.delay.10s");
        assert!(l["depths"].is_null() && l["rates"].is_null() && l["accounting"].is_null());
    }

    #[tokio::test]
    async fn ladders_shows_the_latest_snapshot() {
        let f = fixture();
        let counters = Counters {
            received_intake: 7,
            scheduled: 6,
            parked: 1,
            ..Counters::default()
        };
        f.publish.send_replace(Some(Arc::new(Snapshot {
            at: Instant::now(),
            at_ms: 1_763_766_000_000,
            broker_error: None,
            ladders: vec![LadderSnapshot {
                name: "orders".into(),
                depths: Some(vec![
                    ("intake".into(), Some(0)),
                    ("due".into(), Some(0)),
                    ("parked".into(), Some(1)),
                    ("delay.1s".into(), Some(6)),
                    ("delay.10s".into(), None),
                ]),
                counters,
                rates: Some(Rates {
                    received: 1.4,
                    scheduled: 1.2,
                    delivered: 0.0,
                    parked: 0.2,
                    window_ms: 5000,
                }),
                accounting: AccountingStatus {
                    verdict: "balanced",
                    anchored: true,
                    missing: Some(0),
                    unaccounted: 0,
                },
            }],
        })));
        let v: serde_json::Value = serde_json::from_str(&get(&f.state, "/api/ladders").await.2).unwrap();
        assert_eq!(v["polled_at_ms"], 1_763_766_000_000u64);
        let l = &v["ladders"][0];
        assert_eq!(l["depths"]["delay.1s"], 6);
        assert!(l["depths"]["delay.10s"].is_null(), "a missing queue has no depth");
        assert_eq!(l["rates"]["scheduled"], 1.2);
        assert_eq!(l["totals"]["received_intake"], 7);
        assert_eq!(l["accounting"]["verdict"], "balanced");
    }

    async fn send(state: &Arc<AdminState>, request: Request<Body>) -> (StatusCode, axum::http::HeaderMap, String) {
        let response = router(state.clone()).oneshot(request).await.unwrap();
        let (status, headers) = (response.status(), response.headers().clone());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, headers, String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn the_web_page_lists_every_ladder_with_a_link_to_its_parking_lot() {
        let f = fixture();
        let (status, content_type, body) = get(&f.state, "/").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type.as_deref(), Some("text/html; charset=utf-8"));
        assert!(body.contains("<tr data-ladder=\"orders\">"), "{body}");
        assert!(
            body.contains("class=\"parked-link\" href=\"/ladders/orders/parked\""),
            "{body}"
        );
        assert!(body.contains("1s: ?"), "tiers are listed before the first poll: {body}");
    }

    #[tokio::test]
    async fn replay_and_discard_need_a_configured_token_and_nothing_reaches_the_broker_without_one() {
        let f = fixture();
        for action in ["replay", "discard"] {
            let request = |auth: Option<&str>| {
                let mut r = Request::builder()
                    .method("POST")
                    .uri(format!("/api/ladders/orders/parked/{action}"))
                    .header(header::CONTENT_TYPE, "application/json");
                if let Some(auth) = auth {
                    r = r.header(header::AUTHORIZATION, auth);
                }
                r.body(Body::from("{\"destination\": \"orders\"}")).unwrap()
            };
            let (status, headers, body) = send(&f.state, request(None)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
            assert_eq!(headers.get(header::WWW_AUTHENTICATE).unwrap(), "Bearer");
            assert!(body.contains("admin.tokens"), "{body}");
            // the fixture configures no tokens: nobody may act
            let (status, _, body) = send(&f.state, request(Some("Bearer 0123456789abcdef0123"))).await;
            assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        }
        let form = Request::builder()
            .method("POST")
            .uri("/ladders/orders/parked/7/replay")
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(Body::from("to=orders&token=0123456789abcdef0123"))
            .unwrap();
        let (status, _, body) = send(&f.state, form).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert!(body.contains("id=\"outcome\"") && body.contains("token"), "{body}");
        assert!(
            body.contains("id=\"back\" href=\"/ladders/orders/parked/7/replay\""),
            "{body}"
        );
    }

    #[tokio::test]
    async fn unknown_ladders_and_bad_queries_are_refused_before_the_broker() {
        let f = fixture();
        let (status, content_type, body) = get(&f.state, "/api/ladders/nope/parked").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert_eq!(content_type.as_deref(), Some("application/json"));
        assert!(body.contains("no ladder \\\"nope\\\""), "{body}");
        let (status, _, body) = get(&f.state, "/api/ladders/orders/parked?limit=5000").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        let (status, _, body) = get(&f.state, "/ladders/orders/parked?since=someday").await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(body.contains("id=\"filters\"") && body.contains("RFC 3339"), "{body}");
        assert_eq!(
            get(&f.state, "/ladders/orders/parked/7/explode").await.0,
            StatusCode::NOT_FOUND
        );
    }

    #[tokio::test]
    async fn unknown_paths_are_404() {
        let f = fixture();
        assert_eq!(get(&f.state, "/nope").await.0, StatusCode::NOT_FOUND);
    }
}
