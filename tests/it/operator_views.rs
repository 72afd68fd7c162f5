//! Every operator view — `ladder parked` (the real binary), the web page and the JSON API (the
//! admin router, on a desk following the real stream) — shows records holding any value a
//! message can carry, without panicking: times after the year 9999 (`u64::MAX` included), odd
//! values everywhere (control characters, bytes that are not UTF-8, non-finite floats, numbers
//! beyond every AMQP range, very long strings), and a header nested 24 000 arrays deep, as
//! versions that read any nesting wrote. The records are parked straight into the lot's stream.

use std::process::Output;
use std::sync::Arc;

use crate::common::*;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use http_body_util::BodyExt;
use ladder::admin::{AdminState, router};
use ladder::broker::state::State;
use ladder::model::envelope::{Envelope, FORMAT, OriginalMessage};
use ladder::model::lot::record::{Action, RESOLUTION_FORMAT, Resolution};
use ladder::model::protocol::HistoryEntry;
use ladder_amqp::{BasicProperties, FieldTable, FieldValue, ShortString};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// A ladder whose allow-list takes the test's queues (`{ns}-…`).
const LADDER: &str = "backoff = [\"1s\"]\nmax_attempts = 1\nallow = [\"^{ns}-\"]";

/// The year 10000 begins (ms since the epoch): RFC 3339 cannot show it.
const YEAR_10000_MS: u64 = 253_402_300_800_000;

/// How deep [`deep_record`] nests: beyond what the 8 MiB of a main thread can decode, print or
/// drop in a debug build.
const DEEP_LEVELS: usize = 24_000;

/// A ladder with its topology declared and no service running.
async fn lot(hint: &str) -> TestLadder {
    let t = TestLadder::configure(hint, LADDER).await;
    ladder::broker::declare::apply(&t.config)
        .await
        .expect("the topology is declared");
    t
}

/// Appends `records` — `(type, body)` — to the lot's stream: offsets 0, 1, … in a new lot.
async fn append(t: &TestLadder, records: Vec<(&str, Vec<u8>)>) {
    for (kind, body) in records {
        let props = BasicProperties::default().with_delivery_mode(2).with_type(kind);
        t.publish("", &t.parked_stream(), &body, props).await;
    }
}

fn envelope(t: &TestLadder, props: &BasicProperties, body: &[u8]) -> Envelope {
    Envelope {
        format: FORMAT.into(),
        reason: "max-attempts".into(),
        detail: "failed after 1 retries".into(),
        ladder: t.ladder.clone(),
        destination: Some(format!("{}-orders", t.ns)),
        attempts: Some(1),
        first_failed_at_ms: Some(1),
        history: vec![],
        replayed_from: None,
        parked_at_ms: now_ms(),
        hop: "intake".into(),
        message: OriginalMessage::capture(t.intake(), "", props, body),
    }
}

/// An entry whose every time is `ms`.
fn entry_at(t: &TestLadder, ms: u64) -> (&'static str, Vec<u8>) {
    let mut e = envelope(t, &BasicProperties::default().with_message_id("late"), b"{}");
    e.first_failed_at_ms = Some(ms);
    e.parked_at_ms = ms;
    e.history = vec![HistoryEntry {
        attempt: 1,
        tier: "1s".into(),
        failed_at_ms: ms,
    }];
    (FORMAT, serde_json::to_vec(&e).unwrap())
}

/// Offsets 0 and 1: entries at the year 10000 and at `u64::MAX`; offset 2 resolves the second
/// at `u64::MAX`.
async fn late_lot(hint: &str) -> TestLadder {
    let t = lot(hint).await;
    let resolution = Resolution {
        format: RESOLUTION_FORMAT.into(),
        resolves: 1,
        action: Action::Discarded,
        by: "ops".into(),
        at_ms: u64::MAX,
        to: None,
        edit: None,
    };
    let records = vec![
        entry_at(&t, YEAR_10000_MS),
        entry_at(&t, u64::MAX),
        (RESOLUTION_FORMAT, serde_json::to_vec(&resolution).unwrap()),
    ];
    append(&t, records).await;
    t
}

