//! `ladder parked …`: inspect, search, replay and discard one ladder's parked messages from a
//! terminal — through a running service's admin API when one answers for this config
//! ([`service`]), else straight against the broker's stream. Either way the output is the same;
//! one line on stderr says which answered.

use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Context;
use clap::Subcommand;
use ladder::broker::connect as broker;
use ladder::broker::lot::{self as parking, ParkingLot};
use ladder::config::Config;
use ladder::model::lot::record::ParkedEntry;
use ladder::model::lot::text;
use serde_json::{Value, json};
use tracing::info;

use crate::exit;

mod progress;
mod service;

use progress::Progress;
use service::{Service, Unanswered};

#[derive(clap::Args)]
pub struct ParkedArgs {
    /// The ladder whose parking lot to use (needed when the config has more than one).
    #[arg(long, global = true)]
    ladder: Option<String>,
    /// Ask the service whose admin server is at this URL (`http://host:9464`). Default: the
    /// config's admin.bind, when a service serving this config's namespace answers there.
    #[arg(long, global = true, value_name = "URL", conflicts_with = "stream")]
    admin: Option<String>,
    /// Read the stream itself, never a service's API.
    #[arg(long, global = true)]
    stream: bool,
    /// A token from the service's admin.tokens: replay and discard then go through its API,
    /// and the record names the token's owner. Without one they act on the stream directly.
    #[arg(
        long,
        global = true,
        env = "LADDER_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    token: Option<String>,
    #[command(subcommand)]
    command: ParkedCommand,
}

