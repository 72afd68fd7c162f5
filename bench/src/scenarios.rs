//! The measurements: capacity searches, fixed-rate lateness, the short/long mix against the
//! per-message-TTL recipe, the in-process retry, and a million retries waiting in a long tier.
//!
//! One `Bench` owns the broker connections, the child processes (the real `ladder run`, one
//! minimal relay per configuration) and the registry of names to delete at the end.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use ladder_amqp::{BasicProperties, Channel, Connection, FieldTable, FieldValue};

use crate::broker::{
    self, Collector, Msg, Registry, body, confirm_channel, connect, declare_queue, depth, purge, text, wait_empty,
};
use crate::procs::{self, Child, ProcStat};
use crate::stats::{Capacity, InProcess, Million, Mix, MixStream, Step, pcts};
use ladder::broker::topology::{self, Names};

/// A tier configuration under test.
#[derive(Debug, Clone, Copy)]
pub struct Cfg {
    /// Shown in reports.
    pub key: &'static str,
    /// The ladder's name (file stem).
    pub ladder: &'static str,
    /// `quorum` or `classic`.
    pub queue_type: &'static str,
    /// Dead-letter strategy.
    pub strategy: &'static str,
}

/// Quorum tiers dead-lettering at-least-once (the default), at-most-once, and classic tiers.
pub const CFGS: [Cfg; 3] = [
    Cfg {
        key: "quorum-alo",
        ladder: "qalo",
        queue_type: "quorum",
        strategy: "at-least-once",
    },
    Cfg {
        key: "quorum-amo",
        ladder: "qamo",
        queue_type: "quorum",
        strategy: "at-most-once",
    },
    Cfg {
        key: "classic",
        ladder: "classic",
        queue_type: "classic",
        strategy: "at-most-once",
    },
];

/// The tier every load step uses.
pub const TIER: &str = "1s";
/// Its TTL.
pub const TIER_MS: u64 = 1000;

/// The broker is quiet between steps when it uses less than this share of a core (an idle
/// RabbitMQ 3.10 here: under 0.01; after a missed capacity step at 12 000–16 000/s it took
/// 3–4 s to get below this).
pub const QUIET_BROKER: f64 = 0.1;

/// Over this long.
pub const QUIET_SAMPLE: Duration = Duration::from_secs(1);

/// How long and how hard each part runs.
#[derive(Debug, Clone)]
pub struct Profile {
    /// `full`, `quick` or `smoke`.
    pub name: &'static str,
    /// Which configurations.
    pub cfgs: Vec<Cfg>,
    /// Publishing time of a capacity step.
    pub cap_secs: f64,
    /// Publishing time of a fixed-rate step.
    pub fixed_secs: f64,
    /// After the last publish, how long past the tier's TTL redeliveries may take.
    pub drain: Duration,
    /// Between steps, how long to wait for the queues to empty before purging them.
    pub idle_wait: Duration,
    /// Then, how long to wait at most for the broker to go quiet ([`QUIET_BROKER`]).
    pub quiet_wait: Duration,
    /// First rate of the capacity ramp.
    pub start_rate: f64,
    /// Ramp factor.
    pub factor: f64,
    /// The ramp stops here.
    pub max_rate: f64,
    /// Bisection steps after the ramp.
    pub bisect: u32,
    /// A capacity rate fails only after this many failed steps (one pass is enough).
    pub tries: u32,
    /// Stop a capacity step once more than 1 % of it was over 100 ms late (its p99 can no
    /// longer pass), which saves the search time but leaves the rest uncounted. The smoke run
    /// does not stop: there the point is that every retry is counted back.
    pub stop_late: bool,
    /// Fixed rates for lateness (80% of the lower capacity is added).
    pub fixed_rates: Vec<f64>,
    /// Windows at 80% of the lower capacity, ladder and relay in turn: the CPU-per-retry target is judged
    /// on all of them together, so one burst of other work on a shared machine does not decide it.
    pub cpu_windows: u32,
    /// Mix: rate per stream, publishing time, short and long delay, one long in `long_every`.
    pub mix: (f64, f64, u64, u64, u64),
    /// In-process retry: messages held for the first and the second RSS reading.
    pub inproc: (u64, u64),
    /// Retries to leave waiting in the long tier (0: skip).
    pub million: u64,
    /// Pause before reading memory, so a process or the broker settles.
    pub settle: Duration,
    /// Only these parts (empty: all).
    pub only: Vec<String>,
    /// Extra environment of the ladder and relay processes.
    pub child_env: Vec<(String, String)>,
    /// A command the ladder and the relays run under, alike (a profiler).
    pub wrap: Vec<String>,
}

impl Profile {
    /// Whether part `name` runs.
    pub fn runs(&self, name: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|p| p == name)
    }

    /// The documented full run (~20 minutes after the quiet-machine wait).
    pub fn full() -> Self {
        Profile {
            name: "full",
            cfgs: CFGS.to_vec(),
            cap_secs: 10.0,
            fixed_secs: 10.0,
            drain: Duration::from_secs(10),
            idle_wait: Duration::from_secs(5),
            quiet_wait: Duration::from_secs(60),
            start_rate: 1000.0,
            factor: 1.5,
            max_rate: 40_000.0,
            bisect: 2,
            tries: 3,
            fixed_rates: vec![200.0, 1000.0],
            // a minute of CPU per process at 80 % of capacity: one 5 s window's CPU per retry
            // varied by ~8 % (the relay's more than the ladder's: how the broker batches
            // deliveries), and six of them pooled moved the ratio by ~0.04 between runs
            cpu_windows: 6,
            mix: (200.0, 20.0, 1000, 10_000, 10),
            inproc: (10_000, 100_000),
            million: 1_000_000,
            settle: Duration::from_secs(3),
            stop_late: true,
            only: vec![],
            child_env: vec![],
            wrap: vec![],
        }
    }

    /// Shorter steps, coarser search, 100 000 waiting (~15 minutes), for development.
    pub fn quick() -> Self {
        Profile {
            name: "quick",
            cap_secs: 5.0,
            fixed_secs: 5.0,
            factor: 2.0,
            bisect: 1,
            // half as long as the full run's, twice as many: the same minute of CPU per process
            // at 80 % of capacity (six 5 s windows moved the ratio by ~±0.04 between runs)
            cpu_windows: 12,
            mix: (100.0, 8.0, 1000, 5000, 10),
            inproc: (10_000, 30_000),
            million: 100_000,
            ..Self::full()
        }
    }

    /// Seconds, tiny rates, one configuration: proves the benchmark still works.
    pub fn smoke() -> Self {
        Profile {
            name: "smoke",
            cfgs: vec![CFGS[0]],
            cap_secs: 1.0,
            fixed_secs: 1.0,
            drain: Duration::from_secs(15),
            idle_wait: Duration::from_secs(3),
            quiet_wait: Duration::from_secs(5),
            start_rate: 50.0,
            factor: 2.0,
            max_rate: 50.0,
            bisect: 0,
            tries: 1,
            fixed_rates: vec![20.0],
            cpu_windows: 1,
            mix: (20.0, 1.0, 1000, 2000, 5),
            inproc: (300, 1000),
            million: 2000,
            settle: Duration::from_millis(300),
            stop_late: false,
            only: vec![],
            child_env: vec![],
            wrap: vec![],
        }
    }
}

