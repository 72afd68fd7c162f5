//! The consumer examples in `examples/` — Python (pika), Node.js (amqplib), Go (amqp091-go) and
//! Java (amqp-client) — each in both modes (explicit `retry-to`, and reject with the queue
//! dead-lettering into the ladder), against the real `ladder run` binary: the example fails every
//! message, sees it again after each tier, and the ladder parks it after `max_attempts`. And the
//! consumer snippets of the book (`docs/src/`) and README are excerpts of these files, kept
//! identical.
//!
//! The scheduled-delivery examples (`schedule.py`, `schedule.js`, `go-schedule`), the migration
//! from the delayed-message plugin: each publishes three messages with `x-delay` to a ladder with
//! `exact_delays = true` and reports how long each took to come back; every one must come once,
//! never early and not much late. The book quotes them too.
//!
//! A language whose interpreter or compiler is absent is skipped with a message; one that is
//! present but lacks its AMQP client fails, naming the command that installs it (`scripts/test-env`
//! installs them all).

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{OnceLock, mpsc};
use std::time::{Duration, Instant};

use crate::common::*;
use ladder::broker::topology::Names;
use ladder_amqp::{BasicProperties, Connection, FieldTable, FieldValue};

const LADDER: &str = r#"
backoff = ["200ms", "500ms"]
max_attempts = 2
allow = ["^{ns}-"]
"#;

/// A ladder that schedules deliveries to the test's queues: `exact_delays` declares its delay
/// levels (the test helpers otherwise leave them out).
const SCHEDULING: &str = r#"
exact_delays = true
backoff = ["1s"]
allow = ["^{ns}-"]
"#;

/// The `message_id`s and `x-delay`s (ms) the schedule examples publish.
const SCHEDULED: [(&str, u64); 3] = [("s1", 300), ("s2", 600), ("s3", 900)];

/// How much later than its `x-delay` a scheduled delivery may come: the intake hop, the level
/// hops and the due hop on a busy 2-core machine. It is never earlier.
const SCHEDULE_LATE: Duration = Duration::from_millis(1_500);

/// How long a schedule example may run: its 10 s bound on the deliveries, plus starting up.
const SCHEDULE_RUN: Duration = Duration::from_secs(60);

/// The tiers of [`LADDER`]: the least wait before retry 1 and before retry 2.
const TIERS: [Duration; 2] = [Duration::from_millis(200), Duration::from_millis(500)];

/// How much longer than its tier a retry may take: two hops through the service and the
/// broker's expiry of the tier queue's head.
const SLACK: Duration = Duration::from_millis(2500);

/// How long building an example (Go, Java) or asking a toolchain for its version may take.
const BUILD_WAIT: Duration = Duration::from_secs(300);

/// Where Debian's golang-*-dev packages put their sources: a GOPATH for an offline build.
const DEBIAN_GOPATH: &str = "/usr/share/gocode";

/// The RabbitMQ Java client and its logging API, from Debian's librabbitmq-client-java.
const JAVA_CLASSPATH: [&str; 3] = [
    "/usr/share/java/amqp-client.jar",
    "/usr/share/java/slf4j-api.jar",
    "/usr/share/java/slf4j-nop.jar",
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Lang {
    Python,
    Node,
    Go,
    Java,
    /// A Bunny worker in the Sneakers style.
    Ruby,
    /// A Celery app (Python): dead-letter mode only.
    Celery,
}

const LANGS: [Lang; 6] = [Lang::Python, Lang::Node, Lang::Go, Lang::Java, Lang::Ruby, Lang::Celery];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Explicit,
    DeadLetter,
}

/// Which example of a language: the consumer (both modes), or the scheduled deliveries.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Program {
    Consumer,
    Schedule,
}

/// A region of an example that the docs quote, between `<comment> README:<region>:start`
/// and `…:end`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Region {
    Consumer(Mode),
    Schedule,
    /// The part of a framework's worker its user writes (Ruby).
    Worker,
}

impl Region {
    fn program(self) -> Program {
        match self {
            Region::Consumer(_) | Region::Worker => Program::Consumer,
            Region::Schedule => Program::Schedule,
        }
    }
}

impl fmt::Display for Lang {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Lang::Python => "python",
            Lang::Node => "node",
            Lang::Go => "go",
            Lang::Java => "java",
            Lang::Ruby => "ruby",
            Lang::Celery => "celery",
        })
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Region::Consumer(mode) => mode.fmt(f),
            Region::Schedule => f.write_str("schedule"),
            Region::Worker => f.write_str("worker"),
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Explicit => "explicit",
            Mode::DeadLetter => "dead-letter",
        })
    }
}

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples")
}

/// Build output of the examples, shared by the tests of one run.
fn scratch() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("examples")
}

