//! The `ladder` command: parse the command line, set up logging and the runtime, dispatch to
//! [`cli`], and map the outcome to an exit code.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use ladder::broker::lot as parking;
use ladder::config;

mod cli;

use cli::{Cli, Command};

/// Exit codes (sysexits where one fits).
mod exit {
    /// Invalid config (sysexits EX_USAGE): nothing touched the broker. (clap exits 2 on bad arguments.)
    pub const CONFIG: u8 = 64;
    /// The broker could not be reached, or `run` cannot listen on `admin.bind` (the port is taken
    /// or not ours to use): a resource the service needs is unavailable (EX_UNAVAILABLE). Exiting
    /// beats running without health checks an orchestrator would then fail anyway.
    pub const UNAVAILABLE: u8 = 69;
    /// `ladder parked`: an entry failed, or the request could not be served (no such entry or ladder).
    pub const FAILED: u8 = 1;
    /// `ladder parked replay|discard`: another one runs on the same ladder (EX_TEMPFAIL).
    pub const BUSY: u8 = 75;
    /// The broker holds objects that contradict the config (EX_CONFIG).
    pub const CONFLICT: u8 = 78;
}

fn main() -> ExitCode {
    // a thread any dependency spawns without naming a stack size takes std's default, which std
    // reads from RUST_MIN_STACK when it spawns its first thread; decoding a deeply nested header
    // on such a thread must not overflow it.
    if std::env::var_os("RUST_MIN_STACK").is_none() {
        // SAFETY: nothing has spawned a thread yet, so nothing reads the environment concurrently.
        unsafe { std::env::set_var("RUST_MIN_STACK", ladder::DEEP_STACK_BYTES.to_string()) };
    }
    // Ladder's own header names decode without an allocation each (they are on every message)
    ladder_amqp::share_table_keys(ladder::model::protocol::header::ALL);
    let cli = Cli::parse();
    // completions and man pages need no config
    if let Some(code) = cli::docs::answer(&cli.command) {
        return code;
    }
    tracing_subscriber::fmt()
        .fmt_fields(cli::log::inert_fields())
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();

    let env: HashMap<String, String> = std::env::vars().collect();
    let config = match config::load(&cli.config, &env) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("ladder: invalid config: {e}");
            return ExitCode::from(exit::CONFIG);
        }
    };
    match cli.command {
        Command::Check => runtime().block_on(cli::check(&config)),
        Command::Plan { broker_version } => runtime().block_on(cli::plan(&config, broker_version)),
        Command::Apply => runtime().block_on(cli::serve::apply(&config)),
        Command::Prune(args) => runtime()
            .block_on(cli::prune::prune(&config, args))
            .unwrap_or_else(failed),
        Command::Run { no_dev_broker } => runtime().block_on(cli::serve::run(config, &env, !no_dev_broker)),
        Command::Demo(args) => runtime().block_on(cli::demo::demo(&config, args)),
        Command::Probe => runtime().block_on(cli::probe::probe(&config)),
        Command::Completions { .. } | Command::Man { .. } => unreachable!("answered before the config is read"),
        // decoding, printing and dropping a record whose headers nest deeply recurse once per
        // level, on the thread that drives the command: give it the service's stack
        Command::Parked(args) => {
            on_deep_stack(|| runtime().block_on(cli::parked::parked(&config, *args, &env))).unwrap_or_else(failed)
        }
        Command::Scheduled(args) => runtime()
            .block_on(cli::scheduled::scheduled(&config, args))
            .unwrap_or_else(failed),
        Command::Hold(args) => runtime()
            .block_on(cli::holds::hold(&config, args))
            .unwrap_or_else(failed),
        Command::Resume(args) => runtime()
            .block_on(cli::holds::resume(&config, args))
            .unwrap_or_else(failed),
        Command::Holds(args) => runtime()
            .block_on(cli::holds::holds(&config, args))
            .unwrap_or_else(failed),
    }
}

/// The exit code for an operator command that failed, after saying why.
fn failed(e: anyhow::Error) -> ExitCode {
    eprintln!("ladder: {e:#}");
    ExitCode::from(
        match e
            .downcast_ref::<parking::ParkingError>()
            .map(parking::ParkingError::kind)
        {
            Some(parking::ErrorKind::Unavailable) => exit::UNAVAILABLE,
            Some(parking::ErrorKind::Caller) => exit::CONFIG,
            Some(parking::ErrorKind::Conflict) => exit::BUSY,
            Some(parking::ErrorKind::Missing | parking::ErrorKind::Internal) | None => exit::FAILED,
        },
    )
}

/// Runs `work` on a thread with [`ladder::DEEP_STACK_BYTES`] of stack, as the runtime's worker
/// threads have: `block_on` drives its future on the calling thread, whose stack (8 MiB for the
/// main thread) a record nested tens of thousands of levels deep would overflow.
fn on_deep_stack<T: Send>(work: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        let worker = std::thread::Builder::new()
            .name("ladder-command".into())
            .stack_size(ladder::DEEP_STACK_BYTES)
            .spawn_scoped(scope, work)
            .expect("a thread for the command starts");
        worker.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(ladder::DEEP_STACK_BYTES)
        .build()
        .expect("the tokio runtime starts")
}