#[derive(Subcommand)]
pub enum ParkedCommand {
    /// List parked messages, newest first (unresolved only, unless --all).
    List {
        #[command(flatten)]
        filter: FilterArgs,
        /// Entries to print.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Newest matches to skip (paging).
        #[arg(long, default_value_t = 0)]
        offset: usize,
        /// Include replayed and discarded entries, with their resolution.
        #[arg(long)]
        all: bool,
        /// Print JSON (`{"total", "entries"}`) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Count parked messages matching the filters, in all, per reason and per destination.
    Counts {
        #[command(flatten)]
        filter: FilterArgs,
        /// Count replayed and discarded entries too.
        #[arg(long)]
        all: bool,
        /// Print JSON (`{"total", "by_destination", "by_reason"}`) instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Print one entry in full: body, properties, headers, reason, attempts and times.
    Show {
        /// The entry's stream offset (first column of `list`).
        offset: u64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Write one entry's original body, as bytes, to standard output (`show` prints at most
    /// the first 64 KiB of it).
    Body {
        /// The entry's stream offset.
        offset: u64,
    },
    /// Republish entries (by offset, or all unresolved ones matching the filters) to their queue.
    Replay {
        /// Stream offsets of the entries.
        offsets: Vec<u64>,
        #[command(flatten)]
        filter: FilterArgs,
        /// Replay to this queue instead (it must pass the ladder's allow-list).
        #[arg(long)]
        to: Option<String>,
        /// At most this many per second or minute: `50/s`, `100/m`.
        #[arg(long)]
        rate: Option<String>,
        /// Only print what would be replayed.
        #[arg(long)]
        dry_run: bool,
        /// Edit before replaying (one offset only): set header KEY to the text VALUE; may be
        /// repeated. The entry keeps the original; its resolution records what changed.
        #[arg(long, value_name = "KEY=VALUE")]
        edit_header: Vec<String>,
        /// Edit before replaying (one offset only): replay with this file's bytes as the body.
        #[arg(long, value_name = "FILE")]
        edit_body_file: Option<std::path::PathBuf>,
        /// Who asks, for the record and the log (default: $USER).
        #[arg(long)]
        by: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Mark entries (by offset, or all unresolved ones matching the filters) as discarded.
    Discard {
        /// Stream offsets of the entries.
        offsets: Vec<u64>,
        #[command(flatten)]
        filter: FilterArgs,
        /// Do not ask for confirmation (required when stdin is not a terminal).
        #[arg(long)]
        yes: bool,
        /// Who asks, for the record and the log (default: $USER).
        #[arg(long)]
        by: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
pub struct FilterArgs {
    /// The queue it was headed for.
    #[arg(long)]
    destination: Option<String>,
    /// The reason code (`max-attempts`, `no-route`, ...).
    #[arg(long)]
    reason: Option<String>,
    /// Parked at or after: a duration ago (`2h`) or an RFC 3339 time.
    #[arg(long)]
    since: Option<String>,
    /// Parked at or before: a duration ago (`10m`) or an RFC 3339 time.
    #[arg(long)]
    until: Option<String>,
    /// The original message id.
    #[arg(long)]
    message_id: Option<String>,
    /// The original correlation id.
    #[arg(long)]
    correlation_id: Option<String>,
    /// An original header's text value, `key=value` (repeatable; all must match).
    #[arg(long = "header", value_name = "KEY=VALUE")]
    headers: Vec<String>,
    /// A substring of the (text) body.
    #[arg(long)]
    body_contains: Option<String>,
}

impl FilterArgs {
    fn build(&self, offsets: &[u64]) -> Result<ladder::model::lot::filter::Filter, parking::ParkingError> {
        let input = ladder::model::lot::filter::FilterInput {
            offsets: offsets.to_vec(),
            destination: self.destination.clone(),
            reason: self.reason.clone(),
            message_id: self.message_id.clone(),
            correlation_id: self.correlation_id.clone(),
            headers: self.header_pairs()?,
            body_contains: self.body_contains.clone(),
            since: self.since.clone(),
            until: self.until.clone(),
        };
        Ok(input.build(ladder::clock::now_ms())?)
    }

    fn header_pairs(&self) -> Result<Vec<(String, String)>, parking::ParkingError> {
        Ok(self
            .headers
            .iter()
            .map(|h| ladder::model::lot::filter::parse_header_filter(h))
            .collect::<Result<_, _>>()?)
    }

    /// The filter as the API's query parameters (checked by [`FilterArgs::build`] first).
    fn query(&self) -> Vec<(String, String)> {
        let mut query = vec![];
        let mut add = |key: &str, value: &Option<String>| {
            if let Some(value) = value {
                query.push((key.to_string(), value.clone()));
            }
        };
        add("destination", &self.destination);
        add("reason", &self.reason);
        add("since", &self.since);
        add("until", &self.until);
        add("message_id", &self.message_id);
        add("correlation_id", &self.correlation_id);
        add("body", &self.body_contains);
        query.extend(self.headers.iter().map(|h| ("header".to_string(), h.clone())));
        query
    }

    /// The filter as the fields of an API replay or discard request.
    fn request(&self, offsets: &[u64]) -> Result<serde_json::Map<String, Value>, parking::ParkingError> {
        let mut headers = BTreeMap::new();
        for (key, value) in self.header_pairs()? {
            if headers.get(&key).is_some_and(|v| v != &value) {
                return Err(parking::ParkingError::Invalid(format!(
                    "--header {key} is given twice with different values; the service's API takes one value per header (--stream takes both)"
                )));
            }
            headers.insert(key, value);
        }
        let mut request = serde_json::Map::new();
        if !offsets.is_empty() {
            request.insert("offsets".into(), json!(offsets));
        }
        for (key, value) in [
            ("destination", &self.destination),
            ("reason", &self.reason),
            ("since", &self.since),
            ("until", &self.until),
            ("message_id", &self.message_id),
            ("correlation_id", &self.correlation_id),
            ("body_contains", &self.body_contains),
        ] {
            if let Some(value) = value {
                request.insert(key.into(), json!(value));
            }
        }
        if !headers.is_empty() {
            request.insert("headers".into(), json!(headers));
        }
        Ok(request)
    }
}

impl ParkedCommand {
    /// Whether the command changes the parking lot (and so needs a token for the API).
    fn acts(&self) -> bool {
        matches!(self, ParkedCommand::Replay { .. } | ParkedCommand::Discard { .. })
    }
}

/// `ladder parked …`: resolve the ladder, pick who answers (a service's API or the stream),
/// say which on stderr, run the command there.
pub async fn parked(config: &Config, args: ParkedArgs, env: &HashMap<String, String>) -> anyhow::Result<ExitCode> {
    let spec = super::choose_ladder(config, args.ladder.as_deref())?;
    let stream = ladder::model::names::Names::of(&config.namespace, spec).parked;
    let token = args.token.as_deref().map(str::trim).filter(|t| !t.is_empty());
    let why_not = if args.stream {
        "--stream".to_string()
    } else if args.command.acts() && token.is_none() {
        "no --token or LADDER_TOKEN for a service's API".to_string()
    } else {
        let (base, explicit) = match &args.admin {
            Some(given) => (Some(service::base_url(given)), true),
            None => (service::discovered(config.admin.bind), false),
        };
        match base {
            None => "admin.bind has port 0: no service to ask".to_string(),
            Some(base) => match Service::probe(&base, config, &spec.name).await {
                Ok(service) => {
                    eprintln!("ladder: answered by the service at {}", service.base);
                    let side = Side::Service {
                        service: &service,
                        token,
                    };
                    return run(&side, args.command, &stream).await;
                }
                Err(Unanswered::Mismatch(why)) if explicit => {
                    return Err(parking::ParkingError::Invalid(why).into());
                }
                Err(Unanswered::Mismatch(why) | Unanswered::Fallback(why)) => why,
            },
        }
    };
    eprintln!("ladder: read the stream {stream} ({why_not})");
    let connection = broker::connect(&config.amqp)
        .await
        .map_err(parking::ParkingError::from)
        .with_context(|| format!("cannot reach the broker at {}", config.amqp.brokers()))?;
    let lot = ParkingLot::new(&connection, &config.amqp, &config.namespace, spec);
    let side = Side::Stream {
        lot: Box::new(lot),
        ladder: &spec.name,
        max_header_bytes: config.limits.max_header_bytes,
        user: env.get("USER").cloned(),
    };
    let code = run(&side, args.command, &stream).await;
    let _ = tokio::time::timeout(parking::BROKER_TIMEOUT, connection.close(200, "done")).await;
    code
}

/// Who answers a `ladder parked` command: a running service through its API (replay and
/// discard with `token`), or the stream on a connection of this command's own. Each command is
/// written once ([`run`]); only the transport differs.
enum Side<'a> {
    Service {
        service: &'a Service,
        token: Option<&'a str>,
    },
    Stream {
        lot: Box<ParkingLot<'a>>,
        ladder: &'a str,
        max_header_bytes: usize,
        user: Option<String>,
    },
}

/// A replay as asked, its arguments checked.
struct Replay {
    offsets: Vec<u64>,
    filter: FilterArgs,
    to: Option<String>,
    rate: Option<String>,
    dry_run: bool,
    edit: Option<CliEdit>,
    by: Option<String>,
}

/// What a replay or discard did: each entry's outcome, and how many more match.
type Done = (Vec<parking::Outcome>, u64);

/// Runs `command` against `side`; the output is the same whichever side answers.
async fn run(side: &Side<'_>, command: ParkedCommand, stream: &str) -> anyhow::Result<ExitCode> {
    Ok(match command {
        ParkedCommand::List {
            filter,
            limit,
            offset,
            all,
            json,
        } => print_page(&side.list(&filter, offset, limit, all).await?, all, json, stream)?,
        ParkedCommand::Counts { filter, all, json } => {
            print_counts(&side.counts(&filter, all).await?, all, json, stream)?
        }
        ParkedCommand::Show { offset, json } => print_entry(&side.show(offset).await?, json, stream)?,
        ParkedCommand::Body { offset } => {
            let body = side.body(offset).await?;
            std::io::Write::write_all(&mut std::io::stdout().lock(), &body)?;
            ExitCode::SUCCESS
        }
        ParkedCommand::Replay {
            offsets,
            filter,
            to,
            rate,
            dry_run,
            edit_header,
            edit_body_file,
            by,
            json,
        } => {
            side.may_act("replay", by.as_deref())?;
            let edit = cli_edit(
                &offsets,
                &filter,
                rate.is_some() || dry_run,
                &edit_header,
                edit_body_file.as_deref(),
            )?;
            if edit.is_none() {
                not_everything(&filter.build(&offsets)?)?;
            }
            if let Some(rate) = &rate {
                rate.parse::<ladder::model::lot::pace::Rate>()
                    .map_err(parking::ParkingError::from)?;
            }
            let progress = Progress::new(if dry_run { "checking" } else { "replaying" }, json);
            let replay = Replay {
                offsets,
                filter,
                to,
                rate,
                dry_run,
                edit,
                by,
            };
            let (outcomes, left_over) = side.replay(replay, &progress).await?;
            report(&outcomes, left_over, json)?
        }
        ParkedCommand::Discard {
            offsets,
            filter,
            yes,
            by,
            json,
        } => {
            side.may_act("discard", by.as_deref())?;
            not_everything(&filter.build(&offsets)?)?;
            let progress = Progress::new("discarding", json);
            match side.discard(&offsets, &filter, yes, by, &progress).await? {
                Ok((outcomes, left_over)) => report(&outcomes, left_over, json)?,
                Err(answer) => declined(answer),
            }
        }
    })
}

impl Side<'_> {
    /// Whether this side may replay or discard as asked: over the API with a token, and
    /// without `--by` (the record names the token's owner).
    fn may_act(&self, action: &str, by: Option<&str>) -> anyhow::Result<()> {
        if let Side::Service { token, .. } = self {
            token.with_context(|| format!("{action} through the API needs a token"))?;
            refuse_by(by)?;
        }
        Ok(())
    }

    async fn list(&self, filter: &FilterArgs, offset: usize, limit: usize, all: bool) -> anyhow::Result<parking::Page> {
        let built = filter.build(&[])?.with_entries(entries(all));
        Ok(match self {
            Side::Service { service, .. } => service.list(&filter.query(), offset, limit, all).await?,
            Side::Stream { lot, .. } => {
                let index = lot.index_for(&built).await?;
                lot.list(&index, &built, parking::PageRequest { offset, limit }).await?
            }
        })
    }

    async fn counts(&self, filter: &FilterArgs, all: bool) -> anyhow::Result<ladder::model::lot::index::Counts> {
        let built = filter.build(&[])?.with_entries(entries(all));
        Ok(match self {
            Side::Service { service, .. } => service.counts(&filter.query(), all).await?,
            Side::Stream { lot, .. } => lot.counts(&lot.index_for(&built).await?, &built).await?,
        })
    }

    async fn show(&self, offset: u64) -> anyhow::Result<ParkedEntry> {
        Ok(match self {
            Side::Service { service, .. } => service.show(offset).await?,
            Side::Stream { lot, .. } => {
                let filter = ladder::model::lot::filter::Filter {
                    offsets: Some([offset].into()),
                    ..ladder::model::lot::filter::Filter::default()
                };
                lot.show(&lot.index_for(&filter).await?, offset).await?
            }
        })
    }

    async fn body(&self, offset: u64) -> anyhow::Result<Vec<u8>> {
        Ok(match self {
            Side::Service { service, .. } => service.body(offset).await?,
            Side::Stream { .. } => self
                .show(offset)
                .await?
                .body()
                .map_err(parking::ParkingError::from)?
                .into_owned(),
        })
    }

    async fn replay(&self, replay: Replay, progress: &Progress) -> anyhow::Result<Done> {
        let (lot, ladder, max_header_bytes, user) = match self {
            Side::Service { service, token } => {
                let token = token.context("replay through the API needs a token")?;
                let job = follow(service, &replay.api_action(), token, replay.api_request()?, progress).await?;
                let left_over = job.left_over;
                return Ok((job.outcomes(), left_over));
            }
            Side::Stream {
                lot,
                ladder,
                max_header_bytes,
                user,
            } => (lot, *ladder, *max_header_bytes, user),
        };
        let filter = replay.filter.build(&replay.offsets)?;
        let options = parking::ReplayOptions {
            to: replay.to.clone(),
            rate: replay
                .rate
                .map(|r| r.parse())
                .transpose()
                .map_err(parking::ParkingError::from)?,
            dry_run: replay.dry_run,
            by: asked_by(replay.by, user),
            edit: replay.edit.map(|(set_headers, body)| ladder::model::lot::edit::Edit {
                headers: None,
                set_headers,
                body,
                max_header_bytes,
            }),
        };
        let done = lot
            .act(&filter, &options.by, parking::ActIndex::Fresh, async |index, selection| {
                info!(%ladder, by = %options.by, entries = selection.entries.len(), dry_run = options.dry_run, "replay requested");
                progress.set_length(selection.entries.len());
                let outcomes = lot
                    .replay_with(index, &selection.entries, &options, &mut |_| progress.inc())
                    .await?;
                Ok((outcomes, selection.left_over))
            })
            .await?;
        progress.finish();
        Ok(done)
    }

    /// Discards what `offsets` and `filter` select, after asking unless `yes`: `Err` is the
    /// answer that declined.
    async fn discard(
        &self,
        offsets: &[u64],
        filter: &FilterArgs,
        yes: bool,
        by: Option<String>,
        progress: &Progress,
    ) -> anyhow::Result<Result<Done, Answer>> {
        match self {
            Side::Service { service, token } => {
                let token = token.context("discard through the API needs a token")?;
                let mut request = filter.request(offsets)?;
                if !yes {
                    match confirm_discard(service, offsets, filter).await? {
                        Ok(Some(shown)) => {
                            // exactly what was shown (and still matches and is unresolved)
                            request.insert("offsets".into(), json!(shown));
                        }
                        Ok(None) => {}
                        Err(answer) => return Ok(Err(answer)),
                    }
                }
                let job = follow(service, "discard", token, request, progress).await?;
                let left_over = job.left_over;
                Ok(Ok((job.outcomes(), left_over)))
            }
            Side::Stream { lot, ladder, user, .. } => {
                let filter = filter.build(offsets)?;
                let who = asked_by(by, user);
                let done = lot
                    .act(&filter, &who, parking::ActIndex::Fresh, async |index, selection| {
                        if !yes && !selection.entries.is_empty() {
                            match ask_before_discarding(&selection.entries, 0)? {
                                Answer::Yes => {}
                                answer => return Ok(Err(answer)),
                            }
                        }
                        info!(%ladder, by = %who, entries = selection.entries.len(), "discard requested");
                        progress.set_length(selection.entries.len());
                        let outcomes = lot
                            .discard_with(index, &selection.entries, &who, &mut |_| progress.inc())
                            .await?;
                        Ok(Ok((outcomes, selection.left_over)))
                    })
                    .await?;
                progress.finish();
                Ok(done)
            }
        }
    }
}

impl Replay {
    /// The API's action: an edited replay of one entry, or a replay.
    fn api_action(&self) -> String {
        match (&self.edit, self.offsets.first()) {
            (Some(_), Some(offset)) => format!("{offset}/edit-replay"),
            _ => "replay".to_string(),
        }
    }

    /// The API's request for this replay.
    fn api_request(&self) -> anyhow::Result<serde_json::Map<String, Value>> {
        let mut request = match &self.edit {
            Some((set_headers, body)) => {
                let mut request = serde_json::Map::new();
                request.insert(
                    "set_headers".into(),
                    json!(set_headers.iter().cloned().collect::<BTreeMap<_, _>>()),
                );
                if let Some(body) = body {
                    request.insert(
                        "body_base64".into(),
                        json!(base64::Engine::encode(&base64::engine::general_purpose::STANDARD, body)),
                    );
                }
                request
            }
            None => self.filter.request(&self.offsets)?,
        };
        if let Some(to) = &self.to {
            request.insert("to".into(), json!(to));
        }
        if self.edit.is_none() {
            if let Some(rate) = &self.rate {
                request.insert("rate".into(), json!(rate));
            }
            if self.dry_run {
                request.insert("dry_run".into(), json!(true));
            }
        }
        Ok(request)
    }
}

/// Over the API, shows what a discard would act on — the oldest unresolved matches, at most one
/// page — and asks: the offsets shown when the answer is yes (`None`: nothing matches).
async fn confirm_discard(
    service: &Service,
    offsets: &[u64],
    filter: &FilterArgs,
) -> anyhow::Result<Result<Option<Vec<u64>>, Answer>> {
    let mut query = filter.query();
    if !offsets.is_empty() {
        let list: Vec<String> = offsets.iter().map(u64::to_string).collect();
        query.push(("offsets".into(), list.join(",")));
    }
    let total = service.list(&query, 0, 0, false).await?.total as usize;
    let skip = total.saturating_sub(service::PAGE);
    let mut shown = service.list(&query, skip, service::PAGE, false).await?.entries;
    shown.reverse();
    if shown.is_empty() {
        return Ok(Ok(None));
    }
    match ask_before_discarding(&shown, total - shown.len())? {
        Answer::Yes => Ok(Ok(Some(shown.iter().map(|e| e.offset).collect()))),
        answer => Ok(Err(answer)),
    }
}

/// Who asked, as a record on the stream names them: `--by`, else `$USER`.
fn asked_by(by: Option<String>, user: &Option<String>) -> String {
    by.or_else(|| user.clone()).unwrap_or_else(|| "unknown".into())
}

/// The entries `--all` asks for.
fn entries(all: bool) -> ladder::model::lot::filter::Entries {
    if all {
        ladder::model::lot::filter::Entries::All
    } else {
        ladder::model::lot::filter::Entries::Unresolved
    }
}

/// An action needs offsets or a filter, as [`ParkingLot::act`] says: checked before asking
/// anything, so a discard does not first list every entry to confirm.
fn not_everything(filter: &ladder::model::lot::filter::Filter) -> Result<(), parking::ParkingError> {
    if filter.is_empty() {
        return Err(parking::ParkingError::Invalid(
            "give offsets or at least one filter (an empty one would act on everything)".into(),
        ));
    }
    Ok(())
}

/// Over the API, who asked is the name of the token's owner: `--by` cannot be recorded.
fn refuse_by(by: Option<&str>) -> Result<(), parking::ParkingError> {
    match by {
        Some(_) => Err(parking::ParkingError::Invalid(
            "--by cannot be recorded through the service's API, which records the token's name; drop --by, or use --stream".into(),
        )),
        None => Ok(()),
    }
}

/// Starts a replay or discard on the service and follows its job to the end, the progress bar
/// showing how far it is. Interrupting the command stops only the following: the job runs on in
/// the service, and its URL is printed when it takes longer than the first request.
/// Headers to set (`name`, `value`) and the new body, if one is given.
type CliEdit = (Vec<(String, String)>, Option<Vec<u8>>);

/// The edit `--edit-header` and `--edit-body-file` ask for — the headers to set and the new
/// body — or `None` when neither is given; refused unless exactly one offset and no filter,
/// rate or dry run go with it.
fn cli_edit(
    offsets: &[u64],
    filter: &FilterArgs,
    paced_or_dry: bool,
    headers: &[String],
    body_file: Option<&std::path::Path>,
) -> anyhow::Result<Option<CliEdit>> {
    if headers.is_empty() && body_file.is_none() {
        return Ok(None);
    }
    if offsets.len() != 1 || !filter.build(&[])?.is_empty() || paced_or_dry {
        return Err(parking::ParkingError::Invalid(
            "--edit-header and --edit-body-file edit one entry: give exactly one offset, and no filter, --rate or --dry-run"
                .into(),
        )
        .into());
    }
    let mut set = Vec::with_capacity(headers.len());
    for pair in headers {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(parking::ParkingError::Invalid(format!("--edit-header {pair:?} is not KEY=VALUE")).into());
        };
        set.push((key.to_string(), value.to_string()));
    }
    let body = match body_file {
        Some(path) => {
            let size = std::fs::metadata(path)
                .with_context(|| format!("cannot read --edit-body-file {}", path.display()))?
                .len();
            if size > ladder::model::lot::edit::MAX_EDITED_BODY_BYTES as u64 {
                return Err(parking::ParkingError::Invalid(format!(
                    "--edit-body-file {} is {size} bytes; at most {} are accepted",
                    path.display(),
                    ladder::model::lot::edit::MAX_EDITED_BODY_BYTES
                ))
                .into());
            }
            Some(std::fs::read(path).with_context(|| format!("cannot read --edit-body-file {}", path.display()))?)
        }
        None => None,
    };
    Ok(Some((set, body)))
}

async fn follow(
    service: &Service,
    action: &str,
    token: &str,
    mut request: serde_json::Map<String, Value>,
    progress: &Progress,
) -> anyhow::Result<service::ApiJob> {
    let wait = if progress.is_shown() {
        service::JOB_WAIT_SHOWN
    } else {
        service::JOB_WAIT_QUIET
    };
    request.insert("wait".into(), json!(wait));
    let mut job = service.act(action, token, &Value::Object(request)).await?;
    let link = job.status.clone();
    if !job.done
        && let Some(link) = &link
    {
        eprintln!("ladder: the {action} runs in the service as {}{link}", service.base);
    }
    while !job.done {
        if let Some(selected) = job.selected {
            progress.set_length(selected);
        }
        progress.set_position(job.done_count());
        tokio::time::sleep(service::JOB_POLL).await;
        let link = link
            .as_deref()
            .context("the service answered a running job without its URL")?;
        job = service.job(link).await?;
    }
    progress.finish();
    match job.error.take() {
        Some(error) => Err(anyhow::anyhow!("the {action} failed in the service: {error}")),
        None => Ok(job),
    }
}

fn print_page(page: &parking::Page, all: bool, json: bool, stream: &str) -> anyhow::Result<ExitCode> {
    if json {
        println!("{}", text::pretty_json(page)?);
    } else {
        print!("{}", text::render_table(&page.entries));
        println!(
            "{} of {} {} in {stream}",
            page.entries.len(),
            page.total,
            if all { "entries" } else { "unresolved entries" },
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn print_counts(
    counts: &ladder::model::lot::index::Counts,
    all: bool,
    json: bool,
    stream: &str,
) -> anyhow::Result<ExitCode> {
    if json {
        println!("{}", text::pretty_json(counts)?);
    } else {
        print!("{}", text::render_counts(counts));
        println!(
            "{} {} in {stream}",
            counts.total,
            if all { "entries" } else { "unresolved entries" },
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn print_entry(entry: &ParkedEntry, json: bool, stream: &str) -> anyhow::Result<ExitCode> {
    if json {
        println!("{}", text::pretty_json(entry)?);
    } else {
        print!("{}", text::render_entry(stream, entry));
    }
    Ok(ExitCode::SUCCESS)
}

/// The exit of a discard that was not confirmed.
fn declined(answer: Answer) -> ExitCode {
    match answer {
        Answer::NotATerminal(entries) => {
            eprintln!("ladder: refusing to discard {entries} entries without --yes (stdin is not a terminal)");
            ExitCode::from(exit::CONFIG)
        }
        Answer::Yes | Answer::No => {
            println!("nothing discarded");
            ExitCode::SUCCESS
        }
    }
}

/// What the operator said when asked to confirm a discard.
enum Answer {
    Yes,
    No,
    /// Nobody can be asked: stdin is not a terminal (the number of entries it would discard).
    NotATerminal(usize),
}

/// Shows `entries` and asks whether to discard them (only on a terminal); `more` match beyond
/// them and are left for another run.
fn ask_before_discarding(entries: &[ParkedEntry], more: usize) -> Result<Answer, parking::ParkingError> {
    if !std::io::stdin().is_terminal() {
        return Ok(Answer::NotATerminal(entries.len() + more));
    }
    let unreadable = |e: std::io::Error| parking::ParkingError::Invalid(format!("cannot read the answer: {e}"));
    print!("{}", text::render_table(entries));
    if more > 0 {
        println!("({more} more match; they are left for another run)");
    }
    print!("discard these {} entries? [y/N] ", entries.len());
    std::io::Write::flush(&mut std::io::stdout()).map_err(unreadable)?;
    let mut answer = String::new();
    std::io::stdin().read_line(&mut answer).map_err(unreadable)?;
    Ok(if matches!(answer.trim(), "y" | "Y" | "yes") {
        Answer::Yes
    } else {
        Answer::No
    })
}

/// Prints the outcomes of a replay or discard; exit 1 ([`exit::FAILED`]) if any entry failed.
fn report(outcomes: &[parking::Outcome], left_over: u64, json: bool) -> anyhow::Result<ExitCode> {
    let failed = outcomes
        .iter()
        .filter(|o| matches!(o.status, parking::Status::Failed { .. }))
        .count();
    if json {
        let out = serde_json::json!({ "outcomes": outcomes, "failed": failed, "left_over": left_over });
        println!("{}", text::pretty_json(&out)?);
    } else {
        for o in outcomes {
            // a queue named by the record, and errors that quote it: shown inert
            let to = text::printable(o.to.as_deref().unwrap_or("-"));
            match &o.status {
                parking::Status::Replayed => println!("{}\treplayed to {to}", o.offset),
                parking::Status::WouldReplay => println!("{}\twould replay to {to}", o.offset),
                parking::Status::Discarded => println!("{}\tdiscarded", o.offset),
                parking::Status::Failed { error } => println!("{}\tfailed: {}", o.offset, text::printable(error)),
            }
        }
        println!("{} entries, {failed} failed", outcomes.len());
        if left_over > 0 {
            println!("{left_over} more match; run again to continue");
        }
    }
    Ok(if failed > 0 {
        ExitCode::from(exit::FAILED)
    } else {
        ExitCode::SUCCESS
    })
}
