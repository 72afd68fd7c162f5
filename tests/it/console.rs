//! The operator console in headless Chromium (the harness is `browser.rs`'s), at a laptop's
//! 1366×768: the overview draws the last hour as SVG charts and says the accounting in words,
//! and an operator edits a parked message's headers and body and replays it — the edited
//! message arrives, the entry keeps the original and names who changed what.
//!
//! Each page is saved as a PNG under `/tmp/console-shots/` (the viewport, and the whole page
//! as `*-full.png`), for a person to look at.

use std::time::Duration;

use crate::browser::{Browser, OPERATOR, TOKEN, admin_with_token, step};
use crate::common::parking::ONE_TIER;
use crate::common::*;
use ladder_amqp::{BasicProperties, FieldTable, FieldValue};
use serde_json::Value;

/// Where the screenshots go.
const SHOTS: &str = "/tmp/console-shots";

/// A laptop's screen.
const WIDTH: u32 = 1366;
const HEIGHT: u32 = 768;

/// Saves the viewport as `<name>.png` and the whole page as `<name>-full.png`.
async fn shoot(browser: &Browser, name: &str) {
    std::fs::create_dir_all(SHOTS).unwrap();
    let png = step("a screenshot", browser.client.screenshot()).await;
    std::fs::write(format!("{SHOTS}/{name}.png"), png).unwrap();
    let height = browser
        .script("return document.documentElement.scrollHeight")
        .await
        .as_u64()
        .unwrap_or(u64::from(HEIGHT)) as u32;
    step(
        "a tall window",
        browser.client.set_window_size(WIDTH, height.clamp(HEIGHT, 6000)),
    )
    .await;
    let png = step("a full-page screenshot", browser.client.screenshot()).await;
    std::fs::write(format!("{SHOTS}/{name}-full.png"), png).unwrap();
    step("the laptop's window", browser.client.set_window_size(WIDTH, HEIGHT)).await;
}

