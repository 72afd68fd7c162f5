//! The development broker: what `ladder run` does when no broker answers as it starts.
//!
//! A single local `amqp://` broker (127.0.0.1 or localhost), with Ladder's `scripts/broker`
//! beside the config (that is, run from a checkout of Ladder) and without `--no-dev-broker`,
//! gets one: `scripts/broker up dev --port P` starts the machine's RabbitMQ if it is installed
//! (and P is its port), otherwise a RabbitMQ 4.3 node of its own; `scripts/broker down dev`
//! stops it. Anything else that does not answer is an error (exit 69): a configured broker that
//! is down is never silently replaced by another.

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use ladder::broker::connect as service;
use ladder::config::Config;
use ladder_amqp::AmqpUri;
use tracing::{debug, error, info};

use crate::exit;

/// The command that stops the development broker (logged, and in the README).
pub const STOP_COMMAND: &str = "scripts/broker down dev";

/// The broker script, relative to the config's directory.
const SCRIPT: &str = "scripts/broker";

/// How long `scripts/broker up dev` may take: on a fresh machine the script first builds its
/// Debian root, which a slow mirror makes take minutes.
const START_TIMEOUT: Duration = Duration::from_secs(600);

/// How often the script is looked at while it runs.
const START_POLL: Duration = Duration::from_millis(200);

/// After the script says the broker serves AMQP, how long connecting may still fail (a broker
/// that just opened its listener may not have its users and vhost ready yet).
const CONNECT_GRACE: Duration = Duration::from_secs(30);

/// The pause between connection attempts within [`CONNECT_GRACE`].
const CONNECT_PAUSE: Duration = Duration::from_millis(500);

/// Lines of the script's output shown when it fails.
const LOG_TAIL_LINES: usize = 20;

/// Makes sure a broker answers before `run` serves: one answers, or the development broker was
/// started and now does. `Err` carries the exit code after the reason was logged.
pub async fn ensure(config: &Config, allow_dev: bool) -> Result<(), ExitCode> {
    let error = match service::connect(&config.amqp).await {
        Ok(connection) => {
            let _ = connection.close(200, "checked").await;
            return Ok(());
        }
        Err(e) => e,
    };
    if !matches!(error, ladder_amqp::Error::Io(_)) {
        // something answered: a wrong password or vhost is not fixed by another broker
        error!(brokers = %config.amqp.brokers(), error = %error, "cannot connect to the broker");
        return Err(ExitCode::from(exit::UNAVAILABLE));
    }
    let dev = match DevBroker::for_config(config, allow_dev) {
        Ok(dev) => dev,
        Err(why) => {
            error!(
                brokers = %config.amqp.brokers(),
                error = %error,
                "no broker answers; not starting a development broker: {why}"
            );
            return Err(ExitCode::from(exit::UNAVAILABLE));
        }
    };
    info!(
        brokers = %config.amqp.brokers(),
        "no broker answers at this local address: starting a development broker ({} up dev --port {}); stop it \
         with: {STOP_COMMAND}",
        SCRIPT,
        dev.port
    );
    let script = dev.script.clone();
    let port = dev.port;
    let said = match tokio::task::spawn_blocking(move || start(&script, port)).await {
        Ok(Ok(said)) => said,
        Ok(Err(why)) => {
            error!("cannot start a development broker: {why}");
            return Err(ExitCode::from(exit::UNAVAILABLE));
        }
        Err(e) => {
            error!(error = %e, "cannot start a development broker");
            return Err(ExitCode::from(exit::UNAVAILABLE));
        }
    };
    let deadline = Instant::now() + CONNECT_GRACE;
    loop {
        match service::connect(&config.amqp).await {
            Ok(connection) => {
                let _ = connection.close(200, "checked").await;
                info!("development broker up: {said}");
                return Ok(());
            }
            Err(e) if Instant::now() >= deadline => {
                error!(brokers = %config.amqp.brokers(), error = %e, "the development broker started but does not let Ladder in");
                return Err(ExitCode::from(exit::UNAVAILABLE));
            }
            Err(e) => {
                debug!(error = %e, "the development broker does not answer yet");
                tokio::time::sleep(CONNECT_PAUSE).await;
            }
        }
    }
}

/// A development broker Ladder may start for a config.
#[derive(Debug, PartialEq)]
struct DevBroker {
    script: PathBuf,
    port: u16,
}

