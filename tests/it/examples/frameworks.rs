//! The frameworks behind a ladder (examples/celery, examples/ruby): a Celery task that fails is
//! retried by the ladder, parked, and replayed once it works; what Celery's own `retry()` does
//! beside a ladder; and why Sneakers' own retry handler cannot share a queue with a ladder in
//! dead-letter mode. The Ruby worker's retries run with the other consumers (`ruby_explicit`,
//! `ruby_dead_letter`).

use super::*;
use ladder_amqp::QueueOptions;

/// Celery's workers declare its native delayed delivery on the vhost under the same names for
/// every app (`celery_delayed_0` … `_27`, `celery_delayed_delivery`): the Celery tests run one
/// at a time, and each deletes them when it ends.
static CELERY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Celery's native delayed delivery: 28 level queues, an exchange each, and the delivery exchange.
const CELERY_DELAY_LEVELS: usize = 28;

/// The command line of `celery`, or `None` (the test is skipped) without Python.
fn celery_or_skip(test: &str) -> Option<Vec<OsString>> {
    match Lang::Celery.prepare(Program::Consumer) {
        Ok(argv) => Some(argv),
        Err(why) => {
            eprintln!("SKIPPED: {test}: {why}");
            None
        }
    }
}

impl Run {
    /// Celery's delayed-delivery objects, deleted with the run's own.
    fn own_celery_objects(&mut self) {
        for level in 0..CELERY_DELAY_LEVELS {
            self.queues.push(format!("celery_delayed_{level}"));
            self.exchanges.push(format!("celery_delayed_{level}"));
        }
        self.exchanges.push("celery_delayed_delivery".into());
    }

    /// `celery` (`argv`) run in examples/celery against this run's queue and ladder.
    fn celery(&self, argv: &[OsString], app: &str) -> Command {
        let mut command = Command::new(&argv[0]);
        command
            .args(&argv[1..])
            .args(["-A", app, "--quiet"])
            .current_dir(examples_dir().join("celery"))
            .env("AMQP_URL", amqp_url())
            .env("CELERY_QUEUE", &self.queue)
            .env("LADDER_EXCHANGE", &self.names.exchange)
            .env("PYTHONDONTWRITEBYTECODE", "1");
        command
    }

    /// A worker of `app` on the solo pool, whose lines come in the order its tasks ran.
    fn spawn_celery_worker(&mut self, argv: &[OsString], app: &str, fail_always: bool) {
        let mut worker = self.celery(argv, app);
        worker
            .args(["worker", "-P", "solo", "-l", "warning"])
            .args(["--without-gossip", "--without-mingle", "--without-heartbeat"])
            .env("FAIL_ALWAYS", if fail_always { "1" } else { "0" });
        self.spawn_example(worker);
    }

    /// Sends `task` with the JSON `args` through Celery's own client; the task's id.
    fn celery_call(&self, argv: &[OsString], app: &str, task: &str, args: &str) -> String {
        let mut call = self.celery(argv, app);
        call.args(["call", task, "--args", args]);
        let (status, out) = run_bounded(&mut call, BUILD_WAIT, "celery-call").unwrap();
        assert!(status.success(), "celery call {task}: {status}\n{out}");
        // its stdout is the id alone; a warning on stderr may come before it
        let id = out
            .lines()
            .map(str::trim)
            .rfind(|l| l.len() == 36 && l.matches('-').count() == 4);
        id.unwrap_or_else(|| panic!("celery call printed no task id:\n{out}"))
            .to_string()
    }

    async fn start_ladder(&mut self, conn: &Connection) {
        self.spawn_ladder();
        let (intake, due) = (self.names.intake_queue.clone(), self.names.due.clone());
        self.wait_consumed(conn, &intake, "ladder run").await;
        self.wait_consumed(conn, &due, "ladder run").await;
    }

    async fn expect_lines(&mut self, expected: &[String]) -> Vec<Line> {
        let mut seen = vec![];
        for want in expected {
            let mut line = self.next_line().await;
            while line.text.trim().is_empty() {
                line = self.next_line().await;
            }
            assert_eq!(&line.text, want, "line {} of the worker", seen.len() + 1);
            seen.push(line);
        }
        seen
    }
}