/// Offset 0: an entry with odd values everywhere.
async fn odd_lot(hint: &str) -> TestLadder {
    let t = lot(hint).await;
    let key = |k: &[u8]| ShortString::new(k).unwrap();
    let headers: FieldTable = [
        (key(b"k\xfe"), FieldValue::Double(f64::NAN)),
        (key(b"k"), FieldValue::Float(f32::NEG_INFINITY)),
        (key(b"k"), FieldValue::LongString("esc \x1b[2J bell \x07".into())),
        (key(b"long"), FieldValue::LongString("y".repeat(200_000).into())),
        (key(b"min"), FieldValue::LongLongInt(i64::MIN)),
    ]
    .into_iter()
    .collect();
    let props = BasicProperties {
        message_id: Some(key(b"id-\xff\x1b[2J")),
        headers: Some(headers),
        ..BasicProperties::default()
    };
    let mut e = envelope(&t, &props, b"\x1b]0;title\x07binary");
    e.detail = "line\nbreak \x1b[31m red \u{202e} flipped".into();
    e.attempts = Some(u64::MAX);
    let stored = e.message.properties.as_object_mut().unwrap();
    stored.insert("priority".into(), json!(1e300));
    stored.insert("timestamp".into(), json!(u64::MAX));
    stored.insert("app_id".into(), json!({"base64": "not base64!"}));
    append(&t, vec![(FORMAT, serde_json::to_vec(&e).unwrap())]).await;
    t
}

/// The body of a `ladder.parked/v1` record to `destination` whose header `deep` is a field
/// array nested `levels` deep. Built as text: a value this deep cannot even be dropped on the
/// test's own stack.
fn deep_record(levels: usize, destination: &str) -> Vec<u8> {
    let mut header = r#"{"type":"field-array","value":["#.repeat(levels);
    header.push_str(r#"{"type":"long-string","value":"bottom"}"#);
    header.push_str(&"]}".repeat(levels));
    format!(
        r#"{{"format":"{FORMAT}","reason":"invalid-header","detail":"deep","ladder":"default","destination":"{destination}","attempts":null,"first_failed_at_ms":null,"parked_at_ms":{},"hop":"intake","message":{{"exchange":"x","routing_key":"","properties":{{"message_id":"deep","headers":{{"deep":{header}}}}},"body_base64":"{}"}}}}"#,
        now_ms(),
        B64.encode("deep body"),
    )
    .into_bytes()
}

/// Offset 0: an entry whose header nests [`DEEP_LEVELS`] deep.
async fn deep_lot(hint: &str) -> TestLadder {
    let t = lot(hint).await;
    append(
        &t,
        vec![(FORMAT, deep_record(DEEP_LEVELS, &format!("{}-orders", t.ns)))],
    )
    .await;
    t
}

/// `ladder --config <t's config> <args…>`.
async fn cli(t: &TestLadder, args: &[&str]) -> Output {
    run_ladder(&t.config_path(), args, &[("RUST_LOG", "warn"), ("USER", "views-test")]).await
}

/// Runs `ladder parked <args…>`, asserts it exits 0, and returns what it printed.
async fn parked(t: &TestLadder, args: &[&str]) -> String {
    let mut all = vec!["parked"];
    all.extend_from_slice(args);
    let out = cli(t, &all).await;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "ladder {all:?}: {:?}\nstderr: {}\nstdout: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        stdout.chars().take(2000).collect::<String>()
    );
    stdout
}

