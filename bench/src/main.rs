//! `ladder-bench`: how close the ladder runs to the broker's own limit, side by side with the
//! alternatives (BENCHMARKS.md).
//!
//! It runs the real `ladder run` (built next to this binary) as a child process in a namespace
//! of its own, a minimal relay over the same topology (this binary, `relay` subcommand), the
//! per-message-TTL recipe and an in-process retry (`hold` subcommand), loads them from this
//! process, timestamps every redelivery at the destination, reads CPU and memory from `/proc`,
//! and writes `results.md`, `results.json` and two PNG plots. Everything it declares is deleted
//! at the end, also after a failure or Ctrl-C; it never stops or restarts the broker.

#![forbid(unsafe_code)]

mod broker;
mod decide;
mod delays;
mod failer;
mod hold;
mod minimal_relay;
mod native;
mod parking;
mod plot;
mod procs;
mod report;
mod scenarios;
mod stats;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow};
use clap::{Parser, Subcommand};

use crate::broker::Registry;
use crate::report::{Machine, Results};
use crate::scenarios::{Bench, Profile};

/// Default broker: the machine's own.
const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The load must drop below this before a full run starts (a 2-core machine is shared).
const QUIET_LOAD: f64 = 0.5;

#[derive(Parser)]
#[command(
    name = "ladder-bench",
    about = "Benchmark the ladder against a minimal relay and the alternatives"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Sub>,
    /// Seconds of tiny load that prove the benchmark still works (CI); results are not kept.
    #[arg(long, global = true)]
    smoke: bool,
    /// Shorter steps and 100 000 instead of 1 000 000 waiting (~15 minutes), for development.
    #[arg(long, global = true)]
    quick: bool,
    /// Where results.md, results.json and the plots go (default: `benchmarks/`; smoke: a
    /// temporary directory, removed afterwards).
    #[arg(long, global = true)]
    out: Option<PathBuf>,
    /// The broker.
    #[arg(long, global = true, default_value = DEFAULT_URL)]
    url: String,
    /// The ladder binary (default: `ladder` next to this binary).
    #[arg(long, global = true)]
    ladder_bin: Option<PathBuf>,
    /// Before measuring, wait up to this many seconds for the 1-minute load to drop below 0.5
    /// (default: 1200 for a full run, 0 otherwise).
    #[arg(long, global = true)]
    wait_quiet: Option<u64>,
    /// Skip the million-waiting-retries measurement.
    #[arg(long, global = true)]
    skip_million: bool,
    /// Run only these parts (comma-separated: capacity, fixed, p99, mix, inproc, million).
    #[arg(long, global = true, value_delimiter = ',')]
    only: Vec<String>,
    /// Extra environment for the ladder and relay child processes (`KEY=VALUE`, repeatable),
    /// e.g. `TOKIO_WORKER_THREADS=1` to try a single-threaded runtime in both.
    #[arg(long, global = true)]
    child_env: Vec<String>,
    /// Run the ladder and the relays under this command, alike (a profiler; split at spaces),
    /// e.g. `--wrap "valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p"`. Their CPU
    /// figures then mean nothing.
    #[arg(long, global = true)]
    wrap: Option<String>,
    /// Fixed rates to measure instead of 200 and 1000 per second (comma-separated; a rate may
    /// repeat, to sample it again). 80% of the lower of the ladder's and the relay's capacities is
    /// still added when capacity was measured.
    #[arg(long, global = true, value_delimiter = ',')]
    rates: Vec<f64>,
    /// Only these tier configurations (comma-separated: quorum-alo, quorum-amo, classic).
    #[arg(long, global = true, value_delimiter = ',')]
    cfgs: Vec<String>,
}

