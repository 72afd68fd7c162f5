//! Destination holds over HTTP: the JSON API (`/api/ladders/{ladder}/holds`, hold, resume; the
//! actions need a bearer token) and the web page `/ladders/{ladder}/destinations` (held
//! destinations, the busiest this replica saw, hold and resume forms with a token field).
//! Everything goes through the desk's connection; the relay is never waited for.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Form, Path, State as Extract};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::html;
use serde::{Deserialize, Serialize};

use crate::admin::api::{
    ApiError, ApiJson, ApiPath, BadRequest, Conflict, Internal, LadderPath, NotFound, Unavailable, caller,
};
use crate::admin::state::AdminState;
use crate::admin::web::{self, page, segment, take, token_field};
use crate::broker::holds::{HoldError, format_rate};
use crate::clock::now_ms;
use crate::model::holds::{DestinationHold, HoldAction, HoldState};
use crate::model::lot::pace::Rate;
use crate::model::lot::text::format_time;

/// The busiest destinations shown and answered, at most.
pub const BUSIEST: usize = 20;

/// The HTTP status of a failed hold or resume.
fn status(e: &HoldError) -> StatusCode {
    match e {
        HoldError::NotAllowed { .. } | HoldError::Invalid(_) => StatusCode::BAD_REQUEST,
        HoldError::Missing(_) | HoldError::UnknownLadder(_) => StatusCode::NOT_FOUND,
        HoldError::NotHeld(_) => StatusCode::CONFLICT,
        HoldError::Record(_) | HoldError::Broker(_) | HoldError::Declare(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

impl From<HoldError> for ApiError {
    fn from(e: HoldError) -> Self {
        ApiError::new(status(&e), e.to_string())
    }
}

fn hold_states() -> utoipa::openapi::Object {
    crate::model::words_schema(["held", "releasing"])
}

fn recorded_actions() -> utoipa::openapi::Object {
    crate::model::words_schema([HoldAction::Held.code(), HoldAction::Resumed.code()])
}

/// One destination's hold, as the API answers it.
#[derive(Serialize, utoipa::ToSchema)]
pub(crate) struct HoldView {
    destination: String,
    /// `held` or `releasing`.
    #[schema(schema_with = hold_states)]
    state: &'static str,
    by: String,
    why: String,
    held_since_ms: u64,
    changed_at_ms: u64,
    /// Releasing: the rate (`10/s`).
    #[serde(skip_serializing_if = "Option::is_none")]
    rate: Option<String>,
    held_queue: String,
    /// Messages waiting in the held queue (`null` if the broker did not say).
    messages: Option<u32>,
}

/// A destination this replica delivered to or saw failures of, in the breaker's window, or has
/// messages waiting for.
#[derive(Serialize, utoipa::ToSchema)]
pub(crate) struct BusyView {
    destination: String,
    delivered: u64,
    failed: u64,
    /// Messages this replica put into a tier for it that are not due yet (an estimate: see
    /// `model::leaving::DueCounts`).
    waiting: u64,
}

/// One transition, as the stream recorded it.
#[derive(Serialize, utoipa::ToSchema)]
pub(crate) struct TransitionView {
    destination: String,
    /// `held`, `resumed`, `released`, `probed`, `probe_failed` or `deleted`.
    #[schema(schema_with = HoldAction::schema)]
    action: &'static str,
    by: String,
    why: String,
    at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    rate: Option<String>,
}

/// `GET /api/ladders/{ladder}/holds`.
#[derive(Serialize, utoipa::ToSchema)]
pub(crate) struct HoldsAnswer {
    ladder: String,
    holds: Vec<HoldView>,
    busiest: Vec<BusyView>,
    /// The latest transitions, newest first.
    recent: Vec<TransitionView>,
    /// The window `busiest` counts over, ms.
    window_ms: u64,
}

async fn answer(state: &AdminState, ladder: &str) -> Result<HoldsAnswer, HoldError> {
    // the running service's own state when it has read the stream (a read appends nothing);
    // else the stream, read to a marker
    let holds = match state.service.ladder(ladder).filter(|r| r.holds.caught_up()) {
        Some(runtime) => runtime.holds.snapshot(),
        None => state.desk.holds(ladder).await?,
    };
    let names = crate::model::names::Names::new(&state.config.namespace, ladder);
    let mut views = Vec::new();
    for h in holds.all().filter(|h| h.holds_back()) {
        views.push(view(
            h,
            names.held_queue(&h.destination),
            state.desk.held_depth(ladder, &h.destination).await,
        ));
    }
    let (busiest, window_ms) = match state.service.ladder(ladder) {
        Some(runtime) => {
            let mut breaker = runtime.merged_breaker();
            let window = breaker.policy().window.as_millis() as u64;
            (breaker.busiest(now_ms(), BUSIEST), window)
        }
        None => (Vec::new(), 0),
    };
    Ok(HoldsAnswer {
        ladder: ladder.to_string(),
        holds: views,
        busiest: busiest
            .into_iter()
            .map(|b| BusyView {
                destination: b.destination,
                delivered: b.delivered,
                failed: b.failed,
                waiting: b.waiting,
            })
            .collect(),
        recent: holds
            .recent()
            .map(|r| TransitionView {
                destination: r.destination.clone(),
                action: r.action.code(),
                by: r.by.clone(),
                why: r.why.clone(),
                at_ms: r.at_ms,
                rate: r.rate.clone(),
            })
            .collect(),
        window_ms,
    })
}

fn view(h: &DestinationHold, held_queue: String, messages: Option<u32>) -> HoldView {
    HoldView {
        destination: h.destination.clone(),
        state: h.state_code(),
        by: h.by.clone(),
        why: h.why.clone(),
        held_since_ms: h.held_since_ms,
        changed_at_ms: h.changed_at_ms,
        rate: match h.state {
            HoldState::Releasing { rate, .. } => Some(format_rate(rate)),
            _ => None,
        },
        held_queue,
        messages,
    }
}

/// The held (or releasing) destinations, and the busiest this replica saw.
///
/// Read from the ladder's stream `N.L.holds` up to a marker appended first, so a hold recorded
/// through any replica is in the answer. `busiest` is this replica's own count of deliveries and
/// failures back per destination over the breaker's window, and of the messages it put into a
/// tier for the destination that are not due yet (`waiting`; tiers are shared by every
/// destination, so this is counted from due times, in buckets a 32nd of each message's delay
/// wide: a message may count up to ~3% of its delay too long, never too short).
#[utoipa::path(
    get,
    path = "/api/ladders/{ladder}/holds",
    operation_id = "listHolds",
    params(LadderPath),
    responses(
        (status = 200, description = "the holds", body = HoldsAnswer),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn list(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(LadderPath { ladder }): ApiPath<LadderPath>,
) -> Result<Json<HoldsAnswer>, ApiError> {
    Ok(Json(answer(&state, &ladder).await?))
}

/// `POST …/holds`.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct HoldRequest {
    /// The destination queue.
    #[schema(min_length = 1, max_length = 255)]
    destination: String,
    /// Why, for the record.
    #[serde(default)]
    why: String,
}

/// `POST …/holds/resume`.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ResumeRequest {
    /// The held destination queue.
    #[schema(min_length = 1, max_length = 255)]
    destination: String,
    /// `N/s`, `N/m` or `N/h`; left out, null or blank: the ladder's `release_rate`.
    #[serde(default)]
    #[schema(pattern = r"^\s*([0-9]+\s*/\s*[smh])?\s*$")]
    rate: Option<String>,
}

/// A recorded hold or resume.
#[derive(Serialize, utoipa::ToSchema)]
pub(crate) struct RecordAnswer {
    ladder: String,
    destination: String,
    /// `held` or `resumed`.
    #[schema(schema_with = recorded_actions)]
    action: &'static str,
    by: String,
    why: String,
    at_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    rate: Option<String>,
}

fn record_answer(ladder: String, r: crate::model::holds::HoldRecord) -> RecordAnswer {
    RecordAnswer {
        ladder,
        destination: r.destination,
        action: r.action.code(),
        by: r.by,
        why: r.why,
        at_ms: r.at_ms,
        rate: r.rate,
    }
}

/// Hold a destination queue for every replica: its due messages wait in `N.L.held.<queue>`, no attempt counted.
///
/// Recorded in the ladder's stream `N.L.holds`, which every replica follows; answered once the
/// broker confirmed the record. Refused for a queue the ladder may not deliver to (400) or that
/// does not exist (404).
#[utoipa::path(
    post,
    path = "/api/ladders/{ladder}/holds",
    operation_id = "holdDestination",
    params(LadderPath),
    request_body = HoldRequest,
    security(("token" = [])),
    responses(
        (status = 200, description = "recorded", body = RecordAnswer),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn hold(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(LadderPath { ladder }): ApiPath<LadderPath>,
    headers: HeaderMap,
    ApiJson(request): ApiJson<HoldRequest>,
) -> Result<Json<RecordAnswer>, ApiError> {
    let by = caller(&state, &headers, &ladder, "hold")?;
    let record = state
        .desk
        .hold(&ladder, &request.destination, &by, &request.why)
        .await?;
    Ok(Json(record_answer(ladder, record)))
}

fn parse_rate(rate: Option<&str>) -> Result<Option<Rate>, HoldError> {
    rate.map(str::trim)
        .filter(|r| !r.is_empty())
        .map(|r| r.parse::<Rate>().map_err(|e| HoldError::Invalid(e.0)))
        .transpose()
}

/// Resume a held destination: its held queue is released at `rate` (default the ladder's `release_rate`), oldest first.
///
/// Recorded in the ladder's stream `N.L.holds`, which every replica follows; answered once the
/// broker confirmed the record. Refused for a destination that is not held (409).
#[utoipa::path(
    post,
    path = "/api/ladders/{ladder}/holds/resume",
    operation_id = "resumeDestination",
    params(LadderPath),
    request_body = ResumeRequest,
    security(("token" = [])),
    responses(
        (status = 200, description = "recorded", body = RecordAnswer),
        (status = 400, response = BadRequest),
        (status = 404, response = NotFound),
        (status = 409, response = Conflict),
        (status = 500, response = Internal),
        (status = 503, response = Unavailable),
    ),
)]
pub(crate) async fn resume(
    Extract(state): Extract<Arc<AdminState>>,
    ApiPath(LadderPath { ladder }): ApiPath<LadderPath>,
    headers: HeaderMap,
    ApiJson(request): ApiJson<ResumeRequest>,
) -> Result<Json<RecordAnswer>, ApiError> {
    let by = caller(&state, &headers, &ladder, "resume")?;
    let rate = parse_rate(request.rate.as_deref())?;
    let record = state.desk.resume(&ladder, &request.destination, &by, rate).await?;
    Ok(Json(record_answer(ladder, record)))
}

/// The web page: held destinations, the busiest, and the forms.
pub(crate) async fn destinations(Extract(state): Extract<Arc<AdminState>>, Path(ladder): Path<String>) -> Response {
    let answer = match answer(&state, &ladder).await {
        Ok(answer) => answer,
        Err(e) => {
            return (
                status(&e),
                page("Error", html! { p #outcome .error { (e.to_string()) } }),
            )
                .into_response();
        }
    };
    let action = |what: &str| format!("/ladders/{}/destinations/{what}", segment(&ladder));
    // the parking lot's index counts every replica's parks (it follows the stream)
    let parked: Vec<(String, u64)> = state
        .desk
        .status(&ladder)
        .map(|s| s.unresolved.by_destination)
        .unwrap_or_default();
    let parked_of = |destination: &str| parked.iter().find(|(d, _)| d == destination).map_or(0, |(_, n)| *n);
    let body = html! {
        p { "Ladder " b { (ladder) } ". A held destination gets nothing; its due messages wait in its held queue, no attempt counted, until it is resumed; then they are released at a bounded rate, oldest first." }
        h2 { "Held" }
        (held_table(&answer, &action))
        h2 { "Hold a destination" }
        form #hold method="post" action=(action("hold")) {
            label { "Queue " input type="text" name="destination" maxlength="255" required; } " "
            label { "Why " input type="text" name="why" maxlength="512"; } " "
            (token_field()) " "
            button type="submit" { "Hold it" }
        }
        h2 { "Busiest destinations (this replica: delivered and failed in the last " (answer.window_ms / 1000) " s, waiting now)" }
        (busiest_table(&answer, &action, &parked_of))
        h2 { "Most parked destinations (unresolved, all replicas)" }
        @if parked.is_empty() {
            p { "Nothing parked." }
        } @else {
            table #most-parked {
                tr { th { "Destination" } th { "Parked, unresolved" } }
                @for (destination, n) in parked.iter().take(BUSIEST) {
                    tr { td { code { (destination) } } td { (n) } }
                }
            }
        }
        h2 { "Recent transitions" }
        @if answer.recent.is_empty() {
            p { "None yet." }
        } @else {
            table #transitions {
                tr { th { "When" } th { "Destination" } th { "Transition" } th { "By" } th { "Why" } }
                @for r in &answer.recent {
                    tr {
                        td { (format_time(r.at_ms)) }
                        td { code { (r.destination) } }
                        td { (r.action) @if let Some(rate) = &r.rate { " at " (rate) } }
                        td { (r.by) }
                        td { (r.why) }
                    }
                }
            }
        }
        p { a href="/" { "Back to the ladders" } }
    };
    page(&format!("Destinations of {ladder}"), body).into_response()
}

