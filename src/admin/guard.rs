//! What every request to the admin server passes before a handler sees it, as axum layers
//! ([`crate::admin::router`](fn@crate::admin::router) applies them): the `Host` must be one this server answers to (no
//! DNS rebinding), a state-changing request must come from the server's own pages or from no
//! browser at all (no cross-site form posts), the URI and the body are bounded, and every
//! response carries the headers that keep a browser from framing, sniffing or leaking it.
//!
//! These guard the operator's browser; who may replay or discard is still the token
//! ([`crate::admin::api::authorize`]).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State as Extract};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::admin::state::AdminState;

/// Longest request target (path and query) accepted: a filter's query string is a few hundred
/// bytes; 8 KiB is what common proxies accept by default.
pub const MAX_URI_BYTES: usize = 8 * 1024;

/// Largest request body accepted: a replay or discard request lists filters and at most
/// 10 000 offsets (about 210 KB as JSON); the forms are far smaller.
pub const MAX_BODY_BYTES: usize = 256 * 1024;

/// Paths that answer any `Host`: probes and scrapers reach the server by a Service or
/// container name (`ladder:9464`), and these reveal nothing a page could misuse.
const ANY_HOST_PATHS: [&str; 3] = ["/live", "/ready", "/metrics"];

/// The Content-Security-Policy of every response: nothing may load but stylesheets from this
/// server (it serves one, `/static/ladder.css`), no inline style, no script, no image, font
/// or connection; forms post only to this server, and no other site may frame it. (A hash
/// cannot name an external stylesheet, so `'self'`; the charts are inline SVG, styled by the
/// stylesheet's classes, and need nothing more.)
pub const CONTENT_SECURITY_POLICY: &str =
    "default-src 'none'; style-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Headers set on every response (unless the handler set them).
const FIXED_HEADERS: [(header::HeaderName, &str); 5] = [
    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    (header::REFERRER_POLICY, "no-referrer"),
    (header::X_FRAME_OPTIONS, "DENY"),
    // another site may not load the API's JSON as a script, image or the like
    (
        header::HeaderName::from_static("cross-origin-resource-policy"),
        "same-origin",
    ),
    // parked messages are not for shared caches or the browser's disk
    (header::CACHE_CONTROL, "no-store"),
];

/// A refusal: `{"error"}` JSON under `/api`, plain text elsewhere.
fn refuse(path: &str, status: StatusCode, message: &str) -> Response {
    if path.starts_with("/api/") {
        (status, axum::Json(serde_json::json!({ "error": message }))).into_response()
    } else {
        (
            status,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            message.to_string(),
        )
            .into_response()
    }
}

/// Adds the security headers to every response, refusals included.
pub async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers
        .entry(header::CONTENT_SECURITY_POLICY)
        .or_insert_with(|| HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    for (name, value) in FIXED_HEADERS {
        headers.entry(name).or_insert(HeaderValue::from_static(value));
    }
    response
}

/// Refuses a request target longer than [`MAX_URI_BYTES`] (414).
pub async fn bounded_uri(request: Request, next: Next) -> Response {
    let length = request.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if length > MAX_URI_BYTES {
        return refuse(
            request.uri().path(),
            StatusCode::URI_TOO_LONG,
            &format!("the request target is {length} bytes; at most {MAX_URI_BYTES} are accepted"),
        );
    }
    next.run(request).await
}

/// The request's `Host` (HTTP/1.1), or the URI's authority (HTTP/2); a `Host` that is not
/// ASCII is the empty name, which no rule allows.
fn host_of(request: &Request<Body>) -> Option<&str> {
    match request.headers().get(header::HOST) {
        Some(host) => Some(host.to_str().unwrap_or("")),
        None => request.uri().authority().map(|a| a.as_str()),
    }
}

