//! The operator web page on the admin server: server-rendered HTML (maud escapes every value),
//! no JavaScript and no front-end build. Pages:
//!
//! - `/` — every ladder: tiers with their depths, rates, accounting, unresolved parked entries;
//! - `/ladders/{ladder}/parked` — the parked list with the API's filters and paging, and the
//!   matches counted per reason and per destination (each a link that narrows the filter);
//! - `/ladders/{ladder}/parked/{offset}` — one entry: reason, history, properties, headers, body;
//! - `/ladders/{ladder}/parked/{offset}/{replay|discard}` — a confirmation form (GET) that asks
//!   for a token from `admin.tokens`, and the action (POST);
//! - `/ladders/{ladder}/matching/{replay|discard}?<filters>` — the same for every unresolved
//!   entry matching a filter, with the count shown before confirming and a rate for replays.
//!
//! Element ids and classes (`#ladders`, `#filters`, `#total`, `tr.entry`, `a.show`, `#body`,
//! `#resolution`, `#confirm`, `#outcome`, …) are a contract with the browser test
//! (`tests/it/browser.rs`). Everything the page does goes through the same [`crate::admin::desk`]
//! calls as the JSON API.

use std::sync::Arc;

use axum::Form;
use axum::extract::{Path, Query, State as Extract};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, Markup, html};
use serde_json::Value;

use crate::admin::api::{self, Denied, ListQuery};
use crate::admin::desk::{Job, JobKind, JobView};
use crate::admin::poller::AccountingStatus;
use crate::admin::state::{AdminState, LaddersView};
use crate::broker::lot::{self as parking, PageRequest, ParkingError, ReplayOptions, Status};
use crate::model::lot::filter::{Entries, Filter};
use crate::model::lot::record::ParkedEntry;
use crate::model::lot::text::{format_time, printable};
use crate::model::protocol::ParkReason;

/// The default rate offered for replaying everything that matches a filter: gentle enough for a
/// service that just recovered.
const DEFAULT_BULK_RATE: &str = "50/s";

/// The parked list names the largest this many destinations of its matches; the rest are
/// counted (a lot may hold entries for hundreds of queues).
const BREAKDOWN_DESTINATIONS: usize = 12;

/// The pages' one stylesheet, served at [`STYLESHEET_PATH`]; the Content-Security-Policy
/// allows stylesheets from this server only ([`crate::admin::guard::CONTENT_SECURITY_POLICY`]).
pub(crate) const STYLE: &str = include_str!("ladder.css");

/// Where the stylesheet is served.
pub(crate) const STYLESHEET_PATH: &str = "/static/ladder.css";

/// How long a browser may keep the stylesheet: the pages link it with its hash in the query
/// (`?v=`), so a new build's stylesheet is a new URL and a long lifetime never serves a stale one.
const STYLESHEET_CACHE: &str = "public, max-age=86400, immutable";

/// The stylesheet's URL, with the first 12 hex digits of its SHA-256 as the version.
static STYLESHEET_URL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let digest = ring::digest::digest(&ring::digest::SHA256, STYLE.as_bytes());
    let hex: String = digest.as_ref()[..6].iter().map(|b| format!("{b:02x}")).collect();
    format!("{STYLESHEET_PATH}?v={hex}")
});

/// `GET /static/ladder.css`.
pub(crate) async fn stylesheet() -> Response {
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (axum::http::header::CACHE_CONTROL, STYLESHEET_CACHE),
        ],
        STYLE,
    )
        .into_response()
}

/// How often the overview reloads itself, in seconds.
pub(crate) const OVERVIEW_REFRESH_SECONDS: u32 = 10;

pub(crate) fn page(title: &str, body: Markup) -> Html<String> {
    page_with(title, None, body)
}

/// A page with the header bar; `refresh` reloads it every so many seconds.
fn page_with(title: &str, refresh: Option<u32>, body: Markup) -> Html<String> {
    Html(
        html! {
            (DOCTYPE)
            html lang="en" {
                head {
                    meta charset="utf-8";
                    meta name="viewport" content="width=device-width, initial-scale=1";
                    @if let Some(seconds) = refresh { meta http-equiv="refresh" content=(seconds); }
                    title { (title) " — Ladder" }
                    link rel="stylesheet" href=(STYLESHEET_URL.as_str());
                }
                body {
                    header .bar {
                        a .brand href="/" { "Ladder" }
                        nav #nav {
                            a href="/" { "Overview" }
                            a href="/metrics" { "Metrics" }
                            a href="/api/ladders" { "JSON" }
                            a href="/api/openapi.json" { "API" }
                        }
                        @if let Some(seconds) = refresh {
                            span .note #refresh { "Refreshes every " (seconds) " s · " a href="/?refresh=off" { "stop" } }
                        }
                    }
                    main {
                        h1 { (title) }
                        (body)
                    }
                }
            }
        }
        .into_string(),
    )
}

/// `n` with its thousands apart: `12 408`.
pub(crate) fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// `n message` or `n messages`.
fn messages(n: u64) -> String {
    format!("{} message{}", grouped(n), if n == 1 { "" } else { "s" })
}

/// Hours and minutes (UTC) of `ms`.
fn clock_time(ms: u64) -> String {
    let minutes = ms / 60_000 % (24 * 60);
    format!("{:02}:{:02} UTC", minutes / 60, minutes % 60)
}

/// The accounting check in a sentence, and its status class (`ok`, `warn`, `bad`, `idle`):
/// `received` is what this process took from the intake queue, `unaccounted_since_ms` when the
/// current shortfall was first reported.
pub(crate) fn accounting_sentence(
    a: &AccountingStatus,
    received: u64,
    unaccounted_since_ms: Option<u64>,
) -> (&'static str, String) {
    if a.unaccounted > 0 {
        let since = unaccounted_since_ms.map_or(String::new(), |at| format!(" since {}", clock_time(at)));
        return (
            "bad",
            format!(
                "{} unaccounted for{since} — see the runbook LadderUnaccountedMessages \
                 (docs/src/operations/runbooks.md#runbook-ladderunaccountedmessages).",
                messages(a.unaccounted)
            ),
        );
    }
    if a.in_doubt > 0 {
        return (
            "warn",
            format!(
                "{} missing since a disruption (a partition, a lost connection): in doubt, not lost — \
                 unacked deliveries and unconfirmed publishes of the lost session may still come back.",
                messages(a.in_doubt)
            ),
        );
    }
    match a.verdict {
        "balanced" => ("ok", format!("All {} accounted for.", messages(received))),
        "anchored" => (
            "ok",
            format!("Check started: all {} accounted for.", messages(received)),
        ),
        "rebased" => (
            "ok",
            format!(
                "Found more messages than counted (duplicates, or published straight into a tier); \
                 counting from here: all {} accounted for.",
                messages(received)
            ),
        ),
        "suspect" => (
            "warn",
            format!(
                "{} not found at the last quiet poll; checking again before raising the alarm.",
                messages(a.missing.unwrap_or(0).unsigned_abs())
            ),
        ),
        "busy" if a.anchored => (
            "ok",
            "Messages are moving; at the last quiet poll every one was accounted for.".into(),
        ),
        "busy" => (
            "idle",
            "Messages are moving; the check starts at the first quiet poll.".into(),
        ),
        _ => (
            "idle",
            "Not checked yet: the check starts at the first quiet poll, and stays off while other \
             replicas consume the same queues."
                .into(),
        ),
    }
}

/// `s` as one URL path segment (ladder names are checked at load, but a record's copy is not).
pub(crate) fn segment(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

pub(crate) fn error_page(status: StatusCode, message: &str) -> Response {
    let body = html! { p #outcome .error { (message) } p { a href="/" { "Back to the ladders" } } };
    (status, page("Error", body)).into_response()
}

fn parking_error(e: &ParkingError) -> Response {
    error_page(api::ApiError::status(e), &e.to_string())
}

/// A query string from pairs, without empty values.
fn query_string<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut out = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        if !v.is_empty() {
            out.append_pair(k, v);
        }
    }
    out.finish()
}

