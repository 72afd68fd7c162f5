//! The config loader's rules, one test per rule.

use super::*;

struct Fixture {
    dir: tempfile::TempDir,
}

impl Fixture {
    fn new(main: &str, ladders: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ladder.toml"), main).unwrap();
        std::fs::create_dir(dir.path().join("ladders")).unwrap();
        for (name, text) in ladders {
            std::fs::write(dir.path().join("ladders").join(format!("{name}.toml")), text).unwrap();
        }
        Fixture { dir }
    }

    fn load(&self, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        load(&self.dir.path().join("ladder.toml"), &env)
    }
}

const GOOD_LADDER: &str = r#"
    backoff = ["200ms", "1s", "1m"]
    allow = ["^orders$"]
"#;

/// The one ladder of a config with this ladder file.
fn one(ladder: &str) -> LadderSpec {
    Fixture::new("", &[("default", ladder)])
        .load(&[])
        .unwrap()
        .ladders
        .remove(0)
}

fn problem(main: &str, ladder: &str) -> ConfigError {
    Fixture::new(main, &[("default", ladder)]).load(&[]).unwrap_err()
}

#[test]
fn defaults() {
    let c = Fixture::new("", &[("default", GOOD_LADDER)]).load(&[]).unwrap();
    assert_eq!(c.namespace, "ladder");
    assert_eq!(c.limits.prefetch, 200);
    assert_eq!(c.limits.max_header_bytes, 16 * 1024);
    assert_eq!(c.shutdown_grace, Duration::from_secs(10));
    assert_eq!(c.admin.bind, "127.0.0.1:9464".parse::<SocketAddr>().unwrap());
    assert_eq!(c.admin.poll_interval, Duration::from_secs(5));
    let l = &c.ladders[0];
    assert_eq!(l.name, "default");
    assert_eq!(l.max_attempts, 3);
    assert_eq!(l.queue_type, QueueType::Quorum);
    assert_eq!(l.dead_letter_strategy, DeadLetterStrategy::AtLeastOnce);
    assert!(l.allows("orders") && !l.allows("orders2"));
    let a = &c.amqp;
    assert_eq!(
        (a.heartbeat, a.heartbeat_timeout, a.stall_timeout),
        (Duration::from_secs(1), Duration::from_secs(3), Duration::from_secs(3))
    );
}

#[test]
fn partition_timeouts_are_checked() {
    let c = Fixture::new("[amqp]\nheartbeat = \"2s\"", &[("default", GOOD_LADDER)])
        .load(&[])
        .unwrap();
    assert_eq!(
        c.amqp.heartbeat_timeout,
        Duration::from_secs(6),
        "three intervals of a heartbeat given"
    );
    for (main, key) in [
        ("[amqp]\nheartbeat = \"1500ms\"", "amqp.heartbeat"),
        (
            "[amqp]\nheartbeat = \"2s\"\nheartbeat_timeout = \"2s\"",
            "amqp.heartbeat_timeout",
        ),
        ("[amqp]\nstall_timeout = \"100ms\"", "amqp.stall_timeout"),
    ] {
        assert_eq!(problem(main, GOOD_LADDER).key, key, "{main}");
    }
    let off = Fixture::new("[amqp]\nheartbeat = \"0s\"", &[("default", GOOD_LADDER)])
        .load(&[])
        .unwrap();
    assert!(off.amqp.heartbeat.is_zero());
}

#[test]
fn environment_overrides_nested_keys() {
    let f = Fixture::new(
        "namespace = \"a\"\n[amqp]\nurl = \"amqp://u:p@h:1/v\"\n",
        &[("default", GOOD_LADDER)],
    );
    let c = f
        .load(&[
            ("LADDER_NAMESPACE", "b"),
            ("LADDER_AMQP__URL", "amqp://x:secret@y:2/%2f"),
            ("LADDER_PREFETCH", "7"),
            ("OTHER_PREFETCH", "9"),
        ])
        .unwrap();
    assert_eq!(c.namespace, "b");
    assert_eq!(c.amqp.urls[0].expose(), "amqp://x:secret@y:2/%2f");
    assert_eq!(c.limits.prefetch, 7);
}

