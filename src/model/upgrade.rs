//! Moving a ladder that an earlier release declared to today's layout: the one place that
//! knows the layouts of before. A new install runs none of it; [`plan`] is today's layout only.
//!
//! The layouts of before, all without a layout in the topology stream:
//! - 903c5df and earlier, before the topology stream: `N.L` bound straight to `N.L.intake`, and
//!   each ladder's own tiers `N.L.delay.<tier>` bound to `N.L.tiers`;
//! - the releases between, up to a2d534d, which recorded what they declared but no layout: on
//!   the way to today's they bound `N.L.next` to a ladder's own tiers and `N.L.first` straight
//!   to the intake.
//!
//! Moving on is unbinding those ways in, after today's are bound (so a failure published in
//! between reaches both, a duplicate, never neither). What waited in the old tiers still comes
//! due through `N.L.due`, and `ladder prune` deletes the tiers once they are empty.
//!
//! [`plan`]: crate::model::plan::plan

use crate::model::drift::Registry;
use crate::model::ladder::LadderSpec;
use crate::model::names::Names;
use crate::model::plan::{self, Declaration};

/// Today's layout, recorded with each record of the topology stream.
pub const LAYOUT: u32 = 2;

/// How a ladder was declared before this start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Before {
    /// Not at all: a new ladder.
    Nothing,
    /// By a release before the topology stream (903c5df): its own tiers of before are not
    /// recorded yet.
    Unrecorded,
    /// In an older layout the stream records.
    Older,
    /// In today's layout.
    Current,
}

impl Before {
    /// From what the topology stream says (`None`: it could not be read), and whether the
    /// ladder's intake queue exists, asked only when the stream does not know the ladder.
    ///
    /// A ladder whose own tiers of before are still recorded (not pruned yet) stays older: a
    /// replica of 903c5df that restarts during a rolling deploy binds its ways in again, and
    /// the next start of this release removes them.
    pub async fn of(
        registry: Option<&Registry>,
        names: &Names,
        spec: &LadderSpec,
        intake_exists: impl AsyncFnOnce() -> bool,
    ) -> Before {
        let Some(registry) = registry.filter(|r| r.knows_queue(&names.intake_queue)) else {
            return if intake_exists().await {
                Before::Unrecorded
            } else {
                Before::Nothing
            };
        };
        let old_tiers = spec
            .tiers
            .iter()
            .any(|tier| registry.knows_queue(&names.own_tier_queue_named(&tier.name)));
        match registry.layout() {
            Some(LAYOUT) if !old_tiers => Before::Current,
            _ => Before::Older,
        }
    }
}

/// What moves ladder `spec` from `before` to today's layout: nothing unless it is older.
pub fn steps(names: &Names, spec: &LadderSpec, before: Before) -> Vec<Declaration> {
    if matches!(before, Before::Nothing | Before::Current) {
        return Vec::new();
    }
    let unbind = |exchange: &str, queue: &str, key: &str, args| Declaration::Unbinding {
        exchange: exchange.into(),
        queue: queue.into(),
        key: key.into(),
        args,
    };
    let mut out = Vec::new();
    // the ladder's own tiers: by tier name from N.L.tiers, by retry-next from N.L.next
    for tier in &spec.tiers {
        let own = names.own_tier_queue_named(&tier.name);
        out.push(unbind(&names.tiers_exchange, &own, &tier.name, Vec::new()));
    }
    for tier in &spec.steps {
        let own = names.own_tier_queue_named(&tier.name);
        out.push(unbind(
            &names.next_exchange,
            &own,
            "",
            plan::next_match(&spec.name, &tier.name),
        ));
    }
    // the ways straight into the intake, from before N.L.sort and before N.L.next
    out.push(unbind(&names.first_exchange, &names.intake_queue, "", Vec::new()));
    out.push(unbind(&names.intake_exchange, &names.intake_queue, "", Vec::new()));
    out
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
        let exists = async || true;
        let absent = async || false;
        let current = registry(Some(LAYOUT), &names, &[]);
        let unrecorded = registry(None, &names, &[]);
        assert_eq!(Before::of(Some(&current), &names, &s, absent).await, Before::Current);
        assert_eq!(Before::of(Some(&unrecorded), &names, &s, absent).await, Before::Older);
        // its own tiers of before not pruned yet: a replica of before may bind them again
        let old_tier = names.own_tier_queue_named("1h");
        let draining = registry(Some(LAYOUT), &names, &[&old_tier]);
        assert_eq!(Before::of(Some(&draining), &names, &s, absent).await, Before::Older);
        // not in the stream: 903c5df declared it (it had no stream), or nobody did
        let empty = Registry::default();
        assert_eq!(Before::of(Some(&empty), &names, &s, exists).await, Before::Unrecorded);
        assert_eq!(Before::of(Some(&empty), &names, &s, absent).await, Before::Nothing);
        assert_eq!(Before::of(None, &names, &s, exists).await, Before::Unrecorded);
        // a ladder added to a namespace already in today's layout is new
        let other = Names::new("ns", "billing");
        assert_eq!(Before::of(Some(&current), &other, &s, absent).await, Before::Nothing);
    }

    #[test]
    fn only_an_older_ladder_is_moved_and_the_plan_has_no_step_of_before() {
        let s = spec();
        let names = Names::of("ns", &s);
        assert!(steps(&names, &s, Before::Nothing).is_empty());
        assert!(steps(&names, &s, Before::Current).is_empty());
        assert_eq!(steps(&names, &s, Before::Unrecorded), steps(&names, &s, Before::Older));
        let lines: Vec<String> = steps(&names, &s, Before::Older).iter().map(|d| d.to_string()).collect();
        for line in [
            "unbind   ns.orders.tiers -> ns.orders.delay.1h key=\"1h\"",
            "unbind   ns.orders.next -> ns.orders.delay.1h key=\"\" x-match=all retry-ladder=orders retry-next=1h",
            "unbind   ns.orders.first -> ns.orders.intake key=\"\"",
            "unbind   ns.orders -> ns.orders.intake key=\"\"",
        ] {
            assert!(lines.contains(&line.to_string()), "{line}\n{lines:#?}");
        }
        // one per tier (steps and delay levels), one per step, and the two ways into the intake
        assert_eq!(lines.len(), s.tiers.len() + s.steps.len() + 2, "{lines:#?}");
        let plan = plan::plan("ns", std::slice::from_ref(&s), BrokerVersion::LATEST);
        assert!(
            !plan.iter().any(|d| matches!(d, Declaration::Unbinding { .. })),
            "a new install unbinds nothing: {plan:#?}"
        );
    }
}