fn rate(value: f64) -> String {
    format!("{value:.1}/s")
}

/// `GET /`: every ladder in a table, then per ladder its accounting in a sentence and charts
/// of its last hour; reloads itself every [`OVERVIEW_REFRESH_SECONDS`] unless `?refresh=off`.
pub(crate) async fn overview(
    Extract(state): Extract<Arc<AdminState>>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Html<String> {
    let snapshot = state.snapshots.borrow().clone();
    let view = LaddersView::new(&state.config, snapshot.as_deref()).with_drift(&state.service);
    // a copy, so the lock is not held while rendering
    let history = state
        .history
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let refresh = !pairs.iter().any(|(k, v)| k == "refresh" && v == "off");
    let depth = |l: &crate::admin::state::LadderView, role: &str| -> String {
        match l.depths.as_ref().map(|d| d.get(role).copied().flatten()) {
            Some(Some(n)) => grouped(n),
            Some(None) => "missing".into(),
            None => "?".into(),
        }
    };
    let accounting = |l: &crate::admin::state::LadderView| {
        let since = history.ladder(&l.name).and_then(|h| h.unaccounted_since_ms());
        l.accounting
            .as_ref()
            .map(|a| accounting_sentence(a, l.totals.map_or(0, |t| t.received_intake), since))
            .unwrap_or(("idle", "Not polled yet.".into()))
    };
    let body = html! {
        p {
            "Namespace " code { (view.namespace) } ". "
            @match view.polled_at_ms {
                Some(at) => { "Depths polled at " (format_time(at)) "." }
                None => { "Depths not polled yet." }
            }
            @if let Some(e) = &view.broker_error { span .error { " Broker: " (e) } }
            @if !refresh { " " a href="/" { "Refresh every " (OVERVIEW_REFRESH_SECONDS) " s" } }
        }
        table #ladders {
            tr { th { "Ladder" } th { "Tiers (delay: waiting)" } th { "Intake / due" } th { "Rates" }
                 th { "Parked, unresolved" } }
            @for l in &view.ladders {
                @let status = state.desk.status(&l.name).ok();
                tr data-ladder=(l.name) {
                    td { b { (l.name) } br; code { (l.exchange) } br; "max attempts " (l.max_attempts) }
                    td {
                        @for t in l.tiers.iter().filter(|t| t.step) {
                            (t.name) ": " (depth(l, &format!("delay.{}", t.name)))
                            @if !t.shared_with.is_empty() { span .shared title="tier queues are the namespace's: this count is theirs too" { " (shared with " (t.shared_with.join(", ")) ")" } }
                            @if let Some(at) = t.next_leave_at_ms { span .next-leave { ", next out " (format_time(at)) } }
                            br;
                        }
                        @let levels: Vec<_> = l.tiers.iter().filter(|t| !t.step).collect();
                        @if !levels.is_empty() {
                            @let waiting: Option<u64> = levels.iter().map(|t| l.depths.as_ref().and_then(|d| d.get(&format!("delay.{}", t.name)).copied().flatten())).sum();
                            @let next = levels.iter().filter_map(|t| t.next_leave_at_ms).min();
                            span .levels { (levels.len()) " delay levels: " (waiting.map_or("?".to_string(), grouped)) }
                            @if let Some(at) = next { span .next-leave { ", next out " (format_time(at)) } }
                        }
                    }
                    td { (depth(l, "intake")) " / " (depth(l, "due")) }
                    td {
                        @match &l.rates {
                            Some(r) => {
                                "received " (rate(r.received)) br; "scheduled " (rate(r.scheduled)) br;
                                "delivered " (rate(r.delivered)) br; "parked " (rate(r.parked))
                            }
                            None => { "-" }
                        }
                    }
                    td { (parked_cell(&l.name, status.as_ref())) }
                }
            }
        }
        @if let Some(drift) = view.drift.as_ref().filter(|d| !d.retired.is_empty() || !d.differing.is_empty()) {
            (drift_section(drift))
        }
        @for l in &view.ladders {
            @let (class, sentence) = accounting(l);
            section .ladder data-ladder=(l.name) {
                h2 { (l.name) }
                p { span class={ "status accounting " (class) } { (sentence) } }
                p .actions {
                    a href={ "/ladders/" (l.name) "/parked" } { "Parked messages" }
                    a .destinations-link href={ "/ladders/" (l.name) "/destinations" } { "Destinations" }
                    @if l.tiers.iter().any(|t| !t.step) {
                        a .cancel-link href={ "/ladders/" (l.name) "/scheduled/cancel" } { "Cancel a scheduled delivery…" }
                    }
                }
                (ladder_charts(history.ladder(&l.name), l.tiers.iter().any(|t| !t.shared_with.is_empty())))
            }
        }
        p .muted {
            "Charts: the last hour per minute, as this process counted it since it started (the history \
             is in memory: a restart starts a new hour). Lateness p99 is estimated from the lateness \
             histogram's buckets, which double in width: within a factor of two."
        }
    };
    page_with("Ladders", refresh.then_some(OVERVIEW_REFRESH_SECONDS), body)
}

/// A ladder's unresolved parked messages, by reason, with links to them.
fn parked_cell(ladder: &str, status: Option<&crate::admin::desk::IndexStatus>) -> maud::Markup {
    html! {
                @if let Some(s) = status {
                    @let unresolved: u64 = s.unresolved.by_reason.iter().map(|(_, n)| n).sum();
                    span .unresolved { (unresolved) } " of " (s.entries) " indexed"
                    @if !s.caught_up { " (still reading the stream…)" } br;
                    @for (reason, n) in &s.unresolved.by_reason {
                        a .reason-link href={ "/ladders/" (ladder) "/parked?reason=" (reason) } { (reason) }
                        ": " (n) br;
                    }
                }
                a .parked-link href={ "/ladders/" (ladder) "/parked" } { "Parked messages" }
    }
}

/// What the namespace declared before and its config no longer uses, and what differs.
fn drift_section(drift: &crate::admin::state::DriftView) -> maud::Markup {
    html! {
        section #drift {
            h2 { "Retired and differing topology" }
            p .muted {
                "What this namespace declared before and its config no longer uses (read " (format_time(drift.read_at_ms))
                "). A retired tier of a ladder still served drains by itself; " code { "ladder prune" }
                " removes what is empty (docs/src/operations/changing-a-ladder.md)."
            }
            @if !drift.retired.is_empty() {
                @let (tiers, ladders) = retired_rows(&drift.retired);
                table #retired {
                    tr { th { "Retired" } th { "Ladder" } th { "Messages" } th { "Last due by" } th { "Note" } }
                    @for r in tiers {
                        tr data-retired=(r.name) {
                            td { (r.kind.as_str()) " " code { (r.name) } }
                            td { (r.ladder) }
                            td { @if r.stream { "-" } @else { (grouped(u64::from(r.messages))) } }
                            td { @match r.last_due_by_ms { Some(at) => { (format_time(at)) } None => { "-" } } }
                            td { (r.note) }
                        }
                    }
                    @for (ladder, objects, messages) in ladders {
                        tr data-retired-ladder=(ladder) {
                            td { "ladder " code { (ladder) } ": " (objects) " queues and exchanges" }
                            td { (ladder) " (retired)" }
                            td { (grouped(messages)) }
                            td { "-" }
                            td {
                                @if messages > 0 {
                                    "Messages wait and no replica serves this ladder: put its file back until they drain."
                                } @else {
                                    "Empty: ladder prune removes it (its parking lot only with --with-parking-lot)."
                                }
                            }
                        }
                    }
                }
            }
            @if !drift.differing.is_empty() {
                table #differing {
                    tr { th { "Object" } th { "Differs from the config" } }
                    @for d in &drift.differing {
                        tr { td { (d.kind.as_str()) " " code { (d.name) } } td { (d.detail) } }
                    }
                }
            }
        }
    }
}

