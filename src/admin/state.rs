//! What the admin server's handlers share ([`AdminState`]) and the `/api/ladders` view of
//! every ladder, which the API serves as JSON and the web page renders.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Serialize;
use tokio::sync::watch;

use crate::admin::desk::Desk;
use crate::admin::history::{History, SharedHistory};
use crate::admin::poller::{AccountingStatus, Rates, Snapshot};
use crate::broker::state::State;
use crate::config::Config;
use crate::model::accounting::Counters;
use crate::model::ladder::{DeadLetterStrategy, QueueType, Unidentified};
use crate::model::names::Names;

/// What the admin endpoints read.
#[derive(Debug)]
pub struct AdminState {
    /// Readiness and metrics, shared with the service.
    pub service: Arc<State>,
    /// The configuration the service runs with.
    pub config: Arc<Config>,
    /// The poller's latest snapshot; `None` until its first poll.
    pub snapshots: watch::Receiver<Option<Arc<Snapshot>>>,
    /// The parking lots.
    pub desk: Arc<Desk>,
    /// The last hour per ladder, written by the poller, drawn by the overview.
    pub history: SharedHistory,
}

impl AdminState {
    /// The state for `config` and `service`, reading snapshots from `snapshots`.
    pub fn new(config: Arc<Config>, service: Arc<State>, snapshots: watch::Receiver<Option<Arc<Snapshot>>>) -> Self {
        AdminState {
            service,
            desk: Arc::new(Desk::new(config.clone())),
            history: Arc::new(std::sync::Mutex::new(History::new(&config.ladders))),
            config,
            snapshots,
        }
    }
}

/// `/api/ladders` (and the web page's overview).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct LaddersView {
    pub(crate) namespace: String,
    pub(crate) poll_interval_ms: u64,
    /// When the latest poll ended (ms since the epoch); `null` before the first.
    pub(crate) polled_at_ms: Option<u64>,
    /// Why the latest poll could not read the broker.
    pub(crate) broker_error: Option<String>,
    pub(crate) ladders: Vec<LadderView>,
    /// What the namespace declared before and the config no longer uses, and what the broker
    /// holds with other arguments; `null` until the service looked (after it declared).
    pub(crate) drift: Option<DriftView>,
}