/// Runs `command` to completion within `within`, its stdout and stderr together into a file
/// named after `log_name`; `Err` only when it cannot be started (`NotFound`: the program is not
/// installed).
fn run_bounded(command: &mut Command, within: Duration, log_name: &str) -> std::io::Result<(ExitStatus, String)> {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    std::fs::create_dir_all(scratch()).unwrap();
    // tests run in parallel: a file of its own for each run
    let log_path = scratch().join(format!("{log_name}.{}.log", RUNS.fetch_add(1, Ordering::Relaxed)));
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()?;
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{command:?} did not finish within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok((status, std::fs::read_to_string(&log_path).unwrap_or_default()))
}

/// `Some(version output)` if `program` runs, `None` if it is not installed.
fn tool_version(program: &str, arg: &str) -> Option<String> {
    match run_bounded(
        Command::new(program).arg(arg),
        BUILD_WAIT,
        &format!("{program}-version"),
    ) {
        Ok((_, out)) => Some(out.lines().next().unwrap_or_default().trim().to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => panic!("{program} {arg}: {e}"),
    }
}

impl Lang {
    /// The command line that runs this language's `program` (built if need be), or why the test
    /// is skipped: only an absent interpreter or compiler. A toolchain without its AMQP client
    /// fails the test.
    fn prepare(self, program: Program) -> Result<Vec<OsString>, String> {
        type Built = OnceLock<Result<Vec<OsString>, String>>;
        match (self, program) {
            (Lang::Python, _) => prepare_python(self.source(program).0),
            (Lang::Node, _) => prepare_node(self.source(program).0),
            (Lang::Go, Program::Consumer) => {
                static GO: Built = OnceLock::new();
                GO.get_or_init(|| build_go("go", "go-consumer")).clone()
            }
            (Lang::Go, Program::Schedule) => {
                static GO: Built = OnceLock::new();
                GO.get_or_init(|| build_go("go-schedule", "go-schedule")).clone()
            }
            (Lang::Java, Program::Consumer) => {
                static JAVA: Built = OnceLock::new();
                JAVA.get_or_init(build_java).clone()
            }
            (Lang::Ruby, Program::Consumer) => prepare_ruby(self.source(program).0),
            (Lang::Celery, Program::Consumer) => prepare_celery(),
            (Lang::Java | Lang::Ruby | Lang::Celery, Program::Schedule) => {
                panic!("there is no {self} schedule example")
            }
        }
    }

    /// The regions of this language's examples that the book quotes.
    fn regions(self) -> Vec<Region> {
        let consumer = [Region::Consumer(Mode::Explicit), Region::Consumer(Mode::DeadLetter)];
        match self {
            Lang::Python | Lang::Node | Lang::Go => [consumer.as_slice(), &[Region::Schedule]].concat(),
            Lang::Java => consumer.to_vec(),
            Lang::Ruby => [consumer.as_slice(), &[Region::Worker]].concat(),
            Lang::Celery => vec![Region::Consumer(Mode::DeadLetter)],
        }
    }

    /// The file of this language's `program`, and the comment that starts its README markers.
    fn source(self, program: Program) -> (PathBuf, &'static str) {
        let (path, comment) = match (self, program) {
            (Lang::Python, Program::Consumer) => ("python/consumer.py", "#"),
            (Lang::Python, Program::Schedule) => ("python/schedule.py", "#"),
            (Lang::Node, Program::Consumer) => ("node/consumer.js", "//"),
            (Lang::Node, Program::Schedule) => ("node/schedule.js", "//"),
            (Lang::Go, Program::Consumer) => ("go/main.go", "//"),
            (Lang::Go, Program::Schedule) => ("go-schedule/main.go", "//"),
            (Lang::Java, Program::Consumer) => ("java/LadderConsumer.java", "//"),
            (Lang::Ruby, Program::Consumer) => ("ruby/worker.rb", "#"),
            (Lang::Celery, Program::Consumer) => ("celery/tasks.py", "#"),
            (Lang::Java | Lang::Ruby | Lang::Celery, Program::Schedule) => {
                panic!("there is no {self} schedule example")
            }
        };
        (examples_dir().join(path), comment)
    }
}

fn prepare_python(script: PathBuf) -> Result<Vec<OsString>, String> {
    let Some(version) = tool_version("python3", "--version") else {
        return Err("python3 is not installed (apt-get install python3)".into());
    };
    let mut check = Command::new("python3");
    check.args(["-c", "import pika; print(pika.__version__)"]);
    let (status, out) = run_bounded(&mut check, BUILD_WAIT, "python-pika").unwrap();
    assert!(
        status.success(),
        "{version} cannot import pika: install it with `pip install pika` (scripts/test-env)\n{out}"
    );
    eprintln!("python: {version}, pika {}", out.trim());
    Ok(vec!["python3".into(), "-u".into(), script.into()])
}

fn prepare_ruby(script: PathBuf) -> Result<Vec<OsString>, String> {
    let Some(version) = tool_version("ruby", "--version") else {
        return Err("ruby is not installed (apt-get install ruby ruby-bunny)".into());
    };
    let mut check = Command::new("ruby");
    check.args(["-e", "require 'bunny'; puts Bunny::VERSION"]);
    let (status, out) = run_bounded(&mut check, BUILD_WAIT, "ruby-bunny").unwrap();
    assert!(
        status.success(),
        "{version} cannot load bunny: install it with `apt-get install ruby-bunny` (scripts/test-env)\n{out}"
    );
    eprintln!("ruby: {version}, bunny {}", out.trim());
    Ok(vec!["ruby".into(), script.into()])
}

/// `python3 -m celery`, to be run in examples/celery (or beside another app module).
fn prepare_celery() -> Result<Vec<OsString>, String> {
    let Some(version) = tool_version("python3", "--version") else {
        return Err("python3 is not installed (apt-get install python3)".into());
    };
    let mut check = Command::new("python3");
    check.args(["-c", "import celery; print(celery.__version__)"]);
    let (status, out) = run_bounded(&mut check, BUILD_WAIT, "python-celery").unwrap();
    assert!(
        status.success(),
        "{version} cannot import celery: install it with `pip install celery` (scripts/test-env)\n{out}"
    );
    eprintln!("celery: {}, {version}", out.trim());
    Ok(vec!["python3".into(), "-m".into(), "celery".into()])
}

fn prepare_node(script: PathBuf) -> Result<Vec<OsString>, String> {
    let Some(version) = tool_version("node", "--version") else {
        return Err("node is not installed (apt-get install nodejs npm)".into());
    };
    let dir = examples_dir().join("node");
    let manifest = std::fs::read_to_string(dir.join("node_modules/amqplib/package.json")).unwrap_or_else(|_| {
        panic!("amqplib is not installed for examples/node: run `npm ci --prefix examples/node` (scripts/test-env)")
    });
    let amqplib: serde_json::Value = serde_json::from_str(&manifest).unwrap();
    eprintln!(
        "node: {version}, amqplib {}",
        amqplib["version"].as_str().unwrap_or("?")
    );
    Ok(vec!["node".into(), script.into()])
}

/// Builds examples/`<dir>` into `<binary>` offline in GOPATH mode against Debian's amqp091-go
/// (golang-github-rabbitmq-amqp091-go-dev); `LADDER_TEST_GOPATH` names another GOPATH.
fn build_go(dir: &str, binary: &str) -> Result<Vec<OsString>, String> {
    let Some(version) = tool_version("go", "version") else {
        return Err("go is not installed (apt-get install golang-go golang-github-rabbitmq-amqp091-go-dev)".into());
    };
    let gopath = std::env::var("LADDER_TEST_GOPATH").unwrap_or_else(|_| DEBIAN_GOPATH.into());
    assert!(
        Path::new(&gopath).join("src/github.com/rabbitmq/amqp091-go").is_dir(),
        "{version} is installed but amqp091-go is not in {gopath}: \
         apt-get install golang-github-rabbitmq-amqp091-go-dev (scripts/test-env)"
    );
    let binary = scratch().join(binary);
    let mut build = Command::new("go");
    build
        .args(["build", "-o"])
        .arg(&binary)
        .arg(".")
        .current_dir(examples_dir().join(dir))
        .env("GO111MODULE", "off")
        .env("GOPATH", &gopath)
        .env("GOFLAGS", "")
        .env("GOPROXY", "off")
        .env("GOCACHE", scratch().join("go-cache"));
    let started = Instant::now();
    let (status, out) = run_bounded(&mut build, BUILD_WAIT, "go-build").unwrap();
    assert!(status.success(), "go build of examples/{dir} failed:\n{out}");
    eprintln!("go: {version}, built examples/{dir} in {:?}", started.elapsed());
    Ok(vec![binary.into()])
}

/// Compiles examples/java against Debian's RabbitMQ Java client (librabbitmq-client-java).
fn build_java() -> Result<Vec<OsString>, String> {
    let Some(version) = tool_version("javac", "-version") else {
        return Err("javac is not installed (apt-get install openjdk-17-jdk-headless)".into());
    };
    assert!(
        Path::new(JAVA_CLASSPATH[0]).is_file(),
        "{version} is installed but {} is not: apt-get install librabbitmq-client-java (scripts/test-env)",
        JAVA_CLASSPATH[0]
    );
    let classes = scratch().join("java-classes");
    let mut compile = Command::new("javac");
    compile
        .arg("-d")
        .arg(&classes)
        .args(["-cp", JAVA_CLASSPATH[0]])
        .arg(examples_dir().join("java/LadderConsumer.java"));
    let started = Instant::now();
    let (status, out) = run_bounded(&mut compile, BUILD_WAIT, "javac").unwrap();
    assert!(status.success(), "javac of examples/java failed:\n{out}");
    eprintln!("java: {version}, compiled in {:?}", started.elapsed());
    let mut classpath = vec![classes.into_os_string()];
    classpath.extend(
        JAVA_CLASSPATH
            .iter()
            .filter(|jar| Path::new(jar).is_file())
            .map(OsString::from),
    );
    Ok(vec![
        "java".into(),
        "-cp".into(),
        std::env::join_paths(classpath).unwrap(),
        "LadderConsumer".into(),
    ])
}

/// A line the example printed on stdout, and when the test read it.
struct Line {
    at: Instant,
    /// The same instant in ms since the epoch, the clock of the ladder's `retry-history`.
    at_ms: u64,
    text: String,
}

/// One example against one ladder: the `ladder run` process, the example's process, and every
/// queue and exchange they declare. Dropping it kills both processes and deletes them all.
struct Run {
    label: String,
    dir: tempfile::TempDir,
    names: Names,
    queue: String,
    ladder: Option<Child>,
    consumer: Option<Child>,
    lines: Option<mpsc::Receiver<Line>>,
    queues: Vec<String>,
    exchanges: Vec<String>,
}

impl Run {
    /// A ladder `default` from `ladder_toml` in a namespace named after `hint`; `label` names
    /// the run in the logs printed on failure.
    fn configure(label: String, hint: &str, ladder_toml: &str) -> Self {
        let ns = unique_namespace(hint);
        let dir = tempfile::tempdir().unwrap();
        write_config(dir.path(), &ns, ADMIN_ANY_PORT, "default", ladder_toml);
        let config = ladder::config::load(&dir.path().join("ladder.toml"), &HashMap::new()).expect("a valid config");
        let (mut queues, exchanges) = declared_names(&config);
        let queue = format!("{ns}-orders");
        queues.push(queue.clone());
        Run {
            label,
            dir,
            names: Names::new(&ns, "default"),
            queue,
            ladder: None,
            consumer: None,
            lines: None,
            queues,
            exchanges,
        }
    }

    fn log(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Starts `ladder --config <dir>/ladder.toml run`, its log in `ladder.log`.
    fn spawn_ladder(&mut self) {
        let child = ladder_command(&self.dir.path().join("ladder.toml"))
            .arg("run")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.log("ladder.log")).unwrap())
            .spawn()
            .expect("the ladder binary starts");
        self.ladder = Some(child);
    }

    /// Starts the example: `<argv> <mode> --queue <ns>-orders --exchange <ns>.default
    /// --fail-always`, its stdout lines read with the time each arrived, its stderr in
    /// `consumer.log`.
    fn spawn_consumer(&mut self, argv: &[OsString], mode: Mode) {
        let mut command = Command::new(&argv[0]);
        command
            .args(&argv[1..])
            .arg(mode.to_string())
            .args(["--queue", &self.queue, "--exchange", &self.names.exchange])
            .args(["--prefetch", "10", "--fail-always"]);
        self.spawn_example(command);
    }

    /// Starts `command` with `AMQP_URL` set, its stdout lines read with the time each arrived,
    /// its stderr appended to `consumer.log`. An example already running is stopped first.
    fn spawn_example(&mut self, mut command: Command) {
        self.stop_example();
        let log = std::fs::File::options()
            .create(true)
            .append(true)
            .open(self.log("consumer.log"))
            .unwrap();
        let mut child = command
            .env("AMQP_URL", amqp_url())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{command:?} starts: {e}"));
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx
                    .send(Line {
                        at: Instant::now(),
                        at_ms: now_ms(),
                        text: line,
                    })
                    .is_err()
                {
                    return;
                }
            }
        });
        self.consumer = Some(child);
        self.lines = Some(rx);
    }

    fn stop_example(&mut self) {
        if let Some(mut child) = self.consumer.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.lines = None;
    }

    /// Panics if the service or the example exited.
    fn assert_running(&mut self) {
        for (what, child) in [("ladder run", &mut self.ladder), ("the example", &mut self.consumer)] {
            if let Some(child) = child.as_mut()
                && let Some(status) = child.try_wait().unwrap()
            {
                panic!("{what} exited early: {status}");
            }
        }
    }

    /// Polls until `queue` has a consumer; bounded by [`WAIT`].
    async fn wait_consumed(&mut self, conn: &Connection, queue: &str, what: &str) {
        eventually(&format!("{what} consumes {queue}"), WAIT, async || {
            self.assert_running();
            consumers(conn, queue).await.is_some_and(|n| n > 0).then_some(())
        })
        .await
    }

    /// The next stdout line of the example; bounded by [`WAIT`].
    /// (Each line carries the instant the reader thread read it: how soon this polls does not
    /// change the gaps the test measures.)
    async fn next_line(&mut self) -> Line {
        eventually("the example prints a line", WAIT, async || {
            match self.lines.as_ref().expect("the example runs").try_recv() {
                Ok(line) => return Some(line),
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.assert_running();
                    panic!("the example closed its stdout");
                }
                Err(mpsc::TryRecvError::Empty) => {}
            }
            self.assert_running();
            None
        })
        .await
    }

    fn tail(&self, name: &str) -> String {
        let log = std::fs::read_to_string(self.log(name)).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        for child in [self.consumer.take(), self.ladder.take()].into_iter().flatten() {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- {}: example stderr (tail) ---\n{}",
                self.label,
                self.tail("consumer.log")
            );
            eprintln!("--- {}: ladder log (tail) ---\n{}", self.label, self.tail("ladder.log"));
        }
        delete_all_blocking(std::mem::take(&mut self.queues), std::mem::take(&mut self.exchanges));
    }
}

