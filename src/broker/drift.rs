//! Drift on the broker: the namespace's topology stream (`N.topology`, see [`crate::model::drift`]),
//! what the broker says of retired objects, objects whose arguments differ from the config, and
//! `ladder prune`.
//!
//! Everything here reads with passive declares (which create nothing) except the record a
//! declaring replica appends, and the deletions `ladder prune` makes.

use std::collections::BTreeSet;
use std::time::Duration;

use ladder_amqp::{Channel, Connection, FieldTable, FieldValue, QueueOptions};
use tracing::debug;

use crate::broker::cancels::{CancelError, append, bounded};
use crate::broker::topology::{self, Declaration, Names, precondition_detail as precondition, table};
use crate::config::Config;
use crate::model::drift::{
    Kind, Known, Observed, PruneStep, Registry, Retired, TOPOLOGY_FORMAT, TOPOLOGY_MARKER_FORMAT, TopologyRecord,
};
use crate::model::names::Namespace;

/// How long reading the topology stream up to its marker may take.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Why reading or writing drift failed.
pub type DriftError = CancelError;

/// The fold of the namespace's topology stream, read up to a marker appended first; empty when
/// the stream does not exist (nothing recorded yet, or a release before it).
pub async fn read(connection: &Connection, namespace: &str) -> Result<Registry, DriftError> {
    let stream = Namespace::new(namespace).topology;
    if !queue_exists(connection, &stream).await? {
        return Ok(Registry::default());
    }
    let marker_id = crate::clock::unique_id("topology");
    let marker = serde_json::json!({"format": TOPOLOGY_MARKER_FORMAT, "id": marker_id});
    append(
        connection,
        &stream,
        TOPOLOGY_MARKER_FORMAT,
        marker.to_string().as_bytes(),
    )
    .await?;
    let channel = bounded("opening a channel", connection.create_channel()).await?;
    bounded("setting the prefetch", channel.basic_qos(200)).await?;
    let mut args = FieldTable::default();
    args.set("x-stream-offset", FieldValue::string("first"));
    let mut consumer = bounded(
        "subscribing to the topology stream",
        channel.basic_consume(&stream, "", false, args),
    )
    .await?;
    let mut registry = Registry::default();
    let reading = async {
        while let Some(delivery) = consumer.next().await {
            let delivery = delivery?;
            channel.basic_ack(delivery.delivery_tag, false)?;
            match delivery.properties.kind.as_ref().and_then(|k| k.to_str()) {
                Some(TOPOLOGY_FORMAT) => match TopologyRecord::from_slice(&delivery.body) {
                    Some(record) => registry.apply(&record),
                    None => debug!("an unreadable topology record; skipped"),
                },
                Some(TOPOLOGY_MARKER_FORMAT) => {
                    let ours = serde_json::from_slice::<serde_json::Value>(&delivery.body)
                        .ok()
                        .is_some_and(|v| v["id"] == marker_id.as_str());
                    if ours {
                        return Ok(());
                    }
                }
                _ => {}
            }
        }
        Err(CancelError::Broker(ladder_amqp::Error::ChannelGone))
    };
    let read = tokio::time::timeout(READ_TIMEOUT, reading).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), channel.close(200, "read")).await;
    match read {
        Ok(Ok(())) => Ok(registry),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(CancelError::Timeout(READ_TIMEOUT, "reading the topology stream")),
    }
}

