//! `ladder-bench parking`: the parking lot at a million entries (BENCHMARKS.md).
//!
//! Parks `--entries` synthetic entries straight into a ladder's stream — the record the service
//! writes (envelope body, `type`, `parked-*` headers), with a known mix of reasons, destinations
//! and headers — then measures, side by side in one run:
//! - a bare read of the whole stream (consume and ack, nothing decoded): the broker's floor,
//!   against `ladder parked list` building its index over the same records;
//! - the CLI's counting, deep paging, time-bounded and header searches;
//! - the running service (`ladder run`): how long a new replica takes to catch up with the lot,
//!   what its index costs in memory against the same service over an empty lot, and the HTTP
//!   API's answer times, including a dry-run replay that selects from the whole index.
//!
//! Every answer's count is checked against what was parked, so a fast wrong answer fails the
//! run. It never stops or restarts the broker; everything it declares is deleted at the end.

use std::collections::HashMap;
use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use ladder::broker::topology::{self, Names};
use ladder::model::envelope::{Envelope, FORMAT, OriginalMessage};
use ladder_amqp::{BasicProperties, Connection, FieldTable};
use serde::Serialize;
use serde_json::Value;

use crate::broker::{self, Msg, OP_TIMEOUT, Registry, bounded, text};
use crate::now_ms;
use crate::procs::{self, Child};

/// The ladder whose lot is filled.
const LADDER: &str = "lot";

/// Destinations are spread over this many queues, tenants (a header) over this many values;
/// both prime and unlike the reason cycle (10), so every combination occurs.
const DESTINATIONS: u64 = 17;
const TENANTS: u64 = 101;

/// Original bodies are JSON text of about this size.
const BODY_BYTES: usize = 300;

/// Publishes in flight while filling the lot.
const FILL_WINDOW: usize = 5000;

/// A CLI command or a service catching up on a million entries takes tens of seconds; this
/// bounds each, so a stuck one fails the run instead of hanging it.
const STEP_TIMEOUT: Duration = Duration::from_secs(900);

/// A bare read gives up when nothing arrived for this long.
const READ_IDLE: Duration = Duration::from_secs(30);

/// The token the bench's service config gives for the dry-run replay (replay needs one).
const TOKEN: &str = "ladder-bench-parking-token";

/// What `ladder-bench parking` measured; written as `parking.json` and `parking.md`.
#[derive(Debug, Default, Clone, Serialize)]
pub struct ParkingResults {
    /// Entries parked.
    pub entries: u64,
    /// Average size of a parked record's body (the envelope), bytes.
    pub record_bytes: u64,
    /// How fast the lot was filled (publishes confirmed per second).
    pub fill_per_s: f64,
    /// Timed repetitions of each CLI measurement (medians reported).
    pub runs: usize,
    /// Median seconds for a bare read of the whole stream.
    pub raw_read_s: f64,
    /// CLI commands: what was asked, median seconds, peak RSS (kB), the count it reported.
    pub cli: Vec<CliRow>,
    /// The service over an empty lot: RSS (kB) once ready.
    pub service_empty_rss_kb: u64,
    /// The service over the full lot: seconds from start until its index caught up.
    pub service_catch_up_s: f64,
    /// Its RSS (kB) once caught up.
    pub service_full_rss_kb: u64,
    /// HTTP requests to the caught-up service: what, median and max milliseconds, count.
    pub http: Vec<HttpRow>,
}

/// One CLI measurement.
#[derive(Debug, Default, Clone, Serialize)]
pub struct CliRow {
    /// The `ladder parked` arguments.
    pub what: String,
    /// Median wall time, seconds.
    pub secs: f64,
    /// Largest peak RSS seen over the runs, kB.
    pub peak_rss_kb: u64,
    /// `total` in its answer (checked against the parked mix).
    pub total: u64,
}

/// One HTTP measurement.
#[derive(Debug, Default, Clone, Serialize)]
pub struct HttpRow {
    /// Method and path.
    pub what: String,
    /// Requests timed.
    pub requests: usize,
    /// Median, ms.
    pub p50_ms: f64,
    /// Slowest, ms.
    pub max_ms: f64,
    /// The count it reported (total, or outcomes for an action).
    pub total: u64,
}