/// Consumers on `queue` (a passive declare on a channel of its own), `None` if it does not exist.
async fn consumers(conn: &Connection, queue: &str) -> Option<u32> {
    let ch = conn.create_channel().await.ok()?;
    let declared = tokio::time::timeout(WAIT, ch.queue_inspect(queue)).await.ok()?.ok();
    // a failed passive declare already closed the channel
    if declared.is_some() {
        let _ = ch.close(200, "peeked").await;
    }
    declared.map(|q| q.consumer_count)
}

fn text_header(props: &BasicProperties, key: &str) -> Option<String> {
    match props.headers.as_ref()?.get(key)? {
        FieldValue::LongString(s) => s.to_str().map(str::to_string),
        other => panic!("header {key} is {other:?}, not a string"),
    }
}

fn text(s: &Option<ladder_amqp::ShortString>) -> Option<&str> {
    s.as_ref().and_then(|s| s.to_str())
}

/// Runs one example in one mode end to end: three deliveries (attempts 0, 1, 2) spaced by the
/// tiers, then the message parked as `max-attempts` for `<ns>-orders`, as it was published.
async fn example_retries_then_parks(lang: Lang, mode: Mode) {
    let argv = match lang.prepare(Program::Consumer) {
        Ok(argv) => argv,
        Err(why) => {
            eprintln!("SKIPPED: the {lang} example ({mode} mode): {why}");
            return;
        }
    };
    let started = Instant::now();
    let mut run = Run::configure(format!("{lang} {mode}"), &format!("ex-{lang}-{mode}"), LADDER);
    run.spawn_ladder();
    let conn = connect().await;
    let (intake, due) = (run.names.intake_queue.clone(), run.names.due.clone());
    run.wait_consumed(&conn, &intake, "ladder run").await;
    run.wait_consumed(&conn, &due, "ladder run").await;
    run.spawn_consumer(&argv, mode);
    let queue = run.queue.clone();
    run.wait_consumed(&conn, &queue, "the example").await;

    let id = format!("{}-m1", run.names.exchange);
    let mut headers = FieldTable::default();
    headers.set("tenant", FieldValue::string("acme"));
    let sent = BasicProperties::default()
        .with_message_id(&id)
        .with_content_type("text/plain")
        .with_delivery_mode(2)
        .with_headers(headers);
    let sent = BasicProperties {
        correlation_id: Some("corr-1".try_into().unwrap()),
        app_id: Some("examples-test".try_into().unwrap()),
        kind: Some("order.created".try_into().unwrap()),
        timestamp: Some(1_763_766_000),
        ..sent
    };
    let channel = conn.create_channel().await.unwrap();
    channel.confirm_select().await.unwrap();
    publish(&channel, "", &queue, b"order 1", sent.clone()).await;

    let mut seen = Vec::new();
    for expected in 0..=2 {
        let line = run.next_line().await;
        assert_eq!(
            line.text,
            format!("{id} attempt={expected}"),
            "delivery {} of the example",
            seen.len() + 1
        );
        seen.push(line);
    }

    let parked = read_parked(&conn, &run.names.parked, 1).await.remove(0);
    assert_eq!(parked.reason, "max-attempts", "{parked:?}");
    assert_eq!(parked.destination.as_deref(), Some(queue.as_str()), "{parked:?}");
    assert_eq!(parked.attempts, Some(2), "{parked:?}");
    let tiers: Vec<(u64, &str)> = parked.history.iter().map(|h| (h.attempt, h.tier.as_str())).collect();
    assert_eq!(
        tiers,
        [(1, "200ms"), (2, "500ms")],
        "the ladder's own backoff, nothing else"
    );

    // Each retry came at least its tier after the ladder received the failure before it (its
    // `retry-history`; reading a line late only adds to this), and at most SLACK later than
    // its tier after the delivery before it.
    for (i, tier) in TIERS.iter().enumerate() {
        let (before, retry) = (&seen[i], &seen[i + 1]);
        let gap = retry.at - before.at;
        let since_failure = Duration::from_millis(retry.at_ms.saturating_sub(parked.history[i].failed_at_ms));
        eprintln!(
            "{lang} {mode}: attempt {} came {gap:?} after attempt {i}, {since_failure:?} after the ladder took the failure (tier {tier:?})",
            i + 1
        );
        assert!(
            since_failure >= *tier,
            "attempt {} came {since_failure:?} after the ladder took the failure, before its tier {tier:?}",
            i + 1
        );
        assert!(
            gap <= *tier + SLACK,
            "attempt {} came {gap:?} after attempt {i}, more than {tier:?} + {SLACK:?}",
            i + 1
        );
    }
    assert_eq!(parked.message.body().unwrap(), b"order 1");
    let props = parked.message.properties().unwrap();
    assert_eq!(text(&props.message_id), Some(id.as_str()));
    assert_eq!(text(&props.correlation_id), Some("corr-1"));
    assert_eq!(text(&props.content_type), Some("text/plain"));
    assert_eq!(text(&props.app_id), Some("examples-test"));
    assert_eq!(text(&props.kind), Some("order.created"));
    assert_eq!(props.timestamp, Some(1_763_766_000));
    assert_eq!(props.delivery_mode, Some(2));
    assert_eq!(text_header(&props, "tenant").as_deref(), Some("acme"));
    match mode {
        Mode::Explicit => {
            assert_eq!(text_header(&props, "retry-to").as_deref(), Some(queue.as_str()));
            let reason = text_header(&props, "retry-reason").unwrap_or_default();
            assert!(reason.contains("simulated failure"), "retry-reason {reason:?}");
        }
        Mode::DeadLetter => assert_eq!(text_header(&props, "retry-reason"), None),
    }
    // parked, so never delivered again: the example prints nothing before markers sent through
    // each step of [`LADDER`] (max_attempts 2), behind anything the ladder could still hold (see
    // common/markers.rs)
    let markers = mark_through_ladder(&channel, &run.names.exchange, &TIERS, 2, &queue).await;
    let mut missing: Vec<&String> = markers.ids().iter().collect();
    while !missing.is_empty() {
        let line = run.next_line().await;
        let id = line.text.split(' ').next().unwrap_or_default();
        if !markers.contains(id) {
            panic!("a delivery after the message was parked: {}", line.text);
        }
        missing.retain(|m| *m != id);
    }
    eprintln!("{lang} {mode}: passed in {:?}", started.elapsed());
    let _ = conn.close(200, "done").await;
}

