//! `ladder-bench delays`: exact delays and scheduled deliveries (BENCHMARKS.md).
//!
//! Runs the real `ladder run` with two ladders — `sched` (its only backoff step is a delay
//! level, so its tiers are exactly the 28 levels) and `retry` (a `1s` step) — and measures, in
//! one run:
//! 1. precision: scheduled deliveries (`x-delay`) at 500/s, lateness per delay against the due
//!    time the publisher asked for, with single-level probes beside them for the per-hop lateness
//!    that bounds the delays too long to wait for;
//! 2. throughput: the highest sustained rate of a one-level delay, a six-level composed one and
//!    a plain 1 s retry, taking turns at each rate;
//! 3. memory: the service's RSS with many scheduled messages waiting in a long level;
//! 4. on a RabbitMQ ≥ 4.3 node: the broker's native quorum-queue delayed retry against the
//!    ladder's 1 s retry, both driven by a consumer that fails every message once.
//!
//! It owns nothing of the other subcommands' setup; everything it declares is registered and
//! deleted at the end. It never stops or restarts a broker.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use ladder::broker::topology::{self, Names};
use ladder::model::ladder::LadderSpec;
use ladder_amqp::{BasicProperties, Channel, Connection, FieldTable, FieldValue};
use serde::Serialize;

use crate::broker::{self, Collector, Msg, Registry, Sample, body, confirm_channel, connect, text};
use crate::failer::{Fail, Failer};
use crate::procs::{self, Child};
use crate::report::{Machine, thousands};
use crate::stats::{Pcts, pcts};

/// The ladder whose tiers are exactly the delay levels: its one backoff step (16 ms) is a level.
const SCHED: &str = "sched";
/// The ladder with a `1s` backoff step, for plain retries.
const RETRY: &str = "retry";
/// Its step, ms.
const RETRY_MS: u64 = 1000;

/// Delays reported but not waited for: 1 h, 24 h, 30 d.
const LONG_DELAYS_MS: [(&str, u64); 3] = [("1h", 3_600_000), ("24h", 86_400_000), ("30d", 2_592_000_000)];

/// Single-level probes: each exactly one delay level, so one hop.
const PROBE_LEVELS_MS: [u64; 6] = [16, 64, 256, 1024, 4096, 16384];

/// Probes per second beside the 500/s precision load (spread over the six levels).
const PROBE_RATE: f64 = 30.0;

/// The memory part's delay: 1 h, which first waits in the 2^21 ms level.
const MEMORY_DELAY_MS: u64 = 3_600_000;

/// After the last publish of a step, how long past its delay deliveries may take.
const DRAIN: Duration = Duration::from_secs(10);

/// Between steps, how long to wait for the queues a step used to empty before purging them.
const IDLE_WAIT: Duration = Duration::from_secs(10);

/// Publishes in flight (unconfirmed) at once.
const WINDOW: usize = 20_000;

/// Filling a level with a million messages takes minutes; this bounds it.
const FILL_TIMEOUT: Duration = Duration::from_secs(600);

/// Lateness above this fails a throughput step (the criterion is p99 < 100 ms).
const LATE_MS: i64 = broker::LATE_MS;

/// How long and how hard each part runs.
#[derive(Debug, Clone)]
pub struct Plan {
    /// `quick` or `full`.
    pub name: &'static str,
    /// Precision: rate, publishing seconds, the delays (round-robin).
    pub precision: (f64, f64, Vec<u64>),
    /// Throughput and native: the rates tried, ascending; a case stops at its first miss.
    pub rates: Vec<f64>,
    /// Publishing seconds of a throughput step.
    pub step_secs: f64,
    /// A rate fails only after this many failed steps.
    pub tries: u32,
    /// Scheduled messages left waiting for the memory reading (0: skip).
    pub memory: u64,
}

impl Plan {
    /// The documented run.
    pub fn full() -> Self {
        Plan {
            name: "full",
            precision: (500.0, 40.0, vec![100, 1000, 5000, 10_000, 60_000]),
            rates: vec![250.0, 500.0, 1000.0, 1500.0, 2000.0],
            step_secs: 10.0,
            tries: 2,
            memory: 1_000_000,
        }
    }

    /// No 60 s delay, 200 000 waiting. Still two tries per rate: on a shared 2-core machine one
    /// burst of other work otherwise decides a capacity alone.
    pub fn quick() -> Self {
        Plan {
            name: "quick",
            precision: (500.0, 40.0, vec![100, 1000, 5000, 10_000]),
            memory: 200_000,
            ..Self::full()
        }
    }
}

/// What `ladder-bench delays` measured; written as `delays.json` and `delays.md`.
#[derive(Debug, Default, Clone, Serialize)]
pub struct DelayResults {
    /// `quick` or `full`.
    pub profile: String,
    /// The command line.
    pub command: String,
    /// UTC.
    pub started: String,
    /// UTC.
    pub finished: String,
    /// Where it ran.
    pub machine: Machine,
    /// `/proc/loadavg` at the start and at the end.
    pub load_start: String,
    /// At the end.
    pub load_end: String,
    /// Part 1.
    pub precision: Precision,
    /// Part 2: one entry per case.
    pub throughput: Vec<Case>,
    /// Part 3.
    pub memory: Option<Memory>,
    /// Part 4.
    pub native: Option<Native>,
    /// Why part 4 did not run.
    pub native_skipped: Option<String>,
}

/// Scheduled deliveries under load.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Precision {
    /// Messages per second of the main load.
    pub rate: f64,
    /// Publishing seconds.
    pub secs: f64,
    /// One row per requested delay.
    pub rows: Vec<DelayRow>,
    /// Probes per second beside it.
    pub probe_rate: f64,
    /// One row per single-level probe delay.
    pub probes: Vec<DelayRow>,
    /// The highest p99 of the probes: the per-hop lateness used for the bounds, ms.
    pub per_hop_p99_ms: i64,
    /// Delays not waited for.
    pub long: Vec<LongRow>,
}

/// Lateness of one requested delay.
#[derive(Debug, Default, Clone, Serialize)]
pub struct DelayRow {
    /// Requested, ms.
    pub delay_ms: u64,
    /// Levels it waits in (greedy rule, zero hop latency).
    pub levels: Vec<String>,
    /// Confirmed publishes.
    pub sent: u64,
    /// Delivered (duplicates removed).
    pub delivered: u64,
    /// Delivered more than once.
    pub duplicates: u64,
    /// Delivered before the requested time.
    pub early: u64,
    /// Delivery time − requested due time, ms.
    pub late: Pcts,
}

