//! The parking-lot HTTP JSON API on the admin server: the CLI's `ladder parked` operations, for
//! scripts and tools.
//!
//! - `GET  /api/ladders/{ladder}/parked` — a page of entries, newest first, and the total;
//! - `GET  /api/ladders/{ladder}/parked/counts` — the matching entries counted in all, per
//!   destination and per reason;
//! - `GET  /api/ladders/{ladder}/parked/{offset}` — one entry in full;
//! - `POST /api/ladders/{ladder}/parked/replay` — replay by offsets and/or a filter;
//! - `POST /api/ladders/{ladder}/parked/discard` — discard by offsets and/or a filter;
//! - `GET  /api/ladders/{ladder}/parked/jobs[/{id}]` — replays and discards running or ended;
//! - `POST /api/ladders/{ladder}/scheduled/cancel` — cancel a scheduled delivery by message id;
//! - `GET  /api/openapi.json` — this API described (OpenAPI 3.1, [`crate::admin::openapi`]).
//!
//! Every error under `/api` is `{"error": "..."}` JSON, whoever answers it: a handler, an
//! extractor (a body, path or query that does not parse is 400; a body that is not
//! `application/json` is 415) or the router (404, 405), which `json_errors` rewrites.
//!
//! Reading is open to whoever reaches the admin server, which binds to loopback by default.
//! Replay, discard and cancel need `Authorization: Bearer <token>` with a token from
//! `admin.tokens`; the token's name is who asked, in the log and the resolution record. The query parsing and
//! the token check here are shared with the web page ([`crate::admin::web`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, Query, State as Extract};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use subtle::ConstantTimeEq;
use tracing::warn;

use crate::admin::desk::{Job, JobView};
use crate::admin::state::AdminState;
use crate::broker::lot::{ErrorKind, Page, PageRequest, ParkingError, ReplayOptions};
use crate::config::OperatorToken;
use crate::model::lot::edit::Edit;
use crate::model::lot::filter::{Entries, Filter, FilterInput};
use crate::model::lot::index::Counts;
use crate::model::lot::pace::whole_number;
use crate::model::lot::record::ParkedEntry;

/// Entries per page unless the request says otherwise.
pub const DEFAULT_PAGE_SIZE: usize = 50;

/// The largest page a request may ask for: each entry is read from the stream and rendered, so
/// this bounds a request's work and memory; more is paged.
pub const MAX_PAGE_SIZE: usize = 1000;

/// A listing request: which entries, which page, resolved ones too or not.
#[derive(Debug, Clone, PartialEq)]
pub struct ListQuery {
    /// Which entries, resolved ones too when asked.
    pub filter: Filter,
    /// Which page.
    pub page: PageRequest,
}

/// The filters of a listing's query, as [`parse_query`] reads them (it reads the pairs itself,
/// as `header` repeats): for the description only.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[expect(dead_code, reason = "describes the query parse_query reads")]
pub(crate) struct FilterParams {
    /// The queue it was headed for.
    destination: Option<String>,
    /// The parking reason (`max-attempts`, `no-route`, …).
    reason: Option<String>,
    /// The original message id.
    message_id: Option<String>,
    /// The original correlation id.
    correlation_id: Option<String>,
    /// An original header's text value, `key=value`; repeatable, all must match.
    #[param(style = Form, explode, inline, value_type = Option<Vec<HeaderFilter>>)]
    header: Option<Vec<String>>,
    /// A substring of the (UTF-8) body.
    body: Option<String>,
    /// Parked at or after: RFC 3339, or a duration ago (`2h`).
    since: Option<String>,
    /// Parked at or before: RFC 3339, or a duration ago (`10m`).
    until: Option<String>,
    /// Only these stream offsets, comma-separated.
    #[param(pattern = r"^[\s,]*(\+?[0-9]+[\s,]*)*$")]
    offsets: Option<String>,
    #[param(schema_with = resolved_words)]
    resolved: Option<String>,
}

/// One `header` filter as the server reads it: empty (ignored), or a non-empty key, `=` and any
/// value.
#[derive(utoipa::ToSchema)]
#[schema(pattern = r"^(\s*|[^=]+=[\s\S]*)$")]
#[expect(dead_code, reason = "describes the query parse_query reads")]
pub(crate) struct HeaderFilter(String);

/// `resolved`'s words, as [`parse_query`] reads them (`""` is one, which a derived enum cannot
/// name).
fn resolved_words() -> utoipa::openapi::Object {
    let mut schema = crate::model::words_schema(["include", "true", "yes", "on", "false", "no", "off", ""]);
    schema.description = Some(
        "`include` (or `true`, `yes`, `on`): replayed and discarded entries too, with their resolution; \
         `false`, `no`, `off` or empty: unresolved ones only (the default)"
            .into(),
    );
    schema
}

/// The paging of a listing's query, as [`parse_query`] reads it: for the description only.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[expect(dead_code, reason = "describes the query parse_query reads")]
pub(crate) struct PageParams {
    /// Newest matches to skip.
    #[param(minimum = 0, default = 0)]
    offset: Option<u64>,
    /// Entries to return (at most `MAX_PAGE_SIZE`).
    #[param(minimum = 0)]
    limit: Option<u64>,
}

