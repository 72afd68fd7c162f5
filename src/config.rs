//! Configuration: the service file (`ladder.toml`) and one file per ladder under `ladders_dir`.
//!
//! Two stages: raw serde structs that reject unknown keys, then [`validate`] rules that
//! produce the typed [`Config`]. Every error names the file, the key and the problem, so
//! `ladder check` can print it and exit 64 before anything touches the broker. No I/O here
//! but reading the files; the environment is handed in as a map so tests never mutate it.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use lapin::uri::AMQPUri;
use regex::RegexSet;
use serde::Deserialize;

use crate::ladder::{DeadLetterStrategy, LadderSpec, QueueType};

/// Largest TTL RabbitMQ accepts for `x-message-ttl` (2^32 - 1 ms, about 49.7 days).
const MAX_TIER_MS: u128 = u32::MAX as u128;

/// RabbitMQ's limit on queue and exchange names (they are AMQP short strings).
const MAX_NAME_BYTES: usize = 255;

/// Headers must fit one frame (frame_max defaults to 131072); keep room for properties and
/// the headers the ladder adds itself.
const MAX_HEADER_BYTES_LIMIT: usize = 120 * 1024;

/// The admin server's default address: loopback only, so metrics and the ladder listing are not
/// exposed beyond the host unless the operator says so; 9464 is the default port of
/// OpenTelemetry's Prometheus exporter.
const DEFAULT_ADMIN_BIND: &str = "127.0.0.1:9464";

/// How often the depth poller reads the queues by default: one passive declare per queue every
/// 5 s is negligible load on the broker and matches its own statistics interval.
const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(5);

/// The shortest poll interval accepted: faster polling only adds broker load, and the broker
/// refreshes some counts (stream lengths) no faster than every few seconds anyway.
const MIN_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// The shortest replay/discard token accepted: 16 random characters are beyond guessing over
/// HTTP, and shorter ones are usually placeholders left in a config.
const MIN_TOKEN_CHARS: usize = 16;

/// Prefix of the environment variables that override config keys (`LADDER_AMQP__URL`).
pub const ENV_PREFIX: &str = "LADDER";

/// A config problem, located precisely enough for a platform team to fix it.
#[derive(Debug, thiserror::Error)]
#[error("{}: {key}: {problem}", file.display())]
pub struct ConfigError {
    /// The file that holds the problem.
    pub file: PathBuf,
    /// The key (dotted path) that is wrong, or `-` for the file as a whole.
    pub key: String,
    /// What is wrong, lowercase, no trailing period.
    pub problem: String,
}

impl ConfigError {
    fn new(file: &Path, key: impl Into<String>, problem: impl Into<String>) -> Self {
        ConfigError {
            file: file.to_path_buf(),
            key: key.into(),
            problem: problem.into(),
        }
    }
}

/// An AMQP URI that never prints its password.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUri(String);

impl SecretUri {
    /// Wraps a URI; the caller has checked that it parses.
    pub fn new(uri: impl Into<String>) -> Self {
        SecretUri(uri.into())
    }

    /// The full URI, password included: pass it to the client library only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SecretUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match url::Url::parse(&self.0) {
            Ok(mut url) => {
                if url.password().is_some() {
                    let _ = url.set_password(Some("***"));
                }
                f.write_str(url.as_str())
            }
            Err(_) => f.write_str("<unparseable amqp uri>"),
        }
    }
}

impl fmt::Debug for SecretUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SecretUri({self})")
    }
}

/// Broker connection settings.
#[derive(Debug, Clone)]
pub struct AmqpConfig {
    /// Where the broker is; secret.
    pub url: SecretUri,
    /// Shown in the management UI's connection list.
    pub connection_name: String,
    /// First delay before reconnecting after a lost connection.
    pub reconnect_min: Duration,
    /// The reconnect delay doubles up to this.
    pub reconnect_max: Duration,
}

/// The bounds that keep the service's memory and the broker's channels finite.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Unacked deliveries per consumer; also bounds the publishes in flight per consumer.
    pub prefetch: u16,
    /// Encoded size above which a message's headers are parked with `header-too-large`.
    pub max_header_bytes: usize,
    /// `retry-reason` is truncated to this many bytes.
    pub max_reason_bytes: usize,
}

/// The admin HTTP server and the depth poller that feeds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminConfig {
    /// Where `/live`, `/ready`, `/metrics`, the parking-lot API and the web page are served.
    pub bind: SocketAddr,
    /// How often the poller reads queue depths and checks the accounting identity.
    pub poll_interval: Duration,
    /// Who may replay and discard over HTTP, by name; none configured means nobody may.
    pub tokens: Vec<OperatorToken>,
}

