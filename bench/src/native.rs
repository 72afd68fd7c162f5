//! `ladder-bench native` and `ladder-bench outage`: Ladder beside RabbitMQ 4.3's native
//! quorum-queue delayed retry, on the same ≥ 4.3 node, with the same publisher and the same
//! failing consumer ([`Failer`]); see `benchmarks/native.md`.
//!
//! - **native**: 1 s retries, each message failing `--failures` times, at each of `--rates`
//!   retries per second; windows taken in turns (native, Ladder, native, Ladder, …). Per 10 000
//!   retries: total CPU (broker + the `ladder run` process; native has no service process),
//!   broker CPU alone, lateness of every retry (receive − (failure + 1 s)), lost and duplicates.
//! - **outage**: a destination fails every message for `--outage` while `--rate` messages per
//!   second are published to it, then recovers; for native, Ladder and Ladder with `auto_hold`:
//!   broker and Ladder CPU, deliveries wasted on the failing consumer, lost, time to drain.
//!
//! Native side: a quorum queue with `x-delayed-retry-type: failed`, `x-delayed-retry-min` =
//! `x-delayed-retry-max` = 1000 ms and a delivery limit above any count the run can reach; the
//! consumer rejects with requeue. Ladder side: the real `ladder run`, ladder `retry` with
//! `backoff = ["1s"]`, in dead-letter mode: its work queue (quorum) dead-letters into the
//! ladder's exchange and the consumer rejects without requeue. Everything declared is deleted at
//! the end; no broker is stopped or restarted.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use ladder_amqp::{BasicProperties, FieldTable, FieldValue};
use serde::Serialize;

use crate::broker::{self, Msg, Registry, body, text};
use crate::delays::{Service, at_least_4_3, ladder_file, settle};
use crate::failer::{Fail, Failer};
use crate::procs;
use crate::report::{Machine, thousands};
use crate::scenarios::broker_quiet;
use crate::stats::{Pcts, pcts};

/// The retry delay of both sides, ms.
const DELAY_MS: u64 = 1000;
/// The ladder without a hold, and the one with `auto_hold`.
const RETRY: &str = "retry";
const AUTO: &str = "autohold";
/// Publishes in flight (unconfirmed) at once.
const WINDOW: usize = 20_000;
/// After a window's last publish, how long past its last retry every message may take.
const DRAIN: Duration = Duration::from_secs(20);
/// Before a window, at most this long for the broker to go quiet.
const QUIET_WAIT: Duration = Duration::from_secs(30);

/// `ladder-bench native`.
#[derive(clap::Args, Debug, Clone)]
pub struct NativeArgs {
    /// Failures per message: each is a retry (the rate is in retries per second).
    #[arg(long, default_value_t = 1)]
    pub failures: u32,
    /// Publishing seconds of one window (default 10; --smoke: 2).
    #[arg(long)]
    pub secs: Option<f64>,
    /// Windows per side and rate, taken in turns: native, Ladder, native, Ladder, … (default 2;
    /// --smoke: 1).
    #[arg(long)]
    pub rounds: Option<u32>,
    /// A `rabbitmqctl` for the node (e.g. `scripts/broker ctl 4.3 1`): each window's broker
    /// operations are then counted from the node's global counters (publishes, enqueues by
    /// dead-lettering, deliveries, acks) and reported per retry.
    #[arg(long)]
    pub ctl: Option<String>,
}

/// `ladder-bench outage`.
#[derive(clap::Args, Debug, Clone)]
pub struct OutageArgs {
    /// How long the destination fails every message (default 5m; --smoke: 10s).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub outage: Option<Duration>,
    /// Messages per second published to the destination during the outage (default 500;
    /// --smoke: 100).
    #[arg(long)]
    pub rate: Option<f64>,
    /// The auto-hold ladder's `release_rate`: how fast its held queue drains after the resume.
    #[arg(long, default_value = "1000/s")]
    pub release_rate: String,
    /// After recovery, how long the backlog may take to drain; what is not back by then counts
    /// as lost (default: 5 minutes + twice the outage).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub drain_timeout: Option<Duration>,
    /// Only these sides (comma-separated: native, ladder, auto-hold).
    #[arg(long, value_delimiter = ',')]
    pub sides: Vec<String>,
    /// How the Ladder sides' consumer fails a message.
    #[arg(long, value_enum, default_value_t = Mode::DeadLetter)]
    pub mode: Mode,
}

/// How a Ladder side's consumer hands a failure to the ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// The work queue dead-letters into the ladder's exchange; the consumer rejects.
    DeadLetter,
    /// The consumer publishes the failure to the ladder's exchange with `retry-to`, confirmed,
    /// then acks.
    Explicit,
}

/// One window of one side.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Window {
    /// `native` or `ladder`.
    pub side: String,
    /// Retries per second offered.
    pub rate: f64,
    /// 1, 2, …
    pub round: u32,
    /// Messages published and confirmed.
    pub sent: u64,
    /// Messages consumed successfully (each once).
    pub delivered: u64,
    /// Successful deliveries beyond the first of a message.
    pub duplicates: u64,
    /// Sent but never consumed successfully within the wait.
    pub lost: u64,
    /// Deliveries the consumer failed.
    pub failed: u64,
    /// Deliveries that followed a failure.
    pub retries: u64,
    /// Per retry: receive − (failure + 1 s), ms.
    pub late: Pcts,
    /// Broker CPU seconds, first publish to last success.
    pub broker_cpu_s: f64,
    /// The `ladder run` process's CPU seconds (0 for native).
    pub ladder_cpu_s: f64,
    /// Seconds waited for the broker to go quiet before the window.
    pub settle_s: f64,
    /// The share of the machine's CPU the hypervisor stole meanwhile, %.
    pub steal_pct: f64,
    /// The broker's operations during the window (with `--ctl`): its global counters' growth.
    pub ops: Ops,
}

