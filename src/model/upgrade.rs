//! Moving a ladder that an earlier release declared to today's layout: the one place that
//! knows the layouts of before. A new install runs none of it; [`plan`] is today's layout only.
//!
//! Today (layout 3) `N.L` is a headers exchange that routes a repeat failure into its tier and
//! passes the rest to its alternate exchange `N.L.intake`. Every release before declared `N.L`
//! as a fanout exchange, and RabbitMQ cannot change an exchange's type. So a ladder of before
//! keeps a forwarding layer for good: `N.L` (fanout) → `N.L.next` (headers, today's routes) →
//! its alternate `N.L.first` → the intake. The layouts of before:
//! - 903c5df and earlier, before the topology stream. `N.L` was bound straight to `N.L.intake`,
//!   and each ladder's own tiers `N.L.delay.<tier>` to `N.L.tiers`; they dead-lettered into the
//!   fanout exchange `N.L.due`.
//! - The releases up to a2d534d, which recorded what they declared. `N.L.next` was bound to a
//!   ladder's own tiers, later `N.L.first` → `N.L.sort` → the intake or a first wait
//!   `N.L.wait.<tier>` (`first_failures = "direct"`). A first wait dead-letters into `N.L.due`
//!   with the routing key `wait.<tier>`.
//!
//! Moving on binds the forwarding layer and unbinds each way in of before right after the one
//! that replaces it is bound. A failure published in between reaches both, a duplicate, never
//! neither. While a replica of
//! before still runs, `N.L.tiers` stays bound to the shared tiers it publishes into. What waited
//! in the old tiers and first waits still comes due through `N.L.due`, and `ladder prune`
//! deletes them once they are empty.
//!
//! [`plan`]: crate::model::plan::plan

use std::collections::BTreeSet;

use crate::model::drift::{ENTRY_ROLE, Kind, Known, Registry};
use crate::model::ladder::LadderSpec;
use crate::model::names::Names;
use crate::model::plan::{self, ArgValue, BrokerVersion, Declaration, bind, exchange, unbind};

/// Today's layout, recorded with each record of the topology stream.
pub const LAYOUT: u32 = 3;

/// How a ladder was declared before this start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Before {
    /// Not at all: a new ladder.
    Nothing,
    /// By a release before the topology stream (903c5df): its own tiers of before are not
    /// recorded yet.
    Unrecorded,
    /// By a release whose `N.L` is a fanout exchange, in a layout before today's (or with its
    /// own tiers of before still recorded): moved to today's, behind a forwarding layer.
    Older,
    /// Moved to today's layout behind the forwarding layer of its fanout `N.L`, which it keeps.
    Forwarded,
    /// In today's layout.
    Current,
}

/// The exchanges of the layouts of before, which only a ladder of before has.
pub struct OldNames {
    /// `N.L.next`: the headers exchange behind a fanout `N.L`, carrying the routes.
    pub next: String,
    /// `N.L.first`: `N.L.next`'s alternate exchange, bound to the intake.
    pub first: String,
    /// `N.L.sort`: what `N.L.first` was bound to before layout 3.
    pub sort: String,
    /// `N.L.tiers`: the direct exchange a replica of before publishes into a tier through.
    pub tiers: String,
    /// `N.L.due`: the fanout exchange own tiers and first waits of before dead-letter into.
    pub due: String,
}

impl OldNames {
    /// The old exchanges of the ladder `names` are for.
    pub fn of(names: &Names) -> OldNames {
        let base = &names.exchange;
        OldNames {
            next: format!("{base}.next"),
            first: format!("{base}.first"),
            sort: format!("{base}.sort"),
            tiers: format!("{base}.tiers"),
            due: format!("{base}.due"),
        }
    }
}

