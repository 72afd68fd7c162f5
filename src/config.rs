//! Configuration: the service file (`ladder.toml`) and one file per ladder under `ladders_dir`.
//!
//! Two stages: raw serde structs that reject unknown keys, then `validate` rules that
//! produce the typed [`Config`]. Every error names the file, the key and the problem, so
//! `ladder check` can print it and exit 64 before anything touches the broker. No I/O here
//! but reading the files; the environment is handed in as a map so tests never mutate it.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use regex::RegexSet;
use serde::Deserialize;

use crate::model::ladder::{DeadLetterStrategy, Jitter, LadderSpec, QueueType, Senders, Unidentified};

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

/// The keys a `LADDER_<KEY>` variable overrides (`__` between levels, any case). Any other
/// `LADDER_*` variable is ignored, not an error: Kubernetes sets `LADDER_PORT`,
/// `LADDER_SERVICE_HOST` … in every pod of a namespace with a Service named `ladder`, and tools
/// have variables of their own. `admin.tokens.<name>` takes any name.
const ENV_KEYS: [&str; 25] = [
    "namespace",
    "ladders_dir",
    "prefetch",
    "max_in_flight_per_destination",
    "max_header_bytes",
    "max_reason_bytes",
    "shutdown_grace",
    "amqp__url",
    "amqp__urls",
    "amqp__url_file",
    "amqp__urls_file",
    "amqp__tls__ca_file",
    "amqp__tls__cert_file",
    "amqp__tls__key_file",
    "amqp__tls__server_name",
    "amqp__connection_name",
    "amqp__reconnect_min",
    "amqp__reconnect_max",
    "amqp__heartbeat",
    "amqp__heartbeat_timeout",
    "amqp__stall_timeout",
    "admin__bind",
    "admin__poll_interval",
    "admin__tokens_dir",
    "admin__allowed_hosts",
];

/// Whether `LADDER_<rest>` overrides a config key.
fn is_config_variable(rest: &str) -> bool {
    let key = rest.to_ascii_lowercase();
    ENV_KEYS.contains(&key.as_str())
        || ["admin__tokens__", "admin__token_files__"]
            .iter()
            .any(|prefix| key.strip_prefix(prefix).is_some_and(|name| !name.is_empty()))
}

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
    /// The broker's nodes (one for a single broker); secrets. The service connects to the
    /// first that answers, and after a lost connection tries the next one at once.
    pub urls: Vec<SecretUri>,
    /// Shown in the management UI's connection list.
    pub connection_name: String,
    /// First delay before reconnecting after a lost connection (every node tried once).
    pub reconnect_min: Duration,
    /// The reconnect delay doubles up to this, jittered.
    pub reconnect_max: Duration,
    /// The heartbeat interval asked of the broker (whole seconds; a URI's `?heartbeat=` wins).
    pub heartbeat: Duration,
    /// A connection on which the broker sent nothing for this long is dead: the service fails
    /// over to the next node (a silent cut: a partition, a lost machine).
    pub heartbeat_timeout: Duration,
    /// A hop with work waiting that makes no progress for this long is stalled: the service is
    /// not ready, says why, and fails over to the next node (the node may not reach its queues'
    /// leaders).
    pub stall_timeout: Duration,
    /// Certificates for `amqps://` brokers (`amqp.tls`); `None`: the platform's CA roots and
    /// no client certificate.
    pub tls: Option<ladder_amqp::TlsOptions>,
}

impl AmqpConfig {
    /// The nodes with their passwords masked, for logs: `amqp://u:***@a:5672/%2f, …`.
    pub fn brokers(&self) -> String {
        self.urls.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    }
}

pub use crate::model::ladder::Limits;

/// The admin HTTP server and the depth poller that feeds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminConfig {
    /// Where `/live`, `/ready`, `/metrics`, the parking-lot API and the web page are served.
    pub bind: SocketAddr,
    /// How often the poller reads queue depths and checks the accounting identity.
    pub poll_interval: Duration,
    /// Who may replay and discard over HTTP, by name; none configured means nobody may.
    pub tokens: Vec<OperatorToken>,
    /// Host names (lowercase, without port) the server answers besides the loopback names and
    /// IP addresses; `["*"]` answers any (see [`AdminConfig::allows_host`]).
    pub allowed_hosts: Vec<String>,
}

/// The names that always reach a loopback-bound admin server.
const LOOPBACK_NAMES: [&str; 3] = ["localhost", "localhost.", "ip6-localhost"];

