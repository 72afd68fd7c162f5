//! The parking lots as the running service serves them to operators, through the HTTP API
//! ([`crate::admin::api`]) and the web page ([`crate::admin::web`]). It keeps one [`LotIndex`]
//! per ladder current by following the parked stream, and lists, shows, replays and discards.
//!
//! It owns its own broker connection, apart from the relay's: a slow listing or a replay at a
//! low rate never holds up a retry. The connection is opened on first use and again after it
//! failed.
//!
//! Replay and discard are serialised twice: within this process by a per-ladder mutex, as every
//! request shares one connection and the broker's lock belongs to a connection; and across
//! processes by the [`crate::broker::lot::OperatorLock`]. After taking both, a marker is appended to the stream and
//! the action waits until the index has read it, so a second replica never selects what the
//! first just resolved.
//!
//! [`LotIndex`]: crate::model::lot::index::LotIndex

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use ladder_amqp::Connection;
use tokio::sync::Mutex;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use crate::broker::connect as service;
use crate::broker::holds::HoldError;
use crate::broker::lot::{ActIndex, ErrorKind, Outcome, Page, PageRequest, ParkingError, ParkingLot, ReplayOptions};
use crate::config::Config;
use crate::model::cancels::Cancellation;
use crate::model::holds::{HoldRecord, HoldState, Holds};
use crate::model::ladder::LadderSpec;
use crate::model::lot::filter::Filter;
use crate::model::lot::index::{Counts, SharedIndex};
use crate::model::lot::pace::Rate;
use crate::model::lot::record::ParkedEntry;

/// How long an action waits for the index to reach its marker before it gives up. The follower
/// reads tens of thousands of records a second, so only a stuck broker or an index still being
/// built from millions of entries takes this long.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(60);

/// The follower's pause after a failure doubles from this …
const FOLLOW_RETRY_MIN: Duration = Duration::from_millis(500);

/// … up to this: short, because a listing lags for as long as the follower waits (after a broker
/// restart, or when the admin server starts before the topology is declared), and one retry
/// costs the broker a channel open.
const FOLLOW_RETRY_MAX: Duration = Duration::from_secs(5);

/// Finished jobs are kept for their progress pages up to this many (all ladders together).
pub const JOBS_KEPT: usize = 64;

/// A replay or a discard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum JobKind {
    /// Republish the selected entries.
    Replay,
    /// Mark the selected entries handled.
    Discard,
}

impl std::fmt::Display for JobKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            JobKind::Replay => "replay",
            JobKind::Discard => "discard",
        })
    }
}

/// A replay or discard the desk runs in the background: it runs to its end whether or not the
/// request that started it is still there, and holds the ladder's operator lock only while it
/// runs.
#[derive(Debug)]
pub struct Job {
    /// Unique in this process.
    pub id: u64,
    /// Its ladder.
    pub ladder: String,
    state: tokio::sync::watch::Sender<JobView>,
}

/// Where a job is: what it selected, each entry's outcome so far, how it ended.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct JobView {
    /// The job's id.
    pub id: u64,
    /// Its ladder.
    pub ladder: String,
    /// Replay or discard.
    pub kind: JobKind,
    /// Who asked.
    pub by: String,
    /// When it started, ms since the epoch.
    pub started_at_ms: u64,
    /// Entries selected (`null` until it has selected).
    pub selected: Option<usize>,
    /// One outcome per entry done so far, oldest first.
    pub outcomes: Vec<Outcome>,
    /// Matching unresolved entries not acted on (beyond [`crate::broker::lot::MAX_ACTION_BATCH`]).
    pub left_over: u64,
    /// It has ended (every entry done, or it failed).
    pub done: bool,
    /// Why it failed as a whole, if it did.
    pub error: Option<String>,
    /// What kind of failure that was (for the HTTP status of a request that waited for it).
    #[serde(skip)]
    pub failure: Option<ErrorKind>,
}

impl Job {
    fn new(id: u64, ladder: &str, kind: JobKind, by: &str) -> Self {
        let (state, _) = tokio::sync::watch::channel(JobView {
            id,
            ladder: ladder.to_string(),
            kind,
            by: by.to_string(),
            started_at_ms: crate::clock::now_ms(),
            selected: None,
            outcomes: Vec::new(),
            left_over: 0,
            done: false,
            error: None,
            failure: None,
        });
        Job {
            id,
            ladder: ladder.to_string(),
            state,
        }
    }