#[test]
fn variables_that_name_no_key_are_ignored() {
    // what Kubernetes injects for a Service named `ladder`, and a tool's own variable
    let f = Fixture::new("namespace = \"a\"\n", &[("default", GOOD_LADDER)]);
    let c = f
        .load(&[
            ("LADDER_PORT", "tcp://10.0.0.1:9464"),
            ("LADDER_SERVICE_HOST", "10.0.0.1"),
            ("LADDER_PORT_9464_TCP_ADDR", "10.0.0.1"),
            ("LADDER_TEST_AMQP_URL", "amqp://elsewhere"),
            ("LADDER_TOKEN", "not a config key"),
            ("LADDER_ADMIN__TOKENS__", "no name"),
            ("LADDER_PREFETCH", "9"),
        ])
        .unwrap();
    assert_eq!((c.namespace.as_str(), c.limits.prefetch), ("a", 9));
    assert!(c.admin.tokens.is_empty());
    // every listed key is one the config takes: each overrides, none is refused
    for key in ENV_KEYS {
        assert!(is_config_variable(&key.to_ascii_uppercase()), "{key}");
    }
    assert!(!is_config_variable("AMQP") && !is_config_variable("ADMIN__TOKENS"));
}

#[test]
fn amqp_urls_is_a_list_or_a_comma_separated_string_and_url_still_works() {
    let f = Fixture::new(
        "[amqp]\nurls = [\"amqp://a:1/%2f\", \"amqp://b:2/%2f\"]\n",
        &[("default", GOOD_LADDER)],
    );
    let c = f.load(&[]).unwrap();
    let urls: Vec<&str> = c.amqp.urls.iter().map(SecretUri::expose).collect();
    assert_eq!(urls, ["amqp://a:1/%2f", "amqp://b:2/%2f"]);
    let c = f
        .load(&[("LADDER_AMQP__URLS", "amqp://c:3/%2f, amqp://d:4/%2f")])
        .unwrap();
    assert_eq!(c.amqp.urls.len(), 2);
    assert_eq!(c.amqp.urls[1].expose(), "amqp://d:4/%2f");
    let one = Fixture::new("[amqp]\nurl = \"amqp://u:pw@h:1/%2f\"\n", &[("default", GOOD_LADDER)]);
    let c = one.load(&[]).unwrap();
    assert_eq!(c.amqp.urls.len(), 1);
    assert_eq!(c.amqp.brokers(), "amqp://u:***@h:1/%2f");
    for (text, key) in [
        ("[amqp]\nurl = \"amqp://a\"\nurls = [\"amqp://b\"]\n", "amqp.urls"),
        ("[amqp]\nurls = []\n", "amqp.urls"),
        ("[amqp]\nurls = [\"amqp://a\", \"http://b\"]\n", "amqp.urls"),
    ] {
        let bad = Fixture::new(text, &[("default", GOOD_LADDER)]);
        assert_eq!(bad.load(&[]).unwrap_err().key, key, "{text}");
    }
}

#[test]
fn tokens_are_named_and_never_printed() {
    let f = Fixture::new(
        "[admin.tokens]\nalice = \"0123456789abcdef\"\n",
        &[("default", GOOD_LADDER)],
    );
    let c = f
        .load(&[("LADDER_ADMIN__TOKENS__BOB", "fedcba9876543210-bob")])
        .unwrap();
    let names: Vec<_> = c.admin.tokens.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["alice", "bob"]);
    assert_eq!(c.admin.tokens[1].token, "fedcba9876543210-bob");
    let printed = format!("{c:?}");
    assert!(
        !printed.contains("0123456789abcdef") && printed.contains("alice"),
        "{printed}"
    );
    assert!(f.load(&[]).unwrap().admin.tokens.len() == 1);
    assert!(
        Fixture::new("", &[("default", GOOD_LADDER)])
            .load(&[])
            .unwrap()
            .admin
            .tokens
            .is_empty()
    );
}