/// The retired objects of ladders still served, one row each, and the retired ladders, one row
/// each: (name, objects, messages waiting in their queues).
fn retired_rows(
    retired: &[crate::model::drift::Retired],
) -> (Vec<&crate::model::drift::Retired>, Vec<(String, usize, u64)>) {
    let mut ladders: Vec<(String, usize, u64)> = Vec::new();
    let mut tiers = Vec::new();
    for r in retired {
        if !r.ladder_retired {
            tiers.push(r);
            continue;
        }
        match ladders.iter_mut().find(|(name, _, _)| *name == r.ladder) {
            Some((_, objects, messages)) => {
                *objects += 1;
                *messages += u64::from(r.messages);
            }
            None => ladders.push((r.ladder.clone(), 1, u64::from(r.messages))),
        }
    }
    (tiers, ladders)
}

/// The three charts of one ladder's last hour; `shared` when one of its tier queues is another
/// ladder's too (what waits there is counted for both).
fn ladder_charts(history: Option<&crate::admin::history::LadderHistory>, shared: bool) -> Markup {
    use crate::admin::charts::{Chart, Series, Unit};
    use crate::admin::history::{MINUTES, Point};
    let points = history.map(|h| h.points()).unwrap_or_default();
    let end = history.and_then(|h| h.current_minute()).unwrap_or(0);
    let first = (end + 1).saturating_sub(MINUTES as u64);
    let series = |name: &str, value: &dyn Fn(&Point) -> Option<f64>| {
        let mut values = vec![None; MINUTES];
        for p in &points {
            if let Some(slot) = p.minute.checked_sub(first).map(|i| i as usize).filter(|i| *i < MINUTES) {
                values[slot] = value(p);
            }
        }
        Series {
            name: name.into(),
            values,
            total: None,
        }
    };
    let counted = |name: &str, value: &dyn Fn(&Point) -> Option<f64>| {
        let s = series(name, value);
        Series {
            total: Some(s.values.iter().flatten().sum()),
            ..s
        }
    };
    let chart = |title: &str, unit: Unit, series: Vec<Series>| Chart {
        title: title.into(),
        unit,
        slots: MINUTES,
        start_label: format!("-{MINUTES} min"),
        series,
    };
    let charts = [
        chart(
            "Messages per minute",
            Unit::Messages,
            vec![
                counted("received", &|p| Some(p.received as f64)),
                counted("delivered", &|p| Some(p.delivered as f64)),
                counted("parked", &|p| Some(p.parked as f64)),
            ],
        ),
        chart(
            if shared {
                "Waiting (in tiers shared with other ladders)"
            } else {
                "Waiting"
            },
            Unit::Messages,
            vec![
                series("in backoff steps", &|p| p.waiting_steps.map(|n| n as f64)),
                series("in delay levels", &|p| p.waiting_levels.map(|n| n as f64)),
            ],
        ),
        chart("Lateness p99", Unit::Seconds, vec![series("p99", &|p| p.lateness_p99)]),
    ];
    html! {
        div .charts {
            @for c in &charts { (c.render()) }
        }
    }
}

/// `GET /ladders/{ladder}/scheduled/cancel`: the form that cancels a scheduled delivery.
pub(crate) async fn confirm_cancel(Extract(state): Extract<Arc<AdminState>>, Path(ladder): Path<String>) -> Response {
    if let Err(e) = state.desk.status(&ladder) {
        return parking_error(&e);
    }
    let body = html! {
        form .cancel #confirm method="post" action={ "/ladders/" (segment(&ladder)) "/scheduled/cancel" } {
            p { "A message with this id still waiting in " b { (ladder) } " is parked as " code { "cancelled" }
                " instead of delivered, by every replica." }
            label { "Message id " input type="text" name="message_id" maxlength="255" required; } " "
            (token_field()) " "
            button #confirm-button type="submit" { "Cancel it" }
        }
        p { a href="/" { "Back to the ladders" } }
    };
    page(&format!("Cancel a scheduled delivery — {ladder}"), body).into_response()
}

/// The overview's cancel form: records the cancellation for every replica, then says so.
pub(crate) async fn cancel_scheduled(
    Extract(state): Extract<Arc<AdminState>>,
    Path(ladder): Path<String>,
    Form(mut pairs): Form<Vec<(String, String)>>,
) -> Response {
    let by = match caller(&state, take(&mut pairs, "token").as_deref(), &ladder, "cancel") {
        Ok(by) => by,
        Err(why) => return refused(why, "/"),
    };
    let message_id = take(&mut pairs, "message_id").unwrap_or_default();
    match state.desk.cancel(&ladder, &message_id, &by).await {
        Ok(record) => {
            let body = html! {
                p #outcome {
                    "Cancelled " code { (record.message_id) } " in ladder " (ladder) " by " (record.by)
                    ": a message with this id still waiting is parked as " code { "cancelled" }
                    " instead of delivered (the cancellation holds until " (format_time(record.until_ms)) ")."
                }
                p { a #back href="/" { "Back to the ladders" } }
            };
            page("Cancelled", body).into_response()
        }
        Err(e) => parking_error(&e),
    }
}

fn filter_form(ladder: &str, pairs: &[(String, String)]) -> Markup {
    let value = |key: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == key)
            .map_or("", |(_, v)| v.as_str())
            .to_string()
    };
    let text = |key: &str, label: &str, hint: &str| {
        html! { label { (label) " " input type="text" name=(key) value=(value(key)) placeholder=(hint); } }
    };
    let reason = value("reason");
    html! {
        form #filters method="get" action={ "/ladders/" (ladder) "/parked" } {
            (text("destination", "Destination", "queue"))
            label { "Reason " select name="reason" {
                option value="" selected[reason.is_empty()] { "any" }
                @for r in ParkReason::ALL {
                    option value=(r.code()) selected[reason == r.code()] { (r.code()) }
                }
            } }
            (text("message_id", "Message id", ""))
            (text("correlation_id", "Correlation id", ""))
            (text("header", "Header", "key=value"))
            (text("body", "Body contains", ""))
            (text("since", "Since", "2h or RFC 3339"))
            (text("until", "Until", "10m or RFC 3339"))
            label { input type="checkbox" name="resolved" value="include" checked[!value("resolved").is_empty()];
                    " include resolved" }
            " " button #apply type="submit" { "Apply" }
        }
    }
}

