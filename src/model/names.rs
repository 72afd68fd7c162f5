//! The names every ladder owns on the broker, for namespace `N` and ladder `L` — a contract
//! other tools and languages rely on (README "Topology"). Every name is made here.

use std::fmt;

use crate::model::ladder::{DeadLetterStrategy, LadderSpec, QueueType, Tier};

/// The names of one ladder's exchanges and queues, for namespace `N` and ladder `L`.
#[derive(Debug, Clone)]
pub struct Names {
    /// `N.` — every name of the namespace starts with this.
    pub prefix: String,
    /// `N.due`: the headers exchange every shared tier queue dead-letters into; it routes a
    /// message by its `retry-ladder` to that ladder's `N.L.due` queue, and the rest to
    /// `N.stray`. Shared by every ladder of the namespace.
    pub shared_due: String,
    /// `N.stray`: the fanout exchange and the quorum queue of what a shared tier dead-lettered
    /// for no ladder the namespace serves (a retired ladder, or a message put straight into a
    /// tier): a quarantine, kept for the operator.
    pub stray: String,
    /// `N.watchdog`: the quorum queue (holding at most one message, consumed by nobody) the
    /// session's watchdog publishes a probe into while the hops are quiet: a node that cannot
    /// reach a quorum confirms none, though it still answers reads from its own stale state.
    pub watchdog: String,
    /// What this ladder's tier queues' names end in: empty for quorum tiers that dead-letter
    /// at-least-once (the default), `.at-most-once` or `.classic` otherwise; ladders share a
    /// tier queue only when its arguments are the same.
    pub tier_family: &'static str,
    /// `N.L`: the fanout exchange consumers publish or dead-letter their failures to; bound to
    /// `N.L.next`.
    pub intake_exchange: String,
    /// `N.L.next`: a headers exchange routing a repeat failure by its `retry-next` header
    /// straight into its tier (or, `retry-next: intake`, to the intake); the rest to `N.L.first`.
    pub next_exchange: String,
    /// `N.L.first`: the fanout exchange of what `N.L.next` does not route — first failures
    /// above all — bound to `N.L.sort`.
    pub first_exchange: String,
    /// `N.L.sort`: the headers exchange that sends a first failure to `N.L.intake` when the
    /// intake must take it (every one, unless the ladder has `first_failures = "direct"`; then
    /// one that carries `retry-delay`, `x-delay`, `delay-until`, a `retry-attempt` or a
    /// `retry-next` no tier took), and every other through its alternate exchange, `N.L.wait`,
    /// into its first wait.
    pub sort_exchange: String,
    /// `N.L.wait`: the fanout exchange of the first failures `N.L.sort` does not send to the
    /// intake, bound to the queue where they wait the ladder's first step
    /// ([`Names::wait_queue`]).
    pub wait_exchange: String,
    /// `N.L.intake`: the queue the service consumes failures from.
    pub intake_queue: String,
    /// `N.L.probes`: where a failed probe of the automatic hold comes back (`retry-next:
    /// probe`, routed by `N.L.next`), served by the intake hop ahead of any backlog of the intake.
    pub probes: String,
    /// `N.L.tiers`: the direct exchange routing by tier name.
    pub tiers_exchange: String,
    /// `N.L.due`: the fanout exchange and the queue of expired messages.
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
            prefix: format!("{namespace}."),
            shared_due: format!("{namespace}.due"),
            stray: format!("{namespace}.stray"),
            watchdog: format!("{namespace}.watchdog"),
            tier_family: "",
            intake_queue: format!("{base}.intake"),
            probes: format!("{base}.probes"),
            next_exchange: format!("{base}.next"),
            first_exchange: format!("{base}.first"),
            sort_exchange: format!("{base}.sort"),
            wait_exchange: format!("{base}.wait"),
            tiers_exchange: format!("{base}.tiers"),
            due: format!("{base}.due"),
            parked: format!("{base}.parked"),
            quarantine: format!("{base}.quarantine"),
            operator_lock: format!("{base}.operator-lock"),
            cancels: format!("{base}.cancels"),
            holds: format!("{base}.holds"),
            intake_exchange: base,
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
        let name = format!("{}.held.{destination}", self.intake_exchange);
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
        format!("{}.held.{}~{hash:016x}", self.intake_exchange, &destination[..keep])
    }

    /// `N.topology`: the namespace's topology stream, the record of everything its ladders
    /// declared (`model::drift`).
    pub fn topology(namespace: &str) -> String {
        format!("{namespace}.topology")
    }

    /// `N.delay.<tier>` (with the ladder's [`tier_family`](Names::tier_family)): the queue
    /// where messages wait `tier`, shared by every ladder of the namespace with the same queue
    /// type and dead-letter strategy.
    pub fn tier_queue(&self, tier: &Tier) -> String {
        self.tier_queue_named(&tier.name)
    }

    /// `N.delay.<name>`, for a tier known by its name only.
    pub fn tier_queue_named(&self, name: &str) -> String {
        format!("{}delay.{name}{}", self.prefix, self.tier_family)
    }

    /// `N.L.delay.<name>`: where a tier of this ladder waited before tiers were shared (each
    /// ladder declared its own). Kept by a deployment that upgraded until it drains; `ladder
    /// prune` removes it then.
    pub fn own_tier_queue_named(&self, name: &str) -> String {
        format!("{}.delay.{name}", self.intake_exchange)
    }

    /// `N.L.wait.<tier>` (with the ladder's [`tier_family`](Names::tier_family)): where a first
    /// failure the broker routed past the intake waits the ladder's first step, `tier`. Its
    /// `x-message-ttl` is the tier's; it dead-letters into `N.L.due` with the routing key
    /// [`wait_key`], by which the due hop knows it for a first failure.
    pub fn wait_queue(&self, tier: &Tier) -> String {
        self.wait_queue_named(&tier.name)
    }

    /// `N.L.wait.<name>`, for a first wait known by its tier's name only.
    pub fn wait_queue_named(&self, name: &str) -> String {
        format!("{}.wait.{name}{}", self.intake_exchange, self.tier_family)
    }

    /// Every queue of the ladder with its role, the `queue` label of `ladder_queue_messages`:
    /// `intake`, `due`, `parked`, `quarantine`, then `delay.<tier>` shortest first.
    pub fn queues(&self, spec: &LadderSpec) -> Vec<(String, String)> {
        let mut queues = vec![
            ("intake".to_string(), self.intake_queue.clone()),
            ("due".to_string(), self.due.clone()),
            ("parked".to_string(), self.parked.clone()),
            ("quarantine".to_string(), self.quarantine.clone()),
            ("stray".to_string(), self.stray.clone()),
        ];
        if let Some(tier) = spec.first_route() {
            queues.push((wait_role(&tier.name), self.wait_queue(tier)));
        }
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
        names.extend(spec.first_route().map(|t| self.wait_queue(t)));
        names.into_iter().max_by_key(String::len).unwrap_or_default()
    }
}

