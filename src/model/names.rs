//! The names every ladder owns on the broker, for namespace `N` and ladder `L`: a contract other
//! tools and languages rely on (`docs/src/concepts/topology.md`). Every name is made here.

use std::fmt;

use crate::model::ladder::{DeadLetterStrategy, LadderSpec, QueueType, Tier};

/// The names a namespace `N` owns, whatever its ladders.
#[derive(Debug, Clone)]
pub struct Namespace {
    /// `N.`: every name of the namespace starts with this.
    pub prefix: String,
    /// `N.due`: the headers exchange every shared tier queue dead-letters into; it routes a
    /// message by its `retry-ladder` to that ladder's `N.L.due` queue, and the rest to
    /// `N.stray`.
    pub due: String,
    /// `N.stray`: the fanout exchange and the quorum queue of what a shared tier dead-lettered
    /// for no ladder the namespace serves (a retired ladder, or a message put straight into a
    /// tier).
    pub stray: String,
    /// `N.watchdog`: the quorum queue (holding at most one message, consumed by nobody) the
    /// session's watchdog publishes a heartbeat into while the hops are quiet: a node that cannot
    /// reach a quorum confirms none, though it still answers reads from its own stale state.
    pub watchdog: String,
    /// `N.topology`: the stream of everything the namespace's ladders declared
    /// (`model::drift`).
    pub topology: String,
}

impl Namespace {
    /// The names of namespace `namespace`.
    pub fn new(namespace: &str) -> Self {
        Namespace {
            prefix: format!("{namespace}."),
            due: format!("{namespace}.due"),
            stray: format!("{namespace}.stray"),
            watchdog: format!("{namespace}.watchdog"),
            topology: format!("{namespace}.topology"),
        }
    }
}

/// The names of one ladder's exchanges and queues, for namespace `N` and ladder `L`.
#[derive(Debug, Clone)]
pub struct Names {
    /// The namespace's own names.
    pub namespace: Namespace,
    /// What this ladder's tier queues' names end in: empty for quorum tiers that dead-letter
    /// at-least-once (the default), `.at-most-once` or `.classic` otherwise; ladders share a
    /// tier queue only when its arguments are the same.
    pub tier_family: &'static str,
    /// `N.L`: the headers exchange consumers publish or dead-letter their failures to. It routes
    /// a repeat failure by its `retry-next` straight into its tier (or, `retry-next: intake` or
    /// `probe`, to the intake or the probes queue), and what it does not route, first failures
    /// above all, through its alternate exchange [`intake_exchange`](Names::intake_exchange).
    pub exchange: String,
    /// `N.L.intake`: the fanout exchange bound to the intake queue, `N.L`'s alternate exchange.
    pub intake_exchange: String,
    /// `N.L.intake`: the queue the service consumes failures from.
    pub intake_queue: String,
    /// `N.L.probes`: where a failed probe of the automatic hold comes back (`retry-next:
    /// probe`, routed by `N.L`), served by the intake hop ahead of any backlog of the intake.
    pub probes: String,
    /// `N.L.due`: the queue of messages whose wait is over, which `N.due` routes to.
    pub due: String,
    /// `N.L.parked`: the parking-lot stream.
    pub parked: String,
    /// `N.L.quarantine`: the fanout exchange and the queue intake and due dead-letter into.
    pub quarantine: String,
    /// `N.L.operator-lock`: the exclusive queue a replay or discard holds while it acts.
    pub operator_lock: String,
    /// `N.L.cancels`: the stream of cancelled message ids.
    pub cancels: String,
    /// `N.L.holds`: the stream of destination holds and resumes.
    pub holds: String,
}

impl Names {
    /// Names for ladder `ladder` in namespace `namespace`.
    pub fn new(namespace: &str, ladder: &str) -> Self {
        let base = format!("{namespace}.{ladder}");
        Names {
            namespace: Namespace::new(namespace),
            tier_family: "",
            intake_queue: format!("{base}.intake"),
            probes: format!("{base}.probes"),
            intake_exchange: format!("{base}.intake"),
            due: format!("{base}.due"),
            parked: format!("{base}.parked"),
            quarantine: format!("{base}.quarantine"),
            operator_lock: format!("{base}.operator-lock"),
            cancels: format!("{base}.cancels"),
            holds: format!("{base}.holds"),
            exchange: base,
        }
    }

