//! The parking-lot HTTP JSON API on the admin server — the CLI's `ladder parked` operations for
//! scripts and tools:
//!
//! - `GET  /api/ladders/{ladder}/parked` — a page of entries, newest first, and the total;
//! - `GET  /api/ladders/{ladder}/parked/counts` — the matching entries counted in all, per
//!   destination and per reason;
//! - `GET  /api/ladders/{ladder}/parked/{offset}` — one entry in full;
//! - `POST /api/ladders/{ladder}/parked/replay` — replay by offsets and/or a filter;
//! - `POST /api/ladders/{ladder}/parked/discard` — discard by offsets and/or a filter.
//!
//! Reading is open to whoever reaches the admin server (it binds to loopback by default);
//! replay and discard need `Authorization: Bearer <token>` with a token from `admin.tokens`, and
//! the token's name is who asked, in the log and the resolution record. The query parsing and
//! the token check here are shared with the web page ([`crate::web`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State as Extract};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::json;
use subtle::ConstantTimeEq;
use tracing::warn;

use crate::admin::AdminState;
use crate::config::OperatorToken;
use crate::lot_index::Counts;
use crate::operator::ActionReport;
use crate::parking::{self, Filter, Page, PageRequest, ParkedEntry, ParkingError, ReplayOptions};

/// Entries per page unless the request says otherwise.
pub const DEFAULT_PAGE_SIZE: usize = 50;

/// The largest page a request may ask for: each entry is read from the stream and rendered, so
/// this bounds a request's work and memory; more is paged.
pub const MAX_PAGE_SIZE: usize = 1000;

/// A listing request: which entries, which page, resolved ones too or not.
#[derive(Debug, Clone, PartialEq)]
pub struct ListQuery {
    /// Which entries.
    pub filter: Filter,
    /// Which page.
    pub page: PageRequest,
    /// Include replayed and discarded entries.
    pub include_resolved: bool,
}

/// Parses a listing's query parameters: `destination`, `reason`, `message_id`,
/// `correlation_id`, `header` (`key=value`, repeatable), `body`, `since`, `until` (RFC 3339 or
/// a duration ago), `offset`, `limit`, `resolved` (`include`). Empty values are ignored, as a
/// form submits every field.
pub fn parse_query(pairs: &[(String, String)], now_ms: u64) -> Result<ListQuery, ParkingError> {
    let mut q = ListQuery {
        filter: Filter::default(),
        page: PageRequest {
            offset: 0,
            limit: DEFAULT_PAGE_SIZE,
        },
        include_resolved: false,
    };
    let number = |key: &str, value: &str| {
        value
            .parse::<usize>()
            .map_err(|_| ParkingError::Invalid(format!("{key} must be a whole number, got {value:?}")))
    };
    for (key, value) in pairs {
        let value = value.trim();
        if value.is_empty() {
            continue;
        }
        let text = Some(value.to_string());
        match key.as_str() {
            "destination" => q.filter.destination = text,
            "reason" => q.filter.reason = text,
            "message_id" => q.filter.message_id = text,
            "correlation_id" => q.filter.correlation_id = text,
            "header" => q.filter.headers.push(parking::parse_header_filter(value)?),
            "body" => q.filter.body_contains = text,
            "since" => q.filter.since_ms = Some(parking::parse_time_bound(value, now_ms)?),
            "until" => q.filter.until_ms = Some(parking::parse_time_bound(value, now_ms)?),
            "offset" => q.page.offset = number(key, value)?,
            "limit" => q.page.limit = number(key, value)?,
            "resolved" => q.include_resolved = matches!(value, "include" | "true" | "yes" | "on"),
            other => return Err(ParkingError::Invalid(format!("unknown query parameter {other:?}"))),
        }
    }
    if q.page.limit > MAX_PAGE_SIZE {
        return Err(ParkingError::Invalid(format!(
            "limit is {}; at most {MAX_PAGE_SIZE}",
            q.page.limit
        )));
    }
    Ok(q)
}

/// Why a replay or discard over HTTP is refused before it starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denied {
    /// No token presented.
    Missing,
    /// A token that matches none configured (or none is configured).
    Wrong,
}

/// The name of the configured token equal to `presented`. Every configured token is compared,
/// in constant time, so the answer's timing does not say how close a guess was.
pub fn authorize<'a>(tokens: &'a [OperatorToken], presented: Option<&str>) -> Result<&'a str, Denied> {
    let presented = presented
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .ok_or(Denied::Missing)?;
    let mut found = None;
    for t in tokens {
        if bool::from(t.token.as_bytes().ct_eq(presented.as_bytes())) {
            found = Some(t.name.as_str());
        }
    }
    found.ok_or(Denied::Wrong)
}

/// An error as JSON, `{"error": "..."}`, with the status that fits it.
pub struct ApiError(StatusCode, String);