/// After declaring `config`'s plan for `version`: reads the stream and appends what the plan
/// adds to it (nothing when the stream knows it), with the own tiers of before that still exist
/// of the ladders in `unrecorded` (declared by a release before the stream). Returns what the
/// namespace knows now.
pub async fn record(
    connection: &Connection,
    config: &Config,
    version: topology::BrokerVersion,
    unrecorded: &[String],
) -> Result<Registry, DriftError> {
    let mut registry = read(connection, &config.namespace).await?;
    let prefix = format!("{}.", config.namespace);
    let older = |names: &Names| {
        let ladder = names.exchange.strip_prefix(&prefix).unwrap_or_default();
        unrecorded.iter().any(|l| l == ladder) || crate::model::upgrade::forwards(&registry, names)
    };
    let mut planned = crate::model::upgrade::planned(&config.namespace, &config.ladders, version, older);
    // the tiers a ladder declared itself before tiers were shared, where they still exist:
    // recorded, so they show as retired until `ladder prune` removes them
    let unknown: Vec<Known> = crate::model::upgrade::own_tiers(&config.namespace, &config.ladders)
        .into_iter()
        .filter(|k| unrecorded.contains(&k.ladder) && !registry.knows(k))
        .collect();
    let seen = observe(connection, &unknown).await?;
    planned.extend(unknown.into_iter().zip(seen).filter(|(_, o)| o.exists).map(|(k, _)| k));
    let by = format!("{} {}", config.amqp.connection_name, env!("CARGO_PKG_VERSION"));
    if let Some(record) = registry.declaring(&planned, crate::model::upgrade::LAYOUT, crate::clock::now_ms(), &by) {
        append(
            connection,
            &Namespace::new(&config.namespace).topology,
            TOPOLOGY_FORMAT,
            &record.to_vec(),
        )
        .await?;
        registry.apply(&record);
    }
    Ok(registry)
}

/// Appends that `names` were pruned.
async fn record_pruned(
    connection: &Connection,
    namespace: &str,
    objects: Vec<(Kind, String)>,
) -> Result<(), DriftError> {
    if objects.is_empty() {
        return Ok(());
    }
    let record = TopologyRecord::Pruned {
        at_ms: crate::clock::now_ms(),
        by: format!("ladder prune {}", env!("CARGO_PKG_VERSION")),
        objects,
    };
    append(
        connection,
        &Namespace::new(namespace).topology,
        TOPOLOGY_FORMAT,
        &record.to_vec(),
    )
    .await
}