/// The parked mix: entry `i`'s reason, destination and tenant, so expected counts are computed,
/// not assumed.
fn reason_of(i: u64) -> &'static str {
    match i % 10 {
        0..=5 => "max-attempts",
        6 | 7 => "no-route",
        8 => "invalid-header",
        _ => "destination-not-allowed",
    }
}

fn destination_of(ns: &str, i: u64) -> String {
    format!("{ns}-dest-{}", i % DESTINATIONS)
}

fn tenant_of(i: u64) -> String {
    format!("t{}", i % TENANTS)
}

/// The stream record the service would have written for entry `i`, parked at `parked_at_ms`.
fn record(ns: &str, i: u64, parked_at_ms: u64) -> Msg {
    let destination = destination_of(ns, i);
    let reason = reason_of(i);
    let mut headers = FieldTable::new();
    headers.set("tenant", text(&tenant_of(i)));
    headers.set("retry-to", text(&destination));
    headers.set("retry-reason", text("upstream answered 503"));
    let original = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json")
        .with_message_id(&format!("m-{i}"))
        .with_correlation_id(&format!("order-{}", i / 3))
        .with_headers(headers);
    let mut body = format!("{{\"order\": {i}, \"sku\": {}, \"note\": \"", i % 997);
    while body.len() < BODY_BYTES - 2 {
        body.push('x');
    }
    body.push_str("\"}");
    let envelope = Envelope {
        format: FORMAT.to_string(),
        reason: reason.to_string(),
        detail: format!("bench entry {i}"),
        ladder: LADDER.to_string(),
        destination: Some(destination.clone()),
        attempts: Some(8),
        first_failed_at_ms: Some(parked_at_ms.saturating_sub(3_600_000)),
        history: vec![],
        replayed_from: None,
        parked_at_ms,
        hop: "due".to_string(),
        message: OriginalMessage::capture("", &destination, &original, body.as_bytes()),
    };
    let mut headers = FieldTable::new();
    headers.set("parked-reason", text(reason));
    headers.set("parked-ladder", text(LADDER));
    headers.set("parked-destination", text(&destination));
    Msg {
        exchange: String::new(),
        routing_key: Names::new(ns, LADDER).parked,
        properties: BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type("application/json")
            .with_type(FORMAT)
            .with_message_id(&format!("m-{i}"))
            .with_headers(headers),
        body: serde_json::to_vec(&envelope).expect("an envelope serializes"),
    }
}

/// A free loopback port for a service's admin server (bound and released: a benchmark on a
/// machine of its own, not a test that runs beside others).
fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Writes a one-ladder config for `ns` under `dir`, its admin server on `port`.
fn write_config(dir: &Path, ns: &str, url: &str, port: u16) -> Result<PathBuf> {
    std::fs::create_dir_all(dir.join("ladders"))?;
    let path = dir.join("ladder.toml");
    std::fs::write(
        &path,
        format!(
            "namespace = \"{ns}\"\nshutdown_grace = \"5s\"\n\
             [amqp]\nurl = \"{url}\"\nconnection_name = \"ladder-bench-parking\"\n\
             [admin]\nbind = \"127.0.0.1:{port}\"\n[admin.tokens]\nbench = \"{TOKEN}\"\n"
        ),
    )?;
    std::fs::write(
        dir.join("ladders").join(format!("{LADDER}.toml")),
        format!("backoff = [\"1s\"]\nallow = [\"^{ns}-\"]\n"),
    )?;
    Ok(path)
}

/// Loads the config with the ladder's own loader, remembers its names, declares its topology.
async fn declare(conn: &Connection, registry: &Registry, path: &Path) -> Result<()> {
    let config = ladder::config::load(path, &HashMap::new()).map_err(|e| anyhow!("{e}"))?;
    let plan = topology::plan(&config, topology::version_of(conn));
    registry.plan(&plan);
    bounded(
        "declare the topology",
        OP_TIMEOUT,
        topology::apply(conn, &plan, &|_| {}),
    )
    .await?;
    Ok(())
}