impl AdminConfig {
    /// Whether a request with this `Host` header value may be answered: an IP address (a
    /// DNS-rebinding page can only reach the server under a name it controls), a loopback name,
    /// or a name in `admin.allowed_hosts`. The port is not compared.
    pub fn allows_host(&self, host: &str) -> bool {
        let name = match host.strip_prefix('[') {
            // [::1]:9464
            Some(rest) => {
                return rest
                    .split(']')
                    .next()
                    .is_some_and(|ip| ip.parse::<std::net::Ipv6Addr>().is_ok());
            }
            None => host.rsplit_once(':').map_or(host, |(name, port)| {
                if port.bytes().all(|b| b.is_ascii_digit()) {
                    name
                } else {
                    host
                }
            }),
        };
        if name.parse::<std::net::IpAddr>().is_ok() {
            return true;
        }
        let name = name.to_ascii_lowercase();
        LOOPBACK_NAMES.contains(&name.as_str())
            || self
                .allowed_hosts
                .iter()
                .any(|allowed| allowed == "*" || *allowed == name)
    }
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
    max_in_flight_per_destination: Option<u32>,
    max_header_bytes: Option<usize>,
    max_reason_bytes: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    shutdown_grace: Option<Duration>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAmqp {
    url: Option<String>,
    urls: Option<RawUrls>,
    connection_name: Option<String>,
    #[serde(default, with = "humantime_serde")]
    reconnect_min: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    reconnect_max: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    heartbeat: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    heartbeat_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    stall_timeout: Option<Duration>,
    url_file: Option<PathBuf>,
    urls_file: Option<PathBuf>,
    tls: Option<RawTls>,
}

/// `amqp.tls`: PEM files, relative to the config file.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTls {
    ca_file: Option<PathBuf>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    server_name: Option<String>,
}

/// `amqp.urls`: a list, or one string of comma-separated URIs (as an environment variable).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum RawUrls {
    Many(Vec<String>),
    One(String),
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    bind: Option<String>,
    #[serde(default, with = "humantime_serde")]
    poll_interval: Option<Duration>,
    #[serde(default)]
    tokens: BTreeMap<String, String>,
    tokens_dir: Option<PathBuf>,
    #[serde(default)]
    token_files: BTreeMap<String, PathBuf>,
    allowed_hosts: Option<RawUrls>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLadder {
    backoff: Vec<humantime_serde::Serde<Duration>>,
    max_attempts: Option<u32>,
    allow: Option<Vec<String>>,
    queue_type: Option<QueueType>,
    dead_letter_strategy: Option<DeadLetterStrategy>,
    senders: Option<BTreeMap<String, Vec<String>>>,
    unidentified: Option<Unidentified>,
    exact_delays: Option<bool>,
    jitter: Option<String>,
    allow_exchanges: Option<Vec<String>>,
    release_rate: Option<String>,
    release_ramp: Option<String>,
    auto_hold: Option<RawAutoHold>,
}

/// A ladder's `[auto_hold]` table, as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAutoHold {
    enabled: Option<bool>,
    window: Option<humantime_serde::Serde<Duration>>,
    min_deliveries: Option<u32>,
    failure_ratio: Option<String>,
    probe_every: Option<humantime_serde::Serde<Duration>>,
    /// Read so that a config of an earlier release still loads; a held destination is now
    /// probed every `probe_every`, however long it failed.
    max_hold: Option<humantime_serde::Serde<Duration>>,
}

/// The automatic hold's defaults. Failures ≥ 90 % of ≥ 50 deliveries within a minute trip it: fewer
/// deliveries say too little, and a minute spans several retries of a short first step. Once
/// held it probes every 4 s, so a recovered destination resumes within 8 s.
const DEFAULT_AUTO_WINDOW: Duration = Duration::from_secs(60);
const DEFAULT_AUTO_MIN_DELIVERIES: u32 = 50;
const DEFAULT_AUTO_FAILURE_PERMILLE: u32 = 900;
const DEFAULT_AUTO_PROBE_EVERY: Duration = Duration::from_secs(4);

/// `release_ramp`: `"off"`, or how often a release doubles its rate (at least 100 ms).
fn release_ramp(text: &str) -> Result<Option<Duration>, String> {
    match text.trim() {
        "off" => Ok(None),
        every => humantime::parse_duration(every)
            .ok()
            .filter(|d| *d >= Duration::from_millis(100))
            .map(Some)
            .ok_or_else(|| format!("{text:?} is not \"off\" or a duration of at least 100ms")),
    }
}