pub(crate) async fn list(
    Extract(state): Extract<Arc<AdminState>>,
    Path(ladder): Path<String>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Response {
    let title = format!("Parked — {ladder}");
    let q = match api::parse_query(&pairs, crate::clock::now_ms()) {
        Ok(q) => q,
        Err(e) => {
            let body = html! { (filter_form(&ladder, &pairs)) p #outcome .error { (e) } };
            return (StatusCode::BAD_REQUEST, page(&title, body)).into_response();
        }
    };
    let found = match state.desk.list(&ladder, &q.filter, q.page).await {
        Ok(found) => found,
        Err(e) => return parking_error(&e),
    };
    let filters: Vec<(&str, &str)> = pairs
        .iter()
        .filter(|(k, _)| k != "offset" && k != "limit")
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let paged = |offset: usize| {
        let offset = offset.to_string();
        let mut all = filters.clone();
        all.push(("offset", &offset));
        format!("/ladders/{ladder}/parked?{}", query_string(all))
    };
    let action_link = |action: &str| format!("/ladders/{ladder}/matching/{action}?{}", query_string(filters.clone()));
    // the same filter narrowed to one reason or destination
    let narrowed = |key: &str, value: &str| {
        let mut all: Vec<(&str, &str)> = filters.iter().filter(|(k, _)| *k != key).copied().collect();
        all.push((key, value));
        format!("/ladders/{ladder}/parked?{}", query_string(all))
    };
    // Grouped counts come from the index alone; a header or body search would read its
    // candidates a second time for them, so it goes without.
    let breakdown = if q.filter.needs_records() || found.total == 0 {
        None
    } else {
        state.desk.counts(&ladder, &q.filter).await.ok()
    };
    let PageRequest { offset, limit } = q.page;
    let body = html! {
        (filter_form(&ladder, &pairs))
        p {
            span #total { (found.total) } " matching " @if q.filter.entries == Entries::All { "entries" } @else { "unresolved entries" }
            @if !found.entries.is_empty() { ", showing " (offset + 1) "–" (offset + found.entries.len()) }
            ". "
            @if found.total > 0 && !q.filter.is_empty() {
                a #replay-matching href=(action_link("replay")) { "Replay all matching" } " · "
                a #discard-matching href=(action_link("discard")) { "Discard all matching" }
            }
        }
        @if let Some(c) = &breakdown {
            p #breakdown {
                "By reason: "
                @for (i, (reason, n)) in c.by_reason.iter().enumerate() {
                    @if i > 0 { " · " }
                    a .by-reason href=(narrowed("reason", reason)) { (reason) } " (" (n) ")"
                }
                br;
                "By destination: "
                @for (i, (destination, n)) in c.by_destination.iter().take(BREAKDOWN_DESTINATIONS).enumerate() {
                    @if i > 0 { " · " }
                    @if destination == "-" { "none" } @else {
                        a .by-destination href=(narrowed("destination", destination)) { (destination) }
                    }
                    " (" (n) ")"
                }
                @if c.by_destination.len() > BREAKDOWN_DESTINATIONS {
                    " · and " (c.by_destination.len() - BREAKDOWN_DESTINATIONS) " more"
                }
            }
        }
        (entries_table(&ladder, &found.entries))
        p {
            @if offset > 0 { a #previous href=(paged(offset.saturating_sub(limit))) { "← newer" } " " }
            @if (offset + found.entries.len()) < found.total as usize { a #next href=(paged(offset + limit)) { "older →" } }
        }
    };
    page(&title, body).into_response()
}

/// The rows of a parked list.
fn entries_table(ladder: &str, entries: &[ParkedEntry]) -> Markup {
    html! {
        table #entries {
            tr { th { "Offset" } th { "Parked at" } th { "Reason" } th { "Destination" } th { "Attempts" }
                 th { "Message id" } th { "Resolution" } }
            @for e in entries {
                tr .entry data-offset=(e.offset) {
                    td { a .show href={ "/ladders/" (ladder) "/parked/" (e.offset) } { (e.offset) } }
                    td { (format_time(e.envelope.parked_at_ms)) }
                    td .reason { (printable(&e.envelope.reason)) }
                    td .destination { (printable(e.envelope.destination.as_deref().unwrap_or("-"))) }
                    td { (e.envelope.attempts.map_or("-".to_string(), |a| a.to_string())) }
                    td .message-id { (message_id(e)) }
                    td { (describe(e)) }
                }
            }
        }
    }
}

/// The entry's message id as text (lossy for bytes), `-` when it has none.
fn message_id(e: &ParkedEntry) -> String {
    e.envelope
        .message
        .properties
        .get("message_id")
        .and_then(crate::model::envelope::short_text)
        .map_or_else(|| "-".into(), |id| printable(&id).into_owned())
}

fn describe(e: &ParkedEntry) -> String {
    match &e.resolution {
        None => "unresolved".into(),
        Some(r) => match r.action {
            crate::model::lot::record::Action::Replayed => format!(
                "replayed{} to {} by {} at {}",
                if r.edit.is_some() { " edited" } else { "" },
                printable(r.to.as_deref().unwrap_or("?")),
                printable(&r.by),
                format_time(r.at_ms)
            ),
            crate::model::lot::record::Action::Discarded => {
                format!("discarded by {} at {}", printable(&r.by), format_time(r.at_ms))
            }
        },
    }
}

fn summary(ladder: &str, e: &ParkedEntry) -> Markup {
    let v = &e.envelope;
    html! {
        table #summary {
            tr { th { "Entry" } td { (ladder) " @ " (e.offset) } }
            tr { th { "Reason" } td #reason { (printable(&v.reason)) } }
            tr { th { "Detail" } td { (printable(&v.detail)) } }
            tr { th { "Destination" } td #destination { (printable(v.destination.as_deref().unwrap_or("-"))) } }
            tr { th { "Attempts" } td { (v.attempts.map_or("-".to_string(), |a| a.to_string())) } }
            @if let Some(first) = v.first_failed_at_ms { tr { th { "First failed" } td { (format_time(first)) } } }
            tr { th { "Parked at" } td { (format_time(v.parked_at_ms)) " (" (printable(&v.hop)) " hop)" } }
            tr { th { "Received on" } td {
                "exchange " code { (printable(shown(&v.message.exchange, "(default)"))) }
                ", routing key " code { (printable(shown(&v.message.routing_key, "(empty)"))) }
            } }
            tr { th { "Resolution" } td #resolution {
                (describe(e))
                @if e.resolution.as_ref().is_some_and(|r| r.edit.is_some()) { " · " a #edit-link href="#edit" { "see the edit" } }
            } }
        }
    }
}

pub(crate) async fn entry(
    Extract(state): Extract<Arc<AdminState>>,
    Path((ladder, offset)): Path<(String, u64)>,
) -> Response {
    match state.desk.show(&ladder, offset).await {
        Ok(e) => entry_page(&ladder, &e).into_response(),
        Err(e) => parking_error(&e),
    }
}

/// One entry in full: summary, history, properties, headers with their types, body.
fn entry_page(ladder: &str, e: &ParkedEntry) -> Html<String> {
    let offset = e.offset;
    let props = &e.envelope.message.properties;
    let body = html! {
        p { a href={ "/ladders/" (ladder) "/parked" } { "← all parked messages" } }
        (summary(ladder, e))
        @if e.resolution.is_none() {
            p .actions { a #replay href={ "/ladders/" (ladder) "/parked/" (offset) "/replay" } { "Replay…" }
                a #edit-replay href={ "/ladders/" (ladder) "/parked/" (offset) "/edit" } { "Edit and replay…" }
                a #discard href={ "/ladders/" (ladder) "/parked/" (offset) "/discard" } { "Discard…" } }
        }
        @if let Some((r, edit)) = e.resolution.as_ref().and_then(|r| r.edit.as_ref().map(|edit| (r, edit))) {
            section #edit .edit-audit {
                h2 { "Edited before replay" }
                p { "By " b .editor { (printable(&r.by)) } " at " (format_time(r.at_ms)) "; this entry keeps the original below." }
                table #edit-audit {
                    @if !edit.headers_added.is_empty() { tr { th { "Headers added" } td { (printable(&edit.headers_added.join(", "))) } } }
                    @if !edit.headers_removed.is_empty() { tr { th { "Headers removed" } td { (printable(&edit.headers_removed.join(", "))) } } }
                    @if !edit.headers_changed.is_empty() { tr { th { "Headers changed" } td { (printable(&edit.headers_changed.join(", "))) } } }
                    @if let Some(b) = &edit.body {
                        tr { th { "Body" } td {
                            (b.from_bytes) " bytes (SHA-256 " code { (printable(&b.from_sha256)) } ") → "
                            (b.to_bytes) " bytes (SHA-256 " code { (printable(&b.to_sha256)) } ")"
                        } }
                    }
                }
            }
        }
        h2 { "Attempt history" }
        @if let Some(from) = &e.envelope.replayed_from { p #replayed-from { "Replayed from " code { (printable(from)) } } }
        table #history {
            tr { th { "Attempt" } th { "Tier" } th { "Failed at" } }
            @for h in &e.envelope.history {
                tr { td { (h.attempt) } td { (printable(&h.tier)) } td { (format_time(h.failed_at_ms)) } }
            }
        }
        @if e.envelope.history.is_empty() { p { "No history recorded (parked on its first hop, or by an older version)." } }
        h2 { "Properties" }
        table #properties {
            @if let Some(map) = props.as_object() {
                @for (key, value) in map.iter().filter(|(k, _)| k.as_str() != "headers") {
                    tr { th { (printable(key)) } td { (property_text(value)) } }
                }
            }
        }
        h2 { "Headers" }
        table #headers {
            tr { th { "Name" } th { "Type" } th { "Value" } }
            @if let Some(headers) = props.get("headers") {
                @for (key, typed) in crate::model::envelope::table_entries(headers) {
                    tr {
                        td { (printable(&key)) }
                        td { (printable(typed.get("type").and_then(Value::as_str).unwrap_or("?"))) }
                        td { code { (header_value_text(typed)) } }
                    }
                }
            }
        }
        h2 { "Body" }
        (body_view(e))
    };
    page(&format!("Parked entry {offset}"), body)
}