/// The namespace's drift, as the service saw it after declaring and the admin side refreshes it.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct DriftView {
    /// When its counts were read (ms since the epoch).
    pub(crate) read_at_ms: u64,
    /// Retired tiers and ladders' objects that still exist, with their messages.
    pub(crate) retired: Vec<crate::model::drift::Retired>,
    /// Objects the broker holds with other arguments than the config's.
    pub(crate) differing: Vec<crate::broker::drift::Difference>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct LadderView {
    pub(crate) name: String,
    pub(crate) exchange: String,
    pub(crate) tiers: Vec<TierView>,
    pub(crate) max_attempts: u32,
    pub(crate) allow: Vec<String>,
    /// `quorum` or `classic`.
    #[schema(schema_with = queue_types)]
    pub(crate) queue_type: &'static str,
    /// `at-least-once` or `at-most-once`.
    #[schema(schema_with = dead_letter_strategies)]
    pub(crate) dead_letter_strategy: &'static str,
    /// Each sender (a broker user name) and the destination patterns it may target; absent for
    /// a ladder that does not list its senders.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) senders: Option<BTreeMap<String, Vec<String>>>,
    /// What a message from no listed sender may do (`reject`, `dead-letter`); absent with
    /// `senders`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(schema_with = unidentified)]
    pub(crate) unidentified: Option<&'static str>,
    /// Queue name per role (`intake`, `due`, `parked`, `delay.<tier>`).
    pub(crate) queues: BTreeMap<String, String>,
    /// Message count per role from the latest poll (`null` for a missing queue); `null` before
    /// the first poll or when it could not read the broker.
    pub(crate) depths: Option<BTreeMap<String, Option<u64>>>,
    /// Per-second rates between the two latest polls.
    pub(crate) rates: Option<Rates>,
    /// This process's counters at the latest poll.
    pub(crate) totals: Option<Counters>,
    pub(crate) accounting: Option<AccountingStatus>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub(crate) struct TierView {
    pub(crate) name: String,
    pub(crate) delay_ms: u64,
    pub(crate) queue: String,
    /// A backoff step (else a delay level, used by exact delays only).
    pub(crate) step: bool,
    /// When the next message this process put into the tier leaves it (ms since the epoch, to
    /// a 1024th of the tier), at the latest poll; `None` when none it knows of waits. Other
    /// replicas' messages, and those from before a restart, are not counted.
    pub(crate) next_leave_at_ms: Option<u64>,
    /// How many this process put into the tier that have not left yet, by the same estimate.
    pub(crate) put_in_waiting: Option<u64>,
    /// The other ladders of the config whose messages wait in the same queue (tier queues are
    /// the namespace's): its depth is theirs too. Absent when none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) shared_with: Vec<String>,
}

fn queue_types() -> utoipa::openapi::Object {
    crate::model::words_schema([QueueType::Quorum, QueueType::Classic].map(QueueType::as_str))
}

fn dead_letter_strategies() -> utoipa::openapi::Object {
    let all = [DeadLetterStrategy::AtLeastOnce, DeadLetterStrategy::AtMostOnce];
    crate::model::words_schema(all.map(DeadLetterStrategy::as_str))
}

fn unidentified() -> utoipa::openapi::Object {
    crate::model::words_schema([Unidentified::Reject, Unidentified::DeadLetter].map(Unidentified::as_str))
}

impl LaddersView {
    pub(crate) fn new(config: &Config, snapshot: Option<&Snapshot>) -> Self {
        let ladders = config
            .ladders
            .iter()
            .map(|spec| {
                let names = Names::of(&config.namespace, spec);
                let polled = snapshot.and_then(|s| s.ladder(&spec.name));
                LadderView {
                    name: spec.name.clone(),
                    exchange: names.exchange.clone(),
                    tiers: spec
                        .tiers
                        .iter()
                        .map(|tier| {
                            let leaving = polled
                                .and_then(|l| l.next_leaves.iter().find(|(name, _)| *name == tier.name))
                                .and_then(|(_, next)| *next);
                            TierView {
                                name: tier.name.clone(),
                                delay_ms: tier.ttl_ms(),
                                queue: names.tier_queue(tier),
                                step: spec.steps.contains(tier),
                                next_leave_at_ms: leaving.map(|(at, _)| at),
                                put_in_waiting: leaving.map(|(_, n)| n),
                                shared_with: config
                                    .ladders
                                    .iter()
                                    .filter(|other| other.name != spec.name)
                                    .filter(|other| {
                                        let theirs = Names::of(&config.namespace, other);
                                        other
                                            .tiers
                                            .iter()
                                            .any(|o| theirs.tier_queue(o) == names.tier_queue(tier))
                                    })
                                    .map(|other| other.name.clone())
                                    .collect(),
                            }
                        })
                        .collect(),
                    max_attempts: spec.max_attempts,
                    allow: spec.allow.patterns().to_vec(),
                    queue_type: spec.queue_type.as_str(),
                    dead_letter_strategy: spec.dead_letter_strategy.as_str(),
                    senders: spec.senders.as_ref().map(|s| {
                        s.grants
                            .iter()
                            .map(|(user, allowed)| (user.clone(), allowed.patterns().to_vec()))
                            .collect()
                    }),
                    unidentified: spec.senders.as_ref().map(|s| s.unidentified.as_str()),
                    queues: names.queues(spec).into_iter().collect(),
                    depths: polled
                        .and_then(|l| l.depths.as_ref())
                        .map(|d| d.iter().cloned().collect()),
                    rates: polled.and_then(|l| l.rates),
                    totals: polled.map(|l| l.counters),
                    accounting: polled.map(|l| l.accounting),
                }
            })
            .collect();
        LaddersView {
            namespace: config.namespace.clone(),
            poll_interval_ms: config.admin.poll_interval.as_millis() as u64,
            polled_at_ms: snapshot.map(|s| s.at_ms),
            broker_error: snapshot.and_then(|s| s.broker_error.clone()),
            ladders,
            drift: None,
        }
    }

    /// With the drift the service saw (`service.drift`).
    pub(crate) fn with_drift(mut self, service: &State) -> Self {
        let seen = service
            .drift
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        self.drift = seen.map(|seen| DriftView {
            read_at_ms: seen.at_ms,
            retired: seen.survey.retired.clone(),
            differing: seen.survey.differing.clone(),
        });
        self
    }
}
