//! The operator web page in a real browser: Debian's Chromium, headless, driven over WebDriver by
//! chromedriver, against the admin server and the service on the real broker. An operator finds
//! a ladder's parking lot from the overview, filters it by destination, opens one entry, is
//! refused a replay with a wrong token (403, nothing sent), replays it with the right one, and
//! the message arrives on its queue while the entry shows as replayed and leaves the listing.
//!
//! The browser must be installed (`apt-get install chromium chromium-driver`; `.ci/run` does
//! it): without it these tests fail, they never skip.

use std::future::Future;
use std::process::Stdio;
use std::time::Duration;

use crate::common::parking::ONE_TIER;
use crate::common::*;
use fantoccini::elements::Element;
use fantoccini::{Client, ClientBuilder, Locator};
use ladder_amqp::{BasicProperties, FieldTable, FieldValue};
use rustix::process::{Pid, Signal};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const CHROMIUM: &str = "/usr/bin/chromium";

/// How long chromedriver may take to answer `/status` after it was spawned; it is up in well
/// under a second on an idle machine, but CI builds beside it on two cores.
const DRIVER_START: Duration = Duration::from_secs(20);

/// Upper bound for one browser step: a command, or a page load it starts. Generous for the same
/// reason; a step that hangs fails the test with its name instead of holding it forever.
const STEP: Duration = Duration::from_secs(30);

/// The operator the page test replays as, and the token `admin.tokens` gives them.
pub(crate) const OPERATOR: &str = "alice";
pub(crate) const TOKEN: &str = "browser-test-token-0123456789";

/// Fast polls, an ephemeral port and the operator's token.
pub(crate) fn admin_with_token() -> String {
    format!("[admin]\nbind = \"127.0.0.1:0\"\npoll_interval = \"100ms\"\n[admin.tokens]\n{OPERATOR} = \"{TOKEN}\"")
}

/// Awaits `fut` for at most [`STEP`] and unwraps its result, naming `what` when either fails.
pub(crate) async fn step<T, E: std::fmt::Debug>(what: &str, fut: impl Future<Output = Result<T, E>>) -> T {
    match tokio::time::timeout(STEP, fut).await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => panic!("{what}: {e:?}"),
        Err(_) => panic!("{what}: no answer within {STEP:?}"),
    }
}

/// chromedriver on a free loopback port, in a process group of its own so that dropping it kills
/// the browser it started too: a panicking test must not leave Chromium behind.
struct Driver {
    child: tokio::process::Child,
    /// chromedriver's pid, which is also its process group's id.
    group: Pid,
    port: u16,
    /// Chromium's profile (`--user-data-dir`) and chromedriver's log.
    dir: tempfile::TempDir,
}

impl Driver {
    async fn start() -> Self {
        for binary in [CHROMEDRIVER, CHROMIUM] {
            assert!(
                std::path::Path::new(binary).exists(),
                "{binary} is missing: the browser tests need Debian's Chromium and its driver; install them with \
                 `apt-get install chromium chromium-driver` (.ci/run does)"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(dir.path().join("chromedriver.log")).unwrap();
        // a port free a moment ago: chromedriver has no "pick one and tell me" mode
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = tokio::process::Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("{CHROMEDRIVER} does not start: {e}"));
        let group = Pid::from_raw(child.id().expect("running") as i32).expect("a positive pid");
        let mut driver = Driver {
            child,
            group,
            port,
            dir,
        };
        driver.wait_ready().await;
        driver
    }

    /// Polls `GET /status` until chromedriver says it is ready; panics with its log after
    /// [`DRIVER_START`] or if it exited.
    async fn wait_ready(&mut self) {
        let ready = poll_until(DRIVER_START, async || {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("chromedriver exited with {status}:\n{}", self.log());
            }
            match tokio::time::timeout(Duration::from_secs(2), self.ready()).await {
                Ok(Ok(true)) => Ok(()),
                _ => Err(()),
            }
        })
        .await;
        assert!(
            ready.is_ok(),
            "chromedriver did not answer /status on port {} within {DRIVER_START:?}:\n{}",
            self.port,
            self.log()
        );
    }