impl DevBroker {
    /// The development broker for `config`, whose broker does not answer, or why there is none.
    fn for_config(config: &Config, allow_dev: bool) -> Result<Self, String> {
        if !allow_dev {
            return Err("--no-dev-broker; start the broker".into());
        }
        let [url] = config.amqp.urls.as_slice() else {
            return Err("several brokers are configured (amqp.urls); start them".into());
        };
        let uri: AmqpUri = url
            .expose()
            .parse()
            .map_err(|e| format!("the broker URL does not parse: {e}"))?;
        let port = local_port(&uri)?;
        let script = config
            .file
            .parent()
            .filter(|dir| !dir.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .join(SCRIPT);
        if !script.is_file() {
            return Err(format!(
                "{} does not exist (Ladder starts one only from its own checkout, where the config sits beside \
                 {SCRIPT}); start the broker, or point amqp.url at one",
                script.display()
            ));
        }
        Ok(DevBroker { script, port })
    }
}

/// The port of a broker Ladder may stand in for: plain AMQP at 127.0.0.1 or localhost, where
/// the development broker listens (the machine's RabbitMQ and the script's node alike).
fn local_port(uri: &AmqpUri) -> Result<u16, String> {
    if uri.tls {
        return Err("the broker is configured with TLS (amqps://); start the broker".into());
    }
    let host = uri.host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<IpAddr>() {
        _ if host.eq_ignore_ascii_case("localhost") => Ok(uri.port),
        Ok(ip) if ip == IpAddr::from(Ipv4Addr::LOCALHOST) => Ok(uri.port),
        Ok(ip) if ip.is_loopback() => Err(format!(
            "the development broker listens on 127.0.0.1, not {host}; start the broker, or use 127.0.0.1 or \
             localhost in amqp.url"
        )),
        _ => Err(format!(
            "{host} is not this machine (127.0.0.1 or localhost); start the broker, or point amqp.url at one"
        )),
    }
}

/// Runs `script up dev --port port` to its end (bounded by [`START_TIMEOUT`]), its output in a
/// file: the broker it starts may keep inherited descriptors open, and a pipe would never end.
/// Returns the script's last `==>` line, or why it failed with the tail of its output.
fn start(script: &Path, port: u16) -> Result<String, String> {
    let log_path = std::env::temp_dir().join(format!("ladder-dev-broker-{}.log", std::process::id()));
    let log = File::create(&log_path).map_err(|e| format!("cannot create {}: {e}", log_path.display()))?;
    let err_log = log
        .try_clone()
        .map_err(|e| format!("cannot use {}: {e}", log_path.display()))?;
    let mut child = Command::new(script)
        .args(["up", "dev", "--port", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err_log)
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    let deadline = Instant::now() + START_TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{} up dev did not finish within {START_TIMEOUT:?}; its output: {}",
                    script.display(),
                    log_path.display()
                ));
            }
            Ok(None) => std::thread::sleep(START_POLL),
            Err(e) => return Err(format!("cannot wait for {}: {e}", script.display())),
        }
    };
    let output = std::fs::read_to_string(&log_path).unwrap_or_default();
    if !status.success() {
        let lines: Vec<&str> = output.lines().collect();
        let tail = lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n");
        return Err(format!(
            "{} up dev --port {port} failed ({status}); its output ({}):\n{tail}",
            script.display(),
            log_path.display()
        ));
    }
    let _ = std::fs::remove_file(&log_path);
    Ok(output
        .lines()
        .rev()
        .find_map(|line| line.strip_prefix("==> "))
        .unwrap_or("started")
        .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uri(text: &str) -> AmqpUri {
        text.parse().unwrap()
    }

    #[test]
    fn only_plain_amqp_on_loopback_is_local() {
        assert_eq!(local_port(&uri("amqp://guest:guest@127.0.0.1:5672/%2f")), Ok(5672));
        assert_eq!(local_port(&uri("amqp://localhost:5673")), Ok(5673));
        assert_eq!(local_port(&uri("amqp://LocalHost")), Ok(5672));
        assert!(
            local_port(&uri("amqp://[::1]:5674/%2f"))
                .unwrap_err()
                .contains("listens on 127.0.0.1")
        );
        assert!(
            local_port(&uri("amqp://127.0.0.2:5674/%2f"))
                .unwrap_err()
                .contains("listens on 127.0.0.1")
        );
        assert!(
            local_port(&uri("amqp://10.0.0.7:5672/%2f"))
                .unwrap_err()
                .contains("not this machine")
        );
        assert!(local_port(&uri("amqp://rabbit.example:5672")).is_err());
        assert!(local_port(&uri("amqps://localhost:5671")).unwrap_err().contains("TLS"));
    }
}