fn validate_auto_hold(
    raw: RawAutoHold,
    err: &dyn Fn(&str, String) -> ConfigError,
) -> Result<Option<crate::model::holds::AutoHoldPolicy>, ConfigError> {
    let window = raw.window.map_or(DEFAULT_AUTO_WINDOW, |w| *w);
    if window < Duration::from_secs(1) || window > Duration::from_secs(86_400) {
        return Err(err("auto_hold.window", "must be between 1s and 24h".into()));
    }
    let failure_permille = match raw.failure_ratio.as_deref() {
        None => DEFAULT_AUTO_FAILURE_PERMILLE,
        Some(text) => {
            let percent: f64 = text
                .trim()
                .strip_suffix('%')
                .and_then(|n| n.trim().parse().ok())
                .ok_or_else(|| {
                    err(
                        "auto_hold.failure_ratio",
                        format!("{text:?} must be a percentage such as \"90%\""),
                    )
                })?;
            if !(1.0..=100.0).contains(&percent) {
                return Err(err("auto_hold.failure_ratio", "must be between 1% and 100%".into()));
            }
            (percent * 10.0).round() as u32
        }
    };
    let min_deliveries = raw.min_deliveries.unwrap_or(DEFAULT_AUTO_MIN_DELIVERIES);
    if min_deliveries == 0 {
        return Err(err("auto_hold.min_deliveries", "must be at least 1".into()));
    }
    let probe_every = raw.probe_every.map_or(DEFAULT_AUTO_PROBE_EVERY, |p| *p);
    if probe_every < Duration::from_millis(100) {
        return Err(err("auto_hold.probe_every", "must be at least 100ms".into()));
    }
    if raw.max_hold.is_some() {
        tracing::warn!(
            "auto_hold.max_hold is not used any more (a held destination is probed every probe_every): remove it"
        );
    }
    Ok(raw
        .enabled
        .unwrap_or(false)
        .then_some(crate::model::holds::AutoHoldPolicy {
            window,
            min_deliveries,
            failure_permille,
            probe_every,
        }))
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
                .filter(|(k, _)| match k.strip_prefix(&format!("{ENV_PREFIX}_")) {
                    Some(rest) if is_config_variable(rest) => true,
                    Some(_) => {
                        tracing::debug!(variable = %k, "not a config key; ignored");
                        false
                    }
                    None => false,
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        ));
    let merged = config::Config::builder()
        .add_source(config::File::from(file).format(config::FileFormat::Toml))
        .add_source(env_source)
        .build()
        .map_err(|e| ConfigError::new(file, "-", e.to_string()))?;
    let raw: RawConfig = serde_path_to_error::deserialize(merged).map_err(|e| {
        let key = error_key(e.path(), &e.inner().to_string());
        ConfigError::new(file, key, e.into_inner().to_string())
    })?;
    let raw = prefer_environment(raw, env);

    let base = file.parent().unwrap_or_else(|| Path::new("."));
    let ladders_dir = base.join(raw.ladders_dir.clone().unwrap_or_else(|| DEFAULT_LADDERS_DIR.into()));
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
            let raw: RawLadder = serde_path_to_error::deserialize(toml::Deserializer::parse(&text).map_err(|e| {
                let line = e
                    .span()
                    .map_or_else(|| "-".into(), |span| format!("line {}", line_of(&text, span.start)));
                ConfigError::new(&path, line, e.message().to_string())
            })?)
            .map_err(|e| {
                let key = error_key(e.path(), e.inner().message());
                let line = e.inner().span().map(|span| line_of(&text, span.start));
                match (key.as_str(), line) {
                    ("-", Some(line)) => ConfigError::new(&path, format!("line {line}"), e.inner().message()),
                    (_, Some(line)) => ConfigError::new(&path, key, format!("{} (line {line})", e.inner().message())),
                    (_, None) => ConfigError::new(&path, key, e.inner().message()),
                }
            })?;
            let name = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            Ok((name, path, raw))
        })
        .collect()
}

/// The dotted key a deserialization error is about: its path (`amqp.reconnect_min`,
/// `backoff[2]`), plus the field for an unknown one (serde names it only in the message).
fn error_key(path: &serde_path_to_error::Path, message: &str) -> String {
    let at = path.to_string();
    let at = (at != ".").then_some(at);
    let unknown = message
        .find("unknown field `")
        .map(|start| &message[start + "unknown field `".len()..])
        .and_then(|rest| rest.find('`').map(|end| rest[..end].to_string()));
    match (at, unknown) {
        (Some(parent), Some(field)) if !parent.ends_with(&field) => format!("{parent}.{field}"),
        (Some(at), _) => at,
        (None, Some(field)) => field,
        (None, None) => "-".into(),
    }
}

