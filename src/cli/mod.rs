//! The `ladder` commands: their arguments (clap) and what each does. `main` parses, sets up
//! logging and the runtime, and maps what a command returns to an exit code.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use ladder::broker::topology;
use ladder::config::Config;

pub mod demo;
pub mod dev_broker;
pub mod docs;
pub mod holds;
pub mod log;
pub mod parked;
pub mod probe;
pub mod prune;
pub mod scheduled;
pub mod serve;

pub use demo::DemoArgs;
pub use holds::{HoldArgs, HoldsArgs, ResumeArgs};
pub use parked::ParkedArgs;
pub use prune::PruneArgs;
pub use scheduled::ScheduledArgs;

/// The config file when `--config` is not given.
pub const DEFAULT_CONFIG: &str = "ladder.toml";

#[derive(Parser)]
#[command(
    name = "ladder",
    version,
    about = "Delayed retries with stepped backoff and a parking lot for RabbitMQ"
)]
pub struct Cli {
    /// The service config file; ladder files are read from its `ladders_dir`.
    #[arg(long, short, global = true, default_value = DEFAULT_CONFIG)]
    pub config: PathBuf,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Declare the topology, then serve until SIGTERM/SIGINT. When no broker answers at a local
    /// amqp:// address and scripts/broker is beside the config (a checkout of Ladder), start a
    /// development broker first (`scripts/broker down dev` stops it).
    Run {
        /// Never start a development broker: no answering broker is an error (exit 69).
        #[arg(long)]
        no_dev_broker: bool,
    },
    /// Validate the config and the ladders; exit 64 on the first problem. When a broker answers,
    /// also list the namespace's retired tiers and ladders (with the messages still waiting in
    /// them) and the objects whose arguments differ from the config.
    Check,
    /// Print every exchange, queue, binding and argument that would be declared; when a broker
    /// answers, what is retired or differs follows on stderr.
    Plan {
        /// The RabbitMQ version to plan for (`3.10`, `4.0`, `4.3`); the service reads it from the
        /// broker. Default: the newest supported.
        #[arg(long, value_name = "VERSION", value_parser = parse_broker_version)]
        broker_version: Option<topology::BrokerVersion>,
    },
    /// Declare the topology and exit.
    Apply,
    /// Delete the namespace's retired tiers and retired ladders' queues and exchanges once they
    /// are empty; never what the config uses, nor another namespace's. Exit 75 when something
    /// retired still holds messages (kept, with the reason).
    Prune(PruneArgs),
    /// Inspect, search, replay and discard parked messages.
    Parked(Box<ParkedArgs>),
    /// Cancel scheduled deliveries by message id.
    Scheduled(ScheduledArgs),
    /// Hold a destination queue: its due messages wait in a held queue, no attempt counted,
    /// until `ladder resume`. Refused (64) for a queue that is not allowed or does not exist.
    Hold(HoldArgs),
    /// Resume a held destination: release what it held at a bounded rate, oldest first.
    Resume(ResumeArgs),
    /// List the held destinations of a ladder.
    Holds(HoldsArgs),
    /// Send one failure through a ladder by hand and watch it come back.
    Demo(DemoArgs),
    /// Ask the admin server at admin.bind for /ready: exit 0 on 200, else 1 with the reason.
    Probe,
    /// Print the completion script for a shell (`source <(ladder completions bash)`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page ladder(1) in roff, or write one page per command into a directory.
    Man {
        /// Write `ladder.1`, `ladder-parked.1`, `ladder-parked-replay.1`, … here instead.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

/// `3.10`, `4.0.5` … as a [`topology::BrokerVersion`].
fn parse_broker_version(text: &str) -> Result<topology::BrokerVersion, String> {
    let mut parts = text.split('.').map(|p| p.parse::<u32>());
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(Ok(a)), Some(Ok(b)), c, None) if c.as_ref().is_none_or(Result::is_ok) => {
            Ok(topology::BrokerVersion(a, b, c.and_then(Result::ok).unwrap_or(0)))
        }
        _ => Err(format!("{text:?} is not a version like 4.3 or 3.10.8")),
    }
}

/// The ladder a command acts on: the one named, or the only one.
pub fn choose_ladder<'c>(
    config: &'c Config,
    name: Option<&str>,
) -> anyhow::Result<&'c ladder::model::ladder::LadderSpec> {
    use anyhow::Context as _;
    match (name, config.ladders.as_slice()) {
        (Some(name), ladders) => ladders
            .iter()
            .find(|l| l.name == name)
            .with_context(|| format!("no ladder {name:?} in {}", config.file.display())),
        (None, [only]) => Ok(only),
        (None, _) => anyhow::bail!("the config has several ladders; choose one with --ladder"),
    }
}

/// `ladder check`: the config loaded; say what it holds, and what the broker shows of drift.
pub async fn check(config: &Config) -> ExitCode {
    println!("{}: ok ({} ladders)", config.file.display(), config.ladders.len());
    for ladder in &config.ladders {
        let steps: Vec<_> = ladder.steps.iter().map(|t| t.name.as_str()).collect();
        println!(
            "  {}: tiers [{}], max_attempts {}, {} {}",
            ladder.name,
            steps.join(", "),
            ladder.max_attempts,
            ladder.queue_type.as_str(),
            ladder.dead_letter_strategy.as_str()
        );
        let levels: Vec<_> = ladder.tiers.iter().filter(|t| !ladder.steps.contains(t)).collect();
        if let (Some(first), Some(last)) = (levels.first(), levels.last()) {
            println!(
                "    exact delays: {} delay levels, {} … {}{}{}",
                levels.len(),
                first.name,
                last.name,
                ladder
                    .jitter
                    .map(|j| format!(", jitter {}%", f64::from(j.permille) / 10.0))
                    .unwrap_or_default(),
                if ladder.allow_exchanges.is_empty() {
                    String::new()
                } else {
                    format!(", exchanges [{}]", ladder.allow_exchanges.patterns().join(", "))
                },
            );
        }
        if let Some(senders) = &ladder.senders {
            let grants: Vec<String> = senders
                .grants
                .iter()
                .map(|(user, allowed)| format!("{user} [{}]", allowed.patterns().join(", ")))
                .collect();
            println!(
                "    senders: {}; unidentified {}",
                if grants.is_empty() {
                    "none".to_string()
                } else {
                    grants.join(", ")
                },
                senders.unidentified.as_str()
            );
        }
    }
    for line in prune::describe(config, &prune::look(config).await) {
        println!("{line}");
    }
    ExitCode::SUCCESS
}

/// `ladder plan`: every declaration, for `version` (default: the newest supported). A reader that
/// stopped early (`| head`) ends it quietly with 0, as ripgrep does; `println!` would panic.
pub async fn plan(config: &Config, version: Option<topology::BrokerVersion>) -> ExitCode {
    use std::io::Write as _;
    let written = {
        let mut stdout = std::io::stdout().lock();
        topology::plan(config, version.unwrap_or(topology::BrokerVersion::LATEST))
            .iter()
            .try_for_each(|declaration| writeln!(stdout, "{declaration}"))
            .and_then(|()| stdout.flush())
    };
    if written.is_ok() {
        // stdout stays the declarations only, for scripts; drift is for the operator
        for line in prune::describe(config, &prune::look(config).await) {
            eprintln!("# {line}");
        }
    }
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ladder: cannot write to stdout: {e}");
            ExitCode::from(crate::exit::FAILED)
        }
    }
}