/// Reads the whole stream from its first record, acking and counting, decoding nothing, until
/// `n` records arrived.
async fn raw_read(conn: &Connection, stream: &str, n: u64) -> Result<Duration> {
    let ch = bounded("open channel", OP_TIMEOUT, conn.create_channel()).await?;
    bounded("qos", OP_TIMEOUT, ch.basic_qos(1000)).await?;
    let mut args = FieldTable::new();
    args.set("x-stream-offset", text("first"));
    let started = Instant::now();
    let mut consumer = bounded(
        "consume the stream",
        OP_TIMEOUT,
        ch.basic_consume(stream, "ladder-bench-raw", false, args),
    )
    .await?;
    let mut seen = 0u64;
    while seen < n {
        let delivery = match tokio::time::timeout(READ_IDLE, consumer.next()).await {
            Ok(Some(Ok(d))) => d,
            Ok(Some(Err(e))) => bail!("reading {stream}: {e}"),
            Ok(None) => bail!("reading {stream}: the consumer ended after {seen} records"),
            Err(_) => bail!("reading {stream}: nothing for {READ_IDLE:?} after {seen} of {n} records"),
        };
        seen += 1;
        if seen.is_multiple_of(200) || seen == n {
            ch.basic_ack(delivery.delivery_tag, true)
                .map_err(|e| anyhow!("ack: {e}"))?;
        }
    }
    let took = started.elapsed();
    // cancel the consumer, then close its channel
    let _ = bounded("cancel", OP_TIMEOUT, ch.basic_cancel(consumer.tag())).await;
    let _ = bounded("close channel", OP_TIMEOUT, ch.close(200, "read")).await;
    Ok(took)
}

