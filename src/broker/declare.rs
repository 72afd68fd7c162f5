//! Declaring a namespace's topology: today's layout for a new ladder, the upgrade for one an
//! earlier release declared (`model::upgrade`), then the drift record and its survey.

use std::sync::Arc;
use std::time::Duration;

use ladder_amqp::Connection;
use tracing::{info, warn};

use crate::broker::connect::{close, connect};
use crate::broker::state::{DriftSeen, State};
use crate::broker::topology::{self, Names, TopologyError};
use crate::config::Config;
use crate::model::upgrade;

/// Declares the whole topology of `config` once (what `ladder apply` does), records it in the
/// namespace's topology stream, and logs its drift.
///
/// A declaration the broker fails for a passing reason (a 541 such as a quorum queue's
/// `cluster_not_formed` on a loaded node, or the connection lost mid-way) is tried again on a
/// new connection, for at most [`APPLY_RETRY_FOR`]: declaring is idempotent. A conflict, a
/// refused login or an unreachable broker fail at once.
pub async fn apply(config: &Config) -> Result<(), ApplyError> {
    let deadline = tokio::time::Instant::now() + APPLY_RETRY_FOR;
    let mut pause = Duration::from_millis(500);
    loop {
        let connection = connect(&config.amqp).await?;
        // how each ladder was declared before is read from the topology stream (see `declare`)
        let known = tokio::time::timeout(
            MIGRATED_READ,
            crate::broker::drift::read(&connection, &config.namespace),
        )
        .await
        .ok()
        .and_then(Result::ok);
        let result = declare(&connection, config, known.as_ref(), &|_| {}).await;
        if let Ok(applied) = &result {
            look_at_drift(&connection, config, &State::default(), applied.clone()).await;
        }
        close(&connection).await;
        match result {
            Err(TopologyError::Broker { declaration, source })
                if passing(&source) && tokio::time::Instant::now() + pause < deadline =>
            {
                warn!(%declaration, error = %source, retry_in = ?pause, "declaring failed for a passing reason; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(4));
            }
            result => return result.map(|_| ()).map_err(ApplyError::from),
        }
    }
}

/// How long `apply` keeps trying a declaration the broker failed for a passing reason.
pub const APPLY_RETRY_FOR: Duration = Duration::from_secs(30);

/// True for a declaring error that a new attempt may not meet: the broker's 541
/// INTERNAL_ERROR (a quorum queue whose Raft cluster did not form in time) or a connection lost
/// on the way. Refusals (403, 406, 530 …) are not passing.
fn passing(error: &ladder_amqp::Error) -> bool {
    match error {
        ladder_amqp::Error::ConnectionClosed(reason) | ladder_amqp::Error::ChannelClosed(reason) => reason.code == 541,
        ladder_amqp::Error::Io(_) | ladder_amqp::Error::ConnectionGone | ladder_amqp::Error::HeartbeatTimeout(_) => {
            true
        }
        _ => false,
    }
}

/// How long recording the topology and reading the retired objects may take after declaring.
const DRIFT_TIMEOUT: Duration = Duration::from_secs(20);

/// After declaring: records the plan in the namespace's topology stream, reads what is retired
/// (and what `applied` found: queues kept in an older shape, ladders of a release before the
/// stream), logs it and keeps it in `state`. A failure
/// here is logged and does not stop the service: the relay does not depend on it.
pub(crate) async fn look_at_drift(connection: &Connection, config: &Config, state: &State, applied: Applied) {
    let version = topology::version_of(connection);
    let Applied { older, unrecorded } = applied;
    let looked = tokio::time::timeout(DRIFT_TIMEOUT, async {
        let registry = crate::broker::drift::record(connection, config, version, &unrecorded).await?;
        let retired = crate::broker::drift::retired_now(connection, config, version, &registry).await?;
        Ok::<_, crate::broker::drift::DriftError>((registry, retired))
    })
    .await;
    let (registry, retired) = match looked {
        Ok(Ok(seen)) => seen,
        Ok(Err(e)) => {
            warn!(error = %e, "cannot record the topology or read what is retired; drift is not shown");
            return;
        }
        Err(_) => {
            warn!(timeout = ?DRIFT_TIMEOUT, "recording the topology took too long; drift is not shown");
            return;
        }
    };
    for r in &retired {
        warn!(
            object = %r.name,
            ladder = %r.ladder,
            role = %r.role,
            messages = r.messages,
            last_due_by = %r.last_due_by_ms.map(crate::model::lot::text::format_time).unwrap_or_default(),
            "retired: {}",
            r.note
        );
    }
    if !retired.is_empty() {
        info!(
            retired = retired.len(),
            "objects the config no longer uses; `ladder check` lists them, `ladder prune` removes the empty ones"
        );
    }
    let differing = older
        .iter()
        .map(|o| crate::broker::drift::Difference {
            name: o.name.clone(),
            kind: crate::model::drift::Kind::Queue,
            detail: format!(
                "declared by an older Ladder, without {}; kept (a policy can add it)",
                o.missing.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
            ),
        })
        .collect();
    *state.drift.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Arc::new(DriftSeen {
        registry,
        survey: crate::broker::drift::Survey { retired, differing },
        at_ms: crate::clock::now_ms(),
    }));
}

