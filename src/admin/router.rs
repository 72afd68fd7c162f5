//! The admin server's routes: health, metrics, the ladders' view, the parking-lot API and the
//! web page. Handlers read shared state only; the parking-lot ones go through the desk.

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};

use crate::admin::state::AdminState;
use crate::admin::{api, guard, holds, openapi, status, web};

/// The admin routes.
pub fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/live", get(status::live))
        .route("/ready", get(status::ready))
        .route("/metrics", get(status::metrics))
        .route("/api/ladders", get(status::ladders))
        .route("/api/openapi.json", get(openapi::serve))
        .route("/api/ladders/{ladder}/parked", get(api::list))
        .route("/api/ladders/{ladder}/parked/replay", post(api::replay))
        .route("/api/ladders/{ladder}/parked/discard", post(api::discard))
        .route("/api/ladders/{ladder}/parked/counts", get(api::counts))
        .route("/api/ladders/{ladder}/parked/jobs", get(api::jobs))
        .route("/api/ladders/{ladder}/parked/jobs/{id}", get(api::job))
        .route("/api/ladders/{ladder}/parked/{offset}", get(api::show))
        .route("/api/ladders/{ladder}/parked/{offset}/body", get(api::body))
        .route(
            "/api/ladders/{ladder}/parked/{offset}/edit-replay",
            post(api::edit_replay),
        )
        .route("/api/ladders/{ladder}/scheduled/cancel", post(api::cancel))
        .route("/api/ladders/{ladder}/holds", get(holds::list).post(holds::hold))
        .route("/api/ladders/{ladder}/holds/resume", post(holds::resume))
        .route("/", get(web::overview))
        .route("/ladders/{ladder}/parked", get(web::list))
        .route("/ladders/{ladder}/jobs/{id}", get(web::job_page))
        .route(
            "/ladders/{ladder}/scheduled/cancel",
            get(web::confirm_cancel).post(web::cancel_scheduled),
        )
        .route("/static/ladder.css", get(web::stylesheet))
        .route("/ladders/{ladder}/destinations", get(holds::destinations))
        .route("/ladders/{ladder}/destinations/hold", post(holds::hold_form))
        .route("/ladders/{ladder}/destinations/resume", post(holds::resume_form))
        .route("/ladders/{ladder}/parked/{offset}", get(web::entry))
        .route(
            "/ladders/{ladder}/parked/{offset}/edit",
            get(web::edit_form).post(web::edit_and_replay),
        )
        .route(
            "/ladders/{ladder}/parked/{offset}/{action}",
            get(web::confirm_one).post(web::act_on_one),
        )
        .route(
            "/ladders/{ladder}/matching/{action}",
            get(web::confirm_matching).post(web::act_on_matching),
        )
        // every error under /api as {"error": …} JSON, the router's own 404 and 405 included
        .layer(axum::middleware::from_fn(api::json_errors))
        // the guards (src/admin/guard.rs), the last added running first
        .layer(axum::extract::DefaultBodyLimit::max(guard::MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(guard::same_origin))
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard::allowed_host))
        .layer(axum::middleware::from_fn(guard::bounded_uri))
        .layer(axum::middleware::from_fn(guard::security_headers))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Instant;

    use axum::body::Body;
    use axum::http::{Request, StatusCode, header};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;
    use crate::admin::poller::LadderSnapshot;
    use crate::admin::poller::{AccountingStatus, Rates, Snapshot};
    use crate::admin::status::METRICS_CONTENT_TYPE;
    use crate::broker::state::State;
    use crate::model::accounting::Counters;
    use tokio::sync::watch;

    struct Fixture {
        _dir: tempfile::TempDir,
        state: Arc<AdminState>,
        publish: watch::Sender<Option<Arc<Snapshot>>>,
    }

    /// The ladder `orders` of [`fixture`].
    const ORDERS: &str = "backoff = [\"1s\", \"10s\"]\nmax_attempts = 4\nallow = [\"^orders$\", \"^billing\\\\.\"]\n";

    fn fixture() -> Fixture {
        fixture_with(ORDERS)
    }

    /// A config whose one ladder, `orders`, is `ladder_toml`.
    fn fixture_with(ladder_toml: &str) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ladder.toml"), "namespace = \"ns\"\n").unwrap();
        std::fs::create_dir(dir.path().join("ladders")).unwrap();
        std::fs::write(dir.path().join("ladders/orders.toml"), ladder_toml).unwrap();
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
        f.state.service.health.set_ready(true);
        f.state.service.health.set_reason("blocked", "low on memory");
        let (status, _, body) = get(&f.state, "/ready").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body, "not ready: blocked: low on memory");
        f.state.service.health.set_reason("another", "reason");
        assert_eq!(
            get(&f.state, "/ready").await.2,
            "not ready: another: reason; blocked: low on memory"
        );
        f.state.service.health.clear_reason("another");
        f.state.service.health.clear_reason("blocked");
        let (status, _, body) = get(&f.state, "/ready").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ready"));
    }

    #[tokio::test]
    async fn not_ready_without_a_session_says_connecting() {
        let f = fixture();
        assert_eq!(get(&f.state, "/ready").await.2, "not ready: connecting");
    }

    #[tokio::test]
    async fn a_stalled_hop_is_not_ready_and_says_why() {
        let f = fixture();
        f.state.service.health.set_ready(true);
        let why = "stalled: orders/due no progress for 3s with work waiting";
        f.state.service.health.set_stalled(Some(why.into()));
        let (status, _, body) = get(&f.state, "/ready").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body, format!("not ready: {why}"));
        f.state.service.health.set_stalled(None);
        assert_eq!(get(&f.state, "/ready").await.0, StatusCode::OK);
    }

    #[tokio::test]
    async fn metrics_are_openmetrics_text() {
        let f = fixture();
        let spec = &f.state.config.ladders[0];
        let ladder = f.state.service.metrics.ladder(spec);
        ladder.scheduled("10s", 1_000);
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
        let steps: Vec<_> = l["tiers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["step"] == true)
            .collect();
        assert_eq!(
            steps,
            [
                &serde_json::json!({"name": "1s", "delay_ms": 1000, "queue": "ns.delay.1s", "step": true,
                    "next_leave_at_ms": null, "put_in_waiting": null}),
                &serde_json::json!({"name": "10s", "delay_ms": 10000, "queue": "ns.delay.10s", "step": true,
                    "next_leave_at_ms": null, "put_in_waiting": null}),
            ]
        );
        assert_eq!(
            l["tiers"].as_array().unwrap().len(),
            30,
            "the steps and the 28 delay levels"
        );
        assert_eq!(l["max_attempts"], 4);
        assert_eq!(l["allow"], serde_json::json!(["^orders$", "^billing\\."]));
        assert_eq!(l["queue_type"], "quorum");
        assert_eq!(l["dead_letter_strategy"], "at-least-once");
        assert_eq!(l["queues"]["intake"], "ns.orders.intake");
        assert_eq!(l["queues"]["delay.10s"], "ns.delay.10s");
        assert!(l["depths"].is_null() && l["rates"].is_null() && l["accounting"].is_null());
        // no senders listed: neither key, rather than an empty grant list that reads as "nobody"
        assert!(l.get("senders").is_none() && l.get("unidentified").is_none(), "{l}");

        // a ladder that lists its senders shows each one's patterns and the policy for the rest
        let f = fixture_with(&format!(
            "{ORDERS}unidentified = \"dead-letter\"\n[senders]\nbilling-svc = [\"^billing\\\\.\"]\norders-svc = [\"^orders$\", \"^orders-eu$\"]\n"
        ));
        let v: serde_json::Value = serde_json::from_str(&get(&f.state, "/api/ladders").await.2).unwrap();
        let l = &v["ladders"][0];
        assert_eq!(
            l["senders"],
            serde_json::json!({"billing-svc": ["^billing\\."], "orders-svc": ["^orders$", "^orders-eu$"]})
        );
        assert_eq!(l["unidentified"], "dead-letter");
        // and stays within what the OpenAPI description says of a ladder
        let schema = &crate::admin::openapi::description(&["orders"])["components"]["schemas"]["LadderView"];
        for key in l.as_object().unwrap().keys() {
            assert!(schema["properties"].get(key).is_some(), "{key} is not described");
        }
        for key in schema["required"].as_array().unwrap() {
            assert!(l.get(key.as_str().unwrap()).is_some(), "{key} is required");
        }
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
                    in_doubt: 0,
                },
                next_leaves: vec![("1s".into(), Some((1_763_766_000_600, 6))), ("10s".into(), None)],
                lateness: Default::default(),
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
        let tier = |name: &str| {
            l["tiers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|t| t["name"] == name)
                .unwrap()
                .clone()
        };
        assert_eq!(tier("1s")["next_leave_at_ms"], 1_763_766_000_600u64);
        assert_eq!(tier("1s")["put_in_waiting"], 6);
        assert!(tier("10s")["next_leave_at_ms"].is_null());
        let (_, _, page) = get(&f.state, "/").await;
        assert!(page.contains("next out"), "the page shows the next leave time: {page}");
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
    async fn the_stylesheet_is_served_cacheable_and_every_page_links_it() {
        let f = fixture();
        let response = router(f.state.clone())
            .oneshot(
                Request::builder()
                    .uri("/static/ladder.css")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let headers = response.headers().clone();
        assert_eq!(headers[header::CONTENT_TYPE], "text/css; charset=utf-8");
        assert_eq!(headers[header::CACHE_CONTROL], "public, max-age=86400, immutable");
        assert_eq!(headers[header::CONTENT_SECURITY_POLICY], guard::CONTENT_SECURITY_POLICY);
        let css = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(css, web::STYLE.as_bytes());
        for page in ["/", "/?refresh=off", "/ladders/nope/parked/1/edit"] {
            let (_, _, body) = get(&f.state, page).await;
            assert!(
                body.contains("<link rel=\"stylesheet\" href=\"/static/ladder.css?v="),
                "{page}: {body}"
            );
            assert!(
                body.contains("<header class=\"bar\">") && !body.contains("<style"),
                "{page}: {body}"
            );
        }
    }

    #[tokio::test]
    async fn the_overview_draws_charts_says_the_accounting_in_words_and_refreshes_itself() {
        let f = fixture();
        let (_, _, before) = get(&f.state, "/").await;
        assert!(
            before.contains("no data yet") && before.contains("Not polled yet."),
            "{before}"
        );
        assert!(
            before.contains("<meta http-equiv=\"refresh\" content=\"10\">"),
            "{before}"
        );
        assert!(!get(&f.state, "/?refresh=off").await.2.contains("http-equiv"));
        let counters = Counters {
            received_intake: 12_408,
            delivered: 12_000,
            ..Counters::default()
        };
        let mut lateness = [0; crate::metrics::LATENESS_BUCKETS + 1];
        lateness[3] = 10;
        let snapshot = Snapshot {
            at: Instant::now(),
            at_ms: 1_763_766_000_000,
            broker_error: None,
            ladders: vec![LadderSnapshot {
                name: "orders".into(),
                depths: Some(vec![("delay.1s".into(), Some(6)), ("delay.10s".into(), Some(1))]),
                counters,
                rates: None,
                accounting: AccountingStatus {
                    verdict: "balanced",
                    anchored: true,
                    missing: Some(0),
                    unaccounted: 0,
                    in_doubt: 0,
                },
                next_leaves: Vec::new(),
                lateness,
            }],
        };
        f.state.history.lock().unwrap().record(&snapshot);
        f.publish.send_replace(Some(Arc::new(snapshot)));
        let (_, _, page) = get(&f.state, "/").await;
        assert!(page.contains("All 12 408 messages accounted for."), "{page}");
        assert!(page.contains("class=\"status accounting ok\""), "{page}");
        assert_eq!(page.matches("<svg ").count(), 3, "three charts: {page}");
        assert!(page.contains("in backoff steps: <b>7</b>"), "{page}");
        assert!(page.contains("href=\"/ladders/orders/destinations\""), "{page}");
    }

    #[tokio::test]
    async fn edit_and_replay_needs_a_configured_token_and_nothing_reaches_the_broker_without_one() {
        let f = fixture();
        let api = |auth: Option<&str>| {
            let mut r = Request::builder()
                .method("POST")
                .uri("/api/ladders/orders/parked/7/edit-replay")
                .header(header::CONTENT_TYPE, "application/json");
            if let Some(auth) = auth {
                r = r.header(header::AUTHORIZATION, auth);
            }
            r.body(Body::from("{\"set_headers\": {\"k\": \"v\"}}")).unwrap()
        };
        let (status, _, body) = send(&f.state, api(None)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
        let (status, _, body) = send(&f.state, api(Some("Bearer 0123456789abcdef0123"))).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        let unknown = Request::builder()
            .method("POST")
            .uri("/api/ladders/orders/parked/7/edit-replay")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from("{\"hedaers\": {}}"))
            .unwrap();
        assert_eq!(
            send(&f.state, unknown).await.0,
            StatusCode::BAD_REQUEST,
            "a misspelt field"
        );
        let form = Request::builder()
            .method("POST")
            .uri("/ladders/orders/parked/7/edit")
            .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .body(Body::from("headers=%7B%7D&body=x&token=0123456789abcdef0123"))
            .unwrap();
        let (status, _, body) = send(&f.state, form).await;
        assert_eq!(status, StatusCode::FORBIDDEN);
        assert!(
            body.contains("id=\"back\" href=\"/ladders/orders/parked/7/edit\""),
            "{body}"
        );
    }

    #[tokio::test]
    async fn unknown_paths_are_404() {
        let f = fixture();
        assert_eq!(get(&f.state, "/nope").await.0, StatusCode::NOT_FOUND);
    }
}
