//! The previous release, built from the git history, and this one on the same broker: a
//! rolling deploy in place (issue 36, "Upgrade in place") and this release reading what the
//! previous one wrote (issue 39, "Ladder upgrade"): parked entries, a resolution, a hold and a
//! cancellation.
//!
//! Each release of before is a [`Previous`], extracted with `git archive` under
//! `target/previous/` and built once into the same target directory (its dependencies are this
//! build's), its binary renamed `ladder-previous-<commit>` so it replaces nothing of this build.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use ladder::broker::topology::Names;
use ladder_amqp::{BasicProperties, FieldTable, FieldValue};

/// A release of before that a deployment upgrades from.
#[derive(Clone, Copy)]
struct Previous {
    commit: &'static str,
    /// Its ladders declare their own tiers and delay levels (`N.L.delay.<tier>`); otherwise the
    /// namespace's (`N.delay.<tier>`).
    own_tiers: bool,
}

/// The name the releases of before gave a tier, a level too: its delay in compact humantime
/// (`4s96ms`; today a level is `level-4.1s`).
fn old_name(tier: &ladder::model::ladder::Tier) -> String {
    ladder::model::ladder::compact_duration(tier.delay)
}

impl Previous {
    /// The queue where this release waits a message `tier` (by its name of before).
    fn tier_queue(self, names: &Names, tier: &str) -> String {
        if self.own_tiers {
            names.own_tier_queue_named(tier)
        } else {
            names.tier_queue_named(tier)
        }
    }
}

/// The release users ran when issue 36 was filed, the last commit before one hop per retry.
/// `N.L` is bound straight to `N.L.intake` (no `N.L.next`, no `retry-next`), and each ladder
/// declares its own tiers and delay levels, `N.L.delay.<tier>`, dead-lettering into `N.L.due`.
/// It has every record the second half reads (parked entries, resolutions, holds,
/// cancellations).
const BEFORE_ONE_HOP: Previous = Previous {
    commit: "903c5df",
    own_tiers: true,
};

/// The last release before layout 3: one hop, shared tiers, and `N.L` a fanout exchange bound
/// to `N.L.next`, whose alternate `N.L.first` leads through `N.L.sort` to the intake.
const BEFORE_LAYOUT_3: Previous = Previous {
    commit: "a2d534d",
    own_tiers: false,
};

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
///
/// Its workspace crates are renamed (`ladder-previous`, `ladder-amqp-previous`; their library
/// names stay `ladder` and `ladder_amqp`, so its code builds as it is) before it is built into
/// this build's target directory: cargo names a workspace crate's artifacts by its package name
/// and its path relative to the workspace root, the same for both releases, and `git archive`
/// dates the files at their commit, so under the same names cargo took this build's
/// `ladder-amqp` for the previous release's (measured: 903c5df then failed to compile against
/// this client's `ConnectOptions`) or would replace this build's with it. Renamed, they are
/// built apart, and every dependency from crates.io is shared (the locks agree).
fn previous_binary(previous: Previous) -> PathBuf {
    let commit = previous.commit;
    let package = format!("ladder-previous-{commit}");
    let root = repo();
    let src = root.join("target").join("previous").join(commit);
    let renamed = src.join(".renamed");
    if !renamed.exists() {
        let _ = std::fs::remove_dir_all(&src);
        std::fs::create_dir_all(&src).unwrap();
        let archive = Command::new("git")
            .current_dir(&root)
            .args(["archive", "--format=tar", commit])
            .output()
            .expect("git runs");
        assert!(
            archive.status.success(),
            "the previous release {commit} is not in this checkout's history (a shallow clone?): {}",
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
        edit_manifest(
            commit,
            &src.join("Cargo.toml"),
            &[
                (
                    "[package]\nname = \"ladder\"\n",
                    &format!("[package]\nname = \"{package}\"\n"),
                ),
                ("[lib]\n", "[lib]\nname = \"ladder\"\n"),
                // its binary under another name, so it never replaces this build's `ladder`
                ("[[bin]]\nname = \"ladder\"", &format!("[[bin]]\nname = \"{package}\"")),
                ("default-run = \"ladder\"", &format!("default-run = \"{package}\"")),
                (
                    "ladder-amqp = { path = \"amqp\" }",
                    &format!("ladder-amqp = {{ package = \"ladder-amqp-previous-{commit}\", path = \"amqp\" }}"),
                ),
                // the benchmark names the crates by their old names; it is not built here
                ("members = [\".\", \"amqp\", \"bench\"]", "members = [\".\", \"amqp\"]"),
            ],
        );
        edit_manifest(
            commit,
            &src.join("amqp").join("Cargo.toml"),
            &[
                (
                    "[package]\nname = \"ladder-amqp\"\n",
                    &format!("[package]\nname = \"ladder-amqp-previous-{commit}\"\n"),
                ),
                (
                    "\n[dependencies]\n",
                    "\n[lib]\nname = \"ladder_amqp\"\n\n[dependencies]\n",
                ),
            ],
        );
        std::fs::write(&renamed, commit).unwrap();
    }
    // not --locked: the lock's two renamed path crates are written again (nothing from
    // crates.io changes). Without the variables `cargo test` gave this process: a build script
    // that watches one (ring's, CARGO_MANIFEST_DIR) would run again, and build its crate again
    // for this build next time.
    let mut build = Command::new(env!("CARGO"));
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().to_string();
        if key.starts_with("CARGO_") && key != "CARGO_HOME" {
            build.env_remove(key);
        }
    }
    let built = build
        .current_dir(&src)
        .args(["build", "-p", &package, "--bin", &package, "--target-dir"])
        .arg(root.join("target"))
        .status()
        .expect("cargo runs");
    assert!(built.success(), "the previous release builds");
    root.join("target").join("debug").join(package)
}