/// Whether `queue` exists (a passive declare on a channel of its own).
pub async fn queue_exists(connection: &Connection, queue: &str) -> Result<bool, DriftError> {
    let channel = bounded("opening a channel", connection.create_channel()).await?;
    match bounded("looking for a queue", channel.queue_inspect(queue)).await {
        Ok(_) => {
            let _ = channel.close(200, "looked").await;
            Ok(true)
        }
        Err(CancelError::Broker(e)) if not_found(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether exchange `name` is a fanout exchange without arguments (`Some(true)`: what every
/// release before layout 3 declared as `N.L`), of another shape (`Some(false)`), or missing
/// (`None`). A passive declare, then a declare as that fanout: a no-op for one of that shape,
/// refused for any other (406, which closes only its channel).
pub async fn is_fanout(connection: &Connection, name: &str) -> Result<Option<bool>, DriftError> {
    let channel = bounded("opening a channel", connection.create_channel()).await?;
    match bounded("looking for an exchange", channel.exchange_inspect(name)).await {
        Ok(()) => {}
        Err(CancelError::Broker(e)) if not_found(&e) => return Ok(None),
        Err(e) => return Err(e),
    }
    let declared = bounded(
        "declaring an exchange as it was",
        channel.exchange_declare(name, "fanout", true, FieldTable::new()),
    )
    .await;
    match declared {
        Ok(()) => {
            let _ = channel.close(200, "looked").await;
            Ok(Some(true))
        }
        Err(CancelError::Broker(e)) if precondition(&e).is_some() => Ok(Some(false)),
        Err(e) => Err(e),
    }
}

/// What the broker says of each object: a passive declare each (a 404 closes its channel, so a
/// new one is opened for the next).
pub async fn observe(connection: &Connection, objects: &[Known]) -> Result<Vec<Observed>, DriftError> {
    let mut out = Vec::with_capacity(objects.len());
    let mut channel: Option<Channel> = None;
    for object in objects {
        let open = match channel.take() {
            Some(c) if c.is_open() => c,
            _ => bounded("opening a channel", connection.create_channel()).await?,
        };
        let answer = match object.kind {
            Kind::Queue => bounded("reading a queue", open.queue_inspect(&object.name))
                .await
                .map(|q| (q.message_count, q.consumer_count)),
            Kind::Exchange => bounded("reading an exchange", open.exchange_inspect(&object.name))
                .await
                .map(|()| (0, 0)),
        };
        match answer {
            Ok((messages, consumers)) => {
                out.push(Observed {
                    exists: true,
                    messages,
                    consumers,
                });
                channel = Some(open);
            }
            Err(CancelError::Broker(e)) if not_found(&e) => out.push(Observed::default()),
            Err(e) => return Err(e),
        }
    }
    if let Some(channel) = channel {
        let _ = channel.close(200, "observed").await;
    }
    Ok(out)
}

/// The namespace's drift as the broker shows it now.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Survey {
    /// The retired objects that still exist.
    pub retired: Vec<Retired>,
    /// Planned objects whose arguments differ from what the broker holds.
    pub differing: Vec<Difference>,
}

/// A planned object the broker holds with other arguments.
#[derive(Debug, Clone, PartialEq, serde::Serialize, utoipa::ToSchema)]
pub struct Difference {
    /// Its name.
    pub name: String,
    /// Queue or exchange.
    pub kind: Kind,
    /// The broker's words, or what a queue kept in an older shape lacks.
    pub detail: String,
}

/// Reads the stream and the broker: what is retired, and what differs from the plan.
pub async fn survey(connection: &Connection, config: &Config) -> Result<Survey, DriftError> {
    let version = topology::version_of(connection);
    let registry = read(connection, &config.namespace).await?;
    let retired = retired_now(connection, config, version, &registry).await?;
    let differing = compare(connection, &topology::plan_known(config, version, &registry)).await?;
    Ok(Survey { retired, differing })
}

/// The retired objects of `registry` that still exist, as the broker shows them now.
pub async fn retired_now(
    connection: &Connection,
    config: &Config,
    version: topology::BrokerVersion,
    registry: &Registry,
) -> Result<Vec<Retired>, DriftError> {
    let planned = crate::model::upgrade::planned(&config.namespace, &config.ladders, version, |names: &Names| {
        crate::model::upgrade::forwards(registry, names)
    });
    let retired = registry.retired(&config.namespace, &planned);
    let observed = observe(connection, &retired).await?;
    let live: BTreeSet<&str> = config.ladders.iter().map(|l| l.name.as_str()).collect();
    Ok(crate::model::drift::report(
        &retired,
        &observed,
        &live,
        crate::clock::now_ms(),
    ))
}

/// The planned queues and exchanges that exist with other arguments: each one that exists is
/// declared again with the planned arguments on a channel of its own; a 406 says they differ (a
/// declare with the same arguments changes nothing). A queue an older Ladder declared in a
/// shape the service keeps ([`Declaration::Queue::older`]) is reported with what it lacks.
pub async fn compare(connection: &Connection, declarations: &[Declaration]) -> Result<Vec<Difference>, DriftError> {
    let mut out = Vec::new();
    for declaration in declarations {
        let (name, kind) = match declaration {
            Declaration::Queue { name, .. } => (name, Kind::Queue),
            Declaration::Exchange { name, .. } => (name, Kind::Exchange),
            Declaration::Binding { .. } | Declaration::Unbinding { .. } => continue,
        };
        let exists = observe(
            connection,
            &[Known {
                name: name.clone(),
                kind,
                ladder: String::new(),
                role: String::new(),
                ttl_ms: None,
                stream: false,
            }],
        )
        .await?[0]
            .exists;
        if !exists {
            continue;
        }
        let channel = bounded("opening a channel", connection.create_channel()).await?;
        let answer = match declaration {
            Declaration::Exchange { name, kind, args } => {
                bounded(
                    "comparing an exchange",
                    channel.exchange_declare(name, kind, true, table(args)),
                )
                .await
            }
            Declaration::Queue { name, args, older } => {
                let options = QueueOptions {
                    durable: true,
                    ..Default::default()
                };
                match bounded("comparing a queue", channel.queue_declare(name, options, table(args))).await {
                    Err(CancelError::Broker(e)) if precondition(&e).is_some() && older.is_some() => {
                        let older = older.as_deref().unwrap_or_default();
                        let channel = bounded("opening a channel", connection.create_channel()).await?;
                        let kept =
                            bounded("comparing a queue", channel.queue_declare(name, options, table(older))).await;
                        let _ = channel.close(200, "compared").await;
                        match kept {
                            Ok(_) => {
                                let missing: Vec<&str> =
                                    args.iter().filter(|a| !older.contains(a)).map(|(k, _)| *k).collect();
                                out.push(Difference {
                                    name: name.clone(),
                                    kind,
                                    detail: format!(
                                        "declared by an older Ladder, without {}; kept (a policy can add it)",
                                        missing.join(", ")
                                    ),
                                });
                                continue;
                            }
                            Err(CancelError::Broker(e)) => Err(CancelError::Broker(e)),
                            Err(other) => return Err(other),
                        }
                    }
                    other => other.map(|_| ()),
                }
            }
            Declaration::Binding { .. } | Declaration::Unbinding { .. } => unreachable!("skipped above"),
        };
        match answer {
            Ok(()) => {
                let _ = channel.close(200, "compared").await;
            }
            Err(CancelError::Broker(e)) => match precondition(&e) {
                Some(detail) => out.push(Difference {
                    name: name.clone(),
                    kind,
                    detail,
                }),
                None => return Err(CancelError::Broker(e)),
            },
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// What `ladder prune` did with each object.
#[derive(Debug, Clone, PartialEq)]
pub enum Pruned {
    /// Deleted.
    Deleted(Retired),
    /// Kept, and why.
    Kept(Retired, String),
}

/// Deletes what [`crate::model::drift::prune_plan`] says may go, as the broker shows it now.
/// A retired tier of a ladder still served is first unbound (no new message can reach it), then
/// read once more, and deleted only if still empty (re-bound and kept if not). A retired ladder's
/// exchanges go first (its way in first), then its queues, each read once more before it goes.
/// Appends what went to the topology stream.
pub async fn prune(
    connection: &Connection,
    config: &Config,
    with_parking_lot: bool,
) -> Result<Vec<Pruned>, DriftError> {
    let version = topology::version_of(connection);
    let registry = read(connection, &config.namespace).await?;
    let retired = retired_now(connection, config, version, &registry).await?;
    let steps = crate::model::drift::prune_plan(&retired, with_parking_lot);
    // a retired whole ladder: the exchanges that lead into its queues first (its way in first),
    // so nothing new can enter them; those its queues dead-letter into (due, quarantine) last,
    // and only when none of its queues was kept
    let mut out = Vec::new();
    let mut gone = Vec::new();
    let (queues, exchanges): (Vec<_>, Vec<_>) = steps.into_iter().partition(|s| s.object().kind == Kind::Queue);
    let (outflows, inflows): (Vec<_>, Vec<_>) = exchanges
        .into_iter()
        .partition(|s| matches!(s.object().role.as_str(), "due" | "quarantine"));
    for step in inflows {
        match step {
            PruneStep::Keep(r, why) => out.push(Pruned::Kept(r, why)),
            PruneStep::Delete(r) => {
                delete_exchange(connection, &r.name).await?;
                gone.push((r.kind, r.name.clone()));
                out.push(Pruned::Deleted(r));
            }
        }
    }
    let mut ladders_kept = BTreeSet::new();
    for step in queues {
        let r = match step {
            PruneStep::Keep(r, why) => {
                out.push(Pruned::Kept(r, why));
                continue;
            }
            PruneStep::Delete(r) => r,
        };
        let inflows = retired_inflows(config, &registry, &r);
        let channel = bounded("opening a channel", connection.create_channel()).await?;
        set_inflows(&channel, &inflows, false).await?;
        let now = bounded("reading a queue", channel.queue_inspect(&r.name)).await?;
        // a stream's message count is not its records' (see model::drift::report)
        if (!r.stream && now.message_count > 0) || now.consumer_count > 0 {
            // a tier is bound again (a ladder may route into it); a first wait of before never
            // (bound, it would take a copy of every first failure beside the wait of now)
            if !r.role.starts_with(RETIRED_WAIT) {
                set_inflows(&channel, &inflows, true).await?;
            }
            let _ = channel.close(200, "kept").await;
            ladders_kept.insert(r.ladder.clone());
            out.push(Pruned::Kept(
                r,
                format!(
                    "changed while pruning: {} message(s), {} consumer(s)",
                    now.message_count, now.consumer_count
                ),
            ));
            continue;
        }
        let held = bounded("deleting a queue", channel.queue_delete(&r.name)).await?;
        let _ = channel.close(200, "pruned").await;
        if held > 0 {
            // cannot happen with its inflows removed; said loudly if it ever does
            tracing::error!(queue = %r.name, messages = held, "a pruned queue held messages when it was deleted");
        }
        gone.push((r.kind, r.name.clone()));
        out.push(Pruned::Deleted(r));
    }
    for step in outflows {
        match step {
            PruneStep::Keep(r, why) => out.push(Pruned::Kept(r, why)),
            PruneStep::Delete(r) if ladders_kept.contains(&r.ladder) => {
                let why = format!("ladder {} still has queues that dead-letter into it", r.ladder);
                out.push(Pruned::Kept(r, why));
            }
            PruneStep::Delete(r) => {
                delete_exchange(connection, &r.name).await?;
                gone.push((r.kind, r.name.clone()));
                out.push(Pruned::Deleted(r));
            }
        }
    }
    record_pruned(connection, &config.namespace, gone).await?;
    Ok(out)
}

/// The bindings that may still route into retired queue `r`, removed before it is deleted.
fn retired_inflows(config: &Config, registry: &Registry, r: &Retired) -> Vec<Declaration> {
    match (r.ladder_retired, r.role.strip_prefix("delay.")) {
        // a first wait of an older ladder (`model::upgrade`): N.L.wait led into it
        (false, None) if r.role.starts_with(RETIRED_WAIT) => {
            let names = Names::new(&config.namespace, &r.ladder);
            vec![Declaration::Binding {
                exchange: format!("{}.wait", names.exchange),
                queue: r.name.clone(),
                key: String::new(),
                args: Vec::new(),
                to_exchange: false,
            }]
        }
        // a ladder's own tier, from before tiers were shared
        (false, Some(tier)) if !r.ladder.is_empty() => {
            let names = Names::new(&config.namespace, &r.ladder);
            crate::model::upgrade::tier_inflows(&names, &r.ladder, tier, &r.name, true)
        }
        // a shared tier no ladder uses now: whichever served ladder may still route into it
        (false, Some(tier)) => {
            let tier = tier.split('.').next().unwrap_or(tier);
            config
                .ladders
                .iter()
                .flat_map(|spec| {
                    let names = Names::of(&config.namespace, spec);
                    let older = crate::model::upgrade::forwards(registry, &names);
                    crate::model::upgrade::tier_inflows(&names, &spec.name, tier, &r.name, older)
                })
                .collect()
        }
        _ => Vec::new(),
    }
}

/// The role of a first wait of before (`N.L.wait.<tier>`, `first_failures = "direct"`).
const RETIRED_WAIT: &str = "wait.";

/// Unbinds (or, `bind`, binds again) a retired tier's inflows ([`crate::model::upgrade::tier_inflows`]).
async fn set_inflows(channel: &Channel, inflows: &[Declaration], bind: bool) -> Result<(), DriftError> {
    for inflow in inflows {
        if let Declaration::Binding {
            exchange,
            queue,
            key,
            args,
            ..
        } = inflow
        {
            if bind {
                bounded(
                    "binding a tier again",
                    channel.queue_bind(queue, exchange, key, table(args)),
                )
                .await?;
            } else {
                bounded(
                    "unbinding a tier",
                    channel.queue_unbind(queue, exchange, key, table(args)),
                )
                .await?;
            }
        }
    }
    Ok(())
}

/// Deletes exchange `name` on a channel of its own.
async fn delete_exchange(connection: &Connection, name: &str) -> Result<(), DriftError> {
    let channel = bounded("opening a channel", connection.create_channel()).await?;
    bounded("deleting an exchange", channel.exchange_delete(name)).await?;
    let _ = channel.close(200, "pruned").await;
    Ok(())
}

/// Whether `error` is the broker's 404 NOT_FOUND for a passive declare.
fn not_found(error: &ladder_amqp::Error) -> bool {
    matches!(error, ladder_amqp::Error::ChannelClosed(reason) if reason.code == 404)
}

/// A retired object's line, for the log and the terminal.
pub fn describe(r: &Retired) -> String {
    let what = if r.ladder.is_empty() {
        "shared by the namespace's ladders".to_string()
    } else if r.ladder_retired {
        format!("ladder {} (retired)", r.ladder)
    } else {
        format!("ladder {}", r.ladder)
    };
    let by = r
        .last_due_by_ms
        .map(|ms| format!(", last due by {}", crate::model::lot::text::format_time(ms)))
        .unwrap_or_default();
    format!(
        "{} {} ({what}, {}): {} message(s){by} — {}",
        r.kind.as_str(),
        r.name,
        r.role,
        r.messages,
        r.note
    )
}
