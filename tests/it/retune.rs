//! Re-tuning a ladder as the platform team does (the book's operations/changing-a-ladder.md):
//! a tier taken out of a ladder keeps its promise and is shown while it drains (`ladder
//! check`, `ladder plan`, the log's state, `/api/ladders`), `ladder prune` removes it only once
//! it is empty; a retired ladder is pruned whole, never another namespace's objects nor what the
//! config uses; SIGHUP reloads the files without a restart, losing and doubling nothing.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ladder_amqp::{BasicProperties, Connection, FieldTable};

use crate::common::*;

/// Whether exchange `name` exists.
async fn exchange_exists(conn: &Connection, name: &str) -> bool {
    let ch = conn.create_channel().await.unwrap();
    let found = tokio::time::timeout(WAIT, ch.exchange_inspect(name))
        .await
        .unwrap()
        .is_ok();
    if found {
        let _ = ch.close(200, "peeked").await;
    }
    found
}

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
    let ids: HashSet<String> = (0..20).map(|i| format!("m{i}")).collect();
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

    // refused while it holds messages: kept as it is, exit 75
    let dry = run_ladder(&path, &["prune", "--dry-run"], &[]).await;
    assert!(
        String::from_utf8_lossy(&dry.stdout).contains(&format!("would keep   queue {old_tier}: holds")),
        "{}",
        out(&dry)
    );
    let refused = run_ladder(&path, &["prune"], &[]).await;
    if depth(&t.client, &old_tier).await.is_some_and(|(n, _)| n > 0) {
        assert_eq!(refused.status.code(), Some(75), "{}", out(&refused));
        assert!(
            String::from_utf8_lossy(&refused.stdout).contains("holds"),
            "{}",
            out(&refused)
        );
    }

    // the old tier keeps its promise; once drained, prune --wait deletes it
    receive_each_once(&mut consumer, &ids, WAIT).await;
    let pruned = run_ladder(&path, &["prune", "--wait", "20s"], &[]).await;
    assert_eq!(pruned.status.code(), Some(0), "{}", out(&pruned));
    assert!(
        String::from_utf8_lossy(&pruned.stdout).contains(&format!("deleted queue {old_tier}")),
        "{}",
        out(&pruned)
    );
    assert_eq!(depth(&t.client, &old_tier).await, None, "the retired tier is gone");
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
    for gone in ["", ".next", ".first", ".tiers", ".due", ".quarantine"] {
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

/// Deletes a queue at drop.
struct DeleteQueue(String);

impl Drop for DeleteQueue {
    fn drop(&mut self) {
        delete_all_blocking(vec![self.0.clone()], vec![]);
    }
}