/// Waits until the broker `pid` used less than [`QUIET_BROKER`] of a core over a
/// [`QUIET_SAMPLE`], at most `within`; returns the seconds waited (0 without a pid).
pub async fn broker_quiet(pid: Option<u32>, within: Duration) -> f64 {
    let Some(pid) = pid else { return 0.0 };
    let started = Instant::now();
    loop {
        let Ok(before) = procs::stat(pid) else { return 0.0 };
        tokio::time::sleep(QUIET_SAMPLE).await;
        let Ok(after) = procs::stat(pid) else { return 0.0 };
        let busy = after.cpu.saturating_sub(before.cpu).as_secs_f64() / QUIET_SAMPLE.as_secs_f64();
        let waited = started.elapsed();
        if busy < QUIET_BROKER || waited >= within {
            if waited >= Duration::from_secs(5) {
                eprintln!(
                    "  the broker took {:.0} s to go quiet ({:.2} of a core{})",
                    waited.as_secs_f64(),
                    busy,
                    if busy < QUIET_BROKER {
                        ""
                    } else {
                        ", still busy: stepping anyway"
                    }
                );
            }
            return waited.as_secs_f64();
        }
    }
}

/// One side of a comparison: where to publish, what to watch, whose CPU to read.
struct Target {
    label: &'static str,
    cfg: Cfg,
    intake_exchange: String,
    /// Intake, tier, due and destination queues: empty between steps.
    watch: Vec<String>,
    dest: String,
    collector: Collector,
    pid: u32,
}

/// Everything a run shares.
pub struct Bench {
    /// Broker URL.
    pub url: String,
    /// Parameters.
    pub profile: Profile,
    /// What to delete at the end.
    pub registry: Registry,
    ctl: Connection,
    consume: Connection,
    publish_ch: Channel,
    _publish_conn: Connection,
    work: PathBuf,
    ladder_bin: PathBuf,
    self_exe: PathBuf,
    /// The ladder's namespace.
    pub ns: String,
    relay_ns: String,
    broker_pid: Option<u32>,
    ladder: Option<Child>,
    relays: HashMap<&'static str, Child>,
    targets: Vec<Target>,
    next_step: u32,
    /// Every load step, in order.
    pub steps: Vec<Step>,
    /// Whether the ladder config has an `[admin]` table (the admin server bound to port 0).
    pub admin: bool,
}

fn unique_ns(n: u32) -> String {
    format!("bench-{}-{n}", std::process::id())
}

impl Bench {
    /// Connects, writes the configs, declares the relay's topology, starts the ladder and relays.
    pub async fn start(
        url: &str,
        profile: Profile,
        work: &Path,
        ladder_bin: &Path,
        registry: Registry,
    ) -> Result<Self> {
        let ctl = connect(url, "ladder-bench-control").await?;
        let consume = connect(url, "ladder-bench-consume").await?;
        let publish_conn = connect(url, "ladder-bench-publish").await?;
        let publish_ch = confirm_channel(&publish_conn).await?;
        let mut bench = Bench {
            url: url.to_string(),
            profile,
            registry,
            ctl,
            consume,
            publish_ch,
            _publish_conn: publish_conn,
            work: work.to_path_buf(),
            ladder_bin: ladder_bin.to_path_buf(),
            // the running image itself: a concurrent build may replace (delete) the file meanwhile
            self_exe: match Path::new("/proc/self/exe") {
                p if p.exists() => p.to_path_buf(),
                _ => std::env::current_exe()?,
            },
            ns: unique_ns(0),
            relay_ns: unique_ns(1),
            broker_pid: match url.parse::<ladder_amqp::AmqpUri>() {
                Ok(uri) if ["127.0.0.1", "localhost", "::1"].contains(&uri.host.as_str()) => {
                    procs::broker_pid_for(uri.port)
                }
                // not on this machine: its CPU cannot be read
                Ok(_) => None,
                Err(_) => procs::broker_pid(),
            },
            ladder: None,
            relays: HashMap::new(),
            targets: vec![],
            next_step: 0,
            steps: vec![],
            admin: false,
        };
        bench.start_processes().await?;
        Ok(bench)
    }

    /// The broker's Erlang VM, if found.
    pub fn broker_pid(&self) -> Option<u32> {
        self.broker_pid
    }

    /// What the broker says it is (`connection.start`): `RabbitMQ 4.3.6`.
    pub fn broker_version(&self) -> String {
        let text = |key: &str| match self.ctl.server_properties().get(key) {
            Some(FieldValue::LongString(s)) => s.to_str().map(str::to_string),
            _ => None,
        };
        match (text("product"), text("version")) {
            (Some(product), Some(version)) => format!("{product} {version}"),
            (None, Some(version)) => version,
            _ => "unknown".into(),
        }
    }

    fn ladders(&self) -> Vec<(String, Vec<String>, &'static str, &'static str)> {
        let (_, _, short, long, _) = self.profile.mix;
        let mut v: Vec<_> = self
            .profile
            .cfgs
            .iter()
            .map(|c| (c.ladder.to_string(), vec![TIER.to_string()], c.queue_type, c.strategy))
            .collect();
        v.push((
            "mix".into(),
            vec![format!("{short}ms"), format!("{long}ms")],
            "quorum",
            "at-least-once",
        ));
        v.push(("long".into(), vec!["1h".into()], "quorum", "at-least-once"));
        v
    }