#[test]
fn admin_table_sets_bind_and_poll_interval() {
    let f = Fixture::new(
        "[admin]\nbind = \"[::1]:9000\"\npoll_interval = \"100ms\"\n",
        &[("default", GOOD_LADDER)],
    );
    let c = f.load(&[]).unwrap();
    assert_eq!(c.admin.bind, "[::1]:9000".parse::<SocketAddr>().unwrap());
    assert_eq!(c.admin.poll_interval, Duration::from_millis(100));
    let c = f
        .load(&[
            ("LADDER_ADMIN__BIND", "0.0.0.0:9464"),
            ("LADDER_ADMIN__POLL_INTERVAL", "1m"),
        ])
        .unwrap();
    assert_eq!(c.admin.bind, "0.0.0.0:9464".parse::<SocketAddr>().unwrap());
    assert_eq!(c.admin.poll_interval, Duration::from_secs(60));
}

#[test]
fn uri_password_is_redacted() {
    let uri = SecretUri::new("amqp://user:hunter2@host:5672/%2f");
    assert!(!format!("{uri} {uri:?}").contains("hunter2"));
    assert!(uri.to_string().contains("user"));
}

#[test]
fn unknown_key_is_rejected() {
    let e = problem("prefetc = 3", GOOD_LADDER);
    assert_eq!(e.key, "prefetc", "{e}");
    let e = problem("[amqp]\nurll = \"x\"", GOOD_LADDER);
    assert_eq!(e.key, "amqp.urll", "{e}");
    let e = problem("prefetch = \"many\"", GOOD_LADDER);
    assert_eq!(e.key, "prefetch", "{e}");
    let e = problem("", "backoff = [\"1s\"]\nallow = []\nmax_atempts = 3");
    assert_eq!(e.key, "max_atempts", "{e}");
    assert!(e.file.ends_with("default.toml"));
    let e = problem("", "allow = []\n\nbackoff = [\"soon\"]");
    assert_eq!(e.key, "backoff[0]", "{e}");
    assert!(e.problem.ends_with("(line 3)"), "{e}");
    let e = problem("", "backoff = [\"1s\"]\nallow = []\nqueue_type = \"stream\"");
    assert_eq!(e.key, "queue_type", "{e}");
    assert!(e.problem.contains("`quorum`") && e.problem.contains("`classic`"), "{e}");
    let e = problem("[amqp]\nreconnect_min = \"fast\"", GOOD_LADDER);
    assert_eq!(e.key, "amqp.reconnect_min", "{e}");
    let e = problem("[admin.tokens]\nalice = 5", GOOD_LADDER);
    assert!(e.key.starts_with("admin.tokens"), "{e}");
}

#[test]
fn brokers_from_the_environment_win_over_the_file() {
    let f = Fixture::new("[amqp]\nurl = \"amqp://file:5672\"", &[("default", GOOD_LADDER)]);
    let c = f.load(&[("LADDER_AMQP__URLS", "amqp://a:5672,amqp://b:5672")]).unwrap();
    let urls: Vec<_> = c.amqp.urls.iter().map(|u| u.expose().to_string()).collect();
    assert_eq!(urls, ["amqp://a:5672", "amqp://b:5672"]);
    let f = Fixture::new(
        "[amqp]\nurls = [\"amqp://f1:5672\", \"amqp://f2:5672\"]",
        &[("default", GOOD_LADDER)],
    );
    let c = f.load(&[("LADDER_AMQP__URL", "amqp://env:5672")]).unwrap();
    let urls: Vec<_> = c.amqp.urls.iter().map(|u| u.expose().to_string()).collect();
    assert_eq!(urls, ["amqp://env:5672"]);
    // both in the file is a mistake in the file
    let e = problem(
        "[amqp]\nurl = \"amqp://x:5672\"\nurls = [\"amqp://y:5672\"]",
        GOOD_LADDER,
    );
    assert_eq!(e.key, "amqp.urls", "{e}");
}

