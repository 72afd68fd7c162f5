//! Drift: what a namespace declared before that its config no longer uses, and what `ladder
//! prune` may remove of it.
//!
//! RabbitMQ cannot list a vhost's queues over AMQP, so a namespace remembers what it declared in
//! its topology stream `N.topology` (see [`Namespace`]). When its plan adds something, `ladder
//! run` and `ladder apply` append a `declared` record holding everything the namespace knows of.
//! `ladder prune` appends a `pruned` record naming what it deleted. The fold of the stream is a [`Registry`];
//! what it knows and the plan does not name is *retired*. A record holds the whole known set, so
//! a retention that cut the stream's oldest records loses nothing the newest one knows.
//!
//! [`Namespace`]: crate::model::names::Namespace

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

/// The `type` property of a topology record.
pub const TOPOLOGY_FORMAT: &str = "ladder.topology/v1";

/// The `type` property of the marker a reader appends and reads up to.
pub const TOPOLOGY_MARKER_FORMAT: &str = "ladder.topology-marker/v1";

/// The role of a ladder's way in (`N.L`), the exchange consumers dead-letter into.
pub const ENTRY_ROLE: &str = "entry";

/// A queue or an exchange.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A queue (or a stream).
    Queue,
    /// An exchange.
    Exchange,
}

impl Kind {
    /// `queue` or `exchange`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Queue => "queue",
            Kind::Exchange => "exchange",
        }
    }
}

/// One object a namespace declared.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Known {
    /// Its name (`N.…`).
    pub name: String,
    /// Queue or exchange.
    pub kind: Kind,
    /// The ladder it belongs to; empty for the namespace's own (the topology stream).
    pub ladder: String,
    /// What it is within its ladder: `entry`, `intake`, `delay.6s`, `parked` … (its name after
    /// `N.L.`).
    pub role: String,
    /// A tier queue's `x-message-ttl`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// A stream (whose message count the broker does not report).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stream: bool,
}

impl Known {
    /// The tier's name when this is a tier queue (`delay.<tier>`).
    pub fn tier(&self) -> Option<&str> {
        self.role.strip_prefix("delay.")
    }
}

/// A record of the topology stream.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "record", rename_all = "lowercase")]
pub enum TopologyRecord {
    /// Everything the writer knew of, its own plan included.
    Declared {
        /// When (Unix ms).
        at_ms: u64,
        /// Who: the connection name and version of the writer.
        by: String,
        /// The objects.
        objects: Vec<Known>,
        /// The layout the writer declared ([`crate::model::upgrade::LAYOUT`]); absent in the
        /// records of releases before layouts were recorded.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        layout: Option<u32>,
    },
    /// What `ladder prune` deleted (or found gone).
    Pruned {
        /// When (Unix ms).
        at_ms: u64,
        /// Who.
        by: String,
        /// The objects, by kind and name.
        objects: Vec<(Kind, String)>,
    },
}

impl TopologyRecord {
    /// The record as the JSON body it is stored as.
    pub fn to_vec(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A record read back; `None` for anything else.
    pub fn from_slice(body: &[u8]) -> Option<Self> {
        serde_json::from_slice(body).ok()
    }
}

/// What the topology stream says the namespace declared: the fold of its records, in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Registry {
    /// By kind and name (`N.L.due` is an exchange and a queue).
    known: BTreeMap<(Kind, String), Known>,
    /// The layout of the newest `Declared` record.
    layout: Option<u32>,
}

impl Registry {
    /// Folds one record in.
    pub fn apply(&mut self, record: &TopologyRecord) {
        match record {
            TopologyRecord::Declared { objects, layout, .. } => {
                for object in objects {
                    self.known.insert((object.kind, object.name.clone()), object.clone());
                }
                self.layout = *layout;
            }
            TopologyRecord::Pruned { objects, .. } => {
                for (kind, name) in objects {
                    self.known.remove(&(*kind, name.clone()));
                }
            }
        }
    }

    /// Whether it knows the queue `name`.
    pub fn knows_queue(&self, name: &str) -> bool {
        self.known.contains_key(&(Kind::Queue, name.to_string()))
    }

    /// Whether it knows an exchange named `name`.
    pub fn knows_exchange(&self, name: &str) -> bool {
        self.known.contains_key(&(Kind::Exchange, name.to_string()))
    }

