//! The parking lots as the running service serves them to operators (the HTTP API in
//! [`crate::api`] and the web page in [`crate::web`]): one [`LotIndex`] per ladder kept current
//! by a task that follows the parked stream, and list, show, replay and discard on top of it.
//!
//! It owns its own broker connection, apart from the relay's: a slow listing or a replay at a
//! low rate never holds up a retry. The connection is opened on first use and again after it
//! failed.
//!
//! Replay and discard are serialised twice: within this process by a per-ladder mutex (every
//! request shares one connection, and the broker's exclusive-queue lock belongs to a connection,
//! so it cannot tell two requests of one process apart), and across processes by the
//! [`crate::parking::OperatorLock`]. After taking both, a marker is appended to the stream and
//! the action waits until the index has read it, so a second replica never selects what the
//! first just resolved.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use lapin::Connection;
use tokio::sync::Mutex;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use crate::config::Config;
use crate::ladder::LadderSpec;
use crate::lot_index::{Counts, SharedIndex};
use crate::parking::{
    Filter, Outcome, Page, PageRequest, ParkedEntry, ParkingError, ParkingLot, ReplayOptions, Selection,
};
use crate::service;

/// How long an action waits for the index to reach its marker before it gives up: the
/// follower reads tens of thousands of records a second, so only a stuck broker or an index
/// still being built from millions of entries takes this long.
pub const SYNC_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a waiting action looks at the index's progress.
const SYNC_POLL: Duration = Duration::from_millis(20);

/// The follower's pause after a failure doubles from this …
const FOLLOW_RETRY_MIN: Duration = Duration::from_millis(500);

/// … up to this: short, because a listing lags for as long as the follower waits (after a broker
/// restart, or when the admin server starts before the topology is declared), and one retry
/// costs the broker a channel open.
const FOLLOW_RETRY_MAX: Duration = Duration::from_secs(5);

/// What a replay or a discard did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ActionReport {
    /// One outcome per selected entry, oldest first.
    pub outcomes: Vec<Outcome>,
    /// Matching unresolved entries not acted on (beyond [`crate::parking::MAX_ACTION_BATCH`]).
    pub left_over: u64,
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
    acting: Mutex<()>,
    /// The stream's last offset when the follower first started (`Some(None)`: it was empty);
    /// `None` until known.
    started_at_end: std::sync::Mutex<Option<Option<u64>>>,
}