/// Parses a listing's query parameters: `destination`, `reason`, `message_id`,
/// `correlation_id`, `header` (`key=value`, repeatable), `body`, `since`, `until` (RFC 3339 or
/// a duration ago), `offset`, `limit`, `resolved` (`include`). Empty values of the filter's
/// fields and of `resolved` are ignored, as a form submits every field; an empty `offset` or
/// `limit` (which no form has) is refused like any other that is not a whole number.
pub fn parse_query(pairs: &[(String, String)], now_ms: u64) -> Result<ListQuery, ParkingError> {
    let mut input = FilterInput::default();
    let mut page = PageRequest {
        offset: 0,
        limit: DEFAULT_PAGE_SIZE,
    };
    let mut entries = Entries::Unresolved;
    let number = |key: &str, value: &str| {
        whole_number(value).ok_or_else(|| ParkingError::Invalid(format!("{key} must be a whole number, got {value:?}")))
    };
    for (key, raw) in pairs {
        let value = raw.trim();
        let paging = matches!(key.as_str(), "offset" | "limit");
        if (value.is_empty() && !paging) || input.set(key, value)? {
            continue;
        }
        match key.as_str() {
            // as written: the description's integer has no sign and no blanks
            "offset" => page.offset = number(key, raw)?,
            "limit" => page.limit = number(key, raw)?,
            "resolved" => {
                entries = match value {
                    "include" | "true" | "yes" | "on" => Entries::All,
                    "false" | "no" | "off" => Entries::Unresolved,
                    other => {
                        return Err(ParkingError::Invalid(format!(
                            "resolved is include (or true, yes, on) or false (no, off), got {other:?}"
                        )));
                    }
                }
            }
            other => return Err(ParkingError::Invalid(format!("unknown query parameter {other:?}"))),
        }
    }
    if page.limit > MAX_PAGE_SIZE {
        return Err(ParkingError::Invalid(format!(
            "limit is {}; at most {MAX_PAGE_SIZE}",
            page.limit
        )));
    }
    Ok(ListQuery {
        filter: input.build(now_ms)?.with_entries(entries),
        page,
    })
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

/// Every error under `/api`.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct ErrorBody {
    /// What went wrong, for a person.
    pub(crate) error: String,
}

pub(crate) use responses::{BadRequest, Conflict, Internal, NotFound, Unavailable};

/// The error answers the handlers describe: types for the description, never built (an
/// [`ApiError`] is).
mod responses {
    #![expect(dead_code, reason = "the description reads their types, nothing builds them")]

    /// A path parameter, query or body that does not parse or is not allowed.
    #[derive(utoipa::ToResponse)]
    pub(crate) struct BadRequest(super::ErrorBody);

    /// No such ladder, entry, job or route.
    #[derive(utoipa::ToResponse)]
    pub(crate) struct NotFound(super::ErrorBody);

    /// Another replay or discard of the ladder runs, or the destination is not held.
    #[derive(utoipa::ToResponse)]
    pub(crate) struct Conflict(super::ErrorBody);

    /// A record in the stream does not decode.
    #[derive(utoipa::ToResponse)]
    pub(crate) struct Internal(super::ErrorBody);

    /// The broker is unreachable or did not answer in time.
    #[derive(utoipa::ToResponse)]
    pub(crate) struct Unavailable(super::ErrorBody);
}

impl ApiError {
    /// An error answered with `status`.
    pub(crate) fn new(status: StatusCode, text: String) -> Self {
        ApiError(status, text)
    }

    /// The HTTP status for a parking-lot error.
    pub fn status(e: &ParkingError) -> StatusCode {
        Self::status_of(e.kind())
    }

    /// The HTTP status for a kind of failure.
    pub fn status_of(kind: ErrorKind) -> StatusCode {
        match kind {
            ErrorKind::Caller => StatusCode::BAD_REQUEST,
            ErrorKind::Missing => StatusCode::NOT_FOUND,
            ErrorKind::Conflict => StatusCode::CONFLICT,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
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
        let mut response = (self.0, Json(ErrorBody { error: self.1 })).into_response();
        if self.0 == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// The most of an error response's text [`json_errors`] reads to rewrap it (axum's rejections
/// are a line; anything longer is cut).
const MAX_ERROR_TEXT: usize = 16 * 1024;

/// Whether `path` is the JSON API's, whose every error [`json_errors`] makes JSON.
pub(crate) fn is_api_path(path: &str) -> bool {
    path == "/api" || path.starts_with("/api/")
}

/// Middleware: an error answered under `/api` that is not JSON yet becomes `{"error": "..."}`
/// with the same status and headers. That is the router's 404 and 405 (axum adds `Allow` after
/// this layer), or a rejection of any inner layer.
/// A 422 becomes 400: the API answers every request it cannot read with 400
/// (`docs/src/reference/http-api.md`). Other paths (the web page, health, metrics) are left alone.
pub(crate) async fn json_errors(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    if !is_api_path(request.uri().path()) {
        return next.run(request).await;
    }
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let response = next.run(request).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, MAX_ERROR_TEXT)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let message = match status {
        StatusCode::NOT_FOUND if text.is_empty() => format!("no such resource: {method} {path}"),
        // axum adds `Allow` after this layer has run
        StatusCode::METHOD_NOT_ALLOWED => format!("method {method} is not allowed on {path} (see Allow)"),
        _ if text.is_empty() => status.canonical_reason().unwrap_or("error").to_lowercase(),
        _ => lowercase_first(&text),
    };
    parts.status = if status == StatusCode::UNPROCESSABLE_ENTITY {
        StatusCode::BAD_REQUEST
    } else {
        status
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    let body = serde_json::to_vec(&ErrorBody { error: message }).unwrap_or_default();
    Response::from_parts(parts, axum::body::Body::from(body))
}

/// `Failed to parse …` as `failed to parse …`: error messages start lowercase (STYLE.md),
/// axum's do not.
fn lowercase_first(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) if !chars.as_str().starts_with(|c: char| c.is_uppercase()) => {
            first.to_lowercase().chain(chars).collect()
        }
        _ => text.to_string(),
    }
}

/// A JSON request body whose rejections are [`ApiError`]s: not JSON, or not the fields and
/// types the request takes → 400; no `Content-Type: application/json` → 415; too large → 413.
pub(crate) struct ApiJson<T>(pub(crate) T);

impl<S, T> axum::extract::FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: serde::de::DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        use axum::extract::rejection::JsonRejection;
        match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => Ok(ApiJson(value)),
            Err(JsonRejection::JsonDataError(e)) => Err(ApiError(
                StatusCode::BAD_REQUEST,
                format!("the body is not a valid request: {}", source_text(&e)),
            )),
            Err(JsonRejection::JsonSyntaxError(e)) => Err(ApiError(
                StatusCode::BAD_REQUEST,
                format!("the body is not JSON: {}", source_text(&e)),
            )),
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "the body must be JSON, with Content-Type: application/json".into(),
            )),
            Err(other) => Err(ApiError(other.status(), lowercase_first(&other.body_text()))),
        }
    }
}

