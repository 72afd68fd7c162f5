//! `ladder probe`: asks the admin server at `admin.bind` whether the service is ready
//! (`GET /ready`). Exit 0 on 200, otherwise 1 with the reason — a health check for a container
//! image that has no shell and no HTTP client. Plain HTTP/1.1 over loopback, no client library.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use ladder::config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::exit;

/// How long the whole probe may take: connect, ask, read the answer. Health checkers give a
/// probe a few seconds; a server that needs longer to say "ready" is not healthy.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The most of the answer read: the status line and the short body of `/ready`.
const MAX_ANSWER_BYTES: u64 = 4096;

/// `ladder probe`.
pub async fn probe(config: &Config) -> ExitCode {
    let address = reachable(config.admin.bind);
    let url = format!("http://{address}/ready");
    match tokio::time::timeout(PROBE_TIMEOUT, get(address, "/ready")).await {
        Ok(Ok((200, _))) => {
            println!("{url}: ready");
            ExitCode::SUCCESS
        }
        Ok(Ok((status, body))) => {
            eprintln!("ladder probe: {url} answered {status} {body:?}");
            ExitCode::from(exit::FAILED)
        }
        Ok(Err(e)) => {
            eprintln!("ladder probe: {url}: {e}");
            ExitCode::from(exit::FAILED)
        }
        Err(_) => {
            eprintln!("ladder probe: {url}: no answer within {PROBE_TIMEOUT:?}");
            ExitCode::from(exit::FAILED)
        }
    }
}

/// Where a client on this machine reaches a server bound to `bind`: an unspecified address
/// (`0.0.0.0`, `::`) through the loopback of its family.
pub fn reachable(bind: SocketAddr) -> SocketAddr {
    match bind.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), bind.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), bind.port()),
        _ => bind,
    }
}

/// `GET path` with `Connection: close`: the status code and the body (lossy, trimmed).
async fn get(address: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut stream = TcpStream::connect(address)
        .await
        .map_err(|e| format!("cannot connect: {e} (is `ladder run` serving with this config?)"))?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| format!("cannot send the request: {e}"))?;
    let mut answer = Vec::new();
    stream
        .take(MAX_ANSWER_BYTES)
        .read_to_end(&mut answer)
        .await
        .map_err(|e| format!("cannot read the answer: {e}"))?;
    parse(&answer)
}

/// The status code and the body of an HTTP/1.1 answer.
fn parse(answer: &[u8]) -> Result<(u16, String), String> {
    let text = String::from_utf8_lossy(answer);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .lines()
        .next()
        .and_then(|line| line.strip_prefix("HTTP/1."))
        .and_then(|rest| rest.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {:?}", head.lines().next().unwrap_or("")))?;
    Ok((status, body.trim().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unspecified_bind_is_reached_through_loopback() {
        let at = |s: &str| reachable(s.parse().unwrap()).to_string();
        assert_eq!(at("0.0.0.0:9464"), "127.0.0.1:9464");
        assert_eq!(at("[::]:9464"), "[::1]:9464");
        assert_eq!(at("127.0.0.1:9464"), "127.0.0.1:9464");
        assert_eq!(at("10.1.2.3:80"), "10.1.2.3:80");
    }

    #[test]
    fn answers_parse_to_status_and_body() {
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nready"),
            Ok((200, "ready".into()))
        );
        assert_eq!(
            parse(b"HTTP/1.1 503 Service Unavailable\r\n\r\nnot ready\n"),
            Ok((503, "not ready".into()))
        );
        assert!(parse(b"SSH-2.0-OpenSSH_9.2\r\n").is_err());
        assert!(parse(b"").is_err());
    }
}