impl Before {
    /// From what the topology stream says (`None`: it could not be read). When the stream does not
    /// know the ladder, the broker is asked whether its `N.L` is a fanout exchange of before
    /// (`Some(true)`), today's (`Some(false)`) or missing (`None`). So a stream that cannot be read
    /// never has today's `N.L` declared as a fanout, or the reverse.
    ///
    /// A ladder the stream knows with `N.L.next` keeps its forwarding layer for good. Every start
    /// unbinds the ways in of before again, as a replica of before that restarts during a rolling
    /// deploy binds them again.
    pub async fn of<E>(
        registry: Option<&Registry>,
        names: &Names,
        spec: &LadderSpec,
        fanout_entry: impl AsyncFnOnce() -> Result<Option<bool>, E>,
    ) -> Result<Before, E> {
        let Some(registry) = registry.filter(|r| r.knows_queue(&names.intake_queue)) else {
            return Ok(match fanout_entry().await? {
                Some(true) => Before::Unrecorded,
                Some(false) => Before::Current,
                None => Before::Nothing,
            });
        };
        let old_tiers = spec
            .tiers
            .iter()
            .any(|tier| registry.knows_queue(&names.own_tier_queue_named(&old_name(tier))));
        let forwarded = forwards(registry, names);
        Ok(match registry.layout() {
            Some(LAYOUT) if old_tiers => Before::Older,
            Some(LAYOUT) if forwarded => Before::Forwarded,
            Some(LAYOUT) => Before::Current,
            _ => Before::Older,
        })
    }

    /// [`Before::Older`] when `older`, else [`Before::Nothing`]: what declares the objects of a
    /// ladder, without the unbinds that depend on the rest.
    pub fn from_older(older: bool) -> Before {
        if older { Before::Older } else { Before::Nothing }
    }

    /// Whether this start moves the ladder off a layout of before.
    pub fn moves(self) -> bool {
        matches!(self, Before::Older | Before::Unrecorded)
    }
}

/// Whether the stream knows the ladder `names` are for with the forwarding layer of before.
pub fn forwards(registry: &Registry, names: &Names) -> bool {
    registry.knows_exchange(&OldNames::of(names).next)
}

/// What ladder `spec` declares, `before` as it was: today's plan for a new or current ladder;
/// for one of before, today's plan behind its forwarding layer, which unbinds its ways in of
/// before.
pub fn plan_ladder(names: &Names, spec: &LadderSpec, version: BrokerVersion, before: Before) -> Vec<Declaration> {
    let today = plan::plan_ladder(names, spec, version);
    match before {
        Before::Nothing => return today,
        Before::Current => return [today, plan::retired_routes(names, spec, &names.exchange)].concat(),
        Before::Older | Before::Unrecorded | Before::Forwarded => {}
    }
    let old = OldNames::of(names);
    let mut out = Vec::new();
    for declaration in today {
        match declaration {
            Declaration::Exchange { ref name, .. } if *name == names.exchange => {
                out.extend(forwarding(names, spec, &old));
            }
            Declaration::Exchange { ref name, .. } if *name == names.intake_exchange => {}
            Declaration::Binding { ref exchange, .. } if *exchange == names.intake_exchange => {}
            Declaration::Binding {
                exchange,
                queue,
                key,
                args,
                to_exchange,
            } if exchange == names.exchange => out.push(Declaration::Binding {
                exchange: old.next.clone(),
                queue,
                key,
                args,
                to_exchange,
            }),
            other => out.push(other),
        }
    }
    out.extend(plan::retired_routes(names, spec, &old.next));
    out
}