/// Runs `ladder --config <config> parked <args>` to its end; returns its wall time, its peak
/// RSS (VmHWM, polled every 10 ms, so a peak in its last moments may be missed) and its JSON.
fn run_cli(ladder_bin: &Path, config: &Path, args: &[String]) -> Result<(Duration, u64, Value)> {
    let started = Instant::now();
    let mut child = Command::new(ladder_bin)
        .arg("--config")
        .arg(config)
        .arg("parked")
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("start {}", ladder_bin.display()))?;
    // read both pipes meanwhile: a full pipe would stall the child
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let out = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = out.read_to_end(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut peak = 0;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if let Ok(s) = procs::stat(child.id()) {
            peak = peak.max(s.hwm_kb);
        }
        if started.elapsed() > STEP_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            bail!("ladder parked {}: still running after {STEP_TIMEOUT:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = started.elapsed();
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    if !status.success() {
        bail!("ladder parked {}: {status}: {}", args.join(" "), stderr.trim());
    }
    let json = serde_json::from_slice(&stdout)
        .with_context(|| format!("ladder parked {}: its output is not JSON", args.join(" ")))?;
    Ok((took, peak, json))
}

/// An HTTP request to the service's admin server on loopback: its status and JSON answer.
async fn call(request: reqwest::RequestBuilder) -> Result<(u16, Value)> {
    let response = request.send().await?;
    let status = response.status().as_u16();
    Ok((status, response.json().await?))
}

/// GET `path` as JSON, expecting 200.
async fn get_json(http: &reqwest::Client, port: u16, path: &str) -> Result<Value> {
    let (status, body) = call(http.get(format!("http://127.0.0.1:{port}{path}"))).await?;
    if status != 200 {
        bail!("GET {path}: {status} {body}");
    }
    Ok(body)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { f64::NAN } else { v[v.len() / 2] }
}

fn total_of(v: &Value) -> Result<u64> {
    v["total"].as_u64().ok_or_else(|| anyhow!("no total in {v}"))
}

/// Starts `ladder run` on `config` and waits until its admin server says the lot's index has
/// caught up; returns the child and the time that took.
async fn start_service(
    http: &reqwest::Client,
    ladder_bin: &Path,
    config: &Path,
    port: u16,
    log: &Path,
) -> Result<(Child, Duration)> {
    let started = Instant::now();
    let args = vec!["--config".to_string(), config.display().to_string(), "run".to_string()];
    let mut child = Child::spawn("ladder run", ladder_bin, &args, &[("RUST_LOG", "warn")], log, false)?;
    let path = format!("/api/ladders/{LADDER}/parked?limit=1");
    loop {
        child.stat().context("the ladder service stopped (see its log)")?;
        if let Ok(v) = get_json(http, port, &path).await
            && v["caught_up"].as_bool() == Some(true)
        {
            return Ok((child, started.elapsed()));
        }
        if started.elapsed() > STEP_TIMEOUT {
            bail!("the service's index did not catch up within {STEP_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The whole measurement; the caller cleans up `registry`.
pub async fn measure(
    url: &str,
    ladder_bin: &Path,
    work: &Path,
    registry: &Registry,
    entries: u64,
    runs: usize,
) -> Result<ParkingResults> {
    let pid = std::process::id();
    // `bench-<pid>-<n>`: what `ladder-bench cleanup` recognises
    let ns = format!("bench-{pid}-20");
    let empty_ns = format!("bench-{pid}-21");
    let port = free_port()?;
    let config = write_config(&work.join("full"), &ns, url, port)?;
    let empty_config = write_config(&work.join("empty"), &empty_ns, url, port)?;
    let conn = broker::connect(url, "ladder-bench-parking").await?;
    declare(&conn, registry, &config).await?;
    declare(&conn, registry, &empty_config).await?;
    let stream = Names::new(&ns, LADDER).parked;
    let mut out = ParkingResults {
        entries,
        runs,
        ..Default::default()
    };

    // Fill. Each record's parked_at is its publish time, as the service's would be; the middle
    // one's time is kept for a `--since` search.
    eprintln!("parking {entries} entries into {stream}");
    let ch = broker::confirm_channel(&conn).await?;
    let mut parked_at = Vec::with_capacity(entries as usize);
    let mut bytes = 0u64;
    let published = broker::publish(
        &ch,
        None,
        entries,
        FILL_WINDOW,
        |i| {
            let at = now_ms();
            parked_at.push(at);
            let m = record(&ns, i, at);
            bytes += m.body.len() as u64;
            m
        },
        || false,
    )
    .await?;
    if published.confirmed != entries {
        bail!("{} of {entries} parked records confirmed", published.confirmed);
    }
    out.fill_per_s = entries as f64 / published.secs.max(1e-9);
    out.record_bytes = bytes / entries.max(1);
    eprintln!("  filled at {:.0}/s, {} B per record", out.fill_per_s, out.record_bytes);
    // the broker writes a chunk's timestamp when it stores it; give the last ones time to land
    tokio::time::sleep(Duration::from_secs(1)).await;

    // The floor: the broker delivering every record, nothing decoded.
    let mut raw = vec![];
    for _ in 0..runs {
        raw.push(raw_read(&conn, &stream, entries).await?.as_secs_f64());
    }
    out.raw_read_s = median(raw);
    eprintln!("  bare read of the stream: {:.2} s", out.raw_read_s);

    // The CLI: each command builds its own index from the stream.
    let mid = entries / 2;
    let since = humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(parked_at[mid as usize]));
    let count = |f: &dyn Fn(u64) -> bool| (0..entries).filter(|&i| f(i)).count() as u64;
    let dest3 = destination_of(&ns, 3);
    let cases: Vec<(Vec<String>, u64)> = vec![
        (vec!["--limit".into(), "50".into()], entries),
        (
            vec!["--reason".into(), "no-route".into(), "--limit".into(), "50".into()],
            count(&|i| reason_of(i) == "no-route"),
        ),
        (
            vec!["--offset".into(), mid.to_string(), "--limit".into(), "50".into()],
            entries,
        ),
        (
            vec!["--since".into(), since.to_string(), "--limit".into(), "50".into()],
            parked_at.iter().filter(|&&t| t >= parked_at[mid as usize]).count() as u64,
        ),
        (
            vec![
                "--reason".into(),
                "invalid-header".into(),
                "--destination".into(),
                dest3.clone(),
                "--header".into(),
                "tenant=t7".into(),
                "--limit".into(),
                "20".into(),
            ],
            count(&|i| reason_of(i) == "invalid-header" && i % DESTINATIONS == 3 && i % TENANTS == 7),
        ),
        (
            vec![
                "--reason".into(),
                "invalid-header".into(),
                "--header".into(),
                "tenant=t7".into(),
                "--limit".into(),
                "20".into(),
            ],
            count(&|i| reason_of(i) == "invalid-header" && i % TENANTS == 7),
        ),
        (
            vec![
                "--message-id".into(),
                format!("m-{}", entries - 7),
                "--limit".into(),
                "5".into(),
            ],
            1,
        ),
    ];
    for (args, expected) in cases {
        let mut args = args;
        args.insert(0, "list".into());
        args.push("--json".into());
        let mut secs = vec![];
        let mut row = CliRow {
            what: format!("ladder parked {}", args.join(" ")).replace(&ns, "N"),
            ..Default::default()
        };
        for _ in 0..runs {
            let (took, peak, json) = tokio::task::block_in_place(|| run_cli(ladder_bin, &config, &args))?;
            row.total = total_of(&json)?;
            if row.total != expected {
                bail!("{}: total {} where {expected} were parked", row.what, row.total);
            }
            secs.push(took.as_secs_f64());
            row.peak_rss_kb = row.peak_rss_kb.max(peak);
        }
        row.secs = median(secs);
        eprintln!(
            "  {:<110} {:>7.2} s {:>8} kB  total {}",
            row.what, row.secs, row.peak_rss_kb, row.total
        );
        out.cli.push(row);
    }

    // The service over an empty lot, then over the full one: what the index costs.
    let http = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
    {
        let (mut empty, _) = start_service(&http, ladder_bin, &empty_config, port, &work.join("empty.log")).await?;
        // let the runtime settle (first poll, first scrape of nothing)
        tokio::time::sleep(Duration::from_secs(2)).await;
        out.service_empty_rss_kb = empty.stat()?.rss_kb;
        empty.stop(Duration::from_secs(15));
    }
    let (mut service, took) = start_service(&http, ladder_bin, &config, port, &work.join("full.log")).await?;
    out.service_catch_up_s = took.as_secs_f64();
    tokio::time::sleep(Duration::from_secs(2)).await;
    out.service_full_rss_kb = service.stat()?.rss_kb;
    eprintln!(
        "  service: caught up in {:.2} s; RSS {} kB over an empty lot, {} kB over this one",
        out.service_catch_up_s, out.service_empty_rss_kb, out.service_full_rss_kb
    );

    let base = format!("/api/ladders/{LADDER}/parked");
    let gets: Vec<(String, usize, u64)> = vec![
        (format!("{base}?limit=50"), 20, entries),
        (
            format!("{base}?reason=no-route&limit=50"),
            20,
            count(&|i| reason_of(i) == "no-route"),
        ),
        (format!("{base}?offset={mid}&limit=50"), 20, entries),
        (
            format!("{base}?reason=invalid-header&destination={dest3}&header=tenant%3Dt7&limit=20"),
            5,
            count(&|i| reason_of(i) == "invalid-header" && i % DESTINATIONS == 3 && i % TENANTS == 7),
        ),
        (
            format!("{base}?reason=invalid-header&header=tenant%3Dt7&limit=20"),
            5,
            count(&|i| reason_of(i) == "invalid-header" && i % TENANTS == 7),
        ),
        (format!("{base}?message_id=m-{}", entries - 7), 20, 1),
    ];
    for (path, requests, expected) in gets {
        let mut ms = vec![];
        let mut total = 0;
        for _ in 0..requests {
            let t = Instant::now();
            let v = get_json(&http, port, &path).await?;
            ms.push(t.elapsed().as_secs_f64() * 1000.0);
            total = total_of(&v)?;
            if total != expected {
                bail!("GET {path}: total {total} where {expected} were parked");
            }
        }
        out.http.push(http_row(format!("GET {path}"), ms, total, &ns));
    }
    // one entry in full
    let first = get_json(&http, port, &format!("{base}?limit=1")).await?;
    let offset = first["entries"][0]["offset"]
        .as_u64()
        .ok_or_else(|| anyhow!("no entry in {first}"))?;
    let mut ms = vec![];
    for _ in 0..20 {
        let t = Instant::now();
        let v = get_json(&http, port, &format!("{base}/{offset}")).await?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        if v["offset"].as_u64() != Some(offset) {
            bail!("GET {base}/{offset}: another entry came back");
        }
    }
    out.http.push(http_row(format!("GET {base}/{{offset}}"), ms, 1, &ns));
    // a dry-run replay: lock, marker, wait for the index to read it, select from the whole lot
    let invalid = count(&|i| reason_of(i) == "invalid-header");
    let selected = invalid.min(ladder::broker::lot::MAX_ACTION_BATCH as u64);
    let mut ms = vec![];
    for _ in 0..3 {
        let t = Instant::now();
        let request = http
            .post(format!("http://127.0.0.1:{port}{base}/replay"))
            .bearer_auth(TOKEN)
            .json(&serde_json::json!({"reason": "invalid-header", "dry_run": true}));
        let (status, v) = call(request).await?;
        ms.push(t.elapsed().as_secs_f64() * 1000.0);
        if status != 200 {
            bail!("dry-run replay: {status} {v}");
        }
        let n = v["outcomes"].as_array().map_or(0, Vec::len) as u64;
        let left = v["left_over"].as_u64().unwrap_or(0);
        if n != selected || n + left != invalid {
            bail!("dry-run replay: {n} selected and {left} left over of {invalid} invalid-header entries");
        }
    }
    out.http.push(http_row(
        format!("POST {base}/replay {{reason: invalid-header, dry_run}}"),
        ms,
        selected,
        &ns,
    ));
    for row in &out.http {
        eprintln!(
            "  {:<110} p50 {:>8.1} ms  max {:>8.1} ms  total {}",
            row.what, row.p50_ms, row.max_ms, row.total
        );
    }
    service.stop(Duration::from_secs(15));
    let _ = bounded("close", OP_TIMEOUT, conn.close(200, "done")).await;
    Ok(out)
}

fn http_row(what: String, ms: Vec<f64>, total: u64, ns: &str) -> HttpRow {
    HttpRow {
        what: what.replace(ns, "N"),
        requests: ms.len(),
        max_ms: ms.iter().copied().fold(0.0, f64::max),
        p50_ms: median(ms),
        total,
    }
}

/// The report: the numbers, and the ratios that matter.
pub fn markdown(r: &ParkingResults, command: &str, started: &str, load: &str) -> String {
    let mut s = String::new();
    let mb = |kb: u64| kb as f64 / 1024.0;
    s.push_str(&format!(
        "# Parking lot: {} entries\n\n`{command}`, started {started} UTC, load average {load}.\n\n",
        r.entries
    ));
    s.push_str(&format!(
        "Filled at {:.0} records/s; {} B per record (envelope). Medians of {} runs.\n\n",
        r.fill_per_s, r.record_bytes, r.runs
    ));
    s.push_str("| what | seconds | vs. bare read | peak RSS | total |\n|---|---:|---:|---:|---:|\n");
    s.push_str(&format!(
        "| bare read of the stream (consume + ack, nothing decoded) | {:.2} | 1.00 | | {} |\n",
        r.raw_read_s, r.entries
    ));
    for c in &r.cli {
        s.push_str(&format!(
            "| `{}` | {:.2} | {:.2} | {:.0} MB | {} |\n",
            c.what,
            c.secs,
            c.secs / r.raw_read_s,
            mb(c.peak_rss_kb),
            c.total
        ));
    }
    s.push_str(&format!(
        "| `ladder run`: start until the index caught up | {:.2} | {:.2} | | |\n\n",
        r.service_catch_up_s,
        r.service_catch_up_s / r.raw_read_s
    ));
    let delta = r.service_full_rss_kb.saturating_sub(r.service_empty_rss_kb);
    s.push_str(&format!(
        "Service RSS: {:.0} MB over an empty lot, {:.0} MB over this one: {:.0} MB more, {:.0} B per entry.\n\n",
        mb(r.service_empty_rss_kb),
        mb(r.service_full_rss_kb),
        mb(delta),
        delta as f64 * 1024.0 / r.entries.max(1) as f64
    ));
    s.push_str(
        "| HTTP request to the caught-up service | requests | p50 ms | max ms | total |\n|---|---:|---:|---:|---:|\n",
    );
    for h in &r.http {
        s.push_str(&format!(
            "| `{}` | {} | {:.1} | {:.1} | {} |\n",
            h.what, h.requests, h.p50_ms, h.max_ms, h.total
        ));
    }
    s
}