#[test]
fn release_rate_and_auto_hold() {
    let l = one("backoff = [\"1s\"]\nallow = []");
    assert_eq!(l.release_rate, crate::model::ladder::DEFAULT_RELEASE_RATE);
    assert_eq!(l.auto_hold, None);
    let l = one(
        "backoff = [\"1s\"]\nallow = []\nrelease_rate = \"3/s\"\n[auto_hold]\nenabled = true\nwindow = \"10s\"\nfailure_ratio = \"80%\"\nmin_deliveries = 5\nprobe_every = \"2s\"",
    );
    assert_eq!(l.release_rate, "3/s".parse().unwrap());
    let p = l.auto_hold.unwrap();
    assert_eq!(
        (p.window, p.min_deliveries, p.failure_permille, p.probe_every),
        (Duration::from_secs(10), 5, 800, Duration::from_secs(2))
    );
    // a release ramps every 5 s unless configured; "off" keeps its rate
    assert_eq!(l.release_ramp, Some(Duration::from_secs(5)));
    let ramp = |value: &str| one(&format!("backoff = [\"1s\"]\nallow = []\nrelease_ramp = \"{value}\"")).release_ramp;
    assert_eq!((ramp("2s"), ramp("off")), (Some(Duration::from_secs(2)), None));
    let e = problem("", "backoff = [\"1s\"]\nallow = []\nrelease_ramp = \"10ms\"");
    assert_eq!(e.key, "release_ramp");
    // an earlier release's max_hold still loads
    let l = one("backoff = [\"1s\"]\nallow = []\n[auto_hold]\nenabled = true\nmax_hold = \"10m\"");
    assert_eq!(l.auto_hold.unwrap().probe_every, Duration::from_secs(4));
    // off unless enabled, even when configured
    assert_eq!(
        one("backoff = [\"1s\"]\nallow = []\n[auto_hold]\nwindow = \"10s\"").auto_hold,
        None
    );
    for (toml, key, says) in [
        (
            "backoff = [\"1s\"]\nallow = []\nrelease_rate = \"fast\"",
            "release_rate",
            "N/s",
        ),
        (
            "backoff = [\"1s\"]\nallow = []\n[auto_hold]\nfailure_ratio = \"90\"",
            "auto_hold.failure_ratio",
            "percentage",
        ),
        (
            "backoff = [\"1s\"]\nallow = []\n[auto_hold]\nfailure_ratio = \"0%\"",
            "auto_hold.failure_ratio",
            "between",
        ),
        (
            "backoff = [\"1s\"]\nallow = []\n[auto_hold]\nmin_deliveries = 0",
            "auto_hold.min_deliveries",
            "at least 1",
        ),
        (
            "backoff = [\"1s\"]\nallow = []\n[auto_hold]\nwindow = \"10ms\"",
            "auto_hold.window",
            "between",
        ),
    ] {
        let e = problem("", toml);
        assert_eq!(e.key, key, "{toml}");
        assert!(e.problem.contains(says), "{toml}: {}", e.problem);
    }
}