/// The forwarding layer of a fanout `N.L`. Each alternate exchange is bound before anything can
/// fall into it, and each way in of before is unbound right after the one that replaces it is
/// bound: a failure routed in between reaches both, a duplicate, never neither. `N.L.tiers` is
/// bound to the shared tiers (where a replica of before publishes) before its own tiers are
/// unbound. `N.L` is bound to `N.L.next` while that routes nothing yet, so both lead into the
/// intake, which the broker enqueues once. Today's routes come after.
fn forwarding(names: &Names, spec: &LadderSpec, old: &OldNames) -> Vec<Declaration> {
    let own = |tier: &str| names.own_tier_queue_named(tier);
    let mut out = vec![exchange(&old.tiers, "direct", None)];
    for tier in &spec.tiers {
        // a replica of before publishes with the tier's name of before
        let key = old_name(tier);
        out.push(bind(&old.tiers, &names.tier_queue(tier), &key, false));
        out.push(unbind(&old.tiers, &own(&key), &key, Vec::new(), false));
        if key != tier.name {
            // the shared level of before (a2d534d), renamed since
            out.push(unbind(
                &old.tiers,
                &names.tier_queue_named(&key),
                &key,
                Vec::new(),
                false,
            ));
        }
    }
    out.extend([
        exchange(&old.due, "fanout", None),
        bind(&old.due, &names.due, "", false),
        exchange(&old.first, "fanout", None),
        bind(&old.first, &names.intake_queue, "", false),
        unbind(&old.first, &old.sort, "", Vec::new(), true),
        exchange(&old.next, "headers", Some(&old.first)),
        // N.L.next's alternate leads there too: the binding of before only costs a match
        unbind(
            &old.next,
            &names.intake_queue,
            "",
            plan::next_match(&spec.name, crate::model::protocol::header::NEXT_INTAKE),
            false,
        ),
    ]);
    for tier in &spec.steps {
        out.push(unbind(
            &old.next,
            &own(&tier.name),
            "",
            plan::next_match(&spec.name, &tier.name),
            false,
        ));
    }
    out.extend([
        exchange(&names.exchange, "fanout", None),
        bind(&names.exchange, &old.next, "", true),
        unbind(&names.exchange, &names.intake_queue, "", Vec::new(), false),
    ]);
    out
}

/// The name every release before layout 3 gave tier `tier`, a level too: its delay in compact
/// humantime (`4s96ms`; today's level is `level-4.1s`). A step's name is the same.
pub fn old_name(tier: &crate::model::ladder::Tier) -> String {
    crate::model::ladder::compact_duration(tier.delay)
}

/// The tier a first failure of an older ladder's first wait (`N.L.wait.<tier>`,
/// `first_failures = "direct"`) waited, by the routing key it comes due with (`wait.<tier>`);
/// nothing today puts a message into a tier with such a key.
pub fn waited_tier(routing_key: &[u8]) -> Option<&str> {
    std::str::from_utf8(routing_key.strip_prefix(b"wait.")?).ok()
}

/// `N.L.wait.<tier>` of the ladder `names` are for, with its tier family.
pub fn wait_queue(names: &Names, tier: &str) -> String {
    format!("{}.wait.{tier}{}", names.exchange, names.tier_family)
}

/// The bindings by which ladder `ladder` routes into `queue`, where tier `tier` waits: by
/// `retry-next` from `N.L`, or on a ladder of an older layout from `N.L.next` and by tier name
/// from `N.L.tiers`. `ladder prune` removes them before it looks a last time whether a retired
/// tier is empty. Unbinding one that does not exist is no error.
pub fn tier_inflows(names: &Names, ladder: &str, tier: &str, queue: &str, older: bool) -> Vec<Declaration> {
    if !older {
        return vec![plan::route(&names.exchange, queue, ladder, tier)];
    }
    let old = OldNames::of(names);
    vec![
        plan::route(&old.next, queue, ladder, tier),
        bind(&old.tiers, queue, tier, false),
    ]
}