/// The innermost error's text (axum wraps serde's in a sentence of its own).
fn source_text(error: &dyn std::error::Error) -> String {
    let mut innermost = error;
    while let Some(source) = innermost.source() {
        innermost = source;
    }
    innermost.to_string()
}

/// A path parameter that is a whole number ([`whole_number`]); refused as
/// "`{key}` must be a whole number" by [`ApiPath`].
fn path_number<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    // refused inside the visitor, where axum's path deserializer names the key and the value
    struct Digits;
    impl serde::de::Visitor<'_> for Digits {
        type Value = u64;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a whole number")
        }
        fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<u64, E> {
            whole_number(text).ok_or_else(|| E::custom("not a whole number"))
        }
    }
    deserializer.deserialize_str(Digits)
}

/// Path parameters whose rejections are [`ApiError`]s: a non-numeric offset or job id is 400.
pub(crate) struct ApiPath<T>(pub(crate) T);

impl<S, T> axum::extract::FromRequestParts<S> for ApiPath<T>
where
    S: Send + Sync,
    T: serde::de::DeserializeOwned + Send,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        use axum::extract::path::ErrorKind as PathError;
        use axum::extract::rejection::PathRejection;
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(value)) => Ok(ApiPath(value)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => {
                let message = match e.kind() {
                    PathError::ParseErrorAtKey { key, value, .. } | PathError::DeserializeError { key, value, .. } => {
                        format!("{key} must be a whole number, got {value:?}")
                    }
                    PathError::InvalidUtf8InPathParam { key } => format!("{key} is not UTF-8"),
                    _ => lowercase_first(&e.body_text()),
                };
                Err(ApiError(e.status(), message))
            }
            Err(other) => Err(ApiError(other.status(), lowercase_first(&other.body_text()))),
        }
    }
}

/// The query string as pairs, whose rejection (not `application/x-www-form-urlencoded`) is an
/// [`ApiError`].
pub(crate) struct ApiQuery(pub(crate) Vec<(String, String)>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for ApiQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        match Query::<Vec<(String, String)>>::from_request_parts(parts, state).await {
            Ok(Query(pairs)) => Ok(ApiQuery(pairs)),
            Err(e) => Err(ApiError(
                StatusCode::BAD_REQUEST,
                format!("the query string does not parse: {}", source_text(&e)),
            )),
        }
    }
}

/// `{ladder}` in a path.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub(crate) struct LadderPath {
    /// The ladder's name (its file stem).
    pub(crate) ladder: String,
}

/// `{ladder}/parked/{offset}` in a path.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub(crate) struct EntryPath {
    /// The ladder's name (its file stem).
    ladder: String,
    /// The entry's stream offset.
    #[serde(deserialize_with = "path_number")]
    offset: u64,
}

/// `{ladder}/parked/jobs/{id}` in a path.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
pub(crate) struct JobPath {
    /// The ladder's name (its file stem).
    ladder: String,
    /// The job's id.
    #[serde(deserialize_with = "path_number")]
    id: u64,
}

/// The listing's answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct ListView {
    total: u64,
    entries: Vec<ParkedEntry>,
    /// How far this replica's index has read the stream.
    indexed_entries: usize,
    next_offset: Option<u64>,
    /// Whether this replica's index has read the whole stream yet (counts are partial until).
    caught_up: bool,
}