/// When the file names the brokers one way (`amqp.url`) and the environment the other
/// (`LADDER_AMQP__URLS`), the environment wins, as it does for every other key: a deployment
/// sets its brokers without editing the file it ships with.
fn prefer_environment(mut raw: RawConfig, env: &HashMap<String, String>) -> RawConfig {
    let from_env = |key: &str| env.contains_key(&format!("{ENV_PREFIX}_AMQP__{key}"));
    let a = &raw.amqp;
    let given = [
        ("URL", a.url.is_some()),
        ("URLS", a.urls.is_some()),
        ("URL_FILE", a.url_file.is_some()),
        ("URLS_FILE", a.urls_file.is_some()),
    ];
    let set = given.iter().filter(|(_, set)| *set).count();
    let env_set = given.iter().filter(|(key, set)| *set && from_env(key)).count();
    if set > 1 && env_set > 0 && env_set < set {
        let a = &mut raw.amqp;
        if !from_env("URL") {
            a.url = None;
        }
        if !from_env("URLS") {
            a.urls = None;
        }
        if !from_env("URL_FILE") {
            a.url_file = None;
        }
        if !from_env("URLS_FILE") {
            a.urls_file = None;
        }
    }
    raw
}

/// A secret read from `path` (relative to the config file's folder `base`), without the
/// surrounding whitespace a file usually ends with. Errors name the file, never its content.
fn read_secret(file: &Path, base: &Path, key: &str, path: &Path) -> Result<String, ConfigError> {
    let full = base.join(path);
    let text = std::fs::read_to_string(&full)
        .map_err(|e| ConfigError::new(file, key, format!("cannot read {}: {e}", full.display())))?;
    let text = text.trim();
    if text.is_empty() {
        return Err(ConfigError::new(file, key, format!("{} is empty", full.display())));
    }
    Ok(text.to_string())
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The broker when the config names none: the local development broker.
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The first reconnect waits up to this (jittered), after every node was tried once.
const DEFAULT_RECONNECT_MIN: Duration = Duration::from_millis(250);

/// Reconnect waits double up to this: seconds, so a broker back after a restart is found within
/// a few seconds, while a long outage costs one connection attempt per node every few seconds.
const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(5);

/// The heartbeat interval asked of the broker. RabbitMQ's default (60 s) would notice a silent
/// cut after two minutes; one second costs a 8-byte frame a second each way on an idle
/// connection.
const DEFAULT_HEARTBEAT: Duration = Duration::from_secs(1);

/// Silence after which a connection is dead: three heartbeat intervals. RabbitMQ sends a
/// heartbeat only after a whole interval without sending, checked once per interval, so two of
/// its frames can be up to two intervals apart on a healthy idle connection; the third interval
/// is the margin. With the defaults a silent cut is noticed within 3 s.
const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(3);

/// No progress for this long with work waiting is a stall: short enough to fail over to
/// another node within seconds.
const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(3);

/// By default one destination may hold all but this share of the due hop's prefetch (a
/// quarter): a stalled destination leaves that quarter to the others, and a healthy one that is
/// merely busy is not throttled into deferrals.
const DEFAULT_RESERVED_SHARE: u32 = 4;

/// The namespace when the config names none.
const DEFAULT_NAMESPACE: &str = "ladder";

/// The ladder files' folder, beside the config file, when the config names none.
const DEFAULT_LADDERS_DIR: &str = "ladders";

/// The connection name (in the management UI) when the config names none.
const DEFAULT_CONNECTION_NAME: &str = "ladder";

/// Deliveries each hop's consumer may hold unacknowledged.
const DEFAULT_PREFETCH: u32 = 200;

/// Headers larger than this (encoded) are parked as invalid: 16 KiB holds a long history.
const DEFAULT_MAX_HEADER_BYTES: usize = 16 * 1024;

/// A consumer's `retry-reason` is cut to this.
const DEFAULT_MAX_REASON_BYTES: usize = 1024;

/// How long SIGTERM waits for in-flight work.
const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// What a ladder that lists its senders does with a message from none of them: it fails
/// closed; `dead-letter` is a choice (see SECURITY.md for what it trusts).
const DEFAULT_UNIDENTIFIED: Unidentified = Unidentified::Reject;
/// Ladders declare the delay levels unless they say `exact_delays = false`.
const DEFAULT_EXACT_DELAYS: bool = true;
/// The widest `jitter`: a step may wait from half to one and a half times itself.
const MAX_JITTER_PERCENT: f64 = 50.0;

/// The tiers' queue type when a ladder names none.
const DEFAULT_QUEUE_TYPE: QueueType = QueueType::Quorum;

fn validate(
    file: &Path,
    raw: RawConfig,
    ladders_dir: PathBuf,
    raw_ladders: Vec<(String, PathBuf, RawLadder)>,
) -> Result<Config, ConfigError> {
    let base = file.parent().unwrap_or_else(|| Path::new("."));
    let limits = validate_limits(file, &raw)?;
    let amqp = validate_amqp(file, base, raw.amqp)?;
    let namespace = raw.namespace.unwrap_or_else(|| DEFAULT_NAMESPACE.to_string());
    check_namespace(&namespace).map_err(|p| ConfigError::new(file, "namespace", p))?;
    let admin = validate_admin(file, base, &raw.admin)?;
    let ladders = raw_ladders
        .into_iter()
        .map(|(name, path, raw)| validate_ladder(&namespace, name, &path, raw))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Config {
        file: file.to_path_buf(),
        amqp,
        namespace,
        ladders_dir,
        ladders,
        limits,
        shutdown_grace: raw.shutdown_grace.unwrap_or(DEFAULT_SHUTDOWN_GRACE),
        admin,
    })
}

