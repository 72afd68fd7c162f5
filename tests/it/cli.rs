//! The `ladder` binary as an operator runs it: `check`, `plan` and `apply` on a config in a
//! temporary directory, their exit codes (0, 64 for a bad config, 69 for an unreachable
//! broker), what they print, environment overrides, and that the AMQP password never shows.

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::common::*;
use ladder_amqp::FieldTable;

const LADDER: &str = r#"
backoff = ["200ms", "500ms"]
max_attempts = 2
allow = ["^{ns}-"]
"#;

/// A secret that must never be printed; the broker refuses it, so `apply` cannot connect.
const SECRET: &str = "wrongsecret123";

/// Runs `ladder --config <config> <args…>` with `RUST_LOG=info` and `env` on top of a clean
/// environment (no inherited `LADDER_*` overrides), bounded by [`WAIT`].
async fn ladder(config: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut all = vec![("RUST_LOG", "info")];
    all.extend_from_slice(env);
    run_ladder(config, args, &all).await
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts the exit code, showing both streams when it is not the expected one.
fn assert_exit(out: &Output, code: i32) {
    assert_eq!(
        out.status.code(),
        Some(code),
        "stdout:\n{}\nstderr:\n{}",
        stdout(out),
        stderr(out)
    );
}

/// A valid config for a fresh namespace: `(tempdir, config path, namespace)`.
fn valid_config(hint: &str) -> (tempfile::TempDir, PathBuf, String) {
    let dir = tempfile::tempdir().unwrap();
    let ns = unique_namespace(hint);
    let path = write_config(dir.path(), &ns, "", "default", LADDER);
    (dir, path, ns)
}

#[tokio::test]
async fn check_accepts_a_valid_config_and_prints_the_ladder() {
    let (_dir, path, _ns) = valid_config("check");
    let out = ladder(&path, &["check"], &[]).await;
    assert_exit(&out, 0);
    let text = stdout(&out);
    assert!(text.contains("ok (1 ladders)"), "{text}");
    assert!(
        text.contains("default: tiers [200ms, 500ms], max_attempts 2, quorum at-least-once"),
        "{text}"
    );
}

#[tokio::test]
async fn check_summarises_the_delay_levels_of_a_ladder_with_exact_delays() {
    let dir = tempfile::tempdir().unwrap();
    let ns = unique_namespace("checklevels");
    let ladder_toml = format!("exact_delays = true\njitter = \"10%\"\nallow_exchanges = [\"^events$\"]\n{LADDER}");
    let path = write_config(dir.path(), &ns, "", "default", &ladder_toml);
    let out = ladder(&path, &["check"], &[]).await;
    assert_exit(&out, 0);
    let text = stdout(&out);
    assert!(
        text.contains("default: tiers [200ms, 500ms], max_attempts 2"),
        "the steps: {text}"
    );
    assert!(
        text.contains("exact delays: 28 delay levels, level-16ms … level-24.9d, jitter 10%, exchanges [^events$]"),
        "{text}"
    );
}

/// Which file of the config a case rewrites.
#[derive(Clone, Copy)]
enum File {
    Main,
    Ladder,
}

/// One invalid config: a rewrite of the valid text of one file, and what stderr must say.
struct Invalid {
    case: &'static str,
    file: File,
    rewrite: fn(&str) -> String,
    expected: &'static [&'static str],
}

#[tokio::test]
async fn check_rejects_invalid_configs_with_64_naming_file_key_and_problem() {
    let cases = [
        Invalid {
            case: "max_attempts = 0",
            file: File::Ladder,
            rewrite: |text| text.replace("max_attempts = 2", "max_attempts = 0"),
            expected: &["max_attempts", "must be at least 1"],
        },
        Invalid {
            case: "unknown ladder key",
            file: File::Ladder,
            rewrite: |text| format!("{text}max_atempts = 3\n"),
            expected: &["max_atempts", "unknown field"],
        },
        Invalid {
            case: "prefetch = 0",
            file: File::Main,
            rewrite: |text| text.replace("prefetch = 100", "prefetch = 0"),
            expected: &["prefetch", "must be between 1 and 65535"],
        },
    ];
    for Invalid {
        case,
        file,
        rewrite,
        expected,
    } in cases
    {
        let (dir, path, _ns) = valid_config("invalid");
        let file = match file {
            File::Main => path.clone(),
            File::Ladder => dir.path().join("ladders").join("default.toml"),
        };
        let valid = std::fs::read_to_string(&file).unwrap();
        let invalid = rewrite(&valid);
        assert_ne!(valid, invalid, "{case}: the rewrite changed nothing");
        std::fs::write(&file, invalid).unwrap();

        let out = ladder(&path, &["check"], &[]).await;
        assert_exit(&out, 64);
        let err = stderr(&out);
        assert!(
            err.contains(&file.display().to_string()),
            "{case}: stderr does not name {}:\n{err}",
            file.display()
        );
        for needle in expected {
            assert!(err.contains(needle), "{case}: stderr lacks {needle:?}:\n{err}");
        }
        assert!(stdout(&out).is_empty(), "{case}: {}", stdout(&out));
    }
}