/// A named token that allows replay and discard over HTTP; the name is who asked, in the log
/// and in the resolution record.
#[derive(Clone, PartialEq, Eq)]
pub struct OperatorToken {
    /// Who holds it.
    pub name: String,
    /// The secret; never printed.
    pub token: String,
}

impl fmt::Debug for OperatorToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OperatorToken({}, ***)", self.name)
    }
}

/// The validated configuration of one service instance.
#[derive(Debug, Clone)]
pub struct Config {
    /// The service config file it came from.
    pub file: PathBuf,
    /// Broker connection.
    pub amqp: AmqpConfig,
    /// Prefix of every exchange and queue the service declares.
    pub namespace: String,
    /// Where the ladder files were read from.
    pub ladders_dir: PathBuf,
    /// Every ladder, sorted by name.
    pub ladders: Vec<LadderSpec>,
    /// Bounds.
    pub limits: Limits,
    /// How long SIGTERM waits for in-flight work before giving up on it.
    pub shutdown_grace: Duration,
    /// The admin server and the depth poller.
    pub admin: AdminConfig,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    amqp: RawAmqp,
    #[serde(default)]
    admin: RawAdmin,
    namespace: Option<String>,
    ladders_dir: Option<PathBuf>,
    prefetch: Option<u32>,
    max_header_bytes: Option<usize>,
    max_reason_bytes: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    shutdown_grace: Option<Duration>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAmqp {
    url: Option<String>,
    connection_name: Option<String>,
    #[serde(default, with = "humantime_serde")]
    reconnect_min: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    reconnect_max: Option<Duration>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    bind: Option<String>,
    #[serde(default, with = "humantime_serde")]
    poll_interval: Option<Duration>,
    #[serde(default)]
    tokens: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLadder {
    backoff: Vec<humantime_serde::Serde<Duration>>,
    max_attempts: Option<u32>,
    allow: Option<Vec<String>>,
    queue_type: Option<String>,
    dead_letter_strategy: Option<String>,
}

/// Loads and validates `file`, its ladders, and overrides from `env` (`LADDER_` keys, `__`
/// between nesting levels). Pass `std::env::vars().collect()` in production.
pub fn load(file: &Path, env: &HashMap<String, String>) -> Result<Config, ConfigError> {
    if !file.is_file() {
        return Err(ConfigError::new(file, "-", "config file not found"));
    }
    let env_source = config::Environment::with_prefix(ENV_PREFIX)
        .prefix_separator("_")
        .separator("__")
        .try_parsing(true)
        .source(Some(
            env.iter()
                .filter(|(k, _)| k.starts_with(&format!("{ENV_PREFIX}_")))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        ));
    let raw: RawConfig = config::Config::builder()
        .add_source(config::File::from(file).format(config::FileFormat::Toml))
        .add_source(env_source)
        .build()
        .and_then(|c| c.try_deserialize())
        .map_err(|e| {
            let message = e.to_string();
            ConfigError::new(file, key_in_message(&message).unwrap_or_else(|| "-".into()), message)
        })?;

    let base = file.parent().unwrap_or_else(|| Path::new("."));
    let ladders_dir = base.join(raw.ladders_dir.clone().unwrap_or_else(|| "ladders".into()));
    let ladders = read_ladders(&ladders_dir)?;
    validate(file, raw, ladders_dir, ladders)
}

/// Reads every `*.toml` under `dir` as `(ladder name, file, raw ladder)`, sorted by name.
fn read_ladders(dir: &Path) -> Result<Vec<(String, PathBuf, RawLadder)>, ConfigError> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| ConfigError::new(dir, "-", format!("cannot read ladders directory: {e}")))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ConfigError::new(dir, "-", "no ladder files (*.toml) found"));
    }
    files
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| ConfigError::new(&path, "-", format!("cannot read: {e}")))?;
            let raw: RawLadder = toml::from_str(&text).map_err(|e| {
                let key = key_in_message(e.message())
                    .or_else(|| e.span().map(|span| format!("line {}", line_of(&text, span.start))))
                    .unwrap_or_else(|| "-".into());
                ConfigError::new(&path, key, e.message().to_string())
            })?;
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            Ok((name, path, raw))
        })
        .collect()
}

