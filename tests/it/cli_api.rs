//! `ladder parked` through a running service's admin API, against the real broker and a real
//! admin server: found from the config's `admin.bind` or given with `--admin`, it answers with
//! exactly what the stream path prints; replay and discard go through it with a token (the
//! record names the token's owner) and through the stream without one; a service that is gone
//! or serves another namespace is not used; the progress bar shows on a terminal only.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use crate::common::*;
use ladder_amqp::{BasicProperties, FieldTable, FieldValue};
use serde_json::Value;

const ALICE: &str = "alice-token-0123456789";

/// Fast polls and one operator, alice; the admin server itself is started by the test.
const ADMIN: &str =
    "[admin]\nbind = \"127.0.0.1:0\"\npoll_interval = \"100ms\"\n[admin.tokens]\nalice = \"alice-token-0123456789\"";

/// One tier and no retry to spare: `retry-attempt = 1` is parked at once as `max-attempts`.
const ONE_TIER: &str = "backoff = [\"100ms\"]\nmax_attempts = 1\nallow = [\"^{ns}-\"]";

/// A config for the CLI with the service's namespace and ladder, whose `admin.bind` is `bind`
/// (where the test's admin server listens, or a port nobody listens on).
fn cli_config(dir: &Path, t: &TestLadder, bind: &str) -> PathBuf {
    write_config(dir, &t.ns, &format!("[admin]\nbind = \"{bind}\""), &t.ladder, ONE_TIER)
}