#[test]
fn exact_delays_jitter_and_exchange_targets() {
    let l = one(GOOD_LADDER);
    assert!(l.exact_delays, "on unless a ladder turns them off");
    assert_eq!(l.jitter, None);
    assert!(l.tiers.len() > l.steps.len(), "levels are declared");
    let l = one("backoff = [\"1s\"]\nallow = []\njitter = \"12.5%\"\nallow_exchanges = [\"^events$\"]");
    assert_eq!(l.jitter, Some(Jitter { permille: 125 }));
    assert!(l.allow_exchanges.is_match("events") && !l.allow_exchanges.is_match("other"));
    let l = one("backoff = [\"1s\"]\nallow = []\nexact_delays = false");
    assert!(!l.exact_delays);
    assert_eq!(l.tiers, l.steps, "only the steps are declared");
    for (ladder, key, says) in [
        (
            "backoff = [\"1s\"]\nallow = []\njitter = \"10\"",
            "jitter",
            "percentage",
        ),
        (
            "backoff = [\"1s\"]\nallow = []\njitter = \"60%\"",
            "jitter",
            "between 0% and 50%",
        ),
        (
            "backoff = [\"1s\"]\nallow = []\nexact_delays = false\njitter = \"5%\"",
            "jitter",
            "exact_delays",
        ),
        (
            "backoff = [\"1s\"]\nallow = []\nexact_delays = false\nallow_exchanges = [\"x\"]",
            "allow_exchanges",
            "exact_delays",
        ),
        (
            "backoff = [\"1s\"]\nallow = []\nallow_exchanges = [\"(\"]",
            "allow_exchanges",
            "invalid regex",
        ),
        (
            "backoff = [\"1s\"]\nallow = []\nfirst_failures = \"direct\"",
            "first_failures",
            "unknown field",
        ),
    ] {
        let e = problem("", ladder);
        assert_eq!(e.key, key, "{ladder}: {e}");
        assert!(e.problem.contains(says), "{ladder}: {e}");
    }
}

#[test]
fn missing_file_and_missing_ladders() {
    let f = Fixture::new("", &[]);
    let e = f.load(&[]).unwrap_err();
    assert!(e.problem.contains("no ladder files"), "{e}");
    let e = load(Path::new("/nonexistent/ladder.toml"), &HashMap::new()).unwrap_err();
    assert!(e.problem.contains("not found"));
}

#[test]
fn each_rule_names_its_key() {
    let cases: &[(&str, &str, &str)] = &[
        ("namespace = \"\"", GOOD_LADDER, "namespace"),
        ("namespace = \"amq.x\"", GOOD_LADDER, "namespace"),
        ("namespace = \"a b\"", GOOD_LADDER, "namespace"),
        ("prefetch = 0", GOOD_LADDER, "prefetch"),
        ("prefetch = 70000", GOOD_LADDER, "prefetch"),
        ("max_header_bytes = 10", GOOD_LADDER, "max_header_bytes"),
        ("max_header_bytes = 1000000", GOOD_LADDER, "max_header_bytes"),
        ("max_reason_bytes = 1", GOOD_LADDER, "max_reason_bytes"),
        ("[admin]\nbind = \"localhost\"", GOOD_LADDER, "admin.bind"),
        (
            "[admin.tokens]\nalice = \"too-short\"",
            GOOD_LADDER,
            "admin.tokens.alice",
        ),
        (
            "[admin.tokens]\n\"a b\" = \"0123456789abcdef\"",
            GOOD_LADDER,
            "admin.tokens.a b",
        ),
        ("[admin]\nbind = \"127.0.0.1\"", GOOD_LADDER, "admin.bind"),
        ("[admin]\nbind = \"127.0.0.1:99999\"", GOOD_LADDER, "admin.bind"),
        ("[admin]\npoll_interval = \"99ms\"", GOOD_LADDER, "admin.poll_interval"),
        ("[admin]\npoll_interval = \"0s\"", GOOD_LADDER, "admin.poll_interval"),
        ("[admin]\npoll_interval = \"often\"", GOOD_LADDER, "admin.poll_interval"),
        ("[admin]\nport = 9464", GOOD_LADDER, "admin.port"),
        ("[amqp]\nurl = \"http://x\"", GOOD_LADDER, "amqp.url"),
        (
            "[amqp]\nreconnect_min = \"1m\"\nreconnect_max = \"1s\"",
            GOOD_LADDER,
            "amqp.reconnect_min",
        ),
        ("", "backoff = []\nallow = []", "backoff"),
        ("", "backoff = [\"0s\"]\nallow = []", "backoff[0]"),
        ("", "backoff = [\"1s\", \"1500us\"]\nallow = []", "backoff[1]"),
        ("", "backoff = [\"60d\"]\nallow = []", "backoff[0]"),
        ("", "backoff = [\"1s\"]\nmax_attempts = 0\nallow = []", "max_attempts"),
        ("", "backoff = [\"1s\"]", "allow"),
        ("", "backoff = [\"1s\"]\nallow = [\"(\"]", "allow"),
        (
            "",
            "backoff = [\"1s\"]\nallow = []\nqueue_type = \"lazy\"",
            "queue_type",
        ),
        (
            "",
            "backoff = [\"1s\"]\nallow = []\ndead_letter_strategy = \"twice\"",
            "dead_letter_strategy",
        ),
        (
            "",
            "backoff = [\"1s\"]\nallow = []\nqueue_type = \"classic\"\ndead_letter_strategy = \"at-least-once\"",
            "dead_letter_strategy",
        ),
    ];
    for (main, ladder, key) in cases {
        let e = problem(main, ladder);
        assert_eq!(&e.key, key, "main={main:?} ladder={ladder:?}: {e}");
    }
}

