//! Issue 16, "only the right senders, over encrypted links, with operators' terminals and
//! browsers safe", against real brokers: per-sender authorization with two broker users the
//! test creates (`rabbitmqctl`), TLS and EXTERNAL against the RabbitMQ 4.3 node with a TLS
//! listener (`scripts/broker up 4.3 --tls`), secrets read from files and never printed, the
//! admin server's guards over real HTTP, and escape sequences from a message that never reach
//! the operator's terminal raw.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use ladder_amqp::{BasicProperties, ConnectOptions, Connection, FieldTable, FieldValue};

use crate::common::*;

/// `ladder --config <config>`: the binary cargo built for the tests, without the caller's
/// `LADDER_*` overrides, stdin closed, killed when dropped.
fn ladder_binary(config: &Path) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_ladder"));
    for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("LADDER_")) {
        command.env_remove(key);
    }
    command
        .arg("--config")
        .arg(config)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    command
}

/// Runs [`ladder_binary`] with `args` and `env` to its end, within [`WAIT`].
async fn ladder_output(config: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = ladder_binary(config);
    command.args(args).envs(env.iter().copied());
    tokio::time::timeout(WAIT, command.output())
        .await
        .unwrap_or_else(|_| panic!("ladder {args:?} did not exit within {WAIT:?}"))
        .expect("the ladder binary runs")
}

// --- broker users ---------------------------------------------------------------------------

/// `rabbitmqctl -q` against the broker the tests use: the machine's, or node 1 of the
/// `scripts/broker` profile the run targets (`LADDER_TEST_BROKER_PROFILE`).
fn ctl_command() -> std::process::Command {
    let mut command = match std::env::var("LADDER_TEST_BROKER_PROFILE") {
        Ok(profile) if !profile.is_empty() => {
            let mut c = std::process::Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/broker"));
            c.args(["ctl", &profile, "1"]);
            c
        }
        _ => std::process::Command::new("rabbitmqctl"),
    };
    command.arg("-q");
    command
}

/// Runs `rabbitmqctl ARGS` ([`ctl_command`]) and asserts it succeeded.
fn rabbitmqctl(args: &[&str]) -> Output {
    let out = ctl_command().args(args).output().expect("rabbitmqctl runs");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A broker user of the test's own, deleted when dropped.
struct BrokerUser {
    name: String,
    password: String,
}

impl BrokerUser {
    /// Creates `name` with a random password and `configure`, `write` and `read` permissions
    /// (regexes) on the vhost `/`.
    fn create(name: &str, configure: &str, write: &str, read: &str) -> Self {
        let password = format!("pw-{:016x}", fastrand::u64(..));
        rabbitmqctl(&["add_user", name, &password]);
        let user = BrokerUser {
            name: name.to_string(),
            password,
        };
        rabbitmqctl(&["set_permissions", "-p", "/", name, configure, write, read]);
        user
    }

    /// The test broker's URL with this user's credentials.
    fn url(&self) -> String {
        let mut url = url::Url::parse(&amqp_url()).unwrap();
        url.set_username(&self.name).unwrap();
        url.set_password(Some(&self.password)).unwrap();
        url.to_string()
    }

    async fn connect(&self) -> Connection {
        let options = ConnectOptions::new(self.url().parse().unwrap());
        tokio::time::timeout(WAIT, Connection::connect(&options))
            .await
            .expect("connect timed out")
            .unwrap_or_else(|e| panic!("{} cannot connect: {e}", self.name))
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let out = ctl_command().args(["delete_user", &self.name]).output();
        if !out.is_ok_and(|o| o.status.success()) {
            eprintln!("could not delete the broker user {}", self.name);
        }
    }
}

/// `text` with the regex metacharacters a namespace can hold (`.`) escaped.
fn literal(text: &str) -> String {
    text.replace('.', "\\.")
}

/// A failure in explicit mode, from `user` (its `user_id`, if any), to `to`.
fn explicit(user: Option<&str>, to: &str, id: &str) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.set("retry-to", text(to));
    let props = BasicProperties::default().with_headers(headers).with_message_id(id);
    match user {
        Some(user) => props.with_user_id(user),
        None => props,
    }
}

fn parked_by_id<'a>(
    parked: &'a [ladder::model::envelope::Envelope],
    id: &str,
) -> &'a ladder::model::envelope::Envelope {
    parked
        .iter()
        .find(|e| e.message.properties.get("message_id").and_then(|v| v.as_str()) == Some(id))
        .unwrap_or_else(|| panic!("{id} was not parked"))
}