    /// Whether it knows `object` (by kind and name).
    pub fn knows(&self, object: &Known) -> bool {
        self.known.contains_key(&(object.kind, object.name.clone()))
    }

    /// Every object it knows of, by name.
    pub fn known(&self) -> impl Iterator<Item = &Known> {
        self.known.values()
    }

    /// The layout the newest record was declared in; `None` before layouts were recorded.
    pub fn layout(&self) -> Option<u32> {
        self.layout
    }

    /// The record to append after declaring `planned` in layout `layout` (today's): everything
    /// known with the plan added, or `None` when the stream already knows the plan as it is.
    pub fn declaring(&self, planned: &[Known], layout: u32, at_ms: u64, by: &str) -> Option<TopologyRecord> {
        if self.layout == Some(layout)
            && planned
                .iter()
                .all(|p| self.known.get(&(p.kind, p.name.clone())) == Some(p))
        {
            return None;
        }
        let mut all = self.known.clone();
        for object in planned {
            all.insert((object.kind, object.name.clone()), object.clone());
        }
        Some(TopologyRecord::Declared {
            at_ms,
            by: by.to_string(),
            objects: all.into_values().collect(),
            layout: Some(layout),
        })
    }

    /// What it knows of in namespace `namespace` that `planned` does not name: retired.
    pub fn retired(&self, namespace: &str, planned: &[Known]) -> Vec<Known> {
        let prefix = format!("{namespace}.");
        let planned: BTreeSet<(Kind, &str)> = planned.iter().map(|p| (p.kind, p.name.as_str())).collect();
        self.known
            .values()
            .filter(|k| k.name.starts_with(&prefix) && !planned.contains(&(k.kind, k.name.as_str())))
            .cloned()
            .collect()
    }
}

/// What the broker says of one object: whether it exists, and a queue's messages and consumers
/// (a stream's message count is always 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Observed {
    /// It exists.
    pub exists: bool,
    /// A queue's ready messages.
    pub messages: u32,
    /// A queue's consumers.
    pub consumers: u32,
}

/// A retired object as an operator sees it.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Retired {
    /// Its name.
    pub name: String,
    /// Queue or exchange.
    pub kind: Kind,
    /// Its ladder.
    pub ladder: String,
    /// Its role within the ladder (`delay.6s`, `intake`, `entry` …).
    pub role: String,
    /// The whole ladder is retired (no ladder file names it any more), not one tier of it.
    pub ladder_retired: bool,
    /// A stream.
    pub stream: bool,
    /// A queue's messages.
    pub messages: u32,
    /// A queue's consumers.
    pub consumers: u32,
    /// When the last message that waits in it is due at the latest (Unix ms): a tier of a ladder
    /// still served, with messages.
    pub last_due_by_ms: Option<u64>,
    /// What it means, in a sentence.
    pub note: String,
}

/// The retired objects that still exist, with what the broker says of them; `live` names the
/// config's ladders.
pub fn report(retired: &[Known], observed: &[Observed], live: &BTreeSet<&str>, now_ms: u64) -> Vec<Retired> {
    retired
        .iter()
        .zip(observed)
        .filter(|(_, o)| o.exists)
        .map(|(k, o)| {
            // a stream's count is not its records' (RabbitMQ reports 0, or its last chunk's)
            let o = &Observed {
                messages: if k.stream { 0 } else { o.messages },
                ..*o
            };
            let ladder_retired = !k.ladder.is_empty() && !live.contains(k.ladder.as_str());
            let last_due_by_ms = match (k.ttl_ms, o.messages, ladder_retired) {
                (Some(ttl), 1.., false) => Some(now_ms.saturating_add(ttl)),
                _ => None,
            };
            let note = note(k, o, ladder_retired);
            Retired {
                name: k.name.clone(),
                kind: k.kind,
                ladder: k.ladder.clone(),
                role: k.role.clone(),
                ladder_retired,
                stream: k.stream,
                messages: o.messages,
                consumers: o.consumers,
                last_due_by_ms,
                note,
            }
        })
        .collect()
}