/// Replaces each `(from, to)` once in the manifest at `path`; each `from` must be there.
fn edit_manifest(commit: &str, path: &Path, edits: &[(&str, &str)]) {
    let mut text = std::fs::read_to_string(path).unwrap();
    for (from, to) in edits {
        assert!(text.contains(from), "{} of {commit} has {from:?}", path.display());
        text = text.replacen(from, to, 1);
    }
    std::fs::write(path, text).unwrap();
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

    /// Sends SIGTERM: the service drains and exits (see [`Service::exited`]).
    fn signal_term(&self) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    }

    /// Whether the process has exited, and then that it exited well.
    fn exited(&mut self) -> bool {
        let Some(status) = self.child.try_wait().unwrap() else {
            return false;
        };
        assert!(status.success(), "the {} service exits: {status}", self.what);
        true
    }

    async fn terminate(mut self) {
        self.signal_term();
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

/// The tiers 903c5df declared for the ladder (its steps and its delay levels) drain into its
/// due queue; they are listed as retired and pruned, and the shared ones stay.
async fn own_tiers_retired_and_pruned(
    conn: &ladder_amqp::Connection,
    current: &Path,
    config_path: &Path,
    names: &Names,
    config: &ladder::config::Config,
) {
    let drained = eventually_ok("the previous release's own tiers drain", WAIT, async || {
        let depths = tier_depths(BEFORE_ONE_HOP, conn, names, config).await;
        match depths.iter().all(|(_, n)| *n == 0) {
            true => Ok(depths),
            false => Err(format!("{depths:?}")),
        }
    })
    .await;
    assert_eq!(drained.len(), config.ladders[0].tiers.len());
    let check = command(current, config_path, &["check"]);
    let text = String::from_utf8_lossy(&check.stdout).to_string();
    for tier in &config.ladders[0].tiers {
        let own = names.own_tier_queue_named(&old_name(tier));
        assert!(
            text.contains(&format!(
                "retired queue {own} (ladder default, delay.{})",
                old_name(tier)
            )),
            "{own} is not listed as retired: {text}"
        );
    }
    let pruned = command(current, config_path, &["prune", "--wait", "30s"]);
    let text = String::from_utf8_lossy(&pruned.stdout).to_string();
    assert_eq!(pruned.status.code(), Some(0), "{text}");
    eprintln!("{text}");
    for tier in &config.ladders[0].tiers {
        let own = names.own_tier_queue_named(&old_name(tier));
        assert_eq!(depth(conn, &own).await, None, "{own} is pruned");
        let shared = names.tier_queue(tier);
        assert!(depth(conn, &shared).await.is_some(), "{shared} stays");
    }
}

/// The exchanges only a2d534d's first failures took (`N.L.sort`, `N.L.wait`) are listed as
/// retired and pruned.
async fn old_exchanges_retired_and_pruned(
    conn: &ladder_amqp::Connection,
    current: &Path,
    config_path: &Path,
    names: &Names,
) {
    let gone = [format!("{}.sort", names.exchange), format!("{}.wait", names.exchange)];
    let check = command(current, config_path, &["check"]);
    let text = String::from_utf8_lossy(&check.stdout).to_string();
    for exchange in &gone {
        assert!(
            text.contains(&format!("retired exchange {exchange} ")),
            "{exchange} is not listed as retired: {text}"
        );
    }
    let pruned = command(current, config_path, &["prune"]);
    let text = String::from_utf8_lossy(&pruned.stdout).to_string();
    assert_eq!(pruned.status.code(), Some(0), "{text}");
    eprintln!("{text}");
    for exchange in &gone {
        assert!(!exchange_exists(conn, exchange).await, "{exchange} is pruned");
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

/// Every how long one wave of [`PER_WAVE`] new messages is published, [`WAVES`] in all (200):
/// traffic that goes on through the deploy, so that each stage of a retry meets the switch.
const WAVE_EVERY: Duration = Duration::from_millis(500);
const WAVES: usize = 5;
const PER_WAVE: usize = MESSAGES / WAVES;

/// Scheduled deliveries published through the previous release before the switch: they wait in
/// its own delay levels (`N.L.delay.4s96ms` for 4 s, then the shorter ones) when the new
/// release starts.
const SCHEDULED: usize = 20;
const SCHEDULED_DELAY_MS: u64 = 5_000;

/// How long both releases serve together: longer than the `2s` step, so that repeat failures the
/// new release routed past the intake come due while the previous one still takes from `N.L.due`.
const BOTH: Duration = Duration::from_millis(2_500);

/// How far before the new release starts and after its consumers are up a failure may still be
/// routed twice (see the duplicates' bound in the test): the previous intake's and the
/// dead-lettering's latency, with room for a busy machine.
const SWITCH_MARGIN: Duration = Duration::from_millis(500);

/// The tier queues the previous release waits in (steps and delay levels) and how many messages
/// each holds now.
async fn tier_depths(
    previous: Previous,
    conn: &ladder_amqp::Connection,
    names: &Names,
    config: &ladder::config::Config,
) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for tier in &config.ladders[0].tiers {
        let queue = previous.tier_queue(names, &old_name(tier));
        let (ready, _) = depth(conn, &queue)
            .await
            .unwrap_or_else(|| panic!("the previous release declared {queue}"));
        out.push((old_name(tier), ready));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_deploy_from_the_previous_release_loses_nothing_and_reads_its_records() {
    rolling_deploy(BEFORE_ONE_HOP).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_deploy_from_the_release_before_layout_3_loses_nothing_and_keeps_its_fanout_entry() {
    rolling_deploy(BEFORE_LAYOUT_3).await;
}

/// A rolling deploy from `release`, with retries and scheduled deliveries waiting in its tiers,
/// and this release reading what it wrote; then the objects of before retired and pruned.
async fn rolling_deploy(release: Previous) {
    let previous = previous_binary(release);
    let current = PathBuf::from(env!("CARGO_BIN_EXE_ladder"));
    let ns = unique_namespace(&format!("upgrade-{}", release.commit));
    let dir = tempfile::tempdir().unwrap();
    let config_path = write_config(dir.path(), &ns, ADMIN_ANY_PORT, "default", LADDER);
    let config = ladder::config::load(&config_path, &HashMap::new()).unwrap();
    let names = Names::new(&ns, "default");
    let (mut queues, mut exchanges) = declared_names(&config);
    let orders = format!("{ns}-orders");
    let held = format!("{ns}-held");
    queues.extend([orders.clone(), held.clone(), names.held_queue(&held)]);
    // what the previous release declared beyond this one's plan: the ladder's own tiers, and
    // the exchanges of before
    let old = ladder::model::upgrade::OldNames::of(&names);
    exchanges.extend([
        old.next,
        old.first,
        old.sort,
        old.tiers,
        old.due,
        format!("{ns}.default.wait"),
    ]);
    queues.extend(config.ladders[0].tiers.iter().flat_map(|tier| {
        [
            names.own_tier_queue_named(&old_name(tier)),
            names.tier_queue_named(&old_name(tier)),
        ]
    }));
    let _cleanup = Cleanup(queues, exchanges);

    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let durable = ladder_amqp::QueueOptions {
        durable: true,
        ..Default::default()
    };
    let mut dl = FieldTable::default();
    dl.set("x-dead-letter-exchange", text(&names.exchange));
    ch.queue_declare(&held, durable, FieldTable::default()).await.unwrap();

    // the previous release serves alone, with its own way in and its own tiers
    let mut old = Service::start(&previous, &config_path, &dir.path().join("old.log"), "previous");
    wait_consumers(&conn, &names.due, 1).await;
    ch.queue_declare(&orders, durable, dl).await.unwrap();

    // its records: two parked entries (exhausted at once), one of them discarded (a
    // resolution), a hold, and a cancelled retry
    for id in ["parked-1", "parked-2"] {
        let props = retry_props(&orders, Some(3)).with_message_id(id).with_delivery_mode(2);
        publish(&ch, &names.exchange, "", b"parked", props).await;
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
        &names.exchange,
        "",
        b"cancelled",
        retry_props(&orders, None)
            .with_message_id("cancel-me")
            .with_delivery_mode(2),
    )
    .await;
    command(&previous, &config_path, &["scheduled", "cancel", "cancel-me"]);

    // traffic: every message fails twice (dead-lettered by `orders` into N.L) and is taken on
    // its second retry; waves of new messages go on through the deploy. Beside them, scheduled
    // deliveries the previous release puts into its own delay levels.
    let ids: HashSet<String> = (0..MESSAGES).map(|i| format!("m{i}")).collect();
    let mut scheduled_at: HashMap<String, u64> = HashMap::new();
    for i in 0..SCHEDULED {
        let id = format!("s{i}");
        let mut props = retry_props(&orders, None)
            .with_message_id(id.as_str())
            .with_delivery_mode(2);
        let mut headers = props.headers.take().unwrap();
        headers.set("x-delay", FieldValue::LongLongInt(SCHEDULED_DELAY_MS as i64));
        props = props.with_headers(headers);
        scheduled_at.insert(id, now_ms());
        publish(&ch, &names.exchange, "", b"scheduled", props).await;
    }
    let mut destination = consume(&conn, &orders).await;
    // per message, each delivery's retry-attempt (0: the first delivery) and when it came
    let mut seen: HashMap<String, Vec<(i64, Instant)>> = HashMap::new();
    let mut done: HashMap<String, usize> = HashMap::new();
    let mut scheduled_seen: HashMap<String, usize> = HashMap::new();
    let mut failures: Vec<Instant> = Vec::new();
    let mut cancelled_delivered = false;
    let mut waves = 0;
    let mut new: Option<Service> = None;
    // when the new release was started, when its consumers were seen, when the previous one
    // was told to leave and when it had left
    let (mut switch_started, mut new_ready) = (None::<Instant>, None::<Instant>);
    let (mut old_told, mut old_left) = (None::<Instant>, None::<Instant>);
    let mut at_switch = Vec::new();
    // (ms since the start, messages in N.L.delay.2s, in N.L.delay.4s96ms) until the switch
    let mut probes: Vec<(u128, u32, u32)> = Vec::new();
    let mut last_probe = Instant::now();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(120);
    while done.len() < MESSAGES || scheduled_seen.len() < SCHEDULED || old_left.is_none() {
        assert!(
            Instant::now() < deadline,
            "only {} of {MESSAGES} reached their last retry, {} of {SCHEDULED} scheduled deliveries came \
             (new release started: {}, ready: {}, previous one left: {})",
            done.len(),
            scheduled_seen.len(),
            switch_started.is_some(),
            new_ready.is_some(),
            old_left.is_some()
        );
        if waves < WAVES && started.elapsed() >= WAVE_EVERY * waves as u32 {
            for i in waves * PER_WAVE..(waves + 1) * PER_WAVE {
                let props = BasicProperties::default()
                    .with_message_id(format!("m{i}").as_str())
                    .with_delivery_mode(2);
                publish(&ch, "", &orders, b"order", props).await;
            }
            waves += 1;
        }
        // the rolling deploy, by what the broker holds (passive declares at most every 100 ms):
        // the new release starts once second retries wait in the previous release's `2s`
        // tier and the scheduled deliveries in its own levels; it serves beside the previous one
        // for BOTH once its consumers are up; then the previous one leaves
        if last_probe.elapsed() >= Duration::from_millis(100) {
            last_probe = Instant::now();
            if switch_started.is_none() {
                let step = depth(&conn, &release.tier_queue(&names, "2s")).await.map_or(0, |d| d.0);
                let level = depth(&conn, &release.tier_queue(&names, "4s96ms"))
                    .await
                    .map_or(0, |d| d.0);
                probes.push((started.elapsed().as_millis(), step, level));
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "no retries waited in the previous release's tiers within 20 s: {probes:?}"
                );
                if step >= 10 && level >= 1 {
                    at_switch = tier_depths(release, &conn, &names, &config).await;
                    switch_started = Some(Instant::now());
                    new = Some(Service::start(
                        &current,
                        &config_path,
                        &dir.path().join("new.log"),
                        "current",
                    ));
                }
            } else if new_ready.is_none() {
                if depth(&conn, &names.due)
                    .await
                    .is_some_and(|(_, consumers)| consumers >= 2)
                {
                    new_ready = Some(Instant::now());
                }
            } else if old_told.is_none() && new_ready.unwrap().elapsed() >= BOTH {
                old.signal_term();
                old_told = Some(Instant::now());
            } else if old_told.is_some() && old_left.is_none() && old.exited() {
                old_left = Some(Instant::now());
            }
        }
        if let Some(told) = old_told {
            assert!(
                told.elapsed() < WAIT,
                "the previous release did not exit within {WAIT:?}"
            );
        }
        let Some(d) = next_within(&mut destination, Duration::from_millis(50)).await else {
            continue;
        };
        let id = message_id(&d).to_string();
        if id == "cancel-me" {
            cancelled_delivered = true;
        }
        if let Some(sent) = scheduled_at.get(&id) {
            let late = now_ms() as i64 - (sent + SCHEDULED_DELAY_MS) as i64;
            assert!(late >= 0, "{id} came {}ms early", -late);
            *scheduled_seen.entry(id).or_default() += 1;
            destination.ack(&d);
            continue;
        }
        if !ids.contains(&id) {
            destination.ack(&d);
            continue;
        }
        // never counted twice: a message's retries are numbered 1 and 2, nothing beyond
        let attempt = int_header(&d, "retry-attempt").unwrap_or(0);
        assert!(attempt <= 2, "{id}: attempt {attempt}, a failure was counted twice");
        seen.entry(id.clone()).or_default().push((attempt, Instant::now()));
        if attempt < 2 {
            failures.push(Instant::now());
            destination.reject(&d, false);
        } else {
            // the second retry's history names both failures once, in order, with their steps
            let history = d
                .properties
                .headers
                .as_ref()
                .and_then(|h| h.get("retry-history"))
                .map(ladder::model::protocol::parse_history)
                .unwrap_or_default();
            let steps: Vec<(u64, &str)> = history.iter().map(|e| (e.attempt, e.tier.as_str())).collect();
            assert_eq!(steps, [(1, "1s"), (2, "2s")], "{id}: retry-history");
            *done.entry(id).or_default() += 1;
            destination.ack(&d);
        }
    }
    let elapsed = started.elapsed();
    let (switch_started, new_ready, old_left) = (switch_started.unwrap(), new_ready.unwrap(), old_left.unwrap());
    let new = new.expect("the new release ran");
    drop(old);

    // messages were really waiting in the previous release's tiers and levels at the switch
    eprintln!("waiting in the previous release's tiers when the new release started: {at_switch:?}");
    let waiting = |steps: bool| -> u32 {
        at_switch
            .iter()
            .filter(|(tier, _)| config.ladders[0].steps.iter().any(|s| &s.name == tier) == steps)
            .map(|(_, n)| n)
            .sum()
    };
    assert!(
        waiting(true) > 0,
        "no retry waited in N.L.delay.<step>: {at_switch:?}; probed before: {probes:?}"
    );
    assert!(
        waiting(false) > 0,
        "no scheduled delivery waited in N.L.delay.<level>: {at_switch:?}; probed before: {probes:?}"
    );

    // Duplicates. The new release binds each new way in before it removes the old one: N.L to
    // N.L.next before N.L to N.L.intake, N.L.tiers to N.delay.<tier> before N.L.tiers to
    // N.L.delay.<tier> (this test does not restart the previous release, which would bind N.L to
    // N.L.intake again). A failure dead-lettered into N.L, or a retry the previous intake
    // publishes into N.L.tiers, between the two is routed both ways: a duplicate, never a loss.
    // Both moments are in the new release's `apply`, which comes before its consumers
    // subscribe, and each message fails at most once in it. So the bound: at most the failures
    // the consumer sent from SWITCH_MARGIN before the new release started (what the previous
    // intake still held) to SWITCH_MARGIN after its consumers were seen (the dead-lettering in
    // flight), no message more than once, and a message delivered twice failed in that span.
    let window = (switch_started - SWITCH_MARGIN, new_ready + SWITCH_MARGIN);
    let in_window = |at: &Instant| *at >= window.0 && *at <= window.1;
    let bound = failures.iter().filter(|at| in_window(at)).count();
    let duplicates: usize = done.values().map(|n| n - 1).sum();
    for (id, _) in done.iter().filter(|(_, n)| **n > 1) {
        assert!(
            seen[id].iter().any(|(attempt, at)| *attempt < 2 && in_window(at)),
            "{id} was delivered twice, and none of its failures was sent during the switch: {:?}",
            seen[id]
        );
    }
    let scheduled_duplicates: usize = scheduled_seen.values().map(|n| n - 1).sum();
    assert!(
        done.values().all(|n| *n <= 2),
        "a message was delivered three times: {done:?}"
    );
    assert!(scheduled_seen.values().all(|n| *n <= 2), "{scheduled_seen:?}");
    // A first retry delivered again without a fork: the previous release's due hop takes a
    // repeat failure the new release routed past the intake as a wait it scheduled and delivers
    // it uncounted (one retry more for that message, docs/src/concepts/topology.md). Only while
    // the previous release serves.
    let mut repeated = 0;
    for (id, deliveries) in &seen {
        let firsts: Vec<&Instant> = deliveries.iter().filter(|(a, _)| *a == 1).map(|(_, at)| at).collect();
        assert!(!firsts.is_empty(), "{id} skipped its first retry: {deliveries:?}");
        for at in firsts.iter().skip(1) {
            repeated += 1;
            assert!(
                **at <= old_left + Duration::from_secs(1),
                "{id}: a first retry came again after the previous release had left ({:?} after)",
                at.duration_since(old_left)
            );
        }
    }
    eprintln!(
        "{MESSAGES} messages and {SCHEDULED} scheduled deliveries through a rolling deploy in {elapsed:?} \
         (new release started at {:?}, ready {:?} later; both served {BOTH:?}; the previous one left at {:?}): \
         {duplicates} delivered twice on their last retry, {scheduled_duplicates} scheduled delivered twice \
         (bound: {bound} failures in the switch), {repeated} first retries delivered again uncounted",
        switch_started - started,
        new_ready - switch_started,
        old_left - started,
    );
    assert!(
        duplicates + scheduled_duplicates <= bound,
        "{duplicates} + {scheduled_duplicates} duplicates, more than the {bound} failures sent while \
         the new release switched the topology"
    );
    assert!(
        !cancelled_delivered,
        "a retry cancelled through the previous release was delivered"
    );

    // this release reads what the previous one wrote
    let out = command(&current, &config_path, &["parked", "list", "--stream"]);
    let list = String::from_utf8_lossy(&out.stdout).to_string();
    eprintln!("{list}");
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

    if release.own_tiers {
        own_tiers_retired_and_pruned(&conn, &current, &config_path, &names, &config).await;
    } else {
        old_exchanges_retired_and_pruned(&conn, &current, &config_path, &names).await;
    }
    // what stays of before still leads a failure in, once
    let forwarded = ladder::model::upgrade::OldNames::of(&names);
    for kept in [&forwarded.next, &forwarded.first] {
        assert!(
            exchange_exists(&conn, kept).await,
            "{kept} is kept: N.L forwards through it"
        );
    }
    let props = BasicProperties::default()
        .with_message_id("after-prune")
        .with_delivery_mode(2);
    publish(&ch, "", &orders, b"after", props).await;
    let mut attempts = Vec::new();
    while attempts.len() < 2 {
        let d = eventually("the message after the prune", WAIT, async || {
            next_within(&mut destination, Duration::from_millis(200)).await
        })
        .await;
        assert_eq!(message_id(&d), "after-prune");
        attempts.push(int_header(&d, "retry-attempt").unwrap_or(0));
        if attempts.len() == 1 {
            destination.reject(&d, false);
        } else {
            destination.ack(&d);
        }
    }
    assert_eq!(attempts, [0, 1], "failed once, retried once");
    assert!(
        next_within(&mut destination, Duration::from_secs(2)).await.is_none(),
        "the failure after the prune was retried twice"
    );
    new.terminate().await;
}