/// Runs `ladder --config <config> <args>` without a terminal, `LADDER_TOKEN` set to `token`.
async fn ladder(config: &Path, token: Option<&str>, args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_ladder"));
    command
        .arg("--config")
        .arg(config)
        .args(args)
        .env_remove("LADDER_TOKEN")
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    if let Some(token) = token {
        command.env("LADDER_TOKEN", token);
    }
    tokio::time::timeout(WAIT * 2, command.output())
        .await
        .expect("the command ends in time")
        .expect("the command runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The JSON a successful command printed; it said on stderr which one answered.
fn json_from(out: &Output, answered_by: &str) -> Value {
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        stderr(out)
    );
    let said: Vec<_> = stderr(out)
        .lines()
        .filter(|l| l.starts_with("ladder: "))
        .map(String::from)
        .collect();
    assert_eq!(said.len(), 1, "one line says who answered: {said:?}");
    assert!(said[0].contains(answered_by), "{said:?} names {answered_by:?}");
    serde_json::from_slice(&out.stdout).expect("the command printed JSON")
}

/// Parks `n` messages headed for `queue` (`max-attempts`), then waits until the admin server's
/// index holds them all.
async fn park(t: &TestLadder, admin: &TestAdmin, queue: &str, n: usize, first: usize) {
    for i in first..first + n {
        let mut headers = FieldTable::default();
        headers.set("retry-to", text(queue));
        headers.set("retry-attempt", FieldValue::LongLongInt(1));
        headers.set("tenant", text(&format!("t{}", i % 3)));
        let props = BasicProperties::default()
            .with_message_id(&format!("m-{i}"))
            .with_headers(headers);
        t.publish(&t.intake(), "", format!("{{\"order\": {i}}}").as_bytes(), props)
            .await;
    }
    let url = admin.url(&format!("/api/ladders/{}/parked", t.ladder));
    let want = (first + n) as u64;
    let deadline = Instant::now() + WAIT;
    loop {
        let answer = reqwest::Client::new()
            .get(&url)
            .query(&[("limit", "0"), ("resolved", "include")])
            .send()
            .await;
        if let Ok(answer) = answer
            && let Ok(v) = answer.json::<Value>().await
            && v["caught_up"] == true
            && v["total"].as_u64() == Some(want)
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the admin server never indexed {want} entries"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn parked_answers_from_the_service_found_at_admin_bind_exactly_as_from_the_stream() {
    let mut t = TestLadder::configure_with("cli-api", ADMIN, ONE_TIER).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    park(&t, &admin, &orders, 30, 0).await;
    let dir = tempfile::tempdir().unwrap();
    let config = cli_config(dir.path(), &t, &admin.addr.to_string());
    let service = format!("the service at http://{}", admin.addr);

    // reads: the API answers, with exactly what the stream path prints
    for args in [
        &["parked", "list", "--json", "--limit", "7", "--offset", "3"][..],
        &["parked", "list", "--json", "--header", "tenant=t1", "--all"],
        &["parked", "counts", "--json", "--since", "1h"],
    ] {
        let api = json_from(&ladder(&config, None, args).await, &service);
        let with_stream: Vec<&str> = args.iter().copied().chain(["--stream"]).collect();
        let stream = json_from(&ladder(&config, None, &with_stream).await, "read the stream");
        assert_eq!(api, stream, "{args:?}");
    }
    let page = json_from(&ladder(&config, None, &["parked", "list", "--json"]).await, &service);
    assert_eq!(page["total"], 30);
    let offset = page["entries"][4]["offset"].as_u64().unwrap().to_string();
    let api = json_from(
        &ladder(&config, None, &["parked", "show", &offset, "--json"]).await,
        &service,
    );
    let stream = json_from(
        &ladder(&config, None, &["parked", "show", &offset, "--json", "--stream"]).await,
        "read the stream",
    );
    assert_eq!(api, stream);
    let body = ladder(&config, None, &["parked", "body", &offset]).await;
    assert!(stderr(&body).contains(&service), "{}", stderr(&body));
    assert_eq!(body.stdout, b"{\"order\": 25}");
    let table = String::from_utf8_lossy(&ladder(&config, None, &["parked", "list"]).await.stdout).into_owned();
    assert!(table.starts_with("OFFSET"), "{table}");
    assert!(
        table.ends_with(&format!("30 of 30 unresolved entries in {}\n", t.parked_stream())),
        "{table}"
    );
    let missing = ladder(&config, None, &["parked", "show", "999999"]).await;
    assert_eq!(missing.status.code(), Some(1), "no such entry: {}", stderr(&missing));
    assert!(stderr(&missing).contains("answered 404"), "{}", stderr(&missing));

    // a replay without a token acts on the stream itself; with one, through the service
    let dry = json_from(
        &ladder(
            &config,
            None,
            &["parked", "replay", "--dry-run", "--json", "--header", "tenant=t0"],
        )
        .await,
        "no --token or LADDER_TOKEN",
    );
    assert_eq!(dry["outcomes"].as_array().unwrap().len(), 10);
    let refused = ladder(
        &config,
        Some("not-a-token-at-all-1234"),
        &["parked", "replay", "--header", "tenant=t0"],
    )
    .await;
    assert_eq!(refused.status.code(), Some(64), "a wrong token: {}", stderr(&refused));
    assert!(stderr(&refused).contains("matches none"), "{}", stderr(&refused));
    let by = ladder(
        &config,
        Some(ALICE),
        &["parked", "replay", "--header", "tenant=t0", "--by", "bob"],
    )
    .await;
    assert_eq!(
        by.status.code(),
        Some(64),
        "--by cannot be recorded over the API: {}",
        stderr(&by)
    );
    let out = ladder(
        &config,
        Some(ALICE),
        &["parked", "replay", "--json", "--header", "tenant=t0"],
    )
    .await;
    assert!(
        !stderr(&out).contains("replaying"),
        "no progress bar without a terminal: {}",
        stderr(&out)
    );
    let replayed = json_from(&out, &service);
    let outcomes = replayed["outcomes"].as_array().unwrap();
    assert_eq!(outcomes.len(), 10, "{replayed}");
    assert!(
        outcomes
            .iter()
            .all(|o| o["status"] == "replayed" && o["to"] == orders.as_str())
    );
    assert_eq!(queue_depth(&t.client, &orders).await, 10);
    let all = json_from(
        &ladder(
            &config,
            None,
            &["parked", "list", "--json", "--all", "--header", "tenant=t0", "--stream"],
        )
        .await,
        "read the stream",
    );
    assert!(
        all["entries"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["resolution"]["by"] == "alice" && e["resolution"]["action"] == "replayed"),
        "the record names the token's owner: {all}"
    );

    // a discard through the service: refused without a terminal unless --yes, as on the stream
    let refused = ladder(&config, Some(ALICE), &["parked", "discard", "--header", "tenant=t1"]).await;
    assert_eq!(refused.status.code(), Some(64), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("refusing to discard 10 entries"),
        "{}",
        stderr(&refused)
    );
    let discarded = json_from(
        &ladder(
            &config,
            Some(ALICE),
            &["parked", "discard", "--yes", "--json", "--header", "tenant=t1"],
        )
        .await,
        &service,
    );
    assert_eq!(discarded["outcomes"].as_array().unwrap().len(), 10);
    assert_eq!(discarded["failed"], 0);
    let counts = json_from(&ladder(&config, None, &["parked", "counts", "--json"]).await, &service);
    assert_eq!(counts["total"], 10, "{counts}");

    // --admin names the service; one serving another namespace is refused, not silently used
    let elsewhere = tempfile::tempdir().unwrap();
    let other = write_config(elsewhere.path(), &format!("{}-other", t.ns), "", &t.ladder, ONE_TIER);
    let url = format!("http://{}", admin.addr);
    let mismatch = ladder(&other, None, &["parked", "list", "--admin", &url]).await;
    assert_eq!(mismatch.status.code(), Some(64), "{}", stderr(&mismatch));
    assert!(stderr(&mismatch).contains("serves namespace"), "{}", stderr(&mismatch));
    let nowhere = tempfile::tempdir().unwrap();
    let unbound = cli_config(nowhere.path(), &t, "127.0.0.1:0");
    let named = json_from(
        &ladder(&unbound, None, &["parked", "counts", "--json", "--admin", &url]).await,
        &service,
    );
    assert_eq!(named["total"], 10);

    // the service gone: the stream answers the same
    admin.stop().await;
    let fallback = json_from(
        &ladder(&config, None, &["parked", "counts", "--json"]).await,
        "read the stream",
    );
    assert_eq!(fallback, counts);
    let said = stderr(&ladder(&config, None, &["parked", "counts"]).await);
    assert!(
        said.contains("did not answer") || said.contains("error"),
        "says why: {said}"
    );
}

#[tokio::test]
async fn a_long_replay_shows_its_progress_on_a_terminal_through_the_service_and_the_stream() {
    assert!(
        std::process::Command::new("script").arg("--version").output().is_ok(),
        "util-linux's script gives the command a terminal (Debian's bsdutils)"
    );
    let mut t = TestLadder::configure_with("cli-bar", ADMIN, ONE_TIER).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    park(&t, &admin, &orders, 40, 0).await;
    let dir = tempfile::tempdir().unwrap();
    let config = cli_config(dir.path(), &t, &admin.addr.to_string());

    // under script(1) stdout and stderr are a terminal: the bar is drawn, then cleared
    let on_a_terminal = async |args: &str| {
        let command = format!(
            "LADDER_TOKEN={ALICE} RUST_LOG=warn {} --config {} {args}",
            env!("CARGO_BIN_EXE_ladder"),
            config.display()
        );
        let started = Instant::now();
        let out = tokio::time::timeout(
            WAIT * 2,
            tokio::process::Command::new("script")
                .args(["-qefc", &command, "/dev/null"])
                .stdin(std::process::Stdio::null())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("the command ends in time")
        .expect("script runs");
        let screen = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{args}: {screen}");
        (screen, started.elapsed())
    };
    let (screen, took) = on_a_terminal("parked replay --header tenant=t0 --rate 10/s").await;
    assert!(screen.contains("answered by the service"), "{screen}");
    assert!(
        screen.contains("the replay runs in the service as"),
        "followed as a job: {screen}"
    );
    assert!(
        screen.contains("replaying [") && screen.contains("/14 entries"),
        "the bar: {screen}"
    );
    assert!(screen.contains("14 entries, 0 failed"), "{screen}");
    assert!(took >= Duration::from_secs(1), "paced at 10/s: {took:?}");
    let (screen, _) = on_a_terminal("parked replay --stream --header tenant=t1 --rate 10/s").await;
    assert!(screen.contains("read the stream"), "{screen}");
    assert!(
        screen.contains("replaying [") && screen.contains("/13 entries"),
        "the bar: {screen}"
    );
    assert!(screen.contains("13 entries, 0 failed"), "{screen}");
    let (screen, _) = on_a_terminal("parked replay --header tenant=t2 --json").await;
    assert!(!screen.contains("replaying ["), "never beside --json: {screen}");
    assert_eq!(queue_depth(&t.client, &orders).await, 40);
}

/// `ladder parked replay --edit-header --edit-body-file <offset>`: through the service with a
/// token (the record names the token's owner) and against the stream without one (`--by`);
/// the edited message arrives, the entry keeps the original, and an edit of more than one entry
/// is refused before anything is sent.
#[tokio::test]
async fn parked_replay_edits_one_entry_through_the_service_and_through_the_stream() {
    let mut t = TestLadder::configure_with("cli-edit", ADMIN, ONE_TIER).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    park(&t, &admin, &orders, 2, 0).await;
    let dir = tempfile::tempdir().unwrap();
    let config = cli_config(dir.path(), &t, &admin.addr.to_string());
    let body_file = dir.path().join("fixed.json");
    std::fs::write(&body_file, b"{\"order\": 0, \"fixed\": true}").unwrap();
    let body_arg = body_file.to_str().unwrap();
    let list: Value = reqwest::get(admin.url(&format!("/api/ladders/{}/parked", t.ladder)))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let offset_of = |id: &str| {
        list["entries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["envelope"]["message"]["properties"]["message_id"] == id)
            .unwrap()["offset"]
            .as_u64()
            .unwrap()
            .to_string()
    };
    let (first, second) = (offset_of("m-0"), offset_of("m-1"));

    let refused = ladder(
        &config,
        Some(ALICE),
        &["parked", "replay", "--edit-header", "tenant=x", &first, &second],
    )
    .await;
    assert_eq!(refused.status.code(), Some(64), "{}", stderr(&refused));
    assert!(stderr(&refused).contains("exactly one offset"), "{}", stderr(&refused));

    let through_service = ladder(
        &config,
        Some(ALICE),
        &[
            "parked",
            "replay",
            "--json",
            "--edit-header",
            "tenant=globex",
            "--edit-body-file",
            body_arg,
            &first,
        ],
    )
    .await;
    let v = json_from(&through_service, "the service");
    assert_eq!(v["outcomes"][0]["status"], "replayed", "{v}");
    let through_stream = ladder(
        &config,
        None,
        &[
            "parked",
            "replay",
            "--json",
            "--by",
            "bob",
            "--edit-header",
            "region=eu",
            &second,
        ],
    )
    .await;
    let v = json_from(&through_stream, "read the stream");
    assert_eq!(v["outcomes"][0]["status"], "replayed", "{v}");

    let mut consumer = tokio::time::timeout(WAIT, t.consume(&orders))
        .await
        .expect("consume timed out");
    let mut seen = Vec::new();
    for _ in 0..2 {
        let d = next_within(&mut consumer, WAIT)
            .await
            .expect("the edited messages arrive");
        let h = d.properties.headers.clone().unwrap_or_default();
        let id = d
            .properties
            .message_id
            .as_ref()
            .and_then(|m| m.to_str())
            .unwrap()
            .to_string();
        match id.as_str() {
            "m-0" => {
                assert_eq!(d.body, b"{\"order\": 0, \"fixed\": true}");
                assert_eq!(h.get("tenant"), Some(&text("globex")));
            }
            _ => {
                assert_eq!(d.body, b"{\"order\": 1}");
                assert_eq!(h.get("region"), Some(&text("eu")));
            }
        }
        consumer.ack(&d);
        seen.push(id);
    }
    seen.sort();
    assert_eq!(seen, ["m-0", "m-1"]);

    for (offset, by, changed, added) in [(&first, "alice", "tenant", None), (&second, "bob", "", Some("region"))] {
        let entry: Value = eventually("the resolution is indexed", WAIT, async || {
            let e: Value = reqwest::get(admin.url(&format!("/api/ladders/{}/parked/{offset}", t.ladder)))
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            e["resolution"]["edit"].is_object().then_some(e)
        })
        .await;
        let r = &entry["resolution"];
        assert_eq!(r["by"], by, "{entry}");
        if !changed.is_empty() {
            assert_eq!(r["edit"]["headers_changed"], serde_json::json!([changed]), "{entry}");
            assert_eq!(r["edit"]["body"]["to_bytes"], 27, "{entry}");
        }
        if let Some(added) = added {
            assert_eq!(r["edit"]["headers_added"], serde_json::json!([added]), "{entry}");
        }
        assert!(
            entry["envelope"]["message"]["properties"]["headers"]["tenant"]["value"]
                .as_str()
                .is_some_and(|t| t.starts_with('t')),
            "the entry keeps the original: {entry}"
        );
    }
}
