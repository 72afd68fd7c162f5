//! What one poll of the depth poller ([`crate::admin::poller`]) saw: the [`Snapshot`] it
//! publishes for `/api/ladders`, the web page and the in-memory history
//! ([`crate::admin::history`]), which reads snapshots without depending on the poller.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::metrics::LATENESS_BUCKETS;
use crate::model::accounting::Counters;

/// Per bucket of `ladder_lateness_seconds`, observations (not cumulative), `+Inf` last.
pub type LatenessCounts = [u64; LATENESS_BUCKETS + 1];

/// What one poll saw, for `/api/ladders`.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// When the poll ended (for rates).
    pub at: Instant,
    /// When the poll ended, ms since the epoch.
    pub at_ms: u64,
    /// Why the depths could not be read, when they could not.
    pub broker_error: Option<String>,
    /// One entry per ladder, in config order.
    pub ladders: Vec<LadderSnapshot>,
}

impl Snapshot {
    /// The entry of ladder `name`.
    pub fn ladder(&self, name: &str) -> Option<&LadderSnapshot> {
        self.ladders.iter().find(|l| l.name == name)
    }
}

/// One ladder in a [`Snapshot`].
#[derive(Debug, Clone)]
pub struct LadderSnapshot {
    /// The ladder's name.
    pub name: String,
    /// `(role, message count)` per queue, roles as in [`Names::queues`]; `None` when this poll
    /// could not read the broker. A count is `None` when the queue does not exist.
    ///
    /// [`Names::queues`]: crate::model::names::Names::queues
    pub depths: Option<Vec<(String, Option<u64>)>>,
    /// The service's counters after the poll.
    pub counters: Counters,
    /// Per-second rates since the previous poll; `None` on the first poll.
    pub rates: Option<Rates>,
    /// The accounting check's state after this poll.
    pub accounting: AccountingStatus,
    /// Per tier: when the next message this process put into it leaves, and how many it put in
    /// that have not left ([`LadderMetrics::next_leaves`](crate::metrics::LadderMetrics::next_leaves)).
    pub next_leaves: Vec<(String, Option<(u64, u64)>)>,
    /// Per bucket of `ladder_lateness_seconds`, this process's observations so far (not
    /// cumulative, `+Inf` last), for the history's lateness per minute.
    pub lateness: LatenessCounts,
}

/// Per-second rates of a ladder's counters between two polls.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Rates {
    /// Deliveries taken from the intake queue per second (redeliveries included).
    pub received: f64,
    /// Retries confirmed into a tier per second.
    pub scheduled: f64,
    /// Retries confirmed to their destination per second.
    pub delivered: f64,
    /// Messages parked per second.
    pub parked: f64,
    /// The window the rates were measured over, in ms.
    pub window_ms: u64,
}

impl Rates {
    /// The rates from `from` to `to` over `window`; `None` for an empty window.
    pub fn between(from: &Counters, to: &Counters, window: Duration) -> Option<Rates> {
        let seconds = window.as_secs_f64();
        if seconds <= 0.0 {
            return None;
        }
        let rate = |a: u64, b: u64| b.saturating_sub(a) as f64 / seconds;
        Some(Rates {
            received: rate(from.received_intake, to.received_intake),
            scheduled: rate(from.scheduled, to.scheduled),
            delivered: rate(from.delivered, to.delivered),
            parked: rate(from.parked, to.parked),
            window_ms: window.as_millis() as u64,
        })
    }
}

/// The accounting check of one ladder, as `/api/ladders` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct AccountingStatus {
    /// The latest poll's verdict: `unchecked`, `busy`, `anchored`, `balanced`, `suspect`,
    /// `unaccounted`, `in_doubt` or `rebased`.
    #[schema(schema_with = crate::model::accounting::verdict_schema)]
    pub verdict: &'static str,
    /// Whether a reference balance is set (the check is running).
    pub anchored: bool,
    /// The latest shortfall against the reference on a quiet poll; negative for a surplus.
    pub missing: Option<i64>,
    /// What `ladder_unaccounted_messages` shows.
    pub unaccounted: u64,
    /// What `ladder_in_doubt_messages` shows: missing after a disruption, fate not known yet.
    pub in_doubt: u64,
}
