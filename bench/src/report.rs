//! The generated report: `results.md` (machine, commands, the targets with pass/miss, every
//! table) and `results.json` (everything, for later comparison).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::stats::{Capacity, InProcess, Million, Mix, Step};

/// The machine and the software the numbers were measured on.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Machine {
    /// `/proc/cpuinfo` model name.
    pub cpu: String,
    /// Cores the bench may use.
    pub nproc: usize,
    /// MemTotal, MB.
    pub mem_mb: u64,
    /// Kernel release.
    pub kernel: String,
    /// The broker's product and version, as its `connection.start` says (older runs:
    /// `rabbitmqctl version`).
    pub rabbitmq: String,
    /// Where the broker was: host and port.
    #[serde(default)]
    pub broker: String,
    /// `rustc --version`, if on PATH.
    pub rustc: String,
}

impl Machine {
    /// Reads it from `/proc` and the tools on PATH.
    pub fn detect() -> Self {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let run = |program: &str, args: &[&str]| {
            Command::new("timeout")
                .arg("60")
                .arg(program)
                .args(args)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "unknown".into())
        };
        Machine {
            cpu,
            nproc: std::thread::available_parallelism().map_or(0, |n| n.get()),
            mem_mb: crate::procs::meminfo("MemTotal:") / 1024,
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
            // the bench reads it from the broker it talks to once connected
            rabbitmq: "unknown".into(),
            broker: String::new(),
            rustc: run("rustc", &["--version"]),
        }
    }
}

/// Everything one run measured.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Results {
    /// `full`, `quick`, `smoke`.
    pub profile: String,
    /// The command line.
    pub command: String,
    /// UTC, start and end.
    pub started: String,
    /// UTC.
    pub finished: String,
    /// Where.
    pub machine: Machine,
    /// `/proc/loadavg` at the start of the measurements.
    pub load_start: String,
    /// And at the end.
    pub load_end: String,
    /// How the quiet-machine wait went.
    pub quiet: String,
    /// Whether the ladder's config had an admin table.
    pub admin_server: bool,
    /// CPU ms per second while idle: ladder, minimal relay.
    #[serde(default)]
    pub idle_cpu_ms_per_s: (f64, f64),
    /// Capacity searches.
    pub capacity: Vec<Capacity>,
    /// Every load step.
    pub steps: Vec<Step>,
    /// Ladder VmHWM after the load phases (capacity, fixed rates), kB.
    pub ladder_peak_rss_kb: u64,
    /// Highest minimal-relay VmHWM, kB.
    pub relay_peak_rss_kb: u64,
    /// The mix.
    pub mix: Option<Mix>,
    /// The in-process retry.
    pub in_process: Option<InProcess>,
    /// A million waiting.
    pub million: Option<Million>,
}

/// The targets (issues 5 and 11), each measured, with pass/miss.
pub struct Verdict {
    /// What.
    pub what: String,
    /// Measured.
    pub measured: String,
    /// Goal.
    pub goal: String,
    /// `pass`, `MISS` or `n/a`.
    pub result: &'static str,
}

fn mark(ok: bool) -> &'static str {
    if ok { "pass" } else { "**MISS**" }
}

/// Capacity, ladder / relay: at least this (issue 11).
pub const CAPACITY_GOAL: f64 = 0.95;

/// CPU per retry at 80% of the lower capacity, ladder / relay: at most this (issue 11).
pub const CPU_GOAL: f64 = 1.1;

/// The fixed-rate steps of `cfg` at `rate` for `target`.
fn fixed<'a>(r: &'a Results, cfg: &str, target: &str, rate: f64) -> Option<&'a Step> {
    r.steps
        .iter()
        .find(|s| s.phase == "fixed" && s.cfg == cfg && s.target == target && (s.offered - rate).abs() < 0.5)
}

/// Every fixed-rate step of `cfg` at `rate` for `target` (a rate may be sampled several times).
fn fixed_all<'a>(r: &'a Results, cfg: &'a str, target: &'a str, rate: f64) -> impl Iterator<Item = &'a Step> + 'a {
    r.steps
        .iter()
        .filter(move |s| s.phase == "fixed" && s.cfg == cfg && s.target == target && (s.offered - rate).abs() < 0.5)
}