/// `name`, or `empty` when it is the empty string (which a page would show as nothing).
fn shown<'a>(name: &'a str, empty: &'a str) -> &'a str {
    if name.is_empty() { empty } else { name }
}

/// A JSON value as [`printable`] text: a string as it is, anything else as JSON.
fn value_text(value: &Value) -> String {
    match value {
        Value::String(s) => printable(s).into_owned(),
        other => printable(&other.to_string()).into_owned(),
    }
}

/// A stored property: its text, or for a short string kept as bytes (`{"base64": …}`) its lossy
/// text and the bytes' base64.
fn property_text(value: &Value) -> String {
    match (
        value.get("base64").and_then(Value::as_str),
        crate::model::envelope::short_text(value),
    ) {
        (Some(b64), Some(text)) => format!("{} (bytes, base64 {b64})", printable(&text)),
        _ => value_text(value),
    }
}

/// A typed header value: its value, or `base64 …` for bytes.
fn header_value_text(typed: &Value) -> String {
    match (typed.get("value"), typed.get("base64")) {
        (Some(value), _) => value_text(value),
        (None, Some(b64)) => format!("base64 {}", value_text(b64)),
        (None, None) => "null".into(),
    }
}

fn body_view(e: &ParkedEntry) -> Markup {
    let apart = e.envelope.message.body_record.as_ref();
    match e.body() {
        Ok(bytes) => {
            let (shown, rest) = bytes.split_at(bytes.len().min(crate::model::lot::text::SHOWN_BODY_BYTES));
            let note = match (apart, rest.is_empty()) {
                (Some(_), true) => " (stored apart from the envelope)".to_string(),
                (Some(_), false) => format!(" (stored apart; the first {} shown)", shown.len()),
                (None, true) => String::new(),
                (None, false) => format!(" (the first {} shown)", shown.len()),
            };
            // the envelope's ladder is what the record says: encoded, it cannot break out of the URL
            let ladder = segment(&e.envelope.ladder);
            let download = format!("/api/ladders/{ladder}/parked/{}/body", e.offset);
            html! {
                @match crate::model::lot::text::body_text(shown) {
                    Some(text) => { p { (bytes.len()) " bytes, text" (note) " · " a #body-download href=(download) { "download" } } pre #body { (text) } },
                    None => {
                        p { (bytes.len()) " bytes, binary (hex)" (note) " · " a #body-download href=(download) { "download" } }
                        pre #body .hex { (crate::model::lot::text::hex_dump(shown)) }
                    },
                }
            }
        }
        Err(err) => html! { p #body .error { (err) } },
    }
}

/// The largest body the edit form offers to edit in the page; a larger one is edited through
/// the API (`POST …/edit-replay`), whose request bound is [`crate::admin::guard::MAX_BODY_BYTES`].
const EDITABLE_BODY_BYTES: usize = 64 * 1024;

/// `GET /ladders/{ladder}/parked/{offset}/edit`: the edit-and-replay form.
pub(crate) async fn edit_form(
    Extract(state): Extract<Arc<AdminState>>,
    Path((ladder, offset)): Path<(String, u64)>,
) -> Response {
    match state.desk.show(&ladder, offset).await {
        Ok(e) => edit_page(&ladder, &e, None, None).into_response(),
        Err(e) => parking_error(&e),
    }
}

/// What the edit form was last submitted with, to show again beside an error.
struct Submitted {
    headers: String,
    body: String,
    encoding: String,
    to: String,
}

/// The form: the headers as the envelope's typed JSON, the body as text (or base64 for bytes),
/// the queue, the token.
fn edit_page(ladder: &str, e: &ParkedEntry, submitted: Option<&Submitted>, error: Option<&str>) -> Html<String> {
    let offset = e.offset;
    let headers = e
        .envelope
        .message
        .properties
        .get("headers")
        .cloned()
        .unwrap_or_else(|| Value::Object(Default::default()));
    let body = e.body().ok();
    let too_large = body.as_ref().is_some_and(|b| b.len() > EDITABLE_BODY_BYTES);
    let (body_text, encoding) = match &body {
        Some(bytes) if !too_large => match std::str::from_utf8(bytes) {
            Ok(text) => (text.to_string(), "text"),
            Err(_) => (
                base64::Engine::encode(&base64::engine::general_purpose::STANDARD, bytes),
                "base64",
            ),
        },
        _ => (String::new(), "text"),
    };
    let shown = match submitted {
        Some(s) => Submitted {
            headers: s.headers.clone(),
            body: s.body.clone(),
            encoding: s.encoding.clone(),
            to: s.to.clone(),
        },
        None => Submitted {
            headers: serde_json::to_string_pretty(&headers).unwrap_or_default(),
            body: body_text,
            encoding: encoding.into(),
            to: e.envelope.destination.clone().unwrap_or_default(),
        },
    };
    let body = html! {
        (summary(ladder, e))
        @if let Some(error) = error { p #outcome .error { "Not done: " (error) } }
        @if e.resolution.is_some() {
            p .error { "This entry is resolved; only an unresolved entry can be edited and replayed." }
        } @else {
            form #confirm .edit method="post" action={ "/ladders/" (segment(ladder)) "/parked/" (offset) "/edit" } {
                p { "Change what you need, then replay the edited message with a fresh attempt count. "
                    "The parked entry keeps the original; its resolution records who edited which headers and the body's size and SHA-256." }
                h2 { "Headers" }
                p .muted { "As the entry stores them: each key's AMQP type and value (" code { "{\"type\": \"long-string\", \"value\": \"…\"}" } "). "
                    "The replay sets retry-attempt, retry-tier, retry-due-at, retry-ladder and retry-replayed-from itself: those cannot be changed; a changed retry-to sends it there (when allowed)." }
                textarea #edit-headers name="headers" rows="10" spellcheck="false" { (shown.headers) }
                h2 { "Body" }
                @if too_large {
                    p .muted { "The body is over " (EDITABLE_BODY_BYTES / 1024) " KiB: leave this empty to keep it, or edit it through the API (POST …/edit-replay)." }
                }
                p {
                    label { input type="radio" name="body_encoding" value="text" checked[shown.encoding == "text"]; " text (UTF-8)" } " "
                    label { input type="radio" name="body_encoding" value="base64" checked[shown.encoding == "base64"]; " base64" }
                }
                // a textarea drops one leading line break: double it so a body's own survives
                textarea #edit-body name="body" rows="8" spellcheck="false" {
                    @if shown.body.starts_with('\n') { "\n" } (shown.body)
                }
                p {
                    label { "Queue " input #edit-to type="text" name="to" value=(shown.to); } " "
                    (token_field()) " "
                    button #confirm-button type="submit" { "Replay edited" }
                }
            }
        }
        p { a href={ "/ladders/" (segment(ladder)) "/parked/" (offset) } { "Cancel" } }
    };
    page(&format!("Edit and replay entry {offset}"), body)
}

/// `POST /ladders/{ladder}/parked/{offset}/edit`: checks the edit, then replays it as a job.
pub(crate) async fn edit_and_replay(
    Extract(state): Extract<Arc<AdminState>>,
    Path((ladder, offset)): Path<(String, u64)>,
    Form(mut pairs): Form<Vec<(String, String)>>,
) -> Response {
    let by = match caller(&state, take(&mut pairs, "token").as_deref(), &ladder, "edit-replay") {
        Ok(by) => by,
        Err(why) => return refused(why, &format!("/ladders/{}/parked/{offset}/edit", segment(&ladder))),
    };
    let raw = |key: &str| {
        pairs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let submitted = Submitted {
        headers: raw("headers"),
        body: raw("body"),
        encoding: raw("body_encoding"),
        to: raw("to"),
    };
    let entry = match state.desk.show(&ladder, offset).await {
        Ok(entry) => entry,
        Err(e) => return parking_error(&e),
    };
    let again = |status: StatusCode, error: &str| {
        (status, edit_page(&ladder, &entry, Some(&submitted), Some(error))).into_response()
    };
    let headers = match serde_json::from_str::<Value>(&submitted.headers) {
        Ok(v) => v,
        Err(e) => return again(StatusCode::BAD_REQUEST, &format!("the headers are not JSON: {e}")),
    };
    let original = entry.body().map(|b| b.into_owned()).unwrap_or_default();
    let mut request = api::EditRequest {
        headers: Some(headers),
        ..api::EditRequest::default()
    };
    match submitted.encoding.as_str() {
        // a large body the form did not offer, left empty: kept
        _ if submitted.body.is_empty() && original.len() > EDITABLE_BODY_BYTES => {}
        "base64" => request.body_base64 = Some(submitted.body.clone()),
        _ => {
            // browsers send a textarea's line breaks as CRLF: keep the original's LF
            let text = if original.contains(&b'\r') {
                submitted.body.clone()
            } else {
                submitted.body.replace("\r\n", "\n")
            };
            request.body = Some(text);
        }
    }
    let edit = match request.edit(state.config.limits.max_header_bytes) {
        Ok(edit) => edit,
        Err(e) => return again(api::ApiError::status(&e), &e.to_string()),
    };
    let to = Some(submitted.to.trim().to_string()).filter(|t| !t.is_empty());
    if let Err(e) = api::check_edit(&state, &ladder, offset, to.as_deref(), &edit).await {
        return again(api::ApiError::status(&e), &e.to_string());
    }
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
    match state.desk.replay(&ladder, filter, options) {
        Ok(job) => job_answer(&state, &job, Some(offset)).await,
        Err(e) => parking_error(&e),
    }
}

/// `replay` or `discard`; anything else is not a page.
fn action_of(action: &str) -> Option<&'static str> {
    match action {
        "replay" => Some("replay"),
        "discard" => Some("discard"),
        _ => None,
    }
}

pub(crate) fn token_field() -> Markup {
    html! { label { "Token " input type="password" name="token" autocomplete="off" required; } }
}

pub(crate) async fn confirm_one(
    Extract(state): Extract<Arc<AdminState>>,
    Path((ladder, offset, action)): Path<(String, u64, String)>,
) -> Response {
    let Some(action) = action_of(&action) else {
        return error_page(StatusCode::NOT_FOUND, "no such page");
    };
    match state.desk.show(&ladder, offset).await {
        Ok(e) => confirm_page(&ladder, action, &e).into_response(),
        Err(e) => parking_error(&e),
    }
}

/// The confirmation form for replaying or discarding one entry, with its summary.
fn confirm_page(ladder: &str, action: &str, e: &ParkedEntry) -> Html<String> {
    let offset = e.offset;
    let body = html! {
        (summary(ladder, e))
        form #confirm method="post" action={ "/ladders/" (ladder) "/parked/" (offset) "/" (action) } {
            @if action == "replay" {
                p { "Republish this message with a fresh attempt count to:" }
                label { "Queue " input type="text" name="to" value=(e.envelope.destination.as_deref().unwrap_or("")); }
            } @else {
                p { "Mark this message as discarded. Its record stays in the stream until retention removes it." }
            }
            " " (token_field()) " "
            button #confirm-button type="submit" { @if action == "replay" { "Replay" } @else { "Discard" } }
        }
        p { a href={ "/ladders/" (ladder) "/parked/" (offset) } { "Cancel" } }
    };
    page(&format!("Confirm {action} of entry {offset}"), body)
}

/// Takes `key` out of form `pairs`.
pub(crate) fn take(pairs: &mut Vec<(String, String)>, key: &str) -> Option<String> {
    let i = pairs.iter().position(|(k, _)| k == key)?;
    Some(pairs.remove(i).1).filter(|v| !v.trim().is_empty())
}

/// The caller's name for the form's token, or why it is refused (logged).
pub(crate) fn caller(
    state: &AdminState,
    token: Option<&str>,
    ladder: &str,
    action: &str,
) -> Result<String, &'static str> {
    api::authorize(&state.config.admin.tokens, token)
        .map(str::to_string)
        .map_err(|denied| {
            let why = match denied {
                Denied::Missing => "no token was given",
                Denied::Wrong => "the token matches none in admin.tokens",
            };
            tracing::warn!(ladder, "{action} from the web page refused: {why}");
            why
        })
}

/// The refusal page, linking back to the confirmation form at `form`.
pub(crate) fn refused(why: &str, form: &str) -> Response {
    let body = html! {
        p #outcome .error { "Not done: " (why) "." }
        p { a #back href=(form) { "Back to the confirmation, to enter a valid token" } }
    };
    (StatusCode::FORBIDDEN, page("Not done", body)).into_response()
}

pub(crate) async fn act_on_one(
    Extract(state): Extract<Arc<AdminState>>,
    Path((ladder, offset, action)): Path<(String, u64, String)>,
    Form(mut pairs): Form<Vec<(String, String)>>,
) -> Response {
    let Some(action) = action_of(&action) else {
        return error_page(StatusCode::NOT_FOUND, "no such page");
    };
    let by = match caller(&state, take(&mut pairs, "token").as_deref(), &ladder, action) {
        Ok(by) => by,
        Err(why) => return refused(why, &format!("/ladders/{ladder}/parked/{offset}/{action}")),
    };
    let filter = Filter {
        offsets: Some([offset].into()),
        ..Filter::default()
    };
    let job = if action == "replay" {
        let options = ReplayOptions {
            to: take(&mut pairs, "to"),
            rate: None,
            dry_run: false,
            by,
            edit: None,
        };
        state.desk.replay(&ladder, filter, options)
    } else {
        state.desk.discard(&ladder, filter, by)
    };
    match job {
        Ok(job) => job_answer(&state, &job, Some(offset)).await,
        Err(e) => parking_error(&e),
    }
}

/// How long a form post waits for its job before it sends the operator to the job's page.
const PAGE_JOB_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The answer to a form post that started `job`: its outcome page when it ends within
/// [`PAGE_JOB_WAIT`], else a redirect to its progress page (which refreshes itself).
async fn job_answer(state: &AdminState, job: &Job, offset: Option<u64>) -> Response {
    let view = state.desk.wait(job, PAGE_JOB_WAIT).await;
    if view.done {
        return outcome_page(&view, offset);
    }
    let to = format!("/ladders/{}/jobs/{}", segment(&view.ladder), view.id);
    (StatusCode::SEE_OTHER, [(axum::http::header::LOCATION, to)]).into_response()
}

/// `GET /ladders/{ladder}/jobs/{id}`: a job's progress, refreshing every two seconds until it
/// ends, then its outcomes.
pub(crate) async fn job_page(
    Extract(state): Extract<Arc<AdminState>>,
    Path((ladder, id)): Path<(String, u64)>,
) -> Response {
    match state.desk.job(&ladder, id) {
        Ok(view) => outcome_page(&view, None),
        Err(e) => parking_error(&e),
    }
}

fn outcome_page(view: &JobView, offset: Option<u64>) -> Response {
    let ladder = view.ladder.as_str();
    let action = view.kind.to_string();
    let failed = view
        .outcomes
        .iter()
        .filter(|o| matches!(o.status, Status::Failed { .. }))
        .count();
    let done = view.outcomes.len() - failed;
    let verb = match view.kind {
        JobKind::Replay => "replayed",
        JobKind::Discard => "discarded",
    };
    let title = format!("{ladder} {action} #{}", view.id);
    let body = html! {
        @if !view.done { meta http-equiv="refresh" content="2"; }
        p #outcome .(if failed == 0 && view.error.is_none() { "ok" } else { "error" }) {
            @if let Some(error) = &view.error { "Stopped: " (error) ". " }
            @if !view.done {
                "Running: " (view.outcomes.len()) " of " (view.selected.map_or("?".to_string(), |n| n.to_string())) " done"
                @if failed > 0 { " (" (failed) " failed)" } "; this page refreshes itself."
            } @else if view.outcomes.is_empty() && view.error.is_none() {
                "Nothing to " (action) ": no unresolved entry matched (another operator may have resolved it)."
            } @else {
                (done) " " (verb) @if failed > 0 { ", " (failed) " failed" } "."
            }
            @if view.left_over > 0 { " " (view.left_over) " more match; run it again for the next batch." }
        }
        p { "Started by " (view.by) " at " (format_time(view.started_at_ms)) "." }
        table #outcomes {
            tr { th { "Offset" } th { "To" } th { "Result" } }
            @for o in &view.outcomes {
                tr {
                    td { a href={ "/ladders/" (segment(ladder)) "/parked/" (o.offset) } { (o.offset) } }
                    td { (o.to.as_deref().unwrap_or("-")) }
                    td { @match &o.status {
                        Status::Replayed => { "replayed" }
                        Status::WouldReplay => { "would replay" }
                        Status::Discarded => { "discarded" }
                        Status::Failed { error } => { span .error { "failed: " (error) } }
                    } }
                }
            }
        }
        p {
            @if let Some(offset) = offset { a href={ "/ladders/" (segment(ladder)) "/parked/" (offset) } { "Back to the entry" } " · " }
            a href={ "/ladders/" (segment(ladder)) "/parked" } { "Parked messages" }
        }
    };
    let status = match view.failure {
        Some(kind) => api::ApiError::status_of(kind),
        None if failed > 0 => StatusCode::BAD_GATEWAY,
        None => StatusCode::OK,
    };
    (status, page(&title, body)).into_response()
}

/// A listing query for bulk actions: the filter only (paging and `resolved` do not apply).
fn bulk_query(pairs: &[(String, String)]) -> Result<ListQuery, ParkingError> {
    let filter_only: Vec<(String, String)> = pairs
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "offset" | "limit" | "resolved"))
        .cloned()
        .collect();
    let q = api::parse_query(&filter_only, crate::clock::now_ms())?;
    if q.filter.is_empty() {
        return Err(ParkingError::Invalid(
            "choose at least one filter before acting on everything that matches".into(),
        ));
    }
    Ok(q)
}