/// Every queue and exchange the plan of `ladders` declares in `namespace`, as the topology
/// stream records them; with the forwarding layer of each ladder `older` says an earlier
/// release declared.
pub fn planned(
    namespace: &str,
    ladders: &[LadderSpec],
    version: BrokerVersion,
    older: impl Fn(&Names) -> bool,
) -> Vec<Known> {
    // the namespace's own objects (ladder ""): their role is their name after `N.`
    let shared = (
        String::new(),
        format!("{namespace}."),
        "",
        plan::plan_shared(namespace, ladders, version),
    );
    let own = ladders.iter().map(|spec| {
        let names = Names::of(namespace, spec);
        let base = format!("{}.", names.exchange);
        (
            spec.name.clone(),
            base,
            ENTRY_ROLE,
            plan_ladder(&names, spec, version, Before::from_older(older(&names))),
        )
    });
    let mut out = Vec::new();
    for (ladder, base, bare, declarations) in std::iter::once(shared).chain(own) {
        let role = |name: &str| name.strip_prefix(&base).unwrap_or(bare).to_string();
        for declaration in declarations {
            match declaration {
                Declaration::Queue { name, args, .. } => {
                    let ttl_ms = args.iter().find_map(|(key, value)| match (key, value) {
                        (&"x-message-ttl", ArgValue::Int(ms)) => u64::try_from(*ms).ok(),
                        _ => None,
                    });
                    let stream = args.contains(&("x-queue-type", ArgValue::Str("stream".into())));
                    out.push(Known {
                        role: role(&name),
                        name,
                        kind: Kind::Queue,
                        ladder: ladder.clone(),
                        ttl_ms,
                        stream,
                    });
                }
                Declaration::Exchange { name, .. } => out.push(Known {
                    role: role(&name),
                    name,
                    kind: Kind::Exchange,
                    ladder: ladder.clone(),
                    ttl_ms: None,
                    stream: false,
                }),
                Declaration::Binding { .. } | Declaration::Unbinding { .. } => {}
            }
        }
    }
    // an exchange and a queue may share a name (N.L.due): both are kept, once each
    let mut seen = BTreeSet::new();
    out.retain(|k| seen.insert((k.name.clone(), k.kind)));
    out
}