/// A delay too long to wait for: its levels and a bound on its lateness.
#[derive(Debug, Default, Clone, Serialize)]
pub struct LongRow {
    /// `1h`, `24h`, `30d`.
    pub name: String,
    /// ms.
    pub delay_ms: u64,
    /// Levels.
    pub levels: Vec<String>,
    /// What the levels add up to beyond the delay (below the shortest level), ms.
    pub overshoot_ms: u64,
    /// overshoot + hops × per-hop p99, ms.
    pub bound_ms: i64,
}

/// One throughput case (or one side of the native comparison).
#[derive(Debug, Default, Clone, Serialize)]
pub struct Case {
    /// Short key.
    pub key: String,
    /// What it is.
    pub what: String,
    /// Levels (tiers) per message.
    pub hops: usize,
    /// Highest passing rate (0: none passed).
    pub capacity: f64,
    /// Lowest failing rate (`None`: passed every rate tried).
    pub first_miss: Option<f64>,
    /// Every step, in order.
    pub steps: Vec<StepRow>,
}

/// One load step.
#[derive(Debug, Default, Clone, Serialize)]
pub struct StepRow {
    /// Offered per second.
    pub offered: f64,
    /// Achieved by the publisher.
    pub achieved: f64,
    /// Confirmed.
    pub sent: u64,
    /// Delivered (duplicates removed).
    pub delivered: u64,
    /// Not delivered within the wait.
    pub lost: u64,
    /// Stopped as soon as more than 1% was over 100 ms late.
    pub stopped_early: bool,
    /// Delivered before the requested time.
    pub early: u64,
    /// Lateness, ms.
    pub late: Pcts,
    /// The ladder process's CPU seconds per 10 000 delivered.
    pub ladder_cpu_per_10k: f64,
    /// The broker's CPU seconds per 10 000 delivered.
    pub broker_cpu_per_10k: f64,
    /// Nothing lost, p99 < 100 ms, rate achieved.
    pub pass: bool,
}

/// Scheduled messages waiting in a long level.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Memory {
    /// Messages.
    pub count: u64,
    /// The level they wait in.
    pub level: String,
    /// From the first publish until all were in the level.
    pub secs: f64,
    /// Ladder VmRSS before and after, VmHWM after, kB.
    pub rss_before_kb: u64,
    /// After.
    pub rss_after_kb: u64,
    /// Peak.
    pub hwm_after_kb: u64,
    /// Broker VmRSS before and after, kB.
    pub broker_rss_before_kb: u64,
    /// After.
    pub broker_rss_after_kb: u64,
    /// Skipped, and why.
    pub skipped: Option<String>,
}

/// RabbitMQ 4.3's native delayed retry against the ladder's 1 s retry.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Native {
    /// The node: product and version.
    pub broker: String,
    /// host:port.
    pub at: String,
    /// Whether its `beam.smp` was found (broker CPU is 0 otherwise).
    pub broker_cpu_measured: bool,
    /// `native` and `ladder`.
    pub cases: Vec<Case>,
}

/// The levels a delay of `ms` waits in, by the service's own greedy rule with zero hop latency,
/// and how far their sum overshoots it.
pub fn levels(spec: &LadderSpec, ms: u64) -> (Vec<String>, u64) {
    let mut out = vec![];
    let mut waited = 0;
    while waited < ms {
        let tier = spec.next_wait(Duration::from_millis(ms - waited));
        waited += tier.ttl_ms();
        out.push(tier.name.clone());
    }
    (out, waited - ms)
}

/// One running `ladder run` and what is needed to drive it (also used by `ladder-bench native`).
pub(crate) struct Service {
    pub(crate) url: String,
    pub(crate) ns: String,
    config: ladder::config::Config,
    pub(crate) child: Child,
    pub(crate) ctl: Connection,
    pub(crate) publish_conn: Connection,
    pub(crate) publish_ch: Channel,
    pub(crate) consume: Connection,
    pub(crate) broker_pid: Option<u32>,
    pub(crate) version: String,
}

/// A ladder file: `backoff = [step]`, the namespace's queues allowed, quorum tiers dead-lettering
/// at-least-once, then `extra` (more keys, or tables such as `[auto_hold]`, which go last).
pub(crate) fn ladder_file(ns: &str, step: &str, extra: &str) -> String {
    format!(
        "backoff = [\"{step}\"]\nallow = [\"^{ns}-\"]\nqueue_type = \"quorum\"\ndead_letter_strategy = \"at-least-once\"\n{extra}"
    )
}