/// A Celery task that always fails runs once and once per retry, each retry after its tier;
/// the ladder parks its message as Celery sent it; once the task works again, replaying it by
/// its task id runs it once more, and it succeeds.
#[tokio::test]
async fn celery_task_is_retried_parked_and_replayed() {
    let Some(celery) = celery_or_skip("the celery example") else {
        return;
    };
    let _one_at_a_time = CELERY.lock().await;
    let mut run = Run::configure("celery".into(), "ex-celery", LADDER);
    run.own_celery_objects();
    let conn = connect().await;
    run.start_ladder(&conn).await;
    run.spawn_celery_worker(&celery, "tasks", true);
    let queue = run.queue.clone();
    run.wait_consumed(&conn, &queue, "the celery worker").await;

    let id = run.celery_call(&celery, "tasks", "tasks.charge", r#"["order-1"]"#);
    let runs: Vec<String> = (0..=2).map(|n| format!("{id} attempt={n}")).collect();
    let seen = run.expect_lines(&runs).await;

    let parked = read_parked(&conn, &run.names.parked, 1).await.remove(0);
    assert_eq!(parked.reason, "max-attempts", "{parked:?}");
    assert_eq!(parked.destination.as_deref(), Some(queue.as_str()), "{parked:?}");
    assert_eq!(parked.attempts, Some(2), "{parked:?}");
    for (i, tier) in TIERS.iter().enumerate() {
        let failed_at = parked.history[i].failed_at_ms;
        let since_failure = Duration::from_millis(seen[i + 1].at_ms.saturating_sub(failed_at));
        // how long Celery took to reject the run before: the line is printed as a run starts
        let reject = Duration::from_millis(failed_at.saturating_sub(seen[i].at_ms));
        eprintln!(
            "celery: run {i} was rejected to the ladder within {reject:?}; run {} came {since_failure:?} later (tier {tier:?})",
            i + 1
        );
        assert!(
            since_failure >= *tier,
            "run {} came {since_failure:?} after the failure, before its tier",
            i + 1
        );
    }
    let props = parked.message.properties().unwrap();
    assert_eq!(text(&props.correlation_id), Some(id.as_str()), "Celery's task id");
    assert_eq!(text_header(&props, "id").as_deref(), Some(id.as_str()));
    assert_eq!(text_header(&props, "task").as_deref(), Some("tasks.charge"));
    assert_eq!(text(&props.content_type), Some("application/json"));
    let body: serde_json::Value = serde_json::from_slice(&parked.message.body().unwrap()).unwrap();
    assert_eq!(
        body[0],
        serde_json::json!(["order-1"]),
        "Celery's body: [args, kwargs, embed]"
    );

    // fixed: a worker whose task succeeds, and the parked task replayed by its id
    run.spawn_celery_worker(&celery, "tasks", false);
    run.wait_consumed(&conn, &queue, "the fixed celery worker").await;
    let mut replay = ladder_command(&run.dir.path().join("ladder.toml"));
    replay.args(["parked", "replay", "--correlation-id", &id]);
    let (status, out) = run_bounded(&mut replay, WAIT, "celery-replay").unwrap();
    assert!(status.success(), "ladder parked replay: {status}\n{out}");
    assert!(out.contains("1 entries, 0 failed"), "{out}");
    run.expect_lines(&[format!("{id} attempt=0"), format!("{id} done")])
        .await;
    eventually("the replayed task is acked", WAIT, async || {
        let ch = conn.create_channel().await.ok()?;
        let q = ch.queue_inspect(&queue).await.ok()?;
        let _ = ch.close(200, "peeked").await;
        (q.message_count == 0).then_some(())
    })
    .await;
    let _ = conn.close(200, "done").await;
}

/// Celery's own `retry()` beside a ladder: Celery retries first, with its own countdown, and
/// the ladder sees the message only once Celery gave up. A task with `max_retries = 2` behind a
/// ladder of `max_attempts = 2` runs five times before it is parked; every retry carries the
/// ladder's headers, so the ladder's count is never reset.
#[tokio::test]
async fn celery_own_retry_runs_before_the_ladder() {
    let Some(celery) = celery_or_skip("celery's own retry") else {
        return;
    };
    let _one_at_a_time = CELERY.lock().await;
    let mut run = Run::configure("celery retry()".into(), "ex-celery-retry", LADDER);
    run.own_celery_objects();
    let conn = connect().await;
    run.start_ladder(&conn).await;
    run.spawn_celery_worker(&celery, "limits", true);
    let queue = run.queue.clone();
    run.wait_consumed(&conn, &queue, "the celery worker").await;

    let id = run.celery_call(&celery, "limits", "limits.charge_with_own_retry", r#"["order-1"]"#);
    let runs: Vec<String> = [(0, 0), (0, 1), (0, 2), (1, 2), (2, 2)]
        .iter()
        .map(|(attempt, retries)| format!("{id} attempt={attempt} retries={retries}"))
        .collect();
    run.expect_lines(&runs).await;
    let parked = read_parked(&conn, &run.names.parked, 1).await.remove(0);
    assert_eq!(parked.reason, "max-attempts", "{parked:?}");
    assert_eq!(parked.attempts, Some(2), "{parked:?}");
    let _ = conn.close(200, "done").await;
}

/// Sneakers' Maxretry handler needs the worker's queue to dead-letter into its own
/// `<queue>-retry` exchange. A queue has one dead-letter exchange: once the queue dead-letters
/// into the ladder, the broker refuses the handler's declaration.
#[tokio::test]
async fn sneakers_maxretry_cannot_share_a_ladders_queue() {
    let argv = match Lang::Ruby.prepare(Program::Consumer) {
        Ok(argv) => argv,
        Err(why) => return eprintln!("SKIPPED: sneakers' retry handler: {why}"),
    };
    let mut run = Run::configure("ruby maxretry".into(), "ex-ruby-maxretry", LADDER);
    let conn = connect().await;
    run.spawn_consumer(&argv, Mode::DeadLetter);
    let queue = run.queue.clone();
    run.wait_consumed(&conn, &queue, "the ruby worker").await;

    let mut arguments = FieldTable::default();
    arguments.set("x-queue-type", FieldValue::string("quorum"));
    arguments.set("x-dead-letter-exchange", FieldValue::string(&format!("{queue}-retry")));
    let options = QueueOptions {
        durable: true,
        ..Default::default()
    };
    let ch = conn.create_channel().await.unwrap();
    let declared = tokio::time::timeout(WAIT, ch.queue_declare(&queue, options, arguments)).await;
    match declared.expect("the broker answers the declaration") {
        Ok(_) => panic!("the broker took a second dead-letter exchange for {queue}"),
        Err(e) => assert_eq!(e.reply_code(), Some(406), "{e}"),
    }
    let _ = conn.close(200, "done").await;
}