fn note(k: &Known, o: &Observed, ladder_retired: bool) -> String {
    let ladder = &k.ladder;
    match (k.kind, ladder_retired) {
        (Kind::Exchange, true) => format!("an exchange of retired ladder {ladder}; pruned with its queues"),
        (Kind::Exchange, false) => {
            "an exchange of an older layout that no failure takes now; ladder prune removes it".into()
        }
        (Kind::Queue, _) if k.stream && k.role == "parked" => format!(
            "the parking lot of retired ladder {ladder} (a stream: its entries are not counted here); \
             ladder prune keeps it unless given --with-parking-lot"
        ),
        (Kind::Queue, _) if k.stream => "a stream; pruned with its ladder".into(),
        (Kind::Queue, _) if o.consumers > 0 => format!(
            "{} consumer(s) read it: a replica with an older config still serves it",
            o.consumers
        ),
        (Kind::Queue, false) if o.messages > 0 && ladder.is_empty() => format!(
            "{} message(s) wait in this retired tier and come due through N.due to their own ladders, \
             all within its TTL; ladder prune removes it once it is empty",
            o.messages
        ),
        (Kind::Queue, false) if o.messages > 0 => format!(
            "{} message(s) wait in this retired tier and come due through {ladder}'s due hop, \
             all within its TTL; ladder prune removes it once it is empty",
            o.messages
        ),
        (Kind::Queue, false) => "empty; ladder prune removes it".into(),
        (Kind::Queue, true) if o.messages > 0 && k.role == "due" => format!(
            "{} message(s) came due for retired ladder {ladder}: moved to the ladders served, as N.stray is, \
             each to the one that admits it; ladder prune removes it once empty",
            o.messages
        ),
        (Kind::Queue, true) if o.messages > 0 => format!(
            "{} message(s) wait and no replica serves ladder {ladder}: put its file back in ladders_dir \
             until they drain",
            o.messages
        ),
        (Kind::Queue, true) => format!("empty; ladder prune removes it with the rest of ladder {ladder}"),
    }
}

/// What `ladder prune` does with one retired object.
#[derive(Debug, Clone, PartialEq)]
pub enum PruneStep {
    /// Delete it.
    Delete(Retired),
    /// Keep it, and why.
    Keep(Retired, String),
}

impl PruneStep {
    /// The object.
    pub fn object(&self) -> &Retired {
        match self {
            PruneStep::Delete(r) | PruneStep::Keep(r, _) => r,
        }
    }
}