/// Declares the topology of `config` for the broker `connection` is open to, and warns about
/// queues kept in an older shape (see [`topology::OlderQueue`]), which it returns with the
/// ladders a release before the topology stream declared.
///
/// A ladder an earlier release declared keeps the forwarding layer of its fanout `N.L` and is
/// moved off its ways in of before (`upgrade`); a new ladder declares today's layout only.
pub(crate) async fn declare(
    connection: &Connection,
    config: &Config,
    known: Option<&crate::model::drift::Registry>,
    each: &(dyn Fn(&topology::Declaration) + Sync),
) -> Result<Applied, TopologyError> {
    let version = topology::version_of(connection);
    let mut plan = crate::model::plan::plan_shared(&config.namespace, &config.ladders, version);
    let mut unrecorded = Vec::new();
    for spec in &config.ladders {
        let names = Names::of(&config.namespace, spec);
        // asked only of a ladder the stream does not know; a failure to ask ends the session
        let entry = async || crate::broker::drift::is_fanout(connection, &names.exchange).await;
        let before = upgrade::Before::of(known, &names, spec, entry)
            .await
            .map_err(|e| TopologyError::Broker {
                declaration: format!("the exchange {} as it is", names.exchange),
                source: match e {
                    crate::broker::cancels::CancelError::Broker(source) => source,
                    other => ladder_amqp::Error::Protocol(other.to_string()),
                },
            })?;
        if before.moves() {
            info!(ladder = %spec.name, layout = upgrade::LAYOUT, "moving a ladder declared by an earlier release to today's layout, behind N.L.next");
        }
        if before == upgrade::Before::Unrecorded {
            unrecorded.push(spec.name.clone());
        }
        plan.extend(upgrade::plan_ladder(&names, spec, version, before));
    }
    let older_queues = topology::apply(connection, &plan, each).await?;
    for older in &older_queues {
        let missing: Vec<&str> = older.missing.iter().map(|(k, _)| *k).collect();
        warn!(
            queue = %older.name,
            missing = %missing.join(", "),
            fix = %older.policy_command(),
            "a queue declared by an older Ladder (or on an older RabbitMQ) is kept as it is; RabbitMQ cannot add \
             arguments to an existing queue, so give it what it lacks with a policy"
        );
    }
    Ok(Applied {
        older: older_queues,
        unrecorded,
    })
}

/// What [`declare`] found that the drift record needs.
#[derive(Clone)]
pub(crate) struct Applied {
    /// Queues kept in an older shape.
    older: Vec<topology::OlderQueue>,
    /// Ladders a release before the topology stream declared: their own tiers of before are
    /// looked for and recorded, so they show as retired until pruned.
    unrecorded: Vec<String>,
}

/// How long a starting session may read the topology stream to learn which ladders it declared
/// before; past it every unbind is made.
pub(crate) const MIGRATED_READ: Duration = Duration::from_secs(5);

/// `apply` failed.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The broker could not be reached.
    #[error("cannot reach the broker: {0}")]
    Connect(#[from] ladder_amqp::Error),
    /// Declaring failed.
    #[error(transparent)]
    Topology(#[from] TopologyError),
}