    /// Whether `GET /status` says chromedriver is ready. It keeps the connection open despite
    /// `Connection: close`, so read only until the answer is in.
    async fn ready(&self) -> std::io::Result<bool> {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
        let request = format!(
            "GET /status HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nConnection: close\r\n\r\n",
            self.port
        );
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        let mut chunk = [0; 4096];
        loop {
            let n = stream.read(&mut chunk).await?;
            raw.extend_from_slice(&chunk[..n]);
            let text = String::from_utf8_lossy(&raw);
            if text.contains("\"ready\":true") {
                return Ok(true);
            }
            if n == 0 || text.contains("\"ready\":false") {
                return Ok(false);
            }
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("chromedriver.log")).unwrap_or_default()
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // the whole group: chromedriver does not take its browser down when it is killed itself
        let _ = rustix::process::kill_process_group(self.group, Signal::KILL);
    }
}

/// A headless Chromium session; [`Browser::close`] ends it politely, a drop kills it.
pub(crate) struct Browser {
    pub(crate) client: Client,
    // dropped after `client`: the session's process group goes with it
    _driver: Driver,
}

impl Browser {
    pub(crate) async fn start() -> Self {
        let driver = Driver::start().await;
        let profile = driver.dir.path().join("profile");
        let capabilities = json!({
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": [
                    "--headless",
                    // CI runs as root, where Chromium's sandbox refuses to start
                    "--no-sandbox",
                    "--disable-gpu",
                    // /dev/shm is small in containers
                    "--disable-dev-shm-usage",
                    // only loopback is reachable here; no update, sync or field-trial traffic
                    "--disable-quic",
                    "--no-first-run",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    format!("--user-data-dir={}", profile.display()),
                ],
            },
        });
        let serde_json::Value::Object(capabilities) = capabilities else {
            unreachable!("an object literal")
        };
        // chromedriver speaks plain HTTP on loopback: no TLS connector needed
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = step(
            "a WebDriver session in Chromium",
            ClientBuilder::new(connector)
                .capabilities(capabilities)
                .connect(&driver.url()),
        )
        .await;
        Browser {
            client,
            _driver: driver,
        }
    }

    pub(crate) async fn goto(&self, url: &str) {
        step(&format!("load {url}"), self.client.goto(url)).await;
    }

    /// The element matching `css`, waiting (bounded) for it to appear.
    pub(crate) async fn find(&self, css: &str) -> Element {
        let found = self.client.wait().at_most(STEP).for_element(Locator::Css(css));
        let url = self.url().await;
        step(&format!("find {css} on {url}"), found).await
    }

    pub(crate) async fn find_all(&self, css: &str) -> Vec<Element> {
        step(&format!("find all {css}"), self.client.find_all(Locator::Css(css))).await
    }

    pub(crate) async fn text(&self, css: &str) -> String {
        let element = self.find(css).await;
        step(&format!("text of {css}"), element.text()).await
    }

    /// Reloads the page until `css` reads `expected`; panics with the last text after [`STEP`].
    pub(crate) async fn reload_until_text(&self, css: &str, expected: &str) {
        let mut reload = false;
        eventually_ok(&format!("{css} reads {expected:?}"), STEP, async || {
            if std::mem::replace(&mut reload, true) {
                step("reload", self.client.refresh()).await;
            }
            let text = self.text(css).await;
            if text == expected {
                Ok(())
            } else {
                Err(format!("{text:?}"))
            }
        })
        .await
    }

    pub(crate) async fn url(&self) -> url::Url {
        step("current url", self.client.current_url()).await
    }

    /// Clicks `element` and waits until the page it leads to replaced the current one: a
    /// click's return does not promise that the next page has loaded.
    pub(crate) async fn click_and_load(&self, what: &str, element: &Element) {
        let old = step("the current page", self.client.find(Locator::Css("html"))).await;
        step(&format!("click {what}"), element.click()).await;
        eventually(&format!("clicking {what} loaded a new page"), STEP, async || {
            match tokio::time::timeout(STEP, old.tag_name()).await {
                Ok(Err(e)) if e.is_stale_element_reference() => Some(()),
                // some chromedriver versions say this of an element from a replaced document
                Ok(Err(e)) if e.is_no_such_element() => Some(()),
                // and Chromium's inspector, when the old document goes away mid-call (seen in CI)
                Ok(Err(e)) if format!("{e:?}").contains("does not belong to the document") => Some(()),
                Ok(Ok(_)) => None,
                Ok(Err(e)) => panic!("after clicking {what}: {e:?}"),
                Err(_) => panic!("after clicking {what}: the browser did not answer within {STEP:?}"),
            }
        })
        .await;
        // the new document is at least interactive; wait for the rest of it
        eventually_ok(
            &format!("the page after {what} finished loading"),
            STEP,
            async || match self.script("return document.readyState").await {
                state if state == "complete" => Ok(()),
                state => Err(state),
            },
        )
        .await;
    }

    pub(crate) async fn script(&self, js: &str) -> serde_json::Value {
        step(&format!("run {js}"), self.client.execute(js, vec![])).await
    }

    /// The HTTP status of the current page, which WebDriver does not expose itself (Navigation
    /// Timing Level 2, in Chromium since 109).
    pub(crate) async fn status(&self) -> u64 {
        let v = self
            .script("return performance.getEntriesByType('navigation')[0].responseStatus")
            .await;
        v.as_u64().unwrap_or_else(|| panic!("no response status: {v}"))
    }

    /// Ends the session (chromedriver closes Chromium), then drops the driver.
    pub(crate) async fn close(self) {
        let Browser { client, _driver } = self;
        step("end the WebDriver session", client.close()).await;
    }
}

