//! `ladder parked` through a running service's admin API instead of the stream: the service
//! keeps an index of the parking lot that follows the stream, so a page or a count is a few
//! milliseconds where the CLI would read the whole stream (~15 s for a million entries).
//!
//! Which service: `--admin URL`, else the config's `admin.bind`. It is used only when it serves
//! this config's namespace and ladder and its index has caught up with the stream; otherwise
//! the command reads the stream itself ([`Answered`] says which, once, on stderr). Nothing here
//! talks to the broker.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use anyhow::anyhow;
use ladder::broker::lot::{Outcome, Page, ParkingError, Status};
use ladder::config::Config;
use ladder::model::envelope::Envelope;
use ladder::model::lot::index::Counts;
use ladder::model::lot::record::{ParkedEntry, Resolution};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// How long finding out whether a service answers may take (connect, `/api/ladders`, one empty
/// page): a service that needs longer is in trouble, and the stream is the better answer.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// How long one read may take once the service answered (a header or body search on a large
/// parking lot reads records from the stream: seconds, not minutes).
pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(120);

/// How long a replay or discard request waits for its job before the service answers 202; the
/// CLI then follows the job. Short when a progress bar shows it, else the service's longest.
pub(crate) const JOB_WAIT_QUIET: &str = "20s";
pub(crate) const JOB_WAIT_SHOWN: &str = "1s";

/// How often a running job is polled.
pub(crate) const JOB_POLL: Duration = Duration::from_millis(300);

/// The most entries one request asks for (the API's `MAX_PAGE_SIZE`).
pub(crate) const PAGE: usize = ladder::admin::api::MAX_PAGE_SIZE;

/// A service whose API answers for this config's namespace and ladder.
pub(crate) struct Service {
    /// `http://host:port`, no trailing slash.
    pub(crate) base: String,
    ladder: String,
    http: reqwest::Client,
}

/// Why the stream is read instead of a service's API.
pub(crate) enum Unanswered {
    /// No service to ask, or none answered, or it cannot answer for this config (yet).
    Fallback(String),
    /// `--admin` named a service that serves something else: reading the stream of this
    /// config instead would answer another question than the one asked.
    Mismatch(String),
}

/// Where a client on this machine reaches a server bound to `bind`: an unspecified address
/// (`0.0.0.0`, `::`) through the loopback of its family; `None` for port 0 (an ephemeral port
/// nobody can know).
pub(crate) fn discovered(bind: SocketAddr) -> Option<String> {
    if bind.port() == 0 {
        return None;
    }
    let address = match bind.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), bind.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), bind.port()),
        _ => bind,
    };
    Some(format!("http://{address}"))
}

/// `--admin` as a base URL: `127.0.0.1:9464` and `http://127.0.0.1:9464/` both mean
/// `http://127.0.0.1:9464`.
pub(crate) fn base_url(given: &str) -> String {
    let given = given.trim().trim_end_matches('/');
    if given.contains("://") {
        given.to_string()
    } else {
        format!("http://{given}")
    }
}

/// The one page with every entry's total and how far the service's index is.
#[derive(Deserialize)]
struct Listing {
    total: u64,
    entries: Vec<ApiEntry>,
    indexed_entries: u64,
    caught_up: bool,
}

#[derive(Deserialize)]
struct ApiEntry {
    offset: u64,
    envelope: Envelope,
    resolution: Option<Resolution>,
}

impl From<ApiEntry> for ParkedEntry {
    fn from(e: ApiEntry) -> Self {
        ParkedEntry {
            offset: e.offset,
            envelope: e.envelope,
            resolution: e.resolution,
            body_apart: None,
        }
    }
}

#[derive(Deserialize)]
struct ApiCounts {
    total: u64,
    by_destination: Vec<(String, u64)>,
    by_reason: Vec<(String, u64)>,
}

/// A replay's or discard's job as the API answers it.
#[derive(Deserialize)]
pub(crate) struct ApiJob {
    /// Entries selected; `None` until it has selected.
    pub(crate) selected: Option<usize>,
    outcomes: Vec<ApiOutcome>,
    pub(crate) left_over: u64,
    pub(crate) done: bool,
    pub(crate) error: Option<String>,
    /// The job's URL (in the answer to the request that started it).
    #[serde(default)]
    pub(crate) status: Option<String>,
}