#[tokio::test]
async fn python_explicit() {
    example_retries_then_parks(Lang::Python, Mode::Explicit).await;
}

#[tokio::test]
async fn python_dead_letter() {
    example_retries_then_parks(Lang::Python, Mode::DeadLetter).await;
}

#[tokio::test]
async fn node_explicit() {
    example_retries_then_parks(Lang::Node, Mode::Explicit).await;
}

#[tokio::test]
async fn node_dead_letter() {
    example_retries_then_parks(Lang::Node, Mode::DeadLetter).await;
}

#[tokio::test]
async fn go_explicit() {
    example_retries_then_parks(Lang::Go, Mode::Explicit).await;
}

#[tokio::test]
async fn go_dead_letter() {
    example_retries_then_parks(Lang::Go, Mode::DeadLetter).await;
}

#[tokio::test]
async fn java_explicit() {
    example_retries_then_parks(Lang::Java, Mode::Explicit).await;
}

#[tokio::test]
async fn java_dead_letter() {
    example_retries_then_parks(Lang::Java, Mode::DeadLetter).await;
}

#[tokio::test]
async fn ruby_explicit() {
    example_retries_then_parks(Lang::Ruby, Mode::Explicit).await;
}

#[tokio::test]
async fn ruby_dead_letter() {
    example_retries_then_parks(Lang::Ruby, Mode::DeadLetter).await;
}