impl Window {
    /// What the window's CPU is counted per: its retries; for the plain side, its messages.
    fn units(&self) -> u64 {
        if self.side == PLAIN {
            self.delivered
        } else {
            self.retries
        }
    }

    fn per_10k(&self, cpu_s: f64) -> f64 {
        if self.units() == 0 {
            0.0
        } else {
            cpu_s / self.units() as f64 * 10_000.0
        }
    }
}

/// The plain side: a quorum queue whose consumer acks every message (no failure, no retry), the
/// yardstick of what one message costs the node — one publish, one enqueue, one delivery, one ack.
const PLAIN: &str = "plain";

/// Broker operations, from `rabbit_global_counters:overview()` (summed over protocols, queue
/// types and dead-letter strategies).
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub struct Ops {
    /// Messages clients published (`messages_received_total`).
    pub published: u64,
    /// Messages dead-lettered into another queue: rejected, expired, dropped at a max length
    /// (`messages_dead_lettered_*_total`, but `confirmed`).
    pub dead_lettered: u64,
    /// Deliveries to consumers (`messages_delivered_total`).
    pub delivered: u64,
    /// Acks (`messages_acknowledged_total`).
    pub acked: u64,
}

impl Ops {
    /// From the text `rabbitmqctl eval 'rabbit_global_counters:overview().'` prints.
    pub fn parse(text: &str) -> Ops {
        let mut ops = Ops::default();
        let re = regex::Regex::new(r"([a-z_]+) => ([0-9]+)").expect("a valid pattern");
        for c in re.captures_iter(text) {
            let n: u64 = c[2].parse().unwrap_or(0);
            match &c[1] {
                "messages_received_total" => ops.published += n,
                "messages_delivered_total" => ops.delivered += n,
                "messages_acknowledged_total" => ops.acked += n,
                k if k.starts_with("messages_dead_lettered_") && k != "messages_dead_lettered_confirmed_total" => {
                    ops.dead_lettered += n
                }
                _ => {}
            }
        }
        ops
    }

    fn since(self, before: Ops) -> Ops {
        Ops {
            published: self.published.saturating_sub(before.published),
            dead_lettered: self.dead_lettered.saturating_sub(before.dead_lettered),
            delivered: self.delivered.saturating_sub(before.delivered),
            acked: self.acked.saturating_sub(before.acked),
        }
    }

    fn plus(self, o: Ops) -> Ops {
        Ops {
            published: self.published + o.published,
            dead_lettered: self.dead_lettered + o.dead_lettered,
            delivered: self.delivered + o.delivered,
            acked: self.acked + o.acked,
        }
    }

    /// Enqueues: every publish is routed into one queue here, every dead-lettering too.
    pub fn enqueued(&self) -> u64 {
        self.published + self.dead_lettered
    }
}

/// The node's operation counters, read with `ctl` (`None` without one, or when it fails).
async fn read_ops(ctl: Option<&str>) -> Option<Ops> {
    let ctl = ctl?;
    let mut words = ctl.split_whitespace();
    let program = words.next()?.to_string();
    let mut args: Vec<String> = words.map(str::to_string).collect();
    args.extend(["eval".to_string(), "rabbit_global_counters:overview().".to_string()]);
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(&program).args(&args).output(),
    )
    .await
    .ok()?
    .ok()?;
    out.status
        .success()
        .then(|| Ops::parse(&String::from_utf8_lossy(&out.stdout)))
}

/// One side at one rate, its windows pooled.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Pooled {
    /// `native` or `ladder`.
    pub side: String,
    /// Retries per second offered.
    pub rate: f64,
    /// Windows.
    pub windows: u32,
    /// Retries.
    pub retries: u64,
    /// Broker + Ladder CPU seconds per 10 000 retries.
    pub total_per_10k: f64,
    /// Broker CPU seconds per 10 000 retries.
    pub broker_per_10k: f64,
    /// Ladder CPU seconds per 10 000 retries.
    pub ladder_per_10k: f64,
    /// Every retry's lateness, ms.
    pub late: Pcts,
    /// The broker's operations over the windows (with `--ctl`).
    pub ops: Ops,
    /// Summed over the windows.
    pub sent: u64,
    /// Summed.
    pub lost: u64,
    /// Summed.
    pub duplicates: u64,
}

/// What `ladder-bench native` measured.
#[derive(Debug, Default, Clone, Serialize)]
pub struct NativeResults {
    /// The command line.
    pub command: String,
    /// UTC.
    pub started: String,
    /// UTC.
    pub finished: String,
    /// Where it ran; `machine.rabbitmq` is the node.
    pub machine: Machine,
    /// `/proc/loadavg` at the start and at the end.
    pub load_start: String,
    /// At the end.
    pub load_end: String,
    /// Whether the node's `beam.smp` was found (broker CPU is 0 otherwise).
    pub broker_cpu_measured: bool,
    /// Failures per message.
    pub failures: u32,
    /// Publishing seconds per window.
    pub secs: f64,
    /// Windows per side and rate.
    pub rounds: u32,
    /// Every window, in the order taken.
    pub windows: Vec<Window>,
    /// Per side and rate.
    pub pooled: Vec<Pooled>,
}

/// One side of the outage.
#[derive(Debug, Default, Clone, Serialize)]
pub struct OutageRow {
    /// `native`, `ladder`, `auto-hold`.
    pub side: String,
    /// Messages published and confirmed.
    pub sent: u64,
    /// Messages per second the publisher achieved.
    pub achieved: f64,
    /// Messages consumed successfully (each once).
    pub delivered: u64,
    /// Successful deliveries beyond the first.
    pub duplicates: u64,
    /// Sent but not consumed successfully within the drain timeout.
    pub lost: u64,
    /// Deliveries the failing consumer received and failed: work wasted on it.
    pub wasted: u64,
    /// Broker CPU seconds during the outage, and from the recovery until drained.
    pub broker_cpu_s: (f64, f64),
    /// The `ladder run` process's CPU seconds, the same two spans (0 for native).
    pub ladder_cpu_s: (f64, f64),
    /// Seconds from the recovery until every message was consumed (`None`: not within the timeout).
    pub drain_s: Option<f64>,
}