/// All the CPU seconds and all the retries of every fixed-rate step of `cfg` at `rate` for
/// `target`, and how many steps that is.
fn cpu_and_retries(r: &Results, cfg: &str, target: &str, rate: f64) -> (f64, u64, usize) {
    fixed_all(r, cfg, target, rate).fold((0.0, 0, 0), |(cpu, delivered, n), s| {
        (cpu + s.cpu_s, delivered + s.delivered, n + 1)
    })
}

/// CPU seconds per 10 000 retries over every fixed-rate step of `cfg` at `rate` for `target`
/// (all their CPU over all their retries), and how many steps that is.
pub fn pooled_cpu(r: &Results, cfg: &str, target: &str, rate: f64) -> Option<(f64, usize)> {
    let (cpu, delivered, n) = cpu_and_retries(r, cfg, target, rate);
    (delivered > 0).then(|| (cpu / delivered as f64 * 10_000.0, n))
}

/// Two-sided 95 % quantile of Student's t with `df` degrees of freedom (the table's next lower
/// entry between its rows, so the interval errs wide).
fn t95(df: usize) -> f64 {
    const TABLE: [(usize, f64); 17] = [
        (1, 12.71),
        (2, 4.30),
        (3, 3.18),
        (4, 2.78),
        (5, 2.57),
        (6, 2.45),
        (7, 2.36),
        (8, 2.31),
        (9, 2.26),
        (10, 2.23),
        (11, 2.20),
        (12, 2.18),
        (13, 2.16),
        (14, 2.14),
        (15, 2.13),
        (20, 2.09),
        (30, 2.04),
    ];
    TABLE.iter().rev().find(|(d, _)| *d <= df).map_or(f64::NAN, |(_, t)| *t)
}

/// Several runs put together (`ladder-bench runs`): for every run and every (configuration,
/// fixed rate) with at least two ladder windows, the run's CPU per 10 000 retries of both and
/// their ratio; then per (configuration, rate) the mean of the runs' ratios with a 95 %
/// Student-t interval over the runs, and all runs pooled. One run's ratio is not a verdict: the
/// spread between runs (new processes) is larger than within one.
pub fn runs_summary(runs: &[(String, Results)]) -> String {
    type Key = (String, u64);
    let mut ratios: BTreeMap<Key, Vec<f64>> = BTreeMap::new();
    let mut pooled: BTreeMap<Key, [f64; 4]> = BTreeMap::new();
    let mut o = String::new();
    for (name, r) in runs {
        let mut keys: Vec<Key> = r
            .steps
            .iter()
            .filter(|s| s.phase == "fixed")
            .map(|s| (s.cfg.clone(), s.offered.round() as u64))
            .collect();
        keys.sort();
        keys.dedup();
        for key in keys {
            let rate = key.1 as f64;
            let l = cpu_and_retries(r, &key.0, "ladder", rate);
            let x = cpu_and_retries(r, &key.0, "relay", rate);
            if l.2 < 2 || l.1 == 0 || x.1 == 0 {
                continue;
            }
            let (ladder, relay) = (l.0 / l.1 as f64 * 1e4, x.0 / x.1 as f64 * 1e4);
            let _ = writeln!(
                o,
                "{name}: {} {}/s, {} windows: ladder {ladder:.3} s, relay {relay:.3} s per 10 000, ratio {:.3}",
                key.0,
                key.1,
                l.2,
                ladder / relay
            );
            ratios.entry(key.clone()).or_default().push(ladder / relay);
            let p = pooled.entry(key).or_default();
            for (sum, add) in p.iter_mut().zip([l.0, l.1 as f64, x.0, x.1 as f64]) {
                *sum += add;
            }
        }
    }
    let _ = writeln!(o);
    for (key, v) in &ratios {
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        // one run has no spread to take an interval from
        let interval = if v.len() < 2 {
            "no 95 % interval from one run".to_string()
        } else {
            let sd = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
            let half = t95(v.len() - 1) * sd / n.sqrt();
            format!("95 % interval {:.3}-{:.3}", mean - half, mean + half)
        };
        let p = pooled[key];
        let _ = writeln!(
            o,
            "{} {}/s: {} run{}, mean ratio {mean:.3}, {interval}; pooled {:.3} s vs {:.3} s per 10 000",
            key.0,
            key.1,
            v.len(),
            if v.len() == 1 { "" } else { "s" },
            p[0] / p[1] * 1e4,
            p[2] / p[3] * 1e4
        );
    }
    o
}