#[test]
fn senders_grant_destinations_and_unidentified_defaults_to_reject() {
    use crate::model::ladder::Mode;
    let c = Fixture::new(
        "",
        &[(
            "default",
            "backoff = [\"1s\"]\nallow = [\"^orders$\", \"^billing\\\\.\"]\n\
             [senders]\nbilling-svc = [\"^billing\\\\.\"]\n\"orders svc\" = [\"^orders$\"]\n",
        )],
    )
    .load(&[])
    .unwrap();
    let senders = c.ladders[0].senders.as_ref().unwrap();
    assert_eq!(senders.unidentified, Unidentified::Reject);
    assert!(
        senders
            .refuse("default", Some("billing-svc"), Mode::Explicit, "billing.x")
            .is_none()
    );
    assert!(
        senders
            .refuse("default", Some("orders svc"), Mode::Explicit, "orders")
            .is_none()
    );
    assert!(
        senders
            .refuse("default", Some("billing-svc"), Mode::Explicit, "orders")
            .is_some()
    );
    let c = Fixture::new(
        "",
        &[(
            "default",
            "backoff = [\"1s\"]\nallow = []\nunidentified = \"dead-letter\"\n[senders]\n",
        )],
    )
    .load(&[])
    .unwrap();
    let senders = c.ladders[0].senders.as_ref().unwrap();
    assert_eq!(senders.unidentified, Unidentified::DeadLetter);
    assert!(senders.grants.is_empty());
    let without = Fixture::new("", &[("default", GOOD_LADDER)]).load(&[]).unwrap();
    assert!(without.ladders[0].senders.is_none());
    for (ladder, key) in [
        (
            "backoff = [\"1s\"]\nallow = []\nunidentified = \"reject\"",
            "unidentified",
        ),
        (
            "backoff = [\"1s\"]\nallow = []\nunidentified = \"maybe\"",
            "unidentified",
        ),
        ("backoff = [\"1s\"]\nallow = []\n[senders]\na = [\"(\"]", "senders.a"),
        ("backoff = [\"1s\"]\nallow = []\n[senders]\n\"\" = []", "senders."),
        ("backoff = [\"1s\"]\nallow = []\n[senders]\na = \"^x$\"", "senders.a"),
    ] {
        let e = problem("", ladder);
        assert_eq!(e.key, key, "{ladder}: {e}");
    }
}