/// `[amqp]`: the brokers, TLS, reconnecting and the heartbeat.
fn validate_amqp(file: &Path, base: &Path, raw: RawAmqp) -> Result<AmqpConfig, ConfigError> {
    let urls = validate_urls(file, base, &raw)?;
    let tls = validate_tls(file, base, raw.tls, &urls)?;
    let reconnect_min = raw.reconnect_min.unwrap_or(DEFAULT_RECONNECT_MIN);
    let reconnect_max = raw.reconnect_max.unwrap_or(DEFAULT_RECONNECT_MAX);
    if reconnect_min.is_zero() || reconnect_min > reconnect_max {
        return Err(ConfigError::new(
            file,
            "amqp.reconnect_min",
            "must be above zero and at most amqp.reconnect_max",
        ));
    }
    let heartbeat = raw.heartbeat.unwrap_or(DEFAULT_HEARTBEAT);
    if heartbeat.subsec_nanos() != 0 || heartbeat.as_secs() > u64::from(u16::MAX) {
        return Err(ConfigError::new(
            file,
            "amqp.heartbeat",
            "must be whole seconds, at most 65535 s (\"0s\" turns heartbeats off)",
        ));
    }
    let heartbeat_timeout = raw.heartbeat_timeout.unwrap_or(if raw.heartbeat.is_some() {
        heartbeat * 3
    } else {
        DEFAULT_HEARTBEAT_TIMEOUT
    });
    if !heartbeat.is_zero() && heartbeat_timeout <= heartbeat {
        return Err(ConfigError::new(
            file,
            "amqp.heartbeat_timeout",
            "must be longer than amqp.heartbeat (three intervals leave RabbitMQ's heartbeats a margin)",
        ));
    }
    let stall_timeout = raw.stall_timeout.unwrap_or(DEFAULT_STALL_TIMEOUT);
    if stall_timeout < Duration::from_millis(500) {
        return Err(ConfigError::new(file, "amqp.stall_timeout", "must be at least 500ms"));
    }
    Ok(AmqpConfig {
        urls: urls.into_iter().map(SecretUri::new).collect(),
        connection_name: raw.connection_name.unwrap_or_else(|| DEFAULT_CONNECTION_NAME.into()),
        reconnect_min,
        reconnect_max,
        heartbeat,
        heartbeat_timeout,
        stall_timeout,
        tls,
    })
}

/// The brokers' URIs, from exactly one of `amqp.url`, `amqp.urls`, `amqp.url_file` and
/// `amqp.urls_file`, each one parsed.
fn validate_urls(file: &Path, base: &Path, raw: &RawAmqp) -> Result<Vec<String>, ConfigError> {
    let split = |list: &str| -> Vec<String> {
        list.split([',', '\n'])
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_string)
            .collect()
    };
    let given: Vec<&str> = [
        ("amqp.url", raw.url.is_some()),
        ("amqp.urls", raw.urls.is_some()),
        ("amqp.url_file", raw.url_file.is_some()),
        ("amqp.urls_file", raw.urls_file.is_some()),
    ]
    .into_iter()
    .filter_map(|(key, set)| set.then_some(key))
    .collect();
    if let [_, second, ..] = given.as_slice() {
        return Err(ConfigError::new(
            file,
            *second,
            format!("give one of {}, not several", given.join(", ")),
        ));
    }
    let (key, urls) = match (raw.url.clone(), raw.urls.clone(), &raw.url_file, &raw.urls_file) {
        (Some(url), ..) => ("amqp.url", vec![url]),
        (_, Some(RawUrls::Many(urls)), ..) => ("amqp.urls", urls),
        (_, Some(RawUrls::One(list)), ..) => ("amqp.urls", split(&list)),
        (_, _, Some(path), _) => ("amqp.url_file", vec![read_secret(file, base, "amqp.url_file", path)?]),
        (_, _, _, Some(path)) => (
            "amqp.urls_file",
            split(&read_secret(file, base, "amqp.urls_file", path)?),
        ),
        (None, None, None, None) => ("amqp.url", vec![DEFAULT_AMQP_URL.to_string()]),
    };
    if urls.is_empty() {
        return Err(ConfigError::new(file, key, "names no broker"));
    }
    for (i, url) in urls.iter().enumerate() {
        if let Err(e) = ladder_amqp::AmqpUri::from_str(url) {
            // the parser's message does not echo the URI, so no secret leaks here
            let which = if urls.len() > 1 {
                format!(" (entry {})", i + 1)
            } else {
                String::new()
            };
            return Err(ConfigError::new(file, key, format!("not an AMQP URI{which}: {e}")));
        }
    }
    Ok(urls)
}