/// The dotted key a serde error message is about: `unknown field `x`` inside `for key `amqp``
/// gives `amqp.x`.
fn key_in_message(message: &str) -> Option<String> {
    let quoted_after = |marker: &str| {
        let start = message.find(marker)? + marker.len();
        let end = message[start..].find('`')?;
        Some(message[start..start + end].to_string())
    };
    match (quoted_after("for key `"), quoted_after("unknown field `")) {
        (Some(parent), Some(field)) => Some(format!("{parent}.{field}")),
        (parent, field) => field.or(parent),
    }
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

fn validate(
    file: &Path,
    raw: RawConfig,
    ladders_dir: PathBuf,
    raw_ladders: Vec<(String, PathBuf, RawLadder)>,
) -> Result<Config, ConfigError> {
    let url = raw
        .amqp
        .url
        .unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5672/%2f".to_string());
    if let Err(e) = AMQPUri::from_str(&url) {
        // the parser's message does not echo the URI, so no secret leaks here
        return Err(ConfigError::new(file, "amqp.url", format!("not an AMQP URI: {e}")));
    }
    let reconnect_min = raw.amqp.reconnect_min.unwrap_or(Duration::from_millis(250));
    let reconnect_max = raw.amqp.reconnect_max.unwrap_or(Duration::from_secs(30));
    if reconnect_min.is_zero() || reconnect_min > reconnect_max {
        return Err(ConfigError::new(
            file,
            "amqp.reconnect_min",
            "must be above zero and at most amqp.reconnect_max",
        ));
    }

    let namespace = raw.namespace.unwrap_or_else(|| "ladder".to_string());
    check_namespace(&namespace).map_err(|p| ConfigError::new(file, "namespace", p))?;

    let prefetch = raw.prefetch.unwrap_or(200);
    if !(1..=u16::MAX as u32).contains(&prefetch) {
        return Err(ConfigError::new(file, "prefetch", "must be between 1 and 65535"));
    }
    let max_header_bytes = raw.max_header_bytes.unwrap_or(16 * 1024);
    if !(1024..=MAX_HEADER_BYTES_LIMIT).contains(&max_header_bytes) {
        return Err(ConfigError::new(
            file,
            "max_header_bytes",
            format!("must be between 1024 and {MAX_HEADER_BYTES_LIMIT}"),
        ));
    }
    let max_reason_bytes = raw.max_reason_bytes.unwrap_or(1024);
    if !(16..=max_header_bytes / 2).contains(&max_reason_bytes) {
        return Err(ConfigError::new(
            file,
            "max_reason_bytes",
            "must be between 16 and half of max_header_bytes",
        ));
    }

    let admin = validate_admin(file, &raw.admin)?;

    let ladders = raw_ladders
        .into_iter()
        .map(|(name, path, raw)| validate_ladder(&namespace, name, &path, raw))
        .collect::<Result<Vec<_>, _>>()?;

    Ok(Config {
        file: file.to_path_buf(),
        amqp: AmqpConfig {
            url: SecretUri::new(url),
            connection_name: raw.amqp.connection_name.unwrap_or_else(|| "ladder".into()),
            reconnect_min,
            reconnect_max,
        },
        namespace,
        ladders_dir,
        ladders,
        limits: Limits {
            prefetch: prefetch as u16,
            max_header_bytes,
            max_reason_bytes,
        },
        shutdown_grace: raw.shutdown_grace.unwrap_or(Duration::from_secs(10)),
        admin,
    })
}

fn validate_admin(file: &Path, raw: &RawAdmin) -> Result<AdminConfig, ConfigError> {
    let bind = raw.bind.as_deref().unwrap_or(DEFAULT_ADMIN_BIND);
    let bind = bind.parse::<SocketAddr>().map_err(|e| {
        ConfigError::new(
            file,
            "admin.bind",
            format!("{bind:?} is not an address with a port (\"127.0.0.1:9464\", \"[::]:9464\"): {e}"),
        )
    })?;
    let poll_interval = raw.poll_interval.unwrap_or(DEFAULT_POLL_INTERVAL);
    if poll_interval < MIN_POLL_INTERVAL {
        return Err(ConfigError::new(
            file,
            "admin.poll_interval",
            format!("must be at least {}", humantime::format_duration(MIN_POLL_INTERVAL)),
        ));
    }
    let mut tokens = Vec::with_capacity(raw.tokens.len());
    for (name, token) in &raw.tokens {
        let key = format!("admin.tokens.{name}");
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(ConfigError::new(
                file,
                key.as_str(),
                "a token's name must be non-empty and use only letters, digits, '-', '_' and '.'",
            ));
        }
        if token.chars().count() < MIN_TOKEN_CHARS {
            return Err(ConfigError::new(
                file,
                key.as_str(),
                format!("must be at least {MIN_TOKEN_CHARS} characters (it guards replay and discard)"),
            ));
        }
        tokens.push(OperatorToken {
            name: name.clone(),
            token: token.clone(),
        });
    }
    Ok(AdminConfig {
        bind,
        poll_interval,
        tokens,
    })
}