/// Control characters in `text` other than newlines and tabs.
fn raw_controls(text: &str) -> Vec<char> {
    text.chars()
        .filter(|c| c.is_control() && !matches!(c, '\n' | '\t'))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_shows_times_after_the_year_9999() {
    let t = late_lot("views-late-cli").await;
    for (offset, ms) in [("0", YEAR_10000_MS), ("1", u64::MAX)] {
        let shown = parked(&t, &["show", offset]).await;
        for line in ["first failed", "failed at", "parked at"] {
            let line = shown.lines().find(|l| l.contains(line)).unwrap_or_default();
            assert!(
                line.contains(&format!("{ms} ms since the epoch")),
                "{line:?} in\n{shown}"
            );
        }
        assert!(parked(&t, &["show", offset, "--json"]).await.contains(&ms.to_string()));
    }
    let resolved = parked(&t, &["show", "1"]).await;
    assert!(
        resolved.contains(&format!("discarded by ops at {} ms since the epoch", u64::MAX)),
        "{resolved}"
    );
    let table = parked(&t, &["list", "--all"]).await;
    assert!(
        table.contains(&YEAR_10000_MS.to_string()) && table.matches(&u64::MAX.to_string()).count() == 2,
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_cli_shows_odd_values_without_a_raw_control_character() {
    let t = odd_lot("views-odd-cli").await;
    let shown = parked(&t, &["show", "0"]).await;
    assert!(raw_controls(&shown).is_empty(), "{:?}", raw_controls(&shown));
    for expected in [
        "detail       line\\nbreak \\u{1b}[31m red \\u{202e} flipped",
        "attempts     18446744073709551615",
        "message_id = \"id-\u{fffd}\\u001b[2J\" (bytes, base64 \"aWQt/xtbMko=\")",
        "priority = 1e+300",
        "timestamp = 18446744073709551615",
        "app_id = {\"base64\":\"not base64!\"}",
        "k\u{fffd} (double) = \"NaN\"",
        "k (float) = \"-inf\"",
        "k (long-string) = \"esc \\u001b[2J bell \\u0007\"",
        "min (long-long-int) = -9223372036854775808",
        "body (16 bytes, hex)",
    ] {
        assert!(
            shown.contains(expected),
            "{expected:?} not in\n{}",
            shown.replace(&"y".repeat(200_000), "y…")
        );
    }
    assert!(shown.contains(&"y".repeat(200_000)));
    let table = parked(&t, &["list"]).await;
    assert!(
        raw_controls(&table).is_empty() && table.contains("id-\u{fffd}\\u{1b}[2J"),
        "{table}"
    );
}

/// The main thread has 8 MiB of stack; decoding, printing, replaying (which decodes the headers
/// into AMQP values and strips them) and dropping such a record recurse once per level.
#[tokio::test(flavor = "multi_thread")]
async fn the_cli_shows_and_dry_runs_a_header_nested_24000_deep() {
    let t = deep_lot("views-deep-cli").await;
    let shown = parked(&t, &["show", "0"]).await;
    assert!(shown.contains("deep (field-array) = [{\"type\":\"field-array\"") && shown.contains("bottom"));
    assert!(parked(&t, &["show", "0", "--json"]).await.contains("bottom"));
    assert!(parked(&t, &["list"]).await.contains("invalid-header"));
    let dry = parked(&t, &["replay", "0", "--dry-run"]).await;
    assert!(dry.contains(&format!("0\twould replay to {}-orders", t.ns)), "{dry}");
}

/// An admin router on a desk that follows `t`'s lot, once its index holds `entries` entries.
async fn admin(t: &TestLadder, entries: usize) -> (axum::Router, CancellationToken) {
    let (_, snapshots) = tokio::sync::watch::channel(None);
    let state = Arc::new(AdminState::new(t.config.clone(), Arc::new(State::default()), snapshots));
    let stop = CancellationToken::new();
    tokio::spawn(state.desk.clone().follow(stop.clone()));
    let desk = state.desk.clone();
    wait_until("the desk indexed the lot", || {
        desk.status(&t.ladder)
            .is_ok_and(|s| s.caught_up && s.entries == entries)
    })
    .await;
    (router(state), stop)
}

/// `GET uri`: the status and the body as text.
async fn get(router: &axum::Router, uri: &str) -> (StatusCode, String) {
    let request = Request::builder().uri(uri).body(Body::empty()).unwrap();
    let response = tokio::time::timeout(WAIT, router.clone().oneshot(request))
        .await
        .expect("answered in time")
        .expect("a response");
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// `GET uri`, asserting 200; the body.
async fn page(router: &axum::Router, uri: &str) -> String {
    let (status, body) = get(router, uri).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{uri}: {}",
        body.chars().take(2000).collect::<String>()
    );
    body
}

#[tokio::test(flavor = "multi_thread")]
async fn the_pages_and_the_api_show_times_after_the_year_9999() {
    let t = late_lot("views-late-http").await;
    let (router, stop) = admin(&t, 2).await;
    for (offset, ms) in [(0, YEAR_10000_MS), (1, u64::MAX)] {
        let late = format!("{ms} ms since the epoch");
        let entry = page(&router, &format!("/ladders/default/parked/{offset}")).await;
        // first failed, parked at, the history's failure (and the resolution of the second)
        assert!(entry.matches(&late).count() >= 3, "{entry}");
        for action in ["discard", "replay"] {
            let confirm = page(&router, &format!("/ladders/default/parked/{offset}/{action}")).await;
            assert!(confirm.contains(&late), "{confirm}");
        }
        let api = page(&router, &format!("/api/ladders/default/parked/{offset}")).await;
        assert!(api.contains(&format!("\"parked_at_ms\":{ms}")), "{api}");
    }
    let list = page(&router, "/ladders/default/parked?resolved=include").await;
    assert!(list.contains(&format!("{YEAR_10000_MS} ms since the epoch")), "{list}");
    assert!(
        list.contains(&format!("discarded by ops at {} ms since the epoch", u64::MAX)),
        "{list}"
    );
    let api = page(&router, "/api/ladders/default/parked?resolved=include").await;
    assert!(api.contains(&format!("\"at_ms\":{}", u64::MAX)), "{api}");
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_pages_and_the_api_show_odd_values() {
    let t = odd_lot("views-odd-http").await;
    let (router, stop) = admin(&t, 1).await;
    let entry = page(&router, "/ladders/default/parked/0").await;
    assert!(raw_controls(&entry).is_empty(), "{:?}", raw_controls(&entry));
    for expected in [
        "line\\nbreak \\u{1b}[31m red \\u{202e} flipped",
        "<td>18446744073709551615</td>",
        "id-\u{fffd}\\u{1b}[2J (bytes, base64 aWQt/xtbMko=)",
        "<td>1e+300</td>",
        "<td>k\u{fffd}</td><td>double</td><td><code>NaN</code>",
        "<td>k</td><td>float</td><td><code>-inf</code>",
        "esc \\u{1b}[2J bell \\u{7}",
        "16 bytes, binary (hex)",
    ] {
        assert!(
            entry.contains(expected),
            "{expected:?} not in\n{}",
            entry.replace(&"y".repeat(200_000), "y…")
        );
    }
    for uri in [
        "/ladders/default/parked",
        "/ladders/default/parked/0/discard",
        "/ladders/default/parked/0/replay",
    ] {
        let shown = page(&router, uri).await;
        assert!(raw_controls(&shown).is_empty(), "{uri}: {shown}");
    }
    let api: serde_json::Value = serde_json::from_str(&page(&router, "/api/ladders/default/parked/0").await).unwrap();
    assert_eq!(api["envelope"]["attempts"], json!(u64::MAX));
    assert_eq!(
        api["envelope"]["message"]["properties"]["message_id"],
        json!({"base64": "aWQt/xtbMko="})
    );
    stop.cancel();
}

/// The admin server runs on the runtime's worker threads, which the binary gives
/// [`ladder::DEEP_STACK_BYTES`] of stack; so does this test, and asks from one of them.
#[test]
fn the_pages_and_the_api_show_a_header_nested_24000_deep() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(ladder::DEEP_STACK_BYTES)
        .build()
        .unwrap();
    runtime.block_on(async {
        tokio::spawn(async {
            let t = deep_lot("views-deep-http").await;
            let (router, stop) = admin(&t, 1).await;
            let entry = page(&router, "/ladders/default/parked/0").await;
            assert!(entry.contains("<td>deep</td><td>field-array</td>") && entry.contains("bottom"));
            for uri in [
                "/ladders/default/parked/0/replay",
                "/ladders/default/parked?header=deep%3Dx",
                "/api/ladders/default/parked",
            ] {
                page(&router, uri).await;
            }
            assert!(page(&router, "/api/ladders/default/parked/0").await.contains("bottom"));
            stop.cancel();
        })
        .await
        .unwrap();
    });
}
