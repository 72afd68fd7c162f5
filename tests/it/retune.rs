//! Re-tuning a ladder as the platform team does (the book's operations/changing-a-ladder.md):
//! a tier taken out of a ladder keeps its promise and is shown while it drains (`ladder
//! check`, `ladder plan`, the log's state, `/api/ladders`), `ladder prune` removes it only once
//! it is empty (`--wait` waits for it to drain); a retired ladder is pruned whole, never another
//! namespace's objects nor what the config uses; an object the broker holds with other arguments
//! is named by check and plan; SIGHUP reloads the files without a restart, losing and doubling
//! nothing (a removed ladder's waiting retries wait in its due queue until its file is back).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ladder_amqp::{BasicProperties, Connection, FieldTable};

use crate::common::*;

fn failure(id: &str, destination: &str) -> BasicProperties {
    retry_props(destination, None).with_message_id(id).with_delivery_mode(2)
}

fn out(o: &std::process::Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Receives until every id of `ids` arrived, acking; panics on a duplicate or after `within`.
async fn receive_each_once(consumer: &mut TestConsumer, ids: &HashSet<String>, within: Duration) {
    let mut seen = HashSet::new();
    let got = tokio::time::timeout(within, async {
        while seen.len() < ids.len() {
            let d = next(consumer).await;
            let id = message_id(&d).to_string();
            assert!(ids.contains(&id), "an unknown message {id}");
            assert!(seen.insert(id.clone()), "{id} delivered twice");
            consumer.ack(&d);
        }
    })
    .await;
    assert!(got.is_ok(), "only {} of {} arrived", seen.len(), ids.len());
    // and nothing more comes
    assert!(
        next_within(consumer, Duration::from_millis(1500)).await.is_none(),
        "a delivery after all had arrived once"
    );
}

/// A tier taken out of the ladder: its waiting retries still arrive after the old delay and
/// exactly once; check, the service's drift state and `/api/ladders` show it with its messages;
/// prune refuses while it holds them, deletes it once it drained (`--wait`), and forgets it.
#[tokio::test]
async fn a_retired_tier_is_shown_drains_and_is_pruned_once_empty() {
    let mut t = TestLadder::configure("retune", "backoff = [\"8s\"]\nmax_attempts = 3\nallow = [\"^{ns}-\"]\n").await;
    t.start_service().await;
    let dest = t.declare_queue("dest", FieldTable::new()).await;
    let old_tier = format!("{}.delay.8s", t.ns);
    t.track_queue(&old_tier);
    let mut ids: HashSet<String> = (0..20).map(|i| format!("m{i}")).collect();
    for id in &ids {
        t.publish(&t.intake(), "", b"x", failure(id, &dest)).await;
    }
    eventually("20 retries wait in the 8 s tier", WAIT, async || {
        (depth(&t.client, &old_tier).await == Some((20, 0))).then_some(())
    })
    .await;

    // the platform team changes the file and restarts
    t.stop_service().await;
    let path = write_config(
        t.dir.path(),
        &t.ns,
        "",
        "default",
        "backoff = [\"1s\", \"2s\"]\nmax_attempts = 3\nallow = [\"^{ns}-\"]\n",
    );
    t.config = Arc::new(ladder::config::load(&path, &HashMap::new()).unwrap());
    t.start_service().await;
    let mut consumer = t.consume(&dest).await;

    let seen = t
        .state
        .drift
        .read()
        .unwrap()
        .clone()
        .expect("the service looked at drift");
    let retired: Vec<_> = seen
        .survey
        .retired
        .iter()
        .map(|r| (r.name.as_str(), r.messages))
        .collect();
    assert_eq!(retired, [(old_tier.as_str(), 20)], "{:?}", seen.survey);
    let by = seen.survey.retired[0].last_due_by_ms.expect("when the last is due");
    assert!(by > now_ms() && by <= now_ms() + 8_000, "last due by {by}");

    let check = run_ladder(&path, &["check"], &[]).await;
    assert_eq!(check.status.code(), Some(0), "{}", out(&check));
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(text.contains("1 retired, 0 differing"), "{}", out(&check));
    assert!(
        text.contains(&format!(
            "retired queue {old_tier} (shared by the namespace's ladders, delay.8s)"
        )),
        "{}",
        out(&check)
    );
    let plan = run_ladder(&path, &["plan"], &[]).await;
    assert!(
        String::from_utf8_lossy(&plan.stderr).contains("# broker")
            && String::from_utf8_lossy(&plan.stderr).contains(&old_tier),
        "{}",
        out(&plan)
    );
    assert!(
        !String::from_utf8_lossy(&plan.stdout).contains("delay.8s"),
        "{}",
        out(&plan)
    );

    // refused while it holds messages: kept as it is, exit 75. What has waited since before the
    // restart may have drained by now on a slow machine, so one more retry is put straight into
    // the retired tier (as a replica with the old config would): it waits there its whole 8 s,
    // so the tier certainly still holds it when the two commands below look
    put_into_tier(&t.channel, &old_tier, "probe", &dest).await;
    ids.insert("probe".into());
    let dry = run_ladder(&path, &["prune", "--dry-run"], &[]).await;
    assert!(
        String::from_utf8_lossy(&dry.stdout).contains(&format!("would keep   queue {old_tier}: holds")),
        "{}",
        out(&dry)
    );
    let refused = run_ladder(&path, &["prune"], &[]).await;
    assert_eq!(refused.status.code(), Some(75), "{}", out(&refused));
    assert!(
        String::from_utf8_lossy(&refused.stdout).contains(&format!("kept    queue {old_tier}: holds")),
        "{}",
        out(&refused)
    );
    assert!(depth(&t.client, &old_tier).await.is_some(), "the refused tier is kept");

    // the old tier keeps its promise; once drained, prune --wait deletes it
    receive_each_once(&mut consumer, &ids, WAIT).await;
    prune_deletes(&path, &t.client, &old_tier).await;
    // what the config uses is untouched, and the namespace no longer lists the tier
    assert!(depth(&t.client, &format!("{}.delay.1s", t.ns)).await.is_some());
    let check = run_ladder(&path, &["check"], &[]).await;
    assert!(
        String::from_utf8_lossy(&check.stdout).contains("0 retired, 0 differing"),
        "{}",
        out(&check)
    );

    // a new failure still takes the new ladder's way
    t.publish(&t.intake(), "", b"x", failure("after", &dest)).await;
    receive_each_once(&mut consumer, &HashSet::from(["after".to_string()]), WAIT).await;
}

/// `ladder prune --wait 20s` with the config at `path` exits 0, says it deleted `queue`, and
/// the queue is gone.
async fn prune_deletes(path: &Path, client: &Connection, queue: &str) {
    let pruned = run_ladder(path, &["prune", "--wait", "20s"], &[]).await;
    assert_eq!(pruned.status.code(), Some(0), "{}", out(&pruned));
    assert!(
        String::from_utf8_lossy(&pruned.stdout).contains(&format!("deleted queue {queue}")),
        "{}",
        out(&pruned)
    );
    assert_eq!(depth(client, queue).await, None, "{queue} is gone");
}

/// Puts a retry for `destination` straight into the tier queue `tier`, as a relay with a config
/// that still has the tier does: it waits the tier's TTL, comes due through `N.due` to ladder
/// `default` and is delivered.
async fn put_into_tier(channel: &ladder_amqp::Channel, tier: &str, id: &str, destination: &str) {
    let mut headers = FieldTable::new();
    headers.set("retry-to", text(destination));
    headers.set("retry-ladder", text("default"));
    let props = BasicProperties::default()
        .with_message_id(id)
        .with_delivery_mode(2)
        .with_headers(headers);
    publish(channel, "", tier, b"x", props).await;
}

/// `ladder prune --wait` started while a retired tier still holds retries: it neither deletes
/// the tier nor exits while they wait, deletes it once they left it (exit 0), and every one of
/// them is delivered once.
#[tokio::test]
async fn prune_wait_waits_for_a_retired_tier_to_drain_then_deletes_it() {
    let mut t = TestLadder::configure(
        "prunewait",
        "backoff = [\"3s\"]\nmax_attempts = 3\nallow = [\"^{ns}-\"]\n",
    )
    .await;
    t.start_service().await;
    let dest = t.declare_queue("dest", FieldTable::new()).await;
    let old_tier = format!("{}.delay.3s", t.ns);
    t.track_queue(&old_tier);
    let mut ids: HashSet<String> = (0..10).map(|i| format!("m{i}")).collect();
    for id in &ids {
        t.publish(&t.intake(), "", b"x", failure(id, &dest)).await;
    }
    eventually("10 retries wait in the 3 s tier", WAIT, async || {
        (depth(&t.client, &old_tier).await == Some((10, 0))).then_some(())
    })
    .await;
    t.stop_service().await;
    let path = write_config(
        t.dir.path(),
        &t.ns,
        "",
        "default",
        "backoff = [\"1s\"]\nmax_attempts = 3\nallow = [\"^{ns}-\"]\n",
    );
    t.config = Arc::new(ladder::config::load(&path, &HashMap::new()).unwrap());
    t.start_service().await;
    let mut consumer = t.consume(&dest).await;

    // one more retry, put in just now: the tier holds it for 3 s from here
    put_into_tier(&t.channel, &old_tier, "probe", &dest).await;
    let put_at = std::time::Instant::now();
    ids.insert("probe".into());
    let mut prune = tokio::process::Command::from(ladder_command(&path));
    prune
        .args(["prune", "--wait", "20s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut prune = prune.spawn().expect("ladder prune runs");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        prune.try_wait().unwrap().is_none(),
        "prune --wait ended while the tier still held a retry"
    );
    assert!(
        depth(&t.client, &old_tier).await.is_some_and(|(n, _)| n > 0),
        "the tier is kept while it holds retries"
    );

    let pruned = tokio::time::timeout(WAIT, prune.wait_with_output())
        .await
        .expect("prune --wait ends within the wait")
        .unwrap();
    let waited = put_at.elapsed();
    assert_eq!(pruned.status.code(), Some(0), "{}", out(&pruned));
    let stdout = String::from_utf8_lossy(&pruned.stdout);
    assert!(
        stdout.contains(&format!("deleted queue {old_tier}")),
        "{}",
        out(&pruned)
    );
    assert!(!stdout.contains("kept"), "{}", out(&pruned));
    // the tier could only be empty once the probe had waited its 3 s
    assert!(waited >= Duration::from_secs(3), "prune --wait ended after {waited:?}");
    assert_eq!(depth(&t.client, &old_tier).await, None, "the retired tier is gone");
    assert!(depth(&t.client, &format!("{}.delay.1s", t.ns)).await.is_some());
    // nothing it held was lost: every retry arrives, once
    receive_each_once(&mut consumer, &ids, WAIT).await;
}

/// A ladder whose file is gone: prune keeps it whole while its intake holds a message, then
/// deletes its queues and exchanges (its parking lot only with --with-parking-lot); the other
/// ladder and the same ladder in another namespace are untouched.
#[tokio::test]
async fn a_retired_ladder_is_pruned_whole_and_nothing_else() {
    let ns = unique_namespace("retire");
    let other = unique_namespace("retire-other");
    let (dir, dir_other) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let ladder = "backoff = [\"1s\"]\nmax_attempts = 2\nallow = [\"^x$\"]\n";
    let path = write_config(dir.path(), &ns, "", "a", ladder);
    write_config(dir.path(), &ns, "", "b", ladder);
    let path_other = write_config(dir_other.path(), &other, "", "b", ladder);
    let _cleanup = (Cleanup::for_config(&path), Cleanup::for_config(&path_other));
    for p in [&path, &path_other] {
        let applied = run_ladder(p, &["apply"], &[]).await;
        assert_eq!(applied.status.code(), Some(0), "{}", out(&applied));
    }
    std::fs::remove_file(dir.path().join("ladders/b.toml")).unwrap();
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    publish(
        &ch,
        "",
        &format!("{ns}.b.intake"),
        b"waiting",
        BasicProperties::default(),
    )
    .await;

    // check lists the retired ladder's objects, what waits in them, and that nobody serves it
    let check = run_ladder(&path, &["check"], &[]).await;
    assert_eq!(check.status.code(), Some(0), "{}", out(&check));
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(
        text.contains(&format!(
            "  retired queue {ns}.b.intake (ladder b (retired), intake): 1 message(s) — 1 message(s) wait and no replica serves ladder b"
        )),
        "{}",
        out(&check)
    );
    assert!(
        text.contains(&format!("  retired exchange {ns}.b (ladder b (retired), ")),
        "{}",
        out(&check)
    );
    assert!(
        !text.contains(&format!("{ns}.a.")) && !text.contains(&other),
        "only the retired ladder b: {}",
        out(&check)
    );

    let refused = run_ladder(&path, &["prune"], &[]).await;
    assert_eq!(refused.status.code(), Some(75), "{}", out(&refused));
    let text = String::from_utf8_lossy(&refused.stdout);
    assert!(
        text.contains(&format!(
            "kept    queue {ns}.b.intake: holds 1 message(s) that nothing serves"
        )),
        "{}",
        out(&refused)
    );
    assert!(text.contains(&format!("kept    exchange {ns}.b:")), "{}", out(&refused));
    assert!(exchange_exists(&conn, &format!("{ns}.b")).await, "the way in is kept");
    assert!(depth(&conn, &format!("{ns}.b.intake")).await.is_some());

    ch.queue_purge(&format!("{ns}.b.intake")).await.unwrap();
    let pruned = run_ladder(&path, &["prune"], &[]).await;
    assert_eq!(pruned.status.code(), Some(0), "{}", out(&pruned));
    let text = String::from_utf8_lossy(&pruned.stdout);
    assert!(
        text.contains(&format!("kept    queue {ns}.b.parked")),
        "{}",
        out(&pruned)
    );
    for gone in ["intake", "due", "quarantine", "holds"] {
        assert_eq!(depth(&conn, &format!("{ns}.b.{gone}")).await, None, "{gone} is deleted");
    }
    for gone in ["", ".intake", ".quarantine"] {
        assert!(
            !exchange_exists(&conn, &format!("{ns}.b{gone}")).await,
            "exchange b{gone} is deleted"
        );
    }
    assert!(
        depth(&conn, &format!("{ns}.b.parked")).await.is_some(),
        "the parking lot is kept"
    );
    // the ladder the config uses, and the other namespace's ladder b, are untouched
    for kept in [
        format!("{ns}.a.intake"),
        // the tier a shares with the retired b
        format!("{ns}.delay.1s"),
        format!("{other}.b.intake"),
    ] {
        assert!(depth(&conn, &kept).await.is_some(), "{kept} is kept");
    }
    assert!(exchange_exists(&conn, &format!("{other}.b")).await);
    assert!(exchange_exists(&conn, &format!("{ns}.a")).await);

    let with_lot = run_ladder(&path, &["prune", "--with-parking-lot"], &[]).await;
    assert_eq!(with_lot.status.code(), Some(0), "{}", out(&with_lot));
    assert_eq!(depth(&conn, &format!("{ns}.b.parked")).await, None);
    let dry = run_ladder(&path, &["prune", "--dry-run"], &[]).await;
    assert!(
        String::from_utf8_lossy(&dry.stdout).contains("nothing retired"),
        "{}",
        out(&dry)
    );
}

/// `ladder run` as a child, its stderr in a file.
struct Running {
    child: Child,
    log: std::path::PathBuf,
}

impl Running {
    fn spawn(config: &Path, log: std::path::PathBuf) -> Self {
        let child = ladder_command(config)
            .arg("run")
            .arg("--no-dev-broker")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("ladder runs");
        Running { child, log }
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The admin server's address, from the log.
    async fn admin(&self) -> String {
        eventually("the admin server listens", WAIT, async || {
            self.log()
                .lines()
                .find_map(|l| l.split("admin server listening address=").nth(1))
                .map(|a| a.trim().to_string())
        })
        .await
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- ladder run log ---\n{}", self.log());
        }
    }
}

async fn get(address: &str, path: &str) -> String {
    let url = format!("http://{address}{path}");
    tokio::time::timeout(WAIT, async { reqwest::get(&url).await?.text().await })
        .await
        .expect("the admin server answers")
        .unwrap_or_default()
}

/// SIGHUP with failures flowing: a new ladder and new tiers are declared and served, the old
/// tier drains and is listed as retired, nothing is lost or delivered twice; a broken file keeps
/// the running config, says why in the log and counts in `ladder_config_reloads_total`.
#[tokio::test]
async fn sighup_reloads_the_ladders_without_losing_or_doubling() {
    let ns = unique_namespace("reload");
    let dir = tempfile::tempdir().unwrap();
    let ladder = "backoff = [\"2s\"]\nmax_attempts = 3\nallow = [\"^{ns}-\"]\n";
    let path = write_config(dir.path(), &ns, ADMIN_ANY_PORT, "t", ladder);
    // the objects of the config after the reload too: tiers 2s (retired), 500ms and 1s, ladder u
    let _before = Cleanup::for_config(&path);
    let new_t = "backoff = [\"500ms\", \"1s\"]\nmax_attempts = 3\nallow = [\"^{ns}-\"]\n";
    let dir_after = tempfile::tempdir().unwrap();
    let after = write_config(dir_after.path(), &ns, "", "t", new_t);
    // u shares t's new 1 s tier
    let new_u = "backoff = [\"1s\"]\nmax_attempts = 3\nallow = [\"^{ns}-\"]\n";
    write_config(dir_after.path(), &ns, "", "u", new_u);
    let _after = Cleanup::for_config(&after);

    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let dest = format!("{ns}-dest");
    let options = ladder_amqp::QueueOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(&dest, options, FieldTable::new()).await.unwrap();
    let _dest_cleanup = DeleteQueue(dest.clone());
    let running = Running::spawn(&path, dir.path().join("run.log"));
    let admin = running.admin().await;
    eventually("ready", WAIT, async || {
        (get(&admin, "/ready").await.trim() == "ready").then_some(())
    })
    .await;
    let mut consumer = consume(&conn, &dest).await;

    // failures flow in before, during and after the reload
    let mut ids = HashSet::new();
    for i in 0..30 {
        let id = format!("before-{i}");
        publish(&ch, &format!("{ns}.t"), "", b"x", failure(&id, &dest)).await;
        ids.insert(id);
    }
    std::fs::write(
        dir.path().join("ladders/t.toml"),
        with_test_levels(&new_t.replace("{ns}", &ns)),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("ladders/u.toml"),
        with_test_levels(&new_u.replace("{ns}", &ns)),
    )
    .unwrap();
    running.signal("HUP");
    for i in 0..30 {
        let id = format!("during-{i}");
        publish(&ch, &format!("{ns}.t"), "", b"x", failure(&id, &dest)).await;
        ids.insert(id);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eventually("the new ladder u is served", WAIT, async || {
        depth(&conn, &format!("{ns}.u.intake"))
            .await
            .filter(|(_, consumers)| *consumers > 0)
    })
    .await;
    for i in 0..10 {
        let id = format!("u-{i}");
        publish(&ch, &format!("{ns}.u"), "", b"x", failure(&id, &dest)).await;
        ids.insert(id);
    }
    receive_each_once(&mut consumer, &ids, WAIT * 2).await;

    let ladders = get(&admin, "/api/ladders").await;
    let v: serde_json::Value = serde_json::from_str(&ladders).unwrap();
    let names: Vec<&str> = v["ladders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["t", "u"], "{ladders}");
    let retired: Vec<&str> = v["drift"]["retired"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(retired, [format!("{ns}.delay.2s")], "{ladders}");
    let page = get(&admin, "/?refresh=off").await;
    assert!(page.contains("Retired and differing topology") && page.contains(&format!("{ns}.delay.2s")));
    // the log says it too, once the reload declared the new config (before the state above)
    let log = running.log();
    assert!(
        log.lines()
            .any(|l| l.contains(" WARN ") && l.contains("retired: ") && l.contains(&format!("object={ns}.delay.2s"))),
        "{log}"
    );

    // a broken file: the running config stays, the log says why, the metric counts it
    std::fs::write(dir.path().join("ladders/broken.toml"), "backoff = [").unwrap();
    running.signal("HUP");
    eventually("the invalid reload is counted", WAIT, async || {
        get(&admin, "/metrics")
            .await
            .contains("ladder_config_reloads_total{result=\"invalid\"} 1")
            .then_some(())
    })
    .await;
    assert!(
        running
            .log()
            .contains("SIGHUP: the new config is invalid; serving on with the running one")
    );
    assert!(running.log().contains("broken.toml"), "{}", running.log());
    let metrics = get(&admin, "/metrics").await;
    assert!(
        metrics.contains("ladder_config_reloads_total{result=\"applied\"} 1"),
        "{metrics}"
    );
    publish(&ch, &format!("{ns}.u"), "", b"x", failure("still", &dest)).await;
    receive_each_once(&mut consumer, &HashSet::from(["still".to_string()]), WAIT).await;
    // nothing changed since: unchanged
    std::fs::remove_file(dir.path().join("ladders/broken.toml")).unwrap();
    running.signal("HUP");
    eventually("the unchanged reload is counted", WAIT, async || {
        get(&admin, "/metrics")
            .await
            .contains("ladder_config_reloads_total{result=\"unchanged\"} 1")
            .then_some(())
    })
    .await;
    running.signal("TERM");
    let _ = tokio::time::timeout(WAIT, async {
        while !running.log().contains("stopped") {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
}

/// SIGHUP after a ladder's file was removed, while retries of that ladder wait in its tier: the
/// ladder is retired (`/api/ladders`, the web page, the log, `ladder check`), its retries are
/// neither lost nor delivered twice, and `ladder prune` keeps what holds them.
///
/// Where they wait is what the code does today: they come due through `N.due` into the removed
/// ladder's own due queue `N.u.due` (its binding there stays until the queue is pruned), which
/// no replica serves; `ladder check` counts them there and says to put the file back, and once
/// it is back (another SIGHUP) each is delivered once. They do not reach `N.stray`, nor are they
/// moved to the ladders served, while `N.u.due` exists.
#[tokio::test]
async fn sighup_that_removes_a_ladder_retires_it_and_loses_none_of_its_retries() {
    let ns = unique_namespace("unload");
    let dir = tempfile::tempdir().unwrap();
    let kept = "backoff = [\"1s\"]\nmax_attempts = 3\nallow = [\"^{ns}-\"]\n";
    let removed = "backoff = [\"3s\"]\nmax_attempts = 3\nallow = [\"^{ns}-\"]\n";
    write_config(dir.path(), &ns, ADMIN_ANY_PORT, "u", removed);
    let path = write_config(dir.path(), &ns, ADMIN_ANY_PORT, "t", kept);
    // both ladders, and the 3 s tier only u uses
    let _cleanup = Cleanup::for_config(&path);

    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select().await.unwrap();
    let dest = format!("{ns}-dest");
    let options = ladder_amqp::QueueOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(&dest, options, FieldTable::new()).await.unwrap();
    let _dest_cleanup = DeleteQueue(dest.clone());
    let running = Running::spawn(&path, dir.path().join("run.log"));
    let admin = running.admin().await;
    eventually("ready", WAIT, async || {
        (get(&admin, "/ready").await.trim() == "ready").then_some(())
    })
    .await;
    let mut consumer = consume(&conn, &dest).await;
    let reloads = async |n: u32| {
        let applied = format!("ladder_config_reloads_total{{result=\"applied\"}} {n}");
        eventually(&format!("{n} reload(s) applied"), WAIT, async || {
            get(&admin, "/metrics").await.contains(&applied).then_some(())
        })
        .await;
    };

    // retries of u wait in its 3 s tier when its file goes
    let tier = format!("{ns}.delay.3s");
    let u_due = format!("{ns}.u.due");
    let ids: HashSet<String> = (0..20).map(|i| format!("u-{i}")).collect();
    for id in &ids {
        publish(&ch, &format!("{ns}.u"), "", b"x", failure(id, &dest)).await;
    }
    eventually("20 retries of u wait in its tier", WAIT, async || {
        (depth(&conn, &tier).await == Some((20, 0))).then_some(())
    })
    .await;
    std::fs::remove_file(dir.path().join("ladders/u.toml")).unwrap();
    running.signal("HUP");
    reloads(1).await;

    // u is retired: listed with its objects, no longer served
    eventually_ok("/api/ladders lists u as retired", WAIT, async || {
        let body = get(&admin, "/api/ladders").await;
        let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
        let names: Vec<&str> = v["ladders"]
            .as_array()
            .map(|a| a.iter().filter_map(|l| l["name"].as_str()).collect())
            .unwrap_or_default();
        let retired = v["drift"]["retired"].as_array().cloned().unwrap_or_default();
        let of_u = |name: &str| {
            retired
                .iter()
                .any(|r| r["name"] == name && r["ladder"] == "u" && r["ladder_retired"] == true)
        };
        let tier_retired = retired.iter().any(|r| r["name"] == tier.as_str());
        if names == ["t"] && of_u(&format!("{ns}.u.intake")) && of_u(&u_due) && of_u(&format!("{ns}.u")) && tier_retired
        {
            Ok(())
        } else {
            Err(body)
        }
    })
    .await;
    let page = get(&admin, "/?refresh=off").await;
    assert!(
        page.contains("data-retired-ladder=\"u\"") && page.contains("u (retired)"),
        "{page}"
    );
    let log = running.log();
    assert!(
        log.lines()
            .any(|l| l.contains(" WARN ") && l.contains("retired: ") && l.contains(&format!("object={ns}.u.intake"))),
        "{log}"
    );

    // the retries come due into u's due queue, which the service moves to t, which admits them
    // with its checks, as it does N.stray: each is delivered once, none lost
    receive_each_once(&mut consumer, &ids, WAIT).await;
    eventually_ok(
        "u's tier and due queue are empty, and nobody reads the due queue",
        WAIT,
        async || {
            let seen = (depth(&conn, &tier).await, depth(&conn, &u_due).await);
            if seen == (Some((0, 0)), Some((0, 0))) {
                Ok(())
            } else {
                Err(format!("{tier}, {u_due}: {seen:?}"))
            }
        },
    )
    .await;
    assert!(
        running.log().contains("draining the due queue of a retired ladder"),
        "{}",
        running.log()
    );
    // drained and let go of: prune removes u (its parking lot aside) and the retired tier
    let pruned = run_ladder(&path, &["prune"], &[]).await;
    assert_eq!(pruned.status.code(), Some(0), "{}", out(&pruned));
    let text = String::from_utf8_lossy(&pruned.stdout);
    assert!(
        text.contains(&format!("deleted queue {u_due}")) && text.contains(&format!("deleted queue {tier}")),
        "{}",
        out(&pruned)
    );
    assert_eq!(depth(&conn, &u_due).await, None, "u's due queue is gone");
    assert!(
        next_within(&mut consumer, Duration::from_millis(500)).await.is_none(),
        "a retry of the removed ladder was delivered twice"
    );

    // t was served throughout
    publish(&ch, &format!("{ns}.t"), "", b"x", failure("t-after", &dest)).await;
    receive_each_once(&mut consumer, &HashSet::from(["t-after".to_string()]), WAIT).await;
    running.signal("TERM");
    let _ = tokio::time::timeout(WAIT, async {
        while !running.log().contains("stopped") {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
}

/// Deletes a queue at drop.
struct DeleteQueue(String);

impl Drop for DeleteQueue {
    fn drop(&mut self) {
        delete_all_blocking(vec![self.0.clone()], vec![]);
    }
}

/// An object the config declares that the broker holds with other arguments (here a tier
/// declared by hand with a 5 s TTL where the config says 1 s): `ladder check` and `ladder plan`
/// name it and say what differs, in the broker's words; neither declares anything.
#[tokio::test]
async fn check_and_plan_show_an_object_whose_arguments_differ_from_the_config() {
    let ns = unique_namespace("differ");
    let dir = tempfile::tempdir().unwrap();
    let ladder = "backoff = [\"1s\"]\nmax_attempts = 2\nqueue_type = \"classic\"\nallow = [\"^x$\"]\n";
    let path = write_config(dir.path(), &ns, "", "a", ladder);
    // the planned names, the hand-made tier among them
    let _cleanup = Cleanup::for_config(&path);
    let config = ladder::config::load(&path, &HashMap::new()).unwrap();
    let spec = &config.ladders[0];
    // N.delay.1s.classic: a classic tier is shared only with other classic ones
    let tier = ladder::model::names::Names::of(&ns, spec).tier_queue(&spec.tiers[0]);
    let _tier_cleanup = DeleteQueue(tier.clone());
    let conn = connect().await;
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::new();
    args.set("x-queue-type", ladder_amqp::FieldValue::string("classic"));
    args.set("x-message-ttl", ladder_amqp::FieldValue::LongLongInt(5_000));
    args.set(
        "x-dead-letter-exchange",
        ladder_amqp::FieldValue::string(&format!("{ns}.due")),
    );
    let options = ladder_amqp::QueueOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(&tier, options, args).await.unwrap();

    let check = run_ladder(&path, &["check"], &[]).await;
    assert_eq!(check.status.code(), Some(0), "{}", out(&check));
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(
        text.contains("0 retired, 1 differing from the config"),
        "{}",
        out(&check)
    );
    let differs = text
        .lines()
        .find(|l| l.starts_with(&format!("  differs queue {tier}: ")))
        .unwrap_or_else(|| panic!("no differs line for {tier}\n{}", out(&check)));
    // what differs, as the broker said it: the argument, and both values
    assert!(
        differs.contains("x-message-ttl") && differs.contains("1000") && differs.contains("5000"),
        "{differs}"
    );

    let plan = run_ladder(&path, &["plan"], &[]).await;
    assert_eq!(plan.status.code(), Some(0), "{}", out(&plan));
    let stderr = String::from_utf8_lossy(&plan.stderr);
    assert!(
        stderr.contains("0 retired, 1 differing from the config")
            && stderr.contains(&format!("#   differs queue {tier}: "))
            && stderr.contains("x-message-ttl"),
        "{}",
        out(&plan)
    );
    assert!(
        !String::from_utf8_lossy(&plan.stdout).contains("differs"),
        "stdout stays the declarations: {}",
        out(&plan)
    );

    // looking declared nothing and changed nothing: the ladder's queues do not exist, the tier
    // keeps its 5 s (a declare with the config's 1 s is still refused)
    assert_eq!(depth(&conn, &format!("{ns}.a.intake")).await, None);
    assert_eq!(depth(&conn, &format!("{ns}.topology")).await, None);
    let again = run_ladder(&path, &["check"], &[]).await;
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("0 retired, 1 differing from the config"),
        "{}",
        out(&again)
    );
}