#[tokio::test]
async fn a_missing_config_file_exits_64() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.toml");
    for command in ["check", "plan", "apply", "run"] {
        let out = ladder(&missing, &[command], &[]).await;
        assert_exit(&out, 64);
        let err = stderr(&out);
        assert!(
            err.contains("nope.toml") && err.contains("not found"),
            "{command}: {err}"
        );
    }
}

/// The contract lines `plan` must print for namespace `ns` and ladder `default`.
fn contract(ns: &str) -> Vec<String> {
    let n = format!("{ns}.default");
    vec![
        // the namespace's own record of what it declared (model::drift)
        format!(
            "queue    {ns}.topology durable x-queue-type=stream x-max-length-bytes=8388608 \
             x-stream-max-segment-size-bytes=1048576"
        ),
        // what the namespace's ladders share: the tiers, N.due routing what expires in them to
        // its own ladder, and N.stray for what belongs to none
        format!("exchange {ns}.stray type=fanout durable"),
        format!("queue    {ns}.stray durable x-queue-type=quorum x-delivery-limit=-1"),
        format!("binding  {ns}.stray -> {ns}.stray key=\"\""),
        format!("exchange {ns}.due type=headers durable alternate-exchange={ns}.stray"),
        // the watchdog's probe publishes (a quiet hop's session is proven alive through it)
        format!("queue    {ns}.watchdog durable x-queue-type=quorum x-max-length=1"),
        format!(
            "queue    {ns}.delay.200ms durable x-queue-type=quorum x-message-ttl=200 \
             x-dead-letter-exchange={ns}.due x-dead-letter-strategy=at-least-once x-overflow=reject-publish"
        ),
        format!(
            "queue    {ns}.delay.500ms durable x-queue-type=quorum x-message-ttl=500 \
             x-dead-letter-exchange={ns}.due x-dead-letter-strategy=at-least-once x-overflow=reject-publish"
        ),
        format!("exchange {n}.quarantine type=fanout durable"),
        format!("queue    {n}.quarantine durable x-queue-type=quorum x-delivery-limit=-1"),
        format!("binding  {n}.quarantine -> {n}.quarantine key=\"\""),
        format!(
            "queue    {n}.intake durable x-queue-type=quorum x-dead-letter-exchange={n}.quarantine x-delivery-limit=100"
        ),
        format!(
            "queue    {n}.probes durable x-queue-type=quorum x-dead-letter-exchange={n}.quarantine x-delivery-limit=100"
        ),
        format!(
            "queue    {n}.due durable x-queue-type=quorum x-dead-letter-exchange={n}.quarantine x-delivery-limit=100"
        ),
        format!("binding  {ns}.due -> {n}.due key=\"\" x-match=all retry-ladder=default"),
        format!("exchange {n}.intake type=fanout durable"),
        format!("binding  {n}.intake -> {n}.intake key=\"\""),
        format!("exchange {n} type=headers durable alternate-exchange={n}.intake"),
        format!("binding  {n} -> {ns}.delay.200ms key=\"\" x-match=all retry-ladder=default retry-next=200ms"),
        format!("binding  {n} -> {ns}.delay.500ms key=\"\" x-match=all retry-ladder=default retry-next=500ms"),
        format!("binding  {n} -> {n}.probes key=\"\" x-match=all retry-ladder=default retry-next=probe"),
        format!("queue    {n}.parked durable x-queue-type=stream"),
        format!(
            "queue    {n}.holds durable x-queue-type=stream x-max-length-bytes=8388608 \
             x-stream-max-segment-size-bytes=1048576"
        ),
    ]
}

#[tokio::test]
async fn plan_prints_the_contract_names() {
    let (_dir, path, ns) = valid_config("plan");
    let out = ladder(&path, &["plan"], &[]).await;
    assert_exit(&out, 0);
    let lines: Vec<String> = stdout(&out).lines().map(str::to_string).collect();
    assert_eq!(lines, contract(&ns));
}

#[tokio::test]
async fn environment_overrides_change_what_plan_prints() {
    let (_dir, path, ns) = valid_config("env");
    let other = unique_namespace("other");
    let out = ladder(&path, &["plan"], &[("LADDER_NAMESPACE", &other)]).await;
    assert_exit(&out, 0);
    let text = stdout(&out);
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    assert_eq!(lines, contract(&other));
    assert!(!text.contains(&ns), "the file's namespace still shows:\n{text}");
}