/// The rate at which CPU per retry was compared for `cfg` ([`Capacity::cpu_rate`]).
pub fn eighty(r: &Results, cfg: &str) -> Option<f64> {
    r.capacity.iter().find(|c| c.cfg == cfg)?.cpu_rate()
}

/// Checks every target.
pub fn verdicts(r: &Results) -> Vec<Verdict> {
    let mut v = vec![];
    for c in &r.capacity {
        let ratio = if c.relay > 0.0 { c.ladder / c.relay } else { f64::NAN };
        v.push(Verdict {
            what: format!("capacity, ladder / relay ({})", c.cfg),
            measured: format!("{ratio:.2} ({:.0}/s vs {:.0}/s)", c.ladder, c.relay),
            goal: format!(">= {CAPACITY_GOAL}"),
            result: mark(ratio >= CAPACITY_GOAL),
        });
    }
    for c in &r.capacity {
        let Some(rate) = eighty(r, &c.cfg) else { continue };
        if let (Some((l, n)), Some((x, _))) = (
            pooled_cpu(r, &c.cfg, "ladder", rate),
            pooled_cpu(r, &c.cfg, "relay", rate),
        ) {
            let ratio = l / x;
            let windows = if n > 1 {
                format!(", {n} windows each, in turn")
            } else {
                String::new()
            };
            v.push(Verdict {
                what: format!(
                    "CPU per retry, ladder / relay ({}, {rate:.0}/s = 80% of the lower capacity{windows})",
                    c.cfg
                ),
                measured: format!("{ratio:.2} ({l:.2} s vs {x:.2} s per 10 000)"),
                goal: format!("<= {CPU_GOAL}"),
                result: mark(ratio <= CPU_GOAL),
            });
        }
    }
    let windows = |target: &str| -> Vec<&Step> {
        r.steps
            .iter()
            .filter(|s| s.phase == "p99" && s.target == target && s.cfg == "quorum-alo")
            .collect()
    };
    let (ladder, relay) = (windows("ladder"), windows("relay"));
    if !ladder.is_empty() {
        let median = |w: &[&Step], f: fn(&Step) -> i64| {
            let mut v: Vec<i64> = w.iter().map(|s| f(s)).collect();
            v.sort_unstable();
            v[(v.len() - 1) / 2]
        };
        let each: Vec<String> = ladder.iter().map(|s| s.due.p99.to_string()).collect();
        let relay_each: Vec<String> = relay.iter().map(|s| s.due.p99.to_string()).collect();
        let m = median(&ladder, |s| s.due.p99);
        let lost: u64 = ladder.iter().map(|s| s.lost).sum();
        v.push(Verdict {
            what: format!(
                "p99 lateness at {:.0} retries/s (quorum, at-least-once), median of {} windows of {:.0} s",
                ladder[0].offered,
                ladder.len(),
                ladder[0].secs
            ),
            measured: format!(
                "{m} ms against retry-due-at (windows: {} ms; end to end {} ms; relay in the same turns: {} ms)",
                each.join(", "),
                median(&ladder, |s| s.e2e.p99),
                relay_each.join(", ")
            ),
            goal: "<= 50 ms".into(),
            result: mark(m <= 50 && lost == 0),
        });
    } else if let Some(s) = fixed(r, "quorum-alo", "ladder", 1000.0) {
        v.push(Verdict {
            what: "p99 lateness at 1 000 retries/s (quorum, at-least-once)".into(),
            measured: format!("{} ms against retry-due-at ({} ms end to end)", s.due.p99, s.e2e.p99),
            goal: "<= 50 ms".into(),
            result: mark(s.due.p99 <= 50 && s.lost == 0),
        });
    }
    if r.ladder_peak_rss_kb > 0 {
        v.push(Verdict {
            what: "ladder peak RSS at load (VmHWM after every load step)".into(),
            measured: format!("{:.1} MB", r.ladder_peak_rss_kb as f64 / 1024.0),
            goal: "<= 40 MB".into(),
            result: mark(r.ladder_peak_rss_kb <= 40 * 1024),
        });
    }
    if let Some(m) = &r.million {
        match &m.skipped {
            Some(why) => v.push(Verdict {
                what: "ladder RSS growth with 1 000 000 waiting".into(),
                measured: format!("skipped: {why}"),
                goal: "<= +10 MB".into(),
                result: "n/a",
            }),
            None => {
                let growth = m.ladder_rss_after_kb as f64 - m.ladder_rss_before_kb as f64;
                v.push(Verdict {
                    what: format!("ladder RSS growth with {} waiting", thousands(m.count)),
                    measured: format!(
                        "{:+.1} MB ({:.1} → {:.1} MB)",
                        growth / 1024.0,
                        m.ladder_rss_before_kb as f64 / 1024.0,
                        m.ladder_rss_after_kb as f64 / 1024.0
                    ),
                    goal: "<= +10 MB".into(),
                    result: mark(growth <= 10.0 * 1024.0),
                });
            }
        }
    }
    v
}