    fn selected(&self, entries: usize, left_over: u64) {
        self.state.send_modify(|v| {
            v.selected = Some(entries);
            v.left_over = left_over;
        });
    }

    fn outcome(&self, outcome: &Outcome) {
        self.state.send_modify(|v| v.outcomes.push(outcome.clone()));
    }

    fn finish(&self, error: Option<ParkingError>) {
        self.state.send_modify(|v| {
            v.done = true;
            v.failure = error.as_ref().map(ParkingError::kind);
            v.error = error.map(|e| e.to_string());
        });
    }

    /// Where it is now.
    pub fn view(&self) -> JobView {
        self.state.borrow().clone()
    }
}

/// Opens the desk's connection if it is not open (the slot is shared with running jobs).
async fn open(slot: &Mutex<Option<Arc<Connection>>>, config: &Config) -> Result<Arc<Connection>, ParkingError> {
    let mut slot = slot.lock().await;
    if let Some(connection) = slot.as_ref()
        && connection.is_open()
    {
        return Ok(connection.clone());
    }
    // named apart from the relay's in the management UI
    let name = format!("{}-operator", config.amqp.connection_name);
    let connect = service::connect_named(&config.amqp, &name);
    let connection = match tokio::time::timeout(crate::broker::lot::BROKER_TIMEOUT, connect).await {
        Ok(result) => Arc::new(result?),
        Err(_) => {
            return Err(ParkingError::Timeout {
                during: "connecting",
                timeout: crate::broker::lot::BROKER_TIMEOUT,
            });
        }
    };
    *slot = Some(connection.clone());
    Ok(connection)
}

/// The state of one ladder's index, for an overview.
#[derive(Debug, Clone, serde::Serialize)]
pub struct IndexStatus {
    /// Entries indexed (resolved or not).
    pub entries: usize,
    /// The next stream offset the follower will read; `null` before the first record.
    pub next_offset: Option<u64>,
    /// Whether the index has read the stream up to where it ended when the follower started:
    /// until then, counts are partial (a new replica is still reading).
    pub caught_up: bool,
    /// Unresolved entries by destination and reason.
    pub unresolved: Counts,
}

struct Lot {
    spec: LadderSpec,
    index: SharedIndex,
    acting: Arc<Mutex<()>>,
    /// The stream's last offset when the follower first started (`Some(None)`: it was empty);
    /// `None` until known.
    started_at_end: std::sync::Mutex<Option<Option<u64>>>,
}

/// The operator side of every ladder's parking lot in this process.
pub struct Desk {
    config: Arc<Config>,
    lots: HashMap<String, Lot>,
    connection: Arc<Mutex<Option<Arc<Connection>>>>,
    jobs: std::sync::Mutex<std::collections::VecDeque<Arc<Job>>>,
    /// The running jobs' tasks: owned here, aborted with the desk (an aborted job's lock is
    /// released with its connection).
    jobs_running: std::sync::Mutex<JoinSet<()>>,
    job_ids: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Desk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Desk").field("ladders", &self.lots.len()).finish()
    }
}