/// Two broker users, each allowed its own queue: the broker says who sent a message (it
/// refuses a `user_id` that is not the connection's user), so each reaches its own queue,
/// neither reaches the other's, a message without `user_id` is refused in explicit mode —
/// a `retry-original-user-id` header naming a sender proves nothing — and a message the broker
/// dead-lettered goes back to its queue over and over (the `dead-letter` policy), though
/// Ladder moved its `user_id` into a header on the first pass.
#[tokio::test]
async fn senders_reach_their_own_queues_only_as_the_broker_identifies_them() {
    let ladder = r#"
backoff = ["200ms"]
max_attempts = 5
allow = ["^{ns}-"]
unidentified = "dead-letter"
[senders]
"{ns}-alice" = ["^{ns}-a$"]
"{ns}-bob" = ["^{ns}-b$"]
"#;
    let mut t = TestLadder::start("senders", ladder).await;
    let (a, b) = (
        t.declare_queue("a", FieldTable::default()).await,
        t.declare_queue("b", FieldTable::default()).await,
    );
    let mut dead_letter = FieldTable::default();
    dead_letter.set("x-dead-letter-exchange", text(&t.intake()));
    let c = t.declare_queue("c", dead_letter).await;
    // each may publish to the ladder's exchange and nowhere else
    let write = format!("^{}$", literal(&t.intake()));
    let alice = BrokerUser::create(&format!("{}-alice", t.ns), "^$", &write, "^$");
    let bob = BrokerUser::create(&format!("{}-bob", t.ns), "^$", &write, "^$");
    let (alice_conn, bob_conn) = (alice.connect().await, bob.connect().await);
    let (alice_ch, bob_ch) = (
        alice_conn.create_channel().await.unwrap(),
        bob_conn.create_channel().await.unwrap(),
    );
    alice_ch.confirm_select().await.unwrap();
    bob_ch.confirm_select().await.unwrap();
    let intake = t.intake();

    publish(
        &alice_ch,
        &intake,
        "",
        b"1",
        explicit(Some(&alice.name), &a, "alice-to-a"),
    )
    .await;
    publish(
        &alice_ch,
        &intake,
        "",
        b"2",
        explicit(Some(&alice.name), &b, "alice-to-b"),
    )
    .await;
    publish(&bob_ch, &intake, "", b"3", explicit(Some(&bob.name), &b, "bob-to-b")).await;
    let mut forged = explicit(None, &a, "anonymous-to-a");
    forged
        .headers
        .get_or_insert_with(FieldTable::default)
        .set("retry-original-user-id", text(&alice.name));
    publish(&bob_ch, &intake, "", b"4", forged).await;

    // the broker itself refuses a user_id that is not the connection's user
    let spoofed = explicit(Some(&alice.name), &a, "bob-as-alice");
    let refused = tokio::time::timeout(WAIT, async {
        bob_ch.basic_publish(&intake, "", true, &spoofed, b"5").unwrap().await
    })
    .await
    .expect("the broker answers a spoofed user_id");
    match refused {
        Err(e) => assert_eq!(e.reply_code(), Some(406), "{e}"),
        Ok(confirmation) => panic!("a spoofed user_id was taken: {confirmation:?}"),
    }

    let mut at_a = t.consume(&a).await;
    let d = next(&mut at_a).await;
    assert_eq!(message_id(&d), "alice-to-a");
    assert_eq!(
        headers_of(&d).get("retry-original-user-id"),
        Some(&text(&alice.name)),
        "the sender is moved into a header: Ladder may not publish alice's user_id"
    );
    assert!(d.properties.user_id.is_none());
    at_a.ack(&d);
    let mut at_b = t.consume(&b).await;
    let d = next(&mut at_b).await;
    assert_eq!(message_id(&d), "bob-to-b");
    at_b.ack(&d);

    let parked = t.parked(2).await;
    let e = parked_by_id(&parked, "alice-to-b");
    assert_eq!(
        (e.reason.as_str(), e.destination.as_deref()),
        ("sender-not-allowed", Some(b.as_str()))
    );
    assert!(
        e.detail.contains(&format!("{:?} may not send to {b:?}", alice.name)),
        "{}",
        e.detail
    );
    assert_eq!(e.message.properties["user_id"], alice.name.as_str(), "kept as received");
    let e = parked_by_id(&parked, "anonymous-to-a");
    assert_eq!(e.reason, "sender-not-allowed");
    assert!(
        e.detail.contains("no user_id") && e.detail.contains("only dead-lettered"),
        "{}",
        e.detail
    );

    // dead-letter mode, twice: the broker moved it, so it goes back where it came from
    t.publish(
        "",
        &c,
        b"6",
        BasicProperties::default().with_message_id("dead-lettered"),
    )
    .await;
    let mut at_c = t.consume(&c).await;
    for attempt in [None, Some(1), Some(2)] {
        let d = next(&mut at_c).await;
        assert_eq!(
            (message_id(&d), int_header(&d, "retry-attempt")),
            ("dead-lettered", attempt)
        );
        if attempt == Some(2) {
            at_c.ack(&d);
        } else {
            at_c.reject(&d, false);
        }
    }
    for ch in [alice_ch, bob_ch] {
        let _ = ch.close(200, "done").await;
    }
    let _ = alice_conn.close(200, "done").await;
    let _ = bob_conn.close(200, "done").await;
}

/// `unidentified = "reject"` (the default): nothing without a listed sender passes, a message
/// the broker dead-lettered included.
#[tokio::test]
async fn by_default_a_ladder_with_senders_parks_every_unidentified_message() {
    let ladder = r#"
backoff = ["200ms"]
allow = ["^{ns}-"]
[senders]
nobody-in-particular = ["^{ns}-a$"]
"#;
    let mut t = TestLadder::start("unidentified", ladder).await;
    let checked = ladder_output(&t.dir.path().join("ladder.toml"), &["check"], &[]).await;
    let shown = String::from_utf8_lossy(&checked.stdout);
    assert!(
        shown.contains(&format!(
            "senders: nobody-in-particular [^{}-a$]; unidentified reject",
            t.ns
        )),
        "{shown}"
    );
    let mut dead_letter = FieldTable::default();
    dead_letter.set("x-dead-letter-exchange", text(&t.intake()));
    let c = t.declare_queue("c", dead_letter).await;
    t.publish("", &c, b"x", BasicProperties::default().with_message_id("dl"))
        .await;
    let mut at_c = t.consume(&c).await;
    let d = next(&mut at_c).await;
    at_c.reject(&d, false);
    let parked = t.parked(1).await;
    assert_eq!(parked[0].reason, "sender-not-allowed");
    assert_eq!(parked[0].destination.as_deref(), Some(c.as_str()));
    assert!(
        parked[0].detail.contains("unidentified = \"reject\""),
        "{}",
        parked[0].detail
    );
}

// --- TLS to the broker ------------------------------------------------------------------------