pub(crate) async fn confirm_matching(
    Extract(state): Extract<Arc<AdminState>>,
    Path((ladder, action)): Path<(String, String)>,
    Query(pairs): Query<Vec<(String, String)>>,
) -> Response {
    let Some(action) = action_of(&action) else {
        return error_page(StatusCode::NOT_FOUND, "no such page");
    };
    let q = match bulk_query(&pairs) {
        Ok(q) => q,
        Err(e) => return parking_error(&e),
    };
    let count = PageRequest { offset: 0, limit: 0 };
    // what the action would act on: unresolved entries
    let unresolved = q.filter.clone().with_entries(Entries::Unresolved);
    let total = match state.desk.list(&ladder, &unresolved, count).await {
        Ok(found) => found.total,
        Err(e) => return parking_error(&e),
    };
    let body = html! {
        p { "Filter: " code { (query_string(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())))) } }
        p { span #count { (total) } " unresolved entries match now (at most " (parking::MAX_ACTION_BATCH) " per run)." }
        form #confirm method="post" action={ "/ladders/" (ladder) "/matching/" (action) } {
            @for (k, v) in pairs.iter().filter(|(k, _)| !matches!(k.as_str(), "offset" | "limit" | "resolved")) {
                input type="hidden" name=(k) value=(v);
            }
            @if action == "replay" {
                p { "Republish each to its destination with a fresh attempt count." }
                label { "Rate " input type="text" name="rate" value=(DEFAULT_BULK_RATE); }
                " "
            } @else {
                p { "Mark each as discarded." }
            }
            (token_field()) " "
            button #confirm-button type="submit" { @if action == "replay" { "Replay " (total) } @else { "Discard " (total) } }
        }
        p { a href={ "/ladders/" (ladder) "/parked?" (query_string(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())))) } { "Cancel" } }
    };
    page(&format!("Confirm {action} of matching entries — {ladder}"), body).into_response()
}