/// What `ladder prune` would do with `retired` (as [`report`] made it): queues first, then the
/// exchanges of ladders whose queues all go (their way in first, so nothing new enters).
///
/// It keeps a queue that holds messages or has a consumer, and a parking lot unless
/// `with_parking_lot`, as it cannot count a stream's entries. It keeps a retired ladder's
/// exchanges while any of its queues is kept, a parking lot aside (nothing routes into it).
pub fn prune_plan(retired: &[Retired], with_parking_lot: bool) -> Vec<PruneStep> {
    let mut steps = Vec::new();
    let mut ladders_kept = BTreeSet::new();
    for r in retired.iter().filter(|r| r.kind == Kind::Queue) {
        let keep = if r.consumers > 0 {
            Some(format!("{} consumer(s) read it", r.consumers))
        } else if r.messages > 0 {
            Some(match r.last_due_by_ms {
                Some(by) => format!(
                    "holds {} message(s); the last is due by {} at the latest",
                    r.messages,
                    crate::model::lot::text::format_time(by)
                ),
                None => format!("holds {} message(s) that nothing serves", r.messages),
            })
        } else if r.stream && r.role == "parked" && !with_parking_lot {
            Some("a parking lot: its entries are not counted (--with-parking-lot deletes it)".into())
        } else {
            None
        };
        match keep {
            Some(why) => {
                if !(r.stream && r.role == "parked") {
                    ladders_kept.insert(r.ladder.clone());
                }
                steps.push(PruneStep::Keep(r.clone(), why));
            }
            None => steps.push(PruneStep::Delete(r.clone())),
        }
    }
    let mut exchanges: Vec<&Retired> = retired.iter().filter(|r| r.kind == Kind::Exchange).collect();
    exchanges.sort_by_key(|r| (r.ladder.clone(), r.role != ENTRY_ROLE, r.name.clone()));
    for r in exchanges {
        if ladders_kept.contains(&r.ladder) {
            steps.push(PruneStep::Keep(
                r.clone(),
                format!("ladder {} still has queues that are kept", r.ladder),
            ));
        } else {
            steps.push(PruneStep::Delete(r.clone()));
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Registry {
        fn declaring_today(&self, planned: &[Known], at_ms: u64, by: &str) -> Option<TopologyRecord> {
            self.declaring(planned, LAYOUT, at_ms, by)
        }
    }
    use crate::model::ladder::{DeadLetterStrategy, LadderSpec, QueueType};
    use crate::model::plan::BrokerVersion;
    use crate::model::upgrade::{LAYOUT, planned};

    fn spec(name: &str, steps: &[&str]) -> LadderSpec {
        LadderSpec::new(
            name.into(),
            steps.iter().map(|s| humantime::parse_duration(s).unwrap()).collect(),
            3,
            regex::RegexSet::new(["^x$"]).unwrap(),
            QueueType::Quorum,
            DeadLetterStrategy::AtLeastOnce,
        )
    }

    fn v() -> BrokerVersion {
        BrokerVersion::LATEST
    }

    #[test]
    fn the_plan_is_recorded_once_and_a_removed_tier_is_retired() {
        let six = spec("t", &["6s"]);
        let mut registry = Registry::default();
        let first = planned("ns", std::slice::from_ref(&six), v(), |_| false);
        let record = registry
            .declaring_today(&first, 1, "a")
            .expect("a new plan is recorded");
        registry.apply(&record);
        assert_eq!(
            registry.declaring_today(&first, 2, "a"),
            None,
            "the same plan again adds nothing"
        );
        assert!(registry.retired("ns", &first).is_empty());

        let two = spec("t", &["2s", "4s"]);
        let second = planned("ns", std::slice::from_ref(&two), v(), |_| false);
        registry.apply(
            &registry
                .declaring_today(&second, 3, "b")
                .expect("new tiers are recorded"),
        );
        let retired = registry.retired("ns", &second);
        let names: Vec<&str> = retired.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["ns.delay.6s"], "only the old tier is retired: {names:?}");
        assert_eq!(retired[0].ttl_ms, Some(6_000));
        assert_eq!(retired[0].tier(), Some("6s"));
        assert_eq!(
            retired[0].ladder, "",
            "a tier is the namespace's, shared by its ladders"
        );
        // another namespace's objects are never this namespace's retired ones
        assert!(registry.retired("other", &[]).is_empty());
        // a pruned object is forgotten
        registry.apply(&TopologyRecord::Pruned {
            at_ms: 4,
            by: "p".into(),
            objects: vec![(Kind::Queue, "ns.delay.6s".into())],
        });
        assert!(registry.retired("ns", &second).is_empty());
    }

    #[test]
    fn a_record_round_trips_and_holds_everything_known() {
        let mut registry = Registry::default();
        let a = planned("ns", &[spec("a", &["1s"])], v(), |_| false);
        registry.apply(&registry.declaring_today(&a, 1, "x").unwrap());
        let b = planned("ns", &[spec("b", &["1s"])], v(), |_| false);
        let record = registry.declaring_today(&b, 2, "y").unwrap();
        let back = TopologyRecord::from_slice(&record.to_vec()).expect("reads back");
        assert_eq!(back, record);
        // the newest record alone knows ladder a too: a cut stream loses nothing
        let mut fresh = Registry::default();
        fresh.apply(&back);
        assert!(fresh.known().any(|k| k.name == "ns.a.intake"));
        assert!(fresh.known().any(|k| k.name == "ns.b.intake"));
        let retired = fresh.retired("ns", &b);
        // ladder b uses the 1 s tier too: it stays, shared
        assert!(!retired.iter().any(|k| k.name == "ns.delay.1s"), "{retired:?}");
        assert!(retired.iter().all(|k| k.ladder == "a"), "{retired:?}");
        assert!(retired.iter().any(|k| k.role == ENTRY_ROLE && k.name == "ns.a"));
        assert!(
            retired
                .iter()
                .any(|k| k.kind == Kind::Exchange && k.name == "ns.a.intake")
        );
        assert!(TopologyRecord::from_slice(b"{\"record\":\"other\"}").is_none());
    }

    fn observed(messages: u32, consumers: u32) -> Observed {
        Observed {
            exists: true,
            messages,
            consumers,
        }
    }

    #[test]
    fn prune_keeps_what_waits_and_a_ladder_with_kept_queues() {
        let mut registry = Registry::default();
        registry.apply(
            &registry
                .declaring_today(
                    &planned("ns", &[spec("t", &["6s"]), spec("gone", &["1s"])], v(), |_| false),
                    1,
                    "x",
                )
                .unwrap(),
        );
        let now = planned("ns", &[spec("t", &["2s"])], v(), |_| false);
        let retired = registry.retired("ns", &now);
        let live = BTreeSet::from(["t"]);
        // the 6 s tier holds 3 messages; everything of `gone` is empty
        let obs: Vec<Observed> = retired
            .iter()
            .map(|k| {
                if k.name == "ns.delay.6s" {
                    observed(3, 0)
                } else {
                    observed(0, 0)
                }
            })
            .collect();
        let report = report(&retired, &obs, &live, 1_000);
        let six = report.iter().find(|r| r.name == "ns.delay.6s").unwrap();
        assert_eq!(six.last_due_by_ms, Some(7_000));
        assert!(!six.ladder_retired);
        assert!(six.note.contains("3 message(s)"), "{}", six.note);
        let steps = prune_plan(&report, false);
        let kept: Vec<&str> = steps
            .iter()
            .filter_map(|s| match s {
                PruneStep::Keep(r, _) => Some(r.name.as_str()),
                PruneStep::Delete(_) => None,
            })
            .collect();
        // the 1 s tier only `gone` used is retired with it, and empty: it goes
        assert_eq!(kept, ["ns.delay.6s", "ns.gone.parked"], "{steps:?}");
        assert!(
            steps
                .iter()
                .any(|s| matches!(s, PruneStep::Delete(r) if r.name == "ns.delay.1s" && r.ladder.is_empty()))
        );
        // gone's exchanges go after its queues, its way in first
        let deleted: Vec<&str> = steps
            .iter()
            .filter_map(|s| match s {
                PruneStep::Delete(r) => Some(r.name.as_str()),
                PruneStep::Keep(..) => None,
            })
            .collect();
        let first_exchange = deleted.iter().position(|n| *n == "ns.gone").unwrap();
        assert!(
            deleted[..first_exchange]
                .iter()
                .all(|n| { report.iter().find(|r| r.name == *n).unwrap().kind == Kind::Queue })
        );
        assert!(deleted.contains(&"ns.gone.intake") && deleted.contains(&"ns.gone"));
        // with the parking lot, it goes too
        assert!(
            prune_plan(&report, true)
                .iter()
                .any(|s| matches!(s, PruneStep::Delete(r) if r.name == "ns.gone.parked"))
        );

        // a message in gone's intake keeps every queue-less exchange of gone, and says why
        let obs: Vec<Observed> = retired
            .iter()
            .map(|k| {
                if k.name == "ns.gone.intake" {
                    observed(1, 0)
                } else {
                    observed(0, 0)
                }
            })
            .collect();
        let report = super::report(&retired, &obs, &live, 1_000);
        let intake = report.iter().find(|r| r.name == "ns.gone.intake").unwrap();
        assert!(
            intake.ladder_retired && intake.note.contains("no replica serves"),
            "{}",
            intake.note
        );
        for step in prune_plan(&report, true) {
            if step.object().ladder == "gone" && step.object().kind == Kind::Exchange {
                assert!(matches!(step, PruneStep::Keep(..)), "{step:?}");
            }
        }
        // a consumer on a retired queue keeps it
        let obs: Vec<Observed> = retired.iter().map(|_| observed(0, 1)).collect();
        let report = super::report(&retired, &obs, &live, 1_000);
        assert!(
            prune_plan(&report, true)
                .iter()
                .filter(|s| s.object().kind == Kind::Queue && !s.object().stream)
                .all(|s| matches!(s, PruneStep::Keep(..)))
        );
    }

    #[test]
    fn what_is_gone_is_not_reported() {
        let retired = vec![Known {
            name: "ns.t.delay.6s".into(),
            kind: Kind::Queue,
            ladder: "t".into(),
            role: "delay.6s".into(),
            ttl_ms: Some(6_000),
            stream: false,
        }];
        assert!(report(&retired, &[Observed::default()], &BTreeSet::from(["t"]), 0).is_empty());
    }
}