impl Desk {
    /// A desk for every ladder of `config`; nothing is read until [`Desk::follow`] runs.
    pub fn new(config: Arc<Config>) -> Self {
        let lots = config
            .ladders
            .iter()
            .map(|spec| {
                let lot = Lot {
                    spec: spec.clone(),
                    index: SharedIndex::default(),
                    acting: Arc::new(Mutex::new(())),
                    started_at_end: std::sync::Mutex::new(None),
                };
                (spec.name.clone(), lot)
            })
            .collect();
        Desk {
            config,
            lots,
            connection: Arc::new(Mutex::new(None)),
            jobs: std::sync::Mutex::new(std::collections::VecDeque::new()),
            jobs_running: std::sync::Mutex::new(JoinSet::new()),
            job_ids: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Follows every ladder's parked stream into its index until `stop`, retrying with backoff
    /// when the broker fails.
    pub async fn follow(self: Arc<Self>, stop: CancellationToken) {
        let mut tasks = JoinSet::new();
        for name in self.lots.keys() {
            let desk = self.clone();
            let (name, stop) = (name.clone(), stop.clone());
            let span = info_span!("follow", ladder = %name);
            tasks.spawn(async move { desk.follow_one(&name, &stop).await }.instrument(span));
        }
        while tasks.join_next().await.is_some() {}
    }

    async fn follow_one(&self, name: &str, stop: &CancellationToken) {
        let lot = &self.lots[name];
        let mut backoff = crate::model::backoff::Backoff::new(FOLLOW_RETRY_MIN, FOLLOW_RETRY_MAX);
        while !stop.is_cancelled() {
            let result = match self.connection().await {
                Ok(connection) => {
                    let parking = ParkingLot::new(&connection, &self.config.amqp, &self.config.namespace, &lot.spec);
                    self.note_end(lot, &parking).await;
                    parking.follow(&lot.index, stop).await
                }
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => return,
                Err(e) => {
                    let pause = backoff.next_wait();
                    warn!(error = %e, retry_in = ?pause, "cannot follow the parking lot; the listing may lag");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(pause) => {}
                    }
                }
            }
        }
    }

    /// Records where the stream ended when following began, once, for [`IndexStatus::caught_up`].
    async fn note_end(&self, lot: &Lot, parking: &ParkingLot<'_>) {
        let known = lot
            .started_at_end
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some();
        if !known && let Ok(end) = parking.end().await {
            *lot.started_at_end.lock().unwrap_or_else(PoisonError::into_inner) = Some(end);
        }
    }

    /// The desk's connection, opened (again) if it is not open.
    async fn connection(&self) -> Result<Arc<Connection>, ParkingError> {
        open(&self.connection, &self.config).await
    }

    fn lot(&self, ladder: &str) -> Result<&Lot, ParkingError> {
        self.lots
            .get(ladder)
            .ok_or_else(|| ParkingError::UnknownLadder(ladder.to_string()))
    }

    /// The ladders, in config order.
    pub fn ladders(&self) -> impl Iterator<Item = &LadderSpec> {
        self.config.ladders.iter()
    }

    /// The stream of `ladder`.
    pub fn stream(&self, ladder: &str) -> Result<String, ParkingError> {
        let lot = self.lot(ladder)?;
        Ok(crate::model::names::Names::of(&self.config.namespace, &lot.spec).parked)
    }

    /// Cancels the scheduled delivery (or retry) with `message_id` in `ladder`, for every replica:
    /// the record is in the ladder's cancellation stream once this returns.
    pub async fn cancel(&self, ladder: &str, message_id: &str, by: &str) -> Result<Cancellation, ParkingError> {
        let lot = self.lot(ladder)?;
        if !lot.spec.exact_delays {
            return Err(ParkingError::Invalid(format!(
                "ladder {ladder} has exact_delays = false: it schedules nothing to cancel"
            )));
        }
        let names = crate::model::names::Names::of(&self.config.namespace, &lot.spec);
        let connection = self.connection().await?;
        Ok(crate::broker::cancels::cancel(&connection, &names, message_id, by).await?)
    }

    /// Holds `destination` in `ladder` for every replica (checked: allowed, exists); the record
    /// is in the ladder's hold stream once this returns.
    pub async fn hold(&self, ladder: &str, destination: &str, by: &str, why: &str) -> Result<HoldRecord, HoldError> {
        let (spec, names) = self.spec_names(ladder)?;
        let connection = self.connection().await.map_err(|e| HoldError::Declare(e.to_string()))?;
        crate::broker::holds::hold(&connection, &names, &spec, destination, by, why).await
    }

    /// Resumes `destination` in `ladder` (refused unless the stream says it is held): released
    /// at `rate`, the ladder's `release_rate` if `None`.
    pub async fn resume(
        &self,
        ladder: &str,
        destination: &str,
        by: &str,
        rate: Option<Rate>,
    ) -> Result<HoldRecord, HoldError> {
        let (spec, names) = self.spec_names(ladder)?;
        let connection = self.connection().await.map_err(|e| HoldError::Declare(e.to_string()))?;
        let holds = crate::broker::holds::snapshot(&connection, &names, &spec).await?;
        if !holds.get(destination).is_some_and(|h| h.state == HoldState::Held) {
            return Err(HoldError::NotHeld(destination.into()));
        }
        crate::broker::holds::resume(&connection, &names, &spec, destination, by, rate).await
    }

    /// The holds of `ladder` as its stream says now.
    pub async fn holds(&self, ladder: &str) -> Result<Holds, HoldError> {
        let (spec, names) = self.spec_names(ladder)?;
        let connection = self.connection().await.map_err(|e| HoldError::Declare(e.to_string()))?;
        crate::broker::holds::snapshot(&connection, &names, &spec).await
    }

    /// Messages waiting in the held queue of `destination` in `ladder`, if the broker says.
    pub async fn held_depth(&self, ladder: &str, destination: &str) -> Option<u32> {
        let (_, names) = self.spec_names(ladder).ok()?;
        let connection = self.connection().await.ok()?;
        crate::broker::holds::depth(&connection, &names.held_queue(destination)).await
    }

    fn spec_names(&self, ladder: &str) -> Result<(LadderSpec, crate::model::names::Names), HoldError> {
        let lot = self.lot(ladder).map_err(|e| HoldError::UnknownLadder(e.to_string()))?;
        Ok((
            lot.spec.clone(),
            crate::model::names::Names::of(&self.config.namespace, &lot.spec),
        ))
    }

    /// How far `ladder`'s index is, and what it holds.
    pub fn status(&self, ladder: &str) -> Result<IndexStatus, ParkingError> {
        let lot = self.lot(ladder)?;
        let started_at_end = *lot.started_at_end.lock().unwrap_or_else(PoisonError::into_inner);
        let index = lot.index.read();
        let caught_up = match started_at_end {
            None => false,
            Some(None) => true,
            Some(Some(end)) => index.next_offset().is_some_and(|next| next > end),
        };
        Ok(IndexStatus {
            entries: index.len(),
            next_offset: index.next_offset(),
            caught_up,
            unresolved: index.unresolved_counts(),
        })
    }

    /// A page of `ladder`'s parked entries matching `filter`, newest first.
    pub async fn list(&self, ladder: &str, filter: &Filter, page: PageRequest) -> Result<Page, ParkingError> {
        let lot = self.lot(ladder)?;
        let connection = self.connection().await?;
        ParkingLot::new(&connection, &self.config.amqp, &self.config.namespace, &lot.spec)
            .list(&lot.index, filter, page)
            .await
    }

    /// `ladder`'s parked entries matching `filter`, counted in all, per destination and per
    /// reason.
    pub async fn counts(&self, ladder: &str, filter: &Filter) -> Result<Counts, ParkingError> {
        let lot = self.lot(ladder)?;
        if !filter.needs_records() {
            // from memory: no connection needed
            return Ok(lot.index.read().counts(filter));
        }
        let connection = self.connection().await?;
        ParkingLot::new(&connection, &self.config.amqp, &self.config.namespace, &lot.spec)
            .counts(&lot.index, filter)
            .await
    }

    /// One entry of `ladder`'s parking lot.
    pub async fn show(&self, ladder: &str, offset: u64) -> Result<ParkedEntry, ParkingError> {
        let lot = self.lot(ladder)?;
        let connection = self.connection().await?;
        ParkingLot::new(&connection, &self.config.amqp, &self.config.namespace, &lot.spec)
            .show(&lot.index, offset)
            .await
    }

    /// Starts replaying the unresolved entries of `ladder` matching `filter` as a job (see
    /// [`ParkingLot::replay`]); `options.by` is logged and recorded. At most one replay or
    /// discard per ladder runs at a time across every replica. The job runs to its end whether
    /// or not anyone waits for it ([`Desk::wait`]).
    pub fn replay(&self, ladder: &str, filter: Filter, options: ReplayOptions) -> Result<Arc<Job>, ParkingError> {
        let by = options.by.clone();
        self.start(
            ladder,
            JobKind::Replay,
            filter,
            by,
            move |parking, index, entries, on_outcome| {
                Box::pin(async move { parking.replay_with(index, entries, &options, on_outcome).await })
            },
        )
    }

    /// Starts discarding the unresolved entries of `ladder` matching `filter` as a job; `by`
    /// is logged and recorded.
    pub fn discard(&self, ladder: &str, filter: Filter, by: String) -> Result<Arc<Job>, ParkingError> {
        let who = by.clone();
        self.start(
            ladder,
            JobKind::Discard,
            filter,
            by,
            move |parking, index, entries, on_outcome| {
                Box::pin(async move { parking.discard_with(index, entries, &who, on_outcome).await })
            },
        )
    }

    fn start(
        &self,
        ladder: &str,
        kind: JobKind,
        filter: Filter,
        by: String,
        action: impl for<'p> FnOnce(
            &'p ParkingLot<'p>,
            &'p SharedIndex,
            &'p [ParkedEntry],
            &'p mut (dyn FnMut(&Outcome) + Send),
        ) -> std::pin::Pin<
            Box<dyn Future<Output = Result<Vec<Outcome>, ParkingError>> + Send + 'p>,
        > + Send
        + 'static,
    ) -> Result<Arc<Job>, ParkingError> {
        if filter.is_empty() {
            return Err(ParkingError::Invalid(format!(
                "a {kind} needs offsets or at least one filter"
            )));
        }
        let lot = self.lot(ladder)?;
        // one action per ladder in this process: the broker's lock cannot tell two requests
        // on this desk's connections apart from one
        let Ok(acting) = lot.acting.clone().try_lock_owned() else {
            warn!(ladder, by = %by, "{kind} refused: another replay or discard of this ladder runs here");
            return Err(ParkingError::Busy(ladder.to_string()));
        };
        let job = Arc::new(Job::new(self.next_job(), ladder, kind, &by));
        self.remember(job.clone());
        let (config, spec, index) = (self.config.clone(), lot.spec.clone(), lot.index.clone());
        let connection = self.connection.clone();
        let running = job.clone();
        let span = info_span!("job", ladder = %spec.name, id = job.id, %kind);
        let task = async move {
            let _acting = acting;
            let result = async {
                let connection = open(&connection, &config).await?;
                let parking = ParkingLot::new(&connection, &config.amqp, &config.namespace, &spec);
                let source = ActIndex::Followed {
                    index: &index,
                    within: SYNC_TIMEOUT,
                };
                parking
                    .act(&filter, &by, source, async |index, selection| {
                        info!(ladder = %spec.name, by = %by, entries = selection.entries.len(), "{kind} requested over HTTP");
                        running.selected(selection.entries.len(), selection.left_over);
                        let mut on_outcome = |o: &Outcome| running.outcome(o);
                        action(&parking, index, &selection.entries, &mut on_outcome).await
                    })
                    .await
            }
            .await;
            if let Err(e) = &result {
                warn!(error = %e, "{kind} failed");
            }
            running.finish(result.err());
        };
        self.jobs_running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .spawn(task.instrument(span));
        Ok(job)
    }