/// The bounds: prefetch, in-flight deliveries per destination, header and reason sizes.
fn validate_limits(file: &Path, raw: &RawConfig) -> Result<Limits, ConfigError> {
    let prefetch = raw.prefetch.unwrap_or(DEFAULT_PREFETCH);
    if !(1..=u16::MAX as u32).contains(&prefetch) {
        return Err(ConfigError::new(file, "prefetch", "must be between 1 and 65535"));
    }
    let per_destination = raw
        .max_in_flight_per_destination
        .unwrap_or((prefetch - prefetch / DEFAULT_RESERVED_SHARE).max(1));
    if !(1..=prefetch).contains(&per_destination) {
        return Err(ConfigError::new(
            file,
            "max_in_flight_per_destination",
            "must be between 1 and prefetch",
        ));
    }
    let max_header_bytes = raw.max_header_bytes.unwrap_or(DEFAULT_MAX_HEADER_BYTES);
    if !(1024..=MAX_HEADER_BYTES_LIMIT).contains(&max_header_bytes) {
        return Err(ConfigError::new(
            file,
            "max_header_bytes",
            format!("must be between 1024 and {MAX_HEADER_BYTES_LIMIT}"),
        ));
    }
    let max_reason_bytes = raw.max_reason_bytes.unwrap_or(DEFAULT_MAX_REASON_BYTES);
    if !(16..=max_header_bytes / 2).contains(&max_reason_bytes) {
        return Err(ConfigError::new(
            file,
            "max_reason_bytes",
            "must be between 16 and half of max_header_bytes",
        ));
    }
    Ok(Limits {
        prefetch: prefetch as u16,
        max_in_flight_per_destination: per_destination as u16,
        max_header_bytes,
        max_reason_bytes,
    })
}

/// `amqp.tls`: the files must read and parse now (a bad certificate is a config error, not a
/// reconnect loop), and only `amqps://` brokers use them.
fn validate_tls(
    file: &Path,
    base: &Path,
    raw: Option<RawTls>,
    urls: &[String],
) -> Result<Option<ladder_amqp::TlsOptions>, ConfigError> {
    let uris: Vec<ladder_amqp::AmqpUri> = urls.iter().filter_map(|u| u.parse().ok()).collect();
    let external = uris.iter().any(|u| u.external_auth);
    let Some(raw) = raw else {
        if external {
            return Err(ConfigError::new(
                file,
                "amqp.tls.cert_file",
                "auth_mechanism=external logs in with a client certificate: set amqp.tls.cert_file and key_file",
            ));
        }
        return Ok(None);
    };
    if !uris.iter().any(|u| u.tls) {
        return Err(ConfigError::new(
            file,
            "amqp.tls",
            "no broker URI is amqps://, so these certificates would not be used and nothing would be encrypted",
        ));
    }
    let options = ladder_amqp::TlsOptions {
        ca_file: raw.ca_file.map(|p| base.join(p)),
        cert_file: raw.cert_file.map(|p| base.join(p)),
        key_file: raw.key_file.map(|p| base.join(p)),
        server_name: raw.server_name,
    };
    if external && options.cert_file.is_none() {
        return Err(ConfigError::new(
            file,
            "amqp.tls.cert_file",
            "auth_mechanism=external logs in with a client certificate: set amqp.tls.cert_file and key_file",
        ));
    }
    ladder_amqp::tls::client_config(Some(&options)).map_err(|e| {
        let problem = match e {
            ladder_amqp::Error::Tls(problem) => problem,
            other => other.to_string(),
        };
        // the client's errors start with the file they are about
        let about = |path: &Option<PathBuf>| {
            path.as_ref()
                .is_some_and(|p| problem.starts_with(&p.display().to_string()))
        };
        let key = if about(&options.key_file) || (options.key_file.is_none() && options.cert_file.is_some()) {
            "amqp.tls.key_file"
        } else if about(&options.cert_file) || options.cert_file.is_none() && options.key_file.is_some() {
            "amqp.tls.cert_file"
        } else if about(&options.ca_file) {
            "amqp.tls.ca_file"
        } else {
            "amqp.tls"
        };
        ConfigError::new(file, key, problem)
    })?;
    Ok(Some(options))
}