#[test]
fn brokers_and_tokens_come_from_files_as_kubernetes_mounts_secrets() {
    let f = Fixture::new(
        "[amqp]\nurl_file = \"secrets/url\"\n[admin]\ntokens_dir = \"tokens\"\n\
         [admin.token_files]\ncarol = \"secrets/carol\"\n",
        &[("default", GOOD_LADDER)],
    );
    let dir = f.dir.path();
    std::fs::create_dir_all(dir.join("secrets")).unwrap();
    std::fs::write(dir.join("secrets/url"), "amqp://u:file-secret@h:1/%2f\n").unwrap();
    std::fs::write(dir.join("secrets/carol"), "carol-token-0123456789\n").unwrap();
    // what a Secret volume holds: the keys as links into a hidden, timestamped folder
    let data = dir.join("tokens/..2026_01_01_00_00_00.1");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("alice"), "alice-token-0123456789").unwrap();
    std::os::unix::fs::symlink("..2026_01_01_00_00_00.1", dir.join("tokens/..data")).unwrap();
    std::os::unix::fs::symlink("..data/alice", dir.join("tokens/alice")).unwrap();
    let c = f.load(&[]).unwrap();
    assert_eq!(c.amqp.urls[0].expose(), "amqp://u:file-secret@h:1/%2f");
    let tokens: Vec<_> = c
        .admin
        .tokens
        .iter()
        .map(|t| (t.name.as_str(), t.token.as_str()))
        .collect();
    assert_eq!(
        tokens,
        [("carol", "carol-token-0123456789"), ("alice", "alice-token-0123456789")]
    );
    assert!(!format!("{c:?}").contains("file-secret") && !format!("{c:?}").contains("alice-token"));
    // the environment names the files too, and wins over the file's brokers
    std::fs::write(
        dir.join("secrets/urls"),
        "amqp://a:1/%2f\namqp://b:2/%2f, amqp://c:3/%2f\n",
    )
    .unwrap();
    let c = f.load(&[("LADDER_AMQP__URLS_FILE", "secrets/urls")]).unwrap();
    let urls: Vec<_> = c.amqp.urls.iter().map(SecretUri::expose).collect();
    assert_eq!(urls, ["amqp://a:1/%2f", "amqp://b:2/%2f", "amqp://c:3/%2f"]);
    let c = f.load(&[("LADDER_ADMIN__TOKEN_FILES__DAVE", "secrets/carol")]).unwrap();
    assert!(c.admin.tokens.iter().any(|t| t.name == "dave"));
    // problems name the key and the file, never what it holds
    std::fs::write(dir.join("secrets/url"), "http://u:file-secret@h/\n").unwrap();
    let e = f.load(&[]).unwrap_err();
    assert_eq!(e.key, "amqp.url_file", "{e}");
    assert!(!e.to_string().contains("file-secret"), "{e}");
    std::fs::write(dir.join("secrets/url"), "\n").unwrap();
    assert!(f.load(&[]).unwrap_err().problem.contains("is empty"));
    std::fs::write(dir.join("secrets/url"), "amqp://h/%2f").unwrap();
    std::fs::write(data.join("alice"), "short").unwrap();
    let e = f.load(&[]).unwrap_err();
    assert_eq!(e.key, "admin.tokens_dir: alice", "{e}");
    assert!(!e.to_string().contains("short"), "{e}");
    for (text, key) in [
        ("[amqp]\nurl_file = \"nope\"\n", "amqp.url_file"),
        ("[amqp]\nurl = \"amqp://h\"\nurl_file = \"x\"\n", "amqp.url_file"),
        ("[amqp]\nurls = [\"amqp://h\"]\nurls_file = \"x\"\n", "amqp.urls_file"),
        ("[admin]\ntokens_dir = \"nope\"\n", "admin.tokens_dir"),
        ("[admin.token_files]\nx = \"nope\"\n", "admin.token_files.x"),
        (
            "[admin.tokens]\ncarol = \"0123456789abcdef\"\n[admin.token_files]\ncarol = \"secrets/carol\"\n",
            "admin.token_files.carol",
        ),
    ] {
        let bad = Fixture::new(text, &[("default", GOOD_LADDER)]);
        std::fs::create_dir_all(bad.dir.path().join("secrets")).unwrap();
        std::fs::write(bad.dir.path().join("secrets/carol"), "carol-token-0123456789").unwrap();
        assert_eq!(bad.load(&[]).unwrap_err().key, key, "{text}");
    }
}