/// The routing key a first failure comes due with from its wait in `N.L.wait.<tier>` (the
/// queue's `x-dead-letter-routing-key`): `wait.<tier>`. Nothing the service publishes into a
/// tier carries it (their keys are tier names), so the due hop knows by it a first failure the
/// broker routed past the intake, and how long it waited.
pub fn wait_key(tier: &str) -> String {
    wait_role(tier)
}

/// The tier a routing key made by [`wait_key`] names.
pub fn waited_tier(routing_key: &[u8]) -> Option<&str> {
    std::str::from_utf8(routing_key.strip_prefix(WAIT_KEY_PREFIX.as_bytes())?).ok()
}

/// `wait.<tier>`: the role of a wait queue (the `queue` label of `ladder_queue_messages`, and in
/// the topology stream).
pub fn wait_role(tier: &str) -> String {
    format!("{WAIT_KEY_PREFIX}{tier}")
}

/// What [`wait_key`] and [`wait_role`] begin with.
pub const WAIT_KEY_PREFIX: &str = "wait.";

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
        assert_eq!(n.intake_exchange, "ns.orders");
        assert_eq!(n.intake_queue, "ns.orders.intake");
        assert_eq!(n.tiers_exchange, "ns.orders.tiers");
        assert_eq!(n.due, "ns.orders.due");
        assert_eq!(n.parked, "ns.orders.parked");
        assert_eq!(
            (n.next_exchange.as_str(), n.first_exchange.as_str()),
            ("ns.orders.next", "ns.orders.first")
        );
        let long = Tier::new(Duration::from_millis(5_400_000));
        // tiers are the namespace's, named for their arguments; before, each ladder had its own
        assert_eq!(n.tier_queue(&long), "ns.delay.1h30m");
        assert_eq!(n.tier_queue_named("1h30m"), "ns.delay.1h30m");
        assert_eq!(n.own_tier_queue_named("1h30m"), "ns.orders.delay.1h30m");
        assert_eq!(n.wait_queue_named("1h30m"), "ns.orders.wait.1h30m");
        assert_eq!(wait_key("1h30m"), "wait.1h30m");
        assert_eq!(waited_tier(wait_key("1h30m").as_bytes()), Some("1h30m"));
        assert_eq!(waited_tier(b"1h30m"), None, "a tier's own key is no first wait's");
        assert_eq!((n.shared_due.as_str(), n.stray.as_str()), ("ns.due", "ns.stray"));
        let amo = Names::of("ns", &spec(QueueType::Quorum, DeadLetterStrategy::AtMostOnce));
        assert_eq!(amo.tier_queue(&long), "ns.delay.1h30m.at-most-once");
        let classic = Names::of("ns", &spec(QueueType::Classic, DeadLetterStrategy::AtMostOnce));
        assert_eq!(classic.tier_queue(&long), "ns.delay.1h30m.classic");
        assert_eq!(classic.wait_queue(&long), "ns.orders.wait.1h30m.classic");
        // the first wait counts toward the 255-byte limit of a ladder's names
        let mut direct = spec(QueueType::Classic, DeadLetterStrategy::AtMostOnce);
        direct.first_failures = crate::model::ladder::FirstFailures::Direct;
        let named = Names::of("ns", &direct);
        assert_eq!(
            named.longest_name(&direct),
            named.wait_queue(direct.first_route().unwrap())
        );
        let mut s = spec(QueueType::Quorum, DeadLetterStrategy::AtLeastOnce);
        s.first_failures = crate::model::ladder::FirstFailures::Direct;
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
                ("wait.10s", "ns.orders.wait.10s"),
                ("delay.10s", "ns.delay.10s"),
                ("delay.1h", "ns.delay.1h"),
            ]
        );
    }
}