/// Runs one language's schedule example to completion against `ladder run` with delay levels:
/// by its output, each of [`SCHEDULED`] came once, no sooner than its `x-delay` after the
/// example published it and at most [`SCHEDULE_LATE`] after that.
async fn example_schedules(lang: Lang) {
    let argv = match lang.prepare(Program::Schedule) {
        Ok(argv) => argv,
        Err(why) => {
            eprintln!("SKIPPED: the {lang} schedule example: {why}");
            return;
        }
    };
    let started = Instant::now();
    let mut run = Run::configure(format!("{lang} schedule"), &format!("ex-{lang}-sched"), SCHEDULING);
    run.spawn_ladder();
    let conn = connect().await;
    let (intake, due) = (run.names.intake_queue.clone(), run.names.due.clone());
    run.wait_consumed(&conn, &intake, "ladder run").await;
    run.wait_consumed(&conn, &due, "ladder run").await;
    let _ = conn.close(200, "ready").await;

    let mut example = Command::new(&argv[0]);
    example
        .args(&argv[1..])
        .args(["--queue", &run.queue, "--exchange", &run.names.exchange])
        .env("AMQP_URL", amqp_url());
    let log_name = format!("{lang}-schedule");
    let (status, out) = tokio::task::spawn_blocking(move || run_bounded(&mut example, SCHEDULE_RUN, &log_name))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{:?} starts: {e}", argv[0]));
    assert!(status.success(), "the {lang} schedule example: {status}\n{out}");

    // `<id> waited_ms=<n>` on stdout; its stderr, in the same output, never looks like that
    let waited: Vec<(&str, u64)> = out
        .lines()
        .filter_map(|line| {
            let (id, ms) = line.split_once(" waited_ms=")?;
            Some((id, ms.trim().parse().ok()?))
        })
        .collect();
    for (id, delay) in SCHEDULED {
        let came: Vec<u64> = waited.iter().filter(|(i, _)| *i == id).map(|(_, ms)| *ms).collect();
        assert_eq!(came.len(), 1, "{id} came {} times, not once:\n{out}", came.len());
        let (asked, took) = (Duration::from_millis(delay), Duration::from_millis(came[0]));
        eprintln!("{lang} schedule: {id} came after {took:?} (x-delay {asked:?})");
        assert!(took >= asked, "{id} came after {took:?}, before its x-delay {asked:?}");
        assert!(
            took <= asked + SCHEDULE_LATE,
            "{id} came after {took:?}, more than {SCHEDULE_LATE:?} after its x-delay {asked:?}"
        );
    }
    assert_eq!(waited.len(), SCHEDULED.len(), "deliveries of no id it sent:\n{out}");
    eprintln!("{lang} schedule: passed in {:?}", started.elapsed());
}