fn check_namespace(namespace: &str) -> Result<(), String> {
    let valid_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if namespace.is_empty() || !namespace.chars().all(valid_char) {
        return Err("must be non-empty and use only letters, digits, '-', '_' and '.'".into());
    }
    if namespace.starts_with("amq.") {
        return Err("must not start with 'amq.', which RabbitMQ reserves".into());
    }
    if namespace.starts_with('.') || namespace.ends_with('.') || namespace.contains("..") {
        return Err("must not start or end with '.' or contain '..'".into());
    }
    Ok(())
}

fn validate_ladder(namespace: &str, name: String, file: &Path, raw: RawLadder) -> Result<LadderSpec, ConfigError> {
    let err = |key: &str, problem: String| ConfigError::new(file, key, problem);
    let name_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_');
    if name.is_empty() || !name.chars().all(name_ok) {
        return Err(err(
            "-",
            format!("ladder name {name:?} (the file stem) may use only letters, digits, '-' and '_'"),
        ));
    }
    if raw.backoff.is_empty() {
        return Err(err("backoff", "must list at least one delay".into()));
    }
    for (i, step) in raw.backoff.iter().enumerate() {
        let step: &Duration = step;
        let ms = step.as_millis();
        if ms == 0 || !step.subsec_nanos().is_multiple_of(1_000_000) || ms > MAX_TIER_MS {
            return Err(err(
                &format!("backoff[{i}]"),
                format!(
                    "{} must be a whole number of milliseconds between 1ms and 49d",
                    humantime::format_duration(*step)
                ),
            ));
        }
    }
    let max_attempts = raw.max_attempts.unwrap_or(raw.backoff.len() as u32);
    if max_attempts == 0 {
        return Err(err("max_attempts", "must be at least 1".into()));
    }
    let allow = raw.allow.ok_or_else(|| {
        err(
            "allow",
            "is required: list the destination queues (regexes) this ladder may deliver to".into(),
        )
    })?;
    let allow = RegexSet::new(&allow).map_err(|e| err("allow", format!("invalid regex: {e}")))?;
    let queue_type = match raw.queue_type.as_deref().unwrap_or("quorum") {
        "quorum" => QueueType::Quorum,
        "classic" => QueueType::Classic,
        other => return Err(err("queue_type", format!("{other:?} is not \"quorum\" or \"classic\""))),
    };
    let default_strategy = match queue_type {
        QueueType::Quorum => "at-least-once",
        QueueType::Classic => "at-most-once",
    };
    let strategy = match raw.dead_letter_strategy.as_deref().unwrap_or(default_strategy) {
        "at-least-once" => DeadLetterStrategy::AtLeastOnce,
        "at-most-once" => DeadLetterStrategy::AtMostOnce,
        other => {
            return Err(err(
                "dead_letter_strategy",
                format!("{other:?} is not \"at-least-once\" or \"at-most-once\""),
            ));
        }
    };
    if queue_type == QueueType::Classic && strategy == DeadLetterStrategy::AtLeastOnce {
        return Err(err(
            "dead_letter_strategy",
            "at-least-once needs queue_type = \"quorum\"; classic queues dead-letter at-most-once".into(),
        ));
    }
    let backoff = raw.backoff.into_iter().map(|step| *step).collect();
    let spec = LadderSpec::new(name, backoff, max_attempts, allow, queue_type, strategy);
    let longest = crate::topology::Names::new(namespace, &spec.name).longest_name(&spec);
    if longest.len() > MAX_NAME_BYTES {
        return Err(err(
            "-",
            format!("queue name {longest:?} would exceed {MAX_NAME_BYTES} bytes; shorten the namespace or ladder name"),
        ));
    }
    Ok(spec)
}

#[cfg(test)]
mod tests {
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
        assert_eq!(c.amqp.url.expose(), "amqp://x:secret@y:2/%2f");
        assert_eq!(c.limits.prefetch, 7);
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
        assert_eq!(e.key, "line 3", "{e}");
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
    fn bad_ladder_file_name_is_rejected() {
        let e = Fixture::new("", &[("has.dot", GOOD_LADDER)]).load(&[]).unwrap_err();
        assert!(e.problem.contains("ladder name"), "{e}");
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
}
