//! `ladder-bench decide`: the ladder's own per-message work in isolation — the protocol
//! decision of the intake hop and of the due hop on a typical retry — timed without a broker,
//! so its share of the service's CPU per retry can be told apart from the client library's and
//! the kernel's. Deterministic enough for `valgrind --tool=callgrind`.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Instant;

use anyhow::{Result, anyhow};
use ladder::broker::topology::Names;
use ladder::model::protocol::{Arrival, Decision, HopContext};
use ladder_amqp::{BasicProperties, FieldTable};

use crate::broker::text;

/// What the decide subcommand is told.
#[derive(Debug, Clone, clap::Args)]
pub struct DecideArgs {
    /// Retries to decide (each: one intake and one due decision).
    #[arg(long, default_value_t = 200_000)]
    pub n: u64,
}

/// Times `n` intake + due decisions and prints ns per retry.
pub fn run(args: DecideArgs) -> Result<()> {
    let dir = std::env::temp_dir().join(format!("ladder-bench-decide-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("ladders"))?;
    std::fs::write(dir.join("ladder.toml"), "namespace = \"bench\"\n")?;
    std::fs::write(
        dir.join("ladders").join("qalo.toml"),
        "backoff = [\"1s\"]\nallow = [\"^bench-\"]\n",
    )?;
    let config = ladder::config::load(&dir.join("ladder.toml"), &HashMap::new()).map_err(|e| anyhow!("{e}"));
    let _ = std::fs::remove_dir_all(&dir);
    let config = config?;
    let spec = &config.ladders[0];
    let names = Names::of(&config.namespace, spec);
    let ctx = HopContext {
        spec,
        names: &names,
        limits: &config.limits,
    };
    // as the benchmark's load generator sends it
    let mut headers = FieldTable::new();
    headers.set("retry-to", text("bench-1-0-dest-qalo"));
    let props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("text/plain")
        .with_headers(headers);
    // what the due hop receives: the intake's forward as the tier passes it on (made once; the
    // service publishes it without making this copy)
    let Decision::Forward(first) = ctx.intake(&props, 1_763_766_000_000) else {
        return Err(anyhow!("the intake parked a good message"));
    };
    let waited = first.properties;
    let started = Instant::now();
    let mut forwarded = 0u64;
    for i in 0..args.n {
        let now = 1_763_766_000_000 + i;
        let Decision::Forward(f) = ctx.intake_at(black_box(&props), &Arrival::at(now)) else {
            return Err(anyhow!("the intake parked a good message"));
        };
        black_box(f);
        if let Decision::Forward(g) = ctx.due_at(black_box(&waited), &Arrival::at(now + 1000)) {
            forwarded += 1;
            black_box(g);
        }
    }
    let ns = started.elapsed().as_nanos() as f64 / args.n as f64;
    println!(
        "{} retries decided ({forwarded} forwarded): {ns:.0} ns per retry (intake + due decision) = {:.3} CPU s per 10 000",
        args.n,
        ns * 10_000.0 / 1e9
    );
    Ok(())
}