#[tokio::test]
async fn python_schedule() {
    example_schedules(Lang::Python).await;
}

#[tokio::test]
async fn node_schedule() {
    example_schedules(Lang::Node).await;
}

#[tokio::test]
async fn go_schedule() {
    example_schedules(Lang::Go).await;
}

/// The lines between `<comment> README:<region>:start` and `…:end` in `lang`'s example, less
/// the start marker's indentation, without leading or trailing blank lines.
fn region(lang: Lang, region: Region) -> Vec<String> {
    let (path, comment) = lang.source(region.program());
    let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (start, end) = (
        format!("{comment} README:{region}:start"),
        format!("{comment} README:{region}:end"),
    );
    let lines: Vec<&str> = source.lines().collect();
    let find = |marker: &str| {
        let found: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].trim() == marker).collect();
        assert_eq!(found.len(), 1, "{}: `{marker}` must appear once", path.display());
        found[0]
    };
    let (from, to) = (find(&start), find(&end));
    assert!(from < to, "{}: `{start}` after `{end}`", path.display());
    let indent = &lines[from][..lines[from].len() - lines[from].trim_start().len()];
    let mut out: Vec<String> = lines[from + 1..to]
        .iter()
        .map(|line| {
            assert!(
                line.trim().is_empty() || line.starts_with(indent),
                "{}: `{line}` is indented less than its README marker",
                path.display()
            );
            line.get(indent.len()..).unwrap_or("").trim_end().to_string()
        })
        .collect();
    while out.first().is_some_and(|l| l.is_empty()) {
        out.remove(0);
    }
    while out.last().is_some_and(|l| l.is_empty()) {
        out.pop();
    }
    assert!(!out.is_empty(), "{}: the {region} region is empty", path.display());
    out
}