#[test]
fn tls_files_are_read_at_load_and_only_with_amqps() {
    let f = Fixture::new(
        "[amqp]\nurl = \"amqps://h/%2f\"\n[amqp.tls]\nca_file = \"ca.pem\"\n",
        &[("default", GOOD_LADDER)],
    );
    std::fs::write(f.dir.path().join("ca.pem"), "not a certificate").unwrap();
    let e = f.load(&[]).unwrap_err();
    assert_eq!(e.key, "amqp.tls.ca_file", "{e}");
    assert!(
        e.problem.contains("ca.pem") && e.problem.contains("no certificate"),
        "{e}"
    );
    for (text, key) in [
        ("[amqp]\nurl = \"amqp://h\"\n[amqp.tls]\n", "amqp.tls"),
        (
            "[amqp]\nurl = \"amqps://h?auth_mechanism=external\"\n",
            "amqp.tls.cert_file",
        ),
        (
            "[amqp]\nurl = \"amqps://h\"\n[amqp.tls]\ncert_file = \"c.pem\"\n",
            "amqp.tls.key_file",
        ),
        (
            "[amqp]\nurl = \"amqps://h\"\n[amqp.tls]\nca_file = \"missing.pem\"\n",
            "amqp.tls.ca_file",
        ),
        (
            "[amqp]\nurl = \"amqps://h\"\n[amqp.tls]\ncafile = \"x\"\n",
            "amqp.tls.cafile",
        ),
    ] {
        let bad = Fixture::new(text, &[("default", GOOD_LADDER)]);
        assert_eq!(bad.load(&[]).unwrap_err().key, key, "{text}");
    }
}

#[test]
fn the_admin_server_answers_ip_addresses_loopback_names_and_allowed_hosts() {
    let c = Fixture::new("", &[("default", GOOD_LADDER)]).load(&[]).unwrap();
    for host in [
        "127.0.0.1:9464",
        "localhost:9464",
        "LOCALHOST",
        "[::1]:9464",
        "10.0.0.7",
        "localhost.",
    ] {
        assert!(c.admin.allows_host(host), "{host}");
    }
    for host in [
        "evil.example",
        "evil.example:9464",
        "127.0.0.1.nip.io",
        "localhost.evil",
        "[evil]:1",
        "",
    ] {
        assert!(!c.admin.allows_host(host), "{host}");
    }
    let f = Fixture::new(
        "[admin]\nallowed_hosts = [\"Ladder.Example.org\", \"ladder\"]\n",
        &[("default", GOOD_LADDER)],
    );
    let c = f.load(&[]).unwrap();
    assert!(c.admin.allows_host("ladder.example.org:443") && c.admin.allows_host("ladder:9464"));
    assert!(!c.admin.allows_host("example.org"));
    let c = f.load(&[("LADDER_ADMIN__ALLOWED_HOSTS", "*")]).unwrap();
    assert!(c.admin.allows_host("anything.example"));
    let e = problem("[admin]\nallowed_hosts = [\"http://x:80\"]", GOOD_LADDER);
    assert_eq!(e.key, "admin.allowed_hosts", "{e}");
}

#[test]
fn bad_ladder_file_name_is_rejected() {
    let e = Fixture::new("", &[("has.dot", GOOD_LADDER)]).load(&[]).unwrap_err();
    assert!(e.problem.contains("ladder name"), "{e}");
    // the namespace's own exchanges take these names
    for taken in RESERVED_LADDER_NAMES {
        let e = Fixture::new("", &[(taken, GOOD_LADDER)]).load(&[]).unwrap_err();
        assert!(e.problem.contains("shares"), "{e}");
    }
}

#[test]
fn overlong_names_are_rejected() {
    let ns = "n".repeat(250);
    let e = problem(&format!("namespace = \"{ns}\""), GOOD_LADDER);
    assert!(e.problem.contains("exceed"), "{e}");
}

#[test]
fn classic_defaults_to_at_most_once() {
    let c = Fixture::new("", &[("c", "backoff = [\"1s\"]\nallow = []\nqueue_type = \"classic\"")])
        .load(&[])
        .unwrap();
    assert_eq!(c.ladders[0].dead_letter_strategy, DeadLetterStrategy::AtMostOnce);
    assert!(!c.ladders[0].allows("anything"));
}