/// 1000000 → "1 000 000".
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

fn mb(kb: u64) -> String {
    format!("{:.1}", kb as f64 / 1024.0)
}

/// The Markdown report.
pub fn markdown(r: &Results, plots: &[(&str, &str)]) -> String {
    let mut o = String::new();
    let m = &r.machine;
    let _ = writeln!(o, "# Ladder benchmark results ({} run)\n", r.profile);
    let _ = writeln!(o, "Generated by the benchmark itself. Command: `{}`\n", r.command);
    let _ = writeln!(o, "| | |\n|---|---|");
    let _ = writeln!(o, "| started / finished (UTC) | {} / {} |", r.started, r.finished);
    let _ = writeln!(o, "| CPU | {} × {} |", m.nproc, m.cpu);
    let _ = writeln!(o, "| memory | {} MB |", m.mem_mb);
    let _ = writeln!(o, "| kernel | {} |", m.kernel);
    let at = if m.broker.is_empty() {
        "127.0.0.1:5672"
    } else {
        m.broker.as_str()
    };
    let _ = writeln!(o, "| RabbitMQ | {} (same machine, {at}) |", m.rabbitmq);
    let _ = writeln!(o, "| Rust | {} |", m.rustc);
    let _ = writeln!(o, "| load average at start | {} ({}) |", r.load_start, r.quiet);
    let _ = writeln!(o, "| load average at end | {} |", r.load_end);
    if !r.steps.is_empty() {
        let most = r.steps.iter().map(|s| s.steal_pct).fold(0.0, f64::max);
        let mean = r.steps.iter().map(|s| s.steal_pct).sum::<f64>() / r.steps.len() as f64;
        let _ = writeln!(
            o,
            "| CPU stolen by the hypervisor during load steps | mean {mean:.1} %, most {most:.1} % (per step in results.json, `steal_pct`) |"
        );
    }
    let _ = writeln!(
        o,
        "| ladder service | `target/release/ladder run`, RUST_LOG=warn, prefetch 200, admin server {} |\n",
        if r.admin_server { "on (port 0)" } else { "absent" }
    );

    let _ = writeln!(o, "## Targets\n");
    let _ = writeln!(o, "| target | measured | goal | result |\n|---|---|---|---|");
    for v in verdicts(r) {
        let _ = writeln!(o, "| {} | {} | {} | {} |", v.what, v.measured, v.goal, v.result);
    }

    let _ = writeln!(
        o,
        "\n## Capacity (1 s tier, p99 end-to-end lateness < 100 ms, nothing lost)\n"
    );
    let _ = writeln!(
        o,
        "| tiers | ladder | minimal relay | ladder / relay | ladder first miss | relay first miss |\n|---|---|---|---|---|---|"
    );
    let miss = |f: Option<f64>| f.map_or("none up to the ceiling".to_string(), |x| format!("{x:.0}/s"));
    for c in &r.capacity {
        let _ = writeln!(
            o,
            "| {} | {:.0}/s | {:.0}/s | {:.2} | {} | {} |",
            c.cfg,
            c.ladder,
            c.relay,
            if c.relay > 0.0 { c.ladder / c.relay } else { f64::NAN },
            miss(c.ladder_fail),
            miss(c.relay_fail)
        );
    }

    let _ = writeln!(
        o,
        "\n## Lateness and cost at fixed rates (same offered rate for ladder and relay)\n"
    );
    let _ = writeln!(
        o,
        "Lateness in ms. *due*: redelivery − `retry-due-at` (set at the intake hop). *e2e*: redelivery − (publish + 1 s), which adds the intake hop.\n"
    );
    let _ = writeln!(
        o,
        "| tiers | rate | process | due p50 / p99 / max | e2e p50 / p99 / max | delivered | process CPU s / 10k | broker CPU s / 10k | process RSS MB |\n|---|---|---|---|---|---|---|---|---|"
    );
    for s in r.steps.iter().filter(|s| s.phase == "fixed") {
        let _ = writeln!(
            o,
            "| {} | {:.0}/s | {} | {} / {} / {} | {} / {} / {} | {}/{}{} | {:.2} | {:.2} | {} |",
            s.cfg,
            s.offered,
            s.target,
            s.due.p50,
            s.due.p99,
            s.due.max,
            s.e2e.p50,
            s.e2e.p99,
            s.e2e.max,
            s.delivered,
            s.sent,
            if s.duplicates > 0 {
                format!(" (+{} dup)", s.duplicates)
            } else {
                String::new()
            },
            s.cpu_per_10k,
            s.broker_cpu_per_10k,
            mb(s.rss_kb)
        );
    }
    if r.steps.iter().any(|s| s.phase == "p99") {
        let _ = writeln!(
            o,
            "\n### Lateness target windows (quorum at-least-once, ladder and relay in turn)\n\n| window | process | rate | due p50 / p99 / max | e2e p50 / p99 / max | delivered |\n|---|---|---|---|---|---|"
        );
        for (i, s) in r.steps.iter().filter(|s| s.phase == "p99").enumerate() {
            let _ = writeln!(
                o,
                "| {} | {} | {:.0}/s | {} / {} / {} | {} / {} / {} | {}/{} |",
                i / 2 + 1,
                s.target,
                s.offered,
                s.due.p50,
                s.due.p99,
                s.due.max,
                s.e2e.p50,
                s.e2e.p99,
                s.e2e.max,
                s.delivered,
                s.sent
            );
        }
    }
    let _ = writeln!(o, "\n### CPU per retry, ladder vs relay at the same rate\n");
    let _ = writeln!(
        o,
        "A rate sampled several times (windows taken in turn) counts all its CPU over all its retries.\n"
    );
    let _ = writeln!(
        o,
        "| tiers | rate | windows | ladder CPU s / 10k | relay CPU s / 10k | ratio | broker s / 10k with ladder | with relay |\n|---|---|---|---|---|---|---|---|"
    );
    let mut seen: Vec<(&str, f64)> = vec![];
    for l in r.steps.iter().filter(|s| s.phase == "fixed" && s.target == "ladder") {
        if seen
            .iter()
            .any(|&(c, rate)| c == l.cfg && (rate - l.offered).abs() < 0.5)
        {
            continue;
        }
        seen.push((&l.cfg, l.offered));
        let broker = |target: &str| {
            let steps: Vec<&Step> = fixed_all(r, &l.cfg, target, l.offered).collect();
            let delivered: u64 = steps.iter().map(|s| s.delivered).sum();
            let cpu: f64 = steps.iter().map(|s| s.broker_cpu_per_10k * s.delivered as f64).sum();
            if delivered == 0 { 0.0 } else { cpu / delivered as f64 }
        };
        if let (Some((lc, n)), Some((xc, _))) = (
            pooled_cpu(r, &l.cfg, "ladder", l.offered),
            pooled_cpu(r, &l.cfg, "relay", l.offered),
        ) {
            let _ = writeln!(
                o,
                "| {} | {:.0}/s | {n} | {lc:.2} | {xc:.2} | {:.2} | {:.2} | {:.2} |",
                l.cfg,
                l.offered,
                lc / xc,
                broker("ladder"),
                broker("relay")
            );
        }
    }
    let _ = writeln!(
        o,
        "\nIdle (consumers up, no messages), CPU per second: ladder {:.1} ms, minimal relay {:.1} ms. Peak RSS (VmHWM) after the load phases: ladder {} MB, minimal relay {} MB.",
        r.idle_cpu_ms_per_s.0,
        r.idle_cpu_ms_per_s.1,
        mb(r.ladder_peak_rss_kb),
        mb(r.relay_peak_rss_kb)
    );

    if let Some(mix) = &r.mix {
        let _ = writeln!(
            o,
            "\n## Short and long retries mixed: ladder vs the per-message-TTL wait queue\n\n{}/s into each for {} s; one retry in {} waits {} ms, the others {} ms. Ladder: tiers {} ms and {} ms (picked by `retry-delay`). Recipe: one classic queue, `expiration` per message, dead-lettering straight to the destination. Lateness = redelivery − (publish + delay), ms.\n",
            mix.rate, mix.secs, mix.long_every, mix.long_ms, mix.short_ms, mix.short_ms, mix.long_ms
        );
        let _ = writeln!(
            o,
            "| wait mechanism | short p50 / p99 / max | short > 100 ms late | long p50 / p99 / max | delivered |\n|---|---|---|---|---|"
        );
        for s in &mix.streams {
            let _ = writeln!(
                o,
                "| {} | {} / {} / {} | {} of {} | {} / {} / {} | {}/{} |",
                s.name,
                s.short.p50,
                s.short.p99,
                s.short.max,
                s.short_late_100,
                s.short.n,
                s.long.p50,
                s.long.p99,
                s.long.max,
                s.delivered,
                s.sent
            );
        }
    }

    if let Some(p) = &r.in_process {
        let _ = writeln!(
            o,
            "\n## In-process retry (hold the delivery, sleep 1 h)\n\n| messages waiting | consumer RSS MB |\n|---|---|\n| 0 | {} |",
            mb(p.rss_idle_kb)
        );
        for (n, rss) in &p.rss_held {
            let _ = writeln!(o, "| {} (unacked) | {} |", thousands(*n), mb(*rss));
        }
        let _ = writeln!(
            o,
            "| {} (acked, held in memory) | {} |",
            thousands(p.crash_acked_held),
            mb(p.crash_acked_rss_kb)
        );
        let _ = writeln!(
            o,
            "\nCrash (SIGKILL) with {} unacked messages held: {} were back in the queue, ready, {} ms later — a restarted consumer gets them at once, so every delay is lost (and a poison message loops). Crash with {} acked-and-held messages: {} in the queue afterwards — **{} lost**.",
            thousands(p.crash_unacked_held),
            thousands(p.crash_unacked_back),
            p.crash_unacked_back_ms,
            thousands(p.crash_acked_held),
            p.crash_acked_back,
            thousands(p.crash_acked_held.saturating_sub(p.crash_acked_back))
        );
    }

    if let Some(m) = &r.million {
        let _ = writeln!(o, "\n## Retries waiting in a 1 h tier\n");
        match &m.skipped {
            Some(why) => {
                let _ = writeln!(o, "Skipped: {why}");
            }
            None => {
                let _ = writeln!(
                    o,
                    "{} retries published to the intake as fast as confirms allowed; all in the quorum 1 h tier after {:.0} s ({:.0}/s through the intake hop, {:.2} CPU s per 10 000).\n\n| | ladder RSS MB | broker RSS MB |\n|---|---|---|\n| before | {} | {} |\n| {} waiting | {} (peak while moving them: {}) | {} |\n| after deleting the tier | | {} |",
                    thousands(m.count),
                    m.secs,
                    m.count as f64 / m.secs,
                    m.ladder_cpu_per_10k,
                    mb(m.ladder_rss_before_kb),
                    mb(m.broker_rss_kb.0),
                    thousands(m.count),
                    mb(m.ladder_rss_after_kb),
                    mb(m.ladder_rss_peak_kb),
                    mb(m.broker_rss_kb.1),
                    mb(m.broker_rss_kb.2)
                );
            }
        }
    }

    if !plots.is_empty() {
        let _ = writeln!(o, "\n## Plots\n");
        for (file, title) in plots {
            let _ = writeln!(o, "![{title}]({file})\n");
        }
    }

    let _ = writeln!(o, "\n## Every load step\n");
    let _ = writeln!(
        o,
        "| # | phase | process | tiers | offered | achieved | e2e p50 / p99 / max | due p99 | delivered / sent | CPU s / 10k | broker s / 10k | result |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for (i, s) in r.steps.iter().enumerate() {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {:.0} | {:.0} | {} / {} / {} | {} | {}/{}{} | {:.2} | {:.2} | {} |",
            i + 1,
            s.phase,
            s.target,
            s.cfg,
            s.offered,
            s.achieved,
            s.e2e.p50,
            s.e2e.p99,
            s.e2e.max,
            s.due.p99,
            s.delivered,
            s.sent,
            if s.stopped_early { " (stopped early)" } else { "" },
            s.cpu_per_10k,
            s.broker_cpu_per_10k,
            if s.pass { "pass" } else { "miss" }
        );
    }
    o
}