pub(crate) async fn act_on_matching(
    Extract(state): Extract<Arc<AdminState>>,
    Path((ladder, action)): Path<(String, String)>,
    Form(mut pairs): Form<Vec<(String, String)>>,
) -> Response {
    let Some(action) = action_of(&action) else {
        return error_page(StatusCode::NOT_FOUND, "no such page");
    };
    let rate = take(&mut pairs, "rate");
    let by = match caller(&state, take(&mut pairs, "token").as_deref(), &ladder, action) {
        Ok(by) => by,
        Err(why) => {
            let filters = query_string(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            return refused(why, &format!("/ladders/{ladder}/matching/{action}?{filters}"));
        }
    };
    let q = match bulk_query(&pairs) {
        Ok(q) => q,
        Err(e) => return parking_error(&e),
    };
    let job = if action == "replay" {
        let rate = match rate
            .map(|r| r.parse::<crate::model::lot::pace::Rate>())
            .transpose()
            .map_err(ParkingError::from)
        {
            Ok(rate) => rate,
            Err(e) => return parking_error(&e),
        };
        let options = ReplayOptions {
            to: None,
            rate,
            dry_run: false,
            by,
            edit: None,
        };
        state.desk.replay(&ladder, q.filter, options)
    } else {
        state.desk.discard(&ladder, q.filter, by)
    };
    match job {
        Ok(job) => job_answer(&state, &job, None).await,
        Err(e) => parking_error(&e),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::model::envelope::Envelope;
    use crate::model::envelope::testing::{
        DEEP_LEVELS, LONG, OUT_OF_RANGE_TIMES, deep_record, entry_at, odd_entry, parked_entry,
    };

    /// Every page that shows an entry: in full, both confirmations, its row in the list.
    fn pages(e: &ParkedEntry) -> [String; 4] {
        [
            entry_page("default", e).0,
            confirm_page("default", "discard", e).0,
            confirm_page("default", "replay", e).0,
            entries_table("default", std::slice::from_ref(e)).into_string(),
        ]
    }

    /// The control characters in `page` other than the newlines and tabs of the markup.
    fn raw_controls(page: &str) -> Vec<char> {
        page.chars()
            .filter(|c| (c.is_control() && !matches!(c, '\n' | '\t')) || *c == '\u{202e}')
            .collect()
    }

    fn status(verdict: &'static str, missing: Option<i64>, unaccounted: u64) -> AccountingStatus {
        AccountingStatus {
            verdict,
            anchored: verdict != "unchecked",
            missing,
            unaccounted,
            in_doubt: 0,
        }
    }

    #[test]
    fn the_accounting_reads_as_a_sentence() {
        let at_12_04 = 1_763_726_640_000; // 2025-11-21T12:04:00Z
        for (s, received, since, class, expected) in [
            (
                status("balanced", Some(0), 0),
                12_408,
                None,
                "ok",
                "All 12 408 messages accounted for.",
            ),
            (
                status("balanced", Some(0), 0),
                1,
                None,
                "ok",
                "All 1 message accounted for.",
            ),
            (
                status("anchored", None, 0),
                1_000_000,
                None,
                "ok",
                "Check started: all 1 000 000 messages accounted for.",
            ),
            (
                status("unaccounted", Some(3), 3),
                50,
                Some(at_12_04),
                "bad",
                "3 messages unaccounted for since 12:04 UTC — see the runbook LadderUnaccountedMessages (docs/src/operations/runbooks.md#runbook-ladderunaccountedmessages).",
            ),
            // still reported while traffic moves again
            (
                status("busy", Some(3), 3),
                50,
                Some(at_12_04),
                "bad",
                "3 messages unaccounted for since 12:04 UTC — see the runbook LadderUnaccountedMessages (docs/src/operations/runbooks.md#runbook-ladderunaccountedmessages).",
            ),
            (
                status("suspect", Some(2), 0),
                50,
                None,
                "warn",
                "2 messages not found at the last quiet poll; checking again before raising the alarm.",
            ),
            (
                status("busy", Some(0), 0),
                50,
                None,
                "ok",
                "Messages are moving; at the last quiet poll every one was accounted for.",
            ),
        ] {
            assert_eq!(
                accounting_sentence(&s, received, since),
                (class, expected.to_string()),
                "{s:?}"
            );
        }
        let (class, text) = accounting_sentence(&status("unchecked", None, 0), 0, None);
        assert_eq!(class, "idle");
        assert!(text.starts_with("Not checked yet"), "{text}");
        let not_anchored = AccountingStatus {
            anchored: false,
            ..status("busy", None, 0)
        };
        assert_eq!(accounting_sentence(&not_anchored, 5, None).0, "idle");
        for verdict in [
            "balanced",
            "anchored",
            "rebased",
            "suspect",
            "unaccounted",
            "busy",
            "unchecked",
        ] {
            let (_, text) = accounting_sentence(&status(verdict, Some(1), 0), 7, None);
            assert!(!text.contains(verdict) || verdict == "unaccounted", "{verdict}: {text}");
        }
    }

    #[test]
    fn numbers_are_grouped_by_thousands() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(12_408), "12 408");
        assert_eq!(grouped(1_000_000), "1 000 000");
    }

    #[test]
    fn an_edited_replay_shows_who_changed_what_on_the_entry() {
        use crate::model::lot::edit::{BodyChange, EditAudit};
        let mut e = entry_at(1_763_726_640_000);
        let mut resolution = e
            .resolution
            .clone()
            .unwrap_or_else(|| crate::model::lot::record::Resolution {
                format: crate::model::lot::record::RESOLUTION_FORMAT.into(),
                resolves: e.offset,
                action: crate::model::lot::record::Action::Replayed,
                by: "x".into(),
                at_ms: 1,
                to: None,
                edit: None,
            });
        resolution.action = crate::model::lot::record::Action::Replayed;
        resolution.by = "alice<script>".into();
        resolution.to = Some("orders".into());
        resolution.edit = Some(EditAudit {
            headers_added: vec!["region".into()],
            headers_removed: Vec::new(),
            headers_changed: vec!["tenant".into()],
            body: Some(BodyChange {
                from_bytes: 2,
                from_sha256: "aa".into(),
                to_bytes: 14,
                to_sha256: "bb".into(),
            }),
        });
        e.resolution = Some(resolution);
        let page = entry_page("default", &e).0;
        assert!(
            page.contains("replayed edited to orders by alice&lt;script&gt;"),
            "{page}"
        );
        assert!(page.contains("id=\"edit-link\" href=\"#edit\""), "{page}");
        assert!(page.contains("<th>Headers added</th><td>region</td>"), "{page}");
        assert!(page.contains("<th>Headers changed</th><td>tenant</td>"), "{page}");
        assert!(
            page.contains("2 bytes (SHA-256 <code>aa</code>) → 14 bytes (SHA-256 <code>bb</code>)"),
            "{page}"
        );
        assert!(!page.contains("id=\"edit-replay\""), "a resolved entry offers no edit");
        // the form of an unresolved one shows its headers as typed JSON, escaped
        e.resolution = None;
        let form = edit_page("default", &e, None, None).0;
        assert!(
            form.contains("id=\"edit-headers\"") && form.contains("&quot;type&quot;"),
            "{form}"
        );
        assert!(form.contains("name=\"token\""), "the edit is confirmed with a token");
    }

    #[test]
    fn times_out_of_range_show_as_the_number() {
        for ms in OUT_OF_RANGE_TIMES {
            let [entry, discard, replay, row] = pages(&entry_at(ms));
            // first failed, parked at, the history's failure and the resolution
            assert_eq!(entry.matches(&ms.to_string()).count(), 4, "{entry}");
            for page in [discard, replay] {
                assert_eq!(page.matches(&ms.to_string()).count(), 3, "{page}");
            }
            assert_eq!(row.matches(&ms.to_string()).count(), 2, "{row}");
        }
    }

    #[test]
    fn odd_values_show_visibly() {
        let e = odd_entry();
        let [entry, discard, _, row] = pages(&e);
        let long = "x".repeat(LONG);
        assert!(entry.contains(&format!("<code>&quot;{long}&quot;</code>")) || entry.contains(&long));
        let entry = entry.replace(&long, "x…");
        for page in [&entry, &discard, &row] {
            assert!(raw_controls(page).is_empty(), "{:?} in\n{page}", raw_controls(page));
        }
        for expected in [
            "max-attempts\\u{1b}[2J",
            "line one\\nline two\\r\\0\\u{9b}",
            "(du\\u{7}e hop)",
            "discarded by o\\u{1b}ps",
            "id-\u{fffd}\\u{1b}[2J (bytes, base64 aWQt/xtbMko=)",
            "c\\u{7}\\u{202e}1",
            "<td>1e+300</td>",
            "<td>18446744073709551615</td>",
            "{&quot;base64&quot;:&quot;not base64!&quot;}",
            "<td>k\u{fffd}\\0</td><td>double</td><td><code>NaN</code>",
            "<td>k</td><td>float</td><td><code>inf</code>",
            "<td>k</td><td>double</td><td><code>-inf</code>",
            "a\\nb\\u{1b}[31m\\u{9b}",
            "<code>base64 /wAb</code>",
            "<code>-9223372036854775808</code>",
            "8 bytes, binary (hex)",
        ] {
            assert!(entry.contains(expected), "{expected:?} not in\n{entry}");
        }
        assert!(
            row.contains("id-\u{fffd}\\u{1b}[2J") && row.contains("or\\nders"),
            "{row}"
        );
    }

    /// The admin server's threads have [`crate::DEEP_STACK_BYTES`] of stack (the binary builds
    /// its runtime so): a header nested 24 000 levels deep renders there, in HTML and in JSON.
    #[test]
    fn a_header_nested_24000_deep_renders_on_the_admin_threads_stack() {
        let render = || {
            let envelope = Envelope::from_slice(&deep_record(DEEP_LEVELS, "orders")).unwrap();
            let e = ParkedEntry {
                offset: 7,
                envelope,
                resolution: None,
                body_apart: None,
            };
            let [entry, ..] = pages(&e);
            assert!(entry.contains("bottom") && entry.contains("<td>deep</td><td>field-array</td>"));
            let json = serde_json::to_string(&e).unwrap();
            assert!(json.contains("bottom"));
        };
        std::thread::Builder::new()
            .stack_size(crate::DEEP_STACK_BYTES)
            .spawn(render)
            .unwrap()
            .join()
            .unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

        /// Any entry a record can hold renders on every page, and nothing from it reaches a
        /// page as a raw control character (but the replay form's queue, which is submitted
        /// as it stands, and a text body's tabs and carriage returns).
        #[test]
        fn every_page_renders_any_entry(e in parked_entry()) {
            let [entry, discard, _, row] = pages(&e);
            for page in [entry, discard, row] {
                let raw: Vec<char> = raw_controls(&page).into_iter().filter(|c| c.is_control() && *c != '\r').collect();
                prop_assert!(raw.is_empty(), "{:?} in {}", raw, page);
            }
        }
    }
}