/// The held destinations, each with its resume form.
fn held_table(answer: &HoldsAnswer, action: &dyn Fn(&str) -> String) -> maud::Markup {
    html! {
        @if answer.holds.is_empty() {
            p #no-holds { "No destination is held." }
        } @else {
            table #holds {
                tr { th { "Destination" } th { "State" } th { "By" } th { "Why" } th { "Since" } th { "Messages held" } th { "" } }
                @for h in &answer.holds {
                    tr data-destination=(h.destination) {
                        td { code { (h.destination) } }
                        td { (h.state) @if let Some(rate) = &h.rate { " at " (rate) } }
                        td { (h.by) }
                        td { (h.why) }
                        td { (format_time(h.held_since_ms)) }
                        td .held-messages { (h.messages.map_or("?".to_string(), |n| n.to_string())) }
                        td {
                            @if h.state == "held" {
                                form .resume method="post" action=(action("resume")) {
                                    input type="hidden" name="destination" value=(h.destination);
                                    label { "Rate " input type="text" name="rate" placeholder="10/s" size="6"; } " "
                                    (token_field()) " "
                                    button type="submit" { "Resume" }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The busiest destinations this replica saw, each with its hold form unless held.
fn busiest_table(
    answer: &HoldsAnswer,
    action: &dyn Fn(&str) -> String,
    parked_of: &dyn Fn(&str) -> u64,
) -> maud::Markup {
    html! {
        @if answer.busiest.is_empty() {
            p { "None seen yet." }
        } @else {
            table #busiest {
                tr { th { "Destination" } th { "Delivered" } th { "Failed back" } th title="put into a tier by this replica, not due yet" { "Waiting" } th { "Parked, unresolved" } th { "" } }
                @for b in &answer.busiest {
                    tr data-destination=(b.destination) {
                        td { code { (b.destination) } } td { (b.delivered) } td { (b.failed) }
                        td .waiting { (b.waiting) }
                        td { (parked_of(&b.destination)) }
                        td {
                            @if !answer.holds.iter().any(|h| h.destination == b.destination) {
                                form .hold-row method="post" action=(action("hold")) {
                                    input type="hidden" name="destination" value=(b.destination);
                                    (token_field()) " "
                                    button type="submit" { "Hold" }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn done(ladder: &str, text: maud::Markup) -> Response {
    let body = html! {
        p #outcome { (text) }
        p { a #back href={ "/ladders/" (segment(ladder)) "/destinations" } { "Back to the destinations" } }
    };
    page("Done", body).into_response()
}

fn failed(ladder: &str, e: &HoldError) -> Response {
    let body = html! {
        p #outcome .error { "Not done: " (e.to_string()) }
        p { a #back href={ "/ladders/" (segment(ladder)) "/destinations" } { "Back to the destinations" } }
    };
    (status(e), page("Not done", body)).into_response()
}

/// The hold form.
pub(crate) async fn hold_form(
    Extract(state): Extract<Arc<AdminState>>,
    Path(ladder): Path<String>,
    Form(mut pairs): Form<Vec<(String, String)>>,
) -> Response {
    let back = format!("/ladders/{}/destinations", segment(&ladder));
    let by = match web::caller(&state, take(&mut pairs, "token").as_deref(), &ladder, "hold") {
        Ok(by) => by,
        Err(why) => return web::refused(why, &back),
    };
    let destination = take(&mut pairs, "destination").unwrap_or_default();
    let why = take(&mut pairs, "why").unwrap_or_default();
    match state.desk.hold(&ladder, &destination, &by, &why).await {
        Ok(r) => done(
            &ladder,
            html! { "Held " code { (r.destination) } " by " (r.by) ": its due messages wait in its held queue until it is resumed." },
        ),
        Err(e) => failed(&ladder, &e),
    }
}

/// The resume form.
pub(crate) async fn resume_form(
    Extract(state): Extract<Arc<AdminState>>,
    Path(ladder): Path<String>,
    Form(mut pairs): Form<Vec<(String, String)>>,
) -> Response {
    let back = format!("/ladders/{}/destinations", segment(&ladder));
    let by = match web::caller(&state, take(&mut pairs, "token").as_deref(), &ladder, "resume") {
        Ok(by) => by,
        Err(why) => return web::refused(why, &back),
    };
    let destination = take(&mut pairs, "destination").unwrap_or_default();
    let rate = match parse_rate(take(&mut pairs, "rate").as_deref()) {
        Ok(rate) => rate,
        Err(e) => return failed(&ladder, &e),
    };
    match state.desk.resume(&ladder, &destination, &by, rate).await {
        Ok(r) => done(
            &ladder,
            html! { "Resumed " code { (r.destination) } " by " (r.by) ": what it held is released at " (r.rate.unwrap_or_default()) ", oldest first." },
        ),
        Err(e) => failed(&ladder, &e),
    }
}