#[cfg(test)]
mod runs_tests {
    use super::*;

    fn window(target: &str, cpu_s: f64, delivered: u64) -> Step {
        Step {
            phase: "fixed".into(),
            target: target.into(),
            cfg: "quorum-amo".into(),
            offered: 4800.0,
            cpu_s,
            delivered,
            ..Step::default()
        }
    }

    fn run(ladder_cpu: f64, relay_cpu: f64) -> Results {
        Results {
            steps: vec![
                window("ladder", ladder_cpu, 10_000),
                window("relay", relay_cpu, 10_000),
                window("relay", relay_cpu, 10_000),
                window("ladder", ladder_cpu, 10_000),
            ],
            ..Results::default()
        }
    }

    #[test]
    fn runs_give_a_ratio_each_then_their_mean_interval_and_pool() {
        let runs = vec![("a".to_string(), run(1.1, 1.0)), ("b".to_string(), run(1.3, 1.0))];
        let text = runs_summary(&runs);
        assert!(
            text.contains("a: quorum-amo 4800/s, 2 windows: ladder 1.100 s, relay 1.000 s per 10 000, ratio 1.100"),
            "{text}"
        );
        assert!(
            text.contains("b: quorum-amo 4800/s, 2 windows: ladder 1.300 s"),
            "{text}"
        );
        // mean 1.2, sd 0.1414, t(1) 12.71: half-width 1.271
        assert!(
            text.contains("quorum-amo 4800/s: 2 runs, mean ratio 1.200, 95 % interval -0.071-2.471; pooled 1.200 s vs 1.000 s per 10 000"),
            "{text}"
        );
    }

    #[test]
    fn one_run_has_a_mean_but_no_interval() {
        let text = runs_summary(&[("a".to_string(), run(1.1, 1.0))]);
        assert!(
            text.contains("quorum-amo 4800/s: 1 run, mean ratio 1.100, no 95 % interval from one run; pooled 1.100 s vs 1.000 s per 10 000"),
            "{text}"
        );
        assert!(!text.contains("NaN"), "{text}");
    }

    #[test]
    fn a_run_with_one_ladder_window_is_left_out() {
        let mut one = run(1.1, 1.0);
        one.steps.truncate(3);
        assert_eq!(runs_summary(&[("a".into(), one)]).trim(), "");
    }

    #[test]
    fn t_quantiles_err_wide_between_rows() {
        assert_eq!(t95(4), 2.78);
        assert_eq!(t95(25), 2.09);
        assert_eq!(t95(100), 2.04);
        assert!(t95(0).is_nan());
    }
}
