//! The previous release, built from the git history, and this one on the same broker: a
//! rolling deploy in place (issue 36, "Upgrade in place") and this release reading what the
//! previous one wrote (issue 39, "Ladder upgrade"): parked entries, a resolution, a hold and a
//! cancellation.
//!
//! The previous release is [`PREVIOUS`], extracted with `git archive` under `target/previous/`
//! and built once into the same target directory (its dependencies are this build's), its
//! binary renamed `ladder-previous` so it replaces nothing of this build.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use ladder::broker::topology::Names;
use ladder_amqp::{BasicProperties, FieldTable};

/// The previous release: the last commit that landed before the namespace's ladders shared
/// their tier queues (each ladder declared its own `N.L.delay.<tier>`).
const PREVIOUS: &str = "5b906a5";

const LADDER: &str = r#"
backoff = ["1s", "2s"]
max_attempts = 3
exact_delays = true
allow = ["^{ns}-"]
"#;

const MESSAGES: usize = 200;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Builds the previous release's binary (once: later runs find it fresh) and returns its path.
fn previous_binary() -> PathBuf {
    let root = repo();
    let src = root.join("target").join("previous").join(PREVIOUS);
    if !src.join("Cargo.toml").exists() {
        std::fs::create_dir_all(&src).unwrap();
        let archive = Command::new("git")
            .current_dir(&root)
            .args(["archive", "--format=tar", PREVIOUS])
            .output()
            .expect("git runs");
        assert!(
            archive.status.success(),
            "the previous release {PREVIOUS} is not in this checkout's history (a shallow clone?): {}",
            String::from_utf8_lossy(&archive.stderr)
        );
        let mut untar = Command::new("tar")
            .current_dir(&src)
            .args(["-x", "-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        untar.stdin.take().unwrap().write_all(&archive.stdout).unwrap();
        assert!(untar.wait().unwrap().success());
        // its binary under another name, so it never replaces this build's `ladder`
        let manifest = src.join("Cargo.toml");
        let text = std::fs::read_to_string(&manifest).unwrap();
        let renamed = text
            .replace("[[bin]]\nname = \"ladder\"", "[[bin]]\nname = \"ladder-previous\"")
            .replace("default-run = \"ladder\"", "default-run = \"ladder-previous\"");
        assert_ne!(text, renamed, "the previous manifest names its binary as expected");
        std::fs::write(&manifest, renamed).unwrap();
    }
    let built = Command::new(env!("CARGO"))
        .current_dir(&src)
        .args([
            "build",
            "--locked",
            "-p",
            "ladder",
            "--bin",
            "ladder-previous",
            "--target-dir",
        ])
        .arg(root.join("target"))
        .status()
        .expect("cargo runs");
    assert!(built.success(), "the previous release builds");
    root.join("target").join("debug").join("ladder-previous")
}

/// One `ladder run` process, of either release.
struct Service {
    child: Child,
    what: &'static str,
}

impl Service {
    fn start(binary: &Path, config: &Path, log: &Path, what: &'static str) -> Self {
        let child = Command::new(binary)
            .arg("--config")
            .arg(config)
            .arg("run")
            .env("RUST_LOG", "info")
            .env_remove("RUST_MIN_STACK")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .expect("the service starts");
        Service { child, what }
    }

    async fn terminate(mut self) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let what = format!("the {} service exits", self.what);
        let child = &mut self.child;
        let status = eventually(&what, WAIT, async || child.try_wait().unwrap()).await;
        assert!(status.success(), "{what}: {status}");
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deletes the namespace's objects whatever happens.
struct Cleanup(Vec<String>, Vec<String>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        delete_all_blocking(std::mem::take(&mut self.0), std::mem::take(&mut self.1));
    }
}

fn command(binary: &Path, config: &Path, args: &[&str]) -> std::process::Output {
    let out = Command::new(binary)
        .arg("--config")
        .arg(config)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("the binary runs");
    assert!(
        out.status.success(),
        "{} {args:?}: {}\n{}",
        binary.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

async fn wait_consumers(conn: &ladder_amqp::Connection, queue: &str, at_least: u32) {
    eventually(&format!("{at_least} consumers on {queue}"), WAIT, async || {
        let ch = conn.create_channel().await.ok()?;
        let q = ch.queue_inspect(queue).await.ok()?;
        let _ = ch.close(200, "peeked").await;
        (q.consumer_count >= at_least).then_some(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_deploy_from_the_previous_release_loses_nothing_and_reads_its_records() {
    let previous = previous_binary();
    let current = PathBuf::from(env!("CARGO_BIN_EXE_ladder"));
    let ns = unique_namespace("upgrade");
    let dir = tempfile::tempdir().unwrap();
    let config_path = write_config(dir.path(), &ns, ADMIN_ANY_PORT, "default", LADDER);
    let config = ladder::config::load(&config_path, &HashMap::new()).unwrap();
    let names = Names::new(&ns, "default");
    let (mut queues, mut exchanges) = declared_names(&config);
    let orders = format!("{ns}-orders");
    let held = format!("{ns}-held");
    queues.extend([orders.clone(), held.clone(), names.held_queue(&held)]);
    // what the previous release declared beyond this one's plan: the ladder's own tiers
    exchanges.extend([names.intake_exchange.clone()]);
    queues.extend(
        config.ladders[0]
            .tiers
            .iter()
            .map(|tier| names.own_tier_queue_named(&tier.name)),
    );
    let _cleanup = Cleanup(queues, exchanges);

    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let durable = ladder_amqp::QueueOptions {
        durable: true,
        ..Default::default()
    };
    let mut dl = FieldTable::default();
    dl.set("x-dead-letter-exchange", text(&names.intake_exchange));
    ch.queue_declare(&held, durable, FieldTable::default()).await.unwrap();

    // the previous release serves alone
    let old = Service::start(&previous, &config_path, &dir.path().join("old.log"), "previous");
    wait_consumers(&conn, &names.due, 1).await;
    ch.queue_declare(&orders, durable, dl).await.unwrap();

    // its records: two parked entries (exhausted at once), one of them discarded (a
    // resolution), a hold, and a cancelled retry
    for id in ["parked-1", "parked-2"] {
        let props = retry_props(&orders, Some(3)).with_message_id(id).with_delivery_mode(2);
        publish(&ch, &names.intake_exchange, "", b"parked", props).await;
    }
    let list = eventually("the previous release parked two", WAIT, async || {
        let out = command(&previous, &config_path, &["parked", "list", "--stream"]);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        (text.matches("max-attempts").count() == 2).then_some(text)
    })
    .await;
    eprintln!("parked by the previous release:\n{list}");
    command(
        &previous,
        &config_path,
        &["parked", "discard", "--stream", "--yes", "--message-id", "parked-2"],
    );
    command(&previous, &config_path, &["hold", &held, "--why", "upgrade test"]);
    publish(
        &ch,
        &names.intake_exchange,
        "",
        b"cancelled",
        retry_props(&orders, None)
            .with_message_id("cancel-me")
            .with_delivery_mode(2),
    )
    .await;
    command(&previous, &config_path, &["scheduled", "cancel", "cancel-me"]);

    // traffic: every message fails twice and is taken on its last retry
    let ids: HashSet<String> = (0..MESSAGES).map(|i| format!("m{i}")).collect();
    for id in &ids {
        let props = BasicProperties::default()
            .with_message_id(id.as_str())
            .with_delivery_mode(2);
        publish(&ch, "", &orders, b"order", props).await;
    }
    let mut destination = consume(&conn, &orders).await;
    let mut done: HashMap<String, usize> = HashMap::new();
    let mut cancelled_delivered = false;
    let mut old = Some(old);
    let mut new = None;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(90);
    while done.len() < MESSAGES {
        assert!(
            Instant::now() < deadline,
            "only {} of {MESSAGES} reached their last retry",
            done.len()
        );
        // the rolling deploy: the new release joins after 1.2 s (first retries are being
        // delivered by the previous one), the previous one leaves a second later (second
        // retries wait in the tiers)
        if new.is_none() && started.elapsed() > Duration::from_millis(1_200) {
            new = Some(Service::start(
                &current,
                &config_path,
                &dir.path().join("new.log"),
                "current",
            ));
        }
        if old.is_some() && started.elapsed() > Duration::from_millis(2_200) {
            old.take().unwrap().terminate().await;
        }
        let Some(d) = next_within(&mut destination, Duration::from_millis(200)).await else {
            continue;
        };
        let id = message_id(&d);
        if id == "cancel-me" {
            cancelled_delivered = true;
        }
        if !ids.contains(id) {
            destination.ack(&d);
            continue;
        }
        // the previous release's due hop may deliver a repeat failure without counting it
        // (one retry more for that message); never fewer
        let attempt = int_header(&d, "retry-attempt").unwrap_or(0);
        assert!(attempt <= 3, "{id}: attempt {attempt}");
        if attempt < 2 {
            destination.reject(&d, false);
        } else {
            *done.entry(id.to_string()).or_default() += 1;
            destination.ack(&d);
        }
    }
    let duplicates: usize = done.values().map(|n| n - 1).sum();
    eprintln!(
        "{MESSAGES} messages through a rolling deploy in {:?}: {duplicates} delivered twice on their last retry",
        started.elapsed()
    );
    assert!(
        !cancelled_delivered,
        "a retry cancelled through the previous release was delivered"
    );
    let new = new.expect("the new release ran");
    assert!(
        old.is_none(),
        "the previous release left while retries were still waiting"
    );

    // this release reads what the previous one wrote
    let out = command(&current, &config_path, &["parked", "list", "--stream"]);
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        list.contains("parked-1") || list.matches("max-attempts").count() >= 1,
        "{list}"
    );
    let cancelled = eventually("the cancelled retry is parked as cancelled", WAIT, async || {
        let out = command(
            &current,
            &config_path,
            &["parked", "list", "--stream", "--reason", "cancelled"],
        );
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.contains("cancelled").then_some(text)
    })
    .await;
    eprintln!("{cancelled}");
    let unresolved = command(
        &current,
        &config_path,
        &["parked", "list", "--stream", "--reason", "max-attempts"],
    );
    let unresolved = String::from_utf8_lossy(&unresolved.stdout).to_string();
    eprintln!("{unresolved}");
    let holds = command(&current, &config_path, &["holds"]);
    let holds = String::from_utf8_lossy(&holds.stdout).to_string();
    assert!(holds.contains(&held), "the hold made by the previous release: {holds}");
    // the one unresolved entry replays through this release to its queue
    command(
        &current,
        &config_path,
        &["parked", "replay", "--stream", "--reason", "max-attempts"],
    );
    let replayed = eventually("the unresolved entry replays", WAIT, async || {
        let d = next_within(&mut destination, Duration::from_millis(200)).await?;
        destination.ack(&d);
        (message_id(&d) == "parked-1").then(|| message_id(&d).to_string())
    })
    .await;
    assert_eq!(replayed, "parked-1", "the discarded one stays resolved");
    assert!(
        next_within(&mut destination, Duration::from_secs(2)).await.is_none(),
        "the entry the previous release discarded was not replayed"
    );

    // the tiers the previous release declared for the ladder drained into its due queue; they
    // are listed as retired and pruned, and the shared ones stay
    let own = names.own_tier_queue_named("1s");
    assert!(
        depth(&conn, &own).await.is_some(),
        "the previous release declared {own}"
    );
    let check = command(&current, &config_path, &["check"]);
    let text = String::from_utf8_lossy(&check.stdout).to_string();
    assert!(
        text.contains(&format!("retired queue {own} (ladder default, delay.1s)")),
        "{text}"
    );
    let pruned = command(&current, &config_path, &["prune", "--wait", "30s"]);
    let text = String::from_utf8_lossy(&pruned.stdout).to_string();
    assert_eq!(pruned.status.code(), Some(0), "{text}");
    eprintln!("{text}");
    for tier in &config.ladders[0].tiers {
        let own = names.own_tier_queue_named(&tier.name);
        assert_eq!(depth(&conn, &own).await, None, "{own} is pruned");
        let shared = names.tier_queue(tier);
        assert!(depth(&conn, &shared).await.is_some(), "{shared} stays");
    }
    new.terminate().await;
}