    /// Writes a config for namespace `ns` under `dir` and loads it with the ladder's own loader.
    fn write_config(
        &self,
        dir: &Path,
        ns: &str,
        ladders: &[(String, Vec<String>, &'static str, &'static str)],
        admin: bool,
    ) -> Result<(PathBuf, ladder::config::Config)> {
        std::fs::create_dir_all(dir.join("ladders"))?;
        let admin_table = if admin {
            // port 0: several services (and the tests) may run on this machine at once
            "[admin]\nbind = \"127.0.0.1:0\"\n"
        } else {
            ""
        };
        let main = format!(
            "namespace = \"{ns}\"\nshutdown_grace = \"5s\"\n{admin_table}[amqp]\nurl = \"{}\"\nconnection_name = \"ladder-bench-service\"\n",
            self.url
        );
        let path = dir.join("ladder.toml");
        std::fs::write(&path, main)?;
        for (name, backoff, queue_type, strategy) in ladders {
            let backoff: Vec<String> = backoff.iter().map(|b| format!("\"{b}\"")).collect();
            let text = format!(
                "backoff = [{}]\nallow = [\"^{ns}-\"]\nqueue_type = \"{queue_type}\"\ndead_letter_strategy = \"{strategy}\"\n",
                backoff.join(", ")
            );
            std::fs::write(dir.join("ladders").join(format!("{name}.toml")), text)?;
        }
        let config = ladder::config::load(&path, &HashMap::new()).map_err(|e| anyhow!("{e}"))?;
        Ok((path, config))
    }

    fn register_plan(&self, config: &ladder::config::Config) {
        self.registry
            .plan(&topology::plan(config, topology::BrokerVersion::LATEST));
    }