/// The RabbitMQ 4.3 node with a TLS listener (`scripts/broker up 4.3 --tls`): its `amqps://`
/// URL (EXTERNAL login) and the CA, client certificate and key `scripts/broker` made. From
/// `scripts/broker env 4.3`'s variables when set, else where `scripts/broker` puts them.
struct TlsNode {
    url: String,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl TlsNode {
    /// The node, or `None` (with a note on stderr) when it does not run here: a run with
    /// `scripts/test --3.10-only` has no 4.x nodes.
    fn find() -> Option<Self> {
        let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_string());
        let dir = "/var/tmp/ladder-broker/4.3/tls";
        let node = TlsNode {
            url: var(
                "LADDER_TEST_AMQPS_URL",
                "amqps://localhost:5771/%2f?auth_mechanism=external",
            ),
            ca: var("LADDER_TEST_TLS_CA", &format!("{dir}/ca.pem")).into(),
            cert: var("LADDER_TEST_TLS_CERT", &format!("{dir}/client.pem")).into(),
            key: var("LADDER_TEST_TLS_KEY", &format!("{dir}/client.key")).into(),
        };
        let uri: ladder_amqp::AmqpUri = node.url.parse().expect("LADDER_TEST_AMQPS_URL is an AMQP URI");
        let listening = std::net::TcpStream::connect((uri.host.as_str(), uri.port)).is_ok();
        if !listening || !node.ca.is_file() {
            eprintln!(
                "SKIPPED: no RabbitMQ TLS listener at {} (start one with `scripts/broker up 4.3 --tls`)",
                node.url
            );
            return None;
        }
        Some(node)
    }

    fn options(&self) -> ladder_amqp::TlsOptions {
        ladder_amqp::TlsOptions {
            ca_file: Some(self.ca.clone()),
            cert_file: Some(self.cert.clone()),
            key_file: Some(self.key.clone()),
            server_name: None,
        }
    }

    /// A client of the test's own, over TLS with the client certificate.
    async fn connect(&self) -> Connection {
        let mut options = ConnectOptions::new(self.url.parse().unwrap());
        options.tls = Some(self.options());
        tokio::time::timeout(WAIT, Connection::connect(&options))
            .await
            .expect("connect timed out")
            .expect("the TLS node takes the client certificate")
    }

    /// `ladder.toml` for namespace `ns` on this node, with `tls` as the `[amqp.tls]` table, and
    /// one ladder delivering to `{ns}-*`.
    fn write_config(&self, dir: &Path, ns: &str, url: &str, tls: &str) -> PathBuf {
        std::fs::write(
            dir.join("ladder.toml"),
            format!(
                "namespace = \"{ns}\"\nshutdown_grace = \"5s\"\n[admin]\nbind = \"127.0.0.1:0\"\n\
                 [amqp]\nurl = \"{url}\"\nreconnect_min = \"100ms\"\nreconnect_max = \"1s\"\n[amqp.tls]\n{tls}\n"
            ),
        )
        .unwrap();
        std::fs::create_dir_all(dir.join("ladders")).unwrap();
        std::fs::write(
            dir.join("ladders/default.toml"),
            format!("backoff = [\"200ms\"]\nallow = [\"^{ns}-\"]\n"),
        )
        .unwrap();
        dir.join("ladder.toml")
    }

    /// The `[amqp.tls]` table with this node's files.
    fn table(&self) -> String {
        format!(
            "ca_file = {:?}\ncert_file = {:?}\nkey_file = {:?}",
            self.ca.display().to_string(),
            self.cert.display().to_string(),
            self.key.display().to_string()
        )
    }

    /// Deletes what `config` declared (and `extra` queues), over TLS.
    async fn cleanup(&self, config: &ladder::config::Config, extra: &[&str]) {
        let (mut queues, exchanges) = declared_names(config);
        queues.extend(extra.iter().map(|q| q.to_string()));
        let conn = self.connect().await;
        for q in queues {
            if let Ok(ch) = conn.create_channel().await {
                let _ = tokio::time::timeout(WAIT, ch.queue_delete(&q)).await;
            }
        }
        for e in exchanges {
            if let Ok(ch) = conn.create_channel().await {
                let _ = tokio::time::timeout(WAIT, ch.exchange_delete(&e)).await;
            }
        }
        let _ = conn.close(200, "cleanup").await;
    }
}