/// Refuses (400) a request whose `Host` this server does not answer to: a page an operator
/// opens can resolve a name of its own to 127.0.0.1 (DNS rebinding) and then read whatever a
/// loopback bind was meant to keep local, but its requests carry that name. IP addresses, the
/// loopback names and `admin.allowed_hosts` pass; so do health and metrics
/// (`ANY_HOST_PATHS`).
pub async fn allowed_host(Extract(state): Extract<Arc<AdminState>>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    if ANY_HOST_PATHS.contains(&path) {
        return next.run(request).await;
    }
    match host_of(&request) {
        // no Host at all: not a browser (every browser sends one), so not a rebinding page
        None => next.run(request).await,
        Some(host) if state.config.admin.allows_host(host) => next.run(request).await,
        Some(host) => {
            let shown: String = host.chars().take(64).collect();
            tracing::warn!(host = %shown.escape_debug(), path = %path.escape_debug(), "admin request for a host this server does not serve refused");
            refuse(
                path,
                StatusCode::BAD_REQUEST,
                &format!(
                    "this server does not answer to the host {:?}; add it to admin.allowed_hosts",
                    shown
                ),
            )
        }
    }
}

/// Refuses (403) a state-changing request that a browser sent from another site: a page
/// elsewhere can post a form here. Such a post lacks the token the operator types, but this
/// refuses it before any token is compared, and covers every form and endpoint alike.
/// Browsers say where a request comes from in `Sec-Fetch-Site`, or older ones in `Origin`; a
/// request with neither is not from a browser page, and passes (the token still guards it).
pub async fn same_origin(request: Request, next: Next) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD | Method::OPTIONS) {
        return next.run(request).await;
    }
    if let Err(why) = same_origin_verdict(request.headers(), host_of(&request)) {
        let path = request.uri().path().to_string();
        tracing::warn!(path = %path.escape_debug(), why, "cross-site admin request refused");
        return refuse(
            &path,
            StatusCode::FORBIDDEN,
            &format!("cross-site request refused: {why}"),
        );
    }
    next.run(request).await
}

/// Whether the headers of an unsafe request show it came from this server's own pages (or from
/// no browser page), and why not.
fn same_origin_verdict(headers: &HeaderMap, host: Option<&str>) -> Result<(), &'static str> {
    if let Some(site) = headers.get("sec-fetch-site") {
        return match site.as_bytes() {
            b"same-origin" | b"none" => Ok(()),
            _ => Err("the browser says it comes from another site (Sec-Fetch-Site)"),
        };
    }
    let Some(origin) = headers.get(header::ORIGIN) else {
        return Ok(());
    };
    let origin_host = origin
        .to_str()
        .ok()
        .and_then(|o| o.split_once("://"))
        .map(|(_, authority)| authority);
    match (origin_host, host) {
        (Some(from), Some(host)) if from.eq_ignore_ascii_case(host) => Ok(()),
        _ => Err("its Origin is not this server"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(*k, HeaderValue::from_static(v));
        }
        map
    }

    #[test]
    fn unsafe_requests_pass_from_this_server_or_from_no_browser() {
        let host = Some("127.0.0.1:9464");
        for ok in [
            headers(&[]),
            headers(&[("sec-fetch-site", "same-origin")]),
            headers(&[("sec-fetch-site", "none")]),
            headers(&[("origin", "http://127.0.0.1:9464")]),
            headers(&[("origin", "https://LOCALHOST:9464")]),
        ] {
            let host = if ok.get("origin").is_some_and(|o| o.as_bytes().starts_with(b"https")) {
                Some("localhost:9464")
            } else {
                host
            };
            assert_eq!(same_origin_verdict(&ok, host), Ok(()), "{ok:?}");
        }
        for refused in [
            headers(&[("sec-fetch-site", "cross-site")]),
            headers(&[("sec-fetch-site", "same-site")]),
            // Sec-Fetch-Site wins over an Origin that would pass
            headers(&[("sec-fetch-site", "cross-site"), ("origin", "http://127.0.0.1:9464")]),
            headers(&[("origin", "http://evil.example")]),
            headers(&[("origin", "http://127.0.0.1:9465")]),
            headers(&[("origin", "null")]),
        ] {
            assert!(same_origin_verdict(&refused, host).is_err(), "{refused:?}");
        }
    }

    #[test]
    fn the_policy_allows_the_servers_stylesheet_and_no_script_or_inline_style() {
        let policy = CONTENT_SECURITY_POLICY;
        assert!(policy.contains("style-src 'self'"), "{policy}");
        assert!(
            !policy.contains("unsafe-inline") && !policy.contains("sha256-"),
            "{policy}"
        );
        assert!(
            policy.starts_with("default-src 'none'") && !policy.contains("script-src"),
            "{policy}"
        );
        assert!(policy.contains("frame-ancestors 'none'") && policy.contains("form-action 'self'"));
    }
}