/// A message to `queue`: parked at once with `retry-attempt` 1 (the ladder allows one), else
/// retried once and delivered.
fn message(id: &str, queue: &str, parked: bool) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.set("retry-to", text(queue));
    headers.set("tenant", text("acme"));
    if parked {
        headers.set("retry-attempt", FieldValue::LongLongInt(1));
    }
    BasicProperties::default()
        .with_message_id(id)
        .with_content_type("text/plain")
        .with_headers(headers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overview_charts_the_last_hour_and_says_the_accounting_in_words() {
    let mut t = TestLadder::configure_with("console-overview", &admin_with_token(), ONE_TIER).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let browser = Browser::start().await;
    step("the laptop's window", browser.client.set_window_size(WIDTH, HEIGHT)).await;
    let overview = admin.url("/?refresh=off");
    let section = format!("section.ladder[data-ladder=\"{}\"]", t.ladder);
    // the poller's first sample is the history's baseline: traffic after it is charted
    eventually_ok("the poller's first sample", WAIT, async || {
        browser.goto(&overview).await;
        let charts = browser.find_all(&format!("{section} figure.chart")).await.len();
        let empty = browser
            .find_all(&format!("{section} figure.chart:nth-child(1) text.empty"))
            .await;
        if charts == 3 && empty.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{charts} charts, the first without data: {}",
                !empty.is_empty()
            ))
        }
    })
    .await;
    for i in 0..6 {
        let props = message(&format!("console-m{i}"), &orders, i % 3 == 0);
        t.publish(&t.intake(), "", format!("order {i}").as_bytes(), props).await;
    }
    t.parked(2).await;
    let mut consumer = tokio::time::timeout(WAIT, t.consume(&orders))
        .await
        .expect("consume timed out");
    for _ in 0..4 {
        let delivery = next_within(&mut consumer, WAIT)
            .await
            .expect("the retries are delivered");
        consumer.ack(&delivery);
    }

    browser.goto(&overview).await;
    assert_eq!(browser.status().await, 200);
    // the charts follow the poller (100 ms here): reload until the deliveries are charted;
    // the legend's sums over the hour, as a new minute may have begun since the traffic
    eventually_ok("the chart shows the deliveries", WAIT, async || {
        browser.goto(&overview).await;
        let legend = browser.text(&format!("{section} ul.legend")).await;
        let counted = |name: &str, n: u32| {
            legend
                .lines()
                .any(|l| l.starts_with(&format!("{name}: ")) && l.ends_with(&format!("({n} in the last 60 min)")))
        };
        if counted("received", 6) && counted("delivered", 4) && counted("parked", 2) {
            Ok(())
        } else {
            Err(legend)
        }
    })
    .await;
    let svgs = browser.find_all(&format!("{section} figure.chart svg")).await;
    assert_eq!(svgs.len(), 3, "messages, waiting, lateness");
    let lines = browser.find_all(&format!("{section} svg path.line")).await;
    assert!(
        lines.len() >= 3,
        "received, delivered and parked are drawn: {}",
        lines.len()
    );
    let lateness = browser
        .text(&format!("{section} figure.chart:nth-child(3) ul.legend"))
        .await;
    assert!(lateness.starts_with("p99: ") && !lateness.contains('–'), "{lateness}");
    // the accounting in words, coloured by its state
    let accounting = browser.text(&format!("{section} span.accounting")).await;
    assert!(
        ["accounted for", "Messages are moving", "Not checked yet"]
            .iter()
            .any(|s| accounting.contains(s)),
        "{accounting}"
    );
    assert!(
        !accounting.contains("balanced") && !accounting.contains("busy"),
        "{accounting}"
    );
    // the stylesheet applied: the header bar is dark, and the page fits a laptop's width
    let bar = browser
        .script("return getComputedStyle(document.querySelector('header.bar')).backgroundColor")
        .await;
    assert_eq!(bar, "rgb(36, 41, 47)", "the stylesheet loaded under the CSP");
    let overflow = browser
        .script("return document.documentElement.scrollWidth - document.documentElement.clientWidth")
        .await;
    assert_eq!(overflow.as_i64(), Some(0), "no horizontal scrolling at {WIDTH} px");
    shoot(&browser, "overview").await;
    // with refresh on, the page says so
    browser.goto(&admin.url("/")).await;
    assert!(browser.text("#refresh").await.contains("Refreshes every 10 s"));

    // the other pages, for the eye: the parked list, an entry, its confirmation, a bulk one
    let list = admin.url(&format!("/ladders/{}/parked", t.ladder));
    browser.goto(&list).await;
    browser.reload_until_text("span#total", "2").await;
    shoot(&browser, "parked-list").await;
    let show = browser.find("table#entries tr.entry a.show").await;
    browser.click_and_load("show", &show).await;
    shoot(&browser, "entry").await;
    let replay = browser.find("a#replay").await;
    browser.click_and_load("replay", &replay).await;
    shoot(&browser, "confirm-replay").await;
    browser
        .goto(&admin.url(&format!("/ladders/{}/matching/discard?destination={orders}", t.ladder)))
        .await;
    assert_eq!(browser.text("span#count").await, "2");
    shoot(&browser, "confirm-discard-matching").await;

    browser.close().await;
    admin.stop().await;
    t.stop_service().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_edits_a_parked_message_and_replays_it_in_the_browser() {
    let mut t = TestLadder::configure_with("console-edit", &admin_with_token(), ONE_TIER).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    t.start_service().await;
    let original = "order 7: 3 × blue widget";
    t.publish(
        &t.intake(),
        "",
        original.as_bytes(),
        message("console-edit-m", &orders, true),
    )
    .await;
    t.parked(1).await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let browser = Browser::start().await;
    step("the laptop's window", browser.client.set_window_size(WIDTH, HEIGHT)).await;

    browser.goto(&admin.url(&format!("/ladders/{}/parked", t.ladder))).await;
    browser.reload_until_text("span#total", "1").await;
    let show = browser.find("table#entries tr.entry a.show").await;
    browser.click_and_load("show", &show).await;
    let entry_url = browser.url().await.to_string();
    let edit = browser.find("a#edit-replay").await;
    browser.click_and_load("edit and replay", &edit).await;
    assert_eq!(browser.status().await, 200);
    shoot(&browser, "edit-form").await;

    // the headers as the entry stores them: change one, add one
    let headers = browser.find("textarea#edit-headers").await;
    let stored = step("the headers", headers.prop("value")).await.expect("a value");
    let mut typed: Value = serde_json::from_str(&stored).expect("the form shows JSON");
    assert_eq!(typed["tenant"]["value"], "acme", "{typed}");
    typed["tenant"]["value"] = "globex".into();
    typed["region"] = serde_json::json!({"type": "long-string", "value": "eu"});
    step("clear the headers", headers.clear()).await;
    step("type the headers", headers.send_keys(&typed.to_string())).await;
    let body = browser.find("textarea#edit-body").await;
    assert_eq!(step("the body", body.prop("value")).await.as_deref(), Some(original));
    step("clear the body", body.clear()).await;
    let fixed = "order 7: 3 × blue widget\nship to Ålesund";
    step("type the body", body.send_keys(fixed)).await;

    // a wrong token sends nothing
    let token = browser.find("form#confirm input[name=token]").await;
    step("type a wrong token", token.send_keys("not-the-token-at-all-0000")).await;
    let confirm = browser.find("form#confirm button#confirm-button").await;
    browser.click_and_load("replay edited, wrong token", &confirm).await;
    assert_eq!(browser.status().await, 403);
    // a change that is not allowed is refused with the reason, the form kept
    browser.goto(&format!("{entry_url}/edit")).await;
    let to = browser.find("input#edit-to").await;
    step("clear the queue", to.clear()).await;
    step(
        "type a queue the ladder does not allow",
        to.send_keys("not-allowed-anywhere"),
    )
    .await;
    let body = browser.find("textarea#edit-body").await;
    step("clear the body", body.clear()).await;
    step("type the body", body.send_keys(fixed)).await;
    let token = browser.find("form#confirm input[name=token]").await;
    step("type the token", token.send_keys(TOKEN)).await;
    let confirm = browser.find("form#confirm button#confirm-button").await;
    browser.click_and_load("replay to a queue not allowed", &confirm).await;
    assert_eq!(browser.status().await, 400);
    let refusal = browser.text("#outcome").await;
    assert!(refusal.contains("not-allowed-anywhere"), "{refusal}");
    shoot(&browser, "edit-refused").await;

    // the edit, with the right token
    browser.goto(&format!("{entry_url}/edit")).await;
    let headers = browser.find("textarea#edit-headers").await;
    step("clear the headers", headers.clear()).await;
    step("type the headers", headers.send_keys(&typed.to_string())).await;
    let body = browser.find("textarea#edit-body").await;
    step("clear the body", body.clear()).await;
    step("type the body", body.send_keys(fixed)).await;
    let token = browser.find("form#confirm input[name=token]").await;
    step("type the token", token.send_keys(TOKEN)).await;
    let confirm = browser.find("form#confirm button#confirm-button").await;
    browser.click_and_load("replay edited", &confirm).await;
    assert_eq!(browser.status().await, 200);
    let outcome = browser.text("#outcome").await;
    assert!(outcome.contains("1 replayed"), "{outcome}");
    shoot(&browser, "edit-outcome").await;

    // the edited message arrives, once
    let mut consumer = tokio::time::timeout(WAIT, t.consume(&orders))
        .await
        .expect("consume timed out");
    let delivery = next_within(&mut consumer, WAIT)
        .await
        .expect("the edited message arrives");
    assert_eq!(
        String::from_utf8_lossy(&delivery.body),
        fixed,
        "the edited body, LF kept"
    );
    let h = delivery.properties.headers.clone().unwrap_or_default();
    assert_eq!(h.get("tenant"), Some(&text("globex")));
    assert_eq!(h.get("region"), Some(&text("eu")));
    assert!(h.contains_key("retry-replayed-from"));
    assert_eq!(
        delivery.properties.message_id.as_ref().and_then(|m| m.to_str()),
        Some("console-edit-m")
    );
    consumer.ack(&delivery);
    t.assert_nothing_more("a second message from one edit", &mut consumer, &orders, Via::Queue)
        .await;

    // the entry keeps the original and says who edited what
    browser.goto(&entry_url).await;
    assert_eq!(browser.text("pre#body").await, original);
    let resolution = browser.text("#resolution").await;
    assert!(
        resolution.contains("replayed edited") && resolution.contains(OPERATOR) && resolution.contains(&orders),
        "{resolution}"
    );
    assert_eq!(browser.text("#edit .editor").await, OPERATOR);
    let audit = browser.text("table#edit-audit").await;
    assert!(audit.contains("Headers added region"), "{audit}");
    assert!(audit.contains("Headers changed tenant"), "{audit}");
    assert!(
        audit.contains(&format!("{} bytes", original.len())) && audit.contains(&format!("{} bytes", fixed.len())),
        "{audit}"
    );
    shoot(&browser, "entry-edited").await;

    // the job's page
    let jobs: Value = reqwest::get(admin.url(&format!("/api/ladders/{}/parked/jobs", t.ladder)))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = jobs[0]["id"].as_u64().expect("a job");
    browser
        .goto(&admin.url(&format!("/ladders/{}/jobs/{id}", t.ladder)))
        .await;
    assert_eq!(browser.status().await, 200);
    shoot(&browser, "job").await;

    browser.close().await;
    admin.stop().await;
    t.stop_service().await;
}