    /// Names for ladder `spec` in namespace `namespace`, its tier queues named for its queue
    /// type and dead-letter strategy.
    pub fn of(namespace: &str, spec: &LadderSpec) -> Self {
        Names {
            tier_family: tier_family(spec.queue_type, spec.dead_letter_strategy),
            ..Names::new(namespace, &spec.name)
        }
    }

    /// `N.L.held.<destination>`: where the due messages of a held destination wait, oldest
    /// first. A name that would pass [`MAX_HELD_NAME_BYTES`] keeps the destination's first
    /// bytes and ends in `~` and a 64-bit FNV-1a hash of the whole destination (stable across
    /// versions and replicas: it is part of the topology contract).
    pub fn held_queue(&self, destination: &str) -> String {
        let name = format!("{}.held.{destination}", self.exchange);
        if name.len() <= MAX_HELD_NAME_BYTES {
            return name;
        }
        let hash = destination.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let mut keep = MAX_HELD_NAME_BYTES - 17 - (name.len() - destination.len());
        while !destination.is_char_boundary(keep) {
            keep -= 1;
        }
        format!("{}.held.{}~{hash:016x}", self.exchange, &destination[..keep])
    }

    /// `N.delay.<tier>` (with the ladder's [`tier_family`](Names::tier_family)): the queue
    /// where messages wait `tier`, shared by every ladder of the namespace with the same queue
    /// type and dead-letter strategy.
    pub fn tier_queue(&self, tier: &Tier) -> String {
        self.tier_queue_named(&tier.name)
    }

    /// `N.delay.<name>`, for a tier known by its name only.
    pub fn tier_queue_named(&self, name: &str) -> String {
        format!("{}delay.{name}{}", self.namespace.prefix, self.tier_family)
    }

    /// `N.L.delay.<name>`: where a tier of this ladder waited before tiers were shared (each
    /// ladder declared its own). Kept by a deployment that upgraded until it drains; `ladder
    /// prune` removes it then.
    pub fn own_tier_queue_named(&self, name: &str) -> String {
        format!("{}.delay.{name}", self.exchange)
    }

    /// Every queue of the ladder with its role, the `queue` label of `ladder_queue_messages`:
    /// `intake`, `due`, `parked`, `quarantine`, then `delay.<tier>` shortest first.
    pub fn queues(&self, spec: &LadderSpec) -> Vec<(String, String)> {
        let mut queues = vec![
            ("intake".to_string(), self.intake_queue.clone()),
            ("due".to_string(), self.due.clone()),
            ("parked".to_string(), self.parked.clone()),
            ("quarantine".to_string(), self.quarantine.clone()),
            ("stray".to_string(), self.namespace.stray.clone()),
        ];
        queues.extend(
            spec.tiers
                .iter()
                .map(|tier| (format!("delay.{}", tier.name), self.tier_queue(tier))),
        );
        queues
    }

    /// The longest name this ladder declares (for the 255-byte limit).
    pub fn longest_name(&self, spec: &LadderSpec) -> String {
        let mut names = vec![self.intake_queue.clone(), self.parked.clone()];
        names.extend(spec.tiers.iter().map(|t| self.tier_queue(t)));
        names.into_iter().max_by_key(String::len).unwrap_or_default()
    }
}

/// What the tier queues of a ladder of `queue_type` and `strategy` end in (see
/// [`Names::tier_family`]).
pub fn tier_family(queue_type: QueueType, strategy: DeadLetterStrategy) -> &'static str {
    match (queue_type, strategy) {
        (QueueType::Quorum, DeadLetterStrategy::AtLeastOnce) => "",
        (QueueType::Quorum, DeadLetterStrategy::AtMostOnce) => ".at-most-once",
        (QueueType::Classic, _) => ".classic",
    }
}

/// The longest held-queue name (AMQP names have at most 255 bytes).
pub const MAX_HELD_NAME_BYTES: usize = 255;