impl ApiJob {
    /// Entries done so far.
    pub(crate) fn done_count(&self) -> usize {
        self.outcomes.len()
    }

    /// The outcomes as the stream path reports them.
    pub(crate) fn outcomes(self) -> Vec<Outcome> {
        self.outcomes.into_iter().map(Outcome::from).collect()
    }
}

#[derive(Deserialize)]
struct ApiOutcome {
    offset: u64,
    to: Option<String>,
    status: String,
    #[serde(default)]
    error: Option<String>,
}

impl From<ApiOutcome> for Outcome {
    fn from(o: ApiOutcome) -> Self {
        let status = match o.status.as_str() {
            "replayed" => Status::Replayed,
            "would-replay" => Status::WouldReplay,
            "discarded" => Status::Discarded,
            other => Status::Failed {
                error: o.error.unwrap_or_else(|| format!("status {other}")),
            },
        };
        Outcome {
            offset: o.offset,
            to: o.to,
            status,
        }
    }
}

/// Decodes an answer however deeply its headers nest (as [`Envelope::from_slice`] does).
fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, serde_json::Error> {
    let mut json = serde_json::Deserializer::from_slice(bytes);
    json.disable_recursion_limit();
    T::deserialize(serde_stacker::Deserializer::new(&mut json))
}