/// Holds and resumes through the Destinations page: a wrong token is refused (403, nothing
/// held), the held destination is listed with who and why and how many it holds, and the
/// resume releases every held message to its queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_holds_and_resumes_a_destination_on_its_page() {
    const LADDER: &str = "backoff = [\"200ms\"]\nmax_attempts = 1000\nallow = [\"^{ns}-\"]\nrelease_rate = \"50/s\"";
    let mut t = TestLadder::configure_with("console-holds", &admin_with_token(), LADDER).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    t.track_queue(&ladder::model::names::Names::new(&t.ns, &t.ladder).held_queue(&orders));
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let browser = Browser::start().await;
    step("the laptop's window", browser.client.set_window_size(WIDTH, HEIGHT)).await;
    let page = admin.url("/ladders/default/destinations");
    browser.goto(&page).await;
    browser.find("#no-holds").await;

    // a wrong token is refused, and nothing is held
    let fill = async |token: &str| {
        let form = "#hold";
        for (field, value) in [
            ("destination", orders.as_str()),
            ("why", "orders-db failover"),
            ("token", token),
        ] {
            let input = browser.find(&format!("{form} input[name={field}]")).await;
            step(&format!("type the {field}"), input.send_keys(value)).await;
        }
        let submit = browser.find(&format!("{form} button[type=submit]")).await;
        browser.click_and_load("hold it", &submit).await;
    };
    fill("not-the-token-at-all-0000").await;
    assert_eq!(browser.status().await, 403);
    assert!(browser.text("#outcome").await.starts_with("Not done"));
    let runtime = t.state.ladder("default").unwrap();
    assert!(!runtime.holds.holds_back(&orders), "a wrong token holds nothing");
    browser.goto(&page).await;
    fill(TOKEN).await;
    assert_eq!(browser.status().await, 200);
    let outcome = browser.text("#outcome").await;
    assert!(outcome.starts_with("Held") && outcome.contains(OPERATOR), "{outcome}");
    eventually("held", WAIT, async || runtime.holds.holds_back(&orders).then_some(())).await;

    // due messages wait in the held queue; the page lists the hold with who, why, how many
    for i in 0..5 {
        let mut headers = FieldTable::default();
        headers.set("retry-to", text(&orders));
        let props = BasicProperties::default()
            .with_message_id(&format!("held-{i}"))
            .with_headers(headers);
        t.publish(&t.intake(), "", format!("order {i}").as_bytes(), props).await;
    }
    browser.goto(&page).await;
    let row = format!("#holds tr[data-destination=\"{orders}\"]");
    browser.reload_until_text(&format!("{row} td.held-messages"), "5").await;
    let listed = browser.text(&row).await;
    for word in ["held", OPERATOR, "orders-db failover"] {
        assert!(listed.contains(word), "{word} in {listed:?}");
    }
    assert!(browser.text("#transitions").await.contains("held"));
    shoot(&browser, "destinations").await;

    // resume through the row's form: every held message arrives, once
    let mut consumer = t.consume(&orders).await;
    assert!(
        next_within(&mut consumer, Duration::from_millis(300)).await.is_none(),
        "held"
    );
    let rate = browser.find(&format!("{row} form.resume input[name=rate]")).await;
    step("type the rate", rate.send_keys("50/s")).await;
    let token = browser.find(&format!("{row} form.resume input[name=token]")).await;
    step("type the token", token.send_keys(TOKEN)).await;
    let resume = browser.find(&format!("{row} form.resume button[type=submit]")).await;
    browser.click_and_load("resume", &resume).await;
    assert_eq!(browser.status().await, 200);
    let outcome = browser.text("#outcome").await;
    assert!(outcome.starts_with("Resumed") && outcome.contains("50/s"), "{outcome}");
    let mut ids = std::collections::HashSet::new();
    for _ in 0..5 {
        let d = next_within(&mut consumer, WAIT).await.expect("released");
        ids.insert(message_id(&d).to_string());
        consumer.ack(&d);
    }
    assert_eq!(ids.len(), 5, "every held message once: {ids:?}");
    assert!(
        next_within(&mut consumer, Duration::from_secs(1)).await.is_none(),
        "none twice"
    );
    browser.goto(&page).await;
    shoot(&browser, "destinations-resumed").await;
    assert_eq!(t.lot().end().await.unwrap(), None, "nothing parked");

    browser.close().await;
    admin.stop().await;
    t.stop_service().await;
}
