//! `amqp://` and `amqps://` URIs as RabbitMQ documents them.

use std::fmt;
use std::time::Duration;

use percent_encoding::percent_decode_str;

use crate::error::Error;

/// Where and how to connect.
#[derive(Clone, PartialEq, Eq)]
pub struct AmqpUri {
    /// `amqps` when true.
    pub tls: bool,
    /// Host name or address.
    pub host: String,
    /// Port (5672, or 5671 with TLS, when the URI names none).
    pub port: u16,
    /// User name (guest when absent).
    pub user: String,
    /// Password (guest when absent). Never shown by `Debug`.
    pub password: String,
    /// Virtual host (`/` when the path is absent).
    pub vhost: String,
    /// `?heartbeat=` seconds; `None` = the client's default.
    pub heartbeat: Option<u16>,
    /// `?frame_max=` bytes; `None` = what the broker offers.
    pub frame_max: Option<u32>,
    /// `?channel_max=`.
    pub channel_max: Option<u16>,
    /// `?connection_timeout=` ms.
    pub connection_timeout: Option<Duration>,
    /// `?auth_mechanism=external`: log in with the client certificate.
    pub external_auth: bool,
}

impl fmt::Debug for AmqpUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}://{}:***@{}:{}/{}",
            if self.tls { "amqps" } else { "amqp" },
            self.user,
            self.host,
            self.port,
            percent_encoding::utf8_percent_encode(&self.vhost, percent_encoding::NON_ALPHANUMERIC)
        )
    }
}

impl std::str::FromStr for AmqpUri {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        let url = url::Url::parse(text).map_err(|e| Error::Uri(e.to_string()))?;
        let tls = match url.scheme() {
            "amqp" => false,
            "amqps" => true,
            other => return Err(Error::Uri(format!("scheme {other:?} is neither amqp nor amqps"))),
        };
        let host = url
            .host_str()
            .unwrap_or("localhost")
            .trim_matches(['[', ']'])
            .to_string();
        let decode = |s: &str| {
            percent_decode_str(s)
                .decode_utf8()
                .map(|c| c.into_owned())
                .map_err(|e| Error::Uri(e.to_string()))
        };
        let user = match url.username() {
            "" => "guest".to_string(),
            u => decode(u)?,
        };
        let password = match url.password() {
            None => "guest".to_string(),
            Some(p) => decode(p)?,
        };
        let vhost = match url.path() {
            "" => "/".to_string(),
            path => decode(path.strip_prefix('/').unwrap_or(path))?,
        };
        let mut uri = AmqpUri {
            tls,
            host,
            port: url.port().unwrap_or(if tls { 5671 } else { 5672 }),
            user,
            password,
            vhost: if url.path().is_empty() { "/".into() } else { vhost },
            heartbeat: None,
            frame_max: None,
            channel_max: None,
            connection_timeout: None,
            external_auth: false,
        };
        for (key, value) in url.query_pairs() {
            let number = |v: &str| {
                v.parse::<u64>()
                    .map_err(|_| Error::Uri(format!("{key}={v}: not a whole number")))
            };
            match key.as_ref() {
                "heartbeat" => uri.heartbeat = Some(number(&value)?.min(u64::from(u16::MAX)) as u16),
                "frame_max" => uri.frame_max = Some(number(&value)?.min(u64::from(u32::MAX)) as u32),
                "channel_max" => uri.channel_max = Some(number(&value)?.min(u64::from(u16::MAX)) as u16),
                "connection_timeout" => uri.connection_timeout = Some(Duration::from_millis(number(&value)?)),
                "auth_mechanism" => match value.to_ascii_lowercase().as_str() {
                    "external" => uri.external_auth = true,
                    "plain" => uri.external_auth = false,
                    other => return Err(Error::Uri(format!("auth_mechanism={other}: plain or external"))),
                },
                // certificate settings (cacertfile …) come from the caller's TLS config
                _ => {}
            }
        }
        Ok(uri)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_as_rabbitmq_documents_them() {
        let u: AmqpUri = "amqp://guest:guest@127.0.0.1:5672/%2f".parse().unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.vhost.as_str(), u.tls),
            ("127.0.0.1", 5672, "/", false)
        );
        let u: AmqpUri = "amqps://a%40b:p%3Aw@broker/prod?heartbeat=5&frame_max=16384"
            .parse()
            .unwrap();
        assert_eq!((u.user.as_str(), u.password.as_str()), ("a@b", "p:w"));
        assert_eq!((u.port, u.vhost.as_str(), u.tls), (5671, "prod", true));
        assert_eq!((u.heartbeat, u.frame_max), (Some(5), Some(16384)));
        let u: AmqpUri = "amqp://h".parse().unwrap();
        assert_eq!((u.user.as_str(), u.vhost.as_str()), ("guest", "/"));
        assert!(!format!("{u:?}").contains("guest@") && !format!("{u:?}").contains(":guest"));
        assert!("http://h".parse::<AmqpUri>().is_err());
        assert!("amqp://h?heartbeat=x".parse::<AmqpUri>().is_err());
        let u: AmqpUri = "amqps://h?auth_mechanism=external".parse().unwrap();
        assert!(u.external_auth);
    }
}