/// Every Markdown file that quotes the examples: README and the pages of the book.
fn quoting_files() -> Vec<PathBuf> {
    let mut out = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")];
    out.extend(crate::docs::book_pages());
    out
}

/// A fenced code block quoting an example: `<!-- excerpt: examples/<file>#<region> -->` on the
/// line before its fence.
struct Snippet {
    lang: Lang,
    region: Region,
    /// Line numbers (0-based) of its first and past its last content line.
    lines: (usize, usize),
}

/// The language and region an excerpt marker names.
fn excerpt_of(marker: &str) -> Option<(Lang, Region)> {
    let (file, region) = marker.split_once('#')?;
    let region = match region {
        "explicit" => Region::Consumer(Mode::Explicit),
        "dead-letter" => Region::Consumer(Mode::DeadLetter),
        "schedule" => Region::Schedule,
        "worker" => Region::Worker,
        _ => return None,
    };
    let path = examples_dir().join(file.strip_prefix("examples/")?);
    LANGS
        .into_iter()
        .filter(|lang| lang.regions().contains(&region))
        .find(|lang| path == lang.source(region.program()).0)
        .map(|lang| (lang, region))
}

/// The excerpts in `text` (of `name`). A code block in a language of the examples must be one:
/// every consumer snippet in the docs is checked.
fn snippets(name: &str, text: &str) -> Vec<Snippet> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = vec![];
    let mut i = 0;
    while i < lines.len() {
        let Some(info) = lines[i].strip_prefix("```") else {
            i += 1;
            continue;
        };
        let end = (i + 1..lines.len())
            .find(|&j| lines[j].trim_end() == "```")
            .unwrap_or_else(|| panic!("{name} line {}: an unclosed code block", i + 1));
        let marker = i
            .checked_sub(1)
            .and_then(|m| lines[m].trim().strip_prefix("<!-- excerpt: "))
            .and_then(|m| m.strip_suffix(" -->"));
        match (info.trim(), marker) {
            (_, Some(marker)) => {
                let (lang, region) =
                    excerpt_of(marker).unwrap_or_else(|| panic!("{name} line {}: no example region {marker}", i));
                out.push(Snippet {
                    lang,
                    region,
                    lines: (i + 1, end),
                });
            }
            ("python" | "js" | "javascript" | "go" | "java" | "ruby", None) => panic!(
                "{name} line {}: a {} block that is no excerpt of examples/ (mark it `<!-- excerpt: examples/FILE#REGION -->`)",
                i + 1,
                info.trim()
            ),
            _ => {}
        }
        i = end + 1;
    }
    out
}