/// A page of parked entries matching the filters, newest first.
#[utoipa::path(
    get,
    path = "/api/ladders/{ladder}/parked",
    operation_id = "listParked",
    params(LadderPath, FilterParams, PageParams),
    responses(
        (status = 200, description = "the page and how many match", body = ListView),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn list(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(LadderPath { ladder }): ApiPath<LadderPath>,
    ApiQuery(pairs): ApiQuery,
) -> Result<Json<ListView>, ApiError> {
    let q = parse_query(&pairs, crate::clock::now_ms())?;
    let Page { total, entries } = state.desk.list(&ladder, &q.filter, q.page).await?;
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
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct CountsView {
    #[serde(flatten)]
    counts: Counts,
    /// How far this replica's index has read the stream.
    indexed_entries: usize,
    /// Whether this replica's index has read the whole stream yet (counts are partial until).
    caught_up: bool,
}

/// How many entries match, in all, per reason and per destination.
///
/// The listing's filters; `offset` and `limit` do not apply.
#[utoipa::path(
    get,
    path = "/api/ladders/{ladder}/parked/counts",
    operation_id = "countParked",
    params(LadderPath, FilterParams),
    responses(
        (status = 200, description = "the counts, largest first", body = CountsView),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn counts(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(LadderPath { ladder }): ApiPath<LadderPath>,
    ApiQuery(pairs): ApiQuery,
) -> Result<Json<CountsView>, ApiError> {
    let q = parse_query(&pairs, crate::clock::now_ms())?;
    let counts = state.desk.counts(&ladder, &q.filter).await?;
    let status = state.desk.status(&ladder)?;
    Ok(Json(CountsView {
        counts,
        indexed_entries: status.entries,
        caught_up: status.caught_up,
    }))
}

/// One entry in full.
#[utoipa::path(
    get,
    path = "/api/ladders/{ladder}/parked/{offset}",
    operation_id = "showParked",
    params(EntryPath),
    responses(
        (status = 200, description = "the entry", body = ParkedEntry),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn show(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(EntryPath { ladder, offset }): ApiPath<EntryPath>,
) -> Result<Json<ParkedEntry>, ApiError> {
    Ok(Json(state.desk.show(&ladder, offset).await?))
}

/// The original body of one entry, as bytes.
///
/// From its envelope, or read back from the stream when it was stored apart.
#[utoipa::path(
    get,
    path = "/api/ladders/{ladder}/parked/{offset}/body",
    operation_id = "parkedBody",
    params(EntryPath),
    responses(
        (status = 200, description = "the body", body = String, content_type = "application/octet-stream"),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn body(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(EntryPath { ladder, offset }): ApiPath<EntryPath>,
) -> Result<axum::response::Response, ApiError> {
    let entry = state.desk.show(&ladder, offset).await?;
    let bytes = entry.body().map_err(ParkingError::from)?.into_owned();
    Ok(([(axum::http::header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
}

/// `POST …/replay` and `POST …/discard`: which entries (offsets, filter fields, or both — both
/// narrow), and how. Every field is named here, so a misspelt one is refused rather than
/// ignored (an ignored `destinaton` would widen the selection).
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ActionRequest {
    /// Only these stream offsets.
    #[serde(default)]
    offsets: Vec<u64>,
    /// The queue it was headed for.
    #[serde(default)]
    destination: Option<String>,
    /// The parking reason.
    #[serde(default)]
    reason: Option<String>,
    /// The original message id.
    #[serde(default)]
    message_id: Option<String>,
    /// The original correlation id.
    #[serde(default)]
    correlation_id: Option<String>,
    /// Original headers' text values; all must match.
    #[serde(default)]
    headers: BTreeMap<String, String>,
    /// A substring of the (UTF-8) body.
    #[serde(default)]
    body_contains: Option<String>,
    /// Parked at or after: RFC 3339, or a duration ago (`2h`).
    #[serde(default)]
    since: Option<String>,
    /// Parked at or before: RFC 3339, or a duration ago (`10m`).
    #[serde(default)]
    until: Option<String>,
    /// Replay only: another queue to send to; it must pass the ladder's allow list.
    #[serde(default)]
    to: Option<String>,
    /// Replay only: at most this many per second, minute or hour (`50/s`).
    #[serde(default)]
    rate: Option<String>,
    /// Replay only: say what would be replayed.
    #[serde(default)]
    dry_run: bool,
    /// How long the request waits for the job before answering 202, a duration (at most
    /// `JOB_WAIT`, the default).
    #[serde(default)]
    wait: Option<String>,
}

impl ActionRequest {
    fn filter(&mut self) -> Result<Filter, ParkingError> {
        let input = FilterInput {
            offsets: std::mem::take(&mut self.offsets),
            destination: self.destination.take(),
            reason: self.reason.take(),
            message_id: self.message_id.take(),
            correlation_id: self.correlation_id.take(),
            headers: std::mem::take(&mut self.headers).into_iter().collect(),
            body_contains: self.body_contains.take(),
            since: self.since.take(),
            until: self.until.take(),
        };
        Ok(input.build(crate::clock::now_ms())?)
    }
}

/// The `wait` of a request: a duration up to [`JOB_WAIT`] (longer waits are cut to it).
fn job_wait(wait: Option<&str>) -> Result<std::time::Duration, ParkingError> {
    match wait {
        None => Ok(JOB_WAIT),
        Some(w) => humantime::parse_duration(w)
            .map(|w| w.min(JOB_WAIT))
            .map_err(|e| ParkingError::Invalid(format!("wait {w:?} is not a duration like \"5s\": {e}"))),
    }
}

/// The token of an `Authorization` value in the `Bearer` scheme, whose name is case-insensitive
/// (RFC 9110 §11.1): `Bearer t`, `bearer t`, `BEARER  t`.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// The caller's name from `Authorization: Bearer <token>`, or the refusal (logged).
pub(crate) fn caller(state: &AdminState, headers: &HeaderMap, ladder: &str, what: &str) -> Result<String, ApiError> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(|v| bearer_token(v).unwrap_or(""));
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

/// How long a replay or discard request waits for its job: one that ends sooner is answered
/// with its outcomes (200); a longer one with `202 Accepted` and its job, to follow at
/// `…/parked/jobs/{id}`. The job runs to its end either way.
pub const JOB_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// The answer for a job after waiting for it: its outcomes when it ended, its error when it
/// failed as a whole, else 202 with where it is.
async fn job_response(state: &AdminState, job: &Job, wait: std::time::Duration) -> Result<Response, ApiError> {
    let view = state.desk.wait(job, wait).await;
    if let (Some(kind), Some(error)) = (view.failure, &view.error) {
        return Err(ApiError(ApiError::status_of(kind), error.clone()));
    }
    let status = if view.done {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    let location = format!("/api/ladders/{}/parked/jobs/{}", view.ladder, view.id);
    let mut response = (status, Json(JobAnswer::from(view))).into_response();
    if let Ok(value) = header::HeaderValue::from_str(&location) {
        response.headers_mut().insert(header::LOCATION, value);
    }
    Ok(response)
}

/// A job as the API answers it: its view, plus `job` and `status` links.
#[derive(Serialize, utoipa::ToSchema)]
struct JobAnswer {
    /// The job's id.
    job: u64,
    /// The job's URL, to poll.
    status: String,
    #[serde(flatten)]
    view: JobView,
}

impl From<JobView> for JobAnswer {
    fn from(view: JobView) -> Self {
        JobAnswer {
            job: view.id,
            status: format!("/api/ladders/{}/parked/jobs/{}", view.ladder, view.id),
            view,
        }
    }
}

/// One job, running or among the last `JOBS_KEPT` ended.
#[utoipa::path(
    get,
    path = "/api/ladders/{ladder}/parked/jobs/{id}",
    operation_id = "showJob",
    params(JobPath),
    responses(
        (status = 200, description = "the job", body = JobView),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
    ),
)]
pub(crate) async fn job(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(JobPath { ladder, id }): ApiPath<JobPath>,
) -> Result<Json<JobView>, ApiError> {
    Ok(Json(state.desk.job(&ladder, id)?))
}

/// This server's replays and discards of the ladder, newest first (running, and the last ended).
#[utoipa::path(
    get,
    path = "/api/ladders/{ladder}/parked/jobs",
    operation_id = "listJobs",
    params(LadderPath),
    responses(
        (status = 200, description = "the jobs", body = Vec<JobView>),
        (status = 404, response = NotFound),
    ),
)]
pub(crate) async fn jobs(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(LadderPath { ladder }): ApiPath<LadderPath>,
) -> Result<Json<Vec<JobView>>, ApiError> {
    state.desk.status(&ladder)?;
    Ok(Json(state.desk.jobs(&ladder)))
}

/// Republish the selected unresolved entries to their queue (or `to`), as a job.
#[utoipa::path(
    post,
    path = "/api/ladders/{ladder}/parked/replay",
    operation_id = "replayParked",
    params(LadderPath),
    request_body = ActionRequest,
    security(("token" = [])),
    responses(
        (status = 200, description = "the job ended: every outcome", body = JobAnswer),
        (status = 202, description = "the job runs on: follow it at `Location` (also `status`)", body = JobAnswer,
            headers(("Location" = String, description = "the job's URL"))),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 409, response = Conflict),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn replay(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(LadderPath { ladder }): ApiPath<LadderPath>,
    headers: HeaderMap,
    ApiJson(mut request): ApiJson<ActionRequest>,
) -> Result<Response, ApiError> {
    let by = caller(&state, &headers, &ladder, "replay")?;
    let options = ReplayOptions {
        to: request.to.take().filter(|t| !t.is_empty()),
        rate: request
            .rate
            .take()
            .map(|r| r.parse())
            .transpose()
            .map_err(ParkingError::from)?,
        dry_run: request.dry_run,
        by,
        edit: None,
    };
    let wait = job_wait(request.wait.as_deref())?;
    let filter = request.filter()?;
    let job = state.desk.replay(&ladder, filter, options)?;
    job_response(&state, &job, wait).await
}

/// Mark the selected unresolved entries as discarded, as a job.
#[utoipa::path(
    post,
    path = "/api/ladders/{ladder}/parked/discard",
    operation_id = "discardParked",
    params(LadderPath),
    request_body = ActionRequest,
    security(("token" = [])),
    responses(
        (status = 200, description = "the job ended: every outcome", body = JobAnswer),
        (status = 202, description = "the job runs on: follow it at `Location` (also `status`)", body = JobAnswer,
            headers(("Location" = String, description = "the job's URL"))),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 409, response = Conflict),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn discard(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(LadderPath { ladder }): ApiPath<LadderPath>,
    headers: HeaderMap,
    ApiJson(mut request): ApiJson<ActionRequest>,
) -> Result<Response, ApiError> {
    let by = caller(&state, &headers, &ladder, "discard")?;
    if request.to.is_some() || request.rate.is_some() || request.dry_run {
        return Err(ParkingError::Invalid("to, rate and dry_run are for a replay; a discard takes none".into()).into());
    }
    let wait = job_wait(request.wait.as_deref())?;
    let filter = request.filter()?;
    let job = state.desk.discard(&ladder, filter, by)?;
    job_response(&state, &job, wait).await
}

/// `POST …/parked/{offset}/edit-replay`: what to change before replaying one entry. Every
/// field is named, so a misspelt one is refused rather than ignored.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct EditRequest {
    /// The headers to replay with, replacing the original's, in the envelope's typed form
    /// (what `GET …/parked/{offset}` shows under `envelope.message.properties.headers`): an
    /// object of `{"type", "value"}` (or an array of `[key, value]` pairs).
    #[serde(default)]
    #[schema(schema_with = typed_headers)]
    pub(crate) headers: Option<Value>,
    /// Headers to set to a text value (after `headers`).
    #[serde(default)]
    pub(crate) set_headers: BTreeMap<String, String>,
    /// The body to replay with, as UTF-8 text.
    #[serde(default)]
    pub(crate) body: Option<String>,
    /// The body to replay with, as standard base64 (for bytes that are not text).
    #[serde(default)]
    pub(crate) body_base64: Option<String>,
    /// Another queue to send to.
    #[serde(default)]
    pub(crate) to: Option<String>,
    /// How long to wait for the job before answering 202.
    #[serde(default)]
    pub(crate) wait: Option<String>,
}

/// An object or an array, or null.
fn typed_headers() -> utoipa::openapi::Object {
    use utoipa::openapi::schema::{SchemaType, Type};
    utoipa::openapi::ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Object, Type::Array, Type::Null]))
        .build()
}

impl EditRequest {
    /// The edit asked for, checked for form (its values are checked against the entry by
    /// [`check_edit`]).
    pub(crate) fn edit(&self, max_header_bytes: usize) -> Result<Edit, ParkingError> {
        let headers = self
            .headers
            .as_ref()
            .map(crate::model::envelope::table_from_json)
            .transpose()
            .map_err(|e| ParkingError::Invalid(format!("headers: {e}")))?;
        let body = match (&self.body, &self.body_base64) {
            (Some(_), Some(_)) => {
                return Err(ParkingError::Invalid("give body or body_base64, not both".into()));
            }
            (Some(text), None) => Some(text.as_bytes().to_vec()),
            (None, Some(b64)) => Some(
                base64::engine::general_purpose::STANDARD
                    .decode(b64.trim())
                    .map_err(|e| ParkingError::Invalid(format!("body_base64 is not base64: {e}")))?,
            ),
            (None, None) => None,
        };
        Ok(Edit {
            headers,
            set_headers: self.set_headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            body,
            max_header_bytes,
        })
    }
}

/// Checks an edit of entry `offset` before a job is started, so a mistake is answered at once
/// (400) rather than as a failed job. The entry must exist, be unresolved and have decoded
/// properties; the edit must apply within the limits; and the ladder must allow the queue it
/// would go to (`to`, else a `retry-to` the edit sets, else the recorded destination).
pub(crate) async fn check_edit(
    state: &AdminState,
    ladder: &str,
    offset: u64,
    to: Option<&str>,
    edit: &Edit,
) -> Result<(), ParkingError> {
    let entry = state.desk.show(ladder, offset).await?;
    if let Some(r) = &entry.resolution {
        return Err(ParkingError::Invalid(format!(
            "entry {offset} is already resolved ({} by {}); an edit replays unresolved entries only",
            match r.action {
                crate::model::lot::record::Action::Replayed => "replayed",
                crate::model::lot::record::Action::Discarded => "discarded",
            },
            r.by
        )));
    }
    let properties = match entry.envelope.message.stored_properties()? {
        crate::model::envelope::StoredProperties::Decoded(p) => p,
        crate::model::envelope::StoredProperties::Raw(_) => {
            return Err(ParkingError::Invalid(
                "this entry's properties did not decode, so they cannot be edited; replay it unedited".into(),
            ));
        }
    };
    let headers = properties.headers.clone().unwrap_or_default();
    let (edited, _, _) = edit
        .apply(&headers, &entry.body()?)
        .map_err(|e| ParkingError::Invalid(e.0))?;
    let spec = state
        .config
        .ladders
        .iter()
        .find(|l| l.name == ladder)
        .ok_or_else(|| ParkingError::UnknownLadder(ladder.to_string()))?;
    let edited_to = crate::model::lot::edit::new_destination(&headers, &edited);
    let target = to
        .map(str::to_string)
        .or(edited_to)
        .or(entry.envelope.destination.clone());
    let Some(queue) = target else {
        return Err(ParkingError::Invalid(
            "no destination is recorded; give another queue (to)".into(),
        ));
    };
    let names = crate::model::names::Names::new(&state.config.namespace, ladder);
    if let Some(problem) = crate::model::protocol::refuse_destination(spec, &names, &queue) {
        return Err(ParkingError::Invalid(problem));
    }
    Ok(())
}

/// Change one unresolved entry's headers or body, then republish it; the entry keeps the original.
///
/// `headers` replaces the original's (in the envelope's typed form, as `GET …/parked/{offset}`
/// shows them), then `set_headers` sets text values; `body` (text) or `body_base64` replaces the
/// body. The edit must change something, keep the headers within `limits.max_header_bytes` and
/// send the message to a queue the ladder allows (`to`, else a `retry-to` the edit sets, else the
/// recorded destination); else 400 with the reason, before anything is sent. The entry is
/// resolved as replayed, and its resolution's `edit` names the header keys added, removed and
/// changed, and the body's length and SHA-256 before and after.
#[utoipa::path(
    post,
    path = "/api/ladders/{ladder}/parked/{offset}/edit-replay",
    operation_id = "editReplayParked",
    params(EntryPath),
    request_body = EditRequest,
    security(("token" = [])),
    responses(
        (status = 200, description = "the job ended: every outcome", body = JobAnswer),
        (status = 202, description = "the job runs on: follow it at `Location` (also `status`)", body = JobAnswer,
            headers(("Location" = String, description = "the job's URL"))),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 409, response = Conflict),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn edit_replay(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(EntryPath { ladder, offset }): ApiPath<EntryPath>,
    headers: HeaderMap,
    ApiJson(request): ApiJson<EditRequest>,
) -> Result<Response, ApiError> {
    let by = caller(&state, &headers, &ladder, "edit-replay")?;
    let edit = request.edit(state.config.limits.max_header_bytes)?;
    let to = request.to.clone().filter(|t| !t.is_empty());
    let wait = job_wait(request.wait.as_deref())?;
    check_edit(&state, &ladder, offset, to.as_deref(), &edit).await?;
    let options = ReplayOptions {
        to,
        rate: None,
        dry_run: false,
        by,
        edit: Some(edit),
    };
    let filter = Filter {
        offsets: Some([offset].into()),
        ..Filter::default()
    };
    let job = state.desk.replay(&ladder, filter, options)?;
    job_response(&state, &job, wait).await
}

/// `POST …/scheduled/cancel`: which message id.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CancelRequest {
    /// The scheduled message's id.
    #[schema(min_length = 1, max_length = 255)]
    message_id: String,
}

/// A recorded cancellation, as the API answers it.
#[derive(Serialize, utoipa::ToSchema)]
pub(crate) struct CancelAnswer {
    ladder: String,
    message_id: String,
    by: String,
    at_ms: u64,
    until_ms: u64,
}

/// Cancel a scheduled delivery by message id, for every replica.
///
/// Records the cancellation in the ladder's stream `N.L.cancels`: a message with this id that is
/// still waiting is parked as `cancelled` when it is next handled (at the latest when due)
/// instead of delivered. Answered once the broker confirmed the record. The ladder must have
/// `exact_delays`.
#[utoipa::path(
    post,
    path = "/api/ladders/{ladder}/scheduled/cancel",
    operation_id = "cancelScheduled",
    params(LadderPath),
    request_body = CancelRequest,
    security(("token" = [])),
    responses(
        (status = 200, description = "the cancellation is recorded", body = CancelAnswer),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn cancel(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(LadderPath { ladder }): ApiPath<LadderPath>,
    headers: HeaderMap,
    ApiJson(request): ApiJson<CancelRequest>,
) -> Result<Json<CancelAnswer>, ApiError> {
    let by = caller(&state, &headers, &ladder, "cancel")?;
    let record = state.desk.cancel(&ladder, &request.message_id, &by).await?;
    Ok(Json(CancelAnswer {
        ladder,
        message_id: record.message_id,
        by: record.by,
        at_ms: record.at_ms,
        until_ms: record.until_ms,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The query the description names ([`FilterParams`], [`PageParams`]) is the query
    /// [`parse_query`] reads: each named parameter is taken, with a value of its schema, and a
    /// name it does not give is refused.
    #[test]
    fn the_described_query_is_the_query_parse_query_reads() {
        let description = crate::admin::openapi::description(&[]);
        let parameters = description["paths"]["/api/ladders/{ladder}/parked"]["get"]["parameters"]
            .as_array()
            .expect("the listing's parameters");
        let mut named = vec![];
        for parameter in parameters.iter().filter(|p| p["in"] == "query") {
            let name = parameter["name"].as_str().unwrap().to_string();
            let value = match name.as_str() {
                "header" => "tenant=t1",
                "since" | "until" => "2h",
                "offsets" => "1,2",
                "resolved" => "include",
                "offset" | "limit" => "5",
                _ => "x",
            };
            let parsed = parse_query(&[(name.clone(), value.to_string())], 1_000_000_000_000);
            assert!(parsed.is_ok(), "{name}={value}: {parsed:?}");
            named.push(name);
        }
        assert_eq!(named.len(), 12, "{named:?}");
        let unknown = parse_query(&[("destinaton".into(), "x".into())], 0);
        assert!(unknown.is_err(), "a name the description does not give is refused");
    }

    #[test]
    fn the_bearer_scheme_is_matched_in_any_case() {
        for value in ["Bearer abc", "bearer abc", "BEARER  abc", " Bearer abc "] {
            assert_eq!(bearer_token(value), Some("abc"), "{value:?}");
        }
        for value in ["Basic abc", "Bearerabc", "abc", ""] {
            assert_eq!(bearer_token(value), None, "{value:?}");
        }
    }

    #[test]
    fn a_misspelt_selection_field_is_refused_not_ignored() {
        // ignored, `destinaton` would replay every entry of the reason, to any queue
        let typo = serde_json::from_str::<ActionRequest>(r#"{"reason": "no-route", "destinaton": "orders"}"#);
        assert!(typo.unwrap_err().to_string().contains("destinaton"));
        let mut ok: ActionRequest =
            serde_json::from_str(r#"{"reason": "no-route", "headers": {"tenant": "t1"}, "rate": "5/s", "wait": "1s"}"#)
                .unwrap();
        let filter = ok.filter().unwrap();
        assert_eq!(filter.reason.as_deref(), Some("no-route"));
        assert_eq!(filter.headers, [("tenant".to_string(), "t1".to_string())]);
        assert_eq!(ok.rate.as_deref(), Some("5/s"));
        assert_eq!(job_wait(ok.wait.as_deref()).unwrap(), std::time::Duration::from_secs(1));
        assert_eq!(job_wait(Some("1h")).unwrap(), JOB_WAIT, "a wait is cut to JOB_WAIT");
        assert!(job_wait(Some("soon")).is_err());
    }

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
        assert_eq!(q.filter.entries, Entries::All);
        let empty = parse_query(&[], 0).unwrap();
        assert!(empty.filter.is_empty() && empty.filter.entries == Entries::Unresolved);
        assert_eq!(empty.page.limit, DEFAULT_PAGE_SIZE);
    }

    #[test]
    fn bad_queries_say_what_is_wrong() {
        let bad = |list: &[(&str, &str)]| parse_query(&pairs(list), 0).unwrap_err().to_string();
        assert!(bad(&[("limit", "lots")]).contains("limit"));
        assert!(
            bad(&[("limit", "")]).contains("whole number"),
            "an empty limit is no number"
        );
        assert!(bad(&[("offset", " ")]).contains("whole number"));
        // digits only, as the description's integer: no sign, no blanks around it
        for written in ["+5", " 5", "5 ", "-0", "5.0", "0x5"] {
            assert!(
                bad(&[("limit", written)]).contains("limit must be a whole number"),
                "{written:?}"
            );
            assert!(
                bad(&[("offset", written)]).contains("offset must be a whole number"),
                "{written:?}"
            );
        }
        let fine = parse_query(&pairs(&[("offset", "007"), ("limit", "0")]), 0).unwrap();
        assert_eq!((fine.page.offset, fine.page.limit), (7, 0));
        assert!(bad(&[("limit", "5000")]).contains("at most 1000"));
        assert!(bad(&[("header", "novalue")]).contains("key=value"));
        assert!(bad(&[("since", "yesterday-ish")]).contains("RFC 3339"));
        assert!(bad(&[("colour", "red")]).contains("unknown query parameter"));
    }

    /// A router for one ladder `orders` with no broker behind it: what is refused before the
    /// broker is asked.
    fn router() -> (tempfile::TempDir, axum::Router) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ladder.toml"), "namespace = \"ns\"\n").unwrap();
        std::fs::create_dir(dir.path().join("ladders")).unwrap();
        std::fs::write(
            dir.path().join("ladders/orders.toml"),
            "backoff = [\"1s\"]\nallow = [\"^orders$\"]\n",
        )
        .unwrap();
        let config = crate::config::load(&dir.path().join("ladder.toml"), &std::collections::HashMap::new()).unwrap();
        let (_, snapshots) = tokio::sync::watch::channel(None);
        let state = Arc::new(AdminState::new(
            Arc::new(config),
            Arc::new(crate::broker::state::State::default()),
            snapshots,
        ));
        (dir, crate::admin::router::router(state))
    }

    /// `(status, Allow, the error text)` of a request whose answer must be `{"error": "..."}`.
    async fn refused(method: &str, uri: &str, content_type: Option<&str>, body: &str) -> (StatusCode, String, String) {
        use tower::ServiceExt;
        let (_dir, router) = router();
        let mut request = axum::http::Request::builder().method(method).uri(uri);
        if let Some(content_type) = content_type {
            request = request.header(header::CONTENT_TYPE, content_type);
        }
        let request = request.body(axum::body::Body::from(body.to_string())).unwrap();
        let response = router.oneshot(request).await.unwrap();
        let status = response.status();
        let allow = response
            .headers()
            .get(header::ALLOW)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        assert_eq!(
            response.headers().get(header::CONTENT_TYPE).unwrap(),
            "application/json",
            "{method} {uri}"
        );
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let object = value.as_object().unwrap();
        assert_eq!(object.len(), 1, "{method} {uri}: only \"error\": {value}");
        let text = object["error"].as_str().unwrap().to_string();
        assert!(
            text.starts_with(|c: char| !c.is_uppercase()),
            "{method} {uri}: errors start lowercase: {text}"
        );
        (status, allow, text)
    }

    #[tokio::test]
    async fn every_refusal_under_api_is_json_with_its_documented_status() {
        let replay = "/api/ladders/orders/parked/replay";
        let json = Some("application/json");
        let (status, _, text) = refused("POST", replay, json, "{\"destination\": ").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "malformed JSON: {text}");
        assert!(text.starts_with("the body is not JSON"), "{text}");
        let (status, _, text) = refused("POST", replay, json, r#"{"offsets": ["seven"]}"#).await;
        assert_eq!(
            status,
            StatusCode::BAD_REQUEST,
            "a wrongly typed field is 400, not 422: {text}"
        );
        assert!(text.contains("invalid type"), "{text}");
        let (status, _, text) = refused("POST", replay, json, r#"{"destinaton": "orders"}"#).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        assert!(text.contains("unknown field `destinaton`"), "{text}");
        let (status, _, text) = refused("POST", replay, None, r#"{"destination": "orders"}"#).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{text}");
        let (status, _, text) = refused("POST", replay, Some("text/plain"), r#"{"reason": "x"}"#).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{text}");
        let (status, _, text) = refused("GET", "/api/ladders/orders/parked/seven", None, "").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        assert_eq!(text, "offset must be a whole number, got \"seven\"");
        let (status, _, text) = refused("GET", "/api/ladders/orders/parked/%2B7", None, "").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        assert_eq!(text, "offset must be a whole number, got \"+7\"");
        let (status, _, text) = refused("GET", "/api/ladders/orders/parked/7/body/more", None, "").await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{text}");
        assert_eq!(text, "no such resource: GET /api/ladders/orders/parked/7/body/more");
        let (status, _, _) = refused("GET", "/api/nothing", None, "").await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (status, allow, text) = refused("DELETE", "/api/ladders/orders/parked/7", None, "").await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{text}");
        assert!(allow.contains("GET"), "{allow}");
        assert!(text.contains("method DELETE is not allowed"), "{text}");
        let (status, allow, _) = refused("GET", replay, None, "").await;
        assert_eq!((status, allow.as_str()), (StatusCode::METHOD_NOT_ALLOWED, "POST"));
        let (status, _, text) = refused("GET", "/api/ladders/orders/parked?limit=-1", None, "").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        let (status, _, text) = refused("GET", "/api/ladders/orders/parked?since=%FF", None, "").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        let (status, _, text) = refused("GET", "/api/ladders/nope/parked/jobs/x", None, "").await;
        assert_eq!(
            (status, text.as_str()),
            (StatusCode::BAD_REQUEST, "id must be a whole number, got \"x\"")
        );
        let (status, _, text) = refused("GET", "/api/ladders/nope/parked/jobs/+3", None, "").await;
        assert_eq!(
            (status, text.as_str()),
            (StatusCode::BAD_REQUEST, "id must be a whole number, got \"+3\"")
        );
    }

    #[tokio::test]
    async fn answers_outside_api_are_left_as_they_are() {
        use tower::ServiceExt;
        let (_dir, router) = router();
        let request = axum::http::Request::builder()
            .uri("/nope")
            .body(axum::body::Body::empty())
            .unwrap();
        let response = router.oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        assert_ne!(
            response
                .headers()
                .get(header::CONTENT_TYPE)
                .map(|v| v.to_str().unwrap()),
            Some("application/json")
        );
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