/// The harness alone, against a page that needs no token: if this fails, the browser or the
/// driver is broken, not the operator page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_browser_reads_a_page_of_the_admin_server() {
    let t = TestLadder::configure_with("browser-live", "[admin]\npoll_interval = \"100ms\"", ONE_TIER).await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let browser = Browser::start().await;
    browser.goto(&admin.url("/live")).await;
    assert_eq!(browser.text("body").await, "ok");
    assert_eq!(browser.status().await, 200);
    browser.close().await;
    admin.stop().await;
}

/// A parked message as the test publishes it: `retry-attempt` at the maximum parks it at once.
struct Parked {
    message_id: String,
    destination: String,
    body: String,
}

fn props(p: &Parked) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.set("retry-to", text(&p.destination));
    headers.set("retry-attempt", FieldValue::LongLongInt(1));
    BasicProperties::default()
        .with_message_id(p.message_id.as_str())
        .with_content_type("text/plain")
        .with_headers(headers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_filters_the_parking_lot_and_replays_one_entry_in_the_browser() {
    let mut t = TestLadder::configure_with("browser", &admin_with_token(), ONE_TIER).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let invoices = t.declare_queue("invoices", FieldTable::default()).await;
    t.start_service().await;

    // 4 to orders and 2 to invoices, interleaved, so a filter has to pick rows out of the middle
    let parked: Vec<Parked> = (0..6)
        .map(|i| {
            let destination = if i % 3 == 2 { &invoices } else { &orders };
            Parked {
                message_id: format!("browser-m{i}"),
                destination: destination.clone(),
                body: format!("order {i}: 3 × blue widget, ship to Ålesund"),
            }
        })
        .collect();
    for p in &parked {
        t.publish(&t.intake(), "", p.body.as_bytes(), props(p)).await;
    }
    t.parked(parked.len()).await;
    let to_orders: Vec<&Parked> = parked.iter().filter(|p| p.destination == orders).collect();
    let newest = *to_orders.last().unwrap();

    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let browser = Browser::start().await;

    // the overview links each ladder to its parking lot
    browser.goto(&admin.url("/")).await;
    assert_eq!(browser.status().await, 200);
    browser.find("table#ladders").await;
    let link = browser
        .find(&format!("tr[data-ladder=\"{}\"] a.parked-link", t.ladder))
        .await;
    browser.click_and_load("the parked link", &link).await;
    let list_path = format!("/ladders/{}/parked", t.ladder);
    assert_eq!(browser.url().await.path(), list_path);
    // the listing reads an index that follows the parked stream from the admin server's start,
    // a round trip behind it: an operator who opens the page at once may need to reload
    browser.reload_until_text("span#total", &parked.len().to_string()).await;
    // counted per reason and destination, each a link that narrows the filter
    let breakdown = browser.text("p#breakdown").await;
    let invoices_count = parked.len() - to_orders.len();
    for expected in [
        format!("max-attempts ({})", parked.len()),
        format!("{orders} ({})", to_orders.len()),
        format!("{invoices} ({invoices_count})"),
    ] {
        assert!(breakdown.contains(&expected), "{expected:?} in {breakdown:?}");
    }

    // filter by one destination, as an operator types it
    let destination = browser.find("form#filters input[name=destination]").await;
    step("type the destination", destination.send_keys(&orders)).await;
    let apply = browser.find("form#filters button#apply").await;
    browser.click_and_load("apply", &apply).await;
    let url = browser.url().await;
    assert_eq!(url.path(), list_path);
    assert!(
        url.query_pairs().any(|(k, v)| k == "destination" && v == orders),
        "the filter is in the URL: {url}"
    );
    assert_eq!(browser.text("span#total").await, to_orders.len().to_string());
    let rows = browser.find_all("table#entries tr.entry").await;
    assert_eq!(rows.len(), to_orders.len());
    let mut offsets = Vec::new();
    for (row, expected) in rows.iter().zip(to_orders.iter().rev()) {
        let text = step("a row's text", row.text()).await;
        assert!(
            text.contains(&orders) && !text.contains(&invoices),
            "only {orders} rows: {text}"
        );
        assert!(text.contains("max-attempts"), "{text}");
        assert!(text.contains(&expected.message_id), "newest first: {text}");
        let offset = step("a row's offset", row.attr("data-offset")).await;
        offsets.push(offset.expect("data-offset").parse::<u64>().expect("a numeric offset"));
    }
    assert!(offsets.windows(2).all(|w| w[0] > w[1]), "newest first: {offsets:?}");

    // the newest entry, shown
    let show = browser.find("table#entries tr.entry a.show").await;
    browser.click_and_load("show", &show).await;
    let entry_path = format!("{list_path}/{}", offsets[0]);
    assert_eq!(browser.url().await.path(), entry_path);
    let entry_url = browser.url().await.to_string();
    assert_eq!(browser.text("pre#body").await, newest.body);
    assert_eq!(browser.text("#resolution").await, "unresolved");

    // replay: a wrong token is refused and sends nothing
    let replay = browser.find("a#replay").await;
    browser.click_and_load("replay", &replay).await;
    let confirm_url = browser.url().await;
    assert_eq!(confirm_url.path(), format!("{entry_path}/replay"));
    let form = browser.find("form#confirm").await;
    assert_eq!(
        step("the form's method", form.attr("method"))
            .await
            .map(|m| m.to_lowercase()),
        Some("post".into())
    );
    let to = browser.find("form#confirm input[name=to]").await;
    assert_eq!(
        step("the target", to.prop("value")).await.as_deref(),
        Some(orders.as_str())
    );
    let token = browser.find("form#confirm input[name=token]").await;
    assert_eq!(
        step("the token's type", token.attr("type")).await.as_deref(),
        Some("password")
    );
    step("type a wrong token", token.send_keys("not-the-token-at-all-0000")).await;
    let confirm = browser.find("form#confirm button#confirm-button").await;
    browser.click_and_load("confirm with a wrong token", &confirm).await;
    assert_eq!(browser.status().await, 403);
    let outcome = browser.text("#outcome").await;
    assert!(outcome.to_lowercase().contains("token"), "{outcome}");

    // again, with the right token
    browser.goto(confirm_url.as_str()).await;
    let token = browser.find("form#confirm input[name=token]").await;
    step("clear the token", token.clear()).await;
    step("type the token", token.send_keys(TOKEN)).await;
    let confirm = browser.find("form#confirm button#confirm-button").await;
    browser.click_and_load("confirm", &confirm).await;
    assert_eq!(browser.status().await, 200);
    let outcome = browser.text("#outcome").await;
    assert!(outcome.contains("replayed"), "{outcome}");

    // the message is back on its queue, once: the refused attempt sent nothing
    let mut consumer = tokio::time::timeout(WAIT, t.consume(&orders))
        .await
        .expect("consume timed out");
    let delivery = next_within(&mut consumer, WAIT)
        .await
        .expect("the replayed message arrives");
    assert_eq!(String::from_utf8_lossy(&delivery.body), newest.body);
    assert_eq!(
        delivery.properties.message_id.as_ref().and_then(|id| id.to_str()),
        Some(newest.message_id.as_str())
    );
    consumer.ack(&delivery);
    // the confirm page answered once the replay's publish was confirmed: a marker queues behind
    // anything it sent
    t.assert_nothing_more("a second message from one replay", &mut consumer, &orders, Via::Queue)
        .await;

    // the entry says who replayed it where; the listing no longer counts it
    browser.goto(&entry_url).await;
    let resolution = browser.text("#resolution").await;
    assert!(
        resolution.contains("replayed") && resolution.contains(&orders) && resolution.contains(OPERATOR),
        "{resolution}"
    );
    let mut filtered = url::Url::parse(&admin.url(&list_path)).unwrap();
    filtered.query_pairs_mut().append_pair("destination", &orders);
    browser.goto(filtered.as_str()).await;
    assert_eq!(browser.text("span#total").await, (to_orders.len() - 1).to_string());
    let rows = browser.find_all("table#entries tr.entry").await;
    for row in rows {
        let offset = step("a row's offset", row.attr("data-offset")).await;
        assert_ne!(offset, Some(offsets[0].to_string()), "the replayed entry is gone");
    }

    browser.close().await;
    admin.stop().await;
    t.stop_service().await;
}