/// Which of a ladder's queues a loop consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hop {
    /// `N.L.intake`: failures coming in.
    Intake,
    /// `N.L.due`: messages whose wait is over.
    Due,
    /// `N.L.quarantine`: what the broker dead-lettered out of intake or due (a delivery limit,
    /// or a policy's TTL or length limit); parked as it is.
    Quarantine,
}

impl Hop {
    /// Every hop, in the order the metrics keep them.
    pub const ALL: [Hop; 3] = [Hop::Intake, Hop::Due, Hop::Quarantine];
}

impl fmt::Display for Hop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hop::Intake => "intake",
            Hop::Due => "due",
            Hop::Quarantine => "quarantine",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ladder::{DeadLetterStrategy, QueueType};
    use std::time::Duration;

    fn spec(queue_type: QueueType, strategy: DeadLetterStrategy) -> LadderSpec {
        let mut spec = LadderSpec::new(
            "orders".into(),
            vec![Duration::from_secs(10), Duration::from_secs(3600)],
            3,
            regex::RegexSet::new(["^x$"]).unwrap(),
            queue_type,
            strategy,
        );
        spec.set_exact_delays(false);
        spec
    }

    #[test]
    fn held_queue_names_are_bounded_and_distinct() {
        let n = Names::new("ns", "orders");
        assert_eq!(n.holds, "ns.orders.holds");
        assert_eq!(n.held_queue("billing"), "ns.orders.held.billing");
        let a = n.held_queue(&"a".repeat(250));
        let b = n.held_queue(&format!("{}b", "a".repeat(249)));
        assert!(a.len() <= MAX_HELD_NAME_BYTES && b.len() <= MAX_HELD_NAME_BYTES);
        assert_ne!(a, b);
        assert!(a.starts_with("ns.orders.held.aaa") && a.contains('~'));
        let multibyte = n.held_queue(&"é".repeat(200));
        assert!(multibyte.len() <= MAX_HELD_NAME_BYTES);
    }

    #[test]
    fn names_follow_the_contract() {
        let n = Names::new("ns", "orders");
        assert_eq!(n.exchange, "ns.orders");
        assert_eq!(n.intake_exchange, "ns.orders.intake");
        assert_eq!(n.intake_queue, "ns.orders.intake");
        assert_eq!(n.due, "ns.orders.due");
        assert_eq!(n.parked, "ns.orders.parked");
        let long = Tier::new(Duration::from_millis(5_400_000));
        // tiers are the namespace's, named for their arguments; before, each ladder had its own
        assert_eq!(n.tier_queue(&long), "ns.delay.1h30m");
        assert_eq!(n.tier_queue_named("1h30m"), "ns.delay.1h30m");
        assert_eq!(n.own_tier_queue_named("1h30m"), "ns.orders.delay.1h30m");
        assert_eq!(
            (n.namespace.due.as_str(), n.namespace.stray.as_str()),
            ("ns.due", "ns.stray")
        );
        let amo = Names::of("ns", &spec(QueueType::Quorum, DeadLetterStrategy::AtMostOnce));
        assert_eq!(amo.tier_queue(&long), "ns.delay.1h30m.at-most-once");
        let classic = Names::of("ns", &spec(QueueType::Classic, DeadLetterStrategy::AtMostOnce));
        assert_eq!(classic.tier_queue(&long), "ns.delay.1h30m.classic");
        let s = spec(QueueType::Quorum, DeadLetterStrategy::AtLeastOnce);
        let queues = n.queues(&s);
        let roles: Vec<(&str, &str)> = queues.iter().map(|(r, q)| (r.as_str(), q.as_str())).collect();
        assert_eq!(
            roles,
            [
                ("intake", "ns.orders.intake"),
                ("due", "ns.orders.due"),
                ("parked", "ns.orders.parked"),
                ("quarantine", "ns.orders.quarantine"),
                ("stray", "ns.stray"),
                ("delay.10s", "ns.delay.10s"),
                ("delay.1h", "ns.delay.1h"),
            ]
        );
    }
}