/// What `ladder-bench outage` measured.
#[derive(Debug, Default, Clone, Serialize)]
pub struct OutageResults {
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
    /// Whether the node's `beam.smp` was found.
    pub broker_cpu_measured: bool,
    /// The outage, s.
    pub outage_s: f64,
    /// Messages per second offered.
    pub rate: f64,
    /// Native `x-delivery-limit` and Ladder `max_attempts`.
    pub limit: u32,
    /// The auto-hold ladder's `[auto_hold]` table and `release_rate`, as written.
    pub auto_hold: String,
    /// How the Ladder sides failed.
    pub mode: Option<Mode>,
    /// One per side, in the order taken.
    pub rows: Vec<OutageRow>,
}

/// One side: its queue, its consumer, the queues that must be empty before a window.
struct Side {
    key: &'static str,
    queue: String,
    failer: Failer,
    watch: Vec<String>,
    /// Whether the ladder process works for it.
    ladder: bool,
}

/// Whether the broker at `url` is RabbitMQ ≥ 4.3; its version.
async fn check_node(url: &str) -> Result<String> {
    let conn = broker::connect(url, "ladder-bench-version").await?;
    let t = |key: &str| match conn.server_properties().get(key) {
        Some(FieldValue::LongString(s)) => s.to_str().map(str::to_string),
        _ => None,
    };
    let version = format!(
        "{} {}",
        t("product").unwrap_or_default(),
        t("version").unwrap_or_default()
    );
    let _ = tokio::time::timeout(broker::OP_TIMEOUT, conn.close(200, "bye")).await;
    if !at_least_4_3(&version) {
        bail!(
            "{url} is {version}: native delayed retry needs RabbitMQ ≥ 4.3 (a 4.3 node: `eval \"$(scripts/broker env 4.3)\"` and `--url \"$LADDER_TEST_AMQP_URL\"`)"
        );
    }
    Ok(version)
}

/// The native side's queue: quorum, delayed retry on `basic.reject` with requeue, 1 s, and a
/// delivery limit of `limit`.
async fn declare_native(svc: &Service, registry: &Registry, queue: &str, limit: u32) -> Result<()> {
    let mut args = FieldTable::new();
    args.set("x-queue-type", text("quorum"));
    args.set("x-delayed-retry-type", text("failed"));
    args.set("x-delayed-retry-min", FieldValue::LongLongInt(DELAY_MS as i64));
    args.set("x-delayed-retry-max", FieldValue::LongLongInt(DELAY_MS as i64));
    args.set("x-delivery-limit", FieldValue::LongLongInt(i64::from(limit)));
    broker::declare_queue(&svc.ctl, registry, queue, args).await
}

/// A Ladder side's work queue: quorum, dead-lettering into ladder `ladder`'s exchange in
/// dead-letter mode.
async fn declare_work(svc: &Service, registry: &Registry, queue: &str, ladder: &str, mode: Mode) -> Result<()> {
    let mut args = FieldTable::new();
    args.set("x-queue-type", text("quorum"));
    if mode == Mode::DeadLetter {
        args.set("x-dead-letter-exchange", text(&svc.names(ladder).exchange));
    }
    broker::declare_queue(&svc.ctl, registry, queue, args).await
}

/// The plain side: a quorum queue, consumed by the same consumer, which fails nothing.
async fn plain_side(svc: &Service, registry: &Registry) -> Result<Side> {
    let queue = format!("{}-plain", svc.ns);
    let mut args = FieldTable::new();
    args.set("x-queue-type", text("quorum"));
    broker::declare_queue(&svc.ctl, registry, &queue, args).await?;
    Ok(Side {
        key: PLAIN,
        failer: Failer::start(&svc.consume, &queue, Fail::Reject, 0).await?,
        watch: vec![queue.clone()],
        queue,
        ladder: false,
    })
}

/// The native side, its queue declared and consumed.
async fn native_side(svc: &Service, registry: &Registry, failures: u32, limit: u32) -> Result<Side> {
    let queue = format!("{}-native", svc.ns);
    declare_native(svc, registry, &queue, limit).await?;
    Ok(Side {
        key: "native",
        failer: Failer::start(&svc.consume, &queue, Fail::Reject, failures).await?,
        watch: vec![queue.clone()],
        queue,
        ladder: false,
    })
}