fn validate_admin(file: &Path, base: &Path, raw: &RawAdmin) -> Result<AdminConfig, ConfigError> {
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
    let tokens = validate_tokens(file, base, raw)?;
    let allowed_hosts = match &raw.allowed_hosts {
        None => Vec::new(),
        Some(RawUrls::Many(hosts)) => hosts.clone(),
        Some(RawUrls::One(list)) => list.split(',').map(str::to_string).collect(),
    };
    let allowed_hosts: Vec<String> = allowed_hosts
        .iter()
        .map(|h| h.trim().to_ascii_lowercase())
        .filter(|h| !h.is_empty())
        .collect();
    if let Some(bad) = allowed_hosts.iter().find(|h| {
        *h != "*"
            && !h
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
    }) {
        return Err(ConfigError::new(
            file,
            "admin.allowed_hosts",
            format!("{bad:?} is not a host name (no port, no scheme; \"*\" allows any)"),
        ));
    }
    Ok(AdminConfig {
        bind,
        poll_interval,
        tokens,
        allowed_hosts,
    })
}

/// The operators' tokens, from `admin.tokens`, `admin.token_files` and `admin.tokens_dir`:
/// each named once, with a name and a length that hold.
fn validate_tokens(file: &Path, base: &Path, raw: &RawAdmin) -> Result<Vec<OperatorToken>, ConfigError> {
    // every token with where it came from, for errors: the file's tables, then token files
    let mut sources: Vec<(String, String, String)> = raw
        .tokens
        .iter()
        .map(|(name, token)| (format!("admin.tokens.{name}"), name.clone(), token.clone()))
        .collect();
    for (name, path) in &raw.token_files {
        let key = format!("admin.token_files.{name}");
        let token = read_secret(file, base, &key, path)?;
        sources.push((key, name.clone(), token));
    }
    if let Some(dir) = &raw.tokens_dir {
        // a Kubernetes Secret volume: one file per key, beside `..data` links and dot folders
        let full = base.join(dir);
        let entries = std::fs::read_dir(&full)
            .map_err(|e| ConfigError::new(file, "admin.tokens_dir", format!("cannot read {}: {e}", full.display())))?;
        let mut names: Vec<String> = entries
            .filter_map(|entry| entry.ok())
            .filter(|entry| entry.path().is_file())
            .map(|entry| entry.file_name().to_string_lossy().into_owned())
            .filter(|name| !name.starts_with('.'))
            .collect();
        names.sort();
        for name in names {
            let key = format!("admin.tokens_dir: {name}");
            let token = read_secret(file, base, &key, &full.join(&name))?;
            sources.push((key, name, token));
        }
    }
    let mut tokens: Vec<OperatorToken> = Vec::with_capacity(sources.len());
    for (key, name, token) in &sources {
        if tokens.iter().any(|t| &t.name == name) {
            return Err(ConfigError::new(
                file,
                key.as_str(),
                format!("a token named {name:?} is already configured"),
            ));
        }
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
    Ok(tokens)
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

/// Ladder names taken by the namespace's own exchanges (`N.due`, `N.stray`).
pub const RESERVED_LADDER_NAMES: [&str; 2] = ["due", "stray"];

fn validate_ladder(namespace: &str, name: String, file: &Path, raw: RawLadder) -> Result<LadderSpec, ConfigError> {
    let err = |key: &str, problem: String| ConfigError::new(file, key, problem);
    check_ladder_name(namespace, &name).map_err(|p| err("-", p))?;
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
    let queue_type = raw.queue_type.unwrap_or(DEFAULT_QUEUE_TYPE);
    let strategy = raw.dead_letter_strategy.unwrap_or(queue_type.default_strategy());
    if queue_type == QueueType::Classic && strategy == DeadLetterStrategy::AtLeastOnce {
        return Err(err(
            "dead_letter_strategy",
            "at-least-once needs queue_type = \"quorum\"; classic queues dead-letter at-most-once".into(),
        ));
    }
    let senders = validate_senders(raw.senders, raw.unidentified, &err)?;
    let exact_delays = raw.exact_delays.unwrap_or(DEFAULT_EXACT_DELAYS);
    let jitter = raw
        .jitter
        .as_deref()
        .map(parse_jitter)
        .transpose()
        .map_err(|p| err("jitter", p))?;
    if jitter.is_some() && !exact_delays {
        return Err(err(
            "jitter",
            "needs exact_delays = true: a spread step waits in the delay levels".into(),
        ));
    }
    let allow_exchanges = raw.allow_exchanges.unwrap_or_default();
    if !allow_exchanges.is_empty() && !exact_delays {
        return Err(err(
            "allow_exchanges",
            "needs exact_delays = true: scheduled deliveries wait in the delay levels".into(),
        ));
    }
    let allow_exchanges =
        RegexSet::new(&allow_exchanges).map_err(|e| err("allow_exchanges", format!("invalid regex: {e}")))?;
    let backoff = raw.backoff.into_iter().map(|step| *step).collect();
    let mut spec = LadderSpec::new(name, backoff, max_attempts, allow, queue_type, strategy);
    if let Some(senders) = senders {
        spec = spec.with_senders(senders);
    }
    spec.set_exact_delays(exact_delays);
    spec.jitter = jitter;
    spec.allow_exchanges = allow_exchanges;
    if let Some(rate) = raw.release_rate {
        spec.release_rate = rate
            .parse()
            .map_err(|e: crate::model::lot::Invalid| err("release_rate", e.0))?;
    }
    if let Some(ramp) = raw.release_ramp {
        spec.release_ramp = release_ramp(&ramp).map_err(|e| err("release_ramp", e))?;
    }
    if let Some(auto) = raw.auto_hold {
        spec.auto_hold = validate_auto_hold(auto, &err)?;
    }
    let longest = crate::model::names::Names::of(namespace, &spec).longest_name(&spec);
    if longest.len() > MAX_NAME_BYTES {
        return Err(err(
            "-",
            format!("queue name {longest:?} would exceed {MAX_NAME_BYTES} bytes; shorten the namespace or ladder name"),
        ));
    }
    Ok(spec)
}

/// A ladder's name (its file's stem): letters, digits, `-` and `_`, and not a name the
/// namespace's shared objects take.
fn check_ladder_name(namespace: &str, name: &str) -> Result<(), String> {
    let name_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_');
    if name.is_empty() || !name.chars().all(name_ok) {
        return Err(format!(
            "ladder name {name:?} (the file stem) may use only letters, digits, '-' and '_'"
        ));
    }
    if RESERVED_LADDER_NAMES.contains(&name) {
        return Err(format!(
            "ladder name {name:?} (the file stem) is the name of an exchange every ladder of the namespace \
             shares ({namespace}.{name}); rename the file"
        ));
    }
    Ok(())
}

/// A ladder's `senders` (broker user → the destinations it may send failures to) and what
/// becomes of a failure from no listed sender (`unidentified`).
fn validate_senders(
    senders: Option<BTreeMap<String, Vec<String>>>,
    unidentified: Option<Unidentified>,
    err: &impl Fn(&str, String) -> ConfigError,
) -> Result<Option<Senders>, ConfigError> {
    Ok(match (senders, unidentified) {
        (None, None) => None,
        (None, Some(_)) => {
            return Err(err(
                "unidentified",
                "applies only to a ladder that lists its senders".into(),
            ));
        }
        (Some(grants), unidentified) => Some(Senders {
            grants: grants
                .into_iter()
                .map(|(user, patterns)| {
                    let key = format!("senders.{user}");
                    if user.is_empty() {
                        return Err(err(&key, "a sender is a broker user name, not empty".into()));
                    }
                    RegexSet::new(&patterns)
                        .map(|set| (user, set))
                        .map_err(|e| err(&key, format!("invalid regex: {e}")))
                })
                .collect::<Result<_, _>>()?,
            unidentified: unidentified.unwrap_or(DEFAULT_UNIDENTIFIED),
        }),
    })
}

/// A ladder's `jitter`: a percentage from 0% to 50% (`"10%"`, `"2.5%"`), kept in thousandths.
fn parse_jitter(text: &str) -> Result<Jitter, String> {
    let number = text
        .trim()
        .strip_suffix('%')
        .ok_or_else(|| format!("{text:?} must be a percentage such as \"10%\""))?;
    let percent: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} must be a percentage such as \"10%\""))?;
    if !(0.0..=MAX_JITTER_PERCENT).contains(&percent) {
        return Err(format!("{text:?} must be between 0% and {MAX_JITTER_PERCENT}%"));
    }
    Ok(Jitter {
        permille: (percent * 10.0).round() as u16,
    })
}

#[cfg(test)]
mod tests;