/// The snippets of README and the book are the marked regions of the examples, character for
/// character, and the book quotes every region: both modes in five languages and Celery's
/// dead-letter mode, the scheduled deliveries in three, and the Ruby worker. `LADDER_UPDATE_SNIPPETS=1` rewrites them from the examples instead.
#[test]
fn doc_snippets_are_excerpts_of_the_examples() {
    let mut quoted = vec![];
    let mut differ = vec![];
    for path in quoting_files() {
        let name = path
            .strip_prefix(env!("CARGO_MANIFEST_DIR"))
            .unwrap()
            .display()
            .to_string();
        let text = std::fs::read_to_string(&path).unwrap();
        let found = snippets(&name, &text);
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        let mut changed = false;
        // from the last, so that replacing a block keeps the line numbers of those before it
        for s in found.iter().rev() {
            quoted.push((s.lang, s.region, name.starts_with("docs/")));
            let want = region(s.lang, s.region);
            let have = &lines[s.lines.0..s.lines.1];
            if have != want.as_slice() {
                let first = have
                    .iter()
                    .zip(&want)
                    .position(|(a, b)| a != b)
                    .unwrap_or(have.len().min(want.len()));
                differ.push(format!(
                    "{name} line {}: the {} {} snippet differs from its example at snippet line {}:\n  doc:     {:?}\n  example: {:?}",
                    s.lines.0 + 1,
                    s.lang,
                    s.region,
                    first + 1,
                    have.get(first),
                    want.get(first)
                ));
                lines.splice(s.lines.0..s.lines.1, want);
                changed = true;
            }
        }
        if changed && std::env::var("LADDER_UPDATE_SNIPPETS").as_deref() == Ok("1") {
            let mut updated = lines.join("\n");
            if text.ends_with('\n') {
                updated.push('\n');
            }
            std::fs::write(&path, updated).unwrap();
            eprintln!("rewrote the snippets of {name} from examples/");
        }
    }
    for lang in LANGS {
        for region in lang.regions() {
            assert!(
                quoted.iter().any(|&(l, r, book)| l == lang && r == region && book),
                "the book quotes no {lang} {region} snippet"
            );
        }
    }
    if differ.is_empty() || std::env::var("LADDER_UPDATE_SNIPPETS").as_deref() == Ok("1") {
        return;
    }
    panic!(
        "{}\n(edit the example, then LADDER_UPDATE_SNIPPETS=1 cargo test -p ladder --test it examples::doc_snippets)",
        differ.join("\n")
    );
}

mod frameworks;