/// The tier queues each of `ladders` declared for itself before tiers were shared
/// (`N.L.delay.<tier>`, see [`Names::own_tier_queue_named`]), as the topology stream records
/// them. A release before the stream did not record them: the caller adds those that exist, so
/// they show as retired and `ladder prune` removes them once they drain.
pub fn own_tiers(namespace: &str, ladders: &[LadderSpec]) -> Vec<Known> {
    ladders
        .iter()
        .flat_map(|spec| {
            let names = Names::new(namespace, &spec.name);
            spec.tiers.iter().map(move |tier| Known {
                name: names.own_tier_queue_named(&old_name(tier)),
                kind: Kind::Queue,
                ladder: spec.name.clone(),
                role: format!("delay.{}", old_name(tier)),
                ttl_ms: Some(tier.ttl_ms()),
                stream: false,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::drift::{Known, TopologyRecord};
    use crate::model::ladder::{DeadLetterStrategy, QueueType};
    use crate::model::plan::BrokerVersion;
    use std::time::Duration;

    fn spec() -> LadderSpec {
        LadderSpec::new(
            "orders".into(),
            vec![Duration::from_secs(10), Duration::from_secs(3600)],
            3,
            regex::RegexSet::new(["^x$"]).unwrap(),
            QueueType::Quorum,
            DeadLetterStrategy::AtLeastOnce,
        )
    }

    /// A stream whose one record names the ladder's intake and `queues`, in `layout`.
    fn registry(layout: Option<u32>, names: &Names, queues: &[&str]) -> Registry {
        let queue = |name: &str| Known {
            name: name.into(),
            kind: crate::model::drift::Kind::Queue,
            ladder: "orders".into(),
            role: String::new(),
            ttl_ms: None,
            stream: false,
        };
        let mut objects = vec![queue(&names.intake_queue)];
        objects.extend(queues.iter().map(|q| queue(q)));
        let mut r = Registry::default();
        r.apply(&TopologyRecord::Declared {
            at_ms: 1,
            by: "test".into(),
            objects,
            layout,
        });
        r
    }

    #[tokio::test]
    async fn the_stream_and_the_broker_tell_how_a_ladder_was_declared() {
        let s = spec();
        let names = Names::of("ns", &s);
        let exists = async || Ok::<_, ()>(Some(true));
        let absent = async || Ok::<_, ()>(None);
        let today = async || Ok::<_, ()>(Some(false));
        let current = registry(Some(LAYOUT), &names, &[]);
        let unrecorded = registry(None, &names, &[]);
        assert_eq!(
            Before::of(Some(&current), &names, &s, absent).await.unwrap(),
            Before::Current
        );
        assert_eq!(
            Before::of(Some(&unrecorded), &names, &s, absent).await.unwrap(),
            Before::Older
        );
        // its own tiers of before not pruned yet: a replica of before may bind them again
        let old_tier = names.own_tier_queue_named("1h");
        let draining = registry(Some(LAYOUT), &names, &[&old_tier]);
        assert_eq!(
            Before::of(Some(&draining), &names, &s, absent).await.unwrap(),
            Before::Older
        );
        // recorded in today's layout, but with the forwarding layer of a fanout N.L: older for good
        let mut forwarded = registry(Some(LAYOUT), &names, &[]);
        forwarded.apply(&TopologyRecord::Declared {
            at_ms: 2,
            by: "test".into(),
            objects: vec![Known {
                name: OldNames::of(&names).next,
                kind: crate::model::drift::Kind::Exchange,
                ladder: "orders".into(),
                role: "next".into(),
                ttl_ms: None,
                stream: false,
            }],
            layout: Some(LAYOUT),
        });
        assert!(forwards(&forwarded, &names));
        assert_eq!(
            Before::of(Some(&forwarded), &names, &s, absent).await.unwrap(),
            Before::Forwarded
        );
        // not in the stream: 903c5df declared it (it had no stream), or nobody did
        let empty = Registry::default();
        assert_eq!(
            Before::of(Some(&empty), &names, &s, exists).await.unwrap(),
            Before::Unrecorded
        );
        assert_eq!(
            Before::of(Some(&empty), &names, &s, absent).await.unwrap(),
            Before::Nothing
        );
        assert_eq!(Before::of(None, &names, &s, exists).await.unwrap(), Before::Unrecorded);
        // a stream that cannot be read, over today's N.L: today's, never a fanout declared over it
        assert_eq!(Before::of(None, &names, &s, today).await.unwrap(), Before::Current);
        assert_eq!(
            Before::of(Some(&empty), &names, &s, today).await.unwrap(),
            Before::Current
        );
        // a ladder added to a namespace already in today's layout is new
        let other = Names::new("ns", "billing");
        assert_eq!(
            Before::of(Some(&current), &other, &s, absent).await.unwrap(),
            Before::Nothing
        );
    }

    #[test]
    fn an_older_ladder_keeps_its_fanout_entry_and_a_new_one_has_none_of_it() {
        let s = spec();
        let names = Names::of("ns", &s);
        let v = BrokerVersion::LATEST;
        let today = plan::plan_ladder(&names, &s, v);
        assert_eq!(plan_ladder(&names, &s, v, Before::Nothing), today);
        assert_eq!(
            plan_ladder(&names, &s, v, Before::Current),
            today,
            "no jitter: nothing to unroute"
        );
        for before in [Before::Unrecorded, Before::Forwarded] {
            assert_eq!(
                plan_ladder(&names, &s, v, before),
                plan_ladder(&names, &s, v, Before::Older)
            );
        }
        let lines: Vec<String> = plan_ladder(&names, &s, v, Before::Older)
            .iter()
            .map(|d| d.to_string())
            .collect();
        for line in [
            "exchange ns.orders.first type=fanout durable",
            "binding  ns.orders.first -> ns.orders.intake key=\"\"",
            "exchange ns.orders.next type=headers durable alternate-exchange=ns.orders.first",
            "exchange ns.orders type=fanout durable",
            "binding  ns.orders -> exchange ns.orders.next key=\"\"",
            "binding  ns.orders.next -> ns.delay.1h key=\"\" x-match=all retry-ladder=orders retry-next=1h",
            "unbind   ns.orders.next -> ns.orders.intake key=\"\" x-match=all retry-ladder=orders retry-next=intake",
            "binding  ns.orders.tiers -> ns.delay.1h key=\"1h\"",
            "binding  ns.orders.due -> ns.orders.due key=\"\"",
            "unbind   ns.orders.tiers -> ns.orders.delay.1h key=\"1h\"",
            "unbind   ns.orders.next -> ns.orders.delay.1h key=\"\" x-match=all retry-ladder=orders retry-next=1h",
            "unbind   ns.orders.first -> exchange ns.orders.sort key=\"\"",
            "unbind   ns.orders -> ns.orders.intake key=\"\"",
        ] {
            assert!(lines.contains(&line.to_string()), "{line}\n{lines:#?}");
        }
        let at = |line: &str| lines.iter().position(|l| l == line).unwrap();
        // the new way in is bound before the old ones are removed, and each alternate first
        assert!(
            at("binding  ns.orders.first -> ns.orders.intake key=\"\"")
                < at("unbind   ns.orders.first -> exchange ns.orders.sort key=\"\"")
        );
        assert!(
            at("binding  ns.orders.first -> ns.orders.intake key=\"\"")
                < at("exchange ns.orders.next type=headers durable alternate-exchange=ns.orders.first")
        );
        // N.L leaves the intake while N.L.next routes nothing yet: both ways lead to the intake
        assert!(
            at("binding  ns.orders -> exchange ns.orders.next key=\"\"")
                < at("unbind   ns.orders -> ns.orders.intake key=\"\"")
        );
        assert!(
            at("unbind   ns.orders -> ns.orders.intake key=\"\"")
                < at("binding  ns.orders.next -> ns.delay.1h key=\"\" x-match=all retry-ladder=orders retry-next=1h")
        );
        // N.L is never declared headers over a fanout of before, nor its routes put on it
        assert!(
            !lines.iter().any(|l| l.starts_with("exchange ns.orders type=headers")),
            "{lines:#?}"
        );
        assert!(
            !lines.iter().any(|l| l.starts_with("binding  ns.orders -> ns.")),
            "{lines:#?}"
        );
        // a new install unbinds nothing
        let plan = plan::plan("ns", std::slice::from_ref(&s), v);
        assert!(
            !plan.iter().any(|d| matches!(d, Declaration::Unbinding { .. })),
            "a new install unbinds nothing: {plan:#?}"
        );
        // a replica of before publishes into a level by the level's name of before, which now
        // leads to today's level only
        let mut levelled = s.clone();
        levelled.set_exact_delays(true);
        let lines: Vec<String> = plan_ladder(&names, &levelled, v, Before::Older)
            .iter()
            .map(|d| d.to_string())
            .collect();
        for line in [
            "binding  ns.orders.tiers -> ns.delay.level-1.02s key=\"1s24ms\"",
            "unbind   ns.orders.tiers -> ns.orders.delay.1s24ms key=\"1s24ms\"",
            "unbind   ns.orders.tiers -> ns.delay.1s24ms key=\"1s24ms\"",
        ] {
            assert!(lines.contains(&line.to_string()), "{line}\n{lines:#?}");
        }
        assert!(
            !lines.contains(&"unbind   ns.orders.tiers -> ns.delay.1h key=\"1h\"".to_string()),
            "a step keeps its name: its shared tier stays bound"
        );
        // a current ladder that gained jitter loses its step routes on N.L
        let mut jittered = s.clone();
        jittered.set_exact_delays(true);
        jittered.jitter = Some(crate::model::ladder::Jitter { permille: 100 });
        let lines: Vec<String> = plan_ladder(&names, &jittered, v, Before::Current)
            .iter()
            .map(|d| d.to_string())
            .collect();
        assert!(lines.contains(
            &"unbind   ns.orders -> ns.delay.10s key=\"\" x-match=all retry-ladder=orders retry-next=10s".to_string()
        ));
    }
}