impl ApiError {
    /// The HTTP status for a parking-lot error.
    pub fn status(e: &ParkingError) -> StatusCode {
        match e {
            ParkingError::Invalid(_) => StatusCode::BAD_REQUEST,
            ParkingError::NotFound(_) | ParkingError::UnknownLadder(_) => StatusCode::NOT_FOUND,
            ParkingError::Busy(_) => StatusCode::CONFLICT,
            ParkingError::Broker(_) | ParkingError::Timeout { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ParkingError::Envelope(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl From<ParkingError> for ApiError {
    fn from(e: ParkingError) -> Self {
        ApiError(ApiError::status(&e), e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.0, Json(json!({ "error": self.1 }))).into_response();
        if self.0 == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// The listing's answer.
#[derive(Debug, Serialize)]
pub(crate) struct ListView {
    total: u64,
    entries: Vec<ParkedEntry>,
    /// How far this replica's index has read the stream.
    indexed_entries: usize,
    next_offset: Option<u64>,
    /// Whether this replica's index has read the whole stream yet (counts are partial until).
    caught_up: bool,
}

pub(crate) async fn list(
    Extract(state): Extract<Arc<AdminState>>,
    Path(ladder): Path<String>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Json<ListView>, ApiError> {
    let q = parse_query(&pairs, crate::relay::now_ms())?;
    let Page { total, entries } = state.desk.list(&ladder, &q.filter, q.page, q.include_resolved).await?;
    let status = state.desk.status(&ladder)?;
    Ok(Json(ListView {
        total,
        entries,
        indexed_entries: status.entries,
        next_offset: status.next_offset,
        caught_up: status.caught_up,
    }))
}

/// The counts' answer.
#[derive(Debug, Serialize)]
pub(crate) struct CountsView {
    #[serde(flatten)]
    counts: Counts,
    /// How far this replica's index has read the stream.
    indexed_entries: usize,
    /// Whether this replica's index has read the whole stream yet (counts are partial until).
    caught_up: bool,
}

/// `GET /api/ladders/{ladder}/parked/counts`: the listing's filters; `offset` and `limit` do
/// not apply.
pub(crate) async fn counts(
    Extract(state): Extract<Arc<AdminState>>,
    Path(ladder): Path<String>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Result<Json<CountsView>, ApiError> {
    let q = parse_query(&pairs, crate::relay::now_ms())?;
    let counts = state.desk.counts(&ladder, &q.filter, q.include_resolved).await?;
    let status = state.desk.status(&ladder)?;
    Ok(Json(CountsView {
        counts,
        indexed_entries: status.entries,
        caught_up: status.caught_up,
    }))
}

pub(crate) async fn show(
    Extract(state): Extract<Arc<AdminState>>,
    Path((ladder, offset)): Path<(String, u64)>,
) -> Result<Json<ParkedEntry>, ApiError> {
    Ok(Json(state.desk.show(&ladder, offset).await?))
}

/// Which entries an action is for: offsets, a filter, or both (both narrow).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Selector {
    #[serde(default)]
    offsets: Vec<u64>,
    #[serde(default)]
    destination: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    message_id: Option<String>,
    #[serde(default)]
    correlation_id: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    body_contains: Option<String>,
    #[serde(default)]
    since: Option<String>,
    #[serde(default)]
    until: Option<String>,
}

impl Selector {
    fn filter(self) -> Result<Filter, ParkingError> {
        let now = crate::relay::now_ms();
        let time = |t: Option<String>| t.map(|t| parking::parse_time_bound(&t, now)).transpose();
        Ok(Filter {
            offsets: (!self.offsets.is_empty()).then(|| self.offsets.into_iter().collect()),
            ladder: None,
            destination: self.destination,
            reason: self.reason,
            since_ms: time(self.since)?,
            until_ms: time(self.until)?,
            message_id: self.message_id,
            correlation_id: self.correlation_id,
            headers: self.headers.into_iter().collect(),
            body_contains: self.body_contains,
        })
    }
}

/// `POST …/replay`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReplayRequest {
    #[serde(flatten)]
    select: Selector,
    #[serde(default)]
    to: Option<String>,
    #[serde(default)]
    rate: Option<String>,
    #[serde(default)]
    dry_run: bool,
}

/// `POST …/discard`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct DiscardRequest {
    #[serde(flatten)]
    select: Selector,
}

/// The caller's name from `Authorization: Bearer <token>`, or the refusal (logged).
fn caller(state: &AdminState, headers: &HeaderMap, ladder: &str, what: &str) -> Result<String, ApiError> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.strip_prefix("Bearer ").unwrap_or(""));
    match authorize(&state.config.admin.tokens, presented) {
        Ok(name) => Ok(name.to_string()),
        Err(Denied::Missing) => {
            warn!(ladder, "{what} over HTTP refused: no bearer token");
            Err(ApiError(
                StatusCode::UNAUTHORIZED,
                format!("{what} needs Authorization: Bearer <token> with a token from admin.tokens"),
            ))
        }
        Err(Denied::Wrong) => {
            warn!(
                ladder,
                "{what} over HTTP refused: the token matches none in admin.tokens"
            );
            Err(ApiError(
                StatusCode::FORBIDDEN,
                "the token matches none in admin.tokens".into(),
            ))
        }
    }
}

pub(crate) async fn replay(
    Extract(state): Extract<Arc<AdminState>>,
    Path(ladder): Path<String>,
    headers: HeaderMap,
    Json(request): Json<ReplayRequest>,
) -> Result<Json<ActionReport>, ApiError> {
    let by = caller(&state, &headers, &ladder, "replay")?;
    let options = ReplayOptions {
        to: request.to.filter(|t| !t.is_empty()),
        rate: request.rate.map(|r| r.parse()).transpose()?,
        dry_run: request.dry_run,
        by,
    };
    let filter = request.select.filter()?;
    Ok(Json(state.desk.replay(&ladder, &filter, &options).await?))
}

pub(crate) async fn discard(
    Extract(state): Extract<Arc<AdminState>>,
    Path(ladder): Path<String>,
    headers: HeaderMap,
    Json(request): Json<DiscardRequest>,
) -> Result<Json<ActionReport>, ApiError> {
    let by = caller(&state, &headers, &ladder, "discard")?;
    let filter = request.select.filter()?;
    Ok(Json(state.desk.discard(&ladder, &filter, &by).await?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn queries_parse_every_filter_and_ignore_empty_fields() {
        let q = parse_query(
            &pairs(&[
                ("destination", "orders"),
                ("reason", "max-attempts"),
                ("message_id", ""),
                ("correlation_id", "c-1"),
                ("header", "tenant=acme"),
                ("header", "n=7"),
                ("body", "timeout"),
                ("since", "1h"),
                ("until", "2026-11-22T00:00:00Z"),
                ("offset", "50"),
                ("limit", "25"),
                ("resolved", "include"),
            ]),
            10_000_000,
        )
        .unwrap();
        assert_eq!(q.filter.destination.as_deref(), Some("orders"));
        assert_eq!(q.filter.reason.as_deref(), Some("max-attempts"));
        assert_eq!(q.filter.message_id, None);
        assert_eq!(q.filter.correlation_id.as_deref(), Some("c-1"));
        assert_eq!(
            q.filter.headers,
            vec![("tenant".into(), "acme".into()), ("n".into(), "7".into())]
        );
        assert_eq!(q.filter.body_contains.as_deref(), Some("timeout"));
        assert_eq!(q.filter.since_ms, Some(10_000_000 - 3_600_000));
        assert_eq!(q.filter.until_ms, Some(1_795_305_600_000));
        assert_eq!((q.page.offset, q.page.limit), (50, 25));
        assert!(q.include_resolved);
        let empty = parse_query(&[], 0).unwrap();
        assert!(empty.filter.is_empty() && !empty.include_resolved);
        assert_eq!(empty.page.limit, DEFAULT_PAGE_SIZE);
    }

    #[test]
    fn bad_queries_say_what_is_wrong() {
        let bad = |list: &[(&str, &str)]| parse_query(&pairs(list), 0).unwrap_err().to_string();
        assert!(bad(&[("limit", "lots")]).contains("limit"));
        assert!(bad(&[("limit", "5000")]).contains("at most 1000"));
        assert!(bad(&[("header", "novalue")]).contains("key=value"));
        assert!(bad(&[("since", "yesterday-ish")]).contains("RFC 3339"));
        assert!(bad(&[("colour", "red")]).contains("unknown query parameter"));
    }

    #[test]
    fn tokens_name_the_caller() {
        let tokens = vec![
            OperatorToken {
                name: "alice".into(),
                token: "alice-0123456789abcdef".into(),
            },
            OperatorToken {
                name: "bob".into(),
                token: "bob-0123456789abcdef".into(),
            },
        ];
        assert_eq!(authorize(&tokens, Some("bob-0123456789abcdef")), Ok("bob"));
        assert_eq!(authorize(&tokens, Some(" alice-0123456789abcdef ")), Ok("alice"));
        assert_eq!(authorize(&tokens, Some("alice-0123456789abcde")), Err(Denied::Wrong));
        assert_eq!(authorize(&tokens, Some("")), Err(Denied::Missing));
        assert_eq!(authorize(&tokens, None), Err(Denied::Missing));
        assert_eq!(authorize(&[], Some("anything-at-all-here")), Err(Denied::Wrong));
    }
}