impl Service {
    /// Writes the config for `ladders` (name, ladder file: [`ladder_file`]) in namespace `ns`,
    /// starts the service and waits until it consumes every intake and due queue.
    pub(crate) async fn start(
        url: &str,
        ns: &str,
        ladders: &[(&str, String)],
        work: &Path,
        ladder_bin: &Path,
        registry: &Registry,
    ) -> Result<Self> {
        let dir = work.join(ns);
        std::fs::create_dir_all(dir.join("ladders"))?;
        let path = dir.join("ladder.toml");
        std::fs::write(
            &path,
            format!(
                "namespace = \"{ns}\"\nshutdown_grace = \"5s\"\n[amqp]\nurl = \"{url}\"\nconnection_name = \"ladder-bench-delays\"\n"
            ),
        )?;
        for (name, file) in ladders {
            std::fs::write(dir.join("ladders").join(format!("{name}.toml")), file)?;
        }
        let config = ladder::config::load(&path, &HashMap::new()).map_err(|e| anyhow!("{e}"))?;
        registry.plan(&topology::plan(&config, topology::BrokerVersion::LATEST));
        let ctl = connect(url, "ladder-bench-control").await?;
        let publish_conn = connect(url, "ladder-bench-publish").await?;
        let publish_ch = confirm_channel(&publish_conn).await?;
        let consume = connect(url, "ladder-bench-consume").await?;
        let args = vec!["--config".to_string(), path.display().to_string(), "run".to_string()];
        let mut child = Child::spawn(
            "ladder run",
            ladder_bin,
            &args,
            &[("RUST_LOG", "warn")],
            &work.join(format!("{ns}.log")),
            false,
        )?;
        let deadline = Instant::now() + Duration::from_secs(90);
        for (name, _) in ladders {
            let n = Names::new(ns, name);
            for q in [&n.intake_queue, &n.due] {
                while broker::depth(&ctl, q).await.map(|d| d.1).unwrap_or(0) == 0 {
                    child.stat().context("the ladder service stopped; see its log")?;
                    if Instant::now() > deadline {
                        bail!("no consumer on {q} after 90 s (logs in {})", work.display());
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        let broker_pid = match url.parse::<ladder_amqp::AmqpUri>() {
            Ok(uri) if ["127.0.0.1", "localhost", "::1"].contains(&uri.host.as_str()) => {
                procs::broker_pid_for(uri.port)
            }
            _ => None,
        };
        let version = {
            let t = |key: &str| match ctl.server_properties().get(key) {
                Some(FieldValue::LongString(s)) => s.to_str().map(str::to_string),
                _ => None,
            };
            format!(
                "{} {}",
                t("product").unwrap_or_default(),
                t("version").unwrap_or_default()
            )
        };
        Ok(Service {
            url: url.to_string(),
            ns: ns.to_string(),
            config,
            child,
            ctl,
            publish_conn,
            publish_ch,
            consume,
            broker_pid,
            version,
        })
    }

    pub(crate) fn spec(&self, ladder: &str) -> &LadderSpec {
        self.config
            .ladders
            .iter()
            .find(|l| l.name == ladder)
            .expect("the bench configured this ladder")
    }

    /// The names of `ladder`, its tier queues named for its queue type and dead-letter strategy.
    pub(crate) fn names(&self, ladder: &str) -> Names {
        Names::of(&self.ns, self.spec(ladder))
    }

    /// A level's (or step's) queue: the namespace's `N.delay.<tier>` of the ladder's queue shape,
    /// shared with every ladder of that shape.
    pub(crate) fn tier_queue(&self, ladder: &str, tier: &str) -> String {
        self.names(ladder).tier_queue_named(tier)
    }

    /// (ladder CPU, broker CPU) now.
    pub(crate) fn cpu(&mut self) -> Result<(Duration, Duration)> {
        let ladder = self.child.stat().context("the ladder service (see its log)")?.cpu;
        let broker = self
            .broker_pid
            .and_then(|p| procs::stat(p).ok())
            .unwrap_or_default()
            .cpu;
        Ok((ladder, broker))
    }

    pub(crate) fn host_port(&self) -> String {
        self.url
            .parse::<ladder_amqp::AmqpUri>()
            .map(|u| format!("{}:{}", u.host, u.port))
            .unwrap_or_default()
    }
}

/// A message scheduled through ladder `ladder`'s intake: `x-delay` (when given) and `retry-to`.
fn scheduled(svc: &Service, ladder: &str, dest: &str, step: u32, seq: u64, delay_ms: u64, x_delay: bool) -> Msg {
    let mut headers = FieldTable::new();
    headers.set("retry-to", text(dest));
    if x_delay {
        headers.set("x-delay", FieldValue::LongLongInt(delay_ms as i64));
    }
    Msg {
        exchange: svc.names(ladder).exchange,
        routing_key: String::new(),
        properties: BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(&format!("{step}-{seq}"))
            .with_headers(headers),
        body: body(step, seq, delay_ms),
    }
}

fn row(delay_ms: u64, levels: Vec<String>, sent: u64, samples: &[Sample], duplicates: u64) -> DelayRow {
    let late: Vec<i64> = samples.iter().map(Sample::late_e2e).collect();
    DelayRow {
        delay_ms,
        levels,
        sent,
        delivered: samples.len() as u64,
        duplicates,
        early: late.iter().filter(|&&l| l < 0).count() as u64,
        late: pcts(late),
    }
}

/// Part 1: the precision load and the single-level probes, at the same time.
async fn precision(svc: &Service, registry: &Registry, plan: &Plan) -> Result<Precision> {
    let (rate, secs, delays) = plan.precision.clone();
    eprintln!(
        "precision: {rate}/s for {secs} s, x-delay round-robin {delays:?} ms; probes {PROBE_LEVELS_MS:?} ms at {PROBE_RATE}/s"
    );
    let dest = format!("{}-dest-precision", svc.ns);
    broker::declare_queue(&svc.ctl, registry, &dest, FieldTable::new()).await?;
    let collector = Collector::start(&svc.consume, &dest).await?;
    let spec = svc.spec(SCHED);
    let (main_id, probe_id) = (1, 2);
    let count = (rate * secs) as u64;
    let probes = (PROBE_RATE * secs) as u64;
    let probe_ch = confirm_channel(&svc.publish_conn).await?;
    let n = delays.len() as u64;
    let main = broker::publish(
        &svc.publish_ch,
        Some(rate),
        count,
        WINDOW,
        |seq| scheduled(svc, SCHED, &dest, main_id, seq, delays[(seq % n) as usize], true),
        || false,
    );
    let levels_n = PROBE_LEVELS_MS.len() as u64;
    let probe = broker::publish(
        &probe_ch,
        Some(PROBE_RATE),
        probes,
        WINDOW,
        |seq| {
            let d = PROBE_LEVELS_MS[(seq % levels_n) as usize];
            scheduled(svc, SCHED, &dest, probe_id, seq, d, true)
        },
        || false,
    );
    let (main, probe) = tokio::join!(main, probe);
    let (main, probe) = (main?, probe?);
    if main.refused + probe.refused > 0 {
        bail!("{} scheduled publishes refused", main.refused + probe.refused);
    }
    let longest = delays.iter().chain(PROBE_LEVELS_MS.iter()).max().copied().unwrap_or(0);
    let deadline = Instant::now() + Duration::from_millis(longest) + DRAIN;
    while (collector.progress(main_id).0 < main.confirmed || collector.progress(probe_id).0 < probe.confirmed)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = probe_ch.close(200, "done").await;
    let (samples, _) = collector.take(main_id);
    let (probe_samples, _) = collector.take(probe_id);
    // confirmed counts per delay: seq i asked for delays[i % n]
    let sent_of = |total: u64, k: u64, i: u64| total / k + u64::from(i < total % k);
    let mut out = Precision {
        rate,
        secs,
        probe_rate: PROBE_RATE,
        ..Default::default()
    };
    for (i, &d) in delays.iter().enumerate() {
        let mine: Vec<Sample> = samples.iter().copied().filter(|s| s.delay_ms == d).collect();
        out.rows.push(row(
            d,
            levels(spec, d).0,
            sent_of(main.confirmed, n, i as u64),
            &mine,
            0,
        ));
    }
    for (i, &d) in PROBE_LEVELS_MS.iter().enumerate() {
        let mine: Vec<Sample> = probe_samples.iter().copied().filter(|s| s.delay_ms == d).collect();
        out.probes.push(row(
            d,
            levels(spec, d).0,
            sent_of(probe.confirmed, levels_n, i as u64),
            &mine,
            0,
        ));
    }
    out.per_hop_p99_ms = out.probes.iter().map(|r| r.late.p99).max().unwrap_or(0);
    for (name, ms) in LONG_DELAYS_MS {
        let (lv, overshoot) = levels(spec, ms);
        out.long.push(LongRow {
            name: name.to_string(),
            delay_ms: ms,
            bound_ms: overshoot as i64 + lv.len() as i64 * out.per_hop_p99_ms,
            levels: lv,
            overshoot_ms: overshoot,
        });
    }
    for r in out.rows.iter().chain(out.probes.iter()) {
        eprintln!(
            "  {:>6} ms ({} hops): p50 {} p99 {} max {} ms, {} early, {}/{} delivered",
            r.delay_ms,
            r.levels.len(),
            r.late.p50,
            r.late.p99,
            r.late.max,
            r.early,
            r.delivered,
            r.sent
        );
    }
    Ok(out)
}

/// What one throughput step publishes and how its lateness is judged.
struct Load {
    key: &'static str,
    what: String,
    ladder: &'static str,
    /// The delay it asks for (lateness reference), ms.
    delay_ms: u64,
    /// Scheduled (`x-delay`) or a plain retry.
    x_delay: bool,
    dest: String,
    collector: Collector,
    /// Queues that must be empty before a step.
    watch: Vec<String>,
    hops: usize,
}

/// Part 2: capacity of the three loads, taking turns at each rate.
async fn throughput(svc: &mut Service, registry: &Registry, plan: &Plan) -> Result<Vec<Case>> {
    eprintln!(
        "throughput: rates {:?}/s, {} s steps, {} tries: x-delay 1024 ms, x-delay 1000 ms, 1 s retry",
        plan.rates, plan.step_secs, plan.tries
    );
    let mut loads = vec![];
    for (key, what, ladder, delay_ms, x_delay) in [
        (
            "level-1024ms",
            "scheduled, x-delay = 1024 ms (one level)",
            SCHED,
            1024,
            true,
        ),
        (
            "composed-1000ms",
            "scheduled, x-delay = 1000 ms (composed)",
            SCHED,
            1000,
            true,
        ),
        ("retry-1s", "retry through the 1 s backoff step", RETRY, RETRY_MS, false),
    ] {
        let dest = format!("{}-dest-{key}", svc.ns);
        broker::declare_queue(&svc.ctl, registry, &dest, FieldTable::new()).await?;
        let collector = Collector::start(&svc.consume, &dest).await?;
        let tiers = if x_delay {
            levels(svc.spec(ladder), delay_ms).0
        } else {
            vec![svc.spec(ladder).tier_for_attempt(1).name.clone()]
        };
        let names = svc.names(ladder);
        let mut watch = vec![names.intake_queue.clone(), names.due.clone(), dest.clone()];
        watch.extend(tiers.iter().map(|t| svc.tier_queue(ladder, t)));
        loads.push(Load {
            key,
            what: what.to_string(),
            ladder,
            delay_ms,
            x_delay,
            dest,
            collector,
            watch,
            hops: tiers.len(),
        });
    }
    let mut cases: Vec<Case> = loads
        .iter()
        .map(|l| Case {
            key: l.key.to_string(),
            what: l.what.clone(),
            hops: l.hops,
            ..Default::default()
        })
        .collect();
    let mut next_id = 100;
    for &rate in &plan.rates {
        let mut decided: Vec<Option<bool>> = cases.iter().map(|c| c.first_miss.map(|_| false)).collect();
        for attempt in 0..plan.tries {
            for (i, load) in loads.iter().enumerate() {
                if decided[i].is_some() {
                    continue;
                }
                next_id += 1;
                let step = step(svc, next_id, rate, plan.step_secs, load).await?;
                let pass = step.pass;
                cases[i].steps.push(step);
                if pass {
                    decided[i] = Some(true);
                } else if attempt + 1 == plan.tries {
                    decided[i] = Some(false);
                }
            }
        }
        for (c, d) in cases.iter_mut().zip(decided) {
            match d {
                Some(true) if c.first_miss.is_none() => c.capacity = rate,
                Some(false) if c.first_miss.is_none() => c.first_miss = Some(rate),
                _ => {}
            }
        }
        if cases.iter().all(|c| c.first_miss.is_some()) {
            break;
        }
    }
    Ok(cases)
}

/// One step of `load` at `rate` through the service.
async fn step(svc: &mut Service, id: u32, rate: f64, secs: f64, load: &Load) -> Result<StepRow> {
    settle(&svc.ctl, &load.watch).await?;
    let before = svc.cpu()?;
    let count = (rate * secs).round() as u64;
    let late_limit = count / 100;
    let published = {
        let svc_ref: &Service = svc;
        broker::publish(
            &svc_ref.publish_ch,
            Some(rate),
            count,
            WINDOW,
            |seq| scheduled(svc_ref, load.ladder, &load.dest, id, seq, load.delay_ms, load.x_delay),
            || load.collector.progress(id).1 > late_limit,
        )
        .await?
    };
    let wait = Duration::from_millis(load.delay_ms) + DRAIN;
    let stopped = wait_for(
        &load.collector,
        id,
        published.confirmed,
        late_limit,
        published.stopped,
        wait,
    )
    .await;
    let after = svc.cpu()?;
    let (samples, _) = load.collector.take(id);
    let r = judge(rate, secs, &published, stopped, &samples, before, after);
    eprintln!(
        "  {:<16} {:>6.0}/s: p50 {:>4} p99 {:>5} max {:>5} ms | {}/{}{} | ladder {:.2} s/10k, broker {:.2} s/10k | {}",
        load.key,
        rate,
        r.late.p50,
        r.late.p99,
        r.late.max,
        r.delivered,
        r.sent,
        if r.stopped_early { " stopped early" } else { "" },
        r.ladder_cpu_per_10k,
        r.broker_cpu_per_10k,
        if r.pass { "pass" } else { "MISS" }
    );
    Ok(r)
}

/// Waits until `confirmed` arrived, more than `late_limit` were late, or `wait` passed; returns
/// whether the step was stopped early.
async fn wait_for(
    collector: &Collector,
    id: u32,
    confirmed: u64,
    late_limit: u64,
    stopped: bool,
    wait: Duration,
) -> bool {
    if stopped {
        return true;
    }
    let deadline = Instant::now() + wait;
    loop {
        let (got, late) = collector.progress(id);
        if got >= confirmed {
            return false;
        }
        if late > late_limit {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The verdict of one step: lateness e2e against publish time + delay.
fn judge(
    rate: f64,
    secs: f64,
    published: &broker::Published,
    stopped: bool,
    samples: &[Sample],
    before: (Duration, Duration),
    after: (Duration, Duration),
) -> StepRow {
    let delivered = samples.len() as u64;
    let per_10k = |a: Duration, b: Duration| {
        if delivered == 0 {
            0.0
        } else {
            a.saturating_sub(b).as_secs_f64() / delivered as f64 * 10_000.0
        }
    };
    let late: Vec<i64> = samples.iter().map(Sample::late_e2e).collect();
    let early = late.iter().filter(|&&l| l < 0).count() as u64;
    let late = pcts(late);
    let achieved = if published.secs > 0.0 {
        published.confirmed as f64 / published.secs.max(secs)
    } else {
        rate
    };
    let lost = if stopped {
        0
    } else {
        published.confirmed.saturating_sub(delivered)
    };
    StepRow {
        offered: rate,
        achieved,
        sent: published.confirmed,
        delivered,
        lost,
        stopped_early: stopped,
        early,
        late,
        ladder_cpu_per_10k: per_10k(after.0, before.0),
        broker_cpu_per_10k: per_10k(after.1, before.1),
        pass: !stopped && lost == 0 && published.refused == 0 && late.p99 < LATE_MS && achieved >= 0.97 * rate,
    }
}

/// Waits up to [`IDLE_WAIT`] for `queues` to empty, then purges what is left.
pub(crate) async fn settle(ctl: &Connection, queues: &[String]) -> Result<()> {
    if !broker::wait_empty(ctl, queues, IDLE_WAIT).await? {
        for q in queues {
            broker::purge(ctl, q).await?;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

/// Part 3: the service's memory with `count` scheduled messages waiting in a long level; the
/// level is purged right after, also when the measurement fails.
async fn memory(svc: &mut Service, registry: &Registry, count: u64) -> Result<Memory> {
    let (lv, _) = levels(svc.spec(SCHED), MEMORY_DELAY_MS);
    let level = lv[0].clone();
    let mut out = Memory {
        count,
        level: level.clone(),
        ..Default::default()
    };
    // quorum: ~0.55 GB per million small messages (shared/DESIGN.md); keep a wide margin
    let available = procs::mem_available_kb();
    if available < count * 3 + 2 * 1024 * 1024 {
        out.skipped = Some(format!(
            "only {} MB available; {count} waiting messages need about {} MB of broker memory plus headroom",
            available / 1024,
            count * 3 / 1024
        ));
        return Ok(out);
    }
    eprintln!("memory: {count} messages with x-delay = 1 h into level {level}");
    let queue = svc.tier_queue(SCHED, &level);
    let result = memory_inner(svc, registry, &queue, &mut out).await;
    let purged = broker::purge(&svc.ctl, &queue).await;
    let _ = broker::purge(&svc.ctl, &svc.names(SCHED).intake_queue).await;
    eprintln!(
        "  purged {queue}: {}",
        match &purged {
            Ok(n) => format!("{n} messages"),
            Err(e) => format!("FAILED: {e}"),
        }
    );
    result?;
    purged?;
    Ok(out)
}

async fn memory_inner(svc: &mut Service, registry: &Registry, queue: &str, out: &mut Memory) -> Result<()> {
    let dest = format!("{}-dest-memory", svc.ns);
    broker::declare_queue(&svc.ctl, registry, &dest, FieldTable::new()).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    out.rss_before_kb = svc.child.stat()?.rss_kb;
    out.broker_rss_before_kb = svc
        .broker_pid
        .and_then(|p| procs::stat(p).ok())
        .unwrap_or_default()
        .rss_kb;
    let started = Instant::now();
    let count = out.count;
    let publish = {
        let svc_ref: &Service = svc;
        broker::publish(
            &svc_ref.publish_ch,
            None,
            count,
            5000,
            |seq| scheduled(svc_ref, SCHED, &dest, 3, seq, MEMORY_DELAY_MS, true),
            || false,
        )
    };
    let ctl = &svc.ctl;
    let watch = async {
        let deadline = Instant::now() + FILL_TIMEOUT;
        let mut last_print = Instant::now();
        loop {
            let (n, _) = broker::depth(ctl, queue).await?;
            if u64::from(n) >= count {
                return Ok::<(), anyhow::Error>(());
            }
            if last_print.elapsed() > Duration::from_secs(10) {
                eprintln!("  {n} in {queue}");
                last_print = Instant::now();
            }
            if Instant::now() > deadline {
                bail!("only {n} of {count} in {queue} after {FILL_TIMEOUT:?}");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    let (published, watched) = tokio::join!(publish, watch);
    let published = published?;
    watched?;
    if published.refused > 0 {
        bail!("{} publishes refused", published.refused);
    }
    out.secs = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = svc.child.stat()?;
    out.rss_after_kb = after.rss_kb;
    out.hwm_after_kb = after.hwm_kb;
    out.broker_rss_after_kb = svc
        .broker_pid
        .and_then(|p| procs::stat(p).ok())
        .unwrap_or_default()
        .rss_kb;
    eprintln!(
        "  all {count} waiting after {:.0} s: ladder RSS {} → {} MB (peak {} MB); broker RSS {} → {} MB",
        out.secs,
        out.rss_before_kb / 1024,
        out.rss_after_kb / 1024,
        out.hwm_after_kb / 1024,
        out.broker_rss_before_kb / 1024,
        out.broker_rss_after_kb / 1024
    );
    Ok(())
}

/// Part 4: on a ≥ 4.3 node, the queue's own delayed retry (reject, requeue, back after 1 s)
/// against the ladder's 1 s retry, a consumer failing every message once on both sides.
async fn native(svc: &mut Service, registry: &Registry, plan: &Plan) -> Result<Native> {
    let native_q = format!("{}-native", svc.ns);
    let work_q = format!("{}-work", svc.ns);
    let mut args = FieldTable::new();
    args.set("x-queue-type", text("quorum"));
    args.set("x-delayed-retry-type", text("failed"));
    args.set("x-delayed-retry-min", FieldValue::LongLongInt(RETRY_MS as i64));
    args.set("x-delayed-retry-max", FieldValue::LongLongInt(RETRY_MS as i64));
    broker::declare_queue(&svc.ctl, registry, &native_q, args).await?;
    let mut args = FieldTable::new();
    args.set("x-queue-type", text("quorum"));
    broker::declare_queue(&svc.ctl, registry, &work_q, args).await?;
    let failers = [
        Failer::start(&svc.consume, &native_q, Fail::Reject, 1).await?,
        Failer::start(
            &svc.consume,
            &work_q,
            Fail::Ladder {
                intake: svc.names(RETRY).exchange,
                publish: confirm_channel(&svc.consume).await?,
            },
            1,
        )
        .await?,
    ];
    let names = svc.names(RETRY);
    let watches = [
        vec![native_q.clone()],
        vec![
            work_q.clone(),
            names.intake_queue.clone(),
            names.due.clone(),
            svc.tier_queue(RETRY, &svc.spec(RETRY).tier_for_attempt(1).name),
        ],
    ];
    let queues = [native_q.clone(), work_q.clone()];
    let mut cases = vec![
        Case {
            key: "native".into(),
            what: "RabbitMQ delayed retry (quorum queue, reject with requeue, 1 s)".into(),
            hops: 0,
            ..Default::default()
        },
        Case {
            key: "ladder".into(),
            what: "Ladder 1 s retry (republish to the intake, ack)".into(),
            hops: 1,
            ..Default::default()
        },
    ];
    eprintln!(
        "native delayed retry vs ladder 1 s retry on {} ({}): rates {:?}/s",
        svc.host_port(),
        svc.version,
        plan.rates
    );
    let mut id = 1000;
    for &rate in &plan.rates {
        let mut decided: [Option<bool>; 2] = [0, 1].map(|i| cases[i].first_miss.map(|_| false));
        for attempt in 0..plan.tries {
            for i in 0..2 {
                if decided[i].is_some() {
                    continue;
                }
                id += 1;
                settle(&svc.ctl, &watches[i]).await?;
                let before = svc.cpu()?;
                let count = (rate * plan.step_secs).round() as u64;
                let late_limit = count / 100;
                let failer = &failers[i];
                let q = queues[i].clone();
                let published = broker::publish(
                    &svc.publish_ch,
                    Some(rate),
                    count,
                    WINDOW,
                    |seq| Msg {
                        exchange: String::new(),
                        routing_key: q.clone(),
                        properties: BasicProperties::default().with_delivery_mode(2),
                        body: body(id, seq, RETRY_MS),
                    },
                    || failer.progress(id).1 > late_limit,
                )
                .await?;
                let stopped = wait_on_failer(failer, id, published.confirmed, late_limit, published.stopped).await;
                let after = svc.cpu()?;
                let samples = failer.take(id).samples;
                let mut r = judge(rate, plan.step_secs, &published, stopped, &samples, before, after);
                if i == 0 {
                    // the ladder does nothing for the native side
                    r.ladder_cpu_per_10k = 0.0;
                }
                eprintln!(
                    "  {:<7} {:>6.0}/s: p50 {:>4} p99 {:>5} max {:>5} ms | {}/{}{} | broker {:.2} s/10k, ladder {:.2} s/10k | {}",
                    cases[i].key,
                    rate,
                    r.late.p50,
                    r.late.p99,
                    r.late.max,
                    r.delivered,
                    r.sent,
                    if r.stopped_early { " stopped early" } else { "" },
                    r.broker_cpu_per_10k,
                    r.ladder_cpu_per_10k,
                    if r.pass { "pass" } else { "MISS" }
                );
                let pass = r.pass;
                cases[i].steps.push(r);
                if pass {
                    decided[i] = Some(true);
                } else if attempt + 1 == plan.tries {
                    decided[i] = Some(false);
                }
            }
        }
        for (c, d) in cases.iter_mut().zip(decided) {
            match d {
                Some(true) if c.first_miss.is_none() => c.capacity = rate,
                Some(false) if c.first_miss.is_none() => c.first_miss = Some(rate),
                _ => {}
            }
        }
        if cases.iter().all(|c| c.first_miss.is_some()) {
            break;
        }
    }
    Ok(Native {
        broker: svc.version.clone(),
        at: svc.host_port(),
        broker_cpu_measured: svc.broker_pid.is_some(),
        cases,
    })
}

async fn wait_on_failer(failer: &Failer, id: u32, confirmed: u64, late_limit: u64, stopped: bool) -> bool {
    if stopped {
        return true;
    }
    let deadline = Instant::now() + Duration::from_millis(RETRY_MS) + DRAIN;
    loop {
        let (got, late) = failer.progress(id);
        if got >= confirmed {
            return false;
        }
        if late > late_limit {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether the broker at the other end is RabbitMQ 4.3 or later.
pub(crate) fn at_least_4_3(version: &str) -> bool {
    let v: Vec<u32> = version
        .split_whitespace()
        .last()
        .unwrap_or("")
        .split('.')
        .filter_map(|p| p.parse().ok())
        .collect();
    matches!(v.as_slice(), [major, minor, ..] if (*major, *minor) >= (4, 3))
}

/// Every part, in order; results are stored in `shared` as they come.
pub async fn measure(
    url: &str,
    native_url: Option<&str>,
    plan: Plan,
    work: &Path,
    ladder_bin: &Path,
    registries: (&Registry, &Registry),
    shared: Arc<Mutex<DelayResults>>,
) -> Result<()> {
    let ns = format!("bench-{}-0", std::process::id());
    let mut svc = Service::start(
        url,
        &ns,
        &[
            (SCHED, ladder_file(&ns, "16ms", "")),
            (RETRY, ladder_file(&ns, "1s", "")),
        ],
        work,
        ladder_bin,
        registries.0,
    )
    .await?;
    {
        let mut r = shared.lock().unwrap();
        r.machine.rabbitmq = svc.version.clone();
        r.machine.broker = svc.host_port();
    }
    if svc.broker_pid.is_none() {
        eprintln!("ladder-bench: no beam.smp process found; broker CPU and memory are not measured");
    }
    let p = precision(&svc, registries.0, &plan).await?;
    shared.lock().unwrap().precision = p;
    let t = throughput(&mut svc, registries.0, &plan).await?;
    shared.lock().unwrap().throughput = t;
    if plan.memory > 0 {
        let m = memory(&mut svc, registries.0, plan.memory).await?;
        shared.lock().unwrap().memory = Some(m);
    }
    let native_here = at_least_4_3(&svc.version);
    svc.child.stop(Duration::from_secs(20));
    drop(svc);

    let native_url = match native_url {
        Some(u) => u,
        None if native_here => url,
        None => {
            shared.lock().unwrap().native_skipped =
                Some("no RabbitMQ ≥ 4.3 node given (`--native-url`), and the main broker is older".into());
            return Ok(());
        }
    };
    let ns = format!("bench-{}-1", std::process::id());
    let mut svc = Service::start(
        native_url,
        &ns,
        &[(RETRY, ladder_file(&ns, "1s", ""))],
        work,
        ladder_bin,
        registries.1,
    )
    .await?;
    if !at_least_4_3(&svc.version) {
        shared.lock().unwrap().native_skipped = Some(format!(
            "{} is {}: no native delayed retry before RabbitMQ 4.3",
            svc.host_port(),
            svc.version
        ));
        return Ok(());
    }
    let n = native(&mut svc, registries.1, &plan).await?;
    shared.lock().unwrap().native = Some(n);
    svc.child.stop(Duration::from_secs(20));
    Ok(())
}

fn mb(kb: u64) -> String {
    format!("{:.1}", kb as f64 / 1024.0)
}

fn rate_or_none(r: f64) -> String {
    if r > 0.0 { format!("{r:.0}/s") } else { "none".into() }
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 { format!("{:.2}", a / b) } else { "–".into() }
}

fn steps_table(o: &mut String, cases: &[Case], ladder_cpu: bool) {
    use std::fmt::Write as _;
    let _ = writeln!(
        o,
        "| case | offered | achieved | delivered / sent | p50 | p99 | max | early | {}broker CPU s / 10 000 | result |",
        if ladder_cpu { "ladder CPU s / 10 000 | " } else { "" }
    );
    let _ = writeln!(
        o,
        "|---|---|---|---|---|---|---|---|---|{}---|",
        if ladder_cpu { "---|" } else { "" }
    );
    for c in cases {
        for s in &c.steps {
            let _ = writeln!(
                o,
                "| {} | {:.0}/s | {:.0}/s | {} / {}{} | {} | {} | {} | {} | {}{:.2} | {} |",
                c.key,
                s.offered,
                s.achieved,
                s.delivered,
                s.sent,
                if s.stopped_early { " (stopped early)" } else { "" },
                s.late.p50,
                s.late.p99,
                s.late.max,
                s.early,
                if ladder_cpu {
                    format!("{:.2} | ", s.ladder_cpu_per_10k)
                } else {
                    String::new()
                },
                s.broker_cpu_per_10k,
                if s.pass { "pass" } else { "miss" }
            );
        }
    }
}

/// The Markdown report.
pub fn markdown(r: &DelayResults) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let m = &r.machine;
    let _ = writeln!(o, "# Exact delays and scheduled deliveries ({} run)\n", r.profile);
    let _ = writeln!(o, "Generated by `ladder-bench delays`. Command: `{}`\n", r.command);
    let _ = writeln!(o, "| | |\n|---|---|");
    let _ = writeln!(o, "| started / finished (UTC) | {} / {} |", r.started, r.finished);
    let _ = writeln!(o, "| load average at start / end | {} / {} |", r.load_start, r.load_end);
    let _ = writeln!(
        o,
        "| machine | {} cores ({}), {} MB, Linux {}, {} |",
        m.nproc, m.cpu, m.mem_mb, m.kernel, m.rustc
    );
    let _ = writeln!(o, "| broker (parts 1–3) | {} at {} |", m.rabbitmq, m.broker);
    let _ = writeln!(
        o,
        "| service | `ladder run` (release), ladders `sched` (backoff `16ms`: its tiers are exactly the 28 levels) and `retry` (backoff `1s`), quorum tiers, at-least-once, prefetch 200 |\n"
    );

    let p = &r.precision;
    let _ = writeln!(
        o,
        "## Precision under load\n\n{:.0} scheduled messages/s for {:.0} s, `x-delay` round-robin over the delays below, \
         published with confirms to `N.sched`; lateness = receive time − (publish time + `x-delay`), ms, same clock. \
         Levels by the service's greedy rule (`LadderSpec::next_wait`) at zero hop latency.\n",
        p.rate, p.secs
    );
    let row_table = |o: &mut String, rows: &[DelayRow]| {
        let _ = writeln!(
            o,
            "| x-delay | hops | levels | delivered / sent | p50 | p99 | max | early (< 0) |"
        );
        let _ = writeln!(o, "|---|---|---|---|---|---|---|---|");
        for d in rows {
            let _ = writeln!(
                o,
                "| {} ms | {} | {} | {} / {} | {} | {} | {} | {} |",
                thousands(d.delay_ms),
                d.levels.len(),
                d.levels.join(" "),
                d.delivered,
                d.sent,
                d.late.p50,
                d.late.p99,
                d.late.max,
                d.early
            );
        }
    };
    row_table(&mut o, &p.rows);
    let _ = writeln!(
        o,
        "\n**Per-hop lateness**: single-level probes at the same time ({:.0}/s over six delays that are exactly one level each, so one hop):\n",
        p.probe_rate
    );
    row_table(&mut o, &p.probes);
    let _ = writeln!(
        o,
        "\n**Delays not waited for**: bound = overshoot of the levels + hops × the highest probe p99 ({} ms). \
         Conservative: every hop re-aims at the absolute due time, so earlier hops' lateness is absorbed, not added.\n",
        p.per_hop_p99_ms
    );
    let _ = writeln!(o, "| delay | hops | levels | overshoot | lateness bound |");
    let _ = writeln!(o, "|---|---|---|---|---|");
    for l in &p.long {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} ms | {} ms |",
            l.name,
            l.levels.len(),
            l.levels.join(" "),
            l.overshoot_ms,
            l.bound_ms
        );
    }

    let _ = writeln!(
        o,
        "\n## Throughput\n\nHighest sustained rate: a 10 s step passes when everything is delivered, the publisher achieved the rate \
         and p99 lateness (against publish time + delay) < 100 ms. Rates tried in turn for the three loads; a load stops at its first miss.\n"
    );
    let _ = writeln!(o, "| load | hops | capacity | first miss |");
    let _ = writeln!(o, "|---|---|---|---|");
    for c in &r.throughput {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} |",
            c.what,
            c.hops,
            rate_or_none(c.capacity),
            c.first_miss
                .map_or("none up to the last rate".into(), |f| format!("{f:.0}/s"))
        );
    }
    let cap = |k: &str| r.throughput.iter().find(|c| c.key == k).map_or(0.0, |c| c.capacity);
    let _ = writeln!(
        o,
        "\nRatios: composed (6 hops) / one level = {}; one level / 1 s retry = {}; composed / 1 s retry = {}.\n",
        ratio(cap("composed-1000ms"), cap("level-1024ms")),
        ratio(cap("level-1024ms"), cap("retry-1s")),
        ratio(cap("composed-1000ms"), cap("retry-1s"))
    );
    steps_table(&mut o, &r.throughput, true);

    let _ = writeln!(o, "\n## Memory with scheduled messages waiting\n");
    match &r.memory {
        None => {
            let _ = writeln!(o, "Not measured.");
        }
        Some(mm) if mm.skipped.is_some() => {
            let _ = writeln!(o, "Skipped: {}.", mm.skipped.as_deref().unwrap_or(""));
        }
        Some(mm) => {
            let _ = writeln!(
                o,
                "{} messages with `x-delay` = 1 h published as fast as confirms allow; the service moved them into level `{}` in {:.0} s ({:.0}/s); then the level was purged.\n",
                thousands(mm.count),
                mm.level,
                mm.secs,
                mm.count as f64 / mm.secs.max(0.001)
            );
            let _ = writeln!(o, "| | before | with them waiting | difference |\n|---|---|---|---|");
            let _ = writeln!(
                o,
                "| ladder VmRSS | {} MB | {} MB (VmHWM {} MB) | {:+.1} MB |",
                mb(mm.rss_before_kb),
                mb(mm.rss_after_kb),
                mb(mm.hwm_after_kb),
                (mm.rss_after_kb as f64 - mm.rss_before_kb as f64) / 1024.0
            );
            let _ = writeln!(
                o,
                "| broker VmRSS | {} MB | {} MB | {:+.1} MB |",
                mb(mm.broker_rss_before_kb),
                mb(mm.broker_rss_after_kb),
                (mm.broker_rss_after_kb as f64 - mm.broker_rss_before_kb as f64) / 1024.0
            );
        }
    }

    let _ = writeln!(o, "\n## RabbitMQ 4.3 native delayed retry vs Ladder's 1 s retry\n");
    match (&r.native, &r.native_skipped) {
        (Some(n), _) => {
            let _ = writeln!(
                o,
                "On {} at {}. One consumer per side fails every message once: native — `basic.reject` with requeue on a quorum queue \
                 declared with `x-delayed-retry-type = failed`, `x-delayed-retry-min` = `x-delayed-retry-max` = 1000 ms; Ladder — \
                 republish to the intake of a `1s` ladder with `retry-to` = the queue, ack once confirmed. The second delivery is \
                 timed: lateness = receive − (publish + 1 s), so both include the first delivery. Broker CPU = its `beam.smp`{}, \
                 per retry delivered; Ladder's own CPU is separate.\n",
                n.broker,
                n.at,
                if n.broker_cpu_measured {
                    ""
                } else {
                    " (NOT FOUND: zeros)"
                }
            );
            let _ = writeln!(o, "| side | capacity | first miss |\n|---|---|---|");
            for c in &n.cases {
                let _ = writeln!(
                    o,
                    "| {} | {} | {} |",
                    c.what,
                    rate_or_none(c.capacity),
                    c.first_miss
                        .map_or("none up to the last rate".into(), |f| format!("{f:.0}/s"))
                );
            }
            let nc = |k: &str| n.cases.iter().find(|c| c.key == k).map_or(0.0, |c| c.capacity);
            let _ = writeln!(
                o,
                "\nRatio ladder / native capacity = {}.\n",
                ratio(nc("ladder"), nc("native"))
            );
            steps_table(&mut o, &n.cases, true);
        }
        (None, Some(why)) => {
            let _ = writeln!(o, "Not measured: {why}.");
        }
        (None, None) => {
            let _ = writeln!(o, "Not measured.");
        }
    }
    o
}

/// Writes `delays.json` and `delays.md` into `out`.
pub fn write(results: &DelayResults, out: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join("delays.json"), serde_json::to_string_pretty(results)?)?;
    let md = out.join("delays.md");
    std::fs::write(&md, markdown(results))?;
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched() -> LadderSpec {
        LadderSpec::new(
            SCHED.into(),
            vec![Duration::from_millis(16)],
            1,
            regex::RegexSet::empty(),
            ladder::model::ladder::QueueType::Quorum,
            ladder::model::ladder::DeadLetterStrategy::AtLeastOnce,
        )
    }

    #[test]
    fn a_level_is_one_hop_and_1000_ms_six() {
        let s = sched();
        assert_eq!(s.tiers.len(), 28, "a 16 ms step adds no tier");
        assert_eq!(levels(&s, 1024).0.len(), 1);
        let (l, over) = levels(&s, 1000);
        assert_eq!(l.len(), 6, "{l:?}");
        assert_eq!(over, 8, "512+256+128+64+32+16 = 1008");
        assert_eq!(levels(&s, 3_600_000).0[0], "level-35m");
    }

    #[test]
    fn versions() {
        assert!(at_least_4_3("RabbitMQ 4.3.1"));
        assert!(!at_least_4_3("RabbitMQ 3.10.8"));
    }
}