impl Service {
    /// Asks `base` whether it serves `ladder` of `config`'s namespace with an index that has
    /// caught up with the stream.
    pub(crate) async fn probe(base: &str, config: &Config, ladder: &str) -> Result<Service, Unanswered> {
        let fallback = |why: String| Unanswered::Fallback(why);
        let http = reqwest::Client::builder()
            .connect_timeout(PROBE_TIMEOUT)
            .build()
            .map_err(|e| fallback(format!("no HTTP client: {e}")))?;
        let service = Service {
            base: base.to_string(),
            ladder: ladder.to_string(),
            http,
        };
        let ladders: Value = tokio::time::timeout(PROBE_TIMEOUT, service.get_json("/api/ladders", &[]))
            .await
            .map_err(|_| fallback(format!("{base} did not answer within {PROBE_TIMEOUT:?}")))?
            .map_err(|e| fallback(format!("{e:#}")))?;
        let namespace = ladders["namespace"].as_str().unwrap_or_default();
        let serves_ladder = ladders["ladders"]
            .as_array()
            .is_some_and(|all| all.iter().any(|l| l["name"] == ladder));
        if namespace != config.namespace || !serves_ladder {
            return Err(Unanswered::Mismatch(format!(
                "the service at {base} serves namespace {namespace:?}, not ladder {ladder:?} of namespace {:?}",
                config.namespace
            )));
        }
        let path = format!("/api/ladders/{ladder}/parked");
        let empty: Listing = tokio::time::timeout(
            PROBE_TIMEOUT,
            service.get_json(
                &path,
                &[("limit".into(), "0".into()), ("resolved".into(), "include".into())],
            ),
        )
        .await
        .map_err(|_| fallback(format!("{base} did not answer within {PROBE_TIMEOUT:?}")))?
        .map_err(|e| fallback(format!("{e:#}")))?;
        if !empty.caught_up {
            return Err(fallback(format!(
                "the service at {base} is still reading the stream ({} entries so far)",
                empty.indexed_entries
            )));
        }
        Ok(service)
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn parked(&self, rest: &str) -> String {
        format!("/api/ladders/{}/parked{rest}", self.ladder)
    }

    /// `GET path?query` → JSON, or the service's error as a [`ParkingError`] of the right kind.
    async fn get_json<T: DeserializeOwned>(&self, path: &str, query: &[(String, String)]) -> anyhow::Result<T> {
        let bytes = self.get_bytes(path, query).await?;
        decode(&bytes).map_err(|e| {
            anyhow!(
                "the service at {} answered {path} with JSON that does not decode: {e}",
                self.base
            )
        })
    }

    async fn get_bytes(&self, path: &str, query: &[(String, String)]) -> anyhow::Result<Vec<u8>> {
        let response = self
            .http
            .get(self.url(path))
            .query(query)
            .timeout(READ_TIMEOUT)
            .send()
            .await
            .map_err(|e| unavailable(&self.base, &e))?;
        self.answer(response).await
    }

    async fn answer(&self, response: reqwest::Response) -> anyhow::Result<Vec<u8>> {
        let status = response.status();
        let bytes = response
            .bytes()
            .await
            .map_err(|e| unavailable(&self.base, &e))?
            .to_vec();
        if status.is_success() {
            Ok(bytes)
        } else {
            Err(refusal(&self.base, &self.ladder, status.as_u16(), &bytes))
        }
    }

    /// A page of entries, newest first: `limit` of them after skipping `offset` (paged in
    /// requests of at most [`PAGE`]).
    pub(crate) async fn list(
        &self,
        filter: &[(String, String)],
        offset: usize,
        limit: usize,
        all: bool,
    ) -> anyhow::Result<Page> {
        let mut entries = Vec::new();
        loop {
            let want = (limit - entries.len()).min(PAGE);
            let mut query = filter.to_vec();
            query.push(("offset".into(), (offset + entries.len()).to_string()));
            query.push(("limit".into(), want.to_string()));
            if all {
                query.push(("resolved".into(), "include".into()));
            }
            let page: Listing = self.get_json(&self.parked(""), &query).await?;
            let got = page.entries.len();
            entries.extend(page.entries.into_iter().map(ParkedEntry::from));
            if got < want || entries.len() >= limit || want == 0 {
                return Ok(Page {
                    total: page.total,
                    entries,
                });
            }
        }
    }

    /// How many entries match, in all, per reason and per destination.
    pub(crate) async fn counts(&self, filter: &[(String, String)], all: bool) -> anyhow::Result<Counts> {
        let mut query = filter.to_vec();
        if all {
            query.push(("resolved".into(), "include".into()));
        }
        let counts: ApiCounts = self.get_json(&self.parked("/counts"), &query).await?;
        Ok(Counts {
            total: counts.total,
            by_destination: counts.by_destination,
            by_reason: counts.by_reason,
        })
    }

    /// One entry in full, its body read back when it was parked apart.
    pub(crate) async fn show(&self, offset: u64) -> anyhow::Result<ParkedEntry> {
        let entry: ApiEntry = self.get_json(&self.parked(&format!("/{offset}")), &[]).await?;
        let mut entry = ParkedEntry::from(entry);
        if entry.envelope.message.body_record.is_some() {
            entry.body_apart = Some(self.body(offset).await?);
        }
        Ok(entry)
    }

    /// One entry's original body.
    pub(crate) async fn body(&self, offset: u64) -> anyhow::Result<Vec<u8>> {
        self.get_bytes(&self.parked(&format!("/{offset}/body")), &[]).await
    }

    /// Starts a replay or discard (`action`) with `request` as its body and token `token`, and
    /// returns the job as first answered (done when it ended within the request's `wait`).
    pub(crate) async fn act(&self, action: &str, token: &str, request: &Value) -> anyhow::Result<ApiJob> {
        let wait = request["wait"].as_str().and_then(|w| humantime::parse_duration(w).ok());
        let response = self
            .http
            .post(self.url(&self.parked(&format!("/{action}"))))
            .bearer_auth(token)
            .json(request)
            .timeout(wait.unwrap_or_default() + READ_TIMEOUT)
            .send()
            .await
            .map_err(|e| unavailable(&self.base, &e))?;
        let bytes = self.answer(response).await?;
        decode(&bytes).map_err(|e| {
            anyhow!(
                "the service at {} answered the {action} with JSON that does not decode: {e}",
                self.base
            )
        })
    }

    /// The job at `status` (its URL path) now.
    pub(crate) async fn job(&self, status: &str) -> anyhow::Result<ApiJob> {
        self.get_json(status, &[]).await
    }
}

/// The service could not be reached, or stopped answering (exit 69), with the innermost cause
/// (`Connection refused`, not reqwest's "error sending request").
fn unavailable(base: &str, e: &reqwest::Error) -> anyhow::Error {
    let mut cause: &dyn std::error::Error = e;
    while let Some(source) = cause.source() {
        cause = source;
    }
    let why = if e.is_timeout() {
        "timed out".to_string()
    } else {
        cause.to_string()
    };
    anyhow::Error::new(ParkingError::Refused(format!(
        "the service at {base} did not answer: {why}"
    )))
}

/// An error answer as the [`ParkingError`] whose kind gives the same exit code the stream path
/// would: 400, 401, 403, 413, 415 → 64; 404 → 1; 409 → 75; 503 → 69; anything else → 1.
fn refusal(base: &str, ladder: &str, status: u16, body: &[u8]) -> anyhow::Error {
    let message = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_string());
    let message = format!("the service at {base} answered {status}: {message}");
    anyhow::Error::new(match status {
        400 | 401 | 403 | 413 | 415 => ParkingError::Invalid(message),
        404 => ParkingError::Missing(message),
        409 => ParkingError::Busy(ladder.to_string()),
        503 => ParkingError::Refused(message),
        _ => return anyhow!(message),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_is_found_where_admin_bind_says() {
        let at = |s: &str| discovered(s.parse().unwrap());
        assert_eq!(at("127.0.0.1:9464").as_deref(), Some("http://127.0.0.1:9464"));
        assert_eq!(at("0.0.0.0:9464").as_deref(), Some("http://127.0.0.1:9464"));
        assert_eq!(at("[::]:9464").as_deref(), Some("http://[::1]:9464"));
        assert_eq!(at("10.1.2.3:80").as_deref(), Some("http://10.1.2.3:80"));
        assert_eq!(at("127.0.0.1:0"), None, "an ephemeral port cannot be found");
        assert_eq!(base_url("127.0.0.1:9464/"), "http://127.0.0.1:9464");
        assert_eq!(base_url(" https://ladder.example/ "), "https://ladder.example");
    }

    #[test]
    fn error_answers_give_the_stream_paths_exit_codes() {
        let kind = |status: u16| {
            refusal("http://x", "default", status, br#"{"error": "why"}"#)
                .downcast_ref::<ParkingError>()
                .map(ParkingError::kind)
        };
        use ladder::broker::lot::ErrorKind::*;
        assert_eq!(kind(400), Some(Caller));
        assert_eq!(kind(403), Some(Caller));
        assert_eq!(kind(404), Some(Missing));
        assert_eq!(kind(409), Some(Conflict));
        assert_eq!(kind(503), Some(Unavailable));
        assert_eq!(kind(500), None);
        let text = refusal(
            "http://x",
            "default",
            404,
            br#"{"error": "no parked entry at offset 7"}"#,
        )
        .to_string();
        assert_eq!(
            text,
            "the service at http://x answered 404: no parked entry at offset 7"
        );
    }

    #[test]
    fn job_outcomes_read_as_the_stream_path_reports_them() {
        let job: ApiJob = decode(
            br#"{"id": 1, "job": 1, "status": "/api/ladders/d/parked/jobs/1", "ladder": "d", "kind": "replay",
                 "by": "alice", "started_at_ms": 1, "selected": 3, "left_over": 0, "done": true, "error": null,
                 "outcomes": [{"offset": 1, "to": "q", "status": "replayed"},
                              {"offset": 2, "to": null, "status": "failed", "error": "no destination"},
                              {"offset": 3, "to": "q", "status": "would-replay"}]}"#,
        )
        .unwrap();
        assert_eq!(job.status.as_deref(), Some("/api/ladders/d/parked/jobs/1"));
        assert_eq!(job.done_count(), 3);
        let outcomes = job.outcomes();
        assert_eq!(outcomes[0].status, Status::Replayed);
        assert_eq!(
            outcomes[1].status,
            Status::Failed {
                error: "no destination".into()
            }
        );
        assert_eq!(outcomes[2].status, Status::WouldReplay);
    }
}