/// `ladder plan | head` stops quietly once `head` has read enough, as CLI tools do: the pipe's
/// reading end is closed before `plan` writes a line, so every write meets EPIPE.
#[tokio::test]
async fn plan_into_a_pipe_closed_early_exits_quietly() {
    let (_dir, path, _ns) = valid_config("pipe");
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut command = tokio::process::Command::from(ladder_command(&path));
    command
        .arg("plan")
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    // spawned, not `output()`, which would pipe stdout to itself
    let child = command.spawn().unwrap();
    drop(command); // its copy of the writing end
    let out = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .expect("ladder plan exits")
        .unwrap();
    let text = stderr(&out);
    assert!(!text.contains("panicked"), "{text}");
    assert!(!text.contains("Broken pipe"), "{text}");
    // 141 is how a shell reports a command killed by SIGPIPE
    assert!(matches!(out.status.code(), Some(0 | 141)), "{:?}: {text}", out.status);
}

#[tokio::test]
async fn apply_declares_the_topology_on_the_broker() {
    let (_dir, path, ns) = valid_config("apply");
    let _cleanup = Cleanup::for_config(&path);
    let out = ladder(&path, &["apply"], &[]).await;
    assert_exit(&out, 0);
    assert!(stderr(&out).contains("topology declared"), "{}", stderr(&out));

    let conn = connect().await;
    for queue in [
        format!("{ns}.default.intake"),
        format!("{ns}.default.due"),
        format!("{ns}.delay.200ms"),
        format!("{ns}.delay.500ms"),
        format!("{ns}.stray"),
        format!("{ns}.default.parked"),
    ] {
        // a failed passive declare closes its channel: one channel per queue
        let ch = conn.create_channel().await.unwrap();
        let declared = ch.queue_inspect(&queue).await;
        assert!(declared.is_ok(), "{queue} was not declared: {declared:?}");
        let _ = ch.close(200, "checked").await;
    }
    // applying again is idempotent
    assert_exit(&ladder(&path, &["apply"], &[]).await, 0);
    let _ = conn.close(200, "done").await;
}

/// A new install records today's layout and unbinds nothing. A ladder of 903c5df (its intake
/// there, no topology stream, `N.L` a fanout bound straight to the intake) is moved to today's
/// layout behind `N.L.next`, and a failure then enters the intake once, not twice; the next
/// apply finds it moved.
#[tokio::test]
async fn apply_moves_only_a_ladder_of_an_older_layout() {
    const MOVING: &str = "moving a ladder declared by an earlier release";
    let (_dir, path, ns) = valid_config("layout");
    let _cleanup = Cleanup::for_config(&path);
    let n = format!("{ns}.default");
    let conn = connect().await;
    let layout = async || {
        ladder::broker::drift::read(&conn, &ns)
            .await
            .expect("the topology stream reads")
            .layout()
    };

    let fresh = ladder(&path, &["apply"], &[]).await;
    assert_exit(&fresh, 0);
    assert!(!stderr(&fresh).contains(MOVING), "{}", stderr(&fresh));
    assert_eq!(layout().await, Some(ladder::model::upgrade::LAYOUT));

    // as 903c5df left it: no stream, and N.L a fanout bound straight to the intake
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete(&format!("{ns}.topology")).await.unwrap();
    ch.exchange_delete(&n).await.unwrap();
    ch.exchange_declare(&n, "fanout", true, FieldTable::default())
        .await
        .unwrap();
    ch.queue_bind(&format!("{n}.intake"), &n, "", FieldTable::default())
        .await
        .unwrap();
    let older = ladder(&path, &["apply"], &[]).await;
    assert_exit(&older, 0);
    assert!(stderr(&older).contains(MOVING), "{}", stderr(&older));
    ch.confirm_select().await.unwrap();
    publish(&ch, &n, "", b"once", retry_props(&format!("{ns}-orders"), None)).await;
    let intake = format!("{n}.intake");
    eventually("the failure is in the intake", WAIT, async || {
        (queue_depth(&conn, &intake).await >= 1).then_some(())
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(queue_depth(&conn, &intake).await, 1, "the old way in is gone");

    let again = ladder(&path, &["apply"], &[]).await;
    assert_exit(&again, 0);
    assert!(!stderr(&again).contains(MOVING), "{}", stderr(&again));
    let _ = conn.close(200, "done").await;
}

#[tokio::test]
async fn the_amqp_password_never_appears_in_any_output() {
    let (_dir, path, _ns) = valid_config("secret");
    let url = format!("amqp://guest:{SECRET}@127.0.0.1:5672/%2f");
    let env = [("LADDER_AMQP__URL", url.as_str())];

    let out = ladder(&path, &["apply"], &env).await;
    assert_exit(&out, 69);
    assert!(
        stderr(&out).contains("guest:***@127.0.0.1"),
        "the masked URL is not logged:\n{}",
        stderr(&out)
    );
    let mut outputs = vec![("apply", out)];
    for command in ["check", "plan"] {
        let out = ladder(&path, &[command], &env).await;
        assert_exit(&out, 0);
        outputs.push((command, out));
    }
    for (command, out) in outputs {
        for (stream, text) in [("stdout", stdout(&out)), ("stderr", stderr(&out))] {
            assert!(
                !text.contains(SECRET),
                "{command} printed the password on {stream}:\n{text}"
            );
        }
    }
}