#[derive(Subcommand)]
enum Sub {
    /// Everything (the default).
    All,
    /// Internal: the minimal relay, run as a child process.
    #[command(hide = true)]
    Relay(minimal_relay::RelayArgs),
    /// Internal: the in-process retry, run as a child process.
    #[command(hide = true)]
    Hold(hold::HoldArgs),
    /// The ladder's own per-message decision work, timed without a broker.
    Decide(decide::DecideArgs),
    /// Deletes what an interrupted run left on the broker: every queue and exchange named
    /// `bench-<pid>-<n>…` (listed with `rabbitmqctl`, deleted over AMQP).
    Cleanup {
        /// Only names of this run (`bench-<pid>-`); default: every benchmark run's.
        #[arg(long)]
        pid: Option<u32>,
        /// The command that lists the broker's queues and exchanges, with `rabbitmqctl`'s
        /// arguments appended (for a node of `scripts/broker`: `--ctl "scripts/broker ctl 4.3 1"`).
        #[arg(long, default_value = "rabbitmqctl")]
        ctl: String,
    },
    /// The parking lot at a million entries: the CLI and the service's index and API against a
    /// bare read of the same stream (`benchmarks/parking.md`; `--smoke`: 2 000 entries, nothing
    /// written).
    Parking {
        /// Entries to park (default 1 000 000, or 2 000 with --smoke).
        #[arg(long)]
        entries: Option<u64>,
        /// Repetitions of each timed CLI command and bare read; medians are reported (default 3,
        /// or 1 with --smoke).
        #[arg(long)]
        runs: Option<usize>,
    },
    /// Exact delays and scheduled deliveries: precision under load, throughput of one level,
    /// a composed delay and a 1 s retry, memory with messages waiting, and RabbitMQ 4.3's native
    /// delayed retry (`benchmarks/delays.md`, `--quick`: ~8 minutes).
    Delays {
        /// A RabbitMQ ≥ 4.3 node for the native delayed retry comparison (default: `--url`, if
        /// that broker is ≥ 4.3; else that part is skipped).
        #[arg(long)]
        native_url: Option<String>,
    },
    /// RabbitMQ 4.3's native delayed retry beside Ladder (dead-letter mode) on one ≥ 4.3 node
    /// (`--url`), same publisher and consumer, in turns: CPU per retry (broker + Ladder), broker
    /// CPU, lateness, lost and duplicates, and the ratios (`benchmarks/native.md`; `--rates`,
    /// default 300,1000 retries/s).
    Native(native::NativeArgs),
    /// A destination fails every message for `--outage`, then recovers: native 4.3, Ladder and
    /// Ladder with `auto_hold` on one ≥ 4.3 node (`--url`): broker CPU, deliveries wasted on the
    /// failing consumer, lost, time to drain (`benchmarks/native.md`).
    Outage(native::OutageArgs),
    /// Puts several runs' results.json together: CPU per retry of ladder and relay per run and
    /// rate, the mean ratio over the runs with a 95 % interval, and all runs pooled.
    Runs {
        /// results.json files, one per run.
        #[arg(required = true)]
        json: Vec<PathBuf>,
    },
    /// Writes results.md and the plots again from a results.json (after a change of format).
    Render {
        /// The results.json of a run; the report goes next to it.
        json: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the tokio runtime starts");
    let child = |result: Result<()>| match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ladder-bench: {e:#}");
            ExitCode::FAILURE
        }
    };
    match cli.command {
        Some(Sub::Relay(args)) => {
            procs::exit_with_parent();
            child(runtime.block_on(minimal_relay::run(args)))
        }
        Some(Sub::Hold(args)) => {
            procs::exit_with_parent();
            child(runtime.block_on(hold::run(args)))
        }
        Some(Sub::Decide(args)) => child(decide::run(args)),
        Some(Sub::Render { json }) => child(render(&json)),
        Some(Sub::Runs { json }) => child(runs(&json)),
        Some(Sub::Cleanup { pid, ctl }) => child(runtime.block_on(cleanup(&cli.url, pid, &ctl))),
        Some(Sub::Parking { entries, runs }) => match runtime.block_on(parking_bench(&cli, entries, runs)) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("ladder-bench: {e:#}");
                ExitCode::FAILURE
            }
        },
        Some(Sub::Delays { ref native_url }) => match runtime.block_on(delays_bench(&cli, native_url.as_deref())) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("ladder-bench: {e:#}");
                ExitCode::FAILURE
            }
        },
        Some(Sub::Native(ref args)) => match runtime.block_on(native_bench(&cli, args)) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("ladder-bench: {e:#}");
                ExitCode::FAILURE
            }
        },
        Some(Sub::Outage(ref args)) => match runtime.block_on(outage_bench(&cli, args)) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("ladder-bench: {e:#}");
                ExitCode::FAILURE
            }
        },
        Some(Sub::All) | None => match runtime.block_on(bench(cli)) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("ladder-bench: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}

/// Rates are kept round: multiples of 50 per second.
pub fn round50(r: f64) -> f64 {
    ((r / 50.0).round() * 50.0).max(50.0)
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn utc_now() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M:%S"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The `ladder` binary to measure: `--ladder-bin`, or the one built next to this one.
fn ladder_bin(cli: &Cli) -> Result<PathBuf> {
    let ladder_bin = match &cli.ladder_bin {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .ok_or_else(|| anyhow!("no directory for the ladder binary"))?
            .join("ladder"),
    };
    if !ladder_bin.is_file() {
        return Err(anyhow!(
            "{} not found: build it first (cargo build --release --bins)",
            ladder_bin.display()
        ));
    }
    Ok(ladder_bin)
}

/// `ladder-bench delays`; `Ok(false)` when something it declared could not be deleted.
async fn delays_bench(cli: &Cli, native_url: Option<&str>) -> Result<bool> {
    let ladder_bin = ladder_bin(cli)?;
    let plan = if cli.quick {
        delays::Plan::quick()
    } else {
        delays::Plan::full()
    };
    let work = std::env::temp_dir().join(format!("ladder-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let results = delays::DelayResults {
        profile: plan.name.to_string(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        started: utc_now(),
        machine: Machine::detect(),
        load_start: procs::loadavg(),
        ..Default::default()
    };
    eprintln!(
        "ladder-bench delays ({} run): load average {}; logs in {}",
        plan.name,
        results.load_start,
        work.display()
    );
    let shared = Arc::new(Mutex::new(results));
    let (registry, native_registry) = (Registry::default(), Registry::default());
    let outcome = tokio::select! {
        r = delays::measure(&cli.url, native_url, plan, &work, &ladder_bin, (&registry, &native_registry), shared.clone()) => r,
        signal = interrupted() => Err(anyhow!("{signal}: stopped")),
    };
    eprintln!("cleaning up: deleting every queue and exchange the benchmark declared");
    let mut clean = true;
    for (registry, url) in [
        (&registry, cli.url.as_str()),
        (&native_registry, native_url.unwrap_or(&cli.url)),
    ] {
        let names = registry.snapshot();
        let failures = registry.delete_all(url).await;
        for f in &failures {
            eprintln!("ladder-bench: cleanup: {f}");
        }
        let leftovers = still_there(url, &names).await;
        if !leftovers.is_empty() {
            eprintln!(
                "ladder-bench: still on the broker after cleanup: {}",
                leftovers.join(", ")
            );
        }
        clean &= failures.is_empty() && leftovers.is_empty();
    }
    eprintln!(
        "cleanup: {}",
        if clean {
            "nothing left on the broker"
        } else {
            "SOME REMAIN"
        }
    );
    let mut results = shared.lock().unwrap().clone();
    outcome.with_context(|| format!("logs of the services are in {}", work.display()))?;
    results.finished = utc_now();
    results.load_end = procs::loadavg();
    let out = cli.out.clone().unwrap_or_else(|| PathBuf::from("benchmarks"));
    let md = delays::write(&results, &out)?;
    println!("{}", delays::markdown(&results));
    let _ = std::fs::remove_dir_all(&work);
    eprintln!("wrote {}", md.display());
    Ok(clean)
}

/// Deletes everything `registry` remembers from the broker at `url` and checks that nothing is
/// left; returns whether that held.
async fn clean_up(registry: &Registry, url: &str) -> bool {
    eprintln!("cleaning up: deleting every queue and exchange the benchmark declared");
    let names = registry.snapshot();
    let failures = registry.delete_all(url).await;
    for f in &failures {
        eprintln!("ladder-bench: cleanup: {f}");
    }
    let leftovers = still_there(url, &names).await;
    if !leftovers.is_empty() {
        eprintln!(
            "ladder-bench: still on the broker after cleanup: {}",
            leftovers.join(", ")
        );
    }
    let clean = failures.is_empty() && leftovers.is_empty();
    eprintln!(
        "cleanup: {} queues and exchanges deleted; {}",
        names.len(),
        if clean {
            "nothing left on the broker"
        } else {
            "SOME REMAIN"
        }
    );
    clean
}

/// `ladder-bench native`; `Ok(false)` when a message was lost (`--smoke`) or something it
/// declared could not be deleted.
async fn native_bench(cli: &Cli, args: &native::NativeArgs) -> Result<bool> {
    let ladder_bin = ladder_bin(cli)?;
    let plan = native::NativePlan::new(args, &cli.rates, cli.smoke);
    let work = std::env::temp_dir().join(format!("ladder-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut results = native::NativeResults {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        started: utc_now(),
        machine: Machine::detect(),
        load_start: procs::loadavg(),
        failures: plan.failures,
        secs: plan.secs,
        rounds: plan.rounds,
        ..Default::default()
    };
    let registry = Registry::default();
    let outcome = tokio::select! {
        r = native::measure_native(&cli.url, &plan, &work, &ladder_bin, &registry, &mut results) => r,
        signal = interrupted() => Err(anyhow!("{signal}: stopped")),
    };
    let clean = clean_up(&registry, &cli.url).await;
    outcome.with_context(|| format!("logs of the service are in {}", work.display()))?;
    results.finished = utc_now();
    results.load_end = procs::loadavg();
    let md = native::native_markdown(&results);
    println!("{md}");
    if let Some(out) = &cli.out {
        let path = native::write(out, "native", &results, &md)?;
        eprintln!("wrote {}", path.display());
    }
    let _ = std::fs::remove_dir_all(&work);
    let problems = native::native_problems(&results);
    for p in &problems {
        eprintln!("ladder-bench native: {p}");
    }
    Ok(clean && problems.is_empty())
}

/// `ladder-bench outage`; `Ok(false)` when a message was lost or something it declared could not
/// be deleted.
async fn outage_bench(cli: &Cli, args: &native::OutageArgs) -> Result<bool> {
    let ladder_bin = ladder_bin(cli)?;
    let plan = native::OutagePlan::new(args, cli.smoke)?;
    let work = std::env::temp_dir().join(format!("ladder-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let mut results = native::OutageResults {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        started: utc_now(),
        machine: Machine::detect(),
        load_start: procs::loadavg(),
        ..Default::default()
    };
    let registry = Registry::default();
    let outcome = tokio::select! {
        r = native::measure_outage(&cli.url, &plan, &work, &ladder_bin, &registry, &mut results) => r,
        signal = interrupted() => Err(anyhow!("{signal}: stopped")),
    };
    let clean = clean_up(&registry, &cli.url).await;
    outcome.with_context(|| format!("logs of the service are in {}", work.display()))?;
    results.finished = utc_now();
    results.load_end = procs::loadavg();
    let md = native::outage_markdown(&results);
    println!("{md}");
    if let Some(out) = &cli.out {
        let path = native::write(out, "outage", &results, &md)?;
        eprintln!("wrote {}", path.display());
    }
    let _ = std::fs::remove_dir_all(&work);
    let problems = native::outage_problems(&results);
    for p in &problems {
        eprintln!("ladder-bench outage: {p}");
    }
    Ok(clean && problems.is_empty())
}

/// `ladder-bench parking`; `Ok(false)` when something it declared could not be deleted.
async fn parking_bench(cli: &Cli, entries: Option<u64>, runs: Option<usize>) -> Result<bool> {
    let ladder_bin = ladder_bin(cli)?;
    let entries = entries.unwrap_or(if cli.smoke { 2000 } else { 1_000_000 }).max(10);
    let runs = runs.unwrap_or(if cli.smoke { 1 } else { 3 }).max(1);
    let work = std::env::temp_dir().join(format!("ladder-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let started = utc_now();
    let load = procs::loadavg();
    eprintln!(
        "ladder-bench parking: {entries} entries, load average {load}; logs in {}",
        work.display()
    );
    let registry = Registry::default();
    let outcome = tokio::select! {
        r = parking::measure(&cli.url, &ladder_bin, &work, &registry, entries, runs) => r,
        signal = interrupted() => Err(anyhow!("{signal}: stopped")),
    };
    eprintln!("cleaning up: deleting every queue and exchange the benchmark declared");
    let names = registry.snapshot();
    let failures = registry.delete_all(&cli.url).await;
    for f in &failures {
        eprintln!("ladder-bench: cleanup: {f}");
    }
    let leftovers = still_there(&cli.url, &names).await;
    if !leftovers.is_empty() {
        eprintln!(
            "ladder-bench: still on the broker after cleanup: {}",
            leftovers.join(", ")
        );
    }
    let clean = failures.is_empty() && leftovers.is_empty();
    let results = outcome.with_context(|| format!("logs of the services are in {}", work.display()))?;
    let _ = std::fs::remove_dir_all(&work);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let report = parking::markdown(&results, &command, &started, &load);
    if cli.smoke {
        eprintln!("smoke (numbers mean nothing; every count was checked):\n{report}");
    } else {
        let out = cli.out.clone().unwrap_or_else(|| PathBuf::from("benchmarks"));
        std::fs::create_dir_all(&out)?;
        std::fs::write(out.join("parking.json"), serde_json::to_string_pretty(&results)?)?;
        std::fs::write(out.join("parking.md"), &report)?;
        eprintln!("{report}\nwrote {}", out.join("parking.md").display());
    }
    Ok(clean)
}

/// Runs the benchmark; `Ok(false)` when a smoke run found something wrong.
async fn bench(cli: Cli) -> Result<bool> {
    let mut profile = if cli.smoke {
        Profile::smoke()
    } else if cli.quick {
        Profile::quick()
    } else {
        Profile::full()
    };
    if cli.skip_million {
        profile.million = 0;
    }
    if !cli.cfgs.is_empty() {
        profile.cfgs.retain(|c| cli.cfgs.iter().any(|k| k == c.key));
    }
    let known = ["capacity", "fixed", "p99", "mix", "inproc", "million"];
    if let Some(bad) = cli.only.iter().find(|p| !known.contains(&p.as_str())) {
        return Err(anyhow!("--only {bad}: not one of {}", known.join(", ")));
    }
    profile.only = cli.only.clone();
    if !cli.rates.is_empty() {
        profile.fixed_rates = cli.rates.clone();
    }
    if let Some(wrap) = &cli.wrap {
        profile.wrap = wrap.split_whitespace().map(str::to_string).collect();
    }
    for kv in &cli.child_env {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| anyhow!("--child-env {kv}: expected KEY=VALUE"))?;
        profile.child_env.push((k.to_string(), v.to_string()));
    }
    let smoke = cli.smoke;
    let ladder_bin = ladder_bin(&cli)?;
    let work = std::env::temp_dir().join(format!("ladder-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let out_dir = match (&cli.out, smoke) {
        (Some(dir), _) => dir.clone(),
        (None, true) => work.join("out"),
        (None, false) => PathBuf::from("benchmarks"),
    };

    let mut results = Results {
        profile: profile.name.to_string(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        started: utc_now(),
        machine: Machine::detect(),
        ..Default::default()
    };
    let wait_quiet = cli.wait_quiet.unwrap_or(if profile.name == "full" { 1200 } else { 0 });
    results.quiet = wait_for_quiet(wait_quiet).await;
    results.load_start = procs::loadavg();
    eprintln!(
        "ladder-bench ({} run): load average {}; {}; logs in {}",
        profile.name,
        results.load_start,
        results.quiet,
        work.display()
    );

    let registry = Registry::default();
    let shared = Arc::new(Mutex::new(results));
    let url = cli.url.clone();
    let task = {
        let (shared, registry, work, url, ladder_bin) = (
            shared.clone(),
            registry.clone(),
            work.clone(),
            url.clone(),
            ladder_bin.clone(),
        );
        tokio::spawn(async move { measure(&url, profile, &work, &ladder_bin, registry, shared).await })
    };
    let mut task = task;
    let outcome = tokio::select! {
        joined = &mut task => match joined {
            Ok(r) => r,
            Err(e) if e.is_panic() => Err(anyhow!("the benchmark panicked: {e}")),
            Err(e) => Err(anyhow!("{e}")),
        },
        signal = interrupted() => {
            task.abort();
            // Wait until the aborted task has dropped its child processes (stopped on drop, the
            // ladder after its drain), so none of them declares anything again during cleanup.
            let _ = tokio::time::timeout(Duration::from_secs(60), task).await;
            Err(anyhow!("{signal}: stopped"))
        }
    };

    eprintln!("cleaning up: deleting every queue and exchange the benchmark declared");
    let names = registry.snapshot();
    let failures = registry.delete_all(&url).await;
    for f in &failures {
        eprintln!("ladder-bench: cleanup: {f}");
    }
    let leftovers = still_there(&url, &names).await;
    if !leftovers.is_empty() {
        eprintln!(
            "ladder-bench: still on the broker after cleanup: {}",
            leftovers.join(", ")
        );
    }
    let clean = failures.is_empty() && leftovers.is_empty();
    eprintln!(
        "cleanup: {} queues and exchanges deleted{}",
        names.len(),
        if clean {
            "; nothing left on the broker"
        } else {
            "; SOME REMAIN"
        }
    );

    let mut results = shared.lock().unwrap().clone();
    outcome.with_context(|| format!("logs of the child processes are in {}", work.display()))?;
    results.finished = utc_now();
    results.load_end = procs::loadavg();

    std::fs::create_dir_all(&out_dir)?;
    std::fs::write(out_dir.join("results.json"), serde_json::to_string_pretty(&results)?)?;
    write_report(&results, &out_dir)?;

    eprintln!(
        "\nTargets{}:",
        if smoke {
            " (a smoke run's numbers mean nothing; it checks that everything runs)"
        } else {
            ""
        }
    );
    for v in report::verdicts(&results) {
        eprintln!("  {:<90} {:<45} goal {:<9} {}", v.what, v.measured, v.goal, v.result);
    }

    if smoke {
        let problems = smoke_problems(&results);
        for p in &problems {
            eprintln!("ladder-bench --smoke: {p}");
        }
        let ok = problems.is_empty() && clean;
        let _ = std::fs::remove_dir_all(&work);
        eprintln!("smoke: {}", if ok { "ok" } else { "FAILED" });
        return Ok(ok);
    }
    let _ = std::fs::remove_dir_all(&work);
    eprintln!("\nwrote {}", out_dir.join("results.md").display());
    Ok(clean)
}

/// Writes results.md and the plots into `out_dir`.
fn write_report(results: &Results, out_dir: &Path) -> Result<()> {
    let mut plots = vec![];
    match plot::init_font() {
        Ok(()) => {
            if let Some(mix) = results.mix.as_ref() {
                let path = out_dir.join("lateness.png");
                if mix.streams.iter().any(|s| !s.short_values.is_empty()) {
                    plot::lateness(mix, &path)?;
                }
                if path.is_file() {
                    plots.push(("lateness.png", "lateness of short retries: ladder vs per-message TTL"));
                }
            }
            if !results.capacity.is_empty() {
                plot::capacity(&results.capacity, &results.steps, &out_dir.join("capacity.png"))?;
                plots.push(("capacity.png", "capacity: ladder vs minimal relay"));
            }
        }
        Err(e) => eprintln!("ladder-bench: no plots: {e}"),
    }
    std::fs::write(out_dir.join("results.md"), report::markdown(results, &plots))?;
    Ok(())
}

/// `ladder-bench cleanup`: names come from `rabbitmqctl` or `ctl` (AMQP cannot list them).
async fn cleanup(url: &str, pid: Option<u32>, ctl: &str) -> Result<()> {
    let mut ctl = ctl.split_whitespace();
    let program = ctl.next().ok_or_else(|| anyhow!("--ctl is empty"))?;
    let ctl_args: Vec<&str> = ctl.collect();
    let pattern = match pid {
        Some(pid) => format!("^bench-{pid}-[0-9]+[.-]"),
        None => "^bench-[0-9]+-[0-9]+[.-]".to_string(),
    };
    let ours = regex::Regex::new(&pattern)?;
    let registry = Registry::default();
    let mut found = 0;
    for (what, args) in [
        ("queue", ["-q", "list_queues", "name"]),
        ("exchange", ["-q", "list_exchanges", "name"]),
    ] {
        let out = std::process::Command::new("timeout")
            .arg("60")
            .arg(program)
            .args(&ctl_args)
            .args(args)
            .output()
            .with_context(|| format!("run {program}"))?;
        if !out.status.success() {
            return Err(anyhow!(
                "{program} {}: {}",
                args[1],
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        for name in String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::trim)
            .filter(|n| ours.is_match(n))
        {
            found += 1;
            match what {
                "queue" => registry.queue(name),
                _ => registry.exchange(name),
            }
        }
    }
    let failures = registry.delete_all(url).await;
    for f in &failures {
        eprintln!("ladder-bench cleanup: {f}");
    }
    eprintln!(
        "deleted {} of {found} queues and exchanges matching {pattern}",
        found - failures.len()
    );
    if failures.is_empty() {
        Ok(())
    } else {
        Err(anyhow!("{} could not be deleted", failures.len()))
    }
}

/// `ladder-bench render results.json`.
fn render(json: &Path) -> Result<()> {
    let results: Results = serde_json::from_slice(&std::fs::read(json)?).with_context(|| json.display().to_string())?;
    let dir = json.parent().unwrap_or_else(|| Path::new("."));
    write_report(&results, dir)?;
    eprintln!("wrote {}", dir.join("results.md").display());
    Ok(())
}

fn runs(files: &[PathBuf]) -> Result<()> {
    let runs = files
        .iter()
        .map(|f| {
            let bytes = std::fs::read(f).with_context(|| f.display().to_string())?;
            let results: Results = serde_json::from_slice(&bytes).with_context(|| f.display().to_string())?;
            Ok((f.display().to_string(), results))
        })
        .collect::<Result<Vec<_>>>()?;
    print!("{}", report::runs_summary(&runs));
    Ok(())
}

/// The measurements, in order. Results are stored as they come.
async fn measure(
    url: &str,
    profile: Profile,
    work: &Path,
    ladder_bin: &Path,
    registry: Registry,
    shared: Arc<Mutex<Results>>,
) -> Result<()> {
    let mut bench = Bench::start(url, profile.clone(), work, ladder_bin, registry).await?;
    {
        let mut r = shared.lock().unwrap();
        r.admin_server = bench.admin;
        r.machine.rabbitmq = bench.broker_version();
        r.machine.broker = url
            .parse::<ladder_amqp::AmqpUri>()
            .map(|u| format!("{}:{}", u.host, u.port))
            .unwrap_or_default();
    }
    let window = if profile.name == "smoke" { 1 } else { 10 };
    let idle = bench.idle_cpu(Duration::from_secs(window)).await?;
    eprintln!("idle CPU: ladder {:.1} ms/s, minimal relay {:.1} ms/s", idle.0, idle.1);
    shared.lock().unwrap().idle_cpu_ms_per_s = idle;
    if bench.broker_pid().is_none() {
        eprintln!("ladder-bench: no beam.smp process found; broker CPU and memory are not measured");
    }
    for cfg in profile.cfgs.clone().into_iter().filter(|_| profile.runs("capacity")) {
        let cap = bench.capacity(cfg).await?;
        eprintln!(
            "  capacity {}: ladder {:.0}/s, relay {:.0}/s",
            cap.cfg, cap.ladder, cap.relay
        );
        shared.lock().unwrap().capacity.push(cap);
    }
    for cfg in profile.cfgs.clone().into_iter().filter(|_| profile.runs("fixed")) {
        let mut rates = profile.fixed_rates.clone();
        let cpu_rate = shared
            .lock()
            .unwrap()
            .capacity
            .iter()
            .find(|c| c.cfg == cfg.key)
            .and_then(|c| c.cpu_rate());
        if let Some(r) = cpu_rate {
            let already = profile.fixed_rates.iter().filter(|&&x| x == r).count() as u32;
            for _ in already..profile.cpu_windows.max(1) {
                rates.push(r);
            }
        }
        bench.fixed(cfg, &rates).await?;
    }
    if profile.runs("p99") {
        bench.p99_target(if profile.name == "smoke" { 1 } else { 3 }).await?;
    }
    {
        let ladder_hwm = bench.ladder_stat()?.hwm_kb;
        let relay_hwm = bench.relay_hwm();
        let mut r = shared.lock().unwrap();
        r.steps = bench.steps.clone();
        r.ladder_peak_rss_kb = ladder_hwm;
        r.relay_peak_rss_kb = relay_hwm;
    }
    if profile.runs("mix") {
        let mix = bench.mix().await?;
        shared.lock().unwrap().mix = Some(mix);
    }
    if profile.runs("inproc") {
        let inproc = bench.in_process().await?;
        shared.lock().unwrap().in_process = Some(inproc);
    }
    if profile.million > 0 && profile.runs("million") {
        let million = bench.million().await?;
        shared.lock().unwrap().million = Some(million);
    }
    bench.stop_processes();
    Ok(())
}

/// Waits up to `limit_secs` for the 1-minute load average to drop below [`QUIET_LOAD`].
async fn wait_for_quiet(limit_secs: u64) -> String {
    if limit_secs == 0 {
        return "no wait for a quiet machine".into();
    }
    let started = Instant::now();
    let limit = Duration::from_secs(limit_secs);
    eprintln!(
        "waiting up to {limit_secs} s for the 1-minute load average to drop below {QUIET_LOAD} (now {})",
        procs::loadavg()
    );
    loop {
        let load = procs::load1();
        if load < QUIET_LOAD {
            return format!(
                "waited {:.0} s for the 1-minute load to drop below {QUIET_LOAD}",
                started.elapsed().as_secs_f64()
            );
        }
        if started.elapsed() >= limit {
            return format!("the 1-minute load stayed at or above {QUIET_LOAD} for {limit_secs} s; ran anyway");
        }
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
}

/// Resolves on the first SIGINT or SIGTERM.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// Names that a passive declare still finds.
async fn still_there(url: &str, names: &[String]) -> Vec<String> {
    let Ok(conn) = broker::connect(url, "ladder-bench-verify").await else {
        return vec!["(cannot connect to verify the cleanup)".into()];
    };
    let mut left = vec![];
    for name in names {
        if broker::depth(&conn, name).await.is_ok() || broker::exchange_exists(&conn, name).await {
            left.push(name.clone());
        }
    }
    let _ = tokio::time::timeout(broker::OP_TIMEOUT, conn.close(200, "bye")).await;
    left
}

/// What must hold after a smoke run: everything redelivered, the crash behaviour as expected.
fn smoke_problems(r: &Results) -> Vec<String> {
    let mut p = vec![];
    if r.steps.is_empty() {
        p.push("no load step ran".into());
    }
    for s in &r.steps {
        if s.lost > 0 || s.delivered < s.sent || s.sent == 0 {
            p.push(format!(
                "{} {} {} at {}/s: {} of {} redelivered",
                s.phase, s.target, s.cfg, s.offered, s.delivered, s.sent
            ));
        }
    }
    match &r.mix {
        Some(m) => {
            for s in &m.streams {
                if s.delivered < s.sent || s.sent == 0 {
                    p.push(format!("mix {}: {} of {} redelivered", s.name, s.delivered, s.sent));
                }
            }
        }
        None => p.push("the mix did not run".into()),
    }
    match &r.in_process {
        Some(i) => {
            if i.crash_unacked_back != i.crash_unacked_held {
                p.push(format!(
                    "in-process crash: {} of {} unacked back",
                    i.crash_unacked_back, i.crash_unacked_held
                ));
            }
            if i.crash_acked_back != 0 {
                p.push(format!(
                    "in-process crash: {} acked messages came back",
                    i.crash_acked_back
                ));
            }
        }
        None => p.push("the in-process retry did not run".into()),
    }
    match &r.million {
        Some(m) if m.skipped.is_none() && m.ladder_rss_after_kb > 0 => {}
        Some(m) if m.skipped.is_some() => {}
        _ => p.push("the waiting-retries measurement did not run".into()),
    }
    p
}