/// The operator side of every ladder's parking lot in this process.
pub struct Desk {
    config: Arc<Config>,
    lots: HashMap<String, Lot>,
    connection: Mutex<Option<Arc<Connection>>>,
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
                    acting: Mutex::new(()),
                    started_at_end: std::sync::Mutex::new(None),
                };
                (spec.name.clone(), lot)
            })
            .collect();
        Desk {
            config,
            lots,
            connection: Mutex::new(None),
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
        let mut pause = FOLLOW_RETRY_MIN;
        while !stop.is_cancelled() {
            let result = match self.connection().await {
                Ok(connection) => {
                    let parking = ParkingLot::new(&connection, &self.config.namespace, &lot.spec);
                    self.note_end(lot, &parking).await;
                    parking.follow(&lot.index, stop).await
                }
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => return,
                Err(e) => {
                    warn!(error = %e, retry_in = ?pause, "cannot follow the parking lot; the listing may lag");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(FOLLOW_RETRY_MAX);
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
        let mut slot = self.connection.lock().await;
        if let Some(connection) = slot.as_ref()
            && connection.status().connected()
        {
            return Ok(connection.clone());
        }
        // named apart from the relay's in the management UI; full-size frames, since a replay
        // republishes headers of up to `max_header_bytes` and headers must fit one frame
        let amqp = crate::config::AmqpConfig {
            connection_name: format!("{}-operator", self.config.amqp.connection_name),
            ..self.config.amqp.clone()
        };
        let connect = service::connect(&amqp);
        let connection = match tokio::time::timeout(crate::parking::BROKER_TIMEOUT, connect).await {
            Ok(result) => Arc::new(result?),
            Err(_) => {
                return Err(ParkingError::Timeout {
                    during: "connecting",
                    timeout: crate::parking::BROKER_TIMEOUT,
                });
            }
        };
        *slot = Some(connection.clone());
        Ok(connection)
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
        Ok(crate::topology::Names::new(&self.config.namespace, &lot.spec.name).parked)
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
    pub async fn list(
        &self,
        ladder: &str,
        filter: &Filter,
        page: PageRequest,
        include_resolved: bool,
    ) -> Result<Page, ParkingError> {
        let lot = self.lot(ladder)?;
        let connection = self.connection().await?;
        ParkingLot::new(&connection, &self.config.namespace, &lot.spec)
            .list(&lot.index, filter, page, include_resolved)
            .await
    }

    /// `ladder`'s parked entries matching `filter`, counted in all, per destination and per
    /// reason.
    pub async fn counts(&self, ladder: &str, filter: &Filter, include_resolved: bool) -> Result<Counts, ParkingError> {
        let lot = self.lot(ladder)?;
        if !filter.needs_records() {
            // from memory: no connection needed
            return Ok(lot.index.read().counts(filter, include_resolved));
        }
        let connection = self.connection().await?;
        ParkingLot::new(&connection, &self.config.namespace, &lot.spec)
            .counts(&lot.index, filter, include_resolved)
            .await
    }

    /// One entry of `ladder`'s parking lot.
    pub async fn show(&self, ladder: &str, offset: u64) -> Result<ParkedEntry, ParkingError> {
        let lot = self.lot(ladder)?;
        let connection = self.connection().await?;
        ParkingLot::new(&connection, &self.config.namespace, &lot.spec)
            .show(&lot.index, offset)
            .await
    }

    /// Replays the unresolved entries of `ladder` matching `filter` (see
    /// [`ParkingLot::replay`]), at most one replay or discard per ladder at a time across every
    /// replica; `options.by` is logged and recorded.
    pub async fn replay(
        &self,
        ladder: &str,
        filter: &Filter,
        options: &ReplayOptions,
    ) -> Result<ActionReport, ParkingError> {
        self.act(
            ladder,
            filter,
            &options.by,
            "replay",
            async |lot, parking, selection| {
                info!(ladder, by = %options.by, entries = selection.entries.len(), dry_run = options.dry_run,
                  to = ?options.to, "replay requested over HTTP");
                parking.replay(&lot.index, &selection.entries, options).await
            },
        )
        .await
    }

    /// Discards the unresolved entries of `ladder` matching `filter`; `by` is logged and recorded.
    pub async fn discard(&self, ladder: &str, filter: &Filter, by: &str) -> Result<ActionReport, ParkingError> {
        self.act(ladder, filter, by, "discard", async |lot, parking, selection| {
            info!(
                ladder,
                by,
                entries = selection.entries.len(),
                "discard requested over HTTP"
            );
            parking.discard(&lot.index, &selection.entries, by).await
        })
        .await
    }

    /// Takes both locks, catches the index up, selects, runs `action`, releases.
    async fn act(
        &self,
        ladder: &str,
        filter: &Filter,
        by: &str,
        what: &'static str,
        action: impl AsyncFnOnce(&Lot, &ParkingLot<'_>, &Selection) -> Result<Vec<Outcome>, ParkingError>,
    ) -> Result<ActionReport, ParkingError> {
        if filter.is_empty() {
            return Err(ParkingError::Invalid(format!(
                "a {what} needs offsets or at least one filter"
            )));
        }
        let lot = self.lot(ladder)?;
        let Ok(_acting) = lot.acting.try_lock() else {
            warn!(
                ladder,
                by, "{what} refused: another replay or discard of this ladder runs here"
            );
            return Err(ParkingError::Busy(ladder.to_string()));
        };
        let connection = self.connection().await?;
        let parking = ParkingLot::new(&connection, &self.config.namespace, &lot.spec);
        let lock = parking.lock().await.inspect_err(|e| {
            warn!(ladder, by, error = %e, "{what} refused");
        })?;
        let result = async {
            self.catch_up(lot, &parking, by).await?;
            let selection = parking.select(&lot.index, filter).await?;
            let outcomes = action(lot, &parking, &selection).await?;
            Ok(ActionReport {
                outcomes,
                left_over: selection.left_over,
            })
        }
        .await;
        lock.release().await;
        result
    }

    /// Appends a marker and waits until the follower has applied it: then the index holds every
    /// record written before it, every resolution of an earlier action included.
    async fn catch_up(&self, lot: &Lot, parking: &ParkingLot<'_>, by: &str) -> Result<(), ParkingError> {
        let marker = parking.mark(by).await?;
        let reached = async {
            while !lot.index.read().has_marker(&marker) {
                tokio::time::sleep(SYNC_POLL).await;
            }
        };
        tokio::time::timeout(SYNC_TIMEOUT, reached)
            .await
            .map_err(|_| ParkingError::Timeout {
                during: "bringing the parking-lot index up to the stream's end",
                timeout: SYNC_TIMEOUT,
            })
    }
}