/// A Ladder side through ladder `ladder`, failing in `mode`.
async fn ladder_side(
    svc: &Service,
    registry: &Registry,
    (key, ladder): (&'static str, &str),
    failures: u32,
    mode: Mode,
) -> Result<Side> {
    let queue = format!("{}-work-{ladder}", svc.ns);
    declare_work(svc, registry, &queue, ladder, mode).await?;
    let names = svc.names(ladder);
    let fail = match mode {
        Mode::DeadLetter => Fail::DeadLetter,
        Mode::Explicit => Fail::Ladder {
            intake: names.exchange.clone(),
            publish: broker::confirm_channel(&svc.consume).await?,
        },
    };
    let tier = svc.tier_queue(ladder, &svc.spec(ladder).tier_for_attempt(1).name);
    Ok(Side {
        key,
        failer: Failer::start(&svc.consume, &queue, fail, failures).await?,
        watch: [queue.clone(), names.intake_queue.clone(), names.due.clone(), tier]
            .into_iter()
            .collect(),
        queue,
        ladder: true,
    })
}

/// A message for `queue` through the default exchange: persistent, the benchmark body.
fn message(queue: &str, id: u32, seq: u64) -> Msg {
    Msg {
        exchange: String::new(),
        routing_key: queue.to_string(),
        properties: BasicProperties::default().with_delivery_mode(2),
        body: body(id, seq, DELAY_MS),
    }
}

/// The service for a run: ladders (name, ladder file) on `url` in namespace `bench-<pid>-0`.
async fn service(
    url: &str,
    ladders: &[(&str, String)],
    work: &Path,
    ladder_bin: &Path,
    registry: &Registry,
) -> Result<Service> {
    let ns = format!("bench-{}-0", std::process::id());
    let svc = Service::start(url, &ns, ladders, work, ladder_bin, registry).await?;
    if svc.broker_pid.is_none() {
        eprintln!("ladder-bench: no beam.smp process found for {url}; broker CPU is not measured");
    }
    Ok(svc)
}

/// The options of a `native` run, resolved.
#[derive(Debug, Clone)]
pub struct NativePlan {
    /// Retries per second.
    pub rates: Vec<f64>,
    /// Failures per message.
    pub failures: u32,
    /// Publishing seconds per window.
    pub secs: f64,
    /// Windows per side and rate.
    pub rounds: u32,
    /// A `rabbitmqctl` for the node, to count its operations.
    pub ctl: Option<String>,
}

impl NativePlan {
    /// From the arguments: `rates` (the global `--rates`) default to 300 and 1 000 per second.
    pub fn new(args: &NativeArgs, rates: &[f64], smoke: bool) -> Self {
        let rates = match (rates.is_empty(), smoke) {
            (false, _) => rates.to_vec(),
            (true, true) => vec![50.0],
            (true, false) => vec![300.0, 1000.0],
        };
        NativePlan {
            rates,
            failures: args.failures.max(1),
            secs: args.secs.unwrap_or(if smoke { 2.0 } else { 10.0 }),
            rounds: args.rounds.unwrap_or(if smoke { 1 } else { 2 }).max(1),
            ctl: args.ctl.clone(),
        }
    }
}

/// `ladder-bench native`: every window, in turns; results are stored in `out` as they come.
pub async fn measure_native(
    url: &str,
    plan: &NativePlan,
    work: &Path,
    ladder_bin: &Path,
    registry: &Registry,
    out: &mut NativeResults,
) -> Result<()> {
    let version = check_node(url).await?;
    // a margin over the failures: neither side may drop or park a message that is to succeed
    let limit = plan.failures + 20;
    let max_attempts = format!("max_attempts = {limit}\n");
    let ns_file = |ns: &str| ladder_file(ns, "1s", &max_attempts);
    let ns = format!("bench-{}-0", std::process::id());
    let ladders = vec![(RETRY, ns_file(&ns))];
    let mut svc = service(url, &ladders, work, ladder_bin, registry).await?;
    out.machine.rabbitmq = version;
    out.machine.broker = svc.host_port();
    out.broker_cpu_measured = svc.broker_pid.is_some();
    let sides = vec![
        plain_side(&svc, registry).await?,
        native_side(&svc, registry, plan.failures, limit).await?,
        ladder_side(&svc, registry, ("ladder", RETRY), plan.failures, Mode::DeadLetter).await?,
    ];
    eprintln!(
        "native delayed retry vs Ladder (dead-letter mode) on {} ({}): {} failure(s) per message, rates {:?} retries/s, {} s windows, {} round(s)",
        svc.host_port(),
        out.machine.rabbitmq,
        plan.failures,
        plan.rates,
        plan.secs,
        plan.rounds
    );
    let mut late: HashMap<(usize, u64), Vec<i64>> = HashMap::new();
    let mut id = 2000;
    for &rate in &plan.rates {
        for round in 1..=plan.rounds {
            for (i, side) in sides.iter().enumerate() {
                id += 1;
                let (w, values) = window(&mut svc, side, id, rate, round, plan).await?;
                late.entry((i, rate as u64)).or_default().extend(values);
                out.windows.push(w);
            }
        }
    }
    for &rate in &plan.rates {
        for (i, side) in sides.iter().enumerate() {
            let ws: Vec<&Window> = out
                .windows
                .iter()
                .filter(|w| w.side == side.key && w.rate == rate)
                .collect();
            let retries: u64 = ws.iter().map(|w| w.units()).sum();
            let per_10k = |s: f64| {
                if retries == 0 {
                    0.0
                } else {
                    s / retries as f64 * 10_000.0
                }
            };
            let broker: f64 = ws.iter().map(|w| w.broker_cpu_s).sum();
            let ladder: f64 = ws.iter().map(|w| w.ladder_cpu_s).sum();
            out.pooled.push(Pooled {
                side: side.key.into(),
                rate,
                windows: ws.len() as u32,
                retries,
                total_per_10k: per_10k(broker + ladder),
                broker_per_10k: per_10k(broker),
                ladder_per_10k: per_10k(ladder),
                late: pcts(late.remove(&(i, rate as u64)).unwrap_or_default()),
                ops: ws.iter().fold(Ops::default(), |a, w| a.plus(w.ops)),
                sent: ws.iter().map(|w| w.sent).sum(),
                lost: ws.iter().map(|w| w.lost).sum(),
                duplicates: ws.iter().map(|w| w.duplicates).sum(),
            });
        }
    }
    drop(sides);
    svc.child.stop(Duration::from_secs(20));
    Ok(())
}

/// One window: `rate` retries per second for `plan.secs` through `side`; returns it and the
/// lateness of each retry.
async fn window(
    svc: &mut Service,
    side: &Side,
    id: u32,
    rate: f64,
    round: u32,
    plan: &NativePlan,
) -> Result<(Window, Vec<i64>)> {
    settle(&svc.ctl, &side.watch).await?;
    let settle_s = broker_quiet(svc.broker_pid, QUIET_WAIT).await;
    // the plain side fails nothing: its message rate is the rate
    let msg_rate = if side.key == PLAIN {
        rate
    } else {
        rate / f64::from(plan.failures)
    };
    let count = (msg_rate * plan.secs).round().max(1.0) as u64;
    // read outside the CPU window: the CLI's request is work of the node too
    let ops_before = read_ops(plan.ctl.as_deref()).await;
    let machine_before = procs::machine_ticks().unwrap_or_default();
    let before = svc.cpu()?;
    let published = broker::publish(
        &svc.publish_ch,
        Some(msg_rate),
        count,
        WINDOW,
        |seq| message(&side.queue, id, seq),
        || false,
    )
    .await?;
    let deadline = Instant::now() + Duration::from_millis(DELAY_MS * u64::from(plan.failures)) + DRAIN;
    while side.failer.progress(id).0 < published.confirmed && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = svc.cpu()?;
    let steal_pct = procs::steal_pct(machine_before, procs::machine_ticks().unwrap_or_default());
    let ops = match (ops_before, read_ops(plan.ctl.as_deref()).await) {
        (Some(before), Some(after)) => after.since(before),
        _ => Ops::default(),
    };
    let seen = side.failer.take(id);
    let delivered = seen.samples.len() as u64;
    let w = Window {
        side: side.key.into(),
        rate,
        round,
        sent: published.confirmed,
        delivered,
        duplicates: seen.duplicates,
        lost: published.confirmed.saturating_sub(delivered) + published.refused,
        failed: seen.failed,
        retries: seen.retry_late.len() as u64,
        late: pcts(seen.retry_late.clone()),
        broker_cpu_s: after.1.saturating_sub(before.1).as_secs_f64(),
        ladder_cpu_s: if side.ladder {
            after.0.saturating_sub(before.0).as_secs_f64()
        } else {
            0.0
        },
        settle_s,
        steal_pct,
        ops,
    };
    eprintln!(
        "  {:<6} {:>5.0}/s round {}: late p50 {:>4} p99 {:>5} max {:>5} ms | {}/{} consumed, {} retries, {} dup{} | broker {:.2} + ladder {:.2} = {:.2} s/10k | steal {:.0}%",
        w.side,
        rate,
        round,
        w.late.p50,
        w.late.p99,
        w.late.max,
        w.delivered,
        w.sent,
        w.retries,
        w.duplicates,
        if w.lost > 0 {
            format!(", LOST {}", w.lost)
        } else {
            String::new()
        },
        w.per_10k(w.broker_cpu_s),
        w.per_10k(w.ladder_cpu_s),
        w.per_10k(w.broker_cpu_s + w.ladder_cpu_s),
        w.steal_pct
    );
    Ok((w, seen.retry_late))
}

/// The options of an `outage` run, resolved.
#[derive(Debug, Clone)]
pub struct OutagePlan {
    /// How long the destination fails.
    pub outage: Duration,
    /// Messages per second.
    pub rate: f64,
    /// The auto-hold ladder's release rate (`N/s`).
    pub release_rate: String,
    /// After recovery, how long the backlog may take.
    pub drain_timeout: Duration,
    /// `native`, `ladder`, `auto-hold`, in this order.
    pub sides: Vec<String>,
    /// How the Ladder sides fail.
    pub mode: Mode,
}

/// The sides of the outage.
const OUTAGE_SIDES: [&str; 3] = ["native", "ladder", "auto-hold"];

impl OutagePlan {
    /// From the arguments.
    pub fn new(args: &OutageArgs, smoke: bool) -> Result<Self> {
        let outage = args.outage.unwrap_or(Duration::from_secs(if smoke { 10 } else { 300 }));
        if let Some(bad) = args.sides.iter().find(|s| !OUTAGE_SIDES.contains(&s.as_str())) {
            bail!("--sides {bad}: not one of {}", OUTAGE_SIDES.join(", "));
        }
        Ok(OutagePlan {
            outage,
            rate: args.rate.unwrap_or(if smoke { 100.0 } else { 500.0 }),
            release_rate: args.release_rate.clone(),
            drain_timeout: args.drain_timeout.unwrap_or(Duration::from_secs(300) + outage * 2),
            sides: OUTAGE_SIDES
                .iter()
                .filter(|s| args.sides.is_empty() || args.sides.iter().any(|a| a == *s))
                .map(|s| s.to_string())
                .collect(),
            mode: args.mode,
        })
    }

    /// The retries one message can reach (1 s each) during the outage and its drain, with a
    /// margin: native `x-delivery-limit` and Ladder `max_attempts`.
    pub fn limit(&self) -> u32 {
        let secs = (self.outage + self.drain_timeout).as_secs();
        u32::try_from(secs * 2 + 100).unwrap_or(u32::MAX)
    }

    /// The auto-hold ladder's extra keys: Ladder's defaults for a 5-minute outage (window 1 m,
    /// a probe every 4 s), scaled down for a shorter one (window = a fifth of the outage, at
    /// least 2 s; probe = a sixth of the window, 1 to 4 s), and the release rate.
    pub fn auto_hold(&self) -> String {
        let window = (self.outage.as_secs() / 5).clamp(2, 60);
        let probe = (window / 6).clamp(1, 4);
        format!(
            "release_rate = \"{}\"\n[auto_hold]\nenabled = true\nwindow = \"{window}s\"\nprobe_every = \"{probe}s\"\n",
            self.release_rate
        )
    }
}

/// `ladder-bench outage`: each side in turn; results are stored in `out` as they come.
pub async fn measure_outage(
    url: &str,
    plan: &OutagePlan,
    work: &Path,
    ladder_bin: &Path,
    registry: &Registry,
    out: &mut OutageResults,
) -> Result<()> {
    let version = check_node(url).await?;
    let limit = plan.limit();
    let ns = format!("bench-{}-0", std::process::id());
    let max_attempts = format!("max_attempts = {limit}\n");
    let auto = plan.auto_hold();
    let mut svc = service(
        url,
        &[
            (RETRY, ladder_file(&ns, "1s", &max_attempts)),
            (AUTO, ladder_file(&ns, "1s", &format!("{max_attempts}{auto}"))),
        ],
        work,
        ladder_bin,
        registry,
    )
    .await?;
    out.machine.rabbitmq = version;
    out.machine.broker = svc.host_port();
    out.broker_cpu_measured = svc.broker_pid.is_some();
    out.outage_s = plan.outage.as_secs_f64();
    out.rate = plan.rate;
    out.limit = limit;
    out.auto_hold = auto;
    out.mode = Some(plan.mode);
    let mut sides = vec![];
    for key in &plan.sides {
        sides.push(match key.as_str() {
            "native" => native_side(&svc, registry, 0, limit).await?,
            "ladder" => ladder_side(&svc, registry, ("ladder", RETRY), 0, plan.mode).await?,
            _ => {
                let side = ladder_side(&svc, registry, ("auto-hold", AUTO), 0, plan.mode).await?;
                // declared by the service when it first holds the destination
                registry.queue(&svc.names(AUTO).held_queue(&side.queue));
                side
            }
        });
    }
    eprintln!(
        "outage on {} ({}): {} s of failures at {}/s, then recovery; sides {:?}",
        svc.host_port(),
        out.machine.rabbitmq,
        out.outage_s,
        plan.rate,
        plan.sides
    );
    let mut id = 3000;
    for side in &sides {
        id += 1;
        let row = outage_side(&mut svc, side, id, plan).await?;
        out.rows.push(row);
    }
    drop(sides);
    svc.child.stop(Duration::from_secs(20));
    Ok(())
}

/// One side of the outage.
async fn outage_side(svc: &mut Service, side: &Side, id: u32, plan: &OutagePlan) -> Result<OutageRow> {
    settle(&svc.ctl, &side.watch).await?;
    broker_quiet(svc.broker_pid, QUIET_WAIT).await;
    let count = (plan.rate * plan.outage.as_secs_f64()).round().max(1.0) as u64;
    eprintln!(
        "  {}: failing for {:?} while publishing {} messages",
        side.key,
        plan.outage,
        thousands(count)
    );
    let started = svc.cpu()?;
    side.failer.set_failing(true);
    let publish = broker::publish(
        &svc.publish_ch,
        Some(plan.rate),
        count,
        WINDOW,
        |seq| message(&side.queue, id, seq),
        || false,
    );
    let recover = async {
        tokio::time::sleep(plan.outage).await;
        side.failer.set_failing(false);
        Instant::now()
    };
    let (published, recovered_at) = tokio::join!(publish, recover);
    let recovered = svc.cpu()?;
    let published = published?;
    eprintln!(
        "  {}: recovered; {} deliveries failed so far, {} of {} consumed",
        side.key,
        thousands(side.failer.failed(id)),
        thousands(side.failer.progress(id).0),
        thousands(published.confirmed)
    );
    let deadline = recovered_at + plan.drain_timeout;
    let mut last_print = Instant::now();
    let drain_s = loop {
        let (done, _) = side.failer.progress(id);
        if done >= published.confirmed {
            break Some(recovered_at.elapsed().as_secs_f64());
        }
        if Instant::now() >= deadline {
            break None;
        }
        if last_print.elapsed() >= Duration::from_secs(15) {
            eprintln!(
                "    {:.0} s after recovery: {} of {} consumed",
                recovered_at.elapsed().as_secs_f64(),
                thousands(done),
                thousands(published.confirmed)
            );
            last_print = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let drained = svc.cpu()?;
    let seen = side.failer.take(id);
    let delivered = seen.samples.len() as u64;
    let span = |a: Duration, b: Duration| b.saturating_sub(a).as_secs_f64();
    let row = OutageRow {
        side: side.key.into(),
        sent: published.confirmed,
        achieved: published.confirmed as f64 / published.secs.max(plan.outage.as_secs_f64()),
        delivered,
        duplicates: seen.duplicates,
        lost: published.confirmed.saturating_sub(delivered) + published.refused,
        wasted: seen.failed,
        broker_cpu_s: (span(started.1, recovered.1), span(recovered.1, drained.1)),
        ladder_cpu_s: if side.ladder {
            (span(started.0, recovered.0), span(recovered.0, drained.0))
        } else {
            (0.0, 0.0)
        },
        drain_s,
    };
    eprintln!(
        "  {}: {} wasted deliveries, {}/{} consumed, {} dup, lost {} | broker {:.1} + {:.1} s, ladder {:.1} + {:.1} s | drained {}",
        row.side,
        thousands(row.wasted),
        thousands(row.delivered),
        thousands(row.sent),
        row.duplicates,
        row.lost,
        row.broker_cpu_s.0,
        row.broker_cpu_s.1,
        row.ladder_cpu_s.0,
        row.ladder_cpu_s.1,
        row.drain_s
            .map_or("NOT within the timeout".into(), |d| format!("in {d:.1} s"))
    );
    Ok(row)
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "–".into()
    }
}

fn header(o: &mut String, title: &str, command: &str, m: &Machine, times: (&str, &str), load: (&str, &str)) {
    let _ = writeln!(o, "# {title}\n");
    let _ = writeln!(o, "Command: `{command}`\n");
    let _ = writeln!(o, "| | |\n|---|---|");
    let _ = writeln!(o, "| started / finished (UTC) | {} / {} |", times.0, times.1);
    let _ = writeln!(o, "| load average at start / end | {} / {} |", load.0, load.1);
    let _ = writeln!(
        o,
        "| machine | {} cores ({}), {} MB, Linux {}, {} |",
        m.nproc, m.cpu, m.mem_mb, m.kernel, m.rustc
    );
    let _ = writeln!(o, "| node | {} at {} |", m.rabbitmq, m.broker);
}

/// The Markdown report of a `native` run.
pub fn native_markdown(r: &NativeResults) -> String {
    let mut o = String::new();
    header(
        &mut o,
        "RabbitMQ 4.3 native delayed retry vs Ladder",
        &r.command,
        &r.machine,
        (&r.started, &r.finished),
        (&r.load_start, &r.load_end),
    );
    let _ = writeln!(
        o,
        "\n1 s retries, {} failure(s) per message, {} s windows, {} per side and rate, taken in turns (native, Ladder, …). \
         CPU from the first publish until every message was consumed, per 10 000 retries; broker = its `beam.smp`{}; \
         lateness of every retry = receive − (failure + 1 s), ms.\n",
        r.failures,
        r.secs,
        r.rounds,
        if r.broker_cpu_measured {
            ""
        } else {
            " (NOT FOUND: zeros)"
        }
    );
    let _ = writeln!(
        o,
        "| retries/s | side | windows | retries | total CPU s / 10k | broker CPU s / 10k | Ladder CPU s / 10k | p50 | p99 | max | lost | duplicates |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for p in &r.pooled {
        let _ = writeln!(
            o,
            "| {:.0} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} | {} |",
            p.rate,
            p.side,
            p.windows,
            thousands(p.retries),
            p.total_per_10k,
            p.broker_per_10k,
            p.ladder_per_10k,
            p.late.p50,
            p.late.p99,
            p.late.max,
            p.lost,
            p.duplicates
        );
    }
    let _ = writeln!(
        o,
        "\n| retries/s | side | side / native: total CPU | broker CPU | p50 lateness | p99 lateness |\n|---|---|---|---|---|---|"
    );
    let mut rates: Vec<f64> = r.pooled.iter().map(|p| p.rate).collect();
    rates.dedup();
    for rate in rates {
        let find = |side: &str| r.pooled.iter().find(|p| p.side == side && p.rate == rate);
        for side in ["ladder"] {
            if let (Some(n), Some(l)) = (find("native"), find(side)) {
                let _ = writeln!(
                    o,
                    "| {rate:.0} | {side} | {} | {} | {} | {} |",
                    ratio(l.total_per_10k, n.total_per_10k),
                    ratio(l.broker_per_10k, n.broker_per_10k),
                    ratio(l.late.p50 as f64, n.late.p50 as f64),
                    ratio(l.late.p99 as f64, n.late.p99 as f64)
                );
            }
        }
    }
    // what the retry itself costs: a side's CPU per retry less its messages' own cost (a plain
    // message's, shared by `failures` retries)
    let mut rates: Vec<f64> = r.pooled.iter().map(|p| p.rate).collect();
    rates.dedup();
    let plain_rows = r.pooled.iter().any(|p| p.side == PLAIN);
    if plain_rows {
        let _ = writeln!(
            o,
            "\nWhat the retry itself costs: a side's total CPU per retry less its message's own cost, which the \
             plain side measures (a quorum queue, the same publisher and consumer, nothing failed: one publish, enqueue, \
             delivery and ack per message), divided among the {} retries of a message.\n\n\
             | retries/s | plain message s / 10k | native retry s / 10k | Ladder retry s / 10k | Ladder / native, the retry alone |\n|---|---|---|---|---|",
            r.failures
        );
        for &rate in &rates {
            let find = |side: &str| r.pooled.iter().find(|p| p.side == side && p.rate == rate);
            if let (Some(p), Some(n), Some(l)) = (find(PLAIN), find("native"), find("ladder")) {
                let base = p.total_per_10k / f64::from(r.failures.max(1));
                let (n_extra, l_extra) = (n.total_per_10k - base, l.total_per_10k - base);
                let _ = writeln!(
                    o,
                    "| {rate:.0} | {:.2} | {n_extra:.2} | {l_extra:.2} | {} |",
                    p.total_per_10k,
                    ratio(l_extra, n_extra)
                );
            }
        }
    }
    if r.pooled.iter().any(|p| p.ops.delivered > 0) {
        let _ = writeln!(
            o,
            "\nBroker operations, counted by the node (`rabbit_global_counters`, read before and after each window), per retry \
             (plain: per message). Enqueues = publishes + dead-letterings: each lands in one queue here.\n\n\
             | retries/s | side | publishes | dead-letterings | enqueues | deliveries | acks |\n|---|---|---|---|---|---|---|"
        );
        for p in &r.pooled {
            let per = |n: u64| {
                if p.retries == 0 {
                    0.0
                } else {
                    n as f64 / p.retries as f64
                }
            };
            let _ = writeln!(
                o,
                "| {:.0} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                p.rate,
                p.side,
                per(p.ops.published),
                per(p.ops.dead_lettered),
                per(p.ops.enqueued()),
                per(p.ops.delivered),
                per(p.ops.acked)
            );
        }
    }
    let _ = writeln!(
        o,
        "\nEvery window:\n\n| retries/s | round | side | consumed / sent | retries | total | broker | Ladder (s / 10k) | p50 | p99 | max | lost | dup | quiet wait s | steal % |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for w in &r.windows {
        let _ = writeln!(
            o,
            "| {:.0} | {} | {} | {} / {} | {} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {:.0} | {:.0} |",
            w.rate,
            w.round,
            w.side,
            w.delivered,
            w.sent,
            w.retries,
            w.per_10k(w.broker_cpu_s + w.ladder_cpu_s),
            w.per_10k(w.broker_cpu_s),
            w.per_10k(w.ladder_cpu_s),
            w.late.p50,
            w.late.p99,
            w.late.max,
            w.lost,
            w.duplicates,
            w.settle_s,
            w.steal_pct
        );
    }
    o
}

/// The Markdown report of an `outage` run.
pub fn outage_markdown(r: &OutageResults) -> String {
    let mut o = String::new();
    header(
        &mut o,
        "A destination's outage: RabbitMQ 4.3 native delayed retry, Ladder, Ladder with auto_hold",
        &r.command,
        &r.machine,
        (&r.started, &r.finished),
        (&r.load_start, &r.load_end),
    );
    let _ = writeln!(
        o,
        "\nThe consumer fails every delivery for {:.0} s while {:.0} messages/s are published to its queue, then succeeds; \
         on the Ladder sides {}. 1 s retries on every side; native `x-delivery-limit` and Ladder `max_attempts` = {}. The auto-hold ladder adds `{}`. \
         Broker CPU = its `beam.smp`{}, in seconds, during the outage + from the recovery until drained.\n",
        r.outage_s,
        r.rate,
        match r.mode {
            Some(Mode::Explicit) => "it publishes each failure to the ladder's exchange (explicit mode) and acks",
            _ => "its queue dead-letters into the ladder's exchange (dead-letter mode)",
        },
        r.limit,
        r.auto_hold.trim().replace('\n', "; "),
        if r.broker_cpu_measured {
            ""
        } else {
            " (NOT FOUND: zeros)"
        }
    );
    let _ = writeln!(
        o,
        "| side | sent (achieved/s) | consumed | lost | duplicates | deliveries wasted on the failing consumer | broker CPU s | Ladder CPU s | total CPU s | time to drain after recovery |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|---|");
    for row in &r.rows {
        let (b, l) = (row.broker_cpu_s, row.ladder_cpu_s);
        let _ = writeln!(
            o,
            "| {} | {} ({:.0}/s) | {} | {} | {} | {} | {:.1} + {:.1} | {:.1} + {:.1} | {:.1} | {} |",
            row.side,
            thousands(row.sent),
            row.achieved,
            thousands(row.delivered),
            row.lost,
            row.duplicates,
            thousands(row.wasted),
            b.0,
            b.1,
            l.0,
            l.1,
            b.0 + b.1 + l.0 + l.1,
            row.drain_s
                .map_or("not within the timeout".into(), |d| format!("{d:.1} s"))
        );
    }
    o
}

/// Writes `name.json` and `name.md` into `out`; returns the Markdown file.
pub fn write(out: &Path, name: &str, json: &impl Serialize, md: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join(format!("{name}.json")), serde_json::to_string_pretty(json)?)?;
    let path = out.join(format!("{name}.md"));
    std::fs::write(&path, md)?;
    Ok(path)
}

/// What must hold after any run: every message consumed.
pub fn native_problems(r: &NativeResults) -> Vec<String> {
    let mut p = vec![];
    if r.windows.is_empty() {
        p.push("no window ran".into());
    }
    for w in &r.windows {
        if w.lost > 0 || w.sent == 0 || (w.retries == 0 && w.side != PLAIN) {
            p.push(format!(
                "{} at {}/s round {}: {} of {} consumed, {} retries",
                w.side, w.rate, w.round, w.delivered, w.sent, w.retries
            ));
        }
    }
    p
}

/// What must hold after an outage run: every message consumed.
pub fn outage_problems(r: &OutageResults) -> Vec<String> {
    r.rows
        .iter()
        .filter(|row| row.lost > 0 || row.sent == 0 || row.drain_s.is_none())
        .map(|row| format!("{}: {} of {} consumed", row.side, row.delivered, row.sent))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(outage: u64) -> OutagePlan {
        OutagePlan::new(
            &OutageArgs {
                outage: Some(Duration::from_secs(outage)),
                rate: None,
                release_rate: "1000/s".into(),
                drain_timeout: None,
                sides: vec![],
                mode: Mode::DeadLetter,
            },
            false,
        )
        .unwrap()
    }

    #[test]
    fn the_nodes_counters_are_summed_over_protocols_queue_types_and_strategies() {
        let text = "#{#{protocol => amqp091} =>
      #{consumers => 9,messages_received_total => 100,
        messages_routed_total => 100,messages_confirmed_total => 100},
  #{protocol => amqp091,queue_type => rabbit_quorum_queue} =>
      #{messages_delivered_total => 250,messages_redelivered_total => 50,
        messages_acknowledged_total => 200},
  #{protocol => amqp091,queue_type => rabbit_stream_queue} =>
      #{messages_delivered_total => 6, messages_acknowledged_total => 6},
  #{queue_type => rabbit_quorum_queue,dead_letter_strategy => at_least_once} =>
      #{messages_dead_lettered_expired_total => 40,
        messages_dead_lettered_confirmed_total => 40},
  #{queue_type => rabbit_quorum_queue,dead_letter_strategy => at_most_once} =>
      #{messages_dead_lettered_rejected_total => 30,
        messages_dead_lettered_maxlen_total => 2}}";
        let ops = Ops::parse(text);
        assert_eq!(
            (ops.published, ops.dead_lettered, ops.delivered, ops.acked),
            (100, 72, 256, 206),
            "a confirmed dead-lettering is not a second one"
        );
        assert_eq!(ops.enqueued(), 172);
        let later = Ops { published: 110, ..ops };
        assert_eq!(later.since(ops).published, 10);
    }

    #[test]
    fn a_five_minute_outage_keeps_ladders_auto_hold_defaults() {
        let a = plan(300).auto_hold();
        assert!(a.contains("window = \"60s\""), "{a}");
        assert!(a.contains("probe_every = \"4s\""), "{a}");
        let short = plan(10).auto_hold();
        assert!(short.contains("window = \"2s\""), "{short}");
        assert!(short.contains("probe_every = \"1s\""), "{short}");
        assert_eq!(plan(300).sides, ["native", "ladder", "auto-hold"]);
    }

    #[test]
    fn the_limit_outlasts_the_outage_and_the_drain() {
        let p = plan(300);
        assert!(u64::from(p.limit()) > (p.outage + p.drain_timeout).as_secs());
    }

    #[test]
    fn the_auto_hold_file_is_a_valid_ladder() {
        let dir = std::env::temp_dir().join(format!("ladder-bench-native-test-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("ladders")).unwrap();
        std::fs::write(dir.join("ladder.toml"), "namespace = \"bench-1-0\"\n").unwrap();
        let p = plan(300);
        let extra = format!("max_attempts = {}\n{}", p.limit(), p.auto_hold());
        std::fs::write(
            dir.join("ladders/autohold.toml"),
            ladder_file("bench-1-0", "1s", &extra),
        )
        .unwrap();
        let config = ladder::config::load(&dir.join("ladder.toml"), &HashMap::new());
        let _ = std::fs::remove_dir_all(&dir);
        let config = config.map_err(|e| e.to_string()).unwrap();
        let spec = &config.ladders[0];
        assert!(spec.auto_hold.is_some());
        assert_eq!(spec.max_attempts, p.limit());
    }
}