    /// Waits at most `within` for `job` to finish, then says where it is.
    pub async fn wait(&self, job: &Job, within: Duration) -> JobView {
        let mut rx = job.state.subscribe();
        let _ = tokio::time::timeout(within, rx.wait_for(|v| v.done)).await;
        rx.borrow().clone()
    }

    /// A job of `ladder` by id: running, or among the last [`JOBS_KEPT`] finished.
    pub fn job(&self, ladder: &str, id: u64) -> Result<JobView, ParkingError> {
        self.lot(ladder)?;
        let jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        jobs.iter()
            .find(|j| j.id == id && j.ladder == ladder)
            .map(|j| j.state.borrow().clone())
            .ok_or_else(|| ParkingError::Missing(format!("no job {id} of ladder {ladder}")))
    }

    /// The jobs of `ladder` this process ran or runs, newest first.
    pub fn jobs(&self, ladder: &str) -> Vec<JobView> {
        let jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        jobs.iter()
            .rev()
            .filter(|j| j.ladder == ladder)
            .map(|j| j.state.borrow().clone())
            .collect()
    }

    fn next_job(&self) -> u64 {
        self.job_ids.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    }

    fn remember(&self, job: Arc<Job>) {
        let mut jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        if jobs.len() >= JOBS_KEPT
            && let Some(at) = jobs.iter().position(|j| j.state.borrow().done)
        {
            jobs.remove(at);
        }
        jobs.push_back(job);
        // reap finished tasks, so the set stays as small as what runs
        let mut running = self.jobs_running.lock().unwrap_or_else(PoisonError::into_inner);
        while running.try_join_next().is_some() {}
    }
}