    async fn start_processes(&mut self) -> Result<()> {
        // The service under test: the real binary, its own config, logs at warn.
        let dir = self.work.join("ladder");
        let ladders = self.ladders();
        let (path, config) = match self.write_config(&dir, &self.ns, &ladders, true) {
            Ok(ok) => {
                self.admin = true;
                ok
            }
            // a ladder built before the admin server existed rejects the table
            Err(_) => self.write_config(&dir, &self.ns, &ladders, false)?,
        };
        self.register_plan(&config);
        let args = vec!["--config".to_string(), path.display().to_string(), "run".to_string()];
        let log = self.work.join("ladder.log");
        let mut env: Vec<(&str, &str)> = vec![("RUST_LOG", "warn")];
        env.extend(self.profile.child_env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let (program, args) = self.wrapped(&self.ladder_bin, args);
        self.ladder = Some(Child::spawn("ladder run", &program, &args, &env, &log, false)?);

        // The minimal relay's topology: the ladder's own plan, in a namespace of its own.
        let relay_ladders: Vec<_> = ladders
            .iter()
            .filter(|l| self.profile.cfgs.iter().any(|c| c.ladder == l.0))
            .cloned()
            .collect();
        let (_, relay_config) = self.write_config(&self.work.join("relay"), &self.relay_ns, &relay_ladders, false)?;
        self.register_plan(&relay_config);
        topology::apply(
            &self.ctl,
            &topology::plan(&relay_config, topology::version_of(&self.ctl)),
            &|_| {},
        )
        .await
        .map_err(|e| anyhow!("declare the relay's topology: {e}"))?;
        for cfg in self.profile.cfgs.clone() {
            let spec = relay_config
                .ladders
                .iter()
                .find(|l| l.name == cfg.ladder)
                .ok_or_else(|| anyhow!("the relay's config has no ladder {}", cfg.ladder))?;
            let names = Names::of(&self.relay_ns, spec);
            let tier_queue = names.tier_queue_named(TIER);
            let args: Vec<String> = [
                "relay",
                "--url",
                &self.url,
                "--intake-queue",
                &names.intake_queue,
                "--due-queue",
                &names.due,
                "--ladder",
                cfg.ladder,
                "--tier-queue",
                &tier_queue,
                "--tier",
                TIER,
                "--ttl-ms",
                &TIER_MS.to_string(),
                "--prefetch",
                &config.limits.prefetch.to_string(),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            // a wrapper resolves the path itself: /proc/self/exe would be its own
            let relay_bin = match self.profile.wrap.is_empty() {
                true => self.self_exe.clone(),
                false => std::env::current_exe()?,
            };
            let (program, args) = self.wrapped(&relay_bin, args);
            let child = Child::spawn(
                &format!("relay {}", cfg.key),
                &program,
                &args,
                &env[1..],
                &self.work.join("relay.log"),
                false,
            )?;
            self.relays.insert(cfg.key, child);
        }

        // Every consumer is up when the broker says so.
        let mut queues = vec![];
        for (ladder, ..) in &ladders {
            let n = Names::new(&self.ns, ladder);
            queues.push(n.intake_queue.clone());
            queues.push(n.due.clone());
        }
        for cfg in &self.profile.cfgs {
            let n = Names::new(&self.relay_ns, cfg.ladder);
            queues.push(n.intake_queue.clone());
            queues.push(n.due.clone());
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        for q in &queues {
            loop {
                let consumers = depth(&self.ctl, q).await.map(|d| d.1).unwrap_or(0);
                if consumers > 0 {
                    break;
                }
                if let Some(l) = self.ladder.as_mut() {
                    l.stat().context("the ladder service stopped; see ladder.log")?;
                }
                if Instant::now() > deadline {
                    bail!(
                        "no consumer on {q} after 60 s (ladder.log, relay.log in {})",
                        self.work.display()
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }

        // Destinations and their collectors.
        for cfg in self.profile.cfgs.clone() {
            for (label, ns, config) in [
                ("ladder", self.ns.clone(), &config),
                ("relay", self.relay_ns.clone(), &relay_config),
            ] {
                // the tier queue is the namespace's, named for the ladder's queue shape
                let names = names_of(config, cfg.ladder);
                let dest = format!("{ns}-dest-{}", cfg.ladder);
                declare_queue(&self.ctl, &self.registry, &dest, FieldTable::new()).await?;
                let collector = Collector::start(&self.consume, &dest).await?;
                let pid = match label {
                    "ladder" => self.ladder.as_ref().map(Child::pid).unwrap_or(0),
                    _ => self.relays[cfg.key].pid(),
                };
                let watch = vec![
                    names.intake_queue.clone(),
                    names.tier_queue_named(TIER),
                    names.due.clone(),
                    dest.clone(),
                ];
                self.targets.push(Target {
                    label,
                    cfg,
                    intake_exchange: names.exchange.clone(),
                    watch,
                    dest,
                    collector,
                    pid,
                });
            }
        }
        Ok(())
    }

    /// `program args` as run under [`Profile::wrap`], if any.
    fn wrapped(&self, program: &Path, args: Vec<String>) -> (PathBuf, Vec<String>) {
        match self.profile.wrap.split_first() {
            None => (program.to_path_buf(), args),
            Some((wrapper, wrapper_args)) => {
                let mut all = wrapper_args.to_vec();
                all.push(program.display().to_string());
                all.extend(args);
                (PathBuf::from(wrapper), all)
            }
        }
    }

    /// The ladder service's CPU and memory now.
    pub fn ladder_stat(&mut self) -> Result<ProcStat> {
        self.ladder
            .as_mut()
            .ok_or_else(|| anyhow!("the ladder is not running"))?
            .stat()
            .context("the ladder service (see ladder.log)")
    }

    fn broker_stat(&self) -> ProcStat {
        self.broker_pid.and_then(|p| procs::stat(p).ok()).unwrap_or_default()
    }

    /// Waits until the broker used less than [`QUIET_BROKER`] of a core over a
    /// [`QUIET_SAMPLE`], at most `within`; returns the seconds waited. A step that starts while
    /// the broker still works off the step before measures that step, not its own process (in
    /// pass 10 on 3.10 the ladder's bisection steps at 6 000/s came right after the relay's
    /// misses at 12 000–16 000/s, with the broker at 10–21 s of CPU per 10 000 retries where a
    /// healthy step takes 2.5–4, and missed). Both processes wait alike. Without the broker's
    /// pid (a broker elsewhere) it does not wait.
    async fn broker_quiet(&self, within: Duration) -> f64 {
        broker_quiet(self.broker_pid, within).await
    }

    fn target(&self, label: &str, cfg: &str) -> usize {
        self.targets
            .iter()
            .position(|t| t.label == label && t.cfg.key == cfg)
            .expect("a target for every configuration")
    }

    /// One load step: publish at `rate` for `secs`, wait for the redeliveries, measure.
    async fn step(&mut self, target: usize, phase: &str, rate: f64, secs: f64) -> Result<Step> {
        self.next_step += 1;
        let id = self.next_step;
        let t = &self.targets[target];
        if !wait_empty(&self.ctl, &t.watch, self.profile.idle_wait).await? {
            for q in &t.watch {
                purge(&self.ctl, q).await?;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let settle_s = self.broker_quiet(self.profile.quiet_wait).await;
        let count = (rate * secs).round().max(1.0) as u64;
        // More than 1% of the step over 100 ms late means p99 > 100 ms: a certain miss.
        let late_limit = count / 100;
        let stop_late = phase == "capacity" && self.profile.stop_late;
        let before = (procs::stat(t.pid)?, self.broker_stat());
        let machine_before = procs::machine_ticks().unwrap_or_default();
        let (exchange, dest) = (t.intake_exchange.clone(), t.dest.clone());
        let collector = &t.collector;
        let published = broker::publish(
            &self.publish_ch,
            Some(rate),
            count,
            20_000,
            |seq| Msg {
                exchange: exchange.clone(),
                routing_key: String::new(),
                properties: retry_props(&dest, &[]),
                body: body(id, seq, TIER_MS),
            },
            || stop_late && collector.progress(id).1 > late_limit,
        )
        .await?;
        let deadline = Instant::now() + Duration::from_millis(TIER_MS) + self.profile.drain;
        let mut stopped = published.stopped;
        loop {
            let (got, late) = collector.progress(id);
            if got >= published.confirmed {
                break;
            }
            if stop_late && late > late_limit {
                stopped = true;
                break;
            }
            if Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let after = (procs::stat(t.pid)?, self.broker_stat());
        let steal = procs::steal_pct(machine_before, procs::machine_ticks().unwrap_or_default());
        let (samples, duplicates) = collector.take(id);
        let delivered = samples.len() as u64;
        let per_10k = |d: Duration| {
            if delivered == 0 {
                0.0
            } else {
                d.as_secs_f64() / delivered as f64 * 10_000.0
            }
        };
        let e2e = pcts(samples.iter().map(|s| s.late_e2e()).collect());
        let due = pcts(samples.iter().filter_map(|s| s.late_due()).collect());
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
        let pass =
            !stopped && lost == 0 && published.refused == 0 && e2e.p99 < broker::LATE_MS && achieved >= 0.97 * rate;
        let step = Step {
            phase: phase.to_string(),
            target: t.label.to_string(),
            cfg: t.cfg.key.to_string(),
            offered: rate,
            achieved,
            secs: published.secs,
            sent: published.confirmed,
            delivered,
            duplicates,
            lost,
            refused: published.refused,
            stopped_early: stopped,
            e2e,
            due,
            cpu_s: (after.0.cpu.saturating_sub(before.0.cpu)).as_secs_f64(),
            cpu_per_10k: per_10k(after.0.cpu.saturating_sub(before.0.cpu)),
            sys_per_10k: per_10k(after.0.sys.saturating_sub(before.0.sys)),
            broker_cpu_per_10k: per_10k(after.1.cpu.saturating_sub(before.1.cpu)),
            rss_kb: after.0.rss_kb,
            broker_settle_s: settle_s,
            steal_pct: steal,
            pass,
        };
        eprintln!(
            "  {:<9} {:<6} {:<10} {:>7.0}/s: e2e p50 {:>5} p99 {:>6} max {:>6} ms | due p99 {:>6} | {}/{} {}{} | cpu {:.2} s/10k (sys {:.2}), broker {:.2} s/10k | rss {} MB | steal {:.0}% | {}",
            step.phase,
            step.target,
            step.cfg,
            rate,
            e2e.p50,
            e2e.p99,
            e2e.max,
            due.p99,
            delivered,
            published.confirmed,
            if stopped { "stopped early " } else { "" },
            if lost > 0 {
                format!("LOST {lost} ")
            } else {
                String::new()
            },
            step.cpu_per_10k,
            step.sys_per_10k,
            step.broker_cpu_per_10k,
            step.rss_kb / 1024,
            step.steal_pct,
            if pass { "pass" } else { "MISS" },
        );
        self.steps.push(step.clone());
        Ok(step)
    }

    /// Decides for each `(target, rate)` whether it passes: up to [`Profile::tries`] counted
    /// steps each, taken in turn (ladder, relay, ladder, relay, …) so that a burst of load from
    /// elsewhere on a shared machine hits both sides alike; one passing step is enough.
    ///
    /// A miss counts only when the machine could do it: right after a miss, a run that already
    /// passed (the other process) steps again at its own rate as a witness, and if the witness
    /// misses too, the broker or the machine stalled and the miss is not counted (a stall of a
    /// few seconds used to hit one process three times in a row and end its ramp alone). At
    /// most twice [`Profile::tries`] steps per run, counted or not; after a stall the broker
    /// is given [`Profile::idle_wait`] twice over before the next step, so that a stall of a
    /// minute does not use up a run's steps in a row.
    ///
    /// `first` (modulo the number of runs) is the run that steps first, then the others in
    /// turn: the capacity ramp changes it at every new rate, since the first step at a new
    /// rate meets the broker's own warm-up to it (quorum logs growing, a process's first
    /// burst) more often than the second does.
    async fn decide(&mut self, runs: &[(usize, f64)], first: usize) -> Result<Vec<bool>> {
        let tries = self.profile.tries;
        let mut decided: Vec<Option<bool>> = vec![None; runs.len()];
        let mut taken = vec![Tries::default(); runs.len()];
        while decided.iter().any(Option::is_none) {
            for i in rotated(runs.len(), first) {
                let (target, rate) = runs[i];
                if decided[i].is_some() {
                    continue;
                }
                let pass = self.step(target, "capacity", rate, self.profile.cap_secs).await?.pass;
                let witness = match (pass, (0..runs.len()).find(|&w| w != i && decided[w] == Some(true))) {
                    (false, Some(w)) => {
                        let (target, rate) = runs[w];
                        Some(self.step(target, "capacity", rate, self.profile.cap_secs).await?.pass)
                    }
                    _ => None,
                };
                if witness == Some(false) {
                    eprintln!("  both missed: a stall of the broker or the machine, not counted");
                    tokio::time::sleep(self.profile.idle_wait * 2).await;
                }
                decided[i] = taken[i].record(pass, witness, tries);
            }
        }
        Ok(decided.into_iter().map(|d| d == Some(true)).collect())
    }

    /// Capacity of ladder and relay for `cfg`: a geometric ramp, the two taking turns at each
    /// rate so they see the same machine, then bisection between the last pass and first miss.
    pub async fn capacity(&mut self, cfg: Cfg) -> Result<Capacity> {
        eprintln!("capacity, {} tiers (1 s), ladder and relay in turn", cfg.key);
        let targets = [self.target("ladder", cfg.key), self.target("relay", cfg.key)];
        let mut pass: [f64; 2] = [0.0; 2];
        let mut fail: [Option<f64>; 2] = [None; 2];
        let mut rate = self.profile.start_rate;
        // who steps first at a new rate: the ladder, then the relay, in turn
        let mut round = 0;
        while fail.iter().any(Option::is_none) && rate <= self.profile.max_rate {
            let open: Vec<usize> = (0..2).filter(|&i| fail[i].is_none()).collect();
            let runs: Vec<(usize, f64)> = open.iter().map(|&i| (targets[i], rate)).collect();
            let decided = self.decide(&runs, round).await?;
            round += 1;
            for (&i, ok) in open.iter().zip(decided) {
                if ok {
                    pass[i] = rate;
                } else {
                    fail[i] = Some(rate);
                }
            }
            rate = crate::round50(rate * self.profile.factor);
        }
        for _ in 0..self.profile.bisect {
            let mut open = vec![];
            for i in 0..2 {
                let Some(hi) = fail[i] else { continue };
                let mid = crate::round50((pass[i] + hi) / 2.0);
                if mid > pass[i] && mid < hi {
                    open.push((i, mid));
                }
            }
            let runs: Vec<(usize, f64)> = open.iter().map(|&(i, mid)| (targets[i], mid)).collect();
            let decided = self.decide(&runs, round).await?;
            round += 1;
            for (&(i, mid), ok) in open.iter().zip(decided) {
                if ok {
                    pass[i] = mid;
                } else {
                    fail[i] = Some(mid);
                }
            }
        }
        Ok(Capacity {
            cfg: cfg.key.to_string(),
            ladder: pass[0],
            ladder_fail: fail[0],
            relay: pass[1],
            relay_fail: fail[1],
        })
    }

    /// Lateness and CPU at fixed rates, the ladder and the relay at the same offered rate.
    /// A rate measured again swaps who goes first (ladder, relay; relay, ladder; …), so that
    /// what the broker still does after the step before — a quorum queue's log written out,
    /// a backlog settled — does not always fall in the same process's window.
    pub async fn fixed(&mut self, cfg: Cfg, rates: &[f64]) -> Result<()> {
        eprintln!("fixed rates, {} tiers: {rates:?}", cfg.key);
        for (i, &rate) in rates.iter().enumerate() {
            for label in turn_order(rates[..i].iter().filter(|&&r| r == rate).count()) {
                let t = self.target(label, cfg.key);
                self.step(t, "fixed", rate, self.profile.fixed_secs).await?;
            }
        }
        Ok(())
    }

    /// The lateness target: quorum at-least-once at 1 000 retries/s, `windows` steps each for
    /// ladder and relay, taken in turn; the target is judged on the median window, so one
    /// stall of a shared machine does not decide it alone.
    pub async fn p99_target(&mut self, windows: u32) -> Result<()> {
        let Some(cfg) = self.profile.cfgs.iter().copied().find(|c| c.key == "quorum-alo") else {
            return Ok(());
        };
        // 1 000/s; a smoke run's own (tiny) fixed rate
        let rates = &self.profile.fixed_rates;
        let rate = rates
            .iter()
            .copied()
            .find(|&r| r >= 1000.0)
            .or(rates.last().copied())
            .unwrap_or(1000.0);
        eprintln!(
            "lateness target: {} tiers at {rate}/s, {windows} windows each, in turn",
            cfg.key
        );
        for _ in 0..windows {
            for label in ["ladder", "relay"] {
                let t = self.target(label, cfg.key);
                self.step(t, "p99", rate, self.profile.fixed_secs).await?;
            }
        }
        Ok(())
    }

    /// The short/long mix through the ladder (tiers `short`, `long`) and through the classic
    /// recipe's single wait queue with per-message `expiration`, at the same time.
    pub async fn mix(&mut self) -> Result<Mix> {
        let (rate, secs, short_ms, long_ms, long_every) = self.profile.mix;
        eprintln!(
            "mix: {rate}/s each for {secs} s, one in {long_every} waits {long_ms} ms, the rest {short_ms} ms: ladder vs per-message TTL"
        );
        let names = Names::new(&self.ns, "mix");
        let dest_ladder = format!("{}-dest-mix", self.ns);
        let dest_ttl = format!("{}-dest-ttl", self.ns);
        let wait = format!("{}-ttl-wait", self.ns);
        declare_queue(&self.ctl, &self.registry, &dest_ladder, FieldTable::new()).await?;
        declare_queue(&self.ctl, &self.registry, &dest_ttl, FieldTable::new()).await?;
        let mut args = FieldTable::new();
        args.set("x-dead-letter-exchange", text(""));
        args.set("x-dead-letter-routing-key", text(&dest_ttl));
        declare_queue(&self.ctl, &self.registry, &wait, args).await?;
        let c_ladder = Collector::start(&self.consume, &dest_ladder).await?;
        let c_ttl = Collector::start(&self.consume, &dest_ttl).await?;
        self.next_step += 1;
        let id = self.next_step;
        let count = (rate * secs).round() as u64;
        let delay = move |seq: u64| {
            if seq % long_every == long_every - 1 {
                long_ms
            } else {
                short_ms
            }
        };
        let ch_ttl = confirm_channel(&self._publish_conn).await?;
        let intake = names.exchange.clone();
        let ladder_run = broker::publish(
            &self.publish_ch,
            Some(rate),
            count,
            20_000,
            |seq| Msg {
                exchange: intake.clone(),
                routing_key: String::new(),
                properties: retry_props(
                    &dest_ladder,
                    &[("retry-delay", FieldValue::LongLongInt(delay(seq) as i64))],
                ),
                body: body(id, seq, delay(seq)),
            },
            || false,
        );
        let ttl_run = broker::publish(
            &ch_ttl,
            Some(rate),
            count,
            20_000,
            |seq| Msg {
                exchange: String::new(),
                routing_key: wait.clone(),
                properties: BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_expiration(&delay(seq).to_string()),
                body: body(id, seq, delay(seq)),
            },
            || false,
        );
        let (a, b) = tokio::join!(ladder_run, ttl_run);
        let (a, b) = (a?, b?);
        let deadline = Instant::now() + Duration::from_millis(long_ms) + Duration::from_secs(30);
        while (c_ladder.progress(id).0 < a.confirmed || c_ttl.progress(id).0 < b.confirmed) && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = ch_ttl.close(200, "done").await;
        let stream = |name: &str, c: &Collector, sent: u64| {
            let (samples, _) = c.take(id);
            let short: Vec<i64> = samples
                .iter()
                .filter(|s| s.delay_ms == short_ms)
                .map(|s| s.late_e2e())
                .collect();
            let long: Vec<i64> = samples
                .iter()
                .filter(|s| s.delay_ms == long_ms)
                .map(|s| s.late_e2e())
                .collect();
            MixStream {
                name: name.to_string(),
                short_late_100: short.iter().filter(|&&l| l > broker::LATE_MS).count(),
                short: pcts(short.clone()),
                long: pcts(long),
                sent,
                delivered: samples.len() as u64,
                short_values: short,
            }
        };
        let mix = Mix {
            rate,
            secs,
            short_ms,
            long_ms,
            long_every,
            streams: vec![
                stream("ladder", &c_ladder, a.confirmed),
                stream("per-message TTL", &c_ttl, b.confirmed),
            ],
        };
        for s in &mix.streams {
            eprintln!(
                "  {:<16} short: p50 {} p99 {} max {} ms ({} of {} over 100 ms late) | long: p50 {} p99 {} max {} ms | {}/{} delivered",
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
        Ok(mix)
    }

    /// The in-process retry: RSS as held messages grow, and what a crash does to them.
    pub async fn in_process(&mut self) -> Result<InProcess> {
        let (n1, n2) = self.profile.inproc;
        eprintln!("in-process retry: hold {n1} then {n2} deliveries (1 h each), crash; then acked-and-held, crash");
        let queue = format!("{}-inproc", self.ns);
        declare_queue(&self.ctl, &self.registry, &queue, FieldTable::new()).await?;
        let mut out = InProcess::default();

        let mut hold = self.spawn_hold(&queue, "unacked").await?;
        out.rss_idle_kb = hold.stat()?.rss_kb;
        let mut published = 0;
        for n in [n1, n2] {
            self.fill(&queue, n - published).await?;
            published = n;
            wait_counter(&hold, n, Duration::from_secs(120)).await?;
            tokio::time::sleep(Duration::from_millis(500)).await;
            let rss = hold.stat()?.rss_kb;
            eprintln!("  unacked: {n} held, RSS {} MB", rss / 1024);
            out.rss_held.push((n, rss));
        }
        out.crash_unacked_held = n2;
        let crashed = Instant::now();
        hold.crash()?;
        let deadline = crashed + Duration::from_secs(60);
        loop {
            let (ready, _) = depth(&self.ctl, &queue).await?;
            out.crash_unacked_back = u64::from(ready);
            if out.crash_unacked_back >= n2 || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        out.crash_unacked_back_ms = crashed.elapsed().as_millis() as u64;
        eprintln!(
            "  unacked: SIGKILL with {n2} held: {} back in the queue, ready at once, {} ms after the crash (they were due in 1 h)",
            out.crash_unacked_back, out.crash_unacked_back_ms
        );
        drop(hold);
        purge(&self.ctl, &queue).await?;

        let mut hold = self.spawn_hold(&queue, "acked").await?;
        self.fill(&queue, n1).await?;
        wait_counter(&hold, n1, Duration::from_secs(120)).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        out.crash_acked_held = n1;
        out.crash_acked_rss_kb = hold.stat()?.rss_kb;
        hold.crash()?;
        // give the broker time to requeue anything it would (it requeues unacked ones in ms)
        tokio::time::sleep(Duration::from_secs(1).max(self.profile.settle)).await;
        out.crash_acked_back = u64::from(depth(&self.ctl, &queue).await?.0);
        eprintln!(
            "  acked: SIGKILL with {n1} held: {} in the queue afterwards: {} lost",
            out.crash_acked_back,
            n1 - out.crash_acked_back.min(n1)
        );
        drop(hold);
        broker::delete_queue(&self.ctl, &queue).await?;
        Ok(out)
    }

    async fn spawn_hold(&self, queue: &str, mode: &str) -> Result<Child> {
        let args: Vec<String> = ["hold", "--url", &self.url, "--queue", queue, "--mode", mode]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let child = Child::spawn(
            &format!("hold {mode}"),
            &self.self_exe,
            &args,
            &[],
            &self.work.join("hold.log"),
            true,
        )?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while depth(&self.ctl, queue).await?.1 == 0 {
            if Instant::now() > deadline {
                bail!("the in-process consumer did not start (hold.log)");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(child)
    }

    /// Publishes `n` plain messages straight into `queue`, as fast as confirms allow.
    async fn fill(&self, queue: &str, n: u64) -> Result<()> {
        let p = broker::publish(
            &self.publish_ch,
            None,
            n,
            5000,
            |seq| Msg {
                exchange: String::new(),
                routing_key: queue.to_string(),
                properties: BasicProperties::default().with_delivery_mode(2),
                body: body(0, seq, 0),
            },
            || false,
        )
        .await?;
        if p.refused > 0 {
            bail!("{} publishes to {queue} refused", p.refused);
        }
        Ok(())
    }

    /// A million retries through the intake into a 1 h tier: the ladder's memory must not grow.
    /// The tier is deleted right after, also when the measurement fails.
    pub async fn million(&mut self) -> Result<Million> {
        let count = self.profile.million;
        // a quorum tier dead-lettering at-least-once: the namespace's `N.delay.1h`, which only
        // this ladder uses
        let names = Names::new(&self.ns, "long");
        let tier = names.tier_queue_named("1h");
        let mut out = Million {
            count,
            ..Default::default()
        };
        let available = procs::mem_available_kb();
        // quorum: ~0.55 GB per million small messages (shared/DESIGN.md); keep a wide margin
        let needed = count * 3; // kB
        if available < needed + 2 * 1024 * 1024 {
            out.skipped = Some(format!(
                "only {} MB available; {count} waiting retries need about {} MB of broker memory plus headroom",
                available / 1024,
                needed / 1024
            ));
            return Ok(out);
        }
        eprintln!("{count} retries into a 1 h quorum tier through the ladder's intake");
        let result = self.million_inner(&names, &tier, &mut out).await;
        // delete them now, whatever happened
        let deleted = broker::delete_queue(&self.ctl, &tier).await;
        let _ = purge(&self.ctl, &names.intake_queue).await;
        tokio::time::sleep(self.profile.settle * 2).await;
        out.broker_rss_kb.2 = self.broker_stat().rss_kb;
        eprintln!(
            "  deleted {tier} ({}); broker RSS now {} MB",
            match &deleted {
                Ok(n) => format!("{n} messages"),
                Err(e) => format!("FAILED: {e}"),
            },
            out.broker_rss_kb.2 / 1024
        );
        result?;
        deleted?;
        Ok(out)
    }

    async fn million_inner(&mut self, names: &Names, tier: &str, out: &mut Million) -> Result<()> {
        tokio::time::sleep(self.profile.settle).await;
        let before = self.ladder_stat()?;
        let broker_before = self.broker_stat();
        out.ladder_rss_before_kb = before.rss_kb;
        out.broker_rss_kb.0 = broker_before.rss_kb;
        let started = Instant::now();
        let dest = format!("{}-dest-long", self.ns);
        let intake = names.exchange.clone();
        let publish = broker::publish(
            &self.publish_ch,
            None,
            out.count,
            5000,
            |seq| Msg {
                exchange: intake.clone(),
                routing_key: String::new(),
                properties: retry_props(&dest, &[]),
                body: body(0, seq, 3_600_000),
            },
            || false,
        );
        // watch the tier fill, the ladder's memory and the broker's while publishing and after
        let ctl = &self.ctl;
        let tier_name = tier.to_string();
        let broker_pid = self.broker_pid;
        let ladder_pid = self.ladder.as_ref().map(Child::pid).unwrap_or(0);
        let limit_kb = broker_before.rss_kb + 4 * 1024 * 1024;
        let count = out.count;
        let watch = async move {
            let deadline = Instant::now() + Duration::from_secs(900);
            let mut peak = 0;
            let mut last_print = Instant::now();
            loop {
                let (n, _) = depth(ctl, &tier_name).await?;
                peak = peak.max(procs::stat(ladder_pid)?.rss_kb);
                let broker = broker_pid.and_then(|p| procs::stat(p).ok()).unwrap_or_default();
                if broker.rss_kb > limit_kb {
                    bail!(
                        "broker RSS {} MB: more than 4 GB above where it started; stopping",
                        broker.rss_kb / 1024
                    );
                }
                if last_print.elapsed() > Duration::from_secs(10) {
                    eprintln!("  {n} in the tier, broker RSS {} MB", broker.rss_kb / 1024);
                    last_print = Instant::now();
                }
                if u64::from(n) >= count {
                    return Ok::<u64, anyhow::Error>(peak);
                }
                if Instant::now() > deadline {
                    bail!("only {n} of {count} in {tier_name} after 15 minutes");
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        };
        let (published, peak) = tokio::join!(publish, watch);
        let published = published?;
        let peak = peak?;
        out.secs = started.elapsed().as_secs_f64();
        if published.refused > 0 {
            bail!("{} publishes refused", published.refused);
        }
        tokio::time::sleep(self.profile.settle).await;
        let after = self.ladder_stat()?;
        out.ladder_rss_peak_kb = peak.max(after.rss_kb);
        out.ladder_rss_after_kb = after.rss_kb;
        out.ladder_cpu_per_10k = after.cpu.saturating_sub(before.cpu).as_secs_f64() / out.count as f64 * 10_000.0;
        out.broker_rss_kb.1 = self.broker_stat().rss_kb;
        eprintln!(
            "  all {} waiting after {:.0} s ({:.0}/s through the intake hop): ladder RSS {} MB before, {} MB after (peak {} MB); broker RSS {} → {} MB",
            out.count,
            out.secs,
            out.count as f64 / out.secs,
            out.ladder_rss_before_kb / 1024,
            out.ladder_rss_after_kb / 1024,
            out.ladder_rss_peak_kb / 1024,
            out.broker_rss_kb.0 / 1024,
            out.broker_rss_kb.1 / 1024
        );
        Ok(())
    }

    /// Stops the children (the ladder drains on SIGTERM).
    pub fn stop_processes(&mut self) {
        self.targets.clear();
        self.relays.clear();
        if let Some(mut l) = self.ladder.take() {
            l.stop(Duration::from_secs(20));
        }
    }

    /// CPU milliseconds per second of the ladder and of the quorum-alo relay while idle
    /// (consumers up, nothing to do), over `window`.
    pub async fn idle_cpu(&mut self, window: Duration) -> Result<(f64, f64)> {
        let relay = self.relays.get(self.profile.cfgs[0].key).map(Child::pid).unwrap_or(0);
        let ladder = self.ladder.as_ref().map(Child::pid).unwrap_or(0);
        let before = (procs::stat(ladder)?, procs::stat(relay)?);
        tokio::time::sleep(window).await;
        let after = (procs::stat(ladder)?, procs::stat(relay)?);
        let per_s = |a: Duration, b: Duration| a.saturating_sub(b).as_secs_f64() * 1000.0 / window.as_secs_f64();
        Ok((per_s(after.0.cpu, before.0.cpu), per_s(after.1.cpu, before.1.cpu)))
    }

    /// The highest peak RSS (VmHWM) of the minimal relays, kB.
    pub fn relay_hwm(&mut self) -> u64 {
        self.relays
            .values_mut()
            .filter_map(|c| c.stat().ok())
            .map(|s| s.hwm_kb)
            .max()
            .unwrap_or(0)
    }
}

/// The names of ladder `ladder` of `config`, its tier queues named for its queue type and
/// dead-letter strategy (they are the namespace's, shared by the ladders of the same shape).
fn names_of(config: &ladder::config::Config, ladder: &str) -> Names {
    match config.ladders.iter().find(|l| l.name == ladder) {
        Some(spec) => Names::of(&config.namespace, spec),
        None => Names::new(&config.namespace, ladder),
    }
}

/// A failed message as a consumer republishes it: persistent, `retry-to` set.
fn retry_props(dest: &str, extra: &[(&str, FieldValue)]) -> BasicProperties {
    let mut headers = FieldTable::new();
    headers.set("retry-to", text(dest));
    for (k, v) in extra {
        headers.set(k, v.clone());
    }
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("text/plain")
        .with_headers(headers)
}

async fn wait_counter(child: &Child, n: u64, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    while child.counter.load(Ordering::Relaxed) < n {
        if Instant::now() > deadline {
            bail!(
                "the in-process consumer holds {} of {n} after {within:?}",
                child.counter.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// One run's steps in a capacity decision ([`Bench::decide`]).
#[derive(Debug, Default, Clone, Copy)]
struct Tries {
    /// Misses that count: no witness to ask, or the witness passed.
    counted: u32,
    /// Steps taken, counted or not.
    taken: u32,
}

impl Tries {
    /// Records a step that passed or missed — after a miss, whether the witness passed right
    /// after (`None`: no run had passed to ask) — and returns the decision once there is one:
    /// a pass; `tries` counted misses; or twice `tries` steps.
    fn record(&mut self, pass: bool, witness: Option<bool>, tries: u32) -> Option<bool> {
        self.taken += 1;
        if pass {
            return Some(true);
        }
        if witness != Some(false) {
            self.counted += 1;
        }
        (self.counted >= tries || self.taken >= 2 * tries).then_some(false)
    }
}

/// The runs `0..len` in turn, starting with `first` taken modulo `len` (a capacity decision's
/// order; the ramp passes its round).
fn rotated(len: usize, first: usize) -> impl Iterator<Item = usize> {
    (0..len).map(move |k| (k + first) % len)
}

/// Who goes first the `nth` time a rate is measured (from 0): the ladder, then the relay, and
/// the other way round every other time.
fn turn_order(nth: usize) -> [&'static str; 2] {
    if nth.is_multiple_of(2) {
        ["ladder", "relay"]
    } else {
        ["relay", "ladder"]
    }
}

#[cfg(test)]
mod tests {
    use super::Tries;

    #[test]
    fn a_miss_counts_unless_the_witness_missed_too() {
        // no witness, or one that passed: the miss counts; three counted end it
        let mut t = Tries::default();
        assert_eq!(t.record(false, None, 3), None);
        assert_eq!(t.record(false, Some(true), 3), None);
        assert_eq!(t.record(false, Some(true), 3), Some(false));
        // a miss beside a missing witness is a stall: not counted, the run is tried again
        let mut t = Tries::default();
        assert_eq!(t.record(false, Some(false), 3), None);
        assert_eq!(t.record(false, Some(false), 3), None);
        assert_eq!(t.record(true, None, 3), Some(true));
        // but stalls do not go on for ever: twice `tries` steps decide it
        let mut t = Tries::default();
        for _ in 0..5 {
            assert_eq!(t.record(false, Some(false), 3), None);
        }
        assert_eq!(t.record(false, Some(false), 3), Some(false));
        // a smoke run's single try
        assert_eq!(Tries::default().record(false, None, 1), Some(false));
    }

    #[test]
    fn a_capacity_decision_starts_with_the_run_named_first() {
        assert_eq!(super::rotated(2, 0).collect::<Vec<_>>(), [0, 1]);
        assert_eq!(super::rotated(2, 1).collect::<Vec<_>>(), [1, 0]);
        assert_eq!(super::rotated(1, 0).collect::<Vec<_>>(), [0]);
        assert_eq!(super::rotated(3, 2).collect::<Vec<_>>(), [2, 0, 1]);
        assert_eq!(super::rotated(2, 5).collect::<Vec<_>>(), [1, 0]);
        assert_eq!(super::rotated(0, 3).count(), 0);
    }

    #[test]
    fn a_rate_measured_again_swaps_who_goes_first() {
        let rates: Vec<_> = (0..4).map(super::turn_order).collect();
        assert_eq!(
            rates,
            [
                ["ladder", "relay"],
                ["relay", "ladder"],
                ["ladder", "relay"],
                ["relay", "ladder"]
            ]
        );
    }
}