/// Ladder connects over TLS, checks the broker's certificate against the CA file and logs in
/// with its client certificate (EXTERNAL: the broker names the user after the certificate's
/// CN), and a retry travels through it: `ladder check` and `apply` as an operator runs them,
/// then the service in process.
#[tokio::test]
async fn the_service_runs_over_tls_and_logs_in_with_its_client_certificate() {
    let Some(node) = TlsNode::find() else { return };
    let dir = tempfile::tempdir().unwrap();
    let ns = unique_namespace("tls");
    let path = node.write_config(dir.path(), &ns, &node.url, &node.table());
    let config = Arc::new(ladder::config::load(&path, &HashMap::new()).expect("the TLS config is valid"));
    let destination = format!("{ns}-orders");

    let out = ladder_output(&path, &["check"], &[]).await;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = ladder_output(&path, &["apply"], &[]).await;
    assert!(
        out.status.success(),
        "apply over TLS failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let state = Arc::new(ladder::broker::state::State::default());
    let stop = tokio_util::sync::CancellationToken::new();
    let service = tokio::spawn(ladder::broker::supervisor::run(
        config.clone(),
        state.clone(),
        stop.clone(),
    ));
    wait_until("the service is ready over TLS", || state.health.is_ready()).await;

    let client = node.connect().await;
    let channel = client.create_channel().await.unwrap();
    channel.confirm_select().await.unwrap();
    channel
        .queue_declare(
            &destination,
            ladder_amqp::QueueOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    publish(
        &channel,
        &format!("{ns}.default"),
        "",
        b"over tls",
        explicit(None, &destination, "tls-1"),
    )
    .await;
    let mut consumer = consume(&client, &destination).await;
    let d = next(&mut consumer).await;
    assert_eq!((message_id(&d), int_header(&d, "retry-attempt")), ("tls-1", Some(1)));
    consumer.ack(&d);

    // the broker's own view: Ladder's connections are TLS, as the certificate's user
    // (read until it shows, within WAIT: the broker lists a connection once its handshake is
    // registered, and a loaded machine may show the service mid-reconnect at one instant)
    let mut connections;
    let deadline = std::time::Instant::now() + WAIT;
    let found = loop {
        connections =
            String::from_utf8(rabbitmqctl_tls_node(&["list_connections", "user", "ssl", "client_properties"]).stdout)
                .unwrap();
        let found = connections
            .lines()
            .any(|l| l.starts_with("ladder-client\ttrue\t") && l.contains("{\"connection_name\",\"ladder\"}"));
        if found || std::time::Instant::now() > deadline {
            break found;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(
        found,
        "no TLS connection named ladder, as the certificate's user ladder-client, in:\n{connections}\n(service ready: {}, reconnects: {})",
        state.health.is_ready(),
        state.metrics.reconnects.get()
    );

    stop.cancel();
    tokio::time::timeout(WAIT, service)
        .await
        .expect("the service drains")
        .unwrap()
        .unwrap();
    let _ = client.close(200, "done").await;
    node.cleanup(&config, &[&destination]).await;
}

/// `rabbitmqctl ARGS` against the TLS node (node 1 of profile 4.3).
fn rabbitmqctl_tls_node(args: &[&str]) -> Output {
    let out = std::process::Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/broker"))
        .args(["ctl", "4.3", "1", "-q"])
        .args(args)
        .output()
        .expect("scripts/broker runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    out
}

/// Makes, with openssl, a CA of its own in `dir` and a client certificate it signed (CN
/// `ladder-client`, the user the TLS node knows): trusted by nobody.
fn rogue_certificates(dir: &Path) {
    let sh = |script: &str| {
        let out = std::process::Command::new("sh")
            .args(["-ec", script])
            .current_dir(dir)
            .output()
            .expect("sh runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    sh("openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj '/CN=rogue CA' -keyout rogue-ca.key -out rogue-ca.pem 2>/dev/null
        openssl req -newkey rsa:2048 -nodes -subj '/CN=ladder-client' -keyout rogue.key -out rogue.csr 2>/dev/null
        printf 'extendedKeyUsage=clientAuth\\n' >client.ext
        openssl x509 -req -in rogue.csr -CA rogue-ca.pem -CAkey rogue-ca.key -CAcreateserial -days 2 -extfile client.ext -out rogue.pem 2>/dev/null
        printf 'not a certificate\\n' >garbage.pem");
}

/// A certificate that is wrong says what is wrong: one that does not parse is a config error
/// (64) naming the key; a broker whose certificate the CA file did not sign, a name the
/// certificate does not hold, and a client certificate the broker does not trust each fail
/// `apply` with 69 and a sentence saying which.
#[tokio::test]
async fn a_bad_certificate_is_a_clear_error() {
    let Some(node) = TlsNode::find() else { return };
    let dir = tempfile::tempdir().unwrap();
    rogue_certificates(dir.path());
    let ns = unique_namespace("badtls");
    let d = dir.path().display();
    let (ca, cert, key) = (node.ca.display(), node.cert.display(), node.key.display());
    let cases: [(&str, String, &str, i32, &[&str]); 6] = [
        (
            "a CA file that holds no certificate",
            format!("ca_file = \"{d}/garbage.pem\"\ncert_file = \"{cert}\"\nkey_file = \"{key}\""),
            "check",
            64,
            &["amqp.tls.ca_file", "garbage.pem", "no certificate"],
        ),
        (
            "a key that does not parse",
            format!("ca_file = \"{ca}\"\ncert_file = \"{cert}\"\nkey_file = \"{d}/garbage.pem\""),
            "check",
            64,
            &["amqp.tls.key_file", "garbage.pem"],
        ),
        (
            "a key that is not the certificate's",
            format!("ca_file = \"{ca}\"\ncert_file = \"{cert}\"\nkey_file = \"{d}/rogue.key\""),
            "check",
            64,
            &[
                "amqp.tls.key_file",
                "rogue.key: the key does not belong to the certificate in",
            ],
        ),
        (
            "a CA that did not sign the broker's certificate",
            format!("ca_file = \"{d}/rogue-ca.pem\"\ncert_file = \"{cert}\"\nkey_file = \"{key}\""),
            "apply",
            69,
            &["not signed by a trusted CA"],
        ),
        (
            "a name the broker's certificate does not hold",
            format!(
                "ca_file = \"{ca}\"\ncert_file = \"{cert}\"\nkey_file = \"{key}\"\nserver_name = \"broker.example\""
            ),
            "apply",
            69,
            &["not valid for the name \"broker.example\""],
        ),
        (
            "a client certificate from a CA the broker does not trust",
            format!("ca_file = \"{ca}\"\ncert_file = \"{d}/rogue.pem\"\nkey_file = \"{d}/rogue.key\""),
            "apply",
            69,
            &["refused our client certificate"],
        ),
    ];
    for (case, tls, command, code, expected) in cases {
        let path = node.write_config(dir.path(), &ns, &node.url, &tls);
        let out = ladder_output(&path, &[command], &[]).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{case}:\n{stderr}");
        for text in expected {
            assert!(stderr.contains(text), "{case}: {text:?} not in\n{stderr}");
        }
    }
}

// --- secrets from files -----------------------------------------------------------------------

/// The password in a URL file and the tokens in token files (a Kubernetes Secret volume, and one
/// file per token) reach no output of any command — `check`, `plan`, `apply`, `run` and
/// `parked list`, with debug logs — whether the broker accepts the password or not.
#[tokio::test]
async fn secrets_read_from_files_never_appear_in_any_output() {
    const PASSWORD: &str = "url-file-password-7f3a";
    const TOKEN: &str = "token-file-secret-c41d9e";
    const DIR_TOKEN: &str = "token-dir-secret-88b20f";
    let user = BrokerUser::create(&unique_namespace("secret"), ".*", ".*", ".*");
    let dir = tempfile::tempdir().unwrap();
    let ns = unique_namespace("secretfiles");
    let path = write_config(
        dir.path(),
        &ns,
        "",
        "default",
        "backoff = [\"200ms\"]\nallow = [\"^{ns}-\"]\n",
    );
    // the file names its broker through url_file: drop the [amqp] url the helper wrote
    let main = std::fs::read_to_string(&path).unwrap();
    let main: String = main
        .lines()
        .filter(|l| !l.starts_with("url = "))
        .map(|l| format!("{l}\n"))
        .collect();
    let main = main.replace(
        "[amqp]\n",
        "[admin]\nbind = \"127.0.0.1:0\"\ntokens_dir = \"secrets/tokens\"\n\
         [admin.token_files]\ncarol = \"secrets/carol\"\n[amqp]\nurl_file = \"secrets/amqp-url\"\n",
    );
    std::fs::write(&path, main).unwrap();
    let secrets = dir.path().join("secrets");
    std::fs::create_dir_all(secrets.join("tokens")).unwrap();
    std::fs::write(secrets.join("carol"), format!("{TOKEN}\n")).unwrap();
    std::fs::write(secrets.join("tokens/dave"), DIR_TOKEN).unwrap();
    let url_with = |password: &str| {
        let mut url = url::Url::parse(&user.url()).unwrap();
        url.set_password(Some(password)).unwrap();
        url.to_string()
    };
    let debug = [("RUST_LOG", "debug")];
    let mut outputs = Vec::new();

    // the broker refuses the password: every command that connects says so, masked
    std::fs::write(secrets.join("amqp-url"), url_with(PASSWORD)).unwrap();
    // Regression: the cleanup loaded the config before its url_file existed, so it never ran and
    // `apply` and `run` left ten `lt-secretfiles-*` objects behind on every run. Now it loads
    // once every file is there, and deletes them when dropped, whatever happens.
    let _cleanup = Cleanup::for_config(&path);
    for command in [&["check"][..], &["plan"], &["apply"], &["parked", "list"]] {
        outputs.push((command.join(" "), ladder_output(&path, command, &debug).await));
    }
    let refused = &outputs[2].1;
    assert_eq!(
        refused.status.code(),
        Some(69),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains(":***@"),
        "the masked URL is logged"
    );

    // the right password (the user's, which is just as secret), and the service itself
    std::fs::write(secrets.join("amqp-url"), user.url()).unwrap();
    for command in [&["check"][..], &["plan"], &["apply"]] {
        outputs.push((
            format!("{} (accepted)", command.join(" ")),
            ladder_output(&path, command, &debug).await,
        ));
    }
    let mut run = ladder_binary(&path);
    run.arg("run")
        .env("RUST_LOG", "debug")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = run.spawn().unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.id().unwrap() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let out = tokio::time::timeout(WAIT, child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ready"),
        "the service ran: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    outputs.push(("run".into(), out));

    for (command, out) in &outputs {
        for (stream, text) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
            let text = String::from_utf8_lossy(text);
            for secret in [PASSWORD, TOKEN, DIR_TOKEN, user.password.as_str()] {
                assert!(
                    !text.contains(secret),
                    "{command} printed a secret on {stream}:\n{text}"
                );
            }
        }
    }
}

// --- the admin server's guards ----------------------------------------------------------------

/// One response, as a raw HTTP/1.1 exchange gives it.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Sends `method path` to `addr` with exactly `headers` (a browser's `Host`, `Origin`,
/// `Sec-Fetch-Site` …: no HTTP client library lets every one of them be set freely) and `body`.
async fn raw_http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Answer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        // the server may answer (413) before it read the whole body, and close
        let _ = stream.write_all(body).await;
        let mut raw = Vec::new();
        let _ = stream.read_to_end(&mut raw).await;
        raw
    };
    let raw = tokio::time::timeout(WAIT, exchange)
        .await
        .expect("the admin server answers");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_string(),
    }
}

const OPERATOR_TOKEN: &str = "security-test-token-0123456789";

/// Over real HTTP: a page for a name the server does not answer to is refused (DNS rebinding)
/// while its IP, the loopback names and `admin.allowed_hosts` pass, and health and metrics
/// answer any name; a form or API post from another site is refused before its token is looked
/// at; an overlong URI or body is refused; every page carries the security headers, and its
/// policy allows exactly the stylesheet the page holds.
#[tokio::test]
async fn the_admin_server_answers_only_its_own_names_and_its_own_pages() {
    let t = TestLadder::configure_with(
        "guards",
        &format!("[admin]\nallowed_hosts = [\"ladder.example.org\"]\n[admin.tokens]\nops = \"{OPERATOR_TOKEN}\""),
        "backoff = [\"1s\"]\nallow = [\"^{ns}-\"]\n",
    )
    .await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let own = admin.addr.to_string();
    let get = |host: &str, path: &str| {
        let (addr, host, path) = (admin.addr, host.to_string(), path.to_string());
        async move { raw_http(addr, "GET", &path, &[("Host", &host)], b"").await }
    };

    // DNS rebinding: the attacker's name reaches the loopback server, and is refused
    for host in ["evil.example", "evil.example:9464", "127.0.0.1.nip.io"] {
        for path in [
            "/",
            "/api/ladders",
            "/api/ladders/default/parked",
            "/ladders/default/parked",
        ] {
            let r = get(host, path).await;
            assert_eq!(r.status, 400, "{host} {path}: {}", r.body);
            assert!(r.body.contains("admin.allowed_hosts"), "{}", r.body);
        }
    }
    let r = get("evil.example", "/api/ladders").await;
    assert!(
        r.header("content-type")
            .is_some_and(|c| c.starts_with("application/json")),
        "{:?}",
        r.headers
    );
    for host in [
        own.as_str(),
        "localhost",
        "LOCALHOST:1234",
        "[::1]:9464",
        "ladder.example.org:443",
    ] {
        assert_eq!(get(host, "/api/ladders").await.status, 200, "{host}");
    }
    for path in ["/live", "/ready", "/metrics"] {
        assert_ne!(
            get("ladder:9464", path).await.status,
            400,
            "{path} answers a scraper's name"
        );
    }

    // the page's headers, and a policy that allows the server's own stylesheet and no script
    let page = get(&own, "/").await;
    assert_eq!(page.status, 200);
    let policy = page.header("content-security-policy").expect("a CSP").to_string();
    assert!(policy.contains("style-src 'self'"), "{policy}");
    assert!(
        !page.body.contains("<style") && !page.body.contains("style="),
        "no inline style"
    );
    let href = page
        .body
        .split("<link rel=\"stylesheet\" href=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .expect("a linked stylesheet")
        .to_string();
    assert!(href.starts_with("/static/ladder.css?v="), "{href}");
    let css = get(&own, &href).await;
    assert_eq!(css.status, 200);
    assert_eq!(css.header("content-type"), Some("text/css; charset=utf-8"));
    assert_eq!(css.header("cache-control"), Some("public, max-age=86400, immutable"));
    for directive in [
        "default-src 'none'",
        "frame-ancestors 'none'",
        "form-action 'self'",
        "base-uri 'none'",
    ] {
        assert!(policy.contains(directive), "{directive} not in {policy}");
    }
    assert!(
        !policy.contains("script-src") && !page.body.contains("<script"),
        "no script at all"
    );
    for (name, value) in [
        ("referrer-policy", "no-referrer"),
        ("x-content-type-options", "nosniff"),
        ("x-frame-options", "DENY"),
        ("cache-control", "no-store"),
    ] {
        assert_eq!(page.header(name), Some(value), "{name}");
    }
    let refused = get("evil.example", "/").await;
    assert_eq!(
        refused.header("x-content-type-options"),
        Some("nosniff"),
        "refusals carry them too"
    );

    // a post from another site: refused before the token is compared (the token is right)
    let form = format!("to={}-orders&token={OPERATOR_TOKEN}", t.ns);
    let api = "{\"offsets\": [7], \"dry_run\": true}".to_string();
    let posts: [(&str, &str, &str, &[u8]); 2] = [
        (
            "/ladders/default/parked/7/replay",
            "application/x-www-form-urlencoded",
            "",
            form.as_bytes(),
        ),
        (
            "/api/ladders/default/parked/replay",
            "application/json",
            OPERATOR_TOKEN,
            api.as_bytes(),
        ),
    ];
    for (path, content_type, token, body) in posts {
        let bearer = format!("Bearer {token}");
        for (site, origin) in [
            (Some("cross-site"), None),
            (Some("same-site"), Some(format!("http://other.{own}"))),
            (None, Some("http://evil.example".to_string())),
            (None, Some("null".to_string())),
        ] {
            let mut headers = vec![("Host", own.as_str()), ("Content-Type", content_type)];
            if !token.is_empty() {
                headers.push(("Authorization", &bearer));
            }
            if let Some(site) = site {
                headers.push(("Sec-Fetch-Site", site));
            }
            if let Some(origin) = &origin {
                headers.push(("Origin", origin));
            }
            let r = raw_http(admin.addr, "POST", path, &headers, body).await;
            assert_eq!(r.status, 403, "{path} {site:?} {origin:?}: {}", r.body);
            assert!(r.body.contains("cross-site request refused"), "{}", r.body);
        }
    }
    // from the server's own page, the form gets as far as its token
    let origin = format!("http://{own}");
    let r = raw_http(
        admin.addr,
        "POST",
        "/ladders/default/parked/7/replay",
        &[
            ("Host", &own),
            ("Origin", &origin),
            ("Sec-Fetch-Site", "same-origin"),
            ("Content-Type", "application/x-www-form-urlencoded"),
        ],
        format!("to={}-orders", t.ns).as_bytes(),
    )
    .await;
    assert_eq!(r.status, 403);
    assert!(r.body.contains("no token was given"), "{}", r.body);

    // bounded URIs and bodies
    let long = format!("/api/ladders/default/parked?body={}", "a".repeat(9 * 1024));
    let r = get(&own, &long).await;
    assert_eq!(r.status, 414, "{}", r.body);
    let big = format!("{{\"offsets\": [{}]}}", vec!["1234567890"; 30_000].join(","));
    let bearer = format!("Bearer {OPERATOR_TOKEN}");
    let r = raw_http(
        admin.addr,
        "POST",
        "/api/ladders/default/parked/discard",
        &[
            ("Host", &own),
            ("Content-Type", "application/json"),
            ("Authorization", &bearer),
        ],
        big.as_bytes(),
    )
    .await;
    assert_eq!(r.status, 413, "{} bytes: {}", big.len(), r.body);
    admin.stop().await;
}

// --- operator output is inert -----------------------------------------------------------------

/// Retitles the terminal (OSC 2, ended by BEL) and clears it (CSI 2J), as a message may try.
const ATTACK: &str = "\x1b]2;pwned\x07\x1b[2J";

/// The same with the one-byte C1 CSI and a right-to-left override, which some terminals honour too.
const ATTACK_C1: &str = "\u{9b}2J\u{202e}desrever";

/// The control characters (and bidirectional overrides) in `text` but for line ends and the
/// tabs the CLI separates columns with.
fn raw_controls(text: &str) -> Vec<char> {
    text.chars()
        .filter(|c| {
            (c.is_control() && !matches!(c, '\n' | '\t'))
                || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        })
        .collect()
}

/// Every string a message controls — message id, destination, header names and values,
/// `retry-replayed-from`, the reason's detail, who resolved it — holds escape sequences; the
/// real CLI (`list`, `list --all`, `show`, `counts`, `replay --dry-run`, `discard`, each as
/// text and as JSON) and the log of `ladder run` that parked them show them escaped, visibly,
/// and never as the bytes a terminal would act on.
#[tokio::test]
async fn escape_sequences_from_a_message_never_reach_the_operators_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let ns = unique_namespace("inert");
    let path = write_config(
        dir.path(),
        &ns,
        "[admin]\nbind = \"127.0.0.1:0\"",
        "default",
        "backoff = [\"200ms\"]\nallow = [\"^{ns}-\"]\n",
    );
    let config = ladder::config::load(&path, &HashMap::new()).unwrap();
    // declared before anything is published to it; the service then parks what arrives
    let applied = ladder_output(&path, &["apply"], &[]).await;
    assert!(applied.status.success(), "{}", String::from_utf8_lossy(&applied.stderr));
    let mut service = ladder_binary(&path);
    service
        .arg("run")
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let service = service.spawn().unwrap();
    let client = connect().await;
    let channel = client.create_channel().await.unwrap();
    channel.confirm_select().await.unwrap();
    let intake = format!("{ns}.default");

    // explicit mode, to a destination named by the attack: parked as destination-not-allowed
    let mut headers = FieldTable::default();
    headers.set("retry-to", text(&format!("{ATTACK}{ATTACK_C1}")));
    headers.set(&format!("{ATTACK}name"), text(&format!("value{ATTACK}{ATTACK_C1}")));
    headers.set("retry-replayed-from", text(&format!("{ns}.default.parked@1{ATTACK}")));
    let props = BasicProperties::default()
        .with_headers(headers)
        .with_message_id(&format!("id{ATTACK}{ATTACK_C1}"))
        .with_correlation_id(ATTACK);
    publish(&channel, &intake, "", b"body", props).await;
    // a forged dead-lettering into the quarantine: the x-death's queue and reason reach the detail
    let mut death = FieldTable::default();
    death.set("queue", text(&format!("q{ATTACK}")));
    death.set("reason", text(&format!("why{ATTACK_C1}")));
    let mut headers = FieldTable::default();
    headers.set("x-death", FieldValue::FieldArray(vec![FieldValue::FieldTable(death)]));
    let props = BasicProperties::default()
        .with_headers(headers)
        .with_message_id("quarantined");
    publish(&channel, &format!("{ns}.default.quarantine"), "", b"body", props).await;
    read_parked(&client, &format!("{ns}.default.parked"), 2).await;

    // a queue the ladder may deliver to, named with the attack too: `replay --to` it succeeds
    let odd_queue = format!("{ns}-to{ATTACK}");
    channel
        .queue_declare(&odd_queue, ladder_amqp::QueueOptions::default(), FieldTable::default())
        .await
        .expect("the broker takes a queue name with control characters");
    let by = format!("op{ATTACK}");
    let runs: Vec<Vec<String>> = vec![
        vec!["parked".into(), "list".into()],
        vec!["parked".into(), "list".into(), "--json".into()],
        vec!["parked".into(), "show".into(), "0".into()],
        vec!["parked".into(), "show".into(), "0".into(), "--json".into()],
        vec!["parked".into(), "counts".into()],
        vec!["parked".into(), "counts".into(), "--json".into()],
        vec![
            "parked".into(),
            "replay".into(),
            "--reason".into(),
            "destination-not-allowed".into(),
            "--dry-run".into(),
        ],
        vec![
            "parked".into(),
            "replay".into(),
            "--reason".into(),
            "destination-not-allowed".into(),
        ],
        vec![
            "parked".into(),
            "replay".into(),
            "--reason".into(),
            "destination-not-allowed".into(),
            "--to".into(),
            odd_queue.clone(),
        ],
        vec![
            "parked".into(),
            "discard".into(),
            "--reason".into(),
            "dead-lettered".into(),
            "--yes".into(),
            "--by".into(),
            by.clone(),
        ],
        vec!["parked".into(), "list".into(), "--all".into()],
        vec!["parked".into(), "list".into(), "--all".into(), "--json".into()],
    ];
    let mut outputs = Vec::new();
    for args in &runs {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        outputs.push((args.join(" "), ladder_output(&path, &args, &[]).await));
    }
    // `show` of the second entry, whatever its offset
    let listed = String::from_utf8_lossy(&outputs[1].1.stdout).into_owned();
    let listed: serde_json::Value = serde_json::from_str(&listed).expect("list --json is JSON");
    for entry in listed["entries"].as_array().unwrap() {
        let offset = entry["offset"].to_string();
        outputs.push((
            format!("show {offset}"),
            ladder_output(&path, &["parked", "show", &offset], &[]).await,
        ));
    }

    rustix::process::kill_process(
        rustix::process::Pid::from_raw(service.id().unwrap() as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let log = tokio::time::timeout(WAIT, service.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    outputs.push(("run".into(), log));

    let mut shown = String::new();
    for (command, out) in &outputs {
        for (stream, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
            let text = String::from_utf8_lossy(bytes);
            assert!(
                raw_controls(&text).is_empty(),
                "`ladder {command}` {stream} holds {:?}:\n{text}",
                raw_controls(&text)
            );
            shown.push_str(&text);
        }
        assert!(
            out.status.success() || command.contains("replay"),
            "`ladder {command}` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // shown visibly, not dropped: the escape, the BEL and the C1 CSI as escapes
    for visible in [
        "\\u{1b}]2;pwned\\u{7}\\u{1b}[2J",
        "\\u{9b}2J\\u{202e}desrever",
        "\\u001b]2;pwned\\u0007\\u001b[2J",
    ] {
        assert!(shown.contains(visible), "{visible} is not shown");
    }
    for field in [
        "id\\u{1b}",
        "\\u{1b}[2Jname (long-string) = \"value\\u001b",
        "replayed from ",
        "@1\\u{1b}",
        "q\\u{1b}",
        "why\\u{9b}",
        "by op\\u{1b}",
        "replayed to lt-inert-",
        "-to\\u{1b}]2;pwned",
    ] {
        assert!(shown.contains(field), "{field} is not shown:\n{shown}");
    }
    let (mut queues, exchanges) = declared_names(&config);
    queues.push(odd_queue);
    delete_all(queues, exchanges).await;
    let _ = client.close(200, "done").await;
}

/// Every string value in `value`, at any depth.
fn strings(value: &serde_json::Value) -> Vec<&str> {
    match value {
        serde_json::Value::String(s) => vec![s.as_str()],
        serde_json::Value::Array(items) => items.iter().flat_map(strings).collect(),
        serde_json::Value::Object(map) => map.values().flat_map(strings).collect(),
        _ => vec![],
    }
}

/// The CLI's JSON (`parked list --json`, `show --json`) escapes what serde_json leaves raw —
/// the C1 CSI, bidirectional controls and marks, zero-width characters — as `\uXXXX`, so the
/// text holds none of them, and still parses back to the exact message id.
#[tokio::test]
async fn json_output_escapes_c1_and_bidi_controls_yet_parses_back_to_the_same_id() {
    let t = TestLadder::start("inert-json", "backoff = [\"200ms\"]\nallow = [\"^{ns}-\"]\n").await;
    let id = format!("id{ATTACK_C1}\u{200f}\u{61c}\u{2066}\u{200b}\u{85}end");
    // no destination: parked as soon as the intake reads it
    let props = BasicProperties::default().with_message_id(&id);
    t.publish(&t.intake(), "", b"body", props).await;
    t.parked(1).await;
    let listed = ladder_output(&t.config_path(), &["parked", "list", "--json"], &[]).await;
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    let listed = String::from_utf8(listed.stdout).expect("JSON is UTF-8");
    let page: serde_json::Value = serde_json::from_str(&listed).expect("list --json is JSON");
    let offset = page["entries"][0]["offset"].to_string();
    let shown = ladder_output(&t.config_path(), &["parked", "show", &offset, "--json"], &[]).await;
    assert!(shown.status.success(), "{}", String::from_utf8_lossy(&shown.stderr));
    let shown = String::from_utf8(shown.stdout).expect("JSON is UTF-8");
    for (command, text) in [("list --json", &listed), ("show --json", &shown)] {
        let raw: Vec<char> = text
            .chars()
            .filter(|c| {
                (c.is_control() && *c != '\n')
                    || matches!(c, '\u{61c}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
            })
            .collect();
        assert!(raw.is_empty(), "`ladder parked {command}` holds {raw:?}:\n{text}");
        assert!(
            text.contains("id\\u009b2J\\u202edesrever\\u200f\\u061c\\u2066\\u200b\\u0085end"),
            "{text}"
        );
        let value: serde_json::Value = serde_json::from_str(text).expect("the escaped JSON parses");
        assert!(
            strings(&value).contains(&id.as_str()),
            "`{command}` does not parse back to {id:?}:\n{text}"
        );
    }
}

/// Every kind of page the web UI serves — overview, parked list, one entry, a confirmation form
/// — loads in headless Chromium without a Content-Security-Policy violation: the policy's hash
/// is the one of the stylesheet the browser sees, and the pages need nothing the policy
/// forbids. (Chromium logs each violation on the console; a page whose style it refused is
/// reported there, which a negative check in this test proves.)
#[tokio::test]
async fn the_pages_load_in_a_browser_without_violating_their_policy() {
    const CHROMIUM: &str = "/usr/bin/chromium";
    if !Path::new(CHROMIUM).exists() {
        eprintln!("SKIPPED: no {CHROMIUM} (apt-get install chromium)");
        return;
    }
    let mut t = TestLadder::configure_with(
        "csp",
        &format!("[admin.tokens]\nops = \"{OPERATOR_TOKEN}\""),
        "backoff = [\"200ms\"]\nallow = [\"^{ns}-\"]\n",
    )
    .await;
    t.start_service().await;
    t.publish(&t.intake(), "", b"x", explicit(None, "elsewhere", "csp-1"))
        .await;
    t.parked(1).await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let host = admin.addr.to_string();
    let offset = {
        let mut offset = None;
        for _ in 0..100 {
            let r = raw_http(
                admin.addr,
                "GET",
                "/api/ladders/default/parked",
                &[("Host", &host)],
                b"",
            )
            .await;
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
            if let Some(o) = v["entries"][0]["offset"].as_u64() {
                offset = Some(o);
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        offset.expect("the admin server indexed the parked entry")
    };
    let profile = tempfile::tempdir().unwrap();
    let load = |target: String| {
        let profile = profile.path().to_path_buf();
        async move {
            let run = tokio::process::Command::new(CHROMIUM)
                .args([
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--enable-logging=stderr",
                    "--v=0",
                ])
                .arg(format!("--user-data-dir={}", profile.display()))
                .args(["--dump-dom", &target])
                .kill_on_drop(true)
                .output();
            let out = tokio::time::timeout(WAIT, run)
                .await
                .expect("chromium ends")
                .expect("chromium runs");
            (
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    for (path, element) in [
        ("/".to_string(), "id=\"ladders\""),
        ("/ladders/default/parked".to_string(), "id=\"entries\""),
        (format!("/ladders/default/parked/{offset}"), "id=\"summary\""),
        (format!("/ladders/default/parked/{offset}/replay"), "id=\"confirm\""),
    ] {
        let (dom, console) = load(admin.url(&path)).await;
        assert!(dom.contains(element), "{path} did not render: {dom}");
        assert!(
            !console.contains("Content Security Policy"),
            "{path} violates its policy:\n{console}"
        );
    }
    // the check can fail: the same stylesheet under a policy without its hash is reported
    let page = raw_http(admin.addr, "GET", "/", &[("Host", &host)], b"").await;
    let refused = page.body.replacen(
        "<head>",
        "<head><meta http-equiv=\"Content-Security-Policy\" content=\"style-src 'none'\">",
        1,
    );
    let file = profile.path().join("refused.html");
    std::fs::write(&file, refused).unwrap();
    let (_, console) = load(format!("file://{}", file.display())).await;
    assert!(
        console.contains("Content Security Policy"),
        "no violation reported:\n{console}"
    );
    admin.stop().await;
}
